"""mesh.collectives against numpy references built from every rank's (known) input, and their counters.

Rank r's input is a reproducible integer-valued array seeded by r, so every rank can compute every
other rank's input and hence the expected result of any collective; integer values make float sums
exact whatever the reduction order.
"""
from __future__ import annotations


import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from meshes import get_mesh, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import counters  # noqa: E402
from mpimesh.collectives import guard  # noqa: E402

# Every test runs on every host transport (the staged one stages numpy through a second host buffer),
# and once more with the SPMD check and a time-out on: those change no value or count. The meshes are
# numpy ones also under --backend cupy: these tests hand the collectives host arrays (the GPU
# transports: tests/test_gpu_transports.py).
MODES = ["mpi", "staged", "mpi+guard"]


@pytest.fixture(scope="module", params=[(s, m) for s in mesh_shapes() for m in MODES], name="mesh",
                ids=lambda p: f"{p[0]}-{p[1]}")
def mesh_fixture(request):
    shape, mode = request.param
    mesh = get_mesh(shape, "", mode.split("+")[0], "numpy")
    if mode.endswith("+guard"):
        mm.set_spmd_check(True)
        mm.set_collective_timeout(120)
    try:
        yield mesh
    finally:
        guard.reset()


def inp(rank: int, shape: Sequence[int], seed: int = 0, dtype=np.float64) -> np.ndarray:
    """Rank `rank`'s input: integers in [-50, 50) seeded by (seed, rank)."""
    rng = np.random.default_rng([seed, rank])
    return rng.integers(-50, 50, size=tuple(shape)).astype(dtype)


def coords_of(mesh: mm.Mesh, rank: int) -> dict:
    return dict(zip(mesh.shape.names, (int(c) for c in np.unravel_index(rank, mesh.shape.sizes))))


def group(mesh: mm.Mesh, dims: Sequence[str]) -> list[int]:
    """Ranks whose coords agree with this rank's outside `dims`, in row-major (coordinate) order."""
    mine = mesh.coords
    return [r for r in range(mesh.size)
            if all(coords_of(mesh, r)[n] == mine[n] for n in mesh.shape.names if n not in dims)]


def subsets(names) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for n in names:
        out += [s + [n] for s in out]
    return out


# ---------------------------------------------------------------- values

@pytest.mark.mpi
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_allreduce(mesh: mm.Mesh, op: str) -> None:
    coll = mesh.collectives
    ref = {"sum": np.sum, "max": np.max, "min": np.min}[op]
    for dims in subsets(mesh.shape.names):
        x = inp(mesh.rank, (4, 6))
        got = coll.allreduce(x.copy(), dims, op)
        want = ref(np.stack([inp(r, (4, 6)) for r in group(mesh, dims)]), axis=0)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == x.dtype and got.shape == x.shape
        # multiple dims listed in any order mean the same group
        np.testing.assert_array_equal(coll.allreduce(x.copy(), list(reversed(dims)), op), want)


@pytest.mark.mpi
def test_allreduce_noncontiguous_and_int(mesh: mm.Mesh) -> None:
    dims = list(mesh.shape.names)
    x = inp(mesh.rank, (6, 4), dtype=np.int64).T
    got = mesh.collectives.allreduce(x, dims, "sum")
    want = sum(inp(r, (6, 4), dtype=np.int64) for r in range(mesh.size)).T
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int64


@pytest.mark.mpi
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_allgather(mesh: mm.Mesh, axis: int) -> None:
    coll = mesh.collectives
    for m in mesh.shape.names:
        members = group(mesh, [m])
        got = coll.allgather(inp(mesh.rank, (2, 3, 4)), m, axis)
        want = np.concatenate([inp(r, (2, 3, 4)) for r in members], axis=axis)
        np.testing.assert_array_equal(got, want)
        # a non-contiguous input: a transposed view
        view = inp(mesh.rank, (4, 3, 2)).transpose(2, 1, 0)
        assert not view.flags.c_contiguous
        got = coll.allgather(view, m, axis)
        want = np.concatenate([inp(r, (4, 3, 2)).transpose(2, 1, 0) for r in members], axis=axis)
        np.testing.assert_array_equal(got, want)
        # a strided slice
        got = coll.allgather(inp(mesh.rank, (2, 6, 4))[:, ::2], m, axis)
        want = np.concatenate([inp(r, (2, 6, 4))[:, ::2] for r in members], axis=axis)
        np.testing.assert_array_equal(got, want)


