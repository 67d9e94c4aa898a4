"""The interface every transport implements, and what they share.

`Collectives` holds the short cuts over a mesh dim of size 1 (nothing sent, nothing counted), the
block helpers and the signatures; a transport fills in the underscored methods (`_allreduce`, ...),
called only when data must move. Blocks are `numpy.array_split`'s: given the global length `size`,
unequal blocks move exactly their real elements. Every collective takes `out=`, an array the result
is written into and returned. Details: docs/collectives.md.

>>> import numpy as np
>>> from mpimesh.shape import Shape
>>> c, y = Collectives(Shape("rows:1;cols:1"), np), np.zeros(2)
>>> c.allreduce(np.ones(2), ("rows", "cols"), out=y) is y, y, c.block(np.arange(4), "rows", 0)
(True, array([1., 1.]), array([0, 1, 2, 3]))
"""
from __future__ import annotations

import time
from typing import Optional, Protocol, Sequence

import numpy as np

from ..backend import accumulation_dtype, contiguous, is_eager, is_float
from ..errors import MpimeshError
from ..layout import block_sizes, block_span
from ..liveness import held_only_by
from ..shape import Shape
from .. import counters, flight


class CollectivesLike(Protocol):
    """What an op's `lower(ctx, ...)` may call on `ctx`: every transport and the JAX twin provide it."""

    xp: object
    transport: str

    def coord(self, mesh_dim: str): ...
    def span(self, size: int, mesh_dim: Optional[str]) -> tuple: ...
    def real(self, size: int, mesh_dim: Optional[str]): ...
    def block(self, x, mesh_dim: str, axis: int): ...
    def allreduce(self, x, mesh_dims: Sequence[str], op: str = "sum", out=None, dtype=None): ...
    def bucket_buffer(self, n: int, dtype, mesh_dims: Sequence[str]): ...
    def allgather(self, x, mesh_dim: str, axis: int, size: Optional[int] = None, out=None): ...
    def alltoall(self, x, mesh_dim: str, split_axis: int, concat_axis: int, size: Optional[int] = None,
                 out=None): ...
    def reduce_scatter(self, x, mesh_dim: str, axis: int, op: str = "sum", out=None): ...
    def permute(self, x, mesh_dim: str, offset: int, wrap: bool = True, out=None): ...
    def exscan(self, x, mesh_dim: str, op: str = "sum"): ...
    def any_rank(self, flag: bool) -> bool: ...


def ordered_bits(xp, x):
    """IEEE floats' bits as signed integers that sort as the floats do (a negative float's
    magnitude bits flipped), or those integers back to the bits (the map is its own inverse).

    >>> f = np.array([-np.inf, -2.0, -1.0, -0.0, 0.0, 1.0, np.inf, np.nan], np.float32)
    >>> k = ordered_bits(np, f)
    >>> bool(np.all(np.diff(k) > 0)), np.array_equal(ordered_bits(np, k).view(np.float32), f, equal_nan=True)
    (True, True)
    """
    ints = x if np.dtype(x.dtype).kind == "i" else x.view({4: np.int32, 8: np.int64}[np.dtype(x.dtype).itemsize])
    flip = xp.asarray(np.iinfo(ints.dtype).max, ints.dtype)
    return xp.where(ints < 0, ints ^ flip, ints)


class Request:
    """A started transfer that owns its buffers until it completes (Heat's `MPIRequest` shape).

    `test()` says whether it is done without blocking; `wait()` blocks; both run the completion
    step (`then`, e.g. copying a staged buffer back to the GPU) exactly once and return the result.

    >>> r = Request(lambda: True, lambda: None, then=lambda: "done")
    >>> r.test(), r.wait()
    (True, 'done')
    """

    __slots__ = ("_test", "_wait", "_then", "_done", "result", "span")  # span: its timeline event (`mpimesh.flight`)

    def __init__(self, test, wait, then=None):
        self._test, self._wait, self._then = test, wait, then
        self._done, self.result = False, None

    def _complete(self):
        if not self._done:
            self._done = True
            self.result = self._then() if self._then is not None else None
            self._then = None  # (what it held, a send buffer say, may go now)
        return self.result

    def test(self) -> bool:
        """True once the transfer is complete (its completion step has then run)."""
        if self._done or self._test():
            self._complete()
            return True
        return False

    def wait(self):
        """Block until complete; the completion step's result."""
        if not self._done:
            self._wait()
        return self._complete()


