"""Extrapolation to clusters: known training runs priced by the cost model, beside their published results.

    python benchmarks/simulate.py            # one process, no MPI ranks, no accelerator; needs JAX

Each run's training step (apps/transformer.py's decoder: forward, `mm.gradients`, Adafactor) is
recorded dry (`mm.cost.record` on a `DryMesh`: shapes only, kernels under `jax.eval_shape`,
collectives counted) at its real sizes, mesh shape and layout, and priced by `mm.cost.estimate`
on a machine given by its published figures (`mm.cost.TPUV2`, `TPUV3`: per core). Printed per
run: the predicted step time, its compute and communication parts, the predicted utilisation
(executed FLOPs per core / step time / peak), the published figure, the relative error and which
term of the model dominates. A deep model is recorded with fewer layers and scaled: the step is
priced at `a` and `b` layers, and per-layer cost (b - a) extrapolated to the real depth (linear:
every layer is the same program). The table goes to benchmarks/results/simulate.md.

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
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "apps"))

import mpimesh as mm  # noqa: E402
from mpimesh import cost  # noqa: E402
from mpimesh.cost.model import collective_seconds, op_seconds  # noqa: E402
from mpimesh.dryrun import DryMesh, placeholder  # noqa: E402

import transformer as app  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
GIB = 2 ** 30



# ------------------------------------------------------------------------------ the step

def make_step(cfg: app.Config, opt, moe_capacity=None):
    """The training step to record: loss, `mm.gradients`, Adafactor (apps/transformer.py's)."""
    if moe_capacity is None:
        inner = app.make_train_step(cfg, opt)
        return lambda params, state, batch: inner(params, state, batch)[:2]

    def step(params, state, batch):
        names = list(params)
        loss = app.loss_fn(params, batch, cfg, moe_capacity=moe_capacity)
        grads = dict(zip(names, mm.gradients([loss], [params[n] for n in names])))
        return opt.update(params, grads, state)
    return step


def recording(cfg: app.Config, mesh_shape: str, rules: str, moe_capacity=None):
    """The step of `cfg` recorded dry on `mesh_shape` under `rules`."""
    dry = DryMesh(mesh_shape, rules)
    opt = mm.optim.Adafactor()
    with mm.layout_scope(dry, rules):
        params = app.init_params(dry, cfg)
        state = opt.init(params)
        shape = f"batch:{cfg.batch};length:{cfg.length}"
        batch = {"inputs": placeholder(dry, shape, "int32"), "targets": placeholder(dry, shape, "int32")}
    return cost.record(make_step(cfg, opt, moe_capacity), (params, state, batch), dry, rules)


def parameters(cfg: app.Config) -> int:
    """Parameter count of apps/transformer.py's model with `cfg`."""
    att = 4 * cfg.d_model * cfg.heads * cfg.d_kv
    ffn = 2 * cfg.d_model * cfg.d_ff
    moe = cfg.experts * 2 * cfg.d_model * cfg.d_ff + cfg.d_model * cfg.experts
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.layers))
    return (cfg.layers * (att + 4 * cfg.d_model) + (cfg.layers - n_moe) * ffn + n_moe * moe
            + 2 * cfg.vocab * cfg.d_model + cfg.length * cfg.d_model + 2 * cfg.d_model)


LINEAR = ("seconds", "compute_seconds", "comm_seconds", "flops", "comm_bytes", "state_bytes", "activation_bytes",
          "flop_bound", "memory_bound", "alltoall", "allreduce", "other_comm")


def terms(rec, e: dict, machine) -> dict:
    """`estimate`'s result with its parts split: seconds of ops bound by FLOPs (`flop_bound`) and
    by memory traffic (`memory_bound`, the roofline's other side, fixed costs included), and
    communication by kind (`alltoall`, `allreduce`, `other_comm`)."""
    flop = mem = 0.0
    for op in rec.ops:
        t = op_seconds(op, machine)
        if op.flops / machine.flops >= op.nbytes / machine.memory_bandwidth:
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
    return dict(e, flop_bound=flop, memory_bound=mem, **comm)


