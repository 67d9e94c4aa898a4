"""Nobody waits forever by default: a rank that leaves the job makes the ranks waiting for it raise.

Each test starts MPI jobs of its own (from the 1-rank session) with the settings a program starts
with (no `MPIMESH_COLLECTIVE_TIMEOUT`, no SPMD check), in which one rank returns early or is killed
while the others wait for it in a collective. The survivors time their collective and print the
error they got before re-raising it, so each test can check the time, the names, and that what the
job prints is one paragraph per rank, not a traceback.
"""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from mpimesh.launch import find_mpiexec, is_open_mpi, job_env

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                reason="spawns its own jobs; runs in the 1-rank session")

# The survivors' report: how long their collective ran before it raised, and the message.
REPORT = re.compile(r"^rank (\d+) raised after ([\d.]+) s: (.*)$", re.M)
WAIT = """
    def waiting(what, fn):
        t0 = time.monotonic()
        try:
            fn()
        except mm.CollectiveTimeoutError as e:
            print(f"rank {mesh.rank} raised after {time.monotonic() - t0:.2f} s: {e}", flush=True)
            raise
        print(f"rank {mesh.rank}: {what} completed", flush=True)
"""


def _job(tmp_path: Path, ranks: int, body: str, wrap: bool = False,
         **env) -> tuple[subprocess.CompletedProcess, float]:
    """Run `body` on `ranks` ranks with a clean mpimesh environment; `wrap`: each rank under `sh -c`
    and `mpiexec -disable-auto-cleanup`, so that the launcher sees a shell exit, not a signal, and
    leaves the other ranks running, as `srun` does by default (MPICH's launcher ends the job when a
    rank dies of a signal)."""
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\nimport mpimesh as mm\n" + textwrap.dedent(WAIT) + textwrap.dedent(body))
    launch, rank = [find_mpiexec(), "-n", str(ranks)], [sys.executable, str(script)]
    if wrap:  # (Open MPI's launcher: keep running after a rank's non-zero exit)
        keep = ["--mca", "orte_abort_on_non_zero_status", "0"] if is_open_mpi(launch[0]) else ["-disable-auto-cleanup"]
        launch, rank = [launch[0], *keep, *launch[1:]], ["sh", "-c", f'"{rank[0]}" "{rank[1]}"; exit $?']
    clean = job_env(PYTHONPATH=str(ROOT), **{"MPIMESH_BACKEND": "numpy", **env})  # (host transports, also on a GPU)
    for var in ("MPIMESH_COLLECTIVE_TIMEOUT", "MPIMESH_SPMD_CHECK", "MPIMESH_NO_ABORT"):
        clean.pop(var, None)
    start = time.monotonic()
    proc = subprocess.run([*launch, *rank], env=clean, capture_output=True, text=True,
                          timeout=120)
    return proc, time.monotonic() - start


def _reports(proc) -> dict:
    return {int(r): (float(s), msg) for r, s, msg in REPORT.findall(proc.stdout)}


