"""Shift and halo exchange along a dim that may be split over a mesh dim, both built on a *window*:
the rank at coordinate c gathers the global range `windows[c] = (start, length)` of the dim (its own
block moved or widened; blocks as `numpy.array_split`'s, unequal, possibly empty). The own piece is a
local slice, every other piece one point-to-point permute of a boundary strip (`window_routes`), and
indices outside the dim are zeros (or wrap around). The transpose sends each piece back to its
owner, which adds it in: the gradient of every windowed op (shift, halo exchange, convolution).

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.arange(5.0), "a:5")
>>> [mm.shift(x, 2, "a", wrap=False).to_numpy().tolist(), mm.shift(x, -1, "a", wrap=True).to_numpy().tolist()]
[[0.0, 0.0, 0.0, 1.0, 2.0], [1.0, 2.0, 3.0, 4.0, 0.0]]
>>> mm.halo_exchange(x, "a", 1).to_numpy().tolist()
[0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 0.0]
"""
from __future__ import annotations

import numbers
from functools import lru_cache
from typing import NamedTuple, Optional, Union

import numpy as np

from ..errors import MpimeshError, ShapeError
from ..layout import block, block_sizes, splitting
from ..opdef import Aval, OpDef
from ..shape import Dimension, Shape
from ..trace import dispatch
from .relayout import to_layout


class Route(NamedTuple):
    """The pieces that come from `p` coordinates away (coordinate c's from c+p)."""
    p: int
    width: int    # the widest piece: the permute's length along the axis on every rank
    recv: tuple   # per coordinate c: (lo, hi, pos) = block c+p's local range [lo, hi), at pos in c's window; or None
    send: tuple   # per coordinate s: (lo, hi) of its block that coordinate s-p needs; or None


def uniform(size: int, k: int, windows: tuple) -> bool:
    """True when the blocks are equal and every window sits alike relative to its block: every
    rank then moves the same pieces, and no route needs the coordinate."""
    sizes = block_sizes(size, k)
    return (len(set(sizes)) == 1
            and all(w == (windows[0][0] + c * sizes[0], windows[0][1]) for c, w in enumerate(windows)))


