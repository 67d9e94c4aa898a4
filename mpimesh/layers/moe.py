"""GShard's mixture-of-experts layer with top-2 gating, composed of ops (no communication of its own).

Lepikhin et al. 2020 (GShard, Algorithm 1), as Mesh-TensorFlow's `transformer_moe_layer_v1`: each
token goes to its two likeliest experts while they have capacity (`capacity_factor`), the second by
a policy (`"random"` by default); an overflowing token skips the layer. Tokens move by gathers
(`routing="gather"`) or one-hot einsums (`"one_hot"`). Groups are split while gating, experts while
they run: one alltoall each way. The formulas, routing and layout: docs/moe.md.

>>> import mpimesh as mm
>>> mesh = mm.Mesh("all:1", layout="group:all;experts:all", comm=mm.MPI.COMM_SELF)
>>> p = init_moe(mesh, 0, "d_model:8", "experts:4", "d_ff:16")
>>> y, aux = moe(p, mesh.random_normal("group:2;tokens:8;d_model:8", seed=1), "group", seed=2)
>>> y.shape, aux.shape, sorted(p)
(Shape('[group:2, tokens:8, d_model:8]'), Shape('[]'), ['wg', 'wi', 'wo'])
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

from ..errors import LayoutError, MpimeshError, ShapeError
from ..layout import LayoutRules, check_rules, plan_layout
from ..mesh import layout_scope
from ..ops.einsum import einsum
from ..ops.elementwise import cast, greater, less, stop_gradient
from ..ops.indexing import argmax, one_hot
from ..ops.nn import softmax
from ..ops.reduce import reduce_mean, reduce_sum
from ..ops.relayout import relayout
from ..ops.routing import POLICIES, combine_slots, dispatch_slots, top2_slots
from ..ops.scan import cumsum
from ..ops.slicing import slice as slice_dim
from ..shape import Dimension, Shape
from .core import ACTIVATIONS, DimLike, Params, as_dim, like, subseed

CAPACITY_DIM = "expert_capacity"
ROUTINGS = ("auto", "gather", "one_hot")


def expert_capacity(group_size: int, num_experts: int, capacity_factor: float, min_capacity: int = 4) -> int:
    """C = max(min(S, int(S·capacity_factor/E)), min_capacity), which must be at least 1
    (capacity_factor a finite number > 0, min_capacity an int >= 0).

    >>> expert_capacity(64, 8, 1.25), expert_capacity(8, 8, 1.25), expert_capacity(8, 2, 100.0)
    (10, 4, 8)
    """
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
        raise TypeError(f"moe: capacity_factor must be a real number, got {capacity_factor!r} "
                        f"({type(capacity_factor).__name__})")
    if isinstance(min_capacity, bool) or not isinstance(min_capacity, numbers.Integral):
        raise TypeError(f"moe: min_capacity must be an int, got {min_capacity!r} ({type(min_capacity).__name__})")
    if not (math.isfinite(capacity_factor) and capacity_factor > 0):
        raise MpimeshError(f"moe: capacity_factor must be a finite number > 0, got {capacity_factor}")
    if min_capacity < 0:
        raise MpimeshError(f"moe: min_capacity must be >= 0, got {min_capacity}")
    s, e = group_size, num_experts
    c = max(int(min(s, s * capacity_factor / e)), min_capacity)  # min first: no int(inf)
    if c < 1:
        fix = f" or capacity_factor above {e}/{s} = {e / s:g}" if s else ""
        raise MpimeshError(f"moe: capacity_factor {capacity_factor} and min_capacity {min_capacity} give an expert "
                           f"capacity of 0 for {s} tokens per group and {e} experts (int({s}·{capacity_factor}/{e}) "
                           f"= 0); raise min_capacity to 1{fix}")
    return c


def _phase_rules(base: LayoutRules, assign: dict) -> LayoutRules:
    """`base` with each dim of `assign` put on its mesh dim (None: unsplit); other dims that the
    base put on one of those mesh dims lose their split."""
    taken = {m for m in assign.values() if m}
    pairs = [(t, m) for t, m in base.pairs if t not in assign and m not in taken]
    return LayoutRules(pairs + [(t, m) for t, m in assign.items() if m])


def init_moe(mesh, seed: int, d_model_dim: DimLike, experts_dim: DimLike, d_ff_dim: DimLike,
             expert_mesh_dim: Optional[str] = None, dtype="float32") -> Params:
    """`{"wg": [M, E], "wi": [E, M, H], "wo": [E, H, M]}` from `seed` (the same values on any mesh
    and layout): wg and wi N(0, 1/M), wo N(0, 1/H).

    wg is laid out with E unsplit (the gating needs all experts); wi and wo with E on
    `expert_mesh_dim`, default the mesh dim the rules in force give E (other dims by the rules).
    """
    m, e, h = as_dim(d_model_dim), as_dim(experts_dim), as_dim(d_ff_dim)
    Shape([m, e, h])  # distinct names
    rules = mesh.layout
    em = expert_mesh_dim if expert_mesh_dim is not None else rules.mesh_dim(e.name)
    expert_rules = _phase_rules(rules, {e.name: em})
    check_rules(expert_rules, mesh.shape)
    gate_rules = _phase_rules(rules, {e.name: None})

    def normal(shape, name, stddev, rules_):
        shape = Shape(shape)
        layout = plan_layout(shape, mesh.shape, rules_)
        return mesh.random_normal(shape, subseed(seed, name), stddev=stddev, dtype=dtype, layout=layout)
    return {"wg": normal([m, e], "wg", m.size ** -0.5, gate_rules),
            "wi": normal([e, m, h], "wi", m.size ** -0.5, expert_rules),
            "wo": normal([e, h, m], "wo", h.size ** -0.5, expert_rules)}


def _dims(params: Params, x, group_dim: str) -> tuple:
    """(G, S, M, E, H) Dimensions, checked against each other."""
    wg, wi, wo = params["wg"], params["wi"], params["wo"]
    if wg.shape.rank != 2 or wi.shape.rank != 3 or wo.shape.rank != 3:
        raise ShapeError(f"moe: params need wg [M, E], wi [E, M, H], wo [E, H, M]; got wg {wg.shape}, "
                         f"wi {wi.shape}, wo {wo.shape}")
    m, e = wg.shape.dims
    h = wi.shape[2]
    if wi.shape != Shape([e, m, h]) or wo.shape != Shape([e, h, m]):
        raise ShapeError(f"moe: with wg {wg.shape} the params need wi [{e.name}:{e.size}, {m.name}:{m.size}, "
                         f"d_ff] and wo [{e.name}:{e.size}, d_ff, {m.name}:{m.size}]; got wi {wi.shape}, wo {wo.shape}")
    if e.size < 2:
        raise ShapeError(f"moe: top-2 gating needs at least 2 experts, got {e.name}:{e.size}")
    if x.shape.rank != 3 or group_dim not in x.shape or m.name not in x.shape:
        raise ShapeError(f"moe: x must have exactly three dims: the group dim {group_dim!r}, the group-size "
                         f"dim and the model dim {m.name}:{m.size}; got {x.shape}")
    if x.shape[m.name] != m:
        raise ShapeError(f"moe: x {x.shape} has the model dim {m.name}:{x.shape[m.name].size}, but the params "
                         f"were built for {m.name}:{m.size} (wg {wg.shape})")
    s = next(d for d in x.shape if d.name not in (group_dim, m.name))
    for d in (e, h):
        if d.name in x.shape or d.name == CAPACITY_DIM:
            raise ShapeError(f"moe: param dim {d.name}:{d.size} clashes with x {x.shape} or {CAPACITY_DIM!r}")
    if CAPACITY_DIM in x.shape:
        raise ShapeError(f"moe: x {x.shape} must not have a dim named {CAPACITY_DIM!r}")
    return x.shape[group_dim], s, m, e, h


def _pick(gates, index, e: Dimension):
    """(one_hot(index) [G, S, E], gates at index [G, S]): the gradient reaches the gates through it."""
    mask = one_hot(index, e, dtype=gates.dtype)
    return mask, reduce_sum(gates * mask, reduced_dims=e.name)


def _top2_gates(x, wg, g: Dimension, s: Dimension, e: Dimension, c: Dimension, policy: str, threshold: float,
                seed: int, loss_coef: float, fused: bool, draws: Optional[tuple] = None):
    """Gates, top-2 choice and aux loss of x [G, S, M]: (mask_1, mask_2, g1, g2, uniform draws, aux,
    slots): slots from `top2_slots` when `fused`, else None (the one-hot path decides later)."""
    dt = x.dtype
    gates = softmax(einsum([x, wg], output_shape=Shape([g, s, e])), e.name)
    u = None
    if policy == "random" and draws is None:
        u = x.mesh.random_uniform(Shape([g, s]), seed, dtype=dt)
    elif policy == "random":  # groups first .. first+G-1 of a batch of `total`: their rows of its draws
        first, total = draws
        u = slice_dim(x.mesh.random_uniform(Shape([Dimension(g.name, total), s]), seed, dtype=dt), first, g.size,
                      g.name)
    if fused:
        index_1, index_2, slots = top2_slots(gates, s.name, e.name, c, policy, threshold, u)
        mask_1, gate_1 = _pick(gates, index_1, e)
    else:
        mask_1, gate_1 = _pick(gates, argmax(gates, e.name), e)
        index_2, slots = argmax(gates * (1.0 - mask_1), e.name), None
    mask_2, gate_2 = _pick(gates, index_2, e)
    denom = gate_1 + gate_2 + 1e-9

    # Load balance: mean over groups and experts of (fraction routed first to e) · (mean gate of e).
    density = reduce_mean(mask_1, reduced_dims=s.name)
    proxy = reduce_mean(gates, reduced_dims=s.name)
    aux = reduce_mean(density * proxy) * float(e.size * e.size * loss_coef)
    return mask_1, mask_2, gate_1 / denom, gate_2 / denom, u, aux, slots
def _one_hot_routing(mask_1, mask_2, gate_1, gate_2, u, s: Dimension, c: Dimension, policy: str,
                     threshold: float):
    """(dispatch [G, S, E, C] 0/1, combine [G, S, E, C]) from the top-2 masks and gates."""
    dt = mask_1.dtype
    if policy == "none":
        mask_2 = mask_2 * 0.0
    elif policy == "threshold":
        mask_2 = mask_2 * cast(greater(gate_2, threshold), dt)
    elif policy == "random":
        mask_2 = mask_2 * cast(less(u, gate_2 * (1.0 / max(threshold, 1e-9))), dt)

    # Positions in the experts' buffers: first choices in token order, then second choices.
    pos_1 = cumsum(mask_1, s.name, exclusive=True) * mask_1
    mask_1 = mask_1 * cast(less(pos_1, float(c.size)), dt)
    count_1 = reduce_sum(mask_1, reduced_dims=s.name)
    pos_2 = (cumsum(mask_2, s.name, exclusive=True) + count_1) * mask_2
    mask_2 = mask_2 * cast(less(pos_2, float(c.size)), dt)
    e = mask_1.shape[-1].name
    slot_1 = one_hot(cast(reduce_sum(pos_1, reduced_dims=e), "int32"), c, dtype=dt)
    slot_2 = one_hot(cast(reduce_sum(pos_2, reduced_dims=e), "int32"), c, dtype=dt)
    dispatch_1 = stop_gradient(mask_1 * slot_1)  # [G, S, E, C]
    dispatch_2 = stop_gradient(mask_2 * slot_2)
    return dispatch_1 + dispatch_2, gate_1 * dispatch_1 + gate_2 * dispatch_2


def _gather_blocker(mesh, rules: LayoutRules, x_shape: Shape, tokens: str, buffers: Shape) -> Optional[str]:
    """Why the group phase (`rules`; experts whole) cannot route by gathers, or None if it can."""
    with layout_scope(mesh, rules):
        xl = dict(zip(x_shape.names, mesh.plan(x_shape)))
        bl = dict(zip(buffers.names, mesh.plan(buffers)))
    for name, m in ((tokens, xl[tokens]), (CAPACITY_DIM, bl[CAPACITY_DIM])):
        if m is not None:
            return f"{name} is split over mesh dim {m!r}"
    for n, m in xl.items():
        if n in bl and bl[n] != m:
            return f"{n} is split over {m!r} in x but over {bl[n]!r} in the expert buffers"
    return None


def moe(params: Params, x, group_dim: str = "group", train: bool = True, capacity_factor: Optional[float] = None,
        min_capacity: int = 4, loss_coef: float = 1e-2, second_policy: str = "random",
        second_threshold: float = 0.2, seed: int = 0, activation: str = "relu", routing: str = "auto",
        draws: Optional[tuple] = None):
    """GShard top-2 mixture of experts on x [G, S, M] (params from `init_moe`): `(y, aux_loss)`.

    y has x's shape and the layout the rules in force give it; aux_loss is a scalar to add to the
    training loss. `capacity_factor` defaults to 1.25 when `train`, else 2.0; `seed` seeds the
    random second-expert policy (use a new one each step). `routing`: "gather" (slots and gathers,
    `mpimesh.ops.routing`), "one_hot" (the [G, S, E, C] masks and einsums) or "auto" (gather where
    the layout allows: see the module doc). `draws`, `(first, total)`: x's groups are groups first ..
    of a batch of `total` (a pipeline's microbatch): the random policy draws their numbers of that
    batch. The formulas are in the module doc.
    """
    if second_policy not in POLICIES:
        raise MpimeshError(f"moe: unknown second_policy {second_policy!r}; choose from {list(POLICIES)}")
    if activation not in ACTIVATIONS:
        raise MpimeshError(f"moe: unknown activation {activation!r}; choose from {sorted(ACTIVATIONS)}")
    if routing not in ROUTINGS:
        raise MpimeshError(f"moe: unknown routing {routing!r}; choose from {list(ROUTINGS)}")
    g, s, m, e, h = _dims(params, x, group_dim)
    if capacity_factor is None:
        capacity_factor = 1.25 if train else 2.0
    c = Dimension(CAPACITY_DIM, expert_capacity(s.size, e.size, capacity_factor, min_capacity))
    mesh = x.mesh
    base = mesh.layout
    mg = x.tensor_layout[x.shape.index(g.name)] or base.mesh_dim(g.name)
    me = base.mesh_dim(e.name) or mg
    rules_g = _phase_rules(base, {g.name: mg, e.name: None})
    rules_e = _phase_rules(base, {e.name: me, g.name: mg if mg != me else None})
    out_layout = mesh.plan(x.shape)
    ein_shape, hid_shape = Shape([e, g, c, m]), Shape([e, g, c, h])
    blocker = None if routing == "one_hot" else _gather_blocker(mesh, rules_g, x.shape, s.name, ein_shape)
    if routing == "gather" and blocker:
        raise LayoutError(f"moe: routing='gather' needs the group phase to hold tokens and capacity whole and "
                          f"split x and the expert buffers alike, but {blocker} (rules {rules_g}); use "
                          f"routing='auto'")
    fused = routing != "one_hot" and not blocker
    wg, wi, wo = (like(params[n], x) for n in ("wg", "wi", "wo"))  # x's dtype: float32 masters cast
    with layout_scope(mesh, rules_g):
        mask_1, mask_2, gate_1, gate_2, u, aux, slots = _top2_gates(x, wg, g, s, e, c, second_policy,
                                                                    second_threshold, seed, loss_coef, fused,
                                                                    draws)
        if fused:
            expert_in = dispatch_slots(x, slots, output_shape=ein_shape)
        else:
            dispatch, combine = _one_hot_routing(mask_1, mask_2, gate_1, gate_2, u, s, c, second_policy,
                                                 second_threshold)
            expert_in = einsum([dispatch, x], output_shape=ein_shape)
    with layout_scope(mesh, rules_e):
        expert_in = relayout(expert_in, mesh.plan(ein_shape))  # alltoall: groups -> experts
        hidden = ACTIVATIONS[activation](einsum([expert_in, wi], output_shape=hid_shape))
        expert_out = einsum([hidden, wo], output_shape=ein_shape)
    with layout_scope(mesh, rules_g):
        expert_out = relayout(expert_out, mesh.plan(ein_shape))  # alltoall: experts -> groups
        if fused:
            y = combine_slots(expert_out, slots, (gate_1, gate_2), output_shape=x.shape)
        else:
            y = einsum([combine, expert_out], output_shape=x.shape)
    return relayout(y, out_layout), aux
