"""The cost model against measured step times: predicted vs measured over many layouts.

    mpiexec -n 1 python benchmarks/cost_model.py
    mpiexec -n 2 python benchmarks/cost_model.py
    mpiexec -n 4 python benchmarks/cost_model.py

Each run (one rank count) times two training steps under many layouts and meshes:
  * the Mesh-TensorFlow paper's two-layer MLP (apps/two_layer.py's `train_step`, SGD, float32),
  * apps/transformer.py's decoder (forward, `mm.gradients`, Adafactor) at small sizes,
on a 1-D mesh `all:N` and, on 4 ranks, also on `rows:2;cols:2`. On 1 rank every layout is the
same program, so there the cases vary the batch instead. Beside each measured step (median of
`--repeat` runs, a run's time its slowest rank's) it prints the prediction of
`mm.cost.estimate(trace, rules, mesh_shape, machine)` for the step's recorded trace, with
`machine = mm.cost.calibrate(mesh)` measured once per mesh on the same ranks, and the share of
compute and communication in the prediction. Then the Spearman rank correlation and the median
relative error |predicted - measured| / measured (targets on 2 and 4 ranks: >= 0.8, <= 25%).

Two more checks of `mm.auto_layout` (N > 1): its pick for each step, measured, against the best
measured layout on that mesh (target: within 10%); and, with `memory_per_rank` below the
replicated parameters and optimizer state, that the plan shards the parameters and that its
`bytes_per_rank` is within 10% of this rank's measured bytes (the `.local` bytes of the
parameters and optimizer state, and the peak of live arrays during a step, measured with the
transport's buffer pool emptied first, so that tracemalloc sees the pooled collective outputs).

Writes benchmarks/results/cost_model_n{N}.csv for this rank count (`--out DIR`: elsewhere), then
merges every rank count's CSV into cost_model.csv and draws cost_model.png there (predicted
vs measured, log-log, one colour per rank count). The machine may be shared: the load average is
printed, and a loaded machine slows measured steps that the calibration did not see.
"""
from __future__ import annotations

import common  # noqa: F401  (first: clean BLAS environment, may re-exec)

import argparse  # noqa: E402
import csv  # noqa: E402
import glob  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from common import WORLD, compare, kernel_report, load_average, on_rank0, rank0_print, table, verdict  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as app  # noqa: E402
import two_layer as tl  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import cost  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LR = 1e-4
SPEARMAN_TARGET, ERROR_TARGET, AUTO_TARGET, MEMORY_TARGET = 0.8, 0.25, 0.10, 0.10
MLP_LAYOUTS_1D = ["", "batch:all", "hidden:all", "io:all"]
TR_LAYOUTS_1D = ["", "batch:all", "heads:all;d_ff:all;vocab:all", "heads:all", "d_ff:all", "vocab:all",
                 "d_model:all", "heads:all;d_ff:all"]
MLP_LAYOUTS_2D = ["batch:rows;hidden:cols", "batch:rows;io:cols", "io:rows;hidden:cols"]
TR_LAYOUTS_2D = ["batch:rows;heads:cols;d_ff:cols;vocab:cols", "batch:rows;d_ff:cols", "batch:rows;d_model:cols",
                 "d_model:rows;heads:cols;d_ff:cols;vocab:cols"]


# ------------------------------------------------------------------------------ the two steps

class Workload:
    """A training step to time and price: `build(mesh)` makes its state under the rules in force
    and returns `(run, fn, args)`: `run()` one step in place, `fn(*args)` the same step for
    `auto_layout` to record."""
    name = ""

    def sizes(self) -> str:
        raise NotImplementedError


