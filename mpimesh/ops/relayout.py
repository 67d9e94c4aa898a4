"""Relayout: the same values under another layout, with the least communication.

Per mesh dim: a dim that becomes split is sliced locally (no communication), a dim that stops
being split is all-gathered, and a mesh dim moving from one tensor dim to another costs one
alltoall. A partial tensor's pending sum (DTensor's `Partial`) is taken first: a reduce-scatter where
the target splits a dim over a mesh dim of the sum, an allreduce for the rest (`sum_partial`).

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.eye(2), "a:2;b:2", layout="a:all")
>>> mm.relayout(x, "b:all").layout
{'b': 'all'}
>>> relayout_plan(mm.Shape("a:4;b:4"), mm.Shape("m:2"), ("m", None), (None, "m"))
(('alltoall', 'm', 1, 0),)
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ..errors import ShapeError
from ..layout import TensorLayout, layout_from_spec, splitting
from ..opdef import OpDef
from ..partials import deferred
from ..shape import Shape
from ..tensor import tensor_arg
from ..trace import dispatch


@lru_cache(maxsize=4096)
def relayout_plan(shape: Shape, mesh_shape: Shape, src: TensorLayout, dst: TensorLayout) -> tuple:
    """Steps taking layout `src` to `dst`: `("slice", mesh_dim, axis)`, `("allgather",
    mesh_dim, axis)` or `("alltoall", mesh_dim, split_axis, concat_axis)`."""
    cur = [splitting(m, mesh_shape) for m in src]
    moves = {}
    for m in mesh_shape.names:
        s = src.index(m) if m in src else None
        d = dst.index(m) if m in dst else None
        if s != d and mesh_shape[m].size > 1:
            moves[m] = (s, d)
    steps = []
    while moves:
        # Slices and alltoalls whose target dim is free come first: they shrink the data.
        ready = [m for m, (s, d) in moves.items() if d is not None and cur[d] is None]
        if ready:
            m = ready[0]
            s, d = moves.pop(m)
            if s is None:
                steps.append(("slice", m, d))
            else:
                steps.append(("alltoall", m, d, s))
                cur[s] = None
            cur[d] = m
            continue
        gathers = [m for m, (s, d) in moves.items() if d is None]
        m = gathers[0] if gathers else next(iter(moves))  # otherwise a cycle: break it by a gather
        s, d = moves.pop(m)
        steps.append(("allgather", m, s))
        cur[s] = None
        if d is not None:
            moves[m] = (None, d)
    return tuple(steps)


def _relayout(ctx, x, layout: TensorLayout, steps: tuple, shape: Shape):
    """The kernel: `steps` (`relayout_plan`) on this rank's block `x` of a tensor of global `shape`
    (whose sizes fix the uneven blocks); `layout`, the layout they give, is for the record. It runs on
    `Aval`s too (the dry run)."""
    for step in steps:
        if step[0] == "slice":
            x = ctx.block(x, step[1], step[2])
        elif step[0] == "allgather":
            x = ctx.allgather(x, step[1], step[2], shape[step[2]].size)
        else:
            x = ctx.alltoall(x, step[1], step[2], step[3], shape[step[3]].size)
    return x


def _relayout_grad(op, dy):
    x = op.inputs[0]
    walk = deferred(x) if dy.partial else None  # a gathered weight's gradient: reduce-scattered behind the walk
    g = walk.scatter(dy, x.tensor_layout) if walk is not None else None
    return [to_layout(dy, x.tensor_layout) if g is None else g]


def _start_relayout(params: dict):
    """A relayout that is one allgather (a sharded weight before its einsum), started without waiting."""
    steps = params["steps"]
    if len(steps) != 1 or steps[0][0] != "allgather":
        return None
    _, mesh_dim, axis = steps[0]
    size = params["shape"][axis].size
    return lambda ctx, x: ctx.iallgather(x, mesh_dim, axis, size)


def _bytes(a) -> int:
    return math.prod(a.shape) * np.dtype(a.dtype).itemsize


def _inner(shape, axis: int) -> bool:
    """Whether blocks cut along `axis` of an array of `shape` are not contiguous slabs: an allgather along
    it receives into a buffer of its own, then reorders."""
    return math.prod(shape[:axis]) > 1


def _relayout_scratch(params, ins, outs) -> int:
    """The receive buffer of an allgather along an inner axis (the output's size, then reordered into it)."""
    gathers = [axis for kind, _, axis, *_ in params["steps"] if kind == "allgather"]
    return _bytes(outs[0]) if any(_inner(outs[0].shape, axis) for axis in gathers) else 0


RELAYOUT = OpDef("relayout", _relayout, grad=_relayout_grad, saves=((), ()), linear=True, partial_grads=True,
                 abstract=lambda ctx, shapes, x, **params: (_relayout(ctx, x, **params).dtype,),
                 view=lambda params, ins, outs: None if params["steps"] else 0, start=_start_relayout,
                 scratch=_relayout_scratch)


def sum_kernel(ctx, x, mesh_dims: tuple, dtype=None, scatter: tuple = (), bucket=None):
    """`sum_partial`'s kernel (and a gradient bucket's, `mpimesh.buckets`): `x`'s terms summed over
    `mesh_dims`, then over each `(mesh dim, axis)` of `scatter` keeping this rank's block of that axis;
    rounded to `dtype` where given (a 16-bit result of float32 terms). `bucket`: the gradient bucket a
    replay sums it with."""
    if mesh_dims:
        x = ctx.allreduce(x, mesh_dims)
    for m, axis in scatter:
        x = ctx.reduce_scatter(x, m, axis)
    return x if dtype is None or x.dtype == dtype else x.astype(dtype)


def sum_abstract(ctx, shapes, x, **params) -> tuple:
    """`sum_kernel`'s dry run: its collectives counted, its dtype."""
    return (sum_kernel(ctx, x, **params).dtype,)


def _start_sum(params: dict):
    """A sum that is one reduce-scatter (a sharded weight's gradient), started without waiting."""
    if params["mesh_dims"] or len(params["scatter"]) != 1 or params.get("dtype") is not None:
        return None
    ((mesh_dim, axis),) = params["scatter"]
    return lambda ctx, x: ctx.ireduce_scatter(x, mesh_dim, axis)


SUM_PARTIAL = OpDef("psum", sum_kernel, grad=lambda op, dy: [to_layout(dy, op.inputs[0].tensor_layout)],
                    saves=((), ()), partial_inputs=True, abstract=sum_abstract, start=_start_sum)
"""The sum a partial tensor awaits (named as JAX's `lax.psum`)."""


def sum_partial(x, target: TensorLayout, dtype=None):
    """`x` (a `PartialTensor`) with its pending sum taken, in a layout on the way to `target`: each
    mesh dim of the sum that `target` splits a dim over, where `x` does not, a reduce-scatter along that
    dim; the others summed whole (one allreduce); rounded to `dtype` (default: `x.rounds_to`, the 16-bit
    result of float32 terms) where given.

    >>> import mpimesh as mm
    >>> from mpimesh.tensor import PartialTensor
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> sum_partial(PartialTensor(mesh, mm.Shape("a:2"), (None,), mesh.xp.ones(2), ("all",)), (None,)).partial
    ()
    """
    layout, params = sum_plan(x, target, dtype)
    (y,) = dispatch(SUM_PARTIAL, [x], [(x.shape, layout)], params)
    return y


def sum_plan(x, target: TensorLayout, dtype=None) -> tuple:
    """`sum_partial`'s `(result layout, SUM_PARTIAL's params)`."""
    layout, scatter = list(x.tensor_layout), []
    for m in x.partial:
        if m in target and m not in x.tensor_layout and splitting(m, x.mesh.shape):
            axis = target.index(m)
            if layout[axis] is None:
                scatter.append((m, axis))
                layout[axis] = m
    scattered = {m for m, _ in scatter}
    whole = tuple(n for n in x.mesh.shape.names if n in x.partial and n not in scattered)
    params = {"mesh_dims": whole, "scatter": tuple(scatter)}
    dtype = x.rounds_to if dtype is None else dtype
    if dtype is not None and dtype != x.dtype:
        params["dtype"] = dtype
    return tuple(layout), params


def to_layout(x, tensor_layout: TensorLayout):
    """`x` with the given tensor layout (a tuple with one mesh dim or None per dim); a partial tensor
    summed first (`sum_partial`)."""
    if x.partial:
        x = sum_partial(x, tensor_layout)
    if x.tensor_layout == tensor_layout:
        return x
    steps = relayout_plan(x.shape, x.mesh.shape, x.tensor_layout, tensor_layout)
    (y,) = dispatch(RELAYOUT, [x], [(x.shape, tensor_layout)],
                    {"layout": tensor_layout, "steps": steps, "shape": x.shape})
    return y


def laid_out_within(t, x, what: str, role: str):
    """`t`, whose dims must be a subset of `x`'s (ShapeError naming the dim otherwise: `"{what}: {role}
    dim ..."`), in the layout `x`'s layout gives those dims: a bias or scale beside its input."""
    for d in t.shape:
        if d not in x.shape:
            raise ShapeError(f"{what}: {role} dim {d.name}:{d.size} is not in the input shape {x.shape}")
    return to_layout(t, tuple(x.tensor_layout[x.shape.index(n)] for n in t.shape.names))


def relayout(x, layout):
    """The same values laid out as `layout`: a rules string, list or dict; unnamed dims replicated.

    Example: `mm.relayout(x, "batch:rows;hidden:cols")`.
    """
    tensor_arg("relayout", x)
    return to_layout(x, layout_from_spec(x.shape, x.mesh.shape, layout))