@lru_cache(maxsize=4096)
def window_routes(size: int, k: int, windows: tuple, wrap: bool) -> tuple:
    """The `Route`s, by increasing p, that bring coordinate c the global range `windows[c]` of a
    dim of `size` cut into k blocks. Pieces beyond the dim's ends (without `wrap`) have no route; a
    piece several blocks away is a permute by several coordinates. A permute moves the same shape on
    every rank, so a strip shorter than the widest at its offset travels zero-padded to that width;
    with equal blocks and windows alike relative to each (`uniform`) there is no padding and no route
    needs the coordinate (so a JAX replay can trace it).

    >>> for r in window_routes(7, 3, ((-1, 5), (2, 4), (4, 4)), False):  # a halo of 1 over blocks (3, 2, 2)
    ...     print(r.p, r.width, r.recv)
    -1 1 (None, (2, 3, 0), (1, 2, 0))
    0 3 ((0, 3, 1), (0, 2, 1), (0, 2, 1))
    1 1 ((0, 1, 4), (0, 1, 3), None)
    """
    bounds = [block(size, k, j) for j in range(k)]
    by_p: dict = {}
    for c, (start, length) in enumerate(windows):
        if size == 0 or length <= 0:
            continue
        periods = range(start // size, (start + length - 1) // size + 1) if wrap else (0,)
        for q in periods:
            for j, (b0, b1) in enumerate(bounds):
                lo, hi = max(start, q * size + b0), min(start + length, q * size + b1)
                if hi > lo:
                    by_p.setdefault(q * k + j - c, {})[c] = (lo - q * size - b0, hi - q * size - b0, lo - start)
    routes = []
    for p in sorted(by_p):
        recv = by_p[p]
        send = {(c + p) % k: (lo, hi) for c, (lo, hi, _) in recv.items()}
        routes.append(Route(p, max(hi - lo for lo, hi, _ in recv.values()),
                            tuple(recv.get(c) for c in range(k)), tuple(send.get(s) for s in range(k))))
    return tuple(routes)


def traced(ctx, mesh_dim: Optional[str]) -> bool:
    """True when this rank's coordinate along `mesh_dim` is a traced value (a JAX replay), not a number."""
    return mesh_dim is not None and not isinstance(ctx.coord(mesh_dim), numbers.Integral)


def coordinate(ctx, mesh_dim: Optional[str], what: str) -> int:
    """This rank's coordinate along `mesh_dim` as an int (0 when unsplit), for routes that
    differ by rank; a traced coordinate (a JAX replay of unequal blocks) raises MpimeshError."""
    c = ctx.coord(mesh_dim) if mesh_dim is not None else 0
    if not isinstance(c, numbers.Integral):
        raise MpimeshError(f"{what}: blocks of unequal length along mesh dim {mesh_dim!r} need this rank's "
                           f"coordinate as a number; a traced replay supports equal blocks only")
    return int(c)


def _mine(entries: tuple, c: Optional[int]):
    """Coordinate c's entry; with c None (uniform routes), the entry every coordinate that has one shares."""
    if c is not None:
        return entries[c]
    return next(e for e in entries if e is not None)


def _cut(a, axis: int, lo: int, hi: int):
    return a[(slice(None),) * axis + (slice(lo, hi),)]


def _zeros(xp, like, axis: int, size: int):
    shape = like.shape[:axis] + (size,) + like.shape[axis + 1:]
    return xp.zeros(shape, dtype=like.dtype)


def _strip(xp, a, axis: int, piece, width: int):
    """`a[lo:hi]` along `axis` (nothing when `piece` is None), zero-padded to `width`."""
    seg = _zeros(xp, a, axis, 0) if piece is None else _cut(a, axis, piece[0], piece[1])
    short = width - seg.shape[axis]
    return xp.concatenate([seg, _zeros(xp, a, axis, short)], axis) if short else seg


def _local(route: Route, k: int, mesh_dim: Optional[str], wrap: bool) -> bool:
    """True when the route's pieces come from this rank itself."""
    return mesh_dim is None or route.p == 0 or (wrap and route.p % k == 0)


@lru_cache(maxsize=1024)
def window_index(size: int, windows: tuple, wrap: bool) -> np.ndarray:
    """`[k, longest window]`: the global index of each coordinate's window position; `size` (a zero
    appended to the dim) beyond the dim's ends (without `wrap`) and past the window's own length.

    >>> window_index(3, ((-1, 3), (1, 2)), False).tolist()
    [[3, 0, 1], [1, 2, 3]]
    """
    idx = np.full((len(windows), max(n for _, n in windows)), size, np.int64)
    for c, (start, n) in enumerate(windows):
        pos = start + np.arange(n)
        pos = pos % size if wrap and size else pos
        idx[c, :n] = np.where((pos >= 0) & (pos < size), pos, size)
    idx.setflags(write=False)
    return idx


@lru_cache(maxsize=1024)
def window_sources(size: int, windows: tuple, wrap: bool) -> np.ndarray:
    """`[k, size, m]`, the transpose of `window_index`: for coordinate c and global index i, the
    positions of c's window holding i (a window longer than a wrapped dim holds i several times),
    padded with the longest window's length (a zero appended to the window).

    >>> window_sources(3, ((-1, 3), (1, 2)), False)[:, :, 0].tolist()
    [[1, 2, 3], [3, 0, 1]]
    """
    idx = window_index(size, windows, wrap)
    k, width = idx.shape
    hits = [[np.flatnonzero(idx[c] == i) for i in range(size)] for c in range(k)]
    m = max([1] + [len(h) for row in hits for h in row])
    src = np.full((k, size, m), width, np.int64)
    for c, row in enumerate(hits):
        for i, h in enumerate(row):
            src[c, i, :len(h)] = h
    src.setflags(write=False)
    return src


def _gather_whole(ctx, a, axis: int, mesh_dim: str, size: int, windows: tuple, wrap: bool):
    """`gather_window` with a traced coordinate (a JAX replay of unequal blocks; `a` is the block
    padded to the largest): the whole dim allgathered, then this coordinate's window of
    `window_index`, zero-padded to the longest window.

    A JAX replay (`mm.tpu.replay`) cannot route by coordinate there: the coordinate is traced and
    every device's array has one static shape. This moves the whole dim where MPI moves boundary
    strips, but gives MPI's values; MPI and equal blocks keep the minimal exchange."""
    xp = ctx.xp
    whole = ctx.allgather(a, mesh_dim, axis, size)
    whole = xp.concatenate([whole, _zeros(xp, whole, axis, 1)], axis)
    return xp.take(whole, xp.asarray(window_index(size, windows, wrap))[ctx.coord(mesh_dim)], axis=axis)


def _scatter_whole(ctx, g, axis: int, mesh_dim: str, size: int, windows: tuple, wrap: bool):
    """Transpose of `_gather_whole`: this coordinate's window `g` (zero-padded to the longest)
    added into the whole dim, reduce-scattered: each device gets its block padded to the largest."""
    xp, src = ctx.xp, window_sources(size, windows, wrap)
    g = xp.concatenate([g, _zeros(xp, g, axis, 1)], axis)
    mine = xp.asarray(src)[ctx.coord(mesh_dim)]
    whole = None
    for j in range(src.shape[2]):
        part = xp.take(g, mine[:, j], axis=axis)
        whole = part if whole is None else whole + part
    return ctx.reduce_scatter(whole, mesh_dim, axis)


def gather_window(ctx, a, axis: int, mesh_dim: Optional[str], size: int, windows: tuple, wrap: bool = False):
    """The window `windows[c]` (global `(start, length)`) along `axis` of the dim of `size` whose
    local block is `a`, split over `mesh_dim` into `len(windows)` blocks (None: unsplit), by
    permutes of boundary strips (with a traced coordinate and windows unlike, from the allgathered
    dim: see the module docs)."""
    xp, k = ctx.xp, len(windows)
    if not uniform(size, k, windows) and traced(ctx, mesh_dim):
        return _gather_whole(ctx, a, axis, mesh_dim, size, windows, wrap)
    c = None if uniform(size, k, windows) else coordinate(ctx, mesh_dim, "window")
    length = _mine(windows, c)[1]
    parts, filled = [], 0
    for r in window_routes(size, k, windows, wrap):
        piece = _mine(r.recv, c)
        if _local(r, k, mesh_dim, wrap):
            if piece is None:
                continue
            seg = _cut(a, axis, piece[0], piece[1])
        else:
            seg = ctx.permute(_strip(xp, a, axis, _mine(r.send, c), r.width), mesh_dim, -r.p, wrap)
            if piece is None:
                continue
            seg = _cut(seg, axis, 0, piece[1] - piece[0])
        lo, hi, pos = piece
        if pos > filled:
            parts.append(_zeros(xp, a, axis, pos - filled))
        parts.append(seg)
        filled = pos + hi - lo
    if filled < length or not parts:
        parts.append(_zeros(xp, a, axis, length - filled))
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis)


