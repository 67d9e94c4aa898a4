"""Liveness: when each value of a program is last read, and whether anything but known holders still
refers to an object. Every engine that frees memory asks here: the compiled replay (slots freed after
their last reader), CUDA graphs (which captured outputs later steps read), autodiff (when the backward
walk is past a tensor's last rule), the forward's release, the cost model (lifetimes), the transports'
buffer pools (a pooled buffer no array views).

>>> last_uses([["x"], ["x", "y"], ["y"]])
{'x': 1, 'y': 2}
>>> frees([["x"], ["x", "y"], ["y"]], keep={"y"}), used_from({"x": 1, "y": 2}, 2)
({1: ['x']}, {'y'})
>>> box = {"t": object()}
>>> held_only_by(box, "t"), held_only_by(box, "t", places=1)
(True, False)
"""
from __future__ import annotations

from sys import getrefcount
from typing import Hashable, Iterable, Mapping, MutableSequence, Union


def last_uses(uses: Iterable[Iterable[Hashable]]) -> dict:
    """`{value: index of the last step that uses it}`, for steps given as the values each uses."""
    last: dict = {}
    for i, step in enumerate(uses):
        for v in step:
            last[v] = i
    return last


def used_from(last: Mapping, step: int) -> set:
    """The values of `last` (`last_uses`'s answer) that step `step` or a later one still uses."""
    return {v for v, i in last.items() if i >= step}


def frees(uses: Iterable[Iterable[Hashable]], keep=()) -> dict:
    """`{step index: the values whose last use it is}`, leaving out those in `keep` (outputs, constants)."""
    out: dict = {}
    for v, i in last_uses(uses).items():
        if v not in keep:
            out.setdefault(i, []).append(v)
    return out


def held_only_by(container: Union[MutableSequence, Mapping], key, places: int = 0) -> bool:
    """Whether nothing refers to `container[key]` but `container` and `places` other references the
    caller knows of (records of a trace, a view's owner): numpy's own test before it reuses a temporary."""
    return getrefcount(container[key]) - _ALONE == places  # (no call more: per traced op)


def _count(container, key) -> int:
    return getrefcount(container[key])  # (the expression `held_only_by` evaluates, in a function as there)


_ALONE = _count([object()], 0)  # (measured as it is used: the count of an element nothing else refers to)