def priced(cfg: app.Config, mesh_shape: str, rules: str, machine, depth=None, moe_capacity=None) -> dict:
    """`estimate` of cfg's step (with `terms`), recorded at `depth = (a, b)` layers and scaled
    to `cfg.layers` (None: recorded at full depth): every part extrapolated linearly in depth."""
    t0 = time.perf_counter()

    def one(c):
        rec = recording(c, mesh_shape, rules, moe_capacity)
        return terms(rec, cost.estimate(rec, rules, mesh_shape, machine), machine)
    if depth is None:
        e = one(cfg)
        e["recorded"] = f"{cfg.layers} layers"
    else:
        a, b = depth
        ea, eb = (one(_with(cfg, layers=n)) for n in (a, b))
        scale = (cfg.layers - a) / (b - a)
        e = {k: ea[k] + scale * (eb[k] - ea[k]) for k in LINEAR}
        e["bytes_per_rank"] = e["state_bytes"] + e["activation_bytes"]
        e["collectives"] = eb["collectives"]
        e["recorded"] = f"{a} and {b} layers, scaled to {cfg.layers}"
    e["wall"] = time.perf_counter() - t0
    return e


def _with(cfg: app.Config, **kw) -> app.Config:
    d = dict(cfg.__dict__)
    d.update(kw)
    return app.Config(**d)


def dominant(e: dict) -> str:
    """Which term of the prediction dominates (FLOP-bound compute, memory traffic, communication)."""
    parts = {"compute": e["flop_bound"], "memory": e["memory_bound"], "communication": e["comm_seconds"]}
    name = max(parts, key=parts.get)
    return f"{name} ({100 * parts[name] / e['seconds']:.0f}%)"


# ------------------------------------------------------------------------------ the runs

def mtf_lm(quick: bool) -> list:
    cfg = app.Config(d_model=1024, heads=256, d_kv=256, d_ff=262144, layers=6, vocab=32768, length=256, batch=256,
                     dtype="bfloat16")
    rules = "batch:b;heads:m;d_ff:m;vocab:m"
    e = priced(cfg, "b:16;m:32", rules, cost.TPUV2, depth=(1, 2) if quick else None)
    peak = 512 * cost.TPUV2.flops
    util = e["flops"] / e["seconds"] / cost.TPUV2.flops
    published = 6e15 / 11.5e15
    return [{"run": "Mesh-TensorFlow LM, Table 2 (4.9B)", "machine": "TPUv2-512, mesh b:16 x m:32",
             "config": f"{parameters(cfg) / 1e9:.2f}B params, 6 layers, batch 256x256, bf16; layout {rules}",
             "predicted": f"{e['seconds'] * 1e3:.0f} ms/step; {util:.0%} of peak ({util * peak / 1e15:.1f} PFLOP/s)",
             "published": f"{published:.0%} of peak (6 of 11.5 PFLOP/s)",
             "error": f"{util / published - 1:+.0%} (utilisation)", "why": _why(e), "e": e}]


def gshard_moe(quick: bool) -> list:
    rows = []
    for cores, published in ((128, 0.52), (2048, 0.32)):
        cfg = app.Config(d_model=1024, heads=16, d_kv=64, d_ff=8192, layers=36, vocab=32000, length=1024,
                         batch=2 * cores, dtype="bfloat16", moe_every=2, experts=cores)
        rules = "batch:all;experts:all"
        e = priced(cfg, f"all:{cores}", rules, cost.TPUV3, depth=(2, 4) if quick else None, moe_capacity=(2.0, 1))
        util = e["flops"] / e["seconds"] / cost.TPUV3.flops
        a2a = sum(c["bytes"] for k, c in e["collectives"].items() if k.startswith("alltoall"))
        rows.append({"run": f"GShard MoE, {cores} experts, 36 layers", "machine": f"TPUv3-{cores}, mesh all:{cores}",
                     "config": f"{parameters(cfg) / 1e9:.0f}B params, 2x1024 tokens/core, bf16; layout {rules}",
                     "predicted": f"{e['seconds'] * 1e3:.0f} ms/step; {util:.0%} utilisation; alltoall "
                                  f"{a2a / 2**20:.0f} MiB/core per step",
                     "published": f"{published:.0%} utilisation",
                     "error": f"{util / published - 1:+.0%} (utilisation)", "why": _why(e), "e": e})
    return rows


DENSE = dict(d_model=8192, heads=128, d_kv=128, d_ff=98304, vocab=32000, length=1024, dtype="bfloat16")
DENSE_LAYOUTS = ("batch:rows;heads:cols;d_ff:cols;vocab:cols", "d_model:rows;heads:cols;d_ff:cols;vocab:cols")


