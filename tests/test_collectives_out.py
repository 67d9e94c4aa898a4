"""Collectives given an output buffer (`out=`) against numpy references, with uneven blocks.

Every rank's input is integer-valued and seeded by its group and coordinate, so every rank can build
the global arrays and the expected result; integer values make sums exact (bfloat16 included, whose
sums of small integers are exact in float32 and in bfloat16). Each collective is run into a fresh
contiguous `out`, into a non-contiguous `out` (the result is copied in), and where it applies in place;
its result must be `out` itself, equal to the reference, counted as without `out`, and leave its input
unchanged. Wrong shapes and dtypes raise on every rank, and the mesh works afterwards.
"""
from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from meshes import TRANSPORT_MODES, mesh_shapes, transport_mesh  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import counters  # noqa: E402
from mpimesh.errors import MpimeshError  # noqa: E402
from mpimesh.layout import block_sizes  # noqa: E402

# Every transport and check on up to 4 ranks; on more, one of each kind (out= takes the same paths).
MODES = TRANSPORT_MODES if MPI.COMM_WORLD.Get_size() <= 4 else ["mpi", "staged+timeout"]
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module", params=[(s, m) for s in mesh_shapes() for m in MODES], name="mesh",
                ids=lambda p: f"{p[0]}-{p[1]}")
def mesh_fixture(request):
    yield from transport_mesh(*request.param)


def values(shape, seed, dtype=np.float64) -> np.ndarray:
    """Integers in [-50, 50) seeded by `seed` (a tuple), as `dtype`."""
    return np.random.default_rng(list(seed)).integers(-50, 50, size=tuple(shape)).astype(dtype)


def seed_of(mesh: mm.Mesh, dims, *extra) -> tuple:
    """The same on every rank of this rank's group over `dims`, different between groups."""
    return tuple(c for n, c in mesh.coords.items() if n not in dims) + extra


def outs(shape, dtype) -> list:
    """The output buffers to try: contiguous, and non-contiguous (every other element of a wider
    array), both filled with 7s."""
    return [np.full(shape, 7, dtype), np.full(tuple(shape[:-1]) + (2 * shape[-1],), 7, dtype)[..., ::2]]


def counted(run) -> tuple:
    """`run()`'s result and the profile's collective counters."""
    with mm.profile() as prof:
        got = run()
    return got, counters.traffic(prof.counters)


def check_into(out, run_out, run_plain, want, x=None) -> None:
    """`run_out(out)` returns `out`, holding `want`, counted as `run_plain()`; `x` (if `out` is not
    `x`) unchanged."""
    before = None if x is None or out is x else x.copy()
    got, counts = counted(lambda: run_out(out))
    plain, plain_counts = counted(run_plain)
    assert got is out
    np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
    np.testing.assert_array_equal(np.asarray(plain, np.float64), np.asarray(want, np.float64))
    assert counts == plain_counts
    if before is not None:
        np.testing.assert_array_equal(x, before)


def lengths(k: int) -> list[int]:
    """Global lengths to cut over k ranks: empty blocks, one-longer blocks, equal blocks."""
    return sorted({1, k + 1, 2 * k, 2 * k + 3})


# ---------------------------------------------------------------- values

@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float64, BF16])
@pytest.mark.parametrize("nonblocking", [False, True])
def test_allreduce_out(mesh: mm.Mesh, dtype, nonblocking: bool) -> None:
    coll = mesh.collectives
    subsets = [[]]
    for n in mesh.shape.names:
        subsets += [s + [n] for s in subsets]
    for dims in subsets:
        k = coll.size(dims)
        mine = mesh.coords
        want = sum(values((3, 4), seed_of(mesh, dims) + (c,)) for c in range(k)).astype(dtype)
        c = 0
        for m in coll.ordered(dims):
            c = c * mesh.shape[m].size + mine[m]

        def x_of():
            return values((3, 4), seed_of(mesh, dims) + (c,), dtype)
        for place in ("fresh", "strided", "in place"):
            x = x_of()
            out = x if place == "in place" else outs((3, 4), dtype)[place == "strided"]
            if nonblocking:
                check_into(out, lambda o: coll.iallreduce(x, dims, out=o).wait(),
                           lambda: coll.iallreduce(x_of(), dims).wait(), want, x)
            else:
                check_into(out, lambda o: coll.allreduce(x, dims, out=o), lambda: coll.allreduce(x_of(), dims), want, x)


