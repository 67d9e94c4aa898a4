"""Saves that do not stop training: `mm.save(path, tensors, blocking=False)` returns a `SaveHandle` at once.

The call agrees with the other ranks, copies the blocks this rank writes (what is saved is the values at
the call) and makes the temporary directory; a background thread writes and fsyncs the files, then
commits as a blocking save does, its few collectives on a duplicate of the mesh's communicator
(`checkpoint_sync.CommOps`). A save or a load first waits for the save under way (`wait_pending`).
How, and why it is safe: docs/checkpoints.md.

>>> import os, tempfile, numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> h = mm.save(os.path.join(tempfile.mkdtemp(), "ck"), {"w": mesh.from_numpy(np.arange(3.0), "a:3")}, blocking=False)
>>> h.wait(); h.done(), mm.load(h.path, mesh)["w"].to_numpy()
(True, array([0., 1., 2.]))
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from .checkpoint_sync import CommOps, MeshOps, Ops
from .errors import CheckpointError

Write = Callable[[], Optional[str]]
Commit = Callable[[Ops, Optional[str]], None]

_pending: list = []  # the background save not yet waited for by the next save (at most one)


class SaveHandle:
    """A checkpoint being written in the background (`mm.save(..., blocking=False)`).

    `wait()` blocks until it is committed, and raises its `CheckpointError` (the same on every rank) if it
    failed; `done()` says whether it has finished, without waiting."""

    def __init__(self, path: str):
        self.path = path
        """The checkpoint's absolute path."""
        self.seconds: Optional[float] = None
        """Seconds from the call to the commit, once done (None before)."""
        self._error: Optional[str] = None
        self._told = False  # the error was raised to the caller once
        self._t0 = time.perf_counter()
        self._thread: Optional[threading.Thread] = None

    def done(self) -> bool:
        """Whether the save has finished (committed or failed): `wait()` then returns at once."""
        return self._thread is not None and not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save has finished; raise its CheckpointError if it failed."""
        self._thread.join()
        self._told = True
        if self._error is not None:
            raise CheckpointError(self._error)

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error else f"done in {self.seconds:.3f} s"
        return f"SaveHandle({self.path!r}, {state})"

    def _run(self, write: Write, commit: Commit, ops: CommOps) -> None:
        try:
            commit(ops, write())
        except CheckpointError as e:
            self._error = str(e)
        except Exception as e:  # (write and commit report their errors on every rank: this is a bug's last net)
            self._error = f"cannot save checkpoint {self.path!r}: {type(e).__name__}: {e}"
        finally:
            ops.free()
            self.seconds = time.perf_counter() - self._t0


def launch(mesh, path: str, write: Write, commit: Commit, ops: Optional[CommOps]) -> Optional[SaveHandle]:
    """`commit(ops, write())`: with `ops` None, here, on the mesh's transport (a blocking save: None);
    else on a background thread that owns `ops` (made by `CommOps.of(mesh)` on every rank): its handle."""
    if ops is None:
        commit(MeshOps(mesh), write())
        return None
    handle = SaveHandle(path)
    handle._thread = threading.Thread(target=handle._run, args=(write, commit, ops), name="mpimesh-save")
    _pending.append(handle)
    handle._thread.start()
    return handle


def wait_pending() -> None:
    """Wait for the background save still running, if any; raise its error here if no `wait()` has."""
    while _pending:
        handle = _pending.pop()
        handle._thread.join()
        if handle._error is not None and not handle._told:
            handle._told = True
            raise CheckpointError(f"the background save of {handle.path!r} failed: {handle._error}")