def scatter_window(ctx, g, axis: int, mesh_dim: Optional[str], size: int, windows: tuple, wrap: bool = False):
    """Transpose of `gather_window`: each piece of the window `g` goes back to its owner, which
    adds it to its local block. The block is assembled interval by interval between the pieces'
    edges (each interval the sum of the pieces covering it), so a halo strip costs work
    proportional to its own size, not the block's."""
    xp, k = ctx.xp, len(windows)
    if not uniform(size, k, windows) and traced(ctx, mesh_dim):
        return _scatter_whole(ctx, g, axis, mesh_dim, size, windows, wrap)
    c = None if uniform(size, k, windows) else coordinate(ctx, mesh_dim, "window")
    b0, b1 = block(size, k, 0 if c is None else c)
    n = b1 - b0
    pieces = []  # (lo, hi, values) in the local block
    for r in window_routes(size, k, windows, wrap):
        piece = _mine(r.recv, c)
        if _local(r, k, mesh_dim, wrap):
            if piece is not None:
                pieces.append((piece[0], piece[1], _cut(g, axis, piece[2], piece[2] + piece[1] - piece[0])))
            continue
        back = None if piece is None else (piece[2], piece[2] + piece[1] - piece[0])
        seg = ctx.permute(_strip(xp, g, axis, back, r.width), mesh_dim, r.p, wrap)  # back from c to c+p
        mine = _mine(r.send, c)
        if mine is not None:
            pieces.append((mine[0], mine[1], _cut(seg, axis, 0, mine[1] - mine[0])))
    if n == 0:
        return _zeros(xp, g, axis, 0)
    edges = sorted({0, n}.union(*[(lo, hi) for lo, hi, _ in pieces]))
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        acc = None
        for lo, hi, seg in pieces:
            if lo <= a and b <= hi:
                part = _cut(seg, axis, a - lo, b - lo)
                acc = part if acc is None else acc + part
        out.append(_zeros(xp, g, axis, b - a) if acc is None else acc)
    return out[0] if len(out) == 1 else xp.concatenate(out, axis)


