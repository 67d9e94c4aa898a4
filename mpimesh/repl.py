"""An SPMD Python REPL: what is typed at rank 0's prompt runs on every rank.

Usage::

    $ mpimesh-repl -n 4                       # or: python -m mpimesh.repl -n 4
    $ mpiexec -n 4 python -m mpimesh.repl     # under any launcher (srun, mpirun -hostfile ...)

Each rank has its own namespace, starting with ``mm``, ``np``, ``rank`` and ``size``. Output shows
once, from rank 0, plus any rank whose output or exception differs (``[rank k]``); tracebacks show
the statement's frames (`mpimesh.abort.shown`). Ctrl-C interrupts the statement on every rank;
ranks left in different collectives are named and the job ends rather than hang. ``mpimesh-repl``
owns the terminal and launches the ranks itself. README.md ("Interactive use") says more.
"""
from __future__ import annotations

import argparse
import builtins
import codeop
import contextlib
import io
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Dict, List, Optional, Tuple

try:  # line editing and history for input() in a terminal (where Python has it)
    import readline  # noqa: F401
except ImportError:
    pass

import numpy as np
from mpi4py import MPI

import mpimesh
from .abort import ABORT_GRACE, shown
from .launch import find_mpiexec, job_env

READY = b"\x00mpimesh-repl-ready\x00\n"  # rank 0 -> front end (serve mode): the next statement, please
POLL = 0.005  # seconds between checks while waiting for a message (MPICH's blocking calls spin)
GRACE = 5.0  # seconds ranks get to report after an interrupt before they count as stuck
NOTICE = 1.0  # seconds after an interrupt before rank 0 says where it is stuck, if it has not moved
KILL_AFTER = 3.0  # seconds the launcher gets to end the job after SIGTERM before it is killed
HINT = 30.0  # seconds rank 0 waits for the others before saying what it is waiting for
_CMD, _REPORT = 1, 2  # message tags on the session's own communicator
_COLLECTIVES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "collectives", "")

Report = Tuple[str, Optional[str], Optional[object]]  # (output, traceback, exit code if exit() ran)


class _Interrupts:
    """SIGINT and SIGUSR1 raise KeyboardInterrupt only while `armed`: on every rank while a statement
    runs, and on rank 0 at its prompt. Elsewhere (a rank waiting for the next statement) they do nothing."""

    def __init__(self):
        self.armed = False
        self.count = 0  # every interrupt, armed or not: rank 0 polls it while collecting reports
        for sig in (signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.count += 1
        if self.armed:
            raise KeyboardInterrupt


class _Tee(io.TextIOBase):
    """A text stream that records what is written, and passes it on to `live` if given."""

    def __init__(self, live=None):
        self.live, self.parts = live, []

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.parts.append(s)
        if self.live is not None:
            self.live.write(s)
        return len(s)

    def flush(self) -> None:
        if self.live is not None:
            self.live.flush()

    def text(self) -> str:
        return "".join(self.parts)


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


def _say(text: str) -> None:
    """A line for the user from a rank (to the launcher, whatever sys.stdout is redirected to)."""
    sys.__stdout__.write(text + "\n")
    sys.__stdout__.flush()


def _where(frame) -> str:
    """The calls `frame` is in, from the statement's line inward, e.g. `<module> (<stdin>:1) > f (a.py:3)`."""
    stack = traceback.extract_stack(frame)
    ours = [i for i, f in enumerate(stack) if f.filename == __file__]  # the REPL's frames and their callers
    return " > ".join(f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})"
                      for f in stack[ours[-1] + 1 if ours else 0:])


def _groups(texts: Dict[int, str]) -> List[Tuple[List[int], str]]:
    """Ranks grouped by identical text, in rank order."""
    out: Dict[str, List[int]] = {}
    for r in sorted(texts):
        out.setdefault(texts[r], []).append(r)
    return [(ranks, text) for text, ranks in out.items()]


