"""Extrapolation to clusters: known training runs priced by the cost model, beside their published results.

    python benchmarks/simulate.py            # one process, no MPI ranks, no accelerator; needs JAX
    python benchmarks/simulate.py --quick --only gshard --remat on --fusion on

Each run's training step (apps/transformer.py's decoder: forward, `mm.gradients`, Adafactor) is
recorded dry (`mm.cost.record` on a `DryMesh`: shapes only, kernels under `jax.eval_shape`,
collectives counted) at its real sizes, mesh shape and layout, and priced by `mm.cost.estimate`
on a machine given by its published figures (`mm.cost.TPUV2`, `TPUV3`: per core), in up to four
variants (`--remat`, `--fusion`: off, on, both; default both):
- remat: every block (layer) under `mm.remat` (`Config(remat=layers)`), as jax.checkpoint, GShard
  and lingvo do: the forward pass keeps only each block's input x_l, the backward pass runs each
  block's forward again. Recorded as it runs, so for L blocks of forward time t_f (compute and its
  collectives: an MoE block's dispatch and combine alltoalls again) the step takes
  T_remat = T + L·t_f, and the activations at the peak are Σ_l |x_l| + one block's full activations
  (+ the gradients alive then) instead of all L blocks' activations.
- fusion: elementwise, normalisation and softmax ops priced as XLA fuses them (`kernels`): a region
  of linked fusible ops reads its inputs once and writes its outputs once, at HBM bandwidth, where
  unfused every op reads and writes all its tensors. Matmuls, gathers, scans and collectives stay
  kernels of their own. Fusion changes time, not memory.
Printed per run and variant: the predicted utilisation (executed FLOPs per core, recomputation
included, / step time / peak) or throughput, its error against the published figure, step time and
memory per core; for the variant the run used ("as ran"), which term of the model dominates. A deep
model can be recorded with fewer layers and scaled (`--quick`): the step is priced at `a` and `b`
layers, and per-layer cost (b - a) extrapolated to the real depth. The tables go to
benchmarks/results/simulate.md.

The runs (sizes from the papers and their public configs; what is assumed is said in the table):
  1. Mesh-TensorFlow (Shazeer et al. 2018), Table 2's largest language model: 6 layers, d_model
     1024, d_ff 262,144, 256 heads of d_k = d_v = 256 (4.9B parameters), vocabulary 32,768
     (lm1b's 32k subwords rounded up to a multiple of 128), batch 256 sequences of 256 tokens,
     bfloat16 activations, mesh batch:16 x model:32 on 512 TPUv2 cores; layout batch over the 16,
     heads/d_ff/vocab over the 32 (tensor2tensor's `mtf_transformer_paper_lm_5`). Published: 6 of
     11.5 PFLOP/s, "over 50%" of peak.
  2. GShard (Lepikhin et al. 2020) MoE Transformer, the talk's utilisation figures: 52% on
     TPUv3-128, 32% on TPUv3-2048, with E = cores experts (one per core) in every other layer of
     36, d_model 1024, expert hidden 8192, 16 heads of 64, top-2 gating, capacity 2 tokens per
     expert per group share, bfloat16 activations; per core 2 sequences (groups) of 1024 tokens
     (the paper's 4M-token batch on 2048 cores, weak scaling); experts and groups split over all
     cores, the dense weights replicated (data-parallel), as GShard does.
  3. The dense 2-D sharded Transformer (lingvo's `DenseLm*` configs of GShard/GSPMD: d_model 8192,
     128 heads of 128, gated-GELU FFN of 65,536 (here a plain FFN of 98,304: the same 3 x 8192 x
     65,536 weights per layer), vocabulary 32,000, length 1024, bfloat16 activations, float32
     parameters; 32/64/128 layers = 64B/128B/256B parameters): the largest batch whose predicted
     peak memory per core fits TPUv3's 16 GiB, on TPUv3-1024 (mesh 32 x 32) and TPUv3-2048
     (32 x 64), under two 2-D layouts, and the predicted throughput of lingvo's
     `DenseLm128B32x32` (batch 512 on 2048 cores; its config says ~62k tokens/s).
  4. Weight sharding (`--only weights`; no recording but a cross-check): lingvo's dense 64B/128B/
     256B (gated GELU of 65,536) on TPUv3-1024/2048 under Mesh-TF's 2-D layout, ZeRO-1/2/3 on top
     of it and GSPMD's 2-D weight sharding (weights split over both mesh dims, gathered before use,
     gradients reduce-scattered, activations fully sharded), which one rules string cannot say yet:
     memory per core by `pod_memory`'s formulas, term by term, the largest batch beside GShard's
     slides' (case study 2), and GSPMD's with the activations the cost model records for
     apps/transformer.py's block instead. Written to benchmarks/results/weight_sharding.txt.
  5. GSPMD's nested layout (`--only nested`) on lingvo's DenseLm128B32x32: a pipeline over X (32 stages of
     2 blocks, `mm.pipeline` with its gradient, GPipe, with and without remat; 32, 128 and 512
     microbatches) with heads, d_ff and vocabulary over Y inside each stage, the embedding and softmax
     data-parallel over X, priced by `mm.cost.pipeline_estimate`: step time and memory per core beside
     the unpipelined 2-D layouts.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "apps"))

import mpimesh as mm  # noqa: E402
import numpy as np  # noqa: E402
from mpimesh import cost  # noqa: E402
from mpimesh.cost.model import OpCost, collective_seconds, op_seconds  # noqa: E402
from mpimesh.dryrun import DryMesh, placeholder  # noqa: E402
from mpimesh.trace import Released, current_trace  # noqa: E402

import pod_memory as pm  # noqa: E402
import transformer as app  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
GIB = 2 ** 30



# ------------------------------------------------------------------------------ the step

def make_step(cfg: app.Config, opt, moe_capacity=None):
    """The training step to record: loss, `mm.gradients`, Adafactor (apps/transformer.py's;
    `cfg.remat`: each block under `mm.remat`)."""
    if moe_capacity is None:
        inner = app.make_train_step(cfg, opt)
        return lambda params, state, batch: inner(params, state, batch)[:2]

    def step(params, state, batch):
        names = list(params)
        loss = app.loss_fn(params, batch, cfg, moe_capacity=moe_capacity)
        grads = dict(zip(names, mm.gradients([loss], [params[n] for n in names])))
        return opt.update(params, grads, state)
    return step


def recorded(fn, args, mesh, rules) -> tuple:
    """`(recording, ops)`: `cost.record(fn, args, mesh, rules)` and the `OpRecord`s (inputs, outputs,
    params) of its ops, one per `recording.ops` entry, in order (`record` runs fn in its own trace)."""
    traces = []

    def seen(*a):
        traces.append(current_trace())
        return fn(*a)
    rec = cost.record(seen, args, mesh, rules)
    assert len(traces[0].ops) == len(rec.ops)
    return rec, traces[0].ops


def recording(cfg: app.Config, mesh_shape: str, rules: str, moe_capacity=None) -> tuple:
    """`recorded` for the step of `cfg` on `mesh_shape` under `rules`."""
    dry = DryMesh(mesh_shape, rules)
    opt = mm.optim.Adafactor()
    with mm.layout_scope(dry, rules):
        params = app.init_params(dry, cfg)
        state = opt.init(params)
        shape = f"batch:{cfg.batch};length:{cfg.length}"
        batch = {"inputs": placeholder(dry, shape, "int32"), "targets": placeholder(dry, shape, "int32")}
    return recorded(make_step(cfg, opt, moe_capacity), (params, state, batch), dry, rules)


def parameters(cfg: app.Config) -> int:
    """Parameter count of apps/transformer.py's model with `cfg`."""
    att = 4 * cfg.d_model * cfg.heads * cfg.d_kv
    ffn = 2 * cfg.d_model * cfg.d_ff
    moe = cfg.experts * 2 * cfg.d_model * cfg.d_ff + cfg.d_model * cfg.experts
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.layers))
    return (cfg.layers * (att + 4 * cfg.d_model) + (cfg.layers - n_moe) * ffn + n_moe * moe
            + 2 * cfg.vocab * cfg.d_model + cfg.length * cfg.d_model + 2 * cfg.d_model)


