"""Kernels that write a result over one of their inputs (a compiled replay's donated parameter:
`mm.compile(..., donate_argnums=...)`), `axpy_new` (`mm.axpy`'s kernel), their numpy `_chunked` forms,
and the operations the optimizers' formulas are written in (`mpimesh.ops.updates`): `Functional` (new
arrays: JAX), `Eager` (over temporaries and donated inputs: numpy, CuPy). Each gives bitwise the
values of the op's own kernel: the same roundings in the same order.

>>> import numpy as np
>>> y = np.ones(3, np.float32)
>>> axpy_into_chunked(np, np.float32(-0.5), np.array([1, 2, 3], np.float32), y) is y, y.tolist()
(True, [0.5, 0.0, -0.5])
>>> z = np.ones(2)
>>> Eager(np, chunked=True).axpy(2.0, np.ones(2), z, over="y") is z, z.tolist()
(True, [3.0, 3.0])
"""
from __future__ import annotations

import numpy as np

from ..backend import is_eager

CHUNK_BYTES = 1 << 18
"""How much of y one pass of these kernels takes on numpy: the chunks of x, y and the product stay
in the core's own cache (on a 2 MB L2, 256 KB chunks of a 16 MB axpy took 25% less time than 1 MB)."""


def axpy_new(xp, alpha, x, y):
    """`alpha * x + y` in a new array, the product rounded to its dtype and then added: `mm.axpy`'s
    kernel (into the product's own buffer: one pass over memory less than `alpha * x + y`)."""
    out = xp.multiply(x, alpha)
    if is_eager(xp) and out.ndim and out.dtype == xp.result_type(out, y):
        return xp.add(out, y, out=out)
    return out + y


def axpy_new_chunked(xp, alpha, x, y):
    """`axpy_new` on numpy: where x, y and the product have one shape and dtype and are contiguous, a
    chunk of `CHUNK_BYTES` at a time, the product written into the result and summed there while in
    cache (one pass over memory less than a whole product and then the sum)."""
    if not (x.ndim and x.shape == y.shape and x.dtype == y.dtype == np.result_type(x, alpha)
            and x.flags.c_contiguous and y.flags.c_contiguous):
        return axpy_new(xp, alpha, x, y)
    out = np.empty_like(y)
    xs, ys, outs = x.reshape(-1), y.reshape(-1), out.reshape(-1)
    step = max(1, CHUNK_BYTES // y.itemsize)
    for a in range(0, ys.size, step):
        part = outs[a:a + step]
        np.add(np.multiply(xs[a:a + step], alpha, out=part), ys[a:a + step], out=part)
    return out


def axpy_into(xp, alpha, x, y):
    """`y <- alpha * x + y` in y's buffer, each product rounded to y's dtype and then added, as
    `mm.axpy`'s kernel does. x and y have one shape and dtype, and share no memory."""
    return xp.add(y, xp.multiply(x, alpha), out=y)


def axpy_into_chunked(xp, alpha, x, y):
    """`axpy_into` on numpy: one pass over x and y and no y-sized temporary, a chunk of `CHUNK_BYTES`
    at a time."""
    if not (y.flags.c_contiguous and x.flags.c_contiguous):
        return axpy_into(xp, alpha, x, y)
    xs, ys = x.reshape(-1), y.reshape(-1)
    step = max(1, CHUNK_BYTES // y.itemsize)
    scratch = np.empty(min(step, ys.size), y.dtype)
    for a in range(0, ys.size, step):
        part = ys[a:a + step]
        np.add(part, np.multiply(xs[a:a + step], alpha, out=scratch[:part.size]), out=part)
    return y


def scale_add_into(xp, alpha, x, y):
    """`x <- alpha * x + y` in x's buffer, the product rounded and then added, as `mm.axpy(alpha,
    x, y)`'s kernel does. x and y have one shape and dtype, and share no memory."""
    return xp.add(xp.multiply(x, alpha, out=x), y, out=x)


def scale_add_into_chunked(xp, alpha, x, y):
    """`scale_add_into` on numpy, a chunk at a time (it stays in cache between the two passes)."""
    if not (y.flags.c_contiguous and x.flags.c_contiguous):
        return scale_add_into(xp, alpha, x, y)
    xs, ys = x.reshape(-1), y.reshape(-1)
    step = max(1, CHUNK_BYTES // x.itemsize)
    for a in range(0, xs.size, step):
        part = xs[a:a + step]
        np.add(np.multiply(part, alpha, out=part), ys[a:a + step], out=part)
    return x


class Functional:
    """The operations of the optimizers' formulas (`mpimesh.ops.updates`), each making a new array:
    the generic kernels' (JAX). `over` ("x", "y" or None; True or False) says which input the result
    may be written over (a donated block, or a temporary): `Eager` does, this ignores it."""

    def __init__(self, xp):
        self.xp = xp

    def axpy(self, alpha, x, y, over=None):
        """`alpha * x + y`, the product rounded to its dtype and then added (`axpy_new`)."""
        return self.xp.multiply(x, alpha) + y

    def scale(self, a, s, over: bool = False):
        """`s * a`."""
        return s * a

    def plus(self, a, b):
        """`a + b`, `a` a temporary."""
        return a + b

    def quotient(self, a, b):
        """`a / b`, `a` a temporary."""
        return a / b

    def sqrt(self, a):
        return self.xp.sqrt(a)


class Eager(Functional):
    """`Functional`'s operations on numpy or CuPy, each result written over the input `over` names
    and over a temporary `a` where it has the result's dtype; `chunked` (numpy): a chunk at a time."""

    def __init__(self, xp, chunked: bool = False):
        super().__init__(xp)
        self.chunked = chunked

    def axpy(self, alpha, x, y, over=None):
        if over == "y":
            return (axpy_into_chunked if self.chunked else axpy_into)(self.xp, alpha, x, y)
        if over == "x":
            return (scale_add_into_chunked if self.chunked else scale_add_into)(self.xp, alpha, x, y)
        return (axpy_new_chunked if self.chunked else axpy_new)(self.xp, alpha, x, y)

    def scale(self, a, s, over: bool = False):
        return self.xp.multiply(a, s, out=a) if over else s * a

    def plus(self, a, b):
        return self.xp.add(a, b, out=a) if self._takes(a, b) else a + b

    def quotient(self, a, b):
        return self.xp.divide(a, b, out=a) if self._takes(a, b) else a / b

    def _takes(self, a, b) -> bool:
        """Whether `a` (not a numpy scalar) can hold the result of `a` and `b` (of a's dtype)."""
        return isinstance(a, self.xp.ndarray) and a.dtype == self.xp.result_type(a, b)
