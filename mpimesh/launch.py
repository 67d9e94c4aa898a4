"""Run a Python script on N MPI ranks with this interpreter.

Example::

    $ python -m mpimesh.launch -n 4 --timeout 300 apps/transformer.py --steps 10

runs ``mpiexec -n 4 <this python> apps/transformer.py --steps 10`` with ``MPIEXEC_TIMEOUT=300``.
The launcher beside ``sys.executable`` (where ``pip install mpich`` puts it) wins over one on PATH.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

def find_mpiexec() -> str:
    """Return the path of an MPI launcher: the venv's ``mpiexec``, else ``mpiexec``/``mpirun`` on PATH.

    Raises:
        FileNotFoundError: no launcher anywhere, with how to get one.
    """
    # Not resolved: a venv's python is a symlink, and its launcher sits beside the link.
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    found = found or shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise FileNotFoundError(f"no MPI launcher: no mpiexec beside {sys.executable}, no mpiexec or "
                                "mpirun on PATH; run `pip install mpich`, or load your cluster's MPI module")
    return found


def job_env(**extra: str) -> Dict[str, str]:
    """This process's environment minus the enclosing MPI job's variables (PMI_*, PMIX_*, HYDRA*,
    MPIR*), plus `extra`: for starting a new job from inside one (a test under mpiexec, a front end).

    >>> env = job_env(MPIEXEC_TIMEOUT="60")
    >>> env["MPIEXEC_TIMEOUT"], any(k.startswith(("PMI_", "HYDRA")) for k in env)
    ('60', False)
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA", "MPIR"))}
    env.update(extra)
    return env


def main(argv: Optional[List[str]] = None) -> int:
    """Parse ``-n N [--timeout S] script [args...]`` and run the script under MPI."""
    parser = argparse.ArgumentParser("python -m mpimesh.launch", description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--np", type=int, default=1, metavar="N", help="number of ranks")
    parser.add_argument("--timeout", type=int, metavar="SECONDS", help="kill the job after this long")
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    try:
        cmd = [find_mpiexec(), "-n", str(ns.np), sys.executable, ns.script, *ns.args]
    except FileNotFoundError as e:
        parser.exit(2, f"error: {e}\n")
    env = dict(os.environ, **({} if ns.timeout is None else {"MPIEXEC_TIMEOUT": str(ns.timeout)}))
    mpi = sys.modules.get("mpi4py.MPI")  # imported by mpimesh/__init__ before this module runs
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # else exec skips it and leaks this process's /dev/shm segment
    if os.name == "posix":  # exec: signals (Ctrl-C) go straight to mpiexec
        os.execve(cmd[0], cmd, env)
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
