"""Never a silent hang: the SPMD check before each collective, time-outs, and departed ranks.

Every collective is started non-blocking and polled (flat out at first, then with growing naps).
While it waits, a rank answers others' questions about where it is and looks for ranks of its
group that left the job (`CollectiveTimeoutError`). `set_spmd_check(True)` makes every rank confirm
it is at the same collective as the others before it starts (else `DivergenceError`, nothing
moved); `set_collective_timeout(S)` bounds the wait (`DEFAULT_TIMEOUT`); `set_hang_notice(S)` prints
where every rank is after S seconds (`DEFAULT_NOTICE`). Details: docs/failures.md.

>>> set_spmd_check(False); settings()["check"]
False
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import zlib
from itertools import product
from types import MappingProxyType
from typing import NamedTuple, Optional

import numpy as np
from mpi4py import MPI

from .. import env, flight
from ..errors import CollectiveTimeoutError, DivergenceError, MpimeshError
from .callsite import called, user_frame, where_called
from .liveness import ABANDONED, QUERY, REPLY, Watch, departed, describe

_WIDTH = 400  # bytes of a rank's description of its op, for the SPMD check
_ANSWER = 1024  # bytes of an answer to where-are-you: the question's number, two flags, then text
_PLAIN, _NOTICE, _FINAL = 0.0, 1.0, 2.0  # kinds of question: before raising; for a hang notice; before a
#                                          time-out ends the job (the asked also write their flight records)
DEFAULT_TIMEOUT = 600.0  # seconds: long enough for real work, short of forever
DEFAULT_NOTICE = 30.0  # seconds a collective waits before its rank says where every rank is
_NOTICE_ASK = 1.0  # the longest a hang notice waits for answers
_OUTSIDE = "outside mpimesh (in no collective of this mesh: it went on with its own work, or waits elsewhere)"
_SPIN = 0.05  # seconds a collective is polled flat out, as a blocking call would
_MAX_NAP = 0.02  # the longest nap between polls after that (they grow with the time waited)
_LOOK = 0.1  # seconds between looks for departed ranks and for others' questions
_GRACE = 1.0  # seconds a collective may still complete after a member left (its part may be done)


_SECONDS = {"above": 0.0, "words": {"0": None, "off": None, "none": None},  # how env.number reads the variables
            "what": "a positive number of seconds"}


def _checked_seconds(seconds: Optional[float], what: str) -> Optional[float]:
    if seconds is not None and not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
                                    and 0 < seconds < float("inf")):
        raise MpimeshError(f"{what} must be a positive number of seconds or None, got {seconds!r}")
    return None if seconds is None else float(seconds)


_settings: dict = {}
state = MappingProxyType(_settings)
"""The settings in force, read-only, for a hot path (`trace.dispatch` reads `state["check"]` per op);
`settings()` is the checked accessor."""
in_op: list = [""]  # with the SPMD check on: the op whose kernel runs now (`trace.dispatch` sets it), e.g.
#                     "reduce_sum of [batch:8, io:4]": part of each collective's key, so that ranks running
#                     the same collectives for different ops (in another order) are told apart


def reset() -> None:
    """The settings as the environment gives them (what a program starts with). A bad value of
    `MPIMESH_SPMD_CHECK`, `MPIMESH_COLLECTIVE_TIMEOUT` or `MPIMESH_HANG_NOTICE` gives the default here;
    its `MpimeshError` is raised by the next `Mesh` and by `settings()` (`env.early`)."""
    _settings.update(check=env.early(env.flag, "MPIMESH_SPMD_CHECK", False),
                     timeout=env.early(env.number, "MPIMESH_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT, **_SECONDS),
                     chosen=env.text("MPIMESH_COLLECTIVE_TIMEOUT") is not None,
                     notice=env.early(env.number, "MPIMESH_HANG_NOTICE", DEFAULT_NOTICE, **_SECONDS))


reset()


def set_spmd_check(enabled: bool) -> None:
    """Check before every collective that all ranks of the mesh are at the same op (call it on every rank)."""
    _settings["check"] = bool(enabled)


def set_collective_timeout(seconds: Optional[float]) -> None:
    """Raise `CollectiveTimeoutError` from a collective not complete after `seconds` (None: wait
    forever; the default is `DEFAULT_TIMEOUT`, 600 s). Departed ranks are noticed either way."""
    _settings["timeout"] = _checked_seconds(seconds, "collective time-out")
    _settings["chosen"] = True


def set_hang_notice(seconds: Optional[float]) -> None:
    """Once a collective has waited `seconds` (None: never; the default is `DEFAULT_NOTICE`, 30 s),
    print, once, where every rank of the mesh is: in which public call (`mm.save`, `to_numpy`, an op)
    at which line of the program, or outside mpimesh. Call it on every rank.

    >>> set_hang_notice(5.0); settings()["notice"]
    5.0
    >>> set_hang_notice(None); settings()["notice"] is None
    True
    >>> reset()
    """
    _settings["notice"] = _checked_seconds(seconds, "hang notice")


def settings() -> dict:
    """The check, time-out and hang notice in force: `{"check": bool, "timeout": seconds or None,
    "notice": seconds or None}`.

    >>> settings()["timeout"] == DEFAULT_TIMEOUT or "MPIMESH_COLLECTIVE_TIMEOUT" in os.environ
    True
    """
    env.raise_kept("MPIMESH_SPMD_CHECK", "MPIMESH_COLLECTIVE_TIMEOUT", "MPIMESH_HANG_NOTICE")
    return {"check": _settings["check"], "timeout": _settings["timeout"], "notice": _settings["notice"]}


_yield = getattr(os, "sched_yield", lambda: None)


class Answer(NamedTuple):
    """Where a rank is, as it answers a where-are-you question (or as this rank knows itself)."""
    state: str  # the collective it waits in (`describe`)
    call: str  # the public call the program is in (`callsite.where_called`)
    line: str  # the program's `file:line` of that call
    every: bool = False  # every rank must make that call (`callsite.EVERY_RANK`)
    noticing: bool = False  # it is asking for a hang notice of its own

    def __str__(self) -> str:
        return f"{self.state} in {called(self.call, self.line, self.every)}"


def _encode(number: int, answer: Answer) -> np.ndarray:
    """The answer to question `number`, as sent."""
    buf = np.zeros(_ANSWER, np.uint8)
    buf[:8] = np.array([number], np.int64).view(np.uint8)
    buf[8], buf[9] = answer.every, answer.noticing
    raw = "\x1f".join(answer[:3]).encode()[:_ANSWER - 10]
    buf[10:10 + len(raw)] = np.frombuffer(raw, np.uint8)
    return buf


def _decode(buf: np.ndarray) -> tuple:
    """(the question's number, the `Answer`) from an answer as received.

    >>> _decode(_encode(7, Answer("#3 any_rank", "mm.save", "train.py:9", True, False)))
    (7, Answer(state='#3 any_rank', call='mm.save', line='train.py:9', every=True, noticing=False))
    """
    text = bytes(buf[10:]).rstrip(b"\0").decode(errors="replace").split("\x1f")
    return int(buf[:8].view(np.int64)[0]), Answer(*(text + ["", "", ""])[:3], bool(buf[8]), bool(buf[9]))


def _ranks(ranks) -> str:
    """'rank 3', or 'ranks 1-3, 5'.

    >>> _ranks([5, 1, 2, 3]), _ranks([4])
    ('ranks 1-3, 5', 'rank 4')
    """
    runs: list = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {text}"


def _say(text: str) -> None:
    """Print a notice to stderr in one write (ranks' lines interleave less); never raise."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed stream: the collective goes on all the same
        pass


_keyed: dict = {}  # meshes keyed for timelines (`Guard.timeline_key`), by their ranks in MPI.COMM_WORLD


class Guard:
    """The check, time-out and departure state of one mesh: its sequence number, a communicator of
    its own and the mesh's `liveness.Watch`.

    Args:
      watch: the mesh's watch, over a duplicate of the mesh's communicator (rank r = mesh rank r), for
        the check's allreduce, the where-are-you questions and exit notices; it never carries user data.
      mesh_shape: the mesh shape, to name a group's ranks.
      coords: this rank's mesh coordinates.
    """

    def __init__(self, watch: Watch, mesh_shape, coords: dict):
        self.watch, self.comm, self._shape, self._coords = watch, watch.comm, mesh_shape, coords
        self.seq = 0
        self._buffers: dict = {}  # the check's send and receive buffers, per number of groups
        self.broken: Optional[str] = None
        self._op: Optional[tuple] = None  # (seq, kind, dims, dtype, local shape, detail) of the current collective
        self._sends: list = []  # questions and answers in flight
        self._questions = 0  # this rank's where-are-you questions so far (an answer names its question's number)
        # The current slow wait (past `_SPIN`): its start, by the wall clock (others' questions asked
        # before it are old news); the ranks whose hang notice covers it; whether its own is being asked.
        self._began, self._covered, self._noticing = 0.0, set(), False
        self.arrived = 0.0  # when this rank entered its current (or last) collective, `time.perf_counter()`
        self._keys: dict = {}  # `timeline_key`'s, by mesh dims
        world = MPI.COMM_WORLD
        if flight.job[0] is None and self.comm.Get_size() == world.Get_size() > 1:  # (the flight records' name:
            mine, every = self.comm.Get_group(), world.Get_group()                # rank 0's pid, on every node)
            flight.job[0] = str(watch.roster[MPI.Group.Translate_ranks(every, [0], mine)[0], 1])
            mine.Free()
            every.Free()

    @staticmethod
    def timeout() -> Optional[float]:
        """The time-out in force, seconds, or None."""
        return _settings["timeout"]

    @staticmethod
    def polls_device() -> bool:
        """Whether device-ordered transfers (NCCL) are polled from the host: only under a time-out
        the program chose (the default one would stall every GPU step on the host)."""
        return _settings["chosen"] and _settings["timeout"] is not None

    def enter(self, kind: str, dims: tuple, x, detail: str = "", shape: Optional[str] = None) -> None:
        """Before a collective: refuse on a broken mesh, count it, and run the SPMD check if on
        (`shape`: the local shape to compare, where it is not x's: see `uneven_shape`)."""
        arrived = flight.clock()
        if self.broken:
            raise CollectiveTimeoutError(f"this mesh is unusable after an earlier failed collective: {self.broken}")
        self.watch.poll()
        if self.watch.abandoned:  # its pending transfer would match this rank's next one
            self._refuse_abandoned()
        self.seq += 1
        if in_op[0] and _settings["check"]:
            detail = f"{detail} in {in_op[0]}"
        self._op = self.watch.op = (self.seq, kind, dims, x.dtype, tuple(x.shape) if shape is None else shape, detail)
        self.arrived = arrived
        flight.remember((arrived, "collective", self._op, self._shape))
        if _settings["check"] and self.comm.Get_size() > 1:
            self._check()

    @property
    def _state(self) -> str:
        """What this rank is in (or last was in), for messages and others' questions."""
        return "" if self._op is None else describe(self._op)

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

    def barrier(self) -> None:
        """Wait for every rank of the mesh, as a collective of its own (checked, polled)."""
        self.enter("barrier", tuple(self._shape.names), np.empty(0, np.uint8))
        self.wait_mpi(self.comm.Ibarrier(), None)

    def wait_mpi(self, request: MPI.Request, what: Optional[str], dims: Optional[tuple] = None) -> None:
        """Wait for an MPI request of the guard's own, over the whole mesh or the group over `dims`
        (see `wait`). With `what` None it is a collective of the guard's own (`barrier`, the transports'
        `any_rank` and `broadcast`): an open timeline gets its span."""
        self.wait(_Polled(request.Test), tuple(self._shape.names) if dims is None else dims, what)
        if what is None and flight.timeline:
            seq, kind, dims, dtype, shape, _ = self._op
            nbytes = dtype.itemsize * int(np.prod(shape)) if isinstance(shape, tuple) else 0
            flight.end(flight.begin(self.arrived, kind, dims, nbytes, seq, self.timeline_key(dims), False))

    def timeline_key(self, dims: tuple) -> tuple:
        """What names the ranks of this rank's group over `dims` in a timeline, the same on each of them:
        `(mesh, group)`, the mesh as (its ranks in `MPI.COMM_WORLD`, how many meshes over those ranks
        were keyed before it), the group as its members' ranks in `MPI.COMM_WORLD`. With the guard's
        sequence number it tells one collective's calls on the ranks apart from every other's."""
        key = self._keys.get(dims)
        if key is None:
            if not self._keys:
                world, mine = MPI.COMM_WORLD.Get_group(), self.comm.Get_group()
                ranks = tuple(MPI.Group.Translate_ranks(mine, list(range(mine.Get_size())), world))
                mine.Free()
                world.Free()
                _keyed[ranks] = _keyed.get(ranks, -1) + 1
                self._keys[None] = (ranks, _keyed[ranks])
            mesh = self._keys[None]
            key = self._keys[dims] = (mesh, tuple(mesh[0][r] for r in self._group_ranks(dims)))
        return key

    def wait(self, request, dims: tuple, what: Optional[str] = None) -> None:
        """Poll `request` (anything with `test()`) until done: flat out for `_SPIN` seconds, then with
        growing naps; every `_LOOK` seconds answer others' questions and look for members of the group
        over `dims` that left (raising once one has been gone `_GRACE` seconds), and past the time-out,
        diagnose and raise. `what`: a step before the collective (the SPMD check), for messages."""
        try:
            self._poll(request, dims, what)
        except KeyboardInterrupt:  # the transfer cannot be cancelled: the mesh is unusable from here
            self._abandon(what)
            raise

    def _poll(self, request, dims: tuple, what: Optional[str]) -> None:
        start = time.monotonic()
        fast = start + _SPIN
        while not self._test(request, dims, what):
            if time.monotonic() > fast:
                break
            _yield()  # a peer on this core (more ranks than cores) runs now, not when our slice ends
        else:
            return
        self._began, self._covered, self._noticing = time.time() - (time.monotonic() - start), set(), False
        timeout, notice, others = _settings["timeout"], _settings["notice"], None
        look = noticed = 0.0
        asked: Optional[tuple] = None  # the hang notice's question: (number, deadline, answers)
        while not self._test(request, dims, what):
            now = time.monotonic()
            if now >= look:
                look = now + _LOOK
                self._serve()
                if others is None:
                    others = [r for r in self._group_ranks(dims) if r != self.comm.Get_rank()]
                if self.watch.gone(others):
                    noticed = noticed or now
                    if now - noticed >= _GRACE:
                        self._departed(dims, what)
                if timeout is not None and now - start > timeout:
                    self._expire(dims, timeout, what)
                if notice is not None and now - start >= notice:
                    asked = self._notice(asked, notice, what)
                    if asked is None:
                        notice = None  # told, or covered by another rank's notice: once per wait
            time.sleep(min(_MAX_NAP, max(1e-4, 0.02 * (now - start))))

    def _test(self, request, dims: tuple, what: Optional[str]) -> bool:
        try:
            return request.test()
        except MPI.Exception as e:  # the MPI library saw a peer fail (MPI_ERRORS_RETURN, mpi4py's default)
            self._departed(dims, what, f"MPI reported: {e.Get_error_string().strip()}")
            raise  # not reached

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
        """Answer any rank asking where this one is; one asking for a hang notice since this wait
        began covers this rank's; one about to raise a time-out makes this rank write its flight
        record first (`flight.dump`: the job is about to end)."""
        status, mine = MPI.Status(), None
        while self.comm.Iprobe(MPI.ANY_SOURCE, QUERY, status):
            src, question = status.Get_source(), np.empty(3, np.float64)  # (kind, number, wall clock)
            self.comm.Recv(question, src, QUERY)
            if question[0] == _NOTICE and question[2] >= self._began:
                self._covered.add(src)
            if question[0] == _FINAL and flight.SIZE:
                with contextlib.suppress(OSError):  # (this rank's own error, if any, says so later)
                    flight.dump(f"rank {src} of the mesh timed out and asked where this rank was: waiting in its "
                                f"collective {self._state}", MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
            mine = mine or Answer(self._state, *where_called(), self._noticing)
            self._send(_encode(int(question[1]), mine), src, REPLY)

    def _send(self, buf, dest: int, tag: int) -> None:
        """Start sending `buf`, never waiting for it (the peer may be gone); the request keeps it alive."""
        self._sends = [r for r in self._sends if not r.Test()]
        self._sends.append(self.comm.Isend(buf, dest, tag))

    def _question(self, peers, kind: float) -> int:
        """Ask each of `peers` where it is (never waiting on a send: a peer may be gone); the question's number."""
        self._questions += 1
        question = np.array([kind, self._questions, time.time()], np.float64)
        for r in peers:
            self._send(question, r, QUERY)
        return self._questions

    def _answers(self, number: int, answers: dict) -> None:
        """Take in the answers that arrived, into `answers` ({rank: `Answer`}) where they answer
        question `number` (an earlier question's are dropped)."""
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, REPLY, status):
            buf = np.empty(_ANSWER, np.uint8)
            self.comm.Recv(buf, status.Get_source(), REPLY)
            got, answer = _decode(buf)
            if got == number:
                answers[status.Get_source()] = answer

    def _ask(self, peers: list, seconds: float, kind: float = _PLAIN) -> dict:
        """Where each of `peers` is, as each answers within `seconds` (serving questions meanwhile):
        `{rank: Answer}`."""
        number, answers = self._question(peers, kind), {}
        end = time.monotonic() + seconds
        while len(answers) < len(peers) and time.monotonic() < end:
            self._serve()
            self._answers(number, answers)
            time.sleep(1e-3)
        return answers

    def _notice(self, asked: Optional[tuple], after: float, what: Optional[str]) -> Optional[tuple]:
        """One step of the hang notice, every `_LOOK` seconds while the collective waits (it is
        polled meanwhile): ask every other rank of the mesh where it is, take in answers until all
        are in or `_NOTICE_ASK` seconds passed, then print where each rank is, unless another
        rank's notice covers this one. Returns the question in progress, or None once done."""
        me, size = self.comm.Get_rank(), self.comm.Get_size()
        peers = [r for r in range(size) if r != me]
        if asked is None:
            if self._covered:
                return None
            self._noticing = True
            asked = (self._question(peers, _NOTICE), time.monotonic() + _NOTICE_ASK, {})
        number, deadline, answers = asked
        self._answers(number, answers)
        if len(answers) < len(peers) and time.monotonic() < deadline:
            return asked
        self._noticing = False
        asking = self._covered | {r for r, a in answers.items() if a.noticing}  # at the same time as this one
        if min(asking, default=me) < me:
            return None
        where: dict = {}
        for r in peers:
            where.setdefault(f"left: {self.watch.left[r]}" if r in self.watch.left else
                             f"in {called(*answers[r][1:4])}; waiting in its collective {answers[r].state}"
                             if r in answers else _OUTSIDE, []).append(r)
        timeout = _settings["timeout"]
        _say(f"mpimesh: rank {me} has waited more than {after:g} s in {called(*where_called())}: "
             f"{self._op_text(what)} is not complete. Where the other ranks of the mesh are:\n"
             + "".join(f"mpimesh:   {_ranks(rs)}: {text}\n" for text, rs in where.items())
             + f"mpimesh: (rank {me} waits on: "
             + (f"the time-out ends the job once it has waited {timeout:g} s" if timeout is not None else
                "no time-out is set") + "; MPIMESH_COLLECTIVE_TIMEOUT=S sets it, MPIMESH_HANG_NOTICE=S or off "
             "this notice)\n")
        return None

    def _fail(self, message: str) -> None:
        """Mark the mesh unusable and raise `message`."""
        self.broken = message
        raise CollectiveTimeoutError(message)

    def _op_text(self, what: Optional[str]) -> str:
        """The collective this rank waits in, or the step before it (`what`)."""
        return f"{what}, before its collective {self._state}" if what else f"its collective {self._state}"

    def _where(self, what: Optional[str]) -> str:
        """Where this rank is, for its error messages: the public call, the program's line and the
        collective; ", which every rank must call" where the call is one of `callsite.EVERY_RANK`."""
        return f"rank {self.comm.Get_rank()} is in {called(*where_called())}: {self._op_text(what)}"

    def _refuse_abandoned(self) -> None:
        """Raise: a rank abandoned this mesh (an interrupted collective). (Exit notices only count
        while a collective waits, see `wait`: a rank may have done its part before it left.)"""
        dropped = {r: why for r, why in self.watch.left.items() if why.startswith(ABANDONED)}
        if dropped:
            self.broken = "; ".join(f"rank {r}: {why}" for r, why in dropped.items())
            raise CollectiveTimeoutError(f"this mesh is unusable: {self.broken}")

    def _abandon(self, what: Optional[str]) -> None:
        """After an interrupt inside a collective: mark the mesh unusable here, and tell the other
        ranks, whose collectives on this mesh then raise instead of waiting for this one."""
        call, line, _ = where_called()
        where = f"{self._op_text(what)} in {call} ({line})"
        self.abandon(f"{where} was interrupted before it completed (a transfer cannot be cancelled)",
                     f"{where} was interrupted on it")

    def abandon(self, why: str, told: str) -> None:
        """Mark the mesh unusable here (`why`: its collectives' error says it) and tell the other
        ranks (`told`), whose collectives on it then raise instead of waiting for this one: after
        transfers left in flight, which would match the mesh's next ones."""
        self.broken = why
        sent = self.watch.notify(f"{ABANDONED}: {told}")
        end = time.monotonic() + 0.5  # push the notices out now: this rank may not call MPI again soon
        while not MPI.Request.Testall(sent) and time.monotonic() < end:
            time.sleep(1e-3)
        self._sends += sent

    def _departed(self, dims: tuple, what: Optional[str], mpi_error: str = "") -> None:
        me = self.comm.Get_rank()
        others = [r for r in self._group_ranks(dims) if r != me]
        gone = self.watch.gone(others)
        answers = self._ask([r for r in others if r not in gone], _GRACE)
        where = [f"rank {me} (this one) in it"]
        for r in others:
            where.append(f"rank {r} left: {gone[r]}" if r in gone else
                         f"rank {r} waiting in {answers[r]}" if r in answers else f"rank {r} {_OUTSIDE}")
        place = "the job" if all(why.startswith("its ") for why in gone.values()) else "this mesh"
        who = (f"rank {list(gone)[0]} left {place}" if len(gone) == 1 else
               f"ranks {list(gone)} left {place}" if gone else "a rank of its group failed")
        self._fail(f"{self._where(what)} cannot complete: {who} before it was done. "
                   f"{mpi_error + '. ' if mpi_error else ''}Where the ranks of the collective were: "
                   f"{'; '.join(where)}. The mesh is unusable now; uncaught, this error ends the job.")

    def _expire(self, dims: tuple, timeout: float, what: Optional[str]) -> None:
        me = self.comm.Get_rank()
        peers = [r for r in self._group_ranks(dims) if r != me]
        others = [r for r in range(self.comm.Get_size()) if r != me and r not in peers]
        answers = self._ask(peers + others, min(max(1.0, 0.2 * timeout), 5.0), _FINAL)
        missing = [r for r in peers if r not in answers or answers[r].state != self._state]
        notes = [f"rank {r} " + (f"waiting in {answers[r]}" if r in answers else f"is {_OUTSIDE}") for r in missing]
        silent = [r for r in others if r not in answers]
        if silent and any(r in answers for r in missing):  # those wait in turn, maybe on these
            notes.append(f"no answer from ranks {silent} of the mesh (outside mpimesh, or unreachable)")
        self._fail(f"{self._where(what)} was not complete after {timeout:g} s; ranks {missing} "
                   f"never arrived: {'; '.join(notes)}. A longer time-out: MPIMESH_COLLECTIVE_TIMEOUT=S or "
                   f"mm.set_collective_timeout(S) (None for none). The mesh is unusable now; uncaught, this "
                   "error ends the job.")


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


def arrive(comm: MPI.Comm, what: str) -> None:
    """Wait, polled, until every rank of `comm` is here (`what`: where, e.g. building a mesh, whose
    first collectives block): a CollectiveTimeoutError on the ranks that wait if one of them left
    the job (`liveness.departed`) or the time-out passes, instead of blocking forever."""
    if comm.Get_size() == 1:
        return
    request, start, timeout = comm.Ibarrier(), time.monotonic(), _settings["timeout"]
    while not request.Test():
        gone = departed(comm)
        if gone:
            raise CollectiveTimeoutError(f"{what}: " + "; ".join(f"rank {r} left the job ({why})"
                                                                for r, why in sorted(gone.items())))
        if timeout is not None and time.monotonic() - start > timeout:
            raise CollectiveTimeoutError(f"{what}: not every rank of the {comm.Get_size()} arrived within "
                                         f"{timeout:g} s (MPIMESH_COLLECTIVE_TIMEOUT)")
        time.sleep(1e-4)
