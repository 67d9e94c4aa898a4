"""cuBLAS called through ctypes: the few calls `mpimesh.gemm` makes, usable while a CUDA stream
captures a graph (`mpimesh.graphs`), which CuPy's own bindings refuse. The calls go to the
libcublas CuPy's bindings resolved (found in `/proc/self/maps`), on CuPy's handle, bound to the
current stream first. Why and how the library is found: docs/gpu_kernels.md.

>>> maps = ["7f00-7f01 r-xp 0 00:1 2 /t/libcublas.so.12", "7f01-7f02 r-xp 0 00:1 2 /x/libcublasLt.so.13",
...         "7f02-7f03 r-xp 0 00:1 2 /x/libcublas.so.13", "7f03-7f04 r--p 0 00:1 2 /x/libcublas.so.13"]
>>> at = {"/t/libcublas.so.12": 0x7f00a0, "/x/libcublas.so.13": 0x7f02a0}
>>> _library_path(maps, 0x7f02a0, at.get)   # CuPy's bindings resolved it in /x
'/x/libcublas.so.13'
>>> _library_path(maps, None, at.get) is None   # not known where, and two libraries: neither
True
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


_PROBE = "cublasSetStream_v2"  # a symbol of every libcublas, where CuPy's bindings and a candidate are compared


def _address(lib) -> Optional[int]:
    """Where `lib` (a ctypes library) resolves `_PROBE`, or None."""
    try:
        return ctypes.cast(getattr(lib, _PROBE), ctypes.c_void_p).value
    except AttributeError:
        return None


def _loaded(path: str):
    """The ctypes library of `path` if this process has loaded it already (never loading it), or None."""
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
    except OSError:
        return None


def _address_in(path: str) -> Optional[int]:
    """Where the loaded library `path` has `_PROBE`, or None."""
    lib = _loaded(path)
    return None if lib is None else _address(lib)


# A lookup through a library's handle searches it and its dependencies, not the libraries loaded
# RTLD_GLOBAL before it (PyTorch's are) as its own calls may: where two define the same name, the calls
# take the one of the version they were linked against (cuBLAS versions its symbols: libcublas.so.12,
# .13), which is the dependency's.
def _cupy_address() -> Optional[int]:
    """Where CuPy's cuBLAS bindings (the extension module `cupy_backends.cuda.libs.cublas`) resolve
    `_PROBE`: looked up through the module, from its own dependencies on; None where not found."""
    try:
        from cupy_backends.cuda.libs import cublas as bindings
        path = bindings.__file__
    except (ImportError, AttributeError):  # (older CuPy: no such module)
        return None
    return _address_in(path)


def _library_path(maps: Iterable[str], want: Optional[int], address_in: Callable[[str], Optional[int]]
                  ) -> Optional[str]:
    """Among the libcublas mapped into this process (lines of /proc/self/maps), the one whose `_PROBE`
    is at `want` (where CuPy's bindings resolved it; `address_in(path)`: where each library has it); where
    `want` is None, the only one mapped. None where there is no such library."""
    paths = []
    for line in maps:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if os.path.basename(path).startswith("libcublas.so") and path not in paths:
            paths.append(path)
    if want is None:
        return paths[0] if len(paths) == 1 else None
    return next((path for path in paths if address_in(path) == want), None)


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


_found: dict = {}


def capturable(cupy) -> Optional[Bindings]:
    """These bindings over the libcublas CuPy's own bindings call, or None where it cannot be told
    (then CuPy's own bindings are all there is, and a captured GEMM runs on the host)."""
    if "bindings" not in _found:
        path = None
        try:
            with open("/proc/self/maps") as f:
                path = _library_path(f.read().splitlines(), _cupy_address(), _address_in)
        except OSError:
            pass
        lib = None if path is None else _loaded(path)
        try:
            _found["bindings"] = None if lib is None else Bindings(lib, lambda: cupy.cuda.get_current_stream().ptr)
        except AttributeError:  # a function missing
            _found["bindings"] = None
    return _found["bindings"]
