"""Reductions over named dims: a local reduction, then an allreduce over the mesh dims of the
reduced dims that are split (`reduce_sum` is a one-input einsum).

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.arange(6.0).reshape(2, 3), "b:2;i:3")
>>> mm.reduce_max(x, reduced_dims="i").to_numpy().tolist(), float(mm.reduce_sum(x).to_numpy())
([2.0, 5.0], 15.0)

The dims to reduce (one name or several) are `reduced_dim=`, the contract's spelling, or
`reduced_dims=`, `mm.einsum`'s: the two are one argument, accepted by einsum and every reduction.
(Ops that reduce exactly one dim, such as `softmax`, `argmax` and `top_k`, name it `reduced_dim`.)
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..backend import accumulation_dtype
from ..errors import DTypeError, ShapeError
from ..opdef import Aval, OpDef, per_element, size
from ..shape import Shape, ShapeLike, dim_names
from ..tensor import tensor_arg
from ..trace import dispatch
from .einsum import contraction_plan, einsum, reduced_dims_arg
from .elementwise import cast, equal, exp
from .nn import local_extreme  # an empty block (uneven split) gives the allreduce's identity
from .relayout import to_layout


def output_shape_of(x, output_shape: Optional[ShapeLike], reduced_dims, op: str = "reduction") -> Shape:
    """The output shape of reducing `x`: `output_shape`, or x without `reduced_dims`, or a scalar."""
    tensor_arg(op, x)
    if output_shape is not None and reduced_dims is not None:
        raise ShapeError("give output_shape or reduced_dims, not both")
    if output_shape is not None:
        out = Shape(output_shape)
        for d in out:
            if d not in x.shape:
                raise ShapeError(f"reduction output dim {d.name}:{d.size} is not in the input shape {x.shape}")
        return out
    if reduced_dims is None:
        return Shape(())
    names = dim_names(reduced_dims, x.shape, "reduction")
    for n in names:
        if n not in x.shape:
            raise ShapeError(f"reduced dim {n!r} is not in the input shape {x.shape}")
    return x.shape.without(names)


def reduce_sum(x, output_shape: Optional[ShapeLike] = None, reduced_dims=None, *, reduced_dim=None):
    """Sum over the dims not in `output_shape` (or over `reduced_dims`; neither: everything)."""
    reduced_dims = reduced_dims_arg("reduce_sum", reduced_dims, reduced_dim)
    return einsum([_counted(x, "reduce_sum")], output_shape_of(x, output_shape, reduced_dims, "reduce_sum"))


def _counted(x, op: str):
    """x, or a bool x as int32: a sum counts the True values (an einsum of bools would be their or)."""
    return cast(x, "int32") if tensor_arg(op, x).dtype == bool else x


def reduce_mean(x, output_shape: Optional[ShapeLike] = None, reduced_dims=None, *, reduced_dim=None):
    """Mean over the reduced dims (of 16-bit floats: summed and scaled in float32, rounded once);
    over an empty dim NaN, as numpy's mean of nothing."""
    reduced_dims = reduced_dims_arg("reduce_mean", reduced_dims, reduced_dim)
    out = output_shape_of(x, output_shape, reduced_dims, "reduce_mean")
    count = math.prod(d.size for d in x.shape if d.name not in out)
    scale = 1.0 / count if count else math.nan
    if accumulation_dtype(x.dtype) != x.dtype:
        return cast(einsum([cast(x, accumulation_dtype(x.dtype))], out) * scale, x.dtype)
    return einsum([_counted(x, "reduce_mean")], out) * scale


def _local_reduce(op: OpDef, floats: bool = False):
    """The reduction `op` (a local reduction, then an allreduce) as a function of a tensor."""
    name = op.name

    def reduction(x, output_shape: Optional[ShapeLike] = None, reduced_dims=None, *, reduced_dim=None):
        tensor_arg(name, x, floats=floats)
        if name != "reduce_logsumexp" and np.dtype(x.dtype).kind == "c":
            raise DTypeError(f"{name}: x is a {x.shape} {x.dtype} tensor, and complex numbers have no order "
                             f"(MPI has no max or min of them): reduce their real parts or magnitudes")
        out = output_shape_of(x, output_shape, reduced_dims_arg(name, reduced_dims, reduced_dim), name)
        out_layout = x.mesh.plan(out)
        (target,), reduce_mesh = contraction_plan((x.shape,), (x.tensor_layout,), out, out_layout, x.mesh.shape)
        x = to_layout(x, target)
        axes = tuple(i for i, n in enumerate(x.shape.names) if n not in out)
        kept = [n for n in x.shape.names if n in out]
        perm = tuple(kept.index(n) for n in out.names)
        (y,) = dispatch(op, [x], [(out, out_layout)], {"axes": axes, "reduce_mesh_dims": reduce_mesh,
                                                      "perm": None if perm == tuple(range(len(perm))) else perm})
        return y
    reduction.__name__ = reduction.__qualname__ = name
    reduction.__doc__ = f"{name} over the dims not in `output_shape` (or over `reduced_dims`; neither: everything)."
    return reduction


