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