# ------------------------------------------------------------------------------ fusion

OWN_KERNEL = {"einsum", "gather", "cumsum", "psum"}  # matmuls, data-dependent reads, scans, collectives


def fusible(op) -> bool:
    """Whether XLA fuses `op` with its elementwise neighbours: any op but a matmul, a gather, a
    scan, or one that communicates (a collective ends a fusion; a relayout that only slices does not)."""
    if op.name in OWN_KERNEL or any(op.params.get(k) for k in ("reduce_mesh_dims", "mesh_dims", "mesh_dim")):
        return False
    return all(s[0] == "slice" for s in op.params.get("steps", ()))


def _nbytes(t) -> int:
    shape = t.local_shape if isinstance(t, Released) else t.local.shape
    return math.prod(shape) * np.dtype(t.dtype).itemsize


def kernels(rec, ops, fused: bool) -> list:
    """The step's kernels as `OpCost`s, each priced by `op_seconds` (roofline: max(FLOPs / peak,
    bytes / HBM bandwidth)). Unfused: one per op, bytes = all its inputs and outputs (the cost
    model's own). Fused, as XLA fuses: an op `fusible` rejects stays a kernel; the others form
    regions, the ops of a run of consecutive fusible ops (program order: no region feeds itself
    through another kernel) linked by a tensor one makes and another reads. A region R is one
    kernel: its FLOPs, and bytes = Σ inputs made outside R (each read once) + Σ outputs read
    outside R or by no op (each written once); what R makes and uses inside never goes to HBM."""
    if not fused:
        return list(rec.ops)
    readers: dict = {}
    for i, op in enumerate(ops):
        for t in op.inputs:
            readers.setdefault(id(t), set()).add(i)
    out, root, made_in_run = [], {}, {}

    def find(i):
        while root[i] != i:
            i = root[i]
        return i
    for i, op in enumerate(ops):
        if not fusible(op):
            out.append(rec.ops[i])
            made_in_run = {}
            continue
        root[i] = i
        for t in op.inputs:
            if id(t) in made_in_run:
                root[find(made_in_run[id(t)])] = i
        made_in_run.update((id(t), i) for t in op.outputs)
    regions: dict = {}
    for i in root:
        regions.setdefault(find(i), []).append(i)
    for members in regions.values():
        inside = set(members)
        made = {id(t) for i in members for t in ops[i].outputs}
        reads = {id(t): t for i in members for t in ops[i].inputs if id(t) not in made}
        writes = {id(t): t for i in members for t in ops[i].outputs
                  if not readers.get(id(t)) or readers[id(t)] - inside}
        out.append(OpCost("fusion", sum(rec.ops[i].flops for i in members),
                          sum(map(_nbytes, reads.values())) + sum(map(_nbytes, writes.values()))))
    return out


# ------------------------------------------------------------------------------ pricing

LINEAR = ("seconds", "compute_seconds", "comm_seconds", "flops", "comm_bytes", "state_bytes", "activation_bytes",
          "flop_bound", "memory_bound", "traffic", "alltoall", "allreduce", "other_comm")


def terms(rec, ops, e: dict, machine, fused: bool) -> dict:
    """`estimate`'s result `e` priced with `kernels(rec, ops, fused)`: `seconds` = compute +
    communication (none overlapped, as `estimate`), compute split into kernels bound by FLOPs
    (`flop_bound`) and by memory traffic (`memory_bound`), `traffic` (bytes to and from HBM), and
    communication by kind (`alltoall`, `allreduce`, `other_comm`)."""
    flop = mem = traffic = 0.0
    for k in kernels(rec, ops, fused):
        t = op_seconds(k, machine)
        traffic += k.nbytes
        if k.flops / machine.flops >= k.nbytes / machine.memory_bandwidth:
            flop += t
        else:
            mem += t
    comm = {"alltoall": 0.0, "allreduce": 0.0, "other_comm": 0.0}
    for key, c in e["collectives"].items():
        kind, _, dims = key.partition("/")
        if not dims:
            comm["other_comm"] += c["bytes"] / machine.memory_bandwidth
            continue
        dims = tuple(dims.split("+"))
        k = math.prod(rec.mesh_shape[d].size for d in dims)
        s = collective_seconds(kind, k, c["bytes"], machine, dims, c["calls"])
        comm[kind if kind in comm else "other_comm"] += s
    return dict(e, seconds=flop + mem + e["comm_seconds"], compute_seconds=flop + mem, flop_bound=flop,
                memory_bound=mem, traffic=traffic, **comm)


