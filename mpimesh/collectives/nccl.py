"""The NCCL transport: GPU collectives on CuPy arrays, one NCCL communicator per sub-mesh group.

Each transfer is enqueued on the current CuPy stream (nothing synchronises the host); alltoall,
permute and unequal blocks are grouped point-to-point sends and receives of the real lengths.
Dtypes NCCL lacks move as bytes; host arrays take MPI. Needs CuPy with NCCL and one GPU per rank.
How communicators are made, and time-outs: docs/collectives.md.

>>> _DTYPES["bfloat16"], _REDUCE["sum"]  # what each dtype and reduction is sent as
('NCCL_BFLOAT16', 'NCCL_SUM')
"""
from __future__ import annotations

from itertools import accumulate

import numpy as np
from mpi4py import MPI

from ..backend import contiguous, is_low_precision
from ..errors import DTypeError
from .. import counters, flight
from .base import DONE, Overlapped, Request
from .guard import Guard
from .mpi import MpiCollectives

_REDUCE = {"sum": "NCCL_SUM", "max": "NCCL_MAX", "min": "NCCL_MIN"}
_DTYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
           "bfloat16": "NCCL_BFLOAT16", "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
           "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "bool": "NCCL_UINT8"}


def nccl_module():
    """`cupy.cuda.nccl`, or an ImportError saying what is missing."""
    from cupy.cuda import nccl
    if not getattr(nccl, "available", True):
        raise ImportError("CuPy was built without NCCL")
    return nccl


