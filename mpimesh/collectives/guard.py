"""Never a silent hang: the SPMD check before each collective, and collective time-outs.

`set_spmd_check(True)` (or `MPIMESH_SPMD_CHECK=1`): before each collective, every rank of the mesh
confirms, in one small allreduce on a communicator of its own, that all ranks are at the same op
(a per-mesh sequence number, kind, mesh dims and dtype on every rank; the local shape among the ranks
of the collective's group, since uneven blocks of another split dim may differ between groups; along
an axis cut into unequal blocks the local shape shows the global length instead, see `uneven_shape`).
If not, every rank raises
`DivergenceError` naming what each rank was doing and where in the user's code; no data moved,
so the mesh stays usable. The check is not counted in the profile.

`set_collective_timeout(S)` (or `MPIMESH_COLLECTIVE_TIMEOUT=S`): collectives are started
non-blocking and polled. One not complete after S seconds asks the ranks of its group where they
are (a rank waiting in another collective answers while it polls; one busy elsewhere, or gone,
cannot), then raises `CollectiveTimeoutError` naming the ranks that never arrived. The transfer
can never be cancelled, so the mesh is unusable afterwards and an uncaught error ends the job.

>>> set_spmd_check(False); settings()
{'check': False, 'timeout': None}
"""
from __future__ import annotations

import os
import sys
import time
import zlib
from itertools import product
from typing import Optional

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveTimeoutError, DivergenceError, MpimeshError

_QUERY, _REPLY = 31001, 31002  # tags of the time-out's where-are-you exchange
_WIDTH = 400  # bytes of a rank's description of its op
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _env_timeout() -> Optional[float]:
    raw = os.environ.get("MPIMESH_COLLECTIVE_TIMEOUT", "").strip()
    if not raw:
        return None
    try:
        return _checked_timeout(float(raw))
    except ValueError:
        raise MpimeshError(f"MPIMESH_COLLECTIVE_TIMEOUT={raw!r} is not a positive number of seconds") from None


def _checked_timeout(seconds: Optional[float]) -> Optional[float]:
    if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0 and seconds < float("inf")):
        raise MpimeshError(f"collective time-out must be a positive number of seconds or None, got {seconds!r}")
    return None if seconds is None else float(seconds)


_settings = {"check": os.environ.get("MPIMESH_SPMD_CHECK", "") not in ("", "0"), "timeout": _env_timeout()}


def set_spmd_check(enabled: bool) -> None:
    """Check before every collective that all ranks of the mesh are at the same op (call it on every rank)."""
    _settings["check"] = bool(enabled)


def set_collective_timeout(seconds: Optional[float]) -> None:
    """Raise `CollectiveTimeoutError` from a collective not complete after `seconds` (None: wait forever)."""
    _settings["timeout"] = _checked_timeout(seconds)


def settings() -> dict:
    """The check and time-out in force: `{"check": bool, "timeout": seconds or None}`."""
    return dict(_settings)


