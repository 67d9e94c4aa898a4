"""Elementwise ops, with broadcasting by dim name.

A binary op's output has x's dims, then y's dims that x lacks; it is laid out by the rules in
force and each input is brought to that layout first (slicing is free; anything else is a
relayout). Same name with different sizes is a ShapeError.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.array([1.0, 2.0]), "a:2")
>>> y = mesh.from_numpy(np.array([10.0, 20.0, 30.0]), "b:3")
>>> (x * y).shape, (x * y).to_numpy()[1].tolist()
(Shape('[a:2, b:3]'), [20.0, 40.0, 60.0])
"""
from __future__ import annotations

import math
from functools import lru_cache
from types import SimpleNamespace
from typing import Callable, Optional

import numpy as np

from ..backend import align, as_dtype, contiguous, is_eager, is_float, is_low_precision, result_type
from ..errors import DTypeError, MeshError, ShapeError
from ..layout import local_sizes, plan_layout
from ..partials import partial_for
from ..promotion import cast_operands, operand_casts
from ..shape import Shape, union_shape
from ..tensor import DistTensor, tensor_arg
from ..opdef import C_TYPES, OpDef, c_number, per_element
from ..trace import dispatch
from .einsum import sum_to
from .inplace import axpy_into, axpy_into_chunked, axpy_new, axpy_new_chunked
from .relayout import to_layout
from .reshape import transpose


def _is_tensor(x) -> bool:
    return isinstance(x, DistTensor) or hasattr(x, "tensor_layout")


_COMPARISONS = ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal")  # numpy compares any int


def _scalar(v, what: str, dtype=None):
    """`v` if it can be the non-tensor operand of an elementwise op with a tensor of `dtype`: one
    number (a Python or numpy scalar, or a 0-d array); a ShapeError for arrays and lists (they have
    no dim names, so they cannot be laid out), a DTypeError for anything else (a string, None) and
    for a Python int that the tensor's integer dtype cannot hold (numpy would raise OverflowError)."""
    if isinstance(v, int) and not isinstance(v, bool) and dtype is not None:
        kind = np.dtype(dtype).kind
        if kind in "iub":
            info = np.iinfo(np.dtype(dtype) if kind != "b" else np.int64)
            if not info.min <= v <= info.max:
                raise DTypeError(f"{what}: the integer {v} is outside the range [{info.min}, {info.max}] of the "
                                 f"tensor's dtype {np.dtype(dtype) if kind != 'b' else 'int64 (bool promoted)'}")
        elif (kind in "fc" or is_float(dtype)) and not -(2 ** 1023) <= v <= 2 ** 1023:  # (this module shadows abs)
            raise DTypeError(f"{what}: the integer {v} is too large for a float")
    if isinstance(v, (bool, int, float, complex)):
        return v
    dtype, ndim = getattr(v, "dtype", None), getattr(v, "ndim", None)  # numpy's scalars and arrays, cupy's
    if isinstance(dtype, np.dtype) and isinstance(ndim, int) and (dtype.kind in "biufc" or is_float(dtype)):
        if ndim == 0:
            return v
        raise ShapeError(f"{what}: a non-tensor operand must be one number, got an array of shape {v.shape}: "
                         f"make it a DistTensor (mesh.from_numpy) to combine it by dim names")
    if isinstance(v, (list, tuple)) or ndim is not None:
        raise ShapeError(f"{what}: a non-tensor operand must be one number, got a {type(v).__name__}: "
                         f"make it a DistTensor (mesh.from_numpy) to combine it by dim names")
    raise DTypeError(f"{what}: the other operand must be a DistTensor or a number, got {v!r} "
                     f"({type(v).__name__})")


@lru_cache(maxsize=4096)
def _binary_plan(xs: Shape, ys: Shape, mesh_shape: Shape, rules, name: str, casts) -> tuple:
    """`(output shape, its layout, x's layout, y's layout, same dims, params)` of a binary op:
    planned once per shapes, mesh shape, rules and operand casts."""
    out = union_shape([xs, ys], name)
    out_layout = plan_layout(out, mesh_shape, rules)
    xd, yd, od = xs.names, ys.names, out.names
    same = xd == od and yd == od
    params = {} if same else {"xd": xd, "yd": yd, "od": od}
    if casts is not None:
        params["casts"] = casts
    return (out, out_layout, tuple(out_layout[out.index(n)] for n in xs.names),
            tuple(out_layout[out.index(n)] for n in ys.names), same, params)


_BOOL = np.dtype(bool)
_OVER_FIRST = {0: 0}  # an op's `into`: its output over its first input


