"""Einsum by dim names: a local contraction on each rank's slices, then one allreduce over the
mesh dims of the reduced dims that are split (`EINSUM` declares it, with a kernel per array module).

Inputs of 16-bit floats are contracted in float32: each rank multiplies its blocks into float32 (numpy
upcasts them; on CuPy a cuBLAS GEMM reads the 16-bit words, `mpimesh.gemm`), the float32 partials are
summed across ranks and rounded once to the inputs' promoted dtype (`mm.result_type`). Inputs of an
integer and a float dtype are contracted in the float's (int32 with float32 in float32).

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x, w = mesh.from_numpy(np.ones((2, 3)), "b:2;i:3"), mesh.from_numpy(np.ones((3, 4)), "i:3;h:4")
>>> y = mm.einsum([x, w])
>>> y.shape, float(y.to_numpy()[0, 0])
(Shape('[b:2, h:4]'), 3.0)
"""
from __future__ import annotations

import math
import string
from collections import Counter
from contextlib import nullcontext
from functools import lru_cache, partial
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
import opt_einsum

from ..backend import accumulation_dtype, align, contiguous, is_low_precision, result_type
from .. import counters
from ..errors import MeshError, ShapeError
from ..layout import TensorLayout, local_sizes, plan_layout
from ..opdef import ALL, Aval, OpDef
from ..partials import claim, partial_for, pending, summable
from ..promotion import cast_operands, operand_casts
from ..shape import Shape, ShapeLike, dim_names, union_shape
from ..tensor import DistTensor
from ..trace import dispatch
from ..gemm import (gpu_matmul, gpu_rounding_matmul, gpu_widening_matmul, jax_widening_matmul, rounding_matmul,
                     tf32_math)
from .relayout import relayout_plan, sum_partial, to_layout
from .rowwise import column_sums, fused_rows

_LETTERS = string.ascii_letters


@lru_cache(maxsize=4096)
def contraction_plan(in_shapes: tuple, in_layouts: tuple, out_shape: Shape, out_layout: TensorLayout,
                     mesh_shape: Shape, scatter: bool = False) -> tuple:
    """How to compute a contraction of inputs into `out_shape` laid out as `out_layout`.

    Returns `(input_layouts, reduce_mesh_dims)`: the layout each input must have (output dims
    as in the output; each reduced dim keeps the first input's split when its mesh dim is free)
    and the mesh dims to sum over afterwards. `scatter`: a reduced dim also keeps a split over a mesh
    dim the output splits (its output dim is then computed whole, the sum a reduce-scatter).
    """
    all_dims = union_shape(in_shapes, "einsum")
    for d in out_shape:
        if d.name not in all_dims:
            raise ShapeError(f"output dim {d.name!r} (size {d.size}) is in no input: inputs "
                             f"{', '.join(str(s) for s in in_shapes)}")
        if all_dims[d.name].size != d.size:
            raise ShapeError(f"output dim {d.name!r} has size {d.size}, inputs have {all_dims[d.name].size}")
    comp = dict(zip(out_shape.names, out_layout))
    used = {m for m in out_layout if m}
    reduce_mesh = []
    for d in all_dims:
        if d.name in comp:
            continue
        choice = None
        for shape, layout in zip(in_shapes, in_layouts):
            if d.name in shape:
                m = layout[shape.index(d.name)]
                if m and m not in reduce_mesh and (scatter or m not in used) and mesh_shape[m].size > 1:
                    choice = m
                    break
        comp[d.name] = choice
        if choice:
            used.add(choice)
            reduce_mesh.append(choice)
    for n, m in zip(out_shape.names, out_layout):
        if m in reduce_mesh:
            comp[n] = None  # computed whole here, then reduce-scattered
    targets = tuple(tuple(comp[n] for n in s.names) for s in in_shapes)
    reduce_mesh = tuple(m for m in mesh_shape.names if m in reduce_mesh)
    return targets, reduce_mesh


def _moved(shape: Shape, mesh_shape: Shape, src: TensorLayout, dst: TensorLayout) -> float:
    """Elements a rank sends to take a tensor from layout `src` to `dst` (`relayout_plan`'s steps)."""
    local = shape.size / math.prod(mesh_shape[m].size for m in src if m)
    sent = 0.0
    for step in relayout_plan(shape, mesh_shape, src, dst):
        k = mesh_shape[step[1]].size
        if step[0] == "slice":
            local /= k
        elif step[0] == "allgather":
            local *= k
            sent += local * (k - 1) / k
        else:
            sent += local * (k - 1) / k
    return sent


@lru_cache(maxsize=4096)
def scatters(in_shapes: tuple, in_layouts: tuple, out_shape: Shape, out_layout: TensorLayout,
             mesh_shape: Shape) -> bool:
    """Whether a contraction sends fewer elements computing the output dims split over a mesh dim a
    reduced dim is split over whole, then reduce-scattering them (the partial sums a weight's gradient
    holds over the data-parallel dim: GSPMD's, FSDP's), than relaying its inputs out for the plain plan.

    >>> scatters((Shape("b:8;d:4"), Shape("b:8;f:4")), (("rows", None), ("rows", None)), Shape("d:4;f:4"),
    ...          ("rows", None), Shape("rows:2"))
    True
    """
    def sent(scatter: bool) -> float:
        targets, summed = contraction_plan(in_shapes, in_layouts, out_shape, out_layout, mesh_shape, scatter)
        moved = sum(_moved(s, mesh_shape, src, dst) for s, src, dst in zip(in_shapes, in_layouts, targets))
        whole = {m for m in summed if m in out_layout}
        block = out_shape.size / math.prod(mesh_shape[m].size for m in out_layout if m and m not in whole)
        for m in sorted(summed, key=lambda m: m in whole):  # the allreduce first, as `sum_kernel`
            k = mesh_shape[m].size
            moved += block * (k - 1) / k * (1 if m in whole else 2)
            block /= k if m in whole else 1
        return moved
    return any(m in out_layout for m in contraction_plan(in_shapes, in_layouts, out_shape, out_layout, mesh_shape,
                                                         True)[1]) and sent(True) < sent(False)


