"""JAX across processes started by an MPI launcher: one JAX process per rank, joined by
`jax.distributed`, its devices one global `jax.sharding.Mesh`.

`initialize(comm, local_devices)` (every rank) starts `jax.distributed` with a coordinator that rank
0 picks (`MPIMESH_JAX_COORDINATOR=host:port` decides instead) and JAX's CPU collectives (gloo);
`global_mesh(mesh_shape)` lays the devices out, processes outermost; `spans` says which mesh dims
span processes; `check_same` raises on every rank where ranks recorded different programs. More:
docs/jax_replay.md.

>>> spans_text({"rows": True, "cols": False})
'rows across processes, cols inside each'
"""
from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import subprocess
from typing import Optional

import numpy as np
from mpi4py import MPI

from .. import env
from ..errors import MeshError

_HEARTBEAT = 20  # seconds without a process's heartbeat before JAX ends the job


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _networks() -> list:
    """This host's IPv4 interface networks, e.g. `[IPv4Interface('10.77.0.1/24')]`, loopback left out."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    nets = []
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            iface = ipaddress.ip_interface(parts[parts.index("inet") + 1])
            if not iface.ip.is_loopback:
                nets.append(iface)
    return nets


def _host_port(text: str) -> bool:
    """Whether `text` is `host:port`, a port in 1..65535."""
    host, _, port = text.rpartition(":")
    return bool(host) and port.isascii() and port.isdigit() and 0 < int(port) < 65536


def _coordinator(comm) -> str:
    """`host:port` for rank 0's coordinator (a collective over `comm`)."""
    forced = env.text("MPIMESH_JAX_COORDINATOR", check=_host_port, what="host:port (a port in 1..65535)")
    if forced is not None:
        return forced
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = comm.allreduce(node.Get_size(), op=MPI.MIN) == comm.Get_size()
    node.Free()
    nets = comm.gather([str(n) for n in _networks()] if not one_node else [])
    address = None
    if comm.Get_rank() == 0:
        if one_node:
            host = "127.0.0.1"
        else:
            others = [[ipaddress.ip_interface(n) for n in ranks] for ranks in nets[1:]]
            host = next((str(mine.ip) for mine in map(ipaddress.ip_interface, nets[0])
                         if all(any(o.network == mine.network for o in theirs) for theirs in others)),
                        socket.gethostbyname(socket.gethostname()))
        address = f"{host}:{_free_port()}"
    return comm.bcast(address)


def initialize(comm, local_devices: int = 1) -> None:
    """Join this rank's JAX to the others' (see the module); `local_devices` host devices each."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local_devices}".strip()
    if comm.Get_size() == 1:
        return
    address = _coordinator(comm)
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=address, num_processes=comm.Get_size(),
                                   process_id=comm.Get_rank(), heartbeat_timeout_seconds=_HEARTBEAT)
    except Exception as e:  # every rank fails alike: a clear error, not a hang in the next collective
        raise MeshError(f"jax.distributed.initialize with coordinator {address} failed on rank {comm.Get_rank()}: "
                        f"{type(e).__name__}: {e} (set MPIMESH_JAX_COORDINATOR=host:port to choose it)") from None


def global_mesh(mesh_shape, names: Optional[tuple] = None):
    """Every process's devices as a `jax.sharding.Mesh` of `mesh_shape` (an `mm.Shape`), processes
    outermost (one process: its first devices); a MeshError where they are not as many as the
    mesh's processors."""
    import jax
    from jax.sharding import Mesh
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if jax.process_count() == 1:  # one process may have more devices than the mesh uses
        devices = devices[:mesh_shape.size]
    if len(devices) != mesh_shape.size:
        raise MeshError(f"the jax mesh {mesh_shape} has {mesh_shape.size} processors, but the {jax.process_count()} "
                        f"process(es) have {len(devices)} JAX devices in all ({jax.local_device_count()} each)")
    return Mesh(np.array(devices, dtype=object).reshape(mesh_shape.sizes), mesh_shape.names)


def spans(mesh) -> dict:
    """`{mesh dim: whether devices along it belong to different processes}`."""
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    return {name: bool((np.diff(procs, axis=i) != 0).any()) if procs.shape[i] > 1 else False
            for i, name in enumerate(mesh.axis_names)}


def spans_text(across: dict) -> str:
    """`spans` in words, for the app's header."""
    out = [n for n, v in across.items() if v]
    inside = [n for n, v in across.items() if not v]
    return ", ".join(filter(None, [f"{', '.join(out)} across processes" if out else "",
                                   f"{', '.join(inside)} inside each" if inside else ""]))


def check_same(comm, text: str, what: str = "the recorded step") -> None:
    """A MeshError on every rank unless every rank's `text` (a description of its recording) is equal."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    digests = comm.allgather(digest)
    if len(set(digests)) > 1:
        groups: dict = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        raise MeshError(f"{what} differs across processes (ranks {' vs '.join(str(g) for g in groups.values())}): "
                        f"every process must record the same program (the same arguments, sizes and layout)")
