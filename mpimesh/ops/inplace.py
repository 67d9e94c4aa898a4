"""Kernels that write an op's result over one of its inputs, for a compiled step's replay when it
holds that input's only reference (a donated parameter: `mm.compile(..., donate_argnums=...)`).
Each gives bitwise the values of the op's own kernel: the same roundings in the same order.

>>> import numpy as np
>>> y = np.ones(3, np.float32)
>>> axpy_into(np, np.float32(-0.5), np.array([1, 2, 3], np.float32), y) is y, y.tolist()
(True, [0.5, 0.0, -0.5])
>>> scale_add_into(np, 2.0, y, np.ones(3, np.float32)).tolist()
[2.0, 1.0, 0.0]
"""
from __future__ import annotations

import numpy as np

from ..backend import name

CHUNK_BYTES = 1 << 20
"""How much of y one pass of `axpy_into` takes on numpy: the product stays in the core's cache."""


def axpy_into(xp, alpha, x, y):
    """`y <- alpha * x + y` in y's buffer, each product rounded to y's dtype and then added, as
    `mm.axpy`'s kernel does (one pass over x and y and no y-sized temporary: on numpy a chunk of
    `CHUNK_BYTES` at a time). x and y have one shape and dtype, and share no memory."""
    if name(xp) != "numpy" or not (y.flags.c_contiguous and x.flags.c_contiguous):
        return xp.add(y, xp.multiply(x, alpha), out=y)
    xs, ys = x.reshape(-1), y.reshape(-1)
    step = max(1, CHUNK_BYTES // y.itemsize)
    scratch = np.empty(min(step, ys.size), y.dtype)
    for a in range(0, ys.size, step):
        part = ys[a:a + step]
        np.add(part, np.multiply(xs[a:a + step], alpha, out=scratch[:part.size]), out=part)
    return y


def scale_add_into(xp, alpha, x, y):
    """`x <- alpha * x + y` in x's buffer, the product rounded and then added, as `mm.axpy(alpha,
    x, y)`'s kernel does (on numpy a chunk at a time: it stays in cache between the two passes).
    x and y have one shape and dtype, and share no memory."""
    if name(xp) != "numpy" or not (y.flags.c_contiguous and x.flags.c_contiguous):
        return xp.add(xp.multiply(x, alpha, out=x), y, out=x)
    xs, ys = x.reshape(-1), y.reshape(-1)
    step = max(1, CHUNK_BYTES // x.itemsize)
    for a in range(0, xs.size, step):
        part = xs[a:a + step]
        np.add(np.multiply(part, alpha, out=part), ys[a:a + step], out=part)
    return x
