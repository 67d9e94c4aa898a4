"""Adafactor's update as one op for many parameters (multi-tensor, as `mpimesh.ops.updates` does
for SGD and Adam): `adafactor_update` updates every parameter of one dtype in one dispatch, where
op by op it takes about twenty ops per parameter.

The formulas are `mpimesh.optim.Adafactor`'s. A parameter split over mesh dims needs three sums
across ranks: the squares of p (its RMS, for the parameter scale) and the row and column sums of
g**2 (the factored second moment); the row means of the new row factor; the squares of u (update
clipping). Each round is one allreduce per distinct set of mesh dims, every parameter's partial
sums in one buffer, so the communication is a handful of allreduces per step whatever the number
of parameters, and its elements are those of the op-by-op update. The local sums are `xp.sum`s
(the op-by-op update's are einsums of a tensor with itself), so values agree with it to rounding,
not bitwise.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> p, g = mesh.from_numpy(np.array([1.0, 2.0]), "a:2"), mesh.from_numpy(np.array([0.5, -1.0]), "a:2")
>>> (new_p, new_v), = adafactor_update([(p, g, mesh.zeros("a:2", "float64"))], [None], lr=0.1, decay=0.0,
...                                    beta1=0.0, clip=None, scale_by_rms=False, epsilon1=0.0, epsilon2=0.0)
>>> np.round(new_p.to_numpy(), 6).tolist(), new_v.to_numpy().tolist()
([0.9, 2.1], [0.25, 1.0])
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..backend import is_eager
from ..errors import MpimeshError
from ..trace import dispatch_lower
from .relayout import to_layout
from .updates import _widened


def adafactor_update(groups: Sequence[tuple], factored: Sequence[Optional[tuple]], lr, decay, beta1: float,
                     clip: Optional[float], scale_by_rms: bool, epsilon1: float, epsilon2: float,
                     dtype=None) -> list:
    """Adafactor for many parameters in one op. Each group is `(p, g, vr, vc[, m])` where
    `factored[i]` is `(d0, d1)` (the names of p's two largest dims), else `(p, g, v[, m])`; `m`
    where `beta1 > 0`. Returns per group the new `(p, vr, vc[, m])` or `(p, v[, m])`, each in its
    input's layout. `lr`, `decay`: numbers or 0-d tensors (this step's rates); `dtype`: the dtype
    the update computes in, where a parameter's is narrower (its new value rounded back once)."""
    if not groups:
        return []
    mesh = groups[0][0].mesh
    for group in groups:
        p = group[0]
        if p.mesh is not mesh:
            raise MpimeshError("adafactor_update: parameters live on different meshes")
        if group[1].shape != p.shape:
            raise MpimeshError(f"adafactor_update: a gradient of shape {group[1].shape} goes with a "
                               f"parameter of shape {p.shape}")
    shared = [v for v in (lr, decay) if hasattr(v, "tensor_layout")]
    shared = [to_layout(v, ()) for v in shared]
    plans, tensors, specs = [], list(shared), []
    for group, dims in zip(groups, factored):
        p = group[0]
        layout = p.tensor_layout
        slots = [to_layout(s, tuple(layout[p.shape.index(n)] for n in s.shape.names)) for s in group[2:]]
        plans.append(_Plan(p, dims, len(slots)))
        tensors += [p, to_layout(group[1], layout), *slots]
        specs += [(p.shape, layout)] + [(s.shape, s.tensor_layout) for s in slots]
    sizes = [2 + plan.n_slots for plan in plans]
    options = (beta1, clip, scale_by_rms, epsilon1, epsilon2, dtype)
    lr_in, decay_in = hasattr(lr, "tensor_layout"), hasattr(decay, "tensor_layout")

    firsts = [sum(1 + plan.n_slots for plan in plans[:j]) for j in range(len(plans))]  # each new p's output

    def lower(ctx, *arrays, into=()):
        xp = ctx.xp
        i = len(shared)
        rates = list(arrays[:i])
        lr_v = rates.pop(0) if lr_in else lr
        decay_v = rates.pop(0) if decay_in else decay
        parts = []
        for plan, k in zip(plans, sizes):
            parts.append(arrays[i:i + k])
            i += k
        over = [j in into for j in firsts]  # (a donated p's block takes its new value: `mpimesh.compiled`)
        out = _update(ctx, xp, plans, parts, lr_v, decay_v, options, over)
        return tuple(out) if len(out) > 1 else out[0]
    lower.into = {j: len(shared) + sum(sizes[:g]) for g, j in enumerate(firsts)}
    flops = 16 * sum(math.prod(g[0].local.shape) for g in groups)
    widest = max(math.prod(g[0].local.shape) * np.dtype(dtype or g[0].dtype).itemsize * 3 for g in groups)
    params = {"beta1": beta1, "clipping_threshold": clip, "multiply_by_parameter_scale": scale_by_rms,
              "epsilon1": epsilon1, "epsilon2": epsilon2, "factored": tuple(factored), "scratch_bytes": widest,
              "lr": None if lr_in else lr, "decay": None if decay_in else decay}
    outs = dispatch_lower("adafactor_update", tensors, specs, lower, params, None, flops)
    result, j = [], 0
    for plan in plans:
        result.append(tuple(outs[j:j + 1 + plan.n_slots]))
        j += 1 + plan.n_slots
    return result


