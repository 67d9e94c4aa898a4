"""Layer normalisation as one op, its input gradient as one op.

`layer_norm(x, dims, scale, bias, epsilon)`: `(x - mean) / sqrt(var + epsilon) * scale + bias`;
over `dims`: a local sum and, where a dim is split, one allreduce each; a 16-bit x normalised in float32
and rounded once. Outputs: y, then the statistics (x's dims without `dims`), which the gradient op reads
(dx and the normalised x); the scale's and bias's gradients are einsums, whose data-parallel sum may wait
in a gradient bucket (`mpimesh.buckets`). Kernels: `mpimesh.ops.rowwise`.

>>> import numpy as np, mpimesh as mm
>>> x = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF).from_numpy(np.array([[1.0, 3.0], [2.0, 2.0]]), "b:2;d:2")
>>> np.round(layer_norm(x, ("d",)).to_numpy(), 4).tolist()
[[-1.0, 1.0], [0.0, 0.0]]
"""
from __future__ import annotations

import math

from ..backend import accumulation_dtype, align
from ..errors import ShapeError
from ..layout import splitting
from ..opdef import Aval, OpDef, size
from ..partials import partial_for
from ..tensor import tensor_arg
from ..trace import dispatch
from .einsum import einsum
from .elementwise import cast
from .relayout import laid_out_within, to_layout
from .rowwise import (CUPY, GENERIC, NUMPY, fusable, layer_norm_grad_rows, layer_norm_rows, row_dot, row_kernel,
                      row_sum, rows_fit, variant)


def _plan(x, dims: tuple, what: str) -> tuple:
    """`(layout, params)`: x's layout under the rules in force, and the kernels' params for normalising
    it over `dims`: `axes` (of `dims`), `mesh_dims` (that split them), `count` (elements per statistic),
    `splits` (`(axis, size, mesh dim)` of each split one), `xd` (x's dim names)."""
    for n in dims:
        if n not in x.shape:
            raise ShapeError(f"{what}: normalised dim {n!r} is not in the input shape {x.shape}")
    layout = x.mesh.plan(x.shape)
    axes = tuple(x.shape.index(n) for n in dims)
    splits = tuple((i, x.shape[i].size, layout[i]) for i in axes if splitting(layout[i], x.mesh.shape))
    return layout, {"dims": dims, "axes": axes,
            "mesh_dims": tuple(m for m in x.mesh.shape.names if m in {s[2] for s in splits}),
            "count": max(1, math.prod(x.shape[n].size for n in dims)),  # (an empty dim: no statistic)
            "splits": splits, "xd": x.shape.names}


def _stats(ctx, a, axes, mesh_dims, count, splits, epsilon, be):
    """`(centred, 1 / sqrt(var + epsilon), mean)` of local block `a`, the statistics with keepdims
    (as the unfused ops compute them; a JAX replay's padding is kept out of the variance). On CuPy
    the variance is one reduction of the centred squares and `centred` is None (no array of them)."""
    xp = ctx.xp
    s = row_sum(xp, a, axes, be.einsum)
    if mesh_dims:
        s = ctx.allreduce(s, mesh_dims)
    mean = s * (1.0 / count)
    if be.fused and fusable(a):
        c, q = None, row_kernel(xp, "centred_squares", a, mean, axes=axes)
    else:
        c = _unpadded(ctx, a - mean, splits)
        q = row_dot(xp, c, c, axes, be.einsum)
    if mesh_dims:
        q = ctx.allreduce(q, mesh_dims)
    return c, 1 / xp.sqrt(q * (1.0 / count) + epsilon), mean


def _unpadded(ctx, c, splits):
    """`c` with zeros in a JAX replay's padding of the split normalised axes (as is elsewhere)."""
    for axis, n, m in splits:
        real = ctx.real(n, m)
        if real is not None:
            c = ctx.xp.where(real.reshape((-1,) + (1,) * (c.ndim - axis - 1)), c, ctx.xp.zeros((), c.dtype))
    return c


def layer_norm(x, dims: tuple, scale=None, bias=None, epsilon: float = 1e-6):
    """Normalise `x` over `dims`, then `* scale + bias` (each None, or a tensor whose dims are a
    subset of x's); see the module docstring."""
    dims = tuple(dims)
    layout, params = _plan(tensor_arg("layer_norm", x, floats=True), dims, "layer_norm")
    axes = params["axes"]
    x = to_layout(x, layout)
    scale, bias = (None if t is None else laid_out_within(t, x, "layer_norm", "parameter") for t in (scale, bias))
    extra = [t for t in (scale, bias) if t is not None]
    names = tuple(t.shape.names for t in extra)
    xd = x.shape.names
    params.update(epsilon=epsilon, has=(scale is not None, bias is not None), names=names,
                  vectors=not params["mesh_dims"] and all(n == xd[-1:] for n in names))  # rows whole, parameters along
    stats = (x.shape.without(dims), tuple(m for i, m in enumerate(layout) if i not in axes))
    y, _, _ = dispatch(LAYER_NORM, [x, *extra], [(x.shape, layout), stats, stats], params)
    return y


