"""A decoder-only Transformer language model on bytes, data- and model-parallel, with one command.

    mpiexec -n 4 python apps/transformer.py                       # the defaults, on a 2x2 mesh
    mpiexec -n 4 python apps/transformer.py --mesh "rows:4;cols:1" --layout "batch:rows"
    mpiexec -n 2 python apps/transformer.py --data notes.txt --checkpoint ckpt --steps 1000 [--resume]

Every rank runs this program (SPMD) and holds only its slices of the parameters, optimizer state
and activations; the `--layout` rules say which tensor dim is split over which mesh dim (default:
the Mesh-TensorFlow paper's, batch over rows; heads, d_ff and vocab over cols). The training step
(`make_train_step`: forward, `mm.gradients`, the optimizer update) is compiled (`mm.compile`).
`--help` lists the flags; docs/transformer.md describes the data, the output, `--log-json`,
checkpoints, MoE, `--pipeline`, GPUs, `--layout auto`, `--backend jax` and how `main` is split.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable, Dict, NamedTuple, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import mpimesh as mm  # noqa: E402  (first: it sets BLAS threads per rank before numpy loads BLAS)
import numpy as np  # noqa: E402
from apps import pipelined  # noqa: E402
from apps.cli import (UsageError, check_at_least, check_layout, eta_text, main_guard, parser,  # noqa: E402
                      progress_bar)
from mpimesh import checkpoint, layers, safetensors_io  # noqa: E402
from mpimesh.extras import require  # noqa: E402

PAPER_LAYOUT = "batch:rows;heads:cols;d_ff:cols;vocab:cols"
DIMS = {"batch": "sequences per step (--batch)", "length": "positions in a sequence (--length)",
        "memory_length": "the positions attended to (--length)", "d_model": "the residual stream (--d-model)",
        "heads": "attention heads (--heads)", "d_kv": "per-head query/key/value size (--d-kv)",
        "d_ff": "feed-forward hidden units (--d-ff)", "vocab": "the byte vocabulary (--vocab)",
        "experts": "MoE experts (--experts, with --moe-every)"}
KEEP = 2  # checkpoints kept in --checkpoint DIR
ADAM_LR = 3e-3  # --optimizer adam's learning rate without --lr
Params = Dict[str, "mm.DistTensor"]


# ------------------------------------------------------------------------------------ the model

@dataclass(frozen=True)
class Config:
    """The model's sizes and the training hyper-parameters."""
    d_model: int = 128
    heads: int = 4
    d_kv: int = 32
    d_ff: int = 512
    layers: int = 2
    vocab: int = 256
    length: int = 64
    batch: int = 32
    activation: str = "relu"
    optimizer: str = "adafactor"
    lr: Optional[float] = None  # None: the optimizer's default schedule
    warmup: int = 20
    moe_every: int = 0  # K > 0: layers i with (i + 1) % K == 0 get a GShard MoE instead of the FFN
    experts: int = 0
    dtype: str = "float32"  # the activations' dtype ("bfloat16", "float16"); parameters stay float32
    remat: int = 0  # the first `remat` blocks' sublayers recomputed in the backward pass (`mm.remat`)

    def dim(self, name: str) -> mm.Dimension:
        sizes = {"batch": self.batch, "length": self.length, "memory_length": self.length,
                 "d_model": self.d_model, "heads": self.heads, "d_kv": self.d_kv, "d_ff": self.d_ff,
                 "vocab": self.vocab, "experts": self.experts}
        return mm.Dimension(name, sizes[name])

    def is_moe(self, layer: int) -> bool:
        """Layer `layer`'s feed-forward block is a mixture of experts."""
        return self.moe_every > 0 and (layer + 1) % self.moe_every == 0


def moe_layout(layout: str, moe_every: int) -> str:
    """`layout` plus `experts:<the mesh dim of batch>` when MoE is on and the rules leave experts
    out (GShard: the experts live on the mesh dim that holds the groups, i.e. the batch)."""
    rules = mm.LayoutRules(layout)
    if moe_every <= 0 or "experts" in dict(rules.pairs) or rules.mesh_dim("batch") is None:
        return layout
    return f"{layout};experts:{rules.mesh_dim('batch')}" if layout else f"experts:{rules.mesh_dim('batch')}"


def init_params(mesh: mm.Mesh, cfg: Config, seed: int = 0) -> Params:
    """The parameters as a flat dict (`"layer0/att/q/kernel"`, ...); values depend on the seed only."""
    d = cfg.dim
    tree = {"embed": layers.init_embedding(mesh, layers.subseed(seed, "embed"), d("vocab"), d("d_model")),
            "pos": {"weights": mesh.random_normal([d("length"), d("d_model")], layers.subseed(seed, "pos"),
                                                  stddev=0.1)}}
    for i in range(cfg.layers):
        s = layers.subseed(seed, f"layer{i}")
        tree[f"layer{i}"] = {
            "ln1": layers.init_layer_norm(mesh, d("d_model")),
            "att": layers.init_attention(mesh, layers.subseed(s, "att"), d("d_model"), d("heads"), d("d_kv")),
            "ln2": layers.init_layer_norm(mesh, d("d_model"))}
        if cfg.is_moe(i):
            tree[f"layer{i}"]["moe"] = layers.init_moe(mesh, layers.subseed(s, "moe"), d("d_model"), d("experts"),
                                                       d("d_ff"))
        else:
            tree[f"layer{i}"]["ffn"] = layers.init_feed_forward(mesh, layers.subseed(s, "ffn"), d("d_model"),
                                                                d("d_ff"))
    tree["ln_f"] = layers.init_layer_norm(mesh, d("d_model"))
    tree["logits"] = layers.init_dense(mesh, layers.subseed(seed, "logits"), [d("d_model")], [d("vocab")],
                                       use_bias=False)
    return layers.flatten(tree)


def forward_aux(params: Params, inputs, cfg: Config, train: bool = False, seed: int = 0, moe_capacity=None):
    """`(logits [batch, length, vocab], aux)` for byte ids `[batch, length]` (pre-norm residual
    blocks); aux is the sum of the MoE layers' load-balancing losses (None without MoE). An MoE
    layer takes each sequence as a group of `length` tokens (group dim = batch); `moe_capacity`,
    `(capacity_factor, min_capacity)`, overrides the layer's defaults."""
    capacity = {} if moe_capacity is None else dict(zip(("capacity_factor", "min_capacity"), moe_capacity))
    p = layers.unflatten(params)
    x = embed(p, inputs, cfg)
    aux = None
    for i in range(cfg.layers):
        x, a = block(p[f"layer{i}"], x, cfg, i, train, seed, capacity, remat=i < cfg.remat)
        if a is not None:
            aux = a if aux is None else aux + a
    return head(p, x), aux


def embed(p: dict, inputs, cfg: Config):
    """The residual stream `[batch, length, d_model]` of byte ids `inputs`: embeddings plus positions."""
    return layers.embedding(p["embed"], inputs, cfg.dtype) + mm.cast(p["pos"]["weights"], cfg.dtype)


def head(p: dict, x):
    """The logits `[..., vocab]` of the residual stream x: the final layer norm, then the logits layer."""
    return layers.dense(p["logits"], layers.layer_norm(p["ln_f"], x, "d_model"))


def block(b: dict, x, cfg: Config, i: int, train: bool, seed, capacity: dict, remat: bool = False) -> tuple:
    """Block `i` (params `b`) on x: its two residual sublayers, attention then the feed-forward or
    MoE one (the layers of Mesh-TensorFlow's layer stack), each rematerialised (`mm.remat`) when
    `remat`: `(x, the MoE's aux loss or None)`."""
    run = mm.remat if remat else (lambda f: f)
    x = run(attention_sublayer)(b, x)
    return run(feed_forward_sublayer)(b, x, cfg, i, train, seed, capacity)


def attention_sublayer(b: dict, x):
    """`x + attention(layer_norm(x))`, causal."""
    return x + layers.multihead_attention(b["att"], layers.layer_norm(b["ln1"], x, "d_model"), causal=True)


def feed_forward_sublayer(b: dict, x, cfg: Config, i: int, train: bool, seed, capacity: dict) -> tuple:
    """`(x + feed_forward(layer_norm(x)), None)`, or with the MoE of layer `i`, `(x + moe(...), aux)`."""
    h = layers.layer_norm(b["ln2"], x, "d_model")
    if not cfg.is_moe(i):
        return x + layers.feed_forward(b["ffn"], h, cfg.activation), None
    y, a = layers.moe(b["moe"], h, group_dim="batch", train=train, seed=layers.subseed(seed, f"moe{i}"),
                      activation=cfg.activation, **capacity)
    return x + y, a