class _Plan:
    """One parameter's axes and the mesh dims its sums run over: `all_dims` (the whole of p),
    `d0_dims`/`d1_dims` (its largest and second largest dim, where factored)."""

    def __init__(self, p, dims: Optional[tuple], n_slots: int):
        names, layout = p.shape.names, p.tensor_layout
        self.n_slots = n_slots
        self.size = p.shape.size
        self.split = [(i, p.shape[n].size, layout[i]) for i, n in enumerate(names) if layout[i] is not None]
        self.all_dims = tuple(m for m in layout if m is not None)
        self.factored = dims is not None
        if dims:
            self.ax0, self.ax1 = names.index(dims[0]), names.index(dims[1])
            self.n0, self.n1 = p.shape[dims[0]].size, p.shape[dims[1]].size
            self.d0_dims = tuple(m for m in (layout[self.ax0],) if m is not None)
            self.d1_dims = tuple(m for m in (layout[self.ax1],) if m is not None)
            self.ax1_in_vr = self.ax1 - (self.ax0 < self.ax1)  # d1's axis in vr (p without d0)


def _real(ctx, xp, a, splits):
    """`a` with zeros in a JAX replay's padding along the split axes `(axis, size, mesh dim)`
    (nothing to do on ranks, which hold their blocks unpadded)."""
    for axis, size, m in splits:
        keep = ctx.real(size, m)
        if keep is not None:
            a = xp.where(keep.reshape((-1,) + (1,) * (a.ndim - axis - 1)), a, xp.zeros((), a.dtype))
    return a


class _Sums:
    """Partial sums to be summed across ranks, gathered per set of mesh dims and summed by one
    allreduce each: `add` returns a key, `run` sums, `get(key)` the summed array."""

    def __init__(self, ctx, xp):
        self.ctx, self.xp, self.parts, self.done = ctx, xp, {}, {}

    def add(self, a, mesh_dims: tuple):
        mesh_dims = tuple(sorted(mesh_dims))
        bucket = self.parts.setdefault(mesh_dims, [])
        bucket.append(a)
        return mesh_dims, len(bucket) - 1

    def run(self) -> None:
        xp = self.xp
        for dims, arrays in self.parts.items():
            if not dims:
                self.done[dims] = arrays
                continue
            flat = xp.concatenate([xp.reshape(a, (-1,)) for a in arrays])
            total = self.ctx.allreduce(flat, dims)
            out, at = [], 0
            for a in arrays:
                n = math.prod(a.shape)
                out.append(xp.reshape(total[at:at + n], a.shape))
                at += n
            self.done[dims] = out
        self.parts = {}

    def get(self, key):
        return self.done[key[0]][key[1]]


