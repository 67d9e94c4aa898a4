"""softmax and log_softmax over named dims (a bias and a causal mask inside), and softmax
cross-entropy: each one op, numerically stable when the reduced dim is split, each gradient one op.

softmax: the local max, an allreduce max over the mesh dims of the split reduced dims, the local sum of
exp(x - max), an allreduce sum, then the output; its gradient y * (dy - sum(dy * y)). Cross-entropy keeps
the log-partition as its second output: its gradient needs no communication. Rows all -inf give nan.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.array([[1e4, 1e4], [0.0, np.log(3.0)]]), "b:2;v:2")
>>> np.round(mm.softmax(x, "v").to_numpy(), 6).tolist()
[[0.5, 0.5], [0.25, 0.75]]
>>> np.round(mm.log_softmax(x, "v").to_numpy(), 4).tolist()
[[-0.6931, -0.6931], [-1.3863, -0.2877]]
"""
from __future__ import annotations

import numpy as np

from ..backend import accumulation_dtype, align, finfo, is_float
from ..errors import ShapeError
from ..layout import splitting
from ..opdef import Aval, OpDef, size
from ..partials import partial_for
from ..promotion import cast_operands, operand_casts
from ..shape import dim_names
from ..tensor import tensor_arg
from ..trace import dispatch
from .elementwise import bias_grad
from .relayout import laid_out_within, to_layout
from .rowwise import (CUPY, GENERIC, NUMPY, fusable, row_dot, row_kernel, row_sum, rows_fit, softmax_grad_rows,
                      softmax_rows, variant)

MASK_VALUE = -1e9
"""What a masked entry gets added before a softmax (a dtype that cannot hold it, float16, gets its
lowest finite value): exp of it is exactly 0 next to any unmasked entry."""


def _reduced_names(x, reduced_dim, what: str) -> tuple:
    names = dim_names(reduced_dim, tensor_arg(what, x, floats=True).shape, what)
    if not names:
        raise ShapeError(f"{what}: no reduced dim given for shape {x.shape}")
    for n in names:
        if n not in x.shape:
            raise ShapeError(f"{what}: reduced dim {n!r} is not in shape {x.shape}")
    return names


def local_extreme(xp, a, axes: tuple, op: str = "max", keepdims: bool = False):
    """The max (or min) of `a` over `axes`. Where those axes are empty (this rank's empty block of
    a split dim) it is the identity of the allreduce that follows: the lowest (highest) value of
    a's dtype, -inf (inf) for floats.

    >>> local_extreme(np, np.zeros((2, 0)), (1,)).tolist(), local_extreme(np, np.eye(2), (1,), "min", True).tolist()
    ([-inf, -inf], [[0.0], [0.0]])
    """
    if all(a.shape[i] for i in axes):
        return (xp.max if op == "max" else xp.min)(a, axis=axes, keepdims=keepdims)
    dt = np.dtype(a.dtype)
    if dt.kind == "b":
        fill = op == "min"
    elif dt.kind in "iu":
        fill = np.iinfo(dt).min if op == "max" else np.iinfo(dt).max
    else:
        fill = -np.inf if op == "max" else np.inf
    shape = [1 if i in axes else n for i, n in enumerate(a.shape)]
    return xp.full(tuple(shape) if keepdims else tuple(n for i, n in enumerate(shape) if i not in axes),
                   fill, dtype=a.dtype)


def mask_value(dtype) -> float:
    """`MASK_VALUE`, or the lowest finite value of a `dtype` that cannot hold it (float16).

    >>> mask_value("float32"), mask_value("float16")
    (-1000000000.0, -65504.0)
    """
    return max(MASK_VALUE, float(finfo(dtype).min)) if is_float(dtype) else MASK_VALUE


def _mesh_dims(layout, axes, mesh_shape) -> tuple:
    """The mesh dims that split the axes `axes` of a tensor laid out by `layout`, in mesh order."""
    split = {splitting(layout[i], mesh_shape) for i in axes} - {None}
    return tuple(m for m in mesh_shape.names if m in split)


