"""BLAS threads per rank default to cores // ranks on the node, with MPIMESH_THREADS and the usual
variables as overrides; checked by asking OpenBLAS itself (threadpoolctl) inside jobs of our own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.launch import find_mpiexec, job_env

ROOT = Path(__file__).resolve().parents[1]
CORES = len(os.sched_getaffinity(0))
VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "MPIMESH_THREADS")

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts jobs of its own")

REPORT = """
    import json, sys
    from threadpoolctl import threadpool_info
    with open(f"{sys.argv[1]}/{mm.MPI.COMM_WORLD.Get_rank()}.json", "w") as f:
        json.dump({"blas": sorted({i["num_threads"] for i in threadpool_info()}), "said": mm.threads.describe()}, f)
"""


def _job(tmp_path: Path, n: int, body: str, **env: str) -> list:
    script, out = tmp_path / "job.py", tmp_path / "out"
    out.mkdir(exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    script.write_text(textwrap.dedent(body) + textwrap.dedent(REPORT))
    clean = {k: v for k, v in job_env(PYTHONPATH=str(ROOT)).items() if k not in VARS}
    proc = subprocess.run([find_mpiexec(), "-n", str(n), sys.executable, str(script), str(out)], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [json.loads((out / f"{r}.json").read_text()) for r in range(n)]


@pytest.mark.parametrize("n", [2, 4])
def test_default_is_cores_over_local_ranks(tmp_path, n):
    reports = _job(tmp_path, n, "import mpimesh as mm\nimport numpy")
    want = max(1, CORES // n)
    for r in reports:
        assert r["blas"] == [want]
        assert f"BLAS threads per rank: {want} ({CORES} cores, {n} ranks on this node" in r["said"]


def test_mesh_counts_the_node_when_the_launcher_does_not_say(tmp_path):
    # numpy (and BLAS) loaded first, no launcher variable: the first Mesh counts the node's ranks.
    reports = _job(tmp_path, 2, """
        import os
        for v in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
            os.environ.pop(v, None)
        import numpy
        import mpimesh as mm
        mm.Mesh("all:2")
    """)
    assert [r["blas"] for r in reports] == [[max(1, CORES // 2)]] * 2


@pytest.mark.skipif(CORES < 2, reason="an override to 1 thread looks like the default on one core")
def test_overrides(tmp_path):
    # One rank alone would get every core; each override brings it down to 1.
    assert [r["blas"] for r in _job(tmp_path, 1, "import mpimesh as mm\nimport numpy")] == [[CORES]]
    reports = _job(tmp_path, 1, "import mpimesh as mm", MPIMESH_THREADS="1")
    assert reports[0]["blas"] == [1] and "from MPIMESH_THREADS" in reports[0]["said"]
    reports = _job(tmp_path, 1, "import mpimesh as mm", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    assert reports[0]["blas"] == [1] and "from environment" in reports[0]["said"]
    reports = _job(tmp_path, 1, "import numpy\nimport mpimesh as mm\nmm.threads.set_threads(1)")
    assert reports[0]["blas"] == [1] and "from set_threads" in reports[0]["said"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_set_threads_refuses_nonsense(bad):
    with pytest.raises(mm.MpimeshError, match="threads must be a positive int"):
        mm.threads.set_threads(bad)


@pytest.mark.skipif(CORES < 2, reason="on one core every default is 1 thread")
def test_a_parent_default_is_not_an_override(tmp_path):
    """A 1-rank job's default (every core) reaches its children through the environment; the ranks
    of a 2-rank job it starts (`python -m mpimesh.launch` inside a job) still take cores // 2 each,
    where without the mark they would take the parent's value for a user's override."""
    inner = tmp_path / "inner.py"
    inner.write_text(textwrap.dedent("import mpimesh as mm\nimport numpy") + textwrap.dedent(REPORT))
    (tmp_path / "inner_out").mkdir()
    reports = _job(tmp_path, 1, f"""
        import os, subprocess, sys
        import mpimesh as mm
        from mpimesh.launch import job_env
        assert os.environ["OMP_NUM_THREADS"] == "{CORES}", os.environ.get("OMP_NUM_THREADS")
        subprocess.run([sys.executable, "-m", "mpimesh.launch", "-n", "2", {str(inner)!r}, {str(tmp_path / "inner_out")!r}],
                       env=job_env(), check=True, timeout=100)
    """)
    assert reports[0]["blas"] == [CORES]  # the parent: one rank on the node
    for r in range(2):
        child = json.loads((tmp_path / "inner_out" / f"{r}.json").read_text())
        assert child["blas"] == [max(1, CORES // 2)], child
        assert "ranks on this node" in child["said"], child