def count_window(ctx, a, axis: int, mesh_dim: Optional[str], size: int, windows: tuple, wrap: bool = False,
                 back: bool = False) -> Aval:
    """The dry run of `gather_window` (`scatter_window` with `back`) of the block `a` (an `Aval`):
    its permutes, one per route from another rank, each of the route's width, counted on `ctx` (a
    `DryCollectives`, coordinate 0); the window's (the block's) `Aval`."""
    k = len(windows)
    for r in window_routes(size, k, windows, wrap):
        if not _local(r, k, mesh_dim, wrap):
            ctx.permute(Aval(a.shape[:axis] + (r.width,) + a.shape[axis + 1:], a.dtype), mesh_dim,
                        r.p if back else -r.p, wrap)
    n = (block(size, k, 0)[1] - block(size, k, 0)[0]) if back else windows[0][1]
    return Aval(a.shape[:axis] + (n,) + a.shape[axis + 1:], a.dtype)


def blocks_of(size: int, k: int) -> tuple:
    """The k blocks `(start, stop)` of a dim of `size`."""
    return tuple(block(size, k, c) for c in range(k))


def _dim_axis(x, dim: Union[str, Dimension], what: str) -> int:
    if isinstance(dim, Dimension) or (isinstance(dim, tuple) and len(dim) == 2):
        dim = Dimension(*dim)
        if dim not in x.shape:
            raise ShapeError(f"{what}: dim {dim.name}:{dim.size} is not in {x.shape}")
        return x.shape.index(dim.name)
    return x.shape.index(dim)


def _split(mesh, layout: tuple, axis: int) -> tuple[Optional[str], int]:
    """(mesh dim, k) of a tensor axis; (None, 1) when unsplit or on a mesh dim of size 1."""
    m = splitting(layout[axis], mesh.shape)
    return m, (mesh.shape[m].size if m else 1)


