"""Cumulative sums along a named dim, split or not, without gathering it.

Each rank takes the cumulative sum of its own block, then adds the sum of the blocks before it:
`ctx.exscan` of its block totals (one element per position of the other dims) along the mesh dim
that splits the dim. `reverse=True` (the gradient) sums from the end instead: the block totals are
allgathered along that mesh dim (k values per position, not the data) and each rank adds those of
the coordinates after its own (exact, unlike total-minus-prefix). Blocks may be unequal or empty
(`numpy.array_split`): every rank still passes one total per position (zero for an empty block),
so both collectives move equal blocks.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.array([1, 2, 3, 4]), "i:4")
>>> mm.cumsum(x, "i").to_numpy().tolist(), mm.cumsum(x, "i", exclusive=True).to_numpy().tolist()
([1, 3, 6, 10], [0, 1, 3, 6])
>>> mm.cumsum(x, "i", reverse=True).to_numpy().tolist()
[10, 9, 7, 4]
"""
from __future__ import annotations

from typing import Union

from ..backend import accumulation_dtype
from ..layout import splitting
from ..shape import Dimension
from ..trace import dispatch_lower, saving
from .relayout import to_layout
from .slicing import _dim_name


def _local_cumsum(xp, a, axis: int, exclusive: bool, reverse: bool):
    """Cumulative sum of the local block along `axis` (from the end if `reverse`)."""
    dt = None if a.dtype == bool else a.dtype  # keep int32 int32 (numpy would widen it)
    b = xp.flip(a, axis) if reverse else a
    c = xp.cumsum(b, axis=axis, dtype=dt)
    if exclusive and a.shape[axis]:
        zero = xp.zeros(a.shape[:axis] + (1,) + a.shape[axis + 1:], dtype=c.dtype)
        c = xp.concatenate([zero, xp.take(c, xp.arange(a.shape[axis] - 1), axis=axis)], axis=axis)
    return xp.flip(c, axis) if reverse else c


def cumsum(x, dim: Union[str, Dimension], exclusive: bool = False, reverse: bool = False):
    """Cumulative sum of x along `dim` (`exclusive`: the sum of the elements strictly before;
    `reverse`: from the end); 16-bit floats are summed in float32 and rounded once. Gradient: the
    cumulative sum of dy the other way round."""
    name = _dim_name(x, dim, "cumsum")
    axis = x.shape.index(name)
    layout = x.mesh.plan(x.shape)
    x = to_layout(x, layout)
    m = splitting(layout[axis], x.mesh.shape)
    k = x.mesh.shape[m].size if m else 1
    exclusive, reverse = bool(exclusive), bool(reverse)
    wide = accumulation_dtype(x.dtype)  # 16-bit floats sum in float32, rounded once (bfloat16 stalled at 512)

    def lower(ctx, a):
        xp = ctx.xp
        low, a = a.dtype, (a.astype(wide) if wide != x.dtype else a)
        c = _local_cumsum(xp, a, axis, exclusive, reverse)
        if m is not None:
            total = xp.sum(a, axis=axis, keepdims=True, dtype=c.dtype)
            if not reverse:
                c = c + ctx.exscan(total, m)
            else:
                totals = ctx.allgather(total, m, axis)  # k totals along `axis` (one per rank), in coordinate order
                after = (xp.arange(k) > ctx.coord(m)).reshape((1,) * axis + (k,) + (1,) * (a.ndim - axis - 1))
                later = xp.where(after, totals, xp.zeros((), dtype=c.dtype))
                c = c + xp.sum(later, axis=axis, keepdims=True, dtype=c.dtype)
        return c.astype(low) if c.dtype != low and low != bool else c

    (y,) = dispatch_lower("cumsum", [x], [(x.shape, layout)], lower,
                    {"dim": name, "exclusive": exclusive, "reverse": reverse}, _cumsum_grad)
    return y


def _cumsum_grad(op, dy):
    p = op.params
    return [cumsum(dy, p["dim"], p["exclusive"], not p["reverse"])]


saving(_cumsum_grad)
