"""A cluster on one machine: hosts as Linux network namespaces on a bridge, MPI between them over TCP.

`Cluster(hosts=2, slots=2)` (root and iproute2) makes one namespace per host on a private
10.77.0.0/24 network, a hostfile and an ssh-like launcher for MPICH's `mpiexec` (`mpiexec(n,
argv)`); `link`, `shape`, `bytes`, `pids` and `kill` act on a host; `close()` (or the end of a
`with` block) deletes it all, and `cleanup_leftovers()` what killed runs left. `unavailable()` says
why no cluster can be made here. Details: docs/test_cluster.md.

>>> unavailable() is None or isinstance(unavailable(), str)
True
>>> Cluster.addresses(3)
['10.77.0.1', '10.77.0.2', '10.77.0.3']
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from ..collectives.liveness import alive
from ..launch import find_mpiexec, is_open_mpi, job_env

PREFIX = "mpimesh"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-\d+-(?:sw|h\d+)$")


_SBIN = ("/usr/sbin", "/sbin")  # where root's tools live, also when PATH leaves them out (`env -i`)


def tool(name: str) -> str:
    """The path of system tool `name` (`ip`, `tc`, ...), looked for on PATH, then in the sbin folders."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(_SBIN)) or name


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([tool("ip"), *args], capture_output=True, text=True, check=check)


def unavailable() -> Optional[str]:
    """Why namespaced hosts cannot be made here (one line), or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for name in ("ip", "tc", "unshare", "setpriv", "hostname"):
        if tool(name) == name:
            return f"`{name}` is missing (Debian: apt-get install iproute2 util-linux hostname)"
    try:
        if is_open_mpi(find_mpiexec()):
            return ("its hosts' ranks start through MPICH's launcher options (-f, -launcher-exec), and this "
                    "mpiexec is Open MPI's")
    except FileNotFoundError as e:
        return str(e)
    return None


def namespaces() -> list:
    """The names of this machine's network namespaces."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_in(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def cleanup_leftovers() -> list:
    """Delete the namespaces (and end their processes) that clusters of dead processes left; the
    names deleted."""
    gone = []
    for ns in namespaces():
        m = _NAME.match(ns)
        if m and not alive(int(m.group(1))):
            _kill_in(ns)
            _ip("netns", "del", ns, check=False)
            gone.append(ns)
    return gone


_LAUNCHER = """#!/bin/sh
# mpimesh.testing.cluster's launcher: `launcher [-options] HOST COMMAND...` runs COMMAND inside HOST's
# network namespace with HOST's hostname, as ssh would on a node; it dies when its parent (mpiexec) does.
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}
  *) echo "launcher: no host $host in this cluster" >&2; exit 255 ;;
esac
exec {ip} netns exec "$ns" {setpriv} --pdeathsig KILL {unshare} --uts sh -c '{hostname} "$0" && exec sh -c "$1"' "$name" "$*"
"""


