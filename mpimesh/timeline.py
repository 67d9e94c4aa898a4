"""`mm.profile(timeline=path)`: one Chrome trace-event JSON of every rank, written by rank 0.

Every rank of `MPI.COMM_WORLD` enters the block and leaves it (collectives over it): `align` gives
them a shared time zero, `mpimesh.flight` records each rank's events, and at a normal exit rank 0
gathers them, finds who made whom wait (`attribute`) and writes the trace (`chrome`). An exception
leaving the block writes nothing. Format and accuracy: docs/timeline.md.

>>> import json, os, tempfile, mpimesh as mm
>>> mesh, path = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF), os.path.join(tempfile.mkdtemp(), "t.json")
>>> a, b = mesh.ones("a:2;b:3"), mesh.ones("b:3")
>>> with mm.profile(timeline=path):
...     y = mm.einsum([a, b])
>>> [(e["name"], e["args"]["flops"]) for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
[('einsum', 12)]
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import numpy as np
from mpi4py import MPI

from . import flight
from .collectives import guard
from .errors import MpimeshError

_ROUNDS = 8  # ping-pongs per node leader for its clock's offset; the fastest one counts
_TAG = 31021
_TRACKS = {"main": 0, "comm": 1}


@contextmanager
def recording(path) -> Iterator[None]:
    """Record every rank's events inside the block and write them to `path` on rank 0 at its end."""
    world = MPI.COMM_WORLD
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise MpimeshError(f"mm.profile(timeline=...) takes a file path, got {type(path).__name__} {path!r}")
    if flight.timeline:
        flight.open_timeline()  # (raises: one at a time)
    path = os.path.abspath(os.fspath(path))
    guard.arrive(world, f"mm.profile(timeline={path!r}) starting: every rank of MPI.COMM_WORLD enters its block")
    folder = os.path.dirname(path)
    problem = "" if os.path.isdir(folder) and os.access(folder, os.W_OK) else f"cannot write into {folder!r}"
    problem = world.bcast(problem, root=0)  # (rank 0 writes: its answer holds on every rank)
    if problem:
        raise MpimeshError(f"mm.profile(timeline={path!r}): rank 0 {problem}")
    comm = world.Dup()
    zero = align(comm)
    events = flight.open_timeline()
    try:
        yield
    except BaseException:
        flight.close_timeline()
        raise
    flight.close_timeline()
    guard.arrive(comm, f"mm.profile(timeline={path!r}) gathering every rank's events at the end of its block")
    end = flight.clock()
    mine = {"rank": comm.Get_rank(), "events": _relative(events, zero), "end": end - zero}
    every = comm.gather(mine, root=0)
    comm.Free()
    if every is not None:
        write(path, chrome(every))


def align(comm: MPI.Comm, clock: Callable[[], float] = flight.clock, node: Optional[MPI.Comm] = None) -> float:
    """This rank's `clock()` reading of the time zero all ranks of `comm` share. The ranks of a node
    read one clock (`time.perf_counter` is CLOCK_MONOTONIC, system-wide): they take their node
    leader's zero, exactly. Each other node's leader learns its clock's offset from rank 0's by
    `_ROUNDS` ping-pongs, keeping the fastest: its zero is within half that round trip of rank 0's
    (microseconds on a cluster network). `node`: the ranks that share this one's clock (default:
    `Split_type(COMM_TYPE_SHARED)`; a test may split otherwise)."""
    own = node is None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED) if own else node
    leaders = comm.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, comm.Get_rank())
    zero = 0.0
    if leaders != MPI.COMM_NULL:
        leaders.Barrier()
        zero = clock() if leaders.Get_rank() == 0 else 0.0
        zero = _leader_zero(leaders, clock, zero)
        leaders.Free()
    zero = node.bcast(zero, root=0)
    if own:
        node.Free()
    return zero


def _leader_zero(leaders: MPI.Comm, clock: Callable[[], float], zero: float) -> float:
    """Rank 0 of `leaders` sends each other leader the zero in that leader's clock: its own `zero`
    plus the offset the fastest of `_ROUNDS` round trips gives (the leader's reading minus the
    midpoint of rank 0's send and receive)."""
    ping, pong = np.zeros(1), np.zeros(1)
    if leaders.Get_rank() != 0:
        for _ in range(_ROUNDS):
            leaders.Recv(ping, 0, _TAG)
            pong[0] = clock()
            leaders.Send(pong, 0, _TAG)
        leaders.Recv(ping, 0, _TAG)
        return float(ping[0])
    for r in range(1, leaders.Get_size()):
        best = (float("inf"), 0.0)
        for _ in range(_ROUNDS):
            t1 = clock()
            leaders.Send(ping, r, _TAG)
            leaders.Recv(pong, r, _TAG)
            t2 = clock()
            best = min(best, (t2 - t1, pong[0] - (t1 + t2) / 2))
        leaders.Send(np.array([zero + best[1]]), r, _TAG)
    return zero