def priced(cfg: app.Config, mesh_shape: str, rules: str, machine, depth=None, moe_capacity=None) -> dict:
    """`{fused: terms}` for fused in (False, True): cfg's step (`cfg.remat` as it says) recorded at
    `depth = (a, b)` layers and scaled to `cfg.layers` (None: recorded at full depth): every part
    extrapolated linearly in depth."""
    t0 = time.perf_counter()

    def one(c):
        rec, ops = recording(c, mesh_shape, rules, moe_capacity)
        e = cost.estimate(rec, rules, mesh_shape, machine)
        return {f: terms(rec, ops, e, machine, f) for f in (False, True)}
    if depth is None:
        got = one(cfg)
        for e in got.values():
            e["recorded"] = f"{cfg.layers} layers"
    else:
        a, b = depth
        ea, eb = (one(_with(cfg, layers=n)) for n in (a, b))
        scale = (cfg.layers - a) / (b - a)
        got = {}
        for f in (False, True):
            e = got[f] = {k: ea[f][k] + scale * (eb[f][k] - ea[f][k]) for k in LINEAR}
            e["bytes_per_rank"] = e["state_bytes"] + e["activation_bytes"]
            e["collectives"] = eb[f]["collectives"]
            e["recorded"] = f"{a} and {b} layers, scaled to {cfg.layers}"
    for e in got.values():
        e["wall"] = time.perf_counter() - t0
    return got


def _with(cfg: app.Config, **kw) -> app.Config:
    d = dict(cfg.__dict__)
    d.update(kw)
    if isinstance(d["remat"], bool):  # remat on: every block
        d["remat"] = d["layers"] if d["remat"] else 0
    return app.Config(**d)


def dominant(e: dict) -> str:
    """Which term of the prediction dominates (FLOP-bound compute, memory traffic, communication)."""
    parts = {"compute": e["flop_bound"], "memory": e["memory_bound"], "communication": e["comm_seconds"]}
    name = max(parts, key=parts.get)
    return f"{name} ({100 * parts[name] / e['seconds']:.0f}%)"


def variants(cfg: app.Config, mesh_shape: str, rules: str, machine, remats, fuseds, depth=None,
             moe_capacity=None) -> dict:
    """`{(remat, fused): terms}` for remat in `remats`, fused in `fuseds`: one recording per remat."""
    out = {}
    for r in remats:
        got = priced(_with(cfg, remat=r), mesh_shape, rules, machine, depth, moe_capacity)
        out.update(((r, f), got[f]) for f in fuseds)
    return out


# ------------------------------------------------------------------------------ the runs

VARIANT_NAMES = {(False, False): "no remat, unfused", (False, True): "no remat, fused",
                 (True, False): "remat, unfused", (True, True): "remat, fused"}


def _cells(got: dict, text) -> dict:
    """`{variant name: text(terms)}` for each variant priced."""
    return {VARIANT_NAMES[v]: text(e) for v, e in got.items()}


def _pick(got: dict, as_ran: tuple) -> tuple:
    """The variant that ran (`as_ran`), else the priced one nearest it (remat first, then fusion)."""
    v = min(got, key=lambda v: (v[0] != as_ran[0], v[1] != as_ran[1]))
    return v, got[v]


def mtf_lm(quick: bool, remats, fuseds) -> list:
    cfg = app.Config(d_model=1024, heads=256, d_kv=256, d_ff=262144, layers=6, vocab=32768, length=256, batch=256,
                     dtype="bfloat16")
    rules = "batch:b;heads:m;d_ff:m;vocab:m"
    got = variants(cfg, "b:16;m:32", rules, cost.TPUV2, remats, fuseds, depth=(1, 2) if quick else None)
    peak = 512 * cost.TPUV2.flops
    published = 6e15 / 11.5e15

    def text(e):
        util = e["flops"] / e["seconds"] / cost.TPUV2.flops
        return (f"{util:.0%} ({util / published - 1:+.0%}); {util * peak / 1e15:.1f} PFLOP/s, "
                f"{e['seconds'] * 1e3:.0f} ms, {e['bytes_per_rank'] / GIB:.1f} GiB")
    v, e = _pick(got, (False, True))  # Mesh-TensorFlow: XLA-compiled, no recomputation
    return [{"run": "Mesh-TensorFlow LM, Table 2 (4.9B)", "machine": "TPUv2-512, mesh b:16 x m:32",
             "config": f"{parameters(cfg) / 1e9:.2f}B params, 6 layers, batch 256x256, bf16; layout {rules}",
             "published": f"{published:.0%} of peak (6 of 11.5 PFLOP/s)", "cells": _cells(got, text),
             "as_ran": VARIANT_NAMES[v], "why": _why(e), "e": e}]


