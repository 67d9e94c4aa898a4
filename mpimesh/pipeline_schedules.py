"""Pipeline schedules as data: each rank's ordered steps, and the ticks all ranks run them in.

A step is `(kind, microbatch, virtual)`: `"F"` (forward) or `"B"` (backward) of one microbatch
through the rank's `virtual`-th stage. With S ranks and V virtual stages, rank s holds the stages
applied at positions `v * S + s` of the pipeline (v = 0 .. V-1). `ticks` turns the ranks' orders
into a table of ticks: per tick and rank, a tuple of steps (none, one, or interleaved's forward and
backward pair), run only after the steps they need ran at earlier ticks (an activation or gradient
moves to the neighbour between two ticks). Pure Python: the same table on every rank.

>>> [" ".join("".join(f"{k}{m}" for k, m, _ in u) or "--" for u in row) for row in ticks("1f1b", 2, 3)]
['F0 --', 'F1 F0', '-- B0', 'B0 F1', 'F2 B1', 'B1 F2', '-- B2', 'B2 --']
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Optional

from .errors import MpimeshError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Step(NamedTuple):
    """One rank's work at one tick: `kind` "F" or "B", the microbatch, the rank's virtual stage."""
    kind: str
    mb: int
    virtual: int


def stage_of(s: int, v: int, stages: int) -> int:
    """The pipeline position of rank `s`'s virtual stage `v` (`v * stages + s`).

    >>> [stage_of(s, v, 2) for s in range(2) for v in range(2)]
    [0, 2, 1, 3]
    """
    return v * stages + s


def application_order(stages: int, virtual: int) -> list:
    """Index along a stage dim of size `stages * virtual` (blocks of `virtual` per rank) of the
    stage applied first, second, ...: position `v * stages + s` is index `s * virtual + v`.

    >>> application_order(2, 2), application_order(3, 1)
    ([0, 2, 1, 3], [0, 1, 2])
    """
    return [s * virtual + v for v in range(virtual) for s in range(stages)]


def check_schedule(schedule: str, virtual: int) -> None:
    """A clear error for an unknown schedule, or virtual stages outside "interleaved"."""
    if schedule not in SCHEDULES:
        raise MpimeshError(f"pipeline: unknown schedule {schedule!r}: use one of {', '.join(map(repr, SCHEDULES))}")
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise MpimeshError(f"pipeline: virtual_stages must be a positive int, got {virtual!r}")
    if virtual > 1 and schedule != "interleaved":
        raise MpimeshError(f"pipeline: virtual_stages={virtual} needs schedule='interleaved' (got {schedule!r})")


def rank_order(schedule: str, stages: int, microbatches: int, s: int, virtual: int = 1,
               forward: bool = True, backward: bool = True, extra: int = 0, paired: bool = True) -> list:
    """Rank `s`'s steps in order, grouped into what it runs in one tick (tuples). GPipe: every
    forward, then the backwards in reverse. 1F1B: `stages - s - 1` forwards, then one forward and
    one backward in turn, then the last backwards (at most `stages - s` microbatches in flight).
    Interleaved: as 1F1B over (microbatch, virtual stage) pairs taken in groups of `stages`
    microbatches, stage by stage, with Megatron-LM's longer warm-up, `(stages - s - 1) * 2 +
    (virtual - 1) * stages` forwards, and its steady state's forward and backward in one tick (one
    exchange with the neighbours per pair: every rank's tick then costs a forward and a backward;
    `paired=False`: one step a tick); `extra` more forwards before the first backward (`ticks` adds them where microbatches do not
    fill the groups and Megatron-LM's count would wait for ever).

    >>> [" ".join(f"{k}{m}" for k, m, _ in u) for u in rank_order("1f1b", 3, 4, 0)]
    ['F0', 'F1', 'F2', 'B0', 'F3', 'B1', 'B2', 'B3']
    >>> [" ".join(f"{k}{m}.{v}" for k, m, v in u) for u in rank_order("interleaved", 2, 2, 1, 2)]
    ['F0.0', 'F1.0', 'F0.1 B0.1', 'F1.1 B1.1', 'B0.0', 'B1.0']
    """
    M, S, V = microbatches, stages, virtual
    pairs = sorted(((m, v) for m in range(M) for v in range(V)), key=lambda p: (p[0] // S, p[1], p[0] % S))
    fwd = [(Step("F", m, v),) for m, v in pairs]
    bwd = [(Step("B", m, V - 1 - v),) for m, v in pairs]
    if not backward:
        return fwd
    if not forward:
        return bwd[::-1] if schedule == "gpipe" else bwd
    if schedule == "gpipe":
        return fwd + bwd[::-1]
    interleaved = schedule == "interleaved"
    warm = min(len(fwd), ((S - s - 1) * 2 + (V - 1) * S if interleaved else S - s - 1) + extra)
    order = fwd[:warm]
    for f, b in zip(fwd[warm:], bwd):
        order += [f + b] if interleaved and paired else [f, b]
    return order + bwd[len(fwd) - warm:]


@lru_cache(maxsize=64)  # (a pipeline op asks each step: 0.6 ms for 1F1B, 2-5 ms interleaved, on 2-4 stages)
def ticks(schedule: str, stages: int, microbatches: int, virtual: int = 1, forward: bool = True,
          backward: bool = True) -> tuple:
    """The tick table (cached: tuples): per tick, a tuple of `Step`s per rank (`rank_order`'s groups;
    empty where it idles). A forward of position k needs the forward of position k-1 at an earlier tick; a backward
    needs its forward (earlier, or before it in the same tick) and the backward of position k+1 (the
    last position: its own forward) earlier. Without `forward`, backwards only (the gradient pass of
    `mm.pipeline`, whose forwards ran before); without `backward`, forwards only. Interleaved: its
    steady state paired or one step a tick, whichever `span` finds shorter (pairs where microbatches
    fill groups of `stages`, as Megatron-LM requires; one step a tick wins some other counts).

    >>> [len(ticks("interleaved", 2, 8, 2)), span(ticks("interleaved", 2, 8, 2), 2, 2)]
    [20, 25.5]
    """
    both = schedule == "interleaved" and forward and backward
    tables = [_table(schedule, stages, microbatches, virtual, forward, backward, paired) for paired in
              ((True, False) if both else (True,))]
    return tuple(tuple(row) for row in min(tables, key=lambda table: span(table, stages, virtual)))


def _table(schedule: str, S: int, M: int, V: int, forward: bool, backward: bool, paired: bool) -> list:
    """`ticks`' table of the ranks' `rank_order`s, with the fewest `extra` forwards that progress."""
    for extra in range(M * V + 1):
        orders = [rank_order(schedule, S, M, s, V, forward, backward, extra, paired) for s in range(S)]
        table = _run(orders, S, V, forward)
        if table is not None:
            return table
    raise MpimeshError(f"pipeline schedule {schedule!r} ({S} stages, {M} microbatches, {V} "
                       f"virtual) cannot progress")  # (a bug in the orders: never for users)


def span(table: list, stages: int, virtual: int = 1, backward_cost: float = 2.0) -> float:
    """A table's time in forwards of a whole stage (a virtual stage's: 1/`virtual`), its backward
    `backward_cost` times a forward, the transfers after each tick taking no time but waiting for
    both ends of each message (a rank that sends or receives nothing waits for no one).

    >>> span(ticks("1f1b", 2, 4), 2), span(ticks("interleaved", 2, 4, 2), 2, 2)
    (15.0, 13.5)
    """
    S, last = stages, stages * virtual - 1
    clock = [0.0] * S
    for row in table:
        for s, unit in enumerate(row):
            clock[s] += sum(1.0 if r.kind == "F" else backward_cost for r in unit) / virtual
        for kind, offset, moved in zip("FB", (1, -1), moves(row, S, virtual)):
            if moved:
                hands = [any(r.kind == kind and stage_of(s, r.virtual, S) != (last if kind == "F" else 0)
                             for r in unit) for s, unit in enumerate(row)]
                clock = [max([clock[s]] + [clock[(s + offset) % S]] * hands[s] + [clock[(s - offset) % S]] *
                             hands[(s - offset) % S]) for s in range(S)]
    return max(clock)


def _run(orders: list, S: int, V: int, forward: bool) -> Optional[list]:
    """The tick table of the ranks' `orders`, or None where they wait for each other for ever."""
    last = S * V - 1
    done: dict = {}
    at = [0] * S
    table: list = []
    while any(at[s] < len(orders[s]) for s in range(S)):
        t, row = len(table), []
        for s in range(S):
            unit = orders[s][at[s]] if at[s] < len(orders[s]) else ()
            ran = {(f.mb, f.virtual) for f in unit if f.kind == "F"}
            if unit and all(_ready(step, stage_of(s, step.virtual, S), last, done, t, forward,
                                   (step.mb, step.virtual) in ran) for step in unit):
                row.append(unit)
                at[s] += 1
            else:
                row.append(())
        if not any(row):
            return None
        for s, unit in enumerate(row):
            for step in unit:
                done[(step.kind, step.mb, stage_of(s, step.virtual, S))] = t
        table.append(row)
    return table


def _ready(step: Step, k: int, last: int, done: dict, t: int, forwards: bool, forward_here: bool) -> bool:
    """Whether `step` (at position k) may run at tick t; `forward_here`: its forward runs before it
    in the same tick, on this rank."""
    def before(key) -> bool:
        return key in done and done[key] < t
    if step.kind == "F":
        return k == 0 or before(("F", step.mb, k - 1))
    if forwards and not (forward_here or before(("F", step.mb, k))):
        return False
    return k == last or before(("B", step.mb, k + 1))


def moves(row: list, stages: int, virtual: int = 1) -> tuple:
    """`(forward, backward)` after tick `row`: whether some rank hands an activation on to the next
    position (a forward short of the last), and some a gradient back to the previous (a backward
    past the first): a transfer along the mesh dim each, in which every rank takes part.

    >>> [moves(row, 2) for row in ticks("gpipe", 2, 1)]
    [(True, False), (False, False), (False, True), (False, False)]
    """
    last = stages * virtual - 1
    steps = [(j, r) for j, unit in enumerate(row) for r in unit]
    return (any(r.kind == "F" and stage_of(j, r.virtual, stages) < last for j, r in steps),
            any(r.kind == "B" and stage_of(j, r.virtual, stages) > 0 for j, r in steps))


def sent(unit: tuple, kind: str) -> Optional[Step]:
    """The step of `kind` ("F" or "B") in a rank's tick `unit`, None if it has none."""
    return next((r for r in unit if r.kind == kind), None)


def most_in_flight(table: list, s: int) -> int:
    """The most microbatches (forwards not yet matched by their backward) rank `s` holds at once.

    >>> most_in_flight(ticks("1f1b", 4, 8), 0), most_in_flight(ticks("gpipe", 4, 8), 0)
    (4, 8)
    """
    held = most = 0
    for row in table:
        for step in row[s]:
            held += 1 if step.kind == "F" else -1
            most = max(most, held)
    return most
