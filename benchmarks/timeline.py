"""What the flight recorder and a timeline cost per op: benchmarks/dispatch.py's tiny ops timed plain,
inside `mm.profile()` and inside `mm.profile(timeline=...)`, interleaved in one run.

    python benchmarks/timeline.py                 # one process, a 1-rank mesh
    mpiexec -n 2 python benchmarks/timeline.py    # also a blocking allreduce of 4 floats per call

The timeline's cost per event is (profile with timeline) - (profile alone) over the events a call
records (an op's span; a collective's). The flight recorder is always on: its cost per
op is the append it adds to dispatch, `ring.append((perf_counter(), "op", op))`, timed alone
(`timeit`; the clock reading is new in dispatch too, shown apart). Bars: a timeline event
at most 2 us (the issue: "about 1 us"), the flight recorder's append at most 0.3 us.
"""
from __future__ import annotations

import common  # noqa: F401  (first: fixes the BLAS environment)

import os  # noqa: E402
import tempfile  # noqa: E402
import timeit  # noqa: E402

import numpy as np  # noqa: E402
from common import kernel_report, load_average, table, verdict  # noqa: E402
from dispatch import cases, per_call  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import flight  # noqa: E402
from mpimesh.opdef import OpDef  # noqa: E402

BARS = {"timeline event": 2.0, "flight append": 0.3}
ROUNDS = 5


def ring_cost() -> tuple:
    """(µs per flight-recorder append with its clock reading, µs per bare clock reading)."""
    glob = {"r": flight.ring.append, "c": flight.clock, "o": OpDef("exp", lambda ctx, a: a)}
    n = 200_000
    append = min(timeit.repeat("r((c(), 'op', o))", globals=glob, number=n, repeat=7)) / n * 1e6
    bare = min(timeit.repeat("c()", globals=glob, number=n, repeat=7)) / n * 1e6
    return append, bare


def event_cost() -> tuple:
    """(µs per op span, µs per collective event): the calls the hot paths make with a timeline open,
    timed alone (`timeit`) on an op of two 4x4 inputs and a 4x4 output."""
    a = np.ones((4, 4), np.float32)
    glob = {"flight": flight, "c": flight.clock, "ins": [a, a], "outs": (a,), "key": ((0,), (0,))}
    n = 100_000
    events = flight.open_timeline()
    try:
        op = min(timeit.repeat("flight.op(c(), 'einsum', ins, outs, 128)", globals=glob, number=n, repeat=7))
        events.clear()
        coll = min(timeit.repeat("flight.end(flight.begin(c(), 'allreduce', ('all',), 64, 7, key, True))",
                                 globals=glob, number=n, repeat=7))
    finally:
        flight.close_timeline()
    return op / n * 1e6, coll / n * 1e6


def timed(fn, n: int, path: str) -> tuple:
    """µs per call of `fn`: plain, in a profile, in a profile with a timeline (written to `path`),
    and the timeline's events per call."""
    best = [float("inf")] * 3
    for _ in range(ROUNDS):  # (the three interleaved: the machine's load changes while it runs)
        best[0] = min(best[0], per_call(fn, n, loops=3))
        with mm.profile():
            best[1] = min(best[1], per_call(fn, n, loops=3))
        with mm.profile(timeline=path):
            best[2] = min(best[2], per_call(fn, n, loops=3))
            before = len(flight.timeline[0])
            fn()
            events = len(flight.timeline[0]) - before
    return (*best, events)


def row(name: str, fn, n: int, path: str) -> tuple:
    """A table row for `fn`, and the timeline's µs per event."""
    plain, counted, recorded, events = timed(fn, n, path)
    each = (recorded - counted) / max(events, 1)
    return (name, f"{plain:.2f}", f"{counted:.2f}", f"{recorded:.2f}", str(events), f"{each:.2f}"), each


def main() -> None:
    world = mm.MPI.COMM_WORLD
    rank0 = world.Get_rank() == 0
    if rank0:
        print(kernel_report())
        print(f"load average {load_average()}")
    path = os.path.join(tempfile.mkdtemp(), "timeline.json")
    rows, worst = [], 0.0
    if world.Get_size() == 1:
        mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
        for name, mine, _ in cases(mesh):
            r, each = row(name, mine, 2000, path)
            rows.append(r)
            worst = max(worst, each)
    mesh = mm.Mesh(f"all:{world.Get_size()}")
    if mesh.size > 1:
        coll, x = mesh.collectives, np.ones(4, np.float32)
        rows.append(row("allreduce of 4 floats", lambda: coll.allreduce(x, ("all",)), 500, path)[0])
    append, bare = ring_cost()
    op_event, coll_event = event_cost()
    if not rank0:
        return
    print(f"\nhost time per call, {world.Get_size()} rank(s) (best of {3 * ROUNDS} loops in {ROUNDS} interleaved "
          "rounds; the timeline's cost per event: with it minus the profile alone, over its events per call)")
    print(table(("call", "plain us", "profile us", "profile+timeline us", "events", "us per event"), rows))
    print(f"\nflight recorder, per op added to dispatch: {append:.3f} us (a clock reading, {bare:.3f} us, and "
          f"the append of a 3-tuple, {append - bare:.3f} us)")
    print(f"timeline, timed alone: {op_event:.3f} us per op span (its clock reading, shapes and tuple), "
          f"{coll_event:.3f} us per collective event (begun and closed)")
    verdicts = [verdict(f"flight recorder append at most {BARS['flight append']} us", append <= BARS["flight append"],
                        f"{append:.3f} us"),
                verdict(f"timeline event, timed alone, at most {BARS['timeline event']} us",
                        max(op_event, coll_event) <= BARS["timeline event"], f"{op_event:.3f} us, {coll_event:.3f} us")]
    if worst:
        verdicts.append(verdict(f"timeline event in dispatch at most {BARS['timeline event']} us",
                                worst <= BARS["timeline event"], f"worst op {worst:.2f} us (noisy: a difference)"))
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