class NcclCollectives(MpiCollectives):
    """Collectives over NCCL communicators, one per set of mesh dims (made lazily)."""

    transport = "nccl"

    def __init__(self, mesh):
        super().__init__(mesh)
        self._nccl = nccl_module()
        self._comms: dict[tuple, object] = {}
        self._side = None  # the stream of non-blocking allreduces, made on first use

    def _comm(self, dims: tuple):
        """The NCCL communicator of this rank's group over `dims`; its rank order is the MPI group's."""
        comm = self._comms.get(dims)
        if comm is None:
            group = self.mesh.comm_for(dims)
            uid = np.zeros(128, np.int64)
            if group.Get_rank() == 0:
                uid[:] = self._nccl.get_unique_id()
            # polled: a rank that never comes is named under the time-out (NCCL's init then meets every rank)
            self.guard.wait_mpi(group.Ibcast(uid, root=0), f"making the NCCL communicator over {'+'.join(dims)}", dims)
            comm = self._nccl.NcclCommunicator(group.Get_size(), tuple(int(v) for v in uid), group.Get_rank())
            self._comms[dims] = comm
        return comm

    def _dtype(self, x):
        return getattr(self._nccl, _DTYPES[_name(x)])

    def _post_as(self, kind, dims, send, recv, op, dest, src, counts) -> Request:
        """A transfer of a dtype NCCL lacks (int16, uint16, complex): a move as its raw bytes, a
        complex sum as its real and imaginary parts, an int16/uint16 reduction widened to int32 and
        rounded back (exact: int32 sums wrap to the int16 ones), enqueued after it on the stream."""
        name = _name(send)
        if op is None or (name.startswith("complex") and op == "sum"):
            wire = np.dtype(np.uint8 if op is None else {"complex64": np.float32, "complex128": np.float64}[name])
            k = np.dtype(send.dtype).itemsize // wire.itemsize
            counts = None if counts is None else tuple(tuple(c * k for c in side) for side in counts)
            return self._post(kind, dims, send.reshape(-1).view(wire), recv.reshape(-1).view(wire), op, dest, src,
                              counts)
        if name in ("int16", "uint16"):
            wide = send.astype(np.int32)
            out = wide if recv is send else self.xp.empty(recv.shape, np.int32)
            req = self._post(kind, dims, wide, out, op, dest, src, counts)
            recv[...] = out.astype(recv.dtype)
            return req
        raise DTypeError(f"the nccl transport cannot {op}-reduce dtype {send.dtype}")

    def _post(self, kind, dims, send, recv, op=None, dest=None, src=None, counts=None) -> Request:
        if isinstance(send, np.ndarray):
            return super()._post(kind, dims, send, recv, op, dest, src, counts)  # host control values: MPI
        if _name(send) not in _DTYPES:
            return self._post_as(kind, dims, send, recv, op, dest, src, counts)
        nccl, comm = self._nccl, self._comm(dims)
        stream = self.xp.cuda.get_current_stream()
        s, dt, n = stream.ptr, self._dtype(send), send.size
        if counts is not None:  # unequal blocks, packed one after another
            (sends, recvs), item = counts, send.itemsize
            nccl.groupStart()
            if kind == "reduce_scatter":
                for root, at in enumerate(_starts(sends)):
                    comm.reduce(send.data.ptr + at * item, recv.data.ptr, sends[root], dt,
                                getattr(nccl, _REDUCE[op]), root, s)
            else:  # allgather sends all of `send` to every peer
                froms = _starts(sends) if kind == "alltoall" else (0,) * len(sends)
                for peer, (at, to) in enumerate(zip(froms, _starts(recvs))):
                    comm.send(send.data.ptr + at * item, sends[peer], dt, peer, s)
                    comm.recv(recv.data.ptr + to * item, recvs[peer], dt, peer, s)
            nccl.groupEnd()
        elif kind == "allreduce":
            comm.allReduce(send.data.ptr, recv.data.ptr, n, dt, getattr(nccl, _REDUCE[op]), s)
        elif kind == "allgather":
            comm.allGather(send.data.ptr, recv.data.ptr, n, dt, s)
        elif kind == "reduce_scatter":
            comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size, dt, getattr(nccl, _REDUCE[op]), s)
        elif kind == "alltoall":
            k = self.size(dims)
            step = send.nbytes // k
            nccl.groupStart()
            for peer in range(k):
                comm.send(send.data.ptr + peer * step, n // k, dt, peer, s)
                comm.recv(recv.data.ptr + peer * step, n // k, dt, peer, s)
            nccl.groupEnd()
        elif kind == "permute":
            nccl.groupStart()
            if dest != MPI.PROC_NULL:
                comm.send(send.data.ptr, n, dt, dest, s)
            if src != MPI.PROC_NULL:
                comm.recv(recv.data.ptr, recv.size, dt, src, s)  # (a pipeline's sendrecv: sizes may differ)
            nccl.groupEnd()
        else:
            raise NotImplementedError(kind)
        if not Guard.polls_device():
            return DONE  # ordered on the stream: nothing to wait for on the host
        done = self.xp.cuda.Event(disable_timing=True)
        done.record(stream)
        return _Aborting(done, comm)

    def _iallreduce(self, x, dims: tuple, op: str, out=None) -> Request:
        """The allreduce on a side stream that first waits for the current stream's work so far: the
        kernels enqueued after it overlap the transfer; `wait()` makes the current stream wait for it
        (the host does not block, unless a time-out is set: then it polls). 16-bit floats take both
        steps of `_allreduce16` on the side stream, enqueued at once (NCCL does not block the host)."""
        if isinstance(x, np.ndarray):
            return super()._iallreduce(x, dims, op, out)
        cuda = self.xp.cuda
        x = contiguous(self.xp, x)
        out = self.pool.empty(x.shape, x.dtype) if out is None else out  # `out` may be `x`: NCCL reduces in place
        main = cuda.get_current_stream()
        if self._side is None:
            self._side = cuda.Stream(non_blocking=True)
        ready = cuda.Event(disable_timing=True)
        ready.record(main)
        self._side.wait_event(ready)
        with self._side:  # `_post` enqueues on the current stream: the side one
            if is_low_precision(x.dtype) and x.size:  # summed in float32, rounded once, as blocking
                req = self._allreduce16(x, dims, op, out, ", non-blocking")[1]()  # both steps enqueued now
            else:
                req = self._start("allreduce", dims, x, out, x.size, x.nbytes, f" {op} (non-blocking)", op=op)
        done = cuda.Event(disable_timing=True)
        done.record(self._side)

        def wait():
            self._complete(req, dims)  # polls under a time-out, else returns at once
            main.wait_event(done)

        def then(send=x):  # the request owns `send` and `out` until it completes
            return out
        return Overlapped(lambda: done.done, wait, then, getattr(req, "span", None) if flight.timeline else None)

    def _exscan(self, x, mesh_dim: str, op: str):
        if isinstance(x, np.ndarray):
            return super()._exscan(x, mesh_dim, op)
        xp, dims = self.xp, (mesh_dim,)
        k, c = self.size(dims), self.mesh.coords[mesh_dim]
        x = contiguous(xp, x)
        every = self.pool.empty((k,) + x.shape, x.dtype)
        if flight.timeline:  # (the allgather's timeline event shows the exscan's count)
            self._counted = ("exscan", x.nbytes, bool(counters.opened))
        with counters.paused():  # counted once, as the exscan it is
            self._run("allgather", dims, x, every, x.size, x.nbytes, f" exscan {op}")
        counters.record("exscan", dims, x.size, x.nbytes)
        if c == 0:
            return xp.zeros_like(x)
        before = every[:c]
        return {"sum": before.sum, "max": before.max, "min": before.min}[op](axis=0).astype(x.dtype, copy=False)


def _name(x) -> str:
    """The dtype name NCCL's table knows it by."""
    return "bfloat16" if x.dtype.name == "bfloat16" else np.dtype(x.dtype).name


def _starts(counts) -> tuple:
    """Where each of the blocks of `counts` elements starts when packed one after another."""
    return (0,) + tuple(accumulate(counts))[:-1]


class _Aborting(Request):
    """A NCCL transfer polled through a CUDA event; the communicator is aborted if it is abandoned."""

    __slots__ = ("_event", "_nccl_comm")

    def __init__(self, event, comm):
        super().__init__(lambda: event.done, event.synchronize)
        self._event, self._nccl_comm = event, comm

    def abort(self) -> None:
        self._nccl_comm.abort()
