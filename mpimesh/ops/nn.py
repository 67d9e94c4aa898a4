"""softmax and log_softmax over named dims, with masking inside, and softmax cross-entropy:
each one op, numerically stable when the reduced dim is split, and each gradient one op.

softmax and log_softmax: the local max, an allreduce max over the mesh dims of the split reduced
dims, the local sum of exp(x - max), an allreduce sum, then the result; two allreduces of the
output size without the reduced dims, nothing else. `bias=` adds a tensor first (its dims a subset
of x's); `causal=q` adds `MASK_VALUE` where the position along the (one) reduced dim is after the
position along x's dim q (attention's causal mask, made from the global positions inside the
kernel: no mask tensor). The gradients are one op each, the compact rules softmax:
y * (dy - sum(dy * y)); log_softmax: dy - exp(y) * sum(dy) (a bias gets dx summed to its dims).
Entries of -inf get 0 (softmax) and -inf (log_softmax); a row that is all -inf gives nan, as in
numpy and JAX.

`softmax_cross_entropy(logits, targets, vocab)`: `logsumexp(logits) - logits[target]` for integer
targets, in one op (the max, the sum and the target's logit each one allreduce where vocab is
split; the log-partition is kept as the op's second output), its gradient
`dy * (exp(logits - logsumexp) - one_hot(target))` in one op, with no communication.

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

from ..backend import accumulation_dtype, align, finfo, is_eager, is_float
from ..errors import ShapeError
from ..layout import splitting
from ..partials import partial_for
from ..promotion import cast_operands, operand_casts
from ..shape import dim_names
from ..tensor import tensor_arg
from ..trace import dispatch_lower, saving
from .elementwise import bias_grad
from .relayout import laid_out_within, to_layout
from .rowwise import fused_rows, row_dot, row_kernel, row_sum, rows_fit, softmax_grad_rows, softmax_rows

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


def _positions(ctx, x_shape, layout, axis: int, ndim: int):
    """The global positions along `axis` of this rank's block, shaped to broadcast over `ndim` axes."""
    xp = ctx.xp
    start, n = ctx.span(x_shape[axis].size, layout[axis])
    return (xp.arange(n) + start).reshape((-1,) + (1,) * (ndim - axis - 1))


def _future(ctx, x_shape, layout, q_axis: int, k_axis: int):
    """True where the position along `k_axis` is after the one along `q_axis` (this rank's block)."""
    n = x_shape.rank
    return _positions(ctx, x_shape, layout, k_axis, n) > _positions(ctx, x_shape, layout, q_axis, n)