@pytest.mark.mpi
@pytest.mark.parametrize("split_axis,concat_axis", [(0, 0), (0, 1), (1, 0), (2, 1), (1, 2)])
def test_alltoall(mesh: mm.Mesh, split_axis: int, concat_axis: int) -> None:
    shape = (8, 16, 8)
    for m in mesh.shape.names:
        k, c = mesh.shape[m].size, mesh.coords[m]
        members = group(mesh, [m])
        if split_axis == concat_axis and 8 % k:  # blocks of 8 over 3 are uneven: only across axes
            with pytest.raises(mm.MpimeshError, match="equal blocks"):
                mesh.collectives.alltoall(inp(mesh.rank, shape), m, split_axis, concat_axis)
            continue
        got = mesh.collectives.alltoall(inp(mesh.rank, shape), m, split_axis, concat_axis)
        want = np.concatenate([np.array_split(inp(r, shape), k, axis=split_axis)[c] for r in members],
                              axis=concat_axis)
        np.testing.assert_array_equal(got, want)
        # and on a transposed view
        got = mesh.collectives.alltoall(inp(mesh.rank, shape).transpose(1, 0, 2), m, split_axis, concat_axis)
        want = np.concatenate([np.array_split(inp(r, shape).transpose(1, 0, 2), k, axis=split_axis)[c]
                               for r in members], axis=concat_axis)
        np.testing.assert_array_equal(got, want)


@pytest.mark.mpi
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter(mesh: mm.Mesh, axis: int, op: str) -> None:
    ref = {"sum": np.sum, "max": np.max}[op]
    for m in mesh.shape.names:
        k, c = mesh.shape[m].size, mesh.coords[m]
        members = group(mesh, [m])
        got = mesh.collectives.reduce_scatter(inp(mesh.rank, (8, 16)), m, axis, op)
        total = ref(np.stack([inp(r, (8, 16)) for r in members]), axis=0)
        np.testing.assert_array_equal(got, np.array_split(total, k, axis=axis)[c])


@pytest.mark.mpi
@pytest.mark.parametrize("wrap", [True, False])
def test_permute(mesh: mm.Mesh, wrap: bool) -> None:
    for m in mesh.shape.names:
        k, c = mesh.shape[m].size, mesh.coords[m]
        members = group(mesh, [m])
        for offset in (1, -1, 2, -3, k, 0):
            x = inp(mesh.rank, (3, 5))
            got = mesh.collectives.permute(x, m, offset, wrap)
            src = c - offset
            if wrap:
                src %= k
            want = inp(members[src], (3, 5)) if 0 <= src < k else np.zeros((3, 5))
            np.testing.assert_array_equal(got, want, err_msg=f"{m} offset={offset} wrap={wrap}")
        # non-contiguous input
        got = mesh.collectives.permute(inp(mesh.rank, (5, 3)).T, m, 1, wrap)
        src = (c - 1) % k if wrap else c - 1
        want = inp(members[src], (5, 3)).T if 0 <= src < k else np.zeros((3, 5))
        np.testing.assert_array_equal(got, want)


@pytest.mark.mpi
def test_exscan(mesh: mm.Mesh) -> None:
    for m in mesh.shape.names:
        c = mesh.coords[m]
        members = group(mesh, [m])
        got = mesh.collectives.exscan(inp(mesh.rank, (3, 4)), m, "sum")
        want = sum((inp(r, (3, 4)) for r in members[:c]), np.zeros((3, 4)))
        np.testing.assert_array_equal(got, want)


@pytest.mark.mpi
@pytest.mark.parametrize("axis", [0, 1])
def test_block(mesh: mm.Mesh, axis: int) -> None:
    x = inp(7, (8, 16))  # the same on every rank
    for m in mesh.shape.names:
        k, c = mesh.shape[m].size, mesh.coords[m]
        got = mesh.collectives.block(x, m, axis)
        np.testing.assert_array_equal(got, np.array_split(x, k, axis=axis)[c])


@pytest.mark.mpi
def test_empty_arrays(mesh: mm.Mesh) -> None:
    coll = mesh.collectives
    for m in mesh.shape.names:
        k = mesh.shape[m].size
        x = np.zeros((0, 3))
        assert coll.allreduce(x, [m]).shape == (0, 3)
        assert coll.allgather(x, m, 1).shape == (0, 3 * k)
        assert coll.alltoall(np.zeros((0, 8)), m, 1, 0).shape == (0, len(np.array_split(range(8), k)[mesh.coords[m]]))


