"""Memory per core of a dense Transformer's training step on an X x Y mesh, with and without weight
sharding: explicit formulas, term by term (benchmarks/simulate.py's `weights` run).

The mesh has X rows (the data-parallel dim: the batch is split over it) and Y columns (the model
dim: heads, d_ff and the vocabulary are split over it), as in Mesh-TensorFlow's and GSPMD's 2-D
layouts. Every weight is split over Y on one of its dims. A `Layout` says what is split over X too:
- Mesh-TF 2-D: nothing (weights, gradients and optimizer state replicated over the X rows);
- ZeRO-1 / ZeRO-2 / ZeRO-3 (weight-update sharding, arXiv 1910.02054 / 2004.13336): the optimizer
  state; + the gradients (reduce-scattered over X); + the parameters (all-gathered over X before use);
- GSPMD 2-D ("weight is fully partitioned across all devices"): ZeRO-3's, and the activations fully
  sharded: the d_model-sized ones split over Y as well ([batch/X, length, d_model/Y]).

Bytes per core, the step's terms (float32 parameters, gradients and optimizer state; bfloat16
activations and gathered weights; P parameters, B the batch, L the length):
- parameters 4P / s_p, gradients 4P / s_g, optimizer state 4S / s_o, where s = X·Y if the layout
  splits that term over X, else Y, and S the optimizer's floats (Adafactor, factored: rows + columns
  per matrix; Adam: 2P);
- activations: (B / X) · L · (layers · a_layer + a_out), the bytes per token the backward pass reads
  (`saved_per_token`), each split over Y (the d_model-sized ones only with fully sharded activations);
- gathered weights: g layers' weights in bfloat16 (`largest_layer` / Y · 2 each): all-gathered
  over X under ZeRO-3 and GSPMD, the bfloat16 casts of replicated ones otherwise; g = `gathered`
  (the layer computed and the one prefetched), or every layer when the gathered weights are kept
  from the forward pass to the backward (`Layout.keep_gathered`);
- temporaries: where gradients are split over X, one layer's float32 gradient before its
  reduce-scatter (4 · `largest_layer` / Y); and the optimizer update's two float32 buffers (the
  update and its square) of the largest matrix's local block.
The terms are summed: a bound, since a layer's activations die as its gradients are made.

Example (4 cores as 2 x 2, 4 sequences of 4 tokens):
    >>> tiny = DenseLM(d_model=8, d_ff=16, heads=2, d_kv=4, vocab=10, length=4, layers=2, rel_buckets=2)
    >>> tiny.parameters(), tiny.layer_parameters()
    (1408, 660)
    >>> terms = memory(tiny, LAYOUTS[-1], rows=2, cols=2, batch=4)
    >>> terms["parameters"], terms["activations"], terms["gathered"]
    (1408.0, 2368.0, 1320.0)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BF16, F32 = 2, 4  # bytes: activations and gathered weights; parameters, gradients, optimizer state
TERMS = ("parameters", "gradients", "optimizer", "activations", "gathered", "temporaries")


@dataclass(frozen=True)
class DenseLM:
    """lingvo's `DenseLmTemplate` (tasks/lm/params/synthetic_packed_input.py: GShard's and GSPMD's
    dense language models), its sizes by default: a decoder of `layers` blocks (self-attention with
    a relative-position bias of `rel_buckets` x heads, then a gated-GELU feed-forward layer), a
    vocabulary embedding shared with the softmax, pre-layer norms (a scale each) and a final one."""
    d_model: int = 8192
    d_ff: int = 65536
    heads: int = 128
    d_kv: int = 128
    vocab: int = 32000
    length: int = 1024
    layers: int = 32
    rel_buckets: int = 32

    def layer_matrices(self) -> tuple:
        """One layer's weight matrices (lingvo combines heads and d_kv): q, k, v [d_model, heads·d_kv],
        the attention output [heads·d_kv, d_model], wi_0 and wi_1 [d_model, d_ff], wo [d_ff, d_model],
        the relative-position bias [rel_buckets, heads]."""
        m, a, h = self.d_model, self.heads * self.d_kv, self.d_ff
        return ((m, a),) * 3 + ((a, m), (m, h), (m, h), (h, m), (self.rel_buckets, self.heads))

    def layer_parameters(self) -> int:
        """One layer's parameters: its matrices and its two layer norms' scales."""
        return sum(r * c for r, c in self.layer_matrices()) + 2 * self.d_model

    def parameters(self) -> int:
        """All parameters: the layers, the shared embedding [vocab, d_model], the final layer norm."""
        return self.layers * self.layer_parameters() + self.vocab * self.d_model + self.d_model

    def tensors(self) -> int:
        """How many parameter tensors (10 per layer, the embedding and the final layer norm)."""
        return self.layers * (len(self.layer_matrices()) + 2) + 2

    def largest_layer(self) -> int:
        """Parameters of the largest unit gathered at once: a layer, or the embedding."""
        return max(self.layer_parameters(), self.vocab * self.d_model)

    def adafactor_floats(self) -> int:
        """Adafactor's state, factored and without momentum (lingvo's `XLAShardingAdafactor`,
        `factored=True, beta1=0`): rows + columns per matrix, the whole of each vector."""
        per_layer = sum(r + c for r, c in self.layer_matrices()) + 2 * self.d_model
        return self.layers * per_layer + self.vocab + self.d_model + self.d_model

    def saved_per_token(self) -> tuple:
        """Elements per token per layer the backward pass reads, as `(d_model-sized, model-split)`:
        each sublayer's input and layer-normed input (4 of d_model); q, k, v and the attention
        context (4 of heads·d_kv), the attention probabilities (heads·length: a query's row per
        head); wi_0's and wi_1's outputs and their gated product (3 of d_ff). Elementwise chains
        are fused, their inner values recomputed in the backward (GELU's from wi_0's output)."""
        return (4 * self.d_model,
                4 * self.heads * self.d_kv + self.heads * self.length + 3 * self.d_ff)

    def saved_outside_per_token(self, cols: int, full: bool) -> float:
        """Bytes per token on a core outside the layers: the last block's output and the final
        layer norm's (2 of d_model, bfloat16); the one-hot ids and the logits (bfloat16) and the
        log-softmax (float32) of the vocabulary split over Y."""
        return BF16 * 2 * self.d_model / (cols if full else 1) + (BF16 + BF16 + F32) * self.vocab / cols


@dataclass(frozen=True)
class Layout:
    """What a 2-D layout splits over the data-parallel dim X besides the batch (every weight is
    split over Y): the optimizer state, the gradients, the parameters; `activations`: the
    d_model-sized activations split over Y too (fully sharded); `keep_gathered`: gathered weights
    kept from the forward pass to the backward (not gathered again)."""
    name: str
    optimizer: bool = False
    gradients: bool = False
    parameters: bool = False
    activations: bool = False
    keep_gathered: bool = False


LAYOUTS = (Layout("Mesh-TF 2-D"),
           Layout("ZeRO-1", optimizer=True),
           Layout("ZeRO-2", optimizer=True, gradients=True),
           Layout("ZeRO-3", optimizer=True, gradients=True, parameters=True),
           Layout("GSPMD 2-D, kept", optimizer=True, gradients=True, parameters=True, activations=True,
                  keep_gathered=True),
           Layout("GSPMD 2-D", optimizer=True, gradients=True, parameters=True, activations=True))


def activations_per_sequence(cfg: DenseLM, cols: int, full: bool) -> tuple:
    """`(per layer, outside the layers)`: activation bytes per sequence on a core whose every
    activation is split over the Y = `cols` columns (`full`: the d_model-sized ones too)."""
    wide, split = cfg.saved_per_token()
    per_layer = BF16 * (wide / (cols if full else 1) + split / cols) * cfg.length
    return per_layer, cfg.saved_outside_per_token(cols, full) * cfg.length


def memory(cfg: DenseLM, layout: Layout, rows: int, cols: int, batch: int, optimizer: str = "adafactor",
           gathered: int = 2, acts: tuple | None = None) -> dict:
    """Bytes per core of each of `TERMS` for a step of `batch` sequences (batch / rows per core) on
    a `rows` x `cols` mesh. `acts`: `(per layer, outside)` activation bytes per sequence on a core
    (default `activations_per_sequence`'s)."""
    if batch % rows:
        raise ValueError(f"batch {batch} is not split evenly over the {rows} rows")
    if optimizer not in ("adafactor", "adam"):
        raise ValueError(f"optimizer {optimizer!r}: 'adafactor' or 'adam'")
    everywhere = rows * cols
    p = cfg.parameters()
    state = cfg.adafactor_floats() if optimizer == "adafactor" else 2 * p
    per_layer, outside = acts or activations_per_sequence(cfg, cols, layout.activations)
    held = cfg.layers if layout.keep_gathered else gathered
    largest_matrix = max(r * c for r, c in cfg.layer_matrices() + ((cfg.vocab, cfg.d_model),))
    return {
        "parameters": F32 * p / (everywhere if layout.parameters else cols),
        "gradients": F32 * p / (everywhere if layout.gradients else cols),
        "optimizer": F32 * state / (everywhere if layout.optimizer else cols),
        "activations": batch // rows * (cfg.layers * per_layer + outside),
        "gathered": held * BF16 * cfg.largest_layer() / cols,
        "temporaries": (F32 * cfg.largest_layer() / cols if layout.gradients else 0)
        + 2 * F32 * largest_matrix / (everywhere if layout.optimizer else cols)}


def max_batch(cfg: DenseLM, layout: Layout, rows: int, cols: int, budget: float, **kw) -> int:
    """The largest batch (a multiple of `rows`: whole sequences per row) whose `memory` fits in
    `budget` bytes per core; 0 if none does. `kw`: `memory`'s."""
    fixed = sum(memory(cfg, layout, rows, cols, 0, **kw).values())
    per_row = sum(memory(cfg, layout, rows, cols, rows, **kw).values()) - fixed  # one sequence per row
    return rows * max(0, math.floor((budget - fixed) / per_row))


def weight_collectives(cfg: DenseLM, layout: Layout, rows: int, cols: int) -> dict:
    """`{kind: bytes}` a core hands the collectives over X per step for the weights (the profile's
    count: an allgather's input is this core's block): Mesh-TF allreduces the float32 gradients;
    ZeRO-1/2 reduce-scatter them and all-gather the updated float32 parameters; ZeRO-3 and GSPMD
    all-gather the bfloat16 weights for the forward pass and again for the backward (once if kept)
    and reduce-scatter the gradients."""
    p = cfg.parameters()
    if layout.parameters:
        return {"allgather": (1 if layout.keep_gathered else 2) * BF16 * p / (rows * cols),
                "reduce_scatter": F32 * p / cols}
    if layout.optimizer:
        return {"reduce_scatter": F32 * p / cols, "allgather": F32 * p / (rows * cols)}
    return {"allreduce": F32 * p / cols}
