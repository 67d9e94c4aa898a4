"""Indexing ops: one_hot, gather (embedding lookup), top_k and argmax, with any dim split.

A split output dim of `one_hot` compares against each rank's own global index range. `gather`
with the looked-up dim split takes, on each rank, the rows in its range (zeros elsewhere) and
sums over that dim's mesh dim: one allreduce of the output. `top_k`/`argmax` over a split dim
find each rank's local candidates (values and global indices), allgather only those and pick
the final winners locally: the full dim is never gathered.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.array([[3.0, 1.0, 4.0, 1.0]]), "b:1;v:4")
>>> values, indices = mm.top_k(x, "v", mm.Dimension("k", 2))
>>> values.shape, values.to_numpy().tolist(), indices.to_numpy().tolist(), mm.argmax(x, "v").to_numpy().tolist()
(Shape('[b:1, k:2]'), [[4.0, 3.0]], [[2, 0]], [2])
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..backend import as_dtype, is_float, is_low_precision
from ..errors import MpimeshError, ShapeError
from ..layout import TensorLayout, block_sizes, splitting
from ..mesh import layout_scope
from ..opdef import Aval, OpDef
from ..partials import partial_for
from ..shape import Dimension, Shape, union_shape
from ..tensor import fill_value, tensor_arg
from ..trace import dispatch
from .einsum import contraction_plan, einsum, grad_einsum
from .elementwise import cast
from .relayout import to_layout


def _new_dim(d, what: str) -> Dimension:
    """A Dimension from a Dimension, a (name, size) pair or "name:size"."""
    if isinstance(d, str):
        if ":" not in d:
            raise ShapeError(f"{what}: new dim {d!r} needs a size: give a Dimension or 'name:size'")
        s = Shape(d)
    else:
        s = Shape([d])
    if s.rank != 1:
        raise ShapeError(f"{what}: expected one dim, got {s}")
    return s[0]


def _find_dim(shape: Shape, d, what: str) -> Dimension:
    """The dim of `shape` that `d` (a name, Dimension, pair or "name:size") refers to."""
    if isinstance(d, str) and ":" not in d:
        name, size = d, None
    else:
        dim = _new_dim(d, what)
        name, size = dim.name, dim.size
    if name not in shape:
        raise ShapeError(f"{what}: dim {name!r} is not in shape {shape}")
    if size is not None and shape[name].size != size:
        raise ShapeError(f"{what}: dim {name!r} has size {shape[name].size} in {shape}, not {size}")
    return shape[name]


def _check_indices(indices, what: str) -> None:
    if not np.issubdtype(tensor_arg(what, indices, "indices").dtype, np.integer):
        raise MpimeshError(f"{what}: indices of shape {indices.shape} must have an integer dtype, "
                           f"got {indices.dtype}")


# ------------------------------------------------------------------------------------- one_hot

def one_hot(indices, output_dim, on_value=1, off_value=0, dtype="float32"):
    """`on_value` where `indices` equals the position along the new last dim `output_dim`, else
    `off_value` (indices outside `[0, output_dim.size)` give a row of `off_value`). No gradient.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> i = mesh.from_numpy(np.array([2, 0]), "b:2")
    >>> mm.one_hot(i, mm.Dimension("v", 3)).to_numpy().tolist()
    [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    """
    _check_indices(indices, "one_hot")
    dim = _new_dim(output_dim, "one_hot")
    dt = as_dtype(dtype)
    on, off = fill_value(on_value, dt, "one_hot on_value"), fill_value(off_value, dt, "one_hot off_value")
    if dim.name in indices.shape:
        raise ShapeError(f"one_hot: output dim {dim.name}:{dim.size} is already in the indices shape {indices.shape}")
    mesh = indices.mesh
    out = indices.shape + Shape([dim])
    out_layout = mesh.plan(out)
    indices = to_layout(indices, out_layout[:-1])
    params = {"output_dim": dim, "on_value": on[()], "off_value": off[()], "dtype": dt,  # (numpy scalars: hashable)
              "mesh_dim": splitting(out_layout[-1], mesh.shape)}
    (y,) = dispatch(ONE_HOT, [indices], [(out, out_layout)], params)
    return y


def _one_hot(ctx, a, output_dim, on_value, off_value, dtype, mesh_dim):
    """The kernel: each index against this rank's global index range of the new dim (in a JAX
    replay, run on into the padding)."""
    xp = ctx.xp
    start, n = ctx.span(output_dim.size, mesh_dim)
    pos = xp.arange(n) + start
    y = xp.where(a[..., None] == pos, xp.asarray(on_value, dtype), xp.asarray(off_value, dtype))
    return y.astype(dtype, copy=False)  # (CuPy's where of two bfloat16 arrays gives float32)


def _one_hot_numpy(ctx, a, output_dim, on_value, off_value, dtype, mesh_dim):
    """numpy's kernel: `off` everywhere, then `on` written at each index in range (no comparison array)."""
    start, n = ctx.span(output_dim.size, mesh_dim)
    out = np.full(a.shape + (n,), off_value, dtype)
    if out.size == 0:
        return out
    i = np.asarray(a, np.int64).reshape(-1) - start
    rows = np.flatnonzero((i >= 0) & (i < n))
    out.reshape(-1, n)[rows, i[rows]] = on_value
    return out


