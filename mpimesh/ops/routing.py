"""Routing ops of a top-2 mixture of experts: `top2_slots` picks each token's two experts and its
slots in their capacity buffers; `dispatch_slots` gathers the tokens into those slots,
`combine_slots` the slots back to the tokens, weighted. Each is the other's adjoint, hence its
gradient. Tokens, experts and capacity stay whole; other dims keep their splits (docs/moe.md).

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> logits = mesh.from_numpy(np.array([[[3.0, 2, 0], [3, 0, 2], [3, 2, 0]]]), "g:1;s:3;e:3")
>>> e1, e2, slots = top2_slots(mm.softmax(logits, "e"), "s", "e", mm.Dimension("c", 2), "all")
>>> e1.to_numpy().tolist(), e2.to_numpy().tolist(), slots.tensors[1].to_numpy().tolist()
([[0, 0, 0]], [[1, 2, 1]], [[2, 4, 3]])
>>> x = mesh.from_numpy(np.array([[[1.0], [2.0], [3.0]]]), "g:1;s:3;d:1")
>>> combine_slots(dispatch_slots(x, slots), slots).to_numpy()[..., 0].tolist()  # each token's kept copies, summed
[[2.0, 4.0, 3.0]]
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import numpy as np

from ..backend import is_float, is_low_precision
from ..errors import DTypeError, MpimeshError, ShapeError
from ..opdef import ALL, OpDef, per_element
from ..shape import Dimension, Shape, union_shape
from ..trace import dispatch
from .einsum import einsum
from .relayout import to_layout

POLICIES = ("random", "all", "none", "threshold")


class Slots(NamedTuple):
    """Where tokens go: one int32 tensor of slots per choice (`[..., tokens]`), the tokens dim's name
    and the experts and capacity dims of the buffers. A slot is `e·C + p` (expert e, position p < C in
    its buffer), or -1 for a dropped choice; one slot holds at most one token."""
    tensors: tuple
    tokens: str
    experts: Dimension
    capacity: Dimension

    def only(self, k: int) -> "Slots":
        """These slots with choice k alone."""
        return self._replace(tensors=(self.tensors[k],))


def _dim(d, what: str) -> Dimension:
    """A Dimension from a Dimension or "name:size"."""
    s = Shape([d] if isinstance(d, Dimension) else d)
    if s.rank != 1:
        raise ShapeError(f"{what}: expected one dim, got {s}")
    return s[0]


def _perm(names: tuple, order: Sequence[str]) -> tuple:
    return tuple(names.index(n) for n in order)


def _whole(shape: Shape, layout: tuple, names) -> tuple:
    """`layout` with the dims `names` unsplit."""
    return tuple(None if d.name in names else m for d, m in zip(shape, layout))


def _like(t, shape: Shape, layout: tuple):
    """`t` (whose dims are among `shape`'s) in the layout `layout` gives them."""
    return to_layout(t, tuple(layout[shape.index(n)] for n in t.shape.names))


def _round(dt):
    """Round a float result to `dt` where numpy computes a 16-bit float with a Python float in
    float32 (as the elementwise ops do), so a policy decided here equals the composed one."""
    if not is_low_precision(dt):
        return lambda v: v
    return lambda v: v.astype(dt) if v.dtype != dt else v


# ------------------------------------------------------------------------------------- top2_slots

def top2_slots(gates, tokens_dim: str, experts_dim: str, capacity, policy: str = "random",
               threshold: float = 0.2, uniform=None):
    """GShard's top-2 choice and capacity positions in one op: `(expert_1, expert_2, Slots)`.

    `gates` `[..., tokens, experts]` (softmax output). expert_1 is the argmax, expert_2 the argmax
    with expert_1 zeroed (int32, shaped like gates without experts). First choices take positions
    in token order (an exclusive count per expert), second choices queue after the kept first
    ones; a choice is kept iff its position is below `capacity.size`. The second choice must also
    pass `policy`: "all", "none", "threshold" (g2 > threshold) or "random" (u < g2/threshold, u
    the `uniform` draws shaped like expert_1), with g1, g2 the two gates normalised by
    g1 + g2 + 1e-9, computed as `mpimesh.layers.moe` composes them. Counts are int32. No gradient.
    """
    tokens, cap = tokens_dim, _dim(capacity, "top2_slots capacity")
    if tokens not in gates.shape or experts_dim not in gates.shape or tokens == experts_dim:
        raise ShapeError(f"top2_slots: gates {gates.shape} need two different dims: tokens {tokens!r} and "
                         f"experts {experts_dim!r}")
    experts = gates.shape[experts_dim]
    if cap.name in gates.shape:
        raise ShapeError(f"top2_slots: the capacity dim {cap.name}:{cap.size} must be new, but gates have "
                         f"{gates.shape}")
    if experts.size < 2:
        raise ShapeError(f"top2_slots: top-2 needs at least 2 experts, got {experts.name}:{experts.size}")
    if not is_float(gates.dtype):
        raise DTypeError(f"top2_slots: gates {gates.shape} must be floats, got {gates.dtype}")
    if policy not in POLICIES:
        raise MpimeshError(f"top2_slots: unknown policy {policy!r}; choose from {list(POLICIES)}")
    mesh = gates.mesh
    out = gates.shape.without([experts.name])
    if (uniform is None) != (policy != "random"):
        raise MpimeshError(f"top2_slots: policy {policy!r} {'needs' if policy == 'random' else 'takes no'} "
                           f"uniform draws")
    if uniform is not None and set(uniform.shape.dims) != set(out.dims):
        raise ShapeError(f"top2_slots: uniform draws {uniform.shape} must have the dims of the gates without "
                         f"experts, {out}")
    out_layout = _whole(out, mesh.plan(out), [tokens])
    gates = _like(gates, out + Shape([experts]), out_layout + (None,))
    inputs = [gates] + ([] if uniform is None else [_like(uniform, out, out_layout)])
    batch = [n for n in out.names if n != tokens]
    params = {"tokens": tokens, "experts": experts, "capacity": cap, "policy": policy, "threshold": threshold,
              "gperm": _perm(gates.shape.names, batch + [tokens, experts.name]),
              "uperm": None if uniform is None else _perm(uniform.shape.names, batch + [tokens]),
              "operm": _perm(tuple(batch + [tokens]), out.names)}
    e1, e2, s1, s2 = dispatch(TOP2_SLOTS, inputs, [(out, out_layout)] * 4, params)
    return e1, e2, Slots((s1, s2), tokens, experts, cap)


def _top2_slots(ctx, g, *u, tokens, experts, capacity, policy, threshold, gperm, uperm, operm):
    """The kernel: `[..., tokens, experts]` gates -> e1, e2, and their slots (-1: dropped)."""
    xp, c, r = ctx.xp, capacity.size, _round(g.dtype)
    g = xp.transpose(g, gperm)
    pos = xp.arange(experts.size, dtype=np.int32)
    e1 = xp.argmax(g, axis=-1).astype(np.int32)
    hot1 = e1[..., None] == pos
    e2 = xp.argmax(xp.where(hot1, xp.zeros((), g.dtype), g), axis=-1).astype(np.int32)
    g1, g2 = (xp.take_along_axis(g, e[..., None], -1)[..., 0] for e in (e1, e2))
    g2 = g2 / r(r(g1 + g2) + 1e-9)
    if policy == "random":
        second = xp.transpose(u[0], uperm) < r(g2 * (1.0 / max(threshold, 1e-9)))
    elif policy == "threshold":
        second = g2 > threshold
    else:
        second = xp.full(e2.shape, policy == "all")
    first = hot1.astype(np.int32)
    p1 = xp.take_along_axis(xp.cumsum(first, axis=-2, dtype=np.int32) - first, e1[..., None], -1)[..., 0]
    taken = xp.minimum(first.sum(axis=-2, dtype=np.int32), c)  # kept first choices per expert
    hot2 = ((e2[..., None] == pos) & second[..., None]).astype(np.int32)
    p2 = xp.take_along_axis(xp.cumsum(hot2, axis=-2, dtype=np.int32) - hot2 + taken[..., None, :],
                            e2[..., None], -1)[..., 0]
    s1 = xp.where(p1 < c, e1 * c + p1, -1).astype(np.int32)
    s2 = xp.where(second & (p2 < c), e2 * c + p2, -1).astype(np.int32)
    return tuple(xp.transpose(a, operm) for a in (e1, e2, s1, s2))


def _top2_flops(params, ins, outs) -> int:
    """Per gate: the two argmaxes and the two choices' masks (4), the where (1), the first choices'
    exclusive count (a cumsum and a subtraction) and their sum per expert (3), the second choices'
    mask and count (an and, a cumsum, a subtraction and the kept firsts added: 4), 12 in all; per
    token: the two gates' normalisation (3), the policy (a multiply and a compare for "random", a
    compare for "threshold") and the slots (a compare and a multiply-add; the second's also an and: 7)."""
    policy = {"random": 2, "threshold": 1}.get(params["policy"], 0)
    return 12 * math.prod(ins[0].shape) + (10 + policy) * math.prod(outs[0].shape)


TOP2_SLOTS = OpDef("top2_slots", _top2_slots, flops=_top2_flops,
                   abstract=lambda ctx, shapes, *ins, **params: (np.dtype(np.int32),) * 4)


# ------------------------------------------------------------------------ dispatch_slots, combine_slots

def _check_slots(slots: Slots, what: str) -> Shape:
    """The slots' common shape, checked (int dtype, the tokens dim in it, 1 or 2 choices)."""
    if not isinstance(slots, Slots) or len(slots.tensors) not in (1, 2):
        raise MpimeshError(f"{what}: slots must be a Slots of one or two tensors (from top2_slots)")
    shape = slots.tensors[0].shape
    for t in slots.tensors:
        if not np.issubdtype(t.dtype, np.integer):
            raise DTypeError(f"{what}: slots {t.shape} must have an integer dtype, got {t.dtype}")
        if t.shape != shape:
            raise ShapeError(f"{what}: the choices' slots differ in shape: {t.shape} and {shape}")
    if slots.tokens not in shape:
        raise ShapeError(f"{what}: the tokens dim {slots.tokens!r} is not in the slots' shape {shape}")
    return shape


def _check_weights(weights, slots: Slots, shape: Shape, what: str) -> list:
    if weights is None:
        return []
    weights = list(weights)
    if len(weights) != len(slots.tensors):
        raise MpimeshError(f"{what}: {len(weights)} weights for {len(slots.tensors)} choices of slots")
    for w in weights:
        if set(w.shape.dims) != set(shape.dims) or not is_float(w.dtype):
            raise ShapeError(f"{what}: a weight must be a float tensor with the slots' dims {shape}, got "
                             f"{w.shape} {w.dtype}")
    return weights


def _gathered_shape(x_shape: Shape, shape: Shape, tokens: str, buffers: Sequence[str], what: str) -> tuple:
    """(batch dims, feature dims) of a gather of `x_shape` by slots of `shape`: the slots' dims
    but tokens are batch dims of x too; the rest of x (less tokens and the `buffers` dims) are
    features. Dims of both (tokens too) must have the same sizes."""
    drop = [tokens, *buffers]
    batch = [n for n in shape.names if n not in drop]
    union_shape([x_shape.without(buffers), shape.without(buffers)], f"{what}: {x_shape} and the slots' {shape}")
    missing = [n for n in batch if n not in x_shape]
    if missing:
        raise ShapeError(f"{what}: the slots' dims {missing} (of {shape}) are not in {x_shape}")
    return batch, [n for n in x_shape.names if n not in batch and n not in drop]


def _laid_out(out: Shape, output_shape, whole: list, gone: list, inputs: list, what: str) -> tuple:
    """(output shape: `out`, or `output_shape` with its dims; its layout by the rules with the dims
    `whole` unsplit; `inputs` laid out alike, their dims `gone` from the output unsplit)."""
    if output_shape is not None:
        output_shape = Shape(output_shape)
        if set(output_shape.dims) != set(out.dims):
            raise ShapeError(f"{what}: output_shape {output_shape} must have the dims of {out}")
        out = output_shape
    out_layout = _whole(out, inputs[0].mesh.plan(out), whole)
    full, fl = out + Shape(gone), out_layout + (None,) * len(gone)
    return out, out_layout, [_like(t, full, fl) for t in inputs]


def _set(a, index, values):
    """`a[index] = values` as a new array (the generic kernel: JAX's arrays are immutable)."""
    return a.at[index].set(values)


def _set_in_place(a, index, values):
    """`a[index] = values`, in place (numpy's and CuPy's kernels)."""
    a[index] = values
    return a


def _scaled(xp, slot, weight, dt):
    """The weight of each choice: `weight` (1 if None) where the choice is kept, else 0."""
    one = xp.ones((), dt) if weight is None else weight.astype(dt)
    return xp.where(slot >= 0, one, xp.zeros((), dt))


def _gather_grad(op, dz, forward):
    """The other gather of the pair (weights and slots as the op's), and for each weight the row
    dot product of dz with the op's gathered rows."""
    p = op.params
    k = p["choices"]
    slots = Slots(tuple(op.inputs[1:1 + k]), p["tokens"], p["experts"], p["capacity"])
    weights = op.inputs[1 + k:] or None
    source = op.inputs[0]
    need = op.needs or (True,) * len(op.inputs)
    other = combine_slots if forward else dispatch_slots
    grads = [other(dz, slots, weights, output_shape=source.shape) if need[0] else None] + [None] * k
    for j, w in enumerate(weights or ()):
        if need[1 + k + j]:  # <dz at token s, source at s's slot j>: the slot's rows, gathered back
            rows = combine_slots(dz, slots.only(j), output_shape=source.shape) if forward else \
                combine_slots(source, slots.only(j), output_shape=dz.shape)
            grads.append(einsum([rows, source if forward else dz], output_shape=w.shape))
        else:
            grads.append(None)
    return grads


def _dispatch_grad(op, dz):
    return _gather_grad(op, dz, True)


def _combine_grad(op, dz):
    return _gather_grad(op, dz, False)


def _reads(params) -> tuple:
    """What a gather's gradient reads: the slots, or every input when weighted (the weights' gradient
    reads the gathered source)."""
    return (ALL, ()) if params["weighted"] else ((1, 2), ())


def dispatch_slots(x, slots: Slots, weights: Optional[Sequence] = None, output_shape=None):
    """The expert buffers: `out[e, ..., c, ...] = w_k[s]·x[..., s, ...]` for the token s whose
    choice k took slot (e, c), 0 for an empty slot (`weights` None: w = 1). The output is
    `[experts] + x's dims with tokens replaced by capacity` (or `output_shape`, the same dims in
    another order). The gradient w.r.t. x is `combine_slots` with the same weights; w.r.t. a weight,
    the row dot product of the output's gradient at the slot with x.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> slots = Slots((mesh.from_numpy(np.array([[2, 0, -1]], np.int32), "g:1;s:3"),), "s", mm.Dimension("e", 2),
    ...               mm.Dimension("c", 2))
    >>> x = mesh.from_numpy(np.array([[[1.0], [2.0], [3.0]]]), "g:1;s:3;d:1")
    >>> dispatch_slots(x, slots).to_numpy()[..., 0].tolist()  # token 0 in slot (1, 0), token 1 in (0, 0)
    [[[2.0, 0.0]], [[1.0, 0.0]]]
    """
    shape = _check_slots(slots, "dispatch_slots")
    weights = _check_weights(weights, slots, shape, "dispatch_slots")
    s, e, c = slots.tokens, slots.experts, slots.capacity
    if s not in x.shape or e.name in x.shape or c.name in x.shape:
        raise ShapeError(f"dispatch_slots: x {x.shape} needs the tokens dim {s!r} and neither the experts "
                         f"dim {e.name!r} nor the capacity dim {c.name!r}")
    batch, feats = _gathered_shape(x.shape, shape, s, [], "dispatch_slots")
    out, out_layout, (x, *idx) = _laid_out(Shape([e] + [c if d.name == s else d for d in x.shape]), output_shape,
                                           [e.name, c.name], [x.shape[s]], [x, *slots.tensors, *weights],
                                           "dispatch_slots")
    idx, weights = idx[:len(slots.tensors)], idx[len(slots.tensors):]
    params = {"tokens": s, "experts": e, "capacity": c, "choices": len(idx), "weighted": bool(weights),
              "n_batch": len(batch), "xperm": _perm(x.shape.names, batch + [s] + feats),
              "sperm": _perm(shape.names, batch + [s]), "operm": _perm(tuple([e.name] + batch + [c.name] + feats),
                                                                       out.names)}
    (y,) = dispatch(DISPATCH_SLOTS if is_float(x.dtype) else DISPATCH_SLOTS_NO_GRAD, [x] + idx + weights,
                    [(out, out_layout)], params)
    return y


def _dispatch_slots(ctx, a, *rest, tokens, experts, capacity, choices, weighted, n_batch, xperm, sperm, operm,
                    put=_set):
    """The kernel: each slot's token (and its weight), then the rows gathered into the buffers.
    `put`: how an index is written (`_set`, or `_set_in_place` for numpy and CuPy)."""
    xp, ne, nc, k = ctx.xp, experts.size, capacity.size, choices
    ec = ne * nc
    a = xp.transpose(a, xperm)
    lead, n_tok, tail = a.shape[:n_batch], a.shape[n_batch], a.shape[n_batch + 1:]
    if n_tok == 0:  # no token here (a tokens dim of 0, or an empty block): every slot empty
        return xp.transpose(xp.zeros((ne,) + lead + (nc,) + tail, a.dtype), operm)
    nb = math.prod(lead)
    a = a.reshape(nb, n_tok, math.prod(tail))
    rows = xp.arange(nb)[:, None]
    tok = xp.zeros((nb, ec + 1), np.int32)  # the token in each slot; column ec takes the dropped
    scale = xp.zeros((nb, ec + 1), a.dtype)  # 0 for an empty slot
    positions = xp.arange(n_tok, dtype=np.int32)
    for j in range(k):
        sl = xp.transpose(rest[j], sperm).reshape(nb, n_tok)
        at = (rows, xp.where(sl >= 0, sl, ec))
        tok = put(tok, at, positions)
        w = xp.transpose(rest[k + j], sperm).reshape(nb, n_tok) if weighted else None
        scale = put(scale, at, _scaled(xp, sl, w, a.dtype))
    tok = xp.transpose(tok[:, :ec].reshape(nb, ne, nc), (1, 0, 2))
    scale = xp.transpose(scale[:, :ec].reshape(nb, ne, nc), (1, 0, 2))
    y = a[xp.arange(nb)[None, :, None], tok] * scale[..., None]  # [E, B, C, F]
    return xp.transpose(y.reshape((ne,) + lead + (nc,) + tail), operm)


def _dispatch_in_place(ctx, *blocks, **params):
    return _dispatch_slots(ctx, *blocks, put=_set_in_place, **params)


_IN_PLACE = {"numpy": _dispatch_in_place, "cupy": _dispatch_in_place}
DISPATCH_SLOTS = OpDef("dispatch_slots", _dispatch_slots, kernels=_IN_PLACE, grad=_dispatch_grad, saves=_reads,
                       flops=per_element(1))  # a multiply by the slot's weight per output element
DISPATCH_SLOTS_NO_GRAD = OpDef("dispatch_slots", _dispatch_slots, kernels=_IN_PLACE, flops=per_element(1))


def combine_slots(expert_out, slots: Slots, weights: Optional[Sequence] = None, output_shape=None):
    """Each token's choices gathered back: `y[..., s, ...] = Σ_k w_k[s]·expert_out[e_k, ..., c_k, ...]`
    over the kept choices k of token s (`weights` None: w = 1).

    The output is `expert_out`'s dims without experts and with capacity replaced by tokens (or
    `output_shape`, the same dims in another order). The gradient w.r.t. expert_out is
    `dispatch_slots` of the output's gradient with the same weights; w.r.t. a weight, the row dot
    product of the output's gradient with expert_out at the slot.
    """
    shape = _check_slots(slots, "combine_slots")
    weights = _check_weights(weights, slots, shape, "combine_slots")
    s, e, c = slots.tokens, slots.experts, slots.capacity
    if e not in expert_out.shape or c not in expert_out.shape or s in expert_out.shape:
        raise ShapeError(f"combine_slots: expert_out {expert_out.shape} needs the experts dim {e.name}:{e.size} "
                         f"and the capacity dim {c.name}:{c.size}, and not the tokens dim {s!r}")
    tok = shape[s]
    batch, feats = _gathered_shape(expert_out.shape, shape, s, [e.name, c.name], "combine_slots")
    out, out_layout, (eo, *idx) = _laid_out(Shape([tok if d.name == c.name else d for d in expert_out.shape
                                                   if d.name != e.name]), output_shape, [s], [e, c],
                                            [expert_out, *slots.tensors, *weights], "combine_slots")
    idx, weights = idx[:len(slots.tensors)], idx[len(slots.tensors):]
    params = {"tokens": s, "experts": e, "capacity": c, "choices": len(idx), "weighted": bool(weights),
              "n_batch": len(batch), "n_tokens": tok.size,
              "eperm": _perm(eo.shape.names, [e.name] + batch + [c.name] + feats),
              "sperm": _perm(shape.names, batch + [s]), "operm": _perm(tuple(batch + [s] + feats), out.names)}
    (y,) = dispatch(COMBINE_SLOTS if is_float(eo.dtype) else COMBINE_SLOTS_NO_GRAD, [eo] + idx + weights,
                    [(out, out_layout)], params)
    return y


def _combine_slots(ctx, a, *rest, tokens, experts, capacity, choices, weighted, n_batch, n_tokens, eperm, sperm,
                   operm):
    """The kernel: for each token and choice, the row of its slot, weighted, summed over the choices."""
    xp, ne, nc, k = ctx.xp, experts.size, capacity.size, choices
    a = xp.transpose(a, eperm)
    lead, tail = a.shape[1:1 + n_batch], a.shape[2 + n_batch:]
    if ne * nc == 0:  # buffers without a slot: every choice was dropped
        return xp.transpose(xp.zeros(lead + (n_tokens,) + tail, a.dtype), operm)
    nb = math.prod(lead)
    a = a.reshape(ne, nb, nc, math.prod(tail))
    rows = xp.arange(nb)[:, None]
    y = None
    for j in range(k):
        sl = xp.transpose(rest[j], sperm).reshape(nb, n_tokens)
        i = xp.where(sl >= 0, sl, 0)
        w = xp.transpose(rest[k + j], sperm).reshape(nb, n_tokens) if weighted else None
        term = a[i // nc, rows, i % nc] * _scaled(xp, sl, w, a.dtype)[..., None]  # [B, S, F]
        y = term if y is None else y + term
    return xp.transpose(y.reshape(lead + (n_tokens,) + tail), operm)


def _combine_flops(params, ins, outs) -> int:
    """A multiply and an add per output element and choice."""
    return 2 * params["choices"] * math.prod(outs[0].shape)


COMBINE_SLOTS = OpDef("combine_slots", _combine_slots, grad=_combine_grad, saves=_reads, flops=_combine_flops)
COMBINE_SLOTS_NO_GRAD = OpDef("combine_slots", _combine_slots, flops=_combine_flops)
