"""Shared helpers for the benchmarks: a clean BLAS environment, timing across ranks, reports.

Import this module first thing in every benchmark, before numpy, mpi4py or mpimesh:

    import common  # noqa: F401  (fixes the BLAS environment, may re-exec the interpreter)

Measurement policy: a benchmark measures the default OpenBLAS kernel for this CPU with one BLAS
thread per rank. Some machines force an AVX2 kernel through `OPENBLAS_CORETYPE` (and may set
`OPENBLAS_L2_SIZE`); OpenBLAS reads those when it is loaded, so at import time this module
removes both, sets `OPENBLAS_NUM_THREADS`, `OMP_NUM_THREADS` and `MKL_NUM_THREADS` to 1, and,
if anything had to change, re-executes the interpreter with the same arguments. That is safe under
`mpiexec` because MPI has not been initialised yet (the process keeps its pid and the launcher's
file descriptors). The re-exec's mark names that pid, so a child process that inherits it (each of
benchmarks/gpu.py's precisions runs in one) still fixes its own environment, which its parent may
have changed since (`mpimesh.threads` drops a thread count it takes for an inherited default of its
own). This applies to benchmarks only, never to tests or CI.
"""
from __future__ import annotations

import os
import sys

_DROP = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_ONE = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_MARK = "MPIMESH_BENCH_REEXEC"  # "<pid>:<what changed>", set by the process that re-executed (execv keeps the pid)


def _fixed_here() -> str:
    """What re-executing this very process fixed ("" if it was not re-executed). A child process
    inherits its parent's mark, whose pid is not its own: it checks its own environment afresh."""
    pid, _, changed = os.environ.get(_MARK, "").partition(":")
    return changed if pid == str(os.getpid()) else ""


def _fix_environment() -> None:
    """Drop forced BLAS kernels, pin one BLAS thread, and re-exec once if anything changed."""
    env = os.environ
    dirty = [f"{k}={env[k]}" for k in _DROP if k in env] + \
        [f"{k}={env.get(k, '(unset)')}->1" for k in _ONE if env.get(k) != "1"]
    if not dirty:
        return
    if _fixed_here():  # already re-executed once: never loop
        sys.stderr.write(f"benchmarks/common.py: environment still not clean after re-exec: {'; '.join(dirty)}\n")
        return
    if "numpy" in sys.modules or "mpi4py.MPI" in sys.modules:
        raise RuntimeError("import benchmarks/common.py before numpy and mpi4py: the BLAS library "
                           "is already loaded with the old environment")
    for k in _DROP:
        env.pop(k, None)
    for k in _ONE:
        env[k] = "1"
    env[_MARK] = f"{os.getpid()}:{'; '.join(dirty)}"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable] + sys.argv)


_fix_environment()

