"""Collectives that move unequal blocks (`numpy.array_split` cuts; blocks may be empty), on every
rank count, against numpy; their profile counts; the SPMD check and time-out on them; the JAX twin.

Inputs are integer-valued (sums are exact whatever the order) and built from a global array that
every rank of a group computes identically. Every loop collects its mismatches and asserts at the
end, so every rank runs every collective whatever fails.
"""
from __future__ import annotations

import jaxenv  # noqa: F401  (before jax: host devices, quick compiles)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpimesh as mm  # noqa: E402
from meshes import TRANSPORT_MODES, Errors, get_mesh, mesh_shapes, transport_mesh  # noqa: E402

N, RANK = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
DTYPES = [np.float64, np.int32, np.bool_, np.complex128]
# "guard": the SPMD check and a time-out; "timeout": a time-out alone (polled non-blocking transfers)
MODES = TRANSPORT_MODES


def shapes(n: int) -> list[str]:
    """1-D, 2-D and 3-D meshes of n ranks (tests/meshes.py's, or a factoring of n)."""
    known = mesh_shapes(n)
    if len(known) > 1:
        return known
    p = next((p for p in range(2, n) if n % p == 0), 1)
    return known + [f"rows:{p};cols:{n // p}", f"rows:{n // p};cols:1;planes:{p}"]


@pytest.fixture(scope="module", params=[(s, m) for s in shapes(N) for m in MODES], name="mesh",
                ids=lambda p: f"{p[0]}-{p[1]}")
def mesh_fixture(request):
    yield from transport_mesh(*request.param)


def values(shape, seed, dtype=np.float64) -> np.ndarray:
    """Integers in [-50, 50) seeded by `seed` (a tuple), as `dtype`."""
    rng = np.random.default_rng(list(seed))
    x = rng.integers(-50, 50, size=tuple(shape))
    if dtype == np.bool_:
        return x > 0
    if dtype == np.complex128:
        return x + 1j * rng.integers(-50, 50, size=tuple(shape))
    return x.astype(dtype)


def lengths(k: int) -> list[int]:
    """Global lengths to cut over k ranks: empty blocks, one-longer blocks, equal blocks."""
    return sorted({0, 1, 2, max(k - 1, 0), k + 1, 7, 2 * k + 3})


def with_len(shape: tuple, axis: int, n: int) -> tuple:
    return shape[:axis] + (n,) + shape[axis + 1:]


def part(x: np.ndarray, k: int, c: int, axis: int) -> np.ndarray:
    return np.array_split(x, k, axis=axis)[c]


def seed_of(mesh: mm.Mesh, m: str, *extra) -> tuple:
    """The same on every rank of this rank's group over `m`, different between groups."""
    return tuple(c for n, c in mesh.coords.items() if n != m) + extra


# ---------------------------------------------------------------- values

@pytest.mark.mpi
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_allgather(mesh: mm.Mesh, axis: int) -> None:
    errors = Errors()
    for m in mesh.shape.names:
        k, c = mesh.shape[m].size, mesh.coords[m]
        for size in lengths(k):
            for dtype in DTYPES:
                whole = values(with_len((2, 3, 2), axis, size), seed_of(mesh, m, size), dtype)
                got = mesh.collectives.allgather(part(whole, k, c, axis), m, axis, size)
                errors.expect(got.dtype == whole.dtype and np.array_equal(got, whole),
                              f"allgather over {m} (k={k}) axis {axis} size {size} {np.dtype(dtype)}")
        # a non-contiguous block
        whole = values(with_len((3, 4, 2), axis, k + 1), seed_of(mesh, m))
        got = mesh.collectives.allgather(part(whole.T, k, c, 2 - axis).T, m, axis, k + 1)
        errors.expect(np.array_equal(got, whole), f"allgather of a transposed block over {m}")
    errors.check()


@pytest.mark.mpi
@pytest.mark.parametrize("split_axis,concat_axis", [(0, 1), (1, 0), (2, 0), (1, 2), (0, 2)])
def test_alltoall(mesh: mm.Mesh, split_axis: int, concat_axis: int) -> None:
    errors = Errors()
    for m in mesh.shape.names:
        k, c = mesh.shape[m].size, mesh.coords[m]
        for size in lengths(k):
            for split in (size, k + 1):  # split blocks like the concat ones, or unequal ones (k > 1)
                for dtype in DTYPES:
                    shape = with_len(with_len((2, 3, 2), split_axis, split), concat_axis, size)
                    whole = values(shape, seed_of(mesh, m, size, split), dtype)
                    # coordinate c holds block c along concat_axis, all of split_axis; afterwards block c
                    # along split_axis, all of concat_axis
                    got = mesh.collectives.alltoall(part(whole, k, c, concat_axis), m, split_axis, concat_axis, size)
                    want = part(whole, k, c, split_axis)
                    errors.expect(got.dtype == want.dtype and np.array_equal(got, want),
                                  f"alltoall over {m} (k={k}) {split_axis}->{concat_axis} split {split} "
                                  f"size {size} {np.dtype(dtype)}: {got.shape} vs {want.shape}")
        # size None: equal concat blocks, unequal split blocks
        x = values(with_len((2, 3, 2), split_axis, k + 1), (RANK,))
        got = mesh.collectives.alltoall(x, m, split_axis, concat_axis)
        mine = len(np.array_split(np.arange(k + 1), k)[c])
        errors.expect(got.shape == with_len(with_len(x.shape, split_axis, mine), concat_axis, k * x.shape[concat_axis]),
                      f"alltoall over {m} without size: shape {got.shape}")
    errors.check()


