"""Optimizer updates as one op for many parameters (multi-tensor, as PyTorch's `foreach` and
`fused` optimizers): `sgd_update` and `adam_update` update every parameter of one dtype in one
dispatch, instead of a dozen small ops per parameter.

Each op's inputs are the shared 0-d tensors (the step as a float, a scheduled learning rate),
then each parameter's tensors (parameter, gradient, state slots), all in the parameter's layout;
its outputs are each parameter's new value and new slots, in the same layout. The update is
elementwise, so no communication. The kernels sit side by side:

- numpy and JAX (`_sgd`, `_adam`): the same arithmetic, in the same order, as the unfused
  composition in `mpimesh.optim` (`axpy`, `*`, `/`, `sqrt`): bitwise the same values on numpy;
- CuPy: one `ElementwiseKernel` per parameter (`ADAM_SOURCE`, `SGD_SOURCE`), compiled once. nvcc
  may contract a multiply-add into an FMA, so a GPU's values can differ from the unfused ops in
  the last bit.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> p, g = mesh.from_numpy(np.array([1.0, 2.0]), "a:2"), mesh.from_numpy(np.array([0.5, -1.0]), "a:2")
>>> (new_p, new_v), = sgd_update([(p, g, mesh.zeros("a:2", "float64"))], lr=0.1, momentum=0.9)
>>> new_p.to_numpy().tolist(), new_v.to_numpy().tolist()
([0.95, 2.1], [0.5, -1.0])
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..backend import is_eager, name
from ..errors import MpimeshError
from ..trace import dispatch_lower
from . import inplace
from .relayout import to_layout

ADAM_SOURCE = """
    T m_ = b1 * m;  m1 = g * one_b1 + m_;                        // axpy(1 - b1, g, b1 * m)
    T v_ = b2 * v;  v1 = (g * g) * one_b2 + v_;                  // axpy(1 - b2, g * g, b2 * v)
    T u = (m1 / c1) / (sqrt(v1 / c2) + eps);
    T q = u * neg_lr + p;                                        // axpy(-lr, u, p)
    p1 = decay ? p * neg_lr_wd + q : q;                          // axpy(-lr * wd, p, ...)
"""
"""The CuPy kernel of `adam_update` for one parameter (float32 or float64 `T`). `one_b1` is
`1 - b1` computed in double and rounded to T once, as numpy's `g * (1.0 - b1)` rounds it."""
ADAM_PARAMS = ("T p, T g, T m, T v, T c1, T c2, T neg_lr, T neg_lr_wd, T b1, T b2, T one_b1, T one_b2, T eps, "
               "bool decay", "T p1, T m1, T v1")

SGD_SOURCE = """
    v1 = momentum ? v * mom + g : g;                             // axpy(momentum, v, g)
    p1 = v1 * neg_lr + p;                                        // axpy(-lr, v, p)
"""
"""The CuPy kernel of `sgd_update` for one parameter."""
SGD_PARAMS = ("T p, T g, T v, T neg_lr, T mom, bool momentum", "T p1, T v1")

_cuda: dict = {}


def _axpy(xp, alpha, x, y):
    return (inplace.axpy_new_chunked if name(xp) == "numpy" else inplace.axpy_new)(xp, alpha, x, y)


def axpy_into(xp, alpha, x, y):
    return (inplace.axpy_into_chunked if name(xp) == "numpy" else inplace.axpy_into)(xp, alpha, x, y)


def scale_add_into(xp, alpha, x, y):
    return (inplace.scale_add_into_chunked if name(xp) == "numpy" else inplace.scale_add_into)(xp, alpha, x, y)


def _kernel(xp, which: str):
    """The CuPy ElementwiseKernel `which` ("adam" or "sgd"), compiled on first use."""
    if which not in _cuda:
        params, source = (ADAM_PARAMS, ADAM_SOURCE) if which == "adam" else (SGD_PARAMS, SGD_SOURCE)
        _cuda[which] = xp.ElementwiseKernel(*params, source, f"mpimesh_{which}")
    return _cuda[which]


def _plus(xp, a, b):
    """`a + b`, into `a` on an eager backend (`a` is a temporary: one array fewer, the same values)."""
    if is_eager(xp) and a.ndim:
        return xp.add(a, b, out=a)
    return a + b


def _quotient(xp, a, b):
    """`a / b`, into `a` on an eager backend (as `_plus`)."""
    if is_eager(xp) and a.ndim and a.dtype == xp.result_type(a, b):
        return xp.divide(a, b, out=a)
    return a / b