class MLP(Workload):
    name = "mlp"

    def __init__(self, batch=256, d_io=512, d_hidden=2048):
        self.s = tl.Sizes.of(batch, d_io, d_hidden)

    def sizes(self) -> str:
        return f"b{self.s.batch.size}/io{self.s.io.size}/h{self.s.hidden.size}"

    def build(self, mesh):
        params = tl.init_params(mesh, self.s, seed=0)
        x, target = tl.make_data(mesh, self.s)
        box = {"p": params}

        def fn(params, x, target):
            return tl.train_step(params, x, target, LR, input_grad=False).params

        def run():
            box["p"] = fn(box["p"], x, target)
        return run, fn, (params, x, target), {"params": params}


class Transformer(Workload):
    name = "transformer"

    def __init__(self, batch=16, **kw):
        base = dict(d_model=256, heads=8, d_kv=32, d_ff=1024, layers=2, length=64, batch=batch)
        base.update(kw)
        self.cfg = app.Config(**base)
        self.data = np.random.default_rng(1).integers(0, 256, size=1 << 16).astype(np.uint8)

    def sizes(self) -> str:
        c = self.cfg
        return f"b{c.batch}/L{c.length}/d{c.d_model}/ff{c.d_ff}/h{c.heads}x{c.d_kv}/{c.layers}l"

    def build(self, mesh):
        cfg = self.cfg
        opt = app.make_optimizer(cfg)
        params = app.init_params(mesh, cfg)
        state = opt.init(params)
        step = app.make_train_step(cfg, opt)
        batch = app.make_batch(mesh, self.data, cfg, app.train_offsets(self.data, cfg, 0, 0))
        box = {"p": params, "s": state}

        def fn(params, state, batch):
            return step(params, state, batch)[:2]

        def run():
            box["p"], box["s"] = fn(box["p"], box["s"], batch)
        return run, fn, (params, state, batch), {"params": params, "state": state}


def cases(n: int) -> list:
    """`(workload, mesh shape, rules)` for a run on n ranks."""
    if n == 1:  # one processor: every layout is the same program; vary the batch instead
        return ([(MLP(batch=b), "all:1", "") for b in (64, 128, 256, 512)]
                + [(Transformer(batch=b), "all:1", "") for b in (4, 8, 16, 32)])
    mlp, tr, one = MLP(), Transformer(), f"all:{n}"
    out = [(mlp, one, r) for r in MLP_LAYOUTS_1D] + [(tr, one, r) for r in TR_LAYOUTS_1D]
    if n == 4:
        two = "rows:2;cols:2"
        out += [(mlp, two, r) for r in MLP_LAYOUTS_2D] + [(tr, two, r) for r in TR_LAYOUTS_2D]
    return out


# ------------------------------------------------------------------------------ measuring

_meshes: dict = {}
_machines: dict = {}
_timers: dict = {}


def mesh_of(shape: str) -> "mm.Mesh":
    if shape not in _meshes:
        _meshes[shape] = mm.Mesh(shape)
        _timers[shape] = app.CommTimer(_meshes[shape])  # wall time inside its collective calls
    return _meshes[shape]


def machine_of(shape: str):
    """`calibrate` once per mesh (every rank takes part)."""
    if shape not in _machines:
        t0 = time.perf_counter()
        _machines[shape] = cost.calibrate(mesh_of(shape))
        rank0_print(f"calibrate({shape}): {_machines[shape]} ({time.perf_counter() - t0:.1f} s)")
    return _machines[shape]


