"""apps/transformer.py's model and Adam, written again in PyTorch: the baseline of benchmarks/gpu.py.

The twin takes mpimesh's parameters as numpy arrays under mpimesh's names and shapes
(`{"layer0/att/q/kernel": [d_model, heads, d_kv], ...}`) and reads every size from them, so both
sides start from the same values. It computes what apps/transformer.py computes, with PyTorch's
own primitives (nothing here calls mpimesh): byte embedding plus positional embedding;
pre-norm residual blocks (each layer norm with scale and bias, epsilon 1e-6, the biased
variance) of causal multi-head attention (no biases, queries scaled by d_kv**-0.5) and a ReLU
feed-forward block (no biases); a final layer norm; logits without bias; mean cross-entropy in
nats.

Attention is written out (scores, mask, softmax, weighted sum), as mpimesh computes it;
`attention="sdpa"` uses PyTorch's fused `scaled_dot_product_attention` instead.
"""
from __future__ import annotations

from typing import Mapping, Tuple

import numpy as np
import torch
import torch.nn.functional as F

LN_EPSILON = 1e-6  # mpimesh.layers.layer_norm's default
ATTENTION = ("explicit", "sdpa")


class TorchTwin(torch.nn.Module):
    """The Transformer of apps/transformer.py (MoE off, ReLU) on parameters copied from mpimesh."""

    def __init__(self, arrays: Mapping[str, np.ndarray], attention: str = "explicit",
                 device: str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention {attention!r}: choose from {ATTENTION}")
        self.attention = attention
        self.p = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.tensor(v, dtype=dtype, device=device))
                                         for k, v in arrays.items()})
        self.layers = sum(1 for k in arrays if k.endswith("/ln1/scale"))
        length = arrays["pos/weights"].shape[0]
        self.register_buffer("future", torch.ones(length, length, dtype=torch.bool, device=device).triu(1),
                             persistent=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats) of `ids` `[batch, length]` against `targets`."""
        p = self.p
        x = F.embedding(ids, p["embed/weights"]) + p["pos/weights"]
        for i in range(self.layers):
            x = x + self._attend(f"layer{i}/att/", self._norm(f"layer{i}/ln1", x))
            h = self._norm(f"layer{i}/ln2", x)
            x = x + F.relu(h @ p[f"layer{i}/ffn/wi/kernel"]) @ p[f"layer{i}/ffn/wo/kernel"]
        logits = self._norm("ln_f", x) @ p["logits/kernel"]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.p[f"{name}/scale"], self.p[f"{name}/bias"], LN_EPSILON)

    def _attend(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Causal self-attention of `x` `[batch, length, d_model]`; kernels `[d_model, heads, d_kv]`
        for q, k, v and `[heads, d_kv, d_model]` for the output."""
        _, heads, d_kv = self.p[f"{name}q/kernel"].shape
        q, k, v = ((x @ self.p[f"{name}{w}/kernel"].flatten(1)).unflatten(-1, (heads, d_kv)).transpose(1, 2)
                   for w in "qkv")  # [batch, heads, length, d_kv]
        if self.attention == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            length = x.shape[1]
            scores = (q * d_kv ** -0.5) @ k.transpose(-1, -2)
            scores = scores.masked_fill(self.future[:length, :length], float("-inf"))
            o = torch.softmax(scores, dim=-1) @ v
        return o.transpose(1, 2).flatten(2) @ self.p[f"{name}o/kernel"].flatten(0, 1)


def make_adam(model: torch.nn.Module, lr: float, warmup: int, betas: Tuple[float, float],
              epsilon: float) -> Tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """`torch.optim.Adam` with apps/transformer.py's schedule: step t (1-based) uses
    `lr * min(t / warmup, 1)`; call the scheduler's `step()` after each optimizer step."""
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=betas, eps=epsilon)
    warm = max(1, warmup)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, 1.0))