ONE_HOT = OpDef("one_hot", _one_hot, kernels={"numpy": _one_hot_numpy}, fill="position")


# -------------------------------------------------------------------------------------- gather

class _GatherPlan(NamedTuple):
    """Static index arithmetic of the local lookup: transposes of both slices and of the result."""
    n_shared: int
    n_iother: int
    n_oonly: int
    wperm: tuple
    iperm: tuple
    operm: tuple


@lru_cache(maxsize=1024)
def _gather_plan(wnames: tuple, inames: tuple, v: str, onames: tuple) -> _GatherPlan:
    """The plan of a lookup along `v` (names only: the local sizes, which may differ between ranks,
    are read off the slices)."""
    others = [n for n in wnames if n != v]
    shared = [n for n in inames if n in others]  # batch dims of a batched lookup
    iother = [n for n in inames if n not in shared]
    oonly = [n for n in others if n not in shared]
    order = iother + shared + oonly
    return _GatherPlan(len(shared), len(iother), len(oonly), tuple(wnames.index(n) for n in [v] + shared + oonly),
                       tuple(inames.index(n) for n in iother + shared), tuple(order.index(n) for n in onames))


def gather(weights, indices, dim, dtype=None):
    """Embedding lookup: `out[i..., o...] = weights[indices[i...], o...]` along `dim`, cast to
    `dtype` if given (each rank casts its rows before they are combined: a bfloat16 lookup of a float32
    table moves 16-bit words). The output has indices' dims, then weights' other dims (dims in both
    are batch dims). Indices outside `[0, dim.size)` give zeros. With `dim` split over mesh dim m each
    rank looks up its own range and one allreduce over m combines them. The gradient w.r.t. `weights`
    (in weights' dtype) is a scatter-add keeping dim's split; `indices` get none.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> w = mesh.from_numpy(np.arange(6.0).reshape(3, 2), "v:3;d:2")
    >>> y = mm.gather(w, mesh.from_numpy(np.array([2, 0, 7]), "b:3"), "v")
    >>> y.shape, y.to_numpy().tolist()
    (Shape('[b:3, d:2]'), [[4.0, 5.0], [0.0, 1.0], [0.0, 0.0]])
    """
    _check_indices(indices, "gather")
    if indices.mesh is not tensor_arg("gather", weights, "weights").mesh:
        raise MpimeshError("gather: weights and indices live on different meshes")
    vdim = _find_dim(weights.shape, dim, "gather")
    if vdim.name in indices.shape:
        raise ShapeError(f"gather: the looked-up dim {vdim.name}:{vdim.size} must not be in the indices "
                         f"shape {indices.shape}")
    mesh = weights.mesh
    out = union_shape([indices.shape, weights.shape.without([vdim.name])], "gather")
    out_layout = mesh.plan(out)
    (wl, il), reduce_mesh = contraction_plan((weights.shape, indices.shape),
                                             (weights.tensor_layout, indices.tensor_layout),
                                             out, out_layout, mesh.shape)
    weights, indices = to_layout(weights, wl), to_layout(indices, il)
    out_dtype = None if dtype is None else as_dtype(dtype)
    params = {"dim": vdim, "reduce_mesh_dims": reduce_mesh,
              "plan": _gather_plan(weights.shape.names, indices.shape.names, vdim.name, out.names),
              "mesh_dim": splitting(wl[weights.shape.index(vdim.name)], mesh.shape), "dtype": out_dtype}
    differentiable = is_float(weights.dtype) and (out_dtype is None or is_float(out_dtype))
    (y,) = dispatch(GATHER if differentiable else GATHER_NO_GRAD, [weights, indices], [(out, out_layout)], params)
    return y