# Let `python benchmarks/x.py` find the package without installing it (MPIMESH_BENCH_ROOT: another
# checkout's, for a comparison such as `dispatch.py --against`).
_ROOT = os.environ.get("MPIMESH_BENCH_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import time  # noqa: E402
from typing import Callable, Dict, Optional, Sequence, Tuple  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

WORLD = MPI.COMM_WORLD
LOCK_PATH = os.environ.get("MPIMESH_BENCH_LOCK", "/tmp/mpimesh-benchmarks.lock")


def _sleep_barrier(comm: MPI.Comm, poll: float = 0.01) -> None:
    """A barrier that sleeps instead of spinning (so waiting ranks leave the CPUs to others)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll)


def _run_alone() -> None:
    """One benchmark at a time on this machine: rank 0 takes an exclusive lock on `LOCK_PATH`
    (held until the process exits) while the other ranks sleep. Set MPIMESH_BENCH_LOCK="" to skip."""
    if not LOCK_PATH:
        return
    if WORLD.Get_rank() == 0:
        import fcntl
        global _lock_file
        _lock_file = open(LOCK_PATH, "a")
        try:
            fcntl.flock(_lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(f"waiting for another benchmark to finish (lock {LOCK_PATH})", file=sys.stderr, flush=True)
            fcntl.flock(_lock_file, fcntl.LOCK_EX)
    _sleep_barrier(WORLD)


_lock_file = None
_run_alone()


def rank0_print(*args, comm: Optional[MPI.Comm] = None, **kwargs) -> None:
    """`print` on rank 0 of `comm` (default COMM_WORLD) only, flushed."""
    if (comm or WORLD).Get_rank() == 0:
        print(*args, **kwargs, flush=True)


def kernel_report() -> str:
    """The BLAS libraries in use (threadpoolctl): library, version, kernel architecture, threads."""
    from threadpoolctl import threadpool_info

    lines = [f"python {sys.version.split()[0]}, numpy {np.__version__}, ranks {WORLD.Get_size()}, "
             f"MPI {MPI.Get_library_version().splitlines()[0].strip()}"]
    for info in threadpool_info():
        lines.append(f"{info.get('user_api')}: {info.get('internal_api')} {info.get('version')} "
                     f"kernel={info.get('architecture', '?')} threads={info.get('num_threads')} "
                     f"({os.path.basename(info.get('filepath', ''))})")
    forced = [f"{k}={os.environ[k]}" for k in _DROP if k in os.environ]
    lines.append(f"env fixed at start: {_fixed_here() or 'nothing to fix'}; still forced: "
                 f"{', '.join(forced) or 'none'}; cpus {os.cpu_count()}; load average {load_average()}")
    return "\n".join(lines)


def _gather_max(times: np.ndarray, comm: MPI.Comm) -> np.ndarray:
    """Per-repetition maximum over the ranks of `comm` (the slowest rank sets the time)."""
    out = np.empty_like(times)
    comm.Allreduce(times, out, op=MPI.MAX)
    return out


def timeit(fn: Callable[[], object], repeat: int = 10, warmup: int = 2,
           comm: Optional[MPI.Comm] = None) -> Tuple[float, float]:
    """(min, median) seconds of `fn()` over `repeat` runs after `warmup`, identical on every rank.

    Each run starts after a `comm.Barrier()`; a run's time is the slowest rank's.
    """
    return compare({"fn": fn}, repeat, warmup, comm)["fn"]


def compare(fns: Dict[str, Callable[[], object]], repeat: int = 10, warmup: int = 2,
            comm: Optional[MPI.Comm] = None) -> Dict[str, Tuple[float, float]]:
    """Like `timeit` for several functions, interleaved run by run (so drift hits all alike)."""
    comm = comm or WORLD
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            comm.Barrier()
            fns[n]()
    times = np.zeros((len(names), repeat))
    for r in range(repeat):
        for i, n in enumerate(names if r % 2 == 0 else names[::-1]):
            comm.Barrier()
            t0 = time.perf_counter()
            fns[n]()
            times[names.index(n), r] = time.perf_counter() - t0
    times = _gather_max(times, comm)
    return {n: (float(times[i].min()), float(np.median(times[i]))) for i, n in enumerate(names)}


def on_rank0(fn: Callable[[], object], comm: Optional[MPI.Comm] = None, poll: float = 0.005):
    """Run `fn()` on rank 0 only while the other ranks sleep (not spin) at a non-blocking barrier;
    every rank returns rank 0's result (a small picklable value)."""
    comm = comm or WORLD
    result = fn() if comm.Get_rank() == 0 else None
    _sleep_barrier(comm, poll)
    return comm.bcast(result, root=0)


def load_average() -> str:
    """The 1/5/15-minute load averages (other jobs on the machine make timings noisy)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def verdict(name: str, met: bool, detail: str) -> str:
    """One verdict line: `VERDICT <name>: MET|MISSED (<detail>)`."""
    return f"VERDICT {name}: {'MET' if met else 'MISSED'} ({detail})"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A right-aligned text table."""
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


def fmt_bytes(n: int) -> str:
    """4096 -> '4 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024
    return str(n)
