"""Sums along the last axis, as the fused kernels (softmax, layer norm, cross-entropy) take them.

numpy's `sum(a, axis=-1)` over short rows (64 to 256 elements, a head's or a model's width) pays
a per-row cost: about 4x what `einsum("...i->...")` takes for the same sums (56 against 14 us for
the tiny Transformer's attention probabilities). On numpy, a reduction over the last axis alone
goes through `einsum` (float rounding of a different order, the same for eager and compiled
steps); every other case, and CuPy and JAX, take `xp.sum`.

>>> import numpy as np
>>> a = np.arange(6.0).reshape(2, 3)
>>> row_sum(np, a, (1,)).tolist(), row_dot(np, a, a, (1,)).tolist()
([[3.0], [12.0]], [[5.0], [50.0]])
"""
from __future__ import annotations

import numpy as np


def _last_axis_on_numpy(xp, a, axes: tuple) -> bool:
    return xp is np and tuple(axes) == (a.ndim - 1,) and a.dtype.kind == "f"


def row_sum(xp, a, axes: tuple):
    """`xp.sum(a, axis=axes, keepdims=True)`."""
    if _last_axis_on_numpy(xp, a, axes):
        return np.einsum("...i->...", a)[..., None]
    return xp.sum(a, axis=axes, keepdims=True)


def row_dot(xp, a, b, axes: tuple):
    """`xp.sum(a * b, axis=axes, keepdims=True)`, on numpy without the product's array."""
    if _last_axis_on_numpy(xp, a, axes) and a.shape == b.shape and a.dtype == b.dtype:
        return np.einsum("...i,...i->...", a, b)[..., None]
    return xp.sum(a * b, axis=axes, keepdims=True)
