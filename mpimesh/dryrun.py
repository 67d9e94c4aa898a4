"""Dry runs: ops on tensors without values, over a mesh without processors (no MPI, no kernels).

On a `DryMesh` each op's output blocks are `Aval`s (coordinate 0's, the largest), dtypes and counted
collectives from its `OpDef.abstract` rule; traces record the ops as usual, so the cost model prices
a step on any mesh shape under any rules. More: docs/cost_model.md.

>>> import mpimesh as mm
>>> from mpimesh import counters
>>> mesh = DryMesh("rows:4;cols:2", layout="batch:rows;hidden:cols")
>>> x, w = placeholder(mesh, "batch:64;hidden:32"), placeholder(mesh, "hidden:32;out:8")
>>> with counters.counting() as c, mm.trace() as tr:
...     y = mm.einsum([x, w])
>>> y.local.shape, [op.name for op in tr.ops], c["allreduce/cols"]
((16, 8), ['einsum'], {'calls': 1, 'elements': 128, 'bytes': 512})
"""
from __future__ import annotations

import math

import numpy as np

from .backend import as_dtype
from . import counters
from .collectives.base import Request
from .collectives.dry import AVALS, DryCollectives
from .errors import MpimeshError
from .mesh import AbstractMesh
from .opdef import Aval, OpDef
from .shape import Shape, ShapeLike
from .tensor import DistTensor


class DryMesh(AbstractMesh):
    """An `AbstractMesh` that ops run on dry: tensors on it (see `placeholder`, and the creation
    methods `zeros`, `random_normal`, ... as on a `Mesh`) have shapes, layouts and dtypes but no
    values, and every op on them is traced, counted and recorded, never computed. Its one
    processor is coordinate 0 of every mesh dim.

    >>> DryMesh("x:8").coords, DryMesh("x:8").block_shape("a:20", "a:x")
    ({'x': 0}, (3,))
    """

    dry = True

    def __init__(self, shape: ShapeLike, layout=""):
        super().__init__(shape, layout)
        self._collectives = DryCollectives(self.shape)

    rank = 0  # the one processor a dry run follows
    xp = AVALS

    @property
    def coords(self) -> dict[str, int]:
        """Coordinate 0 on every mesh dim: the processor whose blocks are the largest."""
        return dict.fromkeys(self.shape.names, 0)

    @property
    def coords_key(self) -> tuple:
        """`coords` as a tuple of pairs (see `Mesh.coords_key`)."""
        return tuple(self.coords.items())

    @property
    def collectives(self) -> DryCollectives:
        """The counting collectives on `Aval`s that ops' `abstract` rules call."""
        return self._collectives

    def run_dry(self, op: OpDef, params: dict, arrays: list, specs) -> tuple:
        """`op`'s output blocks on coordinate 0 as `Aval`s: shapes from the output specs' layouts,
        dtypes from its `abstract` rule, which counts its collectives (`dispatch` calls it)."""
        shapes = [self.block_shape(shape, layout) for shape, layout in specs]
        try:
            dtypes = op.abstract(self._collectives, shapes, *arrays, **params)
        except MpimeshError:
            raise
        except Exception as e:
            raise MpimeshError(f"dry run of op {op.name!r}: its abstract rule failed ({type(e).__name__}: {e})") from e
        return tuple(Aval(s, d) for s, d in zip(shapes, dtypes))

    def __repr__(self) -> str:
        return f"DryMesh({str(self.shape)!r}, layout={str(self.rules)!r})"


def placeholder(mesh: DryMesh, shape: ShapeLike, dtype="float32", layout=None):
    """A tensor of `shape` and `dtype` on `mesh`, laid out by `layout` (default: the rules in
    force), without values: its `local` is an `Aval` of coordinate 0's block."""
    if not getattr(mesh, "dry", False):
        raise MpimeshError(f"placeholder: {mesh!r} is not a DryMesh (tensors with values come from mesh.zeros, ...)")
    shape = Shape(shape)
    tl = mesh.layout_of(shape, layout)
    return DistTensor(mesh, shape, tl, Aval(mesh.block_shape(shape, tl), as_dtype(dtype)))


def shaped(shape, dtype) -> Aval:
    """A dry run's stand-in for an array: its shape and dtype."""
    return Aval(shape, as_dtype(dtype))


def count_bucket(mesh: DryMesh, arrays: list, mesh_dims) -> "Request":
    """A gradient bucket's allreduce on `mesh` (`mpimesh.buckets`): counted as the MPI transport
    counts it, one allreduce of the concatenated blocks (nothing over a group of 1); the request's
    result is None (the bucket then gives each gradient its shape and dtype only)."""
    dims = tuple(n for n in mesh.shape.names if n in set(mesh_dims))
    if mesh.group_size(dims) > 1:
        n = sum(math.prod(a.shape) for a in arrays)
        counters.record("allreduce", dims, n, n * np.dtype(arrays[0].dtype).itemsize)
    return Request(lambda: True, lambda: None)
