"""Dry runs: ops on tensors without values, over a mesh without processors (no MPI, no kernels).

On a `DryMesh` (an `AbstractMesh` that ops can run on), `dispatch` does not compute: it asks JAX
for the shapes and dtypes of each op's kernel (`jax.eval_shape`, inside `vmap`s named like the mesh
dims), with `ctx` a `CountingCollectives` that counts every collective the kernel issues, in the
profile's counters (`mm.profile`, `collectives.counters.counting()`): the kind, mesh dims and the
bytes this processor hands the transport, as the MPI transport counts them. A trace records the
ops as usual (names, params, shapes, layouts), so a program can be traced under any layout rules
on any mesh shape, without the ranks or the memory, to price it (mpimesh's cost model).

The kernels are those a JAX replay runs (`tpu/replay.py`): the processor is coordinate 0 on every
mesh dim, and an uneven block is held padded to the largest, coordinate 0's. Needs JAX.

>>> import mpimesh as mm
>>> from mpimesh.collectives import counters
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
from .collectives import counters
from .errors import MpimeshError
from .extras import require
from .mesh import AbstractMesh
from .shape import Shape, ShapeLike


def _counting_collectives(mesh_shape: Shape):
    """A `JaxCollectives` (vmapped) that counts each transfer, as the MPI transport does, before it."""
    from .tpu.collectives import JaxCollectives

    class CountingCollectives(JaxCollectives):
        """The JAX collectives of a dry run: each transfer counted with this processor's input."""

        def _count(self, kind: str, dims, x) -> None:
            counters.record(kind, (dims,) if isinstance(dims, str) else tuple(dims), math.prod(x.shape),
                            math.prod(x.shape) * np.dtype(x.dtype).itemsize)

        def _allreduce(self, x, mesh_dims, op):
            self._count("allreduce", mesh_dims, x)
            return super()._allreduce(x, mesh_dims, op)

        def _allgather(self, x, mesh_dim, axis, sizes):
            self._count("allgather", mesh_dim, x)
            return super()._allgather(x, mesh_dim, axis, sizes)

        def _alltoall(self, x, mesh_dim, split_axis, concat_axis, sizes):
            self._count("alltoall", mesh_dim, x)
            return super()._alltoall(x, mesh_dim, split_axis, concat_axis, sizes)

        def _reduce_scatter(self, x, mesh_dim, axis, op, sizes):
            self._count("reduce_scatter", mesh_dim, x)
            return super()._reduce_scatter(x, mesh_dim, axis, op, sizes)

        def _permute(self, x, mesh_dim, offset, wrap):
            self._count("permute", mesh_dim, x)
            return super()._permute(x, mesh_dim, offset, wrap)

        def _exscan(self, x, mesh_dim, op):
            self._count("exscan", mesh_dim, x)
            return super()._exscan(x, mesh_dim, op)

        def any_rank(self, flag: bool) -> bool:
            return bool(flag)  # one processor stands for all

    return CountingCollectives(mesh_shape, vmapped=True)


class DryMesh(AbstractMesh):
    """An `AbstractMesh` that ops run on dry: tensors on it (see `placeholder`) have shapes,
    layouts and dtypes but no values, and every op on them is traced, counted and recorded, never
    computed. Its one processor is coordinate 0 of every mesh dim.

    >>> DryMesh("x:8").coords, DryMesh("x:8").block_shape("a:20", "a:x")
    ({'x': 0}, (3,))
    """

    dry = True

    def __init__(self, shape: ShapeLike, layout=""):
        require("jax", "tpu", "a dry run (mpimesh.dryrun)")
        super().__init__(shape, layout)
        self._collectives = None

    rank = 0  # the one processor a dry run follows

    @property
    def coords(self) -> dict[str, int]:
        """Coordinate 0 on every mesh dim: the processor whose blocks are the largest."""
        return dict.fromkeys(self.shape.names, 0)

    @property
    def xp(self):
        import jax.numpy as jnp
        return jnp

    @property
    def collectives(self):
        """The counting JAX collectives the kernels are traced with."""
        if self._collectives is None:
            self._collectives = _counting_collectives(self.shape)
        return self._collectives

    def __repr__(self) -> str:
        return f"DryMesh({str(self.shape)!r}, layout={str(self.rules)!r})"


def placeholder(mesh: DryMesh, shape: ShapeLike, dtype="float32", layout=None):
    """A tensor of `shape` and `dtype` on `mesh`, laid out by `layout` (default: the rules in
    force), without values: its `local` is a `jax.ShapeDtypeStruct` of coordinate 0's block."""
    import jax
    from .tensor import DistTensor
    if not getattr(mesh, "dry", False):
        raise MpimeshError(f"placeholder: {mesh!r} is not a DryMesh (tensors with values come from mesh.zeros, ...)")
    shape = Shape(shape)
    tl = mesh.layout_of(shape, layout)
    return DistTensor(mesh, shape, tl, jax.ShapeDtypeStruct(mesh.block_shape(shape, tl), as_dtype(dtype)))


def evaluate(mesh: DryMesh, name: str, lower, locals_: list) -> tuple:
    """The kernel `lower`'s outputs on `mesh`'s processor as `jax.ShapeDtypeStruct`s (its
    collectives counted); an MpimeshError naming the op if the kernel cannot be traced by JAX."""
    import jax
    from .tpu.replay import _x64
    ctx, ms = mesh.collectives, mesh.shape

    def kernel(*arrays):
        out = lower(ctx, *arrays)
        return out if isinstance(out, tuple) else (out,)
    for n in reversed(ms.names):  # every value batched over every mesh dim, as in the replay's gspmd mode
        kernel = jax.vmap(kernel, axis_name=n, axis_size=ms[n].size)
    args = [jax.ShapeDtypeStruct(ms.sizes + tuple(a.shape), a.dtype) for a in locals_]
    try:
        with _x64():
            outs = jax.eval_shape(kernel, *args)
    except MpimeshError:
        raise
    except Exception as e:
        raise MpimeshError(f"dry run of op {name!r}: its kernel cannot be traced by JAX "
                           f"({type(e).__name__}: {e})") from e
    return tuple(jax.ShapeDtypeStruct(o.shape[ms.rank:], o.dtype) for o in outs)