def _subscripts(in_names: tuple, out_names: tuple) -> str:
    letters = {}
    for names in in_names + (out_names,):
        for n in names:
            if n not in letters:
                if len(letters) == len(_LETTERS):
                    raise ShapeError(f"einsum supports at most {len(_LETTERS)} distinct dims")
                letters[n] = _LETTERS[len(letters)]
    return ",".join("".join(letters[n] for n in names) for names in in_names) + "->" + \
        "".join(letters[n] for n in out_names)


@lru_cache(maxsize=4096)
def _expression(subscripts: str, shapes: tuple):
    _, info = opt_einsum.contract_path(subscripts, *shapes, shapes=True)
    return opt_einsum.contract_expression(subscripts, *shapes), int(info.opt_cost)


def contraction_flops(subscripts: str, shapes: tuple) -> int:
    """The flops of the einsum `subscripts` of blocks of `shapes` along opt_einsum's path: 2 per
    multiply-add (a matmul's 2·m·k·n; 1 per element of a reordering).

    >>> contraction_flops("ab,bc->ac", ((2, 3), (3, 4))), contraction_flops("ab->ba", ((2, 3),))
    (48, 6)
    """
    return _expression(subscripts, tuple(tuple(s) for s in shapes))[1]


@lru_cache(maxsize=4096)
def pair_plan(subscripts: str) -> Optional[tuple]:
    """`(swap, axes_a, axes_b)` when a two-input contraction is one `tensordot` whose result is
    already in output order (C-contiguous: no transposed copy later), else None.

    >>> pair_plan("ab,ac->bc"), pair_plan("ab,bc->ca")
    ((False, (0,), (0,)), (True, (0,), (1,)))
    """
    ins, out = subscripts.split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    a, b = parts
    if len(set(a)) < len(a) or len(set(b)) < len(b) or any(c in a and c in b for c in out):
        return None  # repeated (diagonal) or batch dims
    shared = [c for c in a if c in b]
    if any(c not in out for c in a + b if c not in shared):
        return None  # a dim summed within one input
    a_free, b_free = "".join(c for c in a if c not in shared), "".join(c for c in b if c not in shared)
    axes_a, axes_b = tuple(a.index(c) for c in shared), tuple(b.index(c) for c in shared)
    if out == a_free + b_free:
        return False, axes_a, axes_b
    if out == b_free + a_free:
        return True, axes_b, axes_a
    return None


def sum_plan(subscripts: str) -> Optional[tuple]:
    """`(perms, summed, out_perm)` when the einsum is a sum of its inputs' elementwise product: one
    or two inputs over the same dims, none repeated (a bias's gradient "abc->c", a gain's "abc,abc->c").
    `perms`: each further input's axes in the first's order; `summed`: the first's axes summed away;
    `out_perm`: the kept axes into output order (None: already). Else None.

    >>> sum_plan("abc,cab->c"), sum_plan("ab->ba"), sum_plan("ab,bc->ac")
    (((None, (1, 2, 0)), (0, 1), None), ((None,), (), (1, 0)), None)
    """
    ins, out = subscripts.split("->")
    parts = ins.split(",")
    first = parts[0]
    if len(parts) > 2 or any(len(set(p)) < len(p) or set(p) != set(first) for p in parts) or not set(out) <= set(first):
        return None
    perms = tuple(None if p == first else tuple(p.index(c) for c in first) for p in parts)
    kept = [c for c in first if c in out]
    return (perms, tuple(i for i, c in enumerate(first) if c not in out),
            None if "".join(kept) == out else tuple(kept.index(c) for c in out))


def summed_product(xp, arrays: list, plan: tuple):
    """The einsum `sum_plan` describes, as one multiply and one sum, or, where leading axes of
    C-contiguous CuPy blocks in one order are summed (a bias's gradient), as the column-sum kernel
    of `mpimesh.ops.rowwise`: on CuPy, instead of `cupy.einsum`'s cuBLAS GEMV (slow for these
    shapes, and not capturable in a CUDA graph).

    >>> a, b = np.arange(6.0).reshape(2, 3), np.arange(6.0).reshape(3, 2)
    >>> summed_product(np, [a, b], sum_plan("ab,ba->b")).tolist() == np.einsum("ab,ba->b", a, b).tolist()
    True
    """
    perms, summed, out_perm = plan
    k = len(summed)
    if summed == tuple(range(k)) and out_perm is None and all(p is None for p in perms) and k < arrays[0].ndim \
            and fused_rows(xp, *arrays) and all(a.flags.c_contiguous for a in arrays):  # leading axes summed
        rows = math.prod(arrays[0].shape[:k])
        return column_sums(xp, arrays, rows, math.prod(arrays[0].shape[k:])).reshape(arrays[0].shape[k:])
    y = arrays[0]
    for x, perm in zip(arrays[1:], perms[1:]):
        y = y * (x if perm is None else x.transpose(perm))
    if summed:
        y = y.sum(axis=summed)
    return y if out_perm is None else y.transpose(out_perm)