def _kernel(reduce):
    """An op's kernel: `reduce(ctx, a, axes, mesh_dims)`, its result's axes then put in output order."""
    def kernel(ctx, a, axes: tuple, reduce_mesh_dims: tuple, perm: Optional[tuple]):
        y = reduce(ctx, a, axes, reduce_mesh_dims)
        return y if perm is None else ctx.xp.transpose(y, perm)
    return kernel


def _max(ctx, a, axes, mesh_dims):  # (a NaN on any rank: NaN on all, `Collectives._extreme`)
    return ctx.allreduce(local_extreme(ctx.xp, a, axes, "max"), mesh_dims, "max")


def _min(ctx, a, axes, mesh_dims):
    return ctx.allreduce(local_extreme(ctx.xp, a, axes, "min"), mesh_dims, "min")


def _logsumexp(ctx, a, axes, mesh_dims):
    xp, dt = ctx.xp, a.dtype
    if accumulation_dtype(dt) != dt:  # 16-bit floats: in float32 (across ranks too), rounded once
        return _logsumexp(ctx, a.astype(accumulation_dtype(dt)), axes, mesh_dims).astype(dt)
    m = ctx.allreduce(local_extreme(xp, a, axes, "max", keepdims=True), mesh_dims, "max")
    m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))  # all -inf: keep -inf, not nan
    s = ctx.allreduce(xp.sum(xp.exp(a - m), axis=axes), mesh_dims, "sum")
    with np.errstate(divide="ignore"):  # log(0) = -inf is the right answer for an all -inf row
        return xp.log(s) + xp.squeeze(m, axis=axes)


def _reduced(a: Aval, axes: tuple, dtype, keepdims: bool = False) -> Aval:
    return Aval(tuple(1 if i in axes else n for i, n in enumerate(a.shape) if keepdims or i not in axes), dtype)


def _extreme_abstract(op: str):
    """The dry run of `_max` or `_min`: one allreduce of the local extremes."""
    def abstract(ctx, shapes, a, axes, reduce_mesh_dims, perm):
        return (ctx.allreduce(_reduced(a, axes, a.dtype), reduce_mesh_dims, op).dtype,)
    return abstract


def _logsumexp_abstract(ctx, shapes, a, axes, reduce_mesh_dims, perm):
    """The dry run of `_logsumexp`: the allreduce of the maxima, then of the sums, in float32 for 16 bits."""
    acc = accumulation_dtype(a.dtype)
    ctx.allreduce(_reduced(a, axes, acc, keepdims=True), reduce_mesh_dims, "max")
    ctx.allreduce(_reduced(a, axes, acc), reduce_mesh_dims, "sum")
    return (np.dtype(a.dtype),)


def _extreme_grad(op, dy):
    """Ties share the gradient equally."""
    x, y = op.inputs[0], op.outputs[0]
    mask = cast(equal(x, y), dy.dtype)
    return [mask * (dy / reduce_sum(mask, output_shape=y.shape))]


def _logsumexp_grad(op, dy):
    return [exp(op.inputs[0] - op.outputs[0]) * dy]


def _logsumexp_flops(params, ins, outs) -> int:
    """Per input element a max, a subtraction, an exp and an add; per output element a log and an add."""
    return 4 * size(ins[0]) + 2 * size(outs[0])


REDUCE_MAX = OpDef("reduce_max", _kernel(_max), grad=_extreme_grad, saves=((0,), (0,)), fill="lowest",
                   flops=per_element(1, "in"), abstract=_extreme_abstract("max"))
REDUCE_MIN = OpDef("reduce_min", _kernel(_min), grad=_extreme_grad, saves=((0,), (0,)), fill="highest",
                   flops=per_element(1, "in"), abstract=_extreme_abstract("min"))
REDUCE_LOGSUMEXP = OpDef("reduce_logsumexp", _kernel(_logsumexp), grad=_logsumexp_grad, saves=((0,), (0,)),
                         fill="lowest", flops=_logsumexp_flops, abstract=_logsumexp_abstract)

reduce_max = _local_reduce(REDUCE_MAX)
reduce_min = _local_reduce(REDUCE_MIN)
reduce_logsumexp = _local_reduce(REDUCE_LOGSUMEXP, floats=True)
