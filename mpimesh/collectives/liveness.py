"""Departures: a rank that leaves the job is noticed by every rank that waits for it.

A rank whose program ends (it returned, or called `sys.exit`) posts an exit notice at interpreter
exit to every other rank of each mesh still alive, saying what its last collective was (one that
built no mesh, to every rank of COMM_WORLD: the others may be building one, `guard.arrive`). A rank
whose process ends without one (killed, crashed, `os._exit`) is found gone by its process id, where
it shares this machine's process table. The collectives poll for both while they wait (`guard.py`),
so the ranks left waiting raise instead of hanging. A notice is only news: a collective that the
departed rank had already done its part of still completes.

>>> watch = Watch(MPI.COMM_SELF)          # a mesh's watch: one rank, nobody to lose
>>> watch.gone([0]), watch.roster.shape
({}, (1, 2))
"""
from __future__ import annotations

import atexit
import os
import socket
import time
import weakref
import zlib
from typing import Optional

import numpy as np
from mpi4py import MPI

QUERY, REPLY = 31001, 31002  # tags of the where-are-you questions and answers (`guard.py`), on that communicator
_EXIT = 31003  # tag of an exit notice, on a mesh's own guard communicator
_WORLD_EXIT = 31004  # tag of the exit notice of a program that ended before it built any mesh, on COMM_WORLD
_WIDTH = 400  # bytes of a notice's text
_watches: "weakref.WeakSet[Watch]" = weakref.WeakSet()
ABANDONED = "it abandoned this mesh"  # how the notice of a rank whose collective was interrupted begins


def _machine_key() -> int:
    """Equal on two ranks exactly when they see the same process ids: the kernel's boot id and this
    process's pid namespace (namespaced "hosts" on one machine share both; containers do not), else
    the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            key = f.read().strip() + os.readlink("/proc/self/ns/pid")
    except OSError:
        key = socket.gethostname()
    return zlib.crc32(key.encode())


def alive(pid: int) -> bool:
    """Whether process `pid` (on this machine) still runs: not gone, not a zombie awaiting its parent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True


def describe(op: tuple) -> str:
    """A collective as messages name it, from its (sequence number, kind, mesh dims, dtype, local
    shape, detail).

    >>> describe((3, "allgather", ("rows",), np.dtype("float32"), (2, 4), " axis 0"))
    '#3 allgather over rows float32 local shape (2, 4) axis 0'
    """
    seq, kind, dims, dtype, shape, detail = op
    return f"#{seq} {kind} over {'+'.join(dims)} {dtype} local shape {shape}{detail}"


class Watch:
    """Who of `comm`'s ranks is still in the job.

    Made with the mesh (one small allgather of machine keys and process ids on `comm`, right after
    the collective that made `comm`). A receive for notices stays posted, so that any progress MPI
    makes delivers one, and one `poll` finds it. `op` is this rank's latest collective (see
    `describe`), which its exit notice reports; `left` maps each rank known to be gone to why, and
    `abandoned` says whether one of them abandoned the mesh (an interrupted collective).
    """

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.left: dict[int, str] = {}
        self.abandoned = False
        self.op: Optional[tuple] = None
        mine = np.array([_machine_key(), os.getpid()], np.int64)
        self.roster = np.empty((comm.Get_size(), 2), np.int64)
        self._machine = int(mine[0])
        self._status = MPI.Status()
        self._buf = np.empty(_WIDTH, np.uint8)
        self._recv = None
        if comm.Get_size() > 1:
            comm.Allgather(mine, self.roster)
            self._recv = comm.Irecv(self._buf, MPI.ANY_SOURCE, _EXIT)
            weakref.finalize(self, _cancel, self._recv)  # not to leave a receive posted for every mesh ever made
            _watches.add(self)
        else:
            self.roster[0] = mine

    def poll(self) -> bool:
        """Take in the notices that arrived (cheap when none did); whether any did. The receive
        is tested twice: after a quiet spell (no MPI calls), MPICH's first test makes the progress
        that delivers a notice, but answers before it looks again."""
        news = False
        while self._recv is not None and (self._recv.Test(self._status) or self._recv.Test(self._status)):
            why = bytes(self._buf).rstrip(b"\0").decode(errors="replace")
            self.left[self._status.Get_source()] = why
            self.abandoned |= why.startswith(ABANDONED)
            self._recv = self.comm.Irecv(self._buf, MPI.ANY_SOURCE, _EXIT)
            news = True
        return news

    def gone(self, ranks) -> dict:
        """`{rank: why}` for those of `ranks` known to have left: takes in the notices that arrived
        and checks the processes of ranks on this machine."""
        self.poll()
        for r in ranks:
            if r not in self.left and self.roster[r, 0] == self._machine and not alive(int(self.roster[r, 1])):
                self.left[r] = (f"its process (pid {self.roster[r, 1]}) ended without an exit notice "
                                "(killed, crashed, or os._exit)")
        return {r: self.left[r] for r in ranks if r in self.left}

    def notify(self, why: str) -> list:
        """Post `why` this rank is gone (from the job, or from this mesh) to every other rank; the
        send requests, which keep the message alive."""
        me, text = self.comm.Get_rank(), why.encode()[:_WIDTH]
        buf = np.frombuffer(text.ljust(_WIDTH, b"\0"), np.uint8)
        return [self.comm.Isend(buf, r, _EXIT) for r in range(self.comm.Get_size()) if r != me]

    def exit_notice(self) -> list:
        """Post this rank's exit notice (see `notify`): its program ended, after which collective."""
        last = f"after its collective {describe(self.op)}" if self.op else "before its first collective"
        return self.notify(f"its program ended {last}")


