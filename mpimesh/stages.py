"""Per-layer parameters and a pipeline's stage-stacked ones, both ways: `stack_layers`, `unstack_stages`.

L layers (in the order they apply) over K = S*V stage entries (S the mesh dim's size, V virtual stages)
give P = L/K trees of tensors with a `stage` dim of size K over the mesh dim (`mm.pipeline`'s); entry
s*V+v applies at position v*S+s and holds layers (v*S+s)*P .. +P-1 (`layer_index`). Values are kept
bitwise: stacking moves nothing where layers are replicated over the mesh dim, unstacking broadcasts
each layer from its stage. Parameters only, outside `mm.trace` (docs/checkpoints.md).

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("stages:1", comm=mm.MPI.COMM_SELF)
>>> layers = [{"w": mesh.from_numpy(np.full(2, float(i)), "d:2")} for i in range(4)]
>>> stacked = stack_layers(layers, "stages", virtual_stages=2)
>>> [s["w"].to_numpy()[:, 0].tolist() for s in stacked], len(unstack_stages(stacked, "stages", 2))
([[0.0, 2.0], [1.0, 3.0]], 4)
"""
from __future__ import annotations

from typing import Sequence

from .collectives.p2p import broadcast_from
from .errors import MeshError, MpimeshError, ShapeError
from .ops.relayout import to_layout
from .pipeline import stage_mesh
from .shape import Dimension, Shape
from .tensor import DistTensor
from .trace import current_trace
from .tree import flatten, named_leaves, unflatten


def layer_index(entry: int, j: int, stages: int, virtual: int, per_stage: int) -> int:
    """The layer held in place `j` of entry `entry` of a stage dim (S `stages`, V `virtual`, P `per_stage`).

    >>> [layer_index(e, 0, 2, 2, 1) for e in range(4)]
    [0, 2, 1, 3]
    """
    s, v = divmod(entry, virtual)
    return (v * stages + s) * per_stage + j


def _mesh_and_sizes(what: str, mesh, mesh_dim: str, virtual: int, layers: int) -> tuple:
    if current_trace() is not None:
        raise MpimeshError(f"{what} converts parameters outside mm.trace: its result is not differentiable")
    if not isinstance(mesh_dim, str) or mesh_dim not in mesh.shape.names:
        raise MeshError(f"{what}: mesh_dim {mesh_dim!r} is not a dim of mesh {mesh.shape}")
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise MpimeshError(f"{what}: virtual_stages must be a positive int, got {virtual!r}")
    S = mesh.shape[mesh_dim].size
    if layers % (S * virtual):
        raise ShapeError(f"{what}: {layers} layers do not fill {S * virtual} stage entries evenly (mesh dim "
                         f"{mesh_dim!r} of size {S} times virtual_stages {virtual}): the layers must be a multiple "
                         f"of {S * virtual}")
    return S, S * virtual, layers // (S * virtual)


def _without(layout: tuple, mesh_dim: str) -> tuple:
    return tuple(None if m == mesh_dim else m for m in layout)


def stack_layers(layers: Sequence, mesh_dim: str, virtual_stages: int = 1, stage_dim: str = "stage") -> list:
    """The P trees of stage-stacked tensors holding `layers` (a list of L trees, in the order they
    apply; the layers of each place j, i % P == j, alike; see the module doc), each tensor laid out as
    its layers' without `mesh_dim` (a layer split over `mesh_dim` is gathered first), plus `stage_dim`
    over `mesh_dim`."""
    what = "stack_layers"
    if not isinstance(layers, (list, tuple)) or not layers:
        raise MpimeshError(f"{what}: layers must be a non-empty list of trees of tensors, got {type(layers).__name__}")
    first = flatten(layers[0])[0]
    if not first or not isinstance(first[0], DistTensor):
        raise MpimeshError(f"{what}: layers[0] must be a tree of tensors, got {type(layers[0]).__name__}")
    mesh = first[0].mesh
    S, K, P = _mesh_and_sizes(what, mesh, mesh_dim, virtual_stages, len(layers))
    rows = [_checked(what, layers, i, i % P, mesh, mesh_dim, stage_dim) for i in range(len(layers))]
    s, xp = mesh.coords[mesh_dim], mesh.xp
    out = []
    for j in range(P):
        stacked = []
        for n, t0 in enumerate(rows[j]):
            local = xp.stack([rows[layer_index(e, j, S, virtual_stages, P)][n].local
                              for e in range(s * virtual_stages, (s + 1) * virtual_stages)], axis=0)
            stacked.append(DistTensor(mesh, Shape([Dimension(stage_dim, K)] + list(t0.shape)),
                                      (mesh_dim,) + t0.tensor_layout, local))
        out.append(unflatten(flatten(layers[j])[1], stacked))
    return out


def _checked(what: str, layers: Sequence, i: int, j: int, mesh, mesh_dim: str, stage_dim: str) -> list:
    """Layer i's tensors (checked against layer j's, the first of its place), laid out without `mesh_dim`."""
    got, like = named_leaves(layers[i]), named_leaves(layers[j])
    if [n for n, _ in got] != [n for n, _ in like]:
        raise MpimeshError(f"{what}: layers[{i}] holds {[n for n, _ in got]}, layers[{j}] {[n for n, _ in like]}: "
                           f"they take the same place in their stages, so they are stacked together and must hold "
                           f"the same tensors")
    row = []
    for (name, t), (_, t0) in zip(got, like):
        if not isinstance(t, DistTensor) or t.mesh is not mesh or t.shape != t0.shape or t.dtype != t0.dtype:
            desc = f"{t.shape} {t.dtype}" if isinstance(t, DistTensor) else type(t).__name__
            raise ShapeError(f"{what}: layers[{i}][{name!r}] is {desc}, but layers[{j}]'s is {t0.shape} {t0.dtype} "
                             f"on mesh {mesh.shape}: the layers stacked together must match")
        if stage_dim in t.shape.names:
            raise ShapeError(f"{what}: layers[{i}][{name!r}] {t.shape} has a dim named {stage_dim!r} already")
        row.append(to_layout(t, _without(t0.tensor_layout, mesh_dim)))
    return row


