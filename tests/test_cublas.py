"""`mpimesh.cublas` binds the libcublas CuPy's own bindings call, where a process holds two (PyTorch's
beside CuPy's, say): on fake /proc/self/maps lines and symbol addresses, and in a child process
that loads two small libraries compiled here, libcublas.so.12 and libcublas.so.13 (their symbols
versioned, as cuBLAS's are), and a stand-in for CuPy's extension module linked against the second,
in either order (the first libcublas in /proc/self/maps, which the bindings once took, is the wrong one
in one of them). Skipped where no C compiler is installed. (The Bindings' calls: tests/test_gemm.py.)"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
import cuda_source  # noqa: E402

from mpimesh.cublas import _library_path  # noqa: E402

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="no MPI; the 1-rank session runs it")

ROOT = Path(__file__).resolve().parent.parent
MAPS = ["7f10-7f11 r-xp 0 00:1 2 /torch/lib/libcublas.so.12", "7f11-7f12 r--p 0 00:1 2 /torch/lib/libcublas.so.12",
        "7f20-7f21 r-xp 0 00:1 3 /nvidia/cublas/lib/libcublasLt.so.13",
        "7f30-7f31 r-xp 0 00:1 4 /nvidia/cublas/lib/libcublas.so.13", "7f40-7f41 rw-p 0 00:0 0 ",
        "7f50-7f51 r-xp 0 00:1 5 /usr/lib/libcublas_helpers.so"]
AT = {"/torch/lib/libcublas.so.12": 0x7f1000, "/nvidia/cublas/lib/libcublas.so.13": 0x7f3000}


def test_the_library_whose_symbol_cupys_bindings_resolved():
    assert _library_path(MAPS, 0x7f3000, AT.get) == "/nvidia/cublas/lib/libcublas.so.13"
    assert _library_path(MAPS, 0x7f1000, AT.get) == "/torch/lib/libcublas.so.12"
    assert _library_path(MAPS, 0x7f9999, AT.get) is None  # (CuPy's is none of those mapped)


def test_where_cupys_bindings_cannot_tell_only_a_lone_library():
    assert _library_path(MAPS, None, AT.get) is None
    assert _library_path(MAPS[2:], None, AT.get) == "/nvidia/cublas/lib/libcublas.so.13"
    assert _library_path(MAPS[4:], None, AT.get) is None


FAKE_CUBLAS = """
int cublasSetStream_v2(void *handle, void *stream) { return 0; }
int cublasGetPointerMode_v2(void *handle, int *mode) { *mode = %d; return 0; }  /* which library */
int cublasSetPointerMode_v2(void *handle, int mode) { return 0; }
int cublasGemmStridedBatchedEx() { return 0; }
int cublasGemmEx() { return 0; }
"""
FAKE_EXTENSION = """
int cublasGetPointerMode_v2(void *handle, int *mode);
int which_cublas(void) { int mode = -1; cublasGetPointerMode_v2(0, &mode); return mode; }
"""
CHILD = """
import ctypes, importlib.util, sys, types
first, second = sys.argv[1:3]
ctypes.CDLL(first, mode=ctypes.RTLD_GLOBAL)  # (as PyTorch loads its libraries)
ctypes.CDLL(second, mode=ctypes.RTLD_GLOBAL)
spec = importlib.util.spec_from_file_location("mpimesh_cublas", sys.argv[3])
cublas = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cublas)
extension = types.ModuleType("cupy_backends.cuda.libs.cublas")
extension.__file__ = sys.argv[4]
libs = types.ModuleType("cupy_backends.cuda.libs")
libs.cublas = extension
for name, module in [("cupy_backends", types.ModuleType("cupy_backends")),
                     ("cupy_backends.cuda", types.ModuleType("cupy_backends.cuda")),
                     ("cupy_backends.cuda.libs", libs), ("cupy_backends.cuda.libs.cublas", extension)]:
    sys.modules[name] = module
cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0)))
bindings = cublas.capturable(cupy)
print(ctypes.CDLL(sys.argv[4]).which_cublas(), bindings.getPointerMode(0))
"""


def _compile(source: str, out: Path, *args: str) -> None:
    proc = subprocess.run([cuda_source.compiler(), "-x", "c", "-", "-shared", "-fPIC", "-o", str(out), *args],
                          input=source, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(cuda_source.compiler() is None, reason="no C compiler to build the stand-in libraries")
@pytest.mark.parametrize("order", ["cupys first", "cupys second"])
def test_capturable_binds_the_library_cupys_calls_reach(tmp_path, order):
    """Both libraries loaded (RTLD_GLOBAL), the extension after both or between them: the bindings call
    libcublas.so.13, the one the extension's own call reaches (its pointer mode reads 13)."""
    libs = {}
    for version in (12, 13):
        folder = tmp_path / f"v{version}"
        folder.mkdir()
        script = folder / "versions.map"
        script.write_text(f"libcublas.so.{version} {{ global: cublas*; local: *; }};\n")
        libs[version] = folder / f"libcublas.so.{version}"
        _compile(FAKE_CUBLAS % version, libs[version], f"-Wl,-soname,libcublas.so.{version}",
                 f"-Wl,--version-script={script}")
    extension = tmp_path / "v13" / "cublas_extension.so"
    _compile(FAKE_EXTENSION, extension, f"-L{libs[13].parent}", "-l:libcublas.so.13", f"-Wl,-rpath,{libs[13].parent}")
    first, second = (extension, libs[12]) if order == "cupys first" else (libs[12], extension)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(first), str(second),
                           str(ROOT / "mpimesh" / "cublas.py"), str(extension)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["13", "13"], proc.stdout
