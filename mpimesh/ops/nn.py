"""softmax and log_softmax over named dims, numerically stable when the reduced dim is split.

Each is one op: the local max, an allreduce max over the mesh dims of the split reduced dims,
the local sum of exp(x - max), an allreduce sum, then the result; two allreduces of the
output size without the reduced dims, nothing else. Gradients are the compact rules
softmax: y * (dy - sum(dy * y)); log_softmax: dy - exp(y) * sum(dy). Entries of -inf get 0
(softmax) and -inf (log_softmax); a row that is all -inf gives nan, as in numpy and JAX.

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

from ..backend import accumulation_dtype, is_float
from ..errors import ShapeError
from ..layout import splitting
from ..shape import dim_names
from ..trace import dispatch
from .relayout import to_layout


def _reduced_names(x, reduced_dim, what: str) -> tuple:
    names = dim_names(reduced_dim, x.shape, what)
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


def _softmax_grad(op, dy):
    from .reduce import reduce_sum
    y = op.outputs[0]
    return [y * (dy - reduce_sum(dy * y, reduced_dims=op.params["reduced_dims"]))]


def _log_softmax_grad(op, dy):
    from .elementwise import exp
    from .reduce import reduce_sum
    y = op.outputs[0]
    return [dy - exp(y) * reduce_sum(dy, reduced_dims=op.params["reduced_dims"])]


def _normalize(name: str, log: bool, grad, doc: str):
    def op(x, reduced_dim):
        names = _reduced_names(x, reduced_dim, name)
        mesh = x.mesh
        layout = mesh.plan(x.shape)
        x = to_layout(x, layout)
        axes = tuple(x.shape.index(n) for n in names)
        split = {splitting(layout[i], mesh.shape) for i in axes} - {None}
        mdims = tuple(m for m in mesh.shape.names if m in split)

        def lower(ctx, a):
            xp = ctx.xp
            a = a.astype(acc) if low else a  # 16-bit floats: computed in float32, rounded once
            m = local_extreme(xp, a, axes, keepdims=True)
            if mdims:
                m = ctx.allreduce(m, mdims, "max")
            m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))  # rows of -inf: no inf - inf
            z = a - m
            e = xp.exp(z)
            s = xp.sum(e, axis=axes, keepdims=True)
            if mdims:
                s = ctx.allreduce(s, mdims, "sum")
            y = z - xp.log(s) if log else e / s
            return y.astype(dt) if low else y
        dt, acc = x.dtype, accumulation_dtype(x.dtype)
        low = acc != dt
        (y,) = dispatch(name, [x], [(x.shape, layout)], lower, {"reduced_dims": names, "mesh_dims": mdims},
                        grad if is_float(x.dtype) else None)
        return y
    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    return op


softmax = _normalize("softmax", False, _softmax_grad,
                     "exp(x) / sum(exp(x)) over `reduced_dim` (a dim or list of dims), computed stably.")
log_softmax = _normalize("log_softmax", True, _log_softmax_grad,
                         "x - logsumexp(x) over `reduced_dim` (a dim or list of dims), computed stably.")