_world: dict = {"recv": None, "buf": np.empty(_WIDTH, np.uint8), "status": None, "left": {}}


def _poll_world() -> None:
    """Take in the world exit notices that arrived (the receive posted on first use)."""
    w = _world
    if w["recv"] is None:
        w["status"] = MPI.Status()
        w["recv"] = MPI.COMM_WORLD.Irecv(w["buf"], MPI.ANY_SOURCE, _WORLD_EXIT)
    while w["recv"].Test(w["status"]):
        w["left"][w["status"].Get_source()] = bytes(w["buf"]).rstrip(b"\0").decode(errors="replace")
        w["recv"] = MPI.COMM_WORLD.Irecv(w["buf"], MPI.ANY_SOURCE, _WORLD_EXIT)


def departed(comm: MPI.Comm) -> dict:
    """`{rank of comm: why}` for the ranks of `comm` known to have left the job: a program that
    ended before building a mesh (its notice on COMM_WORLD), or one whose exit notice a live mesh's
    watch took in (an abandoned mesh is not a departure)."""
    _poll_world()
    sources = [(MPI.COMM_WORLD, _world["left"])]
    for watch in list(_watches):
        watch.poll()
        sources.append((watch.comm, {r: w for r, w in watch.left.items() if not w.startswith(ABANDONED)}))
    mine, out = comm.Get_group(), {}
    for other, left in sources:
        if left:
            group, ranks = other.Get_group(), sorted(left)
            for r, here in zip(ranks, MPI.Group.Translate_ranks(group, ranks, mine)):
                if here != MPI.UNDEFINED:
                    out[here] = left[r]
            group.Free()
    mine.Free()
    return out


def _cancel(request: MPI.Request) -> None:
    """Withdraw a watch's posted receive (when its mesh is gone)."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        try:
            request.Cancel()
            request.Free()
        except MPI.Exception:
            pass


def _drain(comm: MPI.Comm) -> None:
    """Receive the where-are-you questions and answers that arrived on `comm` and were never taken in."""
    status = MPI.Status()
    for tag in (QUERY, REPLY):
        while comm.Iprobe(MPI.ANY_SOURCE, tag, status):
            comm.Recv(np.empty(status.Get_count(MPI.BYTE), np.uint8), status.Get_source(), tag)


@atexit.register
def _notify_all() -> None:
    """At interpreter exit: every live mesh's exit notice, given a second to leave, and the other
    ranks' notices taken in within that second."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    requests = []
    for watch in list(_watches):
        try:
            requests += watch.exit_notice()
        except MPI.Exception:  # a communicator freed by the program: nobody waits on it
            pass
    world = MPI.COMM_WORLD.Get_size()
    alone = not _watches and world > 1  # no mesh: the others may be building one, and wait for this rank
    if alone:
        text = np.frombuffer(b"its program ended before it built any mesh".ljust(_WIDTH, b"\0"), np.uint8)
        me = MPI.COMM_WORLD.Get_rank()
        requests += [MPI.COMM_WORLD.Isend(text, r, _WORLD_EXIT) for r in range(world) if r != me]
    deadline = time.monotonic() + 1.0
    while requests and not MPI.Request.Testall(requests) and time.monotonic() < deadline:
        time.sleep(1e-3)
    for watch in list(_watches):  # the others' notices, where they all end now: none is left unreceived
        size = watch.comm.Get_size()  # at MPI_Finalize (UCX warns of each), in the second at most
        while len(watch.left) < size - 1 and time.monotonic() < deadline:
            if not watch.poll():
                time.sleep(1e-3)
    while alone and len(_world["left"]) < world - 1 and time.monotonic() < deadline:  # (theirs: likewise)
        _poll_world()
        time.sleep(1e-3)
    for watch in list(_watches):  # no receive left posted when MPI finalizes, and no question or answer
        try:                        # left unreceived (a hang notice's, to a rank that then went on, say)
            _drain(watch.comm)
        except MPI.Exception:  # (a freed communicator)
            pass
        if watch._recv is not None:
            _cancel(watch._recv)
            watch._recv = None
    if _world["recv"] is not None:
        _cancel(_world["recv"])
        _world["recv"] = None