MODEL = pipelined.Model(embed, block, head)  # what --pipeline runs (apps/pipelined.py)


def forward(params: Params, inputs, cfg: Config):
    """Logits `[batch, length, vocab]` for byte ids `[batch, length]` (inference: MoE in eval mode)."""
    return forward_aux(params, inputs, cfg)[0]


def loss_fn(params: Params, batch: dict, cfg: Config, train: bool = True, seed: int = 0, moe_capacity=None):
    """Mean next-byte cross-entropy in nats (a 0-d tensor), plus the MoE auxiliary loss when
    `train` (`train=False`: the MoE layers' eval capacity and no aux loss)."""
    logits, aux = forward_aux(params, batch["inputs"], cfg, train, seed, moe_capacity)
    loss = mm.reduce_mean(layers.softmax_cross_entropy_with_logits(logits, batch["targets"], "vocab"))
    return loss + aux if train and aux is not None else loss


def make_optimizer(cfg: Config):
    """Adafactor (Mesh-TensorFlow's defaults; `lr` a constant relative step) or Adam (lr with a
    linear warmup over `warmup` steps)."""
    if cfg.optimizer == "adafactor":
        return mm.optim.Adafactor(learning_rate=cfg.lr)
    if cfg.optimizer == "adam":
        lr, warm = (ADAM_LR if cfg.lr is None else cfg.lr), max(1, cfg.warmup)
        return mm.optim.Adam(lambda t: lr * mm.minimum(t * (1.0 / warm), 1.0))
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}: choose adafactor or adam")


def learning_rate(cfg: Config, t: int) -> float:
    """The learning rate `make_optimizer(cfg)` applies at its 1-based step `t` (Adafactor's relative
    step, before each parameter's RMS scales it).

    >>> learning_rate(Config(), 1), learning_rate(Config(), 40000), learning_rate(Config(optimizer="adam"), 5)
    (0.01, 0.005, 0.00075)
    """
    if cfg.optimizer == "adafactor":
        return min(0.01, 1 / math.sqrt(t)) if cfg.lr is None else cfg.lr
    return (ADAM_LR if cfg.lr is None else cfg.lr) * min(t / max(1, cfg.warmup), 1.0)


def step_seed(mesh: mm.Mesh, seed: int, step: int):
    """The seed of training step `step` as a seed tensor (a 0-d int64 tensor): a compiled step
    replays with each step's own value, drawing new numbers (`mm.compile`)."""
    return mesh.from_numpy(np.array(layers.subseed(seed, f"step{step}"), np.int64), ())


def loss_scale(cfg: Config) -> Optional[mm.optim.DynamicLossScale]:
    """The dynamic loss scale float16 activations need (None for other dtypes)."""
    return mm.optim.DynamicLossScale() if cfg.dtype == "float16" else None


def init_state(cfg: Config, optimizer, params: Params) -> dict:
    """The optimizer's fresh state, with the loss scale's tensors in it for float16."""
    state = optimizer.init(params)
    scaler = loss_scale(cfg)
    return state if scaler is None else scaler.init(state)


def make_train_step(cfg: Config, optimizer, retain: bool = False) -> Callable:
    """`train_step(params, opt_state, batch, seed=0) -> (params, opt_state, loss)`: one `mm.trace()`
    holding the forward pass, `mm.gradients` and the optimizer update; nothing but mpimesh ops.
    `seed` (an int, or a seed tensor: `step_seed`) draws the MoE layers' random second-expert choices.
    `retain`: autodiff keeps every activation until the trace closes (by default it gives each back
    as soon as the backward pass is done with it: a lower peak). With float16
    activations the loss is scaled dynamically (`mm.optim.DynamicLossScale`), its scale held in
    `opt_state` (`init_state`): a step whose gradients overflow is skipped on every rank, compiled
    or not."""
    scaler = loss_scale(cfg)

    def train_step(params: Params, opt_state: dict, batch: dict, seed: int = 0):
        names = list(params)
        if scaler is not None and "loss_scale" not in opt_state:
            opt_state = scaler.init(opt_state)
        with mm.trace():
            loss = loss_fn(params, batch, cfg, True, seed)
            target = loss if scaler is None else scaler.scaled(loss, opt_state)
            grads = dict(zip(names, mm.gradients([target], [params[n] for n in names], retain=retain)))
            if scaler is None:
                params, opt_state = optimizer.update(params, grads, opt_state)
            else:
                params, opt_state, _ = scaler.step(optimizer, params, grads, opt_state)
        return params, opt_state, loss
    return train_step


# ------------------------------------------------------------------------------------- the data

def _stdlib_files() -> list[str]:
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return out


def load_corpus(path: Optional[str] = None, max_bytes: int = 4 << 20, heldout: float = 0.1):
    """`(train, heldout, description)`: uint8 arrays of the corpus bytes, identical on every rank."""
    if path is None:
        files, where = _stdlib_files(), "the Python standard library's *.py files"
    elif os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
        where = f"{path}/"
    elif os.path.isfile(path):
        files, where = [path], path
    else:
        raise UsageError(f"--data {path!r}: no such file or folder")
    key = (lambda f: zlib.crc32(os.path.relpath(f, path or "/").encode()))
    train, held, total, binary = [], [], 0, 0
    for f in sorted(files, key=lambda f: (key(f), f)):  # a fixed, path-hash order: a mix of the tree
        try:
            with open(f, "rb") as fh:
                data = fh.read(max_bytes - total)
        except OSError:
            continue
        if b"\0" in data[:4096]:
            binary += 1
            continue
        total += len(data)
        if len(files) == 1:
            cut = int(len(data) * (1 - heldout))
            train.append(data[:cut])
            held.append(data[cut:])
        else:
            (held if key(f) % 1000 < heldout * 1000 else train).append(data)
        if total >= max_bytes:
            break
    tr, he = b"\n".join(train), b"\n".join(held)
    if len(he) < 4096 or len(tr) < 4096:
        why = f" ({binary} of {len(files)} files skipped as binary: a NUL byte in their first 4 KiB)" if binary else ""
        raise UsageError(f"--data: {where} gives {len(tr)} training and {len(he)} held-out bytes{why} with "
                         f"--max-bytes {max_bytes} and --heldout {heldout}; need 4 KiB of text for each")
    desc = (f"{where}: {1 if len(files) == 1 else len(train) + len(held)} files, {len(tr):,} training + "
            f"{len(he):,} held-out bytes")
    return np.frombuffer(tr, np.uint8), np.frombuffer(he, np.uint8), desc


def unigram_bits_per_byte(data: np.ndarray) -> float:
    """Entropy (bits) of the byte frequencies of `data`."""
    p = np.bincount(data, minlength=256) / len(data)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def batch_windows(data: np.ndarray, cfg: Config, offsets: np.ndarray) -> tuple:
    """The global int32 inputs and next-byte targets `[batch, length]` of the windows at `offsets`."""
    windows = np.stack([data[o:o + cfg.length + 1] for o in offsets]).astype(np.int32)
    return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


def make_batch(mesh: mm.Mesh, data: np.ndarray, cfg: Config, offsets: np.ndarray) -> dict:
    """Inputs and next-byte targets `[batch, length]` of the windows at `offsets` (global arrays;
    each rank keeps its slice)."""
    x, y = batch_windows(data, cfg, offsets)
    shape = [cfg.dim("batch"), cfg.dim("length")]
    return {"inputs": mesh.from_numpy(x, shape), "targets": mesh.from_numpy(y, shape)}


def train_offsets(data: np.ndarray, cfg: Config, seed: int, step: int) -> np.ndarray:
    """The global batch of `step`: random window starts drawn from `(seed, step)` only."""
    return np.random.default_rng([seed, step]).integers(0, len(data) - cfg.length - 1, size=cfg.batch)


