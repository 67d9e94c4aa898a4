"""Run a Python script on N MPI ranks with this interpreter.

Example::

    $ python -m mpimesh.launch -n 4 --timeout 300 apps/transformer.py --steps 10

runs ``mpiexec -n 4 <this python> apps/transformer.py --steps 10`` with ``MPIEXEC_TIMEOUT=300``.
The launcher beside ``sys.executable`` (where ``pip install mpich`` puts it) wins over one on PATH.

Across machines, ``--hostfile FILE`` (one host per line, ``host`` or ``host:slots`` as MPICH writes
it, ``host slots=N`` as Open MPI does) is handed to the launcher as a host list in its own
spelling (MPICH's ``-hosts a:2,b:4``, Open MPI's ``--host a:2,b:4``), so either file works with
either launcher; ``--launcher-args "..."`` adds options of its own (MPICH's
``-launcher ssh -launcher-exec PROGRAM``, ``-iface eth0``). See launch/README.md.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from functools import lru_cache
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


MAX_SLOTS = 1 << 20  # more on one host is a typo (MPICH's launcher spun forever on 10**20)


def read_hostfile(path: str) -> List[tuple]:
    r"""`[(host, slots), ...]` of a hostfile (`host`, `host:slots` or `host slots=N` lines; `#`
    comments), or a ValueError naming the file and line.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".hosts", delete=False) as f:
    ...     _ = f.write("# two nodes\nnode01:8\nnode02 slots=4\nnode03\n")
    >>> read_hostfile(f.name)
    [('node01', 8), ('node02', 4), ('node03', 1)]
    """
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"hostfile {path!r} cannot be read: {e.strerror}") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([\w.\-]+)(?::(\d+)|\s+slots\s*=\s*(\d+))?", line)
        if m is None or not 1 <= int(m.group(2) or m.group(3) or 1) <= MAX_SLOTS:
            raise ValueError(f"hostfile {path!r} line {number}: {line!r} is not `host`, `host:slots` or "
                             f"`host slots=N` (slots from 1 to {MAX_SLOTS}, nothing after them)")
        hosts.append((m.group(1), int(m.group(2) or m.group(3) or 1)))
    if not hosts:
        raise ValueError(f"hostfile {path!r} lists no hosts")
    return hosts


@lru_cache(maxsize=None)
def is_open_mpi(mpiexec: str) -> bool:
    """Whether the launcher `mpiexec` is Open MPI's (its `--version` says "Open MPI", or "OpenRTE" in
    4.x), else MPICH's or another that takes MPICH's options."""
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    return "Open MPI" in version or "OpenRTE" in version


def hostfile_args(mpiexec: str, hosts: List[tuple]) -> List[str]:
    """The launcher's options for the `(host, slots)` of a hostfile, whichever syntax the file used:
    Open MPI's `--host a:2,b:4`, else MPICH's `-hosts a:2,b:4` (MPICH's own hostfile reader does not
    take Open MPI's `host slots=N` lines)."""
    listed = ",".join(f"{host}:{slots}" for host, slots in hosts)
    return ["--host", listed] if is_open_mpi(mpiexec) else ["-hosts", listed]


# The variables a launcher sets in each rank for its own job: MPICH's Hydra (PMI_*, HYDRA*, HYDI_*: its
# control socket, which a nested launcher would write to), PMIx, the MPIR debugger interface, and Open
# MPI's ORTE (4.x) and PRRTE (5.x). A nested Open MPI mpiexec that sees them refuses ("does not support
# recursive calls"), and a child that starts MPI alone tries to join the enclosing job. Settings of the
# user's own (OMPI_MCA_btl, ...) are not among them and are kept.
_JOB_VARIABLES = ("PMI_", "PMIX_", "HYDRA", "HYDI_", "MPIR", "MPI_LOCAL", "OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE",
                  "OMPI_FIRST_RANKS", "OMPI_FILE_LOCATION", "OMPI_APP_CTX_", "OMPI_NUM_APP_CTX", "OMPI_ARGV",
                  "OMPI_COMMAND", "OMPI_MCA_ess", "OMPI_MCA_orte_", "OMPI_MCA_pmix", "OMPI_MCA_initial_wdir",
                  "OMPI_MCA_shmem_RUNTIME_QUERY_hint", "OMPI_MCA_mpi_oversubscribe", "OMPI_MCA_prte_", "ORTE_",
                  "PRTE_")


def job_env(**extra: str) -> Dict[str, str]:
    """This process's environment minus the enclosing MPI job's variables (`_JOB_VARIABLES`: what
    MPICH's and Open MPI's launchers set in each rank), plus `extra`: for starting a new job from
    inside one (a test under mpiexec, a front end). More ranks than cores are allowed under Open MPI
    too (`OMPI_MCA_rmaps_base_oversubscribe`, unless set: MPICH allows them, and ignores it).

    >>> env = job_env(MPIEXEC_TIMEOUT="60")
    >>> env["MPIEXEC_TIMEOUT"], any(k.startswith(("PMI_", "HYDRA", "HYDI_", "OMPI_COMM_WORLD_")) for k in env)
    ('60', False)
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(_JOB_VARIABLES)}
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env.update(extra)
    return env


def main(argv: Optional[List[str]] = None) -> int:
    """Parse ``-n N [--timeout S] script [args...]`` and run the script under MPI."""
    parser = argparse.ArgumentParser("python -m mpimesh.launch", description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--np", type=int, default=1, metavar="N", help="number of ranks")
    parser.add_argument("--timeout", type=int, metavar="SECONDS", help="kill the job after this long (default: "
                        "no limit)")
    parser.add_argument("--hostfile", metavar="FILE", help="the machines to run on (host, host:slots or "
                        "host slots=N per line)")
    parser.add_argument("--launcher-args", default="", metavar="ARGS",
                        help="more options for mpiexec, e.g. \"-launcher ssh -iface eth0\"")
    parser.add_argument("script", nargs="?", help="the Python script every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.script is None:  # (argparse would name the optional `args` as required too)
        parser.error("a script to run is required, e.g. python -m mpimesh.launch -n 2 apps/transformer.py")
    if ns.np < 1:
        parser.error(f"-n {ns.np}: the number of ranks must be at least 1")
    if ns.timeout is not None and ns.timeout < 1:
        parser.error(f"--timeout {ns.timeout}: must be at least 1 second (leave it out for no limit)")
    try:
        launcher_args = shlex.split(ns.launcher_args)
    except ValueError as e:
        parser.error(f"--launcher-args {ns.launcher_args!r}: {e}")
    if not ns.hostfile and not os.path.isfile(ns.script):  # once here, not per rank (other hosts: theirs)
        parser.error(f"script {ns.script!r}: no such file")
    try:
        mpiexec = find_mpiexec()
        hosts = hostfile_args(mpiexec, read_hostfile(ns.hostfile)) if ns.hostfile else []
        cmd = [mpiexec, *hosts, *launcher_args, "-n", str(ns.np), sys.executable, ns.script, *ns.args]
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"error: {e}\n")
    env = job_env(**({} if ns.timeout is None else {"MPIEXEC_TIMEOUT": str(ns.timeout)}))
    mpi = sys.modules.get("mpi4py.MPI")  # imported by mpimesh/__init__ before this module runs
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # else exec skips it and leaks this process's /dev/shm segment
    if os.name == "posix":  # exec: signals (Ctrl-C) go straight to mpiexec
        os.execve(cmd[0], cmd, env)
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
