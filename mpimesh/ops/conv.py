"""conv1d and conv2d over named dims, with spatial dims that may be split over mesh dims.

Along a split spatial dim rank c computes output block c (`numpy.array_split`'s) from its own
input block plus halos from its neighbours (point-to-point permutes, `shift.gather_window`). A
split in-channels dim is contracted locally and allreduced; batch and out-channel splits need no
communication. The gradients: the transposed kernel and halo exchange for the input, a reduction
over positions, allreduced over batch and spatial splits, for the filter.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.arange(5.0).reshape(5, 1), "len:5;ci:1")
>>> w = mesh.from_numpy(np.ones((3, 1, 1)), "tap:3;ci:1;co:1")
>>> mm.conv1d(x, w).to_numpy()[:, 0].tolist()
[1.0, 3.0, 6.0, 9.0, 7.0]
"""
from __future__ import annotations

import itertools
import math
import numbers
from functools import lru_cache
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np

from ..errors import MpimeshError, ShapeError
from ..layout import block_sizes, splitting
from ..opdef import Aval, OpDef
from ..promotion import cast_operands, operand_casts, result_type
from ..shape import Dimension, Shape
from ..tensor import tensor_arg
from ..trace import dispatch
from .relayout import to_layout
from .shift import blocks_of, coordinate, count_window, gather_window, scatter_window, traced


class _Axis(NamedTuple):
    """One spatial dim of a convolution: per coordinate c along its mesh dim, the input block, the
    output block and the input window that block reads; `n`, `ol`, `win` are coordinate `c`'s."""
    mesh_dim: Optional[str]  # None when unsplit
    k: int                   # ranks along mesh_dim
    size: int                # input length
    f: int                   # filter taps
    s: int                   # stride
    d: int                   # dilation
    ns: tuple                # per coordinate: input block length
    ols: tuple               # per coordinate: output block length
    windows: tuple           # per coordinate: (global start, length) of the input window read
    c: Optional[int] = None  # the coordinate of n, ol, win (None: equal blocks, alike everywhere)

    @property
    def even(self) -> bool:
        """Equal input blocks and equal output blocks: the same program on every rank."""
        return len(set(self.ns)) == 1 and len(set(self.ols)) == 1

    @property
    def n(self) -> int:
        return self.ns[self.c or 0]

    @property
    def ol(self) -> int:
        return self.ols[self.c or 0]

    @property
    def win(self) -> int:
        return self.windows[self.c or 0][1]

    @property
    def span(self) -> int:
        """Extent of one tap's strided read: (ol-1)*s + 1."""
        return (self.ol - 1) * self.s + 1

    @property
    def deltas(self) -> tuple:
        """Equal blocks: per coordinate, the window's start relative to the rank's own block."""
        return tuple(start - c * self.n for c, (start, _) in enumerate(self.windows))


class _Plan(NamedTuple):
    x_shape: Shape
    x_layout: tuple
    f_shape: Shape
    f_layout: tuple
    out_shape: Shape
    out_layout: tuple
    lead: int            # number of leading (batch-like) dims of x
    axes: tuple          # one _Axis per spatial dim
    cin_mesh: Optional[str]
    cout_mesh: Optional[str]
    pos_mesh: tuple      # mesh dims splitting the leading and spatial output dims


def _ints(value, nsp: int, what: str, name: str) -> tuple:
    try:
        vals = (value,) * nsp if isinstance(value, numbers.Integral) else tuple(value)
    except TypeError:
        vals = ()
    if len(vals) != nsp or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1
                                   for v in vals):
        raise MpimeshError(f"{what}: {name} must be {nsp} positive integer(s), got {value!r}")
    return tuple(int(v) for v in vals)


def _paddings(padding, nsp: int, what: str):
    bad = f"{what}: padding must be 'SAME', 'VALID' or (before, after) pairs, got {padding!r}"
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise MpimeshError(bad)
        return padding.upper()
    try:
        pads = tuple((b, a) for b, a in padding)
    except (TypeError, ValueError):
        raise MpimeshError(bad) from None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for pair in pads for v in pair):
        raise MpimeshError(bad)
    pads = tuple((int(b), int(a)) for b, a in pads)
    if len(pads) != nsp or any(b < 0 or a < 0 for b, a in pads):
        raise MpimeshError(f"{what}: padding needs {nsp} non-negative (before, after) pairs, got {padding!r}")
    return pads