class Batches:
    """The training data stream: batch `position` (0, 1, ...) is the windows at `train_offsets(data, cfg,
    seed, position)`. `state()` is what a checkpoint keeps of it (plain values): where it is, its seed
    (which also draws each step's MoE seed, `step_seed`), and what it draws from; `restore` goes on
    from a saved state, refusing one drawn from other data or flags.

    >>> b = Batches(np.arange(100, dtype=np.uint8), Config(length=8, batch=2), seed=1)
    >>> first = b.next(); b.state()["position"], bool((b.next() != first).any())
    (1, True)
    """

    KEPT = ("seed", "batch", "length", "corpus_bytes", "corpus_crc32")  # what must match to go on

    def __init__(self, data: np.ndarray, cfg: Config, seed: int, position: int = 0):
        self.data, self.cfg, self.seed, self.position = data, cfg, seed, position
        self.crc = zlib.crc32(data)

    def next(self) -> np.ndarray:
        """The next batch's window starts."""
        offsets = train_offsets(self.data, self.cfg, self.seed, self.position)
        self.position += 1
        return offsets

    def state(self) -> dict:
        return {"position": self.position, "seed": self.seed, "batch": self.cfg.batch, "length": self.cfg.length,
                "corpus_bytes": len(self.data), "corpus_crc32": self.crc}

    def restore(self, saved: Optional[dict], step: int) -> None:
        """Go on from `saved` (a checkpoint's `state()`; None, a checkpoint from before data positions:
        from batch `step`, the batch of the step it resumes at)."""
        if saved is None:
            self.position = step
            return
        mine = self.state()
        differ = [k for k in self.KEPT if saved.get(k) != mine[k]]
        if differ:
            said = ", ".join(f"{k} {saved.get(k)} (now {mine[k]})" for k in differ)
            raise UsageError(f"--resume: the checkpoint's data stream differs from this run's: {said}; resume with "
                             f"the --seed, --batch, --length and --data (--max-bytes, --heldout) it was saved with")
        self.position = int(saved["position"])


def evaluate(params: Params, mesh: mm.Mesh, data: np.ndarray, cfg: Config, batches: int) -> float:
    """Mean held-out loss (nats per byte) over `batches` batches of evenly spaced windows."""
    n = batches * cfg.batch
    starts = np.linspace(0, len(data) - cfg.length - 1, n).astype(np.int64)
    total = 0.0
    for b in range(batches):
        batch = make_batch(mesh, data, cfg, starts[b * cfg.batch:(b + 1) * cfg.batch])
        total += float(loss_fn(params, batch, cfg, train=False))
    return total / batches


def sample(params: Params, mesh: mm.Mesh, cfg: Config, prompts: np.ndarray, n_bytes: int,
           temperature: float, seed: int) -> np.ndarray:
    """Continue each prompt (`[n, length]` bytes) by `n_bytes` bytes, each drawn from the model's
    next-byte distribution over the last `length` bytes (greedy if temperature is 0)."""
    rng = np.random.default_rng(seed)
    buf = prompts.astype(np.int32)
    shape = [mm.Dimension("batch", len(prompts)), cfg.dim("length")]
    for _ in range(n_bytes):
        logits = forward(params, mesh.from_numpy(np.ascontiguousarray(buf[:, -cfg.length:]), shape), cfg)
        last = logits.to_numpy()[:, -1].astype(np.float64)
        if temperature <= 0:
            nxt = last.argmax(-1)
        else:
            z = last / temperature
            p = np.exp(z - z.max(-1, keepdims=True))
            nxt = np.array([rng.choice(len(row), p=row / row.sum()) for row in p])
        buf = np.concatenate([buf, nxt[:, None].astype(np.int32)], axis=1)
    return buf[:, prompts.shape[1]:]


# ----------------------------------------------------------------------------- measurement, I/O

