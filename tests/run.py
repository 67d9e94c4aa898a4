"""The test entry point: the whole suite under MPI on 1, 2, 3, 4 and 8 ranks (3: uneven blocks).

Usage::

    python tests/run.py                          # every test, on 1, 2, 3, 4 and 8 ranks
    MPIMESH_TEST_RANKS="1 4" python tests/run.py -x -k einsum
    python tests/run.py tests/test_shape.py      # paths given replace tests/
    python tests/run.py --backend cupy           # every mesh on CuPy (MPIMESH_BACKEND=cupy): needs a GPU

Each run is ``mpiexec -n N python -m pytest --with-mpi -q -p no:cacheprovider tests/ [args]`` (where
pytest-mpi is not installed, or ``MPIMESH_TEST_NO_PYTEST_MPI=1``, its stand-in tests/mpi_marks.py in place
of ``--with-mpi``), killed
after ``MPIMESH_TEST_TIMEOUT`` seconds (default 1500, about twice the slowest run in CI: the 1-rank
session, which also runs the README's commands in fresh environments, tests/test_install.py, took
600-770 s in December 2026; a hang costs 25 minutes, not the whole CI budget), with ``MPIMESH_DEBUG=1`` (every op's local output shapes
checked against their layouts; ``MPIMESH_DEBUG=0`` turns it off). A run passes only if pytest exits 0 on every rank:
"no tests collected" (exit 5) is a failure. Only rank 0 reports live (see tests/conftest.py). The last line
is ``<runs> passed, <runs> failed``, counting rank counts; the exit status is 0 only if every run passed.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent


def _launch():
    """``mpimesh/launch.py``, loaded from its file alone: importing the package would run
    ``mpimesh/__init__`` (initialising MPI in this process, or failing on a half-written module)."""
    spec = importlib.util.spec_from_file_location("_mpimesh_launch", ROOT / "mpimesh" / "launch.py")
    assert spec is not None and spec.loader is not None
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    return launch


_EXIT_NAMES = {1: "tests failed", 2: "interrupted", 3: "internal error", 4: "usage error",
               5: "no tests collected", 255: "timed out or killed"}


def _has_paths(args: List[str]) -> bool:
    """Whether the extra pytest arguments name test files or directories of their own."""
    return any(not a.startswith("-") and (ROOT / a.split("::")[0]).exists() for a in args)


def backend_option(args: List[str]) -> Tuple[Optional[str], List[str]]:
    """`--backend NAME` (or `--backend=NAME`) taken out of `args`: (NAME or None, the other args).

    >>> backend_option(["-x", "--backend", "cupy", "-k", "einsum"])
    ('cupy', ['-x', '-k', 'einsum'])
    """
    rest, backend, it = [], None, iter(args)
    for a in it:
        if a == "--backend":
            backend = next(it, "")
        elif a.startswith("--backend="):
            backend = a.split("=", 1)[1]
        else:
            rest.append(a)
    return backend, rest


def check_backend(backend: str) -> Optional[str]:
    """None if meshes can use `backend` here, else why not (mpimesh's own one-line error), asked in
    a child process so that this one never initialises MPI or CUDA."""
    code = "import mpimesh.backend as b, sys; b.array_module(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, backend], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, MPIMESH_NO_ABORT="1"))
    if proc.returncode == 0:
        return None
    return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]


def mpi_plugin(env: Dict[str, str]) -> List[str]:
    """pytest's arguments that run the tests marked `mpi`: `--with-mpi` where pytest-mpi is installed
    (unless `env` has MPIMESH_TEST_NO_PYTEST_MPI=1), else its stand-in tests/mpi_marks.py (tests/ put
    on `env`'s PYTHONPATH for it)."""
    if importlib.util.find_spec("pytest_mpi") is not None and env.get("MPIMESH_TEST_NO_PYTEST_MPI") != "1":
        return ["--with-mpi"]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "tests"), env.get("PYTHONPATH")) if p)
    return ["-p", "no:pytest_mpi", "-p", "mpi_marks"]  # (pytest-mpi, if there, would skip marked tests)


def main(extra: List[str]) -> int:
    backend, extra = backend_option(extra)
    ranks = [int(n) for n in os.environ.get("MPIMESH_TEST_RANKS", "1 2 3 4 8").split()]
    timeout = int(os.environ.get("MPIMESH_TEST_TIMEOUT", "1500"))
    launch = _launch()
    mpiexec = launch.find_mpiexec()
    # (job_env: also more ranks than cores under Open MPI, as MPICH allows them)
    env: Dict[str, str] = launch.job_env(MPIEXEC_TIMEOUT=str(timeout), MPIMESH_TEST_QUIET_NONZERO="1")
    if backend is not None:
        why = check_backend(backend)
        if why is not None:
            print(f"tests/run.py --backend {backend}: {why}", file=sys.stderr)
            return 2
        env["MPIMESH_BACKEND"] = backend  # every Mesh made without backend= uses it
    # Up to 8 ranks share a few cores: one BLAS thread each, or they fight for the cores.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    env.setdefault("MPIMESH_DEBUG", "1")  # every op's local outputs checked against their layouts
    # Calibrations (`mpimesh.cost.cache`) kept for this run only, not mixed with the user's own
    cache = None if "MPIMESH_CACHE_DIR" in env else tempfile.mkdtemp(prefix="mpimesh-test-cache-")
    env.setdefault("MPIMESH_CACHE_DIR", cache or "")
    # Byte code (and pytest's rewritten test modules) cached by the first session for all the others:
    # without it, each of the 18 processes recompiles every module (2 s each, on 2 cores).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    targets = [] if _has_paths(extra) else ["tests/"]
    plugin = mpi_plugin(env)
    results: List[Tuple[int, int, float]] = []
    for n in ranks:
        cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "pytest", *plugin, "-q",
               "-p", "no:cacheprovider", *targets, *extra]
        print(f"\n{'=' * 25} {n} rank{'s' if n > 1 else ''}: {' '.join(cmd)}", flush=True)
        start = time.monotonic()
        try:  # hydra enforces MPIEXEC_TIMEOUT; this is the backstop for launchers that ignore it
            code = subprocess.call(cmd, cwd=ROOT, env=env, timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            code = 255
        results.append((n, code, time.monotonic() - start))
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"\n{'=' * 25} summary", flush=True)
    for n, code, secs in results:
        verdict = "PASSED" if code == 0 else f"FAILED (exit {code}: {_EXIT_NAMES.get(code, 'error')})"
        print(f"{n:>3} rank{'s' if n > 1 else ' '}: {verdict}  [{secs:.1f} s]")
    failed = sum(code != 0 for _, code, _ in results)
    print(f"{len(results) - failed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