def _over(a, b) -> bool:
    """Whether a ufunc's result of `a` and `b` may go into `a`: a float block (not 0-d) and `b` of
    its dtype or bool, so the result has a's dtype."""
    return a.ndim and b.dtype in (a.dtype, _BOOL) and a.dtype.kind in "fc"


def _over_scalar(a, v) -> bool:
    """Whether a ufunc's result of block `a` and number `v` may go into `a`: a Python number (it takes
    a's dtype) and a float or complex block of 32 bits or more, not 0-d."""
    return a.ndim and a.dtype.kind in "fc" and a.dtype.itemsize >= 4 and _weak(v)


_IN_PLACE = {"add": "add", "subtract": "subtract", "multiply": "multiply", "divide": "true_divide",
             "minimum": "minimum", "maximum": "maximum"}
"""The ops whose kernel is one ufunc: a compiled step's replay writes their result over an operand it
holds the only reference to (`OpDef.into`), where the result has that operand's shape and dtype,
bitwise the values of the op's own kernel."""


def _layout_for(x, out_shape: Shape, out_layout):
    return tuple(out_layout[out_shape.index(n)] for n in x.shape.names)


@lru_cache(maxsize=4096)
def _refusal(op: OpDef, args: tuple, params: tuple = ()):
    """numpy's TypeError message for `op`'s kernel on arguments like `args` (dtypes: empty arrays of
    them; Python and numpy scalar types (`_kind`): a 1 of that type), None if it takes them: what a
    dtype cannot do (`-` of bools) is found once per op and dtypes, from dtypes alone, so every rank
    refuses alike, before any kernel runs."""
    try:
        op.kernel(_PROBE, *(np.empty(0, a) if isinstance(a, np.dtype) else a(1) for a in args), **dict(params))
    except TypeError as e:
        return str(e)
    except Exception:  # (a kernel that needs elements to run at all: nothing learned)
        return None
    return None


_PROBE = SimpleNamespace(xp=np, any_rank=bool)  # a kernel's context on empty numpy blocks (one process)


def _probe_dtype(ctx, shapes, *ins, **params) -> tuple:
    """An elementwise op's `abstract` rule: its result dtype, from its own kernel run on empty numpy
    blocks of its inputs' dtypes and ranks (no communication)."""
    op = params.pop("_op")
    key = tuple(sorted((k, type(v), v) for k, v in params.items()))  # (by type too: 2 == 2.0 == True)
    return (_dtype_of(op, tuple((np.dtype(a.dtype), len(a.shape)) for a in ins), key),)


@lru_cache(maxsize=4096)
def _dtype_of(op: OpDef, blocks: tuple, params: tuple) -> np.dtype:
    kwargs = {k: v for k, _, v in params}
    with np.errstate(all="ignore"):  # (a 0-d block holds one element: ones, not whatever memory held)
        return np.dtype(op.kernel(_PROBE, *(np.ones((0,) * n, dt) for dt, n in blocks), **kwargs).dtype)


def _refuse(name: str, why: str, *operands):
    """The DTypeError for a `_refusal`, naming the op and its operands."""
    what = " and ".join(f"a {v.shape} {v.dtype} tensor" if _is_tensor(v) else f"the number {v!r}" for v in operands)
    return DTypeError(f"{name} of {what}: {why}")


def _kind(v):
    """What `_refusal` probes with for a number `v`: its type (a numpy scalar's: its dtype's)."""
    return np.dtype(v.dtype).type if hasattr(v, "dtype") else type(v)


def round_to(y, dtype):
    """`y` rounded to the float `dtype` where it is another float (a 16-bit result computed wider)."""
    return y.astype(dtype) if is_float(y.dtype) and y.dtype != dtype else y


def _keep(dtype) -> dict:
    """A unary or weak-scalar op's params: its result rounded back to a 16-bit float x (numpy computes
    bfloat16 with a Python float, 0.5 * x, in float32, where the contract keeps the tensor's dtype)."""
    return {"keep": np.dtype(dtype)} if is_low_precision(dtype) else {}


def no_c(params, ins, out) -> None:
    """The `cexpr` of an elementwise op without a C form that gives its kernel's values bitwise (a
    library's exp or tanh, a comparison, a select): it is counted as a pass over memory, never fused."""
    return None


def _c_unary(template: Optional[str]) -> Callable:
    """A unary op's `cexpr`: `template` over `{0}`, where its input and output share a float dtype."""
    def cexpr(params, ins, out):
        return template if out.name in C_TYPES and ins[0] == out else None
    return cexpr if template is not None else no_c


