"""The array module in use: numpy on CPU, cupy on GPU. Only this module knows which.

`name(xp)` says which module a kernel runs on (also "jax" under a replay); `to_host`/`to_device`
move arrays and count each copy in the profile (`"d2h"`, `"h2d"`). The dtype policy lives here too
(`is_float`, `accumulation_dtype`, `wire_dtype`, `result_type`), and the precision of float32
contractions on a GPU (`set_matmul_precision`); see docs/dtypes.md.

>>> array_module("numpy").__name__, name(np), resolve_backend("numpy")
('numpy', 'numpy', 'numpy')
>>> is_float("bfloat16"), accumulation_dtype("bfloat16"), wire_dtype("bfloat16"), is_low_precision("float32")
(True, dtype('float32'), dtype('uint16'), False)
>>> result_type("bfloat16", "int32"), result_type("int32", "float32"), result_type("bfloat16", "float16")
(dtype(bfloat16), dtype('float32'), dtype('float32'))
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
from functools import lru_cache
from types import ModuleType
from typing import Any, Callable, Hashable, Optional

import ml_dtypes
import numpy as np

from . import env
from . import counters, flight
from .errors import DTypeError, MpimeshError
from .promotion import BFLOAT16, result_type  # noqa: F401  (the dtype policy's promotion, here with the rest)

BACKENDS = ("numpy", "cupy")
_GPU_HINT = ("run `python3 install.py gpu` in the mpimesh checkout (cupy-cuda12x; `gpu-cuda13` for "
             "CUDA 13), on a machine with an NVIDIA GPU and its driver")


def resolve_backend(backend: Optional[str]) -> str:
    """`backend`, or `$MPIMESH_BACKEND` when it is None, else "numpy"; checked against `BACKENDS`."""
    if backend is None:
        return env.choice("MPIMESH_BACKEND", "numpy", BACKENDS, what="backend")
    if backend not in BACKENDS:
        raise MpimeshError(f"unknown backend {backend!r}: choose one of {list(BACKENDS)}")
    return backend


@lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed host memory for reuse instead of handing it back to the OS
    (once per process; `MPIMESH_KEEP_MEMORY=0`, or off, opts out). A training step frees and allocates the
    same large arrays every step; by default glibc serves them with fresh mmaps and trims the heap,
    so every step page-faults (and zero-fills) memory it just had, which can cost as much as the
    arithmetic. With it, arrays up to 32 MiB come from the heap and up to 1 GiB of free heap stays
    mapped (resident memory stays at its peak, as with a caching allocator).
    Returns whether it took effect (False without glibc's `mallopt`).

    >>> isinstance(keep_freed_memory(), bool)
    True
    """
    if not env.flag("MPIMESH_KEEP_MEMORY", True):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def array_module(backend: str) -> ModuleType:
    """The array module for `backend` ("numpy" or "cupy"); cupy only where a GPU can be used."""
    backend = resolve_backend(backend)
    if backend == "numpy":
        keep_freed_memory()
        return np
    try:
        cp = importlib.import_module("cupy")
    except ImportError as e:
        raise MpimeshError(f"backend 'cupy' needs CuPy, which is not installed ({e}): {_GPU_HINT}") from None
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # cupy's CUDARuntimeError: no driver, or no device visible
        raise MpimeshError(f"backend 'cupy' found no usable GPU ({type(e).__name__}: {e}): {_GPU_HINT}") from None
    if count < 1:
        raise MpimeshError(f"backend 'cupy' found no GPU (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}): {_GPU_HINT}")
    if not _matmul["cupy"]:  # from the first mesh on, CuPy's own GEMMs follow set_matmul_precision
        _matmul["cupy"] = True
        _cupy_compute_type(_matmul["precision"])
    return cp


MATMUL_PRECISIONS = ("highest", "tf32")


def _tf32_from_env() -> bool:
    """CuPy's reading of CUPY_TF32: TF32 for float32 where it is a positive integer."""
    try:
        return int(os.environ.get("CUPY_TF32", "0")) > 0
    except ValueError:
        return False


_matmul = {"precision": "tf32" if _tf32_from_env() else "highest", "cupy": False}  # cupy: a mesh has it


