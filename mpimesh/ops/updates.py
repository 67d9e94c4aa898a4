"""Optimizer updates as one op for many parameters (multi-tensor, as PyTorch's `foreach` optimizers):
`sgd_update` and `adam_update` update every parameter of one dtype in one dispatch. Inputs: the shared
0-d tensors (the step as a float, a scheduled lr), then each parameter's tensors (itself, its gradient,
its slots); outputs: each one's new value and slots, in its layout. Each formula is written once
(`sgd_step`, `adam_step`) over a few operations: new arrays (JAX), in place a chunk at a time (numpy),
mpimesh ops (`mpimesh.optim` op by op), bitwise alike; CuPy runs `ADAM_SOURCE`, `SGD_SOURCE`.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> p, g = mesh.from_numpy(np.array([1.0, 2.0]), "a:2"), mesh.from_numpy(np.array([0.5, -1.0]), "a:2")
>>> (new_p, new_v), = sgd_update([(p, g, mesh.zeros("a:2", "float64"))], lr=0.1, momentum=0.9)
>>> new_p.to_numpy().tolist(), new_v.to_numpy().tolist()
([0.95, 2.1], [0.5, -1.0])
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

import numpy as np

from ..backend import BFLOAT16, cached_kernel
from ..errors import MpimeshError
from ..opdef import OpDef, size
from ..trace import dispatch
from .elementwise import axpy, sqrt
from .inplace import Eager, Functional
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

def kernel_source(which: str, narrow: bool = False) -> tuple:
    """`(in_params, out_params, body, preamble)` of the CuPy kernel `which` ("adam" or "sgd"); `narrow`:
    the gradient read as bfloat16 (its bits) and widened to T as it is loaded (exact, as `cast` widens it:
    `mpimesh.rowfusion` folds a gradient's cast into its update)."""
    ins, outs = ADAM_PARAMS if which == "adam" else SGD_PARAMS
    body = ADAM_SOURCE if which == "adam" else SGD_SOURCE
    if not narrow:
        return ins, outs, body, ""
    return (ins.replace("T g,", "uint16 g16,", 1), outs, "T g = (T)mpimesh_widen(g16);" + body,
            "__device__ float mpimesh_widen(unsigned short v) { return __uint_as_float(((unsigned int)v) << 16); }\n")


def _kernel(xp, which: str, narrow: bool = False):
    """The CuPy ElementwiseKernel `which` (`kernel_source`), compiled on first use."""
    ins, outs, body, preamble = kernel_source(which, narrow)
    return cached_kernel(("updates", which, narrow), lambda: xp.ElementwiseKernel(
        ins, outs, body, f"mpimesh_{which}{'_narrow' * narrow}", preamble=preamble))


# ------------------------------------------------------------------ the formulas, written once

def sgd_step(k, p, g, v, neg_lr, momentum: float, over=()) -> tuple:
    """`mpimesh.optim.SGD`'s step of one parameter in the operations `k` (`mpimesh.ops.inplace`'s
    `Functional`, `Eager`, or `TENSOR_OPS`): `(new p, new v)`; v None: no momentum (new v is g).
    `over`: the outputs (0: p, 1: v) it may write over their inputs."""
    v1 = g if v is None else k.axpy(momentum, v, g, "x" if 1 in over else None)
    return k.axpy(neg_lr, v1, p, "y" if 0 in over else None), v1


def adam_step(k, p, g, m, v, c1, c2, neg_lr, neg_lr_wd, b1: float, b2: float, eps: float, over=()) -> tuple:
    """`mpimesh.optim.Adam`'s step of one parameter in the operations `k` (as `sgd_step`): `(new p,
    new m, new v)`; `c1`, `c2`: 1 - b1**t, 1 - b2**t; `neg_lr_wd`: -lr * weight decay, None for none.
    `over`: the outputs (0: p, 1: m, 2: v) it may write over their inputs."""
    m1 = k.axpy(1.0 - b1, g, k.scale(m, b1, 1 in over), "y" if 1 in over else None)
    v1 = k.axpy(1.0 - b2, g * g, k.scale(v, b2, 2 in over), "y" if 2 in over else None)
    u = k.quotient(m1 / c1, k.plus(k.sqrt(v1 / c2), eps))
    if neg_lr_wd is None:
        return k.axpy(neg_lr, u, p, "y" if 0 in over else None), m1, v1
    if 0 in over:  # the decay of the old p, taken before p's block gets the new value (q + d == d + q)
        decay = p * neg_lr_wd
        return k.plus(k.axpy(neg_lr, u, p, "y"), decay), m1, v1
    return k.axpy(neg_lr_wd, p, k.axpy(neg_lr, u, p)), m1, v1


class _TensorOps(Functional):
    """The formulas' operations as mpimesh ops on DistTensors (`mm.axpy`, `*`, `+`, `/`, `mm.sqrt`)."""

    def __init__(self):
        super().__init__(None)

    def axpy(self, alpha, x, y, over=None):
        return axpy(alpha, x, y)

    def sqrt(self, a):
        return sqrt(a)


TENSOR_OPS = _TensorOps()
"""`sgd_step` and `adam_step` on DistTensors, one op each: `mpimesh.optim`'s update op by op."""


# ------------------------------------------------------------------ the kernels

def widened(p, g, dtype):
    """`p` and `g` in the update's dtype (as `cast` makes them), where theirs is narrower."""
    if dtype is None:
        return p, g
    return (p if p.dtype == dtype else p.astype(dtype)), (g if g.dtype == dtype else g.astype(dtype))


def _narrow(cuda: bool, dtype, p, g, *slots) -> bool:
    """Whether CuPy's kernel reads a bfloat16 `g` as it is (`kernel_source`: widened as it loads it) for a
    float32 update (`dtype`, p and its slots float32)."""
    return cuda and g.dtype == BFLOAT16 and dtype == np.float32 and all(a.dtype == dtype for a in (p, *slots))


def gradient_inputs(op: OpDef, params: dict, n_inputs: int) -> list:
    """The input indices of the gradients of an `sgd_update` or `adam_update` op, else []."""
    if op.kernels is ADAM_KERNELS:
        first, k = 1 + (params["lr"] is None), 4
    elif op.kernels is SGD_KERNELS:
        first, k = int(params["lr"] is None), 3 if params["momentum"] else 2
    else:
        return []
    return list(range(first + 1, n_inputs, k))


def _rounded(a, dtype):
    return a if a.dtype == dtype else a.astype(dtype)


def _groups(arrays, n_shared: int, k: int) -> tuple:
    """The shared blocks, and each parameter's `k` blocks."""
    return arrays[:n_shared], [arrays[i:i + k] for i in range(n_shared, len(arrays), k)]


def _mine(into, j: int, n_out: int) -> frozenset:
    """The outputs (0..n_out-1) of parameter j that the replay lets the kernel write over their inputs."""
    return frozenset(o for o in range(n_out) if j * n_out + o in into)


def _result(out: list):
    return tuple(out) if len(out) > 1 else out[0]  # (dispatch takes one output bare)


def _typed(value, dtype):
    """A 0-d array in `dtype` (a Python number as it is): a CuPy ElementwiseKernel refuses arrays of
    two dtypes for one type placeholder (a float64 schedule's lr beside float32 parameters)."""
    return value.astype(dtype) if hasattr(value, "astype") and value.dtype != dtype else value


def _in_place(dtype, p, *values) -> bool:
    """Whether writing over the inputs gives the usual values: no widening, and every other array
    and number of the update in p's dtype (a Python number adapts to it; numpy's scalars do not), so
    that no intermediate is computed wider and rounded back."""
    if dtype is not None and dtype != p.dtype:
        return False
    return all(v is None or type(v) in (int, float) or getattr(v, "dtype", None) == p.dtype for v in values)


def _sgd_kernel(ops: Callable, in_place: bool = False, cuda: bool = False) -> Callable:
    """An `sgd_update` kernel in the operations `ops(xp)`; `in_place`: it writes over what `into`
    allows; `cuda`: a parameter with momentum and one dtype runs `SGD_SOURCE`."""
    def kernel(ctx, *arrays, lr, momentum, dtype, into=()):
        xp = ctx.xp
        shared, groups = _groups(arrays, int(lr is None), 3 if momentum else 2)
        neg_lr = -shared[0] if lr is None else -lr
        k, n_out, out = ops(xp), 2 if momentum else 1, []
        for j, (p, g, *v) in enumerate(groups):
            v = v[0] if v else None
            over = _mine(into, j, n_out) if in_place and into and _in_place(dtype, p, g, v, neg_lr) else ()
            pdt = p.dtype
            narrow = v is not None and _narrow(cuda, dtype, p, g, v)
            p, g = (p, g.view(np.uint16)) if narrow else widened(p, g, dtype)
            if narrow or cuda and v is not None and p.dtype == g.dtype == v.dtype:
                p1, v1 = _kernel(xp, "sgd", narrow)(p, g, v, _typed(neg_lr, p.dtype), momentum, True)
            else:
                p1, v1 = sgd_step(k, p, g, v, neg_lr, momentum, over)
            out += [_rounded(p1, pdt), v1][:n_out]
        return _result(out)
    return kernel


def _adam_kernel(ops: Callable, in_place: bool = False, cuda: bool = False) -> Callable:
    """An `adam_update` kernel, as `_sgd_kernel` (`cuda`: a parameter of one dtype runs `ADAM_SOURCE`)."""
    def kernel(ctx, *arrays, lr, beta1, beta2, epsilon, weight_decay, dtype, into=()):
        xp = ctx.xp
        shared, groups = _groups(arrays, 1 + (lr is None), 4)
        lr_ = shared[1] if lr is None else lr
        c1, c2 = xp.asarray(1.0 - beta1 ** shared[0]), xp.asarray(1.0 - beta2 ** shared[0])
        neg_lr, neg_lr_wd = -lr_, -(lr_ * weight_decay)
        k, out = ops(xp), []
        for j, (p, g, m, v) in enumerate(groups):
            mine = in_place and into and _in_place(dtype, p, g, m, v, c1, c2, neg_lr, neg_lr_wd)
            pdt = p.dtype
            narrow = _narrow(cuda, dtype, p, g, m, v)
            p, g = (p, g.view(np.uint16)) if narrow else widened(p, g, dtype)
            if narrow or cuda and p.dtype == g.dtype == m.dtype == v.dtype:
                scalars = (_typed(a, p.dtype) for a in (c1, c2, neg_lr, neg_lr_wd))
                p1, m1, v1 = _kernel(xp, "adam", narrow)(p, g, m, v, *scalars, beta1, beta2, 1.0 - beta1, 1.0 - beta2,
                                                         epsilon, bool(weight_decay))
            else:
                p1, m1, v1 = adam_step(k, p, g, m, v, c1, c2, neg_lr, neg_lr_wd if weight_decay else None, beta1,
                                       beta2, epsilon, _mine(into, j, 3) if mine else ())
            out += [_rounded(p1, pdt), m1, v1]
        return _result(out)
    return kernel


def _numpy(xp):
    return Eager(xp, chunked=True)


SGD_KERNELS = {"numpy": _sgd_kernel(_numpy, in_place=True), "cupy": _sgd_kernel(Eager, cuda=True)}
ADAM_KERNELS = {"numpy": _adam_kernel(_numpy, in_place=True), "cupy": _adam_kernel(Eager, cuda=True)}
"""The update ops' kernels per backend (every `OpDef` of an op shares its dict); JAX runs the generic
kernels (`Functional`: new arrays)."""


# ------------------------------------------------------------------ the ops

def _news(outs, n_out: int) -> list:
    """The parameters' new blocks among an update's outputs (each parameter's n_out, p's first)."""
    return list(outs[::n_out])


def _scratch(n_out: int, temporaries: int) -> Callable:
    """An update's `scratch`: `temporaries` parameter-sized arrays in the update's dtype at once, and
    a copy of p and g where they are widened (the largest parameter's)."""
    def scratch(params, ins, outs) -> int:
        dtype = params["dtype"]
        return max((size(p) * np.dtype(dtype or p.dtype).itemsize
                    * (temporaries + 2 * (dtype is not None and p.dtype != dtype)) for p in _news(outs, n_out)),
                   default=0)
    return scratch


def _sgd_flops(params, ins, outs) -> int:
    """Per element: v = momentum * v + g (2, with momentum), p = -lr * v + p (2)."""
    n_out = 2 if params["momentum"] else 1
    return 2 * n_out * sum(size(p) for p in _news(outs, n_out))


def _adam_flops(params, ins, outs) -> int:
    """Per element: m = (1 - b1) g + b1 m (3), v = (1 - b2) g*g + b2 v (4), u = (m / c1) / (sqrt(v /
    c2) + eps) (5), p = -lr u + p (2), and -lr wd p + p (2) with weight decay."""
    return (16 if params["weight_decay"] else 14) * sum(size(p) for p in _news(outs, 3))


def _sgd_abstract(ctx, shapes, *ins, lr, momentum, dtype) -> tuple:
    """New p in p's dtype; new v in numpy's promotion of `momentum * v + g` (g widened to `dtype`)."""
    _, groups = _groups(ins, int(lr is None), 3 if momentum else 2)
    return tuple(d for p, g, *v in groups
                 for d in (p.dtype, *(np.result_type(s.dtype, dtype or g.dtype, momentum) for s in v)))


def _adam_abstract(ctx, shapes, *ins, lr, beta1, beta2, dtype, **_) -> tuple:
    """New p in p's dtype; m and v in numpy's promotion of their formulas (g widened to `dtype`)."""
    _, groups = _groups(ins, 1 + (lr is None), 4)
    return tuple(d for p, g, m, v in groups for d in (p.dtype, np.result_type(m.dtype, dtype or g.dtype, beta1),
                                                      np.result_type(v.dtype, dtype or g.dtype, beta2)))


_SGD, _ADAM = _sgd_kernel(Functional), _adam_kernel(Functional)  # (the generic kernels: JAX's)
_KINDS = {  # name, tensors per parameter, {output: input} of one parameter, kernels, flops, abstract, temporaries
    "sgd": ("sgd_update", 2, {0: 0}, _SGD, SGD_KERNELS, _sgd_flops, _sgd_abstract, 0),
    "sgd momentum": ("sgd_update", 3, {0: 0, 1: 2}, _SGD, SGD_KERNELS, _sgd_flops, _sgd_abstract, 0),
    "adam": ("adam_update", 4, {0: 0, 1: 2, 2: 3}, _ADAM, ADAM_KERNELS, _adam_flops, _adam_abstract, 2)}


@lru_cache(maxsize=256)
def _update_op(kind: str, n_groups: int, n_shared: int) -> OpDef:
    """The `OpDef` of update `kind` (a key of `_KINDS`) of `n_groups` parameters after `n_shared`
    shared inputs: its `into` maps each parameter's new value and slots over the old."""
    name, k, slots, kernel, kernels, flops, abstract, temporaries = _KINDS[kind]
    n_out = len(slots)
    into = {j * n_out + o: n_shared + j * k + i for j in range(n_groups) for o, i in slots.items()}
    return OpDef(name, kernel, kernels=kernels, into=into, flops=flops, scratch=_scratch(n_out, temporaries),
                 abstract=abstract)


def _fused(kind: str, groups: Sequence[tuple], shared: Sequence, params: dict) -> list:
    """Dispatch update `kind` (`_KINDS`) over `groups` (each parameter's tensors, the parameter first,
    all brought to its layout) after the 0-d tensors `shared`; returns each group's new tensors."""
    if not groups:
        return []
    op, k, slots = _KINDS[kind][:3]
    n_out = len(slots)
    mesh = groups[0][0].mesh
    for group in groups:
        p = group[0]
        if len(group) != k:
            raise MpimeshError(f"{op}: each group must be {k} tensors here, got {len(group)} for a parameter of "
                               f"shape {p.shape}")
        if p.mesh is not mesh:
            raise MpimeshError(f"{op}: parameters live on different meshes")
        for t in group[1:]:
            if t.shape != p.shape:
                raise MpimeshError(f"{op}: a tensor of shape {t.shape} goes with a parameter of shape {p.shape}")
    groups = [tuple(to_layout(t, g[0].tensor_layout) for t in g) for g in groups]
    specs = [(g[0].shape, g[0].tensor_layout) for g in groups for _ in range(n_out)]
    outs = dispatch(_update_op(kind, len(groups), len(shared)), [*shared, *(t for g in groups for t in g)], specs,
                    params)
    return [tuple(outs[j * n_out:(j + 1) * n_out]) for j in range(len(groups))]


def _dtype(dtype):
    return None if dtype is None else np.dtype(dtype)


def sgd_update(groups: Sequence[tuple], lr, momentum: float = 0.0, dtype=None) -> list:
    """SGD for many parameters in one op: each group is `(p, g)`, or `(p, g, v)` with momentum;
    returns `(new_p,)` or `(new_p, new_v)` per group. `lr`: a number or a 0-d tensor (a schedule);
    `dtype`: as in `adam_update`. The formulas are `mpimesh.optim.SGD`'s (`sgd_step`):

        v <- momentum * v + g;  p <- p - lr * v       (v is g without momentum)
    """
    scaled = hasattr(lr, "tensor_layout")
    params = {"lr": None if scaled else lr, "momentum": momentum, "dtype": _dtype(dtype)}
    return _fused("sgd momentum" if momentum else "sgd", groups, [lr] if scaled else [], params)


def adam_update(groups: Sequence[tuple], t, lr, beta1: float, beta2: float, epsilon: float,
                weight_decay: float = 0.0, dtype=None) -> list:
    """Adam(W) for many parameters in one op: each group is `(p, g, m, v)`, `t` the 1-based step as
    a 0-d float tensor, `lr` a number or a 0-d tensor; returns `(new_p, new_m, new_v)` per group.
    `dtype`: the dtype the update computes in, where a parameter's is narrower (its new value is
    rounded back once, as `cast` would). The formulas are `mpimesh.optim.Adam`'s (`adam_step`)."""
    scaled = hasattr(lr, "tensor_layout")
    params = {"beta1": beta1, "beta2": beta2, "epsilon": epsilon, "weight_decay": weight_decay,
              "lr": None if scaled else lr, "dtype": _dtype(dtype)}
    return _fused("adam", groups, [t, lr] if scaled else [t], params)
