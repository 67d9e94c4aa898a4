"""Weight sharding (GSPMD's 2-D weight sharding, ZeRO-3, PyTorch's FSDP): `shard_weights` splits each
float parameter additionally over mesh dims of its choice, so that no rank keeps a whole copy.

An einsum gathers such a weight just before its use (its inputs' relayout) and the gathered copy dies
after it (the forward release frees it; the backward gathers it again: FSDP's reshard-after-forward);
the weight's gradient is reduce-scattered into the weight's layout (`mm.gradients` leaves the einsum's
sum pending through the gather); optimizer slots made from the sharded parameters are laid out like
them. The rule for picking a dim is in `shard_weights`. More: docs/weight_sharding.md.

>>> from mpimesh import Shape
>>> pick_dim(Shape("d:4;f:6"), (None, None), 2), pick_dim(Shape("d:5;f:3"), (None, None), 2)
('f', 'd')
>>> pick_dim(Shape("d:4;f:6"), (None, "cols"), 2), pick_dim(Shape("s:1"), (None,), 2)
('d', None)
"""
from __future__ import annotations

from typing import Mapping, Optional

from .backend import is_float
from .errors import LayoutError, MpimeshError
from .layout import pick_dim
from .ops.relayout import to_layout
from .tree import flatten, named_leaves, unflatten


def shard_weights(params, over: str, dims: Optional[Mapping] = None):
    """`params` (a dict, nested allowed) with each float tensor additionally split over the mesh dim
    `over` (or several, `"rows+cols"`), values unchanged. Per tensor and mesh dim: the tensor dim
    `dims[key]` where given (`key` the leaf's '/'-joined path; a name, or one per mesh dim of `over`),
    else its largest dim not yet split whose size the mesh dim divides, else its largest dim at least
    as long as the mesh dim (uneven blocks); a tensor with no such dim, or already split over that mesh
    dim, stays as it is for it, as every tensor does for a mesh dim of size 1. A collective: call it on
    every rank."""
    leaves, structure = flatten(params)
    names = [name for name, _ in named_leaves(params)]
    tensors = [t for t in leaves if hasattr(t, "tensor_layout")]
    if not tensors:
        return params
    mesh = tensors[0].mesh
    wanted = _mesh_dims(over, mesh)
    dims = dict(dims or {})
    unknown = sorted(set(dims) - set(names))
    if unknown:
        raise MpimeshError(f"shard_weights: dims names {unknown}, which are not parameters; they are: "
                           f"{', '.join(names)}")
    out = []
    for name, t in zip(names, leaves):
        if not hasattr(t, "tensor_layout") or not is_float(t.dtype):
            out.append(t)
            continue
        given = dims.get(name)
        given = (given,) * len(wanted) if given is None or isinstance(given, str) else tuple(given)
        if len(given) != len(wanted):
            raise MpimeshError(f"shard_weights: dims[{name!r}] gives {len(given)} dims {given} for the "
                               f"{len(wanted)} mesh dims {'+'.join(wanted)}")
        layout = list(t.tensor_layout)
        for m, d in zip(wanted, given):
            if m in layout:
                continue
            axis = _axis(name, t, layout, m, d)
            if axis is not None and mesh.shape[m].size > 1:
                layout[axis] = m
        out.append(to_layout(t, tuple(layout)) if tuple(layout) != t.tensor_layout else t)
    return unflatten(structure, out)


def _mesh_dims(over: str, mesh) -> tuple:
    """The mesh dims of `over` ("rows" or "rows+cols"), checked against the mesh."""
    if not isinstance(over, str) or not over:
        raise MpimeshError(f"shard_weights: over must name mesh dims ('rows' or 'rows+cols'), got {over!r}")
    wanted = tuple(m.strip() for m in over.split("+"))
    for m in wanted:
        if m not in mesh.shape:
            raise LayoutError(f"shard_weights: {m!r} is not a dim of the mesh {mesh.shape}")
    if len(set(wanted)) != len(wanted):
        raise MpimeshError(f"shard_weights: over names a mesh dim twice: {over!r}")
    return wanted


def _axis(name: str, t, layout: list, m: str, dim: Optional[str]) -> Optional[int]:
    """The axis of `t` to split over mesh dim `m`: `dim`'s, or the rule's choice; None: none fits."""
    k = t.mesh.shape[m].size
    if dim is not None:
        if dim not in t.shape:
            raise MpimeshError(f"shard_weights: {name!r} ({t.shape}) has no dim {dim!r}")
        axis = t.shape.index(dim)
        if layout[axis] is not None:
            raise LayoutError(f"shard_weights: {name!r}'s dim {dim}:{t.shape[dim].size} is split over "
                              f"{layout[axis]!r} already; a dim is split over one mesh dim")
        return axis
    dim = pick_dim(t.shape, tuple(layout), k)
    return None if dim is None else t.shape.index(dim)

