"""Bucketed, overlapped gradient sums: the "partial" state of a gradient.

In a data-parallel step each rank's gradient of a parameter is a partial sum: it still awaits a sum
over the mesh dims the batch is split over (Mesh-TensorFlow's `LazyAllreduceSum`, DTensor's
`Partial()`). Inside `mm.gradients`, the gradient rule that makes a leaf's gradient (a tensor the
trace did not produce, e.g. a parameter) marks its einsum with `partial_for(leaf)` (`mpimesh.partials`,
below the ops): the einsum then skips its allreduce, and the gradient joins the bucket of gradients that need the same allreduce
(mesh dims, dtype). The einsum writes that gradient straight into its slot of the bucket's flat
buffer (PyTorch DDP's `gradient_as_bucket_view`): nothing is copied in. A bucket that is full, or
that the next gradient would overflow, starts one non-blocking allreduce of the buffer in place
(`Collectives.iallreduce`, `MPI.IN_PLACE`) while the backward pass goes on; `mm.gradients` starts
the rest and waits for every bucket, and each gradient is a view of its slot: nothing is unpacked.
An elementwise sum of a concatenation is the per-tensor sums, so the values are those of
unbucketed reduction (bitwise, where the transport sums each element in an order that does not
depend on the message length, as MPICH's algorithms do).

Ownership: every walk (and every compiled replay) sums into buffers of its own, so a later step
never overwrites the gradients a step returned; a buffer lives as long as any of its gradients.
The transport hands them out (`Collectives.bucket_buffer`): on the host, from a pool that gives a
buffer again only once nothing refers to it (a fresh one would page-fault each step), in shared
memory where the group's ranks share a node, which the transport then sums in place without
messages (`collectives/shm.py`).

Bucket size, in bytes of local gradient blocks: `mm.gradients(..., bucket_bytes=N)`, else
`set_bucket_bytes(N)` or `MPIMESH_BUCKET_BYTES=N`; the default is 25 MiB, PyTorch DDP's
`bucket_cap_mb=25`. 0 turns bucketing off: each gradient is summed on the spot, as before. A bucket
takes gradients while they fit in that size (one bigger than it gets a bucket of its own), counting
each gradient as its largest block (`slot_bytes`), the same on every rank, so that every rank cuts
the same buckets even where uneven blocks differ in length. Its buffer is no bigger than the
gradients still to come may fill: each use of a leaf in the forward ops may give one.

Through a cast: a layer casts its float32 master parameter to the bfloat16 or float16 activation
dtype, so the einsum gives the cast's output's gradient, not the leaf's. `mm.gradients` treats the
outputs of casts and relayouts of a leaf as leaves too, and runs their gradient rules once their
(summed) gradients are in, where the unbucketed walk would have. An einsum of 16-bit inputs adds
float32 partial sums to a float32 bucket (so never a blocking 16-bit allreduce), and its gradient
is rounded to the 16-bit dtype once, after the sum (its one copy): float32 local sums, float32 sum over ranks, one
rounding, then the cast's rule back to float32, the unbucketed path step for step.

In the trace, the einsum is recorded without its allreduce and followed by a `"psum"` op whose
kernel is `ctx.allreduce(a, mesh_dims)` (then the rounding to `dtype`, where it has one): a JAX
replay runs it as `psum`. Its `params["bucket"]` is `(bucket serial, position, members)`: a
compiled step (`mpimesh.compiled`) makes each bucket's buffer afresh, its members' einsums write
their slots, and one non-blocking allreduce sums it in place, as the eager walk did.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> w = mesh.from_numpy(np.array([1.0, 2.0]), "h:2")
>>> x = mesh.ones("b:3;h:2")
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
from .backend import accumulation_dtype, name as backend_name
from .dryrun import count_bucket, shaped
from .errors import MpimeshError
from .layout import local_sizes
from .ops.elementwise import cast
from .partials import active
from .tensor import DistTensor
from .opdef import OpDef
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

    def partial(self, y, dims: tuple, dtype=None):
        """`y` (an einsum's local sums, written into its `slot`, replicated over `dims` in its layout
        but not yet summed there) as a gradient awaiting that sum: recorded as a `"psum"` op, its
        values arriving at `finish`. `dtype` (a 16-bit float, where `y` holds float32 partials of
        16-bit inputs): the sum is rounded to it once, as an unbucketed einsum rounds its float32
        allreduce."""
        dtype = None if dtype is None or dtype == y.dtype else dtype
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

    def _start(self, key) -> None:
        bucket = self.open.pop(key)
        bucket.start()
        self.started.append(bucket)

    def poll(self) -> None:
        """Let the transfers in flight progress (MPI moves data only inside its calls)."""
        for bucket in self.started:
            bucket.request.test()

    def finish(self) -> None:
        """Start the buckets still filling, wait for every one, and hand each gradient its values."""
        for key in list(self.open):
            self._start(key)
        for bucket in self.started:
            bucket.finish()
        self.started = []


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
    return 1 if backend_name(xp) == "numpy" else max(256 // itemsize, 1)


def next_slot(at: int, n: int, step: int) -> int:
    """The element where the slot after one of `n` elements at element `at` starts (a multiple of `step`).

    >>> next_slot(0, 3, 64), next_slot(64, 64, 64), next_slot(5, 3, 1)
    (64, 128, 8)
    """
    return -(-(at + n) // step) * step


def _psum(ctx, a, mesh_dims: tuple, dtype=None, bucket=None):
    total = ctx.allreduce(a, mesh_dims)
    return total if dtype is None else total.astype(dtype)


def _psum_grad(op, dy):
    if dy.dtype == op.inputs[0].dtype:
        return [dy]
    return [cast(dy, op.inputs[0].dtype)]


def _psum_abstract(ctx, shapes, a, mesh_dims: tuple, dtype=None, bucket=None) -> tuple:
    ctx.allreduce(a, mesh_dims)
    return (a.dtype if dtype is None else dtype,)


PSUM = OpDef("psum", _psum, grad=_psum_grad, saves=((), ()), abstract=_psum_abstract, bucketed=True)
"""A gradient's sum over mesh dims, recorded after the einsum that left it to a bucket (`bucket`:
`(bucket id, position, members)`, which a replay groups into one allreduce)."""
