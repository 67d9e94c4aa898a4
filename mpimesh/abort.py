"""One rank's uncaught exception ends the whole job, from `import mpimesh` on.

Without this, a rank that dies (say, before its first `Mesh`, opening a missing file) leaves the
others waiting forever in their next collective. Under MPI with more than one rank, `install()`
wraps `sys.excepthook`: it prints the traceback with the rank's number, leaves the launcher
`ABORT_GRACE` seconds to forward it, then calls `MPI_Abort`. mpimesh's own errors (`MpimeshError`:
bad input, which the message names) show only the program's frames, not mpimesh's. A collective
that failed (time-out, departed rank, divergence) prints only its message, one paragraph that
already names where each rank was: the traceback through mpimesh's internals would say nothing
more. Set
`MPIMESH_NO_ABORT=1` (or on, true, yes) to keep Python's own hook (a debugger's post-mortem, say);
any value but those and 0/off/false/no still installs the hook, and the first `Mesh` raises its error.

`MPI_Abort` asks the launcher to end the job; a rank on a node cut off from it (a failed link)
would wait there forever, holding its GPU and memory. So a watchdog process is started first: if
the rank is still alive `ABORT_WATCHDOG` seconds later, it says so on the rank's stderr and kills it.

>>> install()  # idempotent; a no-op on one rank
>>> getattr(sys.excepthook, "_mpimesh", False) == (MPI.COMM_WORLD.Get_size() > 1)
True
"""
from __future__ import annotations

import os
import sys
import time
import traceback

from mpi4py import MPI

from . import env
from .errors import CollectiveTimeoutError, DivergenceError, MpimeshError

ABORT_GRACE = 0.5  # seconds between printing an uncaught exception and ending the job
ABORT_WATCHDOG = 5.0  # seconds MPI_Abort has to end this process before the watchdog does


def install() -> None:
    """Make an uncaught exception on any rank print its traceback and end the whole job (called at
    import, and again by `Mesh` for a program that initialises MPI itself after importing us)."""
    off = env.early(env.flag, "MPIMESH_NO_ABORT", False)  # a bad value: the hook, and its error at the next Mesh
    if (off or not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1
            or getattr(sys.excepthook, "_mpimesh", False)):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            rank = MPI.COMM_WORLD.Get_rank()
            if isinstance(value, (CollectiveTimeoutError, DivergenceError)):
                sys.stderr.write(f"mpimesh: rank {rank}: {kind.__name__}: {value}\nmpimesh: aborting all ranks\n")
            else:
                sys.stderr.write(f"mpimesh: uncaught exception on rank {rank}; aborting all ranks\n"  # (one write:
                                 + "".join(_shown(kind, value, tb)))                        # ranks interleave less)
            sys.stderr.flush()
            time.sleep(ABORT_GRACE)  # the launcher forwards our stderr before MPI_Abort tears it down
        finally:
            end_self_after(ABORT_WATCHDOG, MPI.COMM_WORLD.Get_rank())
            MPI.COMM_WORLD.Abort(1)

    hook._mpimesh = True  # type: ignore[attr-defined]
    hook.previous = previous  # type: ignore[attr-defined]
    sys.excepthook = hook


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _shown(kind, value, tb) -> list:
    """The traceback's lines; for mpimesh's own errors (bad input, named in the message) only the
    program's frames, not mpimesh's internals: each rank's is a few lines, the line at fault last."""
    shown = traceback.TracebackException(kind, value, tb)
    if isinstance(value, MpimeshError):
        mine = [f for f in shown.stack if not os.path.abspath(f.filename).startswith(_PACKAGE)]
        if mine:
            shown.stack = traceback.StackSummary.from_list(mine)
    return list(shown.format())


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