@pytest.mark.mpi
@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter(mesh: mm.Mesh, axis: int, op: str) -> None:
    errors = Errors()
    reduce = {"sum": np.sum, "max": np.max}[op]
    for m in mesh.shape.names:
        k, c = mesh.shape[m].size, mesh.coords[m]
        group = [r for r in range(mesh.size) if all(
            int(rc) == mesh.coords[n] for n, rc in zip(mesh.shape.names, np.unravel_index(r, mesh.shape.sizes))
            if n != m)]
        for size in lengths(k):
            for dtype in ([np.float64, np.int32] if op == "max" else [np.float64, np.int32, np.complex128]):
                shape = with_len((2, 3, 2), axis, size)
                got = mesh.collectives.reduce_scatter(values(shape, (RANK, size), dtype), m, axis, op)
                total = reduce(np.stack([values(shape, (r, size), dtype) for r in group]), axis=0).astype(dtype)
                want = part(total, k, c, axis)
                errors.expect(got.dtype == want.dtype and np.array_equal(got, want),
                              f"reduce_scatter {op} over {m} (k={k}) axis {axis} size {size} {np.dtype(dtype)}")
    errors.check()


@pytest.mark.mpi(min_size=3)
def test_empty_blocks() -> None:
    """A dim of size 2 over N >= 3 ranks: ranks 2.. hold nothing, and still take part."""
    mesh = get_mesh(f"all:{N}")
    coll, c = mesh.collectives, mesh.coords["all"]
    whole = values((3, 2), (1,))
    mine = whole[:, c:c + 1]
    assert mine.shape == ((3, 1) if c < 2 else (3, 0))
    np.testing.assert_array_equal(coll.allgather(mine, "all", 1, 2), whole)
    got = coll.alltoall(mine, "all", 0, 1, 2)  # 3 rows over N: rows c (c < 3), each with both columns
    np.testing.assert_array_equal(got, whole[c:c + 1] if c < 3 else np.zeros((0, 2)))
    got = coll.reduce_scatter(whole, "all", 1)
    np.testing.assert_array_equal(got, N * mine)
    assert got.shape == mine.shape


@pytest.mark.mpi
def test_one_axis_alltoall_needs_equal_blocks(mesh: mm.Mesh) -> None:
    for m in (n for n in mesh.shape.names if mesh.shape[n].size > 1):
        k = mesh.shape[m].size
        with pytest.raises(mm.MpimeshError, match="alltoall along one axis needs equal blocks"):
            mesh.collectives.alltoall(np.zeros((k + 1, 2)), m, 0, 0)


# ---------------------------------------------------------------- counts

@pytest.mark.mpi
def test_counts_are_the_elements_sent(mesh: mm.Mesh) -> None:
    coll = mesh.collectives
    big = [d.name for d in mesh.shape if d.size > 1]
    want: dict = {}

    def add(kind: str, m: str, x: np.ndarray) -> None:
        c = want.setdefault(f"{kind}/{m}", {"calls": 0, "elements": 0, "bytes": 0})
        c["calls"], c["elements"], c["bytes"] = c["calls"] + 1, c["elements"] + x.size, c["bytes"] + x.nbytes

    with mm.profile() as prof:
        for m in mesh.shape.names:
            k, c = mesh.shape[m].size, mesh.coords[m]
            for size in (2, k + 1, 2 * k + 3):
                mine = part(np.ones((4, size), np.float32), k, c, 1)
                coll.allgather(mine, m, 1, size)
                coll.alltoall(mine, m, 0, 1, size)
                coll.reduce_scatter(np.ones((size, 3), np.int32), m, 0)
                if m in big:
                    add("allgather", m, mine)
                    add("alltoall", m, mine)
                    add("reduce_scatter", m, np.ones((size, 3), np.int32))
    assert {k: v for k, v in prof.counters.items() if k != "flops"} == want


@pytest.mark.mpi
def test_equal_blocks_with_size_change_nothing(mesh: mm.Mesh) -> None:
    coll = mesh.collectives
    errors = Errors()
    for m in mesh.shape.names:
        k = mesh.shape[m].size
        x = values((2 * k, 3, 4), (RANK,))
        with mm.profile() as plain:
            a = [coll.allgather(x, m, 1), coll.alltoall(x, m, 0, 1), coll.reduce_scatter(x, m, 0)]
        with mm.profile() as sized:
            b = [coll.allgather(x, m, 1, 3 * k), coll.alltoall(x, m, 0, 1, 3 * k), coll.reduce_scatter(x, m, 0)]
        errors.expect(all(np.array_equal(p, q) for p, q in zip(a, b)), f"values over {m}")
        errors.expect(plain.counters == sized.counters, f"counts over {m}: {plain.counters} vs {sized.counters}")
    errors.check()