@pytest.mark.mpi
@pytest.mark.parametrize("shape,axis", [((5, 2, 3), 0), ((2, 5, 3), 1), ((2, 3, 5), 2), ((1, 5, 3), 1)])
def test_allgather_out(mesh: mm.Mesh, shape, axis: int) -> None:
    coll = mesh.collectives
    for m in mesh.shape.names:
        k, c = mesh.shape[m].size, mesh.coords[m]
        for n in lengths(k):
            full = values(shape[:axis] + (n,) + shape[axis + 1:], seed_of(mesh, [m], n))
            x = np.array_split(full, k, axis=axis)[c]
            for out in outs(full.shape, full.dtype):
                check_into(out, lambda o: coll.allgather(x, m, axis, n, out=o),
                           lambda: coll.allgather(x, m, axis, n), full, x)


@pytest.mark.mpi
@pytest.mark.parametrize("split_axis,concat_axis", [(0, 0), (0, 1), (1, 0), (2, 1), (1, 2)])
def test_alltoall_out(mesh: mm.Mesh, split_axis: int, concat_axis: int) -> None:
    coll = mesh.collectives
    for m in mesh.shape.names:
        k, c = mesh.shape[m].size, mesh.coords[m]
        for n in ([None] if split_axis == concat_axis else lengths(k)):
            size = 2 * k if n is None else n  # the concat axis's global length
            split_len = 2 * k if split_axis == concat_axis else k + 1  # uneven on the split axis too

            def x_of(r):
                shape = [3, 3, 3]
                shape[split_axis] = split_len
                if split_axis != concat_axis:
                    shape[concat_axis] = block_sizes(size, k)[r]
                return values(shape, seed_of(mesh, [m], r, split_axis, concat_axis, size))
            x = x_of(c)
            if split_axis == concat_axis:
                want = np.concatenate([np.split(x_of(r), k, axis=split_axis)[c] for r in range(k)], split_axis)
            else:
                want = np.concatenate([np.array_split(x_of(r), k, axis=split_axis)[c] for r in range(k)],
                                      concat_axis)
            for out in outs(want.shape, want.dtype):
                check_into(out, lambda o: coll.alltoall(x, m, split_axis, concat_axis, n, out=o),
                           lambda: coll.alltoall(x, m, split_axis, concat_axis, n), want, x)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float64, BF16])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_reduce_scatter_out(mesh: mm.Mesh, dtype, axis: int) -> None:
    coll = mesh.collectives
    for m in mesh.shape.names:
        k, c = mesh.shape[m].size, mesh.coords[m]
        for n in lengths(k):
            shape = (3, 3, 3)[:axis] + (n,) + (3, 3, 3)[axis + 1:]
            x = values(shape, seed_of(mesh, [m], n, c), dtype)
            total = sum(values(shape, seed_of(mesh, [m], n, r)) for r in range(k))
            want = np.array_split(total, k, axis=axis)[c].astype(dtype)
            for out in outs(want.shape, dtype):
                check_into(out, lambda o: coll.reduce_scatter(x, m, axis, out=o),
                           lambda: coll.reduce_scatter(x, m, axis), want, x)


@pytest.mark.mpi
@pytest.mark.parametrize("offset,wrap", [(1, True), (-1, True), (1, False), (2, False)])
def test_permute_out(mesh: mm.Mesh, offset: int, wrap: bool) -> None:
    coll = mesh.collectives
    for m in mesh.shape.names:
        k, c = mesh.shape[m].size, mesh.coords[m]
        src = c - offset
        if wrap:
            src %= k
        x = values((2, 3, 4), seed_of(mesh, [m], c))
        want = values((2, 3, 4), seed_of(mesh, [m], src)) if 0 <= src < k else np.zeros((2, 3, 4))
        for out in outs(x.shape, x.dtype):
            check_into(out, lambda o: coll.permute(x, m, offset, wrap, out=o),
                       lambda: coll.permute(x, m, offset, wrap), want, x)