@lru_cache(maxsize=4096)
def batched_plan(subscripts: str, shapes: tuple) -> Optional[tuple]:
    """`(swap, perm_a, shape_a, perm_b, shape_b, shape_c, perm_c, into, (n_batch, n_a, n_b))`: a
    two-input contraction with batch dims (or an output order tensordot cannot give) as one `matmul`
    of the inputs transposed by `perm_a`, `perm_b` (None: as they are; the batch axes, then a's free or
    b's contracted axes, then the others: `n_batch`, `n_a`, `n_b` of them, `_operand`) and reshaped to
    [batch, free, contracted] @ [batch, contracted, free], then reshaped to `shape_c` and transposed by
    `perm_c` (a's and b's swapped where `swap`). `into`: the permutation viewing the output as the
    matmul's result where that view needs no copy (each input's free dims adjacent and in order in the
    output), so the matmul writes the output in place; else None. None where the plan does not apply
    (a dim repeated or summed within one input, nothing contracted, or a matrix-vector product at most).

    >>> batched_plan("gsm,gse->egm", ((2, 3, 4), (2, 3, 5)))
    (True, (0, 2, 1), (2, 5, 3), None, (2, 3, 4), (2, 5, 4), (1, 0, 2), (1, 0, 2), (1, 1, 1))
    """
    ins, out = subscripts.split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    a, b = parts
    if len(set(a)) < len(a) or len(set(b)) < len(b) or any(c not in out and not (c in a and c in b) for c in a + b):
        return None
    size = {c: n for sub, shp in zip(parts, shapes) for c, n in zip(sub, shp)}
    con = [c for c in a if c in b and c not in out]
    batch = [c for c in out if c in a and c in b]
    free_a, free_b = [c for c in out if c in a and c not in b], [c for c in out if c in b and c not in a]
    n_a, n_b, k = (math.prod(size[c] for c in cs) for cs in (free_a, free_b, con))
    if k <= 1 or min(n_a, n_b) <= 1:
        return None
    swap = out.index(free_b[0]) < out.index(free_a[0]) if free_a and free_b else False
    if swap:
        a, b, free_a, free_b, n_a, n_b = b, a, free_b, free_a, n_b, n_a
    lead = tuple(size[c] for c in batch)
    order = batch + free_a + free_b

    def perm(sub, cs):
        p = tuple(sub.index(c) for c in cs)
        return None if p == tuple(range(len(p))) else p
    pc = perm("".join(order), list(out))
    into = None
    if pc is not None and all(_adjacent(out, cs) for cs in (free_a, free_b)):
        into = tuple(out.index(c) for c in order)
    return (swap, perm(a, batch + free_a + con), lead + (n_a, k), perm(b, batch + con + free_b), lead + (k, n_b),
            tuple(size[c] for c in order), pc, into, (len(batch), len(free_a), len(con)))


def _adjacent(out: str, dims: list) -> bool:
    """Whether `dims` appear in `out` side by side and in this order (so they merge into one axis)."""
    at = [out.index(c) for c in dims]
    return all(j == i + 1 for i, j in zip(at, at[1:]))


@lru_cache(maxsize=4096)
def default_output(in_shapes: tuple, reduced: Optional[tuple]) -> Shape:
    """Dims that appear in exactly one input (or, with `reduced`, all dims but those)."""
    all_dims = union_shape(in_shapes, "einsum")
    if reduced is not None:
        for n in reduced:
            if n not in all_dims:
                raise ShapeError(f"einsum: reduced dim {n!r} is in no input {list(all_dims.names)}")
        return all_dims.without(reduced)
    counts = Counter(n for s in in_shapes for n in s.names)
    return Shape(tuple(d for d in all_dims if counts[d.name] == 1))


def reduced_dims_arg(op: str, reduced_dims, reduced_dim):
    """The dims to reduce, given as `reduced_dims` or as `reduced_dim` (the contract's spelling for
    the reductions, `mm.einsum`'s for einsum: both are accepted everywhere), not both.

    >>> reduced_dims_arg("reduce_sum", None, "i"), reduced_dims_arg("einsum", ["i", "j"], None)
    ('i', ['i', 'j'])
    """
    if reduced_dim is None:
        return reduced_dims
    if reduced_dims is not None:
        raise ShapeError(f"{op}: give reduced_dims or reduced_dim (two spellings of one argument), not both")
    return reduced_dim


