"""Sums through shared memory (`mpimesh.collectives.shm`): the same values as MPI's allreduce.

Every rank's array is drawn from its own seed, so every rank can make every other's: the reference
is numpy's float64 reduction of the group's arrays, and, for float sums, the MPI library's own
`Allreduce` of the same arrays on the group's communicator, which the shared path must equal
bitwise (it sums in MPICH's order; under another MPI library, on more than 2 ranks, the gathered
arrays summed in that order). Groups are each mesh dim and all of them, on 1-D, 2-D and 3-D
meshes; lengths that do not divide by the group size; in place, out of place, non-blocking; a
rank whose buffer is not shared (MPI then sums); the path switched off; lengths that differ; a
data-parallel step's gradients with it on and off; and a rank that leaves while the others sum.
"""
from __future__ import annotations

import gc
import itertools
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.collectives import shm
from mpimesh.launch import find_mpiexec, job_env
from meshes import mesh_shapes

ROOT = Path(__file__).resolve().parents[1]
N = MPI.COMM_WORLD.Get_size()
LENGTH = shm.MIN_BYTES // 4 + 13  # float32 elements: over the threshold, not a multiple of 2, 3, 4 or 8
_UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def _array(rank: int, length: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, length).astype(dtype)
    return (rng.standard_normal(length) * 10.0 ** rng.integers(-2, 3)).astype(dtype)


def _groups(mesh) -> list:
    names = mesh.shape.names
    return [(n,) for n in names] + ([tuple(names)] if len(names) > 1 else [])


def _group_ranks(mesh, dims) -> list:
    """Mesh ranks of this rank's group over `dims`, in the group's order (row-major over dims)."""
    others = {n: mesh.coords[n] for n in mesh.shape.names if n not in dims}
    ranks = []
    for r in range(mesh.size):
        coords = np.unravel_index(r, mesh.shape.sizes)
        c = dict(zip(mesh.shape.names, (int(i) for i in coords)))
        if all(c[n] == v for n, v in others.items()):
            ranks.append(r)
    return ranks


def _expected(mesh, dims, length, dtype, op):
    parts = [_array(r, length, dtype).astype(np.float64) for r in _group_ranks(mesh, dims)]
    return _UFUNCS[op].reduce(parts)


