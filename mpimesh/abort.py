"""One rank's uncaught exception ends the whole job, from `import mpimesh` on, and prints once.

`install()` wraps `sys.excepthook`: under MPI with more than one rank the hook prints the error
once for all the ranks that raised it alike (point-to-point digests to rank 0, no collective), then
calls `MPI_Abort`, with a watchdog that kills a rank the abort has not ended. Tracebacks show the
program's frames, not mpimesh's (also in one process and in the REPL: `shown`); `MPIMESH_DEBUG=1`
keeps every frame and `MPIMESH_NO_ABORT=1` keeps Python's own hook. How ranks agree on what to print,
and the time limits: docs/failures.md.

>>> install()  # idempotent
>>> ranks_text([3, 0, 1, 2, 5])
'ranks 0-3, 5'
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import time
import traceback
from typing import Optional

from mpi4py import MPI

from . import env, flight
from .errors import CollectiveTimeoutError, DivergenceError, MpimeshError

ABORT_GRACE = 0.5  # seconds between printing an uncaught exception and ending the job
ABORT_WATCHDOG = 5.0  # seconds MPI_Abort has to end this process before the watchdog does
COLLECT = 1.0  # seconds rank 0 waits for the other ranks' digests (less once all have come)
WORD = 2.0  # seconds another rank waits for rank 0's word before it prints its own
_DIGEST, _WORD = 31011, 31012  # tags on COMM_WORLD: rank -> rank 0, rank 0 -> each rank
_POLL = 0.002  # seconds between looks for a message


def install() -> None:
    """Make an uncaught exception print once, trimmed, and, on any rank of a job, end the whole job
    (called at import, and again by `Mesh`)."""
    off = env.early(env.flag, "MPIMESH_NO_ABORT", False)  # a bad value: the hook, and its error at the next Mesh
    if off or getattr(sys.excepthook, "_mpimesh", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        world = MPI.COMM_WORLD if MPI.Is_initialized() and not MPI.Is_finalized() else None
        if world is None or world.Get_size() == 1:  # (decided now: a program may start MPI after importing us)
            _write("".join(shown(kind, value, tb)))
            return
        try:
            _report(world, kind, value, tb)
        finally:
            end_self_after(ABORT_WATCHDOG, world.Get_rank())
            world.Abort(1)

    hook._mpimesh = True  # type: ignore[attr-defined]
    hook.previous = previous  # type: ignore[attr-defined]
    sys.excepthook = hook


def _report(world, kind, value, tb) -> None:
    """Print this rank's error, or let rank 0 print it for every rank that has the same (see the module)."""
    rank = world.Get_rank()
    brief = isinstance(value, (CollectiveTimeoutError, DivergenceError))
    text = f"{kind.__name__}: {value}\n" if brief else "".join(shown(kind, value, tb))
    if brief and flight.SIZE:
        text += flight_note(text, rank, world.Get_size())
    sends: list = []  # (held until the abort: a send in flight keeps its request)
    try:
        # a time-out's or departure's message is this rank's own: printed at once, as its own
        done = not isinstance(value, CollectiveTimeoutError) and _printed_once(world, text, brief, sends)
    except Exception:  # noqa: BLE001 - MPI in a bad state: this rank prints its own, as before
        done = False
    if not done:
        _write(_headed([rank], brief, text))
    time.sleep(ABORT_GRACE)  # the launcher forwards our stderr before MPI_Abort tears it down


def flight_note(error: str, rank: int, size: int) -> str:
    """Write this rank's flight record (`flight.dump`) of the `error` ending the job; the line that
    names the records, the same on every rank that wrote one (so that rank 0 prints it once)."""
    try:
        flight.dump(error.strip(), rank, size)
    except OSError as e:
        return f"mpimesh: rank {rank} could not write its flight record {flight.path(rank)}: {e}\n"
    return (f"mpimesh: flight records, each rank's last {flight.SIZE} ops and collectives: {flight.path('<N>')} "
            f"(N: its rank in MPI.COMM_WORLD)\n")


def _printed_once(world, text: str, brief: bool, sends: list) -> bool:
    """Whether rank 0 printed `text` for this rank (rank 0: having printed it for those that have it)."""
    rank, size = world.Get_rank(), world.Get_size()
    digest = hashlib.sha1(text.encode(errors="replace")).digest()
    if rank == 0:
        printed = _collect(world, size, digest)
        sends += [world.isend((digest, printed), r, _WORD) for r in range(1, size)]
        _write(_headed(printed, brief, text))  # (a word's receivers wait ABORT_GRACE before they abort too)
        return True
    sends.append(world.isend(digest, 0, _DIGEST))
    word = _receive(world, 0, _WORD, WORD)
    return word is not None and word[0] == digest and rank in word[1]


