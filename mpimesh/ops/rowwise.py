"""Row and column sums as the fused kernels (softmax, layer norm, cross-entropy) and the bias gradients
take them, and the CuPy kernels of softmax and layer norm.

An op's kernels share one body, told what its backend allows (`Backend`: `GENERIC`, functional, for
JAX; `NUMPY`, in place, row sums by einsum; `CUPY`, in place, the `ROW_SOURCES` kernels); its CuPy
kernel first tries the one-kernel rows (`ROWS_SOURCE`), where a row is the last axis of a contiguous
block, whole on this rank. The CUDA sources also compile for the CPU (a warp of one thread,
`PRELUDE_TYPES`), which is how the CPU suite checks them (tests/test_cuda_sources.py).

>>> import numpy as np
>>> a = np.arange(6.0).reshape(2, 3)
>>> row_sum(np, a, (1,)).tolist(), row_dot(np, a, a, (1,), einsum=True).tolist()
([[3.0], [12.0]], [[5.0], [50.0]])
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from ..backend import cached_kernel, on_gpu


class Backend(NamedTuple):
    """What a kernel body may do on one backend (the OpDef's kernels pick it)."""

    in_place: bool
    """numpy, CuPy: steps write into the kernel's own arrays (the same values, fewer arrays)."""
    einsum: bool
    """numpy: a float row sum over the last axis alone by `einsum` (see `row_sum`)."""
    fused: bool
    """CuPy: the reductions and outputs of `ROW_SOURCES`."""


GENERIC, NUMPY, CUPY = Backend(False, False, False), Backend(True, True, False), Backend(True, False, True)


def variant(body: Callable, **flags) -> Callable:
    """A kernel `(ctx, *arrays, **params)` that runs `body` with `flags` (e.g. `be=NUMPY`) added."""
    def kernel(ctx, *arrays, **params):
        return body(ctx, *arrays, **flags, **params)
    return kernel


# numpy's `sum(a, axis=-1)` over short rows (64 to 256 elements, a head's or a model's width) pays a
# per-row cost: about 4x what `einsum("...i->...")` takes for the same sums (56 against 14 us for the
# tiny Transformer's attention probabilities). So numpy's kernels (`einsum=True`) sum over the last
# axis alone by einsum (float rounding of another order, the same for eager and compiled steps);
# every other case, and CuPy and JAX, take `xp.sum`.
def _by_einsum(a, axes: tuple) -> bool:
    return tuple(axes) == (a.ndim - 1,) and a.dtype.kind == "f"


def row_sum(xp, a, axes: tuple, einsum: bool = False):
    """`xp.sum(a, axis=axes, keepdims=True)` (`einsum`: numpy's kernels)."""
    if einsum and _by_einsum(a, axes):
        return np.einsum("...i->...", a)[..., None]
    return xp.sum(a, axis=axes, keepdims=True)


def row_dot(xp, a, b, axes: tuple, einsum: bool = False):
    """`xp.sum(a * b, axis=axes, keepdims=True)`; `einsum` (numpy's kernels): without the product's array."""
    if einsum and _by_einsum(a, axes) and a.shape == b.shape and a.dtype == b.dtype:
        return np.einsum("...i,...i->...", a, b)[..., None]
    return xp.sum(a * b, axis=axes, keepdims=True)


# On CuPy, softmax and its gradient are two kernels each (`ROW_SOURCES`, `row_kernel`): a reduction whose
# map is the elementwise term (`sum(exp(x - m))`, `sum(dy * y)`: no array of the terms), then one
# elementwise kernel for the output, where the unfused composition makes a pass for each of subtract,
# exp, sum, divide (and multiply, sum, subtract, multiply backwards). Layer norm likewise: the mean, the
# centred squares' sum and one output kernel forwards; the normalised x, the two sums and dx backwards.
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


def fusable(*arrays) -> bool:
    """Whether the kernels of `ROW_SOURCES` take `arrays` (of one float32 or float64 dtype)."""
    return arrays[0].dtype.name in ("float32", "float64") and all(a.dtype == arrays[0].dtype for a in arrays)


def fused_rows(xp, *arrays) -> bool:
    """Whether the CuPy kernels of `ROW_SOURCES` take `arrays` (CuPy arrays of one float32 or float64 dtype)."""
    return on_gpu(xp) and fusable(*arrays)


def row_kernel(xp, which: str, *arrays, axes: tuple = (), out=None):
    """The CuPy kernel `which` of `ROW_SOURCES`, compiled on first use, on `arrays`: a row sum
    over `axes` (kept) for the reductions, else the elementwise output (into `out` where given)."""
    kernel = cached_kernel(("rowwise", which), lambda: _row_kernel(xp, which))
    if which in _REDUCTIONS:
        return kernel(*arrays, axis=axes, keepdims=True)
    return kernel(*arrays) if out is None else kernel(*arrays, out)


def _row_kernel(xp, which: str):
    ins, outs, body = ROW_SOURCES[which]
    if which in _REDUCTIONS:
        return xp.ReductionKernel(ins, outs, body, "a + b", "s = a", "0", f"mpimesh_{which}")
    return xp.ElementwiseKernel(ins, outs, body, f"mpimesh_{which}")


def column_sums(xp, arrays: list, rows: int, cols: int):
    """The column sums of the [rows, cols] product of `arrays` (one or two C-contiguous arrays of one
    dtype and `rows * cols` elements), by `COLUMN_SUM_SOURCES`'s kernel then a sum of its chunks'
    partials: a `[cols]` array (zeros for no rows: a rank's empty block of an uneven layout)."""
    n = len(arrays)
    chunks = -(-rows // COLUMN_CHUNK)
    if not chunks:
        return xp.zeros(cols, arrays[0].dtype)
    kernel = cached_kernel(("rowwise", "columns", n),
                           lambda: xp.ElementwiseKernel(*COLUMN_SUM_SOURCES[n], f"mpimesh_column_sums{n}"))
    partial = kernel(*arrays, rows, cols, COLUMN_CHUNK, size=chunks * cols)
    return partial.reshape(chunks, cols).sum(axis=0) if chunks > 1 else partial


# Where a softmax's (or a layer norm's) row is the last axis of a contiguous block, whole on this rank (no
# sum across ranks), one kernel does all of it each way (`ROWS_SOURCE`: `softmax_rows`, `layer_norm_rows`
# and their gradients): one warp per row reads the row for its max (mean), again (from cache) for the sum
# (of squares), and writes the output, softmax's causal mask added as it reads; bfloat16 is read and
# written as it is and computed in float32 (the kernels above made a pass for each step, and a cast each
# way). One warp per row (`WARP_ROW`: the row, the lane, rows past the end return; `LANES(j)`: the lane's
# elements of the row): `WARP`, `warp_max`, `warp_sum` and `NEG_INF` come from `GPU_PRELUDE` (a
# CPU build gives a warp of one thread); `T` the stored dtype, `A` the arithmetic's, `load`/`store`
# convert (`PRELUDE_TYPES`). The row's max skips NaN (a NaN makes the sum, so the whole row, NaN),
# and a row whose max is not finite takes 0 for it, as the two-kernel path does (all -inf: NaN).
ROWS_PARAMS = {
    "mpimesh_softmax_rows": "const T* x, T* y, long long rows, long long n, int log_out, int causal, "
                            "long long q_div, long long q_mod, long long q_off, A masked",
    "mpimesh_softmax_grad_rows": "const T* y, const T* g, T* dx, long long rows, long long n, int log_out",
    "mpimesh_layer_norm_rows": "const T* x, const A* sc, const A* b, T* y, A* mean, A* rstd, long long rows, "
                               "long long n, A inv_n, A eps, int has_scale, int has_bias",
    "mpimesh_layer_norm_grad_rows": "const T* x, const T* g, const A* mu, const A* r, const A* sc, T* dx, A* yhat, "
                                    "long long rows, long long n, A inv_n, int has_scale",
}
ROWS_HEAD = """
#define WARP_ROW long long row = (long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP; \\
  long long lane = threadIdx.x % WARP; \\
  if (row >= rows) return;
#define LANES(j) for (long long j = lane; j < n; j += WARP)

__device__ __forceinline__ A entry(const T* xr, long long j, bool masked_here, A masked) {
  A v = load(xr[j]);
  return masked_here ? v + masked : v;
}
"""
# The layer norm kernels' loads of x (forwards) and g (backwards) and their store of dx, as macros: `X_LOAD(j)`
# in the passes before the last, `X_LAST(j)` in the last (`mpimesh.rowfusion` defines them otherwise: an
# elementwise chain computed as the row is read, or applied to dx as it is stored).
ROWS_HOOKS = """#define X_LOAD(j) load(xr[j])
#define X_LAST(j) load(xr[j])
#define G_LOAD(j) load(gr[j])
#define G_LAST(j) load(gr[j])
#define DX_STORE(j, v) dr[j] = store(v)
"""
ROWS_KERNELS = {
    "mpimesh_softmax_rows": """
extern "C" __global__ void mpimesh_softmax_rows(%(mpimesh_softmax_rows)s) {
  WARP_ROW
  const T* xr = x + row * n;
  T* yr = y + row * n;
  long long q = causal ? (row / q_div) %% q_mod + q_off : 0;
  A m = NEG_INF;
  LANES(j) {
    A v = entry(xr, j, causal && j > q, masked);
    m = v > m ? v : m;
  }
  m = warp_max(m);
  if (!isfinite(m)) m = 0;
  A s = 0;
  LANES(j) s += exp(entry(xr, j, causal && j > q, masked) - m);
  s = warp_sum(s);
  A ls = log(s);
  LANES(j) {
    A v = entry(xr, j, causal && j > q, masked);
    yr[j] = store(log_out ? (v - m) - ls : exp(v - m) / s);
  }
}
""",
    "mpimesh_softmax_grad_rows": """
extern "C" __global__ void mpimesh_softmax_grad_rows(%(mpimesh_softmax_grad_rows)s) {
  WARP_ROW
  const T* yr = y + row * n;
  const T* gr = g + row * n;
  T* dr = dx + row * n;
  A s = 0;
  LANES(j) s += log_out ? load(gr[j]) : load(gr[j]) * load(yr[j]);
  s = warp_sum(s);
  LANES(j) {
    A yv = load(yr[j]), gv = load(gr[j]);
    dr[j] = store(log_out ? gv - exp(yv) * s : yv * (gv - s));
  }
}
""",
    "mpimesh_layer_norm_rows": """
extern "C" __global__ void mpimesh_layer_norm_rows(%(mpimesh_layer_norm_rows)s) {
  WARP_ROW
  const T* xr = x + row * n;
  T* yr = y + row * n;
  A s = 0;
  LANES(j) s += X_LOAD(j);
  A mu = warp_sum(s) * inv_n;
  A q = 0;
  LANES(j) { A c = X_LOAD(j) - mu; q += c * c; }
  A r = 1 / sqrt(warp_sum(q) * inv_n + eps);
  LANES(j) {
    A v = (X_LAST(j) - mu) * r;
    if (has_scale) v = v * sc[j];
    if (has_bias) v = v + b[j];
    yr[j] = store(v);
  }
  if (lane == 0) { mean[row] = mu; rstd[row] = r; }
}
""",
    "mpimesh_layer_norm_grad_rows": """
extern "C" __global__ void mpimesh_layer_norm_grad_rows(%(mpimesh_layer_norm_grad_rows)s) {
  WARP_ROW
  const T* xr = x + row * n;
  const T* gr = g + row * n;
  T* dr = dx + row * n;
  A* hr = yhat + row * n;
  A m = mu[row], rr = r[row], m1 = 0, m2 = 0;
  LANES(j) {
    A gs = has_scale ? G_LOAD(j) * sc[j] : G_LOAD(j);
    m1 += gs;
    m2 += gs * ((load(xr[j]) - m) * rr);
  }
  A a1 = warp_sum(m1) * inv_n, a2 = warp_sum(m2) * inv_n;
  LANES(j) {
    A gs = has_scale ? G_LAST(j) * sc[j] : G_LAST(j);
    A yh = (load(xr[j]) - m) * rr;
    hr[j] = yh;
    DX_STORE(j, ((gs - a1) - yh * a2) * rr);
  }
}
""",
}
"""name -> the kernel's source, its parameters `%(name)s` (`ROWS_PARAMS`)."""
ROWS_SOURCE = ROWS_HEAD + ROWS_HOOKS + "".join(ROWS_KERNELS.values()) % ROWS_PARAMS
BF16_CONVERSIONS = (
    "__device__ __forceinline__ float load(unsigned short v) { return __uint_as_float(((unsigned int)v) << 16); }\n"
    "__device__ __forceinline__ unsigned short store(float f) {  /* to nearest, ties to even; NaN quiet */\n"
    "  unsigned int u = __float_as_uint(f);\n"
    "  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);\n"
    "  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);\n}\n")
"""bfloat16 (its bits, an unsigned short) to float and back, as ml_dtypes converts (the fused kernels' too)."""
PRELUDE_TYPES = {
    "float32": "typedef float T; typedef float A;\n__device__ __forceinline__ A load(T v) { return v; }\n"
               "__device__ __forceinline__ T store(A v) { return v; }\n",
    "float64": "typedef double T; typedef double A;\n__device__ __forceinline__ A load(T v) { return v; }\n"
               "__device__ __forceinline__ T store(A v) { return v; }\n",
    "bfloat16": "typedef unsigned short T; typedef float A;\n" + BF16_CONVERSIONS,
}
GPU_PRELUDE = """#define WARP 32
#define NEG_INF (-__int_as_float(0x7f800000))
template <typename V> __device__ __forceinline__ V warp_sum(V v) {
  for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename V> __device__ __forceinline__ V warp_max(V v) {
  for (int o = WARP / 2; o > 0; o /= 2) { V u = __shfl_xor_sync(0xffffffffu, v, o); v = u > v ? u : v; }
  return v;
}
"""
ROWS_PER_BLOCK = 8  # warps (rows) per block of 256 threads


def rows_fit(xp, a, axes: tuple) -> bool:
    """Whether `softmax_rows` takes `a` (a CuPy kernel's block: float32, float64 or bfloat16, C-contiguous,
    reduced over its last axis alone, not empty) and its kernels compiled."""
    return (a.dtype.name in PRELUDE_TYPES and a.ndim >= 1 and tuple(axes) == (a.ndim - 1,) and a.size > 0
            and a.flags.c_contiguous and _rows_kernels(xp, a.dtype))


def rows_kernels(xp, key: tuple, source: str, names, dtype):
    """`{name: kernel}` of the raw CUDA `source` (a warp per row; one function per name of `names`)
    for `dtype`, compiled on first use and cached under `key + (dtype name,)` (`backend.cached_kernel`);
    None where NVRTC refuses it (then the caller's few-kernel path runs)."""
    return cached_kernel(key + (dtype.name,), lambda: compile_rows(xp, source, names, dtype.name))


def compile_rows(xp, source: str, names, dtype: str):
    """`{name: kernel}` of `source` (after `GPU_PRELUDE` and `PRELUDE_TYPES[dtype]`) by NVRTC, or None."""
    try:  # (no multiply-add contraction: a chain folded into a row kernel keeps each op's rounding, `rowfusion`)
        module = xp.RawModule(code=GPU_PRELUDE + PRELUDE_TYPES[dtype] + source, options=("--fmad=false",))
        return {k: module.get_function(k) for k in names}
    except Exception:  # (an NVRTC that refuses the source: the kernels stay off, the others serve)
        return None


def launch_rows(kernels: dict, a, which: str, *args) -> None:
    """Launch `kernels[which]` (`rows_kernels`) over the rows of `a`'s last axis, a warp per row."""
    rows = a.size // a.shape[-1]
    kernels[which]((-(-rows // ROWS_PER_BLOCK),), (ROWS_PER_BLOCK * 32,), args)


def _rows_kernels(xp, dtype):
    """`ROWS_SOURCE`'s kernels for `dtype` (`rows_kernels`)."""
    return rows_kernels(xp, ("rowwise", "rows"), ROWS_SOURCE, ROWS_PARAMS, dtype)


def _launch(xp, a, which: str, *args) -> None:
    launch_rows(_rows_kernels(xp, a.dtype), a, which, *args)


def softmax_rows(xp, x, log: bool, masked: float, causal: tuple = ()):
    """softmax (log_softmax) of `x` over its last axis by one kernel (`rows_fit(xp, x, ...)`):
    `causal`: `(q_axis, q_start)`, masking `masked` into entries whose position along the last axis
    (whole here: from 0) is after the row's along `q_axis` (this block's from `q_start`)."""
    n = x.shape[-1]
    y = xp.empty_like(x)
    q_axis, q_start = causal or (0, 0)
    q_div = int(np.prod(x.shape[q_axis + 1:-1], dtype=np.int64)) if causal else 1
    acc = np.float64 if x.dtype == np.float64 else np.float32
    _launch(xp, x, "mpimesh_softmax_rows", x, y, np.int64(x.size // n), np.int64(n), np.int32(log),
            np.int32(bool(causal)), np.int64(q_div), np.int64(x.shape[q_axis]), np.int64(q_start), acc(masked))
    return y


def layer_norm_rows(xp, x, epsilon: float, scale=None, bias=None, fused=None) -> tuple:
    """`(y, mean, 1 / std)` of layer norm over x's last axis by one kernel (`rows_fit`): `scale`
    and `bias` None or vectors of that axis's length in the arithmetic's dtype (float32 for
    bfloat16); the statistics in that dtype, of x's shape without the last axis. `fused`:
    `(kernels, extra args)` of a kernel whose prologue computes x (`mpimesh.rowfusion`; x an `Aval`)."""
    n = x.shape[-1]
    acc = np.float64 if x.dtype == np.float64 else np.float32
    y = xp.empty(x.shape, x.dtype)
    mean, rstd = (xp.empty(x.shape[:-1], acc) for _ in range(2))
    kernels, extra = fused or (_rows_kernels(xp, x.dtype), ())
    x = y if fused else x  # (a prologue reads no x)
    launch_rows(kernels, y, "mpimesh_layer_norm_rows", x, x if scale is None else scale, x if bias is None else bias,
                y, mean, rstd, np.int64(y.size // n), np.int64(n), acc(1.0 / n), acc(epsilon),
                np.int32(scale is not None), np.int32(bias is not None), *extra)
    return y, mean, rstd


def layer_norm_grad_rows(xp, x, g, mean, rstd, scale=None, fused=None) -> tuple:
    """`(dx, normalised x)` of layer norm over x's last axis by one kernel: `g` of x's shape and
    dtype; `mean`, `rstd` and `scale` (None or a vector) in the arithmetic's dtype, as
    `layer_norm_rows` gives and takes them; the normalised x in that dtype. `fused`: `(kernels, extra
    args, dx)` of a kernel whose prologue computes g (g None) or whose epilogue takes dx (`dx` False:
    dx is not written, and None takes its place) (`mpimesh.rowfusion`)."""
    n = x.shape[-1]
    kernels, extra, written = fused or (_rows_kernels(xp, x.dtype), (), True)
    dx, yhat = xp.empty(x.shape if written else (1,), x.dtype), xp.empty(x.shape, mean.dtype)
    launch_rows(kernels, x, "mpimesh_layer_norm_grad_rows", x, x if g is None else g, mean, rstd,
                x if scale is None else scale, dx, yhat, np.int64(x.size // n), np.int64(n),
                mean.dtype.type(1.0 / n), np.int32(scale is not None), *extra)
    return dx if written else None, yhat


def softmax_grad_rows(xp, y, g, log: bool):
    """The input gradient of softmax (log_softmax) output `y` for `g` (of y's shape, dtype and
    contiguity) over the last axis by one kernel."""
    dx = xp.empty_like(y)
    n = y.shape[-1]
    _launch(xp, y, "mpimesh_softmax_grad_rows", y, g, dx, np.int64(y.size // n), np.int64(n), np.int32(log))
    return dx
