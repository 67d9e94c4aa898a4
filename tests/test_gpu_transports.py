"""GPU transports (staged, CUDA-aware MPI, NCCL), pinned staging buffers, host-device copy counts and
the device choice. Every test skips cleanly where CuPy or a GPU is missing; NCCL between ranks needs
one GPU per rank, so on a single GPU those skip too (NCCL refuses two ranks on one GPU)."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.backend import device_count, to_host

N = MPI.COMM_WORLD.Get_size()
GPUS = device_count()

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(GPUS == 0, reason="needs CuPy and a GPU")]


def _node_rank() -> int:
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def _inputs(mesh, n: int = 6):
    return np.arange(n, dtype=np.float32) + 10 * mesh.rank


def test_device_is_the_node_rank_modulo_the_gpus():
    mesh = mm.Mesh(f"all:{N}", backend="cupy", transport="staged")
    import cupy
    assert mesh.device == _node_rank() % GPUS == cupy.cuda.Device().id
    assert mesh.backend == "cupy" and isinstance(mesh.ones("a:4").local, cupy.ndarray)


def test_bad_device_is_refused():
    with pytest.raises(mm.MeshError, match="sees"):
        mm.Mesh(f"all:{N}", backend="cupy", device=GPUS)


@pytest.mark.parametrize("transport", ["staged", "mpi", "nccl"])
def test_every_collective_on_gpu_matches_numpy(transport):
    if transport == "nccl" and N > GPUS:
        pytest.skip(f"nccl needs a GPU per rank: {N} ranks, {GPUS} GPU(s)")
    if transport == "mpi" and not _cuda_aware():
        pytest.skip("the MPI library is not CUDA-aware (test_mpi_transport_needs_a_cuda_aware_mpi)")
    import cupy
    mesh = mm.Mesh(f"all:{N}", backend="cupy", transport=transport)
    assert mesh.transport == transport
    coll = mesh.collectives
    every = [np.arange(6, dtype=np.float32) + 10 * r for r in range(N)]
    x = cupy.asarray(_inputs(mesh))
    with mm.profile() as prof:
        np.testing.assert_array_equal(to_host(coll.allreduce(x, ["all"])), sum(every))
        np.testing.assert_array_equal(to_host(coll.allgather(x, "all", 0)), np.concatenate(every))
        if 6 % N == 0:
            blocks = [np.split(e, N)[mesh.rank] for e in every]
            np.testing.assert_array_equal(to_host(coll.alltoall(x, "all", 0, 0)), np.concatenate(blocks))
            np.testing.assert_array_equal(to_host(coll.reduce_scatter(x, "all", 0)), np.split(sum(every), N)[mesh.rank])
        np.testing.assert_array_equal(to_host(coll.permute(x, "all", 1)), every[(mesh.rank - 1) % N])
        want = sum(every[:mesh.rank]) if mesh.rank else np.zeros(6, np.float32)
        np.testing.assert_array_equal(to_host(coll.exscan(x, "all")), want)
    if N > 1:
        staged = {k: v for k, v in prof.counters.items() if k.startswith(("d2h/", "h2d/"))}
        assert bool(staged) == (transport == "staged")
        if transport == "staged":  # every collective's input went down and its output came back
            assert prof.counters["d2h/all"]["calls"] == prof.counters["h2d/all"]["calls"] >= 4 + 2 * (6 % N == 0)


def test_mpi_transport_needs_a_cuda_aware_mpi(monkeypatch):
    """transport="mpi" hands MPI GPU pointers: an MPI library that cannot read them crashed the job
    (a segmentation fault in the first allreduce); it is refused at once, on every rank, saying why."""
    monkeypatch.setenv("MPIMESH_CUDA_AWARE_MPI", "0")
    with pytest.raises(mm.MeshError, match="transport 'mpi' needs an MPI library that reads GPU memory"):
        mm.Mesh(f"all:{N}", backend="cupy", transport="mpi")
    monkeypatch.setenv("MPIMESH_CUDA_AWARE_MPI", "1")  # the user's word for it
    assert mm.Mesh(f"all:{N}", backend="cupy", transport="mpi").transport == "mpi"


@pytest.mark.parametrize("dtype", ["int16", "uint16", "complex64", "complex128"])
def test_nccl_moves_and_sums_the_dtypes_it_lacks(dtype):
    """NCCL has no int16, uint16 or complex type: they move as bytes, a complex sum goes as float
    pairs, an int16 sum or max in int32 (each raised an error); against numpy on the global values."""
    if N > GPUS:
        pytest.skip(f"nccl needs a GPU per rank: {N} ranks, {GPUS} GPU(s)")
    import cupy
    mesh = mm.Mesh(f"all:{N}", backend="cupy", transport="nccl")
    coll = mesh.collectives
    every = [(np.arange(6) * (1 + 1j if "complex" in dtype else 1) + 10 * r).astype(dtype) for r in range(N)]
    x = cupy.asarray(every[mesh.rank])
    np.testing.assert_array_equal(to_host(coll.allreduce(x, ["all"])), sum(every).astype(dtype))
    np.testing.assert_array_equal(to_host(coll.allgather(x, "all", 0)), np.concatenate(every))
    np.testing.assert_array_equal(to_host(coll.permute(x, "all", 1)), every[(mesh.rank - 1) % N])
    if "int" in dtype:
        np.testing.assert_array_equal(to_host(coll.allreduce(x, ["all"], "max")), np.max(every, axis=0))


def test_ops_make_no_host_round_trips():
    mesh = mm.Mesh(f"all:{N}", backend="cupy", layout="batch:all")
    x = mesh.random_normal(f"batch:{4 * N};d:8", seed=0)
    w = mesh.random_normal("d:8;h:4", seed=1)
    with mm.profile() as prof:
        y = mm.softmax(mm.einsum([x, w]), "h")
        mm.reduce_sum(y)
    assert "d2h" not in prof.counters and "h2d" not in prof.counters
    with mm.profile() as prof:
        y.to_numpy()
    assert prof.counters["d2h"]["calls"] >= 1  # the one copy that is asked for is counted


def test_staging_buffers_are_pinned_and_reused():
    import cupyx  # noqa: F401
    from mpimesh.collectives.staged import StagingBuffers
    import cupy
    bufs = StagingBuffers(cupy)
    a = bufs.take(4096)
    ptr = a.ctypes.data
    assert cupy.cuda.runtime.pointerGetAttributes(ptr).type == cupy.cuda.runtime.memoryTypeHost
    bufs.give(a)
    assert bufs.take(4096).ctypes.data == ptr


def _cuda_aware() -> bool:
    from mpimesh.collectives.placement import cuda_aware_mpi
    return bool(MPI.COMM_WORLD.allreduce(int(cuda_aware_mpi()), op=MPI.MIN))