def _mpi(mesh, dims, x, op):
    """The MPI library's own allreduce of `x` over the group."""
    y = x.copy()
    mesh.comm_for(dims).Allreduce(MPI.IN_PLACE, y, op={"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op])
    return y


def _shared(mesh, dims, x, op):
    """What the shared path must give bitwise: MPI's own allreduce under MPICH, whose order it
    takes, and under any library on 2 ranks (a + b is b + a); elsewhere (Open MPI's order may
    differ) the group's arrays, gathered, summed here in MPICH's order."""
    comm = mesh.comm_for(dims)
    if op == "sum" and comm.Get_size() > 2 and "MPICH" not in MPI.Get_library_version():
        return shm.tree_reduce([np.array(p) for p in comm.allgather(x)], np.add)
    return _mpi(mesh, dims, x, op)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
def test_in_place_sums_equal_mpi_bitwise(shape):
    mesh = mm.Mesh(shape, backend="numpy")
    coll = mesh.collectives
    for dims, (dtype, op) in itertools.product(_groups(mesh), [("float32", "sum"), ("float64", "sum"),
                                                              ("int64", "sum"), ("float32", "max"), ("int32", "min")]):
        x = coll.bucket_buffer(LENGTH, dtype, dims)
        assert (shm.arena.locate(x) is not None) == (coll.size(dims) > 1 and shm.enabled()), (dims, dtype)
        x[...] = _array(mesh.rank, LENGTH, dtype)
        reference = _shared(mesh, dims, x, op)
        got = coll.allreduce(x, dims, op, out=x)
        assert got is x
        np.testing.assert_array_equal(got, reference, err_msg=f"{shape} {dims} {dtype} {op}")
        np.testing.assert_allclose(got, _expected(mesh, dims, LENGTH, dtype, op), rtol=1e-5, atol=1e-3)
    if mesh.size > 1:
        assert all(coll._shm_groups.values()), coll._shm_groups  # every group here shares this node


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
def test_out_of_place_and_non_blocking_sums(shape):
    mesh = mm.Mesh(shape, backend="numpy")
    coll = mesh.collectives
    for dims in _groups(mesh):
        x = _array(mesh.rank, LENGTH, np.float32).reshape(-1, 1)  # private memory, 2-D
        kept = x.copy()
        for _ in range(2):  # the first probes the group
            y = coll.allreduce(x, dims)
            np.testing.assert_array_equal(x, kept)  # the input is left alone
            np.testing.assert_array_equal(y, _shared(mesh, dims, kept, "sum"))
            assert (shm.arena.locate(y) is not None) == (coll.size(dims) > 1)  # the result lies in shared memory
        buffers = [coll.bucket_buffer(LENGTH, np.float32, dims) for _ in range(2)]
        for j, b in enumerate(buffers):
            b[...] = _array(mesh.rank + j, LENGTH, np.float32)
        refs = [_shared(mesh, dims, b, "sum") for b in buffers]
        requests = [coll.iallreduce(b, dims, out=b) for b in buffers]  # two in flight, waited in order
        for b, req, ref in zip(buffers, requests, refs):
            assert req.wait() is b
            np.testing.assert_array_equal(b, ref)


@pytest.mark.mpi
def test_a_rank_whose_buffer_is_private_makes_mpi_sum():
    mesh = mm.Mesh(f"all:{N}", backend="numpy")
    coll = mesh.collectives
    x = np.empty(LENGTH, np.float32) if mesh.rank == 0 else coll.bucket_buffer(LENGTH, np.float32, ("all",))
    x[...] = _array(mesh.rank, LENGTH, np.float32)
    reference = _mpi(mesh, ("all",), x, "sum")
    np.testing.assert_array_equal(coll.iallreduce(x, ("all",), out=x).wait(), reference)


@pytest.mark.mpi
def test_switched_off():
    mesh = mm.Mesh(f"all:{N}", backend="numpy")
    coll = mesh.collectives
    shm.set_enabled(False)
    try:
        x = coll.bucket_buffer(LENGTH, np.float64, ("all",))
        assert shm.arena.locate(x) is None
        x[...] = _array(mesh.rank, LENGTH, np.float64)
        reference = _mpi(mesh, ("all",), x, "sum")
        np.testing.assert_array_equal(coll.allreduce(x, ("all",), out=x), reference)
    finally:
        shm.set_enabled(True)


@pytest.mark.mpi(min_size=2)
def test_lengths_that_differ_are_a_clear_error_on_every_rank():
    mesh = mm.Mesh(f"all:{N}", backend="numpy")
    coll = mesh.collectives
    n = LENGTH + 4 * mesh.rank
    x = coll.bucket_buffer(n, np.float32, ("all",))
    x[...] = 1
    with pytest.raises(mm.MpimeshError, match=r"different buffers \(rank 0: \d+ bytes of float32, rank 1: "):
        coll.allreduce(x, ("all",), out=x)
    y = coll.bucket_buffer(LENGTH, np.float32, ("all",))  # the mesh is still usable: nothing was summed
    y[...] = 1
    np.testing.assert_array_equal(coll.allreduce(y, ("all",), out=y), np.full(LENGTH, float(N), np.float32))


def _data_parallel_grads(mesh, bucket_bytes):
    rng = np.random.default_rng(3)
    x_g, w_g = rng.standard_normal((8 * N, 64)), rng.standard_normal((64, 4100))  # w: 1 MiB in float32
    x = mesh.from_numpy(x_g.astype(np.float32), f"batch:{8 * N};i:64")
    w = mesh.from_numpy(w_g.astype(np.float32), "i:64;h:4100")
    g = _data_parallel_step(x, w, bucket_bytes)
    reference = 2 * x_g.T @ (x_g @ w_g)  # d/dw sum((xw)^2), float64
    return g.to_numpy(), reference


def _data_parallel_step(x, w, bucket_bytes=25 << 20):
    with mm.layout_scope(x.mesh, f"batch:{x.mesh.shape.names[0]}"), mm.trace():
        y = mm.einsum([x, w])  # [batch, h]
        (g,) = mm.gradients([mm.reduce_sum(y * y)], [w], bucket_bytes=bucket_bytes)
    return g


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
def test_data_parallel_gradients_the_same_bitwise(shape):
    mesh = mm.Mesh(shape, backend="numpy")
    on, reference = _data_parallel_grads(mesh, 25 << 20)
    shm.set_enabled(False)
    try:
        off, _ = _data_parallel_grads(mesh, 25 << 20)
        unbucketed, _ = _data_parallel_grads(mesh, 0)
    finally:
        shm.set_enabled(True)
    np.testing.assert_allclose(on, reference, rtol=1e-4, atol=1e-2)
    if mesh.shape[0].size > 2 and "MPICH" not in MPI.Get_library_version():
        return  # MPI's order (off) may differ from MPICH's (on) in the last bits
    np.testing.assert_array_equal(on, off)
    np.testing.assert_array_equal(on, unbucketed)


@pytest.mark.mpi
def test_buffers_are_reused_once_their_gradients_are_gone():
    """Eager steps and compiled replays alike, with the cycle collector off: nothing keeps a step's
    gradients alive once the caller drops them (a reference cycle in the walker of a compiled step's
    results once did: every replay then had a private buffer, summed through MPI)."""
    mesh = mm.Mesh(f"all:{N}", backend="numpy")
    rng = np.random.default_rng(4)
    x = mesh.from_numpy(rng.standard_normal((8 * N, 64)).astype(np.float32), f"batch:{8 * N};i:64")
    w = mesh.from_numpy(rng.standard_normal((64, 4100)).astype(np.float32), "i:64;h:4100")
    step = mm.compile(_data_parallel_step)
    expected = _data_parallel_step(x, w).to_numpy()
    gc.disable()
    try:
        for run in (lambda: _data_parallel_step(x, w), lambda: step(x, w)):
            made = shm.arena._serial
            for _ in range(4):
                np.testing.assert_array_equal(run().to_numpy(), expected)
            assert shm.arena._serial - made <= 1  # one buffer at most, made on the first step, then reused
    finally:
        gc.enable()
    assert step.replays == 3


@pytest.mark.skipif(N != 1, reason="spawns its own 2-rank job; runs in the 1-rank session")
def test_a_rank_that_leaves_makes_the_other_raise(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        import numpy as np
        import mpimesh as mm
        mesh = mm.Mesh("all:2", backend="numpy")
        coll = mesh.collectives
        x = coll.bucket_buffer({LENGTH}, np.float32, ["all"])
        x[...] = 1
        coll.allreduce(x, ["all"], out=x)   # both take part once: shared memory, probed
        with open(f"warm-{{mesh.rank}}", "w") as f:  # a file per rank: two ranks' stdout lines may interleave
            f.write(str(x[0]))
        if mesh.rank == 1:
            sys.exit(0)
        t0 = time.monotonic()
        try:
            coll.iallreduce(x, ["all"], out=x).wait()
        except mm.CollectiveTimeoutError as e:
            print(f"raised after {{time.monotonic() - t0:.1f}} s: {{e}}", flush=True)
            raise
    """))
    env = job_env(PYTHONPATH=str(ROOT))
    env.pop("MPIMESH_COLLECTIVE_TIMEOUT", None)
    start = time.monotonic()
    proc = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(script)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0 and time.monotonic() - start < 60, proc
    assert [(tmp_path / f"warm-{r}").read_text() for r in (0, 1)] == ["2.0", "2.0"]
    assert "raised after" in proc.stdout and "rank 1 left the job" in proc.stdout, proc.stdout + proc.stderr
