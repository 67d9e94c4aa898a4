"""The GEMMs of `mpimesh.ops.einsum`'s kernels: every cuBLAS GEMM on CuPy (16-bit floats into float32,
float32 in the precision `mm.set_matmul_precision` chose, float64), and the 16-bit matmuls into float32
on every array module (numpy: upcast, then sgemm; a JAX replay: XLA asked for float32 results).
While a CUDA graph captures, the GEMMs go through `mpimesh.cublas`. More: docs/gpu_kernels.md.

>>> import numpy as np, ml_dtypes
>>> a = np.ones((2, 3), ml_dtypes.bfloat16)
>>> y = widening_matmul(np, a, a.T)
>>> y.dtype, float(y[0, 0])
(dtype('float32'), 3.0)
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import numpy as np

from .backend import BFLOAT16, is_low_precision, matmul_precision
from .cublas import capturable

# cuBLAS and CUDA enums (cublas_api.h, library_types.h)
_CUDA_TYPES = {np.dtype(np.float16): 2, BFLOAT16: 14, np.dtype(np.float32): 0,  # CUDA_R_16F, _16BF, _32F,
               np.dtype(np.float64): 1}  # CUDA_R_64F
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32, _COMPUTE_64F = 68, 77, 70  # cublasComputeType_t
_TF32_TENSOR_OP_MATH = 3  # cublasMath_t
_GEMM_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT: cuBLAS picks the algorithm (tensor cores for 16-bit inputs)
_OP_N, _OP_T = 0, 1  # CUBLAS_OP_N, CUBLAS_OP_T
_POINTER_MODE_HOST = 0
# alpha and beta, read from host memory, in the compute type's scalar type (float64 for COMPUTE_64F)
_ONE, _ZERO, _ONE64, _ZERO64 = np.ones(1, np.float32), np.zeros(1, np.float32), np.ones(1), np.zeros(1)


def compute_type(dtype, precision: str) -> int:
    """cuBLAS's compute type for a GEMM of `dtype` inputs at `precision` ("highest" or "tf32"): TF32
    tensor cores only for float32 inputs at "tf32"; 16-bit inputs always in float32; float64 in float64.

    >>> compute_type(np.float32, "tf32"), compute_type(np.float32, "highest"), compute_type(BFLOAT16, "tf32")
    (77, 68, 68)
    """
    if np.dtype(dtype) == np.float64:
        return _COMPUTE_64F
    return _COMPUTE_32F_FAST_TF32 if np.dtype(dtype) == np.float32 and precision == "tf32" else _COMPUTE_32F


def widening_matmul(xp, a, b, out=None):
    """`a @ b` in float32 for 16-bit float (or float32) `a` and `b` of shapes `[..., m, k]` and
    `[..., k, n]` with the same leading (batch) shape, or 2-D, the blocks upcast first (numpy's: BLAS
    has no 16-bit kernels); into `out` where given (a C-contiguous float32 array of the product's shape)."""
    f32 = np.float32
    y = xp.matmul(a.astype(f32, copy=False), b.astype(f32, copy=False))
    if out is None:
        return y
    out[...] = y
    return out


def jax_widening_matmul(xp, a, b, out=None):
    """`widening_matmul` under JAX: one dot of the arrays as they are with float32 results, which XLA
    lowers to a GEMM reading the 16-bit words (`out` is never given: JAX arrays are immutable)."""
    return xp.matmul(a, b, preferred_element_type=np.float32)


def gpu_widening_matmul(xp, a, b, out=None):
    """`widening_matmul` on CuPy: one cuBLAS GEMM of the 16-bit (or float32) words as they lie
    (`gpu_matmul`: no upcast copies); the upcast product where one call cannot take them."""
    if is_low_precision(a.dtype) or a.dtype == np.float32:
        y = gpu_matmul(xp, a, b, out)
        if y is not None:
            return y
    return widening_matmul(xp, a, b, out)


def rounding_matmul(xp, a, b, out=None, widening=widening_matmul):
    """`a @ b` of 16-bit floats `a` and `b` of one dtype, summed in float32 and rounded once to that
    dtype (an einsum's 16-bit result that no rank sums: the product of `widening`, e.g.
    `jax_widening_matmul`, rounded), into `out` where given (C-contiguous, that dtype).

    >>> import ml_dtypes
    >>> a = np.array([[1.0] + [2.0 ** -9] * 256], ml_dtypes.bfloat16)  # a bfloat16 sum would stay at 1
    >>> y = rounding_matmul(np, a, np.ones((257, 1), ml_dtypes.bfloat16))
    >>> y.dtype, float(y[0, 0])
    (dtype(bfloat16), 1.5)
    """
    y = widening(xp, a, b).astype(a.dtype)
    if out is None:
        return y
    out[...] = y
    return out


def gpu_rounding_matmul(xp, a, b, out=None):
    """`rounding_matmul` on CuPy: the GEMM writes the 16-bit words itself (cuBLAS rounds its float32
    sums as it stores them): no float32 product is made and then cast."""
    dtype = a.dtype
    if b.dtype == dtype and is_low_precision(dtype) and a.ndim >= 2 and b.ndim >= 2:
        y = gpu_matmul(xp, a, b, out if out is not None else xp.empty(a.shape[:-1] + b.shape[-1:], dtype))
        if y is not None:
            return y
    return rounding_matmul(xp, a, b, out, gpu_widening_matmul)


def gpu_matmul(xp, a, b, out=None):
    """`a @ b` on CuPy by one cuBLAS GEMM (`cublas_matmul`) for float64, float32 (in
    the matmul precision) or 16-bit float (into float32) `a` and `b` of one dtype and the same leading
    shape, into `out` where given (C-contiguous, the product's shape and dtype, or for 16-bit inputs
    their own dtype: rounded by the GEMM); else None."""
    if a.dtype != b.dtype or a.dtype not in _CUDA_TYPES or a.shape[:-2] != b.shape[:-2] or a.ndim < 2 \
            or b.ndim < 2:
        return None
    if out is not None and (out.dtype not in (_out_dtype(a.dtype), a.dtype) or not out.flags.c_contiguous):
        y = gpu_matmul(xp, a, b)
        out[...] = y
        return out
    return cublas_matmul(xp, _cublas(xp), a, b, compute_type(a.dtype, matmul_precision()), out)


def _out_dtype(dtype) -> np.dtype:
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def _gemm_operand(x):
    """How cuBLAS (column-major) reads the row-major `[..., r, c]` matrices of `x` in place:
    `(transposed, ld, batch stride)` in elements, or None where it cannot (then `x` is copied).
    Row-major matrices with rows `ld` apart are, to cuBLAS, the column-major `[c, r]` transposes
    (`transposed` False: operation N on them gives xᵀ); the transpose of such a view (rows one
    element apart) is, to cuBLAS, x itself (`transposed` True: operation T gives xᵀ)."""
    s = x.itemsize
    r, c = x.shape[-2:]
    # a batch dim of size 1 takes no step: its stride is anything (numpy's and CuPy's contiguity ignore it too)
    lead = [(n, step) for n, step in zip(x.shape[:-2], x.strides[:-2]) if n != 1]
    if any(step != inner * n for (_, step), (n, inner) in zip(lead, lead[1:])):
        return None  # batch dims that do not merge into one stride
    batch = lead[-1][1] // s if lead else 0
    if x.strides[-1] == s or c == 1:
        ld = max(x.strides[-2] // s if r > 1 else c, c, 1)
        if r == 1 or x.strides[-2] >= c * s:
            return False, ld, batch
    if x.strides[-2] == s or r == 1:
        ld = max(x.strides[-1] // s if c > 1 else r, r, 1)
        if c == 1 or x.strides[-1] >= r * s:
            return True, ld, batch
    return None


def cublas_matmul(xp, cublas, a, b, compute: int = _COMPUTE_32F, out=None):
    """`a @ b` (same leading shape) into a new float32 array (float64 for float64 inputs), or into
    `out` (C-contiguous, of that shape and dtype, or 16-bit inputs' own dtype: cuBLAS rounds the
    float32 sums as it stores them), by one cuBLAS GEMM (`GemmEx` for one product, else
    `GemmStridedBatchedEx`) with compute
    type `compute` (`cublas`: CuPy's or `mpimesh.cublas`'s bindings, or a stand-in with the same calls).

    cuBLAS is column-major: to it, a row-major `[r, c]` block is the column-major `[c, r]` matrix
    (its transpose). So the row-major `[m, n]` product C = A·B is computed as the column-major
    Cᵀ = Bᵀ·Aᵀ: cuBLAS's m, n, k are our n, m, k, its A is our `b`, its B our `a`, its C our result
    (leading dimension n, batch entries m·n apart). Each operand is read where it lies, with its
    own leading dimension and batch stride, and a transpose flag where it is the transposed view
    of a row-major block (`_gemm_operand`): an einsum's operands need no copy. Only an operand
    whose strides cuBLAS cannot express is copied first."""
    *lead, m, k = a.shape
    n = b.shape[-1]
    batch = int(np.prod(lead, dtype=np.int64)) if lead else 1
    if out is None:
        out = xp.empty((*lead, m, n), _out_dtype(a.dtype))
    if out.size == 0:
        return out
    if k == 0:
        out[...] = 0
        return out
    ops = []
    for x in (b, a):
        how = _gemm_operand(x)
        if how is None:
            x = xp.ascontiguousarray(x)
            how = _gemm_operand(x)
        ops.append((x, how))
    (b, (tb, ldb, sb)), (a, (ta, lda, sa)) = ops
    handle = xp.cuda.device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, _POINTER_MODE_HOST)
    ops = (_OP_T if tb else _OP_N, _OP_T if ta else _OP_N, n, m, k)
    one, zero = (_ONE64, _ZERO64) if out.dtype == np.float64 else (_ONE, _ZERO)
    types = _CUDA_TYPES[b.dtype], _CUDA_TYPES[a.dtype], _CUDA_TYPES[out.dtype]
    try:
        if batch == 1:  # (the plain GEMM: as PyTorch's 2-D matmul, cuBLAS's heuristics for one product)
            cublas.gemmEx(handle, *ops, one.ctypes.data, b.data.ptr, types[0], ldb, a.data.ptr, types[1], lda,
                          zero.ctypes.data, out.data.ptr, types[2], n, compute, _GEMM_DEFAULT)
        else:
            cublas.gemmStridedBatchedEx(handle, *ops, one.ctypes.data, b.data.ptr, types[0], ldb, sb,
                                        a.data.ptr, types[1], lda, sa, zero.ctypes.data,
                                        out.data.ptr, types[2], n, m * n, batch, compute, _GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)
    return out


def tf32_math(xp, cublas=None):
    """A context in which cuBLAS may use TF32 tensor cores for float32 (its handle's math mode
    `CUBLAS_TF32_TENSOR_OP_MATH`, restored afterwards) where the precision is "tf32": for CuPy's own
    routines (`xp`: CuPy), such as the matmuls inside `cupy.einsum`. At "highest" it does nothing."""
    if matmul_precision() != "tf32":
        return nullcontext()
    return _math_mode(xp, cublas or _cublas(), _TF32_TENSOR_OP_MATH)


@contextmanager
def _math_mode(xp, cublas, mode: int):
    handle = xp.cuda.device.get_cublas_handle()
    before = cublas.getMathMode(handle)
    cublas.setMathMode(handle, mode)
    try:
        yield
    finally:
        cublas.setMathMode(handle, before)


def _cublas(xp=None):
    """CuPy's cuBLAS bindings; while `xp`'s current stream captures a CUDA graph, `mpimesh.cublas`'s
    (CuPy's refuse to run then), where they find the library."""
    if xp is not None and xp.cuda.get_current_stream().is_capturing():
        bindings = capturable(xp)
        if bindings is not None:
            return bindings
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:  # older CuPy
        from cupy.cuda import cublas
    return cublas
