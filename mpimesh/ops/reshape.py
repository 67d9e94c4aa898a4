"""Reshape, rename and transpose (broadcast, the adjoint of a sum, is with einsum).

A reshape that merges or splits dims moves no data when every split dim leads its group of
merged/split dims and keeps its mesh dim, and its blocks hold the same elements before and after
(always when the mesh dim divides both sizes; `numpy.array_split` blocks of other sizes often do
not); otherwise only the offending groups are gathered, reshaped and sliced again.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.arange(6).reshape(2, 3), "a:2;b:3")
>>> mm.reshape(x, "ab:6").to_numpy().tolist()
[0, 1, 2, 3, 4, 5]
>>> reshape_groups((2, 3, 4), (6, 2, 2))
(((0, 1), (0,)), ((2,), (1, 2)))
"""
from __future__ import annotations

import math
from functools import lru_cache

from ..errors import ShapeError
from ..layout import TensorLayout, block, local_sizes, splitting
from ..opdef import OpDef
from ..shape import Dimension, Shape, ShapeLike
from ..tensor import tensor_arg
from ..trace import dispatch
from .relayout import to_layout


@lru_cache(maxsize=4096)
def reshape_groups(old: tuple, new: tuple) -> tuple:
    """Pair runs of old and new axes with equal products."""
    if 0 in old or 0 in new:
        return ((tuple(range(len(old))), tuple(range(len(new)))),)
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        gi, gj, po, pn = [], [], 1, 1
        if i < len(old):
            gi.append(i)
            po *= old[i]
            i += 1
        if j < len(new):
            gj.append(j)
            pn *= new[j]
            j += 1
        while po != pn:
            if po < pn:
                gi.append(i)
                po *= old[i]
                i += 1
            else:
                gj.append(j)
                pn *= new[j]
                j += 1
        groups.append((tuple(gi), tuple(gj)))
    return tuple(groups)


@lru_cache(maxsize=4096)
def reshape_plan(old: Shape, new: Shape, mesh_shape: Shape, src: TensorLayout, dst: TensorLayout) -> tuple:
    """`(mid, post)`: x is brought to layout `mid`, reshaped locally, giving layout `post`.

    A group keeps the mesh dim m of its leading new dim only if the blocks of its leading old dim
    over m hold exactly the elements of the new dim's blocks (always when m divides both sizes).

    >>> mesh = Shape("x:3")
    >>> reshape_plan(Shape("a:6;b:2"), Shape("ab:12"), mesh, ("x", None), ("x",))
    (('x', None), ('x',))
    >>> reshape_plan(Shape("a:5;b:2"), Shape("ab:10"), mesh, ("x", None), ("x",))  # blocks 2,2,1 vs 4,3,3
    ((None, None), (None,))
    """
    def eff(m):
        return splitting(m, mesh_shape)
    mid, post = [None] * old.rank, [None] * new.rank
    for gi, gj in reshape_groups(old.sizes, new.sizes):
        new_split = [(p, eff(dst[p])) for p in gj if eff(dst[p])]
        if len(new_split) == 1 and new_split[0][0] == gj[0] and gi:
            m = new_split[0][1]
            if _aligned(old.sizes[gi[0]], math.prod(old.sizes[i] for i in gi[1:]), new.sizes[gj[0]],
                        math.prod(new.sizes[j] for j in gj[1:]), mesh_shape[m].size):
                mid[gi[0]], post[gj[0]] = m, m
    return tuple(mid), tuple(post)


def _aligned(n: int, rest: int, n2: int, rest2: int, k: int) -> bool:
    """Whether the k blocks of n rows of `rest` elements cover the same flat ranges as the k
    blocks of n2 rows of `rest2` (n * rest == n2 * rest2)."""
    return all(block(n, k, c)[0] * rest == block(n2, k, c)[0] * rest2 for c in range(1, k))


def _reshape_grad(op, dy):
    return [reshape(dy, op.inputs[0].shape)]


def _reshape(ctx, a, shape: Shape, sizes: tuple):
    """The kernel: this rank's block `a` as its block `sizes` of the new `shape` (a view)."""
    return a.reshape(sizes)


RESHAPE = OpDef("reshape", _reshape, grad=_reshape_grad, saves=((), ()), view=lambda params, ins, outs: 0)


def reshape(x, new_shape: ShapeLike):
    """The same elements (row-major order) under `new_shape`."""
    new = Shape(new_shape)
    if tensor_arg("reshape", x).shape.size != new.size:
        raise ShapeError(f"cannot reshape {x.shape} ({x.shape.size} elements) to {new} ({new.size} elements)")
    if new == x.shape:
        return to_layout(x, x.mesh.plan(new))
    mesh = x.mesh
    dst = mesh.plan(new)
    mid, post = reshape_plan(x.shape, new, mesh.shape, x.tensor_layout, dst)
    x = to_layout(x, mid)
    sizes = local_sizes(new, mesh.shape, post, mesh.coords)
    (y,) = dispatch(RESHAPE, [x], [(new, post)], {"shape": new, "sizes": sizes})
    return to_layout(y, dst)


def rename_dimension(x, old_name: str, new_name: str):
    """x with dim `old_name` renamed `new_name` (laid out by the rules for the new name)."""
    if not isinstance(old_name, str):
        raise ShapeError(f"rename_dimension: the dim to rename must be given by name, got {old_name!r}")
    d = tensor_arg("rename_dimension", x).shape[old_name]
    return reshape(x, [Dimension(new_name, d.size) if e.name == old_name else e for e in x.shape])


TRANSPOSE = OpDef("transpose", lambda ctx, a, perm: ctx.xp.transpose(a, perm),
                  grad=lambda op, dy: [transpose(dy, op.inputs[0].shape)], saves=((), ()))


def transpose(x, new_shape: ShapeLike):
    """x with its dims reordered as `new_shape`."""
    new = Shape(new_shape)
    if sorted(new.dims) != sorted(tensor_arg("transpose", x).shape.dims):
        raise ShapeError(f"transpose: {new} is not a permutation of {x.shape}")
    dst = x.mesh.plan(new)
    x = to_layout(x, tuple(dst[new.index(n)] for n in x.shape.names))
    perm = tuple(x.shape.index(n) for n in new.names)
    (y,) = dispatch(TRANSPOSE, [x], [(new, dst)], {"perm": perm})
    return y
