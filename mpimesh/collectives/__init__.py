"""Collectives over mesh dims, one file per transport behind one interface (`base.Collectives`).

`make(mesh)` builds the transport the mesh chose (`placement.choose`): `mpi.py` (host buffers, or
GPU buffers for a CUDA-aware MPI), `staged.py` (GPU -> pinned host -> MPI -> GPU), `nccl.py`.
`guard.py` adds the SPMD check and time-outs to all of them, and each feeds the profile (`mpimesh.counters`);
`shm.py` sums host buffers of ranks on one node through shared memory, for `mpi.py`.

>>> from mpimesh import Mesh, MPI
>>> type(make(Mesh("all:1", comm=MPI.COMM_SELF))).__name__
'MpiCollectives'
"""
from .mpi import MpiCollectives
from .nccl import NcclCollectives
from .staged import StagedCollectives


def make(mesh):
    """The collectives of `mesh`, over the transport named by `mesh.transport`."""
    if mesh.transport == "nccl":
        return NcclCollectives(mesh)
    if mesh.transport == "staged":
        return StagedCollectives(mesh)
    return MpiCollectives(mesh)


__all__ = ["make"]
