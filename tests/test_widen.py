"""mpimesh.widen: 16-bit matmuls into float32, checked against float64 numpy on the same values.

The CuPy path is one cuBLAS call whose arguments (row-major blocks handed to a column-major
library: swapped operands, leading dimensions, batch strides) are easy to get wrong and run here
without a GPU: `FakeCublas` implements the documented semantics of `cublasGemmStridedBatchedEx`
on host memory (column-major operands read through their pointers, leading dimensions and strides),
independently of the code under test, and the fake "device" arrays are numpy arrays with a
`.data.ptr`. A GPU runs the real call (tests/run.py --backend cupy).
"""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from mpimesh.widen import cublas_matmul, widening_matmul

BF16 = np.dtype(ml_dtypes.bfloat16)
_TYPES = {2: np.dtype(np.float16), 14: BF16, 0: np.dtype(np.float32)}  # cudaDataType_t values


class DeviceArray(np.ndarray):
    """A host array that shows a CuPy-like `.data.ptr`."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)


def _device(a: np.ndarray) -> DeviceArray:
    return np.ascontiguousarray(a).view(DeviceArray)


FAKE_XP = SimpleNamespace(ascontiguousarray=_device, empty=lambda shape, dtype: _device(np.empty(shape, dtype)),
                          cuda=SimpleNamespace(device=SimpleNamespace(get_cublas_handle=lambda: 7)))


class FakeCublas:
    """`gemmStridedBatchedEx` as cuBLAS documents it, on host pointers: for each batch entry i,
    C_i = alpha·A_i·B_i + beta·C_i with column-major A_i (m x k, element (r, c) at A + i·strideA + r + c·lda),
    B_i (k x n) and C_i (m x n), no transposes; alpha and beta read as float32 from host pointers."""

    def __init__(self):
        self.mode, self.calls = 0, 0

    def getPointerMode(self, handle):
        return self.mode

    def setPointerMode(self, handle, mode):
        self.mode = mode

    @staticmethod
    def _matrix(ptr, dtype, rows, cols, ld, offset):
        """The column-major rows x cols matrix at element `offset` of `ptr` (a view of that memory)."""
        count = offset + ld * (cols - 1) + rows
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * (count * dtype.itemsize)).from_address(ptr))
        flat = raw.view(dtype)
        return flat[offset + np.arange(rows)[:, None] + ld * np.arange(cols)[None, :]], flat, offset

    def gemmStridedBatchedEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, sA, B, Btype, ldb, sB,
                             beta, C, Ctype, ldc, sC, batch, compute, algo):
        assert handle == 7 and transa in (0, 1) and transb in (0, 1) and compute == 68  # OP_N/OP_T, COMPUTE_32F
        assert self.mode == 0, "alpha and beta are host pointers: pointer mode must be host"
        # op(A) is m x k: A itself (N, stored m x k, lda >= m) or the transpose of a stored k x m (T, lda >= k)
        assert lda >= (k if transa else m) and ldb >= (n if transb else k) and ldc >= m
        self.calls += 1
        self.ops = (transa, transb)
        al, be = (float(np.ctypeslib.as_array((ctypes.c_float * 1).from_address(p))[0]) for p in (alpha, beta))
        for i in range(batch):
            a = (self._matrix(A, _TYPES[Atype], k, m, lda, i * sA)[0].T if transa else
                 self._matrix(A, _TYPES[Atype], m, k, lda, i * sA)[0]).astype(np.float64)
            b = (self._matrix(B, _TYPES[Btype], n, k, ldb, i * sB)[0].T if transb else
                 self._matrix(B, _TYPES[Btype], k, n, ldb, i * sB)[0]).astype(np.float64)
            c, flat, off = self._matrix(C, _TYPES[Ctype], m, n, ldc, i * sC)
            value = al * (a @ b) + (be * c.astype(np.float64) if be else 0.0)  # beta 0: C is never read
            flat[off + np.arange(m)[:, None] + ldc * np.arange(n)[None, :]] = value


def _values(shape, dtype, seed: int) -> np.ndarray:
    """Multiples of 1/8 in [-4, 4): exact in both 16-bit floats."""
    return (np.random.default_rng(seed).integers(-32, 32, shape) / 8).astype(dtype)


SHAPES = [((3, 5), (5, 4)), ((2, 3, 7), (2, 7, 6)), ((2, 2, 1, 9), (2, 2, 9, 1)), ((4, 0), (0, 3)), ((0, 2), (2, 5))]


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: f"{s[0]}@{s[1]}")
def test_cublas_arguments(shapes, dtype):
    a, b = _values(shapes[0], dtype, 1), _values(shapes[1], dtype, 2)
    fake = FakeCublas()
    fake.mode = 1  # a device pointer mode left by someone else: set to host for the call, then restored
    got = cublas_matmul(FAKE_XP, fake, _device(a), _device(b))
    assert got.dtype == np.float32 and got.shape == np.matmul(a, b).shape
    np.testing.assert_array_equal(np.asarray(got), a.astype(np.float64) @ b.astype(np.float64))
    assert fake.mode == 1 and fake.calls == (1 if got.size and a.shape[-1] else 0)


@pytest.mark.parametrize("ta,tb", [(False, True), (True, False), (True, True)])
def test_transposed_views_are_read_in_place_with_transpose_flags(ta, tb):
    """An einsum's operands are often transposed views (a gradient's xᵀ·dy): cuBLAS reads them where
    they lie, with CUBLAS_OP_T, in 2-D and batched (one batch stride) products."""
    for lead in ((), (3,)):
        a = _values(lead + ((5, 3) if ta else (3, 5)), BF16, 3)
        b = _values(lead + ((4, 5) if tb else (5, 4)), BF16, 4)
        av = np.swapaxes(_device(a), -1, -2) if ta else _device(a)
        bv = np.swapaxes(_device(b), -1, -2) if tb else _device(b)
        fake = FakeCublas()
        got = cublas_matmul(FAKE_XP, fake, av, bv)
        ref = np.matmul(np.asarray(av).astype(np.float64), np.asarray(bv).astype(np.float64))
        np.testing.assert_array_equal(np.asarray(got), ref)
        assert fake.ops == (int(tb), int(ta))  # cuBLAS's A is our b, its B our a


def test_operands_cublas_cannot_read_are_copied():
    a = _values((4, 3, 5), BF16, 5)
    view = _device(a)[::2, :, ::2]  # no unit stride in either matrix dim: copied first
    b = _values((2, 3, 6), BF16, 6)
    got = cublas_matmul(FAKE_XP, FakeCublas(), _device(b).swapaxes(-1, -2), view)
    np.testing.assert_array_equal(np.asarray(got), np.matmul(b.swapaxes(-1, -2).astype(np.float64),
                                                             a[::2, :, ::2].astype(np.float64)))


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=["bfloat16", "float16"])
def test_accumulates_in_float32(dtype):
    """1 + 256 terms of 2^-9: a 16-bit accumulator would stay at 1; float32 gives 1.5 exactly."""
    a = np.concatenate([[1.0], np.full(256, 2.0 ** -9)]).astype(dtype)[None, :]
    b = np.ones((257, 1), dtype)
    assert widening_matmul(np, a, b).dtype == np.float32
    assert float(widening_matmul(np, a, b)[0, 0]) == 1.5
    jnp = pytest.importorskip("jax.numpy")
    got = widening_matmul(jnp, jnp.asarray(a), jnp.asarray(b))
    assert got.dtype == np.float32 and float(got[0, 0]) == 1.5