def _positions(ctx, sizes: tuple, layout, axis: int):
    """The global positions along `axis` of this rank's block of a tensor of `sizes`, shaped to
    broadcast over its axes."""
    xp = ctx.xp
    start, n = ctx.span(sizes[axis], layout[axis])
    return (xp.arange(n) + start).reshape((-1,) + (1,) * (len(sizes) - axis - 1))


def _future(ctx, sizes: tuple, layout, q_axis: int, k_axis: int):
    """True where the position along `k_axis` is after the one along `q_axis` (this rank's block)."""
    return _positions(ctx, sizes, layout, k_axis) > _positions(ctx, sizes, layout, q_axis)


def _row(shape: tuple, axes: tuple, dtype) -> Aval:
    """A row statistic of a block of `shape` (its `axes` kept as 1) as an `Aval`."""
    return Aval(tuple(1 if i in axes else n for i, n in enumerate(shape)), dtype)


def _normalize_kernel(ctx, a, *b, log: bool, reduced_dims, mesh_dims, causal, axes, q_axis, sizes, layout, xd, bd,
                      casts, masked, be=GENERIC):
    """softmax's (log_softmax's) kernel on x's block `a` and the bias's, if any (`b`)."""
    xp = ctx.xp
    dt = a.dtype
    acc = accumulation_dtype(dt)
    low = acc != dt
    fresh = bool(b) or low  # whether `a` is this kernel's own array
    if b:  # x + bias, in their promotion as the add op computes it (`mm.result_type`)
        a, c = cast_operands((a, b[0]), casts)
        a = a + align(xp, c, bd, xd)
    a = a.astype(acc) if low else a  # 16-bit floats: computed in float32, rounded once
    eager = be.in_place  # numpy, CuPy: the same steps in place (fewer arrays, the same values)
    if q_axis is not None:
        future = _future(ctx, sizes, layout, q_axis, axes[0])
        if eager:  # where(future, a + masked, a) as a + (masked or 0): one pass over a, no temporary
            bias = xp.where(future, xp.asarray(masked, a.dtype), xp.asarray(0, a.dtype))  # (a mask's shape)
            a = xp.add(a, bias, out=a) if fresh else a + bias
            fresh = True
        else:
            a = xp.where(future, a + masked, a)
    m = local_extreme(xp, a, axes, keepdims=True)
    if mesh_dims:
        m = ctx.allreduce(m, mesh_dims, "max")
    m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))  # rows of -inf: no inf - inf
    if be.fused and fusable(a, m):  # CuPy: a reduction of exp(a - m), then the output: two kernels
        s = row_kernel(xp, "sum_exp", a, m, axes=axes)
        if mesh_dims:
            s = ctx.allreduce(s, mesh_dims, "sum")
        y = row_kernel(xp, "log_softmax" if log else "softmax", a, m, s, out=a if fresh else None)
        return y.astype(dt) if low else y
    z = xp.subtract(a, m, out=a) if eager and fresh else a - m
    if log:
        s = row_sum(xp, xp.exp(z), axes, be.einsum)
    else:  # e = exp(z) in z's place: z is not needed again
        e = xp.exp(z, out=z) if eager else xp.exp(z)
        s = row_sum(xp, e, axes, be.einsum)
    if mesh_dims:
        s = ctx.allreduce(s, mesh_dims, "sum")
    if log:
        y = xp.subtract(z, xp.log(s), out=z) if eager else z - xp.log(s)
    else:
        y = xp.divide(e, s, out=e) if eager else e / s
    return y.astype(dt) if low else y


def _sum_dtype(x_dtype, b_dtype, casts) -> np.dtype:
    """The dtype of x + bias as the kernels compute it."""
    a, c = cast_operands((np.zeros(0, x_dtype), np.zeros(0, b_dtype)), casts)
    return (a + c).dtype