def einsum(xs: Sequence, output_shape: Optional[ShapeLike] = None, reduced_dims=None, *, reduced_dim=None):
    """Contract tensors by dim names (Mesh-TensorFlow's `einsum`).

    Args:
      xs: the input tensors.
      output_shape: the output dims; default: dims in exactly one input, in order of appearance.
      reduced_dims: alternatively, the dims to sum away (all others are kept).
      reduced_dim: another spelling of `reduced_dims` (the reductions' in the contract).
    """
    if reduced_dim is not None:
        reduced_dims = reduced_dims_arg("einsum", reduced_dims, reduced_dim)
    if output_shape is not None and reduced_dims is not None:
        raise ShapeError("einsum: give output_shape or reduced_dims, not both")
    if type(xs) is not list:  # (a list as it is: per-op time; `_einsum` never writes it)
        if hasattr(xs, "tensor_layout") or not hasattr(xs, "__iter__"):
            raise TypeError(f"einsum takes a list of tensors, got a {type(xs).__name__}: mm.einsum([x, w], ...)")
        xs = list(xs)
    if not xs:
        raise ShapeError("einsum needs at least one input")
    mesh = getattr(xs[0], "mesh", None)
    for i, x in enumerate(xs):
        if type(x) is not DistTensor and not hasattr(x, "tensor_layout"):
            raise TypeError(f"einsum: input {i} is a {type(x).__name__}, not a DistTensor (mesh.from_numpy makes one)")
        if x.mesh is not mesh:
            raise MeshError(f"einsum: inputs live on different meshes ({', '.join(str(x.mesh.shape) for x in xs)})")
    out_spec = output_shape if output_shape is None or isinstance(output_shape, (str, Shape)) else Shape(output_shape)
    reduced = tuple(reduced_dims) if isinstance(reduced_dims, list) else reduced_dims
    return _einsum(xs, mesh, out_spec, reduced, None)


def _einsum(xs: list, mesh, out_spec, reduced, layout: Optional[TensorLayout], leave: bool = False):
    """`einsum` of checked inputs, its output laid out as `layout` (None: by the rules in force);
    `leave`: its sum over ranks left pending (a `PartialTensor`, rounded to 16 bits once summed)."""
    if len(xs) == 2:  # the common case, without generators: this is per-op time
        a, b = xs
        shapes, layouts, dtypes = (a.shape, b.shape), (a.tensor_layout, b.tensor_layout), (a.local.dtype, b.local.dtype)
    else:
        shapes, layouts = tuple(x.shape for x in xs), tuple(x.tensor_layout for x in xs)
        dtypes = tuple(x.local.dtype for x in xs)
    mesh_shape, coords = mesh.shape, mesh.coords_key
    out, out_layout, reduce_mesh, plan = _front(shapes, layouts, out_spec, reduced, mesh_shape,
                                                mesh.layout if layout is None else layout, coords, dtypes)
    bucket = claim(result_type(*dtypes)) if pending() else None  # a gradient's sum that may wait in a bucket
    left = leave and reduce_mesh
    if bucket is not None and reduce_mesh and not plan.whole:
        plan = _plan(shapes, layouts, out, out_layout, mesh_shape, coords, dtypes, True, False)
    else:
        bucket = None
        if left:
            plan = _plan(shapes, layouts, out, out_layout, mesh_shape, coords, dtypes, True, bool(plan.whole))
    if layouts != plan.targets:
        xs = [x if x.tensor_layout == t else to_layout(x, t) for x, t in zip(xs, plan.targets)]
    if bucket is not None:  # a bucketed gradient's GEMM writes its slot in the bucket's flat buffer
        into = bucket.slot(mesh, out, out_layout, reduce_mesh, accumulation_dtype(result_type(*dtypes)))
        (y,) = dispatch(EINSUM, xs, [(out, out_layout)], plan.params, out=into, partial=reduce_mesh)
        return bucket.partial(y, plan.out_dtype)
    if left:
        (y,) = dispatch(EINSUM, xs, [(out, plan.layout)], plan.params, partial=reduce_mesh)
        y.rounds_to = plan.out_dtype
        return y
    if plan.whole:  # each rank's sums of the output dims computed whole, then reduce-scattered
        (y,) = dispatch(EINSUM, xs, [(out, plan.layout)], plan.params, partial=plan.whole)
        return to_layout(sum_partial(y, out_layout, plan.out_dtype), out_layout)
    (y,) = dispatch(EINSUM, xs, [(out, out_layout)], plan.params)
    return y


@lru_cache(maxsize=4096)
def _front(in_shapes: tuple, in_layouts: tuple, output_shape, reduced_dims, mesh_shape: Shape, rules,
           coords: tuple, dtypes: tuple) -> tuple:
    """`(output shape, its layout, mesh dims to sum, _plan)` of an einsum call, from its arguments
    (`rules`: the mesh's layout rules, or the output's layout itself)."""
    if output_shape is None:
        reduced = None if reduced_dims is None else dim_names(reduced_dims, union_shape(in_shapes, "einsum"), "einsum")
        out = default_output(in_shapes, reduced)
    else:
        out = Shape(output_shape)
    out_layout = rules if isinstance(rules, tuple) else plan_layout(out, mesh_shape, rules)
    scatter = scatters(in_shapes, in_layouts, out, out_layout, mesh_shape)
    reduce_mesh = contraction_plan(in_shapes, in_layouts, out, out_layout, mesh_shape, scatter)[1]
    return out, out_layout, reduce_mesh, _plan(in_shapes, in_layouts, out, out_layout, mesh_shape, coords, dtypes,
                                               False, scatter)


class _Plan(NamedTuple):
    targets: tuple
    out_dtype: Optional[object]
    layout: TensorLayout  # the kernel's output's: the output's, but for dims it computes whole (`whole`)
    whole: tuple  # the mesh dims whose sums a reduce-scatter takes after the kernel (`scatters`)
    params: dict  # the op record's (shared by every record of this plan: never written)


