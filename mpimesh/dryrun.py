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
import types

import numpy as np

from .backend import as_dtype
from .collectives import counters
from .errors import MpimeshError
from .extras import require
from .collectives.dry import AVALS, DryCollectives
from .mesh import AbstractMesh
from .opdef import Aval, OpDef
from .shape import Shape, ShapeLike
from .tensor import DistTensor
from .trace import LegacyOp


def _counting_collectives(mesh_shape: Shape):
    """A `JaxCollectives` (vmapped) that counts each transfer, as the MPI transport does, before it."""
    from .tpu.collectives import JaxCollectives

    class CountingCollectives(JaxCollectives):
        """The JAX collectives of a dry run: each transfer counted with this processor's input."""

        log = None  # while `evaluate` traces a kernel: the counts it makes, to replay on a cache hit

        def _count(self, kind: str, dims, x, result_dtype=None) -> None:
            n, size = math.prod(x.shape), np.dtype(x.dtype).itemsize
            entry = (kind, (dims,) if isinstance(dims, str) else tuple(dims), n,
                     counters.reduction_bytes(n, size, np.dtype(result_dtype or x.dtype).itemsize))
            if self.log is not None:
                self.log.append(entry)
            counters.record(*entry)

        def _allreduce(self, x, mesh_dims, op):
            self._count("allreduce", mesh_dims, x)
            return super()._allreduce(x, mesh_dims, op)

        def _allreduce_rounded(self, x, mesh_dims, op, dtype):
            self._count("allreduce", mesh_dims, x, dtype)
            return JaxCollectives._allreduce(self, x, mesh_dims, op).astype(dtype)

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
        self._jax = None

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
        if isinstance(op, LegacyOp):
            return tuple(Aval(o.shape, o.dtype) for o in evaluate(self, op.name, op.lower, arrays))
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
    from .collectives.base import Request
    dims = tuple(n for n in mesh.shape.names if n in set(mesh_dims))
    if mesh.group_size(dims) > 1:
        n = sum(math.prod(a.shape) for a in arrays)
        counters.record("allreduce", dims, n, n * np.dtype(arrays[0].dtype).itemsize)
    return Request(lambda: True, lambda: None)


class _Uncacheable(Exception):
    pass


def _key(v, depth: int = 0):
    """A hashable stand-in for a kernel's closure value (`_Uncacheable` where there is none that
    is safe: an object known only by its address, a large array, a deep nest)."""
    if isinstance(v, (bool, int, float, complex)):  # by type too: 2 == 2.0 == True, whose results differ
        return type(v), v
    if v is None or isinstance(v, (str, bytes, np.dtype, type)):
        return v
    if depth > 6:
        raise _Uncacheable
    if isinstance(v, (tuple, list, frozenset, set)):
        items = sorted(map(repr, v)) if isinstance(v, (set, frozenset)) else [_key(x, depth + 1) for x in v]
        return type(v).__name__, tuple(items)
    if isinstance(v, dict):
        return "dict", tuple((_key(k, depth + 1), _key(x, depth + 1)) for k, x in v.items())
    if isinstance(v, slice):
        return "slice", v.start, v.stop, v.step
    if isinstance(v, np.ndarray):
        if v.size > 64:
            raise _Uncacheable
        return "array", v.dtype.str, v.shape, v.tobytes()
    if hasattr(v, "tensor_layout") and hasattr(v, "local"):  # a DistTensor: never its repr (a gather)
        if not getattr(v.mesh, "dry", False):
            raise _Uncacheable
        return "tensor", str(v.shape), v.tensor_layout, str(v.dtype)
    if isinstance(v, types.FunctionType):
        cells = []
        for c in v.__closure__ or ():
            try:
                cells.append(_key(c.cell_contents, depth + 1))
            except ValueError:  # an empty cell
                cells.append("<empty>")
        return v.__code__, tuple(cells), _key(v.__defaults__, depth + 1)
    r = repr(v)
    if " at 0x" in r or "..." in r:
        raise _Uncacheable
    return type(v).__qualname__, r


_cache: dict = {}  # (mesh shape, kernel key, input shapes and dtypes) -> (outputs, counts)
_CACHE_SIZE = 50_000


def evaluate(mesh: DryMesh, name: str, lower, locals_: list) -> tuple:
    """The kernel `lower`'s outputs on `mesh`'s processor as `jax.ShapeDtypeStruct`s (its
    collectives counted); an MpimeshError naming the op if the kernel cannot be traced by JAX.

    A kernel is a function of its code, its closure's values and its inputs' shapes and dtypes:
    one seen before (on a mesh of this shape) is not traced again, its outputs and counts are
    replayed (a program re-run dry under many layouts repeats most of its kernels)."""
    try:
        key = (str(mesh.shape), name, _key(lower), tuple((tuple(a.shape), str(a.dtype)) for a in locals_))
        hit = _cache.get(key)
    except (_Uncacheable, TypeError):
        key, hit = None, None
    if hit is not None:
        outs, log = hit
        for entry in log:
            counters.record(*entry)
        return outs
    if mesh._jax is None:
        require("jax", "tpu", f"a dry run of op {name!r}, which has no OpDef yet")
        mesh._jax = _counting_collectives(mesh.shape)
    ctx = mesh._jax
    ctx.log = []
    try:
        outs = _trace(mesh, name, lower, locals_)
        log = ctx.log
    finally:
        ctx.log = None
    if key is not None:
        if len(_cache) >= _CACHE_SIZE:
            _cache.clear()
        _cache[key] = (outs, tuple(log))
    return outs


def _trace(mesh: DryMesh, name: str, lower, locals_: list) -> tuple:
    import jax
    from .tpu.replay import _x64
    ctx, ms = mesh._jax, mesh.shape

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


def _bind_creation() -> None:
    """Give `DryMesh` the creation methods of `Mesh` (`mpimesh.creation`: `zeros`, `ones`, `full`,
    `random_normal`, ...), so code that initializes a model on a mesh makes placeholders on a dry one.

    >>> DryMesh("x:2", layout="a:x").random_normal("a:5;b:3", seed=0).local.shape
    (3, 3)
    """
    from .creation import METHODS
    for name, fn in METHODS.items():
        setattr(DryMesh, name, fn)


_bind_creation()