class Cluster:
    """`hosts` namespaced hosts with `slots` ranks each (see the module); a context manager."""

    _serial = 0

    def __init__(self, hosts: int = 2, slots: int = 2):
        why = unavailable()
        if why is not None:
            raise RuntimeError(f"no namespaced cluster here: {why}")
        if not 1 <= hosts <= 8:
            raise ValueError(f"hosts must be 1..8, got {hosts}")
        cleanup_leftovers()
        Cluster._serial += 1
        self.prefix = f"{PREFIX}-{os.getpid()}-{Cluster._serial}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = [f"{self.prefix}-h{i}" for i in range(hosts)]
        self.names = [f"h{i}" for i in range(hosts)]
        self.address = self.addresses(hosts)
        self.slots = slots
        self.dir = tempfile.mkdtemp(prefix="mpimesh-cluster-")
        self._made: list = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        self.hostfile = os.path.join(self.dir, "hostfile")
        with open(self.hostfile, "w") as f:
            f.writelines(f"{a}:{slots}\n" for a in self.address)
        self.launcher = os.path.join(self.dir, "launcher")
        cases = "\n".join(f"  {a}) ns={ns}; name={name} ;;" for a, ns, name in zip(self.address, self.hosts, self.names))
        with open(self.launcher, "w") as f:
            f.write(_LAUNCHER.format(cases=cases, **{t: tool(t) for t in ("ip", "setpriv", "unshare", "hostname")}))
        os.chmod(self.launcher, 0o755)

    @staticmethod
    def addresses(hosts: int) -> list:
        """The hosts' addresses, in 10.77.0.0/24."""
        return [f"10.77.0.{i + 1}" for i in range(hosts)]

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.hosts, self.address)):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")

    def env(self, **extra: str) -> dict:
        """The environment of a job on the cluster: this one's minus any enclosing MPI job's, with
        UCX on TCP only, and `extra`."""
        path = os.environ.get("PATH", "").split(os.pathsep)
        return job_env(UCX_TLS="tcp,self", PATH=os.pathsep.join(path + [d for d in _SBIN if d not in path]), **extra)

    def host_argv(self, host: int, argv: Sequence[str]) -> list:
        """`argv` run on host `host`: inside its namespace, with its hostname."""
        return [tool("ip"), "netns", "exec", self.hosts[host], tool("unshare"), "--uts", "sh", "-c",
                f'{tool("hostname")} {self.names[host]} && exec "$@"', "sh", *argv]

    def launcher_args(self) -> list:
        """MPICH's options that start each host's ranks through the cluster's launcher program."""
        return ["-launcher", "ssh", "-launcher-exec", self.launcher]

    def mpiexec_argv(self, n: int, argv: Sequence[str]) -> list:
        """`mpiexec` over the hosts (filling each host's slots in turn), `n` ranks, run from host 0."""
        return self.host_argv(0, [find_mpiexec(), "-f", self.hostfile, *self.launcher_args(), "-n", str(n), *argv])

    def mpiexec(self, n: int, argv: Sequence[str], env: Optional[dict] = None, **popen) -> subprocess.Popen:
        """Start `argv` on `n` ranks over the cluster (see `mpiexec_argv`); the `Popen`."""
        return subprocess.Popen(self.mpiexec_argv(n, argv), env=env or self.env(),
                                start_new_session=True, **popen)

    def link(self, host: int, up: bool) -> None:
        """Take host `host`'s link up or down."""
        _ip("-n", self.hosts[host], "link", "set", "eth0", "up" if up else "down")

    def shape(self, host: int, rate: str, burst: str = "256kb", latency: str = "50ms") -> None:
        """Limit host `host`'s outgoing bandwidth to `rate` (tc's units, e.g. "1gbit") with a token
        bucket filter."""
        _ip("netns", "exec", self.hosts[host], tool("tc"), "qdisc", "replace", "dev", "eth0", "root",
            "tbf", "rate", rate, "burst", burst, "latency", latency)

    def unshape(self, host: int) -> None:
        """Take host `host`'s shaping off."""
        _ip("netns", "exec", self.hosts[host], tool("tc"), "qdisc", "del", "dev", "eth0", "root", check=False)

    def netem_available(self) -> bool:
        """Whether this kernel can add delays (`tc ... netem`, often a missing module)."""
        r = _ip("netns", "exec", self.switch, tool("tc"), "qdisc", "add", "dev", "br0", "root", "netem", "delay", "1ms",
                check=False)
        if r.returncode == 0:
            _ip("netns", "exec", self.switch, tool("tc"), "qdisc", "del", "dev", "br0", "root", check=False)
        return r.returncode == 0

    def bytes(self, host: int) -> tuple:
        """(received, sent) bytes on host `host`'s link so far."""
        out = _ip("netns", "exec", self.hosts[host], "cat", "/proc/net/dev").stdout
        for line in out.splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                fields = rest.split()
                return int(fields[0]), int(fields[8])
        raise RuntimeError(f"no eth0 in {self.hosts[host]}")

    def pids(self, host: Optional[int] = None) -> list:
        """The processes living in host `host`'s namespace (every host's when None)."""
        names = self.hosts if host is None else [self.hosts[host]]
        return [int(p) for ns in names for p in _ip("netns", "pids", ns, check=False).stdout.split()]

    def kill(self, host: int, sig: int = signal.SIGKILL) -> list:
        """Send `sig` to every process of host `host`; their pids."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def wait_empty(self, timeout: float) -> list:
        """Wait until no process lives in any host, at most `timeout` seconds; those still there."""
        end = time.monotonic() + timeout
        while True:
            left = self.pids()
            if not left or time.monotonic() > end:
                return left
            time.sleep(0.2)

    def describe(self, pids: Sequence[int]) -> str:
        """`pid: command line` of each process, for messages."""
        out = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out.append(f"{pid}: {shlex.join(f.read().decode(errors='replace').split(chr(0)))[:200]}")
            except OSError:
                out.append(f"{pid}: (gone)")
        return "; ".join(out)

    def close(self) -> None:
        """Kill every process in the namespaces and delete them (idempotent)."""
        for ns in self._made:
            _kill_in(ns)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made = []
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cluster({len(self.hosts)} hosts x {self.slots} slots, {self.prefix})"