def format_reports(reports: Dict[int, Report]) -> str:
    """What rank 0 shows after a statement, beyond its own live output: the other ranks' output
    where it differs from rank 0's, then the tracebacks (once if every rank raised the same one).

    >>> print(format_reports({0: ("a\\n", None, None), 1: ("a\\n", None, None), 2: ("b\\n", "E\\n", None)}))
    [rank 2] b
    [rank 2] E
    """
    lines: List[str] = []
    other = {r: out for r, (out, _, _) in reports.items() if r != 0 and out and out != reports[0][0]}
    for ranks, text in _groups(other):
        lines += [f"[{_ranks(ranks)}] {line}" for line in text.rstrip("\n").split("\n")]
    errors = {r: err for r, (_, err, _) in reports.items() if err}
    groups = _groups(errors)
    if len(groups) == 1 and len(groups[0][0]) == len(reports) > 0:
        lines.append(groups[0][1].rstrip("\n"))
    else:
        for ranks, text in groups:
            lines += [f"[{_ranks(ranks)}] {line}" for line in text.rstrip("\n").split("\n")]
    return "\n".join(lines)


class Session:
    """One rank's side of the REPL. Rank 0 reads statements (from a terminal or pipe, or as JSON
    lines from the `mpimesh-repl` front end when `serve`), sends each to the other ranks, runs it,
    gathers every rank's output and errors, and shows them."""

    def __init__(self, serve: bool = False):
        self.comm = MPI.COMM_WORLD.Dup()  # the REPL's messages never meet the user's collectives
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.serve = serve
        self.compile = codeop.CommandCompiler()
        self.namespace = {"__name__": "__console__", "__doc__": None, "mm": mpimesh, "np": np,
                          "rank": self.rank, "size": self.size}
        self.interrupts = _Interrupts()
        if self.rank == 0:
            sys.stdout.reconfigure(line_buffering=True)  # a pipe under every launcher

    # -- every rank -------------------------------------------------------------------------------
    def run(self, source: str) -> Report:
        """Run `source` in this rank's namespace; return its output, traceback and exit request."""
        out = _Tee(live=sys.__stdout__ if self.rank == 0 else None)
        err: Optional[str] = None
        code: Optional[object] = None
        saved = sys.stdout, sys.stderr, sys.displayhook
        sys.stdout = sys.stderr = out
        sys.displayhook = self._display
        try:
            self.interrupts.armed = True
            code_obj = self.compile(source, "<stdin>", "single")  # None: unfinished (input ended in a block)
            exec(code_obj if code_obj is not None else compile(source, "<stdin>", "single"), self.namespace)
        except SystemExit as e:
            code = 0 if e.code is None else e.code
        except (SyntaxError, OverflowError, ValueError) as e:
            # from compile, or from the statement: the traceback starts in codeop or in this frame
            inner = e.__traceback__.tb_next
            frames = inner if inner is not None and inner.tb_frame.f_code.co_filename == "<stdin>" else None
            err = "".join(shown(type(e), e, frames) if frames else
                          traceback.format_exception_only(type(e), e))
        except BaseException as e:  # noqa: B036 - KeyboardInterrupt is reported like any error
            err = "".join(shown(type(e), e, e.__traceback__.tb_next))  # the statement's frames, not mpimesh's
        finally:
            self.interrupts.armed = False
            sys.stdout, sys.stderr, sys.displayhook = saved
        return out.text(), err, code

    def _display(self, value) -> None:
        """sys.displayhook on every rank: a DistTensor's repr may gather, so no rank may skip it."""
        if value is None:
            return
        builtins._ = None
        sys.stdout.write(repr(value) + "\n")
        builtins._ = value

    def _receive(self, source: int, tag: int):
        """A message from `source`, sleeping between probes (MPICH's blocking receive spins a core)."""
        while not self.comm.Iprobe(source=source, tag=tag):
            time.sleep(POLL)
        return self.comm.recv(source=source, tag=tag)

    def loop(self) -> int:
        """Serve statements until exit; return the exit status."""
        if self.rank == 0:
            return self._lead()
        while True:
            kind, arg = self._receive(0, _CMD)
            if kind == "exit":
                return int(arg) if isinstance(arg, int) else (0 if arg is None else 1)
            self.comm.send(self.run(arg), dest=0, tag=_REPORT)

    # -- rank 0 -----------------------------------------------------------------------------------
    def _lead(self) -> int:
        self._watch()
        print(f"mpimesh {mpimesh.__version__} SPMD REPL on {self.size} rank"
              f"{'s' if self.size > 1 else ''}, Python {sys.version.split()[0]}. Every statement runs on "
              "every rank;\noutput shows once (rank 0's), plus any rank whose output differs. Preloaded: "
              "mm, np, rank, size.\nexit() or Ctrl-D ends the session on every rank.")
        while True:
            source = self._read()
            if source is None:  # end of input
                return self._end(0)
            for r in range(1, self.size):
                self.comm.send(("run", source), dest=r, tag=_CMD)
            reports = {0: self.run(source)}
            reports.update(self._collect())
            shown = format_reports(reports)
            if shown:
                print(shown)
            codes = [c for _, _, c in reports.values() if c is not None]
            if codes:
                return self._end(codes[0])

    def _watch(self) -> None:
        """Start rank 0's watch on its own interrupts. Python acts on a signal only between bytecodes,
        so one that arrives during a call that never returns (a collective the other ranks skipped)
        raises nothing. A thread woken by each signal (through the wakeup fd) checks that the statement
        moved: if not within NOTICE seconds it says where rank 0 is stuck; if that is one of mpimesh's
        collectives, it ends the job after GRACE (a long numpy call is left to finish)."""
        wakeups, self._wakeup = socket.socketpair()
        self._wakeup.setblocking(False)
        signal.set_wakeup_fd(self._wakeup.fileno())
        main = threading.main_thread().ident

        def watch() -> None:
            while True:
                if wakeups.recv(1)[0] not in (signal.SIGINT, signal.SIGUSR1) or not self.interrupts.armed:
                    continue
                frame = sys._current_frames()[main]
                at = frame.f_lasti

                def stuck() -> bool:  # still in the statement, at the same instruction of the same frame
                    return (self.interrupts.armed and sys._current_frames()[main] is frame
                            and frame.f_lasti == at)
                time.sleep(NOTICE)
                if not stuck():
                    continue
                if not any(_COLLECTIVES in f.filename for f in traceback.extract_stack(frame)):
                    _say(f"\nmpimesh-repl: rank 0 has not seen the interrupt yet: it is in {_where(frame)}, a "
                         "call Python cannot interrupt; the interrupt lands when it returns (a second Ctrl-C "
                         f"after {GRACE + 1:.0f} s ends the job)")
                    continue
                _say(f"\nmpimesh-repl: rank 0 has not seen the interrupt: it is in {_where(frame)}, a call "
                     "Python cannot interrupt (a collective the other ranks skipped never returns); ending the "
                     f"job in {GRACE - NOTICE:.0f} s unless it returns")
                time.sleep(GRACE - NOTICE)
                if stuck():  # and so is any rank whose report has not come
                    self._give_up([0, *(r for r in range(1, self.size) if not self.comm.Iprobe(r, _REPORT))])

        threading.Thread(target=watch, daemon=True).start()

    @staticmethod
    def _give_up(stuck: List[int]) -> None:
        """End the job: the `stuck` ranks did not stop after an interrupt, and can never meet the others."""
        _say(f"mpimesh-repl: {_ranks(stuck)} did not stop (stuck in a collective the other ranks left); "
             "ending the job")
        time.sleep(ABORT_GRACE)  # the launcher forwards our output before MPI_Abort tears it down
        MPI.COMM_WORLD.Abort(1)

    def _end(self, code) -> int:
        for r in range(1, self.size):
            self.comm.send(("exit", code), dest=r, tag=_CMD)
        sys.stdout.flush()
        return int(code) if isinstance(code, int) else (0 if code is None else 1)

    def _read(self) -> Optional[str]:
        """The next complete statement, or None at end of input."""
        if self.serve:
            sys.stdout.flush()
            sys.__stdout__.buffer.write(READY)
            sys.__stdout__.buffer.flush()
            line = sys.stdin.readline()
            return json.loads(line) if line.strip() else None
        self.interrupts.armed = True  # Ctrl-C at the prompt drops the unfinished statement
        try:
            return read_statement()
        finally:
            self.interrupts.armed = False

    def _collect(self) -> Dict[int, Report]:
        """Every other rank's report. After an interrupt, ranks that have not reported within `GRACE`
        seconds are stuck in a collective their peers left: name them and end the job."""
        reports: Dict[int, Report] = {}
        missing = list(range(1, self.size))
        interrupted_at: Optional[float] = None
        seen = self.interrupts.count  # disarmed: an interrupt is counted, never raised mid-receive
        hint_at = time.monotonic() + HINT
        while missing:
            if interrupted_at is None and self.interrupts.count != seen:
                interrupted_at = time.monotonic()
            if interrupted_at is None and time.monotonic() > hint_at:
                hint_at = float("inf")
                _say(f"mpimesh-repl: rank 0 finished {HINT:.0f} s ago; waiting for {_ranks(missing)} (a "
                     "collective only some ranks run never ends: Ctrl-C interrupts)")
            for r in list(missing):
                if self.comm.Iprobe(source=r, tag=_REPORT):
                    reports[r] = self.comm.recv(source=r, tag=_REPORT)
                    missing.remove(r)
            if missing and interrupted_at is not None and time.monotonic() - interrupted_at > GRACE:
                self._give_up(missing)
            time.sleep(POLL)
        return reports


