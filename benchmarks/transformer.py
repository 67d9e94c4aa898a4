"""Transformer training step time and model-FLOPs utilisation (MFU), data- and model-parallel.

    mpiexec -n 1 python benchmarks/transformer.py
    mpiexec -n 2 python benchmarks/transformer.py

The model is apps/transformer.py's decoder with d_model 1024, d_ff 4096 (16 heads of 64, 2 layers,
length 128, byte vocabulary), trained by Adafactor. MFU = model FLOPs per step (the matmuls of
forward and backward: 3 x 2 x (matmul parameters + attention) per token, the usual convention) /
step time / peak, where peak is the float32 matmul rate this run measures on the same ranks (a
2048^3 matmul per rank, one BLAS thread each, all ranks at once), timed interleaved with the steps,
run by run, so that other jobs on a shared machine slow both alike (medians); "(of best peak)" is
MFU against the best of separate peak readings instead (target: MFU >= 70%). Prints the profile of one step
(collectives and flops per rank), the share of the step spent in collectives, and the step's peak
resident memory with activations kept until the step ends against released during the backward pass.

Gradient buckets (data-parallel): the same step with `mm.gradients`' buckets (25 MiB, the default)
and without (`mm.set_bucket_bytes(0)`: every gradient allreduced on the spot, blocking). Prints per
step the allreduce calls and the exposed communication seconds: time in blocking collectives plus
time blocked waiting for non-blocking ones (`mm.profile().overlap["exposed"]`), beside the seconds
the buckets' allreduces ran hidden behind the backward pass (medians over `--steps`).

Each layout's step also runs compiled (`mm.compile`, recorded once and replayed without per-op
Python), interleaved with the eager one: "compiled ms" and "MFU compiled" beside them.
"""
from __future__ import annotations

import common  # noqa: F401  (first: fixes the BLAS environment)

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from common import WORLD, compare, kernel_report, load_average, rank0_print, table, verdict  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as app  # noqa: E402

import mpimesh as mm  # noqa: E402

LAYOUTS = {"data-parallel": "batch:all", "model-parallel": "heads:all;d_ff:all;vocab:all"}


def model_flops(cfg: "app.Config") -> float:
    """Matmul FLOPs of one training step (forward + backward = 3 x forward)."""
    per_layer = 4 * cfg.d_model * cfg.heads * cfg.d_kv + 2 * cfg.d_model * cfg.d_ff
    matmul_params = cfg.layers * per_layer + cfg.d_model * cfg.vocab
    attention = cfg.layers * 2 * cfg.length * cfg.heads * cfg.d_kv  # QK^T and AV, per token
    return 3 * 2 * (matmul_params + attention) * cfg.batch * cfg.length


PEAK_N = 2048