def set_matmul_precision(precision: str) -> None:
    """Run float32 contractions on a GPU in full float32 (`"highest"`) or on TF32 tensor cores (`"tf32"`:
    inputs rounded to 10 mantissa bits, float32 sums). The default is `"tf32"` where `CUPY_TF32` is a
    positive integer, else `"highest"`. It reaches every float32 GEMM on CuPy (dot, tensordot, matmul,
    einsum's) and a JAX replay's matmul precision; 16-bit inputs and numpy are unaffected. Details:
    docs/dtypes.md.

    >>> import mpimesh as mm
    >>> before = mm.matmul_precision()
    >>> mm.set_matmul_precision("tf32")
    >>> mm.matmul_precision()
    'tf32'
    >>> mm.set_matmul_precision(before)
    """
    if precision not in MATMUL_PRECISIONS:
        raise MpimeshError(f"matmul precision {precision!r} is not one of {list(MATMUL_PRECISIONS)}")
    _matmul["precision"] = precision
    if _matmul["cupy"]:
        _cupy_compute_type(precision)


def matmul_precision() -> str:
    """The precision of float32 contractions on a GPU: "highest" or "tf32" (`set_matmul_precision`)."""
    return _matmul["precision"]


def _cupy_compute_type(precision: str) -> None:
    """CuPy's compute type for float32 GEMMs (which it otherwise takes from CUPY_TF32, once)."""
    linalg = importlib.import_module("cupy._core._routines_linalg")
    linalg.set_compute_type(_FLOAT32, linalg.COMPUTE_TYPE_TF32 if precision == "tf32" else linalg.COMPUTE_TYPE_DEFAULT)


def name(xp) -> str:
    """"numpy", "cupy" or "jax": which array module a kernel was handed."""
    mod = getattr(xp, "__name__", "")
    return "jax" if mod.startswith("jax") else mod.split(".")[0]


def is_eager(xp) -> bool:
    """Whether arrays of `xp` have concrete values (numpy, cupy), not traced ones (jax)."""
    return name(xp) in BACKENDS


def on_host(xp) -> bool:
    """Whether `xp` keeps its arrays in host memory (numpy), where the host may read and pool them.

    >>> on_host(np), on_gpu(np)
    (True, False)
    """
    return name(xp) == "numpy"


def on_gpu(xp) -> bool:
    """Whether `xp` keeps its arrays in GPU memory (CuPy: its kernels, streams and memory pool)."""
    return name(xp) == "cupy"


def synchronize(xp) -> None:
    """Wait until the work queued so far on `xp`'s GPU is done (CuPy's default stream); on the host
    there is nothing to wait for. For timings."""
    if on_gpu(xp):
        xp.cuda.Stream.null.synchronize()


def free_memory(xp) -> Optional[float]:
    """The free bytes of `xp`'s current GPU, or None where its arrays are in host memory."""
    return float(xp.cuda.runtime.memGetInfo()[0]) if on_gpu(xp) else None


def device_name(xp, device: Optional[int]) -> str:
    """The name of GPU `device` for `xp` (CuPy), "" where its arrays are in host memory."""
    if not on_gpu(xp):
        return ""
    return xp.cuda.runtime.getDeviceProperties(device)["name"].decode(errors="replace")


def pinned_empty(nbytes: int):
    """A uint8 host buffer of `nbytes` in page-locked memory (CuPy's), which GPU copies reach directly."""
    return importlib.import_module("cupyx").empty_pinned((nbytes,), np.uint8)


_kernels: dict = {}  # the compiled GPU kernels, by key (`cached_kernel`)
_UNBUILT = object()


def cached_kernel(key: Hashable, build: Callable[[], Any]) -> Any:
    """The kernel cached under `key`, made by `build()` on first use (CuPy compiles it for a device
    when it first launches there). `key` names the kernel's module and variant, e.g. `("rowwise",
    "sum_exp")`; what `build` returns is kept, None too (a kernel the GPU's compiler refused).

    >>> cached_kernel(("doc", "twice"), lambda: lambda a: 2 * a)(21), cached_kernel(("doc", "twice"), None)(1)
    (42, 2)
    >>> del _kernels["doc", "twice"]
    """
    kernel = _kernels.get(key, _UNBUILT)
    if kernel is _UNBUILT:
        kernel = _kernels[key] = build()
    return kernel


