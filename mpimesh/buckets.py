"""Bucketed, overlapped gradient sums: the "partial" state of a gradient.

In a data-parallel step each rank's gradient of a parameter is a partial sum: it still awaits a sum
over the mesh dims the batch is split over (Mesh-TensorFlow's `LazyAllreduceSum`, DTensor's
`Partial()`). Inside `mm.gradients`, the gradient rule that makes a leaf's gradient (a tensor the
trace did not produce, e.g. a parameter) marks its einsum with `partial_for(leaf)` (`mpimesh.partials`,
below the ops): the einsum then skips its allreduce, and the gradient joins the bucket of gradients that need the same allreduce
(mesh dims, dtype). A bucket that reaches the bucket size starts one non-blocking allreduce of its
flattened concatenation (`Collectives.iallreduce`) while the backward pass goes on; `mm.gradients`
starts the rest, waits for every bucket and unpacks. An elementwise sum of a concatenation is the
per-tensor sums, so the values are those of unbucketed reduction (bitwise, where the transport sums
each element in an order that does not depend on the message length, as MPICH's algorithms do).

Bucket size, in bytes of local gradient blocks: `mm.gradients(..., bucket_bytes=N)`, else
`set_bucket_bytes(N)` or `MPIMESH_BUCKET_BYTES=N`; the default is 25 MiB, PyTorch DDP's
`bucket_cap_mb=25`. 0 turns bucketing off: each gradient is summed on the spot, as before. A bucket's
fill counts each gradient as its global bytes over the ranks that split it, the same on every rank,
so that every rank cuts the same buckets even where uneven blocks differ in length.

Through a cast: a layer casts its float32 master parameter to the bfloat16 or float16 activation
dtype, so the einsum gives the cast's output's gradient, not the leaf's. `mm.gradients` treats the
outputs of casts and relayouts of a leaf as leaves too, and runs their gradient rules once their
(summed) gradients are in, where the unbucketed walk would have. An einsum of 16-bit inputs adds
float32 partial sums to a float32 bucket (so never a blocking 16-bit allreduce), and its gradient
is rounded to the 16-bit dtype once, at unpacking: float32 local sums, float32 sum over ranks, one
rounding, then the cast's rule back to float32, the unbucketed path step for step.

In the trace, the einsum is recorded without its allreduce and followed by a `"psum"` op whose
kernel is `ctx.allreduce(a, mesh_dims)` (then the rounding to `dtype`, where it has one): a JAX
replay runs it as `psum`. Its `params["bucket"]` is `(bucket serial, position, members)`: a
compiled step (`mpimesh.compiled`) sums each bucket's members in one non-blocking allreduce, as
the eager walk did.

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
import os

from .dryrun import count_bucket, shaped
from .errors import MpimeshError
from .ops.elementwise import cast
from .partials import active
from .tensor import DistTensor
from .trace import OpRecord, _open_traces, saving

DEFAULT_BUCKET_BYTES = 25 << 20


def _checked(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise MpimeshError(f"bucket size must be a whole number of bytes >= 0 (0: no buckets), got {n!r}")
    return n


def _env_bytes() -> int:
    raw = os.environ.get("MPIMESH_BUCKET_BYTES", "").strip()
    if not raw:
        return DEFAULT_BUCKET_BYTES
    try:
        return _checked(int(raw))
    except ValueError:
        raise MpimeshError(f"MPIMESH_BUCKET_BYTES={raw!r} is not a whole number of bytes") from None


_settings = {"bytes": _env_bytes()}


def set_bucket_bytes(n: int) -> None:
    """Gradient bucket size in bytes for `mm.gradients` (default 25 MiB; 0: each gradient summed on
    the spot, no buckets). Call it on every rank alike."""
    _settings["bytes"] = _checked(n)


def bucket_bytes() -> int:
    """The gradient bucket size in force, bytes."""
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
      leaves: ids of the tensors whose gradients may wait in a bucket.
      limit: bucket size in bytes (> 0).
    """

    def __init__(self, leaves: set, limit: int):
        self.leaves, self.limit = leaves, limit
        self.open: dict = {}  # (mesh id, mesh dims, dtype) -> _Bucket still filling
        self.started: list = []  # buckets in flight, in start order

    def __enter__(self) -> "Bucketer":
        active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        active.remove(self)

    def partial(self, y, dims: tuple, dtype=None):
        """`y` (an einsum's local sums, replicated over `dims` in its layout but not yet summed there)
        as a gradient awaiting that sum: recorded as a `"psum"` op, its values arriving at `finish`.
        `dtype` (a 16-bit float, where `y` holds float32 partials of 16-bit inputs): the sum is
        rounded to it once, as an unbucketed einsum rounds its float32 allreduce."""
        dtype = None if dtype is None or dtype == y.dtype else dtype
        out = DistTensor(y.mesh, y.shape, y.tensor_layout, Unreduced(y.local, dims, dtype))
        rec = None
        if _open_traces:
            params = {"mesh_dims": dims} if dtype is None else {"mesh_dims": dims, "dtype": dtype}
            rec = OpRecord("psum", (y,), (out,), params, _psum_kernel(dims, dtype), _psum_grad, y.mesh.layout)
            for tr in _open_traces:
                tr._append(rec)
        key = (id(y.mesh), dims, str(y.dtype))
        bucket = self.open.get(key)
        if bucket is None:
            bucket = self.open[key] = _Bucket(y.mesh, dims)
        bucket.add(out, y.local, _nominal_bytes(y), rec)
        if bucket.bytes >= self.limit:
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
    __slots__ = ("mesh", "dims", "tensors", "arrays", "bytes", "request", "records")

    def __init__(self, mesh, dims: tuple):
        self.mesh, self.dims = mesh, dims
        self.tensors, self.arrays, self.bytes, self.request, self.records = [], [], 0, None, []

    def add(self, t, local, nbytes: int, rec=None) -> None:
        self.tensors.append(t)
        self.arrays.append(local)
        self.bytes += nbytes
        if rec is not None:
            self.records.append(rec)

    def start(self) -> None:
        serial = next(_serials)  # the trace's psum records learn their bucket: a replay sums them alike
        for k, rec in enumerate(self.records):
            rec.params["bucket"] = (serial, k, len(self.records))
        self.records = []
        if getattr(self.mesh, "dry", False):  # a dry run: count the one allreduce, values never come
            self.request = count_bucket(self.mesh, self.arrays, self.dims)
            self.arrays = []
            return
        self.request = start_sum(self.mesh, self.arrays, self.dims)
        self.arrays = []  # the request owns their concatenation now: the partial sums can go

    def finish(self) -> None:
        total = self.request.wait()
        shapes = [t.local.shape for t in self.tensors]
        dtypes = [t.local.dtype for t in self.tensors]
        if total is None:  # a dry run's bucket: shapes and dtypes only
            blocks = [shaped(s, d) for s, d in zip(shapes, dtypes)]
        else:
            blocks = split_sum(total, shapes, dtypes)
        for t, block in zip(self.tensors, blocks):
            t.local = block
        self.tensors = []