def _c_binary(template: Optional[str]) -> Callable:
    """A binary op's `cexpr`: `template` over `{0}` and `{1}` where both operands have the output's float
    dtype; a number operand (one side) as the kernel converts it to that dtype (`c_number`)."""
    def cexpr(params, ins, out):
        if out.name not in C_TYPES or params.get("casts") is not None or any(d != out for d in ins):
            return None
        if "scalar" not in params:
            return template
        v = params["scalar"]
        own = np.dtype(v.dtype) == out if hasattr(v, "dtype") else \
            isinstance(v, float) or isinstance(v, int) and not isinstance(v, bool) and -2 ** 53 < v < 2 ** 53
        number = c_number(v, out) if own else None
        if number is None:
            return None
        return template.format(*(("{0}", number) if params["side"] == "right" else (number, "{0}")))
    return cexpr if template is not None else no_c


def _elementwise(name: str, kernel: Callable, grad=None, saves=((), ()), flops: int = 1, into=None,
                 cexpr: Callable = no_c) -> OpDef:
    """An elementwise op's `OpDef`: `kernel(ctx, *blocks, **params)`, its dtypes probed on empty blocks;
    `cexpr` its C expression (`OpDef.cexpr`)."""
    op = OpDef(name, kernel, grad=grad, saves=saves, flops=per_element(flops), into=into or {}, cexpr=cexpr,
               abstract=lambda ctx, shapes, *ins, **p: _probe_dtype(ctx, shapes, *ins, _op=op, **p))
    return op


def _unary(name: str, kernel: Callable, doc: str, grad: Callable = None, reads: str = "x", flops: int = 1,
           c: Optional[str] = None):
    """`grad(x, y, dy)` reads the values of the input x, the output y, or neither (`reads`: "x", "y", "");
    `c`: the kernel as a C expression of `{0}` in float or double (None: it has none that is bitwise)."""
    rule = None if grad is None else (lambda op, dy: [grad(op.inputs[0], op.outputs[0], dy)])

    def k(ctx, a, keep=None):
        y = kernel(ctx.xp, a)
        return y if keep is None else round_to(y, keep)
    opdef = _elementwise(name, k, rule, ((0,) if "x" in reads else (), (0,) if "y" in reads else ()), flops,
                         cexpr=_c_unary(c))

    def op(x):
        why = _refusal(opdef, (tensor_arg(name, x).dtype,))  # (cached: the door of every elementwise op)
        if why is not None:
            raise _refuse(name, why, x)
        x = to_layout(x, x.mesh.plan(x.shape))
        (y,) = dispatch(opdef, [x], [(x.shape, x.tensor_layout)], _keep(x.dtype))
        return y
    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    op.opdef = opdef
    return op


def _binary_defs(name: str, kernel: Callable, rule, reads: tuple, flops: int, c: Optional[str]) -> tuple:
    """The `OpDef`s of a binary op: of two tensors of the same dims, of two tensors whose axes are
    aligned by name (`xd`, `yd`, `od`), and of a tensor and a number (`scalar` on the `side` of it);
    `c` the kernel as a C expression of `{0}` and `{1}` (None: none that is bitwise)."""
    whole_ctx = getattr(kernel, "with_ctx", False)  # the kernel takes the context, not just its array module
    ufunc = _IN_PLACE.get(name)
    into = _OVER_FIRST if ufunc else None

    def same(ctx, a, b, casts=None, into=()):
        if into and _over(a, b):
            return getattr(ctx.xp, ufunc)(a, b, out=a)
        if casts is not None:  # operands of two dtypes, in their promotion (`mpimesh.promotion`)
            a, b = cast_operands((a, b), casts)
        return kernel(ctx if whole_ctx else ctx.xp, a, b)

    def aligned(ctx, a, b, xd, yd, od, casts=None, into=()):
        xp = ctx.xp
        b = align(xp, b, yd, od)
        if into and xd == od and _over(a, b):  # (x's block has the output's shape)
            return getattr(xp, ufunc)(a, b, out=a)
        a = align(xp, a, xd, od)
        if casts is not None:
            a, b = cast_operands((a, b), casts)
        return kernel(ctx if whole_ctx else ctx.xp, a, b)

    def scalar(ctx, a, scalar, side, keep=None, casts=None, into=()):
        if into and _over_scalar(a, scalar):
            return getattr(ctx.xp, ufunc)(a, scalar, out=a) if side == "right" else \
                getattr(ctx.xp, ufunc)(scalar, a, out=a)
        pair = (a, scalar) if side == "right" else (scalar, a)
        if casts is not None:
            pair = cast_operands(pair, casts)
        y = kernel(ctx if whole_ctx else ctx.xp, *pair)
        return y if keep is None else round_to(y, keep)
    both = reads[0] + reads[1]
    tensors = ([i for i, v in enumerate("xy") if v in both], (0,) if "z" in both else ())
    right = ((0,) if "x" in reads[0] else (), (0,) if "z" in reads[0] else ())
    left = ((0,) if "y" in reads[1] else (), (0,) if "z" in reads[1] else ())
    cexpr = _c_binary(c)
    return (_elementwise(name, same, rule, tensors, flops, into, cexpr),
            _elementwise(name, aligned, rule, tensors, flops, into, cexpr),
            _elementwise(name, scalar, rule, lambda p: right if p["side"] == "right" else left, flops, into, cexpr))


