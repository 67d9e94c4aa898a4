"""Placement (backend, device, transport), the collectives' buffer pool, and the staged transport's
buffers. Values of every collective on every transport are in test_collectives.py."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.collectives.mpi import BufferPool
from mpimesh.collectives.staged import StagingBuffers

N = MPI.COMM_WORLD.Get_size()
HAS_CUPY = importlib.util.find_spec("cupy") is not None


@pytest.mark.mpi
def test_numpy_mesh_reports_its_placement():
    mesh = mm.Mesh(f"all:{N}", backend="numpy")
    assert (mesh.backend, mesh.device, mesh.transport) == ("numpy", None, "mpi")
    assert mesh.collectives.transport == "mpi"
    staged = mm.Mesh(f"all:{N}", transport="staged", backend="numpy")
    assert staged.transport == staged.collectives.transport == "staged"


@pytest.mark.mpi
@pytest.mark.parametrize("kwargs,message", [
    ({"transport": "nccl", "backend": "numpy"}, "transport 'nccl' needs backend='cupy'"),
    ({"transport": "carrier-pigeon"}, "unknown transport 'carrier-pigeon'"),
    ({"device": 0, "backend": "numpy"}, "device=0 needs backend='cupy'"),
    ({"backend": "torch"}, "unknown backend 'torch'"),
])
def test_bad_placement_is_refused_on_every_rank(kwargs, message):
    with pytest.raises(mm.MpimeshError, match=message):
        mm.Mesh(f"all:{N}", **kwargs)


@pytest.mark.mpi
def test_backend_from_the_environment(monkeypatch):
    monkeypatch.setenv("MPIMESH_BACKEND", "numpy")
    assert mm.Mesh(f"all:{N}").backend == "numpy"
    monkeypatch.setenv("MPIMESH_BACKEND", "tpu")
    with pytest.raises(mm.MpimeshError, match="unknown backend 'tpu' \\(from MPIMESH_BACKEND\\)"):
        mm.Mesh(f"all:{N}")
    assert mm.Mesh(f"all:{N}", backend="numpy").backend == "numpy"  # an argument beats the variable


@pytest.mark.mpi
@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed: this checks the message where it is not")
def test_cupy_backend_without_cupy_says_what_to_install():
    with pytest.raises(mm.MpimeshError, match=r"needs CuPy.*python3 install.py gpu"):
        mm.Mesh(f"all:{N}", backend="cupy")


# ---------------------------------------------------------------- the buffer pool

def test_pool_never_hands_out_a_live_buffer():
    pool = BufferPool(np, min_bytes=64)
    a = pool.empty((32,), np.float32)
    a[:] = 1.0
    view = a[::2]  # only a view is left: the buffer is still in use
    del a
    b = pool.empty((32,), np.float32)
    b[:] = 2.0
    np.testing.assert_array_equal(view, 1.0)
    assert not np.shares_memory(view, b)


def test_pool_recycles_idle_buffers_by_size_and_device():
    pool = BufferPool(np, min_bytes=64)
    a = pool.empty((32,), np.float32)
    address = a.ctypes.data
    del a
    assert pool.empty((4, 8), np.float32).ctypes.data == address  # same bytes, another shape
    c = pool.empty((8, 2), np.float64)  # same size again: the buffer is idle once more
    assert c.ctypes.data == address
    other = BufferPool(np, device=1, min_bytes=64)
    assert other.empty((32,), np.float32).ctypes.data != address  # pools are per transport
    small = pool.empty((4,), np.float32)  # under min_bytes: never pooled
    assert small.base is None


def test_pool_forgets_everything_past_its_byte_limit():
    pool = BufferPool(np, min_bytes=64, max_bytes=256)
    held = [pool.empty((32,), np.float32) for _ in range(3)]  # 3 x 128 bytes > 256
    for h, v in zip(held, (1.0, 2.0, 3.0)):
        h[:] = v
    for h, v in zip(held, (1.0, 2.0, 3.0)):
        np.testing.assert_array_equal(h, v)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("transport", ["mpi", "staged"])
def test_collective_outputs_survive_later_collectives(transport):
    """Outputs from the pool (>= 256 KiB) stay intact while held, whatever runs after them."""
    mesh = mm.Mesh(f"all:{N}", transport=transport, backend="numpy")  # (host buffer pools)
    coll = mesh.collectives
    n = 1 << 16  # 256 KiB of float32
    outs, views = [], []
    for i in range(6):
        y = coll.allreduce(np.full(n, i + mesh.rank, np.float32), ["all"])
        if i % 2:
            views.append((i, y[1::3]))  # keep only a view
        else:
            outs.append((i, y))
        del y
    rank_sum = N * (N - 1) / 2
    for i, y in outs + views:
        np.testing.assert_array_equal(y, N * i + rank_sum)
    addresses = {y.__array_interface__["data"][0] for _, y in outs}
    assert len(addresses) == len(outs)
    # With nothing held any more, the next output reuses one of those buffers instead of allocating
    pooled = {y.ctypes.data for _, y in outs} | {v.base.ctypes.data for _, v in views}
    del outs, views
    z = coll.allreduce(np.ones(n, np.float32), ["all"])
    assert z.ctypes.data in pooled
    np.testing.assert_array_equal(z, N)


def test_staging_buffers_are_reused():
    bufs = StagingBuffers(np)
    a = bufs.take(1024)
    b = bufs.take(1024)
    assert a is not b
    bufs.give(a)
    assert bufs.take(1024) is a
    assert bufs.take(2048).nbytes == 2048
