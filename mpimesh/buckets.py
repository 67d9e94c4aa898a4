"""Bucketed, overlapped gradient sums: the "partial" state of a gradient.

A parameter's gradient awaiting its data-parallel sum (`partials.partial_for`) is written into its slot
of a bucket per (mesh dims, dtype), summed in place by one non-blocking allreduce while the backward goes
on (a `"psum"` op in the trace); a sharded weight's joins a bucket of reduce-scatters (packed by
destination). Values: unbucketed reduction's. Size: `set_bucket_bytes` (default 25 MiB; 0: off).

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> w, x = mesh.from_numpy(np.array([1.0, 2.0]), "h:2"), mesh.ones("b:3;h:2")
>>> with mm.trace():
...     (g,) = mm.gradients([mm.reduce_sum(x * w)], [w], bucket_bytes=1 << 20)
>>> g.to_numpy().tolist(), bucket_bytes()
([3.0, 3.0], 26214400)
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from . import env
from .backend import accumulation_dtype, on_host
from .dryrun import count_bucket, shaped
from .errors import MpimeshError
from .layout import block_sizes, local_sizes
from .ops.elementwise import cast
from .ops.relayout import SUM_PARTIAL, sum_abstract, sum_kernel, sum_plan
from .partials import active
from .tensor import DistTensor
from .opdef import OpDef
from .overlap import prefetch_depth
from .trace import OpRecord, _open_traces

DEFAULT_BUCKET_BYTES = 25 << 20
ALONE_BYTES = 1 << 20  # a sharded weight's gradient this big is reduce-scattered alone, at once (`Bucketer.scatter`)


def _checked(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise MpimeshError(f"bucket size must be a whole number of bytes >= 0 (0: no buckets), got {n!r}")
    return n


# read at import: a bad value gives the default, and its error is raised by the first Mesh or bucket_bytes()
_settings = {"bytes": env.early(env.whole, "MPIMESH_BUCKET_BYTES", DEFAULT_BUCKET_BYTES, minimum=0,
                               what="a whole number of bytes >= 0 (0: no buckets)")}


def set_bucket_bytes(n: int) -> None:
    """Gradient bucket size in bytes for `mm.gradients` (default 25 MiB; 0: each gradient summed on
    the spot, no buckets). Call it on every rank alike."""
    _settings["bytes"] = _checked(n)


def bucket_bytes() -> int:
    """The gradient bucket size in force, bytes."""
    env.raise_kept("MPIMESH_BUCKET_BYTES")
    return _settings["bytes"]


class Unreduced:
    """The local array of a gradient whose sum is still in flight: reading it is an error."""

    __slots__ = ("shape", "dtype", "dims")

    def __init__(self, like, dims: tuple, dtype=None):
        self.shape, self.dims = like.shape, dims
        self.dtype = like.dtype if dtype is None else dtype

    def __getattr__(self, name):
        raise MpimeshError(f"a [{self.shape}] {self.dtype} gradient still awaits its sum over mesh dims "
                           f"{'+'.join(self.dims)}: it is only usable once `mm.gradients` returns")


class Bucketer:
    """The buckets of one `mm.gradients` walk.

    Args:
      leaves: the tensors whose gradients may wait in a bucket, by id.
      limit: bucket size in bytes (> 0).
      ops: the walk's forward ops: each use of a leaf there may give one partial gradient, which
        bounds the gradients and bytes still to come (a bucket's buffer is no bigger than what may
        fill it).
    """

    def __init__(self, leaves: dict, limit: int, ops: list):
        self.leaves, self.limit = leaves, limit
        uses = [t for op in ops for t in op.inputs if id(t) in leaves]
        self.expected = sum(slot_bytes(t.mesh, t.shape, t.tensor_layout, accumulation_dtype(t.dtype)) for t in uses)
        self.uses = len(uses)
        self.open: dict = {}  # (mesh id, mesh dims, dtype) -> _Bucket still filling
        self.started: list = []  # buckets in flight, in start order
        self.scattering: dict = {}  # (mesh id, mesh dim, dtype) -> _Scatter still filling
        self.scatters: list = []  # _Scatter buckets started, in start order
        self.scattered = 0  # how many of them were waited for (the oldest first)

    def __enter__(self) -> "Bucketer":
        active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        active.remove(self)

    def slot(self, mesh, shape, layout, dims: tuple, dtype):
        """Where an einsum writes a gradient (global `shape` laid out by `layout`, local sums in
        `dtype`) that awaits its sum over `dims`: its slot in the buffer of the bucket filling for
        (dims, dtype); a bucket is opened if none is, or if this gradient would overflow it (that
        one is started). None on a dry mesh. `partial` then takes the einsum's result."""
        nbytes = slot_bytes(mesh, shape, layout, dtype)
        key = (id(mesh), dims, str(dtype))
        bucket = self.open.get(key)
        if bucket is not None and not bucket.fits(nbytes):
            self._start(key)
            bucket = None
        if bucket is None:
            capacity = max(nbytes, min(self.limit, self.expected))
            bucket = self.open[key] = _Bucket(mesh, dims, capacity, max(self.uses, 1), dtype)
        self.expected -= nbytes
        self.uses -= 1
        return bucket.reserve(local_sizes(shape, mesh.shape, layout, mesh.coords), nbytes)

    def partial(self, y, dtype=None):
        """`y` (a `PartialTensor`: an einsum's local sums, written into its `slot`, awaiting their sum
        over `y.partial`) as a gradient: recorded as a `"psum"` op, its values arriving at `finish`.
        `dtype` (a 16-bit float, where `y` holds float32 partials of 16-bit inputs): the sum is
        rounded to it once, as an unbucketed einsum rounds its float32 allreduce."""
        dtype, dims = None if dtype is None or dtype == y.dtype else dtype, y.partial
        out = DistTensor(y.mesh, y.shape, y.tensor_layout, Unreduced(y.local, dims, dtype))
        rec = None
        if _open_traces:
            rec = OpRecord(PSUM, (y,), (out,), {"mesh_dims": dims, "dtype": dtype}, y.mesh.layout)
            for tr in _open_traces:
                tr._append(rec)
        key = (id(y.mesh), dims, str(y.dtype))
        bucket = self.open[key]
        bucket.add(out, y.local, rec)
        if bucket.bytes >= bucket.capacity:  # full: nothing more fits
            self._start(key)
        return out

    def scatter(self, y, layout):
        """`y` (a `PartialTensor`: a gathered weight's gradient terms) reduce-scattered into `layout`, the
        weight's, in a bucket of reduce-scatters over the same mesh dim and dtype (`_Scatter`: one
        collective per bucket, started when the next gradient would overflow it or it is full, and waited
        for in `finish`, or sooner: at most `MPIMESH_PREFETCH` + 1 buckets are in flight,
        `overlap.prefetch_depth`). A gradient of `ALONE_BYTES` (1 MiB, DDP's first bucket) or more is
        started alone at once: packing saves a call's latency, small beside its transfer, and would hold
        it whole and start it late. Recorded as the `"psum"` op `to_layout` would run, when its bucket
        starts. None where that sum is not one reduce-scatter: the caller sums it itself."""
        out_layout, params = sum_plan(y, layout)
        if out_layout != tuple(layout) or params["mesh_dims"] or len(params["scatter"]) != 1 or "dtype" in params:
            return None
        ((mesh_dim, axis),) = params["scatter"]
        block = shaped(local_sizes(y.shape, y.mesh.shape, out_layout, y.mesh.coords), y.dtype)
        out = DistTensor(y.mesh, y.shape, out_layout, Unreduced(block, (mesh_dim,)))
        nbytes = slot_bytes(y.mesh, y.shape, y.tensor_layout, y.dtype)  # alike on every rank
        if nbytes >= ALONE_BYTES:
            alone = _Scatter(y.mesh, mesh_dim)
            alone.add(y, out, axis, params, nbytes)
            self._start_scatter(alone)
            return out
        key = (id(y.mesh), mesh_dim, str(y.dtype))
        bucket = self.scattering.get(key)
        if bucket is not None and bucket.bytes + nbytes > self.limit:
            self._start_scatter(self.scattering.pop(key))
            bucket = None
        if bucket is None:
            bucket = self.scattering[key] = _Scatter(y.mesh, mesh_dim)
        bucket.add(y, out, axis, params, nbytes)
        if bucket.bytes >= self.limit:
            self._start_scatter(self.scattering.pop(key))
        return out

    def _start_scatter(self, bucket) -> None:
        if len(self.scatters) - self.scattered > prefetch_depth():  # at most depth + 1 in flight: each
            self._take_scatter()                                     # holds its gradients till done
        bucket.start()
        self.scatters.append(bucket)

    def _start(self, key) -> None:
        bucket = self.open.pop(key)
        bucket.start()
        self.started.append(bucket)

    def poll(self) -> None:
        """Let the transfers in flight progress (MPI moves data only inside its calls)."""
        for bucket in self.started:
            bucket.request.test()
        for bucket in self.scatters[self.scattered:]:
            bucket.request.test()

    def finish(self) -> None:
        """Start the buckets still filling, wait for every one, and hand each gradient its values."""
        for key in list(self.open):
            self._start(key)
        for key in list(self.scattering):
            self._start_scatter(self.scattering.pop(key))
        for bucket in self.started:
            bucket.finish()
        self.started = []
        while self.scattered < len(self.scatters):
            self._take_scatter()
        self.scatters, self.scattered = [], 0

    def _take_scatter(self) -> None:
        """Wait for the oldest bucket of reduce-scatters in flight; its gradients get their blocks."""
        self.scatters[self.scattered].finish()
        self.scatters[self.scattered] = None
        self.scattered += 1


