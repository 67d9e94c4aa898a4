"""Counters that collectives and kernels feed while a profile is open (`mm.profile()`).

>>> with counting() as c:
...     record("allreduce", ("rows",), 10, 40)
...     record_overlap(0.5, 0.125)
>>> c["allreduce/rows"], c.overlap["hidden"]
({'calls': 1, 'elements': 10, 'bytes': 40}, 0.375)
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import ContextManager, Iterator, Sequence

from .stack import Stack

opened: Stack = Stack()
"""The `Counters` of the profiles open now, innermost last (`counting` pushes them): each counts everything."""
_open = opened  # TEMPORARY: the name trace.py, compiled.py and graphs.py read until the lead's edit (issue 41)


class Counters(dict):
    """`{"<kind>/<mesh dims>": {"calls", "elements", "bytes"}, "flops": {...}}`, and in `overlap` the
    non-blocking collectives completed: `{"requests", "seconds", "exposed", "hidden"}` (kept apart
    from the dict's items, which are all counts of calls)."""

    __slots__ = ("overlap",)

    def __init__(self):
        super().__init__()
        self.overlap = {"requests": 0, "seconds": 0.0, "exposed": 0.0, "hidden": 0.0}


def active() -> bool:
    """Whether any profile is counting."""
    return bool(opened)


def record(kind: str, mesh_dims: Sequence[str], elements: int, nbytes: int) -> None:
    """Count one collective call of `kind` over `mesh_dims` with this rank's input size (a host-device
    copy, `"h2d"` or `"d2h"`, has no mesh dims and is keyed by its kind alone).

    The input is what this rank hands the transport: its block for an allgather, all of `x` for an
    alltoall or reduce-scatter (its own block included). With unequal blocks that is exactly what it
    sends, never padding (no transport pads), and 0 for an empty block (the call still counts)."""
    if not opened:
        return
    key = f"{kind}/{'+'.join(mesh_dims)}" if mesh_dims else kind
    for counters in opened:
        c = counters.setdefault(key, {"calls": 0, "elements": 0, "bytes": 0})
        c["calls"] += 1
        c["elements"] += int(elements)
        c["bytes"] += int(nbytes)


def reduction_bytes(elements: int, itemsize: int, result_itemsize: int) -> int:
    """Bytes counted for a reduction of `elements` partials of `itemsize` bytes into a result of
    `result_itemsize` bytes each: half at each width, since an allreduce is a reduce-scatter of the
    partials and an allgather of the result (the same as `elements * itemsize` when they agree).

    >>> reduction_bytes(10, 4, 2), reduction_bytes(10, 4, 4)
    (30, 40)
    """
    return elements * (itemsize + result_itemsize) // 2


def traffic(counts) -> dict:
    """The entries of `counts` that are transfers (collectives, host-device copies): all but
    `"flops"` and `"copies"` (arrays copied on this rank to change memory order).

    >>> traffic({"allreduce/x": {"calls": 1}, "flops": {"calls": 2}, "copies": {"calls": 3}})
    {'allreduce/x': {'calls': 1}}
    """
    return {k: v for k, v in counts.items() if k not in ("flops", "copies")}


def record_flops(flops: int) -> None:
    """Count one local compute kernel of `flops` floating-point operations."""
    for counters in opened:
        c = counters.setdefault("flops", {"calls": 0, "flops": 0})
        c["calls"] += 1
        c["flops"] += int(flops)


def record_overlap(seconds: float, exposed: float) -> None:
    """Count one completed non-blocking collective: `seconds` from its start to its completion, of
    which the caller spent `exposed` blocked waiting for it (the rest was hidden behind other work)."""
    for counters in opened:
        c = counters.overlap
        c["requests"] += 1
        c["seconds"] += seconds
        c["exposed"] += exposed
        c["hidden"] += max(0.0, seconds - exposed)


def counting() -> ContextManager[Counters]:
    """Open a counter dict that every collective and kernel in the block adds to (a context manager)."""
    return opened.push(Counters())


@contextmanager
def paused() -> Iterator[None]:
    """Count nothing inside the block (e.g. the gather behind a tensor's repr is not the program's)."""
    saved = opened[:]
    opened.clear()
    try:
        yield
    finally:
        opened[:0] = saved