def device_count() -> int:
    """GPUs visible to this process (0 without CuPy or a driver)."""
    try:
        return int(importlib.import_module("cupy").cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def use_device(index: int) -> None:
    """Make GPU `index` current for this process's CuPy work."""
    importlib.import_module("cupy").cuda.Device(index).use()


_pool_caps: dict = {}  # device index -> the cap this module put on its CuPy pool


def cap_gpu_pool(device: int, sharing: int) -> Optional[int]:
    """Cap this process's CuPy memory pool on GPU `device` at `MPIMESH_GPU_MEMORY_FRACTION` (default
    0.9) of the GPU's memory, split evenly among the `sharing` ranks that drive it (the mesh counts
    them). Past the cap CuPy frees the pool's cached blocks before it asks CUDA for more (and only
    then raises OutOfMemoryError), so a long job's cache cannot crowd out a rank sharing its GPU.
    A cap the user set (`pool.set_limit`) is kept, and so is the first cap of each device; `0` or
    `off`: no cap. Returns the cap in bytes, None for none."""
    fraction = env.number("MPIMESH_GPU_MEMORY_FRACTION", 0.9, minimum=0.0, maximum=1.0,
                          words={"off": 0.0, "none": 0.0},
                          what="a fraction in [0, 1] of the GPU's memory, 0 for no cap")
    if device in _pool_caps or fraction == 0.0:
        return _pool_caps.get(device)
    cp = importlib.import_module("cupy")
    pool = cp.get_default_memory_pool()
    with cp.cuda.Device(device):  # the pool's limit and the memory are the current device's
        if pool.get_limit():
            return int(pool.get_limit())  # the user's own
        _, total = cp.cuda.runtime.memGetInfo()
        cap = _pool_caps[device] = int(total * fraction / max(1, sharing))
        pool.set_limit(size=cap)
    return cap


def to_host(array) -> np.ndarray:
    """A numpy copy-or-view of an array of any backend (a GPU array's copy counts as `"d2h"`)."""
    if isinstance(array, np.ndarray):
        return array
    get = getattr(array, "get", None)  # cupy
    if get is None:
        return np.asarray(array)
    counters.record("d2h", (), array.size, array.nbytes)
    if not flight.timeline:
        return get()
    t0, out = flight.clock(), get()
    flight.span(t0, "d2h", "copy", {"bytes": int(array.nbytes)})
    return out


def to_device(xp, array):
    """`array` as an array of `xp`; a host array sent to a GPU counts as `"h2d"`."""
    if name(xp) == "cupy" and isinstance(array, np.ndarray):
        counters.record("h2d", (), array.size, array.nbytes)
        if flight.timeline:
            t0, out = flight.clock(), xp.asarray(array)
            flight.span(t0, "h2d", "copy", {"bytes": int(array.nbytes)})
            return out
    return xp.asarray(array)


def index_constant(xp, values: tuple, dtype="int64"):
    """A small constant array of `values` on `xp`'s device, made once per device and kept (a kernel's
    index terms: a host copy inside a CUDA-graph capture would be captured reading a pinned staging
    buffer that CuPy reuses, or would split the graph). On numpy, a fresh array.

    >>> index_constant(np, (0, 3, 5)).tolist()
    [0, 3, 5]
    """
    if name(xp) != "cupy":
        return np.asarray(values, dtype)
    return _device_constant(xp, int(xp.cuda.runtime.getDevice()), tuple(int(v) for v in values), np.dtype(dtype).str)


@lru_cache(maxsize=1024)
def _device_constant(xp, device: int, values: tuple, dtype: str):
    return to_device(xp, np.asarray(values, dtype))  # (read only: shared by every caller)


_KINDS = "biufc"  # bool, signed and unsigned integers, floats, complex: what the collectives can move
_LOW = (np.dtype(np.float16), BFLOAT16)  # the 16-bit floats: computed and summed in float32
_FLOAT32 = np.dtype(np.float32)


def is_float(dtype) -> bool:
    """Whether `dtype` is a real floating-point dtype: numpy's floats and bfloat16 (kind 'V', not
    `np.floating`); what decides whether an op's output is differentiable.

    >>> is_float("float16"), is_float(np.int32), is_float("complex64")
    (True, False, False)
    """
    dt = np.dtype(dtype)
    return dt.kind == "f" or dt == BFLOAT16


def is_low_precision(dtype) -> bool:
    """Whether `dtype` is a 16-bit float (float16, bfloat16)."""
    return np.dtype(dtype) in _LOW


def accumulation_dtype(dtype) -> np.dtype:
    """The dtype sums and contractions of `dtype` are computed in: float32 for the 16-bit floats,
    `dtype` itself otherwise."""
    dt = np.dtype(dtype)
    return _FLOAT32 if dt in _LOW else dt


def wire_dtype(dtype) -> np.dtype:
    """The dtype MPI moves `dtype`'s words as: uint16 for the 16-bit floats (mpi4py cannot export
    bfloat16, nor float16 under Open MPI, which has no MPI type for it; a transfer that only moves
    data is exact on the raw words), `dtype` itself otherwise."""
    dt = np.dtype(dtype)
    return np.dtype(np.uint16) if dt in _LOW else dt


def finfo(dtype):
    """`numpy.finfo` of a float dtype, bfloat16 included."""
    return ml_dtypes.finfo(dtype) if np.dtype(dtype) == BFLOAT16 else np.finfo(dtype)


def check_dtype(dt: np.dtype, what: str = "dtype") -> np.dtype:
    """`dt` if tensors may have it (bool, integer, float, bfloat16 or complex), else a `DTypeError`
    naming `what` and the dtype."""
    if dt == BFLOAT16:
        return dt
    if dt.kind not in _KINDS or dt.fields is not None or dt.subdtype is not None:
        raise DTypeError(f"{what} is {dt!s}, which tensors cannot hold: they hold bool, integer, float "
                         f"(bfloat16 included) or complex values (e.g. 'float32', 'bfloat16', 'int32', 'bool')")
    return dt


def as_dtype(dtype) -> np.dtype:
    """Normalise a dtype spec (`"float32"`, `np.float32`, `"bfloat16"`, ...) to a numpy dtype in native
    byte order; a `DTypeError` (an MpimeshError) for anything else, None included, or a dtype tensors
    cannot hold.

    >>> as_dtype("float32"), as_dtype(np.int64), as_dtype(">i2"), as_dtype("bfloat16")
    (dtype('float32'), dtype('int64'), dtype('int16'), dtype(bfloat16))
    """
    if dtype is None:
        raise DTypeError("dtype None: give a dtype such as 'float32'")
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError) as e:  # SyntaxError: numpy's parser of comma strings
        raise DTypeError(f"cannot read {dtype!r} as a dtype ({e}): give a dtype such as 'float32'") from None
    return check_dtype(dt, f"dtype {dtype!r}").newbyteorder("=")  # '>i2' is int16: kernels compute natively