def _gather(ctx, w, i, dim, reduce_mesh_dims, plan, mesh_dim, dtype, numpy=False):
    """The kernel: the rows of this rank's block of `dim` that the indices pick, zeros for indices
    outside it, summed over `reduce_mesh_dims`. `numpy`: numpy's kernel (`take` for a plain lookup,
    no masking pass when every index is in range)."""
    xp, p = ctx.xp, plan
    ns = p.n_shared
    w, i = xp.transpose(w, p.wperm), xp.transpose(i, p.iperm)
    gshape = i.shape + w.shape[1 + ns:]  # iother, shared, oonly: local sizes
    sflat = math.prod(w.shape[1:1 + ns])
    w = w.reshape(w.shape[:1] + (sflat,) + w.shape[1 + ns:])
    i = i.reshape(i.shape[:p.n_iother] + (sflat,))
    nv = w.shape[0]
    if nv:  # a padded block (JAX replay) looks up zeros past its end: the next block's rows are the next's
        wide = np.int32 if dim.size < 2 ** 31 else np.int64  # block positions of the looked-up dim fit
        if np.dtype(i.dtype).kind == "u" or np.dtype(i.dtype).itemsize < np.dtype(wide).itemsize:
            i = i.astype(wide)  # (int8 -100 - 100 wrapped into the block; a block start past int8 raised)
        i = i - ctx.span(dim.size, mesh_dim)[0]  # position inside this rank's block
        valid = (i >= 0) & (i < nv)
        if numpy and sflat == 1:  # a plain lookup: `take`, the same rows as the fancy index
            g = np.expand_dims(np.take(w[:, 0], np.where(valid, i, 0)[..., 0], axis=0), i.ndim - 1)
        else:
            g = w[xp.where(valid, i, 0), xp.arange(sflat)]
        if not numpy or not valid.all():  # (numpy's, looked at: no pass when all are in range)
            g = xp.where(valid.reshape(valid.shape + (1,) * p.n_oonly), g, 0)
            g = g.astype(w.dtype, copy=False)  # (CuPy's where of bfloat16 gives float32)
    else:  # an empty block of the looked-up dim: nothing to look up here
        g = xp.zeros(i.shape + w.shape[2:], w.dtype)
    g = xp.transpose(g.reshape(gshape), p.operm)
    if dtype is not None:  # exact before the sum: each row comes from one rank, zeros from the others
        g = g.astype(dtype)
    return ctx.allreduce(g, reduce_mesh_dims) if reduce_mesh_dims else g


def _gather_numpy(ctx, w, i, **params):
    return _gather(ctx, w, i, numpy=True, **params)


def _gather_abstract(ctx, shapes, w, i, reduce_mesh_dims, dtype, **_) -> tuple:
    """The output's allreduce over the mesh dims that split the looked-up dim."""
    dt = np.dtype(dtype or w.dtype)
    if reduce_mesh_dims:
        ctx.allreduce(Aval(shapes[0], dt), reduce_mesh_dims)
    return (dt,)


