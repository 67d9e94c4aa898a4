"""The MPI transport: collectives over mpi4py's buffer methods on host buffers, or on GPU buffers
when the MPI library is CUDA-aware (`transport="mpi"` with the cupy backend).

Every collective takes its output from the transport's `BufferPool` (or receives into `out=`),
counts itself in an open profile, runs the guard's checks, and hands the transfer to `_post`, the
one method the staged and NCCL transports replace. Unequal blocks take the v-variants. 16-bit
floats move as their 16-bit words and are summed in float32, rounded once. Details:
docs/collectives.md.

>>> from mpimesh import Mesh
>>> import numpy as np
>>> coll = Mesh("all:1", comm=MPI.COMM_SELF).collectives
>>> coll.transport, coll.allreduce(np.ones(3), ("all",))
('mpi', array([1., 1., 1.]))
"""
from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from ..backend import accumulation_dtype, contiguous, is_low_precision, on_gpu, on_host, wire_dtype
from ..errors import CollectiveTimeoutError, MpimeshError
from ..layout import block_sizes
from .. import counters, flight
from . import guard, shm
from .base import (DONE, Collectives, Overlapped, Request, block_counts, idle, merge_front, pack,
                   split_front, unpack)
from .guard import Guard, uneven_shape

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
# kind -> (blocking, non-blocking) mpi4py method
_CALLS = {"allreduce": ("Allreduce", "Iallreduce"), "allgather": ("Allgather", "Iallgather"),
          "alltoall": ("Alltoall", "Ialltoall"), "reduce_scatter": ("Reduce_scatter_block", "Ireduce_scatter_block"),
          "exscan": ("Exscan", "Iexscan")}
_VCALLS = {"allgather": ("Allgatherv", "Iallgatherv"), "alltoall": ("Alltoallv", "Ialltoallv"),
           "reduce_scatter": ("Reduce_scatter", "Ireduce_scatter")}  # unequal blocks


