"""The flight recorder, always on, and the events of an open timeline (`mm.profile(timeline=...)`).

`ring` keeps this rank's last `MPIMESH_FLIGHT_RECORDS` (200) ops and collectives: an op's `OpDef` as it
is (no time: one append per op), else a small tuple (`(time, "collective", the guard's key, mesh
shape)`, `(time, "replay", name)`); `dump` writes it when a time-out or divergence ends the job
(`mpimesh.abort`). `timeline` holds the open timeline's event list, or nothing: the hot paths test it once. Event layouts:
docs/timeline.md.

>>> events = open_timeline()
>>> s = begin(clock(), "allreduce", ("rows",), 40, 7, None, True)
>>> end(s)
>>> close_timeline(); [e[0] for e in events], s[SEQ], s[T1] >= s[T0]
(['collective'], 7, True)
"""
from __future__ import annotations

import json
import os
import socket
import time
from collections import deque
from operator import attrgetter
from typing import Optional

from . import env
from .errors import MpimeshError

clock = time.perf_counter
_shape = attrgetter("shape")

SIZE = env.early(env.whole, "MPIMESH_FLIGHT_RECORDS", 200, minimum=0)
ring: deque = deque(maxlen=SIZE)
"""This rank's last `SIZE` ops and collectives (see the module)."""
remember = ring.append

timeline: list = []
"""`[events]` while a timeline records, else empty."""
job: list = [None]  # the process id of rank 0 of MPI.COMM_WORLD, where known (`job_id`)

# the fields of a collective's event (a list)
T0, T1, KIND, DIMS, BYTES, SEQ, KEY, COUNTED, TRACK, EXPOSED = range(1, 11)
_JOB_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "COBALT_JOBID", "PMIX_NAMESPACE",
                  "OMPI_MCA_ess_base_jobid")


def open_timeline() -> list:
    """Start recording events; the list they go into."""
    if timeline:
        raise MpimeshError("mm.profile(timeline=...): a timeline is already being recorded; open one at a time "
                           "(profiles without a timeline may nest inside it)")
    events: list = []
    timeline.append(events)
    return events


def close_timeline() -> None:
    timeline.clear()


def op(t0: float, name: str, arrays, result, flops: int) -> None:
    """One op's span, from `t0` to now: its name, its blocks' shapes in and out, its flops."""
    timeline[0].append(("op", t0, clock(), name, list(map(_shape, arrays)), list(map(_shape, result)), flops))


def span(t0: float, name: str, category: str, args: Optional[dict] = None, track: str = "main") -> None:
    """A span from `t0` to now on `track` ("main", or "comm": the transfers in flight)."""
    timeline[0].append(("span", t0, clock(), name, category, args, track))


def begin(t0: float, kind: str, dims: tuple, nbytes: int, seq: int, key, counted: bool) -> list:
    """A collective's event from its arrival `t0`, still open (`end` closes it): `kind` over mesh dims
    `dims`, `nbytes`, number `seq` on its mesh, `key` its group (`Guard.timeline_key`), `counted`
    whether the profile counted it (a step of a larger collective is not)."""
    event = ["collective", t0, None, kind, dims, nbytes, seq, key, counted, "main", None]
    timeline[0].append(event)
    return event


def end(event: Optional[list]) -> None:
    """Close a collective's event now (None: nothing to close)."""
    if event is not None and event[T1] is None:
        event[T1] = clock()


def finish(event: list, exposed: float) -> None:
    """Close a non-blocking collective's event (on the "comm" track) now, `exposed` seconds of it
    spent blocked in its wait."""
    event[T1], event[EXPOSED] = clock(), exposed


def job_id() -> str:
    """The job's id as its scheduler or launcher gives it, else `job[0]` (rank 0's process id, once
    a mesh over every rank knows it: `Guard`), else the launcher's process id (the parent of every
    rank of a node under mpiexec)."""
    for name in _JOB_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            return "".join(c if c.isalnum() or c in "-_." else "_" for c in value)
    return job[0] or str(os.getppid())


def directory() -> str:
    """Where flight records go: `MPIMESH_FLIGHT_DIR`, else the working directory."""
    return os.path.abspath(env.text("MPIMESH_FLIGHT_DIR") or os.getcwd())


def path(rank) -> str:
    """The flight record file of `rank` (an int, or a pattern such as "<N>")."""
    return os.path.join(directory(), f"mpimesh-flight-{job_id()}-rank{rank}.json")


def dump(error: str, rank: int, size: int) -> str:
    """Write this rank's ring, with `error` (the one ending the job), to `path(rank)`; the path.
    Raises OSError where it cannot be written."""
    now, wall = clock(), time.time()
    records = [_entry(e, now) for e in list(ring)]
    doc = {"rank": rank, "size": size, "job": job_id(), "host": socket.gethostname(), "pid": os.getpid(),
           "written": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(wall)), "error": error,
           "kept": SIZE}
    head = json.dumps(doc, indent=1)[:-2]  # (one record a line, oldest first)
    text = head + ',\n "records": [\n' + ",\n".join("  " + json.dumps(r) for r in records) + "\n ]\n}\n"
    where = path(rank)
    os.makedirs(os.path.dirname(where), exist_ok=True)
    with open(where + ".part", "w") as f:
        f.write(text)
    os.replace(where + ".part", where)
    return where


def _entry(e: tuple, now: float) -> dict:
    """One ring entry as written: `ago` (seconds before the dump; not for an op), `kind`, and what it was."""
    if type(e) is not tuple:  # an op's OpDef
        return {"kind": "op", "name": e.name}
    out = {"ago": round(now - e[0], 6), "kind": e[1]}
    if e[1] == "collective":
        seq, kind, dims, dtype, shape, detail = e[2]
        out.update(seq=seq, collective=kind, mesh_dims=list(dims), dtype=str(dtype),
                   shape=list(shape) if isinstance(shape, tuple) else shape, detail=detail.strip(), mesh=str(e[3]))
    else:
        out["name"] = e[2]
    return out