def _scatter_hot(indices, dim: Dimension, dtype):
    """The one_hot a gradient scatters through: laid out by the rules in force, unless they put `dim`
    on a mesh dim that one of the indices dims takes too (a tensor uses a mesh dim once, e.g.
    "batch:all;vocab:all"); then `dim` stays whole in the one_hot and the einsum after it splits
    the result."""
    mesh = indices.mesh
    rules = mesh.layout
    m = rules.mesh_dim(dim.name)
    if m is None or all(rules.mesh_dim(n) != m for n in indices.shape.names):
        return one_hot(indices, dim, dtype=dtype)
    with layout_scope(mesh, [(t, x) for t, x in rules.pairs if t != dim.name]):
        return one_hot(indices, dim, dtype=dtype)


def _gather_grad(op, dy):
    """Scatter-add of dy into the looked-up rows (out-of-range indices add nothing)."""
    weights, indices = op.inputs
    if dy.dtype != weights.dtype:  # a lookup cast to another dtype: scatter-add in weights' own
        dy = cast(dy, weights.dtype)
    hot = _scatter_hot(indices, op.params["dim"], dy.dtype)
    with partial_for(weights):  # an embedding's gradient summed over the batch may wait in a bucket
        return [grad_einsum([hot, dy], weights), None]


GATHER = OpDef("gather", _gather, kernels={"numpy": _gather_numpy}, grad=_gather_grad, saves=((1,), ()),
               fill="position", abstract=_gather_abstract)
GATHER_NO_GRAD = OpDef("gather", _gather, kernels={"numpy": _gather_numpy}, fill="position",
                       abstract=_gather_abstract)


# -------------------------------------------------------------------------------- top_k, argmax

def _candidate_layout(x, axis: int, others: TensorLayout) -> tuple:
    """x's layout for a search along `axis`: the other dims as `others` say; the searched dim
    keeps its split if its mesh dim is free. Returns (layout, mesh dim of the searched dim)."""
    m = splitting(x.tensor_layout[axis], x.mesh.shape)
    if m in others:
        m = None
    return others[:axis] + (m,) + others[axis:], m


def _candidates(size: int, k: int, kr: int) -> int:
    """How many candidates the ranks send in all: min(k, block length) from each of the `kr` blocks of
    a dim of `size` (none from an empty block). Those counts are `numpy.array_split`'s of their
    total (the block lengths are, and min with k keeps that), the `size` the allgathers are told."""
    return sum(min(k, n) for n in block_sizes(size, kr))


def _exchange(ctx, vals, idx, size: int, k: int, m: str, a: int) -> tuple:
    """Every rank's candidates along axis `a` (values, and local positions that become global)
    gathered over mesh dim `m`, which splits a dim of `size`. Candidates arrive in coordinate
    order, so among equal values a lower global position comes first."""
    idx = (idx + ctx.span(size, m)[0]).astype(np.int32)
    total = _candidates(size, k, ctx.size((m,)))
    return ctx.allgather(vals, m, a, size=total), ctx.allgather(idx, m, a, size=total)


def _count_exchange(ctx, x, size: int, k: int, m: str, a: int) -> None:
    """`_exchange`'s allgathers in a dry run: of coordinate 0's min(k, n) candidates of block `x`."""
    shape = x.shape[:a] + (min(k, x.shape[a]),) + x.shape[a + 1:]
    total = _candidates(size, k, ctx.size((m,)))
    for dt in (x.dtype, np.int32):
        ctx.allgather(Aval(shape, dt), m, a, size=total)


def _take(a, axis: int, k: int):
    return a[(slice(None),) * axis + (slice(0, k),)]


