"""Uneven shards: the Transformer step with a vocabulary its mesh dim does not divide.

    mpiexec -n 2 python benchmarks/uneven.py

The model is benchmarks/transformer.py's (d_model 1024, d_ff 4096, 16 heads of 64, 2 layers, length
128, batch 8, Adafactor) with vocabulary 257 against 256, the vocab dim split over all ranks
("vocab:all", and the model-parallel "heads:all;d_ff:all;vocab:all"): 257 over 2 ranks leaves
blocks of 129 and 128 rows of the embedding and logits matrices. For each layout it prints:

- the loss and gradients of one vocabulary-257 step against the same step on one rank
  (`COMM_SELF`, nothing split): the largest relative difference per tensor;
- the step times of vocabulary 257 and 256, interleaved run by run, and their ratio (bar 1.05).
"""
from __future__ import annotations

import common  # noqa: F401  (first: fixes the BLAS environment)

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
from common import WORLD, compare, kernel_report, rank0_print, table, verdict  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as app  # noqa: E402

import mpimesh as mm  # noqa: E402

LAYOUTS = {"vocab split": "vocab:all", "model-parallel": "heads:all;d_ff:all;vocab:all"}


def loss_and_grads(mesh: mm.Mesh, cfg: "app.Config", data: np.ndarray) -> tuple:
    """The loss and gradients (global arrays, float64) of step 0's batch at seed-0 parameters."""
    params = app.init_params(mesh, cfg)
    batch = app.make_batch(mesh, data, cfg, app.train_offsets(data, cfg, 0, 0))
    names = sorted(params)
    with mm.trace():
        loss = app.loss_fn(params, batch, cfg)
        grads = mm.gradients([loss], [params[n] for n in names])
    return float(loss), {n: g.to_numpy().astype(np.float64) for n, g in zip(names, grads)}


def worst(a: dict, b: dict) -> tuple:
    """(name, max |a - b| / max |b|) of the tensor that differs most."""
    errs = {n: float(np.abs(a[n] - b[n]).max() / max(np.abs(b[n]).max(), 1e-30)) for n in b}
    name = max(errs, key=errs.get)
    return name, errs[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per vocabulary (interleaved)")
    args = ap.parse_args()
    rank0_print(kernel_report())
    n = WORLD.Get_size()
    sizes = dict(d_model=1024, heads=16, d_kv=64, d_ff=4096, layers=2, length=128, batch=args.batch)
    data = np.random.default_rng(1).integers(0, 256, size=1 << 16).astype(np.uint8)
    one = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    ref_loss, ref_grads = loss_and_grads(one, app.Config(vocab=257, **sizes), data)
    rows, ok = [], True
    for name, rules in LAYOUTS.items():
        mesh = mm.Mesh(f"all:{n}", layout=rules)
        loss, grads = loss_and_grads(mesh, app.Config(vocab=257, **sizes), data)
        tensor, err = worst(grads, ref_grads)
        loss_err = abs(loss - ref_loss) / abs(ref_loss)
        steps = {}
        for vocab in (257, 256):
            cfg = app.Config(vocab=vocab, **sizes)
            opt = app.make_optimizer(cfg)
            box = {"p": app.init_params(mesh, cfg)}
            box["s"] = opt.init(box["p"])
            step = app.make_train_step(cfg, opt)
            batch = app.make_batch(mesh, data, cfg, app.train_offsets(data, cfg, 0, 0))

            def run(step=step, batch=batch, box=box):
                box["p"], box["s"], _ = step(box["p"], box["s"], batch)
            steps[f"vocab {vocab}"] = run
        times = compare(steps, repeat=args.steps, warmup=1)
        t257, t256 = times["vocab 257"][1], times["vocab 256"][1]
        ok &= loss_err < 1e-5 and err < 1e-4 and t257 / t256 <= 1.05
        rows.append((name, rules, f"{loss:.6f}", f"{loss_err:.1e}", f"{err:.1e} ({tensor})",
                     f"{t257 * 1e3:.0f}", f"{t256 * 1e3:.0f}", f"{t257 / t256:.3f}"))
    rank0_print(f"\nTransformer step, vocabulary 257 vs 256, on {n} rank(s); reference: the 257 step on one rank "
                f"(loss {ref_loss:.6f}); times are medians of {args.steps} interleaved steps")
    rank0_print(table(("layout", "rules", "loss 257", "loss rel err", "grad max rel err", "257 ms", "256 ms",
                       "257/256"), rows))
    rank0_print(verdict("vocab 257 = one rank (loss 1e-5, grads 1e-4) and step within 1.05x of vocab 256", ok,
                        "; ".join(f"{r[0]}: {r[-1]}x" for r in rows)))


if __name__ == "__main__":
    main()
