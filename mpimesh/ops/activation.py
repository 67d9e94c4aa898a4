"""Bias plus activation as one op, its gradient as one op: `bias_activation(x, bias, "relu")` is
`relu(x + bias)` (also "gelu", tanh approximation, "tanh", and None: the sum alone), with the arithmetic of
the unfused ops (`add`, `mm.relu`, `mm.gelu`). The gradient recomputes `x + bias` (nothing else is
kept) and gives dx in one op; the bias's gradient is dx summed to its dims, an einsum that a
data-parallel sum can take into a gradient bucket (`mpimesh.buckets`). On CuPy (float32, float64)
the op and its gradient are one `ElementwiseKernel` each (`SOURCES`), the bias broadcast in.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x, b = mesh.from_numpy(np.array([[-1.0, 2.0]]), "n:1;h:2"), mesh.from_numpy(np.array([0.5, -3.0]), "h:2")
>>> bias_activation(x, b, "relu").to_numpy().tolist()
[[0.0, 0.0]]
"""
from __future__ import annotations

import math
from typing import Optional

from ..backend import align, is_low_precision, name
from ..errors import ShapeError
from ..partials import partial_for
from ..promotion import cast_operands, operand_casts
from ..trace import dispatch_lower, saving
from .elementwise import _gelu, _round_to, bias_grad
from .relayout import laid_out_within, to_layout

_C = math.sqrt(2.0 / math.pi)


def _relu(xp, a):
    return xp.maximum(a, 0)


def _relu_grad(xp, a, g):
    return g * (a > 0)


def _gelu_grad(xp, a, g):
    t = xp.tanh(_C * (a + 0.044715 * a * a * a))
    return g * (0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * a * a))


def _tanh_grad(xp, a, g):
    y = xp.tanh(a)
    return g * (1.0 - y * y)


ACTIVATIONS = {"relu": (_relu, _relu_grad), "gelu": (_gelu, _gelu_grad), "tanh": (lambda xp, a: xp.tanh(a), _tanh_grad),
               None: (lambda xp, a: a, lambda xp, a, g: g)}
"""name -> (forward kernel, gradient kernel `(xp, pre-activation, dy) -> dx`)."""

_GELU_T = "T t = tanh((T)0.7978845608028654 * (a + (T)0.044715 * a * a * a));"  # sqrt(2/pi)
SOURCES = {
    "relu": ("y = (a > (T)0 || a != a) ? a : (T)0;",  # numpy's maximum(a, 0): NaN kept, -0 -> +0
             "dx = g * (T)(a > (T)0);"),
    "gelu": (_GELU_T + " y = (T)0.5 * a * ((T)1.0 + t);",
             _GELU_T + " dx = g * ((T)0.5 * ((T)1.0 + t) + (T)0.5 * a * ((T)1.0 - t * t) * (T)0.7978845608028654"
                       " * ((T)1.0 + (T)(3 * 0.044715) * a * a));"),
    "tanh": ("y = tanh(a);", "T t = tanh(a); dx = g * ((T)1.0 - t * t);"),
    None: ("y = a;", "dx = g;"),
}
"""name -> (forward, gradient) bodies of the CuPy kernels, the arithmetic of the numpy kernels
above in the same order: `a` is the pre-activation (x + bias), `g` the output's gradient."""
_KERNEL_DTYPES = ("float32", "float64")
_cuda: dict = {}


def kernel_params(activation: Optional[str], grad: bool, bias: bool) -> tuple[str, str, str]:
    """`(inputs, outputs, body)` of the CuPy kernel of `bias_<activation>` (`grad`: its gradient)."""
    inputs = "T x" + (", T g" if grad else "") + (", T b" if bias else "")
    return inputs, "T dx" if grad else "T y", ("T a = x + b; " if bias else "T a = x; ") + SOURCES[activation][grad]


def _fused(xp, activation: Optional[str], grad: bool, arrays: tuple):
    """The CuPy kernel, compiled on first use, applied to `arrays` (x[, dy][, bias aligned to x])."""
    key = (activation, grad, len(arrays) == 2 + grad)
    if key not in _cuda:
        _cuda[key] = xp.ElementwiseKernel(*kernel_params(*key), f"mpimesh_bias_{activation or 'add'}"
                                          + ("_grad" if grad else ""))
    return _cuda[key](*arrays)


def bias_activation(x, bias=None, activation: Optional[str] = "relu"):
    """`activation(x + bias)` in one op, named `bias_<activation>` (`bias_add` without one; `bias`
    None: `activation(x)`; its dims a subset of x's)."""
    if activation not in ACTIVATIONS:
        raise ShapeError(f"bias_activation: unknown activation {activation!r}; choose relu, gelu, tanh or None")
    layout = x.mesh.plan(x.shape)
    x = to_layout(x, layout)
    inputs = [x]
    if bias is not None:
        inputs.append(laid_out_within(bias, x, "bias_activation", "bias"))
    xd, bd = x.shape.names, None if bias is None else bias.shape.names
    forward, backward = ACTIVATIONS[activation]
    op_name = f"bias_{activation or 'add'}"
    low = x.dtype if is_low_precision(x.dtype) else None  # a 16-bit float stays one, as the unfused op keeps it

    def act(xp, a):
        return forward(xp, a) if low is None else _round_to(forward(xp, a), low)
    casts = None if bias is None or bias.dtype == x.dtype else operand_casts((x.dtype, bias.dtype))

    def pre(xp, a, b):  # x + bias in their promotion (`mm.result_type`: float32 with int32 is float32)
        if not b:
            return a
        a, c = cast_operands((a, b[0]), casts)
        return a + align(xp, c, bd, xd)

    def fits(xp, *arrays) -> bool:  # the CuPy kernel takes them
        return name(xp) == "cupy" and arrays[0].dtype.name in _KERNEL_DTYPES and all(
            v.dtype == arrays[0].dtype for v in arrays)

    def lower(ctx, a, *b):
        if fits(ctx.xp, a, *b):
            return _fused(ctx.xp, activation, False, (a, *(align(ctx.xp, b[0], bd, xd) for _ in b)))
        return act(ctx.xp, pre(ctx.xp, a, b))

    def rule(op, dy):
        need = op.needs or (True,) * len(op.inputs)
        dy = to_layout(dy, layout)

        def grad(ctx, a, g, *b):
            if fits(ctx.xp, a, g, *b):
                return _fused(ctx.xp, activation, True, (a, g, *(align(ctx.xp, b[0], bd, xd) for _ in b)))
            d = backward(ctx.xp, pre(ctx.xp, a, b), g)
            return d.astype(g.dtype) if d.dtype != g.dtype else d
        (dx,) = dispatch_lower(f"{op_name}_grad", [op.inputs[0], dy, *op.inputs[1:]], [(dy.shape, layout)], grad)
        if len(op.inputs) == 1:
            return [dx]
        with partial_for(op.inputs[1]):
            db = bias_grad(dx, op.inputs[1]) if need[1] else None
        return [dx if need[0] else None, db]
    saving(rule, "all")
    (y,) = dispatch_lower(op_name, inputs, [(x.shape, layout)], lower, {"activation": activation}, rule)
    return y
