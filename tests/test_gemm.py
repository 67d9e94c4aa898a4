"""mpimesh.gemm: 16-bit matmuls into float32, checked against float64 numpy on the same values.

The CuPy path is one cuBLAS call whose arguments (row-major blocks handed to a column-major
library: swapped operands, leading dimensions, batch strides) are easy to get wrong and run here
without a GPU: `FakeCublas` implements the documented semantics of `cublasGemmStridedBatchedEx`
on host memory (column-major operands read through their pointers, leading dimensions and strides),
independently of the code under test, and the fake "device" arrays are numpy arrays with a
`.data.ptr`. A GPU runs the real call (tests/run.py --backend cupy).
"""
from __future__ import annotations

import ctypes
import sys
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from mpimesh.gemm import (cublas_matmul, gpu_rounding_matmul, jax_widening_matmul, rounding_matmul,
                         widening_matmul)

BF16 = np.dtype(ml_dtypes.bfloat16)
_TYPES = {2: np.dtype(np.float16), 14: BF16, 0: np.dtype(np.float32), 1: np.dtype(np.float64)}  # cudaDataType_t


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
    B_i (k x n) and C_i (m x n), no transposes; alpha and beta read from host pointers as float32
    (compute type CUBLAS_COMPUTE_32F) or float64 (CUBLAS_COMPUTE_64F, float64 operands only)."""

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
        assert handle == 7 and transa in (0, 1) and transb in (0, 1) and compute in (68, 70)  # OP_N/OP_T, 32F/64F
        assert (compute == 70) == (Atype == Btype == Ctype == 1), "float64 operands and only they compute in 64F"
        assert self.mode == 0, "alpha and beta are host pointers: pointer mode must be host"
        # op(A) is m x k: A itself (N, stored m x k, lda >= m) or the transpose of a stored k x m (T, lda >= k)
        assert lda >= (k if transa else m) and ldb >= (n if transb else k) and ldc >= m
        self.calls += 1
        self.ops, self.types = (transa, transb), (Atype, Btype, Ctype)
        scalar = ctypes.c_double if compute == 70 else ctypes.c_float
        al, be = (float(np.ctypeslib.as_array((scalar * 1).from_address(p))[0]) for p in (alpha, beta))
        for i in range(batch):
            a = (self._matrix(A, _TYPES[Atype], k, m, lda, i * sA)[0].T if transa else
                 self._matrix(A, _TYPES[Atype], m, k, lda, i * sA)[0]).astype(np.float64)
            b = (self._matrix(B, _TYPES[Btype], n, k, ldb, i * sB)[0].T if transb else
                 self._matrix(B, _TYPES[Btype], k, n, ldb, i * sB)[0]).astype(np.float64)
            c, flat, off = self._matrix(C, _TYPES[Ctype], m, n, ldc, i * sC)
            value = al * (a @ b) + (be * c.astype(np.float64) if be else 0.0)  # beta 0: C is never read
            flat[off + np.arange(m)[:, None] + ldc * np.arange(n)[None, :]] = value

    def gemmEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
               compute, algo):
        """`cublasGemmEx`: the one product of `gemmStridedBatchedEx` (a batch of 1, no strides)."""
        self.gemm_ex = getattr(self, "gemm_ex", 0) + 1
        FakeCublas.gemmStridedBatchedEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb,
                                        0, beta, C, Ctype, ldc, 0, 1, compute, algo)


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
    called = got.size and a.shape[-1]
    assert fake.mode == 1 and fake.calls == (1 if called else 0)
    # one product (2-D, or a batch of 1) takes the plain GemmEx, as PyTorch's 2-D matmul does
    assert getattr(fake, "gemm_ex", 0) == (1 if called and np.prod(a.shape[:-2]) == 1 else 0)


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


def test_float64_products_stay_float64_and_write_into_out():
    """float64 blocks (an einsum on CuPy in float64) take the same call with CUBLAS_COMPUTE_64F and
    float64 alpha and beta; `out` (a bucketed gradient's slot) is written, not a new array."""
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 5, 2))
    fake = FakeCublas()
    got = cublas_matmul(FAKE_XP, fake, _device(a), _device(b), compute=70)
    assert got.dtype == np.float64 and fake.calls == 1
    np.testing.assert_allclose(np.asarray(got), a @ b, rtol=1e-14)
    out = _device(np.full((3, 4, 2), np.nan))
    assert cublas_matmul(FAKE_XP, fake, _device(a), _device(b), compute=70, out=out) is out
    np.testing.assert_allclose(np.asarray(out), a @ b, rtol=1e-14)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=["bfloat16", "float16"])
