"""Never a silent hang: the SPMD check (`mm.set_spmd_check`) and collective time-outs.

In-process tests take every rank of the session's mesh through a divergence and back; the time-out
tests start jobs of their own (from the 1-rank session) in which one rank never arrives, and check
that every job ends within the time-out plus 10 s, non-zero, naming the missing ranks.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.collectives import guard
from mpimesh.launch import find_mpiexec, job_env

ROOT = Path(__file__).resolve().parents[1]
N = MPI.COMM_WORLD.Get_size()


def _diverge(mesh: mm.Mesh, mine) -> str:
    """Run `mine()` (which differs by rank), expecting a DivergenceError on every rank; its message."""
    with pytest.raises(mm.DivergenceError) as info:
        mine()
    return str(info.value)


@pytest.mark.mpi(min_size=2)
def test_divergent_kind_raises_on_every_rank_and_mesh_stays_usable(checked):
    mesh = mm.Mesh(f"all:{N}", layout="a:all")
    x = mesh.from_numpy(np.arange(4.0 * N), f"a:{4 * N}")
    # Rank 0 sums over the split dim (an allreduce); the others gather it (an allgather).
    message = _diverge(mesh, lambda: mm.reduce_sum(x) if mesh.rank == 0 else x.to_numpy())
    assert "rank 0: " in message and "allreduce over all" in message
    for r in range(1, N):
        assert f"rank {r}: " in message
    assert message.count("allgather over all") == N - 1
    assert f"{Path(__file__).name}:" in message  # the user's line, not mpimesh's
    # No data moved: the mesh still works, with the right values.
    assert float(mm.reduce_sum(x).to_numpy()) == float(np.arange(4.0 * N).sum())
    np.testing.assert_array_equal(x.to_numpy(), np.arange(4.0 * N))


@pytest.mark.mpi(min_size=2)
def test_the_same_collectives_for_other_ops_are_a_divergence(checked):
    """Rank 0 sums x then y, the others y then x: the same two scalar allreduces, so the check passed
    them and each rank got the other tensor's sum. The op and its inputs' global shapes are part of
    a collective's key now, and named in the message."""
    mesh = mm.Mesh(f"all:{N}", layout="b:all")
    x = mesh.from_numpy(np.arange(8.0 * N), f"b:{8 * N}")
    y = mesh.from_numpy(-np.arange(16.0 * N), f"b:{16 * N}")
    first, second = (x, y) if mesh.rank == 0 else (y, x)
    message = _diverge(mesh, lambda: (mm.reduce_sum(first), mm.reduce_sum(second)))
    assert f"in einsum of [b:{8 * N}]" in message and f"in einsum of [b:{16 * N}]" in message, message
    assert float(mm.reduce_sum(x).to_numpy()) == float(np.arange(8.0 * N).sum())  # (nothing was sent)


