"""mpimesh from Jupyter: a cluster of ipyparallel MPI engines on 127.0.0.1 driven from this process, and
the example notebook executed end to end. Each test runs in a private IPython directory, always stops
what it started, and fails if any process it started outlives it."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import ipyparallel as ipp
import nbclient
import nbformat
import numpy as np
import psutil
import pytest
from mpi4py import MPI

from mpimesh.launch import find_mpiexec, job_env

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "jupyter_mpimesh.ipynb"

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                reason="starts its own MPI job of engines; runs in the 1-rank session")

X = np.arange(24.0).reshape(4, 6)
W = (np.arange(18.0).reshape(6, 3) - 7) / 4
EINSUM = """
from mpi4py import MPI
import mpimesh as mm
mesh = mm.Mesh("rows:2;cols:2", layout="batch:rows;hidden:cols")
x = mesh.from_numpy(x_np, "batch:4;hidden:6")
w = mesh.from_numpy(w_np, "hidden:6;out:3")
y = mm.einsum([x, w], "batch:4;out:3")  # hidden is split over cols: an allreduce over cols
y_global, y_local, coords = y.to_numpy(), mm.backend.to_host(y.local), mesh.coords
world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
print("rank", world[0])
"""


def _started_under(ipython_dir: str) -> list[psutil.Process]:
    """Live processes (other than this one) whose environment carries `ipython_dir` as IPYTHONDIR."""
    found = []
    for proc in psutil.process_iter():
        try:
            if (proc.pid != os.getpid() and proc.status() != psutil.STATUS_ZOMBIE
                    and proc.environ().get("IPYTHONDIR") == ipython_dir):
                found.append(proc)
        except psutil.Error:  # gone, or not ours
            pass
    return found


@pytest.fixture
def ipython_dir(tmp_path, monkeypatch):
    """A private environment for clusters and kernels: none of the enclosing MPI job's variables (they
    would confuse the engines' mpiexec), IPython and Jupyter state under tmp_path, mpimesh importable,
    and a deadline for the engines' job. Afterwards, fails if anything started under it still runs."""
    extra = {"IPYTHONDIR": str(tmp_path / "ipython"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
             "PYTHONPATH": str(ROOT), "MPIEXEC_TIMEOUT": "120"}
    env = job_env(**extra)
    for name in set(os.environ) - set(env):
        monkeypatch.delenv(name)
    for name, value in extra.items():
        monkeypatch.setenv(name, value)
    yield extra["IPYTHONDIR"]
    _, alive = psutil.wait_procs(_started_under(extra["IPYTHONDIR"]), timeout=15)
    names = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):  # it may end by itself meanwhile
            names.append(" ".join(proc.cmdline()))
            proc.kill()
    assert not alive, f"processes left running after the test: {names}"


@pytest.fixture
def engines(ipython_dir, tmp_path):
    """A client of 4 MPI engines run by find_mpiexec() with a controller on 127.0.0.1; the cluster is
    stopped afterwards whatever happened."""
    cluster = ipp.Cluster(engines="mpi", n=4, controller_ip="127.0.0.1", profile_dir=str(tmp_path / "profile"),
                          cluster_id="test", engine_timeout=90)
    cluster.config.MPIEngineSetLauncher.mpi_cmd = [find_mpiexec()]
    try:
        client = cluster.start_and_connect_sync()
        yield client
        client.close()
    finally:
        cluster.stop_cluster_sync()


def test_einsum_on_mpi_engines(engines):
    view = engines[:]
    view.push({"x_np": X, "w_np": W}, block=False).get(timeout=60)
    run = view.execute(EINSUM, block=False)
    run.get(timeout=60)
    run.wait_for_output(timeout=30)  # an engine's stdout may arrive after its result
    assert run.stdout == [f"rank {i}\n" for i in range(4)]  # engine i is rank i
    pulled = view.pull(["world", "coords", "y_local", "y_global"], block=False).get(timeout=60)
    assert [world for world, *_ in pulled] == [(i, 4) for i in range(4)]
    expected = X @ W
    for _, coords, y_local, y_global in pulled:
        np.testing.assert_allclose(y_global, expected)
        rows = 2 * coords["rows"]  # batch is split over rows, out is replicated
        np.testing.assert_allclose(y_local, expected[rows:rows + 2])


def test_example_notebook_runs(ipython_dir, tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    assert not any(c.outputs or c.execution_count for c in cells), "keep the notebook's outputs cleared"
    # Kernel "python3" is this interpreter, whatever other python3 kernel specs the machine has.
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nbclient.NotebookClient(nb, timeout=120, startup_timeout=60, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    errors = [out for c in cells for out in c.outputs if out.output_type == "error"]
    assert not errors, errors
    assert all(c.execution_count for c in cells)
