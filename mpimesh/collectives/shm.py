"""In-place sums over the ranks of one node through shared memory: no message, the data read once.

Where every rank's buffer lies in memory each rank of the group can map (`Arena.empty`: a `memfd`
mapped by the others through /proc), rank j of k sums block j of every rank's buffer into block j
of every one, in MPICH's order (`tree_reduce`), so values are bitwise `MPI_Allreduce`'s
(`ShmAllreduce`; else the sum goes through MPI). For buffers of at least `MIN_BYTES`, on groups
that `probe` finds on one node; off with `MPIMESH_SHM=0` or `set_enabled(False)`. The steps, the
pool's caps and measured times: docs/collectives.md.

>>> import numpy as np
>>> tree_reduce([np.array([1.0]), np.array([2.0]), np.array([4.0])], np.add).tolist()
[7.0]
"""
from __future__ import annotations

import mmap
import os
from typing import Optional

import numpy as np
from mpi4py import MPI

from .. import env
from ..errors import MpimeshError
from ..layout import block_span
from .base import idle

MIN_BYTES = 1 << 20  # smaller sums are latency-bound: MPI's own path is as fast
MAX_BYTES = 1 << 30  # bytes of shared buffers one process keeps at most
MAX_BUFFERS = 64  # and how many (each holds a file descriptor open)
PER_SIZE = 4  # shared buffers of one size at most (a step's live gradient buckets)
_BLOCK = 1 << 18  # bytes of each rank's block reduced at a time (k of them stay in cache)
_FIELDS = 7  # pid, serial, fd, offset, bytes, dtype character, shared (1) or not (0)
_OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


_settings = {"enabled": env.early(env.flag, "MPIMESH_SHM", True)}  # a bad value: raised at first use


def set_enabled(enabled: bool) -> None:
    """Whether in-place sums of shared buffers go through shared memory (call on every rank alike)."""
    _settings["enabled"] = bool(enabled)


def enabled() -> bool:
    """Whether the shared-memory path is on (`MPIMESH_SHM`, `set_enabled`); only on Linux (memfd)."""
    env.raise_kept("MPIMESH_SHM")
    return _settings["enabled"] and hasattr(os, "memfd_create")