def _fused(op: str, kernel, groups: Sequence[tuple], shared: Sequence, n_out: int, params: dict,
           flops_per_element: int, scratch: int, dtype=None, into: dict = None) -> list:
    """Dispatch `op`: `kernel(xp, shared_arrays, *group_arrays, into=...)` -> n_out arrays, for each
    group (a parameter's tensors, the parameter first); returns each group's n_out output tensors.
    `scratch`: how many parameter-sized temporaries (in `dtype`, default the parameter's, plus a
    copy of p and g where they are narrower) the kernel holds at once, for the cost model.
    `into`: `{output: input}` positions within a group that the kernel can write in place (passed
    `into=` the outputs a compiled replay lets it: `mpimesh.compiled`)."""
    if not groups:
        return []
    first = groups[0][0]
    mesh = first.mesh
    for group in groups:
        p = group[0]
        if p.mesh is not mesh:
            raise MpimeshError(f"{op}: parameters live on different meshes")
        for t in group[1:]:
            if t.shape != p.shape:
                raise MpimeshError(f"{op}: a tensor of shape {t.shape} goes with a parameter of shape {p.shape}")
    groups = [tuple(to_layout(t, g[0].tensor_layout) for t in g) for g in groups]
    sizes = [len(g) for g in groups]
    n_shared = len(shared)

    def lower(ctx, *arrays, into=()):
        xp, out, i = ctx.xp, [], n_shared
        values = arrays[:n_shared]
        for g, k in enumerate(sizes):
            mine = {j for j in range(n_out) if g * n_out + j in into}
            out.extend(kernel(xp, values, *arrays[i:i + k], into=mine))
            i += k
        return tuple(out) if len(out) > 1 else out[0]  # (dispatch takes one output bare)
    if into:
        starts = [n_shared + sum(sizes[:g]) for g in range(len(sizes))]
        lower.into = {g * n_out + j: starts[g] + i for g in range(len(sizes)) for j, i in into.items()}
    specs = [(g[0].shape, g[0].tensor_layout) for g in groups for _ in range(n_out)]
    flops = flops_per_element * sum(math.prod(g[0].local.shape) for g in groups)
    widest = max(math.prod(g[0].local.shape) * np.dtype(dtype or g[0].dtype).itemsize
                 * (scratch + 2 * (dtype is not None and g[0].dtype != dtype)) for g in groups)
    params = dict(params, scratch_bytes=widest)
    outs = dispatch_lower(op, [*shared, *(t for g in groups for t in g)], specs, lower, params, None, flops)
    return [tuple(outs[j * n_out:(j + 1) * n_out]) for j in range(len(groups))]


def _widened(p, g, dtype):
    """`p` and `g` in the update's dtype (as `cast` makes them), where theirs is narrower."""
    if dtype is None:
        return p, g
    return (p if p.dtype == dtype else p.astype(dtype)), (g if g.dtype == dtype else g.astype(dtype))


def sgd_update(groups: Sequence[tuple], lr, momentum: float = 0.0, dtype=None) -> list:
    """SGD for many parameters in one op: each group is `(p, g)`, or `(p, g, v)` with momentum;
    returns `(new_p,)` or `(new_p, new_v)` per group. `lr`: a number or a 0-d tensor (a schedule);
    `dtype`: as in `adam_update`. The formulas are `mpimesh.optim.SGD`'s:

        v <- momentum * v + g;  p <- p - lr * v       (v is g without momentum)
    """
    scaled = hasattr(lr, "tensor_layout")

    def kernel(xp, shared, p, g, v=None, into=()):
        pdt = p.dtype
        neg_lr = -shared[0] if scaled else -lr
        if into and _in_place(xp, dtype, p, g, v, neg_lr):
            v1 = g if v is None else scale_add_into(xp, momentum, v, g) if 1 in into else _axpy(xp, momentum, v, g)
            p1 = axpy_into(xp, neg_lr, v1, p) if 0 in into else _axpy(xp, neg_lr, v1, p)
            return (p1, v1) if v is not None else (p1,)
        p, g = _widened(p, g, dtype)
        if name(xp) == "cupy" and v is not None:
            p1, v1 = _kernel(xp, "sgd")(p, g, v, _typed(neg_lr, p.dtype), momentum, True)
        else:
            v1 = _axpy(xp, momentum, v, g) if v is not None else g
            p1 = _axpy(xp, neg_lr, v1, p)
        p1 = p1 if p1.dtype == pdt else p1.astype(pdt)
        return (p1, v1) if v is not None else (p1,)
    n_out = 2 if momentum else 1
    return _fused("sgd_update", kernel, groups, [lr] if scaled else [], n_out,
                  {"momentum": momentum, "lr": None if scaled else lr}, 2 * n_out, 0, dtype,
                  {0: 0, 1: 2} if momentum else {0: 0})