def _update(ctx, xp, plans, parts, lr, decay, options, over) -> list:
    beta1, clip, scale_by_rms, eps1, eps2, dtype = options
    one = 1.0 - decay
    first = _Sums(ctx, xp)
    keys = []
    for plan, (p, g, *slots) in zip(plans, parts):
        p, g = _widened(p, g, dtype)
        g2 = _real(ctx, xp, g * g, plan.split)
        k = {"p": p, "g": g}
        if scale_by_rms:
            k["pp"] = first.add(xp.sum(_real(ctx, xp, p * p, plan.split)), plan.all_dims)
        if plan.factored:
            k["r"] = first.add(xp.sum(g2, axis=plan.ax0), plan.d0_dims)  # vr's shape: p without d0
            k["c"] = first.add(xp.sum(g2, axis=plan.ax1), plan.d1_dims)
        else:
            k["g2"] = g2
        keys.append(k)
    first.run()
    second = _Sums(ctx, xp)
    for plan, k, (_, _, *slots) in zip(plans, keys, parts):
        if plan.factored:
            vr = decay * slots[0] + one * (first.get(k["r"]) * (1.0 / max(plan.n0, 1)) + eps1)
            vc = decay * slots[1] + one * (first.get(k["c"]) * (1.0 / max(plan.n1, 1)) + eps1)
            k["vr"], k["vc"] = vr, vc
            masked = _real(ctx, xp, vr, [(a - (a > plan.ax0), n, m) for a, n, m in plan.split if a != plan.ax0])
            k["row"] = second.add(xp.sum(masked, axis=plan.ax1_in_vr, keepdims=True), plan.d1_dims)
        else:
            k["v"] = decay * slots[0] + one * (k["g2"] + eps1)
    second.run()
    third = _Sums(ctx, xp)
    for plan, k in zip(plans, keys):
        if plan.factored:
            row_mean = second.get(k["row"]) * (1.0 / max(plan.n1, 1))
            r = 1.0 / xp.sqrt(k["vr"] / row_mean)
            c = 1.0 / xp.sqrt(k["vc"])
            u = k["g"] * (xp.expand_dims(r, plan.ax0) * xp.expand_dims(c, plan.ax1))
        else:
            u = k["g"] / xp.sqrt(k["v"])
        k["u"] = u
        if clip is not None:
            k["uu"] = third.add(xp.sum(_real(ctx, xp, u * u, plan.split)), plan.all_dims)
    third.run()
    out = []
    for plan, k, (p_in, _, *slots), mine in zip(plans, keys, parts, over):
        scale = lr
        if scale_by_rms:
            scale = lr * xp.maximum(xp.sqrt(first.get(k["pp"]) * (1.0 / max(plan.size, 1))), eps2)
        if clip is not None:
            rms_u = xp.sqrt(third.get(k["uu"]) * (1.0 / max(plan.size, 1)))
            scale = scale / xp.maximum(rms_u * (1.0 / clip), 1.0)
        d = k["u"] * scale
        new_slots = [k["vr"], k["vc"]] if plan.factored else [k["v"]]
        if beta1:
            d = beta1 * slots[-1] + (1.0 - beta1) * d
            new_slots.append(d)
        if mine and k["p"] is p_in and is_eager(xp):  # p - d rounded to p's dtype, as below, in p's block
            p1 = xp.subtract(p_in, d, out=p_in)
        else:
            p1 = k["p"] - d
        out.append(p1.astype(p_in.dtype) if p1.dtype != p_in.dtype else p1)
        out += [s.astype(old.dtype) if s.dtype != old.dtype else s for s, old in zip(new_slots, slots)]
    return out