def _one_paragraph(proc) -> None:
    """The job's error output: each failing rank's one line from the abort hook, no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    for line in proc.stderr.splitlines():
        if line.startswith("mpimesh: rank"):
            assert "CollectiveTimeoutError: " in line and "left the job" in line, line


@pytest.mark.parametrize("ranks,transport", [(2, "mpi"), (4, "mpi"), (3, "staged")])
def test_rank_returning_early_makes_the_others_raise(tmp_path, ranks, transport):
    last = ranks - 1
    proc, seconds = _job(tmp_path, ranks, f"""
        mesh = mm.Mesh("all:{ranks}", layout="a:all", transport="{transport}")
        x = mesh.ones("a:{4 * ranks}")
        print(f"warm {{float(mm.reduce_sum(x).to_numpy())}}", flush=True)   # every rank takes part once
        if mesh.rank == {last}:
            sys.exit(0)          # leaves: the others' next collective can never complete
        waiting("to_numpy", x.to_numpy)
    """)
    assert proc.returncode != 0, proc
    assert proc.stdout.count(f"warm {4.0 * ranks}") == ranks
    reports = _reports(proc)
    assert reports, proc.stdout + proc.stderr
    for r, (after, message) in reports.items():
        assert after < 5.0, (r, after)
        assert f"rank {last} left the job" in message
        assert "its program ended after its collective #1 allreduce over all" in message  # what it did last
        assert "allgather over all" in message and "job.py:" in message  # where this rank waited
        assert f"rank {r} (this one) in it" in message
        for other in set(range(last)) - {r}:  # the other survivors, waiting in the same collective
            assert f"rank {other} waiting in #2 allgather over all" in message
    _one_paragraph(proc)
    assert seconds < 30


def test_rank_returning_early_while_the_others_agree_on_an_error(tmp_path):
    """The agreement on whether any rank failed (`any_rank`: a checkpoint's, `from_local`'s, an
    optimizer's) is polled like a collective: a rank that left makes the others raise (it was a
    plain MPI call, waiting forever)."""
    proc, seconds = _job(tmp_path, 3, """
        mesh = mm.Mesh("all:3")
        mesh.barrier()
        if mesh.rank == 2:
            sys.exit(0)
        waiting("from_local", lambda: mm.from_local(mesh.xp.zeros((1, 2)), "a:3;b:2", mesh, "a:all"))
    """)
    assert proc.returncode != 0, proc
    reports = _reports(proc)  # (the first to raise ends the job: the other may not get to print)
    assert reports and set(reports) <= {0, 1}, proc.stdout + proc.stderr
    for r, (after, message) in reports.items():
        assert after < 5.0 and "rank 2 left the job" in message, message
        assert re.search(r"collective #\d (broadcast|any_rank) over all", message), message
    _one_paragraph(proc)
    assert seconds < 30


def test_rank_killed_by_sigkill_under_a_launcher_that_leaves_the_others_running(tmp_path):
    proc, _ = _job(tmp_path, 3, """
        mesh = mm.Mesh("all:3", layout="a:all")
        x = mesh.ones("a:6")
        mm.reduce_sum(x)
        if mesh.rank == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), 9)
        waiting("allreduce", lambda: mm.reduce_sum(x))
    """, wrap=True)
    assert proc.returncode != 0
    reports = _reports(proc)
    assert reports, proc.stdout + proc.stderr
    for r, (after, message) in reports.items():
        assert after < 5.0 + 0.5, (r, after)
        # (a survivor that raised first and aborted may be named gone too: this launcher leaves each alone)
        assert re.search(r"rank 1 left: its process \(pid \d+\) ended without an exit notice \(killed",
                         message), message
    _one_paragraph(proc)


def test_rank_killed_by_sigkill_under_mpiexec_ends_the_job(tmp_path):
    """MPICH's launcher ends the whole job itself when a rank dies of a signal: nobody waits."""
    proc, seconds = _job(tmp_path, 2, """
        mesh = mm.Mesh("all:2", layout="a:all")
        x = mesh.ones("a:4")
        mm.reduce_sum(x)
        if mesh.rank == 1:
            os.kill(os.getpid(), 9)
        waiting("allreduce", lambda: mm.reduce_sum(x))
    """)
    assert proc.returncode != 0
    assert seconds < 15  # start-up included


def test_a_departure_outside_the_collectives_group_is_not_an_error(tmp_path):
    """On rows:2;cols:2, rank 3 leaves: ranks 0 and 1 (one row) still sum over cols, and 0 and 2
    over rows; only rank 1, whose column holds rank 3, raises."""
    proc, _ = _job(tmp_path, 4, """
        mesh = mm.Mesh("rows:2;cols:2", layout="a:rows;b:cols")
        x = mesh.ones("a:4;b:4")
        mm.reduce_sum(x, reduced_dims=["a"]), mm.reduce_sum(x, reduced_dims=["b"])  # makes both sub-communicators
        if mesh.rank == 3:
            sys.exit(0)
        if mesh.rank in (0, 1):
            waiting("sum over cols", lambda: mm.reduce_sum(x, reduced_dims=["b"]).local)
        time.sleep(1.5)  # rank 3's notice has arrived by now everywhere
        waiting("sum over rows", lambda: mm.reduce_sum(x, reduced_dims=["a"]).local)
    """)
    assert proc.returncode != 0
    assert "rank 0: sum over cols completed" in proc.stdout and "rank 1: sum over cols completed" in proc.stdout
    assert "rank 0: sum over rows completed" in proc.stdout and "rank 2: sum over rows completed" in proc.stdout
    reports = _reports(proc)
    assert list(reports) == [1], proc.stdout
    assert "rank 3 left the job" in reports[1][1] and reports[1][0] < 5.0