def start_sum(mesh, arrays: list, dims: tuple):
    """One non-blocking allreduce over `dims` of the arrays' flat concatenation, reduced in place in
    it (the bucket's own buffer; a single array is not written): its `Request`."""
    flat = [a.reshape(-1) for a in arrays]
    send = flat[0] if len(flat) == 1 else mesh.xp.concatenate(flat)
    return mesh.collectives.iallreduce(send, dims, out=send if len(flat) > 1 else None)


def split_sum(total, shapes: list, dtypes: list) -> list:
    """The summed concatenation `total` cut back into blocks of `shapes`, each in its dtype."""
    blocks, at = [], 0
    for shape, dtype in zip(shapes, dtypes):
        n = math.prod(shape)
        block = total[at:at + n].reshape(shape)
        blocks.append(block if block.dtype == dtype else block.astype(dtype))
        at += n
    return blocks


def _nominal_bytes(t) -> int:
    """`t`'s bytes over the ranks that split it, rounded up: the same on every rank."""
    split = math.prod(t.mesh.shape[m].size for m in t.tensor_layout if m)
    return -(-math.prod(t.shape.sizes) // split) * t.local.dtype.itemsize


def _psum_kernel(dims: tuple, dtype=None):
    def lower(ctx, a):
        total = ctx.allreduce(a, dims)
        return total if dtype is None else total.astype(dtype)
    return lower


def _psum_grad(op, dy):
    if dy.dtype == op.inputs[0].dtype:
        return [dy]
    return [cast(dy, op.inputs[0].dtype)]


saving(_psum_grad)
