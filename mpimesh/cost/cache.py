"""Calibrations kept per machine and mesh shape, so that a layout search prices alike from run to run.

`calibrated(mesh)` returns the `Machine` calibrated earlier for this machine, mesh shape, backend,
ranks per node and threads, from a JSON file in `$MPIMESH_CACHE_DIR` (else the user's cache
directory), or calibrates and keeps it; `redo=True` or `MPIMESH_RECALIBRATE=1` measures again.
Rank 0 reads and writes the file, every rank gets its machine; `read_machine(path)` and
`write_machine(path, machine)` read and write such a file anywhere (docs/cost_model.md).

>>> import os, tempfile, mpimesh as mm
>>> os.environ["MPIMESH_CACHE_DIR"] = tempfile.mkdtemp()
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> first = calibrated(mesh, seconds=0.3)
>>> calibrated(mesh) == first, read_machine(cache_file(mesh)) == first
(True, True)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
import time
from typing import Optional

import numpy as np

from .. import env, threads
from ..backend import as_dtype, device_name
from ..version import __version__
from ..errors import MpimeshError
from .calibrate import calibrate
from .machine import Machine

FORMAT = 1  # bump when what `calibrate` measures changes: older files are then ignored


def cache_dir() -> str:
    """Where calibrations are kept (see the module docstring)."""
    root = env.text("MPIMESH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mpimesh")
    return os.path.join(root, "calibration")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def machine_key(mesh, dtype="float32") -> dict:
    """What a calibration depends on: this host and its CPU, the mesh shape, backend and device, the
    dtype it computes in, the ranks per node, BLAS threads per rank, and mpimesh's version."""
    info = threads.settings()
    device = device_name(mesh.xp, mesh.device)
    return {"format": FORMAT, "host": socket.gethostname(), "cpu": _cpu(), "cores": info["cores"],
            "mesh": str(mesh.shape), "backend": mesh.backend, "device": device, "dtype": str(as_dtype(dtype)),
            "ranks_per_node": info["local_ranks"] or 1, "threads": info["threads"], "mpimesh": __version__}


def cache_file(mesh, dtype="float32") -> str:
    """The file that keeps `mesh`'s calibration in `dtype` on this machine."""
    digest = hashlib.sha1(json.dumps(machine_key(mesh, dtype), sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"calibration-{digest}.json")


def read_machine(path: str) -> Machine:
    """The `Machine` in the JSON file at `path`: a calibration this module keeps (`{"key", "machine",
    "when"}`) or the machine's fields alone. OSError if it cannot be read; MpimeshError naming the
    file and the field that is wrong otherwise."""
    with open(path) as f:
        try:
            saved = json.load(f)
        except ValueError as e:
            raise MpimeshError(f"machine file {path}: not JSON ({e})") from e
    fields = saved.get("machine", saved) if isinstance(saved, dict) else saved
    if not isinstance(fields, dict):
        raise MpimeshError(f"machine file {path}: expected an object of Machine fields, got {type(fields).__name__}")
    known = {f.name: f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
             for f in dataclasses.fields(Machine)}  # name -> required
    problems = [f"unknown field {k!r}" for k in fields if k not in known] + \
        [f"missing field {k!r}" for k, required in known.items() if required and k not in fields]
    if problems:
        raise MpimeshError(f"machine file {path}: {'; '.join(problems)}")
    links = fields.get("links", ())
    if isinstance(links, list):  # JSON has no tuples
        links = tuple(tuple(link) if isinstance(link, list) else link for link in links)
    fields = dict(fields, links=links)
    try:
        return Machine(**fields)
    except (TypeError, MpimeshError) as e:
        raise MpimeshError(f"machine file {path}: {e}") from e


def write_machine(path: str, machine: Machine, key: Optional[dict] = None) -> None:
    """Keep `machine` in the JSON file at `path` (written whole, then renamed into place), with
    `key` (what it was calibrated for: `machine_key(mesh)`) and the time."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"key": key, "machine": dataclasses.asdict(machine), "when": time.strftime("%Y-%m-%d %H:%M:%S")},
                  f, indent=1)
    os.replace(tmp, path)


def _read(path: str, key: dict) -> Optional[Machine]:
    try:
        with open(path) as f:
            if json.load(f).get("key") != key:
                return None
        return read_machine(path)
    except (OSError, ValueError, AttributeError, MpimeshError):
        return None


def calibrated(mesh, redo: bool = False, seconds: float = 3.0, dtype="float32") -> Machine:
    """This mesh's `Machine` in `dtype` (`calibrate`'s): the cached calibration, or a new one (`redo`,
    `MPIMESH_RECALIBRATE=1`, or none cached), then kept. A collective: every rank calls it and gets
    the same machine."""
    redo = redo or env.flag("MPIMESH_RECALIBRATE", False)
    path, key = cache_file(mesh, dtype), machine_key(mesh, dtype)
    found = None if redo or mesh.rank != 0 else _read(path, key)
    text = _from_rank_0(mesh, "" if found is None else json.dumps(dataclasses.asdict(found)))
    if text:  # rank 0 had one: every rank takes its figures
        fields = json.loads(text)
        fields["links"] = tuple(tuple(link) for link in fields["links"])
        return Machine(**fields)
    machine = calibrate(mesh, seconds, dtype=dtype)
    if mesh.rank == 0:
        try:
            write_machine(path, machine, key)
        except OSError as e:
            sys.stderr.write(f"mpimesh: could not keep the calibration in {path}: {e}\n")
    return machine


def _from_rank_0(mesh, text: str) -> str:
    """Rank 0's `text`, on every rank of `mesh`."""
    if mesh.size == 1:
        return text
    data = np.frombuffer(text.encode(), np.uint8)
    n = int(mesh.collectives.broadcast(np.array([data.size], np.int64), 0)[0])
    buf = data if mesh.rank == 0 else np.zeros(n, np.uint8)
    return bytes(mesh.collectives.broadcast(buf, 0)).decode() if n else ""
