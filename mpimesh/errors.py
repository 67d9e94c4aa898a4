"""The errors mpimesh raises; each names the offending dims and sizes.

Every check that can raise runs on shapes and layouts alone, which are the same on every
rank, so every rank raises the same error before any communication starts.

>>> raise LayoutError("dim 'batch' is laid out on mesh dim 'planes', but the mesh has dims ['rows', 'cols']")
Traceback (most recent call last):
...
mpimesh.errors.LayoutError: dim 'batch' is laid out on mesh dim 'planes', but the mesh has dims ['rows', 'cols']
"""
from __future__ import annotations

from typing import Sequence


class MpimeshError(ValueError):
    """Base class of every mpimesh error."""


class LayoutError(MpimeshError):
    """A layout that cannot be realised: two tensor dims on one mesh dim, or an unknown mesh dim
    (sizes need not divide: a dim is cut like `numpy.array_split`)."""


class ShapeError(MpimeshError):
    """Dims that disagree (same name, different size; missing or unexpected dims)."""


class MeshError(MpimeshError):
    """A mesh whose size differs from its communicator, or a malformed mesh string."""


class DTypeError(MpimeshError, TypeError):
    """A dtype mpimesh cannot hold (not a bool, integer, float or complex type, or not a dtype at
    all), or a value that the dtype cannot represent. Also a TypeError, as numpy's dtype errors are."""


class CheckpointError(MpimeshError):
    """A checkpoint that is truncated, corrupted or does not match what was asked for."""


class DivergenceError(MpimeshError):
    """Ranks of a mesh reached different collectives (another kind, mesh dims, dtype or local shape):
    raised on every rank before any data moved, so the mesh stays usable."""


class CollectiveTimeoutError(MpimeshError):
    """A collective did not complete within the time-out; names the ranks that never arrived."""


class MissingDependencyError(MpimeshError, ImportError):
    """An optional package a feature needs is not installed; names the extra that brings it."""


def by_rank(values: Sequence) -> str:
    """Each distinct value of `values` (rank r's is `values[r]`) with the ranks that have it, at
    most four named: how a message says what the ranks disagree on.

    >>> by_rank(["a", "a", "b", "a", "a", "a"])
    'ranks 0, 1, 3, 4 and 1 more: a; rank 2: b'
    """
    groups: dict = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs[:4]))}"
                     f"{f' and {len(rs) - 4} more' if len(rs) > 4 else ''}: {v}" for v, rs in groups.items())
