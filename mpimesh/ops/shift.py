"""Shift and halo exchange along a dim that may be split over a mesh dim.

Both are built on one primitive, a *window*: the rank at coordinate c (holding the block
`[c*n, (c+1)*n)` of a dim split over k ranks) gathers the global range
`[c*n + start, c*n + start + length)`. The range is cut into pieces by the rank that owns them;
the own piece is a local slice, every other piece is one point-to-point permute of a boundary
strip (a piece more than one block away is a permute by several coordinates), and indices
outside the dim are zeros (or wrap around). Its transpose sends each piece back to its owner,
which adds it in: that is the gradient of every windowed op (shift, halo exchange, convolution).

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.arange(5.0), "a:5")
>>> mm.shift(x, 2, "a", wrap=False).to_numpy().tolist()
[0.0, 0.0, 0.0, 1.0, 2.0]
>>> mm.shift(x, -1, "a", wrap=True).to_numpy().tolist()
[1.0, 2.0, 3.0, 4.0, 0.0]
>>> mm.halo_exchange(x, "a", 1).to_numpy().tolist()
[0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 0.0]
>>> window_pieces(4, 2, -1, 6, False)
((-1, 3, 4, 0), (0, 0, 4, 1), (1, 0, 1, 5))
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional, Union

from ..errors import MpimeshError, ShapeError
from ..shape import Dimension, Shape
from ..trace import dispatch
from .relayout import to_layout


@lru_cache(maxsize=4096)
def window_pieces(n: int, k: int, start: int, length: int, wrap: bool) -> tuple:
    """The pieces of the window `[c*n + start, c*n + start + length)` of a dim split into k
    blocks of n: `(p, lo, hi, pos)` = local range `[lo, hi)` of coordinate c+p's block, placed at
    `pos` in the window. Pieces with no source (beyond the edges without `wrap`) are left out."""
    if n == 0 or length <= 0:
        return ()
    pieces = []
    first, last = start // n, -(-(start + length) // n)
    if not wrap:  # only the k blocks exist: a huge window must not cost a loop over the void
        first, last = max(first, -(k - 1)), min(last, k)
    for p in range(first, last):
        lo, hi = max(start - p * n, 0), min(start + length - p * n, n)
        if hi > lo and (wrap or abs(p) < k):
            pieces.append((p, lo, hi, p * n + lo - start))
    return tuple(pieces)


def _cut(a, axis: int, lo: int, hi: int, step: int = 1):
    return a[(slice(None),) * axis + (slice(lo, hi, step),)]


def _zeros(xp, like, axis: int, size: int):
    shape = like.shape[:axis] + (size,) + like.shape[axis + 1:]
    return xp.zeros(shape, dtype=like.dtype)


def gather_window(ctx, a, axis: int, mesh_dim: Optional[str], k: int, start: int, length: int,
                  wrap: bool = False):
    """The window `[c*n + start, c*n + start + length)` along `axis` of the dim whose local
    block is `a`, split over `mesh_dim` (None: unsplit, k=1), by permutes of boundary strips."""
    xp, n = ctx.xp, a.shape[axis]
    parts, filled = [], 0
    for p, lo, hi, pos in window_pieces(n, k, start, length, wrap):
        if pos > filled:
            parts.append(_zeros(xp, a, axis, pos - filled))
        seg = _cut(a, axis, lo, hi)
        if p != 0 and mesh_dim is not None:
            seg = ctx.permute(seg, mesh_dim, -p, wrap)  # coordinate c+p sends to c
        parts.append(seg)
        filled = pos + hi - lo
    if filled < length:
        parts.append(_zeros(xp, a, axis, length - filled))
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis)


def scatter_window(ctx, g, axis: int, mesh_dim: Optional[str], k: int, n: int, start: int,
                   wrap: bool = False):
    """Transpose of `gather_window`: each piece of the window `g` goes back to its owner, which
    adds it to its local block of size `n`. The block is assembled interval by interval between
    the pieces' edges (each interval the sum of the pieces covering it), so a halo strip costs
    work proportional to its own size, not the block's."""
    xp = ctx.xp
    pieces = []  # (lo, hi, values) in the local block
    for p, lo, hi, pos in window_pieces(n, k, start, g.shape[axis], wrap):
        seg = _cut(g, axis, pos, pos + hi - lo)
        if p != 0 and mesh_dim is not None:
            seg = ctx.permute(seg, mesh_dim, p, wrap)  # back from c to c+p
        pieces.append((lo, hi, seg))
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


