"""top_k's kernel under an array module with CuPy's signatures, on the host: CuPy's `argsort` takes
no `stable=` (older versions no `kind=` either) and is always stable, so the kernel must ask numpy alone
for a stable sort. Values and indices (ties to the lower position, NaNs last) equal numpy's."""
from __future__ import annotations

import types

import numpy as np
import pytest

from mpimesh.ops.indexing import _top


def _cupy_like() -> types.ModuleType:
    """numpy under CuPy's name, with CuPy's `argsort(a, axis=-1)`: stable, and no keywords besides axis."""
    cp = types.ModuleType("cupy")
    cp.__getattr__ = lambda attr: getattr(np, attr)
    cp.argsort = lambda a, axis=-1: np.argsort(a, axis=axis, kind="stable")
    return cp


def _reference(x: np.ndarray, axis: int, k: int) -> tuple:
    order = np.take(np.argsort(-x, axis=axis, kind="stable"), np.arange(k), axis=axis)
    return np.take_along_axis(x, order, axis=axis), order


def _rows(n: int) -> np.ndarray:
    """Ties (small integers), a row of NaNs and a row with some."""
    x = np.random.default_rng(7).integers(0, 4, (6, n)).astype(np.float32)
    x[1, ::3] = np.nan
    x[2] = np.nan
    return x


@pytest.mark.parametrize("n, k", [(8, 5), (64, 3), (64, 16)], ids=["full-sort", "partition", "partition-4k"])
@pytest.mark.parametrize("axis", [0, 1])
def test_cupy_signature(n: int, k: int, axis: int) -> None:
    x = _rows(n)
    x = x if axis == 1 else np.ascontiguousarray(x.T)
    want_values, want_positions = _reference(x, axis, k)
    values, positions = _top(_cupy_like(), x, axis, k)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(positions, want_positions)


def test_integers_without_nans() -> None:
    x = np.random.default_rng(8).integers(-3, 3, (4, 40)).astype(np.int32)
    values, positions = _top(_cupy_like(), x, 1, 4)
    np.testing.assert_array_equal(positions, _reference(x, 1, 4)[1])
    np.testing.assert_array_equal(values, _reference(x, 1, 4)[0])
