"""Adafactor's update as one op for many parameters (multi-tensor, as `mpimesh.ops.updates`), the
formulas `mpimesh.optim.Adafactor`'s. A split parameter needs three rounds of sums across ranks (the
squares of p and the row and column sums of g**2; the new row factor's row means; the squares of u),
each one allreduce per set of mesh dims for every parameter's partial sums. The local sums are
`xp.sum`s (op by op: einsums), so values agree with the op-by-op update to rounding, not bitwise.

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
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np

from ..errors import MpimeshError
from ..opdef import Aval, OpDef, size
from ..trace import dispatch
from .relayout import to_layout
from .updates import widened


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
    for group, dims in zip(groups, factored):
        p = group[0]
        if p.mesh is not mesh:
            raise MpimeshError("adafactor_update: parameters live on different meshes")
        if group[1].shape != p.shape:
            raise MpimeshError(f"adafactor_update: a gradient of shape {group[1].shape} goes with a "
                               f"parameter of shape {p.shape}")
        if len(group) != 3 + (dims is not None) + bool(beta1):
            raise MpimeshError(f"adafactor_update: a parameter of shape {p.shape} comes with {len(group) - 2} slots, "
                               f"its update needs {1 + (dims is not None) + bool(beta1)}")
    shared = [to_layout(v, ()) for v in (lr, decay) if hasattr(v, "tensor_layout")]
    plans, tensors, specs = [], list(shared), []
    for group, dims in zip(groups, factored):
        p = group[0]
        layout = p.tensor_layout
        slots = [to_layout(s, tuple(layout[p.shape.index(n)] for n in s.shape.names)) for s in group[2:]]
        plans.append(_plan(p.shape, layout, None if dims is None else tuple(dims), len(slots)))
        tensors += [p, to_layout(group[1], layout), *slots]
        specs += [(p.shape, layout)] + [(s.shape, s.tensor_layout) for s in slots]
    params = {"plans": tuple(plans), "lr": None if hasattr(lr, "tensor_layout") else lr,
              "decay": None if hasattr(decay, "tensor_layout") else decay, "beta1": beta1, "clipping_threshold": clip,
              "multiply_by_parameter_scale": scale_by_rms, "epsilon1": epsilon1, "epsilon2": epsilon2,
              "dtype": None if dtype is None else np.dtype(dtype)}
    outs = dispatch(_op(tuple(plan.n_slots for plan in plans), len(shared)), tensors, specs, params)
    result, j = [], 0
    for plan in plans:
        result.append(tuple(outs[j:j + 1 + plan.n_slots]))
        j += 1 + plan.n_slots
    return result


def _kernel(in_place: bool):
    """`adafactor_update`'s kernel; `in_place` (numpy, CuPy): a donated p's block takes its new value."""
    def kernel(ctx, *arrays, plans, lr, decay, beta1, clipping_threshold, multiply_by_parameter_scale, epsilon1,
               epsilon2, dtype, into=()):
        i = (lr is None) + (decay is None)
        rates = list(arrays[:i])
        lr = rates.pop(0) if lr is None else lr
        decay = rates.pop(0) if decay is None else decay
        parts, over, j = [], [], 0
        for plan in plans:
            parts.append(arrays[i:i + 2 + plan.n_slots])
            over.append(in_place and j in into)
            i += 2 + plan.n_slots
            j += 1 + plan.n_slots
        options = (beta1, clipping_threshold, multiply_by_parameter_scale, epsilon1, epsilon2, dtype)
        out = _update(ctx, ctx.xp, plans, parts, lr, decay, options, over)
        return tuple(out) if len(out) > 1 else out[0]
    return kernel


def _flops(params, ins, outs) -> int:
    """Per element of p: g*g, u * scale, p - d (3); RMS(p) and clipping 2 each (a square, its sum);
    the momentum m 3. Factored: the two sums of g**2 and u = g * (r c) (4), and per element of vr 9
    (its update 5, its row sum 1, r = 1/sqrt(vr / row mean) 3), of vc 7 (5, c = 1/sqrt(vc) 2), of the
    row means 1; else 6 (v's update 4, u = g / sqrt(v) 2). The scalars (scale, clipping) not counted."""
    total, j = 0, 0
    per = 3 + 2 * bool(params["multiply_by_parameter_scale"]) + 2 * (params["clipping_threshold"] is not None) \
        + 3 * bool(params["beta1"])
    for plan in params["plans"]:
        n = size(outs[j])
        if plan.factored:
            vr, vc = outs[j + 1].shape, outs[j + 2].shape
            rows = math.prod(vr[:plan.ax1_in_vr] + vr[plan.ax1_in_vr + 1:])
            total += (per + 4) * n + 9 * math.prod(vr) + 7 * math.prod(vc) + rows
        else:
            total += (per + 6) * n
        j += 1 + plan.n_slots
    return total


def _scratch(params, ins, outs) -> int:
    """Three temporaries the size of the largest parameter, in the update's dtype."""
    dtype, j, most = params["dtype"], 0, 0
    for plan in params["plans"]:
        most = max(most, size(outs[j]) * np.dtype(dtype or outs[j].dtype).itemsize * 3)
        j += 1 + plan.n_slots
    return most


def _abstract(ctx, shapes, *ins, plans, lr, decay, multiply_by_parameter_scale, clipping_threshold, dtype,
              **_) -> tuple:
    """The outputs' dtypes (each its input's), and the kernel's three rounds of allreduces counted on
    `ctx`: one per set of mesh dims, of the partial sums' blocks (`_Sums`), in numpy's promotion of
    the kernel's formulas."""
    i = (lr is None) + (decay is None)
    rate = (ins[i - 1].dtype,) if decay is None else ()  # (a decay tensor takes part in the slots' dtypes)
    groups = []  # (plan, p, slots, g's dtype in the update, g's shape)
    for plan in plans:
        p, g, *slots = ins[i:i + 2 + plan.n_slots]
        groups.append((plan, p, slots, np.dtype(dtype or g.dtype), g.shape))
        i += 2 + plan.n_slots
    first, second, third = _DrySums(ctx), _DrySums(ctx), _DrySums(ctx)
    for plan, p, slots, gw, shape in groups:
        if multiply_by_parameter_scale:
            first.add((), dtype or p.dtype, plan.all_dims)
        if plan.factored:
            first.add(_without(shape, plan.ax0), gw, plan.d0_dims)
            first.add(_without(shape, plan.ax1), gw, plan.d1_dims)
    first.run()
    for plan, p, slots, gw, shape in groups:
        if plan.factored:
            row = list(slots[0].shape)
            row[plan.ax1_in_vr] = 1
            second.add(tuple(row), np.result_type(*rate, slots[0].dtype, first.get(gw, plan.d0_dims)), plan.d1_dims)
    second.run()
    for plan, p, slots, gw, shape in groups:
        if plan.factored:
            vr = np.result_type(*rate, slots[0].dtype, first.get(gw, plan.d0_dims))
            vc = np.result_type(*rate, slots[1].dtype, first.get(gw, plan.d1_dims))
            u = np.result_type(gw, vr, second.get(vr, plan.d1_dims), vc)
        else:
            u = np.result_type(gw, *rate, slots[0].dtype)
        if clipping_threshold is not None:
            third.add((), u, plan.all_dims)
    third.run()
    return tuple(a.dtype for _, p, slots, _, _ in groups for a in (p, *slots))


def _without(shape: tuple, axis: int) -> tuple:
    return shape[:axis] + shape[axis + 1:]


class _DrySums:
    """`_Sums` on shapes and dtypes: `add` a partial sum's block, `run` counts each set of mesh dims'
    allreduce on `ctx` (the blocks concatenated, in their promotion), `get` the dtype a sum comes back in."""

    def __init__(self, ctx):
        self.ctx, self.parts = ctx, {}

    def add(self, shape: tuple, dtype, mesh_dims: tuple) -> None:
        self.parts.setdefault(tuple(sorted(mesh_dims)), []).append((math.prod(shape), np.dtype(dtype)))

    def run(self) -> None:
        for dims, parts in self.parts.items():
            if dims:
                self.ctx.allreduce(Aval((sum(n for n, _ in parts),), np.result_type(*(d for _, d in parts))), dims)

    def get(self, dtype, mesh_dims: tuple):
        """The dtype of a sum of `dtype` over `mesh_dims` once summed (its bucket's, where it has one)."""
        dims = tuple(sorted(mesh_dims))
        return np.result_type(*(d for _, d in self.parts[dims])) if dims else dtype


@lru_cache(maxsize=256)
def _op(slots: tuple, n_shared: int) -> OpDef:
    """The `OpDef` of an update of parameters with `slots` slots each, after `n_shared` rates: its
    `into` maps each parameter's new value over the old (its slots are new arrays)."""
    into, i, j = {}, n_shared, 0
    for n in slots:
        into[j] = i
        i += 2 + n
        j += 1 + n
    return OpDef("adafactor_update", _GENERIC, kernels=_KERNELS, into=into, flops=_flops, scratch=_scratch,
                 abstract=_abstract)


_GENERIC = _kernel(in_place=False)
_KERNELS = {"numpy": _kernel(in_place=True), "cupy": _kernel(in_place=True)}


@lru_cache(maxsize=1024)
def _plan(shape, layout: tuple, dims: Optional[tuple], n_slots: int) -> "_Plan":
    """One parameter's `_Plan`, made once per shape, layout, factored dims and slots (a param of the op)."""
    return _Plan(shape, layout, dims, n_slots)


class _Plan:
    """One parameter's axes and the mesh dims its sums run over: `all_dims` (the whole of p),
    `d0_dims`/`d1_dims` (its largest and second largest dim, where factored)."""

    def __init__(self, shape, layout: tuple, dims: Optional[tuple], n_slots: int):
        names = shape.names
        self.n_slots = n_slots
        self.size = shape.size
        self.split = [(i, shape[n].size, layout[i]) for i, n in enumerate(names) if layout[i] is not None]
        self.all_dims = tuple(m for m in layout if m is not None)
        self.factored = dims is not None
        if dims:
            self.ax0, self.ax1 = names.index(dims[0]), names.index(dims[1])
            self.n0, self.n1 = shape[dims[0]].size, shape[dims[1]].size
            self.d0_dims = tuple(m for m in (layout[self.ax0],) if m is not None)
            self.d1_dims = tuple(m for m in (layout[self.ax1],) if m is not None)
            self.ax1_in_vr = self.ax1 - (self.ax0 < self.ax1)  # d1's axis in vr (p without d0)


def _real(ctx, xp, a, splits):
    """`a` with zeros in a JAX replay's padding along the split axes `(axis, size, mesh dim)`
    (nothing to do on ranks, which hold their blocks unpadded)."""
    for axis, length, m in splits:
        keep = ctx.real(length, m)
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
        p, g = widened(p, g, dtype)
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
        if mine and k["p"] is p_in:  # p - d rounded to p's dtype, as below, in p's block (numpy, CuPy)
            p1 = xp.subtract(p_in, d, out=p_in)
        else:
            p1 = k["p"] - d
        out.append(p1.astype(p_in.dtype) if p1.dtype != p_in.dtype else p1)
        out += [s.astype(old.dtype) if s.dtype != old.dtype else s for s, old in zip(new_slots, slots)]
    return out