def _binary(name: str, kernel: Callable, doc: str, grad: Callable = None, reads: tuple = ("xyz", "xyz"),
            flops: int = 1, c: Optional[str] = None):
    """`grad(x, y, z, dz)` returns two functions of no argument, giving x's and y's gradient: only
    those of the inputs that need one run (nothing is computed for a constant side). `reads`: the
    values (of x, y, the output z) each of the two reads; `c`: the kernel as a C expression."""
    def rule(op, dz):
        if len(op.inputs) == 2:
            x, y = op.inputs
            gx, gy = grad(x, y, op.outputs[0], dz)
            need = op.needs or (True, True)
            with partial_for(x):  # a parameter's gradient summed over the batch may wait in a bucket
                gx = sum_to(gx(), x.shape, x) if need[0] else None
            with partial_for(y):
                gy = sum_to(gy(), y.shape, y) if need[1] else None
            return [gx, gy]
        if op.params["side"] == "right":
            return [grad(op.inputs[0], op.params["scalar"], op.outputs[0], dz)[0]()]
        return [grad(op.params["scalar"], op.inputs[0], op.outputs[0], dz)[1]()]
    same, aligned, scalar = _binary_defs(name, kernel, None if grad is None else rule, reads, flops, c)
    compare = name in _COMPARISONS

    def with_number(t, v, side: str):
        v = _scalar(v, name, None if compare else t.dtype)
        params = {"scalar": v, "side": side}
        if _weak(v):
            params.update(_keep(t.dtype))
        else:
            dtypes = (t.dtype, _strong(v)) if side == "right" else (_strong(v), t.dtype)
            casts = None if None in dtypes else operand_casts(dtypes)
            if casts is not None:
                params["casts"] = casts
        why = _refusal(scalar, (t.dtype, _kind(v)),
                       (("side", side),) + (() if "casts" not in params else (("casts", params["casts"]),)))
        if why is not None:
            raise _refuse(name, why, *((t, v) if side == "right" else (v, t)))
        t = to_layout(t, t.mesh.plan(t.shape))
        (z,) = dispatch(scalar, [t], [(t.shape, t.tensor_layout)], params)
        return z

    def op(x, y):
        xt, yt = _is_tensor(x), _is_tensor(y)
        if not xt and not yt:
            raise TypeError(f"{name}: at least one argument must be a DistTensor")
        if not yt:
            return with_number(x, y, "right")
        if not xt:
            return with_number(y, x, "left")
        mesh = x.mesh
        if mesh is not y.mesh:
            raise MeshError(f"{name}: inputs live on different meshes ({x.mesh.shape} and {y.mesh.shape}, "
                            f"or two meshes of one shape)")
        why, casts = _checked(same, x.dtype, y.dtype)
        if why is not None:
            raise _refuse(name, why, x, y)
        out, out_layout, x_layout, y_layout, is_same, params = _binary_plan(x.shape, y.shape, mesh.shape, mesh.layout,
                                                                            name, casts)
        if x.tensor_layout != x_layout:
            x = to_layout(x, x_layout)
        if y.tensor_layout != y_layout:
            y = to_layout(y, y_layout)
        if is_same:  # (x's own shape and layout: `dispatch` knows them valid, per-op time)
            (z,) = dispatch(same, [x, y], [(x.shape, x.tensor_layout)], params)
        else:
            (z,) = dispatch(aligned, [x, y], [(out, out_layout)], params)
        return z
    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    op.opdefs = (same, aligned, scalar)
    return op


def _weak(v) -> bool:
    """Whether a scalar operand takes the tensor's dtype (a Python number), as in numpy's NEP 50."""
    return isinstance(v, (bool, int, float))


def _strong(v):
    """The dtype a non-weak number promotes with (a numpy scalar's or 0-d array's); None for a Python
    complex, which numpy's own rule combines."""
    return np.dtype(v.dtype) if hasattr(v, "dtype") else None