def contiguous(xp, a):
    """`a` itself where it is C-contiguous (a 0-d array always is: `ascontiguousarray` would make it
    1-d) or has no strides (a JAX array), else a C-contiguous copy of it (`xp.ascontiguousarray`).

    >>> a = np.zeros((3, 2))
    >>> contiguous(np, a) is a, contiguous(np, a.T).flags.c_contiguous, contiguous(np, np.array(1.0)).shape
    (True, True, ())
    """
    flags = getattr(a, "flags", None)
    return a if flags is None or flags.c_contiguous else xp.ascontiguousarray(a)


@lru_cache(maxsize=4096)
def _alignment(dims: tuple, out_dims: tuple) -> tuple:
    """Axis permutation of an input with `dims`, and which output axes it has."""
    perm = tuple(dims.index(n) for n in out_dims if n in dims)
    return (None if perm == tuple(range(len(perm))) else perm), tuple(n in dims for n in out_dims)


def align(xp, a, dims: tuple, out_dims: tuple):
    """View local array `a` (axes named `dims`) so that it broadcasts against axes `out_dims`
    (a kernel helper: `dims` is a subset of `out_dims`, in any order).

    >>> align(np, np.zeros((2, 3)), ("b", "a"), ("a", "c", "b")).shape
    (3, 1, 2)
    """
    perm, present = _alignment(dims, out_dims)
    if perm is not None:
        a = xp.transpose(a, perm)
    if all(present):
        return a
    it = iter(a.shape)
    return a.reshape(tuple(next(it) if p else 1 for p in present))