def _layer_norm_kernel(ctx, a, *sb, dims, axes, mesh_dims, count, splits, xd, epsilon, has, names, vectors,
                       be=GENERIC):
    """y, the mean and 1/std from x's block `a` and the scale's and bias's (`sb`, as `has` says)."""
    xp = ctx.xp
    dt = a.dtype
    acc = accumulation_dtype(dt)
    a = a.astype(acc) if acc != dt else a
    c, r, mean = _stats(ctx, a, axes, mesh_dims, count, splits, epsilon, be)
    if c is None:  # CuPy: the mean, the centred squares' sum, then y: three kernels
        which = "layer_norm" + ("_" + "s" * has[0] + "b" * has[1] if any(has) else "")
        y = row_kernel(xp, which, a, mean, r, *(align(xp, _as(t, acc), n, xd) for t, n in zip(sb, names)))
        return _as(y, dt), xp.squeeze(mean, axis=axes), xp.squeeze(r, axis=axes)
    mul, add = _steps(xp, be)  # c is the kernel's own array: y is made in its place
    y = mul(c, r)
    if has[0]:  # the parameters in y's dtype, as `mm.layers.like` casts them
        y = mul(y, align(xp, _as(sb[0], y.dtype), names[0], xd))
    if has[1]:
        y = add(y, align(xp, _as(sb[-1], y.dtype), names[-1], xd))
    return _as(y, dt), xp.squeeze(mean, axis=axes), xp.squeeze(r, axis=axes)


def _layer_norm_cupy(ctx, a, *sb, **params):
    """CuPy: one kernel where the rows are whole here and the parameters lie along them."""
    xp = ctx.xp
    if params["vectors"] and rows_fit(xp, a, params["axes"]):
        acc, has = accumulation_dtype(a.dtype), params["has"]
        sc, b = (xp.ascontiguousarray(_as(sb[i], acc)) if has[k] else None for k, i in ((0, 0), (1, -1)))
        return layer_norm_rows(xp, a, params["epsilon"], sc, b)
    return _layer_norm_kernel(ctx, a, *sb, be=CUPY, **params)


def _statistic(x: Aval, axes: tuple) -> Aval:
    """A row statistic of block `x` (`axes` kept as 1), in the arithmetic's dtype."""
    return Aval(tuple(1 if i in axes else n for i, n in enumerate(x.shape)), accumulation_dtype(x.dtype))


def _layer_norm_abstract(ctx, shapes, x, *sb, axes, mesh_dims, **_) -> tuple:
    """y in x's dtype, the statistics in the arithmetic's; the allreduces of the sum and of the
    centred squares' sum where a normalised dim is split."""
    if mesh_dims:
        ctx.allreduce(_statistic(x, axes), mesh_dims)
        ctx.allreduce(_statistic(x, axes), mesh_dims)
    acc = accumulation_dtype(x.dtype)
    return x.dtype, acc, acc


def _layer_norm_flops(params, ins, outs) -> int:
    """Per element of x: the sum, subtract the mean, square and sum, times 1/std, and the scale's
    multiply and the bias's add where there are."""
    return (5 + sum(params["has"])) * size(ins[0])


def _layer_norm_rule(op, dy, *_):  # (the statistics' outputs get no gradient)
    """dx in one op, from x, dy, scale and the forward's mean and 1/std (kept as its outputs, so no
    statistic is summed again); the parameters' gradients are einsums (see the module)."""
    p = op.params
    x, (_, mean, rstd), has = op.inputs[0], op.outputs, p["has"]
    scale = op.inputs[1] if has[0] else None
    bias = op.inputs[-1] if has[1] else None
    need = op.needs or (True,) * len(op.inputs)
    acc = accumulation_dtype(x.dtype)
    dy = to_layout(dy, x.tensor_layout)
    xd, sd = x.shape.names, None if scale is None else scale.shape.names
    params = {k: p[k] for k in ("dims", "axes", "mesh_dims", "count", "splits", "xd")}
    params.update(sd=sd, vectors=not p["mesh_dims"] and (sd is None or sd == xd[-1:]))  # rows whole, scale along
    dx, yhat = dispatch(LAYER_NORM_GRAD, [x, dy, mean, rstd, *([scale] if scale is not None else [])],
                        [(x.shape, x.tensor_layout)] * 2, params)
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


