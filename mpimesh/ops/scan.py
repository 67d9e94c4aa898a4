"""Cumulative sums along a named dim, split or not, without gathering it.

Each rank sums its own block cumulatively, then adds the sum of the blocks before it (`ctx.exscan`
of the block totals along the mesh dim that splits the dim). `reverse=True` (the gradient)
allgathers the block totals instead and adds those after its own (exact, unlike total minus
prefix). Unequal or empty blocks pass one total each (zero when empty): equal-block collectives.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.array([1, 2, 3, 4]), "i:4")
>>> [mm.cumsum(x, "i", exclusive=e, reverse=r).to_numpy().tolist() for e, r in ((0, 0), (1, 0), (0, 1))]
[[1, 3, 6, 10], [0, 1, 3, 6], [10, 9, 7, 4]]
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Union

import numpy as np

from ..backend import accumulation_dtype
from ..layout import splitting
from ..opdef import Aval, OpDef
from ..shape import Dimension
from ..trace import dispatch
from .relayout import to_layout
from .slicing import dim_name_of


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
    name = dim_name_of(x, dim, "cumsum")
    axis = x.shape.index(name)
    layout = x.mesh.plan(x.shape)
    x = to_layout(x, layout)
    params = {"dim": name, "exclusive": bool(exclusive), "reverse": bool(reverse), "axis": axis,
              "mesh_dim": splitting(layout[axis], x.mesh.shape)}
    (y,) = dispatch(CUMSUM, [x], [(x.shape, layout)], params)
    return y


def _cumsum(ctx, a, dim, exclusive, reverse, axis, mesh_dim):
    """The kernel: this block's cumulative sum plus the totals of the blocks before it (after it,
    `reverse`) along `mesh_dim`; 16-bit floats in float32 (bfloat16 alone stalls at 512)."""
    xp = ctx.xp
    low = a.dtype
    wide = accumulation_dtype(low)
    a = a.astype(wide) if wide != low else a
    c = _local_cumsum(xp, a, axis, exclusive, reverse)
    if mesh_dim is not None:
        total = xp.sum(a, axis=axis, keepdims=True, dtype=c.dtype)
        if not reverse:
            c = c + ctx.exscan(total, mesh_dim)
        else:
            k = ctx.size((mesh_dim,))
            totals = ctx.allgather(total, mesh_dim, axis)  # k totals along `axis` (one per rank), in coordinate order
            after = (xp.arange(k) > ctx.coord(mesh_dim)).reshape((1,) * axis + (k,) + (1,) * (a.ndim - axis - 1))
            later = xp.where(after, totals, xp.zeros((), dtype=c.dtype))
            c = c + xp.sum(later, axis=axis, keepdims=True, dtype=c.dtype)
    return c.astype(low) if c.dtype != low and low != bool else c


@lru_cache(maxsize=64)
def _sum_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype numpy's cumulative sum of a block of `dtype` (widened as the kernel does) has."""
    return _local_cumsum(np, np.zeros(1, accumulation_dtype(dtype)), 0, False, False).dtype


def _abstract(ctx, shapes, a, dim, exclusive, reverse, axis, mesh_dim) -> tuple:
    """The kernel's collective on the block totals (one per position of the other dims), and its dtype."""
    wide = _sum_dtype(np.dtype(a.dtype))
    if mesh_dim is not None:
        total = Aval(a.shape[:axis] + (1,) + a.shape[axis + 1:], wide)
        if reverse:
            ctx.allgather(total, mesh_dim, axis)
        else:
            ctx.exscan(total, mesh_dim)
    return (wide if a.dtype == bool else np.dtype(a.dtype),)


def _flops(params, ins, outs) -> int:
    """One addition per element; split, one more for its block's total and one for the offset added."""
    n = math.prod(ins[0].shape)
    return n if params["mesh_dim"] is None else 3 * n


def _cumsum_grad(op, dy):
    p = op.params
    return [cumsum(dy, p["dim"], p["exclusive"], not p["reverse"])]


CUMSUM = OpDef("cumsum", _cumsum, grad=_cumsum_grad, saves=((), ()), flops=_flops, abstract=_abstract)