def local_bytes(tree) -> int:
    """This rank's bytes of every tensor's `.local` in a (nested) dict of tensors."""
    if isinstance(tree, mm.DistTensor):
        return int(tree.local.nbytes)
    if isinstance(tree, dict):
        return sum(local_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(local_bytes(v) for v in tree)
    return 0


def fresh_pool(mesh) -> None:
    """Empty the MPI transport's buffer pool (`collectives/mpi.py`'s `BufferPool`) before a step
    whose memory is measured: collective outputs of 256 KiB or more are views of pooled buffers,
    and a warm pool's, allocated by earlier steps before tracemalloc started, are invisible to it
    (a step with d_model split holds its summed projections there: 13 of its 67 MiB on 2 ranks)."""
    pool = getattr(mesh.collectives, "pool", None)
    if pool is not None and hasattr(pool, "_bufs"):
        pool._bufs.clear()
        pool._bytes = 0


def predict(fn, args, mesh, rules: str, machine) -> dict:
    """`estimate` of `fn(*args)` recorded dry under `rules` (the numbers only: rank 0 runs it)."""
    e = cost.estimate(cost.record(fn, args, mesh, rules), rules, mesh.shape, machine)
    return {k: e[k] for k in ("seconds", "compute_seconds", "comm_seconds", "bytes_per_rank")}


def plan_of(fn, args, mesh, machine, memory_per_rank=None) -> dict:
    """`auto_layout`'s plan as plain values, and its search time (every rank calls it: on a mesh of
    several ranks the candidates are shared out over them)."""
    t0 = time.perf_counter()
    plan = mm.auto_layout(fn, args, mesh, memory_per_rank=memory_per_rank, machine=machine)
    return {"rules": plan.rules, "seconds": plan.seconds, "bytes_per_rank": plan.bytes_per_rank,
            "report": plan.report(5), "search_s": time.perf_counter() - t0, "candidates": plan.candidates}


def prepare(work, shape: str, rules: str) -> tuple:
    """`work`'s step under `rules` on mesh `shape`: built, warmed up, its trace, memory and
    communication share measured, and priced; returns `(row, run)`, `run` one step in its scope."""
    mesh = mesh_of(shape)
    with mm.layout_scope(mesh, rules):
        run, fn, args, held = work.build(mesh)
        fresh_pool(mesh)
        with mm.profile(memory=True) as prof:  # the first step (also the warm-up): what it allocates
            run()
        with mm.trace() as tr:
            run()
        c0, t0 = _timers[shape].seconds, time.perf_counter()
        run()
        comm, total = _timers[shape].seconds - c0, time.perf_counter() - t0
    machine = machine_of(shape)
    est = on_rank0(lambda: predict(fn, args, mesh, rules, machine))

    def scoped():
        with mm.layout_scope(mesh, rules):
            run()
    row = {"ranks": WORLD.Get_size(), "model": work.name, "sizes": work.sizes(), "mesh": shape,
           "rules": rules or "[]", "predicted_s": float(est["seconds"]), "compute_s": float(est["compute_seconds"]),
           "comm_s": float(est["comm_seconds"]), "measured_comm_share": comm / total,
           "predicted_bytes": int(est["bytes_per_rank"]), "held_bytes": local_bytes(held),
           "peak_array_bytes": local_bytes(args) + int(prof.peak_bytes.get("arrays", 0)), "ops": len(tr.ops)}
    return row, scoped


def measure_all(todo: list, repeat: int) -> list:
    """Rows for every `(work, mesh shape, rules)` of `todo`, their steps timed interleaved run by
    run (`common.compare`: drift and other jobs' load hit every case alike), median of `repeat`."""
    rows, runs = [], {}
    for i, (work, shape, rules) in enumerate(todo):
        row, runs[i] = prepare(work, shape, rules)
        rows.append(row)
    times = compare(runs, repeat=repeat, warmup=0)
    for i, row in enumerate(rows):
        row["measured_min_s"], row["measured_s"] = times[i]
        rank0_print(f"  {row['model']:<11} {row['sizes']:<28} {row['mesh']:<14} {row['rules']:<44} measured "
                    f"{row['measured_s'] * 1e3:8.1f} ms  predicted {row['predicted_s'] * 1e3:8.1f} ms")
    return rows


# ------------------------------------------------------------------------------ statistics

def ranks_of(x) -> np.ndarray:
    """Average ranks (ties share their mean rank), 1-based."""
    x = np.asarray(x, float)
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tie = x == v
        r[tie] = r[tie].mean()
    return r


def spearman(a, b) -> float:
    """Spearman's rank correlation: Pearson's correlation of the average ranks.

    >>> round(spearman([1, 2, 3, 4], [10, 20, 40, 30]), 3)
    0.8
    """
    ra, rb = ranks_of(a), ranks_of(b)
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def median_rel_error(pred, meas) -> float:
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    return float(np.median(np.abs(pred - meas) / meas))


# ------------------------------------------------------------------------------ auto_layout checks

def auto_picks(todo: list) -> list:
    """`auto_layout`'s pick for each workload and mesh of `todo`: `(work, shape, plan)`."""
    picks, seen = [], set()
    for work, shape, _ in todo:
        if (work.name, shape) in seen:
            continue
        seen.add((work.name, shape))
        mesh, machine = mesh_of(shape), machine_of(shape)
        with mm.layout_scope(mesh, ""):
            _, fn, args, _ = work.build(mesh)
        picks.append((work, shape, plan_of(fn, args, mesh, machine)))
    return picks


def auto_check(work, shape: str, plan: dict, rows: list) -> None:
    """`auto_layout`'s pick for `work` on mesh `shape`, measured, against the best measured case."""
    mine = [r for r in rows if r["model"] == work.name and r["mesh"] == shape]
    got = next(r for r in mine if r["rules"] == (plan["rules"] or "[]"))
    best = min(mine, key=lambda r: r["measured_s"])
    ratio = got["measured_s"] / best["measured_s"]
    fastest = min(mine, key=lambda r: r["measured_min_s"])
    ratio_min = got["measured_min_s"] / fastest["measured_min_s"]
    rank0_print(f"\nauto_layout({work.name}, {shape}) in {plan['search_s']:.1f} s: {plan['rules'] or '[]'} predicted "
                f"{plan['seconds'] * 1e3:.1f} ms, measured {got['measured_s'] * 1e3:.1f} ms; best measured "
                f"{best['rules']} {best['measured_s'] * 1e3:.1f} ms\n{plan['report']}")
    rank0_print(verdict(f"auto_layout pick within {AUTO_TARGET:.0%} of the best measured ({work.name}, {shape})",
                        ratio <= 1 + AUTO_TARGET, f"median {ratio:.2f}x of the best median; fastest run "
                        f"{ratio_min:.2f}x of the fastest ({fastest['rules']}); load average {load_average()}"))


def param_dims(held) -> set:
    """The tensor dims of the parameters in `held` (what `build` returns)."""
    p = held["params"]
    return {d.name for t in p.values() for d in t.shape}


def memory_check(work, shape: str) -> None:
    """A memory limit just below every plan that keeps the parameters replicated: the plan must
    shard them; its bytes_per_rank against this rank's measured peak of live arrays in a step."""
    mesh = mesh_of(shape)
    machine = machine_of(shape)
    with mm.layout_scope(mesh, ""):
        _, fn, args, held = work.build(mesh)
        replicated = local_bytes(held["params"])
    free = plan_of(fn, args, mesh, machine)
    pdims = param_dims(held)
    keep = [b for r, _, b in free["candidates"] if not pdims & {d for d, _ in mm.LayoutRules(r).pairs}]
    shard = [(r, b) for r, _, b in free["candidates"] if pdims & {d for d, _ in mm.LayoutRules(r).pairs}]
    if not shard or min(b for _, b in shard) >= min(keep):
        rank0_print(f"\nmemory ({work.name}, {shape}): no plan that shards the parameters needs less memory than "
                    f"the best that keeps them replicated ({min(keep) / 2**20:.2f} MiB predicted; parameters "
                    f"{replicated / 2**20:.2f} MiB): activations dominate; check skipped")
        return
    limit = int(0.97 * min(keep))
    plan = plan_of(fn, args, mesh, machine, memory_per_rank=limit)
    with mm.layout_scope(mesh, plan["rules"]):
        run, _, args, held = work.build(mesh)
        fresh_pool(mesh)
        with mm.profile(memory=True) as prof:  # tracemalloc: only what the step allocates
            run()
    params_bytes = local_bytes(held["params"])
    peak = local_bytes(args) + int(prof.peak_bytes.get("arrays", 0))  # + the arguments, allocated before
    pred = plan["bytes_per_rank"]
    err = abs(pred - peak) / peak if peak else float("nan")
    rank0_print(f"\nmemory ({work.name}, {shape}): parameters replicated {replicated / 2**20:.2f} MiB/rank; the "
                f"smallest plan with replicated parameters needs {min(keep) / 2**20:.2f} MiB (predicted); limit "
                f"{limit / 2**20:.2f} MiB -> {plan['rules'] or '[]'}: predicted {pred / 2**20:.2f} MiB/rank; measured: "
                f"parameters .local {params_bytes / 2**20:.2f} MiB, arguments' .local {local_bytes(args) / 2**20:.2f} MiB + "
                f"peak of arrays allocated in the step {(peak - local_bytes(args)) / 2**20:.2f} MiB = {peak / 2**20:.2f} MiB")
    rank0_print(verdict(f"memory-limited plan shards the parameters ({work.name}, {shape})", params_bytes < replicated,
                        f"{params_bytes / 2**20:.2f} of {replicated / 2**20:.2f} MiB"))
    rank0_print(verdict(f"plan bytes_per_rank within {MEMORY_TARGET:.0%} of measured peak ({work.name}, {shape})",
                        err <= MEMORY_TARGET, f"predicted {pred / 2**20:.2f} MiB vs measured "
                        f"{peak / 2**20:.2f} MiB ({100 * (pred / peak - 1):+.0f}%)"))


# ------------------------------------------------------------------------------ output

FIELDS = ["ranks", "model", "sizes", "mesh", "rules", "measured_s", "measured_min_s", "predicted_s", "compute_s",
          "comm_s", "measured_comm_share", "predicted_bytes", "held_bytes", "peak_array_bytes", "ops"]


def write_csv(path: str, rows: list) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in FIELDS})


