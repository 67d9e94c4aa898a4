"""Host time per op on tiny tensors (the cost of mpimesh's Python per op), beside numpy's own op
timed in the same run, and the ops per training step of benchmarks/gpu.py's Transformer.

    python benchmarks/dispatch.py                  # one process, a 1-rank mesh

Each case runs many times in a loop on a 1-rank mesh (`COMM_SELF`), plain and inside `mm.trace()`,
interleaved with the numpy expression it lowers to; times are the best of 7 loops. Bars: `x + y`
at most 8x numpy's `+`; a 4x4 einsum at most 5x numpy's `@`. The op count is `len(trace.ops)` of one
step of apps/transformer.py's train step in benchmarks/gpu.py's configuration (Adam; d_model 1024,
4 layers, 16x64 heads, d_ff 4096), recorded dry (shapes only), per dtype; bar: at most 700.
"""
from __future__ import annotations

import common  # noqa: F401  (first: fixes the BLAS environment)

import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from common import kernel_report, table, verdict  # noqa: E402

import mpimesh as mm  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as app  # noqa: E402

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


def main() -> None:
    print(kernel_report())
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
