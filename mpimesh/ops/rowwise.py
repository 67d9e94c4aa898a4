"""Row and column sums, as the fused kernels (softmax, layer norm, cross-entropy) and the bias
gradients take them, and the CuPy kernels of softmax and layer norm.

numpy's `sum(a, axis=-1)` over short rows (64 to 256 elements, a head's or a model's width) pays
a per-row cost: about 4x what `einsum("...i->...")` takes for the same sums (56 against 14 us for
the tiny Transformer's attention probabilities). On numpy, a reduction over the last axis alone
goes through `einsum` (float rounding of a different order, the same for eager and compiled
steps); every other case, and CuPy and JAX, take `xp.sum`.

On CuPy, softmax and its gradient are two kernels each (`ROW_SOURCES`, `row_kernel`): a reduction
whose map is the elementwise term (`sum(exp(x - m))`, `sum(dy * y)`: no array of the terms), then
one elementwise kernel for the output, where the unfused composition makes a pass for each of
subtract, exp, sum, divide (and multiply, sum, subtract, multiply backwards) over the logits.
Layer norm likewise: the mean, the centred squares' sum and one output kernel forwards; the
normalised x, the two sums and dx backwards. Column sums over leading axes (`column_sums`) take a
kernel of their own.

>>> import numpy as np
>>> a = np.arange(6.0).reshape(2, 3)
>>> row_sum(np, a, (1,)).tolist(), row_dot(np, a, a, (1,)).tolist()
([[3.0], [12.0]], [[5.0], [50.0]])
"""
from __future__ import annotations

import numpy as np


def _last_axis_on_numpy(xp, a, axes: tuple) -> bool:
    return xp is np and tuple(axes) == (a.ndim - 1,) and a.dtype.kind == "f"


def row_sum(xp, a, axes: tuple):
    """`xp.sum(a, axis=axes, keepdims=True)`."""
    if _last_axis_on_numpy(xp, a, axes):
        return np.einsum("...i->...", a)[..., None]
    return xp.sum(a, axis=axes, keepdims=True)


def row_dot(xp, a, b, axes: tuple):
    """`xp.sum(a * b, axis=axes, keepdims=True)`, on numpy without the product's array."""
    if _last_axis_on_numpy(xp, a, axes) and a.shape == b.shape and a.dtype == b.dtype:
        return np.einsum("...i,...i->...", a, b)[..., None]
    return xp.sum(a * b, axis=axes, keepdims=True)


