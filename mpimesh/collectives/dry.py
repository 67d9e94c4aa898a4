"""The collectives of a dry run: on `Aval`s (shapes and dtypes), each transfer counted, nothing moved.

A `DryMesh`'s one processor is coordinate 0 of every mesh dim. Each method returns the `Aval` of
the result a real transport would give there, and counts in the profile what the MPI transport
counts (the kind, the mesh dims, this rank's input), so an op's `abstract` rule, written like its
kernel, prices the op exactly.

>>> from mpimesh.shape import Shape
>>> from mpimesh import counters
>>> ctx = DryCollectives(Shape("rows:2;cols:3"))
>>> with counters.counting() as c:
...     y = ctx.allgather(Aval((4, 5), "float32"), "cols", 1, size=14)
>>> y, c["allgather/cols"]
(Aval((4, 14), float32), {'calls': 1, 'elements': 20, 'bytes': 80})
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from ..backend import accumulation_dtype, is_float
from ..opdef import Aval
from ..shape import Shape
from .. import counters
from .base import Collectives

AVALS = SimpleNamespace(__name__="mpimesh.dry", uint8=np.uint8, zeros_like=lambda x: Aval(x.shape, x.dtype),
                        asarray=lambda x, dtype=None: Aval(x.shape, dtype or x.dtype))
"""The array module a dry run's collectives see: what `Collectives`' shared code asks of one."""


def _with(shape: tuple, axis: int, n: int) -> tuple:
    return shape[:axis] + (n,) + shape[axis + 1:]


class DryCollectives(Collectives):
    """`Collectives` over `Aval`s at coordinate 0, counting each transfer as the MPI transport does."""

    transport = "dry"

    def __init__(self, mesh_shape: Shape):
        super().__init__(mesh_shape, AVALS)

    def coord(self, mesh_dim: str) -> int:
        return 0

    def any_rank(self, flag: bool) -> bool:
        return bool(flag)  # one processor stands for all

    def _count(self, kind: str, dims, x, result_dtype=None) -> None:
        n, size = math.prod(x.shape), np.dtype(x.dtype).itemsize
        counters.record(kind, (dims,) if isinstance(dims, str) else tuple(dims), n,
                        counters.reduction_bytes(n, size, np.dtype(result_dtype or x.dtype).itemsize))

    def _slice(self, x, axis: int, start, n: int):
        return Aval(_with(x.shape, axis, n), x.dtype)

    def _allreduce(self, x, mesh_dims: tuple, op: str, out=None):
        # a max or min of floats moves integers as wide as their accumulation dtype (`Collectives._extreme`)
        wide = op != "sum" and is_float(x.dtype)
        self._count("allreduce", mesh_dims, Aval(x.shape, accumulation_dtype(x.dtype)) if wide else x)
        return Aval(x.shape, x.dtype)

    def _allreduce_rounded(self, x, dims: tuple, op: str, dtype):
        self._count("allreduce", dims, x, dtype)
        return Aval(x.shape, dtype)

    def _allgather(self, x, mesh_dim: str, axis: int, sizes, out=None):
        self._count("allgather", mesh_dim, x)
        n = sum(sizes) if sizes is not None else self._sizes[mesh_dim] * x.shape[axis]
        return Aval(_with(x.shape, axis, n), x.dtype)

    def _alltoall(self, x, mesh_dim: str, split_axis: int, concat_axis: int, sizes, out=None):
        self._count("alltoall", mesh_dim, x)
        k = self._sizes[mesh_dim]
        if sizes is None:
            shape = _with(x.shape, split_axis, x.shape[split_axis] // k)
            total = k * x.shape[concat_axis]
        else:
            shape, total = _with(x.shape, split_axis, sizes[0][0]), sum(sizes[1])
        return Aval(shape if split_axis == concat_axis else _with(shape, concat_axis, total), x.dtype)

    def _reduce_scatter(self, x, mesh_dim: str, axis: int, op: str, sizes, out=None):
        self._count("reduce_scatter", mesh_dim, x)
        n = x.shape[axis]
        first = sizes[0] if sizes is not None else n // self._sizes[mesh_dim]
        return Aval(_with(x.shape, axis, first), x.dtype)

    def _permute(self, x, mesh_dim: str, offset: int, wrap: bool, out=None):
        sends = wrap or 0 <= offset < self._sizes[mesh_dim]  # (coordinate 0 sends to coordinate `offset`)
        self._count("permute", mesh_dim, x if sends else Aval((0,), x.dtype))
        return Aval(x.shape, x.dtype)

    def _exscan(self, x, mesh_dim: str, op: str):
        self._count("exscan", mesh_dim, x)
        return Aval(x.shape, x.dtype)

    def bucket_buffer(self, n: int, dtype, mesh_dims):
        return Aval((n,), dtype)