class BufferPool:
    """Output buffers of one transport, keyed by device and size. Numpy buffers of `min_bytes` or more
    are views of uint8 arrays kept here (a fresh one would take a page fault per page when MPI first
    writes it), handed out again once no array holds them; GPU buffers come from CuPy's pool.

    >>> pool = BufferPool(np, min_bytes=8)
    >>> a, b = pool.empty((4,), np.float32), pool.empty((4,), np.float32)
    >>> a.base is b.base                       # `a` is alive: `b` gets another buffer
    False
    >>> address = a.ctypes.data; del a
    >>> pool.empty((2, 2), np.float32).ctypes.data == address   # `a`'s, idle now, is handed out again
    True
    """

    def __init__(self, xp, device=None, min_bytes: int = 1 << 18, max_bytes: int = 256 << 20, per_size: int = 4):
        self.xp, self.device = xp, device
        self.min_bytes, self.max_bytes, self.per_size = min_bytes, max_bytes, per_size
        self._host = on_host(xp)  # (GPU buffers come from CuPy's pool)
        self._bufs: dict[tuple, list] = {}
        self._bytes = 0

    def empty(self, shape: tuple, dtype):
        """An uninitialised array of `shape` and `dtype`."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes or not self._host:
            return self.xp.empty(shape, dtype)
        key = (self.device, nbytes)
        bufs = self._bufs.setdefault(key, [])
        for i in range(len(bufs)):
            if idle(bufs, i):
                return bufs[i].view(dtype).reshape(shape)
        raw = np.empty(nbytes, np.uint8)
        if len(bufs) < self.per_size:
            if self._bytes + nbytes > self.max_bytes:
                self._bytes = 0
                self._bufs.clear()  # forget everything: idle buffers are freed, busy ones live on with their users
                bufs = self._bufs[key] = []
            bufs.append(raw)
            self._bytes += nbytes
        return raw.view(dtype).reshape(shape)


class _TwoStep(Request):
    """The request of a non-blocking allreduce in two steps (of 16-bit floats, or through shared
    memory, `shm.py`): the first step's transfer (an alltoall; the records' allgather) is in flight;
    the second (reduce, then the allgather; the sum, then a barrier) starts in a drain of its
    transport's `SecondSteps`, which runs where every rank of the group is: at its `wait`, or at the
    start of any later collective, never inside a `test()` poll. Until then `test()` only lets the
    alltoall progress and says False. So every rank starts its transfers in the same order, however
    it orders its waits and whatever collectives come between them."""

    __slots__ = ("_first", "_second", "_req", "_queue")

    def __init__(self, first: Request, second, queue: "SecondSteps"):
        super().__init__(None, None)  # no bound methods of its own: a cycle would keep the buffers until a GC
        self._first, self._second, self._req, self._queue = first, second, None, queue
        queue.append(self)  # (until its second step starts)

    def start_second(self) -> None:
        if self._req is None:
            self._queue.drain()

    def _begin(self) -> None:
        self._req = self._second()
        self._first = self._second = self._queue = None  # the buffers they hold can go once the transfer has

    def test(self) -> bool:
        if not self._done:
            if self._req is None:
                self._first.test()
                return False
            if self._req.test():
                self._complete()
        return self._done

    def wait(self):
        if not self._done:
            self.start_second()
            self._req.wait()
        return self._complete()


class SecondSteps(list):
    """The two-step requests whose second step has not started, in start order. `drain()` starts
    them all, in that order (a second step's own transfers do not drain again). It runs before any
    collective starts and at a wait: the same program points on every rank, so the ranks post the
    same transfers in the same order.

    >>> q, log = SecondSteps(), []
    >>> a, b = (_TwoStep(None, lambda n=n: log.append(n), q) for n in "ab")
    >>> b.start_second(); log, len(q)
    (['a', 'b'], 0)
    """

    draining = False

    def drain(self) -> None:
        if self.draining:
            return
        self.draining, op = True, guard.in_op[0]
        guard.in_op[0] = ""  # (they belong to the ops that started them, not to the one draining them)
        try:
            while self:
                self.pop(0)._begin()
        finally:
            self.draining, guard.in_op[0] = False, op


class MpiCollectives(Collectives):
    """The collectives of one mesh, over MPI sub-communicators per set of mesh dims."""

    transport = "mpi"
    fills_out = True

    def __init__(self, mesh):
        super().__init__(mesh.shape, mesh.xp)
        self.mesh = mesh
        self.pool = BufferPool(mesh.xp, mesh.device)
        self.guard = Guard(mesh.watch, mesh.shape, mesh.coords)
        self._device = on_gpu(mesh.xp)
        self._host_pool = BufferPool(np) if self._device else self.pool
        self._mpi_comms: dict[tuple, MPI.Comm] = {}  # `mesh.comm_for`'s, by ordered dims
        self._shm_groups: dict[tuple, bool] = {}  # whether the group over dims sums through shared memory
        self._two_steps = SecondSteps()  # the two-step allreduces whose second step has not started
        self._counted = None  # (kind, bytes, counted) of a 16-bit reduction, for its first step's timeline event

    def _on(self, x):
        """(array module, buffer pool) for `x`: host control values stay on the host on any backend."""
        return (np, self._host_pool) if isinstance(x, np.ndarray) else (self.xp, self.pool)

    def coord(self, mesh_dim: str) -> int:
        """This rank's coordinate along `mesh_dim`."""
        return self.mesh.coords[mesh_dim]

    def _slice(self, x, axis: int, start, n: int):
        return x[(slice(None),) * axis + (slice(start, start + n),)].copy()  # a copy: the full array can go

    def _comm(self, dims: tuple) -> MPI.Comm:
        comm = self._mpi_comms.get(dims)
        if comm is None:
            comm = self._mpi_comms[dims] = self.mesh.comm_for(dims)
        return comm

    def bucket_buffer(self, n: int, dtype, mesh_dims):
        """Gradient buckets' flat buffers: on the host, shared memory where the group over `mesh_dims`
        may sum through it (`shm.py`), else pooled (no page faults each step); on a GPU, CuPy's pool."""
        dtype = np.dtype(dtype)
        raw = self._shared(n * dtype.itemsize, self.ordered(mesh_dims)) if not self._device else None
        return self.pool.empty((n,), dtype) if raw is None else raw.view(dtype)

    def _shared(self, nbytes: int, dims: tuple):
        """A shared-memory uint8 buffer of `nbytes` for sums over `dims` (`shm.Arena`), or None."""
        if self.transport == "mpi" and self.size(dims) > 1 and nbytes >= shm.MIN_BYTES and shm.enabled() \
                and self._shm_groups.get(dims) is not False:
            return shm.arena.empty(nbytes)
        return None

    def _summable(self, x, op: str) -> bool:
        """Whether an allreduce `op` of `x` may go through shared memory: a large host array of numbers
        (16-bit floats travel in two steps of their own), summed, maxed or minned."""
        return (self.transport == "mpi" and op in _OPS and isinstance(x, np.ndarray) and x.dtype.kind in "iufc"
                and not is_low_precision(x.dtype) and x.nbytes >= shm.MIN_BYTES and shm.enabled())

    def _through_shm(self, dims: tuple, x, op) -> bool:
        """Whether an in-place allreduce of `x` over `dims` goes through shared memory (probing the
        group the first time: the same answer on every rank of it)."""
        if not self._summable(x, op):
            return False
        ok = self._shm_groups.get(dims)
        if ok is None:
            ok = self._shm_groups[dims] = shm.probe(self._comm(dims),
                                                    lambda r, what: self.guard.wait_mpi(r, what, dims))
        return ok

    # The transfer: the one step other transports replace ------------------------------------
    def _post(self, kind: str, dims: tuple, send, recv, op=None, dest=None, src=None, counts=None) -> Request:
        """Start `kind` from `send` into `recv` over `dims`, non-blocking (`guard.wait` polls it as
        fast as a blocking call would complete; see `guard.py`).
        `counts`: for unequal blocks, (elements to each coordinate, elements from each coordinate)."""
        comm = self._comm(dims)
        if self._device and not isinstance(send, np.ndarray):  # CUDA-aware MPI reads GPU memory:
            self.xp.cuda.get_current_stream().synchronize()    # the kernels that wrote `send` must be done
        in_place = send is recv  # an allreduce into its input
        if is_low_precision(send.dtype):  # move the raw words (16-bit floats are never reduced by MPI:
            assert op is None, kind        # `_exchange16` moves them, float32 sums them)
            send, recv = send.view(wire_dtype(send.dtype)), recv.view(wire_dtype(recv.dtype))
        if in_place:
            send = MPI.IN_PLACE
        if kind == "permute":
            reqs = [comm.Irecv(recv, src, 0), comm.Isend(send, dest, 0)]
            return Request(lambda: MPI.Request.Testall(reqs), lambda: MPI.Request.Waitall(reqs))
        if counts is None:
            calls, args = _CALLS[kind], (send, recv)
        elif kind == "reduce_scatter":
            calls, args = _VCALLS[kind], (send, recv, list(counts[1]))
        else:  # [buffer, counts], the counts a list (mpi4py reads a tuple as (counts, displacements))
            sends, recvs = list(counts[0]), list(counts[1])
            calls, args = _VCALLS[kind], ([send, sends] if kind == "alltoall" else send, [recv, recvs])
        args += () if op is None else (_OPS[op],)
        req = getattr(comm, calls[1])(*args)
        return Request(req.Test, req.Wait)

    def _run(self, kind: str, dims: tuple, send, recv, elements: int, nbytes: int, detail: str,
             shape=None, **kw) -> None:
        """Check, count, post and complete one transfer (`detail`: the call's parameters, and `shape`
        the local shape where it is not send's, for the check)."""
        self._complete(self._start(kind, dims, send, recv, elements, nbytes, detail, shape, **kw), dims)

    def _start(self, kind: str, dims: tuple, send, recv, elements: int, nbytes: int, detail: str,
               shape=None, **kw) -> Request:
        """Check, count and post one transfer: its request (`DONE` where nothing moves), with its
        event where a timeline records (`_spanned`)."""
        req = self._transfer(kind, dims, send, recv, elements, nbytes, detail, shape, **kw)
        if flight.timeline:
            self._spanned(req, kind, dims, nbytes)
        return req

    def _spanned(self, req: Request, kind: str, dims: tuple, nbytes: int) -> None:
        """The open timeline's event of the transfer `req` just started, from this rank's arrival to
        its completion (`_complete`; at once for `DONE`). The first step of a reduction of 16-bit
        floats carries the count of the whole (`_counted`, set by `_exchange16`); a step that the
        profile did not count says so. The transfers a drain starts belong to non-blocking requests,
        whose one event `Overlapped` keeps: they get none."""
        carried, self._counted = self._counted, None
        if self._two_steps.draining:
            return
        kind, nbytes, counted = carried if carried is not None else (kind, nbytes, bool(counters.opened))
        event = flight.begin(self.guard.arrived, kind, dims, nbytes, self.guard.seq, self.guard.timeline_key(dims),
                             counted)
        if req is DONE:
            flight.end(event)
        else:
            req.span = event

    def _transfer(self, kind: str, dims: tuple, send, recv, elements: int, nbytes: int, detail: str,
                  shape=None, **kw) -> Request:
        """`_start`'s check, count and post. First the second steps of the two-step requests started
        before it (`SecondSteps`)."""
        self._two_steps.drain()
        self.guard.enter(kind, dims, send, detail, shape)
        counters.record(kind, dims, elements, nbytes)
        if self.mesh.size > 1 and not self.mesh.has_comm(dims):
            # making a sub-communicator is a blocking collective over the whole mesh: first make sure,
            # polled, that every rank is here
            self.guard.wait_mpi(self.guard.comm.Ibarrier(), f"making the communicator over {'+'.join(dims)}")
        if send.size == 0 and kw.get("counts") is None:  # an empty block: the whole group has nothing to send
            self.mesh.comm_for(dims)  # but a first use makes the communicator, over the whole mesh: join it
            return DONE
        if kind == "allreduce" and self._through_shm(dims, send, kw["op"]):  # (the same answer on every rank)
            if recv is not send:
                recv[...] = send  # summed in place: in shared memory where `recv` lies there
            comm, op = self._comm(dims), _OPS[kw["op"]]
            run = shm.ShmAllreduce(comm, recv, kw["op"], lambda: comm.Iallreduce(MPI.IN_PLACE, recv, op=op))
            records = Request(run.records.Test, run.records.Wait)

            def second() -> Request:
                self._complete(records, dims)
                req = run.second()
                return Request(req.Test, req.Wait)
            return _TwoStep(records, second, self._two_steps)
        return self._post(kind, dims, send, recv, **kw)

    def _complete(self, req: Request, dims: tuple) -> None:
        """Wait for `req`, polled (see `guard.wait`)."""
        if req is DONE:
            return
        if isinstance(req, _TwoStep):
            req.start_second()  # here, where every rank of the group completes its requests in the same order
        try:
            self.guard.wait(req, dims)
        except CollectiveTimeoutError:
            getattr(req, "abort", lambda: None)()  # a NCCL group that will never finish
            raise
        req.wait()
        if flight.timeline:
            flight.end(getattr(req, "span", None))

    # The collectives ------------------------------------------------------------------------
    def _group_rank(self, dims: tuple) -> int:
        """This rank's rank in the group over `dims` (row-major over their coordinates, as `comm_for`)."""
        j = 0
        for m in dims:
            j = j * self._sizes[m] + self.mesh.coords[m]
        return j

    def _exchange16(self, kind: str, dims: tuple, send, sizes: tuple, op: str, shape, detail: str = "",
                    dtype=None) -> tuple:
        """Start the first step of a reduction over `dims` of the 16-bit floats in flat `send` (or of
        wider partials rounded to 16-bit `dtype`): an alltoall of the raw words (block j of `sizes`
        to group rank j). Returns its request and a function that completes it and gives this rank's
        block of the reduction, in float32 in rank order, rounded once to `dtype` (default send's).
        Counted as one `kind` of `send` (`shape`: the local shape the SPMD check compares)."""
        k, j = len(sizes), self._group_rank(dims)
        dtype = send.dtype if dtype is None else dtype
        recv = self._on(send)[1].empty((k * sizes[j],), send.dtype)
        counters.record(kind, dims, send.size, counters.reduction_bytes(send.size, send.itemsize, dtype.itemsize))
        if flight.timeline:
            self._counted = (kind, counters.reduction_bytes(send.size, send.itemsize, dtype.itemsize),
                             bool(counters.opened))
        what = "16-bit floats" if dtype == send.dtype else f"{send.dtype} partials of a {dtype} result"
        with counters.paused():
            first = self._start("alltoall", dims, send, recv, send.size, send.nbytes,
                                f" {op} ({kind} of {what}{detail})", shape,
                                counts=(tuple(sizes), (sizes[j],) * k))

        def reduced():
            self._complete(first, dims)
            rows = recv.reshape(k, sizes[j])
            wide = rows.astype(accumulation_dtype(rows.dtype), copy=False)
            return getattr(self._on(rows)[0], op)(wide, axis=0).astype(dtype)  # sum, max or min
        return first, reduced

    def _allreduce_rounded(self, x, dims: tuple, op: str, dtype):
        """Wider partials (float32) into a 16-bit result: the alltoall moves the partials, each rank
        reduces its block in rank order and rounds it once, and the allgather moves 16-bit words:
        three quarters of a float32 allreduce's bytes, the same values."""
        if not (is_low_precision(dtype) and x.size):
            return super()._allreduce_rounded(x, dims, op, dtype)
        xp, pool = self._on(x)
        x, out = contiguous(xp, x), pool.empty(x.shape, dtype)
        self._complete(self._allreduce16(x, dims, op, out, "")[1](), dims)
        return out

    def _allreduce(self, x, dims: tuple, op: str, out=None):
        xp, pool = self._on(x)
        x = contiguous(xp, x)
        out = self._result(x, dims, op) if out is None else out
        if is_low_precision(x.dtype) and x.size:  # `out` may be `x`: the alltoall has read it when the allgather runs
            self._complete(self._allreduce16(x, dims, op, out, "")[1](), dims)
            return out
        self._run("allreduce", dims, x, out, x.size, x.nbytes, f" {op}", op=op)
        return out

    def _result(self, x, dims: tuple, op: str):
        """A buffer for the allreduce of `x`: shared memory unless the group is known not to sum
        through it (`_start` probes it at its first such sum, after the SPMD check), so that even
        that first sum runs in the shared path's order."""
        raw = self._shared(x.nbytes, dims) if self._summable(x, op) else None
        return self._on(x)[1].empty(x.shape, x.dtype) if raw is None else raw.view(x.dtype).reshape(x.shape)

    def _allreduce16(self, x, dims: tuple, op: str, out, detail: str) -> tuple:
        """The allreduce of 16-bit floats in two steps (see the module): starts the alltoall
        (`_exchange16`) and returns its request and the second step, a function that completes it,
        reduces, and starts the allgather into `out` (returning that request)."""
        sizes = block_sizes(x.size, self.size(dims))
        first, reduced = self._exchange16("allreduce", dims, x.reshape(-1), sizes, op, x.shape, detail, out.dtype)

        def second() -> Request:
            mine = reduced()
            with counters.paused():
                return self._start("allgather", dims, mine, out.reshape(-1), mine.size, mine.nbytes,
                                   f" {op} (allreduce to 16-bit floats{detail})", x.shape,
                                   counts=((mine.size,) * len(sizes), sizes))
        return first, second

    def _iallreduce(self, x, dims: tuple, op: str, out=None) -> Request:
        x = contiguous(self._on(x)[0], x)
        out = self._result(x, dims, op) if out is None else out
        if is_low_precision(x.dtype) and x.size:
            first, second = self._allreduce16(x, dims, op, out, ", non-blocking")
            req, begun = _TwoStep(first, second, self._two_steps), first
        else:
            req = begun = self._start("allreduce", dims, x, out, x.size, x.nbytes, f" {op} (non-blocking)", op=op)

        def wait():
            if isinstance(req, _TwoStep):
                req.start_second()  # the allgather starts here, at a point every rank reaches alike
            self._complete(req, dims)

        def then(send=x):  # the request owns `send` and `out` until it completes
            req.wait()
            return out
        return Overlapped(req.test, wait, then, getattr(begun, "span", None) if flight.timeline else None)

    def _allgather(self, x, mesh_dim: str, axis: int, sizes, out=None):
        args, kw, finish = self._gathering(x, mesh_dim, axis, sizes, out)
        self._run(*args, **kw)
        return finish()

    def _iallgather(self, x, mesh_dim: str, axis: int, sizes) -> Request:
        return self._overlapped(*self._gathering(x, mesh_dim, axis, sizes))

    def _gathering(self, x, mesh_dim: str, axis: int, sizes, out=None) -> tuple:
        """An allgather as `(args, kw, finish)`: `_run`'s (or `_start`'s) arguments, and what gives the
        result once the transfer is complete."""
        k, (xp, pool) = self.size((mesh_dim,)), self._on(x)
        x = contiguous(xp, x)
        front = axis == 0 or math.prod(x.shape[:axis]) == 1  # blocks stack in memory: receive straight into the result
        dims, detail = (mesh_dim,), f" axis {axis}"
        if sizes is not None:
            counts = block_counts(x.shape, axis, sizes)
            flat = out.reshape(-1) if out is not None and front else pool.empty((sum(counts),), x.dtype)
            args = ("allgather", dims, x, flat, x.size, x.nbytes, detail,
                    uneven_shape(x.shape, axis, sizes, self.coord(mesh_dim)))
            kw = {"counts": ((x.size,) * k, counts)}
            if not front:
                return args, kw, lambda: unpack(xp, flat, x.shape, axis, sizes)
            shape = x.shape[:axis] + (sum(sizes),) + x.shape[axis + 1:]
            return args, kw, (lambda: flat.reshape(shape)) if out is None else (lambda: out)
        if front:
            shape = x.shape[:axis] + (k * x.shape[axis],) + x.shape[axis + 1:]
            recv = pool.empty(shape, x.dtype) if out is None else out
            return ("allgather", dims, x, recv, x.size, x.nbytes, detail), {}, lambda: recv
        every = pool.empty((k,) + x.shape, x.dtype)
        return ("allgather", dims, x, every, x.size, x.nbytes, detail), {}, lambda: merge_front(xp, every, axis)

    def _overlapped(self, args: tuple, kw: dict, finish) -> Request:
        """Start the transfer `_start(*args, **kw)` without waiting: an `Overlapped` request (counted
        in the profile's overlap) whose `wait()` completes it and gives `finish()`."""
        req, dims = self._start(*args, **kw), args[1]

        def then(send=args[2], recv=args[3]):  # the request owns its buffers until it completes
            req.wait()
            return finish()
        return Overlapped(req.test, lambda: self._complete(req, dims), then,
                          getattr(req, "span", None) if flight.timeline else None)

    def _alltoall(self, x, mesh_dim: str, split_axis: int, concat_axis: int, sizes, out=None):
        k, (xp, pool) = self.size((mesh_dim,)), self._on(x)
        if sizes is not None:
            (splits, concats), c = sizes, self.coord(mesh_dim)
            send = pack(xp, x, split_axis, splits)
            piece = x.shape[:split_axis] + (splits[c],) + x.shape[split_axis + 1:]  # each sender's block for us
            counts = (block_counts(x.shape, split_axis, splits), block_counts(piece, concat_axis, concats))
            front = math.prod(piece[:concat_axis]) == 1  # arriving blocks stack in memory
            recv = out.reshape(-1) if out is not None and front else pool.empty((sum(counts[1]),), x.dtype)
            self._run("alltoall", (mesh_dim,), send, recv, send.size, send.nbytes, f" axes {split_axis}->{concat_axis}",
                      uneven_shape(x.shape, concat_axis, concats, c), counts=counts)
            if front:
                return recv.reshape(piece[:concat_axis] + (sum(concats),) + piece[concat_axis + 1:]) \
                    if out is None else out
            return unpack(xp, recv, piece, concat_axis, concats)
        flat = split_axis == concat_axis == 0  # blocks go and come back along axis 0: no reshaping
        send = contiguous(xp, x) if flat else split_front(xp, x, split_axis, k)
        if out is not None and (flat or concat_axis == 0):  # arriving blocks stack along axis 0 of `out`
            recv = out.reshape(send.shape)
            self._run("alltoall", (mesh_dim,), send, recv, send.size, send.nbytes, f" axes {split_axis}->{concat_axis}")
            return out
        recv = pool.empty(send.shape, send.dtype)
        self._run("alltoall", (mesh_dim,), send, recv, send.size, send.nbytes, f" axes {split_axis}->{concat_axis}")
        return recv if flat else merge_front(xp, recv, concat_axis)

    def _reduce_scatter(self, x, mesh_dim: str, axis: int, op: str, sizes, out=None):
        k, xp = self.size((mesh_dim,)), self._on(x)[0]
        if is_low_precision(x.dtype):
            sizes = sizes or block_sizes(x.shape[axis], k)
            c = self.coord(mesh_dim)
            mine = self._exchange16("reduce_scatter", (mesh_dim,), pack(xp, x, axis, sizes),
                                    block_counts(x.shape, axis, sizes), op, x.shape)[1]()
            return mine.reshape(x.shape[:axis] + (sizes[c],) + x.shape[axis + 1:])
        args, kw = self._scattering(x, mesh_dim, axis, op, sizes, out)
        self._run(*args, **kw)
        return args[3]

    def _ireduce_scatter(self, x, mesh_dim: str, axis: int, op: str, sizes) -> Request:
        if is_low_precision(x.dtype):  # (two steps: blocking)
            return super()._ireduce_scatter(x, mesh_dim, axis, op, sizes)
        args, kw = self._scattering(x, mesh_dim, axis, op, sizes)
        return self._overlapped(args, kw, lambda: args[3])

    def _scattering(self, x, mesh_dim: str, axis: int, op: str, sizes, out=None) -> tuple:
        """A reduce-scatter of wide words as `(args, kw)` for `_run` or `_start`; its result is `args[3]`."""
        k, (xp, pool) = self.size((mesh_dim,)), self._on(x)
        detail = f" {op} axis {axis}"
        if sizes is not None:
            send, counts = pack(xp, x, axis, sizes), block_counts(x.shape, axis, sizes)
            c = self.coord(mesh_dim)
            recv = pool.empty(x.shape[:axis] + (sizes[c],) + x.shape[axis + 1:], x.dtype) if out is None else out
            return ("reduce_scatter", (mesh_dim,), send, recv, send.size, send.nbytes, detail), \
                {"op": op, "counts": (counts, counts)}
        if axis == 0:  # block j is already the j-th contiguous slab
            send = contiguous(xp, x)
            shape = (x.shape[0] // k,) + x.shape[1:]
        else:
            send = split_front(xp, x, axis, k)
            shape = send.shape[1:]
        recv = pool.empty(shape, x.dtype) if out is None else out
        return ("reduce_scatter", (mesh_dim,), send, recv, send.size, send.nbytes, detail), {"op": op}

    def _permute(self, x, mesh_dim: str, offset: int, wrap: bool, out=None):
        k, c = self.size((mesh_dim,)), self.mesh.coords[mesh_dim]
        dest, src = c + offset, c - offset
        if wrap:
            dest, src = dest % k, src % k
        dest = dest if 0 <= dest < k else MPI.PROC_NULL
        src = src if 0 <= src < k else MPI.PROC_NULL
        xp, pool = self._on(x)
        x = contiguous(xp, x)
        # Zeros only where nothing arrives; otherwise the receive overwrites every element.
        if out is None:
            out = xp.zeros_like(x) if src == MPI.PROC_NULL else pool.empty(x.shape, x.dtype)
        elif src == MPI.PROC_NULL:
            out[...] = 0
        sends = dest != MPI.PROC_NULL
        self._run("permute", (mesh_dim,), x, out, x.size if sends else 0, x.nbytes if sends else 0,
                  f" offset {offset} wrap {wrap}", dest=dest, src=src)
        return out

    def _exscan(self, x, mesh_dim: str, op: str):
        if is_low_precision(x.dtype):  # in float32, rounded once
            return self._exscan(x.astype(accumulation_dtype(x.dtype)), mesh_dim, op).astype(x.dtype)
        xp = self._on(x)[0]
        x = contiguous(xp, x)
        out = xp.zeros_like(x)
        self._run("exscan", (mesh_dim,), x, out, x.size, x.nbytes, f" {op}", op=op)
        if self.mesh.coords[mesh_dim] == 0:
            out[...] = 0
        return out

    # Control values (host, never counted) ----------------------------------------------------
    def any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank (for errors only one rank can see).
        Polled by the guard like a collective (on its communicator: no other is made here), so a
        rank that left raises here instead of leaving the others waiting."""
        if self.mesh.size == 1:
            return bool(flag)
        mine, out = np.array([int(bool(flag))], np.int32), np.zeros(1, np.int32)
        self.guard.enter("any_rank", tuple(self.mesh.shape.names), mine)
        self.guard.wait_mpi(self.guard.comm.Iallreduce(mine, out, op=MPI.MAX), None)
        return bool(out[0])

    def broadcast(self, x, root: int = 0, out=None):
        """A copy of mesh rank `root`'s numpy array `x` on every rank (into `out`, a C-contiguous
        numpy array of x's shape and dtype, where given); every rank passes an array of the same shape
        and dtype. For small control values (names, flags); like `any_rank`, not counted."""
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < self.mesh.size:
            raise MpimeshError(f"broadcast: root must be a rank of the mesh, 0 to {self.mesh.size - 1}, got {root!r}")
        if out is None:
            out = np.array(x, copy=True, order="C")
        else:
            x = np.asarray(x)
            self._check_out(out, x, x.shape, "broadcast")
            if not (isinstance(out, np.ndarray) and out.flags.c_contiguous):
                raise MpimeshError(f"broadcast: out must be a C-contiguous numpy array, got {type(out).__name__}")
            out[...] = x
        if self.mesh.size > 1:  # (polled, as any_rank)
            self.guard.enter("broadcast", tuple(self.mesh.shape.names), out, f" from rank {root}")
            words = out.view(wire_dtype(out.dtype)) if is_low_precision(out.dtype) else out  # (mpi4py: no bfloat16)
            self.guard.wait_mpi(self.guard.comm.Ibcast(words, root=root), None)
        return out