# name -> (inputs, output, reduction's map or elementwise body): the arithmetic of the numpy lowering in
# nn.py in the same order; `m` the row maximum, `s` the row sum, `y` softmax's (log-softmax's) output.
ROW_SOURCES = {
    "sum_exp": ("T x, T m", "T s", "exp(x - m)"),
    "row_dot": ("T g, T y", "T s", "g * y"),
    "softmax": ("T x, T m, T s", "T y", "y = exp(x - m) / s;"),
    "log_softmax": ("T x, T m, T s", "T y", "y = (x - m) - log(s);"),
    "softmax_grad": ("T y, T g, T s", "T dx", "dx = y * (g - s);"),
    "log_softmax_grad": ("T y, T g, T s", "T dx", "dx = g - exp(y) * s;"),
}
# layer norm's: `mu` the mean, `r` 1/std, `sc`/`b` the scale and bias (a 0-d 1 where the gradient has no
# scale: g * 1 is g), `yh` the normalised x, `m1`/`m2` the gradient's two sums over the count
ROW_SOURCES.update({
    "centred_squares": ("T x, T mu", "T s", "(x - mu) * (x - mu)"),
    "scaled_sum": ("T g, T sc", "T s", "g * sc"),
    "scaled_dot": ("T g, T sc, T yh", "T s", "(g * sc) * yh"),
    "layer_norm": ("T x, T mu, T r", "T y", "y = (x - mu) * r;"),
    "layer_norm_s": ("T x, T mu, T r, T sc", "T y", "y = ((x - mu) * r) * sc;"),
    "layer_norm_b": ("T x, T mu, T r, T b", "T y", "y = ((x - mu) * r) + b;"),
    "layer_norm_sb": ("T x, T mu, T r, T sc, T b", "T y", "y = (((x - mu) * r) * sc) + b;"),
    "normalised": ("T x, T mu, T r", "T yh", "yh = (x - mu) * r;"),
    "layer_norm_grad": ("T g, T sc, T yh, T m1, T m2, T r", "T dx", "dx = (((g * sc) - m1) - yh * m2) * r;"),
})
_REDUCTIONS = ("sum_exp", "row_dot", "centred_squares", "scaled_sum", "scaled_dot")
# Column sums of a [rows, cols] block (of x, or of x * w): thread i sums column i % cols over one chunk
# of rows, reading rows one after the other (the threads of a warp read one row's neighbouring
# elements); the chunks' partial sums are summed after. CuPy's own reduction over leading axes took
# 0.4 ms for a [16384, 1024] float32 block on an H200 (a bias's gradient; a pass is 0.03 ms).
COLUMN_SUM_SOURCES = {
    1: ("raw T x, int64 rows, int64 cols, int64 chunk", "T s",
        "long long c = i % cols, r0 = (i / cols) * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows; T acc = 0; "
        "for (long long r = r0; r < r1; ++r) acc += x[r * cols + c]; s = acc;"),
    2: ("raw T x, raw T w, int64 rows, int64 cols, int64 chunk", "T s",
        "long long c = i % cols, r0 = (i / cols) * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows; T acc = 0; "
        "for (long long r = r0; r < r1; ++r) acc += x[r * cols + c] * w[r * cols + c]; s = acc;"),
}
COLUMN_CHUNK = 128
_cuda: dict = {}


def fused_rows(xp, *arrays) -> bool:
    """Whether the CuPy kernels of `ROW_SOURCES` take `arrays` (CuPy arrays of one float32 or float64 dtype)."""
    return getattr(xp, "__name__", "") == "cupy" and arrays[0].dtype.name in ("float32", "float64") and all(
        a.dtype == arrays[0].dtype for a in arrays)


def row_kernel(xp, which: str, *arrays, axes: tuple = (), out=None):
    """The CuPy kernel `which` of `ROW_SOURCES`, compiled on first use, on `arrays`: a row sum
    over `axes` (kept) for the reductions, else the elementwise output (into `out` where given)."""
    if which not in _cuda:
        ins, outs, body = ROW_SOURCES[which]
        _cuda[which] = (xp.ReductionKernel(ins, outs, body, "a + b", "s = a", "0", f"mpimesh_{which}")
                        if which in _REDUCTIONS else xp.ElementwiseKernel(ins, outs, body, f"mpimesh_{which}"))
    if which in _REDUCTIONS:
        return _cuda[which](*arrays, axis=axes, keepdims=True)
    return _cuda[which](*arrays) if out is None else _cuda[which](*arrays, out)


def column_sums(xp, arrays: list, rows: int, cols: int):
    """The column sums of the [rows, cols] product of `arrays` (one or two C-contiguous arrays of one
    dtype and `rows * cols` elements), by `COLUMN_SUM_SOURCES`'s kernel then a sum of its chunks'
    partials: a `[cols]` array."""
    n = len(arrays)
    if ("columns", n) not in _cuda:
        _cuda["columns", n] = xp.ElementwiseKernel(*COLUMN_SUM_SOURCES[n], f"mpimesh_column_sums{n}")
    chunks = -(-rows // COLUMN_CHUNK)
    partial = _cuda["columns", n](*arrays, rows, cols, COLUMN_CHUNK, size=chunks * cols)
    return partial.reshape(chunks, cols).sum(axis=0) if chunks > 1 else partial