DONE = Request(lambda: True, lambda: None)  # a transfer that completed when it was started


def completed(result) -> Request:
    """A request complete when made, whose `wait()` gives `result`."""
    return Request(lambda: True, lambda: None, then=lambda: result)


in_flight: list = []
"""Started transfers that no one waits for yet (a pipeline's, run ahead of its ticks). MPI moves a
message only inside its calls, so `progress` tests them between ops (`trace.dispatch`): a sender
busy computing still hands its activation over, instead of at its next wait."""


def progress() -> None:
    """Test the transfers `in_flight`; those complete leave it.

    >>> r = completed(1); in_flight.append(r); progress(); in_flight
    []
    """
    in_flight[:] = [r for r in in_flight if not r.test()]


class Overlapped(Request):
    """A non-blocking collective's request that, when it completes, adds to the profile's
    `"overlap"`: its lifetime (start to the first `test()` or `wait()` that saw it done), the part
    spent blocked in `wait()` (exposed) and the rest (hidden behind the caller's other work).
    `event`: its timeline event (`flight.begin`'s), moved to the "comm" track and closed on completion.

    >>> from mpimesh import counters
    >>> with counters.counting() as c:
    ...     r = Overlapped(lambda: True, lambda: None, then=lambda: 7)
    ...     r.wait(), c.overlap["requests"], c.overlap["exposed"]
    (7, 1, 0.0)
    """

    __slots__ = ("_t0", "_event")

    def __init__(self, test, wait, then=None, event=None):
        super().__init__(test, wait, then)
        self._t0, self._event = time.perf_counter(), event
        if event is not None:
            event[flight.TRACK] = "comm"

    def _finished(self, exposed: float):
        counters.record_overlap(time.perf_counter() - self._t0, exposed)
        if self._event is not None:
            flight.finish(self._event, exposed)
        return self._complete()

    def test(self) -> bool:
        if not self._done and self._test():
            self._finished(0.0)
        return self._done

    def wait(self):
        if not self._done:
            if self._test():
                self._finished(0.0)
            else:
                t = time.perf_counter()
                self._wait()
                self._finished(time.perf_counter() - t)
        return self.result