@lru_cache(maxsize=4096)
def _checked(op: OpDef, x_dtype, y_dtype) -> tuple:
    """`(_refusal's message or None, the operand casts or None)` for two tensors of these dtypes:
    one cached look-up per op (`mpimesh.promotion.operand_casts`: numpy's own promotion would give
    another dtype, int32 with float32 float64, or round an integer otherwise than JAX)."""
    casts = None if x_dtype == y_dtype else operand_casts((x_dtype, y_dtype))
    return _refusal(op, (x_dtype, y_dtype), () if casts is None else (("casts", casts),)), casts


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_values(xp, a):
    """GELU (tanh approximation) of the array `a`: the kernel of `gelu`, also `bias_gelu`'s."""
    return 0.5 * a * (1.0 + xp.tanh(_SQRT_2_OVER_PI * (a + 0.044715 * a * a * a)))


def _gelu_grad(x, y, dy):
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    t = tanh(inner)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x))


def _sign(x):
    return cast(greater(x, 0), x.dtype) - cast(less(x, 0), x.dtype)


_MAX = "(({0} > {1}) || ({0} != {0})) ? {0} : {1}"  # numpy's maximum: a NaN wins, a tie gives the second
_MIN = "(({0} < {1}) || ({0} != {0})) ? {0} : {1}"
relu = _unary("relu", lambda xp, a: xp.maximum(a, 0), "max(x, 0).", lambda x, y, dy: dy * greater(x, 0),
              c=_MAX.format("{0}", "0"))
gelu = _unary("gelu", gelu_values, "GELU, tanh approximation (as Mesh-TensorFlow and jax.nn.gelu).", _gelu_grad)
exp = _unary("exp", lambda xp, a: xp.exp(a), "e**x.", lambda x, y, dy: dy * y, "y")
log = _unary("log", lambda xp, a: xp.log(a), "Natural logarithm.", lambda x, y, dy: dy / x)
sqrt = _unary("sqrt", lambda xp, a: xp.sqrt(a), "Square root.", lambda x, y, dy: dy * 0.5 / y, "y")
rsqrt = _unary("rsqrt", lambda xp, a: 1 / xp.sqrt(a), "1 / sqrt(x).", lambda x, y, dy: dy * -0.5 * y * y * y, "y")
tanh = _unary("tanh", lambda xp, a: xp.tanh(a), "Hyperbolic tangent.", lambda x, y, dy: dy * (1.0 - y * y), "y")
sigmoid = _unary("sigmoid", lambda xp, a: 0.5 * (1 + xp.tanh(0.5 * a)), "1 / (1 + e**-x), overflow-free.",
                 lambda x, y, dy: dy * y * (1.0 - y), "y")
square = _unary("square", lambda xp, a: a * a, "x * x.", lambda x, y, dy: dy * 2.0 * x, c="{0} * {0}")
abs = _unary("abs", lambda xp, a: xp.abs(a), "|x|.", lambda x, y, dy: dy * _sign(x))  # noqa: A001 - the API's name
sin = _unary("sin", lambda xp, a: xp.sin(a), "Sine.", lambda x, y, dy: dy * cos(x))
cos = _unary("cos", lambda xp, a: xp.cos(a), "Cosine.", lambda x, y, dy: -(dy * sin(x)))
negative = _unary("negative", lambda xp, a: -a, "-x.", lambda x, y, dy: -dy, "", c="-{0}")


def _min_max_grad(pick_x):
    def grad(x, y, z, dz):
        made = []

        def take_x():  # ties go to x; made once where both sides need it
            if not made:
                made.append(cast(pick_x(x, y), dz.dtype))
            return made[0]
        return (lambda: dz * take_x()), (lambda: dz * (1.0 - take_x()))
    return grad


def _pow_grad(x, y, z, dz):
    return (lambda: dz * y * power(x, y - 1)), (lambda: dz * z * (log(x) if _is_tensor(x) else math.log(x)))


add = _binary("add", lambda xp, a, b: a + b, "x + y.", lambda x, y, z, dz: ((lambda: dz), (lambda: dz)), ("", ""),
              c="{0} + {1}")
subtract = _binary("subtract", lambda xp, a, b: a - b, "x - y.", lambda x, y, z, dz: ((lambda: dz), (lambda: -dz)),
                   ("", ""), c="{0} - {1}")
multiply = _binary("multiply", lambda xp, a, b: a * b, "x * y.",
                   lambda x, y, z, dz: ((lambda: dz * y), (lambda: dz * x)), ("y", "x"), c="{0} * {1}")
divide = _binary("divide", lambda xp, a, b: a / b, "x / y.",
                 lambda x, y, z, dz: ((lambda: dz / y), (lambda: -(dz * z) / y)), ("y", "yz"), c="{0} / {1}")


def _kind_letter(v) -> str:
    """The dtype kind of an array or a number (`xp.result_type` fails on ml_dtypes' 16-bit floats)."""
    return np.dtype(v.dtype).kind if hasattr(v, "dtype") else np.asarray(v).dtype.kind