def _dim_axis(x, dim: Union[str, Dimension], what: str) -> int:
    if isinstance(dim, Dimension) or (isinstance(dim, tuple) and len(dim) == 2):
        dim = Dimension(*dim)
        if dim not in x.shape:
            raise ShapeError(f"{what}: dim {dim.name}:{dim.size} is not in {x.shape}")
        return x.shape.index(dim.name)
    return x.shape.index(dim)


def _split(mesh, layout: tuple, axis: int) -> tuple[Optional[str], int]:
    """(mesh dim, k) of a tensor axis; (None, 1) when unsplit or on a mesh dim of size 1."""
    m = layout[axis]
    k = mesh.shape[m].size if m else 1
    return (m if k > 1 else None), k


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

    When `dim` is split, each rank sends at most two boundary strips (its whole block, in at most
    two pieces) to the ranks `offset // n` and `offset // n + 1` coordinates away. The gradient is
    the shift by `-offset`.

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
    n = size // k

    def lower(ctx, a):
        return gather_window(ctx, a, axis, m, k, -offset, n, wrap)
    (y,) = dispatch("shift", [x], [(x.shape, x.tensor_layout)], lower,
                    {"offset": offset, "dim": name, "wrap": wrap}, _shift_grad)
    return y


def _shift_grad(op, dy):
    p = op.params
    return [shift(dy, -p["offset"], p["dim"], p["wrap"])]


def halo_exchange(x, dim: Union[str, Dimension], halo: int, wrap: bool = False):
    """Each slice of x along `dim` widened by `halo` elements from its neighbours on both sides.

    Per-slice semantics (Mesh-TensorFlow's halo exchange): when `dim` (size N) is split over a
    mesh dim of size k into blocks of n = N/k, the output has a dim of the same name and size
    N + 2*halo*k, split over the same mesh dim, whose block c is
    `[left halo] + x's block c + [right halo]`, where the left halo is the `halo` elements just
    before block c (the left neighbour's last ones) and the right halo the `halo` just after it.
    A halo wider than a block is gathered from several neighbours. Beyond the ends of `dim`
    the halo is zeros: padding, not data (with `wrap=True` it wraps around instead). When `dim`
    is unsplit (k = 1) this is plain zero padding by `halo` on both sides.

    The gradient sends each halo back to its owner, which adds it in.

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
    n = size // k
    out_shape = Shape(tuple(Dimension(name, size + 2 * halo * k) if i == axis else d
                            for i, d in enumerate(x.shape)))
    out_layout = mesh.plan(out_shape)
    params = {"dim": name, "halo": halo, "wrap": wrap, "axis": axis, "mesh_dim": m, "k": k, "n": n,
              "in_shape": x.shape, "in_layout": in_layout, "out_shape": out_shape, "out_layout": out_layout}
    return _halo_apply(x, params)


def _halo_apply(x, p: dict):
    """halo_exchange with a fixed plan `p` (also the gradient of its transpose)."""
    axis, m, k, n, halo, wrap = p["axis"], p["mesh_dim"], p["k"], p["n"], p["halo"], p["wrap"]
    x = to_layout(x, p["in_layout"])

    def lower(ctx, a):
        return gather_window(ctx, a, axis, m, k, -halo, n + 2 * halo, wrap)
    (y,) = dispatch("halo_exchange", [x], [(p["out_shape"], p["out_layout"])], lower, p,
                    lambda op, dy: [_halo_transpose(dy, op.params)])
    return y


def _halo_transpose(dy, p: dict):
    """The transpose of halo_exchange: halos sent back to their owners and added in."""
    axis, m, k, n, halo, wrap = p["axis"], p["mesh_dim"], p["k"], p["n"], p["halo"], p["wrap"]
    dy = to_layout(dy, p["out_layout"])

    def lower(ctx, g):
        return scatter_window(ctx, g, axis, m, k, n, -halo, wrap)
    (dx,) = dispatch("halo_exchange_transpose", [dy], [(p["in_shape"], p["in_layout"])], lower, p,
                     lambda op, g: [_halo_apply(g, op.params)])
    return dx