class CommTimer:
    """Wall time spent inside the mesh's collective calls (wraps them on this mesh only)."""

    KINDS = ("allreduce", "allgather", "alltoall", "reduce_scatter", "permute", "exscan")

    def __init__(self, mesh: mm.Mesh):
        self.seconds = 0.0
        coll = mesh.collectives
        for kind in self.KINDS:
            if hasattr(coll, kind):
                setattr(coll, kind, self._timed(getattr(coll, kind)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def checkpoint_tensors(params: Params, opt_state: dict) -> Params:
    """The flat dict a checkpoint holds: `params/<name>`, `opt/step` and `opt/<slot>/<name>`."""
    out = {f"params/{k}": t for k, t in params.items()}
    for slot, d in opt_state.items():
        out.update({"opt/step": d} if slot == "step" else {f"opt/{slot}/{k}": t for k, t in d.items()})
    return out


def checkpoint_tree(params: Params, opt_state: dict, data: Optional[dict] = None) -> dict:
    """What a checkpoint holds: `checkpoint_tensors` as a nest of dicts (its tensors named as there),
    and `data`, the data stream's `Batches.state()`, where given."""
    tree = layers.unflatten(checkpoint_tensors(params, opt_state))
    return tree if data is None else {**tree, "data": data}


def save_checkpoint(root: str, step: int, params: Params, opt_state: dict, data: Optional[dict] = None,
                    blocking: bool = True):
    """Parameters, the whole optimizer state and the data stream's state as the checkpoint
    `root/step-NNNNNNNN` (atomic; then all but the newest KEEP in `root` are deleted); returns its
    path, or with `blocking=False` at once its `mm.SaveHandle` (written in the background)."""
    return checkpoint.save_step(root, step, checkpoint_tree(params, opt_state, data), keep=KEEP, blocking=blocking)


def load_checkpoint(path: str, mesh: mm.Mesh, params: Params, opt_state: dict) -> tuple:
    """`(params, opt_state, step)` from the checkpoint `path`, resharded onto `mesh` (`read_checkpoint`)."""
    return read_checkpoint(path, mesh, params, opt_state)[:3]


def read_checkpoint(path: str, mesh: mm.Mesh, params: Params, opt_state: dict) -> tuple:
    """`(params, opt_state, step, data)` from the checkpoint `path`, resharded onto `mesh`; `data`: the
    data stream's state (None in a checkpoint from before they held one). `params` and `opt_state` are
    templates (a fresh init): the checkpoint must hold their names and shapes, else a CheckpointError
    on every rank names the first tensor and dim that differ; each tensor comes back in its template's
    layout."""
    ck = mm.load(path, mesh, shapes=checkpoint_tree(params, opt_state))
    data = ck.pop("data", None)
    ck = layers.flatten(ck) if "params" in ck else ck  # (a flat dict from before: the same names)
    state = {s: like(ck["opt/step"], d) if s == "step" else {k: like(ck[f"opt/{s}/{k}"], d[k]) for k in d}
             for s, d in opt_state.items()}
    return {k: like(ck[f"params/{k}"], params[k]) for k in params}, state, int(state["step"].to_numpy()), data


def like(t, template):
    """`t` laid out as `template` (a checkpoint loads by the rules in force; `--shard-weights`' layouts are
    the templates')."""
    return t if t.tensor_layout == template.tensor_layout else mm.relayout(t, template.layout)


def _unwritable(path: str) -> Optional[str]:
    """Why this process cannot keep checkpoints in the folder `path` (made if missing), or None."""
    if os.path.exists(path) and not os.path.isdir(path):
        return None  # (refused by `checkpoint.steps`, naming it a file)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    return None if os.access(path, os.W_OK | os.X_OK) else "permission denied"


def resume_point(args: argparse.Namespace, mesh: mm.Mesh) -> Optional[str]:
    """The checkpoint `--resume` continues from: the newest complete one in --checkpoint, the one
    of step N there, or a path; None without --resume. Refuses (CheckpointError on every rank) a
    --checkpoint DIR holding other things, and one holding a checkpoint without --resume or
    --overwrite. Otherwise, without --resume, deletes DIR's checkpoints (--overwrite) and
    interrupted saves. A --checkpoint DIR that some rank cannot make or write into is refused
    here, before training, not at the first save."""
    if args.checkpoint:
        why = _unwritable(args.checkpoint)
        whys = mesh.comm_for(mesh.shape.names).allgather(why) if mesh.size > 1 else [why]
        if any(whys):
            raise UsageError(f"--checkpoint {args.checkpoint!r}: cannot write there: "
                             + "; ".join(f"rank {r}: {w}" for r, w in enumerate(whys) if w))
    found = checkpoint.steps(args.checkpoint, mesh) if args.checkpoint else []
    if args.resume is None:
        if found and not args.overwrite:
            raise mm.CheckpointError(f"--checkpoint {args.checkpoint!r} already holds a checkpoint at step "
                                     f"{found[-1]}: pass --resume to continue it, or --overwrite to delete it and "
                                     "start from step 0")
        if args.checkpoint:
            checkpoint.prune(args.checkpoint, mesh, keep=0)
        return None
    if args.resume == "newest":
        if not found:
            raise mm.CheckpointError(f"--resume: no complete checkpoint in {args.checkpoint!r}; run without --resume")
        return checkpoint.step_path(args.checkpoint, found[-1])
    if args.resume.isdigit():
        if int(args.resume) not in found:
            raise mm.CheckpointError(f"--resume {args.resume}: {args.checkpoint!r} holds no complete checkpoint of "
                                     f"step {int(args.resume)}; it holds steps {found or 'none'}")
        return checkpoint.step_path(args.checkpoint, int(args.resume))
    return args.resume


def resume(path: str, args: argparse.Namespace, mesh: mm.Mesh, params: Params, opt_state: dict) -> tuple:
    """`(params, opt_state, step, data)` of the checkpoint `path` (see `read_checkpoint`). A damaged
    checkpoint (a truncated or corrupted file) is refused naming the newest intact one in
    --checkpoint and how to resume from it; a step past --steps is refused too."""
    try:
        params, opt_state, step, data = read_checkpoint(path, mesh, params, opt_state)
    except mm.CheckpointError as e:
        damaged = checkpoint.verify(path) if mesh.rank == 0 else None
        damaged = mesh.collectives.any_rank(damaged is not None)  # the same answer on every rank
        match = checkpoint.STEP_DIR.fullmatch(os.path.basename(os.path.normpath(path)))
        if not damaged and "does not fit" in str(e):
            raise mm.CheckpointError(f"{e}; a checkpoint continues only under the flags it was saved with: the "
                                     f"model sizes, --optimizer ({args.optimizer} now), --dtype ({args.dtype} now; "
                                     f"float16 saves its loss scale)") from None
        if not (damaged and args.checkpoint):
            raise
        intact = checkpoint.newest_intact(args.checkpoint, mesh, before=int(match[1]) if match else None)
        hint = (f"the newest intact checkpoint is {checkpoint.step_path(args.checkpoint, intact)}: resume from it "
                f"with --resume {intact}" if intact is not None else
                f"no older intact checkpoint is in {args.checkpoint!r}")
        raise mm.CheckpointError(f"{e}; {hint}") from None
    if step > args.steps:
        raise mm.CheckpointError(f"--resume: the checkpoint {path!r} is at step {step}, past --steps {args.steps} "
                                 f"(the total step count, not steps to add); pass --steps above {step} to train on")
    return params, opt_state, step, data


def auto_layout(mesh_shape: str, cfg: Config, seed: int, recalibrate: bool = False, top: int = 5) -> tuple:
    """`--layout auto`: `(rules, predicted seconds per step, blocks to remat, mesh dims to shard the weights over
    or "")` that `mm.auto_layout` chooses for the training step on a mesh of `mesh_shape` (weight sharding only
    when no rules fit the memory), priced on this machine's calibration for that mesh
    (kept on disk from an earlier run, or measured now: `recalibrate` measures again); rank 0
    prints them and the next `top` alternatives with their predicted step times. The step is
    recorded dry: the parameters and optimizer state are placeholders on a `DryMesh` (shapes and
    dtypes, no values)."""
    from mpimesh.cost import cache
    from mpimesh.dryrun import DryMesh
    mesh = mm.Mesh(mesh_shape)
    optimizer = make_optimizer(cfg)
    params = init_params(DryMesh(mesh_shape), cfg, seed)
    tokens = mm.cost.ArgSpec([cfg.dim("batch"), cfg.dim("length")], "int32")
    t0 = time.perf_counter()
    where = cache.cache_file(mesh, cfg.dtype)
    fresh = recalibrate or not os.path.exists(where)
    machine = cache.calibrated(mesh, redo=recalibrate, dtype=cfg.dtype)
    t1 = time.perf_counter()
    step = make_train_step(replace(cfg, remat=cfg.layers), optimizer)  # auto_layout decides which blocks remat
    state = init_state(cfg, optimizer, params)
    plan = mm.auto_layout(step, (params, state, {"inputs": tokens, "targets": tokens}), mesh, machine=machine)
    if mesh.rank == 0:
        how = (f"measured in {t1 - t0:.1f} s and kept in {where}" if fresh else
               f"kept from an earlier run in {where} (--recalibrate measures again)")
        print(f"--layout auto on mesh {mesh.shape}: {plan.rules or '(replicated)'!s}, predicted "
              f"{plan.seconds * 1e3:.1f} ms per step ({time.perf_counter() - t1:.1f} s to search); calibration "
              f"{how}")
        print(plan.report(top), flush=True)
    return plan.rules, plan.seconds, -(-plan.remat // 2), plan.shard_weights or ""  # blocks: two remat sublayers each


def predicted_beside_measured(predicted: float, times: list) -> str:
    """The cost model's step time beside the median of the measured ones (the first left out, where
    there are more: it warms up).

    >>> predicted_beside_measured(0.1, [0.5, 0.11, 0.12, 0.13])
    '--layout auto: predicted 100.0 ms per step, measured 120.0 ms (median of steps 2-4): 1.20x the prediction'
    """
    kept = times[1:] if len(times) > 1 else times
    measured = float(np.median(kept))
    return (f"--layout auto: predicted {predicted * 1e3:.1f} ms per step, measured {measured * 1e3:.1f} ms "
            f"(median of steps {len(times) - len(kept) + 1}-{len(times)}): {measured / predicted:.2f}x the prediction")


def default_mesh(n: int) -> str:
    """`rows:r;cols:c` with r*c == n, r <= c, as square as possible (a prime n: `rows:1;cols:n`,
    in effect 1-D; sizes that the mesh dims do not divide are cut unevenly).

    >>> default_mesh(4), default_mesh(3), default_mesh(6)
    ('rows:2;cols:2', 'rows:1;cols:3', 'rows:2;cols:3')
    """
    r = max(d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0)
    return f"rows:{r};cols:{n // r}"


SIZES = {"d_model": "residual stream width", "heads": "attention heads", "d_kv": "per-head key/value size",
         "d_ff": "feed-forward hidden units", "layers": "Transformer blocks", "vocab": "vocabulary (>= 256 bytes)",
         "length": "positions per sequence (alias --seq)", "batch": "sequences per step"}


def parse_args(argv=None) -> argparse.Namespace:
    """The flags (in --help's order, by group), checked: a bad one or a bad combination is one line on
    stderr from rank 0 and exit status 2 on every rank, before any work."""
    ap = parser(__doc__.split("\n\n")[0] + "\n\nFull description: docs/transformer.md.", DIMS, PAPER_LAYOUT)
    for add in (_model_flags, _optimizer_flags, _step_flags, _parallel_flags, pipelined.add_flags, _data_flags,
                _eval_flags, _checkpoint_flags, _output_flags):
        add(ap)
    args = ap.parse_args(argv)
    _check_checkpoint_flags(ap, args)
    _check_values(ap, args)
    pipelined.check_flags(ap, args)
    _check_log_json(ap, args)
    _check_export(ap, args)
    for note in _idle_flags(ap, args) if mm.MPI.COMM_WORLD.Get_rank() == 0 else ():
        print(f"note: {note}", file=sys.stderr)
    return args


def _model_flags(ap: argparse.ArgumentParser) -> None:
    """The model's sizes, activation and activations' dtype."""
    c = Config()
    for name, what in SIZES.items():
        flags = dict.fromkeys([f"--{name.replace('_', '-')}", f"--{name}"])  # --d-model and --d_model
        ap.add_argument(*flags, dest=name, type=int, default=getattr(c, name), help=what)
    ap.add_argument("--seq", dest="length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--activation", default=c.activation, choices=["relu", "gelu"])
    ap.add_argument("--dtype", default=c.dtype, choices=["float32", "bfloat16", "float16"],
                    help="the activations' dtype (parameters and optimizer state stay float32; float16 scales the "
                         "loss dynamically)")


def _optimizer_flags(ap: argparse.ArgumentParser) -> None:
    c = Config()
    ap.add_argument("--optimizer", default=c.optimizer, choices=["adafactor", "adam"])
    ap.add_argument("--lr", type=float, default=None,
                    help="the learning rate (default: adafactor, a relative step of min(0.01, 1/sqrt(t)); adam, 3e-3)")
    ap.add_argument("--warmup", type=int, default=c.warmup, help="adam's linear warmup steps")


def _step_flags(ap: argparse.ArgumentParser) -> None:
    """Mixtures of experts, rematerialisation and the number of steps."""
    ap.add_argument("--moe-every", dest="moe_every", type=int, default=0,
                    help="K > 0: every K-th feed-forward block (layers i with (i+1) %% K == 0) is a GShard top-2 "
                         "mixture of --experts experts (each sequence one group); if --layout does not place "
                         "'experts', 'experts:<the mesh dim of batch>' is added (GShard: experts on the groups' "
                         "mesh dim; the dispatch and combine are alltoalls over it)")
    ap.add_argument("--experts", type=int, default=0, help="experts per MoE layer (>= 2 with --moe-every)")
    ap.add_argument("--remat", nargs="?", type=int, const=math.inf, default=0, metavar="N",
                    help="rematerialise the first N blocks (all without N; mm.remat on each of their two "
                    "sublayers): their activations are recomputed in the backward pass instead of kept (less "
                    "memory, about one more forward pass); with --layout "
                    "auto, mm.auto_layout remats the fewest blocks that let a layout fit when memory is short")
    ap.add_argument("--steps", type=int, default=200, help="the total number of training steps (with --resume too)")


def _parallel_flags(ap: argparse.ArgumentParser) -> None:
    """The mesh, the backend, the device and the layout."""
    ap.add_argument("--mesh", default=None, help="e.g. 'rows:2;cols:2' (default: the squarest rows x cols; with "
                    "--backend jax: rows:2;cols:2)")
    ap.add_argument("--backend", default="mpi", choices=["mpi", "jax"],
                    help="jax: the train step is recorded once with mpimesh on 1 rank and replayed by JAX for the "
                         "loop on a jax mesh named and sized like --mesh (host devices on CPU; under mpiexec, "
                         "one JAX process per rank), sharded by --layout; see apps/transformer_jax.py")
    ap.add_argument("--compile-cache", dest="compile_cache",
                    default=os.path.join(os.path.expanduser("~"), ".cache", "mpimesh", "jax"),
                    help="--backend jax: JAX's persistent compilation cache ('none': no cache)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"],
                    help="gpu: each rank's slices live on its GPU (CuPy; python3 install.py gpu), one rank per GPU; "
                         "the transport (nccl, CUDA-aware mpi, or staged through host) is chosen per mesh")
    ap.add_argument("--layout", default=PAPER_LAYOUT, help="layout rules: tensor dim:mesh dim pairs (see below), or "
                    "'auto': chosen by mm.auto_layout (the cost model, calibrated on this mesh, prices the step "
                    "recorded dry under each candidate)")
    ap.add_argument("--recalibrate", action="store_true", help="with --layout auto: measure the machine again "
                    "instead of using the calibration an earlier run kept for this mesh")
    ap.add_argument("--shard-weights", dest="shard_weights", default="", metavar="MESH_DIM",
                    help="split every weight, its gradient and its optimizer state over MESH_DIM too (or "
                         "'rows+cols'): GSPMD's weight sharding, ZeRO-3, FSDP (mm.shard_weights); each op "
                         "gathers a weight before use and its gradient is reduce-scattered")


def _data_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data", default=None, help="a text file or folder (default: the stdlib's sources)")
    ap.add_argument("--max-bytes", type=int, default=4 << 20, help="corpus bytes read at most")
    ap.add_argument("--heldout", type=float, default=0.1, help="held-out fraction")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batch order")


def _eval_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--log-every", type=int, default=20, help="steps between progress lines")
    ap.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")


def _checkpoint_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--checkpoint", default=None, help=f"directory of step-NNNNNNNN checkpoints, saved every "
                    f"--save-every steps and at the end; the newest {KEEP} are kept")
    ap.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    ap.add_argument("--resume", nargs="?", const="newest", default=None, metavar="STEP|PATH",
                    help="continue, up to --steps, from the newest complete checkpoint in --checkpoint, or from its "
                    "step STEP, or from the checkpoint directory PATH (then --checkpoint, if given, is where new "
                    "ones go)")
    ap.add_argument("--overwrite", action="store_true", help="start from step 0 although --checkpoint holds "
                    "checkpoints (they are deleted)")
    ap.add_argument("--blocking-save", dest="blocking_save", action="store_true", help="save each checkpoint "
                    "before training on (default: in the background, mm.save(..., blocking=False), the state of "
                    "the step copied first)")
    ap.add_argument("--export", default=None, metavar="DIR", help="at the end, write the parameters as Hugging "
                    "Face safetensors files in DIR (mm.save(..., format='safetensors')) with a config.json of the "
                    "model's sizes")


def _output_flags(ap: argparse.ArgumentParser) -> None:
    """What rank 0 writes and prints, op-by-op steps, and the samples at the end."""
    ap.add_argument("--log-json", default=None, metavar="FILE", help="rank 0 writes one JSON line per training "
                    "step: step, loss, tokens_per_s and step_ms (that step's), comm_share (of its time in "
                    "collectives; null with --backend jax), lr (the optimizer's learning rate at its step count), "
                    "peak_bytes (rank 0's peak memory in the step, mm.profile()'s: host = resident set high-water "
                    "mark; gpu, gpu_cached with --device gpu), heldout_loss on the evaluated steps alone, and "
                    "with --pipeline bubble (rank 0's share of the pipeline op in the transfers between stages)")
    ap.add_argument("--profile", action="store_true", help="print the comm/compute counters of every step")
    ap.add_argument("--timeline", default=None, metavar="FILE", help="record every rank's ops and collectives "
                    "over the training steps (use a few --steps) into FILE, a Chrome trace (Perfetto, "
                    "chrome://tracing), and draw it beside it as FILE's name .png (mm.profile(timeline=...))")
    ap.add_argument("--eager", action="store_true", help="run every step op by op (default: the step is recorded "
                    "once and replayed without per-op Python, mm.compile; the same values)")
    ap.add_argument("--samples", type=int, default=3, help="sampled lines at the end")
    ap.add_argument("--sample-bytes", type=int, default=120, help="bytes per sampled line")
    ap.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (0: greedy)")


def _check_checkpoint_flags(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--resume and --overwrite: what they need, and not both."""
    if args.resume is not None and not args.checkpoint and (args.resume == "newest" or args.resume.isdigit()):
        ap.error(f"--resume{'' if args.resume == 'newest' else ' ' + args.resume} needs --checkpoint DIR "
                 "(or give the checkpoint's path: --resume DIR/step-NNNNNNNN)")
    if args.overwrite and not args.checkpoint:
        ap.error("--overwrite needs --checkpoint DIR")
    if args.resume is not None and args.overwrite:
        ap.error("--resume continues the checkpoint that --overwrite deletes: give one of them")
    if args.resume is not None and args.resume.lstrip("+-").isdigit() and not args.resume.isdigit():
        ap.error(f"--resume {args.resume}: a step is at least 0 (a checkpoint path: --resume ./{args.resume})")


def _check_values(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The numbers' ranges, the MoE flags together, --recalibrate's --layout auto."""
    check_at_least(args, 1, *SIZES, "steps", "log_every", "eval_every", "eval_batches", "save_every", "max_bytes")
    check_at_least(args, 0, "moe_every", "experts", "warmup", "seed", "samples", "sample_bytes", "temperature",
                   *(["remat"] if args.remat != math.inf else []))  # inf: --remat without N, all blocks
    if args.moe_every > 0 and args.experts < 2:
        ap.error(f"--moe-every {args.moe_every} needs --experts E with E >= 2, got {args.experts}")
    if args.experts and not args.moe_every:
        ap.error(f"--experts {args.experts} needs --moe-every K: which layers are mixtures of experts")
    if args.moe_every > args.layers:
        ap.error(f"--moe-every {args.moe_every} with --layers {args.layers} makes no layer a mixture of experts: "
                 f"K must be at most --layers")
    if args.recalibrate and args.layout != "auto":
        ap.error("--recalibrate needs --layout auto: it measures the machine for the cost model")
    if not 0 < args.heldout < 1:
        ap.error(f"--heldout {args.heldout}: a fraction between 0 and 1")


def _check_log_json(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.log_json:  # rank 0 writes it: its answer, on every rank, before any work
        why = mm.MPI.COMM_WORLD.bcast(unwritable(args.log_json) if mm.MPI.COMM_WORLD.Get_rank() == 0 else None)
        if why:
            ap.error(f"--log-json {args.log_json!r}: {why}")


def _check_export(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--export DIR: the safetensors package there, and DIR empty, new or an export (checked on rank 0)."""
    if args.export:
        require("safetensors", "safetensors", "--export")
        why = None
        if mm.MPI.COMM_WORLD.Get_rank() == 0:
            try:
                safetensors_io.check_replaceable(os.path.abspath(args.export))
            except mm.CheckpointError as e:
                why = str(e)
        why = mm.MPI.COMM_WORLD.bcast(why)
        if why:
            ap.error(f"--export {args.export!r}: {why}")


def _idle_flags(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list:
    """Notes on flags that change nothing here: said, not refused (scripts pass them to every run)."""
    notes = []
    if args.save_every != ap.get_default("save_every") and not args.checkpoint:
        notes.append(f"--save-every {args.save_every} does nothing without --checkpoint DIR")
    if args.blocking_save and not args.checkpoint:
        notes.append("--blocking-save does nothing without --checkpoint DIR")
    if args.warmup != ap.get_default("warmup") and args.optimizer == "adafactor":
        notes.append(f"--warmup {args.warmup} does nothing with --optimizer adafactor: it is Adam's linear warmup")
    return notes


def unwritable(path: str) -> Optional[str]:
    """Why the file `path` cannot be written (None if it can), without creating it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory"
    if not os.path.isdir(folder):
        return f"no directory {folder!r}"
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        return f"no permission to write {'it' if os.path.exists(path) else 'in ' + repr(folder)}"
    return None


def _jax_helper():
    """apps/transformer_jax.py (imports jax only when the jax backend is asked for)."""
    require("jax", "tpu", "--backend jax")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import transformer_jax
    return transformer_jax


def on_first_rank(fn: Callable):
    """`fn()` on world rank 0 alone, its result (or its error, raised again) on every rank: for the
    JAX processes, each of which holds everything on its own 1-rank mesh."""
    comm = mm.MPI.COMM_WORLD
    result = error = None
    if comm.Get_rank() == 0:
        try:
            result = fn()
        except mm.MpimeshError as e:
            error = e
    result, error = comm.bcast((result, error))
    if error is not None:
        raise error
    return result


class JaxSide(NamedTuple):
    """--backend jax: apps/transformer_jax.py, the JAX mesh, how it spans the processes, --mesh's text."""
    helper: object
    mesh: object
    across: object
    shape: str


@dataclass
class Run:
    """What `main` sets up before training: the flags, the model, the mesh and the corpus."""
    args: argparse.Namespace
    cfg: Config
    mesh: mm.Mesh
    train: np.ndarray
    held: np.ndarray
    predicted: Optional[float] = None  # --layout auto: the cost model's seconds per step
    jax: Optional[JaxSide] = None  # --backend jax
    pipe: Optional[pipelined.Pipe] = None  # --pipeline

    @property
    def first_rank(self) -> bool:
        return mm.MPI.COMM_WORLD.Get_rank() == 0

    def say(self, *args, **kwargs) -> None:
        """`print` on world rank 0 alone."""
        if self.first_rank:
            print(*args, **kwargs)


class Start(NamedTuple):
    """Where training starts: the parameters, the optimizer and its state, the step, the checkpoint (or
    None), the data stream."""
    params: Params
    opt_state: dict
    optimizer: object
    step: int
    path: Optional[str]
    batches: Batches


class StepResult(NamedTuple):
    """One training step as the loop logs it (`in_comm`: None where XLA places the collectives)."""
    loss: float
    seconds: float
    in_comm: Optional[float]
    sent: int
    t: int  # the optimizer's step count after it
    prof: object


def main(argv=None) -> None:
    """The app: flags, the model and mesh, training, the final evaluation and samples (docs/transformer.md)."""
    args = parse_args(argv)
    cfg = make_config(args)
    auto = check_layout_flags(args, cfg)
    train, held, desc = read_corpus(args, cfg)
    run = make_run(args, cfg, auto, train, held)
    start = initial_state(run)
    if start is None:
        return
    base = unigram_bits_per_byte(train)
    print_banner(run, start, desc, base)
    with mm.profile(timeline=args.timeline) if args.timeline else nullcontext():
        params, held_loss, train_time = train_loop(run, start, base)
    if args.timeline and run.first_rank:
        run.say(f"timeline of every rank: {args.timeline}, drawn in {mm.profile.plot(args.timeline)}")
    print_summary(run, start, base, held_loss, train_time)
    if args.export:
        export_model(run, params)
    print_samples(run, params)


def make_config(args: argparse.Namespace) -> Config:
    """The model's `Config` from the flags; a vocabulary under 256 bytes or a bad --lr is refused."""
    cfg = Config(**{k: getattr(args, k) for k in ("d_model", "heads", "d_kv", "d_ff", "layers", "vocab", "length",
                                                  "batch", "activation", "optimizer", "lr", "warmup",
                                                  "moe_every", "experts", "dtype")},
                 remat=min(args.remat, args.layers))
    if cfg.vocab < 256:
        raise UsageError(f"--vocab {cfg.vocab}: byte-level text needs a vocabulary of at least 256")
    if cfg.lr is not None and not (math.isfinite(cfg.lr) and cfg.lr >= 0):
        raise UsageError(f"--lr {cfg.lr}: the learning rate must be a finite number >= 0")
    return cfg


def check_layout_flags(args: argparse.Namespace, cfg: Config) -> bool:
    """Whether --layout is auto (which needs --backend mpi); other rules are checked against the
    model's dims and get MoE's `experts` rule (`moe_layout`) in `args.layout`."""
    auto = args.layout == "auto"
    if auto and args.backend == "jax":
        raise UsageError("--layout auto needs --backend mpi: it calibrates the cost model on the mesh's ranks")
    if not auto:
        check_layout(args.layout, DIMS if cfg.moe_every else {k: v for k, v in DIMS.items() if k != "experts"})
        args.layout = moe_layout(args.layout, cfg.moe_every)
    return auto


def read_corpus(args: argparse.Namespace, cfg: Config) -> tuple:
    """`load_corpus` of the flags: `(train, heldout, description)`; each part must hold a window."""
    train, held, desc = load_corpus(args.data, args.max_bytes, args.heldout)
    if min(len(train), len(held)) <= cfg.length + 1:
        raise UsageError(f"--length {cfg.length}: the text gives {len(train)} training and {len(held)} held-out "
                         f"bytes (--max-bytes {args.max_bytes}, --heldout {args.heldout}); each needs more than "
                         f"--length + 1")
    return train, held, desc


def make_run(args: argparse.Namespace, cfg: Config, auto: bool, train: np.ndarray, held: np.ndarray) -> Run:
    """The mesh: with --backend jax, a 1-rank mesh with --mesh's dim names (each of size 1) and the JAX mesh
    the step is replayed on; else --mesh (default: the squarest) under --layout, or under the rules
    `--layout auto` chooses (then with the blocks it remats)."""
    world = mm.MPI.COMM_WORLD.Get_size()
    if args.device == "gpu" and args.backend == "jax":
        raise UsageError("--device gpu is for --backend mpi (CuPy on each rank's GPU); a JAX replay runs on the "
                         "devices JAX sees")
    if args.backend == "jax":  # record on 1 rank per process, replay on the jax mesh (transformer_jax.py)
        if args.shard_weights:
            raise UsageError("--shard-weights is for --backend mpi (the JAX replay shards by --layout)")
        for flag in ("eager", "profile"):
            if getattr(args, flag) and mm.MPI.COMM_WORLD.Get_rank() == 0:
                print(f"note: --{flag} is for --backend mpi; the JAX replay runs as XLA compiled it")
        helper = _jax_helper()
        jax_mesh = args.mesh or default_mesh(4)
        jm, across = helper.jax_mesh(jax_mesh)
        if args.compile_cache != "none":
            helper.use_compile_cache(args.compile_cache)
        ones = ";".join(f"{n}:1" for n in mm.Shape(jax_mesh).names)  # --mesh's dim names, each of size 1
        mesh = mm.Mesh(ones, layout=args.layout, comm=mm.MPI.COMM_SELF)
        return Run(args, cfg, mesh, train, held, jax=JaxSide(helper, jm, across, jax_mesh))
    predicted = None
    if auto:
        rules, predicted, remat, shard = auto_layout(args.mesh or default_mesh(world), cfg, args.seed, args.recalibrate)
        cfg = replace(cfg, remat=max(cfg.remat, remat))
        args.shard_weights = args.shard_weights or shard
        args.layout = moe_layout(rules, cfg.moe_every)
    mesh = mm.Mesh(args.mesh or default_mesh(world), layout=args.layout,
                   backend="cupy" if args.device == "gpu" else "numpy")
    pipe = pipelined.from_args(args)
    if pipe:
        pipelined.check(pipe, mesh, cfg)
    return Run(args, cfg, mesh, train, held, predicted=predicted, pipe=pipe)


def initial_state(run: Run) -> Optional[Start]:
    """A fresh init, or --resume's checkpoint; None (said on rank 0) when that checkpoint is at --steps."""
    args, mesh = run.args, run.mesh
    from_path = on_first_rank(lambda: resume_point(args, mesh)) if args.backend == "jax" else resume_point(args, mesh)
    params = init_params(mesh, run.cfg, args.seed)
    if args.shard_weights:
        params = mm.shard_weights(params, args.shard_weights)
    optimizer = make_optimizer(run.cfg)
    opt_state = init_state(run.cfg, optimizer, params)
    start, batches = 0, Batches(run.train, run.cfg, args.seed)
    if from_path:
        params, opt_state, start, data = resume(from_path, args, mesh, params, opt_state)
        batches.restore(data, start)
        if start == args.steps:
            run.say(f"nothing to do: the checkpoint {from_path!r} is at step {start}, and --steps {args.steps} is "
                    f"the total step count; pass a larger --steps to train on")
            return None
    if run.pipe:  # the blocks stacked into stages (checkpoints and the init stay per layer)
        params = pipelined.to_stages(params, run.pipe, mesh, run.cfg)
        opt_state = pipelined.state_to_stages(opt_state, run.pipe, mesh, run.cfg)
    return Start(params, opt_state, optimizer, start, from_path, batches)


def print_banner(run: Run, start: Start, desc: str, base: float) -> None:
    """Rank 0's first lines: ranks, mesh and layout, the model, the data, the baseline, where it resumed."""
    args, cfg, say = run.args, run.cfg, run.say
    world = mm.MPI.COMM_WORLD.Get_size()
    n_params = sum(t.shape.size for t in start.params.values())
    if run.jax:
        devices = run.jax.mesh.devices.ravel()
        say(f"mpimesh transformer, jax backend: {world} process(es), jax mesh {mm.Shape(run.jax.shape)} on "
            f"{len(devices)} {devices[0].platform} devices ({run.jax.helper.distributed.spans_text(run.jax.across)}), "
            f"layout {args.layout!r}")
    else:
        say(f"mpimesh transformer: {world} ranks, mesh {run.mesh.shape}, layout {args.layout!r}; "
            + (f"GPU {run.mesh.device} per rank (rank 0's), transport {run.mesh.transport}" if args.device == "gpu"
               else mm.threads.describe()))
    say(f"model: {cfg.layers} layers, d_model {cfg.d_model}, heads {cfg.heads}x{cfg.d_kv}, d_ff {cfg.d_ff}, "
        f"vocab {cfg.vocab}, length {cfg.length}; {n_params:,} parameters; batch {cfg.batch}; {cfg.optimizer}; "
        f"{cfg.dtype} activations")
    if args.shard_weights:
        held = sum(t.local.nbytes for t in start.params.values())
        whole = sum(t.shape.size * t.dtype.itemsize for t in start.params.values())
        say(f"weights sharded over {args.shard_weights}: this rank holds {held / 2**20:.2f} of {whole / 2**20:.2f} "
            f"MiB of parameters (and its share of their optimizer state)")
    if cfg.moe_every:
        say(f"MoE: layers {[i for i in range(cfg.layers) if cfg.is_moe(i)]} have {cfg.experts} experts "
            f"(top-2 gating, groups = sequences)")
    if run.pipe:
        say(pipelined.banner(run.pipe, run.mesh, cfg))
    say(f"data: {desc}")
    say(f"unigram baseline: {base:.3f} bits per byte (entropy of the training bytes)")
    if start.path:
        say(f"resumed from {start.path} at step {start.step}")


def build_step(run: Run, start: Start) -> tuple:
    """`(step, timer)`: the JAX replay of the training step (`JaxTrainStep`, timer None), or the step
    compiled with the parameters and optimizer state donated (--eager: as it is) and a `CommTimer`."""
    train_step = make_train_step(run.cfg, start.optimizer)
    if run.jax:
        mesh, args, jx = run.mesh, run.args, run.jax
        first = make_batch(mesh, run.train, run.cfg, train_offsets(run.train, run.cfg, args.seed, start.step))
        t0 = time.perf_counter()
        jstep = jx.helper.JaxTrainStep(train_step, start.params, start.opt_state, first,
                                       step_seed(mesh, args.seed, start.step), jx.mesh, args.layout)
        run.say(f"jax: step recorded on 1 rank and compiled for the jax mesh {mm.Shape(jx.shape)} in "
                f"{time.perf_counter() - t0:.1f} s (tracing {jstep.seconds['trace']:.2f} s, XLA compile "
                f"{jstep.seconds['compile']:.2f} s{', loaded from the cache' if jstep.from_cache else ''}; "
                + (f"persistent cache {args.compile_cache})" if args.compile_cache != "none" else "no cache)"))
        return jstep, None
    timer = CommTimer(run.mesh)
    if run.pipe:  # (op by op: mm.compile does not replay pipelines yet)
        return pipelined.make_train_step(run.cfg, start.optimizer, run.pipe, MODEL), timer
    if not run.args.eager:  # the parameters and optimizer state given to the step: updated in place
        train_step = mm.compile(train_step, donate_argnums=(0, 1))
    return train_step, timer


def mpi_step(run: Run, train_step: Callable, timer: CommTimer, step: int, offsets: np.ndarray, params: Params,
             opt_state: dict) -> tuple:
    """Training step `step` on the mesh: `(params, opt_state, StepResult)`."""
    batch = make_batch(run.mesh, run.train, run.cfg, offsets)
    c0, t0 = timer.seconds, time.perf_counter()
    with mm.profile() as prof:
        params, opt_state, loss = train_step(params, opt_state, batch, step_seed(run.mesh, run.args.seed, step))
        loss_value = float(loss)
    seconds, in_comm = time.perf_counter() - t0, timer.seconds - c0
    sent = sum(v["bytes"] for v in prof.transfers.values())
    t = int(opt_state["step"].to_numpy())  # (float16 skips a step whose gradients overflow)
    return params, opt_state, StepResult(loss_value, seconds, in_comm, sent, t, prof)


def jax_step(run: Run, jstep, step: int, offsets: np.ndarray) -> StepResult:
    """Training step `step` replayed by JAX (its state stays in JAX: `jstep.state()` brings it back)."""
    with mm.profile() as prof:  # (the host's peak memory)
        t0 = time.perf_counter()
        loss_value = jstep.step(lambda a, b, offsets=offsets: batch_windows(run.train, run.cfg, offsets[a:b]),
                                layers.subseed(run.args.seed, f"step{step}"))
    return StepResult(loss_value, time.perf_counter() - t0, None, 0, step + 1, prof)


def progress_line(run: Run, done: int, acc: np.ndarray, per_step: float) -> str:
    """The progress line after step `done`: `acc` sums seconds, seconds in collectives, bytes sent and
    losses over its `acc[4]` steps; `per_step`: the mean seconds per step, for the ETA."""
    s, c, b, lo, n = acc
    comm = "jax (XLA)" if run.jax else f"comm {100 * c / s:4.1f}%  {b / n / 2**20:.2f} MiB/step sent"
    eta = eta_text(per_step * (run.args.steps - done))
    return (f"step {done:5d}/{run.args.steps} {progress_bar(done / run.args.steps)} {eta}  loss {lo / n:.3f}  "
            f"{run.cfg.batch * run.cfg.length * n / s:7.0f} tok/s  step {1e3 * s / n:6.1f} ms  {comm}")


def save(run: Run, done: int, params: Params, opt_state: dict, data: dict, pending: Optional[tuple]) -> Optional[tuple]:
    """The checkpoint of step `done`, with the data stream's state `data`, once the save under way
    (`pending`) is done and reported: in the background, returning `(step, its SaveHandle)`; with
    --blocking-save, or --backend jax (every process holds all of it: the first writes it), here."""
    finish_save(run, pending)
    root, t0 = run.args.checkpoint, time.perf_counter()
    if run.jax:
        path = on_first_rank(lambda: save_checkpoint(root, done, params, opt_state, data))
    elif run.args.blocking_save:
        path = save_checkpoint(root, done, params, opt_state, data)
    else:
        return done, save_checkpoint(root, done, params, opt_state, data, blocking=False)
    report_save(run, done, path, time.perf_counter() - t0)
    return None


def finish_save(run: Run, pending: Optional[tuple]) -> None:
    """Wait for the background save `pending` (`(step, SaveHandle)` or None) and report it."""
    if pending is not None:
        done, handle = pending
        handle.wait()
        report_save(run, done, handle.path, handle.seconds, " (in the background)")


def report_save(run: Run, done: int, path: str, seconds: float, how: str = "") -> None:
    if run.first_rank:
        size = sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
        run.say(f"  checkpoint: step {done} saved to {path}, {size / 2**20:.2f} MiB in {seconds:.2f} s{how}",
                flush=True)


def train_loop(run: Run, start: Start, base: float) -> tuple:
    """Steps `start.step` to --steps, with progress lines, held-out evaluations, --log-json records and
    checkpoints: `(params, the final held-out loss, seconds of training up to its evaluation)`."""
    args, cfg = run.args, run.cfg
    step_fn, timer = build_step(run, start)
    params, opt_state = start.params, start.opt_state
    log = open(args.log_json, "w") if args.log_json and run.first_rank else None
    pending = None  # the background save under way: (its step, its SaveHandle)
    acc = np.zeros(5)  # seconds, seconds in collectives, bytes sent, loss, steps since the last line
    step_times: list = []  # with --layout auto, for the predicted time beside the measured one
    bubbles: list = []  # with --pipeline, this rank's measured bubble per step
    t_begin = t_first = time.perf_counter()  # t_first: the end of the first step (it records the step)
    for step in range(start.step, args.steps):
        offsets = start.batches.next()
        if run.jax:
            r = jax_step(run, step_fn, step, offsets)
        else:
            params, opt_state, r = mpi_step(run, step_fn, timer, step, offsets, params, opt_state)
            step_times.append(r.seconds)
            if run.predicted and len(step_times) == min(20, args.steps - start.step):
                run.say(predicted_beside_measured(run.predicted, step_times))
            if args.profile:
                run.say(f"step {step + 1} profile (rank 0):\n{r.prof.report()}")
        acc += [r.seconds, r.in_comm or 0, r.sent, r.loss, 1]
        done = step + 1
        record = {"step": done, "loss": r.loss, "tokens_per_s": cfg.batch * cfg.length / r.seconds,
                  "step_ms": 1e3 * r.seconds, "comm_share": None if r.in_comm is None else r.in_comm / r.seconds,
                  "lr": learning_rate(cfg, r.t), "peak_bytes": r.prof.peak_bytes}
        if run.pipe:
            bubbles.append(record.setdefault("bubble", pipelined.measured_share()))
        if done % args.log_every == 0 or done == args.steps:
            per_step = (time.perf_counter() - t_first) / (done - start.step - 1) if done > start.step + 1 else acc[0]
            run.say(progress_line(run, done, acc, per_step), flush=True)
            acc[:] = 0
        evaluating = done % args.eval_every == 0 or done == args.steps
        saving = args.checkpoint and (done % args.save_every == 0 or done == args.steps)
        if run.jax and (evaluating or saving):
            params, opt_state = step_fn.state()  # back to mpimesh tensors (from_numpy)
        if evaluating or saving:  # per layer (--pipeline: the stacked blocks unstacked)
            layer_params, layer_state = per_layer(run, params, opt_state)
        if evaluating:
            t_end = time.perf_counter()  # (the last evaluation is the final one, not training)
            held_loss = record["heldout_loss"] = evaluate(layer_params, run.mesh, run.held, cfg, args.eval_batches)
            if done != args.steps:
                run.say(f"  held-out loss {held_loss:.3f}  {held_loss / math.log(2):.3f} bits per byte "
                        f"(unigram baseline {base:.3f})", flush=True)
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()
        if saving:
            pending = save(run, done, layer_params, layer_state, start.batches.state(), pending)
        if done == start.step + 1:
            t_first = time.perf_counter()
    finish_save(run, pending)
    if log:
        log.close()
    if run.pipe:
        run.say(pipelined.bubble_line(run.pipe, run.mesh, bubbles))
    return layer_params, held_loss, t_end - t_begin


def per_layer(run: Run, params: Params, opt_state: dict) -> tuple:
    """`(params, opt_state)` with one tensor per layer, as checkpoints, evaluation and sampling take them."""
    if not run.pipe:
        return params, opt_state
    return (pipelined.from_stages(params, run.pipe, run.mesh, run.cfg),
            pipelined.state_to_stages(opt_state, run.pipe, run.mesh, run.cfg, back=True))


def print_summary(run: Run, start: Start, base: float, held_loss: float, train_time: float) -> None:
    """The final held-out loss against the unigram baseline, the training time, the last checkpoint."""
    bpb = held_loss / math.log(2)
    run.say(f"final held-out loss {held_loss:.3f} nats = {bpb:.3f} bits per byte, {abs(base - bpb):.3f} bits "
            f"{'below' if bpb <= base else 'above'} the unigram baseline {base:.3f}; training {train_time:.1f} s "
            f"({run.args.steps - start.step} steps)")
    if run.args.checkpoint:
        run.say(f"checkpoint: {checkpoint.step_path(run.args.checkpoint, run.args.steps)}")


MODEL_FIELDS = ("d_model", "heads", "d_kv", "d_ff", "layers", "vocab", "length", "activation", "moe_every", "experts",
                "dtype")  # config.json of --export: the model's sizes (not the training's)


def export_model(run: Run, params: Params) -> None:
    """--export DIR: the parameters as safetensors files (`mm.save(..., format="safetensors")`: each tensor
    under its name, e.g. `layer0/att/q/kernel`, its dims named in the files' metadata) and DIR/config.json
    (`model_type` and `MODEL_FIELDS`)."""
    path = os.path.abspath(run.args.export)
    if run.jax:
        on_first_rank(lambda: mm.save(path, params, format="safetensors"))
    else:
        mm.save(path, params, format="safetensors")
    if run.first_rank:
        config = {"model_type": "mpimesh-transformer", **{k: getattr(run.cfg, k) for k in MODEL_FIELDS},
                  "parameters_dtype": "float32"}
        with open(os.path.join(path, ".config.json.tmp"), "w") as f:
            f.write(json.dumps(config, indent=2) + "\n")
        os.replace(os.path.join(path, ".config.json.tmp"), os.path.join(path, "config.json"))
        files = sorted(os.listdir(path))
        size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
        run.say(f"exported the parameters to {path}: {', '.join(files)} ({size / 2**20:.2f} MiB)")


def print_samples(run: Run, params: Params) -> None:
    """--samples lines sampled after held-out prompts (the text before evenly spaced line starts)."""
    args, cfg, held = run.args, run.cfg, run.held
    if args.samples <= 0 or args.sample_bytes <= 0:
        return
    n = args.samples
    lines = np.flatnonzero(held[:-cfg.length - 1] == ord("\n"))
    picks = lines[np.linspace(0, len(lines) - 1, n + 2).astype(int)[1:-1]] + 1
    prompts = np.stack([held[p - cfg.length:p] if p >= cfg.length else held[:cfg.length] for p in picks])
    t0 = time.perf_counter()
    out = sample(params, run.mesh, cfg, prompts, args.sample_bytes, args.temperature, args.seed)
    run.say(f"samples (temperature {args.temperature}, {args.sample_bytes} bytes each after a held-out prompt, "
            f"{time.perf_counter() - t0:.1f} s):")
    for i in range(args.samples):
        prompt = bytes(prompts[i]).decode("utf-8", "replace").rstrip("\n").rsplit("\n", 1)[-1]
        text = bytes(out[i].astype(np.uint8)).decode("utf-8", "replace")
        run.say(f"--- sample {i + 1}, after the prompt line {prompt!r}:")
        run.say(text.rstrip())


if __name__ == "__main__":
    main_guard(main)()  # errors in bad input: one line per job