def _collect(world, size: int, digest: bytes) -> list:
    """Rank 0: the ranks (itself first) whose digest is `digest`, among those heard from within COLLECT s."""
    same, heard, status = [0], set(), MPI.Status()
    deadline = time.monotonic() + COLLECT
    while len(heard) < size - 1 and time.monotonic() < deadline:
        if world.iprobe(MPI.ANY_SOURCE, _DIGEST, status):
            r = status.Get_source()
            heard.add(r)
            if world.recv(source=r, tag=_DIGEST) == digest:
                same.append(r)
        else:
            time.sleep(_POLL)
    return sorted(same)


def _receive(world, source: int, tag: int, seconds: float):
    """The message from `source` on `tag` if one comes within `seconds`, else None (never a blocking wait)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if world.iprobe(source, tag):
            return world.recv(source=source, tag=tag)
        time.sleep(_POLL)
    return None


def _headed(ranks: list, brief: bool, text: str) -> str:
    """`text` under the line that names the ranks it is for."""
    if brief:
        return f"mpimesh: {ranks_text(ranks)}: {text}mpimesh: aborting all ranks\n"
    same = " (the same on each)" if len(ranks) > 1 else ""
    return f"mpimesh: uncaught exception on {ranks_text(ranks)}{same}; aborting all ranks\n{text}"


def ranks_text(ranks) -> str:
    """'rank 3', or 'ranks 0-3, 5' (see the module's example)."""
    runs: list = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    listed = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {listed}"


def _write(text: str) -> None:
    """One write to stderr (ranks' lines interleave less), never raising."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed stream
        pass


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARIES = ("<frozen", *{os.path.abspath(p) + os.sep for k, p in sysconfig.get_paths().items()
                            if k in ("stdlib", "platstdlib", "purelib", "platlib")})


def shown(kind, value, tb) -> list:
    """The lines Python would print for this exception, with mpimesh's frames dropped (and the
    library frames it called, down to the next frame of the program) in it and in the exceptions
    chained to it; the whole traceback with `MPIMESH_DEBUG=1` (see the module)."""
    whole = traceback.TracebackException(kind, value, tb)
    if env.early(env.flag, "MPIMESH_DEBUG", False):
        return list(whole.format())
    inside = _trim(whole, set())
    lines = list(whole.format())
    if inside is not None and isinstance(value, Exception) and not isinstance(value, MpimeshError):
        where = os.path.relpath(inside.filename, _PACKAGE)
        lines.append(f"(raised inside mpimesh at {where}:{inside.lineno}, in {inside.name}; MPIMESH_DEBUG=1 "
                     f"shows mpimesh's frames)\n")
    return lines


def _trim(te: traceback.TracebackException, seen: set) -> Optional[traceback.FrameSummary]:
    """Drop mpimesh's frames from `te` and from the exceptions chained to it; the innermost frame of
    mpimesh's, where the exception was raised in mpimesh or in a library it called, else None."""
    if id(te) in seen:
        return None
    seen.add(id(te))
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            _trim(chained, seen)
    kept, ours, last = [], False, None
    for f in te.stack:
        path = f.filename if f.filename.startswith("<") else os.path.abspath(f.filename)  # ("<stdin>": the program)
        if path.startswith(_PACKAGE):
            ours, last = True, f
        elif not (ours and path.startswith(_LIBRARIES)):
            ours = False
            kept.append(f)
    if kept:  # (nothing of the program's: left whole)
        te.stack = traceback.StackSummary.from_list(kept)
    return last if ours and kept else None


def end_self_after(seconds: float, rank: int) -> None:
    """Start a watchdog process that, if this process still lives `seconds` from now, writes one
    line on its stderr and kills it (SIGKILL): `MPI_Abort` hangs where the launcher cannot be
    reached. A separate process, since this one may be stuck inside MPI, holding the GIL."""
    pid = os.getpid()
    line = (f"mpimesh: rank {rank}: MPI_Abort did not end this process within {seconds:g} s (its launcher "
            f"cannot be reached: a node cut off?); ending it\n")
    script = f'trap "" PIPE; sleep {seconds:g}; kill -0 {pid} 2>/dev/null || exit 0; printf "%s" "$0" >&2; kill -9 {pid}'
    try:
        os.posix_spawn("/bin/sh", ["sh", "-c", script, line], os.environ)
    except OSError as e:  # no /bin/sh: MPI_Abort alone, as before
        sys.stderr.write(f"mpimesh: rank {rank}: no abort watchdog ({e})\n")
