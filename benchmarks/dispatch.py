"""Host time per op on tiny tensors (the cost of mpimesh's Python per op), beside numpy's own op
timed in the same run, and the ops per training step of benchmarks/gpu.py's Transformer.

    python benchmarks/dispatch.py                  # one process, a 1-rank mesh
    python benchmarks/dispatch.py --against DIR    # also per-op µs of the mpimesh checkout in DIR

Each case runs many times in a loop on a 1-rank mesh (`COMM_SELF`), plain and inside `mm.trace()`,
interleaved with the numpy expression it lowers to; times are the best of 7 loops. Bars: `x + y`
at most 8x numpy's `+`; a 4x4 einsum at most 5x numpy's `@`. The op count is `len(trace.ops)` of one
step of apps/transformer.py's train step in benchmarks/gpu.py's configuration (Adam; d_model 1024,
4 layers, 16x64 heads, d_ff 4096), recorded dry (shapes only), per dtype; bar: at most 700.
`--against DIR` (another checkout, e.g. `git worktree add /tmp/prev HEAD~1`) times the same cases with
DIR's mpimesh and with this one, in fresh processes taking turns (`--rounds`, best of all), and prints
each case's ratio: how a change moved per-op time, measured in one run.
"""
from __future__ import annotations

import common  # noqa: F401  (first: fixes the BLAS environment)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from common import kernel_report, table, verdict  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.launch import find_mpiexec, job_env  # noqa: E402

APPS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps")

GPU_CONFIG = {"d_model": 1024, "heads": 16, "d_kv": 64, "d_ff": 4096, "layers": 4, "batch": 32, "length": 512}
BARS = {"x + y": 8.0, "einsum 4x4 @ 4x4": 5.0}


def per_call(fn, n: int, loops: int = 7) -> float:
    """Best microseconds per call of `fn` over `loops` loops of `n` calls."""
    fn()
    best = float("inf")
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def cases(mesh):
    """(name, mpimesh thunk, numpy thunk): tiny operands, the numpy expression the op lowers to."""
    a, b = np.ones((4, 4), np.float32), np.full((4, 4), 2.0, np.float32)
    x, y = mesh.from_numpy(a, "i:4;j:4"), mesh.from_numpy(b, "i:4;j:4")
    w = mesh.from_numpy(b, "j:4;k:4")
    yield "x + y", lambda: x + y, lambda: a + b
    yield "x * 2.0", lambda: x * 2.0, lambda: a * np.float32(2.0)
    yield "exp(x)", lambda: mm.exp(x), lambda: np.exp(a)
    yield "einsum 4x4 @ 4x4", lambda: mm.einsum([x, w]), lambda: a @ b
    yield "reduce_sum(x)", lambda: mm.reduce_sum(x), lambda: a.sum()


def step_ops() -> dict:
    """Ops in one training step of the GPU benchmark's Transformer, per activation dtype."""
    from mpimesh.dryrun import DryMesh
    sys.path.insert(0, APPS)
    import transformer as app  # (here: a turn of --against runs another checkout, whose mpimesh this app may outgrow)
    counts = {}
    for dtype in ("float32", "bfloat16"):
        cfg = app.Config(**GPU_CONFIG, optimizer="adam", dtype=dtype)
        opt = app.make_optimizer(cfg)
        params = app.init_params(DryMesh("all:1"), cfg, 0)
        tokens = mm.cost.ArgSpec([cfg.dim("batch"), cfg.dim("length")], "int32")
        rec = mm.cost.record(app.make_train_step(cfg, opt), (params, opt.init(params),
                                                             {"inputs": tokens, "targets": tokens}), "all:1", "")
        counts[dtype] = len(rec.ops)
    return counts


def case_times(mesh) -> dict:
    """`{case: best µs per call}` of mpimesh's side of each case (plain, then traced)."""
    times = {}
    for name, mine, _ in cases(mesh):
        times[name] = per_call(mine, 2000)
        with mm.trace():
            times[name + " (traced)"] = per_call(mine, 500)
    return times


def against(other: str, rounds: int) -> None:
    """Per-op µs of this checkout and of `other`'s, fresh processes taking turns, best of `rounds`."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    best: dict = {here: {}, other: {}}
    for _ in range(rounds):
        for tree in (other, here):
            env = job_env(MPIMESH_BENCH_ROOT=tree, MPIMESH_BENCH_LOCK="")  # (this process holds the lock)
            out = subprocess.run([find_mpiexec(), "-n", "1", sys.executable, os.path.abspath(__file__), "--case-times"],
                                 env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
            assert json.loads(out.splitlines()[-2]) == tree, (out, tree)  # (the checkout it timed)
            for name, t in json.loads(out.splitlines()[-1]).items():
                best[tree][name] = min(best[tree].get(name, float("inf")), t)
    rows = [(name, f"{best[other][name]:.2f}", f"{t:.2f}", f"{t / best[other][name]:.3f}")
            for name, t in best[here].items()]
    print(f"\nhost time per op, this checkout ({here}) against {other}: best of {rounds} turns each")
    print(table(("op", "other us", "this us", "this / other"), rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", metavar="DIR", help="another mpimesh checkout to time the same cases with")
    parser.add_argument("--rounds", type=int, default=5, help="turns each with --against (default 5)")
    parser.add_argument("--case-times", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case_times:  # (a turn of --against: this process imports the checkout on PYTHONPATH)
        print(json.dumps(os.path.dirname(os.path.dirname(os.path.abspath(mm.__file__)))))
        print(json.dumps(case_times(mm.Mesh("all:1", comm=mm.MPI.COMM_SELF))))
        return
    print(kernel_report())
    if args.against:
        against(os.path.abspath(args.against), args.rounds)
        return
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    rows, verdicts = [], []
    for name, mine, ref in cases(mesh):
        n = 2000
        t_np, t_mm = per_call(ref, 20 * n), per_call(mine, n)
        with mm.trace():
            t_tr = per_call(mine, n // 4)
        rows.append((name, f"{t_np:.2f}", f"{t_mm:.2f}", f"{t_tr:.2f}", f"{t_mm / t_np:.1f}x"))
        if name in BARS:
            verdicts.append(verdict(f"{name} at most {BARS[name]:g}x numpy's", t_mm <= BARS[name] * t_np,
                                    f"{t_mm:.2f} us against numpy's {t_np:.2f} us: {t_mm / t_np:.1f}x"))
    print("\nhost time per op on tiny tensors, 1 rank (best of 7 loops)")
    print(table(("op", "numpy us", "mpimesh us", "traced us", "mpimesh / numpy"), rows))
    ops = step_ops()
    print("\nops per Transformer training step (benchmarks/gpu.py's configuration, Adam): "
          + ", ".join(f"{n} in {d}" for d, n in ops.items()))
    verdicts.append(verdict("ops per step at most 700", max(ops.values()) <= 700, str(ops)))
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