def gshard_moe(quick: bool, remats, fuseds) -> list:
    rows = []
    for cores, published in ((128, 0.52), (2048, 0.32)):
        cfg = app.Config(d_model=1024, heads=16, d_kv=64, d_ff=8192, layers=36, vocab=32000, length=1024,
                         batch=2 * cores, dtype="bfloat16", moe_every=2, experts=cores)
        rules = "batch:all;experts:all"
        got = variants(cfg, f"all:{cores}", rules, cost.TPUV3, remats, fuseds, depth=(2, 4) if quick else None,
                       moe_capacity=(2.0, 1))

        def text(e):
            util = e["flops"] / e["seconds"] / cost.TPUV3.flops
            return (f"{util:.0%} ({util / published - 1:+.0%}); {e['seconds'] * 1e3:.0f} ms, "
                    f"{e['bytes_per_rank'] / GIB:.1f} GiB")
        v, e = _pick(got, (True, True))  # GShard: XLA-compiled, each layer rematerialised
        a2a = sum(c["bytes"] for k, c in e["collectives"].items() if k.startswith("alltoall"))
        rows.append({"run": f"GShard MoE, {cores} experts, 36 layers", "machine": f"TPUv3-{cores}, mesh all:{cores}",
                     "config": f"{parameters(cfg) / 1e9:.0f}B params, 2x1024 tokens/core, bf16; layout {rules}; "
                               f"alltoall {a2a / 2**20:.0f} MiB/core per step",
                     "published": f"{published:.0%} utilisation", "cells": _cells(got, text),
                     "as_ran": VARIANT_NAMES[v], "why": _why(e), "e": e})
    return rows


DENSE = dict(d_model=8192, heads=128, d_kv=128, d_ff=98304, vocab=32000, length=1024, dtype="bfloat16")
DENSE_LAYOUTS = ("batch:rows;heads:cols;d_ff:cols;vocab:cols", "d_model:rows;heads:cols;d_ff:cols;vocab:cols")