def _normalize_abstract(ctx, shapes, x, *b, mesh_dims, axes, casts, **_) -> tuple:
    """The output's dtype; the allreduces of the row max and sum where a reduced dim is split."""
    dt, acc = x.dtype, accumulation_dtype(x.dtype)
    work = acc if acc != dt else _sum_dtype(dt, b[0].dtype, casts) if b else dt
    if mesh_dims:
        ctx.allreduce(_row(x.shape, axes, work), mesh_dims, "max")
        ctx.allreduce(_row(x.shape, axes, work), mesh_dims, "sum")
    return (dt if acc != dt else work,)


def _normalize_flops(params, ins, outs) -> int:
    """Per element of x: the max, subtract, exp, sum and divide (log_softmax: subtract), and the
    bias's add and the causal mask's where there is one."""
    return (5 + (len(ins) > 1) + (params["q_axis"] is not None)) * size(ins[0])


def _normalize_grad_kernel(ctx, out, g, *, log: bool, mesh_dims, axes, be=GENERIC):
    """The gradient's kernel on y's block `out` and dy's `g`."""
    xp = ctx.xp
    dt = out.dtype
    acc = accumulation_dtype(dt)
    if acc != dt:  # 16-bit floats: in float32 (the sums across ranks too), rounded once
        out, g = out.astype(acc), g.astype(acc)
    if be.fused and fusable(out, g):  # CuPy: the row sum (of dy, or of dy * y), then dx: two kernels
        s = row_sum(xp, g, axes) if log else row_kernel(xp, "row_dot", g, out, axes=axes)
        if mesh_dims:
            s = ctx.allreduce(s, mesh_dims, "sum")
        dx = row_kernel(xp, "log_softmax_grad" if log else "softmax_grad", out, g, s)
        return dx.astype(dt) if dx.dtype != dt else dx
    if log:  # dy - exp(y) * sum(dy)
        s = row_sum(xp, g, axes, be.einsum)
        if mesh_dims:
            s = ctx.allreduce(s, mesh_dims, "sum")
        dx = g - xp.exp(out) * s
    else:
        s = row_dot(xp, g, out, axes, be.einsum)  # y * (dy - sum(dy * y))
        if mesh_dims:
            s = ctx.allreduce(s, mesh_dims, "sum")
        dx = out * (g - s)
    return dx.astype(dt) if dx.dtype != dt else dx


def _normalize_defs(name: str, log: bool) -> tuple:
    """The `OpDef`s of softmax (log_softmax, `log`) and of its gradient."""
    def cupy(ctx, a, *b, **params):  # the rows whole here, no bias: one kernel
        if not b and not params["mesh_dims"] and rows_fit(ctx.xp, a, params["axes"]):
            q = params["q_axis"]
            mask = () if q is None else (q, ctx.span(params["sizes"][q], params["layout"][q])[0])
            return softmax_rows(ctx.xp, a, log, params["masked"], mask)
        return _normalize_kernel(ctx, a, *b, log=log, be=CUPY, **params)

    def cupy_grad(ctx, out, g, *, mesh_dims, axes):
        if not mesh_dims and rows_fit(ctx.xp, out, axes) and g.dtype == out.dtype and g.flags.c_contiguous:
            return softmax_grad_rows(ctx.xp, out, g, log)  # the rows whole here: one kernel
        return _normalize_grad_kernel(ctx, out, g, log=log, mesh_dims=mesh_dims, axes=axes, be=CUPY)

    def abstract_grad(ctx, shapes, y, g, *, mesh_dims, axes) -> tuple:
        dt, acc = y.dtype, accumulation_dtype(y.dtype)
        if mesh_dims:  # the row sum of dy (of dy * y)
            work = acc if acc != dt else g.dtype if log else np.result_type(g.dtype, y.dtype)
            ctx.allreduce(_row(y.shape, axes, work), mesh_dims, "sum")
        return (dt,)
    grad_op = OpDef(f"{name}_grad", variant(_normalize_grad_kernel, log=log),
                    kernels={"numpy": variant(_normalize_grad_kernel, log=log, be=NUMPY), "cupy": cupy_grad},
                    # softmax: dy * y, its sum, dy - s, times y; log_softmax: the sum, exp, times s, dy - that
                    flops=lambda params, ins, outs: 4 * size(outs[0]), abstract=abstract_grad)

    def rule(op, dy):
        y = op.outputs[0]
        dy = to_layout(dy, y.tensor_layout)
        (dx,) = dispatch(grad_op, [y, dy], [(y.shape, y.tensor_layout)],
                         {"mesh_dims": op.params["mesh_dims"], "axes": op.params["axes"]})
        if len(op.inputs) == 1:
            return [dx]
        with partial_for(op.inputs[1]):
            db = bias_grad(dx, op.inputs[1]) if (op.needs or (True, True))[1] else None
        return [dx, db]
    op = OpDef(name, variant(_normalize_kernel, log=log),
               kernels={"numpy": variant(_normalize_kernel, log=log, be=NUMPY), "cupy": cupy},
               grad=rule, saves=((), (0,)), fill="lowest", flops=_normalize_flops, abstract=_normalize_abstract)
    return op, grad_op