@pytest.mark.mpi
def test_broadcast_out(mesh: mm.Mesh) -> None:
    coll = mesh.collectives
    x = values((4,), (mesh.rank,))
    out = np.zeros(4)
    assert coll.broadcast(x, root=mesh.size - 1, out=out) is out
    np.testing.assert_array_equal(out, values((4,), (mesh.size - 1,)))


# ---------------------------------------------------------------- errors

@pytest.mark.mpi
def test_wrong_out_raises_everywhere(mesh: mm.Mesh) -> None:
    """Every rank passes the same wrong `out`: every rank raises before anything moves, and the
    mesh's collectives work afterwards."""
    coll = mesh.collectives
    x = np.ones((4, 6))
    names = list(mesh.shape.names)
    m = names[-1]
    k = mesh.shape[m].size
    bad = [
        (lambda o: coll.allreduce(x, names, out=o), (4, 6)),
        (lambda o: coll.iallreduce(x, names, out=o), (4, 6)),
        (lambda o: coll.allgather(x, m, 1, out=o), (4, 6 * k)),
        (lambda o: coll.alltoall(x, m, 0, 1, out=o), None),
        (lambda o: coll.reduce_scatter(x, m, 1, out=o), None),
        (lambda o: coll.permute(x, m, 1, out=o), (4, 6)),
        (lambda o: coll.broadcast(x, out=o), (4, 6)),
    ]
    for run, shape in bad:
        with pytest.raises(MpimeshError, match=r"out has shape \(4, 5\).*result has shape"):
            run(np.empty((4, 5)))
        if shape is not None:
            with pytest.raises(MpimeshError, match=r"dtype float32.*dtype float64"):
                run(np.empty(shape, np.float32))
    np.testing.assert_array_equal(coll.allreduce(x, names), np.full((4, 6), float(mesh.size)))


@pytest.mark.mpi
def test_in_place_only_where_it_can(mesh: mm.Mesh) -> None:
    """`out=x` for a collective that cannot run in place, and an `out` overlapping `x`, still give the
    reference (through a copy)."""
    coll = mesh.collectives
    for m in mesh.shape.names:
        k, c = mesh.shape[m].size, mesh.coords[m]
        x = values((2 * k, 3), seed_of(mesh, [m], c))
        want = np.concatenate([np.split(values((2 * k, 3), seed_of(mesh, [m], r)), k)[c] for r in range(k)])
        assert coll.alltoall(x, m, 0, 0, out=x) is x
        np.testing.assert_array_equal(x, want)
        x = values((2, 3), seed_of(mesh, [m], c))
        want = values((2, 3), seed_of(mesh, [m], (c - 1) % k))
        assert coll.permute(x, m, 1, out=x) is x
        np.testing.assert_array_equal(x, want)
        y = values((2, 3), seed_of(mesh, [m], c))
        view = y.reshape(3, 2).reshape(2, 3)  # the same memory, another array: not taken as in place
        want = sum(values((2, 3), seed_of(mesh, [m], r)) for r in range(k))
        assert coll.allreduce(y, [m], out=view) is view
        np.testing.assert_array_equal(y, want)


def test_host_buffers_on_a_gpu_mesh_are_compared_by_numpy() -> None:
    """Whether a transport may receive into `out`: host arrays handed to a GPU mesh's collectives
    are compared by numpy (CuPy's `may_share_memory` refuses host arrays), views of one buffer overlap."""
    from types import SimpleNamespace

    from mpimesh.collectives.base import _fits

    def refuse(a, b):
        raise TypeError("Unsupported type <class 'numpy.ndarray'>")
    gpu = SimpleNamespace(may_share_memory=refuse)
    x, out = np.zeros(8), np.zeros(8)
    assert _fits(gpu, out, x, in_place=False)
    assert not _fits(gpu, x[2:], x[:4], in_place=False) and not _fits(gpu, x, x, in_place=False)
    assert _fits(gpu, x, x, in_place=True) and not _fits(gpu, np.zeros((4, 4))[:, :2], x, in_place=False)