def _check_int(value, what: str, name: str, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise MpimeshError(f"{what}: {name} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise MpimeshError(f"{what}: {name} must be >= {minimum}, got {value}")
    return value


def shift(x, offset: int, dim: Union[str, Dimension], wrap: bool):
    """x shifted by `offset` along `dim`: `out[i] = x[i - offset]`; with `wrap` the shift is a
    roll, otherwise vacated positions are zeros.

    When `dim` is split, each rank's window is its own block moved by `-offset`: with equal
    blocks of n it sends its block in at most two pieces, to the ranks `offset // n` and
    `offset // n + 1` coordinates away; with unequal blocks a window may span a few more (short or
    empty) blocks. The gradient is the shift by `-offset`.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> mm.shift(mesh.from_numpy(np.arange(4.0), "a:4"), 7, "a", True).to_numpy().tolist()
    [1.0, 2.0, 3.0, 0.0]
    """
    offset = _check_int(offset, "shift", "offset")
    axis = _dim_axis(x, dim, "shift")
    name, size = x.shape[axis]
    wrap = bool(wrap)
    if wrap and size:
        offset %= size
    x = to_layout(x, x.mesh.plan(x.shape))
    m, k = _split(x.mesh, x.tensor_layout, axis)
    windows = tuple((b0 - offset, b1 - b0) for b0, b1 in blocks_of(size, k))
    params = {"offset": offset, "dim": name, "wrap": wrap, "axis": axis, "mesh_dim": m, "size": size,
              "windows": windows}
    (y,) = dispatch(SHIFT, [x], [(x.shape, x.tensor_layout)], params)
    return y


def _gather_kernel(ctx, a, axis, mesh_dim, size, windows, wrap, **_):
    return gather_window(ctx, a, axis, mesh_dim, size, windows, wrap)


def _scatter_kernel(ctx, g, axis, mesh_dim, size, windows, wrap, **_):
    return scatter_window(ctx, g, axis, mesh_dim, size, windows, wrap)


def _counted(back: bool):
    """The `abstract` rule of a windowed op: its permutes counted, its input's dtype."""
    def abstract(ctx, shapes, a, axis, mesh_dim, size, windows, wrap, **_) -> tuple:
        count_window(ctx, a, axis, mesh_dim, size, windows, wrap, back)
        return (a.dtype,)
    return abstract


def _shift_grad(op, dy):
    p = op.params
    return [shift(dy, -p["offset"], p["dim"], p["wrap"])]


SHIFT = OpDef("shift", _gather_kernel, grad=_shift_grad, saves=((), ()), abstract=_counted(False))
"""A shift moves data only: no flops (so do the halo exchanges; the transpose's halo sums are boundary strips)."""


def halo_exchange(x, dim: Union[str, Dimension], halo: int, wrap: bool = False):
    """Each slice of x along `dim` widened by `halo` elements from its neighbours on both sides
    (Mesh-TensorFlow's halo exchange). With `dim` (size N) split over a mesh dim of size k, the output
    dim has the same name, size N + 2*halo*k and split, and its block c is `[the halo elements just
    before x's block c] + x's block c + [the halo just after it]`, gathered from several neighbours
    where blocks are short or empty. Beyond the ends of `dim` the halo is zeros (with `wrap=True` it
    wraps around); unsplit (k = 1), this is zero padding. The gradient sends each halo back to its
    owner, which adds it in.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> x = mesh.from_numpy(np.arange(3.0), "a:3")
    >>> mm.halo_exchange(x, "a", 2, wrap=True).to_numpy().tolist()
    [1.0, 2.0, 0.0, 1.0, 2.0, 0.0, 1.0]
    """
    halo = _check_int(halo, "halo_exchange", "halo", 0)
    axis = _dim_axis(x, dim, "halo_exchange")
    name, size = x.shape[axis]
    wrap = bool(wrap)
    mesh = x.mesh
    in_layout = mesh.plan(x.shape)
    m, k = _split(mesh, in_layout, axis)
    windows = tuple((b0 - halo, b1 - b0 + 2 * halo) for b0, b1 in blocks_of(size, k))
    out_shape = Shape(tuple(Dimension(name, size + 2 * halo * k) if i == axis else d
                            for i, d in enumerate(x.shape)))
    out_layout = mesh.plan(out_shape)
    params = {"dim": name, "halo": halo, "wrap": wrap, "axis": axis, "mesh_dim": m, "size": size,
              "windows": windows, "in_shape": x.shape, "in_layout": in_layout, "out_shape": out_shape,
              "out_layout": out_layout}
    return _halo_apply(x, params)


def _halo_apply(x, p: dict):
    """halo_exchange with a fixed plan `p` (also the gradient of its transpose)."""
    x = to_layout(x, p["in_layout"])
    (y,) = dispatch(HALO_EXCHANGE, [x], [(p["out_shape"], p["out_layout"])], p)
    return y


def _halo_transpose(dy, p: dict):
    """The transpose of halo_exchange: halos sent back to their owners and added in."""
    dy = to_layout(dy, p["out_layout"])
    (dx,) = dispatch(HALO_EXCHANGE_TRANSPOSE, [dy], [(p["in_shape"], p["in_layout"])], p)
    return dx


HALO_EXCHANGE = OpDef("halo_exchange", _gather_kernel, grad=lambda op, dy: [_halo_transpose(dy, op.params)],
                      saves=((), ()), abstract=_counted(False))
HALO_EXCHANGE_TRANSPOSE = OpDef("halo_exchange_transpose", _scatter_kernel,
                                grad=lambda op, g: [_halo_apply(g, op.params)], saves=((), ()),
                                abstract=_counted(True))
