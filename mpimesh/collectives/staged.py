"""The staged transport: device -> pinned host buffer -> MPI -> device, for any MPI library and for
ranks that share a GPU (which NCCL refuses).

Only `_post` differs from `mpi.py`: it copies the input into a reused host staging buffer, runs the
MPI transfer there, and copies the result back when it completes; each copy counts in the profile
as `"d2h/<mesh dims>"` or `"h2d/<mesh dims>"`. On numpy the copies are plain host copies, uncounted.

>>> from mpimesh import Mesh
>>> import numpy as np
>>> coll = Mesh("all:1", comm=MPI.COMM_SELF, transport="staged").collectives
>>> coll.transport, coll.allreduce(np.ones(2), ("all",))
('staged', array([1., 1.]))
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .. import counters, flight
from ..backend import on_gpu, pinned_empty
from .base import DONE, Request
from .mpi import MpiCollectives


class StagingBuffers:
    """Reusable host buffers by size: page-locked for a GPU backend, plain numpy otherwise.

    >>> bufs = StagingBuffers(np)
    >>> a = bufs.take(16); bufs.give(a); bufs.take(16) is a
    True
    """

    def __init__(self, xp):
        self._gpu = on_gpu(xp)
        self._free: dict[int, list] = {}

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 host buffer of `nbytes`, this caller's until `give`."""
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        if self._gpu:
            return pinned_empty(nbytes)
        return np.empty(nbytes, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """Return `buf` for reuse."""
        self._free.setdefault(buf.nbytes, []).append(buf)


class StagedCollectives(MpiCollectives):
    """MPI collectives on host copies of this rank's (GPU) arrays."""

    transport = "staged"

    def __init__(self, mesh):
        super().__init__(mesh)
        self.staging = StagingBuffers(mesh.xp)

    def _host_view(self, buf: np.ndarray, like) -> np.ndarray:
        return buf.view(like.dtype).reshape(like.shape)

    def _post(self, kind, dims, send, recv, op=None, dest=None, src=None, counts=None) -> Request:
        if isinstance(send, np.ndarray) and self._device:
            return super()._post(kind, dims, send, recv, op, dest, src, counts)  # host control values
        hs_raw, hr_raw = self.staging.take(send.nbytes), self.staging.take(recv.nbytes)
        hs, hr = self._host_view(hs_raw, send), self._host_view(hr_raw, recv)
        self._to_host(send, hs, dims)
        inner = super()._post(kind, dims, hs, hr, op, dest, src, counts)
        arrives = not (kind == "permute" and src == MPI.PROC_NULL)  # else `recv` keeps its zeros

        def back():
            if arrives:
                self._to_device(hr, recv, dims)
            self.staging.give(hs_raw)
            self.staging.give(hr_raw)

        if inner is DONE:
            back()
            return DONE
        return Request(inner.test, inner.wait, back)

    def _to_host(self, src, dst: np.ndarray, dims: tuple) -> None:
        if not self._device:
            np.copyto(dst, src)
            return
        counters.record("d2h", dims, src.size, src.nbytes)
        t0 = flight.clock()
        src.get(out=dst)  # synchronises with the stream that wrote `src`
        if flight.timeline:
            flight.span(t0, "d2h", "copy", {"bytes": int(src.nbytes), "mesh_dims": list(dims)})

    def _to_device(self, src: np.ndarray, dst, dims: tuple) -> None:
        if not self._device:
            np.copyto(dst, src)
            return
        counters.record("h2d", dims, src.size, src.nbytes)
        t0 = flight.clock()
        dst.set(src)
        self.xp.cuda.get_current_stream().synchronize()  # the staging buffer is reused right after
        if flight.timeline:
            flight.span(t0, "h2d", "copy", {"bytes": int(src.nbytes), "mesh_dims": list(dims)})
