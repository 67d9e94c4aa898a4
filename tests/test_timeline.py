"""`mm.profile(timeline=path)`: one Chrome trace of every rank (mpimesh/timeline.py, flight.py).

Rank 0 reads the JSON its block wrote and checks it against what the ranks know independently: every
rank present, spans well nested on each track, each rank's counted collectives (calls and bytes) equal
to its own profile counters, gathered; a rank that sleeps before a collective is the one the others
are found waiting for, by about as long as it slept; the clock alignment undoes a planted skew.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh import flight
from mpimesh.collectives import shm
from mpimesh.launch import find_mpiexec, job_env
from mpimesh.timeline import align
from meshes import mesh_shapes

ROOT = Path(__file__).resolve().parents[1]
WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()
KINDS = ("allreduce", "allgather", "alltoall", "reduce_scatter", "permute", "exscan")
EPS = 1e-6  # µs: float rounding of ts + dur (both come from whole nanoseconds)


def _path(tmp_path) -> str:
    return WORLD.bcast(str(tmp_path / "timeline.json"), root=0)  # (rank 0's: it writes)


def _spans(doc: dict) -> list:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _check_nested(doc: dict) -> int:
    """Assert that on each (rank, thread) track any two spans are disjoint or one holds the other;
    the number of spans."""
    tracks: dict = {}
    for e in _spans(doc):
        assert e["dur"] >= 0 and e["tid"] in (0, 1), e
        tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for track, spans in tracks.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list = []
        for a, b, name in spans:
            while stack and stack[-1][1] <= a + EPS:
                stack.pop()
            assert not stack or b <= stack[-1][1] + EPS, f"{track}: {name} [{a}, {b}] straddles {stack[-1]}"
            stack.append((a, b, name))
    return sum(len(s) for s in tracks.values())


def _counted(doc: dict, rank: int) -> dict:
    """`{"kind/dims": {"calls", "bytes"}}` of the counted collective spans of `rank`."""
    out: dict = {}
    for e in _spans(doc):
        a = e["args"]
        if e["pid"] == rank and e["cat"] == "collective" and a["counted"]:
            c = out.setdefault(f"{a['kind']}/{'+'.join(a['mesh_dims'])}", {"calls": 0, "bytes": 0})
            c["calls"] += 1
            c["bytes"] += a["bytes"]
    return out


def _collectives(counters: dict) -> dict:
    return {k: {"calls": v["calls"], "bytes": v["bytes"]} for k, v in counters.items() if k.split("/")[0] in KINDS}


def _workload(mesh: mm.Mesh) -> None:
    """Collectives of every kind, over each mesh dim and all of them, even and uneven, 16-bit, large
    (through shared memory), non-blocking, and a compiled training step with gradient buckets."""
    names, k = mesh.shape.names, mesh.size
    x = mesh.from_numpy(np.arange(6.0 * k * 5).reshape(6 * k, 5), f"a:{6 * k};b:5", layout=f"a:{names[0]}")
    for d in names:
        y = mm.relayout(x, f"b:{d}" if d != names[0] else f"a:{d}")  # an alltoall, or nothing
        mm.reduce_sum(y).to_numpy()  # allreduce, allgather
        mm.reduce_sum(mm.cast(y, "bfloat16"), output_shape=f"a:{6 * k}").to_numpy()  # a 16-bit reduction
    uneven = mesh.from_numpy(np.arange(2.0 * k + 1), f"u:{2 * k + 1}", layout=f"u:{names[-1]}")
    mm.shift(uneven, 1, "u", wrap=True).to_numpy()  # permute
    mm.cumsum(uneven, "u").to_numpy()  # exscan
    coll = mesh.collectives
    big = np.ones(shm.MIN_BYTES // 8)
    coll.allreduce(big, names)  # through shared memory where it is on
    coll.iallreduce(big.copy(), names).wait()
    coll.iallreduce(np.ones(3, ml_dtypes.bfloat16), names).wait()
    coll.any_rank(False)
    w = mesh.random_normal("d:8;e:8", seed=2)
    data = mesh.random_normal(f"batch:{2 * k + 1};d:8", seed=1)

    def step(w, scale):
        with mm.trace():
            (g,) = mm.gradients([mm.reduce_sum(mm.square(mm.einsum([data * scale, w])))], [w])
        return g
    run = mm.compile(step)
    for s in range(3):
        run(w, mesh.ones("d:8") * float(s + 1)).to_numpy()


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes()[:2])
def test_the_json_holds_every_rank_well_nested_and_the_counters_bytes(tmp_path, shape):
    mesh = mm.Mesh(shape, layout=f"batch:{mm.Shape(shape).names[-1]}")
    path = _path(tmp_path)
    with mm.profile(timeline=path) as prof:
        _workload(mesh)
    counters = WORLD.gather(_collectives(prof.counters), root=0)
    if RANK != 0:
        return
    doc = json.load(open(path))
    assert doc["displayTimeUnit"] == "ms"
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(N)}
    assert {e["pid"] for e in _spans(doc)} == set(range(N))
    assert _check_nested(doc) > 50
    for r in range(N):
        assert counters[r] or N == 1, r
        assert _counted(doc, r) == counters[r], f"rank {r}"
    matmuls = [e["args"] for e in _spans(doc) if e["name"] == "einsum" and e["args"].get("shapes", [[]])[-1] == [8, 8]]
    assert matmuls and all(a["flops"] == 2 * a["shapes"][0][0] * 8 * 8 for a in matmuls), matmuls  # [m,8] @ [8,8]
    if N > 1:
        kinds = {e["args"]["kind"] for e in _spans(doc) if e["cat"] == "collective"}
        assert {"allreduce", "allgather", "any_rank"} <= kinds, kinds
        comm = [e for e in _spans(doc) if e["tid"] == 1]  # the non-blocking allreduces, the buckets' among them
        assert len(comm) >= 2 * N and all(e["args"]["kind"] == "allreduce" for e in comm)
        assert all(0 <= e["args"]["exposed_us"] <= e["dur"] + EPS for e in comm)
    names = {e["name"] for e in _spans(doc)}
    assert "replay step" in names and {"bucket make", "bucket start", "bucket wait"} <= names or N == 1, names


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("over", ["all", "cols"])
def test_a_late_rank_is_the_one_the_others_waited_for(tmp_path, over):
    """Rank 1 sleeps before an allreduce: every other rank of its group waits for it about that long
    (a wait span inside the collective's, naming rank 1); rank 1 arrived last and waited for nobody.
    Over `cols` of a 2-row mesh (4 ranks) the other row's group is not held up by rank 1."""
    if over == "cols" and (N % 2 or N < 4):
        pytest.skip("needs a 2-row mesh with 2 or more columns")
    mesh = mm.Mesh(f"all:{N}") if over == "all" else mm.Mesh(f"rows:2;cols:{N // 2}")
    x = mesh.ones(f"a:{4 * N}", layout=f"a:{over}")
    mm.reduce_sum(x).to_numpy()
    path, nap = _path(tmp_path), 0.4
    with mm.profile(timeline=path):
        if mesh.rank == 1:
            time.sleep(nap)
        mm.reduce_sum(x).to_numpy()
    if RANK != 0:
        return
    doc = json.load(open(path))
    _check_nested(doc)
    group = [r for r in range(N) if over == "all" or r // (N // 2) == 0]  # rank 1's group
    first = {}
    for e in _spans(doc):
        if e["cat"] == "collective" and e["args"]["kind"] == "allreduce" and e["pid"] not in first:
            first[e["pid"]] = e
    assert sorted(first) == list(range(N))
    for r in group:
        a = first[r]["args"]
        if r == 1:
            assert a.get("arrived_last") and a["waited_us"] == 0, a
            continue
        assert a["waited_for_rank"] == 1 and a["waited_us"] > 0.5 * nap * 1e6, (r, a)
        waits = [e for e in _spans(doc) if e["pid"] == r and e["cat"] == "wait" and e["args"]["seq"] == a["seq"]]
        assert len(waits) == 1 and waits[0]["name"] == "wait for rank 1"
        assert abs(waits[0]["dur"] - a["waited_us"]) < 1e-3 and waits[0]["ts"] == first[r]["ts"]
    for r in set(range(N)) - set(group):  # the other row: never waited for rank 1
        assert first[r]["args"].get("waited_for_rank") != 1


@pytest.mark.mpi(min_size=2)
def test_alignment_undoes_a_clock_skew():
    """Each rank's clock runs 100 s * rank ahead and every rank is its own "node": the zero each
    rank gets, read back on the real (shared) clock, is rank 0's, to within the ping-pong's round
    trip (a wrong sign would be 200 s * rank off)."""
    skew = 100.0 * RANK
    zero = align(WORLD, clock=lambda: flight.clock() + skew, node=MPI.COMM_SELF)
    zeros = WORLD.allgather(zero - skew)
    assert max(zeros) - min(zeros) < 0.1, zeros
    assert abs(align(WORLD) - zeros[0]) < 10.0  # (later, on the real clocks: the same kind of number)


@pytest.mark.mpi
def test_bad_paths_and_nested_timelines_are_refused_on_every_rank(tmp_path):
    with pytest.raises(mm.MpimeshError, match="cannot write into '/nonexistent"):
        with mm.profile(timeline="/nonexistent/dir/t.json"):
            pass
    for bad in (3, ""):
        with pytest.raises(mm.MpimeshError, match="takes a file path"):
            with mm.profile(timeline=bad):
                pass
    path = _path(tmp_path)
    with pytest.raises(mm.MpimeshError, match="already being recorded"):
        with mm.profile(timeline=path):
            with mm.profile(timeline=path + "2"):
                pass
    assert not flight.timeline


@pytest.mark.mpi
def test_an_exception_leaving_the_block_writes_nothing_and_closes_it(tmp_path):
    mesh = mm.Mesh(f"all:{N}")
    path = _path(tmp_path)
    with pytest.raises(ZeroDivisionError):
        with mm.profile(timeline=path):
            mm.reduce_sum(mesh.ones(f"a:{N}", layout="a:all"))
            1 / 0
    assert not flight.timeline
    if RANK == 0:
        assert not (tmp_path / "timeline.json").exists()
    with mm.profile(timeline=path):  # and the next one works
        mm.reduce_sum(mesh.ones(f"a:{N}", layout="a:all"))
    if RANK == 0:
        assert any(e["cat"] == "op" for e in _spans(json.load(open(path))))


@pytest.mark.mpi
def test_no_timeline_records_nothing_and_the_flight_ring_still_runs():
    mesh = mm.Mesh(f"all:{N}")
    with mm.profile():
        assert not flight.timeline
        mm.reduce_sum(mesh.ones(f"a:{N}", layout="a:all"))
    before = len(flight.ring)
    ring = list(flight.ring)
    assert ring and (ring[-1].name == "einsum" if N == 1 else ring[-1][1] == "collective"), ring[-3:]  # (the sum)
    assert all(e[0] <= flight.clock() for e in ring if type(e) is tuple) and before == min(len(ring), flight.SIZE)


@pytest.mark.mpi
def test_the_plot_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    mesh = mm.Mesh(f"all:{N}")
    path = _path(tmp_path)
    with mm.profile(timeline=path):
        mm.reduce_sum(mesh.ones(f"a:{4 * N}", layout="a:all")).to_numpy()
    if RANK == 0:
        png = mm.profile.plot(path)
        assert png == path[:-5] + ".png"
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(N != 1, reason="spawns its own 2-rank job; runs in the 1-rank session")
def test_the_transformer_app_writes_the_timeline_and_its_picture(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.json"
    proc = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(ROOT / "apps" / "transformer.py"),
                           "--steps", "2", "--d-model", "32", "--d-ff", "64", "--heads", "2", "--layers", "1",
                           "--batch", "4", "--length", "16", "--eval-batches", "1", "--samples", "0",
                           "--mesh", "rows:2;cols:1", "--timeline", str(path)],
                          env=job_env(PYTHONPATH=str(ROOT), MPIMESH_BACKEND="numpy"), capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"timeline of every rank: {path}, drawn in {tmp_path / 'run.png'}" in proc.stdout
    doc = json.loads(path.read_text())
    assert {e["pid"] for e in _spans(doc)} == {0, 1} and _check_nested(doc) > 100
    names = {e["name"] for e in _spans(doc)}
    assert "replay train_step" in names and "bucket wait" in names, names  # step 2 replays step 1
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