# ---------------------------------------------------------------- counters

def _calls(coll, m: str, x: np.ndarray) -> list[str]:
    """Run each kind once over mesh dim `m`; return the keys that must have been counted."""
    coll.allreduce(x, [m])
    coll.allgather(x, m, 0)
    coll.alltoall(x, m, 0, 1)
    coll.reduce_scatter(x, m, 0)
    coll.permute(x, m, 1, True)
    coll.exscan(x, m)
    coll.block(x, m, 0)  # no communication: never counted
    return [f"{kind}/{m}" for kind in ("allreduce", "allgather", "alltoall", "reduce_scatter", "permute", "exscan")]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_counters(mesh: mm.Mesh, dtype) -> None:
    coll = mesh.collectives
    x = inp(mesh.rank, (8, 8), dtype=dtype)
    item = np.dtype(dtype).itemsize
    big = [d.name for d in mesh.shape if d.size > 1]
    want: dict = {}
    with mm.profile() as prof:
        for m in big:
            _calls(coll, m, x)
            for key in _calls(coll, m, x):  # twice: counts add up
                want[key] = {"calls": 2, "elements": 2 * x.size, "bytes": 2 * x.nbytes}
        if len(big) > 1:  # several mesh dims, listed out of order: key in mesh order
            coll.allreduce(x[:2], list(reversed(big)))
            want["allreduce/" + "+".join(big)] = {"calls": 1, "elements": 16, "bytes": 16 * item}
    assert counters.traffic(prof.counters) == want
    # outside the profile nothing is counted any more
    coll.allreduce(x, big)
    assert counters.traffic(prof.counters) == want


@pytest.mark.mpi
def test_counters_group_of_one(mesh: mm.Mesh) -> None:
    coll = mesh.collectives
    x = inp(mesh.rank, (8, 8))
    ones = [d.name for d in mesh.shape if d.size == 1]
    with mm.profile() as prof:
        coll.allreduce(x, [])
        for m in ones:
            _calls(coll, m, x)
            coll.permute(x, m, 1, False)
        if ones:
            coll.allreduce(x, ones)
    assert prof.counters == {}


@pytest.mark.mpi
def test_counters_nested_profiles(mesh: mm.Mesh) -> None:
    big = [d.name for d in mesh.shape if d.size > 1]
    x = inp(mesh.rank, (4,))
    with mm.profile() as outer:
        with mm.profile() as inner:
            for m in big:
                mesh.collectives.allgather(x, m, 0)
        for m in big:
            mesh.collectives.allgather(x, m, 0)
    for m in big:
        assert inner.counters[f"allgather/{m}"] == {"calls": 1, "elements": 4, "bytes": 32}
        assert outer.counters[f"allgather/{m}"] == {"calls": 2, "elements": 8, "bytes": 64}
    assert len(inner.counters) == len(big) == len(outer.counters)


def _everywhere(value) -> list:
    return MPI.COMM_WORLD.allgather(value)


@pytest.mark.parametrize("shape", mesh_shapes())
def test_nans_bools_and_16_bit_edge_cases(shape):
    """The same answers on every rank, numpy's: a max or min with a NaN on one rank (MPI's max
    dropped or kept it by arrival order), bools in iallreduce and reduce_scatter (MPI has no sum
    of bools), bfloat16 broadcast (mpi4py cannot export it), and a bad root a clear error."""
    import ml_dtypes
    mesh = get_mesh(shape, "", "mpi", "numpy")
    coll, names = mesh.collectives, list(mesh.shape.names)
    r, n = mesh.rank, mesh.size
    for dt in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16):
        x = np.array([float(r), float(-r), 1.0, 2.0]).astype(dt)
        if r == n - 1:
            x[2] = np.nan
        got = [coll.allreduce(x, names, op).astype(np.float64).tolist() for op in ("max", "min")]
        want = [[n - 1.0, 0.0, np.nan if n > 0 else 1.0, 2.0], [0.0, -(n - 1.0), np.nan, 2.0]]
        for g in _everywhere(got):
            assert np.array_equal(g, want, equal_nan=True), (dt, g, want)
    flags = np.array([r == 0, False, True])
    req = coll.iallreduce(flags, names)
    assert req.wait().tolist() == [True, False, True] and req.result.dtype == bool
    assert coll.iallreduce(flags, names, "min").wait().tolist() == [n == 1, False, True]
    d = max(names, key=lambda m: mesh.shape[m].size)
    k = mesh.shape[d].size
    mine = np.array([mesh.coords[d] == 0, False, True])  # (True on one rank of each group along d)
    scattered = coll.reduce_scatter(np.tile(mine[:, None], (1, 2 * k)).T.copy(), d, 0)
    assert scattered.dtype == bool and scattered.shape == (2, 3) and scattered.tolist() == [[True, False, True]] * 2
    b = coll.broadcast(np.full(3, r + 1.5, ml_dtypes.bfloat16), root=n - 1)
    assert b.dtype == ml_dtypes.bfloat16 and b.astype(float).tolist() == [n + 0.5] * 3
    for root in (n, -1, 1.0, True):
        with pytest.raises(mm.MpimeshError, match=rf"broadcast: root must be a rank of the mesh, 0 to {n - 1}"):
            coll.broadcast(np.arange(3.0), root=root)


