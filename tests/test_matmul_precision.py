"""mm.set_matmul_precision: the setting (validation, round trip, default from CUPY_TF32), and how it
reaches each float32 GEMM path, checked on the host:

- einsum's batched matmuls on CuPy: one cuBLAS GemmStridedBatchedEx whose compute type is
  CUBLAS_COMPUTE_32F_FAST_TF32 at "tf32" and CUBLAS_COMPUTE_32F otherwise (16-bit inputs always the
  latter), against tests/test_gemm.py's host model of cuBLAS, here also checking that cuBLAS takes
  that compute type only for float32 A, B and C (CuPy's own batched matmul ignores TF32);
- einsum's 2-D float32 matmuls on CuPy: the same cuBLAS call;
- CuPy's dot and tensordot: CuPy's compute type for float32, set through a stand-in of
  `cupy._core._routines_linalg`;
- the rest of CuPy's routines (einsum's opt_einsum fallback): the cuBLAS handle's math mode;
- a JAX replay: the dots' precision in the lowered program.
A GPU runs the real calls (tests/run.py --backend cupy, tests/gpu_check.sh).
"""
from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import jaxenv  # noqa: E402,F401  (before jax: host devices, quick compiles)
from test_gemm import BF16, FAKE_XP, FakeCublas, _device, _values  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import backend, gemm  # noqa: E402
from mpimesh.ops.einsum import _matmul_cupy as _matmul  # noqa: E402  (the CuPy kernel's GEMM)

F32, TF32_COMPUTE, F32_COMPUTE = np.dtype(np.float32), 77, 68


@pytest.fixture(name="precision")
def precision_fixture():
    """Sets the precision for one test; the one before is restored afterwards."""
    before = mm.matmul_precision()
    yield mm.set_matmul_precision
    mm.set_matmul_precision(before)


def test_round_trip_and_validation(precision):
    for p in ("tf32", "highest"):
        precision(p)
        assert mm.matmul_precision() == p
    with pytest.raises(mm.MpimeshError, match=r"'float16' is not one of \['highest', 'tf32'\]"):
        precision("float16")
    assert mm.matmul_precision() == "highest"


@pytest.mark.parametrize("value, tf32", [("1", True), ("2", True), ("0", False), ("", False), ("yes", False)])
def test_default_reads_cupy_tf32_as_cupy_does(monkeypatch, value, tf32):
    monkeypatch.setenv("CUPY_TF32", value)
    assert backend._tf32_from_env() is tf32


class ComputeTypes(FakeCublas):
    """The host model of cuBLAS, also taking CUBLAS_COMPUTE_32F_FAST_TF32, which cuBLAS accepts only
    for float32 A, B and C; each call's compute type recorded. Inputs here are exact in TF32, so the
    values are those of CUBLAS_COMPUTE_32F."""

    def __init__(self):
        super().__init__()
        self.computes = []

    def gemmStridedBatchedEx(self, *args):
        *head, compute, algo = args
        a_type, b_type, c_type = args[8], args[12], args[17]
        assert compute in (F32_COMPUTE, TF32_COMPUTE), compute
        assert compute != TF32_COMPUTE or a_type == b_type == c_type == 0, "FAST_TF32 needs float32 A, B and C"
        self.computes.append(compute)
        super().gemmStridedBatchedEx(*head, F32_COMPUTE, algo)

    def gemmEx(self, *args):
        *head, compute, algo = args
        assert compute != TF32_COMPUTE or args[8] == args[11] == args[15] == 0, "FAST_TF32 needs float32 A, B and C"
        self.computes.append(compute)
        super().gemmEx(*head, F32_COMPUTE if compute == TF32_COMPUTE else compute, algo)


def _cupy_like(cublas: ComputeTypes) -> types.ModuleType:
    """test_gemm's fake device arrays under CuPy's name; `matmul` is CuPy's own, the one that must
    not be used for float32 (it ignores TF32 when batched, and cannot be captured in a CUDA graph)."""
    cp = types.ModuleType("cupy")
    cp.ascontiguousarray, cp.empty, cp.cuda = FAKE_XP.ascontiguousarray, FAKE_XP.empty, FAKE_XP.cuda
    cp.matmul = lambda a, b: ("cupy.matmul", np.matmul(a, b))
    return cp