def _power(ctx, a, b):
    """a ** b, where numpy raises for an integer to a negative integer power: a DTypeError on every
    rank, where any rank's block of the exponent holds one (`any_rank`; for integer results only)."""
    xp = ctx.xp
    if is_eager(xp) and hasattr(b, "dtype") and _kind_letter(a) in "biu" and _kind_letter(b) in "biu" \
            and ctx.any_rank(bool((b < 0).any())):
        raise DTypeError("power: an integer to a negative integer power (the exponent tensor holds one on some "
                         "rank); numpy, JAX and PyTorch refuse it too: cast to a float dtype first")
    return a ** b


_power.with_ctx = True


_power_op = _binary("power", _power, "", _pow_grad)


def power(x, y):
    """x ** y. An integer to a negative integer power is a DTypeError on every rank, as in numpy:
    where the exponent is a number, before anything runs; where it is an integer tensor, once the
    ranks have agreed (`any_rank`) that some block of it holds a negative number."""
    if _is_tensor(x) and np.dtype(x.dtype).kind in "iu" and isinstance(y, (int, np.integer)) \
            and not isinstance(y, bool) and y < 0:
        raise DTypeError(f"power: a {x.shape} {x.dtype} tensor to the negative integer power {y}; numpy, JAX and "
                         f"PyTorch refuse it too: cast to a float dtype first")
    return _power_op(x, y)


minimum = _binary("minimum", lambda xp, a, b: xp.minimum(a, b), "Elementwise minimum.",
                  _min_max_grad(lambda x, y: less_equal(x, y)), c=_MIN)
maximum = _binary("maximum", lambda xp, a, b: xp.maximum(a, b), "Elementwise maximum.",
                  _min_max_grad(lambda x, y: greater_equal(x, y)), c=_MAX)
less = _binary("less", lambda xp, a, b: a < b, "x < y (no gradient).")
less_equal = _binary("less_equal", lambda xp, a, b: a <= b, "x <= y (no gradient).")
greater = _binary("greater", lambda xp, a, b: a > b, "x > y (no gradient).")
greater_equal = _binary("greater_equal", lambda xp, a, b: a >= b, "x >= y (no gradient).")
equal = _binary("equal", lambda xp, a, b: a == b, "x == y (no gradient).")
not_equal = _binary("not_equal", lambda xp, a, b: a != b, "x != y (no gradient).")


def bias_grad(dx, bias):
    """A fused op's gradient `dx` summed back to its `bias`'s shape, in the wider of their dtypes (a
    float32 bias of a bfloat16 input gets a float32 gradient, as `x + bias` gives it).

    >>> import mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> bias_grad(cast(mesh.ones("a:2;b:3"), "bfloat16"), mesh.ones("b:3")).dtype
    dtype('float32')
    """
    wide = result_type(dx.dtype, bias.dtype)
    return sum_to(cast(dx, wide) if dx.dtype != wide else dx, bias.shape, bias)


def axpy(alpha, x, y):
    """`alpha * x + y` in one op, written into the product's buffer (BLAS's axpy; numpy would make
    two arrays and pass over memory once more): the optimizers' `p - lr * g` is `axpy(-lr, g, p)`.
    `x` and `y` have the same dims (the result has x's order); `alpha` is a number or a 0-d tensor
    (a learning-rate schedule). Tensors of several dtypes get the two ops, `alpha * x` and then `+ y`,
    each in its operands' promotion (`mm.result_type`).

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> g, p = mesh.from_numpy(np.array([1.0, 2.0]), "a:2"), mesh.ones("a:2")
    >>> axpy(-0.5, g, p).to_numpy().tolist()
    [0.5, 0.0]
    """
    for what, t in (("x", x), ("y", y)):
        if not _is_tensor(t):
            raise TypeError(f"axpy: {what} must be a DistTensor, got {type(t).__name__}")
    scaled = _is_tensor(alpha)  # a 0-d tensor: an input of the op (and differentiable)
    if x.mesh is not y.mesh or scaled and alpha.mesh is not x.mesh:
        raise MeshError(f"axpy: inputs live on different meshes ({x.mesh.shape} and {y.mesh.shape})")
    if sorted(x.shape) != sorted(y.shape):
        raise ShapeError(f"axpy: x has shape {x.shape}, y has {y.shape}: they must have the same dims")
    if scaled and alpha.shape.rank:
        raise ShapeError(f"axpy: alpha must be a number or a 0-d tensor, got shape {alpha.shape}")
    if x.dtype != y.dtype or scaled and alpha.dtype != x.dtype:  # (rare) the two ops, each in its promotion:
        return add(multiply(alpha, x), y)  # bfloat16 x, float16 y: float32; int32 x, float32 y: float32
    alpha = to_layout(alpha, ()) if scaled else _scalar(alpha, "axpy", x.dtype)
    layout = x.mesh.plan(x.shape)
    x, y = to_layout(x, layout), to_layout(y, _layout_for(y, x.shape, layout))
    low = x.dtype if is_low_precision(x.dtype) and not scaled else None  # numpy computes bf16 * 0.5 in float32
    params = {"xd": x.shape.names, "yd": y.shape.names, "low": low}
    if scaled:
        (z,) = dispatch(AXPY_SCALED, [alpha, x, y], [(x.shape, layout)], params)
    else:
        (z,) = dispatch(AXPY, [x, y], [(x.shape, layout)], dict(params, alpha=alpha))
    return z