def unstack_stages(stacked: Sequence, mesh_dim: str, virtual_stages: int = 1, stage_dim: str = "stage") -> list:
    """The L per-layer trees of `stacked` (P trees of stage-stacked tensors, as `stack_layers` returns),
    each tensor laid out as its stacked one without `stage_dim` (replicated over `mesh_dim`): one
    broadcast along `mesh_dim` per layer and tensor, from the ranks of its stage."""
    what = "unstack_stages"
    if not isinstance(stacked, (list, tuple)) or not stacked:
        raise MpimeshError(f"{what}: stacked must be a non-empty list of trees of stage-stacked tensors (as "
                           f"stack_layers returns), got {type(stacked).__name__}")
    first = flatten(stacked[0])[0]
    if not first or not all(isinstance(t, DistTensor) for t in first):
        raise MpimeshError(f"{what}: stacked[0] must be a tree of tensors, got {type(stacked[0]).__name__}")
    mesh = first[0].mesh
    S = mesh.shape[mesh_dim].size if mesh_dim in mesh.shape.names else 1
    K = S * virtual_stages if isinstance(virtual_stages, int) else 0
    _, _, P = _mesh_and_sizes(what, mesh, mesh_dim, virtual_stages, K * len(stacked))
    layers: list = [[] for _ in range(K * P)]
    structures = []
    for j, tree in enumerate(stacked):
        leaves, structure = flatten(tree)
        structures.append(structure)
        for name, t in named_leaves(tree):
            ax = _stage_axis(what, f"stacked[{j}][{name!r}]", t, mesh, mesh_dim, stage_dim, K)
            shape = Shape([d for i, d in enumerate(t.shape) if i != ax])
            layout = tuple(m for i, m in enumerate(t.tensor_layout) if i != ax)
            for e in range(K):
                root, v = divmod(e, virtual_stages)
                mine = t.local[(slice(None),) * ax + (v,)]
                block = broadcast_from(mesh.collectives, mine, mesh_dim, root) if S > 1 else mine.copy()
                layers[layer_index(e, j, S, virtual_stages, P)].append(DistTensor(mesh, shape, layout, block))
    return [unflatten(structures[i % P], leaves) for i, leaves in enumerate(layers)]


def _stage_axis(what: str, name: str, t, mesh, mesh_dim: str, stage_dim: str, K: int) -> int:
    """The axis of `stage_dim` in the stacked tensor `t`, checked."""
    if not isinstance(t, DistTensor) or t.mesh is not mesh:
        raise MpimeshError(f"{what}: {name} must be a tensor of mesh {mesh.shape}, got {type(t).__name__}")
    if stage_dim not in t.shape.names or t.shape[stage_dim].size != K:
        raise ShapeError(f"{what}: {name} {t.shape} must have a dim {stage_dim!r} of size {K} (the size of mesh "
                         f"dim {mesh_dim!r} times virtual_stages)")
    ax = t.shape.index(stage_dim)
    if t.tensor_layout[ax] != mesh_dim:
        raise MpimeshError(f"{what}: {name} {t.shape}: dim {stage_dim!r} must be split over mesh dim {mesh_dim!r}, "
                           f"but its layout is {t.layout}")
    return ax


def stage_entries(t, mesh_dim: str, stage_dim: str = "stage") -> list:
    """This rank's V entries of the stage-stacked tensor `t`, each a tensor of the stage mesh
    (`pipeline.stage_mesh`: `mesh_dim` of size 1) without `stage_dim`: views, no copy (an optimizer
    then updates each layer as a tensor of its own, as it would unpipelined)."""
    if not isinstance(t, DistTensor):
        raise MpimeshError(f"stage_entries: expected a stage-stacked tensor, got {type(t).__name__}")
    mesh = t.mesh
    if mesh_dim not in mesh.shape.names:
        raise MeshError(f"stage_entries: mesh_dim {mesh_dim!r} is not a dim of mesh {mesh.shape}")
    K = t.shape[stage_dim].size if stage_dim in t.shape.names else 0
    ax = _stage_axis("stage_entries", "t", t, mesh, mesh_dim, stage_dim, K)
    sub = stage_mesh(mesh, mesh_dim)
    shape = Shape([d for i, d in enumerate(t.shape) if i != ax])
    layout = tuple(m for i, m in enumerate(t.tensor_layout) if i != ax)
    return [DistTensor(sub, shape, layout, t.local[(slice(None),) * ax + (v,)]) for v in range(t.local.shape[ax])]


def from_entries(entries: Sequence, like, stage_dim: str = "stage") -> DistTensor:
    """The stage-stacked tensor of `like`'s shape and layout whose entries on this rank are `entries`
    (tensors of the stage mesh, as `stage_entries` gives them; relaid out to `like`'s where they differ)."""
    ax = like.shape.index(stage_dim)
    layout = tuple(m for i, m in enumerate(like.tensor_layout) if i != ax)
    parts = [to_layout(e, layout).local for e in entries]
    return DistTensor(like.mesh, like.shape, like.tensor_layout, like.mesh.xp.stack(parts, axis=ax))