def test_a_16bit_result_is_rounded_by_the_gemm(monkeypatch, dtype):
    """`gpu_rounding_matmul`: one GEMM whose C is the 16-bit dtype (cuBLAS rounds the float32
    sums as it stores them: no float32 product, no cast pass), into `out` where given; each entry
    1 + 256·2^-9 summed in float32 (1.5) and rounded once; where the shapes do not fit one call
    (a broadcast batch), the widening product rounded."""
    from mpimesh import gemm
    fake = FakeCublas()
    monkeypatch.setattr(gemm, "_cublas", lambda xp=None: fake)
    a = _device(np.tile(np.array([1.0] + [2.0 ** -9] * 256, dtype), (2, 3, 1)))  # [2, 3, 257]
    b = _device(np.ones((2, 257, 4), dtype))
    got = gpu_rounding_matmul(FAKE_XP, a, b)
    assert fake.calls == 1 and fake.types == (_CODE[dtype],) * 3 and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got).astype(np.float64), np.full((2, 3, 4), 1.5))
    out = _device(np.full((2, 3, 4), np.nan, dtype))
    assert gpu_rounding_matmul(FAKE_XP, a, b, out) is out and fake.calls == 2
    np.testing.assert_array_equal(np.asarray(out).astype(np.float64), np.full((2, 3, 4), 1.5))
    monkeypatch.setattr(FAKE_XP, "matmul", np.matmul, raising=False)
    wide = gpu_rounding_matmul(FAKE_XP, a[:1], b)  # (batch 1 against 2: not one strided call)
    assert fake.calls == 2 and wide.dtype == dtype and wide.shape == (2, 3, 4)
    np.testing.assert_array_equal(np.asarray(wide).astype(np.float64), np.full((2, 3, 4), 1.5))


_CODE = {BF16: 14, np.dtype(np.float16): 2}  # CUDA_R_16BF, CUDA_R_16F


def _odd_stride(x: np.ndarray, axis: int) -> np.ndarray:
    """`x` (of size 1 along `axis`) with a stride along `axis` that no other dim explains, as a slice may leave."""
    strides = list(x.strides)
    strides[axis] = 7 * x.nbytes + x.itemsize
    return np.lib.stride_tricks.as_strided(x, x.shape, strides, subok=True)


@pytest.mark.parametrize("base, view, how", [
    ((2, 3, 5), lambda x: x[:, None], (False, 5, 15)),  # a new axis: stride 0
    ((2, 1, 3, 5), lambda x: _odd_stride(x, 1), (False, 5, 15)),
    ((1, 2, 3, 5), lambda x: _odd_stride(x, 0), (False, 5, 15)),
    ((2, 1, 5, 3), lambda x: _odd_stride(x, 1).swapaxes(-1, -2), (True, 3, 15)),
    ((1, 1, 3, 5), lambda x: _odd_stride(_odd_stride(x, 0), 1), (False, 5, 0)),
], ids=["new-axis", "inner", "outer", "transposed", "all-ones"])
def test_size_1_batch_dims_take_no_step(base, view, how):
    """A batch dim of size 1 may have any stride: it takes no step, so it merges with the others and
    cuBLAS reads the operand in place (issue 44: such an operand got no plan, `ascontiguousarray` handed
    it back as it was, being contiguous, and the plan's unpack raised TypeError). The plan of numpy
    arrays; the product on the host model of cuBLAS, against numpy."""
    from mpimesh.gemm import _gemm_operand
    assert _gemm_operand(view(np.zeros(base))) == how
    a = view(_device(_values(base, BF16, 10)))
    b = _device(_values(a.shape[:-2] + (a.shape[-1], 4), BF16, 11))
    fake = FakeCublas()
    got = cublas_matmul(FAKE_XP, fake, a, b)
    assert fake.calls == 1
    np.testing.assert_array_equal(np.asarray(got), np.matmul(np.asarray(a).astype(np.float64), b.astype(np.float64)))


def test_capturing_stream_takes_the_ctypes_bindings(monkeypatch):
    """While the current stream captures a CUDA graph, GEMMs go through `mpimesh.cublas` (CuPy's
    bindings refuse every cuBLAS call then); otherwise through CuPy's."""
    from mpimesh import gemm
    sentinel = object()
    monkeypatch.setattr(gemm, "capturable", lambda cupy: sentinel)
    capturing = [True]
    stream = SimpleNamespace(is_capturing=lambda: capturing[0])
    xp = SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: stream))
    assert gemm._cublas(xp) is sentinel
    capturing[0] = False
    cupys = SimpleNamespace(cublas=object())  # CuPy's bindings, where no CuPy is installed
    for module in ("cupy_backends", "cupy_backends.cuda", "cupy_backends.cuda.libs"):
        monkeypatch.setitem(sys.modules, module, cupys)
    assert gemm._cublas(xp) is cupys.cublas


class _FakeFunction:
    """A ctypes function of a fake libcublas: records its calls, returns `status`."""

    def __init__(self, name, log, status=0, value=None):
        self.name, self.log, self.status, self.value = name, log, status, value

    def __call__(self, *args):
        self.log.append((self.name, args))
        if self.value is not None:  # an output parameter, passed by reference
            args[-1]._obj.value = self.value
        return self.status