def _top(xp, a, axis: int, k: int, numpy: bool = False):
    """The k largest along `axis`, descending, ties to the lower position: (values, positions).

    The generic kernel (CuPy, JAX) sorts the whole row (stably: CuPy's and JAX's argsort are; CuPy
    sorts no 16-bit float, so those are sorted as float32, which holds them exactly). numpy's
    (`numpy`) for small k partitions to find the k-th largest value t; the winners are every value
    above t and the lowest-placed values equal to t, and only those k are sorted (O(n + k log k) per
    row instead of a full sort); NaNs take the full sort, which numpy makes stable when asked."""
    key = a.astype(np.int8) if a.dtype.kind == "b" else a
    if not numpy:
        if is_low_precision(key.dtype):
            key = key.astype(np.float32)
        order = _take(xp.argsort(_reversed(key), axis=axis), axis, k)  # (CuPy's takes no `kind=`)
        return xp.take_along_axis(a, order, axis=axis), order
    n = a.shape[axis]
    if 4 * k > n or ((key.dtype.kind == "c" or is_float(key.dtype)) and bool(np.isnan(key).any())):
        order = _take(np.argsort(_reversed(key), axis=axis, kind="stable"), axis, k)
        return np.take_along_axis(a, order, axis=axis), order
    key = np.moveaxis(key, axis, -1)
    t = np.partition(key, n - k, axis=-1)[..., n - k:n - k + 1]
    above, tied = key > t, key == t
    need = k - above.sum(-1, keepdims=True)
    chosen = above | (tied & (np.cumsum(tied, -1) <= need))  # exactly k per row, in position order
    pos = np.nonzero(chosen)[-1].reshape(key.shape[:-1] + (k,))
    order = np.argsort(_reversed(np.take_along_axis(key, pos, -1)), axis=-1, kind="stable")
    pos = np.moveaxis(np.take_along_axis(pos, order, -1), -1, axis)
    return np.take_along_axis(a, pos, axis=axis), pos


def _reversed(key):
    """Keys in the opposite order: `~key` for integers (-key overflows at the most negative int, and
    an unsigned one cast to int64 wrapped), `-key` for floats."""
    return ~key if np.dtype(key.dtype).kind in "iu" else -key


def top_k(x, reduced_dim, k_dim):
    """The `k_dim.size` largest values along `reduced_dim` and their global positions (int32).

    Both outputs are shaped like x with `reduced_dim` replaced in place by `k_dim`; values are
    in descending order, ties go to the lower position. Over a split dim each rank sends only
    its min(k, local size) candidates (values and indices: two allgathers). The gradient
    scatters dy back to the winning positions; the indices get none.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> x = mesh.from_numpy(np.array([1.0, 5.0, 5.0, 2.0]), "v:4")
    >>> v, i = mm.top_k(x, "v", "k:3")
    >>> v.to_numpy().tolist(), i.to_numpy().tolist()
    ([5.0, 5.0, 2.0], [1, 2, 3])
    """
    r = _find_dim(tensor_arg("top_k", x).shape, reduced_dim, "top_k")
    if r.size == 0:
        raise ShapeError(f"top_k: reduced dim {r.name}:0 of shape {x.shape} is empty: it has no largest values")
    kd = _new_dim(k_dim, "top_k")
    if kd.name in x.shape:
        raise ShapeError(f"top_k: k_dim {kd.name}:{kd.size} must be a new dim, but x has {x.shape}")
    if not 1 <= kd.size <= r.size:
        raise ShapeError(f"top_k: k_dim {kd.name}:{kd.size} must have a size in 1..{r.size} "
                         f"(the size of reduced dim {r.name!r})")
    mesh = x.mesh
    a = x.shape.index(r.name)
    out = Shape(x.shape.dims[:a] + (kd,) + x.shape.dims[a + 1:])
    out_layout = mesh.plan(out)
    target, mr = _candidate_layout(x, a, out_layout[:a] + out_layout[a + 1:])
    x = to_layout(x, target)
    params = {"reduced_dim": r, "k_dim": kd, "mesh_dim": mr, "axis": a,
              "k_mesh_dim": splitting(out_layout[a], mesh.shape)}
    values, indices = dispatch(TOP_K if is_float(x.dtype) else TOP_K_NO_GRAD, [x], [(out, out_layout)] * 2, params)
    return values, indices


def _top_k(ctx, xa, reduced_dim, k_dim, mesh_dim, axis, k_mesh_dim, numpy=False):
    """The kernel: this block's candidates (all of them where there are no more than k), over a split
    `reduced_dim` gathered from every rank and searched again; this rank's block of the k winners."""
    xp, a, k = ctx.xp, axis, k_dim.size
    n = xa.shape[a]  # this rank's block: possibly shorter than k, or empty
    if mesh_dim and k >= n:  # every local element is a candidate: no local sort needed
        vals = xa
        idx = xp.broadcast_to(xp.arange(n, dtype=np.int32).reshape((n,) + (1,) * (xa.ndim - a - 1)), xa.shape)
    else:
        vals, idx = _top(xp, xa, a, k, numpy)
        idx = idx.astype(np.int32)
    if mesh_dim:
        vals, idx = _exchange(ctx, vals, idx, reduced_dim.size, k, mesh_dim, a)
        vals, pos = _top(xp, vals, a, k, numpy)
        idx = xp.take_along_axis(idx, pos, axis=a)
    if k_mesh_dim:
        vals, idx = ctx.block(vals, k_mesh_dim, a), ctx.block(idx, k_mesh_dim, a)
    return vals, idx


