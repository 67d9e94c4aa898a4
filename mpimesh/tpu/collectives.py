"""The JAX twin of the MPI transport: the same calls over mesh dims, as named-axis collectives of
`jax.lax` (psum, all_gather, all_to_all, psum_scatter, ppermute), for an op's `lower(ctx, ...)` run
inside `shard_map` (or `vmap`). The short cuts over a mesh dim of size 1 and `block` come from
`collectives.base.Collectives`. Unequal blocks are padded with zeros to the largest (static
shapes) around each equal-block collective. The call-by-call table: docs/collectives.md.

>>> import jax, jax.numpy as jnp
>>> ctx = JaxCollectives(Shape("all:2"), vmapped=True)
>>> x = jnp.arange(4.0).reshape(2, 2)  # row i is device i's block
>>> jax.vmap(lambda b: ctx.allreduce(b, ["all"]), axis_name="all")(x).tolist()
[[2.0, 4.0], [2.0, 4.0]]
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..backend import accumulation_dtype, is_low_precision
from ..collectives.base import Collectives
from ..errors import MpimeshError
from ..layout import block, block_sizes
from ..shape import Shape


class JaxCollectives(Collectives):
    """`ctx` for replaying op kernels with `jax.numpy` on the named axes of a JAX mesh.

    Args:
      mesh_shape: the mpimesh mesh shape (axis names and sizes).
      vmapped: the kernels run under nested `jax.vmap(axis_name=...)` instead of `shard_map`;
        `ppermute` there needs a full permutation, so a non-wrapping permute sends cyclically and
        masks what arrived from beyond the edge.
    """

    transport = "jax"

    def __init__(self, mesh_shape: Shape, vmapped: bool = False):
        import jax.numpy as jnp
        from jax import lax
        super().__init__(mesh_shape, jnp)
        self._lax = lax
        self._vmapped = vmapped

    def coord(self, mesh_dim: str):
        """This device's coordinate along `mesh_dim` (a traced int32; 0 on a dim of size 1)."""
        return 0 if self._sizes[mesh_dim] == 1 else self._lax.axis_index(mesh_dim)

    def _slice(self, x, axis: int, start, n: int):
        return self._lax.dynamic_slice_in_dim(x, start, n, axis)

    def span(self, size: int, mesh_dim):
        """`(start, length)` of this device's block of a dim of `size` split over `mesh_dim`: the
        start traced, the length the largest block's (every block is held padded to it). Past the
        block's end the positions run on into the next block (or past `size`): a kernel computes
        there what the padding then drops.

        >>> import jax, jax.numpy as jnp
        >>> ctx = JaxCollectives(Shape("x:3"), vmapped=True)
        >>> jax.vmap(lambda _: jnp.array(ctx.span(7, "x")), axis_name="x")(jnp.zeros(3)).tolist()
        [[0, 3], [3, 3], [5, 3]]
        """
        if not mesh_dim or self._sizes[mesh_dim] == 1:
            return 0, size
        k = self._sizes[mesh_dim]
        return block(size, k, self.coord(mesh_dim))[0], -(-size // k)

    def block(self, x, mesh_dim: str, axis: int):
        """This device's block of `x` along `axis`; an unequal one zero-padded to the largest."""
        sizes = block_sizes(x.shape[axis], self._sizes[mesh_dim])
        if len(set(sizes)) == 1:
            return super().block(x, mesh_dim, axis)
        return self.xp.take(pad_blocks(self.xp, x, axis, sizes), self.coord(mesh_dim) * max(sizes)
                            + self.xp.arange(max(sizes)), axis=axis)

    def real(self, size: int, mesh_dim):
        """None where the blocks of a dim of `size` split over `mesh_dim` are equal (no padding),
        else this device's held block's positions that are real: a traced boolean array.

        >>> import jax, jax.numpy as jnp
        >>> ctx = JaxCollectives(Shape("x:3"), vmapped=True)
        >>> jax.vmap(lambda _: ctx.real(7, "x"), axis_name="x")(jnp.zeros(3)).tolist()
        [[True, True, True], [True, True, False], [True, True, False]]
        """
        if not mesh_dim or self._sizes[mesh_dim] == 1 or size % self._sizes[mesh_dim] == 0:
            return None
        k = self._sizes[mesh_dim]
        start, stop = block(size, k, self.coord(mesh_dim))
        return self.xp.arange(-(-size // k)) < stop - start

    def fill_padding(self, x, axis: int, mesh_dim: str, sizes: tuple, fill):
        """`x` (this device's block along `axis`, padded to the largest of `sizes`) with `fill` in
        the padding (a select: nan or inf there never spreads)."""
        n = self.xp.asarray(sizes)[self.coord(mesh_dim)]
        valid = (self.xp.arange(x.shape[axis]) < n).reshape((-1,) + (1,) * (x.ndim - axis - 1))
        return self.xp.where(valid, x, self.xp.asarray(fill, x.dtype))

    def _check_padded(self, x, axis: int, sizes: tuple, what: str):
        """MpimeshError (at trace time) unless `axis` has the largest block's length."""
        if x.shape[axis] != max(sizes):
            raise MpimeshError(f"{what}: axis {axis} of a device's block has length {x.shape[axis]}, but "
                               f"blocks {sizes} are held padded to the largest, {max(sizes)}")

    def _allreduce(self, x, mesh_dims: Sequence[str], op: str):
        dims = tuple(m for m in mesh_dims if self._sizes[m] > 1)
        fn = {"sum": self._lax.psum, "max": self._lax.pmax, "min": self._lax.pmin}[op]
        if op == "sum" and dims and is_low_precision(x.dtype):  # summed in float32, rounded once, as on MPI
            return fn(x.astype(accumulation_dtype(x.dtype)), dims).astype(x.dtype)
        return fn(x, dims)

    def _allgather(self, x, mesh_dim: str, axis: int, sizes):
        if sizes is not None:
            self._check_padded(x, axis, sizes, "allgather")
        elif x.shape[axis] == 0:  # every block empty (XLA refuses to gather along an empty axis)
            return x
        y = self._lax.all_gather(x, mesh_dim, axis=axis, tiled=True)
        return y if sizes is None else unpad_blocks(self.xp, y, axis, sizes)

    def _alltoall(self, x, mesh_dim: str, split_axis: int, concat_axis: int, sizes):
        if sizes is None:
            return self._lax.all_to_all(x, mesh_dim, split_axis, concat_axis, tiled=True)
        splits, concats = sizes
        self._check_padded(x, concat_axis, concats, "alltoall")
        y = pad_blocks(self.xp, x, split_axis, splits)
        y = self._lax.all_to_all(y, mesh_dim, split_axis, concat_axis, tiled=True)
        return unpad_blocks(self.xp, y, concat_axis, concats)

    def _reduce_scatter(self, x, mesh_dim: str, axis: int, op: str, sizes):
        if op != "sum":
            return self.block(self.allreduce(x, (mesh_dim,), op), mesh_dim, axis)
        if sizes is None and x.shape[axis] == 0:  # every block empty (XLA refuses to scatter along it)
            return x
        x = x if sizes is None else pad_blocks(self.xp, x, axis, sizes)
        return self._lax.psum_scatter(x, mesh_dim, scatter_dimension=axis, tiled=True)

    def _permute(self, x, mesh_dim: str, offset: int, wrap: bool):
        k = self._sizes[mesh_dim]
        if x.size == 0:
            return x
        if wrap:
            return self._lax.ppermute(x, mesh_dim, [(c, (c + offset) % k) for c in range(k)])
        pairs = [(c, c + offset) for c in range(k) if 0 <= c + offset < k]
        if not pairs:
            return self.xp.zeros_like(x)
        if not self._vmapped:
            return self._lax.ppermute(x, mesh_dim, pairs)
        y = self._lax.ppermute(x, mesh_dim, [(c, (c + offset) % k) for c in range(k)])
        src = self.coord(mesh_dim) - offset
        return self.xp.where((src >= 0) & (src < k), y, self.xp.zeros_like(y))

    def _exscan(self, x, mesh_dim: str, op: str):
        xp, k = self.xp, self._sizes[mesh_dim]
        every = self._lax.all_gather(x, mesh_dim, axis=0, tiled=False)  # (k,) + x.shape
        c = self.coord(mesh_dim)
        before = (xp.arange(k) < c).reshape((k,) + (1,) * x.ndim)
        if op == "sum":
            return xp.sum(xp.where(before, every, xp.zeros_like(every)), axis=0, dtype=x.dtype)
        if op == "max":
            fill, reduce = _lowest(xp, x.dtype), xp.max
        else:
            fill, reduce = _highest(xp, x.dtype), xp.min
        out = reduce(xp.where(before, every, xp.full_like(every, fill)), axis=0)
        return xp.where(c == 0, xp.zeros_like(out), out)

    def any_rank(self, flag: bool) -> bool:
        """`flag` (checks that need it run on shapes alone, which every device shares)."""
        return bool(flag)


def pad_blocks(xp, x, axis: int, sizes: tuple):
    """`x` with each block along `axis` (lengths `sizes`) zero-padded to the largest (a static gather;
    `x` itself where the blocks are equal).

    >>> import jax.numpy as jnp
    >>> pad_blocks(jnp, jnp.arange(1, 6), 0, (3, 2)).tolist()
    [1, 2, 3, 4, 5, 0]
    """
    if len(set(sizes)) == 1:
        return x
    width, starts = max(sizes), np.cumsum((0,) + sizes[:-1])
    rows = np.arange(width)
    index = np.concatenate([np.where(rows < n, start + rows, sum(sizes)) for start, n in zip(starts, sizes)])
    zero = xp.zeros(x.shape[:axis] + (1,) + x.shape[axis + 1:], x.dtype)
    return xp.take(xp.concatenate([x, zero], axis), index, axis=axis)


def unpad_blocks(xp, y, axis: int, sizes: tuple):
    """The real rows of `y`, whose blocks along `axis` are padded to the largest of `sizes` (a static
    gather; `y` itself where the blocks are equal).

    >>> import jax.numpy as jnp
    >>> unpad_blocks(jnp, jnp.array([1, 2, 3, 4, 5, 0]), 0, (3, 2)).tolist()
    [1, 2, 3, 4, 5]
    """
    if len(set(sizes)) == 1:
        return y
    width = max(sizes)
    return xp.take(y, np.concatenate([c * width + np.arange(n) for c, n in enumerate(sizes)]), axis=axis)


def _lowest(xp, dtype):
    return -xp.inf if xp.issubdtype(dtype, xp.floating) else xp.iinfo(dtype).min


def _highest(xp, dtype):
    return xp.inf if xp.issubdtype(dtype, xp.floating) else xp.iinfo(dtype).max
