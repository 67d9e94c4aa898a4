"""Pipelines (`mm.pipeline_value_and_grad`): step time and bubble per schedule and microbatch count,
beside the unpipelined step measured in the same run.

    mpiexec -n 2 python benchmarks/pipeline.py [--repeat N] [--d 256 --f 1024 --batch 256]

Two ranks as two stages (`stages:2`); each stage a residual ReLU MLP block h + relu(h·w1)·w2 (float32), the
loss a sum of squares. The reference: the same two blocks applied in turn on one rank (rank 0 alone over
COMM_SELF, the whole batch, `mm.gradients`), time T1. Each schedule runs with M = 4 and 8 microbatches
(interleaved: V = 2 virtual stages of half-width blocks, the same flops). Printed per case: the median
step time; its ratio to the ideal (T1 / 2) x (1 + bubble) with the theory's bubble (S-1)/(M+S-1) (divided
by V when interleaved); and the measured bubble, the share of the step each rank spent waiting in the
transfers between stages (`mm.profile(timeline=...)`'s waits, mean of the ranks), beside the theory.
"""
import common  # noqa: F401  (first: clean BLAS environment, may re-exec)

import argparse
import json
import os
import tempfile

import numpy as np

import mpimesh as mm
from common import WORLD, compare, kernel_report, load_average, on_rank0, rank0_print, table

S = 2  # stages: the ranks


def stage_fn(p, h):
    a = mm.relu(mm.einsum([h, p["w1"]]))  # [b, f]
    return h + mm.einsum([a, p["w2"]])  # [b, d]


def loss_fn(h, t):
    d = h - t
    return mm.reduce_sum(d * d)


def weights(rng, entries: int, d: int, f: int) -> dict:
    """Stage-stacked weights as numpy arrays: `entries` blocks of width `f`."""
    return {"w1": (rng.standard_normal((entries, d, f)) / np.sqrt(d)).astype(np.float32),
            "w2": (rng.standard_normal((entries, f, d)) / np.sqrt(f)).astype(np.float32)}


def reference_step(w: dict, x: np.ndarray, t: np.ndarray, d: int, f: int):
    """The unpipelined step on rank 0 alone: both blocks in turn on the whole batch, with gradients."""
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    blocks = [{"w1": mesh.from_numpy(w["w1"][s], f"d:{d};f:{f}"), "w2": mesh.from_numpy(w["w2"][s], f"f:{f};d:{d}")}
              for s in range(w["w1"].shape[0])]
    xs, ts = mesh.from_numpy(x, f"b:{x.shape[0]};d:{d}"), mesh.from_numpy(t, f"b:{x.shape[0]};d:{d}")

    def step():
        with mm.trace():
            h = xs
            for p in blocks:
                h = stage_fn(p, h)
            loss = loss_fn(h, ts)
            return mm.gradients([loss], [v for p in blocks for v in p.values()])
    return step


def pipelined_step(mesh, w: dict, x: np.ndarray, t: np.ndarray, d: int, m: int, schedule: str, v: int):
    entries, f = w["w1"].shape[0], w["w1"].shape[2]
    p = {"w1": mesh.from_numpy(w["w1"], f"stage:{entries};d:{d};f:{f}", "stage:stages"),
         "w2": mesh.from_numpy(w["w2"], f"stage:{entries};f:{f};d:{d}", "stage:stages")}
    xs, ts = mesh.from_numpy(x, f"b:{x.shape[0]};d:{d}"), mesh.from_numpy(t, f"b:{x.shape[0]};d:{d}")

    def step():
        return mm.pipeline_value_and_grad(stage_fn, loss_fn, p, xs, ts, "stages", m, schedule=schedule,
                                          virtual_stages=v)
    return step


def measured_bubble(step, path: str) -> float:
    """The mean over ranks of the share of one step spent waiting in collectives (the transfers)."""
    WORLD.Barrier()
    with mm.profile(timeline=path):
        step()
    WORLD.Barrier()
    share = None
    if WORLD.Get_rank() == 0:
        events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
        shares = []
        for r in range(WORLD.Get_size()):
            mine = [e for e in events if e["pid"] == r]
            span = max(e["ts"] + e["dur"] for e in mine) - min(e["ts"] for e in mine)
            waited = sum(e["args"].get("waited_us", 0.0) for e in mine if e["cat"] == "collective")
            shares.append(waited / span)
        share = float(np.mean(shares))
    return WORLD.bcast(share, root=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--f", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    if WORLD.Get_size() != S:
        raise SystemExit(f"run on {S} ranks (mpiexec -n {S}): one stage each")
    rank0_print(kernel_report())
    rank0_print(f"load average {load_average()}; d {args.d}, f {args.f}, batch {args.batch}, float32, {S} stages")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.d)).astype(np.float32)
    t = rng.standard_normal((args.batch, args.d)).astype(np.float32)
    mesh = mm.Mesh(f"stages:{S}")
    whole = weights(rng, S, args.d, args.f)
    half = weights(rng, 2 * S, args.d, args.f // 2)  # interleaved: V = 2 entries a rank, the same flops
    cases = {f"{s} M={m}": (s, m, 1, whole) for s in ("gpipe", "1f1b") for m in (4, 8)}
    cases.update({f"interleaved V=2 M={m}": ("interleaved", m, 2, half) for m in (4, 8)})
    fns = {name: pipelined_step(mesh, w, x, t, args.d, m, s, v) for name, (s, m, v, w) in cases.items()}
    ref = reference_step(whole, x, t, args.d, args.f) if WORLD.Get_rank() == 0 else None
    fns["one rank, unpipelined"] = lambda: on_rank0(lambda: ref() and None)  # (the other rank sleeps meanwhile)
    times = compare(fns, repeat=args.repeat)
    t1 = times.pop("one rank, unpipelined")[1]
    folder = WORLD.bcast(tempfile.mkdtemp() if WORLD.Get_rank() == 0 else None, root=0)
    rows = []
    for name, (s, m, v, _) in cases.items():
        theory = (S - 1) / (m + S - 1) / v
        ideal = t1 / S * (1 + theory)
        bubble = measured_bubble(fns[name], os.path.join(folder, "timeline.json"))
        rows.append((name, f"{times[name][1] * 1e3:.2f}", f"{times[name][1] / ideal:.2f}x",
                     f"{100 * bubble:.1f}%", f"{100 * theory:.1f}%", f"{100 * (bubble - theory):+.1f}"))
    rank0_print(f"\nunpipelined, one rank: {t1 * 1e3:.2f} ms (median of {args.repeat})")
    rank0_print(table(("case", "ms (median)", "/ ideal (T1/2)(1+bubble)", "bubble measured", "theory",
                       "points"), rows))
    rank0_print("bars (issue 43): measured bubble within 5 points of the theory for M = 4 and 8; "
                "the step at most 1.15x the ideal")


if __name__ == "__main__":
    main()
