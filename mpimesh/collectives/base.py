"""The interface every transport implements, and what they share.

`Collectives` holds the semantics common to every transport: the short cuts over a mesh dim of
size 1 (nothing sent, nothing counted), the block helpers, and the signatures. A transport
fills in the underscored methods (`_allreduce`, `_allgather`, ...), which are only called when
data must really move. The MPI-based transports (`mpi.py`, `staged.py`, `nccl.py`) and the JAX
twin (`tpu/collectives.py`) derive from it.

>>> import numpy as np
>>> from mpimesh.shape import Shape
>>> c = Collectives(Shape("rows:1;cols:1"), np)
>>> c.allreduce(np.ones(2), ("rows", "cols")), c.block(np.arange(4), "rows", 0)
(array([1., 1.]), array([0, 1, 2, 3]))
"""
from __future__ import annotations

from typing import Protocol, Sequence

from ..layout import block, block_sizes
from ..shape import Shape


class CollectivesLike(Protocol):
    """What an op's `lower(ctx, ...)` may call on `ctx`: every transport and the JAX twin provide it."""

    xp: object
    transport: str

    def coord(self, mesh_dim: str): ...
    def block(self, x, mesh_dim: str, axis: int): ...
    def allreduce(self, x, mesh_dims: Sequence[str], op: str = "sum"): ...
    def allgather(self, x, mesh_dim: str, axis: int): ...
    def alltoall(self, x, mesh_dim: str, split_axis: int, concat_axis: int): ...
    def reduce_scatter(self, x, mesh_dim: str, axis: int, op: str = "sum"): ...
    def permute(self, x, mesh_dim: str, offset: int, wrap: bool = True): ...
    def exscan(self, x, mesh_dim: str, op: str = "sum"): ...
    def any_rank(self, flag: bool) -> bool: ...


class Request:
    """A started transfer that owns its buffers until it completes (Heat's `MPIRequest` shape).

    `test()` says whether it is done without blocking; `wait()` blocks; both run the completion
    step (`then`, e.g. copying a staged buffer back to the GPU) exactly once and return the result.

    >>> r = Request(lambda: True, lambda: None, then=lambda: "done")
    >>> r.test(), r.wait()
    (True, 'done')
    """

    __slots__ = ("_test", "_wait", "_then", "_done", "result")

    def __init__(self, test, wait, then=None):
        self._test, self._wait, self._then = test, wait, then
        self._done, self.result = False, None

    def _complete(self):
        if not self._done:
            self._done = True
            self.result = self._then() if self._then is not None else None
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


class Collectives:
    """Collectives over the named dims of a mesh of shape `mesh_shape`, on arrays of `xp`.

    Every method takes this rank's array and the mesh dims to communicate over and returns the
    result; over ranks that form a group of one nothing is sent and nothing is counted.
    """

    transport = "none"

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
        raise NotImplementedError

    def _allgather(self, x, mesh_dim: str, axis: int):
        raise NotImplementedError

    def _alltoall(self, x, mesh_dim: str, split_axis: int, concat_axis: int):
        raise NotImplementedError

    def _reduce_scatter(self, x, mesh_dim: str, axis: int, op: str):
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
        c = self.coord(mesh_dim)
        lengths = block_sizes(x.shape[axis], k)
        n = lengths[0] if len(set(lengths)) == 1 else lengths[c]  # static even where `c` is traced
        return self._slice(x, axis, block(x.shape[axis], k, c)[0], n)

    def allreduce(self, x, mesh_dims: Sequence[str], op: str = "sum"):
        """Elementwise sum/max/min of `x` over the ranks of `mesh_dims`."""
        dims = self.ordered(mesh_dims)
        if self.size(dims) == 1 or x.size == 0:
            return x
        return self._allreduce(x, dims, op)

    def allgather(self, x, mesh_dim: str, axis: int):
        """Concatenate the ranks' `x` along `axis`, in coordinate order along `mesh_dim`."""
        return x if self._sizes[mesh_dim] == 1 else self._allgather(x, mesh_dim, axis)

    def alltoall(self, x, mesh_dim: str, split_axis: int, concat_axis: int):
        """Split `x` into k blocks along `split_axis`, send block j to coordinate j, and
        concatenate what arrives along `concat_axis` in coordinate order."""
        if self._sizes[mesh_dim] == 1:
            return x
        return self._alltoall(x, mesh_dim, split_axis, concat_axis)

    def reduce_scatter(self, x, mesh_dim: str, axis: int, op: str = "sum"):
        """Reduce `x` over `mesh_dim`; coordinate j keeps block j along `axis`."""
        return x if self._sizes[mesh_dim] == 1 else self._reduce_scatter(x, mesh_dim, axis, op)

    def permute(self, x, mesh_dim: str, offset: int, wrap: bool = True):
        """Send `x` to coordinate c+offset along `mesh_dim` and return what coordinate c-offset
        sent; without `wrap`, ranks with no source get zeros."""
        k = self._sizes[mesh_dim]
        if k == 1 or offset % k == 0 and wrap:
            return x if wrap or offset == 0 else self.xp.zeros_like(x)
        return self._permute(x, mesh_dim, offset, wrap)

    def exscan(self, x, mesh_dim: str, op: str = "sum"):
        """Exclusive prefix reduction over coordinates along `mesh_dim` (zeros on coordinate 0)."""
        if self._sizes[mesh_dim] == 1:
            return self.xp.zeros_like(x)
        return self._exscan(x, mesh_dim, op)


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


def contiguous(xp, x):
    """`x`, or a C-contiguous copy of it."""
    return x if x.flags.c_contiguous else xp.ascontiguousarray(x)
