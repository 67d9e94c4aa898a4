"""A feature whose optional package is missing says, in one line, which extra installs it (jax for
mm.tpu, cupy for backend="cupy", matplotlib for the scaling plots), instead of a bare
ModuleNotFoundError. The packages are hidden from a child interpreter by a meta-path blocker."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mpi4py import MPI

from mpimesh.launch import job_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts processes of its own")

BLOCK = """
import sys
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, _Hide())
"""


def _python(hidden: set, body: str, *args: str) -> subprocess.CompletedProcess:
    code = BLOCK.format(hidden=sorted(hidden)) + textwrap.dedent(body)
    env = job_env(PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):  # else benchmarks/common.py re-executes, unhidden
        env.pop(var, None)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


def test_tpu_replay_without_jax_names_the_extra():
    proc = _python({"jax", "jaxlib"}, """
        import numpy as np, mpimesh as mm
        mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
        x = mesh.ones("a:2")
        with mm.trace() as tr:
            y = mm.exp(x)
        try:
            mm.tpu.replay(tr, [x], [y])
        except ImportError as e:
            assert isinstance(e, mm.MpimeshError)
            print("ERROR:", e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "mm.tpu.replay needs jax, which is not installed: run `python3 install.py tpu`" in proc.stdout


def test_cupy_backend_without_cupy_names_the_extra():
    proc = _python({"cupy"}, """
        import mpimesh as mm
        try:
            mm.Mesh("all:1", comm=mm.MPI.COMM_SELF, backend="cupy")
        except mm.MpimeshError as e:
            print("ERROR:", e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "backend 'cupy' needs CuPy" in proc.stdout and "install.py gpu" in proc.stdout


def test_scaling_benchmark_without_matplotlib_says_so_before_running():
    proc = _python({"matplotlib"}, """
        import runpy, sys
        sys.argv = ["scaling.py", "--ranks", "1", "--size", "tiny"]
        sys.path.insert(0, "benchmarks")
        runpy.run_path("benchmarks/scaling.py", run_name="__main__")
    """)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs matplotlib, which is not installed: run `python3 install.py bench`" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout.strip() == ""


def test_transformer_backend_jax_without_jax_is_one_line():
    proc = _python({"jax", "jaxlib"}, """
        import runpy, sys
        sys.argv = ["transformer.py", "--backend", "jax", "--steps", "1"]
        runpy.run_path("apps/transformer.py", run_name="__main__")
    """)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("transformer.py: error: --backend jax needs jax, which is not installed: run "
                                   "`python3 install.py tpu` in the mpimesh checkout (or pip install -e \".[tpu]\")")


def test_notebook_without_ipyparallel_names_the_extra():
    import json
    cells = json.loads((ROOT / "examples" / "jupyter_mpimesh.ipynb").read_text())["cells"]
    first = next("".join(c["source"]) for c in cells if "require(\"ipyparallel\"" in "".join(c["source"]))
    setup = first.split("cluster = ")[0]  # the imports, up to starting engines
    proc = _python({"ipyparallel"}, setup)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "mpimesh.errors.MissingDependencyError: MPI engines in Jupyter needs ipyparallel, which is not installed: "
        "run `python3 install.py notebook` in the mpimesh checkout (or pip install -e \".[notebook]\")")
