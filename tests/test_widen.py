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
        assert handle == 7 and transa == transb == 0 and compute == 68  # CUBLAS_OP_N, CUBLAS_COMPUTE_32F
        assert self.mode == 0, "alpha and beta are host pointers: pointer mode must be host"
        assert lda >= m and ldb >= k and ldc >= m
        self.calls += 1
        al, be = (float(np.ctypeslib.as_array((ctypes.c_float * 1).from_address(p))[0]) for p in (alpha, beta))
        for i in range(batch):
            a = self._matrix(A, _TYPES[Atype], m, k, lda, i * sA)[0].astype(np.float64)
            b = self._matrix(B, _TYPES[Btype], k, n, ldb, i * sB)[0].astype(np.float64)
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


def test_transposed_inputs_are_made_contiguous():
    a, b = _values((5, 3), BF16, 3), _values((4, 5), BF16, 4)
    got = cublas_matmul(FAKE_XP, FakeCublas(), _device(a).T, _device(b).T)  # strided views
    np.testing.assert_array_equal(np.asarray(got), a.T.astype(np.float64) @ b.T.astype(np.float64))


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
