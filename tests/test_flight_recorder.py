"""A hang leaves a record (mpimesh/flight.py): each rank's last ops and collectives, always kept, written
beside the error when a divergence or a time-out ends the job, and named in the printed error.

The job tests start jobs of their own from the 1-rank session, in which the ranks run known ops and then
diverge (or hang), and check each rank's file against what that rank ran.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh import flight
from mpimesh.launch import find_mpiexec, job_env

ROOT = Path(__file__).resolve().parents[1]
N = MPI.COMM_WORLD.Get_size()
only_in_1_rank_session = pytest.mark.skipif(N != 1, reason="spawns its own jobs; runs in the 1-rank session")


def _job(tmp_path: Path, ranks: int, body: str, **env) -> tuple[subprocess.CompletedProcess, dict]:
    """Run `body` on `ranks` ranks with its flight records going to `tmp_path`; the finished job and
    `{rank: its record}` of the files written there."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    out = tmp_path / "records"
    proc = subprocess.run([find_mpiexec(), "-n", str(ranks), sys.executable, str(script)],
                          env=job_env(PYTHONPATH=str(ROOT), MPIMESH_FLIGHT_DIR=str(out), MPIMESH_BACKEND="numpy",
                                      **env),
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    records = {}
    for f in sorted(out.glob("mpimesh-flight-*-rank*.json")) if out.exists() else []:
        doc = json.loads(f.read_text())
        records[doc["rank"]] = doc
        assert f.name == f"mpimesh-flight-{doc['job']}-rank{doc['rank']}.json"
    return proc, records


def _names(record: dict, kind: str) -> list:
    return [r.get("collective", r.get("name")) for r in record["records"] if r["kind"] == kind]


@only_in_1_rank_session
def test_a_divergence_on_3_ranks_leaves_each_ranks_last_ops_named_in_the_error(tmp_path):
    proc, records = _job(tmp_path, 3, """
        import numpy as np
        import mpimesh as mm
        mm.set_spmd_check(True)
        mesh = mm.Mesh("all:3", layout="a:all")
        x = mesh.from_numpy(np.arange(12.0), "a:12")
        for _ in range(60):  # more ops than the ring keeps: it holds the last ones
            x = mm.exp(x * 0.0)
        y = mm.tanh(x) if mesh.rank == 0 else mm.sigmoid(x)  # each rank's own last op
        mm.reduce_sum(y).to_numpy() if mesh.rank == 0 else y.to_numpy()  # an allreduce against allgathers
    """, MPIMESH_FLIGHT_RECORDS="40")
    assert proc.returncode != 0
    assert "DivergenceError" in proc.stderr and "ranks diverged" in proc.stderr, proc.stderr
    assert sorted(records) == [0, 1, 2], (proc.stderr, records.keys())
    job = records[0]["job"]
    named = str(tmp_path / "records" / f"mpimesh-flight-{job}-rank<N>.json")
    assert named in proc.stderr, proc.stderr
    for r, rec in records.items():
        assert rec["size"] == 3 and rec["job"] == job and rec["kept"] == 40
        assert len(rec["records"]) == 40  # the ring's size: the older entries are gone
        assert rec["error"].startswith("DivergenceError: ranks diverged"), rec["error"]
        timed = [e["ago"] for e in rec["records"] if "ago" in e]  # (ops carry no time)
        assert timed and all(a >= b >= 0 for a, b in zip(timed, timed[1:]))  # oldest first
        ops = _names(rec, "op")
        assert ("tanh" if r == 0 else "sigmoid") in ops[-4:] and ("sigmoid" if r == 0 else "tanh") not in ops
        assert ops.count("exp") >= 10  # the loop's ops before it
        last = [e for e in rec["records"] if e["kind"] == "collective"][-1]
        assert last["collective"] == ("allreduce" if r == 0 else "allgather"), last
        assert last["mesh_dims"] == ["all"] and last["mesh"] == "[all:3]" and last["seq"] >= 1


@only_in_1_rank_session
def test_a_time_out_leaves_the_records_of_the_ranks_that_waited(tmp_path):
    """Ranks 0 and 1 wait in an allreduce that rank 2 never joins: it waits in a barrier of the same
    mesh. The time-out ends the job; ranks 0 and 1 write their records as they raise, rank 2 when
    they ask where it is, and its record shows the barrier it was in."""
    proc, records = _job(tmp_path, 3, """
        import mpimesh as mm
        mesh = mm.Mesh("all:3", layout="a:all")
        x = mesh.ones("a:6")
        mm.reduce_sum(x).to_numpy()
        if mesh.rank == 2:
            mesh.barrier()
        else:
            mm.reduce_sum(x * 2.0).to_numpy()
    """, MPIMESH_COLLECTIVE_TIMEOUT="3")
    assert proc.returncode != 0
    assert "CollectiveTimeoutError" in proc.stderr and "flight records" in proc.stderr, proc.stderr
    assert sorted(records) == [0, 1, 2], (proc.stderr, records.keys())
    for r in (0, 1):
        last = [e for e in records[r]["records"] if e["kind"] == "collective"][-1]
        assert last["collective"] == "allreduce", last
    last = [e for e in records[2]["records"] if e["kind"] == "collective"][-1]
    assert last["collective"] == "barrier", last
    assert "timed out" in records[2]["error"] or "CollectiveTimeoutError" in records[2]["error"]


@pytest.mark.mpi
def test_the_ring_holds_the_last_ops_and_collectives_and_dumps_them(tmp_path, monkeypatch):
    mesh = mm.Mesh(f"all:{N}", layout="a:all")
    x = mesh.from_numpy(np.arange(4.0 * N), f"a:{4 * N}")
    mm.reduce_sum(mm.sqrt(mm.abs(x))).to_numpy()
    tail = list(flight.ring)[-8:]
    ops = [e.name for e in tail if type(e) is not tuple]  # (an op's entry is its OpDef)
    assert "sqrt" in ops and ops.index("abs") < ops.index("sqrt"), ops
    collectives = [e[2][1] for e in tail if type(e) is tuple and e[1] == "collective"]
    assert (collectives[-1] == "allreduce") if N > 1 else not collectives, collectives  # (the sum's: no gather)
    assert flight.ring.maxlen == flight.SIZE == 200  # (the default)
    folder = MPI.COMM_WORLD.bcast(str(tmp_path))
    monkeypatch.setenv("MPIMESH_FLIGHT_DIR", folder)
    rank = MPI.COMM_WORLD.Get_rank()
    where = flight.dump("SomeError: for the test", rank, N)
    assert where == str(Path(folder) / f"mpimesh-flight-{flight.job_id()}-rank{rank}.json")
    doc = json.loads(Path(where).read_text())
    assert doc["error"] == "SomeError: for the test" and doc["rank"] == rank
    assert [e["name"] for e in doc["records"] if e["kind"] == "op"][-len(ops):] == ops
