"""Bucketed, overlapped gradient sums: the "partial" state of a gradient.

A parameter's gradient that still awaits its data-parallel sum (`partials.partial_for`) is written
into its slot of a bucket per (mesh dims, dtype); a full bucket is summed in place by one non-blocking
allreduce while the backward goes on (a `"psum"` op in the trace). Values: unbucketed reduction's.
Size: `set_bucket_bytes` (default 25 MiB; 0: off). More: docs/compile.md.

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
from .layout import local_sizes
from .ops.elementwise import cast
from .ops.relayout import SUM_PARTIAL, sum_abstract, sum_kernel, sum_plan
from .partials import active
from .tensor import DistTensor
from .opdef import OpDef
from .overlap import prefetch_depth
from .trace import OpRecord, _open_traces

DEFAULT_BUCKET_BYTES = 25 << 20


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
        self.scatters: list = []  # (gradient, its reduce-scatter), in start order
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
        weight's, started now and waited for in `finish`, or sooner: at most `MPIMESH_PREFETCH` + 1 are in
        flight (`overlap.prefetch_depth`). Recorded as the `"psum"` op `to_layout` would run. None where
        that sum is not one reduce-scatter (or on a dry mesh): the caller sums it itself."""
        out_layout, params = sum_plan(y, layout)
        if getattr(y.mesh, "dry", False) or out_layout != tuple(layout) or params["mesh_dims"] or \
                len(params["scatter"]) != 1 or "dtype" in params:
            return None
        ((mesh_dim, axis),) = params["scatter"]
        if len(self.scatters) - self.scattered > prefetch_depth():  # at most depth + 1 in flight: each
            self._take_scatter()                                     # holds a whole gradient till done
        request = y.mesh.collectives.ireduce_scatter(y.local, mesh_dim, axis)
        out = DistTensor(y.mesh, y.shape, out_layout, Unreduced(y.local, (mesh_dim,)))
        if _open_traces:
            rec = OpRecord(SUM_PARTIAL, (y,), (out,), params, y.mesh.layout)
            for tr in _open_traces:
                tr._append(rec)
        self.scatters.append((out, request))
        return out

    def _start(self, key) -> None:
        bucket = self.open.pop(key)
        bucket.start()
        self.started.append(bucket)

    def poll(self) -> None:
        """Let the transfers in flight progress (MPI moves data only inside its calls)."""
        for bucket in self.started:
            bucket.request.test()
        for _, request in self.scatters[self.scattered:]:
            request.test()

    def finish(self) -> None:
        """Start the buckets still filling, wait for every one, and hand each gradient its values."""
        for key in list(self.open):
            self._start(key)
        for bucket in self.started:
            bucket.finish()
        self.started = []
        while self.scattered < len(self.scatters):
            self._take_scatter()
        self.scatters, self.scattered = [], 0

    def _take_scatter(self) -> None:
        """Wait for the oldest reduce-scatter in flight; its gradient gets its block."""
        out, request = self.scatters[self.scattered]
        out.local = request.wait()
        self.scatters[self.scattered] = (out, None)
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