def user_frame() -> str:
    """`file:line` of the innermost frame outside the mpimesh package (the user's call site)."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back
    return "<mpimesh>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


class Guard:
    """The check and time-out state of one mesh: its sequence number and a communicator of its own.

    Args:
      comm: a duplicate of the mesh's communicator (rank r = mesh rank r), for the check's allreduce
        and the time-out's point-to-point questions; it never carries user data.
      mesh_shape: the mesh shape, to name a group's ranks.
      coords: this rank's mesh coordinates.
    """

    def __init__(self, comm: MPI.Comm, mesh_shape, coords: dict):
        self.comm, self._shape, self._coords = comm, mesh_shape, coords
        self.seq = 0
        self._buffers: dict = {}  # the check's send and receive buffers, per number of groups
        self.broken: Optional[str] = None
        self._op: Optional[tuple] = None  # (seq, kind, dims, dtype, local shape, detail) of the current collective

    @staticmethod
    def active() -> bool:
        """Whether the check or a time-out is on."""
        return _settings["check"] or _settings["timeout"] is not None

    @staticmethod
    def timeout() -> Optional[float]:
        """The time-out in force, seconds, or None."""
        return _settings["timeout"]

    def enter(self, kind: str, dims: tuple, x, detail: str = "", shape: Optional[str] = None) -> None:
        """Before a collective: refuse on a broken mesh, count it, and run the SPMD check if on
        (`shape`: the local shape to compare, where it is not x's: see `uneven_shape`)."""
        if self.broken:
            raise CollectiveTimeoutError(f"this mesh is unusable after an earlier time-out: {self.broken}")
        self.seq += 1
        self._op = (self.seq, kind, dims, x.dtype, shape or tuple(x.shape), detail)  # formatted only when needed
        if _settings["check"] and self.comm.Get_size() > 1:
            self._check()

    @property
    def _state(self) -> str:
        """What this rank is in (or last was in), for messages and others' questions."""
        if self._op is None:
            return ""
        seq, kind, dims, dtype, shape, detail = self._op
        return f"#{seq} {kind} over {'+'.join(dims)} {dtype} local shape {shape}{detail}"

    def _check(self) -> None:
        seq, kind, dims, dtype, shape, detail = self._op  # a compact key: str(dtype) alone costs 4 us
        h = zlib.crc32(f"{seq}|{kind}|{dims}|{dtype.char}{dtype.itemsize}|{detail}".encode())
        # The local shape is compared within the collective's group only: uneven blocks of a dim split
        # over another mesh dim make it differ between groups. Slot g holds group g's shape key.
        groups, g = 1, 0
        for d in self._shape:
            if d.name not in dims:
                groups, g = groups * d.size, g * d.size + self._coords[d.name]
        if groups not in self._buffers:
            self._buffers[groups] = (np.empty(2 + 2 * groups, np.int64), np.empty(2 + 2 * groups, np.int64))
        mine, out = self._buffers[groups]
        mine.fill(np.iinfo(np.int64).max)  # no key: ignored by MIN
        mine[0], mine[1] = h, -h
        k = zlib.crc32(str(shape).encode())
        mine[2 + 2 * g], mine[3 + 2 * g] = k, -k
        if _settings["timeout"] is None:  # the common case: one blocking allreduce of a few ints
            self.comm.Allreduce(mine, out, op=MPI.MIN)
        else:
            self.wait_mpi(self.comm.Iallreduce(mine, out, op=MPI.MIN), "the SPMD check")
        if (out[0::2] == -out[1::2]).all():  # every rank had the same key: min == max
            return
        every = self._gather_states(f"{self._state} at {user_frame()}")
        lines = "\n".join(f"  rank {r}: {s}" for r, s in enumerate(every))
        raise DivergenceError(f"ranks diverged at collective #{self.seq} of this mesh (no data was sent; "
                              f"the mesh is still usable):\n{lines}")

    def _gather_states(self, mine: str) -> list:
        buf = np.zeros(_WIDTH, np.uint8)
        raw = mine.encode()[:_WIDTH]
        buf[:len(raw)] = np.frombuffer(raw, np.uint8)
        every = np.empty((self.comm.Get_size(), _WIDTH), np.uint8)
        self.wait_mpi(self.comm.Iallgather(buf, every), "the SPMD check")
        return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every]

    def wait_mpi(self, request: MPI.Request, what: str) -> None:
        """Wait for an MPI request of the guard's own, under the time-out if one is set."""
        if _settings["timeout"] is None:
            request.Wait()
            return
        self.wait(_Polled(request.Test), tuple(self._shape.names), what)

    def wait(self, request, dims: tuple, what: Optional[str] = None) -> None:
        """Poll `request` (anything with `test()`) until done; past the time-out, diagnose and raise."""
        timeout = _settings["timeout"]
        start = time.monotonic()
        spins = 0
        while not request.test():
            spins += 1
            if spins < 200:
                continue
            self._serve()
            if time.monotonic() - start > timeout:
                self._expire(dims, timeout, what)
            time.sleep(2e-4 if spins < 5000 else 2e-3)

    def _group_ranks(self, dims: tuple) -> list:
        """Mesh ranks of this rank's group over `dims` (coordinates differ only there)."""
        names, sizes = self._shape.names, self._shape.sizes
        ranges = [range(s) if n in dims else [self._coords[n]] for n, s in zip(names, sizes)]
        ranks = []
        for c in product(*ranges):
            r = 0
            for ci, s in zip(c, sizes):
                r = r * s + ci
            ranks.append(r)
        return ranks

    def _serve(self) -> None:
        """Answer any rank asking where this one is."""
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, _QUERY, status):
            src = status.Get_source()
            self.comm.Recv(np.empty(1, np.int64), src, _QUERY)
            answer = f"{self._state} at {user_frame()}".encode()[:_WIDTH]
            self.comm.Send(np.frombuffer(answer.ljust(_WIDTH, b"\0"), np.uint8), src, _REPLY)

    def _expire(self, dims: tuple, timeout: float, what: Optional[str]) -> None:
        me = self.comm.Get_rank()
        peers = [r for r in self._group_ranks(dims) if r != me]
        for r in peers:
            self.comm.Send(np.array([self.seq], np.int64), r, _QUERY)
        answers: dict = {}
        grace_end = time.monotonic() + min(max(1.0, 0.2 * timeout), 5.0)
        status = MPI.Status()
        while len(answers) < len(peers) and time.monotonic() < grace_end:
            self._serve()
            while self.comm.Iprobe(MPI.ANY_SOURCE, _REPLY, status):
                buf = np.empty(_WIDTH, np.uint8)
                self.comm.Recv(buf, status.Get_source(), _REPLY)
                answers[status.Get_source()] = bytes(buf).rstrip(b"\0").decode(errors="replace")
            time.sleep(1e-3)
        mine = self._state
        missing = [r for r in peers if answers.get(r, "").split(" at ", 1)[0] != mine]
        notes = [f"  rank {r}: " + (f"waiting in {answers[r]}" if r in answers else
                                    "did not answer (busy outside mpimesh's collectives, or finished)")
                 for r in missing]
        op = f"collective {mine} at {user_frame()}"
        op = f"{what}, before {op}" if what else op
        self.broken = (f"{op} on rank {me} was not complete after {timeout:g} s; ranks {missing} never "
                       f"arrived:\n" + "\n".join(notes))
        sys.stderr.write(f"mpimesh: CollectiveTimeoutError: {self.broken}\n")
        sys.stderr.flush()
        raise CollectiveTimeoutError(self.broken)


def uneven_shape(shape, axis: int, sizes: tuple, c: int) -> str:
    """The local `shape` as the SPMD check compares it when `axis` holds block c of unequal blocks
    of lengths `sizes`: that axis shows the global length over the block count (the same on every
    rank) if the local length is block c's, else the local length and block c's, which no other
    coordinate can show.

    >>> uneven_shape((2, 3), 1, (3, 2, 2), 0), uneven_shape((2, 2), 1, (3, 2, 2), 1)
    ('(2, 7/3)', '(2, 7/3)')
    >>> uneven_shape((2, 2), 1, (3, 2, 2), 0)
    '(2, 2 but block 0 of 7/3 is 3)'
    """
    whole = f"{sum(sizes)}/{len(sizes)}"
    mine = whole if shape[axis] == sizes[c] else f"{shape[axis]} but block {c} of {whole} is {sizes[c]}"
    return "(" + ", ".join(mine if i == axis else str(n) for i, n in enumerate(shape)) + ")"


class _Polled:
    """A `test()`-able wrapper around an MPI test function."""

    __slots__ = ("test",)

    def __init__(self, test):
        self.test = test
