"""Rematerialisation (`mm.remat` on each block's two sublayers) on a 4-layer Transformer: peak
memory, step time, and the cost model's prediction of the peak, each against the same step
without remat in the same run.

Run (common.py fixes the BLAS environment by itself: one BLAS thread per rank):

    mpiexec -n N python benchmarks/remat.py [--repeat 7] [--layers 4 --batch 16 --length 128 ...]

The step is `apps/transformer.py`'s training step (forward, `mm.gradients`, Adafactor)
with `Config(remat=0)` and `Config(remat=layers)` (every block's sublayers), data-parallel over
all ranks (`batch:all`).
- Peak activation bytes per rank: `mm.profile(memory=True)`'s peak of live arrays during the
  step's forward and backward pass (the arrays made inside it: activations, gradients; the
  parameters and the batch were made before). Bar: with remat at most 40% of without.
- Step time: median of `--repeat` interleaved eager steps, and of compiled steps (`mm.compile`).
  Bar: at most 1.4x without (remat adds one forward pass of every block: about 1.33x of the
  compute).
- The cost model's predicted peak (`mm.cost.record` of the same forward and backward, dry, then
  `activation_bytes`) beside the measured one. Bar: within 10%.
Ratios only: no verdict against absolute times from another machine.
"""
import common  # noqa: F401  (first: clean BLAS environment, may re-exec)

import argparse
import os
import sys
from dataclasses import replace

import numpy as np

import mpimesh as mm
from common import WORLD, compare, kernel_report, rank0_print, table

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as T  # noqa: E402


def grads_fn(cfg):
    """forward + backward of the loss: (loss, gradients) -- what remat changes."""
    def fn(params, batch):
        names = sorted(params)
        with mm.trace():
            loss = T.loss_fn(params, batch, cfg, True, 0)
            grads = mm.gradients([loss], [params[n] for n in names])
        return loss, grads
    return fn


def measured_peak(fn, params, batch) -> int:
    with mm.profile(memory=True) as prof:
        out = fn(params, batch)
    del out
    return int(prof.peak_bytes["arrays"])


def predicted_peak(fn, params, batch, mesh) -> int:
    return int(mm.cost.record(fn, (params, batch), mesh).activation_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    a = ap.parse_args()
    n = WORLD.Get_size()
    mesh = mm.Mesh(f"all:{n}", layout="batch:all")
    cfg = T.Config(d_model=a.d_model, heads=a.heads, d_kv=a.d_model // a.heads, d_ff=a.d_ff, layers=a.layers,
                   length=a.length, batch=a.batch)
    rank0_print(f"remat benchmark: {a.layers}-layer Transformer, batch {a.batch} x length {a.length}, d_model "
                f"{a.d_model}, d_ff {a.d_ff}, {n} rank(s), batch:all\n{kernel_report()}")
    params = T.init_params(mesh, cfg)
    rng = np.random.default_rng(0)
    batch = T.make_batch(mesh, rng.integers(0, 256, 1 << 16).astype(np.uint8), cfg,
                         rng.integers(0, (1 << 16) - cfg.length - 1, cfg.batch))
    rows, times = [], {}
    steps = {}
    for remat in (0, cfg.layers):
        c = replace(cfg, remat=remat)
        fn = grads_fn(c)
        peak = max(measured_peak(fn, params, batch) for _ in range(2))
        pred = predicted_peak(fn, params, batch, mesh)
        opt = T.make_optimizer(c)
        state = opt.init(params)
        eager, compiled = T.make_train_step(c, opt), mm.compile(T.make_train_step(c, opt))
        steps[f"eager{'+remat' if remat else ''}"] = (lambda s=eager, st=state: s(params, st, batch, 0))
        steps[f"compiled{'+remat' if remat else ''}"] = (lambda s=compiled, st=state: s(params, st, batch, 0))
        rows.append([remat, peak, pred, pred / peak])
    times = compare(steps, repeat=a.repeat)
    peaks = WORLD.allreduce(np.array([r[1] for r in rows]), op=mm.MPI.MAX)
    rank0_print(table(["remat", "peak bytes (measured)", "predicted", "predicted/measured"],
                      [[r[0], int(p), r[2], f"{r[3]:.3f}"] for r, p in zip(rows, peaks)]))
    rank0_print(f"peak with remat / without: {peaks[1] / peaks[0]:.3f}  (bar <= 0.40)")
    for mode in ("eager", "compiled"):
        t0, t1 = times[mode][1], times[f"{mode}+remat"][1]
        rank0_print(f"{mode:>8}: step {t0 * 1e3:8.1f} ms, with remat {t1 * 1e3:8.1f} ms: {t1 / t0:.3f}x "
                    f"(bar <= 1.4x; min {times[f'{mode}+remat'][0] / times[mode][0]:.3f}x)")


if __name__ == "__main__":
    main()