def test_ctypes_bindings_bind_the_stream_then_call_and_check_status():
    from mpimesh.cublas import Bindings, CublasCallError
    log = []
    lib = SimpleNamespace(cublasSetStream_v2=_FakeFunction("stream", log),
                          cublasGetPointerMode_v2=_FakeFunction("get", log, value=1),
                          cublasSetPointerMode_v2=_FakeFunction("set", log),
                          cublasGemmStridedBatchedEx=_FakeFunction("gemm", log),
                          cublasGemmEx=_FakeFunction("gemm1", log))
    cublas = Bindings(lib, stream=lambda: 1234)
    gemm_args = lib.cublasGemmStridedBatchedEx.argtypes  # 23; the batch strides are long long
    assert len(gemm_args) == 23 and [i for i, t in enumerate(gemm_args) if t is ctypes.c_longlong] == [10, 14, 19]
    one_args = lib.cublasGemmEx.argtypes  # 19: pointers at alpha, A, B, beta, C
    assert len(one_args) == 19 and [i for i, t in enumerate(one_args) if t is ctypes.c_void_p] == [0, 6, 7, 10, 13, 14]
    assert cublas.getPointerMode(7) == 1
    cublas.setPointerMode(7, 0)
    cublas.gemmStridedBatchedEx(7, *range(22))
    assert [n for n, _ in log] == ["get", "set", "stream", "gemm"] and log[2][1] == (7, 1234)
    assert log[3][1] == (7, *range(22))
    cublas.gemmEx(7, *range(18))
    assert [n for n, _ in log[4:]] == ["stream", "gemm1"] and log[5][1] == (7, *range(18))
    lib.cublasGemmStridedBatchedEx.status = 7
    with pytest.raises(CublasCallError, match="cublasGemmStridedBatchedEx returned cuBLAS status 7"):
        cublas.gemmStridedBatchedEx(7, *range(22))


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=["bfloat16", "float16"])
def test_accumulates_in_float32(dtype):
    """1 + 256 terms of 2^-9: a 16-bit accumulator would stay at 1; float32 gives 1.5 exactly."""
    a = np.concatenate([[1.0], np.full(256, 2.0 ** -9)]).astype(dtype)[None, :]
    b = np.ones((257, 1), dtype)
    assert widening_matmul(np, a, b).dtype == np.float32
    assert float(widening_matmul(np, a, b)[0, 0]) == 1.5
    jnp = pytest.importorskip("jax.numpy")
    got = jax_widening_matmul(jnp, jnp.asarray(a), jnp.asarray(b))
    assert got.dtype == np.float32 and float(got[0, 0]) == 1.5
    got = rounding_matmul(jnp, jnp.asarray(a), jnp.asarray(b), widening=jax_widening_matmul)  # rounded once
    assert got.dtype == dtype and float(got[0, 0]) == 1.5


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "bfloat16 rounded"])
def test_gemm_captured_in_a_cuda_graph_equals_eager(dtype):
    """On a GPU: einsum's GEMM captured in a CUDA graph (CuPy's own cuBLAS calls refuse capture),
    launched into a poisoned output, writes what the same call writes eagerly, bit for bit; a
    16-bit C ("rounded", `gpu_rounding_matmul`) is the float32 product rounded to the nearest (within
    one bfloat16 step of the cast CuPy makes)."""
    from mpimesh.backend import device_count
    if device_count() == 0:
        pytest.skip("needs CuPy and a GPU")
    import cupy
    from mpimesh.gemm import gpu_matmul
    rounded = dtype.endswith("rounded")
    matmul = gpu_rounding_matmul if rounded else gpu_matmul
    rng = np.random.default_rng(3)
    kind = BF16 if dtype.startswith("bfloat16") else np.dtype(dtype)
    for lead in ((3,), ()):  # a batch (GemmStridedBatchedEx) and one product (GemmEx)
        a, b = (cupy.asarray(rng.standard_normal(lead + s).astype(kind)) for s in ((64, 32), (32, 48)))
        _captured_equals_eager(cupy, matmul, a, b, dtype, rounded)


def _captured_equals_eager(cupy, matmul, a, b, dtype: str, rounded: bool) -> None:
    """`matmul(cupy, a, b)` captured in a CUDA graph and launched writes what it writes eagerly."""
    from mpimesh.gemm import gpu_matmul
    want = matmul(cupy, a, b)
    assert want.dtype == (BF16 if rounded else np.float64 if dtype == "float64" else np.float32)
    if rounded:
        np.testing.assert_allclose(want.get().astype(np.float64), gpu_matmul(cupy, a, b).get(), rtol=2.0 ** -8)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = cupy.empty_like(want)
        stream.begin_capture()
        matmul(cupy, a, b, out)
        graph = stream.end_capture()
        out[...] = cupy.full(out.shape, np.nan, np.float32).astype(out.dtype)  # (poisoned: the launch writes it)
        graph.launch(stream=stream)
        stream.synchronize()
    assert out.dtype == want.dtype and out.tobytes() == want.tobytes()
    np.testing.assert_allclose(out.get().astype(np.float64),
                               np.matmul(a.get().astype(np.float64), b.get().astype(np.float64)),
                               rtol=1e-2 if dtype != "float64" else 1e-12, atol=1e-2 if dtype != "float64" else 1e-12)