class Collectives:
    """Collectives over the named dims of a mesh of shape `mesh_shape`, on arrays of `xp`.

    Every method takes this rank's array and the mesh dims to communicate over and returns the
    result; over ranks that form a group of one nothing is sent and nothing is counted.
    """

    transport = "none"
    fills_out = False  # whether the underscored methods take `out=` (a buffer to receive into, or None)

    def __init__(self, mesh_shape: Shape, xp):
        self.xp = xp
        self._mesh_shape = mesh_shape
        self._sizes = dict(zip(mesh_shape.names, mesh_shape.sizes))

    # What a transport provides ------------------------------------------------------------
    def coord(self, mesh_dim: str):
        """This rank's coordinate along `mesh_dim`."""
        raise NotImplementedError

    def _slice(self, x, axis: int, start, n: int):
        """`x[start:start+n]` along `axis`, as an array this rank owns."""
        raise NotImplementedError

    def _allreduce(self, x, mesh_dims: tuple, op: str):
        """With `fills_out`, each of these also takes `out`: None, `x` itself (allreduce only: in
        place), or a C-contiguous array apart from `x` of the result's shape and dtype."""
        raise NotImplementedError

    def _allgather(self, x, mesh_dim: str, axis: int, sizes: Optional[tuple]):
        """`sizes`: None (equal blocks) or the k unequal block lengths along `axis`."""
        raise NotImplementedError

    def _alltoall(self, x, mesh_dim: str, split_axis: int, concat_axis: int, sizes: Optional[tuple]):
        """`sizes`: None (equal blocks both ways) or `(split block lengths, concat block lengths)`."""
        raise NotImplementedError

    def _reduce_scatter(self, x, mesh_dim: str, axis: int, op: str, sizes: Optional[tuple]):
        """`sizes`: None (equal blocks) or the k unequal block lengths along `axis`."""
        raise NotImplementedError

    def _permute(self, x, mesh_dim: str, offset: int, wrap: bool):
        raise NotImplementedError

    def _exscan(self, x, mesh_dim: str, op: str):
        raise NotImplementedError

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank (for errors only one rank can see)."""
        raise NotImplementedError

    # Shared semantics ------------------------------------------------------------------------
    def size(self, mesh_dims: Sequence[str]) -> int:
        """The number of ranks over `mesh_dims`."""
        n = 1
        for m in mesh_dims:
            n *= self._sizes[m]
        return n

    def ordered(self, mesh_dims: Sequence[str]) -> tuple:
        """`mesh_dims` in mesh order."""
        wanted = set(mesh_dims)
        return tuple(n for n in self._mesh_shape.names if n in wanted)

    def block(self, x, mesh_dim: str, axis: int):
        """This rank's block of `x` along `axis` when that axis is split over `mesh_dim` (no communication)."""
        k = self._sizes[mesh_dim]
        if k == 1:
            return x
        start, n = block_span(x.shape[axis], k, self.coord(mesh_dim))
        return self._slice(x, axis, start, n)

    def span(self, size: int, mesh_dim: Optional[str]) -> tuple:
        """`(start, length)` of this rank's block of a dim of `size` split over `mesh_dim` (None:
        the whole dim): where it starts in the dim, and the length of the array axis that holds it
        (a Python int; the block's own here, the largest block's in a JAX replay, which holds
        blocks padded).

        >>> import numpy as np
        >>> Collectives(Shape("x:1"), np).span(7, "x"), Collectives(Shape("x:1"), np).span(7, None)
        ((0, 7), (0, 7))
        """
        if not mesh_dim or self._sizes[mesh_dim] == 1:
            return 0, size
        return block_span(size, self._sizes[mesh_dim], self.coord(mesh_dim))

    def real(self, size: int, mesh_dim: Optional[str]):
        """None where every position of this rank's held block of a dim of `size` split over
        `mesh_dim` is real (always here: a rank holds its block as it is); a JAX replay holds uneven
        blocks padded, and gives a 1-D boolean array, False in the padding, for kernels whose
        padding would not stay out of a sum (`JaxCollectives.real`).

        >>> import numpy as np
        >>> Collectives(Shape("x:2"), np).real(7, "x") is None
        True
        """
        return None

    def allreduce(self, x, mesh_dims: Sequence[str], op: str = "sum", out=None, dtype=None):
        """Elementwise sum/max/min of `x` over the ranks of `mesh_dims` (`out`: see the module;
        `out=x` reduces in place). `dtype`: a narrower result dtype for wider partials (float32
        partial sums of a bfloat16 einsum): reduced at x's width, rounded once to `dtype`, whose
        words are what the second half of the transfer moves (not with `out`)."""
        dims = self.ordered(mesh_dims)
        if dtype is not None and np.dtype(dtype) != x.dtype:
            if out is not None:
                raise MpimeshError(f"allreduce: give out= or dtype={np.dtype(dtype)}, not both")
            if self.size(dims) == 1:
                return x.astype(dtype)
            return self._allreduce_rounded(x, dims, op, np.dtype(dtype))
        if out is not None:
            self._check_out(out, x, x.shape, "allreduce")
        if self.size(dims) == 1:
            return x if out is None else _copy(out, x)
        if x.dtype == bool:  # MPI has no sum, max or min of bools: as bytes, a sum or max is an or, a min an and
            r = self._allreduce(x.astype(self.xp.uint8), dims, "min" if op == "min" else "max").astype(bool)
            return r if out is None else _copy(out, r)
        if op != "sum" and is_float(x.dtype) and is_eager(self.xp):
            r = self._extreme(x, dims, op)
            return r if out is None else _copy(out, r)
        if out is None:
            return self._allreduce(x, dims, op)
        return self._into(out, x, lambda o: self._allreduce(x, dims, op, **o), in_place=True)

    def _extreme(self, x, dims: tuple, op: str):
        """The max (min) of floats over the ranks of `dims`, NaN where any rank's is, as numpy's:
        MPI's max and min keep or drop a NaN by the order they meet it in, so the ranks would
        disagree. The floats travel as integers in the same order (`ordered_bits`; 16-bit floats as
        float32's: NCCL has no int16), a NaN above every number for max, below for min."""
        xp, dt = self.xp, x.dtype
        y = xp.asarray(x, accumulation_dtype(dt))
        nan = xp.asarray(np.nan if op == "max" else -np.nan, y.dtype)  # (the sign bit of a NaN orders it)
        back = ordered_bits(xp, self._allreduce(ordered_bits(xp, xp.where(xp.isnan(y), nan, y)), dims, op))
        back = back.view(y.dtype)
        return xp.where(xp.isnan(back), xp.asarray(np.nan, y.dtype), back).astype(dt, copy=False)

    def _allreduce_rounded(self, x, dims: tuple, op: str, dtype):
        """`allreduce(x, dims, op, dtype=dtype)` over more than one rank: here the reduction at x's
        width, then the rounding; transports that move the result's narrower words replace it."""
        return self._allreduce(x, dims, op).astype(dtype)

    def iallreduce(self, x, mesh_dims: Sequence[str], op: str = "sum", out=None) -> Request:
        """Start `allreduce(x, mesh_dims, op, out)` without waiting: a `Request` that owns `x` and the
        result buffer, whose `wait()` gives the result (`test()` polls). Counted in the profile as
        the allreduce it is, and, once complete, in its `overlap` (see `Overlapped`). Every rank of
        the group starts its requests in the same order; `x` (and `out`) must not change until completion.
        On the MPI transports an allreduce of 16-bit floats, or one summed through shared memory,
        takes two steps, and the second starts only in a `wait()` or when a later collective starts
        (points every rank reaches in order): its `test()` says False until then. Its requests may be
        waited for in any order, other collectives between the waits or not; bools reduce as bytes
        (an or; min: an and)."""
        dims = self.ordered(mesh_dims)
        if out is not None:
            self._check_out(out, x, x.shape, "iallreduce")
        if self.size(dims) == 1:
            return completed(x if out is None else _copy(out, x))
        if x.dtype == bool:  # as bytes (see `allreduce`)
            r = self._iallreduce(x.astype(self.xp.uint8), dims, "min" if op == "min" else "max")
            return Request(r.test, r.wait, then=lambda: r.result.astype(bool) if out is None
                           else _copy(out, r.result.astype(bool)))
        if out is None or not self.fills_out or not _fits(self.xp, out, x, True):
            return self._iallreduce(x, dims, op) if out is None else _copied(self._iallreduce(x, dims, op), out)
        return self._iallreduce(x, dims, op, out=out)

    def bucket_buffer(self, n: int, dtype, mesh_dims: Sequence[str]):
        """A flat buffer of `n` elements of `dtype` for gradients that an in-place `iallreduce` over
        `mesh_dims` will sum (a transport may hand out memory it sums faster: `mpi.py`).

        >>> import numpy as np
        >>> Collectives(Shape("x:1"), np).bucket_buffer(3, np.float32, ("x",)).shape
        (3,)
        """
        return self.xp.empty(n, dtype)

    def _iallreduce(self, x, dims: tuple, op: str, **out) -> Request:
        """A transport without a non-blocking path: the blocking allreduce, complete when started."""
        return completed(self._allreduce(x, dims, op, **out))

    def iallgather(self, x, mesh_dim: str, axis: int, size: Optional[int] = None) -> Request:
        """Start `allgather(x, mesh_dim, axis, size)` without waiting: a `Request` (as `iallreduce`'s)
        whose `wait()` gives the result. `x` must not change until it completes."""
        k = self._sizes[mesh_dim]
        if k == 1:
            return completed(x)
        return self._iallgather(x, mesh_dim, axis, None if size is None else _unequal(block_sizes(size, k)))

    def _iallgather(self, x, mesh_dim: str, axis: int, sizes) -> Request:
        """A transport without a non-blocking path: the blocking allgather, complete when started."""
        return completed(self._allgather(x, mesh_dim, axis, sizes))

    def ireduce_scatter(self, x, mesh_dim: str, axis: int, op: str = "sum", sizes: Optional[tuple] = None) -> Request:
        """Start `reduce_scatter(x, mesh_dim, axis, op)` without waiting: a `Request` (as `iallreduce`'s)
        whose `wait()` gives this rank's block. `x` must not change until it completes. `sizes`: each
        coordinate's block length along `axis` (None: cut like `numpy.array_split`; a bucket of
        reduce-scatters passes its packed blocks' lengths)."""
        k, n = self._sizes[mesh_dim], x.shape[axis]
        if sizes is not None and (len(sizes) != k or sum(sizes) != n):
            raise MpimeshError(f"reduce_scatter over mesh dim {mesh_dim!r} of size {k}: block lengths {tuple(sizes)} "
                               f"do not cut axis {axis} of length {n}")
        if k == 1 or x.dtype == bool:
            return completed(self.reduce_scatter(x, mesh_dim, axis, op))
        if sizes is None:
            return self._ireduce_scatter(x, mesh_dim, axis, op, None if n % k == 0 else _unequal(block_sizes(n, k)))
        return self._ireduce_scatter(x, mesh_dim, axis, op, _unequal(tuple(sizes)))

    def _ireduce_scatter(self, x, mesh_dim: str, axis: int, op: str, sizes) -> Request:
        """A transport without a non-blocking path: the blocking reduce-scatter, complete when started."""
        return completed(self._reduce_scatter(x, mesh_dim, axis, op, sizes))

    def allgather(self, x, mesh_dim: str, axis: int, size: Optional[int] = None, out=None):
        """Concatenate the ranks' `x` along `axis`, in coordinate order along `mesh_dim`.

        `size`: the length of the result along `axis`, where coordinate c holds block c of
        `block_sizes(size, k)` (None: equal blocks, k * x.shape[axis]). E.g. size 5 over 2 ranks:
        coordinate 0 passes 3 rows, coordinate 1 passes 2, and both get all 5.
        """
        k = self._sizes[mesh_dim]
        if out is not None:
            self._check_out(out, x, _with(x.shape, axis, k * x.shape[axis] if size is None else size), "allgather")
        if k == 1:
            return x if out is None else _copy(out, x)
        sizes = None if size is None else _unequal(block_sizes(size, k))
        if out is None:
            return self._allgather(x, mesh_dim, axis, sizes)
        return self._into(out, x, lambda o: self._allgather(x, mesh_dim, axis, sizes, **o))

    def alltoall(self, x, mesh_dim: str, split_axis: int, concat_axis: int, size: Optional[int] = None, out=None):
        """Cut `x` into k blocks along `split_axis` (like `numpy.array_split`; that axis has the same
        length on every rank), send block j to coordinate j, and concatenate what arrives along
        `concat_axis` in coordinate order.

        `size`: the length of the result along `concat_axis`, where coordinate c's `x` holds block c
        of `block_sizes(size, k)` there (None: equal blocks, k * x.shape[concat_axis]). E.g. over 2
        ranks, x of shape (5, 3) on coordinate 0 and (5, 2) on coordinate 1, split_axis 0,
        concat_axis 1, size 5: coordinate 0 gets rows 0:3 of both, shape (3, 5); coordinate 1 rows 3:5.
        """
        k = self._sizes[mesh_dim]
        if k == 1:
            if out is not None:
                self._check_out(out, x, x.shape, "alltoall")
            return x if out is None else _copy(out, x)
        n, total = x.shape[split_axis], k * x.shape[concat_axis] if size is None else size
        if n % k == 0 and total == k * x.shape[concat_axis]:  # equal blocks both ways (no block lists to make)
            sizes = None
        else:
            splits, concats = block_sizes(n, k), block_sizes(total, k)
            sizes = None if _unequal(splits) is None and _unequal(concats) is None else (splits, concats)
            if sizes is not None and split_axis == concat_axis:
                raise MpimeshError(f"alltoall along one axis needs equal blocks: length {x.shape[split_axis]} "
                                   f"(size {size}) over mesh dim {mesh_dim!r} of size {k}")
        if out is None:
            return self._alltoall(x, mesh_dim, split_axis, concat_axis, sizes)
        shape = x.shape if split_axis == concat_axis else \
            _with(_with(x.shape, split_axis, block_sizes(n, k)[self.coord(mesh_dim)]), concat_axis, total)
        self._check_out(out, x, shape, "alltoall")
        return self._into(out, x, lambda o: self._alltoall(x, mesh_dim, split_axis, concat_axis, sizes, **o))

    def reduce_scatter(self, x, mesh_dim: str, axis: int, op: str = "sum", out=None):
        """Reduce `x` over `mesh_dim`; coordinate j keeps block j along `axis` (cut like
        `numpy.array_split`: 5 rows over 2 ranks leave 3 on coordinate 0, 2 on coordinate 1)."""
        k = self._sizes[mesh_dim]
        if k == 1:
            if out is not None:
                self._check_out(out, x, x.shape, "reduce_scatter")
            return x if out is None else _copy(out, x)
        if x.dtype == bool:  # as bytes (see `allreduce`)
            r = self.reduce_scatter(x.astype(self.xp.uint8), mesh_dim, axis, "min" if op == "min" else "max")
            return r.astype(bool) if out is None else _copy(out, r.astype(bool))
        n = x.shape[axis]
        blocks = (n // k,) * k if n % k == 0 else block_sizes(n, k)
        if out is None:
            return self._reduce_scatter(x, mesh_dim, axis, op, _unequal(blocks))
        self._check_out(out, x, _with(x.shape, axis, blocks[self.coord(mesh_dim)]), "reduce_scatter")
        return self._into(out, x, lambda o: self._reduce_scatter(x, mesh_dim, axis, op, _unequal(blocks), **o))

    def permute(self, x, mesh_dim: str, offset: int, wrap: bool = True, out=None):
        """Send `x` to coordinate c+offset along `mesh_dim` and return what coordinate c-offset
        sent; without `wrap`, ranks with no source get zeros."""
        k = self._sizes[mesh_dim]
        if out is not None:
            self._check_out(out, x, x.shape, "permute")
        if k == 1 or offset % k == 0 and wrap:
            if wrap or offset == 0:
                return x if out is None else _copy(out, x)
            if out is None:
                return self.xp.zeros_like(x)
            out[...] = 0
            return out
        if out is None:
            return self._permute(x, mesh_dim, offset, wrap)
        return self._into(out, x, lambda o: self._permute(x, mesh_dim, offset, wrap, **o))

    def exscan(self, x, mesh_dim: str, op: str = "sum"):
        """Exclusive prefix reduction over coordinates along `mesh_dim` (zeros on coordinate 0)."""
        if self._sizes[mesh_dim] == 1:
            return self.xp.zeros_like(x)
        return self._exscan(x, mesh_dim, op)


    # Output buffers ------------------------------------------------------------------------------
    def _check_out(self, out, x, shape: tuple, kind: str) -> None:
        """Refuse an `out` that is not of the result's `shape` and `x`'s dtype."""
        if tuple(out.shape) != tuple(shape) or out.dtype != x.dtype:
            raise MpimeshError(f"{kind}: out has shape {tuple(out.shape)} and dtype {out.dtype}, but the result "
                               f"has shape {tuple(shape)} and dtype {x.dtype} (input shape {tuple(x.shape)})")

    def _into(self, out, x, run, in_place: bool = False):
        """`run(o)` with `o = {"out": out}` where this transport can receive straight into `out`
        (else `{}`, and the result is copied into `out`); `out`, holding the result."""
        if self.fills_out and _fits(self.xp, out, x, in_place):
            result = run({"out": out})
            return out if result is out else _copy(out, result)
        return _copy(out, run({}))


def idle(items: list, i: int) -> bool:
    """Whether nothing but the list `items` refers to `items[i]` (a pooled buffer that no array
    views any more: every numpy view's `.base` is the array that owns the memory).

    >>> import numpy as np
    >>> bufs = [np.empty(4)]
    >>> view = bufs[0][1:]
    >>> idle(bufs, 0)
    False
    >>> del view
    >>> idle(bufs, 0)
    True
    """
    return held_only_by(items, i)


def _with(shape: tuple, axis: int, n: int) -> tuple:
    """`shape` with length `n` along `axis`."""
    return tuple(shape[:axis]) + (n,) + tuple(shape[axis + 1:])


def _fits(xp, out, x, in_place: bool) -> bool:
    """Whether a transport may receive into `out`: C-contiguous and apart from `x` (or, where
    `in_place`, `x` itself). Host arrays on a GPU mesh are compared by numpy (CuPy's test takes
    device arrays only)."""
    if not out.flags.c_contiguous:
        return False
    if out is x:
        return in_place
    host = isinstance(out, np.ndarray) and isinstance(x, np.ndarray)
    return not (np if host else xp).may_share_memory(out, x)


def _copy(out, result):
    """`result` copied into `out` (nothing to do where they are one); `out`."""
    if result is not out:
        out[...] = result
    return out


def _copied(req: Request, out) -> Request:
    """`req` whose result is copied into `out` when it completes."""
    then = req._then
    req._then = (lambda: _copy(out, then() if then is not None else None))
    return req


def _unequal(sizes: tuple) -> Optional[tuple]:
    """`sizes` if the blocks differ in length, else None (the equal-block path)."""
    return sizes if len(set(sizes)) > 1 else None


def block_counts(shape: Sequence[int], axis: int, sizes: Sequence[int]) -> tuple:
    """Elements in each block of an array of `shape` cut along `axis` into blocks of `sizes`.

    >>> block_counts((4, 9, 2), 1, (3, 3, 2, 1))
    (24, 24, 16, 8)
    """
    inner = 1
    for i, n in enumerate(shape):
        inner *= 1 if i == axis else n
    return tuple(n * inner for n in sizes)


def pack(xp, x, axis: int, sizes: Sequence[int]):
    """`x`'s blocks along `axis` (lengths `sizes`, summing to x.shape[axis]), each C-contiguous,
    one after another in a flat array (a view where x is contiguous and axis is 0).

    >>> import numpy as np
    >>> pack(np, np.arange(6).reshape(2, 3), 1, (2, 1))
    array([0, 1, 3, 4, 2, 5])
    """
    if axis == 0:
        return contiguous(xp, x).reshape(-1)
    out, at, start = xp.empty(x.size, x.dtype), 0, 0
    for n in sizes:
        piece = x[(slice(None),) * axis + (slice(start, start + n),)]
        out[at:at + piece.size].reshape(piece.shape)[...] = piece
        at, start = at + piece.size, start + n
    return out


def unpack(xp, flat, shape: Sequence[int], axis: int, sizes: Sequence[int]):
    """Inverse of `pack`: the blocks in `flat` (block j: `shape` with length `sizes[j]` along
    `axis`) concatenated along `axis` (a view of `flat` when axis is 0).

    >>> import numpy as np
    >>> unpack(np, np.array([0, 1, 3, 4, 2, 5]), (2, 0), 1, (2, 1))
    array([[0, 1, 2],
           [3, 4, 5]])
    """
    shape = tuple(shape)
    if axis == 0:
        return flat.reshape((sum(sizes),) + shape[1:])
    pieces, at = [], 0
    for n, count in zip(sizes, block_counts(shape, axis, sizes)):
        pieces.append(flat[at:at + count].reshape(shape[:axis] + (n,) + shape[axis + 1:]))
        at += count
    return xp.concatenate(pieces, axis)


def split_front(xp, x, axis: int, k: int):
    """x split into k blocks along `axis`, blocks stacked on a new leading axis, contiguous."""
    s = x.shape
    if axis == 0:  # already block-major: a view when x is contiguous
        return contiguous(xp, x).reshape((k, s[0] // k) + s[1:])
    blocks = x.reshape(s[:axis] + (k, s[axis] // k) + s[axis + 1:])
    return contiguous(xp, xp.moveaxis(blocks, axis, 0))


def merge_front(xp, y, axis: int):
    """Inverse of `split_front`: merge the leading block axis into `axis` (block-major)."""
    k, s = y.shape[0], y.shape[1:]
    if axis == 0:
        return y.reshape((k * s[0],) + s[1:])
    return xp.moveaxis(y, 0, axis).reshape(s[:axis] + (k * s[axis],) + s[axis + 1:])
