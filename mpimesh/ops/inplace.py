"""Kernels that write an op's result over one of its inputs, for a compiled step's replay when it
holds that input's only reference (a donated parameter: `mm.compile(..., donate_argnums=...)`),
and `axpy_new`, the op's own kernel; the `_chunked` forms are their numpy kernels. Each gives
bitwise the values of the op's own kernel: the same roundings in the same order.

>>> import numpy as np
>>> y = np.ones(3, np.float32)
>>> axpy_into_chunked(np, np.float32(-0.5), np.array([1, 2, 3], np.float32), y) is y, y.tolist()
(True, [0.5, 0.0, -0.5])
>>> scale_add_into(np, 2.0, y, np.ones(3, np.float32)).tolist()
[2.0, 1.0, 0.0]
>>> axpy_new_chunked(np, 2.0, y, np.ones(3, np.float32)).tolist()
[5.0, 3.0, 1.0]
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