def _axpy(ctx, *arrays, xd, yd, low, alpha=None, into=(), chunked=False):
    """`axpy`'s kernel: `alpha * x + y` (alpha a param, or the first block); into y's block where the
    replay holds it (`into`: same dims in the same order and dtype, no rounding to do)."""
    xp = ctx.xp
    a, xa, ya = arrays if alpha is None else (alpha, *arrays)
    if into and xd == yd and low is None and xa.dtype == ya.dtype == getattr(a, "dtype", xa.dtype):
        return (axpy_into_chunked if chunked else axpy_into)(xp, a, xa, ya)
    ya = align(xp, ya, yd, xd)
    if low is None:
        return (axpy_new_chunked if chunked else axpy_new)(xp, a, xa, ya)
    out = round_to(xp.multiply(xa, a), low)
    if is_eager(xp) and out.ndim and out.dtype == result_type(out.dtype, ya.dtype):  # (0-d: numpy gives a scalar)
        return xp.add(out, ya, out=out)  # into the product's own buffer: one pass less
    return out + ya


def _axpy_grad(op, dz):
    need = op.needs or (True,) * len(op.inputs)
    yt = op.inputs[-1]
    gy = (dz if yt.shape == dz.shape else transpose(dz, yt.shape)) if need[-1] else None
    if len(op.inputs) == 3:
        a, xt, _ = op.inputs
        return [sum_to(dz * xt, Shape(())) if need[0] else None, dz * a if need[1] else None, gy]
    return [dz * op.params["alpha"] if need[0] else None, gy]


def _axpy_def(scaled: bool) -> OpDef:
    def numpy_kernel(ctx, *arrays, **params):  # a chunk at a time, in cache (`mpimesh.ops.inplace`)
        return _axpy(ctx, *arrays, chunked=True, **params)
    return OpDef("axpy", _axpy, kernels={"numpy": numpy_kernel}, grad=_axpy_grad, cexpr=no_c,
                 saves=((0, 1) if scaled else (), ()), into={0: 2 if scaled else 1}, flops=per_element(2))


AXPY, AXPY_SCALED = _axpy_def(False), _axpy_def(True)


def cast(x, dtype):
    """x converted to `dtype`; the gradient is cast back (none for non-float targets), so the
    gradient of a float32 tensor cast to bfloat16 is float32.

    >>> import mpimesh as mm
    >>> cast(mm.Mesh("all:1", comm=mm.MPI.COMM_SELF).ones("a:2"), "int32").dtype
    dtype('int32')
    """
    tensor_arg("cast", x)
    dt = as_dtype(dtype)
    x = to_layout(x, x.mesh.plan(x.shape))
    if x.dtype == dt:
        return x
    differentiable = is_float(dt) and is_float(x.dtype)
    (y,) = dispatch(CAST if differentiable else CAST_NO_GRAD, [x], [(x.shape, x.tensor_layout)], {"dtype": dt})
    return y


def _cast(ctx, a, dtype):
    return a.astype(dtype)


_C_CAST_FROM = {"float32": (*C_TYPES, "int32", "int64", "bool"), "float64": (*C_TYPES, "int32", "int64", "bool"),
                "bfloat16": ("float32",)}  # (float64 to bfloat16 rounds once in numpy, twice through float)


def _c_cast(params, ins, out):
    """A cast's C expression: its input converted to the output's C type (rounded to bfloat16 after)."""
    return "{0}" if ins[0].name in _C_CAST_FROM.get(out.name, ()) else None


CAST = OpDef("cast", _cast, grad=lambda op, dy: [cast(dy, op.inputs[0].dtype)], saves=((), ()), linear=True,
             cexpr=_c_cast)
CAST_NO_GRAD = OpDef("cast", _cast, cexpr=_c_cast)


