"""Elementwise passes over memory and their bytes per Transformer training step, counted from the
compiled step's program before and after the fusion pass (`mpimesh.fusion`), and what it fused.

    python benchmarks/fusion.py                 # benchmarks/gpu.py's tiny model (the CPU smoke run's)
    python benchmarks/fusion.py --size full     # its GPU step (d_model 1024, batch 32 x 512): records for long

A count, not a timing: the step (apps/transformer.py's, Adam, one rank) is recorded once by
`mm.compile` on numpy, with float32 or bfloat16 activations; a pass is a step of an op that declares
itself elementwise (`OpDef.cexpr`), its bytes each distinct input block read once and each output
written once (`fusion.traffic`); "after" is the program as the CuPy engine runs it (`fusion.fuse`, then
`rowfusion.fold`: chains inside the layer norm row kernels add bytes, not passes).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as app  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import fusion, rowfusion  # noqa: E402

SIZES = {"full": {"d_model": 1024, "heads": 16, "d_kv": 64, "d_ff": 4096, "layers": 4, "batch": 32, "length": 512},
         "tiny": {"d_model": 64, "heads": 4, "d_kv": 16, "d_ff": 256, "layers": 2, "batch": 8, "length": 64}}
"""benchmarks/gpu.py's sizes."""


def program(dtype: str, size: str):
    """The compiled Transformer step's program (shapes only) for activations of `dtype`."""
    cfg = app.Config(optimizer="adam", lr=3e-3, warmup=20, dtype=dtype, **SIZES[size])
    mesh = mm.Mesh("all:1", backend="numpy", comm=mm.MPI.COMM_SELF)
    data = np.random.default_rng(1).integers(0, 256, size=1 << 16).astype(np.uint8)
    batch = app.make_batch(mesh, data, cfg, app.train_offsets(data, cfg, 0, 0))
    opt = app.make_optimizer(cfg)
    params = app.init_params(mesh, cfg)
    step = mm.compile(app.make_train_step(cfg, opt))
    step(params, opt.init(params), batch)
    return step.programs()[-1]


def counts(dtype: str, size: str) -> tuple:
    """`((passes, bytes) before, (passes, bytes) after, fused groups' member names)`."""
    p = program(dtype, size)
    fused = rowfusion.fold(fusion.fuse(p.ops, p.output_ids), p.output_ids)
    groups = ["+".join(r.name for r in rec.members) for rec in fused
              if isinstance(rec, (fusion.FusedRecord, rowfusion.RowRecord))]
    return fusion.traffic(p.ops), fusion.traffic(fused), groups


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = ap.parse_args(argv)
    print(f"Transformer step ({args.size}): elementwise passes and bytes per step, before and after fusion")
    print(f"{'activations':<12}{'passes':>16}{'ratio':>8}{'MiB':>22}{'ratio':>8}")
    for dtype in ("float32", "bfloat16"):
        (n0, b0), (n1, b1), groups = counts(dtype, args.size)
        print(f"{dtype:<12}{f'{n0} -> {n1}':>16}{n1 / n0:>8.2f}{f'{b0 / 2**20:.1f} -> {b1 / 2**20:.1f}':>22}"
              f"{b1 / b0:>8.2f}")
        print("  fused: " + ", ".join(f"{k} x{n}" for k, n in Counter(groups).items()))


if __name__ == "__main__":
    main()