@lru_cache(maxsize=1024)
def conv_geometry(x_shape: Shape, f_shape: Shape, nsp: int, strides: tuple, padding, dilation: tuple,
                  what: str) -> tuple:
    """`(out_shape, ((out_size, pad_before), ...))`, checking the dims (TensorFlow's SAME/VALID)."""
    if x_shape.rank < nsp + 1:
        raise ShapeError(f"{what}: x {x_shape} needs {nsp} spatial dims and an in-channels dim")
    if f_shape.rank != nsp + 2:
        raise ShapeError(f"{what}: filters {f_shape} must have {nsp} tap dims, in-channels and out-channels")
    cin, cout = f_shape[-2], f_shape[-1]
    if cin != x_shape[-1]:
        raise ShapeError(f"{what}: filters' in-channels dim {cin.name}:{cin.size} differs from x's last dim "
                         f"{x_shape[-1].name}:{x_shape[-1].size} (x {x_shape}, filters {f_shape})")
    if cout.name in x_shape.names[:-1]:
        raise ShapeError(f"{what}: filters' out-channels dim {cout.name!r} is already a dim of x {x_shape}")
    geo, out_dims = [], []
    for i in range(nsp):
        dim, f, s, d = x_shape[x_shape.rank - nsp - 1 + i], f_shape[i].size, strides[i], dilation[i]
        extent = (f - 1) * d + 1
        if padding == "SAME":
            o = -(-dim.size // s)
            pb = max((o - 1) * s + extent - dim.size, 0) // 2
        elif padding == "VALID":
            o, pb = -(-(dim.size - extent + 1) // s), 0
        else:
            pb, pa = padding[i]
            o = (dim.size + pb + pa - extent) // s + 1
        if o < 1 or f < 1:
            raise ShapeError(f"{what}: spatial dim {dim.name!r} (size {dim.size}) is too small for filter dim "
                             f"{f_shape[i].name}:{f} with dilation {d} and padding {padding!r}")
        geo.append((o, pb))
        out_dims.append(Dimension(dim.name, o))
    out = Shape(x_shape.dims[:x_shape.rank - nsp - 1] + tuple(out_dims) + (cout,))
    return out, tuple(geo)


@lru_cache(maxsize=1024)
def conv_plan(x_shape: Shape, f_shape: Shape, x_layout: tuple, f_layout: tuple, out_shape: Shape,
              out_layout: tuple, mesh_shape: Shape, geo: tuple, strides: tuple, dilation: tuple) -> _Plan:
    """Layouts of x and filters for the kernel, and the halo geometry per spatial dim."""
    nsp = len(geo)
    lead = x_shape.rank - nsp - 1

    def eff(m):
        return splitting(m, mesh_shape)
    used = {m for m in out_layout if m}
    cin_mesh = next((m for m in (x_layout[-1], f_layout[-2]) if eff(m) and m not in used), None)
    axes = []
    for i, (o, pb) in enumerate(geo):
        m = eff(out_layout[lead + i])
        k, size = mesh_shape[m].size if m else 1, x_shape[lead + i].size
        s, d, f = strides[i], dilation[i], f_shape[i].size
        outs = blocks_of(o, k)  # output block c reads the window from o0*s - pb, empty for an empty block
        windows = tuple((o0 * s - pb, (o1 - o0 - 1) * s + (f - 1) * d + 1 if o1 > o0 else 0) for o0, o1 in outs)
        axes.append(_Axis(m, k, size, f, s, d, block_sizes(size, k), tuple(o1 - o0 for o0, o1 in outs), windows))
    x_target = tuple(out_layout[:lead + nsp]) + (cin_mesh,)
    f_target = (None,) * nsp + (cin_mesh, out_layout[-1])
    pos_mesh = tuple(m for m in mesh_shape.names if m in {eff(x) for x in out_layout[:lead + nsp]})
    return _Plan(x_shape, x_target, f_shape, f_target, out_shape, out_layout, lead, tuple(axes), cin_mesh,
                 eff(out_layout[-1]), pos_mesh)


# ---- local kernels (only ctx.xp and ctx's collectives) ----

def _order(p: _Plan) -> tuple:
    """Spatial axes in exchange order: the split ones first (corners travel with the second
    exchange of a 2-D split), then the unsplit ones (zero padding only)."""
    return tuple(sorted(range(len(p.axes)), key=lambda i: p.axes[i].mesh_dim is None))


def _local(ctx, p: _Plan) -> _Plan:
    """`p` with each axis of unequal blocks fixed to this rank's coordinate; a traced one (a JAX
    replay) to coordinate 0, whose output block and window are the longest: every device then
    computes as many outputs as the first, from its window zero-padded to that length, and the
    outputs past its own block are padding."""
    axes = tuple(ax if ax.even else ax._replace(c=0 if traced(ctx, ax.mesh_dim) else
                                                coordinate(ctx, ax.mesh_dim, "conv")) for ax in p.axes)
    return p._replace(axes=axes)


def _union(ax: _Axis) -> tuple:
    """Equal blocks: every coordinate's window widened to the union of the halos any rank needs."""
    lo, hi = min(ax.deltas), max(ax.deltas)
    return tuple((c * ax.n + lo, hi - lo + ax.win) for c in range(ax.k))


def _gather(ctx, a, p: _Plan):
    """The input window of this rank: halos along each spatial dim in turn (split dims first, so
    a split dim's halo strip is not widened by an unsplit dim's zero padding), then (equal blocks,
    windows not alike) this rank's own window out of the union.

    Output block c, `[o_c, o_c + ol_c)`, reads the input window starting at `o_c*stride -
    pad_before` of length `(ol_c-1)*stride + (f-1)*dilation + 1` (zeros beyond the edges are the
    padding). Along height first, then along width on the already widened slab, which brings the
    corners with it. With equal blocks of input and output, when the window does not sit at the same
    place relative to every rank's block (VALID padding, or a stride not dividing the size), all
    ranks gather the union of the halos they need and each selects its own window (a k-way select on
    the coordinate: the same program on every rank). With unequal blocks each rank gathers exactly
    its own window, its pieces routed by coordinate (a piece may come from beyond the neighbours,
    past short or empty blocks), and a rank whose output block is empty computes nothing."""
    xp = ctx.xp
    for i in _order(p):
        ax, axis = p.axes[i], p.lead + i
        if not ax.even:
            a = gather_window(ctx, a, axis, ax.mesh_dim, ax.size, ax.windows)
            continue
        lo, hi = min(ax.deltas), max(ax.deltas)
        a = gather_window(ctx, a, axis, ax.mesh_dim, ax.size, _union(ax))
        if hi != lo:
            sel = None
            for c, dc in enumerate(ax.deltas):
                part = a[(slice(None),) * axis + (slice(dc - lo, dc - lo + ax.win),)]
                sel = part if sel is None else xp.where(ctx.coord(ax.mesh_dim) == c, part, sel)
            a = sel
    return a


def _scatter(ctx, g, p: _Plan):
    """Transpose of `_gather`: the window gradient added back into the local input block."""
    xp = ctx.xp
    for i in reversed(_order(p)):
        ax, axis = p.axes[i], p.lead + i
        if not ax.even:
            g = scatter_window(ctx, g, axis, ax.mesh_dim, ax.size, ax.windows)
            continue
        lo, hi = min(ax.deltas), max(ax.deltas)
        if hi != lo:
            sel = None
            for c, dc in enumerate(ax.deltas):
                widths = [(0, 0)] * g.ndim
                widths[axis] = (dc - lo, hi - dc)
                part = xp.pad(g, widths)
                sel = part if sel is None else xp.where(ctx.coord(ax.mesh_dim) == c, part, sel)
            g = sel
        g = scatter_window(ctx, g, axis, ax.mesh_dim, ax.size, _union(ax))
    return g


def _taps(p: _Plan):
    """(tap index, slab index of that tap's strided read) for every filter tap."""
    for t in itertools.product(*[range(ax.f) for ax in p.axes]):
        idx = tuple(slice(ti * ax.d, ti * ax.d + ax.span, ax.s) for ti, ax in zip(t, p.axes))
        yield t, (slice(None),) * p.lead + idx


def _dilate(xp, a, axis: int, s: int):
    """Insert s-1 zeros between the elements of `a` along `axis`."""
    n = a.shape[axis]
    if s == 1 or n <= 1:
        return a
    z = xp.zeros_like(a)
    a = xp.stack([a] + [z] * (s - 1), axis=axis + 1)
    a = a.reshape(a.shape[:axis] + (n * s,) + a.shape[axis + 2:])
    return a[(slice(None),) * axis + (slice(0, (n - 1) * s + 1),)]


# Stride-1 kernels (the common case), as 2-D problems `[L, rows, cols, C]`: a block of output
# rows at a time, the slab's rows are unrolled along the width taps only (`[rows, cols, fw*C]`,
# one concatenate), and each height tap is then one matmul of contiguous rows with that tap's
# `[fw*C, out]` matrix. numpy's kernel (`chunked`) takes blocks of about _BLOCK_BYTES, so they stay
# in cache; the generic kernel (JAX, CuPy) takes the whole array as one block (no unrolled loop to
# compile). The input and filter gradients are the same kernel on the padded output gradient, resp.
# with the output gradient as the matrix.
_BLOCK_BYTES = 1 << 19


def _fast(p: _Plan) -> bool:
    return len(p.axes) in (1, 2) and all(ax.s == 1 for ax in p.axes)


def _as_2d(p: _Plan, a):
    """A local array `[lead..., spatial..., C]` as `[L, rows, cols, C]` (1-D: one row)."""
    lead = math.prod(a.shape[:p.lead])
    return a.reshape((lead,) + (1,) * (2 - len(p.axes)) + a.shape[p.lead:])


def _dil2(p: _Plan) -> tuple:
    return ((1,) * (2 - len(p.axes))) + tuple(ax.d for ax in p.axes)


def _blocks(n_lead: int, rows: int, row_bytes: int, chunked: bool):
    """(lead slice, first row, row count) of each block (`chunked`: cache-sized, else one)."""
    if not chunked:
        yield slice(0, n_lead), 0, rows
        return
    step = max(1, _BLOCK_BYTES // max(row_bytes, 1))
    for b in range(n_lead):
        for r0 in range(0, rows, step):
            yield slice(b, b + 1), r0, min(step, rows - r0)


def _unroll(xp, a, fw: int, dw: int, wo: int, chunked: bool):
    """`[..., cols, C]` -> `[..., wo, fw*C]`: the fw width taps side by side (`chunked`: numpy's kernel)."""
    if fw == 1:
        return a[..., :wo, :]
    ci, item = a.shape[-1], a.itemsize
    if chunked and dw == 1 and ci >= 4 and a.strides[-1] == item and a.strides[-2] == ci * item:
        # numpy: a row's fw taps are one run of fw*C consecutive values, so copy from an
        # overlapping strided view (runs of fw*C instead of C values: about twice as fast)
        view = xp.lib.stride_tricks.as_strided(a, a.shape[:-2] + (wo, fw * ci), a.strides, writeable=False)
        return xp.ascontiguousarray(view)
    return xp.concatenate([a[..., j * dw:j * dw + wo, :] for j in range(fw)], axis=-1)


def _correlate(xp, a, w, dil: tuple, out_hw: tuple, chunked: bool):
    """`y[l, r, c] = sum_ij a[l, r + i*dh, c + j*dw] @ w[i, j]`: a `[L, R, C, ci]`, w
    `[fh, fw, ci, co]` -> `[L, out_h, out_w, co]`."""
    fh, fw, ci, co = w.shape
    (dh, dw), (ho, wo) = dil, out_hw
    mats = [w[i].reshape(fw * ci, co) for i in range(fh)]
    per_lead: dict = {}
    for lead, r0, r in _blocks(a.shape[0], ho, wo * fw * ci * a.itemsize, chunked):
        s3 = _unroll(xp, a[lead, r0:r0 + r + (fh - 1) * dh], fw, dw, wo, chunked)
        y = None
        for i in range(fh):
            term = s3[:, i * dh:i * dh + r].reshape(-1, fw * ci) @ mats[i]
            y = term if y is None else y + term
        per_lead.setdefault(lead.start, []).append(y.reshape(-1, r, wo, co))
    parts = [v[0] if len(v) == 1 else xp.concatenate(v, axis=1) for v in per_lead.values()]
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=0)


def _correlate_filter(xp, a, g, taps: tuple, dil: tuple, chunked: bool):
    """`dw[i, j] = sum_lrc a[l, r + i*dh, c + j*dw]^T g[l, r, c]`: a `[L, R, C, ci]`, g
    `[L, out_h, out_w, co]` -> `[fh, fw, ci, co]`."""
    (fh, fw), (dh, dw) = taps, dil
    ci, (ho, wo, co) = a.shape[-1], g.shape[1:]
    acc = [None] * fh
    for lead, r0, r in _blocks(a.shape[0], ho, wo * fw * ci * a.itemsize, chunked):
        s3 = _unroll(xp, a[lead, r0:r0 + r + (fh - 1) * dh], fw, dw, wo, chunked)
        gb = g[lead, r0:r0 + r].reshape(-1, co)
        for i in range(fh):
            term = s3[:, i * dh:i * dh + r].reshape(-1, fw * ci).T @ gb
            acc[i] = term if acc[i] is None else acc[i] + term
    return xp.stack(acc).reshape(fh, fw, ci, co)


def _forward_fast(xp, slab, w, p: _Plan, chunked: bool):
    w4 = w.reshape((1,) * (2 - len(p.axes)) + w.shape)
    out_hw = ((1,) * (2 - len(p.axes))) + tuple(ax.ol for ax in p.axes)
    y = _correlate(xp, _as_2d(p, slab), w4, _dil2(p), out_hw, chunked)
    return y.reshape(slab.shape[:p.lead] + tuple(ax.ol for ax in p.axes) + (w.shape[-1],))


def _input_grad_fast(xp, g, w, p: _Plan, chunked: bool):
    """The slab gradient: g zero-padded by (f-1)*d on both sides, correlated with the flipped,
    transposed filters."""
    widths = [(0, 0)] * p.lead + [((ax.f - 1) * ax.d,) * 2 for ax in p.axes] + [(0, 0)]
    w4 = w.reshape((1,) * (2 - len(p.axes)) + w.shape)
    wt = xp.swapaxes(xp.flip(w4, (0, 1)), -1, -2)
    out_hw = ((1,) * (2 - len(p.axes))) + tuple(ax.win for ax in p.axes)
    d = _correlate(xp, _as_2d(p, xp.pad(g, widths)), wt, _dil2(p), out_hw, chunked)
    return d.reshape(g.shape[:p.lead] + tuple(ax.win for ax in p.axes) + (w.shape[-2],))


def _filter_grad_fast(xp, slab, g, p: _Plan, chunked: bool):
    taps = ((1,) * (2 - len(p.axes))) + tuple(ax.f for ax in p.axes)
    dw = _correlate_filter(xp, _as_2d(p, slab), _as_2d(p, g), taps, _dil2(p), chunked)
    return dw.reshape(tuple(ax.f for ax in p.axes) + dw.shape[-2:])


def _empty(xp, shape: tuple, matmul: bool, a, b):
    """Zeros of `shape` when this rank's part is empty (an empty block of positions, channels or
    output), else None. Their dtype is the product's, by `@` (`matmul`) or `tensordot`, as the other
    ranks' (ml_dtypes multiplies bfloat16 matrices with `@` into float32): the sums across ranks
    then add alike."""
    if 0 in shape or 0 in a.shape or 0 in b.shape:
        u, v = xp.ones((1, 1), a.dtype), xp.ones((1, 1), b.dtype)
        return xp.zeros(shape, (u @ v if matmul else xp.tensordot(u, v, axes=([1], [0]))).dtype)
    return None


def _forward_local(xp, slab, w, p: _Plan, chunked: bool):
    """This rank's outputs from its window `slab`: the stride-1 kernel above, else a sum over the
    filter taps of a tensordot of a strided slice of the slab with that tap's `[in, out]` matrix."""
    y = _empty(xp, slab.shape[:p.lead] + tuple(ax.ol for ax in p.axes) + (w.shape[-1],), _fast(p), slab, w)
    if y is not None:
        return y
    if _fast(p):
        return _forward_fast(xp, slab, w, p, chunked)
    for t, idx in _taps(p):
        patch = slab[idx]
        term = xp.tensordot(patch, w[t], axes=([patch.ndim - 1], [0]))
        y = term if y is None else y + term
    return y


def _input_grad_local(xp, g, w, p: _Plan, chunked: bool):
    """The gradient of this rank's input window."""
    dslab = _empty(xp, g.shape[:p.lead] + tuple(ax.win for ax in p.axes) + (w.shape[-2],), _fast(p), g, w)
    if dslab is not None:
        return dslab
    if _fast(p):
        return _input_grad_fast(xp, g, w, p, chunked)
    for t, _ in _taps(p):
        term = xp.tensordot(g, w[t], axes=([g.ndim - 1], [1]))
        widths = [(0, 0)] * term.ndim
        for i, (ti, ax) in enumerate(zip(t, p.axes)):
            term = _dilate(xp, term, p.lead + i, ax.s)
            widths[p.lead + i] = (ti * ax.d, ax.win - ti * ax.d - ax.span)
        term = xp.pad(term, widths)
        dslab = term if dslab is None else dslab + term
    return dslab


def _filter_grad_local(xp, slab, g, p: _Plan, chunked: bool):
    taps = tuple(ax.f for ax in p.axes)
    dw = _empty(xp, taps + (slab.shape[-1], g.shape[-1]), True, slab, g)
    if dw is not None:
        return dw
    if _fast(p):
        return _filter_grad_fast(xp, slab, g, p, chunked)
    g2 = g.reshape(-1, g.shape[-1])  # positions x out-channels
    terms = [slab[idx].reshape(-1, slab.shape[-1]).T @ g2 for _, idx in _taps(p)]
    return xp.stack(terms).reshape(taps + terms[0].shape)


def _forward_kernel(ctx, a, w, plan, casts, dtype, chunked=False):
    """conv: this rank's input window (halos gathered), the local convolution, summed over a split
    in-channels dim. Every kernel here takes blocks of two dtypes in their promotion `dtype`
    (`mm.result_type`): cast first where numpy's would differ (int32 with float32 is float32), the
    result rounded to it where the kernel's is wider (ml_dtypes multiplies bfloat16 matrices into
    float32: summed across ranks in float32, then rounded once)."""
    a, w = cast_operands((a, w), casts)
    q = _local(ctx, plan)
    y = _forward_local(ctx.xp, _gather(ctx, a, q), w, q, chunked)
    y = ctx.allreduce(y, (q.cin_mesh,)) if q.cin_mesh else y
    return y if y.dtype == dtype else y.astype(dtype)


def _input_grad_kernel(ctx, g, w, plan, casts, dtype, chunked=False):
    """conv_input_grad: the window's gradient, its halos sent back and added in, summed over a split
    out-channels dim."""
    g, w = cast_operands((g, w), casts)
    q = _local(ctx, plan)
    dx = _scatter(ctx, _input_grad_local(ctx.xp, g, w, q, chunked), q)
    dx = ctx.allreduce(dx, (q.cout_mesh,)) if q.cout_mesh else dx
    return dx if dx.dtype == dtype else dx.astype(dtype)


def _filter_grad_kernel(ctx, a, g, plan, casts, dtype, chunked=False):
    """conv_filter_grad: a reduction over this rank's positions, summed over the mesh dims that split them."""
    a, g = cast_operands((a, g), casts)
    q = _local(ctx, plan)
    dw = _filter_grad_local(ctx.xp, _gather(ctx, a, q), g, q, chunked)
    dw = ctx.allreduce(dw, q.pos_mesh) if q.pos_mesh else dw
    return dw if dw.dtype == dtype else dw.astype(dtype)


# ---- the dry run of each kernel: its halo permutes and allreduce on `Aval`s ----

@lru_cache(maxsize=256)
def _product_dtype(matmul: bool, a: np.dtype, b: np.dtype) -> np.dtype:
    """The dtype of a local kernel's result on numpy blocks of `a` and `b`: the fast kernels multiply
    with `@`, the others with `tensordot` (ml_dtypes gives float32 for bfloat16 from the one, bfloat16
    from the other)."""
    u, v = np.ones((1, 1), a), np.ones((1, 1), b)
    return (u @ v if matmul else np.tensordot(u, v, axes=([1], [0]))).dtype


def _local_dtype(matmul: bool, *blocks) -> np.dtype:
    """The result dtype of a local kernel that multiplies blocks with `@` (`matmul`) or `tensordot`."""
    return _product_dtype(matmul, *(np.dtype(x.dtype) for x in blocks))


def _cast_avals(blocks, casts) -> list:
    return [x if c is None else Aval(x.shape, c) for x, c in zip(blocks, casts or (None,) * len(blocks))]


def _count_gather(ctx, a: Aval, p: _Plan) -> Aval:
    """`_gather` dry: its halo permutes counted on `ctx`; the window's `Aval`."""
    for i in _order(p):
        ax, axis = p.axes[i], p.lead + i
        a = count_window(ctx, a, axis, ax.mesh_dim, ax.size, ax.windows if not ax.even else _union(ax))
        a = Aval(a.shape[:axis] + (ax.win,) + a.shape[axis + 1:], a.dtype)
    return a


def _count_scatter(ctx, g: Aval, p: _Plan) -> Aval:
    """`_scatter` dry: its permutes counted on `ctx`; the block's `Aval`."""
    for i in reversed(_order(p)):
        ax, axis = p.axes[i], p.lead + i
        g = count_window(ctx, g, axis, ax.mesh_dim, ax.size, ax.windows if not ax.even else _union(ax), back=True)
    return g


def _forward_abstract(ctx, shapes, a, w, plan, casts, dtype) -> tuple:
    a, w = _cast_avals((a, w), casts)
    q = _local(ctx, plan)
    slab = _count_gather(ctx, a, q)
    if q.cin_mesh:
        ctx.allreduce(Aval(shapes[0], _local_dtype(_fast(q), slab, w)), (q.cin_mesh,))
    return (dtype,)


def _input_grad_abstract(ctx, shapes, g, w, plan, casts, dtype) -> tuple:
    g, w = _cast_avals((g, w), casts)
    q = _local(ctx, plan)
    win = g.shape[:q.lead] + tuple(ax.win for ax in q.axes) + (w.shape[-2],)
    dx = _count_scatter(ctx, Aval(win, _local_dtype(_fast(q), g, w)), q)
    if q.cout_mesh:
        ctx.allreduce(dx, (q.cout_mesh,))
    return (dtype,)


def _filter_grad_abstract(ctx, shapes, a, g, plan, casts, dtype) -> tuple:
    a, g = _cast_avals((a, g), casts)
    q = _local(ctx, plan)
    slab = _count_gather(ctx, a, q)
    if q.pos_mesh:
        ctx.allreduce(Aval(shapes[0], _local_dtype(True, slab, g)), q.pos_mesh)  # (always `@`)
    return (dtype,)


# ---- the dispatched ops; each one's gradient is written with the other two ----

def _conv_flops(out: Optional[int], taps_in: Optional[int]):
    """A convolution's multiply-adds, times 2: this rank's outputs x taps x local in-channels (the
    output block's elements from input `out`, else the output; taps x in-channels: the product of
    the filter block's dims but out-channels, from input `taps_in`, else the output)."""
    def flops(params, ins, outs) -> int:
        y = ins[out] if out is not None else outs[0]
        f = ins[taps_in] if taps_in is not None else outs[0]
        return 2 * math.prod(y.shape) * math.prod(f.shape[:-1])
    return flops


def _params(p: _Plan, a, b) -> dict:
    """The params of a kernel of blocks of tensors `a` and `b`: the plan and their promotion."""
    casts = None if a.dtype == b.dtype else operand_casts((a.dtype, b.dtype))
    return {"plan": p, "casts": casts, "dtype": result_type(a.dtype, b.dtype)}


def _forward(x, w, p: _Plan):
    x, w = to_layout(x, p.x_layout), to_layout(w, p.f_layout)
    (y,) = dispatch(CONV, [x, w], [(p.out_shape, p.out_layout)], _params(p, x, w))
    return y


def _input_grad(dy, w, p: _Plan):
    dy, w = to_layout(dy, p.out_layout), to_layout(w, p.f_layout)
    (dx,) = dispatch(CONV_INPUT_GRAD, [dy, w], [(p.x_shape, p.x_layout)], _params(p, dy, w))
    return dx


def _filter_grad(x, dy, p: _Plan):
    x, dy = to_layout(x, p.x_layout), to_layout(dy, p.out_layout)
    (dw,) = dispatch(CONV_FILTER_GRAD, [x, dy], [(p.f_shape, p.f_layout)], _params(p, x, dy))
    return dw


def _forward_grad(op, dy):
    (x, w), p = op.inputs, op.params["plan"]
    return [_input_grad(dy, w, p), _filter_grad(x, dy, p)]


def _input_grad_grad(op, g):
    (dy, w), p = op.inputs, op.params["plan"]
    return [_forward(g, w, p), _filter_grad(g, dy, p)]


def _filter_grad_grad(op, g):
    (x, dy), p = op.inputs, op.params["plan"]
    return [_input_grad(dy, g, p), _forward(x, g, p)]


def _numpy(kernel):
    """numpy's kernel of `kernel`: cache-sized blocks (`chunked`)."""
    def numpy_kernel(ctx, *blocks, **params):
        return kernel(ctx, *blocks, chunked=True, **params)
    return numpy_kernel


CONV = OpDef("conv", _forward_kernel, kernels={"numpy": _numpy(_forward_kernel)}, grad=_forward_grad,
             saves=((0, 1), ()), flops=_conv_flops(None, 1), abstract=_forward_abstract)
CONV_INPUT_GRAD = OpDef("conv_input_grad", _input_grad_kernel, kernels={"numpy": _numpy(_input_grad_kernel)},
                        grad=_input_grad_grad, saves=((0, 1), ()), flops=_conv_flops(0, 1),
                        abstract=_input_grad_abstract)
CONV_FILTER_GRAD = OpDef("conv_filter_grad", _filter_grad_kernel, kernels={"numpy": _numpy(_filter_grad_kernel)},
                         grad=_filter_grad_grad, saves=((0, 1), ()), flops=_conv_flops(1, None),
                         abstract=_filter_grad_abstract)


def _conv(x, filters, nsp: int, strides, padding, dilation, what: str):
    tensor_arg(what, x), tensor_arg(what, filters, "filters")
    strides = _ints(strides, nsp, what, "strides")
    dilation = _ints(dilation, nsp, what, "dilation")
    padding = _paddings(padding, nsp, what)
    if x.mesh is not filters.mesh:
        raise MpimeshError(f"{what}: x and filters live on different meshes")
    out_shape, geo = conv_geometry(x.shape, filters.shape, nsp, strides, padding, dilation, what)
    out_layout = x.mesh.plan(out_shape)
    p = conv_plan(x.shape, filters.shape, x.tensor_layout, filters.tensor_layout, out_shape, out_layout,
                  x.mesh.shape, geo, strides, dilation)
    return _forward(x, filters, p)


def conv2d(x, filters, strides: Union[int, Sequence[int]] = (1, 1), padding="SAME",
           dilation: Union[int, Sequence[int]] = (1, 1)):
    """2-D convolution (cross-correlation, as TensorFlow's): x's last three dims are height, width
    and in-channels; `filters` has dims `[fh, fw, in_channels, out_channels]`.

    The output has x's leading dims, its height and width names (sizes: SAME gives
    ceil(size/stride), VALID ceil((size - (f-1)*dilation)/stride); or pass explicit
    `((top, bottom), (left, right))` padding) and the out-channels dim.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> x = mesh.ones("b:1;h:4;w:4;ci:2")
    >>> y = mm.conv2d(x, mesh.ones("fh:3;fw:3;ci:2;co:5"), strides=2)
    >>> y.shape, y.to_numpy()[0, :, :, 0].tolist()
    (Shape('[b:1, h:2, w:2, co:5]'), [[18.0, 12.0], [12.0, 8.0]])
    """
    return _conv(x, filters, 2, strides, padding, dilation, "conv2d")


def conv1d(x, filters, stride: int = 1, padding="SAME", dilation: int = 1):
    """1-D convolution: x's last two dims are length and in-channels; `filters` has dims
    `[f, in_channels, out_channels]`. Otherwise as `conv2d`.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> x = mesh.from_numpy(np.arange(6.0).reshape(6, 1), "len:6;ci:1")
    >>> w = mesh.from_numpy(np.ones((2, 1, 1)), "tap:2;ci:1;co:1")
    >>> mm.conv1d(x, w, stride=2, padding="VALID").to_numpy()[:, 0].tolist()
    [1.0, 5.0, 9.0]
    """
    return _conv(x, filters, 1, stride, padding, dilation, "conv1d")
