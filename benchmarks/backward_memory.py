"""Peak memory of a training step's forward and backward with `mm.gradients`' defaults, with and without
`mm.remat`, at several depths: the table of issue 41 (residual relu blocks, batch 256, d 24, f 96, one
rank, float32; peaks of live arrays from `mm.profile(memory=True)`).

    python benchmarks/backward_memory.py [--depths 8 16 32]

Columns: the forward's peak, the whole step's peak, and the backward's own part (the step's peak less
what the forward left alive and less the gradients it returns), each with defaults and with
`retain=True` (every intermediate kept for a second backward pass, PyTorch's `retain_graph`). Memory
is deterministic here: no timing, no reference run needed.
"""
from __future__ import annotations

import argparse
import tracemalloc

import numpy as np

import mpimesh as mm


def residual_blocks(depth: int, seed: int = 0):
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    rng = np.random.default_rng(seed)
    x = mesh.from_numpy(rng.standard_normal((256, 24)).astype("float32"), "batch:256;d:24")
    params = [{"w1": mesh.from_numpy((rng.standard_normal((24, 96)) * 0.1).astype("float32"), "d:24;f:96"),
               "w2": mesh.from_numpy((rng.standard_normal((96, 24)) * 0.1).astype("float32"), "f:96;d:24")}
              for _ in range(depth)]
    return x, params


def block(p, h):
    return h + mm.einsum([mm.relu(mm.einsum([h, p["w1"]])), p["w2"]])


def step_peaks(x, params, remat: bool, retain: bool) -> dict:
    """Bytes: `forward` (its peak), `step` (the whole step's), `backward` (the backward's own part)."""
    weights = [w for p in params for w in p.values()]
    with mm.profile(memory=True) as whole:
        with mm.trace():
            with mm.profile(memory=True) as fwd:
                h = x
                for p in params:
                    h = (mm.remat(block) if remat else block)(p, h)
                loss = mm.reduce_sum(h * h)
            left = tracemalloc.get_traced_memory()[0]
            grads = mm.gradients([loss], weights, retain=retain)
        grad_bytes = sum(g.local.nbytes for g in grads)
        del grads, h, loss
    step = int(whole.peak_bytes["arrays"])
    return {"forward": int(fwd.peak_bytes["arrays"]), "step": step, "backward": step - left - grad_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32])
    args = ap.parse_args()
    print(f"{'depth':>5} {'remat':>5} {'gradients':>12} {'forward MB':>10} {'step MB':>8} {'backward MB':>11}")
    steps = {}
    for depth in args.depths:
        x, params = residual_blocks(depth)
        for remat in (False, True):
            for retain in (False, True):
                r = step_peaks(x, params, remat, retain)
                steps[depth, remat, retain] = r["step"]
                print(f"{depth:>5} {str(remat):>5} {'retain=True' if retain else 'default':>12} "
                      f"{r['forward'] / 1e6:>10.2f} {r['step'] / 1e6:>8.2f} {r['backward'] / 1e6:>11.2f}")
    for depth in args.depths:
        print(f"depth {depth}: the step's peak with remat / without, defaults: "
              f"{steps[depth, True, False] / steps[depth, False, False]:.2f}")


if __name__ == "__main__":
    main()