def test_default_time_out_is_on(tmp_path):
    code = "from mpimesh.collectives import guard; print(guard.settings()['timeout'])"
    env = job_env(PYTHONPATH=str(ROOT))
    env.pop("MPIMESH_COLLECTIVE_TIMEOUT", None)

    def timeout_with(**extra) -> str:
        proc = subprocess.run([sys.executable, "-c", code], env=dict(env, **extra), capture_output=True, text=True)
        return proc.stdout.strip() or proc.stderr.strip().splitlines()[-1]
    assert timeout_with() == "600.0"
    assert timeout_with(MPIMESH_COLLECTIVE_TIMEOUT="90") == "90.0"
    assert timeout_with(MPIMESH_COLLECTIVE_TIMEOUT="off") == timeout_with(MPIMESH_COLLECTIVE_TIMEOUT="0") == "None"
    assert "is not a positive number of seconds" in timeout_with(MPIMESH_COLLECTIVE_TIMEOUT="-3")


def test_a_waiting_rank_backs_off(tmp_path):
    """Rank 1 arrives 10 s late; rank 0's CPU time over its 10 s in the collective is under 1 s."""
    proc, _ = _job(tmp_path, 2, """
        mesh = mm.Mesh("all:2", layout="a:all")
        x = mesh.ones("a:4")
        mm.reduce_sum(x)
        if mesh.rank == 1:
            time.sleep(10)
        cpu, wall = time.process_time(), time.monotonic()
        total = float(mm.reduce_sum(x).to_numpy())
        print(f"rank {mesh.rank}: {total} after {time.monotonic() - wall:.2f} s, cpu {time.process_time() - cpu:.3f} s")
    """)
    assert proc.returncode == 0, proc.stderr
    waited = re.search(r"rank 0: 4.0 after ([\d.]+) s, cpu ([\d.]+) s", proc.stdout)
    assert waited, proc.stdout
    assert float(waited.group(1)) >= 9.5 and float(waited.group(2)) < 1.0, waited.group(0)


@pytest.mark.parametrize("first_mesh", [False, True])
def test_a_rank_that_leaves_before_the_others_build_a_mesh(tmp_path, first_mesh):
    """Building a mesh starts with blocking MPI calls: a rank that ended before them (before any
    mesh, or after an earlier one) left the others waiting for ever, time-out or not. Now they raise
    at once, naming it."""
    proc, seconds = _job(tmp_path, 3, f"""
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
        if {first_mesh}:
            mm.Mesh("x:3").barrier()
        if rank == 1:
            sys.exit(0)
        t0 = time.monotonic()
        try:
            mm.Mesh("y:3")
        except mm.CollectiveTimeoutError as e:
            print(f"rank {{rank}} raised after {{time.monotonic() - t0:.2f}} s: {{e}}", flush=True)
            raise
    """)
    assert proc.returncode != 0, proc
    reports = _reports(proc)
    assert reports and set(reports) <= {0, 2}, proc.stdout + proc.stderr
    why = "its program ended " + ("after its collective #1 barrier" if first_mesh else "before it built any mesh")
    for r, (after, message) in reports.items():
        assert after < 5.0 and message.startswith("building mesh [y:3]: rank 1 left the job") and why in message
    _one_paragraph(proc)
    assert seconds < 30
