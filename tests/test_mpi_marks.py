"""tests/run.py without pytest-mpi (as on the GPU machines' image; MPIMESH_TEST_NO_PYTEST_MPI=1 hides it
here): its stand-in, tests/mpi_marks.py, runs the tests marked `mpi` and skips those marked
`mpi(min_size=N)` on fewer than N ranks, as pytest-mpi's `--with-mpi` does; on 1 and 2 ranks."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from mpimesh.launch import job_env

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="child processes; the 1-rank session runs it")

ROOT = Path(__file__).resolve().parent.parent
MARKED = """import os

import pytest
from mpi4py import MPI


def ran(name):
    with open(os.environ["MARKS_LOG"], "a") as f:
        f.write(f"{name} {MPI.COMM_WORLD.Get_size()}\\n")


@pytest.mark.mpi
def test_marked():
    ran("marked")


@pytest.mark.mpi(min_size=2)
def test_two_ranks_or_more():
    ran("two_ranks_or_more")


def test_unmarked():
    ran("unmarked")
"""


@pytest.mark.parametrize("hidden", ["1", "0"], ids=["stand-in", "pytest-mpi"])
def test_marked_tests_run_and_min_size_skips(tmp_path, hidden):
    """Each test writes its name and the rank count to a log, on every rank."""
    if hidden == "0":
        pytest.importorskip("pytest_mpi")
    path, log = tmp_path / "test_marked.py", tmp_path / "ran.txt"
    path.write_text(MARKED)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "run.py"), str(path), "-rs"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240,
                          env=job_env(MPIMESH_TEST_RANKS="1 2", MPIMESH_TEST_NO_PYTEST_MPI=hidden, MARKS_LOG=str(log)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plugin = "-p no:pytest_mpi -p mpi_marks" if hidden == "1" else "--with-mpi"
    assert proc.stdout.count(f"-m pytest {plugin} -q") == 2, proc.stdout
    assert sorted(log.read_text().splitlines()) == sorted(["marked 1", "unmarked 1"] + 2 * ["marked 2", "unmarked 2",
                                                                                         "two_ranks_or_more 2"])
    if hidden == "1":
        assert "needs 2 MPI ranks, only 1 here" in proc.stdout
