"""Run a CuPy `ElementwiseKernel`'s source on the CPU: the body compiled by the host's C++ compiler
inside a loop over the elements, so that the CUDA sources mpimesh ships are checked against its
numpy lowerings on machines without a GPU.

`raw_module(code, params)` compiles a `RawModule`'s source (its CUDA prelude replaced by `CPU_PRELUDE`:
a warp of one thread) and returns its kernels, each called as CuPy calls one: `f(grid, block, args)`,
every (block, thread) run in turn.

`elementwise(in_params, out_params, body, preamble)` returns `f(*inputs) -> output(s)`, called as a CuPy
`ElementwiseKernel` is: a plain parameter is one element (arrays broadcast to the output's shape,
or to `size=`, as CuPy's where every array is raw), a `raw` parameter the whole array, indexed by
hand; `i` is the element's C-order index; `T` is the
dtype of the arrays given for T parameters, and numbers are cast to their parameter's type; `preamble`
(functions the body calls) follows `CPU_PRELUDE`. Compiled with `-ffp-contract=off`, so a
multiply-add stays two roundings, as numpy does it (nvcc may fuse them: a GPU may differ from this
in the last bit). `compiler()` is None where no C++ compiler is installed (tests then skip).

>>> f = elementwise("T x, T a", "T y", "y = a * x + (T)i;")
>>> f(np.array([1.0, 2.0]), 3.0).tolist()
[3.0, 7.0]
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np

_C_TYPES = {"bool": "bool", "float32": "float", "float64": "double", "int32": "int", "int64": "long long",
            "uint16": "unsigned short", "uint32": "unsigned int", "uint64": "unsigned long long"}
_BUILT: dict = {}


def compiler():
    """The C++ compiler's path, or None."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _params(spec: str) -> list[tuple[bool, str, str]]:
    """`"T x, raw uint64 s"` -> [(raw, type, name), ...]."""
    out = []
    for part in spec.split(","):
        words = part.split()
        raw = words[0] == "raw"
        if raw:
            words = words[1:]
        out.append((raw, words[0], words[1]))
    return out


def elementwise(in_params: str, out_params: str, body: str, preamble: str = ""):
    """The kernel `body` as a Python function (see the module's docstring); `T` is the dtype of the
    arrays given for T parameters (they must agree, as CuPy requires), numbers are cast to it."""
    ins, outs = _params(in_params), _params(out_params)

    def call(*inputs, size=None):
        if len(inputs) != len(ins):
            raise TypeError(f"{len(ins)} inputs expected, got {len(inputs)}")
        given = {np.asarray(x).dtype.name for (_, t, _), x in zip(ins, inputs)
                 if t == "T" and isinstance(x, (np.ndarray, np.generic))}
        typed = any(t == "T" for _, t, _ in ins + outs)
        if typed and len(given) != 1:
            raise TypeError(f"the arrays for T have dtypes {sorted(given)}: CuPy needs exactly one")
        dtype = given.pop() if typed else None
        plain = [np.asarray(x) for (raw, _, _), x in zip(ins, inputs) if not raw]
        shape = (size,) if size is not None else np.broadcast_shapes(*(x.shape for x in plain)) if plain else ()
        arrays = []
        for (raw, t, _), x in zip(ins, inputs):
            dt = np.dtype(dtype if t == "T" else t)
            a = np.asarray(x, dtype=dt) if raw else np.broadcast_to(np.asarray(x, dtype=dt), shape)
            arrays.append(np.ascontiguousarray(a))
        results = [np.zeros(shape, dtype=np.dtype(dtype if t == "T" else t)) for _, t, _ in outs]
        lib = _build(_source(ins, outs, body, dtype, preamble))
        lib.run(ctypes.c_longlong(int(np.prod(shape))),
                *(a.ctypes.data_as(ctypes.c_void_p) for a in arrays + results))
        return tuple(results) if len(results) > 1 else results[0]
    return call


def _source(ins: list, outs: list, body: str, dtype, preamble: str = "") -> str:
    """The C++ of the loop: each element's plain inputs loaded, the body run, the outputs stored
    (`dtype`: T's, None where no parameter is a T)."""
    def ctype(t):
        return _C_TYPES[dtype if t == "T" else t]
    args, loads, decls, stores = ["long long n"], [], [], []
    for raw, t, name in ins:
        args.append(f"const {ctype(t)}* {name}_p")
        loads.append(f"const {ctype(t)}* {name} = {name}_p;" if raw else f"const {ctype(t)} {name} = {name}_p[i];")
    for _, t, name in outs:
        args.append(f"{ctype(t)}* {name}_p")
        decls.append(f"{ctype(t)} {name} = 0;")
        stores.append(f"{name}_p[i] = {name};")
    return (f"{CPU_PRELUDE if preamble else ''}{preamble}#include <cmath>\n#include <cstdint>\nusing namespace std;\n"
            f"{'typedef %s T;' % ctype('T') if dtype else ''}\n"
            f"extern \"C\" void run({', '.join(args)}) {{\n"
            f"  for (long long i = 0; i < n; ++i) {{\n    {' '.join(loads)}\n    {' '.join(decls)}\n"
            f"    {{\n{body}\n    }}\n    {' '.join(stores)}\n  }}\n}}\n")


def _build(source: str):
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    if key not in _BUILT:
        with tempfile.TemporaryDirectory(prefix="mpimesh-cuda-source-") as where:  # (loaded: no file needed)
            path = os.path.join(where, f"k{key}.so")
            proc = subprocess.run([compiler(), "-O1", "-shared", "-fPIC", "-ffp-contract=off", "-x", "c++",
                                   "-", "-o", path], input=source, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"the kernel does not compile:\n{proc.stderr}\n{source}")
            _BUILT[key] = ctypes.CDLL(path)
    return _BUILT[key]


CPU_PRELUDE = """#include <cmath>
#include <cstring>
using namespace std;
#define WARP 1
#define NEG_INF (-INFINITY)
#define __global__
#define __device__
#define __forceinline__ inline
struct Dim { unsigned int x; };
static Dim threadIdx, blockIdx, blockDim;
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
template <typename V> inline V warp_sum(V v) { return v; }
template <typename V> inline V warp_max(V v) { return v; }
"""
_SCALARS = {np.dtype(np.int32): ctypes.c_int, np.dtype(np.int64): ctypes.c_longlong,
            np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def raw_module(code: str, params: dict) -> dict:
    """The kernels `params` names (`{name: "T* x, long long n, ..."}`) of `code` (after `CPU_PRELUDE`),
    each as `f(grid, block, args)`: arrays by their data pointer, numpy scalars by their dtype."""
    launchers = []
    for name, spec in params.items():
        names = [p.split()[-1].lstrip("*") for p in spec.split(",")]
        launchers.append(f'extern "C" void launch_{name}(unsigned int grid, unsigned int block, {spec}) {{\n'
                         f"  blockDim.x = block;\n  for (unsigned int blk_ = 0; blk_ < grid; ++blk_)\n"
                         f"    for (unsigned int thr_ = 0; thr_ < block; ++thr_) {{\n"
                         f"      blockIdx.x = blk_; threadIdx.x = thr_; "
                         f"{name}({', '.join(names)}); }}\n}}\n")
    lib = _build(CPU_PRELUDE + code + "\n".join(launchers))

    def kernel(name):
        def call(grid, block, args):
            values = [a.ctypes.data_as(ctypes.c_void_p) if isinstance(a, np.ndarray)
                      else _SCALARS[np.dtype(type(a))](a) for a in args]
            getattr(lib, f"launch_{name}")(ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]), *values)
        return call
    return {name: kernel(name) for name in params}
