"""What an op is, declared once: `OpDef`, read by every engine instead of the op's name.

An op module defines one `OpDef` per op kind at import: its kernel (per backend where they differ),
its gradient rule and what that rule reads, the in-place map and padding fill a replay needs, and
the flops, bytes and scratch the cost model prices. `trace.dispatch(op, inputs, specs, params)`
runs it; the compiled replay, CUDA graphs, the JAX replay, the dry run and the cost model read the
same fields. `params` (hashable values: dims, plans, numbers) are the kernel's keyword arguments.

>>> import numpy as np
>>> EXP = OpDef("exp", lambda ctx, a: ctx.xp.exp(a), flops=per_element(1))
>>> EXP.kernel_for("cupy") is EXP.kernel, EXP.count_flops({}, [np.ones((2, 3))], [np.ones((2, 3))])
(True, 6)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

ALL = "all"
"""`saves` entry: the gradient rule reads every input (or output)."""

FILLS = ("zero", "lowest", "highest", "position")
"""What an op needs in the padding of an uneven block under the JAX replay: "zero" (its kernel is
right on zero padding: elementwise ops, einsum), "lowest"/"highest" (a max, a softmax), "position"
(it indexes by global position, and what lands in the padding is dropped with it)."""


class Aval:
    """A block without values: its shape and dtype (what the dry run computes on).

    >>> a = Aval((2, 3), "float32"); (a.size, a.nbytes, a.ndim)
    (6, 24, 2)
    """

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(int(n) for n in shape), np.dtype(dtype)

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: math.prod(self.shape))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)

    def astype(self, dtype, copy: bool = True) -> "Aval":
        return Aval(self.shape, dtype)

    def __repr__(self) -> str:
        return f"Aval({self.shape}, {self.dtype})"


def size(a) -> int:
    """Elements of an array or `Aval` (a numpy scalar counts one)."""
    return math.prod(getattr(a, "shape", ()))


def nbytes(a) -> int:
    return size(a) * np.dtype(a.dtype).itemsize


def per_element(k: float, of: str = "out") -> Callable:
    """A `flops` rule: `k` flops per element of the first output (`of="out"`) or input (`"in"`)."""
    def flops(params, ins, outs) -> int:
        arrays = outs if of == "out" else ins
        return int(k * size(arrays[0])) if arrays else 0
    return flops


def traffic(params, ins, outs) -> int:
    """The default `bytes` rule: every input read once, every output written once."""
    return sum(nbytes(a) for a in ins) + sum(nbytes(a) for a in outs)


C_TYPES = {"float32": "float", "float64": "double", "bfloat16": "float"}
"""The dtypes an elementwise op's C expression (`OpDef.cexpr`) computes, and the C type it computes them
in: bfloat16 in float, rounded back after each op, as numpy's bfloat16 ufuncs do."""


def c_number(v, dtype) -> Optional[str]:
    """The number `v` as an op on `dtype` computes with it, as a C value (numpy converts a Python number
    to the tensor's dtype first: 0.05 is 0.0500488 beside bfloat16), or None where it is not finite. The
    literal is the shortest decimal that reads back as that double exactly (Python's repr).

    >>> c_number(0.25, "float32"), c_number(0.05, "bfloat16")
    ('((float)0.25)', '((float)0.050048828125)')
    """
    x = float(np.asarray(v).astype(dtype).astype(np.float64))
    return f"(({C_TYPES[np.dtype(dtype).name]}){x!r})" if math.isfinite(x) else None


def same_dtype(ctx, outs, *ins, **params) -> tuple:
    """The default `abstract` rule: no communication, every output of `params["dtype"]`, else of the
    first input's dtype (an op without inputs must give `dtype`)."""
    dt = params.get("dtype") or ins[0].dtype
    return (np.dtype(dt),) * len(outs)