def read_csv(path: str) -> list:
    with open(path, newline="") as f:
        return [{k: (v if k in ("model", "sizes", "mesh", "rules") else float(v)) for k, v in r.items()}
                for r in csv.DictReader(f)]


def merge_and_plot(out: str) -> None:
    """Merge every rank count's CSV in `out` into cost_model.csv and draw cost_model.png there."""
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "cost_model_n*.csv"))):
        rows += read_csv(path)
    write_csv(os.path.join(out, "cost_model.csv"), rows)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 5.5))
    for n, colour in ((1, "tab:gray"), (2, "tab:blue"), (4, "tab:red")):
        sel = [r for r in rows if int(r["ranks"]) == n]
        if not sel:
            continue
        p, m = [r["predicted_s"] * 1e3 for r in sel], [r["measured_s"] * 1e3 for r in sel]
        for marker, model in (("o", "mlp"), ("^", "transformer")):
            pm = [(a, b) for a, b, r in zip(p, m, sel) if r["model"] == model]
            if pm:
                ax.scatter(*zip(*pm), c=colour, marker=marker, alpha=0.8,
                           label=f"{model}, {n} rank{'s' if n > 1 else ''}")
        rank0_print(f"  {n} ranks: Spearman {spearman(p, m):.2f}, median error {100 * median_rel_error(p, m):.0f}% "
                    f"({len(sel)} cases)")
    lo = min(min(r["predicted_s"], r["measured_s"]) for r in rows) * 1e3 / 1.5
    hi = max(max(r["predicted_s"], r["measured_s"]) for r in rows) * 1e3 * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [lo / 1.25, hi / 1.25], [lo * 1.25, hi * 1.25], color="k", alpha=0.07, label="±25%")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="predicted step (ms)",
           ylabel="measured step (ms)", title="mpimesh cost model: predicted vs measured step time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "cost_model.png"), dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="timed steps per case (the median is kept)")
    ap.add_argument("--no-auto", action="store_true", help="skip the auto_layout and memory checks")
    ap.add_argument("--out", default=RESULTS, help="folder of the CSVs and the plot (default benchmarks/results)")
    args = ap.parse_args()
    n = WORLD.Get_size()
    rank0_print(kernel_report())
    rank0_print(f"\ncost model vs measured steps on {n} rank(s); median of {args.repeat} runs per case; "
                f"load average {load_average()} (other jobs on this machine slow the measured steps)")
    todo = cases(n)
    picks = auto_picks(todo) if n > 1 and not args.no_auto else []
    have = {(w.name, s, r or "") for w, s, r in todo}
    todo += [(w, s, p["rules"]) for w, s, p in picks if (w.name, s, p["rules"] or "") not in have]
    rows = measure_all(todo, args.repeat)
    for work, shape, plan in picks:
        auto_check(work, shape, plan, rows)
    if n > 1 and not args.no_auto:
        for work in (MLP(), Transformer()):
            memory_check(work, f"all:{n}")
    p, m = [r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]
    rank0_print(f"\n{len(rows)} cases on {n} rank(s):")
    rank0_print(table(("model", "sizes", "mesh", "rules", "measured ms", "(min)", "predicted ms", "error", "compute ms",
                       "comm ms", "comm share: predicted", "measured", "ops"),
                      [(r["model"], r["sizes"], r["mesh"], r["rules"], f"{r['measured_s'] * 1e3:.1f}",
                        f"{r['measured_min_s'] * 1e3:.1f}", f"{r['predicted_s'] * 1e3:.1f}",
                        f"{100 * (r['predicted_s'] / r['measured_s'] - 1):+.0f}%", f"{r['compute_s'] * 1e3:.1f}",
                        f"{r['comm_s'] * 1e3:.1f}", f"{100 * r['comm_s'] / r['predicted_s']:.0f}%",
                        f"{100 * r['measured_comm_share']:.0f}%", r["ops"]) for r in rows]))
    rho, err = spearman(p, m), median_rel_error(p, m)
    err_min = median_rel_error(p, [r["measured_min_s"] for r in rows])
    for model in ("mlp", "transformer"):
        sel = [(a, b) for a, b, r in zip(p, m, rows) if r["model"] == model]
        if len(sel) > 1:
            rank0_print(f"  {model}: Spearman {spearman(*zip(*sel)):.2f}, median error "
                        f"{100 * median_rel_error(*zip(*sel)):.0f}% ({len(sel)} cases)")
    rank0_print(f"all: Spearman {rho:.2f}, median relative error {100 * err:.0f}% (against the fastest runs: "
                f"{100 * err_min:.0f}%); load average {load_average()}")
    mem = median_rel_error([r["predicted_bytes"] for r in rows], [r["peak_array_bytes"] for r in rows])
    rank0_print(f"memory: predicted bytes_per_rank vs measured (arguments' .local + tracemalloc peak of the first "
                f"step): median error {100 * mem:.0f}% over {len(rows)} cases")
    if n > 1:
        rank0_print(verdict(f"cost model Spearman >= {SPEARMAN_TARGET} on {n} ranks", rho >= SPEARMAN_TARGET,
                            f"{rho:.2f} over {len(rows)} cases"))
        rank0_print(verdict(f"cost model median error <= {ERROR_TARGET:.0%} on {n} ranks", err <= ERROR_TARGET,
                            f"{100 * err:.0f}%"))
    if WORLD.Get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        write_csv(os.path.join(args.out, f"cost_model_n{n}.csv"), rows)
        rank0_print(f"\nall rank counts so far ({os.path.relpath(args.out)}/cost_model.csv, cost_model.png):")
        merge_and_plot(args.out)


if __name__ == "__main__":
    main()
