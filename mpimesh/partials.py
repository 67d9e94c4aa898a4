"""Which einsum may leave its sum over mesh dims to a gradient bucket, and which relayout its reduce-scatter:
the hooks between the ops and `mpimesh.buckets` (which sits above them).

A gradient rule wraps the one einsum that makes a leaf's gradient in `partial_for(leaf)`; the
einsum asks `claim(dtype)`: a `Bucketer` (an `mm.gradients` walk in progress that buckets that leaf) to
hand its local sums to, or None. Buckets register their walk with `active`.

>>> with partial_for(None):
...     claim("float32") is None
True
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

active: list = []  # the Bucketer of each `mm.gradients` walk in progress, innermost last
summable: set = set()  # ids of tensors whose gradient an einsum may leave awaiting its sum over ranks
#                        (`mm.gradients` adds a gathered tensor's: its relayout's rule reduce-scatters it)
_claims: list = []  # per `partial_for` block: the Bucketer its einsum may defer to, or None


@contextmanager
def partial_for(x) -> Iterator[None]:
    """Around a gradient rule's one einsum whose result is `x`'s gradient itself: where `x` is a leaf
    of a bucketed `mm.gradients` walk, that einsum's sum over mesh dims is left to a bucket."""
    b = active[-1] if active else None
    _claims.append((b, x.dtype) if b is not None and x is not None and id(x) in b.leaves else None)
    try:
        yield
    finally:
        _claims.pop()


def deferred(x) -> Optional[object]:
    """The Bucketer of the innermost `mm.gradients` walk in progress if `x` is one of the leaves it
    buckets (whose gradients it reads only once every transfer is in), else None: a gathered weight's
    relayout rule hands it its gradient's reduce-scatter (`Bucketer.scatter`)."""
    b = active[-1] if active else None
    return b if b is not None and id(x) in b.leaves else None


def pending() -> bool:
    """Whether the innermost `partial_for` block may still hand an einsum's sum to a bucket (the
    einsum's cheap test, before it works out its result dtype for `claim`)."""
    return bool(_claims) and _claims[-1] is not None


def claim(dtype) -> Optional[object]:
    """For an einsum whose result has `dtype`: the Bucketer its allreduce may be left to (once per
    `partial_for` block), or None; None too where `dtype` is not the leaf's (float64 activations
    of float32 parameters: the rule casts the gradient, which needs its sum first)."""
    if not _claims or _claims[-1] is None:
        return None
    (b, leaf), _claims[-1] = _claims[-1], None
    return b if dtype == leaf else None