def where(cond, x, y):
    """Elementwise `x if cond else y`, broadcasting by dim name (output: cond's dims, then x's
    new dims, then y's); x or y may be scalars. No gradient flows to `cond`."""
    if not _is_tensor(cond):
        raise TypeError("where: cond must be a DistTensor")
    other = next((t.dtype for t in (x, y) if _is_tensor(t)), None)
    x = x if _is_tensor(x) else _scalar(x, "where", other)
    y = y if _is_tensor(y) else _scalar(y, "where", other)
    if any(_is_tensor(t) and t.mesh is not cond.mesh for t in (x, y)):
        raise MeshError("where: inputs live on different meshes")
    if cond.dtype != bool:
        cond = not_equal(cond, 0)
    tensors = [t for t in (cond, x, y) if _is_tensor(t)]
    mesh = cond.mesh
    out = union_shape([t.shape for t in tensors], "where")
    out_layout = mesh.plan(out)
    ins, names, slots = [], [], []
    for i, t in enumerate((cond, x, y)):
        if _is_tensor(t):
            ins.append(to_layout(t, _layout_for(t, out, out_layout)))
            names.append(t.shape.names)
            slots.append(i)
    consts = tuple(None if _is_tensor(t) else t for t in (cond, x, y))
    low = other if other is not None and is_low_precision(other) and all(
        _is_tensor(t) and t.dtype == other or _weak(t) for t in (x, y)) else None  # a Python scalar keeps it
    dts = tuple(np.dtype(t.dtype) for t in (x, y) if hasattr(t, "dtype"))  # tensors' and numpy numbers'
    casts = operand_casts(dts) if len(dts) == 2 and dts[0] != dts[1] else None
    params = {"slots": tuple(slots), "names": tuple(names), "od": out.names, "consts": consts, "casts": casts,
              "low": low, "sizes": local_sizes(out, mesh.shape, out_layout, mesh.coords)}
    (z,) = dispatch(WHERE, ins, [(out, out_layout)], params)
    return z


def _where(ctx, *arrays, slots, names, od, consts, casts, low, sizes):
    xp = ctx.xp
    vals = list(consts)
    for i, a, n in zip(slots, arrays, names):
        vals[i] = align(xp, a, n, od)
    if casts is not None:  # x and y of two dtypes: in their promotion (`mpimesh.promotion`)
        vals[1:] = cast_operands(vals[1:], casts)
    z = xp.where(*vals)
    z = round_to(z, low) if low is not None else z
    return contiguous(xp, xp.broadcast_to(z, sizes))


def _where_grad(op, dz):
    c = op.inputs[0]
    grads = []
    for i, t in zip(op.params["slots"], op.inputs):
        if i == 0:
            grads.append(None)
        else:
            keep = c if i == 1 else equal(c, False)
            grads.append(sum_to(where(keep, dz, 0.0), t.shape, t))
    return grads


WHERE = OpDef("where", _where, grad=_where_grad, saves=((0,), ()), cexpr=no_c,
              abstract=lambda ctx, shapes, *ins, sizes, **p: _probe_dtype(ctx, shapes, *ins, _op=WHERE,
                                                                          sizes=(0,) * len(sizes), **p))


def stop_gradient(x):
    """x unchanged, but no gradient flows through it (an identity op without a gradient rule).

    >>> import mpimesh as mm
    >>> stop_gradient(mm.Mesh("all:1", comm=mm.MPI.COMM_SELF).ones("a:2")).to_numpy().tolist()
    [1.0, 1.0]
    """
    x = to_layout(x, x.mesh.plan(x.shape))
    (y,) = dispatch(STOP_GRADIENT, [x], [(x.shape, x.tensor_layout)])
    return y


STOP_GRADIENT = OpDef("stop_gradient", lambda ctx, a: a, view=lambda params, ins, outs: 0)


def _bind_operators() -> None:
    """DistTensor's operators are these ops (bound here: the tensor module sits below the ops)."""
    for name, fn in [("__add__", add), ("__sub__", subtract), ("__mul__", multiply), ("__truediv__", divide),
                     ("__pow__", power), ("__lt__", less), ("__le__", less_equal), ("__gt__", greater),
                     ("__ge__", greater_equal), ("__eq__", equal), ("__ne__", not_equal), ("__neg__", negative)]:
        setattr(DistTensor, name, fn)
    for name, fn in [("__radd__", add), ("__rsub__", subtract), ("__rmul__", multiply), ("__rtruediv__", divide),
                     ("__rpow__", power)]:
        setattr(DistTensor, name, _swapped(fn))


def _swapped(fn):
    def method(self, other):
        return fn(other, self)
    method.__name__ = method.__qualname__ = f"r{fn.__name__}"
    return method


_bind_operators()
