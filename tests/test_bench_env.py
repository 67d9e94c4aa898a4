"""benchmarks/common.py leaves every benchmark process with a clean BLAS environment, the child
processes of a process it re-executed included (benchmarks/gpu.py runs each precision in one). A
child inherits the parent's re-exec mark; if the parent's environment changed after its re-exec
(`mpimesh.threads` drops the thread counts it takes for an inherited default of its own), the child
must re-execute itself, not give up with "environment still not clean after re-exec"."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from mpimesh.launch import job_env

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="child processes; the 1-rank session runs it")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
CHILD = "import common, os\nprint(os.environ.get('OMP_NUM_THREADS'), os.environ.get('OPENBLAS_CORETYPE'))\n"
DIRTY = {  # how the parent's environment gets dirty after its own re-exec
    "mpimesh.threads": "import mpimesh",  # with MPIMESH_AUTO_THREADS=1 inherited: it drops the 1s common.py set
    "by hand": "os.environ.update(OMP_NUM_THREADS='16', OPENBLAS_CORETYPE='Haswell')",
}


@pytest.mark.parametrize("how", sorted(DIRTY))
def test_a_child_of_a_reexecuted_process_cleans_its_own_environment(how, tmp_path):
    (tmp_path / "child.py").write_text(CHILD)  # scripts, not -c: a re-exec runs sys.argv again
    (tmp_path / "parent.py").write_text(
        f"import common, os, subprocess, sys\n{DIRTY[how]}\n"
        "assert os.environ.get('MPIMESH_BENCH_REEXEC'), 'the parent was not re-executed'\n"
        f"sys.exit(subprocess.call([sys.executable, {str(tmp_path / 'child.py')!r}]))\n")
    env = job_env(MPIMESH_BENCH_LOCK="", MPIMESH_AUTO_THREADS="1", PYTHONPATH=str(BENCHMARKS))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "MPIMESH_THREADS",
                "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "MPIMESH_BENCH_REEXEC"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(tmp_path / "parent.py")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not clean" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1", "None"], proc.stdout