def complete(source: str) -> bool:
    """Whether `source` is a whole statement (or a syntax error, which is shown, not continued).

    >>> complete("x = 1"), complete("for i in range(3):"), complete("for i in range(3):\\n  print(i)\\n")
    (True, False, True)
    """
    try:
        return codeop.compile_command(source, "<stdin>", "single") is not None
    except (SyntaxError, OverflowError, ValueError):
        return True


def read_statement() -> Optional[str]:
    """The next whole statement typed at `>>> ` / `... ` prompts, or None at end of input; Ctrl-C
    (KeyboardInterrupt) drops the unfinished one, as Python's REPL does."""
    lines: List[str] = []
    while True:
        try:
            lines.append(input("... " if lines else ">>> "))
        except KeyboardInterrupt:
            print("\nKeyboardInterrupt", flush=True)
            lines = []
            continue
        except EOFError:  # the statement typed so far runs (an unfinished one: its SyntaxError), as Python's REPL
            print(flush=True)
            return "\n".join(lines) + "\n" if lines else None
        if complete("\n".join(lines)):
            return "\n".join(lines)


# -- the front end: owns the terminal, launches the ranks ----------------------------------------
def _marker_prefix(buf: bytes) -> int:
    """The length of the longest end of `buf` that could begin a READY marker."""
    return next((k for k in range(min(len(buf), len(READY) - 1), 0, -1) if READY.startswith(buf[-k:])), 0)


