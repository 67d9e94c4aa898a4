"""Which GPU a rank drives and which transport a mesh uses, decided the same way on every rank.

- device: this rank's index among the ranks on its node (`Split_type(COMM_TYPE_SHARED)`), modulo
  the GPUs it can see, unless given; its CuPy memory pool is capped at a share of that GPU
  (`backend.cap_gpu_pool`: 0.9 of its memory split among the mesh's ranks that drive it).
- transport (`None`: automatic): `"nccl"` when every rank of the mesh has a GPU of its own and CuPy
  has NCCL; else `"mpi"` when the MPI library says it reads GPU memory (`MPIX_Query_cuda_support`,
  or `MPIMESH_CUDA_AWARE_MPI=1` to force it, `=0` to deny it); else `"staged"`. The numpy backend
  uses `"mpi"` (or `"staged"`, which then stages through a second host buffer: a CPU test of that path).

>>> choose(MPI.COMM_SELF, "numpy", None, None)
(None, 'mpi')
"""
from __future__ import annotations

import ctypes
import socket
from typing import Optional

import numpy as np
from mpi4py import MPI

from .. import env
from ..backend import cap_gpu_pool, device_count, use_device
from ..errors import MeshError
from .nccl import nccl_module

TRANSPORTS = ("nccl", "mpi", "staged")


def node_rank(comm: MPI.Comm) -> tuple[int, int]:
    """(this rank's index among the ranks of `comm` on its node, how many there are)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def cuda_aware_mpi() -> bool:
    """Whether the MPI library reads GPU memory: `MPIMESH_CUDA_AWARE_MPI` if set (1/0, true/false,
    yes/no, on/off; anything else is an `MpimeshError`), else the library's
    own answer (Open MPI's `MPIX_Query_cuda_support`, MPICH's `MPIX_GPU_query_support`), else False."""
    forced = env.flag("MPIMESH_CUDA_AWARE_MPI", None)
    if forced is not None:
        return forced
    lib = ctypes.CDLL(None)  # mpi4py loaded the MPI library into this process
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        return bool(query())
    gpu_query = getattr(lib, "MPIX_GPU_query_support", None)
    if gpu_query is not None:
        flag = ctypes.c_int(0)
        return gpu_query(0, ctypes.byref(flag)) == 0 and bool(flag.value)  # 0: MPIX_GPU_SUPPORT_CUDA
    return False


def _all(comm: MPI.Comm, flag: bool) -> bool:
    """True on every rank iff `flag` is true on every rank of `comm`."""
    return bool(comm.allreduce(int(bool(flag)), op=MPI.MIN))


def choose(comm: MPI.Comm, backend: str, device: Optional[int], transport: Optional[str]):
    """(device index or None, transport name) for a mesh over `comm`; a collective over `comm`."""
    if transport is not None and transport not in TRANSPORTS:
        raise MeshError(f"unknown transport {transport!r}: choose one of {list(TRANSPORTS)} or None (automatic)")
    if backend == "numpy":
        if transport == "nccl":
            raise MeshError("transport 'nccl' needs backend='cupy' (NCCL moves GPU memory only)")
        if device is not None:
            raise MeshError(f"device={device!r} needs backend='cupy'")
        return None, transport or "mpi"
    count = device_count()
    index, _ = node_rank(comm)
    if device is None:
        device = index % count
    elif not (isinstance(device, (int, np.integer)) and 0 <= device < count):
        raise MeshError(f"device={device!r} on rank {comm.Get_rank()}: this rank sees {count} GPU(s), 0..{count - 1}")
    use_device(int(device))
    placed = comm.allgather((socket.gethostname(), int(device)))
    shared = len(set(placed)) < len(placed)
    cap_gpu_pool(int(device), placed.count(placed[comm.Get_rank()]))
    if transport in (None, "nccl"):
        try:
            nccl_module()
            has_nccl = True
        except Exception:
            has_nccl = False
        has_nccl = _all(comm, has_nccl)
        if transport == "nccl" and (shared or not has_nccl):
            host, dev = next(p for p in placed if placed.count(p) > 1) if shared else (None, None)
            why = (f"ranks share GPU {dev} on {host}, and NCCL refuses two ranks on one GPU" if shared
                   else "CuPy has no NCCL here")
            raise MeshError(f"transport 'nccl' is not possible: {why}; use transport='staged' or 'mpi', "
                            f"or None to choose automatically")
        if transport is None:
            transport = "nccl" if has_nccl and not shared else ("mpi" if _all(comm, cuda_aware_mpi()) else "staged")
    elif transport == "mpi" and not _all(comm, cuda_aware_mpi()):  # its collectives would hand MPI GPU pointers
        raise MeshError("transport 'mpi' needs an MPI library that reads GPU memory (CUDA-aware), and this one "
                        "does not say it does (MPIX_Query_cuda_support / MPIX_GPU_query_support, on some rank): "
                        "use transport='staged' (through host memory) or None (automatic); "
                        "MPIMESH_CUDA_AWARE_MPI=1 overrides the check")
    return int(device), transport