SOFTMAX, SOFTMAX_GRAD = _normalize_defs("softmax", False)
LOG_SOFTMAX, LOG_SOFTMAX_GRAD = _normalize_defs("log_softmax", True)


def _normalize(opdef: OpDef, doc: str):
    name = opdef.name

    def op(x, reduced_dim, bias=None, causal=None):
        names = _reduced_names(x, reduced_dim, name)
        mesh = x.mesh
        layout = mesh.plan(x.shape)
        x = to_layout(x, layout)
        axes = tuple(x.shape.index(n) for n in names)
        inputs = [x]
        if bias is not None:
            inputs.append(laid_out_within(bias, x, name, "bias"))
        casts = None if bias is None or bias.dtype == x.dtype else operand_casts((x.dtype, bias.dtype))
        params = {"reduced_dims": names, "mesh_dims": _mesh_dims(layout, axes, mesh.shape), "causal": causal,
                  "axes": axes, "q_axis": _causal_axis(x, names, causal, name), "sizes": x.shape.sizes,
                  "layout": layout, "xd": x.shape.names, "bd": None if bias is None else bias.shape.names,
                  "casts": casts, "masked": mask_value(x.dtype)}
        (y,) = dispatch(opdef, inputs, [(x.shape, layout)], params)
        return y
    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    op.opdef = opdef
    return op


def _causal_axis(x, names: tuple, causal, what: str):
    """The axis of x's query dim `causal` (None: no causal mask)."""
    if causal is None:
        return None
    if len(names) != 1:
        raise ShapeError(f"{what}: causal={causal!r} masks along one reduced dim, got {list(names)}")
    (q,) = dim_names(causal, x.shape, what)
    if q not in x.shape or q == names[0]:
        raise ShapeError(f"{what}: causal={causal!r} must name another dim of {x.shape} than the reduced "
                         f"{names[0]!r} (the query positions)")
    if x.shape[q].size != x.shape[names[0]].size:
        raise ShapeError(f"{what}: causal needs equal lengths, got {q}:{x.shape[q].size} and "
                         f"{names[0]}:{x.shape[names[0]].size}")
    return x.shape.index(q)


softmax = _normalize(SOFTMAX, "exp(x) / sum(exp(x)) over `reduced_dim` (a dim or list of dims), computed stably; "
                              "`bias`: a tensor added first; `causal`: x's query dim, masking later positions.")
log_softmax = _normalize(LOG_SOFTMAX, "x - logsumexp(x) over `reduced_dim` (a dim or list of dims), computed "
                                      "stably; `bias` and `causal` as in `softmax`.")