class FrontEnd:
    """`mpimesh-repl -n N`: reads statements with readline, sends each to rank 0 of a launched job,
    copies the job's output to the terminal, and turns Ctrl-C during a statement into SIGUSR1 for
    the launcher to forward (MPICH's mpiexec ends the job at a second SIGINT, but not at SIGUSR1).
    SIGTERM or SIGHUP (the terminal closed) ends the job, then this process."""

    def __init__(self, cmd: List[str], ranks: int):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=job_env(),
                                     start_new_session=True)  # its own process group, for _end_job
        self.ranks = ranks
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._copy, daemon=True)
        self.reader.start()

    def _copy(self) -> None:
        """Copy the job's output to our stdout, turning each READY marker into `self.ready`."""
        fd, buf, out = self.proc.stdout.fileno(), b"", sys.stdout.buffer
        while True:
            chunk = os.read(fd, 65536)
            buf += chunk
            while READY in buf:
                before, buf = buf.split(READY, 1)
                out.write(before)
                out.flush()
                self.ready.set()
            keep = _marker_prefix(buf) if chunk else 0  # a marker may straddle two reads
            out.write(buf[:len(buf) - keep])
            out.flush()
            buf = buf[len(buf) - keep:]
            if not chunk:
                self.ready.set()
                return

    def _wait(self) -> bool:
        """Wait for the job to ask for a statement; False once it has ended."""
        first: Optional[float] = None
        while True:
            try:
                while not self.ready.wait(0.1):
                    pass
                self.ready.clear()
                return self.proc.poll() is None and self.reader.is_alive()
            except KeyboardInterrupt:
                if first is None or time.monotonic() - first < GRACE + 1:
                    first = first or time.monotonic()
                    self.proc.send_signal(signal.SIGUSR1)
                else:  # rank 0 cannot even end the job: only we can
                    self._end_job("the ranks do not stop")

    def _on_signal(self, signum, frame) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # no KeyboardInterrupt while we end the job
        self._end_job(signal.Signals(signum).name)
        sys.exit(128 + signum)

    def _end_job(self, why: str) -> None:
        """Say so, and end the job: SIGTERM to the launcher's process group (MPICH's mpiexec then ends
        every rank, whichever process group it is in), then SIGKILL to what remains of the group."""
        with contextlib.suppress(OSError):  # a terminal that hung up
            print(f"\nmpimesh-repl: {why}: ending the job ({self.ranks} rank{'s' if self.ranks > 1 else ''})",
                  file=sys.stderr, flush=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            deadline = time.monotonic() + KILL_AFTER
            while self.proc.poll() is None and time.monotonic() < deadline:  # poll: safe in a signal handler
                time.sleep(0.05)

    def loop(self) -> int:
        """Statements in, output out, until exit(), Ctrl-D or the job ends; return its exit status."""
        while self._wait():
            source = read_statement()
            try:
                if source is None:
                    self.proc.stdin.close()
                    break
                self.proc.stdin.write(json.dumps(source).encode() + b"\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                break
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.reader.join(timeout=5)
        return code


def main(argv: Optional[List[str]] = None) -> int:
    """`mpimesh-repl [-n N] [--launcher CMD]`: with -n, launch N ranks and drive them from this
    terminal; without, be one rank of the session (as under `mpiexec -n N python -m mpimesh.repl`)."""
    parser = argparse.ArgumentParser("mpimesh-repl", description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--np", type=int, metavar="N", help="launch N ranks and drive them from here")
    parser.add_argument("--launcher", metavar="CMD", help="launch command, {n} for the rank count "
                        "(default: the mpiexec beside this Python, '<mpiexec> -n {n}'), e.g. 'srun -n {n}'")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.np is None:
        return Session(serve=ns.serve).loop()
    if ns.np < 1:
        parser.error(f"-n must be at least 1, got {ns.np}")
    try:
        launcher = shlex.split(ns.launcher.format(n=ns.np)) if ns.launcher else [find_mpiexec(), "-n", str(ns.np)]
    except FileNotFoundError as e:
        parser.exit(2, f"error: {e}\n")
    except (KeyError, IndexError, ValueError) as e:  # a {field} other than {n}, or an unclosed quote
        what = f"unknown field {{{e.args[0]}}}" if isinstance(e, KeyError) else str(e)
        parser.error(f"--launcher {ns.launcher!r}: {what} (the one field is {{n}}, the rank count)")
    if not launcher or shutil.which(launcher[0]) is None:
        parser.error(f"--launcher {ns.launcher!r}: no program {launcher[0] if launcher else ''!r} on PATH")
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()  # this process only drives the job
    return FrontEnd([*launcher, sys.executable, "-m", "mpimesh.repl", "--serve"], ns.np).loop()


if __name__ == "__main__":
    sys.exit(main())