def adam_update(groups: Sequence[tuple], t, lr, beta1: float, beta2: float, epsilon: float,
                weight_decay: float = 0.0, dtype=None) -> list:
    """Adam(W) for many parameters in one op: each group is `(p, g, m, v)`, `t` the 1-based step as
    a 0-d float tensor, `lr` a number or a 0-d tensor; returns `(new_p, new_m, new_v)` per group.
    `dtype`: the dtype the update computes in, where a parameter's is narrower (its new value is
    rounded back once, as `cast` would). The formulas are `mpimesh.optim.Adam`'s."""
    scaled = hasattr(lr, "tensor_layout")
    b1, b2, eps, wd = beta1, beta2, epsilon, weight_decay

    def kernel(xp, shared, p, g, m, v, into=()):
        tt = shared[0]
        lr_ = shared[1] if scaled else lr
        pdt = p.dtype
        c1, c2 = xp.asarray(1.0 - b1 ** tt), xp.asarray(1.0 - b2 ** tt)
        neg_lr = -lr_
        neg_lr_wd = -(lr_ * wd)
        if into and _in_place(xp, dtype, p, g, m, v, c1, c2, neg_lr, neg_lr_wd):
            return _adam_into(xp, into, p, g, m, v, c1, c2, neg_lr, neg_lr_wd, b1, b2, eps, wd)
        p, g = _widened(p, g, dtype)
        if name(xp) == "cupy":
            c1, c2, neg_lr, neg_lr_wd = (_typed(u, p.dtype) for u in (c1, c2, neg_lr, neg_lr_wd))
            p1, m1, v1 = _kernel(xp, "adam")(p, g, m, v, c1, c2, neg_lr, neg_lr_wd, b1, b2, 1.0 - b1, 1.0 - b2,
                                             eps, bool(wd))
        else:
            m1 = _axpy(xp, 1.0 - b1, g, b1 * m)
            v1 = _axpy(xp, 1.0 - b2, g * g, b2 * v)
            p1 = _axpy(xp, neg_lr, _quotient(xp, m1 / c1, _plus(xp, xp.sqrt(v1 / c2), eps)), p)
            if wd:
                p1 = _axpy(xp, neg_lr_wd, p, p1)
        return (p1.astype(pdt) if p1.dtype != pdt else p1), m1, v1
    return _fused("adam_update", kernel, groups, [t, lr] if scaled else [t], 3,
                  {"beta1": b1, "beta2": b2, "epsilon": eps, "weight_decay": wd,
                   "lr": None if scaled else lr}, 12, 2, dtype, {0: 0, 1: 2, 2: 3})


def _typed(value, dtype):
    """A 0-d array in `dtype` (a Python number as it is): a CuPy ElementwiseKernel refuses arrays of
    two dtypes for one type placeholder (a float64 schedule's lr beside float32 parameters)."""
    return value.astype(dtype) if hasattr(value, "astype") and value.dtype != dtype else value


def _in_place(xp, dtype, p, *values) -> bool:
    """Whether the in-place kernels give the usual kernel's values: on numpy, with no widening, and
    every other array and number of the update in p's dtype (a Python number adapts to it; numpy's
    scalars do not), so that no intermediate is computed wider and rounded back."""
    if name(xp) != "numpy" or (dtype is not None and np.dtype(dtype) != p.dtype):
        return False
    return all(v is None or type(v) in (int, float) or getattr(v, "dtype", None) == p.dtype for v in values)


def _adam_into(xp, into, p, g, m, v, c1, c2, neg_lr, neg_lr_wd, b1, b2, eps, wd) -> tuple:
    """`adam_update`'s numpy kernel with the new p, m, v (outputs 0, 1, 2 in `into`) written over
    the old: the same operations in the same order, so the same values."""
    m1 = axpy_into(xp, 1.0 - b1, g, np.multiply(m, b1, out=m)) if 1 in into else _axpy(xp, 1.0 - b1, g, b1 * m)
    v1 = axpy_into(xp, 1.0 - b2, g * g, np.multiply(v, b2, out=v)) if 2 in into else _axpy(xp, 1.0 - b2, g * g, b2 * v)
    u = _quotient(xp, m1 / c1, _plus(xp, xp.sqrt(v1 / c2), eps))
    decay = np.multiply(p, neg_lr_wd) if wd else None  # (of the old p)
    if 0 not in into:
        p1 = _axpy(xp, neg_lr, u, p)
        return (_axpy(xp, neg_lr_wd, p, p1) if wd else p1), m1, v1
    p1 = axpy_into(xp, neg_lr, u, p)
    return (np.add(p1, decay, out=p1) if wd else p1), m1, v1