def softmax_cross_entropy(logits, targets, vocab_dim):
    """Per-position `logsumexp(logits) - logits[target]` over `vocab_dim` for integer `targets`
    (logits' dims without vocab; an id outside the vocabulary picks nothing), as one op, in
    float32 for 16-bit logits; the gradient w.r.t. logits is one op. Where vocab is split: one
    allreduce each of the max, the sum and the target's logit.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> logits = mesh.from_numpy(np.array([[0.0, 0.0], [1e4, 0.0]]), "b:2;vocab:2")
    >>> loss = softmax_cross_entropy(logits, mesh.from_numpy(np.array([1, 0]), "b:2"), "vocab")
    >>> np.round(loss.to_numpy(), 4).tolist()
    [0.6931, 0.0]
    """
    (v,) = dim_names(vocab_dim, logits.shape, "softmax_cross_entropy")
    if v not in logits.shape:
        raise ShapeError(f"softmax_cross_entropy: vocab dim {v!r} is not in logits {logits.shape}")
    if logits.shape[v].size == 0:  # (a value on some layouts, an IndexError on others)
        raise ShapeError(f"softmax_cross_entropy: vocab dim {v}:0 of logits {logits.shape} is empty: there is no "
                         f"class to predict")
    mesh = logits.mesh
    layout = mesh.plan(logits.shape)
    logits = to_layout(logits, layout)
    out_shape = logits.shape.without([v])
    axis = logits.shape.index(v)
    out_layout = tuple(m for i, m in enumerate(layout) if i != axis)
    targets = to_layout(targets, tuple(layout[logits.shape.index(n)] for n in targets.shape.names))
    params = {"vocab": v, "mesh_dims": _mesh_dims(layout, (axis,), mesh.shape), "axis": axis,
              "sizes": logits.shape.sizes, "layout": layout, "td": targets.shape.names, "od": out_shape.names}
    loss, _ = dispatch(CROSS_ENTROPY if is_float(logits.dtype) else CROSS_ENTROPY_NO_GRAD, [logits, targets],
                       [(out_shape, out_layout)] * 2, params)
    return loss


def _hit(ctx, t, sizes: tuple, layout, axis: int, td: tuple, od: tuple):
    """True where this rank's vocab position is the target (the target aligned to logits' axes),
    never in a JAX replay's padding (whose positions run on into the next block)."""
    xp = ctx.xp
    found = _positions(ctx, sizes, layout, axis) == xp.expand_dims(align(xp, t, td, od), axis)
    real = ctx.real(sizes[axis], layout[axis])
    return found if real is None else found & real.reshape((-1,) + (1,) * (len(sizes) - axis - 1))


def _target_index(a, t, axis: int, td: tuple, od: tuple):
    """numpy's kernels, the whole vocabulary here: `(index, valid)` of each target along `axis` (an
    id outside the vocabulary: index 0, not valid), shaped as `a` with 1 there; else None."""
    at = np.expand_dims(align(np, t, td, od), axis)
    if at.shape != a.shape[:axis] + (1,) + a.shape[axis + 1:]:
        return None
    valid = (at >= 0) & (at < a.shape[axis])
    return np.where(valid, at, 0), valid


def _cross_entropy_kernel(ctx, a, t, *, vocab, mesh_dims, axis, sizes, layout, td, od, be=GENERIC, pick=False):
    """The loss and the log-partition from logits' block `a` and the targets' `t` (`pick`: numpy's
    kernel takes the target's logit by its index where the vocabulary is whole here)."""
    xp = ctx.xp
    acc = accumulation_dtype(a.dtype)
    a = a.astype(acc) if a.dtype != acc else a
    m = local_extreme(xp, a, (axis,), keepdims=True)
    if mesh_dims:
        m = ctx.allreduce(m, mesh_dims, "max")
    m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))
    s = xp.squeeze(row_sum(xp, xp.exp(a - m), (axis,), be.einsum), axis=axis)
    found = _target_index(a, t, axis, td, od) if pick and not mesh_dims else None
    if found is None:
        gold = xp.sum(xp.where(_hit(ctx, t, sizes, layout, axis, td, od), a, xp.zeros((), a.dtype)), axis=axis)
    else:  # the target's logit picked, not summed with zeros (the same value)
        index, valid = found
        gold = np.squeeze(np.where(valid, np.take_along_axis(a, index, axis), a.dtype.type(0)), axis=axis)
    if mesh_dims:
        s, gold = ctx.allreduce(s, mesh_dims, "sum"), ctx.allreduce(gold, mesh_dims, "sum")
    lse = xp.log(s) + xp.squeeze(m, axis=axis)
    return lse - gold, lse