def _normalize(name: str, log: bool, doc: str):
    def op(x, reduced_dim, bias=None, causal=None):
        names = _reduced_names(x, reduced_dim, name)
        mesh = x.mesh
        layout = mesh.plan(x.shape)
        x = to_layout(x, layout)
        axes = tuple(x.shape.index(n) for n in names)
        mdims = _mesh_dims(layout, axes, mesh.shape)
        q_axis = _causal_axis(x, names, causal, name)
        inputs = [x]
        if bias is not None:
            inputs.append(laid_out_within(bias, x, name, "bias"))
        xd, bd = x.shape.names, None if bias is None else bias.shape.names
        shape = x.shape
        dt, acc = x.dtype, accumulation_dtype(x.dtype)
        casts = None if bias is None or bias.dtype == dt else operand_casts((dt, bias.dtype))
        low = acc != dt
        masked = mask_value(dt)

        def lower(ctx, a, *b):
            xp = ctx.xp
            if not b and not mdims and rows_fit(xp, a, axes):  # CuPy, the rows whole here: one kernel
                mask = () if q_axis is None else (q_axis, ctx.span(shape[q_axis].size, layout[q_axis])[0])
                return softmax_rows(xp, a, log, masked, mask)
            eager = is_eager(xp)  # numpy, CuPy: the same steps in place (fewer arrays, the same values)
            fresh = bool(b) or low  # whether `a` is this kernel's own array
            if b:  # x + bias, in their promotion as the add op computes it (`mm.result_type`)
                a, c = cast_operands((a, b[0]), casts)
                a = a + align(xp, c, bd, xd)
            a = a.astype(acc) if low else a  # 16-bit floats: computed in float32, rounded once
            if q_axis is not None:
                future = _future(ctx, shape, layout, q_axis, axes[0])
                if eager:  # where(future, a + masked, a) as a + (masked or 0): one pass over a, no temporary
                    bias = xp.where(future, xp.asarray(masked, a.dtype), xp.asarray(0, a.dtype))  # (a mask's shape)
                    a = xp.add(a, bias, out=a) if fresh else a + bias
                    fresh = True
                else:
                    a = xp.where(future, a + masked, a)
            m = local_extreme(xp, a, axes, keepdims=True)
            if mdims:
                m = ctx.allreduce(m, mdims, "max")
            m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))  # rows of -inf: no inf - inf
            if fused_rows(xp, a, m):  # CuPy: a reduction of exp(a - m), then the output: two kernels
                s = row_kernel(xp, "sum_exp", a, m, axes=axes)
                if mdims:
                    s = ctx.allreduce(s, mdims, "sum")
                y = row_kernel(xp, name, a, m, s, out=a if fresh else None)
                return y.astype(dt) if low else y
            z = xp.subtract(a, m, out=a) if eager and fresh else a - m
            if log:
                s = row_sum(xp, xp.exp(z), axes)
            else:  # e = exp(z) in z's place: z is not needed again
                e = xp.exp(z, out=z) if eager else xp.exp(z)
                s = row_sum(xp, e, axes)
            if mdims:
                s = ctx.allreduce(s, mdims, "sum")
            if log:
                y = xp.subtract(z, xp.log(s), out=z) if eager else z - xp.log(s)
            else:
                y = xp.divide(e, s, out=e) if eager else e / s
            return y.astype(dt) if low else y

        def rule(op, dy):
            dx = _normalize_grad(op.outputs[0], dy, axes, mdims, log, name)
            if len(op.inputs) == 1:
                return [dx]
            with partial_for(op.inputs[1]):
                db = bias_grad(dx, op.inputs[1]) if (op.needs or (True, True))[1] else None
            return [dx, db]
        saving(rule, (), (0,))
        (y,) = dispatch_lower(name, inputs, [(x.shape, layout)], lower,
                        {"reduced_dims": names, "mesh_dims": mdims, "causal": causal},
                        rule if is_float(x.dtype) else None)
        return y
    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
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


def _normalize_grad(y, dy, axes, mdims, log: bool, name: str):
    """The input gradient of softmax (log_softmax) output `y` for `dy`, as one op."""
    dy = to_layout(dy, y.tensor_layout)
    dt, acc = y.dtype, accumulation_dtype(y.dtype)

    def lower(ctx, out, g):
        xp = ctx.xp
        if not mdims and rows_fit(xp, out, axes) and g.dtype == out.dtype and g.flags.c_contiguous:
            return softmax_grad_rows(xp, out, g, log)  # CuPy, the rows whole here: one kernel
        if acc != dt:  # 16-bit floats: in float32 (the sums across ranks too), rounded once
            out, g = out.astype(acc), g.astype(acc)
        if fused_rows(xp, out, g):  # CuPy: the row sum (of dy, or of dy * y), then dx: two kernels
            s = row_sum(xp, g, axes) if log else row_kernel(xp, "row_dot", g, out, axes=axes)
            if mdims:
                s = ctx.allreduce(s, mdims, "sum")
            dx = row_kernel(xp, f"{name}_grad", out, g, s)
            return dx.astype(dt) if dx.dtype != dt else dx
        if log:  # dy - exp(y) * sum(dy)
            s = row_sum(xp, g, axes)
            if mdims:
                s = ctx.allreduce(s, mdims, "sum")
            dx = g - xp.exp(out) * s
        else:
            s = row_dot(xp, g, out, axes)  # y * (dy - sum(dy * y))
            if mdims:
                s = ctx.allreduce(s, mdims, "sum")
            dx = out * (g - s)
        return dx.astype(dt) if dx.dtype != dt else dx
    (dx,) = dispatch_lower(f"{name}_grad", [y, dy], [(y.shape, y.tensor_layout)], lower, {"mesh_dims": mdims})
    return dx


softmax = _normalize("softmax", False,
                     "exp(x) / sum(exp(x)) over `reduced_dim` (a dim or list of dims), computed stably; "
                     "`bias`: a tensor added first; `causal`: x's query dim, masking later positions.")
log_softmax = _normalize("log_softmax", True,
                         "x - logsumexp(x) over `reduced_dim` (a dim or list of dims), computed stably; "
                         "`bias` and `causal` as in `softmax`.")