@pytest.mark.mpi(min_size=2)
def test_divergent_shape_and_dtype(checked):
    mesh = mm.Mesh(f"all:{N}")
    coll = mesh.collectives
    n = 3 if mesh.rank == N - 1 else 4
    message = _diverge(mesh, lambda: coll.allreduce(np.ones(n), ["all"]))
    assert "local shape (4,)" in message and "local shape (3,)" in message
    dtype = np.float32 if mesh.rank == 0 else np.float64
    message = _diverge(mesh, lambda: coll.allgather(np.ones(2, dtype), "all", 0))
    assert "float32" in message and "float64" in message
    np.testing.assert_array_equal(coll.allreduce(np.full(2, mesh.rank, np.int64), ["all"]),
                                  np.full(2, N * (N - 1) // 2))


@pytest.mark.mpi
def test_check_changes_no_value_and_no_count():
    shape = "rows:2;cols:%d" % (N // 2) if N % 2 == 0 and N > 1 else f"all:{N}"
    mesh = mm.Mesh(shape, layout="batch:rows;hidden:cols" if N > 1 and N % 2 == 0 else "batch:all")
    x = mesh.random_normal("batch:8;io:16", seed=0, dtype="float64")
    w = mesh.random_normal("io:16;hidden:8", seed=1, dtype="float64")
    v = mesh.random_normal("hidden:8;io:16", seed=2, dtype="float64")

    def program():
        with mm.profile() as prof, mm.trace():
            h = mm.relu(mm.einsum([x, w]))
            y = mm.einsum([h, v])
            loss = mm.reduce_mean(mm.square(y))
            gw, = mm.gradients([loss], [w])
            values = [y.to_numpy(), loss.to_numpy(), gw.to_numpy()]
        return values, prof.counters

    plain_values, plain_counts = program()
    mm.set_spmd_check(True)
    mm.set_collective_timeout(60)
    try:
        checked_values, checked_counts = program()
    finally:
        guard.reset()
    for a, b in zip(plain_values, checked_values):
        assert a.tobytes() == b.tobytes()
    assert plain_counts == checked_counts


@pytest.mark.skipif(N < 4 or N % 2, reason="needs a mesh with two dims of size > 1")
def test_uneven_blocks_of_another_mesh_dim_are_not_a_divergence(checked):
    """a:3 over rows leaves the rows groups different local shapes; collectives over cols (each
    within one row) are consistent and must pass the check, with the right values."""
    mesh = mm.Mesh(f"rows:2;cols:{N // 2}", layout="a:rows;b:cols")
    g = np.arange(21.0).reshape(3, 7)
    x = mesh.from_numpy(g, "a:3;b:7")
    np.testing.assert_array_equal(mm.shift(x, 1, "b", wrap=True).to_numpy(), np.roll(g, 1, axis=1))
    np.testing.assert_array_equal(mm.reduce_sum(x, reduced_dims="b").to_numpy(), g.sum(1))


def test_settings_reject_bad_values():
    with pytest.raises(mm.MpimeshError, match="positive number of seconds"):
        mm.set_collective_timeout(-1)
    with pytest.raises(mm.MpimeshError, match="positive number of seconds"):
        mm.set_collective_timeout("5")
    assert guard.settings()["timeout"] == guard.DEFAULT_TIMEOUT  # unchanged by the refused calls
    assert issubclass(mm.DivergenceError, mm.MpimeshError)
    assert issubclass(mm.CollectiveTimeoutError, mm.MpimeshError)


# ---------------------------------------------------------------- time-outs, in jobs of their own

only_in_1_rank_session = pytest.mark.skipif(N != 1, reason="spawns its own jobs; runs in the 1-rank session")


def _job(tmp_path: Path, ranks: int, body: str, timeout: float, **env) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    start = time.monotonic()
    proc = subprocess.run([find_mpiexec(), "-n", str(ranks), sys.executable, str(script)],
                          env=job_env(PYTHONPATH=str(ROOT), MPIMESH_COLLECTIVE_TIMEOUT=str(timeout),
                                      **{"MPIMESH_BACKEND": "numpy", **env}),  # (host transports, also under --backend cupy)
                          capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - start


@only_in_1_rank_session
@pytest.mark.parametrize("ranks,transport", [(2, "mpi"), (4, "mpi"), (2, "staged")])
def test_missing_rank_times_out_and_ends_the_job(tmp_path, ranks, transport):
    timeout = 3.0
    proc, seconds = _job(tmp_path, ranks, f"""
        import time
        import mpimesh as mm
        mesh = mm.Mesh("all:{ranks}", layout="a:all", transport="{transport}")
        x = mesh.ones("a:{4 * ranks}")
        print(f"warm {{float(mm.reduce_sum(x).to_numpy())}}", flush=True)  # every rank takes part once
        if mesh.rank == {ranks - 1}:
            time.sleep(100)      # the last rank never joins the next collective
        mm.reduce_sum(x)
    """, timeout)
    assert proc.returncode != 0
    assert seconds < timeout + 10 + 5  # + the job's own start-up
    assert "CollectiveTimeoutError" in proc.stderr
    assert f"ranks [{ranks - 1}] never arrived" in proc.stderr
    assert "allreduce over all" in proc.stderr and "job.py:" in proc.stderr
    assert proc.stdout.count("warm 16.0" if ranks == 4 else "warm 8.0") == ranks
