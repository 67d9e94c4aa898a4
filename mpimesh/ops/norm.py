"""Layer and RMS normalisation, each one op, its input gradient one op.

`layer_norm(x, dims, scale, bias, epsilon)`: `(x - mean) / sqrt(var + epsilon) * scale + bias`;
`rms_norm(x, dims, scale, epsilon)`: `x / sqrt(mean(x**2) + epsilon) * scale` (LLaMA's). The statistics
over `dims`: a local sum and, where a dim is split, one allreduce each; a 16-bit x normalised in float32
and rounded once. Outputs: y, then the statistics (x's dims without `dims`), which the gradient op reads
(dx and the normalised x); the scale's and bias's gradients are einsums, whose data-parallel sum may wait
in a gradient bucket (`mpimesh.buckets`). Kernels: `mpimesh.ops.rowwise`, and rms_norm's CUDA rows here.

>>> import numpy as np, mpimesh as mm
>>> x = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF).from_numpy(np.array([[1.0, 3.0], [2.0, 2.0]]), "b:2;d:2")
>>> [np.round(f(x, ("d",)).to_numpy(), 4).tolist() for f in (layer_norm, rms_norm)]
[[[-1.0, 1.0], [0.0, 0.0]], [[0.4472, 1.3416], [1.0, 1.0]]]
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import accumulation_dtype, align
from ..errors import ShapeError
from ..layout import splitting
from ..opdef import Aval, OpDef, size
from ..partials import partial_for
from ..tensor import tensor_arg
from ..trace import dispatch
from .einsum import grad_einsum
from .elementwise import cast
from .relayout import laid_out_within, to_layout
from .rowwise import (CUPY, GENERIC, NUMPY, ROWS_HEAD, ROWS_HOOKS, fusable, launch_rows, layer_norm_grad_rows,
                      layer_norm_rows, row_dot, row_kernel, row_sum, rows_fit, rows_kernels, variant)


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
        return layer_norm_rows(xp, a, params["epsilon"], *row_parameters(xp, sb, params["has"], a.dtype))
    return _layer_norm_kernel(ctx, a, *sb, be=CUPY, **params)


def row_parameters(xp, sb: tuple, has: tuple, dtype) -> tuple:
    """`(scale, bias)` as the one-kernel rows take them (`rowwise.layer_norm_rows`): contiguous, in the
    arithmetic's dtype of x's `dtype`, None where `has` says there is none."""
    acc = accumulation_dtype(dtype)
    return tuple(xp.ascontiguousarray(_as(sb[i], acc)) if has[k] else None for k, i in ((0, 0), (1, -1)))


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
            ds = grad_einsum([dy_acc, yhat], scale) if need[1] else None
        grads.append(ds if ds is None or ds.dtype == scale.dtype else cast(ds, scale.dtype))
    if bias is not None:
        with partial_for(bias):
            db = grad_einsum([dy_acc], bias) if need[-1] else None
        grads.append(db if db is None or db.dtype == bias.dtype else cast(db, bias.dtype))
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


# ------------------------------------------------------------------------------------ rms norm

def rms_norm(x, dims: tuple, scale=None, epsilon: float = 1e-6):
    """`x / sqrt(mean(x**2 over dims) + epsilon) * scale` (`scale` None, or a tensor whose dims are
    a subset of x's); see the module docstring."""
    dims = tuple(dims)
    layout, params = _plan(tensor_arg("rms_norm", x, floats=True), dims, "rms_norm")
    del params["splits"]  # (a JAX replay's zero padding adds nothing to the sum of squares: nothing to mask)
    x = to_layout(x, layout)
    scale = None if scale is None else laid_out_within(scale, x, "rms_norm", "scale")
    xd, sd = x.shape.names, None if scale is None else scale.shape.names
    params.update(epsilon=epsilon, sd=sd, vectors=not params["mesh_dims"] and sd in (None, xd[-1:]))
    stat = (x.shape.without(dims), tuple(m for i, m in enumerate(layout) if i not in params["axes"]))
    y, _ = dispatch(RMS_NORM, [x] if scale is None else [x, scale], [(x.shape, layout), stat], params)
    return y


def _rms_norm_kernel(ctx, a, *s, dims, axes, mesh_dims, count, xd, epsilon, sd, vectors, be=GENERIC):
    """y and 1/rms from x's block `a` and the scale's (`s`, if any). CuPy's kernels of `ROW_SOURCES`
    serve with a mean of 0 (`x - 0` is x): the sum of squares, then y."""
    xp = ctx.xp
    dt = a.dtype
    acc = accumulation_dtype(dt)
    a = _as(a, acc)
    fused = be.fused and fusable(a)
    q = row_kernel(xp, "row_dot", a, a, axes=axes) if fused else row_dot(xp, a, a, axes, be.einsum)
    if mesh_dims:
        q = ctx.allreduce(q, mesh_dims)
    r = 1 / xp.sqrt(q * (1.0 / count) + epsilon)
    sc = () if sd is None else (align(xp, _as(s[0], acc), sd, xd),)  # the scale in the arithmetic's dtype
    if fused:
        y = row_kernel(xp, "layer_norm_s" if sc else "layer_norm", a, xp.zeros((), acc), r, *sc)
    else:
        mul, _ = _steps(xp, be)
        y = a * r  # (a new array: `a` may be x's own)
        y = mul(y, sc[0]) if sc else y
    return _as(y, dt), xp.squeeze(r, axis=axes)


def _rms_norm_cupy(ctx, a, *s, **params):
    """CuPy: one kernel (`RMS_ROWS_SOURCE`) where the rows are whole here and the scale lies along them."""
    xp = ctx.xp
    if params["vectors"] and rows_fit(xp, a, params["axes"]) and rms_rows_kernels(xp, a.dtype) is not None:
        return rms_norm_rows(xp, a, params["epsilon"],
                             xp.ascontiguousarray(_as(s[0], accumulation_dtype(a.dtype))) if s else None)
    return _rms_norm_kernel(ctx, a, *s, be=CUPY, **params)


def _rms_norm_abstract(ctx, shapes, x, *s, axes, mesh_dims, **_) -> tuple:
    """y in x's dtype, 1/rms in the arithmetic's; the allreduce of the sum of squares where a
    normalised dim is split."""
    if mesh_dims:
        ctx.allreduce(_statistic(x, axes), mesh_dims)
    return x.dtype, accumulation_dtype(x.dtype)


def _rms_norm_flops(params, ins, outs) -> int:
    """Per element of x: square and sum (2), times 1/rms, and times the scale where there is one."""
    return (3 + (params["sd"] is not None)) * size(ins[0])


def _rms_norm_rule(op, dy, *_):  # (the statistic's output gets no gradient)
    """dx in one op, from x, dy, the scale and the forward's 1/rms; the scale's gradient an einsum
    of dy and the normalised x (its data-parallel sum may wait in a bucket)."""
    p = op.params
    x, rrms, scale = op.inputs[0], op.outputs[1], op.inputs[1] if p["sd"] is not None else None
    need = op.needs or (True,) * len(op.inputs)
    dy = to_layout(dy, x.tensor_layout)
    params = {k: p[k] for k in ("dims", "axes", "mesh_dims", "count", "xd", "sd", "vectors")}
    dx, yhat = dispatch(RMS_NORM_GRAD, [x, dy, rrms, *([scale] if scale is not None else [])],
                        [(x.shape, x.tensor_layout)] * 2, params)
    grads = [dx if need[0] else None]
    if scale is not None:
        acc = accumulation_dtype(x.dtype)
        with partial_for(scale):
            ds = grad_einsum([cast(dy, acc) if dy.dtype != acc else dy, yhat], scale) if need[1] else None
        grads.append(ds if ds is None or ds.dtype == scale.dtype else cast(ds, scale.dtype))
    return grads


def _rms_norm_grad_kernel(ctx, a, g, r, *s, dims, axes, mesh_dims, count, xd, sd, vectors, be=GENERIC):
    """dx = (g s - yhat mean(g s yhat)) / rms and the normalised x `yhat = x / rms`, from the blocks
    of x, dy, 1/rms and the scale (`s`, if any). CuPy: layer norm's kernels with a mean of 0."""
    xp = ctx.xp
    dt = a.dtype
    acc = accumulation_dtype(dt)
    a, g = _as(a, acc), _as(g, acc)
    r = xp.expand_dims(r, axes)
    sc = align(xp, _as(s[0], acc), sd, xd) if s else None
    if be.fused and fusable(a, g, r):  # the normalised x, the sum, then dx: three kernels
        zero, sc = xp.zeros((), acc), xp.ones((), acc) if sc is None else sc
        yhat = row_kernel(xp, "normalised", a, zero, r)
        m2 = row_kernel(xp, "scaled_dot", g, sc, yhat, axes=axes)
        if mesh_dims:
            m2 = ctx.allreduce(m2, mesh_dims)
        return _as(row_kernel(xp, "layer_norm_grad", g, sc, yhat, zero, m2 * (1.0 / count), r), dt), yhat
    yhat = a * r
    if sc is not None:
        g = g * sc
    m2 = row_dot(xp, g, yhat, axes, be.einsum)
    if mesh_dims:
        m2 = ctx.allreduce(m2, mesh_dims)
    d = yhat * (m2 * (1.0 / count))  # r * (g - yhat * m2 / count), in d's array
    d = xp.subtract(g, d, out=d) if be.in_place and isinstance(d, xp.ndarray) else g - d
    mul, _ = _steps(xp, be)
    return _as(mul(d, r), dt), yhat


def _rms_norm_grad_cupy(ctx, a, g, r, *s, **params):
    """CuPy: one kernel where the rows are whole here and the scale lies along them."""
    xp = ctx.xp
    if (params["vectors"] and rows_fit(xp, a, params["axes"]) and g.dtype == a.dtype and g.flags.c_contiguous
            and rms_rows_kernels(xp, a.dtype) is not None):
        return rms_norm_grad_rows(xp, a, g, xp.ascontiguousarray(r),
                                  xp.ascontiguousarray(_as(s[0], accumulation_dtype(a.dtype))) if s else None)
    return _rms_norm_grad_kernel(ctx, a, g, r, *s, be=CUPY, **params)


def _rms_norm_grad_abstract(ctx, shapes, x, *rest, axes, mesh_dims, **_) -> tuple:
    """dx in x's dtype, the normalised x in the arithmetic's; the allreduce of the one sum."""
    if mesh_dims:
        ctx.allreduce(_statistic(x, axes), mesh_dims)
    return x.dtype, accumulation_dtype(x.dtype)


def _rms_norm_grad_flops(params, ins, outs) -> int:
    """Per element of x: x times 1/rms, the sum of g yhat (2), dx's product, difference and times
    1/rms (3), and dy times the scale where there is one."""
    return (6 + (len(ins) > 3)) * size(ins[0])


# One kernel each way where the normalised dim is the last of a contiguous block, whole on this rank: a
# warp per row (`rowwise.ROWS_SOURCE`'s scheme, its prelude: `T` stored, `A` the arithmetic's, `load`/
# `store`, `warp_sum`), reading the row for its sum of squares, then again (from cache) to write y (dx).
RMS_ROWS_PARAMS = {
    "mpimesh_rms_norm_rows": "const T* x, const A* sc, T* y, A* rrms, long long rows, long long n, A inv_n, A eps, "
                             "int has_scale",
    "mpimesh_rms_norm_grad_rows": "const T* x, const T* g, const A* r, const A* sc, T* dx, A* yhat, long long rows, "
                                  "long long n, A inv_n, int has_scale",
}
RMS_ROWS_KERNELS = {
    "mpimesh_rms_norm_rows": """
extern "C" __global__ void mpimesh_rms_norm_rows(%(mpimesh_rms_norm_rows)s) {
  WARP_ROW
  const T* xr = x + row * n;
  T* yr = y + row * n;
  A q = 0;
  LANES(j) { A v = X_LOAD(j); q += v * v; }
  A r = 1 / sqrt(warp_sum(q) * inv_n + eps);
  LANES(j) {
    A v = X_LAST(j) * r;
    if (has_scale) v = v * sc[j];
    yr[j] = store(v);
  }
  if (lane == 0) rrms[row] = r;
}
""",
    "mpimesh_rms_norm_grad_rows": """
extern "C" __global__ void mpimesh_rms_norm_grad_rows(%(mpimesh_rms_norm_grad_rows)s) {
  WARP_ROW
  const T* xr = x + row * n;
  const T* gr = g + row * n;
  T* dr = dx + row * n;
  A* hr = yhat + row * n;
  A rr = r[row], m2 = 0;
  LANES(j) {
    A gs = has_scale ? G_LOAD(j) * sc[j] : G_LOAD(j);
    m2 += gs * (load(xr[j]) * rr);
  }
  A a2 = warp_sum(m2) * inv_n;
  LANES(j) {
    A gs = has_scale ? G_LAST(j) * sc[j] : G_LAST(j);
    A yh = load(xr[j]) * rr;
    hr[j] = yh;
    DX_STORE(j, (gs - yh * a2) * rr);
  }
}
""",
}
"""name -> the kernel's source (`rowwise.ROWS_KERNELS`' scheme: its loads and dx's store `rowwise.ROWS_HOOKS`)."""
RMS_ROWS_SOURCE = ROWS_HEAD + ROWS_HOOKS + "".join(RMS_ROWS_KERNELS.values()) % RMS_ROWS_PARAMS


def rms_rows_kernels(xp, dtype):
    """`RMS_ROWS_SOURCE`'s kernels for `dtype` (`rowwise.rows_kernels`; None: the few-kernel path runs)."""
    return rows_kernels(xp, ("norm", "rms_rows"), RMS_ROWS_SOURCE, RMS_ROWS_PARAMS, dtype)


def rms_norm_rows(xp, x, epsilon: float, scale=None, fused=None) -> tuple:
    """`(y, 1 / rms)` of rms_norm over x's last axis by one kernel: `scale` None or a vector of that
    axis's length in the arithmetic's dtype (float32 for bfloat16), 1/rms in that dtype. `fused`: as
    `rowwise.layer_norm_rows` takes it (a prologue computes x, an `Aval`)."""
    n = x.shape[-1]
    acc = np.float64 if x.dtype == np.float64 else np.float32
    y, rrms = xp.empty(x.shape, x.dtype), xp.empty(x.shape[:-1], acc)
    kernels, extra = fused or (rms_rows_kernels(xp, x.dtype), ())
    x = y if fused else x  # (a prologue reads no x)
    launch_rows(kernels, y, "mpimesh_rms_norm_rows", x, x if scale is None else scale, y, rrms,
                np.int64(y.size // n), np.int64(n), acc(1.0 / n), acc(epsilon), np.int32(scale is not None), *extra)
    return y, rrms


def rms_norm_grad_rows(xp, x, g, rrms, scale=None, fused=None) -> tuple:
    """`(dx, normalised x)` of rms_norm over x's last axis by one kernel: `g` of x's shape and dtype,
    `rrms` and `scale` as `rms_norm_rows` gives and takes them; the normalised x in rrms's dtype.
    `fused`: as `rowwise.layer_norm_grad_rows` takes it (g None: a prologue computes it)."""
    n = x.shape[-1]
    kernels, extra, written = fused or (rms_rows_kernels(xp, x.dtype), (), True)
    dx, yhat = xp.empty(x.shape if written else (1,), x.dtype), xp.empty(x.shape, rrms.dtype)
    launch_rows(kernels, x, "mpimesh_rms_norm_grad_rows", x, x if g is None else g, rrms,
                x if scale is None else scale, dx, yhat, np.int64(x.size // n), np.int64(n),
                rrms.dtype.type(1.0 / n), np.int32(scale is not None), *extra)
    return dx if written else None, yhat


RMS_NORM = OpDef("rms_norm", _rms_norm_kernel,
                 kernels={"numpy": variant(_rms_norm_kernel, be=NUMPY), "cupy": _rms_norm_cupy},
                 grad=_rms_norm_rule, saves=lambda p: ((0,) if p["sd"] is None else (0, 1), (1,)),  # x, scale, 1/rms
                 flops=_rms_norm_flops, abstract=_rms_norm_abstract)
RMS_NORM_GRAD = OpDef("rms_norm_grad", _rms_norm_grad_kernel,
                      kernels={"numpy": variant(_rms_norm_grad_kernel, be=NUMPY), "cupy": _rms_norm_grad_cupy},
                      flops=_rms_norm_grad_flops, abstract=_rms_norm_grad_abstract)