def tree_reduce(parts: list, ufunc):
    """`ufunc` over `parts` (equal arrays, in rank order) in MPICH's allreduce order: with k = 2^p + r,
    parts 2i and 2i+1 are combined for i < r, then the 2^p values pairwise, pairs of pairs, ...
    In place: the result is `parts[0]` (the other parts may be overwritten too)."""
    k = len(parts)
    if k == 1:
        return parts[0]
    pof2 = 1 << (k.bit_length() - 1)
    rem = k - pof2
    level = [ufunc(parts[2 * i], parts[2 * i + 1], out=parts[2 * i]) for i in range(rem)] + list(parts[2 * rem:])
    while len(level) > 2:
        level = [ufunc(level[2 * i], level[2 * i + 1], out=level[2 * i]) for i in range(len(level) // 2)]
    return ufunc(level[0], level[1], out=level[0])


class Arena:
    """This process's shared buffers: each a memfd mapped here, handed out as uint8 arrays; found
    again by the array a view of it names as its base (`locate`), and mapped from other ranks by
    (pid, serial, fd) (`peer`)."""

    def __init__(self):
        self._pool: dict[int, list] = {}  # nbytes -> uint8 arrays
        self._where: dict[int, tuple] = {}  # id(uint8 array) -> (serial, fd)
        self._peers: dict[tuple, np.ndarray] = {}  # (pid, serial) -> another rank's buffer, mapped here
        self._bytes = self._serial = 0
        self._probe: Optional[np.ndarray] = None

    def empty(self, nbytes: int) -> Optional[np.ndarray]:
        """A shared uint8 buffer of `nbytes` that nothing refers to, or None where the pool is full or
        the system refuses one."""
        bufs = self._pool.setdefault(nbytes, [])
        for i in range(len(bufs)):
            if idle(bufs, i):
                return bufs[i]
        if len(bufs) >= PER_SIZE or self._bytes + nbytes > MAX_BYTES or len(self._where) >= MAX_BUFFERS:
            return None
        raw = self._make(nbytes)
        if raw is not None:
            bufs.append(raw)
            self._bytes += nbytes
        return raw

    def _make(self, nbytes: int) -> Optional[np.ndarray]:
        try:
            fd = os.memfd_create(f"mpimesh-{self._serial}")
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, nbytes)  # the memory now, or a clean refusal (never SIGBUS later)
            raw = np.frombuffer(mmap.mmap(fd, nbytes), np.uint8)  # exactly: views' `.base` is then `raw`
        except OSError:
            os.close(fd)
            return None
        self._where[id(raw)] = (self._serial, fd)  # the fd stays open: the other ranks open it by its number
        self._serial += 1
        return raw

    def locate(self, x: np.ndarray) -> Optional[tuple]:
        """(serial, fd, byte offset) of C-contiguous `x` within a buffer of this arena, else None."""
        base = x.base  # a buffer here is never freed: its id is never another array's
        where = self._where.get(id(base)) if isinstance(base, np.ndarray) else None
        if where is None or not x.flags.c_contiguous:
            return None
        return where + (x.ctypes.data - base.ctypes.data,)

    def peer(self, pid: int, serial: int, fd: int) -> np.ndarray:
        """Rank `pid`'s buffer `serial` (its descriptor `fd`), mapped here once."""
        buf = self._peers.get((pid, serial))
        if buf is None:
            own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
            try:
                buf = self._peers[(pid, serial)] = np.frombuffer(mmap.mmap(own, 0), np.uint8)
            finally:
                os.close(own)
        return buf

    def probe_page(self) -> tuple:
        """(serial, fd, mark) of this process's probe page, made once: 8 bytes of its own mark."""
        if self._probe is None:
            raw = self._make(8)
            if raw is None:
                return -1, -1, 0
            raw.view(np.int64)[0] = int.from_bytes(os.urandom(7), "little")
            self._probe = raw
        serial, fd = self._where[id(self._probe)]
        return serial, fd, int(self._probe.view(np.int64)[0])


arena = Arena()


def probe(comm: MPI.Comm, wait) -> bool:
    """Whether the ranks of `comm` can sum through shared memory: they share a node (MPI's view) and
    each maps every other's probe page and finds its mark. A collective over `comm` (every step but
    the node split polled by `wait(request, what)`); the same answer on every rank."""
    wait(comm.Ibarrier(), "probing shared memory")  # the node split below blocks: all are here first
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_size() == comm.Get_size()
    node.Free()
    mine = np.array([os.getpid(), *arena.probe_page()], np.int64) if local else np.full(4, -1, np.int64)
    every = np.empty((comm.Get_size(), 4), np.int64)
    wait(comm.Iallgather(mine, every), "probing shared memory")
    ok = local and bool((every[:, 2] >= 0).all())
    for j, (pid, serial, fd, mark) in enumerate(every.tolist()):
        if ok and j != comm.Get_rank():
            try:
                ok = int(arena.peer(pid, serial, fd)[:8].view(np.int64)[0]) == mark
            except (OSError, ValueError):
                ok = False
    flag = np.array([int(ok)], np.int32)
    agreed = np.empty(1, np.int32)
    wait(comm.Iallreduce(flag, agreed, op=MPI.MIN), "probing shared memory")
    return bool(agreed[0])


class ShmAllreduce:
    """An in-place allreduce of `x` over `comm` through shared memory (see the module), in two
    steps: the constructor starts the allgather of the records (`records`, an MPI request); `second()`,
    called once that is complete, at a point every rank of the group reaches in the same order
    (never inside a poll: the collectives it starts must match), sums this rank's block and starts
    the barrier, or starts `fallback()` (MPI's allreduce) where some rank's buffer is not shared;
    it returns that MPI request."""

    __slots__ = ("comm", "x", "op", "mine", "every", "records", "fallback")

    def __init__(self, comm: MPI.Comm, x: np.ndarray, op: str, fallback):
        self.comm, self.x, self.op, self.fallback = comm, x, op, fallback
        where = arena.locate(x)
        self.mine = np.array([os.getpid(), *(where or (-1, -1, -1)), x.nbytes, ord(x.dtype.char),
                              int(where is not None)], np.int64)
        self.every = np.empty((comm.Get_size(), _FIELDS), np.int64)
        self.records = comm.Iallgather(self.mine, self.every)

    def second(self) -> MPI.Request:
        every = self.every
        if not ((every[:, 4] == every[0, 4]).all() and (every[:, 5] == every[0, 5]).all()):
            sizes = ", ".join(f"rank {j}: {n} bytes of {np.dtype(chr(d)).name}"
                              for j, (n, d) in enumerate(every[:, 4:6].tolist()))
            raise MpimeshError(f"allreduce: the ranks of the group pass different buffers ({sizes})")
        if not every[:, 6].all():
            return self.fallback()
        self._reduce()
        return self.comm.Ibarrier()

    def _reduce(self) -> None:
        """Sum block j (this rank's) of every rank's buffer and write it into each of them."""
        j, k, x = self.comm.Get_rank(), self.comm.Get_size(), self.x
        flat = x.reshape(-1)
        bufs = [flat if q == j else
                arena.peer(pid, serial, fd)[offset:offset + x.nbytes].view(x.dtype)
                for q, (pid, serial, fd, offset) in enumerate(self.every[:, :4].tolist())]
        start, n = block_span(flat.size, k, j)
        step = max(_BLOCK // x.itemsize, 1)
        ufunc = _OPS[self.op]
        for a in range(start, start + n, step):
            b = min(a + step, start + n)
            parts = [buf[a:b] for buf in bufs]
            total = tree_reduce(parts, ufunc)
            for part in parts[1:]:  # `total` is parts[0]
                np.copyto(part, total)
