"""BLAS/OpenMP threads per rank: by default the cores divided among the ranks on this node.

Under MPI each rank gets `max(1, cores // ranks on this node)` threads, so that ranks sharing a
node's cores do not fight over them: at `import mpimesh` from the launcher's count of local ranks
(setting `OMP_NUM_THREADS`, `OPENBLAS_NUM_THREADS`, `MKL_NUM_THREADS` before numpy loads BLAS), else
at the first `Mesh` (through threadpoolctl where BLAS is loaded already). `MPIMESH_THREADS=N`, one of
those variables set before the program starts, or `set_threads(n)` override it; `describe()` says
what is in force. How the count is found and passed to child jobs: docs/environment.md.

>>> info = settings()
>>> sorted(info), info["threads"] >= 1
(['cores', 'local_ranks', 'source', 'threads'], True)
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from mpi4py import MPI

from . import env
from .errors import MpimeshError

__all__ = ["configure_at_import", "configure_for", "set_threads", "settings", "describe", "cores"]

_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_AUTO = "MPIMESH_AUTO_THREADS"  # the value this module put in _VARS by default (not a user's choice)
_LOCAL_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
               "PALS_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
_DEFAULT = "cores // local ranks"
_state: dict = {"threads": None, "source": "not set", "local_ranks": None}


def cores() -> int:
    """The cores this process may run on (its CPU affinity, which a launcher's binding narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def _launcher_local_ranks() -> Optional[int]:
    for name in _LOCAL_VARS:
        n = _env_int(name)
        if n is not None:
            return n
    return None


def _apply(n: int, source: str, local_ranks: Optional[int]) -> None:
    _state.update(threads=n, source=source, local_ranks=local_ranks)
    for var in _VARS:
        os.environ[var] = str(n)  # for BLAS loaded from now on, and for child processes
    if source == _DEFAULT:
        os.environ[_AUTO] = str(n)
    else:
        os.environ.pop(_AUTO, None)
    if "numpy" in sys.modules:  # BLAS may be loaded already: its pools are resized in place
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            return
        threadpool_limits(limits=n)


def configure_at_import() -> None:
    """Set the default before numpy loads, where the launcher says how many ranks share the node."""
    inherited = os.environ.pop(_AUTO, None)
    for var in _VARS:  # a parent's default, chosen for its own job's ranks: not an override
        if inherited is not None and os.environ.get(var) == inherited:
            del os.environ[var]
    forced = env.early(env.whole, "MPIMESH_THREADS", None, minimum=1)  # a bad value: raised by the first Mesh
    if forced is not None:
        _apply(forced, "MPIMESH_THREADS", _launcher_local_ranks())
    elif any(v in os.environ for v in _VARS):
        _state.update(threads=_env_int("OMP_NUM_THREADS") or _env_int("OPENBLAS_NUM_THREADS")
                      or _env_int("MKL_NUM_THREADS"), source="environment")
    else:
        local = _launcher_local_ranks()
        if local is not None:
            _apply(max(1, cores() // local), _DEFAULT, local)


def configure_for(comm) -> None:
    """At the first `Mesh` (a collective over `comm`): the default, if nothing has set one yet.
    Every `Mesh` calls it: first it raises the `MpimeshError` of any `MPIMESH_*` variable that was
    read at import and has a bad value (`env.raise_kept`; on every rank alike, as every rank has
    the same environment)."""
    env.raise_kept()
    if _state["source"] != "not set" or comm.Get_size() == 1:
        return
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_size()
    node.Free()
    _apply(max(1, cores() // local), _DEFAULT, local)


def set_threads(n: int) -> None:
    """Use `n` BLAS/OpenMP threads on this rank from now on."""
    if not isinstance(n, int) or n < 1:
        raise MpimeshError(f"threads must be a positive int, got {n!r}")
    _apply(n, "set_threads", _state["local_ranks"])


def settings() -> dict:
    """`{"threads", "source", "cores", "local_ranks"}`: what is in force and why."""
    env.raise_kept("MPIMESH_THREADS")
    return {"threads": _state["threads"] or cores(), "source": _state["source"], "cores": cores(),
            "local_ranks": _state["local_ranks"]}


def describe() -> str:
    """One line for a program's header, e.g. `BLAS threads per rank: 1 (2 cores, 4 ranks on this node)`."""
    s = settings()
    if s["source"] == _DEFAULT:
        why = f"{s['cores']} cores, {s['local_ranks']} ranks on this node; MPIMESH_THREADS=N overrides"
    elif s["source"] == "not set":
        why = "one rank: the BLAS default"
    else:
        why = f"from {s['source']}"
    return f"BLAS threads per rank: {s['threads']} ({why})"
