"""Matmuls of 16-bit floats that accumulate in float32 and return float32, on every array module.

An einsum of bfloat16 or float16 blocks sums in float32 and rounds once, after the sum across ranks
(`mpimesh.ops.einsum`). The partial products must therefore come out of the matmul in float32:

- numpy: the blocks are upcast to float32 and multiplied by sgemm (BLAS has no 16-bit kernels, and
  ml_dtypes' own matmul loops in Python-level ufuncs);
- CuPy: one cuBLAS `GemmStridedBatchedEx` with 16-bit A and B, a float32 C and `CUBLAS_COMPUTE_32F`:
  tensor cores read the 16-bit words directly, no upcast copies are made;
- JAX (a replay): `matmul(..., preferred_element_type=float32)`, which XLA lowers the same way.

>>> import numpy as np, ml_dtypes
>>> a = np.ones((2, 3), ml_dtypes.bfloat16)
>>> y = widening_matmul(np, a, a.T)
>>> y.dtype, float(y[0, 0])
(dtype('float32'), 3.0)
"""
from __future__ import annotations

import numpy as np

from .backend import BFLOAT16, is_low_precision, name

# cuBLAS and CUDA enums (cublas_api.h, library_types.h)
_CUDA_TYPES = {np.dtype(np.float16): 2, BFLOAT16: 14, np.dtype(np.float32): 0}  # CUDA_R_16F, _16BF, _32F
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F
_GEMM_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT: cuBLAS picks the algorithm (tensor cores for 16-bit inputs)
_OP_N = 0  # CUBLAS_OP_N
_POINTER_MODE_HOST = 0
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)  # alpha and beta, read from host memory


def widening_matmul(xp, a, b):
    """`a @ b` in float32 for 16-bit float (or float32) `a` and `b` of shapes `[..., m, k]` and
    `[..., k, n]` with the same leading (batch) shape, or 2-D."""
    f32 = np.float32
    kind = name(xp)
    if kind == "jax":
        return xp.matmul(a, b, preferred_element_type=f32)
    if kind == "cupy" and a.dtype == b.dtype and is_low_precision(a.dtype) and a.shape[:-2] == b.shape[:-2]:
        return cublas_matmul(xp, _cublas(), a, b)
    return xp.matmul(a.astype(f32, copy=False), b.astype(f32, copy=False))


def cublas_matmul(xp, cublas, a, b):
    """`a @ b` (same leading shape) into a new float32 array by one strided-batched cuBLAS GEMM
    (`cublas`: CuPy's bindings, or a stand-in with the same calls).

    cuBLAS is column-major: to it, a C-contiguous row-major `[r, c]` block is the column-major
    `[c, r]` matrix (its transpose) with leading dimension c. So the row-major `[m, n]` product
    C = A·B is computed as the column-major Cᵀ = Bᵀ·Aᵀ: cuBLAS's m, n, k are our n, m, k, its A is
    our `b` (leading dimension n), its B our `a` (k), its C our result (n); batch entries lie one
    matrix apart (strides k·n, m·k, m·n)."""
    a, b = xp.ascontiguousarray(a), xp.ascontiguousarray(b)
    *lead, m, k = a.shape
    n = b.shape[-1]
    batch = int(np.prod(lead, dtype=np.int64)) if lead else 1
    out = xp.empty((*lead, m, n), np.float32)
    if out.size == 0:
        return out
    if k == 0:
        out[...] = 0
        return out
    handle = xp.cuda.device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, _POINTER_MODE_HOST)
    try:
        cublas.gemmStridedBatchedEx(
            handle, _OP_N, _OP_N, n, m, k, _ONE.ctypes.data,
            b.data.ptr, _CUDA_TYPES[b.dtype], n, k * n,
            a.data.ptr, _CUDA_TYPES[a.dtype], k, m * k,
            _ZERO.ctypes.data,
            out.data.ptr, _CUDA_TYPES[out.dtype], n, m * n,
            batch, _COMPUTE_32F, _GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)
    return out


def _cublas():
    """CuPy's cuBLAS bindings."""
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:  # older CuPy
        from cupy.cuda import cublas
    return cublas
