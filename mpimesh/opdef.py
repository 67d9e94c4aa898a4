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


def same_dtype(ctx, outs, *ins, **params) -> tuple:
    """The default `abstract` rule: no communication, every output of `params["dtype"]`, else of the
    first input's dtype (an op without inputs must give `dtype`)."""
    dt = params.get("dtype") or ins[0].dtype
    return (np.dtype(dt),) * len(outs)


@dataclass(frozen=True, eq=False)
class OpDef:
    """One op kind. `kernel(ctx, *arrays, **params)` gives this rank's output block(s) from its input
    blocks, with `ctx.xp` the array module and `ctx`'s collectives over mesh dims; `kernels` replaces
    it on one backend ("numpy", "cupy", "jax"). `grad(rec, *dys)` (an `OpRecord` with `params`,
    `inputs`, `outputs`, `needs`) gives the inputs' gradients, reading the values only of the inputs
    and outputs in `saves` (positions, or `ALL`; a callable of params for ops whose operands vary).
    `into`: {output: input} a replay may write over (the kernel then gets `into=`). `fill`: what it
    needs in padding (`FILLS`), None if it cannot run on padded blocks. `flops`, `bytes`, `scratch`:
    `(params, input blocks, output blocks) -> int`, blocks being arrays or `Aval`s. `abstract(ctx,
    output shapes, *input avals, **params)` -> output dtypes, counting its collectives on `ctx` (the
    dry run). `capture`: whether a CUDA graph may capture its kernel. `bucketed`: its kernel is an
    allreduce that a replay may sum together with the others of its gradient bucket (`params["bucket"]`).
    `view(params, ins, outs)`: where its one output may be a view of input 0's memory (a reshape, a
    reordering): 0, else None (the cost model's memory counts it once). `gemm`: its kernel is a matrix
    product (the cost model adds a machine's fixed cost per GEMM, not per elementwise pass). `linear`:
    one input, and a gradient rule that needs only its output's gradient and the input's dtype and
    layout (a relayout, a cast): a parameter's gradient may wait in a bucket through it, its sum
    over ranks still pending."""

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

    def __post_init__(self):
        if not callable(self.kernel):
            raise TypeError(f"op {self.name!r}: its kernel is {self.kernel!r}, not a function")
        if self.fill is not None and self.fill not in FILLS:
            raise ValueError(f"op {self.name!r}: fill {self.fill!r} is not one of {FILLS} or None")

    def kernel_for(self, backend: str) -> Callable:
        """The kernel that runs on `backend` ("numpy", "cupy", "jax")."""
        return self.kernels.get(backend, self.kernel)

    def saved(self, params: Mapping) -> tuple:
        """`(inputs, outputs)` whose values the gradient rule reads, for these params."""
        saves = self.saves(params) if callable(self.saves) else self.saves
        return tuple(_ALL if v == ALL else tuple(v) for v in saves)

    def count_flops(self, params: Mapping, ins: Sequence, outs: Sequence) -> int:
        return int(self.flops(params, ins, outs)) if self.flops is not None else 0

    def count_bytes(self, params: Mapping, ins: Sequence, outs: Sequence) -> int:
        return int(self.bytes(params, ins, outs))

    def count_scratch(self, params: Mapping, ins: Sequence, outs: Sequence) -> int:
        return int(self.scratch(params, ins, outs)) if self.scratch is not None else 0

    def __repr__(self) -> str:
        return f"OpDef({self.name!r})"


class _All:
    def __contains__(self, i) -> bool:
        return True


_ALL = _All()
