"""An uncaught exception on one rank ends the whole job promptly, with its traceback printed."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from mpimesh.launch import find_mpiexec, job_env

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                reason="spawns its own 2-rank job; runs in the 1-rank session")


def _run(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env = job_env(PYTHONPATH=str(ROOT))
    start = time.monotonic()
    proc = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(script)], env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - start


def test_exception_on_one_rank_aborts_all(tmp_path):
    proc, seconds = _run(tmp_path, """
        import mpimesh as mm
        mesh = mm.Mesh("all:2")
        if mesh.rank == 1:
            raise RuntimeError("boom on rank 1")
        mesh.barrier()  # rank 0 would wait here forever without the abort
    """)
    assert proc.returncode != 0
    assert "boom on rank 1" in proc.stderr
    assert "Traceback" in proc.stderr
    assert seconds < 60


def test_clean_job_exits_zero(tmp_path):
    proc, _ = _run(tmp_path, """
        import mpimesh as mm
        mesh = mm.Mesh("all:2", layout="a:all")
        x = mesh.ones("a:4")
        assert float(mm.reduce_sum(x).to_numpy()) == 4.0
    """)
    assert proc.returncode == 0, proc.stderr


def test_exception_before_any_mesh_aborts_all(tmp_path):
    # The guard is in force from `import mpimesh`: rank 1 dies opening a missing file before any Mesh
    # exists, and rank 0, already waiting in a plain MPI barrier, is taken down too.
    proc, seconds = _run(tmp_path, """
        import mpimesh as mm
        if mm.MPI.COMM_WORLD.Get_rank() == 1:
            open("/nonexistent/mpimesh-input.txt")
        mm.MPI.COMM_WORLD.Barrier()
    """)
    assert proc.returncode != 0
    assert "uncaught exception on rank 1" in proc.stderr
    assert "mpimesh-input.txt" in proc.stderr
    assert seconds < 60


def test_opt_out_keeps_pythons_hook(tmp_path):
    proc, _ = _run(tmp_path, """
        import os, sys
        os.environ["MPIMESH_NO_ABORT"] = "1"
        import mpimesh
        assert not getattr(sys.excepthook, "_mpimesh", False)
    """)
    assert proc.returncode == 0, proc.stderr


def test_a_rank_whose_abort_hangs_ends_itself_and_says_so():
    """`mpimesh.abort.end_self_after`: the watchdog kills a process that outlives its grace."""
    code = "import time; from mpimesh.abort import end_self_after; end_self_after(0.5, 7); time.sleep(60)"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], env=job_env(PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == -9 and time.monotonic() - t0 < 10, (r.returncode, r.stderr)
    assert "mpimesh: rank 7: MPI_Abort did not end this process within 0.5 s" in r.stderr


def test_an_mpimesh_error_shows_the_programs_frames_only(tmp_path):
    """A ShapeError (a typo in an output dim) on every rank: each rank's traceback is the program's
    line and the message, not mpimesh's internals (57 lines from 4 ranks before, interleaved)."""
    proc, _ = _run(tmp_path, """
        import mpimesh as mm
        mesh = mm.Mesh("all:2")
        x, w = mesh.ones("batch:4;hidden:8"), mesh.ones("hidden:8;out:2")
        y = mm.einsum([x, w], output_shape="batch:4;hiden:8")
    """)
    assert proc.returncode != 0
    assert proc.stderr.count("output dim 'hiden' (size 8) is in no input") == 2, proc.stderr
    assert proc.stderr.count('job.py", line 5') == 2 and "mpimesh/ops" not in proc.stderr, proc.stderr