class Contraction:
    """What an einsum's kernel does on its blocks, planned once per shapes, layouts and dtypes (the
    `plan` param of `EINSUM`, hashed by identity): the operands' `casts`, the opt_einsum expression,
    the `pair`, `bmm` and `sums` plans of its faster paths (each None where it does not apply), the
    planned operand `views` of a two-operand GEMM of C-contiguous blocks, whether operands are 16-bit
    floats (`low`, contracted in float32) and the result is rounded to `out_dtype` here (`rounded`),
    `dtype`: the contraction's own result dtype, before any rounding (what a bucket sums), and `whole`:
    the mesh dims whose sums a reduce-scatter takes after the kernel (`scatters`)."""

    __slots__ = ("casts", "expr", "pair", "bmm", "sums", "views", "low", "out_dtype", "rounded", "dtype", "whole")

    def __init__(self, **fields):
        for k, v in fields.items():
            setattr(self, k, v)


@lru_cache(maxsize=4096)
def _plan(in_shapes: tuple, in_layouts: tuple, out: Shape, out_layout: TensorLayout, mesh_shape: Shape,
          coords: tuple, dtypes: tuple, bucketed: bool, scatter: bool) -> _Plan:
    """Everything an einsum decides from its operands' shapes, layouts and dtypes, once: the inputs'
    layouts, the subscripts, the mesh dims summed here (none where a bucket sums them; `scatter`: those
    of output dims computed whole are left to a reduce-scatter after the kernel), the 16-bit
    result dtype, and the kernel's `Contraction`. Operands of several dtypes are first cast as
    `mpimesh.promotion.operand_casts` says (int32 with float32: float32, not numpy's float64), and the
    rest is planned for their dtypes after that."""
    casts = operand_casts(dtypes) if len(set(dtypes)) > 1 else None
    if casts is not None:
        dtypes = tuple(d if c is None else c for d, c in zip(dtypes, casts))
    targets, reduce_mesh = contraction_plan(in_shapes, in_layouts, out, out_layout, mesh_shape, scatter)
    whole = tuple(m for m in reduce_mesh if m in out_layout)
    layout = tuple(None if m in whole else m for m in out_layout)
    subs = _subscripts(tuple(s.names for s in in_shapes), out.names)
    where = dict(coords)
    local = tuple(local_sizes(s, mesh_shape, t, where) for s, t in zip(in_shapes, targets))
    expr = _expression(subs, local)[0]
    pair = pair_plan(subs)
    bmm = None if pair is not None else batched_plan(subs, local)
    low = any(is_low_precision(d) for d in dtypes)
    out_dtype = result_type(*dtypes) if low else None
    summed = () if bucketed else tuple(m for m in reduce_mesh if m not in whole)
    views = _pair_views(pair, local, dtypes) if pair is not None and pair[1] and not low and not summed else None
    plan = Contraction(casts=casts, expr=expr, pair=pair, bmm=bmm, views=views, low=low, out_dtype=out_dtype,
                       rounded=low and not bucketed and not whole,  # a bucket or the reduce-scatter rounds them
                       sums=None if pair is not None or bmm is not None else sum_plan(subs),
                       dtype=np.result_type(*(accumulation_dtype(d) for d in dtypes)) if low else
                       np.result_type(*dtypes), whole=whole)
    return _Plan(targets, out_dtype, layout, whole, {"subscripts": subs, "reduce_mesh_dims": summed, "plan": plan})


def _pair_views(pair: tuple, local: tuple, dtypes: tuple) -> Optional[tuple]:
    """A two-operand contraction's operand views planned ahead for C-contiguous blocks of the recorded
    shapes (the common case: no per-call planning), `(swap, shape a, shape b, view a, view b, as is,
    result shape)` for `_planned_pair`; None where an operand would be copied."""
    swap, axes_a, axes_b = pair
    (sa, sb), (da, db) = (local[::-1], dtypes[::-1]) if swap else (local, dtypes)
    free_a, free_b = _free(len(sa), axes_a), _free(len(sb), axes_b)
    va = _view_plan(sa, _c_strides(sa, np.dtype(da).itemsize), (), free_a, axes_a)
    vb = _view_plan(sb, _c_strides(sb, np.dtype(db).itemsize), (), axes_b, free_b)
    if va[3] or vb[3]:
        return None
    out_shape = tuple(sa[i] for i in free_a) + tuple(sb[i] for i in free_b)
    same = (va[0] is None and not va[2] and va[1] == sa, vb[0] is None and not vb[2] and vb[1] == sb,
            va[1][:-1] + vb[1][-1:] == out_shape)  # (views and the result's shape that are the arrays as they are)
    return swap, sa, sb, va, vb, same, out_shape


def _planned_pair(xp, matmul, arrays, views: tuple, out):
    """The GEMM `_pair_views` planned, or None where the blocks are not as planned (C-contiguous, of
    the recorded shapes): the general path then runs."""
    swap, sa, sb, va, vb, same, out_shape = views
    a, b = arrays[::-1] if swap else arrays
    if a.shape != sa or b.shape != sb or not (a.flags.c_contiguous and b.flags.c_contiguous):
        return None
    if not same[0]:  # (an operand viewed only where the plan says so: a 2-D matmul makes none, per-op time)
        a = _view(a, va)
    if not same[1]:
        b = _view(b, vb)
    if out is None:
        y = matmul(xp, a, b)
        return y if same[2] else y.reshape(out_shape)
    _into(xp, matmul, True, a, b, out)
    return out


def _view(x, plan: tuple):
    perm, shape, turn, _ = plan
    m = (x if perm is None else x.transpose(perm)).reshape(shape)
    return m.swapaxes(-1, -2) if turn else m