def _layer_norm_grad_kernel(ctx, a, g, mu, r, *s, dims, axes, mesh_dims, count, splits, xd, sd, vectors,
                            be=GENERIC):
    """dx and the normalised x from the blocks of x, dy, the mean, 1/std and the scale (`s`, if any)."""
    xp = ctx.xp
    dt = a.dtype
    acc = accumulation_dtype(dt)
    a, g = _as(a, acc), _as(g, acc)
    mu, r = xp.expand_dims(mu, axes), xp.expand_dims(r, axes)
    if be.fused and fusable(a, g, mu, r):  # CuPy: the normalised x, the two sums, then dx: four kernels
        sc = align(xp, _as(s[0], acc), sd, xd) if s else xp.ones((), acc)
        yhat = row_kernel(xp, "normalised", a, mu, r)
        m1 = row_kernel(xp, "scaled_sum", g, sc, axes=axes)
        m2 = row_kernel(xp, "scaled_dot", g, sc, yhat, axes=axes)
        if mesh_dims:
            m1, m2 = ctx.allreduce(m1, mesh_dims), ctx.allreduce(m2, mesh_dims)
        dx = row_kernel(xp, "layer_norm_grad", g, sc, yhat, m1 * (1.0 / count), m2 * (1.0 / count), r)
        return _as(dx, dt), yhat
    mul, _ = _steps(xp, be)
    yhat = mul(_unpadded(ctx, a - mu, splits), r)
    if s:
        g = g * align(xp, _as(s[0], acc), sd, xd)
    m1 = row_sum(xp, g, axes, be.einsum)
    m2 = row_dot(xp, g, yhat, axes, be.einsum)
    if mesh_dims:
        m1, m2 = ctx.allreduce(m1, mesh_dims), ctx.allreduce(m2, mesh_dims)
    d = yhat * (m2 * (1.0 / count))  # r * (g - m1 / count - yhat * m2 / count), in d's array
    d = xp.subtract(g - m1 * (1.0 / count), d, out=d) if be.in_place else g - m1 * (1.0 / count) - d
    return _as(mul(d, r), dt), yhat


def _layer_norm_grad_cupy(ctx, a, g, mu, r, *s, **params):
    """CuPy: one kernel where the rows are whole here and the scale lies along them."""
    xp = ctx.xp
    if params["vectors"] and rows_fit(xp, a, params["axes"]) and g.dtype == a.dtype and g.flags.c_contiguous:
        return layer_norm_grad_rows(xp, a, g, xp.ascontiguousarray(mu), xp.ascontiguousarray(r),
                                    xp.ascontiguousarray(_as(s[0], accumulation_dtype(a.dtype))) if s else None)
    return _layer_norm_grad_kernel(ctx, a, g, mu, r, *s, be=CUPY, **params)


def _layer_norm_grad_abstract(ctx, shapes, x, *rest, axes, mesh_dims, **_) -> tuple:
    """dx in x's dtype, the normalised x in the arithmetic's; the allreduces of the two sums."""
    if mesh_dims:
        ctx.allreduce(_statistic(x, axes), mesh_dims)
        ctx.allreduce(_statistic(x, axes), mesh_dims)
    return x.dtype, accumulation_dtype(x.dtype)


def _layer_norm_grad_flops(params, ins, outs) -> int:
    """Per element of x: x - mean, times 1/std, the two sums (3), the three terms of dx (3), times
    1/std, and dy times the scale where there is one."""
    return (9 + (len(ins) > 4)) * size(ins[0])


def _steps(xp, be):
    """`(multiply, add)` of a kernel's own array by another: into the first where `be` is in place
    (numpy, CuPy: the same values, one array fewer), plain for JAX."""
    if be.in_place:  # (a 0-d result may be a numpy scalar, which takes no `out`)
        return ((lambda a, b: xp.multiply(a, b, out=a) if isinstance(a, xp.ndarray) else a * b),
                (lambda a, b: xp.add(a, b, out=a) if isinstance(a, xp.ndarray) else a + b))
    return (lambda a, b: a * b), (lambda a, b: a + b)


def _as(a, dtype):
    return a if a.dtype == dtype else a.astype(dtype)


LAYER_NORM = OpDef("layer_norm", _layer_norm_kernel,
                   kernels={"numpy": variant(_layer_norm_kernel, be=NUMPY), "cupy": _layer_norm_cupy},
                   grad=_layer_norm_rule, saves=lambda p: ((0, 1) if p["has"][0] else (0,), (1, 2)),  # x, scale, stats
                   flops=_layer_norm_flops, abstract=_layer_norm_abstract)
LAYER_NORM_GRAD = OpDef("layer_norm_grad", _layer_norm_grad_kernel,
                        kernels={"numpy": variant(_layer_norm_grad_kernel, be=NUMPY), "cupy": _layer_norm_grad_cupy},
                        flops=_layer_norm_grad_flops, abstract=_layer_norm_grad_abstract)