_serials = itertools.count()


class _Bucket:
    """A bucket filling: up to `capacity` bytes of gradients (as `slot_bytes` counts them), at most
    `count` of them, their slots in one flat buffer of its own (none on a dry mesh), summed in
    place by one allreduce. Every rank decides alike what fits, from `slot_bytes` and the slot
    alignment, never from the lengths of its own blocks (which are never longer)."""

    __slots__ = ("mesh", "dims", "capacity", "bytes", "itemsize", "step", "room", "nominal", "flat", "used", "tensors",
                 "partials", "request", "records")

    def __init__(self, mesh, dims: tuple, capacity: int, count: int, dtype):
        self.mesh, self.dims, self.capacity, self.bytes = mesh, dims, capacity, 0
        self.itemsize = np.dtype(dtype).itemsize
        self.step = slot_step(mesh.xp, self.itemsize)
        self.room = next_slot(0, -(-capacity // self.itemsize), self.step) + count * (self.step - 1)  # elements
        self.nominal = self.used = 0  # elements taken, as every rank counts them and in this rank's buffer
        dry = getattr(mesh, "dry", False)  # a dry run: shapes only, the one allreduce counted
        self.flat = None if dry else mesh.collectives.bucket_buffer(self.room, dtype, dims)
        self.tensors, self.partials, self.request, self.records = [], [], None, []

    def fits(self, nbytes: int) -> bool:
        """Whether a gradient of `nbytes` (`slot_bytes`) fits in what is left."""
        end = next_slot(self.nominal, nbytes // self.itemsize, self.step)
        return self.bytes + nbytes <= self.capacity and end <= self.room

    def reserve(self, shape: tuple, nbytes: int):
        """The next slot, a C-contiguous `shape` view of the flat buffer (None on a dry mesh)."""
        self.bytes += nbytes
        self.nominal = next_slot(self.nominal, nbytes // self.itemsize, self.step)
        if self.flat is None:
            return None
        at, n = self.used, math.prod(shape)
        self.used = next_slot(at, n, self.step)
        if self.used > at + n:
            self.flat[at + n:self.used] = 0  # the padding to the next slot: summed, never read
        return self.flat[at:at + n].reshape(shape)

    def add(self, t, local, rec=None) -> None:
        self.tensors.append(t)
        self.partials.append(local)
        if rec is not None:
            self.records.append(rec)

    def start(self) -> None:
        serial = next(_serials)  # the trace's psum records learn their bucket: a replay sums them alike
        for k, rec in enumerate(self.records):
            rec.params["bucket"] = (serial, k, len(self.records))
        self.records = []
        if self.flat is None:
            self.request = count_bucket(self.mesh, self.partials, self.dims)
            return
        used = self.flat[:self.used]
        self.request = self.mesh.collectives.iallreduce(used, self.dims, out=used)  # in place
        self.flat = None  # its gradients' views keep it: it lives as long as one of them

    def finish(self) -> None:
        """Each gradient its summed slot (a view; rounded to its 16-bit dtype, where it has one)."""
        done = self.request.wait() is not None
        for t, p in zip(self.tensors, self.partials):
            dtype = t.local.dtype
            t.local = (p if p.dtype == dtype else p.astype(dtype)) if done else shaped(p.shape, dtype)
        self.tensors, self.partials = [], []


class _Scatter:
    """A bucket of reduce-scatters over mesh dim `dim`: gathered weights' gradients (whole, their terms
    still to sum), each cut along its own axis, packed by destination (`pack_by_destination`) into one
    buffer that one reduce-scatter sums; each gradient's block is then a view of this rank's part. A
    bucket of one gradient reduce-scatters that gradient itself (no copy). Each member is recorded as
    its `"psum"` op when the bucket starts (`params["bucket"]`: `(bucket id, position, members)`,
    where there are several), so a replay packs them alike and the gradients live to there."""

    __slots__ = ("mesh", "dim", "bytes", "members", "request")

    def __init__(self, mesh, dim: str):
        self.mesh, self.dim, self.bytes, self.members, self.request = mesh, dim, 0, [], None

    def add(self, y, out, axis: int, params: dict, nbytes: int) -> None:
        self.members.append((y, out, axis, params))
        self.bytes += nbytes

    def start(self) -> None:
        coll, k = self.mesh.collectives, self.mesh.shape[self.dim].size
        locals_, axes = [m[0].local for m in self.members], [m[2] for m in self.members]
        if len(self.members) == 1:
            self.request = coll.ireduce_scatter(locals_[0], self.dim, axes[0])
        elif getattr(self.mesh, "dry", False):  # shapes only: the one reduce-scatter counted
            sizes = destination_sizes([a.shape for a in locals_], axes, k)
            self.request = coll.ireduce_scatter(shaped((sum(sizes),), locals_[0].dtype), self.dim, 0, sizes=sizes)
        else:
            flat, sizes = pack_by_destination(self.mesh.xp, locals_, axes, k)
            self.request = coll.ireduce_scatter(flat, self.dim, 0, sizes=sizes)
        if _open_traces:  # (after the transfer started: the cost model gives it to the first member)
            serial = next(_serials)
            for j, (y, out, _, params) in enumerate(self.members):
                params = dict(params, bucket=(serial, j, len(self.members))) if len(self.members) > 1 else params
                rec = OpRecord(SUM_PARTIAL, (y,), (out,), params, y.mesh.layout)
                for tr in _open_traces:
                    tr._append(rec)
        self.members = [(None, out, axis, a.shape) for a, (_, out, axis, _) in zip(locals_, self.members)]

    def finish(self) -> None:
        """Each gradient its block (a view of this rank's part of the bucket)."""
        got = self.request.wait()
        if len(self.members) == 1:
            self.members[0][1].local = got
        elif getattr(self.mesh, "dry", False):
            for _, out, _, _ in self.members:
                out.local = shaped(out.local.shape, got.dtype)
        else:
            k, c = self.mesh.shape[self.dim].size, self.mesh.coords[self.dim]
            blocks = unpack_destination(got, [m[3] for m in self.members], [m[2] for m in self.members], k, c)
            for (_, out, _, _), block in zip(self.members, blocks):
                out.local = block
        self.members = []


def destination_sizes(shapes: list, axes: list, k: int) -> tuple:
    """The elements each of k coordinates gets of arrays of `shapes` cut along `axes` (`pack_by_destination`).

    >>> destination_sizes([(4,), (2, 3)], [0, 1], 2)
    (6, 4)
    """
    cuts = [block_sizes(shape[axis], k) for shape, axis in zip(shapes, axes)]
    return tuple(sum(math.prod(shape) // max(shape[axis], 1) * cut[c] for shape, axis, cut in zip(shapes, axes, cuts))
                 for c in range(k))


def pack_by_destination(xp, arrays: list, axes: list, k: int) -> tuple:
    """`arrays` (one dtype), each cut into k blocks along its axis of `axes` (as `numpy.array_split`),
    laid out by destination in one flat buffer: coordinate 0's block of each array in turn, then
    coordinate 1's, and so on; with the elements each coordinate gets. A reduce-scatter of the buffer
    with those lengths leaves coordinate c the sums of its blocks, `unpack_destination`'s input.

    >>> flat, sizes = pack_by_destination(np, [np.arange(4), np.arange(6).reshape(2, 3) + 10], [0, 1], 2)
    >>> flat.tolist(), sizes
    ([0, 1, 10, 11, 13, 14, 2, 3, 12, 15], (6, 4))
    """
    sizes = destination_sizes([a.shape for a in arrays], axes, k)
    cuts = [block_sizes(a.shape[axis], k) for a, axis in zip(arrays, axes)]
    flat = xp.empty(sum(sizes), arrays[0].dtype)
    at = 0
    for c in range(k):
        for a, axis, cut in zip(arrays, axes, cuts):
            lo = sum(cut[:c])
            block = a[(slice(None),) * axis + (slice(lo, lo + cut[c]),)]
            flat[at:at + block.size].reshape(block.shape)[...] = block
            at += block.size
    return flat, sizes


def unpack_destination(part, shapes: list, axes: list, k: int, c: int) -> list:
    """Coordinate c's blocks of arrays of `shapes` cut along `axes` (`pack_by_destination`'s layout), as
    views of `part`, its part of the buffer.

    >>> [b.tolist() for b in unpack_destination(np.array([2, 3, 12, 15]), [(4,), (2, 3)], [0, 1], 2, 1)]
    [[2, 3], [[12], [15]]]
    """
    blocks, at = [], 0
    for shape, axis in zip(shapes, axes):
        shape = tuple(shape[:axis]) + (block_sizes(shape[axis], k)[c],) + tuple(shape[axis + 1:])
        n = math.prod(shape)
        blocks.append(part[at:at + n].reshape(shape))
        at += n
    return blocks


def slot_bytes(mesh, shape, layout, dtype) -> int:
    """A gradient's bytes as a bucket counts them, the same on every rank: those of its largest
    block (each dim's length over the ranks that split it, rounded up), in `dtype`'s words. Uneven
    blocks differ in length from rank to rank; this does not, so every rank cuts the same buckets,
    and no rank's block is longer than its slot.

    >>> from mpimesh.mesh import AbstractMesh
    >>> from mpimesh.shape import Shape
    >>> slot_bytes(AbstractMesh("x:2"), Shape("b:5;h:3"), ("x", None), "float32")  # 3 of the 5 rows
    36
    """
    sizes = [-(-d.size // mesh.shape[m].size) if m else d.size for d, m in zip(shape, layout)]
    return math.prod(sizes) * np.dtype(dtype).itemsize


def slot_step(xp, itemsize: int) -> int:
    """The elements a bucket's slots are aligned to: on a GPU, 256 bytes, where a fresh allocation
    starts (cuBLAS picks its GEMM by the output's alignment: the same GEMM, the same bits; the
    allreduce then also sums the padding, under 256 bytes a gradient); none on numpy.

    >>> slot_step(np, 4)
    1
    """
    return 1 if on_host(xp) else max(256 // itemsize, 1)


def next_slot(at: int, n: int, step: int) -> int:
    """The element where the slot after one of `n` elements at element `at` starts (a multiple of `step`).

    >>> next_slot(0, 3, 64), next_slot(64, 64, 64), next_slot(5, 3, 1)
    (64, 128, 8)
    """
    return -(-(at + n) // step) * step


def _psum_grad(op, dy):
    if dy.dtype == op.inputs[0].dtype:
        return [dy]
    return [cast(dy, op.inputs[0].dtype)]


PSUM = OpDef("psum", sum_kernel, grad=_psum_grad, saves=((), ()), abstract=sum_abstract, bucketed=True,
             partial_inputs=True)
"""A gradient's sum over mesh dims, recorded after the einsum that left it to a bucket (`bucket`:
`(bucket id, position, members)`, which a replay groups into one allreduce)."""
