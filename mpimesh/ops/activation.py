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
from functools import lru_cache
from types import SimpleNamespace
from typing import Optional

import numpy as np

from ..backend import align, cached_kernel, is_low_precision
from ..errors import ShapeError
from ..opdef import ALL, C_TYPES, OpDef, size
from ..partials import partial_for
from ..promotion import cast_operands, operand_casts
from ..trace import dispatch
from .elementwise import bias_grad, gelu_values, no_c, round_to
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


ACTIVATIONS = {"relu": (_relu, _relu_grad), "gelu": (gelu_values, _gelu_grad), "tanh": (lambda xp, a: xp.tanh(a), _tanh_grad),
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


def kernel_params(activation: Optional[str], grad: bool, bias: bool) -> tuple[str, str, str]:
    """`(inputs, outputs, body)` of the CuPy kernel of `bias_<activation>` (`grad`: its gradient)."""
    inputs = "T x" + (", T g" if grad else "") + (", T b" if bias else "")
    return inputs, "T dx" if grad else "T y", ("T a = x + b; " if bias else "T a = x; ") + SOURCES[activation][grad]


def _fused(xp, activation: Optional[str], grad: bool, arrays: tuple):
    """The CuPy kernel, compiled on first use, applied to `arrays` (x[, dy][, bias aligned to x])."""
    key = (activation, grad, len(arrays) == 2 + grad)
    return cached_kernel(("activation",) + key, lambda: xp.ElementwiseKernel(
        *kernel_params(*key), f"mpimesh_bias_{activation or 'add'}" + ("_grad" if grad else "")))(*arrays)


def _fits(*arrays) -> bool:
    """Whether the CuPy kernel takes `arrays` (one of `_KERNEL_DTYPES`)."""
    return arrays[0].dtype.name in _KERNEL_DTYPES and all(v.dtype == arrays[0].dtype for v in arrays)


def _pre(xp, a, b: tuple, xd: tuple, bd, casts):
    """x + bias in their promotion (`mm.result_type`: float32 with int32 is float32); x without one."""
    if not b:
        return a
    a, c = cast_operands((a, b[0]), casts)
    return a + align(xp, c, bd, xd)


def _forward(ctx, a, *b, activation, xd, bd, casts, low):
    """`activation(x + bias)` from the blocks of x and the bias (`b`, if any); rounded back to a 16-bit
    float x's dtype (`low`), as the unfused op keeps it."""
    y = ACTIVATIONS[activation][0](ctx.xp, _pre(ctx.xp, a, b, xd, bd, casts))
    return y if low is None else round_to(y, low)


def _forward_cupy(ctx, a, *b, activation, xd, bd, casts, low):
    if _fits(a, *b):
        return _fused(ctx.xp, activation, False, (a, *(align(ctx.xp, b[0], bd, xd) for _ in b)))
    return _forward(ctx, a, *b, activation=activation, xd=xd, bd=bd, casts=casts, low=low)


def _backward(ctx, a, g, *b, activation, xd, bd, casts):
    """dx in dy's dtype from the blocks of x, dy and the bias (`b`, if any)."""
    d = ACTIVATIONS[activation][1](ctx.xp, _pre(ctx.xp, a, b, xd, bd, casts), g)
    return d.astype(g.dtype) if d.dtype != g.dtype else d


def _backward_cupy(ctx, a, g, *b, activation, xd, bd, casts):
    if _fits(a, g, *b):
        return _fused(ctx.xp, activation, True, (a, g, *(align(ctx.xp, b[0], bd, xd) for _ in b)))
    return _backward(ctx, a, g, *b, activation=activation, xd=xd, bd=bd, casts=casts)


_PROBE = SimpleNamespace(xp=np)  # a kernel's context on empty numpy blocks


def _forward_abstract(ctx, shapes, *ins, **params) -> tuple:
    """The output's dtype, from the kernel run on empty numpy blocks of the inputs' dtypes (no communication)."""
    return (_dtype_of(tuple((a.dtype, len(a.shape)) for a in ins), tuple(sorted(params.items()))),)


@lru_cache(maxsize=1024)
def _dtype_of(blocks: tuple, params: tuple) -> np.dtype:
    return np.dtype(_forward(_PROBE, *(np.empty((0,) * n, dt) for dt, n in blocks), **dict(params)).dtype)


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
    params = {"activation": activation, "xd": x.shape.names, "bd": None if bias is None else bias.shape.names,
              "casts": None if bias is None or bias.dtype == x.dtype else operand_casts((x.dtype, bias.dtype))}
    low = x.dtype if is_low_precision(x.dtype) else None  # a 16-bit float stays one, as the unfused op keeps it
    (y,) = dispatch(OPS[activation][0], inputs, [(x.shape, layout)], dict(params, low=low))
    return y


def _rule(op, dy):
    need = op.needs or (True,) * len(op.inputs)
    x = op.inputs[0]
    dy = to_layout(dy, x.tensor_layout)
    params = {k: op.params[k] for k in ("activation", "xd", "bd", "casts")}
    (dx,) = dispatch(OPS[params["activation"]][1], [x, dy, *op.inputs[1:]], [(dy.shape, x.tensor_layout)], params)
    if len(op.inputs) == 1:
        return [dx]
    with partial_for(op.inputs[1]):
        db = bias_grad(dx, op.inputs[1]) if need[1] else None
    return [dx if need[0] else None, db]


# Flops per element: the bias's add (where there is a bias), then the activation's, forward and gradient, as
# counted in the kernels' formulas above (gelu's: 9 forward; backward 6 for t, 13 for the rest).
FLOPS = {"relu": (1, 2), "gelu": (9, 19), "tanh": (1, 4), None: (0, 0)}


def _flops(grad: bool):
    def flops(params, ins, outs) -> int:
        return (FLOPS[params["activation"]][grad] + (len(ins) > 1 + grad)) * size(outs[0])
    return flops


C_EXPRESSIONS = {"relu": ("(({a} > 0) || ({a} != {a})) ? {a} : 0", "{g} * (({a} > 0) ? 1 : 0)"), None: ("{a}", "{g}")}
"""activation -> (forward, gradient) as C expressions of the pre-activation `a` (x + bias) and the output's
gradient `g`, the arithmetic of the numpy kernels above (`mpimesh.fusion` fuses them); none for gelu
and tanh, whose libraries' tanh differ."""


def _cexpr(activation: Optional[str], grad: bool):
    """The op's `OpDef.cexpr`: where x, the bias, dy and the output share a float dtype (a bfloat16 x + bias
    is rounded before the activation compares it: not one expression)."""
    if activation not in C_EXPRESSIONS:
        return no_c

    def cexpr(params, ins, out):
        bias = len(ins) > 1 + grad
        if out.name not in C_TYPES or any(d != out for d in ins) or bias and out.name == "bfloat16" and activation:
            return None
        a = "({0} + {%d})" % (1 + grad) if bias else "{0}"
        return C_EXPRESSIONS[activation][grad].format(a=a, g="{1}")
    return cexpr


def _defs(activation: Optional[str]) -> tuple:
    """The OpDefs of `bias_<activation>` and of its gradient."""
    name = f"bias_{activation or 'add'}"
    backward = OpDef(f"{name}_grad", _backward, kernels={"cupy": _backward_cupy}, flops=_flops(True),
                     abstract=lambda ctx, shapes, a, g, *b, **params: (g.dtype,), cexpr=_cexpr(activation, True))
    forward = OpDef(name, _forward, kernels={"cupy": _forward_cupy}, grad=_rule, saves=(ALL, ()),
                    flops=_flops(False), abstract=_forward_abstract, cexpr=_cexpr(activation, False))
    return forward, backward


OPS = {activation: _defs(activation) for activation in ACTIVATIONS}
"""activation -> (the op's OpDef, its gradient's)."""
