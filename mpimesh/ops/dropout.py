"""Dropout with a layout-independent mask.

Whether element i of the global tensor is kept is a hash of (seed, i) (the counter-based hash of
`ops/random.py`), so for the same seed and shape the mask is the same on 1 rank or 8, under any
layout, and each rank computes only its own slice of it: no communication.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> y = mm.dropout(mesh.ones("a:1000"), 0.25, seed=3).to_numpy()
>>> sorted(set(y.tolist())) == [0.0, np.float32(1 / 0.75)], bool(abs((y > 0).mean() - 0.75) < 0.05)
(True, True)
"""
from __future__ import annotations

import numbers

from ..errors import MpimeshError
from ..trace import dispatch
from .random import check_seed, global_index, uniform01
from .relayout import to_layout

_STREAM = 0x44524F50  # "DROP": a stream of the hash that random_uniform/random_normal do not use


def dropout(x, rate: float, seed: int):
    """x with each element zeroed with probability `rate` and the kept ones scaled by 1/(1-rate).

    The mask depends only on `seed` and x's shape. `rate` 0 returns x. Gradient: dy through the
    same mask and scale.
    """
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
        raise MpimeshError(f"dropout rate must be a number in [0, 1), got {rate!r}")
    rate = float(rate)
    seed = check_seed(seed, "dropout")
    if rate == 0.0:
        return x
    layout = x.mesh.plan(x.shape)
    x = to_layout(x, layout)
    shape, mesh_shape = x.shape, x.mesh.shape
    split = tuple(m for m in layout if m)
    scale = 1.0 / (1.0 - rate)

    def lower(ctx, a):
        xp = ctx.xp
        index = global_index(xp, shape, mesh_shape, layout, {m: ctx.coord(m) for m in split}, a.shape)
        keep = uniform01(xp, index, seed, _STREAM) >= rate
        return xp.where(keep, a * scale, xp.zeros((), dtype=a.dtype)).astype(a.dtype)

    (y,) = dispatch("dropout", [x], [(x.shape, layout)], lower, {"rate": rate, "seed": seed},
                    lambda op, dy: [dropout(dy, op.params["rate"], op.params["seed"])])
    return y
