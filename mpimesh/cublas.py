"""cuBLAS called through ctypes: the few calls `mpimesh.widen` makes, usable while a CUDA stream
captures a graph (`mpimesh.graphs`).

CuPy's bindings refuse every cuBLAS call during stream capture ("calling cuBLAS API during stream
capture is currently unsupported"), though cuBLAS itself supports capture (its documentation's
"CUDA Graphs Support": a GEMM whose alpha and beta are read from host memory is captured with
their values). These bindings make the same calls on the same handle: the library is the one CuPy
loaded (found in `/proc/self/maps`), so CuPy's handles are valid here; each GEMM first binds the
handle to the current stream, as CuPy's own bindings do. Their method names are CuPy's.

>>> maps = ["7f00-7f01 r-xp 0 00:1 2 /x/libcublasLt.so.13", "7f01-7f02 r-xp 0 00:1 2 /x/libcublas.so.13"]
>>> _library_path(maps)
'/x/libcublas.so.13'
"""
from __future__ import annotations

import ctypes
import os
from typing import Callable, Iterable, Optional

_I, _P, _LL = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong
_SIGNATURES = {
    "cublasSetStream_v2": [_P, _P],
    "cublasGetPointerMode_v2": [_P, ctypes.POINTER(_I)],
    "cublasSetPointerMode_v2": [_P, _I],
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta,
    # C, Ctype, ldc, strideC, batchCount, computeType, algo
    "cublasGemmStridedBatchedEx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _LL, _P, _I, _I, _LL, _P,
                                   _P, _I, _I, _LL, _I, _I, _I],
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
    # computeType, algo
    "cublasGemmEx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I],
}


class CublasCallError(RuntimeError):
    """A cuBLAS call through these bindings returned an error status."""


def _library_path(maps: Iterable[str]) -> Optional[str]:
    """The path of the libcublas mapped into this process (lines of /proc/self/maps), or None."""
    for line in maps:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if os.path.basename(path).startswith("libcublas.so"):
            return path
    return None


class Bindings:
    """`getPointerMode`, `setPointerMode`, `gemmEx` and `gemmStridedBatchedEx` on `lib` (a ctypes
    library of cuBLAS), the GEMMs on the stream `stream()` returns (a pointer)."""

    def __init__(self, lib, stream: Callable[[], int]):
        self.stream = stream
        self.fns = {}
        for fn, args in _SIGNATURES.items():
            try:
                f = getattr(lib, fn)
            except AttributeError:  # a library that exports the name without its "_v2"
                f = getattr(lib, fn.replace("_v2", ""))
            f.argtypes, f.restype = args, _I
            self.fns[fn] = f

    def _call(self, fn: str, *args) -> None:
        status = self.fns[fn](*args)
        if status != 0:
            raise CublasCallError(f"{fn} returned cuBLAS status {status}")

    def getPointerMode(self, handle: int) -> int:
        mode = _I(0)
        self._call("cublasGetPointerMode_v2", handle, ctypes.byref(mode))
        return mode.value

    def setPointerMode(self, handle: int, mode: int) -> None:
        self._call("cublasSetPointerMode_v2", handle, mode)

    def gemmStridedBatchedEx(self, handle: int, *args) -> None:
        self._call("cublasSetStream_v2", handle, self.stream())
        self._call("cublasGemmStridedBatchedEx", handle, *args)

    def gemmEx(self, handle: int, *args) -> None:
        self._call("cublasSetStream_v2", handle, self.stream())
        self._call("cublasGemmEx", handle, *args)


_loaded: dict = {}


def capturable(cupy) -> Optional[Bindings]:
    """These bindings over the libcublas CuPy loaded, or None where it cannot be found (then CuPy's
    own bindings are all there is, and a captured GEMM runs on the host)."""
    if "bindings" not in _loaded:
        path = None
        try:
            with open("/proc/self/maps") as f:
                path = _library_path(f)
        except OSError:
            pass
        try:
            _loaded["bindings"] = None if path is None else \
                Bindings(ctypes.CDLL(path), lambda: cupy.cuda.get_current_stream().ptr)
        except (OSError, AttributeError):  # not loadable, or a function missing
            _loaded["bindings"] = None
    return _loaded["bindings"]