def largest_batch(mesh: str, rules: str, remat: bool, step: int) -> dict:
    """`{layers: (largest batch, fixed bytes, bytes per sequence)}` for 32, 64, 128 layers: predicted
    bytes per core are bilinear in batch and depth (every layer and every sequence alike), so 4
    recordings (1 and 2 layers, two batches) give every model size."""
    b1, b2 = 32, 64
    got = {(n, b): priced(app.Config(**DENSE, layers=n, batch=b, remat=n if remat else 0), mesh, rules, cost.TPUV3)[False]
           for n in (1, 2) for b in (b1, b2)}
    out = {}
    for n_layers in (32, 64, 128):
        at = {b: got[(1, b)]["bytes_per_rank"] + (n_layers - 1) * (got[(2, b)]["bytes_per_rank"]
                                                                  - got[(1, b)]["bytes_per_rank"]) for b in (b1, b2)}
        per_seq = (at[b2] - at[b1]) / (b2 - b1)
        fixed = at[b1] - per_seq * b1
        if per_seq > 0:
            fit = max(0, int((cost.TPUV3.memory - fixed) // per_seq) // step * step)
        else:  # the peak is batch-independent (the optimizer update's, after activations are freed)
            fit = math.inf if fixed <= cost.TPUV3.memory else 0
        out[n_layers] = (fit, fixed, per_seq)
    return out


def dense_2d(quick: bool, remats, fuseds) -> list:
    """Largest batch per core count, layout, depth and remat (fusion changes no memory), and
    lingvo's DenseLm128B32x32's throughput."""
    rows = []
    known = {(128, 2048): 512}  # lingvo DenseLm128B32x32, 2-D weight sharding
    for cores, mesh in ((1024, "rows:32;cols:32"), (2048, "rows:32;cols:64")):
        for rules in DENSE_LAYOUTS:
            step = 32 if rules.startswith("batch") else 1  # batch split over rows: multiples of 32
            fits = {r: largest_batch(mesh, rules, r, step) for r in remats}
            for billions, n_layers in ((64, 32), (128, 64), (256, 128)):
                pub = known.get((billions, cores))

                def text(r):
                    fit, fixed, per_seq = fits[r][n_layers]
                    err = f" ({fit / pub - 1:+.0%})" if pub else ""
                    return (f"{fit or 'none'}{err} ({fixed / GIB:.1f} GiB fixed + {per_seq / 2**20:.0f} MiB per "
                            f"sequence)")
                cfg = app.Config(**DENSE, layers=n_layers, batch=1)
                rows.append({"run": f"dense {billions}B ({n_layers} layers): largest batch",
                             "machine": f"TPUv3-{cores}, mesh {mesh.replace('rows:', '').replace(';cols:', ' x ')}",
                             "config": f"{parameters(cfg) / 1e9:.0f}B params, length 1024, bf16; layout {rules}"
                                       f"{'; batch in multiples of 32' if step > 1 else ''}",
                             "published": f"{pub} (lingvo DenseLm128B32x32)" if pub else "not retrieved",
                             "cells": {("remat" if r else "no remat"): text(r) for r in remats}})
    # lingvo's DenseLm128B32x32: batch 512 of 1024 tokens on 2048 cores, "Expect ~62k tokens/sec"
    cfg = app.Config(**DENSE, layers=64, batch=512)
    for rules in DENSE_LAYOUTS:
        got = variants(cfg, "rows:32;cols:64", rules, cost.TPUV3, remats, fuseds, depth=(1, 2))

        def text(e):
            tps = 512 * 1024 / e["seconds"]
            return (f"{tps / 1e3:.0f}k tokens/s ({tps / 62e3 - 1:+.0%}); {e['seconds']:.2f} s, "
                    f"{e['bytes_per_rank'] / GIB:.0f} GiB")
        v, e = _pick(got, (True, True))
        rows.append({"run": "dense 128B (64 layers), lingvo DenseLm128B32x32", "machine": "TPUv3-2048, mesh 32 x 64",
                     "config": f"{parameters(cfg) / 1e9:.0f}B params, batch 512x1024, bf16; layout {rules}",
                     "published": "~62k tokens/s (config comment)", "cells": _cells(got, text),
                     "as_ran": VARIANT_NAMES[v], "why": _why(e), "e": e})
    return rows


# ------------------------------------------------------------------------------ GSPMD's nested layout

NESTED_STAGE = "heads:cols;d_ff:cols;vocab:cols"  # operators over Y inside a stage
NESTED_AROUND = "batch:rows;heads:cols;d_ff:cols;vocab:cols"  # embedding and softmax: data-parallel over X


def nested_stage(cfg: app.Config, per_stage: int, stages: int) -> tuple:
    """`(stage_fn, stage_params)`: `per_stage` of cfg's blocks (apps/transformer.py's `block`) as one pipeline
    stage, their parameters as `ArgSpec`s stacked over `stages` (a leading dim `stage`)."""
    one = app.init_params(DryMesh("all:1"), _with(cfg, layers=per_stage, remat=False))
    specs = {k: cost.ArgSpec(mm.Shape([mm.Dimension("stage", stages)] + list(t.shape)), t.dtype)
             for k, t in one.items() if k.startswith("layer")}

    def stage_fn(p, h):
        tree = app.layers.unflatten(p)
        for i in range(per_stage):
            h, _ = app.block(tree[f"layer{i}"], h, cfg, i, True, 0, {})
        return h
    return stage_fn, specs


def nested_around(cfg: app.Config, mesh_shape: str, rules: str, machine) -> dict:
    """`estimate` of what runs around the pipeline, on the whole mesh under `rules`: the embedding and
    position, the final norm, logits and loss, forward and backward (the pipeline's output h and the dx it
    returns are arguments), and Adafactor's update of their parameters."""
    dry = DryMesh(mesh_shape, rules)
    opt = mm.optim.Adafactor()
    with mm.layout_scope(dry, rules):
        params = app.init_params(dry, _with(cfg, layers=0, remat=False))
        state = opt.init(params)
        shape = f"batch:{cfg.batch};length:{cfg.length}"
        batch = {"inputs": placeholder(dry, shape, "int32"), "targets": placeholder(dry, shape, "int32")}
        h, dx = (placeholder(dry, f"{shape};d_model:{cfg.d_model}", cfg.dtype) for _ in range(2))

    def step(params, state, batch, h, dx):
        names = list(params)
        with mm.trace():
            p = app.layers.unflatten(params)
            x = app.layers.embedding(p["embed"], batch["inputs"], cfg.dtype) + mm.cast(p["pos"]["weights"], cfg.dtype)
            logits = app.layers.dense(p["logits"], app.layers.layer_norm(p["ln_f"], h, "d_model"))
            loss = mm.reduce_mean(app.layers.softmax_cross_entropy_with_logits(logits, batch["targets"], "vocab"))
            grads = mm.gradients([loss, x], [params[n] for n in names] + [h],
                                 [loss.mesh.ones(loss.shape, loss.dtype), dx])
            return opt.update(params, dict(zip(names, grads)), state)
    return cost.estimate(cost.record(step, (params, state, batch, h, dx), dry, rules), rules, mesh_shape, machine)


def nested_update(specs: dict, stage_mesh: str, rules: str, machine) -> tuple:
    """`(estimate, optimizer state bytes)` of Adafactor's update of one stage's parameters on the stage mesh."""
    dry = DryMesh(stage_mesh, rules)
    opt = mm.optim.Adafactor()
    with mm.layout_scope(dry, rules):
        params = {k: placeholder(dry, mm.Shape([d for d in a.shape if d.name != "stage"]), a.dtype)
                  for k, a in specs.items()}
        grads = {k: placeholder(dry, t.shape, t.dtype) for k, t in params.items()}
        state = opt.init(params)
    rec = cost.record(lambda p, g, st: opt.update(p, g, st), (params, grads, state), dry, rules)
    held = sum(math.prod(t.local.shape) * np.dtype(t.dtype).itemsize for t in mm.tree.tensors(state))
    return cost.estimate(rec, rules, stage_mesh, machine), held


def gspmd_nested(quick: bool, remats, fuseds) -> list:
    """GSPMD's nested layout on lingvo's DenseLm128B32x32 (64 layers, batch 512, TPUv3-2048 as 32 x 64): a
    pipeline over X (32 stages of 2 blocks, `mm.pipeline` and its gradient: GPipe, with and without remat)
    with operators over Y inside each stage, the embedding and softmax data-parallel over X; per microbatch
    count, beside the unpipelined 2-D layouts (unfused, as `pipeline_estimate` prices)."""
    cfg = app.Config(**DENSE, layers=64, batch=512)
    rows, cols, machine = 32, 64, cost.TPUV3
    mesh, stage_mesh = f"rows:{rows};cols:{cols}", f"rows:1;cols:{cols}"
    stage_fn, specs = nested_stage(cfg, cfg.layers // rows, rows)
    x = cost.ArgSpec(f"batch:{cfg.batch};length:{cfg.length};d_model:{cfg.d_model}", cfg.dtype)
    around = nested_around(cfg, mesh, NESTED_AROUND, machine)
    update, opt_state = nested_update(specs, stage_mesh, NESTED_STAGE, machine)
    rows_out = []
    for rules in DENSE_LAYOUTS:
        got = variants(cfg, mesh, rules, machine, remats, (False,), depth=(1, 2))
        for (r, _), e in got.items():
            rows_out.append(_nested_row(f"unpipelined, {rules}", r, "-", "-", e["seconds"], e["bytes_per_rank"],
                                        e["comm_seconds"]))
    for remat in remats:
        for m in (32, 128, 512):
            t0 = time.perf_counter()
            e = cost.pipeline_estimate(stage_fn, specs, x, mesh, "rows", m, machine,
                                       rules=f"{NESTED_AROUND};stage:rows", remat=remat)
            seconds = e["seconds"] + around["seconds"] + update["seconds"]
            nbytes = e["bytes_per_rank"] + opt_state + update["activation_bytes"] + around["bytes_per_rank"]
            comm = e["comm_seconds"] + around["comm_seconds"] + update["comm_seconds"]
            rows_out.append(_nested_row("GSPMD nested: pipeline over rows (GPipe), heads/d_ff/vocab over cols; "
                                        "embedding and softmax batch:rows", remat, m, f"{e['bubble']:.1%}", seconds,
                                        nbytes, comm, e))
            print(f"  nested, remat {remat}, {m} microbatches: {seconds:.2f} s, {nbytes / GIB:.1f} GiB "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows_out


def _nested_row(layout: str, remat: bool, m, bubble_text: str, seconds: float, nbytes: float, comm: float,
                e: Optional[dict] = None) -> dict:
    parts = "" if e is None else (f"; stage memory: activations {e['stages'][0]['activation_bytes'] / GIB:.1f} GiB, "
                                  f"inputs and outputs {e['stages'][0]['memory']['inputs_outputs'] / GIB:.1f} GiB, "
                                  f"bubble {e['bubble_seconds']:.2f} s")
    return {"layout": layout, "remat": "remat" if remat else "no remat", "microbatches": m, "bubble": bubble_text,
            "cells": f"{seconds:.2f} s, {512 * 1024 / seconds / 1e3:.0f}k tokens/s, {nbytes / GIB:.1f} GiB/core"
                     f"{' (fits)' if nbytes <= cost.TPUV3.memory else ''}; communication {comm:.2f} s{parts}"}


# ------------------------------------------------------------------------------ weight sharding at pod scale

SLIDES = {(64, 1024): 512, (64, 2048): 1024, (128, 1024): 256, (128, 2048): 512, (256, 1024): 128, (256, 2048): 256}
"""GShard's slides, case study 2 (dense Transformer, bfloat16 activations, no rematerialisation):
the largest batch per (billions of parameters, TPUv3 cores), as quoted in mpimesh's issue 42."""
POD_MESHES = {1024: (32, 32), 2048: (32, 64)}  # cores: (X rows, data-parallel; Y columns, model)
MIB = 2 ** 20


def recorded_activations(cols: int, full: bool) -> tuple:
    """`(per layer, outside the layers)`: activation bytes per sequence on a core as mpimesh's cost
    model records apps/transformer.py's step (no remat) at `DENSE`'s sizes: dry, on a mesh whose
    every core holds all sequences, each activation split over `cols` (heads, d_ff, vocabulary on
    one mesh dim; `full`: d_model on a second one of `cols` too): the recorded peak's slope per
    sequence (32 to 64 sequences) at 1 and 2 layers."""
    mesh = f"a:{cols};b:{cols}" if full else f"b:{cols}"
    rules = ("d_model:a;" if full else "") + "heads:b;d_ff:b;vocab:b"
    peak = {(n, b): recording(app.Config(**DENSE, layers=n, batch=b), mesh, rules)[0].activation_bytes
            for n in (1, 2) for b in (32, 64)}
    slope = {n: (peak[(n, 64)] - peak[(n, 32)]) / 32 for n in (1, 2)}
    return slope[2] - slope[1], 2 * slope[1] - slope[2]


def weight_seconds(cfg: pm.DenseLM, layout: pm.Layout, rows: int, cols: int) -> float:
    """The weights' collectives over the rows per step (`pm.weight_collectives`), priced by the
    cost model on TPUv3, one call per parameter tensor and kind."""
    return sum(collective_seconds(kind, rows, nbytes, cost.TPUV3, ("rows",), cfg.tensors())
               for kind, nbytes in pm.weight_collectives(cfg, layout, rows, cols).items())


def weight_sharding() -> list:
    """The lines of the `weights` run: per dense model (64B/128B/256B) and TPUv3 pod (1024/2048
    cores), the largest batch in 16 GiB per core under each of `pm.LAYOUTS` beside the slides'
    (GSPMD's layout), and the memory terms at the slides' batch."""
    budget = cost.TPUV3.memory
    recorded = {cols: recorded_activations(cols, True) for cols in sorted({y for _, y in POD_MESHES.values()})}
    recorded_mtf = recorded_activations(32, False)
    formula = [pm.activations_per_sequence(pm.DenseLM(), 32, full)[0] for full in (True, False)]
    names = [lay.name for lay in pm.LAYOUTS]
    out = ["# Weight sharding at pod scale: largest batch in 16 GiB per TPUv3 core (benchmarks/simulate.py "
           "--only weights)", "",
           "Dense LM of lingvo's DenseLmTemplate: d_model 8192, gated-GELU d_ff 65536, 128 heads of 128, vocabulary",
           "32,000, length 1024; float32 parameters, bfloat16 activations, Adafactor (factored, no momentum), "
           "no remat.",
           "Cores as a mesh of X rows (batch) x Y columns (model): 1024 = 32 x 32, 2048 = 32 x 64. Each cell: the",
           "largest batch (a multiple of X) and its ratio to the slides' (for GSPMD's layout). GSPMD pow2: the largest",
           "power of two at most GSPMD's. GSPMD recorded: GSPMD's with the activations mpimesh's cost model records",
           "for apps/transformer.py's block (plain FFN of 98,304: the same weights per layer) instead of the formula.",
           "", f"{'model':<14}{'cores':>6}{'slides':>7} |" + "".join(f"{n:>17}" for n in names)
           + f"{'GSPMD pow2':>14}{'GSPMD recorded':>16}"]
    terms = []
    for billions, layers in ((64, 32), (128, 64), (256, 128)):
        cfg = pm.DenseLM(layers=layers)
        for cores, (rows, cols) in POD_MESHES.items():
            slides = SLIDES[(billions, cores)]
            fits = [pm.max_batch(cfg, lay, rows, cols, budget) for lay in pm.LAYOUTS]
            gspmd = fits[-1]
            pow2 = 2 ** int(math.log2(gspmd)) if gspmd else 0
            rec = pm.max_batch(cfg, pm.LAYOUTS[-1], rows, cols, budget, acts=recorded[cols])
            cells = [f"{b} ({b / slides:.2f}x)" for b in fits + [pow2, rec]]
            out.append(f"{f'{billions}B ({layers} L)':<14}{cores:>6}{slides:>7} |"
                       + "".join(f"{c:>17}" for c in cells[:-2]) + f"{cells[-2]:>14}{cells[-1]:>16}")
            allreduce = weight_seconds(cfg, pm.LAYOUTS[0], rows, cols)
            for lay in pm.LAYOUTS:
                got = pm.memory(cfg, lay, rows, cols, slides)
                total = sum(got.values())
                secs = weight_seconds(cfg, lay, rows, cols)
                terms.append(f"{f'{billions}B':<6}{cores:>6}  {lay.name:<17}"
                             + "".join(f"{got[t] / GIB:>12.2f}" for t in pm.TERMS)
                             + f"{total / GIB:>8.2f}{total / budget:>7.2f}{secs:>9.2f}{secs / allreduce:>7.2f}")
    out += ["", "Memory per core at the slides' batch (GiB), its total over 16 GiB, and the weights' collectives "
            "over X",
            "per step (seconds on TPUv3's links as the cost model prices them; x Mesh-TF's gradient allreduce):", "",
            f"{'model':<6}{'cores':>6}  {'layout':<17}" + "".join(f"{t:>12}" for t in pm.TERMS)
            + f"{'total':>8}{'/16GiB':>7}{'comm s':>9}{'x MTF':>7}"] + terms
    adam = [pm.memory(pm.DenseLM(), lay, 32, 32, 0, optimizer="adam")["optimizer"] / GIB for lay in pm.LAYOUTS[:2]]
    out += ["", "Activations per sequence and layer on a core, Y = 32: formula (lingvo's block) "
            f"{formula[0] / MIB:.2f} MiB fully sharded, {formula[1] / MIB:.2f} MiB with d_model unsplit (Mesh-TF);",
            f"recorded by mpimesh's cost model (apps/transformer.py's block) {recorded[32][0] / MIB:.2f} MiB and "
            f"{recorded_mtf[0] / MIB:.2f} MiB; outside the layers, per sequence: formula "
            f"{pm.activations_per_sequence(pm.DenseLM(), 32, True)[1] / MIB:.2f} MiB, recorded "
            f"{recorded[32][1] / MIB:.2f} MiB (fully sharded).",
            f"With Adam's two float32 moments instead of Adafactor, 64B on 1024 cores: optimizer state "
            f"{adam[0]:.2f} GiB per core (Mesh-TF 2-D), {adam[1]:.2f} GiB (ZeRO-1).", "", WEIGHT_NOTES]
    return out


WEIGHT_NOTES = """Sources and assumptions (docs/cost_model.md, "Weight sharding at pod scale"):
- The slides' figures: GShard's slides, case study 2, as quoted in mpimesh's issue 42.
- Sizes: lingvo's tasks/lm/params/synthetic_packed_input.py (DenseLmTemplate; DenseLm128B8x8's
  "Total params: 137,702,416,384" for 64 layers equals pod_memory's count). 32/64/128 layers of
  2^31 parameters each: 64B/128B/256B. Layouts: lingvo's core/gshard_builder.py DenseBuilder
  (weights split over both mesh dims; activations [batch over X, length, d_model over Y]). The
  GShard (arXiv 2006.16668) and GSPMD (arXiv 2105.04663) papers' own tables were not read here.
- Memory: benchmarks/pod_memory.py's terms, summed (a bound); gathered weights: the layer computed
  and the one prefetched, gathered again for the backward ("kept": every layer's kept instead);
  parameters and optimizer state updated in place (XLA's variables)."""


def _why(e: dict) -> str:
    return (f"{dominant(e)}: FLOP-bound {e['flop_bound'] * 1e3:.0f} ms, memory-bound {e['memory_bound'] * 1e3:.0f} ms "
            f"({e['traffic'] / GIB:.0f} GiB HBM traffic), communication {e['comm_seconds'] * 1e3:.0f} ms (allreduce "
            f"{e['allreduce'] * 1e3:.0f}, alltoall {e['alltoall'] * 1e3:.0f}, other {e['other_comm'] * 1e3:.0f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="record fewer layers and scale (faster)")
    ap.add_argument("--only", choices=["mtf", "gshard", "dense", "nested", "weights"], action="append",
                    help="run only these")
    ap.add_argument("--remat", choices=["off", "on", "both"], default="both",
                    help="price the step without and/or with each block rematerialised (default both)")
    ap.add_argument("--fusion", choices=["off", "on", "both"], default="both",
                    help="price elementwise ops one by one and/or fused as XLA does (default both)")
    args = ap.parse_args()
    choice = {"off": (False,), "on": (True,), "both": (False, True)}
    runs = {"mtf": mtf_lm, "gshard": gshard_moe, "dense": dense_2d, "nested": gspmd_nested}
    rows = []
    for key, fn in runs.items():
        if args.only and key not in args.only:
            continue
        t0 = time.perf_counter()
        got = fn(args.quick, choice[args.remat], choice[args.fusion])
        for r in got:
            if "layout" in r:  # a row of the nested layout's table
                print(f"{r['layout']}, {r['remat']}, microbatches {r['microbatches']}: {r['cells']}", flush=True)
                continue
            cells = "; ".join(f"{k}: {v}" for k, v in r["cells"].items())
            print(f"{r['run']} on {r['machine']}: published {r['published']}; {cells}"
                  + (f"; as ran ({r['as_ran']}): {r['why']} [recorded {r['e']['recorded']}]" if "e" in r else ""),
                  flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        rows += got
    if rows:
        write_table(rows)
    if not args.only or "weights" in args.only:
        lines = weight_sharding()
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, "weight_sharding.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))


def write_table(rows: list) -> None:
    lines = ["# Cost model vs published runs (benchmarks/simulate.py)", "",
             "Machines: " + "; ".join(f"`{m.name}`: {m.flops / 1e12:.1f} TFLOP/s, α {m.latency * 1e6:.0f} µs, "
                                      f"β {m.bandwidth / 1e9:.0f} GB/s, {m.memory / GIB:.0f} GiB, HBM "
                                      f"{m.memory_bandwidth / 1e9:.0f} GB/s per core" for m in (cost.TPUV2, cost.TPUV3)),
             "", "Each cell: the prediction (its error against the published figure); step time; memory per core.", ""]
    for title, group in (("Speed", [r for r in rows if "e" in r]), ("Largest batch in 16 GiB per core",
                                                                       [r for r in rows if "cells" in r and "e" not in r
                                                                        and "layout" not in r])):
        if not group:
            continue
        names = list(group[0]["cells"])
        extra = ["as ran", "dominant term (as ran)"] if title == "Speed" else []
        lines += [f"## {title}", "", "| " + " | ".join(["run", "machine", "configuration", "published"] + names + extra)
                  + " |", "|" + "---|" * (4 + len(names) + len(extra))]
        for r in group:
            lines.append("| " + " | ".join([r["run"], r["machine"], r["config"], r["published"]]
                                           + [r["cells"][n] for n in names]
                                           + ([r["as_ran"], r["why"]] if extra else [])) + " |")
        lines.append("")
    nested = [r for r in rows if "layout" in r]
    if nested:
        lines += ["## GSPMD's nested layout: pipeline over X, operators over Y (dense 128B, TPUv3-2048, 32 x 64, "
                  "batch 512)", "", "| layout | remat | microbatches | bubble | predicted (unfused) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['layout']} | {r['remat']} | {r['microbatches']} | {r['bubble']} | {r['cells']} |"
                  for r in nested]
        lines += ["", NESTED_NOTES]
    lines += [NOTES]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "simulate.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


NESTED_NOTES = """The nested layout (`gspmd_nested`; GSPMD's example: X pipelines the blocks and splits the batch of
the embedding and softmax, Y splits heads, d_ff and vocabulary): 64 blocks as 32 stages of 2 on the rows,
priced by `mm.cost.pipeline_estimate` as `mm.pipeline` and its gradient run them (GPipe; remat: each stage
keeps its microbatches' inputs only), plus the embedding, final norm and softmax on the whole mesh
(`batch:rows`) and Adafactor's updates, none overlapped. Unfused only: the pipeline's prices are
`estimate`'s. The unpipelined rows are the Speed table's layouts at the same batch, unfused. What
dominates the pipelined memory: mpimesh's pipeline takes x replicated along the pipeline dim (an
allgather of the batch over rows), cuts and joins it on the end stages, and broadcasts y and dx along it,
so each rank holds several copies of the whole batch's [512, 1024, 8192] bfloat16 activations (8 GiB
each), where GSPMD's pipeline keeps one microbatch per stage in a shifting buffer. Without remat each
microbatch's run also keeps its own bfloat16 cast of the stage's float32 weights (128 MiB per core), so the
held activations grow with the microbatch count. Every stage run allreduces its activations over Y, as
the unpipelined 2-D layout does for the whole batch; a transfer between stages is 16 MiB per sequence
of the microbatch (each core sends the whole [b, 1024, 8192] block: d_model is not split)."""

NOTES = """Notes and assumptions:
- Utilisation is the FLOPs the recorded step executes per core (every einsum, MoE dispatch and
  combine, and with remat the recomputed forward, included) over predicted step time and peak,
  as hardware utilisation counts them; the papers' own FLOP counts may differ.
- As ran: Mesh-TensorFlow (2018) compiled with XLA (fused), no recomputation; GShard and lingvo's
  dense LMs compiled with XLA and rematerialise every layer (remat, fused).
- Fusion (`kernels`) is XLA's loop fusion within runs of consecutive elementwise ops in program
  order; matmuls keep their own traffic (no fusion of a cast or bias into a matmul's operands or
  result), and attention's [batch, heads, length, length] scores and probabilities go to HBM
  (no flash attention in 2018-2020).
- Mesh-TensorFlow: layer count (6), vocabulary (lm1b 32k, padded to 32,768), length 256 and bfloat16
  activations from tensor2tensor's `mtf_transformer_paper_lm(5)` (4.90B parameters there, as here).
  Adafactor, as in the paper. Compute dominates, and every FLOP-bound einsum is priced at the
  MXU's peak: the prediction is above the published figure by what the MXUs lose to shapes and
  padding, which the model does not price.
- GShard: the talk's 52% / 32% are taken as given; the model is a decoder-only stack of the paper's
  36 layers (the paper's is encoder-decoder), group = a sequence of 1024 tokens, 2 groups per core,
  expert capacity 2·S/E per group (GShard's), dense weights replicated. The 600B model's sizes
  (2048 experts of 1024 x 8192) give 2048 · 18 · 16.8M = 620B expert weights, matching the paper.
  At 128 cores remat adds one forward pass of the blocks (about a third of the compute, with
  their dispatch and combine alltoalls) to time and FLOPs alike, and fusion removes the
  elementwise traffic between kernels. From 128 to 2048 cores the published utilisation falls
  52% -> 32%, the prediction far less: the α-β model prices an alltoall at (k-1)/k · bytes / β,
  flat in the core count, where on TPUv3-2048's 32 x 32-chip torus the bisection bounds it near
  k_side / 8 · bytes / β = 4 · bytes / β (about bytes / β on 128 cores), and prices an allreduce's
  latency as α per call, not per ring step (a ring over 2048 cores takes 2 · 2047 steps).
- Dense 2-D: sizes of lingvo's `DenseLmTemplate` (GSPMD); mpimesh's rules map each tensor dim to one
  mesh dim and a tensor may not use a mesh dim twice, so GShard's weight sharding over both mesh
  dims *with* the batch split (activations [batch(x), length, model(y)], weights [model(x),
  hidden(y)]) is not expressible in one rules string (its memory: the `weights` run,
  weight_sharding.txt, by formulas); the two layouts priced are Mesh-TensorFlow's 2-D (batch on
  rows, model dims on cols: weights replicated over rows) and a fully model-parallel 2-D (d_model on
  rows, heads/d_ff/vocab on cols: no data parallelism). The slides' largest batches are for GSPMD's
  layout: compared in weight_sharding.txt; the memory model here counts parameters, optimizer state
  and the peak of live op outputs (no kernel temporaries), float32 parameters and gradients, no
  in-place update. Why lingvo's batch 512 still does not fit with remat: under Mesh-TensorFlow's 2-D
  layout the weights are replicated over the 32 batch rows, and the optimizer update's peak
  (parameters, float32 gradients and the updated parameters at once) exceeds 16 GiB at any batch,
  remat or not (it frees activations only); under the fully model-parallel layout remat cuts the
  bytes per sequence to the stored block inputs plus one block, but every core holds all sequences'
  activations (split by d_model or heads/d_ff only, never by batch), so far fewer than 512 fit.
  GSPMD's layout splits the batch over one mesh dim and the weights over both: not expressible here
  (above).
- Depth scaling (`--quick`, the dense runs): recorded at a and b layers and extrapolated linearly in
  the layer count.
"""


if __name__ == "__main__":
    main()