@pytest.mark.parametrize("size", [16, 300_000])  # (300,000 float32: summed through shared memory)
def test_requests_waited_in_other_orders_pair_the_same_transfers(size):
    """Rank 0 waits for a then b, the others for b then a: each gets its own sum (16-bit floats and
    shared-memory sums complete in two steps: they were mixed up, or half summed)."""
    import ml_dtypes
    mesh = get_mesh(f"all:{MPI.COMM_WORLD.Get_size()}", "", "mpi", "numpy")
    coll, r, n = mesh.collectives, mesh.rank, mesh.size
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
        a, b = np.full(size, r + 1, dt), np.full(size, 10 * (r + 1), dt)
        ra, rb = coll.iallreduce(a, ["all"]), coll.iallreduce(b, ["all"])
        first, second = (ra, rb) if r == 0 else (rb, ra)
        first.wait()
        second.wait()
        assert np.all(ra.result.astype(np.float64) == n * (n + 1) / 2), (dt, ra.result[:3])
        assert np.all(rb.result.astype(np.float64) == 10 * n * (n + 1) / 2), (dt, rb.result[:3])


@pytest.mark.parametrize("size", [16, 300_000])
def test_requests_waited_in_other_orders_around_another_collective(size):
    """As above, with a blocking allreduce between the two waits: rank 0 waits for a, sums c, waits for
    b; the others wait for b (so a's and b's second steps start there), sum c, then wait for a. The
    second steps start before any later collective (they were paired with c's transfer: wrong sums)."""
    import ml_dtypes
    mesh = get_mesh(f"all:{MPI.COMM_WORLD.Get_size()}", "", "mpi", "numpy")
    coll, r, n = mesh.collectives, mesh.rank, mesh.size
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
        a, b, c = np.full(size, r + 1, dt), np.full(size, 10 * (r + 1), dt), np.full(size, 3 * (r + 1), dt)
        ra, rb = coll.iallreduce(a, ["all"]), coll.iallreduce(b, ["all"])
        first, second = (ra, rb) if r == 0 else (rb, ra)
        first.wait()
        sc = coll.allreduce(c, ["all"])
        second.wait()
        assert np.all(ra.result.astype(np.float64) == n * (n + 1) / 2), (dt, ra.result[:3])
        assert np.all(rb.result.astype(np.float64) == 10 * n * (n + 1) / 2), (dt, rb.result[:3])
        assert np.all(sc.astype(np.float64) == 3 * n * (n + 1) / 2), (dt, sc[:3])


def test_the_spmd_check_takes_a_16_bit_sum_to_a_scalar():
    """The check compared the ranks' pieces of the 16-bit allgather (1 element against 0) instead
    of the 0-d shape, and aborted a correct program."""
    mesh = get_mesh(f"all:{MPI.COMM_WORLD.Get_size()}", "", "mpi", "numpy")
    t = mesh.from_numpy(np.arange(8, dtype=np.float16), "b:8", layout="b:all")
    old = guard._settings["check"]
    mm.set_spmd_check(True)
    try:
        assert float(mm.reduce_sum(t).to_numpy()) == 28.0
        assert float(mm.reduce_sum(mm.cast(t, "bfloat16")).to_numpy()) == 28.0
    finally:
        mm.set_spmd_check(old)