def _top_k_numpy(ctx, xa, **params):
    return _top_k(ctx, xa, numpy=True, **params)


def _top_k_abstract(ctx, shapes, x, reduced_dim, k_dim, mesh_dim, axis, **_) -> tuple:
    if mesh_dim:
        _count_exchange(ctx, x, reduced_dim.size, k_dim.size, mesh_dim, axis)
    return x.dtype, np.dtype(np.int32)


def _top_k_grad(op, dvalues, dindices):
    """dy scattered back to the winning positions (einsum of one_hot(indices, reduced_dim) with dy)."""
    x, indices = op.inputs[0], op.outputs[1]
    hot = _scatter_hot(indices, op.params["reduced_dim"], dvalues.dtype)
    return [einsum([hot, dvalues], output_shape=x.shape)]


TOP_K = OpDef("top_k", _top_k, kernels={"numpy": _top_k_numpy}, grad=_top_k_grad, saves=((), (1,)), fill="lowest",
              abstract=_top_k_abstract)
TOP_K_NO_GRAD = OpDef("top_k", _top_k, kernels={"numpy": _top_k_numpy}, fill="lowest", abstract=_top_k_abstract)


def argmax(x, reduced_dim):
    """The global position (int32) of the largest value along `reduced_dim`, the lowest on ties.

    Over a split dim each rank sends one candidate per output element (value and index). No gradient.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> x = mesh.from_numpy(np.array([[1.0, 7.0, 7.0], [9.0, 0.0, 9.0]]), "b:2;v:3")
    >>> mm.argmax(x, "v").to_numpy().tolist()
    [1, 0]
    """
    r = _find_dim(tensor_arg("argmax", x).shape, reduced_dim, "argmax")
    if r.size == 0:
        raise ShapeError(f"argmax: reduced dim {r.name}:0 of shape {x.shape} is empty: it has no maximum")
    mesh = x.mesh
    a = x.shape.index(r.name)
    out = x.shape.without([r.name])
    out_layout = mesh.plan(out)
    target, mr = _candidate_layout(x, a, out_layout)
    x = to_layout(x, target)
    (y,) = dispatch(ARGMAX, [x], [(out, out_layout)], {"reduced_dim": r, "mesh_dim": mr, "axis": a})
    return y


def _argmax(ctx, xa, reduced_dim, mesh_dim, axis):
    """The kernel: the first maximum (the lowest position on ties); over a split `reduced_dim`, each
    rank's one candidate gathered, and the first maximum among them (the lowest coordinate)."""
    xp, a = ctx.xp, axis
    if not mesh_dim:
        return xp.argmax(xa, axis=a).astype(np.int32)
    if xa.shape[a]:
        li = xp.expand_dims(xp.argmax(xa, axis=a), a)
    else:  # an empty block: no candidate
        li = xp.zeros(xa.shape, dtype=np.int32)
    vals, idx = _exchange(ctx, xp.take_along_axis(xa, li, axis=a), li, reduced_dim.size, 1, mesh_dim, a)
    j = xp.expand_dims(xp.argmax(vals, axis=a), a)
    return xp.squeeze(xp.take_along_axis(idx, j, axis=a), axis=a)


def _argmax_abstract(ctx, shapes, x, reduced_dim, mesh_dim, axis) -> tuple:
    if mesh_dim:
        _count_exchange(ctx, x, reduced_dim.size, 1, mesh_dim, axis)
    return (np.dtype(np.int32),)


ARGMAX = OpDef("argmax", _argmax, fill="lowest", abstract=_argmax_abstract)