def _c_strides(shape: tuple, itemsize: int) -> tuple:
    """The strides of a C-contiguous array of `shape`."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _matmul(xp, a, b, out=None):
    """`a @ b` (into `out`, where given: a C-contiguous array of the result's shape and dtype)."""
    return xp.matmul(a, b) if out is None else xp.matmul(a, b, out=out)  # (jax.numpy takes no `out`)


def _matmul_numpy(xp, a, b, out=None):
    return np.matmul(a, b, out=out)


def _matmul_cupy(xp, a, b, out=None):
    """`_matmul` through `mpimesh.gemm`'s cuBLAS call, in the matmul precision (CuPy's batched matmul
    ignores TF32, and CuPy's own cuBLAS calls cannot be captured in a CUDA graph)."""
    y = gpu_matmul(xp, a, b, out)
    return y if y is not None else _matmul(xp, a, b, out)


def _no_math(xp):
    return nullcontext()


class _Backend(NamedTuple):
    """What an array module's einsum kernel does its own way (`_contract`)."""

    matmul: Callable  # `matmul(xp, a, b, out=None)`
    widening: Optional[Callable]  # a GEMM of 16-bit operands as they are into float32 sums (`mpimesh.gemm`);
    rounding: Optional[Callable]  # the same rounded once to their dtype; both None: operands upcast first
    gemm_out: bool  # the widening GEMMs write a given `out` themselves (cuBLAS)
    bmm_out: bool  # a batched matmul may write the output through a transposed view of it
    sums: bool  # sums of elementwise products as `summed_product` (not the expression's GEMV)
    views: bool  # the planned GEMM of C-contiguous blocks (`_pair_views`)
    backend: str  # opt_einsum's name for the array module ("auto": the arrays')
    expr_out: bool  # opt_einsum's expression takes `out=`
    math: Callable  # `math(xp)`: the context for the module's own cuBLAS calls (`tf32_math`)


_GENERIC = _Backend(_matmul, jax_widening_matmul, partial(rounding_matmul, widening=jax_widening_matmul), False,
                    False, False, False, "auto", False, _no_math)  # (JAX's: the generic kernel runs a replay)
_NUMPY = _Backend(_matmul_numpy, None, None, False, True, False, True, "numpy", True, _no_math)
_CUPY = _Backend(_matmul_cupy, gpu_widening_matmul, gpu_rounding_matmul, True, False, True, True, "cupy", False,
                 tf32_math)


def _contract(ctx, arrays, plan: Contraction, summed: tuple, out, be: _Backend):
    """The einsum's kernel on backend `be`: this rank's contraction, then the allreduce over `summed`.
    `out` (a bucketed gradient's slot in its bucket, `mpimesh.buckets`; never with `summed`): a
    C-contiguous array of the local result's shape and dtype that the GEMM writes, returned."""
    xp = ctx.xp
    if plan.casts is not None:
        arrays = cast_operands(arrays, plan.casts)
    if plan.views is not None and be.views:
        y = _planned_pair(xp, be.matmul, arrays, plan.views, out)
        if y is not None:
            return y
    pair, bmm, low, out_dtype, rounded = plan.pair, plan.bmm, plan.low, plan.out_dtype, plan.rounded
    # 16-bit inputs: a GPU or a replay multiplies them as they are, into float32 (`mpimesh.gemm`);
    # numpy upcasts this rank's blocks. Either way the allreduce below sums float32 partials and
    # rounds once to the 16-bit result, whose words its second half moves (`allreduce(dtype=)`:
    # 3/4 of a float32 allreduce's bytes). A bucket sums the float32 partials (`mpimesh.buckets`).
    # A result no rank sums is rounded by the GEMM itself on a GPU (`gpu_rounding_matmul`).
    wide = low and be.widening is not None and (bmm is not None or pair is not None and bool(pair[1]))
    if low and not wide:
        arrays = [a.astype(accumulation_dtype(a.dtype)) for a in arrays]
    matmul = be.matmul if not wide else be.rounding if (
        rounded and not summed and out is None and all(a.dtype == out_dtype for a in arrays)) else be.widening
    writes = matmul is be.matmul or be.gemm_out  # whether `matmul` writes a given `out` itself
    if pair is not None:  # opt_einsum may return a transposed view; later ops would pay for that
        a, b = arrays[::-1] if pair[0] else arrays
        if pair[1]:
            y = _tensordot(xp, matmul, writes, a, b, pair[1], pair[2], out)
        else:  # an outer product: BLAS is slow at it (a matmul with one contracted element)
            y = a.reshape(a.shape + (1,) * b.ndim) * b if out is None else \
                xp.multiply(a.reshape(a.shape + (1,) * b.ndim), b, out=out)
    elif bmm is not None:  # numpy's einsum would loop over the batch dims without BLAS
        swap, pa, sa, pb, sb, sc, pc, into, (nb, nf, nk) = bmm
        a, b = arrays[::-1] if swap else arrays
        pa, pb = pa or tuple(range(a.ndim)), pb or tuple(range(b.ndim))
        a = _operand(xp, a, pa[:nb], pa[nb:nb + nf], pa[nb + nf:])
        b = _operand(xp, b, pb[:nb], pb[nb:nb + nk], pb[nb + nk:])
        if pc is None:
            y = _into(xp, matmul, writes, a, b, out).reshape(sc)
        elif into is not None and be.bmm_out:  # the matmul writes the output: no transposed copy
            y = xp.empty(tuple(sc[i] for i in pc), xp.result_type(a, b)) if out is None else out
            view = xp.transpose(y, into).reshape(sa[:-1] + sb[-1:])
            assert view.size == 0 or xp.may_share_memory(view, y), "einsum: output view is a copy"
            xp.matmul(a, b, out=view)
        else:  # the output reordered: a copy, counted
            y = xp.transpose(matmul(xp, a, b).reshape(sc), pc)
            if out is not None:
                y = _write(out, y)
            elif getattr(y, "strides", None) is not None:
                counters.record("copies", (), y.size, y.nbytes)
                y = contiguous(xp, y)
    elif plan.sums is not None and be.sums:
        y = summed_product(xp, arrays, plan.sums)
        if out is not None:
            y = _write(out, y)
    else:
        into = {"out": out} if out is not None and be.expr_out else {}
        with be.math(xp):  # CuPy's matmuls inside opt_einsum's steps follow the matmul precision
            y = plan.expr(*arrays, backend=be.backend, **into)
        if out is not None and y is not out:
            y = _write(out, y)
    if out is not None:  # every path above wrote the result into it
        return out
    if summed:  # a 16-bit result: float32 partials summed across ranks and rounded once (see above)
        return ctx.allreduce(y, summed, dtype=out_dtype if rounded else None)
    return y.astype(out_dtype) if rounded and y.dtype != out_dtype else y  # (rounding_matmul's: rounded)


def _kernel(be: _Backend) -> Callable:
    views, matmul = be.views, be.matmul

    def kernel(ctx, *arrays, plan: Contraction, subscripts: str, reduce_mesh_dims: tuple, out=None):
        if views and plan.views is not None and plan.casts is None:  # (`_contract`'s first path, per-op time)
            y = _planned_pair(ctx.xp, matmul, arrays, plan.views, out)
            if y is not None:
                return y
        return _contract(ctx, arrays, plan, reduce_mesh_dims, out, be)
    return kernel


def _into(xp, matmul, writes: bool, a, b, out):
    """`matmul(xp, a, b)` into `out` (None: a new array), viewed in the product's shape: the one array
    a bucketed gradient's GEMM writes (`mpimesh.buckets`); `writes`: whether `matmul` can write it."""
    if out is None:
        return matmul(xp, a, b)
    out = out.reshape(a.shape[:-1] + b.shape[-1:])
    if writes:
        return matmul(xp, a, b, out)
    return _write(out, matmul(xp, a, b))


def _write(out, y):
    """`y` copied into `out` (a kernel path that cannot compute into it), counted as a copy; `out`."""
    counters.record("copies", (), y.size, y.nbytes)
    out[...] = y
    return out


def _tensordot(xp, matmul, writes: bool, a, b, axes_a: tuple, axes_b: tuple, out=None):
    """`tensordot(a, b, (axes_a, axes_b))` as one `matmul(xp, a2, b2)` of 2-D views (`_operand`),
    into `out` where it can (see `_into`)."""
    free_a, free_b = _free(a.ndim, axes_a), _free(b.ndim, axes_b)
    a2 = _operand(xp, a, (), free_a, axes_a)
    b2 = _operand(xp, b, (), axes_b, free_b)
    y = _into(xp, matmul, writes, a2, b2, out)
    return y.reshape(tuple(a.shape[i] for i in free_a) + tuple(b.shape[i] for i in free_b))


@lru_cache(maxsize=1024)
def _free(ndim: int, axes: tuple) -> tuple:
    """The axes of an `ndim`-array not in `axes`, in order."""
    return tuple(i for i in range(ndim) if i not in axes)


def _merges(shape: tuple, strides: tuple, groups: list) -> bool:
    """Whether the axes of each group (consecutive, in order) merge into one strided axis: a view.

    >>> _merges((2, 3, 4), (96, 32, 8), [[0], [1, 2]]), _merges((3, 2), (8, 24), [[0, 1]])
    (True, False)
    """
    for group in groups:
        dims = [i for i in group if shape[i] != 1]
        for i, j in zip(dims, dims[1:]):
            if strides[i] != strides[j] * shape[j]:
                return False
    return True


def _operand(xp, a, batch, rows, cols):
    """`a`'s axes `batch`, `rows`, `cols` as a [batch..., rows, cols] stack of matrices for a GEMM,
    as a view where the strides allow: directly, or as the transpose of a [batch..., cols, rows]
    view (BLAS and cuBLAS read it with a transpose flag). Else a copy, counted in the profile
    (`"copies"`). Arrays without strides (JAX) are reshaped; XLA lays them out itself.

    >>> x = np.arange(24.0).reshape(2, 3, 4)
    >>> m = _operand(np, x, (), [2], [0, 1])   # [4, 6]: the transpose of x's [6, 4] view
    >>> m.shape, np.shares_memory(m, x), bool((m == x.reshape(6, 4).T).all())
    ((4, 6), True, True)
    """
    perm, shape, swap, copied = _view_plan(a.shape, getattr(a, "strides", None), tuple(batch), tuple(rows),
                                           tuple(cols))
    if copied:
        counters.record("copies", (), a.size, a.nbytes)
    m = (a if perm is None else a.transpose(perm)).reshape(shape)
    return m.swapaxes(-1, -2) if swap else m


@lru_cache(maxsize=4096)
def _view_plan(shape: tuple, strides: Optional[tuple], batch: tuple, rows: tuple, cols: tuple) -> tuple:
    """`(perm, new shape, swap, copied)` for `_operand`: transpose by `perm` (None: as is) and reshape,
    then swap the last two axes if `swap`; `copied` where no view can serve (the reshape copies)."""
    lead = tuple(shape[i] for i in batch)
    r, c = math.prod(shape[i] for i in rows), math.prod(shape[i] for i in cols)
    direct = batch + rows + cols
    plain = (None if direct == tuple(range(len(shape))) else direct), lead + (r, c), False
    if strides is None:
        return (*plain, False)
    groups = [[i] for i in batch]
    if _merges(shape, strides, groups + [list(rows), list(cols)]):
        return (*plain, False)
    if _merges(shape, strides, groups + [list(cols), list(rows)]):
        turned = batch + cols + rows
        return (None if turned == tuple(range(len(shape))) else turned), lead + (c, r), True, False
    return (*plain, True)


def _einsum_grad(op, dy):
    """d/dx_i is the einsum of dy with the other inputs, broadcast over dims only x_i had."""
    grads = []
    for i, x in enumerate(op.inputs):
        if op.needs is not None and not op.needs[i]:
            grads.append(None)  # nothing differentiates this input: skip its einsum and allreduce
            continue
        others = [t for j, t in enumerate(op.inputs) if j != i]
        avail = {n for t in [dy] + others for n in t.shape.names}
        keep = Shape(tuple(d for d in x.shape if d.name in avail))
        whole = keep == x.shape
        with partial_for(x if whole else None):  # in x's layout: a sharded weight's is reduce-scattered
            g = _einsum([dy] + others, x.mesh, keep, None, x.tensor_layout if whole else None,
                        whole and id(x) in summable)
        grads.append(g if keep == x.shape else broadcast(g, x.shape))
    return grads


def _einsum_abstract(ctx, shapes, *ins, plan: Contraction, subscripts: str, reduce_mesh_dims: tuple) -> tuple:
    """The dry run of `_contract`: its result, then the allreduce of it (rounded to 16 bits)."""
    if reduce_mesh_dims:
        y = ctx.allreduce(Aval(shapes[0], plan.dtype), reduce_mesh_dims, dtype=plan.out_dtype if plan.rounded else None)
        return (y.dtype,)
    return (plan.out_dtype if plan.rounded else plan.dtype,)


def _einsum_view(params, ins, outs) -> Optional[int]:
    """0 where the einsum only reorders its one operand's dims, none repeated, at 32 bits or more
    (numpy's einsum may give a view), no sum across ranks."""
    if params["reduce_mesh_dims"] or params["plan"].whole or outs[0].dtype.itemsize <= 2:
        return None
    sub_in, _, sub_out = params["subscripts"].partition("->")
    return 0 if sorted(sub_in) == sorted(sub_out) and len(set(sub_in)) == len(sub_in) else None


EINSUM = OpDef("einsum", _kernel(_GENERIC), kernels={"numpy": _kernel(_NUMPY), "cupy": _kernel(_CUPY)},
               grad=_einsum_grad, saves=(ALL, ()), abstract=_einsum_abstract, view=_einsum_view, gemm=True,
               flops=lambda params, ins, outs: contraction_flops(params["subscripts"], [a.shape for a in ins]))
"""An einsum: `plan` (`Contraction`), `subscripts` and `reduce_mesh_dims` (the mesh dims its kernel sums
over; none where a gradient bucket sums them) are its params."""


def sum_to(g, shape: Shape, like=None):
    """The gradient `g` of a broadcast output summed back to an input's `shape` (an einsum); `like`:
    that input, whose layout the sum takes (a gathered weight's is left pending, as `_einsum_grad`'s).

    >>> import mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> sum_to(mesh.ones("a:2;b:3"), mm.Shape("b:3")).to_numpy().tolist()
    [2.0, 2.0, 2.0]
    """
    if g is None or g.shape == shape:
        return g
    return grad_einsum([g], like) if like is not None and like.shape == shape else einsum([g], output_shape=shape)


def grad_einsum(xs: list, like):
    """The einsum of `xs` into the gradient of input `like`: its shape, in its layout, the sum over ranks
    left pending where `like` is a gathered weight's copy in a `mm.gradients` walk (its relayout's rule
    then reduce-scatters it) and the dtypes agree."""
    leave = id(like) in summable and result_type(*(x.dtype for x in xs)) == like.dtype
    return _einsum(list(xs), like.mesh, like.shape, None, like.tensor_layout, leave)


def broadcast(x, new_shape: ShapeLike):
    """x repeated along the dims of `new_shape` it lacks (and reordered as `new_shape`)."""
    new = Shape(new_shape)
    union_shape([new, x.shape], "broadcast")
    missing = [n for n in x.shape.names if n not in new]
    if missing:
        raise ShapeError(f"broadcast: dims {missing} of {x.shape} are not in the target shape {new}")
    dst = x.mesh.plan(new)
    x = to_layout(x, tuple(dst[new.index(n)] for n in x.shape.names))
    sizes = local_sizes(new, x.mesh.shape, dst, x.mesh.coords)
    (y,) = dispatch(BROADCAST, [x], [(new, dst)], {"shape": new, "dims": x.shape.names, "sizes": sizes})
    return y


def _broadcast(ctx, a, shape: Shape, dims: tuple, sizes: tuple):
    """The kernel: block `a` (axes `dims`) repeated to this rank's block `sizes` of `shape`."""
    xp = ctx.xp
    return contiguous(xp, xp.broadcast_to(align(xp, a, dims, shape.names), sizes))


BROADCAST = OpDef("broadcast", _broadcast, grad=lambda op, dy: [sum_to(dy, op.inputs[0].shape, op.inputs[0])],
                  saves=((), ()))
