"""Prefetch and overlap in a compiled step: an op that is one collective able to run without blocking
(`OpDef.start`: a sharded weight's gather, a gradient's reduce-scatter) becomes a start and a wait
(`program.AsyncStep`). The wait goes before the first step reading the result (else the end); the start
where its input exists, but no earlier than the `depth`-th such op before it (FSDP's prefetch), with at
most `depth` + 1 in flight. Values are eager's: the same transfers, in the same order on every rank.

>>> from mpimesh.opdef import OpDef
>>> gather, use = OpDef("g", lambda ctx, x: x, start=lambda p: lambda ctx, x: None), OpDef("use", lambda ctx, x: x)
>>> steps = [OpStep(gather, {}, [0], [2]), OpStep(use, {}, [2], [3]), OpStep(gather, {}, [1], [4]),
...          OpStep(use, {}, [4], [5])]
>>> [f"{s.kind} {s.step.outs}" if hasattr(s, "begin") else s.op.name for s in schedule(steps, depth=1)]
['start [2]', 'start [4]', 'wait [2]', 'use', 'wait [4]', 'use']
"""
from __future__ import annotations

from . import env
from .program import AsyncStep, OpStep

DEFAULT_DEPTH = 1


def prefetch_depth() -> int:
    """How many overlappable collectives a compiled step starts ahead of their turn: `MPIMESH_PREFETCH`
    (default 1; 0: each starts in its place, still waited for only where its result is read)."""
    return env.whole("MPIMESH_PREFETCH", DEFAULT_DEPTH, minimum=0)


def schedule(steps: list, depth: int) -> list:
    """`steps` (an engine's, in order) with every op step whose `OpDef.start` gives a starter for its
    params split into an `AsyncStep` start and wait, placed as the module says."""
    ready: dict = {}  # slot -> the step index from which it holds its value
    found = []  # (index, step, starter, start index, wait index) of each op that may run without blocking
    for i, step in enumerate(steps):
        begin = _starter(step)
        if begin is None:
            for s in step.writes():
                ready[s] = i + 1
            continue
        anchor = [found[-depth][0]] if depth and len(found) >= depth else []
        at = max([ready.get(s, 0) for s in step.ins] + anchor) if depth else i
        if len(found) > depth:  # at most depth + 1 in flight: the one depth + 1 back is waited for first
            k, *rest, until = found[-depth - 1]
            found[-depth - 1] = (k, *rest, min(until, at))
        out = step.outs[0]
        until = next((j for j in range(i + 1, len(steps)) if out in steps[j].reads()), len(steps))
        found.append((i, step, begin, at, until))
        ready[out] = until
    if not found:
        return steps
    starts: dict[int, list] = {}
    waits: dict[int, list] = {}
    for i, step, begin, at, until in found:
        starts.setdefault(at, []).append(AsyncStep("start", step, begin))
        waits.setdefault(until, []).append(AsyncStep("wait", step))
    split = {f[0] for f in found}
    out = []
    for i, step in enumerate(steps):
        out += waits.get(i, []) + starts.get(i, [])
        if i not in split:
            out.append(step)
    return out + waits.get(len(steps), [])


def _starter(step):
    """The starter of an op step that may run without blocking, or None."""
    if type(step) is not OpStep or step.op.start is None or step.write is not None or len(step.outs) != 1:
        return None
    return step.op.start(step.params)