def dense_2d(quick: bool) -> list:
    """Largest batch per core count, layout and depth: predicted bytes per core are bilinear in
    batch and depth (every layer and every sequence alike), so 4 recordings (1 and 2 layers, two
    batches) give every model size."""
    rows = []
    known = {(128, 2048): "512 runs (lingvo DenseLm128B32x32, 2-D weight sharding)"}
    for cores, mesh in ((1024, "rows:32;cols:32"), (2048, "rows:32;cols:64")):
        for rules in DENSE_LAYOUTS:
            step = 32 if rules.startswith("batch") else 1  # batch split over rows: multiples of 32
            b1, b2 = 32, 64
            got = {(n, b): priced(app.Config(**DENSE, layers=n, batch=b), mesh, rules, cost.TPUV3)
                   for n in (1, 2) for b in (b1, b2)}

            def mem(n_layers, batch):
                per_layer = {b: got[(2, b)]["bytes_per_rank"] - got[(1, b)]["bytes_per_rank"] for b in (b1, b2)}
                at = {b: got[(1, b)]["bytes_per_rank"] + (n_layers - 1) * per_layer[b] for b in (b1, b2)}
                per_seq = (at[b2] - at[b1]) / (b2 - b1)
                return at[b1] - per_seq * b1, per_seq
            for billions, n_layers in ((64, 32), (128, 64), (256, 128)):
                fixed, per_seq = mem(n_layers, 0)
                if per_seq > 0:
                    fit = int((cost.TPUV3.memory - fixed) // per_seq) // step * step
                else:  # the peak is batch-independent (the optimizer update's, after activations are freed)
                    fit = math.inf if fixed <= cost.TPUV3.memory else 0
                cfg = app.Config(**DENSE, layers=n_layers, batch=1)
                e = got[(1, b1)]
                rows.append({"run": f"dense {billions}B ({n_layers} layers): largest batch", "machine":
                             f"TPUv3-{cores}, mesh {mesh.replace('rows:', '').replace(';cols:', ' x ')}",
                             "config": f"{parameters(cfg) / 1e9:.0f}B params, length 1024, bf16; layout {rules}",
                             "predicted": f"{fit if fit > 0 else 'none'} (per core: {fixed / GIB:.1f} GiB fixed + "
                                          f"{per_seq / 2**20:.0f} MiB per sequence{'; in multiples of 32' if step > 1 else ''})",
                             "published": known.get((billions, cores), "slides' table not retrieved"),
                             "error": (f"{(fit if fit > 0 else 0) / 512 - 1:+.0%}" if (billions, cores) in known else "n/a"),
                             "why": "memory: parameters, gradients, Adafactor state (fixed) + activations", "e": e})
    # lingvo's DenseLm128B32x32: batch 512 of 1024 tokens on 2048 cores, "Expect ~62k tokens/sec"
    cfg = app.Config(**DENSE, layers=64, batch=512)
    for rules in DENSE_LAYOUTS:
        e = priced(cfg, "rows:32;cols:64", rules, cost.TPUV3, depth=(1, 2))
        tps = 512 * 1024 / e["seconds"]
        rows.append({"run": "dense 128B (64 layers), lingvo DenseLm128B32x32", "machine": "TPUv3-2048, mesh 32 x 64",
                     "config": f"{parameters(cfg) / 1e9:.0f}B params, batch 512x1024, bf16; layout {rules}",
                     "predicted": f"{e['seconds']:.2f} s/step, {tps / 1e3:.0f}k tokens/s; "
                                  f"{e['bytes_per_rank'] / GIB:.1f} GiB/core",
                     "published": "~62k tokens/s (config comment)", "error": f"{tps / 62e3 - 1:+.0%} (throughput)",
                     "why": _why(e), "e": e})
    return rows


def _why(e: dict) -> str:
    return (f"{dominant(e)}: FLOP-bound {e['flop_bound'] * 1e3:.0f} ms, memory-bound {e['memory_bound'] * 1e3:.0f} ms, "
            f"communication {e['comm_seconds'] * 1e3:.0f} ms (allreduce {e['allreduce'] * 1e3:.0f}, alltoall "
            f"{e['alltoall'] * 1e3:.0f}, other {e['other_comm'] * 1e3:.0f}); {e['bytes_per_rank'] / GIB:.1f} GiB/core")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="record fewer layers and scale (faster)")
    ap.add_argument("--only", choices=["mtf", "gshard", "dense"], action="append", help="run only these")
    args = ap.parse_args()
    runs = {"mtf": mtf_lm, "gshard": gshard_moe, "dense": dense_2d}
    rows = []
    for key, fn in runs.items():
        if args.only and key not in args.only:
            continue
        t0 = time.perf_counter()
        got = fn(args.quick)
        for r in got:
            print(f"{r['run']} on {r['machine']}: predicted {r['predicted']}; published {r['published']}; "
                  f"error {r['error']}; {r['why']} [recorded {r['e'].get('recorded', '')}]", flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        rows += got
    write_table(rows)


def write_table(rows: list) -> None:
    lines = ["# Cost model vs published runs (benchmarks/simulate.py)", "",
             "Machines: " + "; ".join(f"`{m.name}`: {m.flops / 1e12:.1f} TFLOP/s, α {m.latency * 1e6:.0f} µs, "
                                      f"β {m.bandwidth / 1e9:.0f} GB/s, {m.memory / GIB:.0f} GiB, HBM "
                                      f"{m.memory_bandwidth / 1e9:.0f} GB/s per core" for m in (cost.TPUV2, cost.TPUV3)),
             "", "| run | machine | configuration | predicted | published | error | dominant term |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['machine']} | {r['config']} | {r['predicted']} | {r['published']} | "
                     f"{r['error']} | {r['why']} |")
    lines += ["", NOTES]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "simulate.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


NOTES = """Notes and assumptions:
- Utilisation here is the FLOPs the recorded step executes per core (every einsum, MoE dispatch and
  combine included) over predicted step time and peak; the papers' own FLOP counts may differ.
- Mesh-TensorFlow: layer count (6), vocabulary (lm1b 32k, padded to 32,768), length 256 and bfloat16
  activations from tensor2tensor's `mtf_transformer_paper_lm(5)` (4.90B parameters there, as here).
  Adafactor, as in the paper.
- GShard: the talk's 52% / 32% are taken as given; the model is a decoder-only stack of the paper's
  36 layers (the paper's is encoder-decoder), group = a sequence of 1024 tokens, 2 groups per core,
  expert capacity 2·S/E per group (GShard's), dense weights replicated. The 600B model's sizes
  (2048 experts of 1024 x 8192) give 2048 · 18 · 16.8M = 620B expert weights, matching the paper.
- Dense 2-D: sizes of lingvo's `DenseLmTemplate` (GSPMD); mpimesh's rules map each tensor dim to one
  mesh dim and a tensor may not use a mesh dim twice, so GShard's weight sharding over both mesh dims
  *with* the batch split (activations [batch(x), length, model(y)], weights [model(x), hidden(y)]) is
  not expressible in one rules string; the two layouts priced are Mesh-TensorFlow's 2-D (batch on rows,
  model dims on cols: weights replicated over rows) and a fully model-parallel 2-D (d_model on rows,
  heads/d_ff/vocab on cols: no data parallelism). The slides' table of largest batches was not
  retrieved here; the memory model counts parameters, optimizer state and the peak of live op outputs
  (no rematerialisation, no kernel temporaries), float32 parameters and gradients.
- Depth scaling: recorded at a and b layers and extrapolated linearly in the layer count.
- Which term is off: Mesh-TensorFlow's LM is priced within a few percent. GShard at 128 cores is
  under-predicted (33% vs 52%) by the memory-traffic term: every elementwise op is priced unfused at
  HBM bandwidth, where XLA fuses them. From 128 to 2048 cores the published utilisation falls 52% -> 32%,
  the prediction only 33% -> 29%: the α-β alltoall term, (k-1)/k · bytes / β, does not grow with the
  core count, while on a 2-D torus the per-core alltoall bandwidth falls (bisection ~ √cores).
  The dense runs are bounded by memory: with Mesh-TensorFlow's 2-D layout the weights are replicated
  over the batch rows and the peak (the optimizer update: parameters, float32 gradients and the
  updated parameters alive at once, no in-place update) does not fit in 16 GiB at any batch; the
  fully model-parallel 2-D layout fits only a few sequences (no rematerialisation, activations not
  split by batch), where lingvo runs 512 with 2-D weight sharding and rematerialisation.
"""


if __name__ == "__main__":
    main()