@dataclass(frozen=True, eq=False)
class OpDef:
    """One op kind, whose fields every engine reads. `kernel(ctx, *arrays, **params)` gives this rank's
    output block(s) from its input blocks (`ctx.xp`, collectives over mesh dims); `kernels` replaces
    it per backend ("numpy", "cupy", "jax"). `grad(rec, *dys)` gives the inputs' gradients, reading
    only the values in `saves`. `abstract` gives the output dtypes in a dry run, counting its
    collectives; `flops`, `bytes`, `scratch` count for the profile and the cost model. The rest say
    where an engine may take a shortcut or must take care: `into` (outputs a replay may write over
    inputs), `fill` (padding), `capture` (CUDA graphs), `bucketed`, `view`, `gemm`, `linear`,
    `partial_inputs`, `partial_grads` (its rule takes a gradient still awaiting its sum over ranks), `start`
    (`start(params)`: for one collective, `(ctx, *arrays) -> Request` starting it without waiting, the
    request's `wait()` its one output; None where it cannot: a replay prefetches and overlaps it), `cexpr`
    (an elementwise op's C expression, from which `mpimesh.fusion` generates fused kernels). More:
    docs/architecture.md ("OpDef's fields")."""

    name: str
    kernel: Callable
    kernels: Mapping[str, Callable] = field(default_factory=dict)
    grad: Optional[Callable] = None
    saves: Any = (ALL, ALL)
    into: Mapping[int, int] = field(default_factory=dict)
    fill: Optional[str] = "zero"
    flops: Optional[Callable] = None
    bytes: Callable = traffic
    scratch: Optional[Callable] = None
    abstract: Callable = same_dtype
    capture: bool = True
    bucketed: bool = False
    view: Optional[Callable] = None
    gemm: bool = False
    linear: bool = False
    partial_inputs: bool = False
    partial_grads: bool = False
    start: Optional[Callable] = None
    cexpr: Optional[Callable] = None

    def __post_init__(self):
        if not callable(self.kernel):
            raise TypeError(f"op {self.name!r}: its kernel is {self.kernel!r}, not a function")
        if self.fill is not None and self.fill not in FILLS:
            raise ValueError(f"op {self.name!r}: fill {self.fill!r} is not one of {FILLS} or None")
        # (`saved` is read per traced op: static saves normalised once)
        object.__setattr__(self, "_saved", None if callable(self.saves) else _normalised(self.saves))

    def kernel_for(self, backend: str) -> Callable:
        """The kernel that runs on `backend` ("numpy", "cupy", "jax")."""
        return self.kernels.get(backend, self.kernel)

    def saved(self, params: Mapping) -> tuple:
        """`(inputs, outputs)` whose values the gradient rule reads, for these params."""
        saved = self._saved
        return saved if saved is not None else _normalised(self.saves(params))

    def count_flops(self, params: Mapping, ins: Sequence, outs: Sequence) -> int:
        return int(self.flops(params, ins, outs)) if self.flops is not None else 0

    def count_bytes(self, params: Mapping, ins: Sequence, outs: Sequence) -> int:
        return int(self.bytes(params, ins, outs))

    def count_scratch(self, params: Mapping, ins: Sequence, outs: Sequence) -> int:
        return int(self.scratch(params, ins, outs)) if self.scratch is not None else 0

    def c_expression(self, params: Mapping, ins: Sequence, out) -> Optional[str]:
        """This elementwise op's C expression for these params and input/output dtypes (`cexpr`), or
        None: not elementwise, or no C form that computes the kernel's values bitwise."""
        return self.cexpr(params, tuple(np.dtype(d) for d in ins), np.dtype(out)) if self.cexpr is not None else None

    def __repr__(self) -> str:
        return f"OpDef({self.name!r})"


class _All:
    def __contains__(self, i) -> bool:
        return True


_ALL = _All()


def _normalised(saves) -> tuple:
    """`saves` as `(inputs, outputs)` tuples of indices (`ALL`: every one)."""
    return tuple(_ALL if v == ALL else tuple(v) for v in saves)