def _cross_entropy_abstract(ctx, shapes, x, t, *, mesh_dims, axis, **_) -> tuple:
    """The loss's and the log-partition's dtypes (as the kernel's numpy arithmetic gives them); the
    allreduces of the max, the sum and the target's logit where vocab is split."""
    a = np.zeros((1, 1), accumulation_dtype(x.dtype))
    s, gold = np.exp(a - a).sum(axis=1), a.sum(axis=1)  # (the target's logit as the generic kernel sums it)
    lse = np.log(s) + a[:, 0]
    if mesh_dims:
        ctx.allreduce(_row(x.shape, (axis,), a.dtype), mesh_dims, "max")
        row = tuple(n for i, n in enumerate(x.shape) if i != axis)
        ctx.allreduce(Aval(row, s.dtype), mesh_dims, "sum")
        ctx.allreduce(Aval(row, gold.dtype), mesh_dims, "sum")
    return (lse - gold).dtype, lse.dtype


def _cross_entropy_grad_kernel(ctx, a, t, z, g, *, vocab, mesh_dims, axis, sizes, layout, td, od, pick=False):
    """`dy * (softmax(logits) - one_hot(target))` in logits' dtype, the softmax from the forward's
    log-partition `z` (so with no communication)."""
    xp = ctx.xp
    dt = a.dtype
    acc = accumulation_dtype(dt)
    a = a.astype(acc) if a.dtype != acc else a
    found = _target_index(a, t, axis, td, od) if pick and not mesh_dims else None
    if found is None:
        p = xp.exp(a - xp.expand_dims(z, axis)) - xp.where(_hit(ctx, t, sizes, layout, axis, td, od),
                                                          xp.ones((), acc), xp.zeros((), acc))
    else:  # 1 taken from the target's probability alone (x - 0 elsewhere: the same values)
        index, valid = found
        p = np.subtract(a, np.expand_dims(z, axis))
        p = np.exp(p, out=p)
        picked = np.take_along_axis(p, index, axis)
        np.put_along_axis(p, index, np.where(valid, picked - acc.type(1), picked), axis)
    g = xp.expand_dims(g.astype(acc) if g.dtype != acc else g, axis)
    dx = p * g if found is None else np.multiply(p, g, out=p)
    return dx.astype(dt) if dx.dtype != dt else dx


def _cross_entropy_rule(op, dy, _):  # the log-partition, kept for the gradient, gets none
    (logits, targets), lse = op.inputs, op.outputs[1]
    dy = to_layout(dy, lse.tensor_layout)
    (dx,) = dispatch(CROSS_ENTROPY_GRAD, [logits, targets, lse, dy], [(logits.shape, logits.tensor_layout)],
                     dict(op.params))
    return [dx, None]


def _cross_entropy_flops(params, ins, outs) -> int:
    """Per logit the max, subtract, exp and sum; per position the log, the max's add and the target's
    logit subtracted (the target's logit picked: not counted)."""
    return 4 * size(ins[0]) + 3 * size(outs[0])


_CROSS_ENTROPY = dict(kernel=_cross_entropy_kernel, fill="lowest", flops=_cross_entropy_flops,
                      kernels={"numpy": variant(_cross_entropy_kernel, be=NUMPY, pick=True)},
                      abstract=_cross_entropy_abstract)
CROSS_ENTROPY = OpDef("softmax_cross_entropy", grad=_cross_entropy_rule, saves=((0, 1), (1,)), **_CROSS_ENTROPY)
CROSS_ENTROPY_NO_GRAD = OpDef("softmax_cross_entropy", **_CROSS_ENTROPY)
CROSS_ENTROPY_GRAD = OpDef("softmax_cross_entropy_grad", _cross_entropy_grad_kernel,
                           kernels={"numpy": variant(_cross_entropy_grad_kernel, pick=True)}, fill="lowest",
                           # subtract the log-partition, exp, subtract the one-hot, times dy
                           flops=lambda params, ins, outs: 4 * size(outs[0]))