def softmax_cross_entropy(logits, targets, vocab_dim):
    """Per-position `logsumexp(logits) - logits[target]` over `vocab_dim` for integer `targets`
    (logits' dims without vocab; an id outside the vocabulary picks nothing), as one op, in
    float32 for 16-bit logits; the gradient w.r.t. logits is one op.

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
    mdims = _mesh_dims(layout, (axis,), mesh.shape)
    td, shape = targets.shape.names, logits.shape
    acc = accumulation_dtype(logits.dtype)
    od = out_shape.names

    def hit(ctx, t):
        """True where this rank's vocab position is the target (the target aligned to logits' axes),
        never in a JAX replay's padding (whose positions run on into the next block)."""
        xp = ctx.xp
        pos = _positions(ctx, shape, layout, axis, shape.rank)
        found = pos == xp.expand_dims(align(xp, t, td, od), axis)
        real = ctx.real(shape[axis].size, layout[axis])
        return found if real is None else found & real.reshape((-1,) + (1,) * (shape.rank - axis - 1))

    def target_index(ctx, a, t):
        """On numpy with the whole vocabulary here: `(index, valid)` of each target along `axis`
        (an id outside the vocabulary: index 0, not valid), shaped as `a` with 1 there; else None."""
        if mdims or ctx.xp is not np:
            return None
        at = np.expand_dims(align(np, t, td, od), axis)
        if at.shape != a.shape[:axis] + (1,) + a.shape[axis + 1:]:
            return None
        valid = (at >= 0) & (at < a.shape[axis])
        return np.where(valid, at, 0), valid

    def lower(ctx, a, t):
        xp = ctx.xp
        a = a.astype(acc) if a.dtype != acc else a
        m = local_extreme(xp, a, (axis,), keepdims=True)
        if mdims:
            m = ctx.allreduce(m, mdims, "max")
        m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))
        s = xp.squeeze(row_sum(xp, xp.exp(a - m), (axis,)), axis=axis)
        found = target_index(ctx, a, t)
        if found is None:
            gold = xp.sum(xp.where(hit(ctx, t), a, xp.zeros((), a.dtype)), axis=axis)
        else:  # the target's logit picked, not summed with zeros (the same value)
            index, valid = found
            gold = np.squeeze(np.where(valid, np.take_along_axis(a, index, axis), a.dtype.type(0)), axis=axis)
        if mdims:
            s, gold = ctx.allreduce(s, mdims, "sum"), ctx.allreduce(gold, mdims, "sum")
        lse = xp.log(s) + xp.squeeze(m, axis=axis)
        return lse - gold, lse

    def rule(op, dy, _):  # the log-partition, kept for the gradient, gets none
        return [_cross_entropy_grad(op, dy, axis, hit, target_index), None]
    saving(rule, (0, 1), (1,))  # logits, targets and the log-partition
    loss, _ = dispatch_lower("softmax_cross_entropy", [logits, targets], [(out_shape, out_layout)] * 2, lower,
                       {"vocab": v, "mesh_dims": mdims}, rule if is_float(logits.dtype) else None)
    return loss


def _cross_entropy_grad(op, dy, axis, hit, target_index):
    """`dy * (softmax(logits) - one_hot(target))` in logits' dtype, as one op: the softmax from the
    forward's log-partition (its second output), so with no communication."""
    (logits, targets), lse = op.inputs, op.outputs[1]
    dy = to_layout(dy, lse.tensor_layout)
    dt, acc = logits.dtype, accumulation_dtype(logits.dtype)

    def lower(ctx, a, t, z, g):
        xp = ctx.xp
        a = a.astype(acc) if a.dtype != acc else a
        found = target_index(ctx, a, t)
        if found is None:
            p = xp.exp(a - xp.expand_dims(z, axis)) - xp.where(hit(ctx, t), xp.ones((), acc), xp.zeros((), acc))
        else:  # 1 taken from the target's probability alone (x - 0 elsewhere: the same values)
            index, valid = found
            p = np.subtract(a, np.expand_dims(z, axis))
            p = np.exp(p, out=p)
            picked = np.take_along_axis(p, index, axis)
            np.put_along_axis(p, index, np.where(valid, picked - acc.type(1), picked), axis)
        g = xp.expand_dims(g.astype(acc) if g.dtype != acc else g, axis)
        dx = p * g if found is None else np.multiply(p, g, out=p)
        return dx.astype(dt) if dx.dtype != dt else dx
    (dx,) = dispatch_lower("softmax_cross_entropy_grad", [logits, targets, lse, dy],
                     [(logits.shape, logits.tensor_layout)], lower, {"mesh_dims": op.params["mesh_dims"]})
    return dx