def peak_matmul(n: int = PEAK_N):
    """The peak's kernel: one float32 n^3 matmul on this rank."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    return lambda: a @ a


def peak_flops(n: int = PEAK_N) -> float:
    """Float32 matmul FLOP/s of all ranks together (each rank its own n^3 matmul at once), best of 7."""
    t = compare({"mm": peak_matmul(n)}, repeat=7, warmup=3)["mm"][0]
    return 2 * n ** 3 / t * WORLD.Get_size()


def bucket_comparison(cfg: "app.Config", data: np.ndarray, steps: int) -> None:
    """Data-parallel steps with and without gradient buckets: allreduce calls, exposed and hidden
    communication seconds per step (rank 0's, medians), and the verdicts of issue 15."""
    n = WORLD.Get_size()
    rows, got = [], {}
    for label, size in (("unbucketed", 0), ("buckets 25 MiB", mm.buckets.DEFAULT_BUCKET_BYTES)):
        mm.set_bucket_bytes(size)
        mesh = mm.Mesh(f"all:{n}", layout=LAYOUTS["data-parallel"])
        opt = app.make_optimizer(cfg)
        params = app.init_params(mesh, cfg)
        state = opt.init(params)
        step = app.make_train_step(cfg, opt)
        batch = app.make_batch(mesh, data, cfg, app.train_offsets(data, cfg, 0, 0))
        timer = app.CommTimer(mesh)
        params, state, _ = step(params, state, batch)  # warm-up
        per = []
        for _ in range(steps):
            mesh.barrier()
            c0, t0 = timer.seconds, time.perf_counter()
            with mm.profile() as prof:
                params, state, _ = step(params, state, batch)
            t = time.perf_counter() - t0
            calls = sum(v["calls"] for k, v in prof.counters.items() if k.startswith("allreduce/"))
            per.append((t, calls, timer.seconds - c0 + prof.overlap["exposed"], prof.overlap["hidden"]))
        t, calls, exposed, hidden = (float(np.median([p[i] for p in per])) for i in range(4))
        got[size] = (calls, exposed)
        rows.append((label, f"{t * 1e3:.0f}", f"{calls:.0f}", f"{exposed * 1e3:.1f}", f"{hidden * 1e3:.1f}"))
    mm.set_bucket_bytes(mm.buckets.DEFAULT_BUCKET_BYTES)
    rank0_print(f"\ngradient buckets, data-parallel on {n} rank(s), {cfg.dtype} activations, per step "
                f"(rank 0, median of {steps}):")
    rank0_print(table(("gradients", "step ms", "allreduce calls", "exposed comm ms", "hidden comm ms"), rows))
    if n > 1:
        (c0, e0), (c1, e1) = got[0], got[mm.buckets.DEFAULT_BUCKET_BYTES]
        rank0_print(verdict("allreduce calls per step <= 5", c1 <= 5, f"{c1:.0f} (unbucketed {c0:.0f})"))
        rank0_print(verdict("exposed communication <= half of unbucketed", e1 <= 0.5 * e0,
                            f"{e1 * 1e3:.1f} ms vs {e0 * 1e3:.1f} ms"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--buckets-only", action="store_true", help="only the comparison with and without gradient buckets")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the activations' dtype (parameters stay float32; the peak is float32's either way)")
    args = ap.parse_args()
    rank0_print(kernel_report())
    cfg = app.Config(d_model=1024, heads=16, d_kv=64, d_ff=4096, layers=2, length=128, batch=args.batch,
                     dtype=args.dtype)
    if args.buckets_only:
        bucket_comparison(cfg, np.random.default_rng(1).integers(0, 256, size=1 << 16).astype(np.uint8), args.steps)
        return
    peak = peak_flops()
    flops = model_flops(cfg)
    data = np.random.default_rng(1).integers(0, 256, size=1 << 16).astype(np.uint8)
    results, memory = [], []
    n = WORLD.Get_size()
    for name, rules in LAYOUTS.items():
        mesh = mm.Mesh(f"all:{n}", layout=rules)
        opt = app.make_optimizer(cfg)
        params = app.init_params(mesh, cfg)
        state = opt.init(params)
        step = app.make_train_step(cfg, opt)
        batch = app.make_batch(mesh, data, cfg, app.train_offsets(data, cfg, 0, 0))
        box = {"p": params, "s": state}

        def run():
            box["p"], box["s"], _ = step(box["p"], box["s"], batch)
        compiled = mm.compile(step)

        def run_compiled():
            box["p"], box["s"], _ = compiled(box["p"], box["s"], batch)
        # the peak's matmul interleaved with the steps, run by run: other jobs on the machine slow both alike
        times = compare({"step": run, "compiled": run_compiled, "peak": peak_matmul()}, repeat=args.steps, warmup=1)
        t_med, c_med = times["step"][1], times["compiled"][1]
        peak_here = 2 * PEAK_N ** 3 * n / times["peak"][1]
        timer = app.CommTimer(mesh)
        with mm.profile() as prof:
            t0 = time.perf_counter()
            run()
            total = time.perf_counter() - t0
        results.append((name, rules, t_med, c_med, timer.seconds / total, peak_here))
        rank0_print(f"\n{name} ({rules}) on {n} rank(s), rank 0's profile of one step:\n{prof.report()}")
        peaks = {}
        for release in (False, True):  # one step each, activations kept vs released during backward
            kept = app.make_train_step(cfg, opt, retain=not release)
            with mm.profile(memory=True) as mem:
                box["p"], box["s"], _ = kept(box["p"], box["s"], batch)
            peaks[release] = mem.peak_bytes["arrays"]
        memory.append((name, peaks[False], peaks[True]))
    peak = max(peak, peak_flops())  # measured again after the steps: the higher (warmer) reading counts
    rows = [(name, rules, f"{t * 1e3:.0f}", f"{flops / t / 1e9:.1f}", f"{100 * flops / t / here:.1f}%",
             f"{100 * flops / t / peak:.1f}%", f"{100 * comm:.0f}%", f"{c * 1e3:.0f}", f"{100 * flops / c / here:.1f}%")
            for name, rules, t, c, comm, here in results]
    rank0_print(f"\nmodel: d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.heads}x{cfg.d_kv} heads, {cfg.layers} layers, "
                f"batch {cfg.batch} x length {cfg.length}; {flops / 1e9:.1f} model GFLOP per step; "
                f"measured peak {peak / 1e9:.1f} GFLOP/s on {n} rank(s)")
    rank0_print(table(("layout", "rules", "step ms", "GFLOP/s", "MFU", "(of best peak)", "comm", "compiled ms",
                       "MFU compiled"), rows))
    rank0_print("\npeak memory of live arrays in one step on rank 0 (activations kept until the step ends vs "
                "released as the backward pass goes):")
    rank0_print(table(("layout", "kept MiB", "released MiB", "ratio"),
                      [(name, f"{a / 2**20:.0f}", f"{b / 2**20:.0f}", f"{b / a:.2f}") for name, a, b in memory]))
    best = max(float(r[4].rstrip("%")) for r in rows)
    rank0_print(verdict("transformer MFU >= 70% of the measured peak", best >= 70.0,
                        f"best {best:.1f}% ({', '.join(f'{r[0]} {r[4]}' for r in rows)}); load average {load_average()}"))
    bucket_comparison(cfg, data, args.steps)


if __name__ == "__main__":
    main()
