"""Layer normalisation as one op, its input gradient as one op.

`layer_norm(x, dims, scale, bias, epsilon)`: `(x - mean) / sqrt(var + epsilon) * scale + bias`,
the statistics over `dims` (split or not: each is a local sum and, where a dim is split, one
allreduce over its mesh dims), a 16-bit float x normalised in float32 and rounded once. The same
arithmetic as the unfused composition (`reduce_mean`, subtract, square, `rsqrt`, multiply, add),
but for the order of the terms in its sums (`mpimesh.ops.rowwise`), in place on numpy, and on CuPy
as a few kernels each way (`mpimesh.ops.rowwise.ROW_SOURCES`), or one where the normalised dim is
x's last, whole on each rank, and the parameters lie along it (`mpimesh.ops.rowwise.ROWS_SOURCE`).

The op's outputs are y, then the mean and 1/std (x's dims without `dims`: small), which the
gradient reads instead of summing them again. The gradient: one op `layer_norm_grad` gives dx
(from x, dy, scale and those statistics: the two sums of the backward pass, one allreduce each
where a dim is split, as the unfused ops) and the normalised x; the gradients of scale and bias
are then an einsum and a reduction over the other dims, so that a data-parallel sum of them waits
in a gradient bucket as any parameter's does (`mpimesh.buckets`).

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.array([[1.0, 3.0], [2.0, 2.0]]), "b:2;d:2")
>>> np.round(layer_norm(x, ("d",)).to_numpy(), 4).tolist()
[[-1.0, 1.0], [0.0, 0.0]]
"""
from __future__ import annotations

import math

from ..backend import accumulation_dtype, align, is_eager
from ..errors import ShapeError
from ..layout import splitting
from ..partials import partial_for
from ..tensor import tensor_arg
from ..trace import dispatch_lower, saving
from .einsum import einsum
from .elementwise import cast
from .relayout import laid_out_within, to_layout
from .rowwise import (fused_rows, layer_norm_grad_rows, layer_norm_rows, row_dot, row_kernel, row_sum,
                      rows_fit)


def _plan(x, dims: tuple, what: str):
    """`(layout, axes, mesh dims, count, splits)`: x's layout by the rules in force, the axes of
    `dims`, the mesh dims that split them, the elements per statistic, and `(axis, size, mesh dim)`
    of each split one."""
    for n in dims:
        if n not in x.shape:
            raise ShapeError(f"{what}: normalised dim {n!r} is not in the input shape {x.shape}")
    layout = x.mesh.plan(x.shape)
    axes = tuple(x.shape.index(n) for n in dims)
    splits = tuple((i, x.shape[i].size, layout[i]) for i in axes if splitting(layout[i], x.mesh.shape))
    mdims = tuple(m for m in x.mesh.shape.names if m in {s[2] for s in splits})
    count = max(1, math.prod(x.shape[n].size for n in dims))  # (an empty dim: an empty result, no statistic)
    return layout, axes, mdims, count, splits


def _stats(ctx, a, plan, epsilon):
    """`(centred, 1 / sqrt(var + epsilon), mean)` of local block `a`, the statistics with keepdims
    (as the unfused ops compute them; a JAX replay's padding is kept out of the variance). On CuPy
    the variance is one reduction of the centred squares and `centred` is None (no array of them)."""
    xp = ctx.xp
    _, axes, mdims, count, splits = plan
    s = row_sum(xp, a, axes)
    if mdims:
        s = ctx.allreduce(s, mdims)
    mean = s * (1.0 / count)
    if fused_rows(xp, a):
        c, q = None, row_kernel(xp, "centred_squares", a, mean, axes=axes)
    else:
        c = _unpadded(ctx, a - mean, splits)
        q = row_dot(xp, c, c, axes)
    if mdims:
        q = ctx.allreduce(q, mdims)
    return c, 1 / xp.sqrt(q * (1.0 / count) + epsilon), mean


def _unpadded(ctx, c, splits):
    """`c` with zeros in a JAX replay's padding of the split normalised axes (as is elsewhere)."""
    for axis, size, m in splits:
        real = ctx.real(size, m)
        if real is not None:
            c = ctx.xp.where(real.reshape((-1,) + (1,) * (c.ndim - axis - 1)), c, ctx.xp.zeros((), c.dtype))
    return c


def layer_norm(x, dims: tuple, scale=None, bias=None, epsilon: float = 1e-6):
    """Normalise `x` over `dims`, then `* scale + bias` (each None, or a tensor whose dims are a
    subset of x's); see the module docstring."""
    dims = tuple(dims)
    plan = _plan(tensor_arg("layer_norm", x, floats=True), dims, "layer_norm")
    layout = plan[0]
    x = to_layout(x, layout)
    dt, acc = x.dtype, accumulation_dtype(x.dtype)
    scale, bias = (None if t is None else laid_out_within(t, x, "layer_norm", "parameter") for t in (scale, bias))
    params = [t for t in (scale, bias) if t is not None]
    names = [t.shape.names for t in params]
    has = (scale is not None, bias is not None)
    xd = x.shape.names

    axes = plan[1]
    stats = (x.shape.without(dims), tuple(m for i, m in enumerate(layout) if i not in axes))
    vectors = not plan[2] and all(n == xd[-1:] for n in names)  # rows whole here, parameters along them

    which = "layer_norm" + ("_" + "s" * has[0] + "b" * has[1] if any(has) else "")

    def lower(ctx, a, *sb):
        xp = ctx.xp
        if vectors and rows_fit(xp, a, axes):  # CuPy, the rows whole here: one kernel
            sc, b = (xp.ascontiguousarray(_as(sb[i], acc)) if has[k] else None for k, i in ((0, 0), (1, -1)))
            return layer_norm_rows(xp, a, epsilon, sc, b)
        a = a.astype(acc) if acc != dt else a
        c, r, mean = _stats(ctx, a, plan, epsilon)
        if c is None:  # CuPy: the mean, the centred squares' sum, then y: three kernels
            y = row_kernel(xp, which, a, mean, r, *(align(xp, _as(t, acc), n, xd) for t, n in zip(sb, names)))
            return _as(y, dt), xp.squeeze(mean, axis=axes), xp.squeeze(r, axis=axes)
        mul, add = _in_place(xp)  # c is the kernel's own array: y is made in its place
        y = mul(c, r)
        if has[0]:  # the parameters in y's dtype, as `mm.layers.like` casts them
            y = mul(y, align(xp, _as(sb[0], y.dtype), names[0], xd))
        if has[1]:
            y = add(y, align(xp, _as(sb[-1], y.dtype), names[-1], xd))
        return _as(y, dt), xp.squeeze(mean, axis=axes), xp.squeeze(r, axis=axes)

    def rule(op, dy, *_):  # (the statistics' outputs get no gradient)
        return _layer_norm_grad(op, dy, dims, has)
    saving(rule, (0, 1) if has[0] else (0,), (1, 2))  # x, scale, mean and 1/std
    y, _, _ = dispatch_lower("layer_norm", [x, *params], [(x.shape, layout), stats, stats], lower,
                       {"dims": dims, "epsilon": epsilon}, rule)
    return y