def _relative(events: list, zero: float) -> list:
    """The events with their times in seconds from `zero`, as plain tuples (open ones dropped)."""
    out = []
    for e in events:
        if e[flight.T1] is None:
            continue
        e = list(e)
        e[flight.T0] -= zero
        e[flight.T1] -= zero
        out.append(tuple(e))
    return out


def attribute(every: list) -> dict:
    """Who made whom wait: for each blocking collective whose group's ranks all recorded it (the
    same group key and number on each), the rank that arrived last, and each other rank's wait
    from its own arrival to that one (cut at its own end). Returns `{(rank, index of the event):
    (seconds waited, the rank waited for)}`, the last to arrive mapping to `(0.0, None)`."""
    calls: dict = {}
    for part in every:
        for i, e in enumerate(part["events"]):
            if e[0] == "collective" and e[flight.TRACK] == "main" and e[flight.KEY] is not None:
                calls.setdefault((e[flight.KEY], e[flight.SEQ]), []).append((part["rank"], i, e))
    out = {}
    for (key, _), members in calls.items():
        if sorted(r for r, _, _ in members) != sorted(key[1]):
            continue  # some rank of the group did not record it (its call was outside the block)
        last, _, latest = max(members, key=lambda m: (m[2][flight.T0], m[0]))
        for r, i, e in members:
            waited = max(0.0, min(latest[flight.T0], e[flight.T1]) - e[flight.T0])
            out[(r, i)] = (0.0, None) if r == last else (waited, last)
    return out


def chrome(every: list) -> dict:
    """The trace-event document of the ranks' events (`every`: one dict per rank, from `recording`)."""
    waits = attribute(every)
    out = []
    for part in sorted(every, key=lambda p: p["rank"]):
        r = part["rank"]
        out += [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}},
                {"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}},
                {"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "main"}},
                {"name": "thread_name", "ph": "M", "pid": r, "tid": 1, "args": {"name": "comm (in flight)"}}]
        for i, e in enumerate(part["events"]):
            out += _events(r, e, waits.get((r, i)))
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"producer": "mpimesh", "ranks": len(every),
                          "clock": "time.perf_counter; ranks on one node share it exactly, other nodes are "
                                   "aligned to rank 0's by ping-pong (to half the fastest round trip)"}}


def _events(rank: int, e: tuple, wait: Optional[tuple]) -> list:
    """One recorded event as trace events (a blocking collective that waited: also its wait)."""
    if e[0] == "op":
        _, t0, t1, name, ins, outs, flops = e
        return [_x(rank, 0, name, "op", t0, t1, {"flops": flops, "shapes": [list(s) for s in ins],
                                                   "out_shapes": [list(s) for s in outs]})]
    if e[0] == "span":
        _, t0, t1, name, category, args, track = e
        return [_x(rank, _TRACKS[track], name, category, t0, t1, dict(args or {}))]
    _, t0, t1, kind, dims, nbytes, seq, key, counted, track, exposed = e
    args = {"kind": kind, "mesh_dims": list(dims), "bytes": nbytes, "seq": seq, "counted": counted}
    if key is not None:
        args["group"] = list(key[1])
    if exposed is not None:
        args["exposed_us"] = round(exposed * 1e6, 3)
    name = f"{kind} {'+'.join(dims)}"
    if wait is None:
        return [_x(rank, _TRACKS[track], name, "collective", t0, t1, args)]
    waited, last = wait
    args["waited_us"] = round(waited * 1e6, 3)
    if last is None:
        args["arrived_last"] = True
        return [_x(rank, 0, name, "collective", t0, t1, args)]
    args["waited_for_rank"] = last
    return [_x(rank, 0, name, "collective", t0, t1, args),
            _x(rank, 0, f"wait for rank {last}", "wait", t0, t0 + waited, {"rank": last, "in": name, "seq": seq})]


def _x(pid: int, tid: int, name: str, category: str, t0: float, t1: float, args: dict) -> dict:
    """A complete event; times in whole nanoseconds first, so that rounding keeps spans nested."""
    a, b = round(t0 * 1e9), round(t1 * 1e9)
    return {"name": name, "cat": category, "ph": "X", "ts": a / 1e3, "dur": (b - a) / 1e3, "pid": pid, "tid": tid,
            "args": args}


def write(path: str, doc: dict) -> None:
    """`doc` as JSON at `path`, whole or not at all (written beside it, then renamed)."""
    with open(path + ".part", "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(path + ".part", path)