@pytest.mark.parametrize("setting, want", [("tf32", TF32_COMPUTE), ("highest", F32_COMPUTE)])
def test_batched_float32_gemm_compute_type(monkeypatch, precision, setting, want):
    cublas = ComputeTypes()
    monkeypatch.setattr(gemm, "_cublas", lambda xp=None: cublas)
    precision(setting)
    a, b = _values((3, 4, 5), F32, 1), _values((3, 5, 2), F32, 2)
    got = _matmul(_cupy_like(cublas), _device(a), _device(b))
    np.testing.assert_array_equal(np.asarray(got), a.astype(np.float64) @ b.astype(np.float64))
    assert cublas.computes == [want]


def test_16_bit_inputs_stay_float32_sums_and_2d_float32_takes_the_setting(monkeypatch, precision):
    """16-bit inputs are read as they are, into float32 sums, at either precision; a 2-D float32 matmul
    takes cuBLAS's GemmEx (CuPy's own matmul cannot be captured in a CUDA graph), in the setting's
    compute type; CuPy's matmul is not used."""
    cublas = ComputeTypes()
    monkeypatch.setattr(gemm, "_cublas", lambda xp=None: cublas)
    precision("tf32")
    cp = _cupy_like(cublas)
    a, b = _values((2, 3, 4), BF16, 3), _values((2, 4, 5), BF16, 4)
    np.testing.assert_array_equal(np.asarray(gemm.gpu_widening_matmul(cp, _device(a), _device(b))),
                                  a.astype(np.float64) @ b.astype(np.float64))
    assert cublas.computes == [F32_COMPUTE]
    a, b = _values((3, 4), F32, 5), _values((4, 2), F32, 6)
    np.testing.assert_array_equal(np.asarray(_matmul(cp, _device(a), _device(b))), a.astype(np.float64) @ b)
    assert cublas.computes == [F32_COMPUTE, TF32_COMPUTE] and cublas.gemm_ex == 1


def _linalg_stand_in(calls: list) -> types.ModuleType:
    """`cupy._core._routines_linalg`'s compute-type setter and constants (cupy/_core/_routines_linalg.pxd)."""
    linalg = types.ModuleType("cupy._core._routines_linalg")
    linalg.COMPUTE_TYPE_DEFAULT, linalg.COMPUTE_TYPE_TF32 = 1, 7
    linalg.set_compute_type = lambda dtype, compute_type: calls.append((np.dtype(dtype), compute_type))
    return linalg


def test_cupy_compute_type_follows_the_setting(monkeypatch, precision):
    """Set when a mesh first takes CuPy (CuPy would otherwise read CUPY_TF32 itself, once), and on every
    change after that."""
    calls: list = []
    cp = types.ModuleType("cupy")
    cp.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupy._core._routines_linalg", _linalg_stand_in(calls))
    monkeypatch.setitem(backend._matmul, "cupy", False)
    precision("tf32")
    assert calls == []  # no mesh has CuPy yet
    assert backend.array_module("cupy") is cp and calls == [(F32, 7)]
    backend.array_module("cupy")
    precision("highest")
    assert calls == [(F32, 7), (F32, 1)]


class MathModes:
    """cuBLAS's math mode per handle (cublasGetMathMode / cublasSetMathMode)."""

    def __init__(self):
        self.mode, self.seen = 0, []

    def getMathMode(self, handle):
        return self.mode

    def setMathMode(self, handle, mode):
        assert handle == 7
        self.mode = mode
        self.seen.append(mode)


def test_tf32_math_mode_for_cupy_routines(precision):
    modes = MathModes()
    cp = _cupy_like(ComputeTypes())
    precision("tf32")
    with gemm.tf32_math(cp, modes):
        assert modes.mode == 3  # CUBLAS_TF32_TENSOR_OP_MATH
    assert modes.mode == 0 and modes.seen == [3, 0]
    precision("highest")
    with gemm.tf32_math(cp, modes), gemm.tf32_math(np, modes):
        pass
    assert modes.seen == [3, 0]


def test_replay_dots_take_the_precision(precision):
    jax = pytest.importorskip("jax")
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    x = mesh.from_numpy(_values((2, 3, 4), F32, 7), "g:2;s:3;m:4")
    w = mesh.from_numpy(_values((2, 3, 5), F32, 8), "g:2;s:3;e:5")
    with mm.trace() as tr:
        y = mm.einsum([x, w], output_shape="g:2;m:4;e:5")
    replay = mm.tpu.replay(tr, [x, w], [y], devices=jax.devices()[:1])
    args = (x.to_numpy(), w.to_numpy())
    for setting, jax_name in (("tf32", "HIGH"), ("highest", "HIGHEST")):
        precision(setting)
        text = replay.lower(*args).as_text()
        assert f"precision = [{jax_name}, {jax_name}]" in text, text
        np.testing.assert_array_equal(np.asarray(replay(*args)[0]), y.to_numpy())