def _layer_norm_grad(op, dy, dims, has):
    """dx in one op, from x, dy, scale and the forward's mean and 1/std (kept as its outputs, so no
    statistic is summed again); the parameters' gradients are einsums (see the module)."""
    x, (_, mean, rstd) = op.inputs[0], op.outputs
    scale = op.inputs[1] if has[0] else None
    bias = op.inputs[-1] if has[1] else None
    need = op.needs or (True,) * len(op.inputs)
    plan = _plan(x, dims, "layer_norm_grad")
    layout, axes, mdims, count, splits = plan
    dt, acc = x.dtype, accumulation_dtype(x.dtype)
    dy = to_layout(dy, layout)
    xd, sd = x.shape.names, None if scale is None else scale.shape.names
    vectors = not mdims and (sd is None or sd == xd[-1:])  # rows whole here, the scale along them

    def lower(ctx, a, g, mu, r, *s):
        xp = ctx.xp
        if vectors and rows_fit(xp, a, axes) and g.dtype == a.dtype and g.flags.c_contiguous:  # CuPy: one kernel
            return layer_norm_grad_rows(xp, a, g, xp.ascontiguousarray(mu), xp.ascontiguousarray(r),
                                        xp.ascontiguousarray(_as(s[0], acc)) if s else None)
        a, g = _as(a, acc), _as(g, acc)
        mu, r = xp.expand_dims(mu, axes), xp.expand_dims(r, axes)
        if fused_rows(xp, a, g, mu, r):  # CuPy: the normalised x, the two sums, then dx: four kernels
            sc = align(xp, _as(s[0], acc), sd, xd) if s else xp.ones((), acc)
            yhat = row_kernel(xp, "normalised", a, mu, r)
            m1 = row_kernel(xp, "scaled_sum", g, sc, axes=axes)
            m2 = row_kernel(xp, "scaled_dot", g, sc, yhat, axes=axes)
            if mdims:
                m1, m2 = ctx.allreduce(m1, mdims), ctx.allreduce(m2, mdims)
            dx = row_kernel(xp, "layer_norm_grad", g, sc, yhat, m1 * (1.0 / count), m2 * (1.0 / count), r)
            return _as(dx, dt), yhat
        mul, _ = _in_place(xp)
        yhat = mul(_unpadded(ctx, a - mu, splits), r)
        if s:
            g = g * align(xp, _as(s[0], acc), sd, xd)
        m1 = row_sum(xp, g, axes)
        m2 = row_dot(xp, g, yhat, axes)
        if mdims:
            m1, m2 = ctx.allreduce(m1, mdims), ctx.allreduce(m2, mdims)
        d = yhat * (m2 * (1.0 / count))  # r * (g - m1 / count - yhat * m2 / count), in d's array
        d = xp.subtract(g - m1 * (1.0 / count), d, out=d) if is_eager(xp) else g - m1 * (1.0 / count) - d
        return _as(mul(d, r), dt), yhat
    (dx, yhat) = dispatch_lower("layer_norm_grad", [x, dy, mean, rstd, *([scale] if scale is not None else [])],
                          [(x.shape, layout), (x.shape, layout)], lower, {"dims": dims})
    grads = [dx if need[0] else None]
    dy_acc = cast(dy, acc) if dy.dtype != acc else dy
    if scale is not None:
        with partial_for(scale):
            ds = einsum([dy_acc, yhat], output_shape=scale.shape) if need[1] else None
        grads.append(None if ds is None else cast(ds, scale.dtype))
    if bias is not None:
        with partial_for(bias):
            db = einsum([dy_acc], output_shape=bias.shape) if need[-1] else None
        grads.append(None if db is None else cast(db, bias.dtype))
    return grads


def _in_place(xp):
    """`(multiply, add)` of a kernel's own array by another, into the first on numpy and CuPy (the
    same values, one array fewer), plain on JAX."""
    if is_eager(xp):  # (a 0-d result may be a numpy scalar, which takes no `out`)
        return ((lambda a, b: xp.multiply(a, b, out=a) if isinstance(a, xp.ndarray) else a * b),
                (lambda a, b: xp.add(a, b, out=a) if isinstance(a, xp.ndarray) else a + b))
    return (lambda a, b: a * b), (lambda a, b: a + b)


def _as(a, dtype):
    return a if a.dtype == dtype else a.astype(dtype)