# ---------------------------------------------------------------- the SPMD check


@pytest.mark.mpi(min_size=2)
def test_a_rank_with_another_size_or_block_diverges_everywhere(checked) -> None:
    mesh = get_mesh(f"all:{N}")
    coll, c = mesh.collectives, mesh.coords["all"]
    whole = values((N + 1, 2), (2,))
    mine = part(whole, N, c, 0)
    calls = {
        "another size": lambda: coll.allgather(mine, "all", 0, N + 1 + (c == 0)),
        "another block": lambda: coll.allgather(whole[:3] if c == N - 1 else mine, "all", 0, N + 1),
        "no size": lambda: coll.allgather(mine, "all", 0, None if c == 0 else N + 1),
        "alltoall size": lambda: coll.alltoall(mine, "all", 1, 0, N + 1 + (c == 0)),
        "alltoall split": lambda: coll.alltoall(values((N + 1 + (c == 0), 2), (3,)), "all", 0, 1),
        "reduce_scatter": lambda: coll.reduce_scatter(values((N + 1 + (c == 0), 2), (3,)), "all", 0),
    }
    for what, call in calls.items():
        with pytest.raises(mm.DivergenceError, match="ranks diverged") as info:
            call()
        assert f"rank {N - 1}: " in str(info.value), what
    # no data moved: the mesh still works
    np.testing.assert_array_equal(coll.allgather(mine, "all", 0, N + 1), whole)


# ---------------------------------------------------------------- the JAX twin

def _jax_run(fn, k: int, stacked: np.ndarray, mode: str):
    """`fn` on each of k devices of a 1-D mesh "all"; `stacked[c]` is device c's input."""
    import jax
    from jax.sharding import Mesh, PartitionSpec as P
    from mpimesh.tpu.replay import _shard_map
    if mode == "vmap":
        return np.asarray(jax.vmap(fn, axis_name="all")(stacked))
    mesh = Mesh(np.array(jax.devices()[:k]), ("all",))
    per = _shard_map(lambda b: fn(b[0])[None], mesh, P("all"), P("all"))
    return np.asarray(jax.jit(per)(stacked))


def _padded(x: np.ndarray, axis: int, width: int) -> np.ndarray:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, width - x.shape[axis])
    return np.pad(x, pad)


@pytest.mark.skipif(N != 1, reason="no MPI inside (k devices of one process): the "
                    "1-rank session runs the JAX twin")
@pytest.mark.parametrize("k,mode", [(3, "vmap"), (4, "vmap"), (3, "shard_map")])
def test_jax_twin(k: int, mode: str) -> None:
    pytest.importorskip("jax")
    from mpimesh.tpu.collectives import JaxCollectives
    ctx = JaxCollectives(mm.Shape(f"all:{k}"), vmapped=mode == "vmap")
    errors = Errors()
    for size in lengths(k):
        width = -(-size // k)  # the largest block: what each device holds
        whole = values((2, size), (size,))
        blocks = np.stack([_padded(part(whole, k, c, 1), 1, width) for c in range(k)])
        got = _jax_run(lambda b: ctx.allgather(b, "all", 1, size), k, blocks, mode)
        errors.expect(np.array_equal(got, np.stack([whole] * k)), f"allgather size {size}")
        every = np.stack([whole.T] * k)  # each device: all of axis 0
        got = _jax_run(lambda b: ctx.block(b, "all", 0), k, every, mode)
        errors.expect(np.array_equal(got, np.stack([_padded(part(whole.T, k, c, 0), 0, width) for c in range(k)])),
                      f"block size {size}")
        got = _jax_run(lambda b: ctx.reduce_scatter(b, "all", 0), k, every, mode)
        errors.expect(np.array_equal(got, np.stack([_padded(k * part(whole.T, k, c, 0), 0, width)
                                                    for c in range(k)])), f"reduce_scatter size {size}")
        got = _jax_run(lambda b: ctx.reduce_scatter(b, "all", 0, "max"), k, every, mode)
        errors.expect(np.array_equal(got, np.stack([_padded(part(whole.T, k, c, 0), 0, width) for c in range(k)])),
                      f"reduce_scatter max size {size}")
        # alltoall: (split 5, concat size) -> concat blocks to split blocks
        grid = values((5, size), (size, 1))
        split_width = -(-5 // k)
        ins = np.stack([_padded(part(grid, k, c, 1), 1, width) for c in range(k)])
        got = _jax_run(lambda b: ctx.alltoall(b, "all", 0, 1, size), k, ins, mode)
        want = np.stack([_padded(part(grid, k, c, 0), 0, split_width) for c in range(k)])
        errors.expect(np.array_equal(got, want), f"alltoall size {size}: {got.shape} vs {want.shape}")
    errors.check()
