"""Differential test: random programs of about twenty ops, run under random layouts on every mesh
of this session's rank count (1-D, 2-D and 3-D, see meshes.py), must give the values of

* the same program on a one-rank mesh (`comm=MPI.COMM_SELF`, the same mesh dim names, all of size 1),
* numpy in float64, written here independently of the library (by dim names, with np.einsum),

to tight float64 tolerances. The gradients of a weighted sum of every value the program made, with
respect to its inputs, must also match between the mesh and the one-rank mesh.

A program is generated from a seed alone (numpy's generator and the program's own numpy values,
which steer it away from near-ties where argmax, where or a max's gradient could flip on rounding),
so every rank builds the same program; `test_programs_identical_on_every_rank` checks that. The
ops: einsum (1-3 inputs; output shape or reduced dims), elementwise binary/unary/scalar ops,
where, reductions (sum, mean, max, min, logsumexp; by reduced dims or output shape), softmax,
log_softmax, cumsum (exclusive, reverse), shift (wrap or not), slice, pad, concat, split, reshape,
transpose, rename_dimension, broadcast, relayout, argmax + one_hot, top_k, gather, conv1d, a
float32 round trip and stop_gradient; each op may run inside a `layout_scope` of random rules, and
the whole program runs under random global rules. Base sizes are multiples of 8 (even splits on 2, 4
and 8 ranks, uneven on 3 and 6); sizes made by slice, pad, concat and split are often uneven everywhere.
"""
from __future__ import annotations

import collections
import math
import os
import string
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from meshes import get_mesh, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import counters  # noqa: E402

WORLD = MPI.COMM_WORLD
NRANKS = WORLD.Get_size()
# Programs per mesh shape; MPIMESH_DIFF_SEEDS=N runs N for a deeper search.
SEEDS = range(int(os.environ.get("MPIMESH_DIFF_SEEDS", 0)) or {1: 10, 2: 16, 4: 12}.get(NRANKS, 8))
N_OPS = 20
BASE = {"a": 8, "b": 16, "c": 8, "d": 24}
MAX_ELEMENTS, MAX_RANK = 4096, 4
RTOL = 1e-9  # float64; each value is also allowed RTOL times the largest magnitude of its tensor
GAP = 1e-7   # a near-tie closer than this (relative) could flip on rounding: such ops are not generated


# --------------------------------------------------------------------------- the program format

@dataclass
class Step:
    """One op of a program: `op` applied to pool entries `ins` with parameters `p`, inside a
    `layout_scope(rules)` when `scope` is set. Its outputs are appended to the pool."""
    op: str
    ins: tuple
    p: dict = field(default_factory=dict)
    scope: Optional[dict] = None

    def __repr__(self) -> str:
        p = {k: (f"<array {v.shape}>" if isinstance(v, np.ndarray) else v) for k, v in self.p.items()}
        return f"{self.op}{list(self.ins)} {p}" + (f" scope={self.scope}" if self.scope else "")


@dataclass
class Val:
    """A pool entry on the numpy side: dim names, values (axes in names order), and whether it is
    an input (exact values on every mesh)."""
    names: tuple
    value: np.ndarray
    leaf: bool = False

    @property
    def sizes(self) -> tuple:
        return self.value.shape

    def size_of(self, name: str) -> int:
        return self.value.shape[self.names.index(name)]


# ------------------------------------------------------------------------ numpy, by dim names

def _subs(in_names: list, out_names) -> str:
    letters: dict = {}
    for names in list(in_names) + [out_names]:
        for n in names:
            letters.setdefault(n, string.ascii_letters[len(letters)])
    return ",".join("".join(letters[n] for n in ns) for ns in in_names) + "->" + "".join(letters[n] for n in out_names)


def _align(v: Val, out_names) -> np.ndarray:
    """v's values transposed and expanded to broadcast against axes `out_names`."""
    a = np.transpose(v.value, [v.names.index(n) for n in out_names if n in v.names])
    return a.reshape([v.size_of(n) if n in v.names else 1 for n in out_names])


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


UNARY_NP = {
    "tanh": np.tanh, "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "sin": np.sin, "cos": np.cos, "gelu": _gelu,
    "relu": lambda x: np.maximum(x, 0.0), "abs": np.abs, "square": np.square, "exp": np.exp,
    "negative": np.negative, "log1p2": lambda x: np.log(1.0 + x * x), "sqrt1p2": lambda x: np.sqrt(1.0 + x * x),
    "rsqrt1p2": lambda x: 1.0 / np.sqrt(1.0 + x * x),
}
BINARY_NP = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
             "minimum": np.minimum, "divide": lambda x, y: x / (1.0 + y * y)}


def _shift_np(a, axis, offset, wrap):
    if wrap:
        return np.roll(a, offset, axis)
    out = np.zeros_like(a)
    n = a.shape[axis]
    src = np.arange(n) - offset
    ok = (src >= 0) & (src < n)
    idx = [slice(None)] * a.ndim
    idx[axis] = np.nonzero(ok)[0]
    sidx = [slice(None)] * a.ndim
    sidx[axis] = src[ok]
    out[tuple(idx)] = a[tuple(sidx)]
    return out


def np_run(step: Step, ins: list) -> list:
    """The numpy float64 value(s) of one step, as Vals."""
    p, op = step.p, step.op
    x = ins[0] if ins else None
    if op == "leaf":
        return [Val(tuple(p["names"]), p["value"], leaf=True)]
    if op == "einsum":
        y = np.einsum(_subs([v.names for v in ins], p["out"]), *[v.value for v in ins]) * p["scale"]
        return [Val(tuple(p["out"]), y)]
    if op == "binary":
        out = x.names + tuple(n for n in ins[1].names if n not in x.names)
        return [Val(out, BINARY_NP[p["fn"]](_align(x, out), _align(ins[1], out)))]
    if op == "scalar":
        c, a = p["c"], x.value
        y = {"add": lambda: a + c, "mul": lambda: a * c, "rsub": lambda: c - a, "pow2": lambda: a ** 2,
             "max": lambda: np.maximum(a, c)}[p["fn"]]()
        return [Val(x.names, y)]
    if op == "unary":
        return [Val(x.names, UNARY_NP[p["fn"]](x.value))]
    if op == "where":
        out = x.names + tuple(n for n in ins[1].names if n not in x.names)
        xa = _align(x, out)
        return [Val(out, np.where(xa > 0, xa, _align(ins[1], out)))]
    if op == "reduce":
        axes = tuple(x.names.index(n) for n in p["reduced"])
        kind = p["kind"]
        if kind == "logsumexp":
            m = x.value.max(axis=axes, keepdims=True)
            r = np.log(np.exp(x.value - m).sum(axis=axes)) + np.squeeze(m, axes)
        else:
            r = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[kind](x.value, axis=axes)
        kept = [n for n in x.names if n not in p["reduced"]]
        return [Val(tuple(p["out"]), np.transpose(r, [kept.index(n) for n in p["out"]]))]
    if op == "softmax":
        axes = tuple(x.names.index(n) for n in p["dims"])
        z = x.value - x.value.max(axis=axes, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=axes, keepdims=True))
        return [Val(x.names, z - lse if p["log"] else np.exp(z - lse))]
    if op == "cumsum":
        ax = x.names.index(p["dim"])
        a = np.flip(x.value, ax) if p["reverse"] else x.value
        c = np.cumsum(a, ax) - (a if p["exclusive"] else 0.0)
        return [Val(x.names, np.flip(c, ax) if p["reverse"] else c)]
    if op == "shift":
        return [Val(x.names, _shift_np(x.value, x.names.index(p["dim"]), p["offset"], p["wrap"]))]
    if op == "slice":
        ax = x.names.index(p["dim"])
        return [Val(x.names, np.take(x.value, np.arange(p["begin"], p["begin"] + p["size"]), ax))]
    if op == "pad":
        ax = x.names.index(p["dim"])
        return [Val(x.names, np.pad(x.value, [(p["before"], p["after"]) if i == ax else (0, 0)
                                               for i in range(x.value.ndim)]))]
    if op == "concat":
        return [Val(x.names, np.concatenate([v.value for v in ins], x.names.index(p["dim"])))]
    if op == "split":
        ax = x.names.index(p["dim"])
        return [Val(x.names, part) for part in np.split(x.value, np.cumsum(p["sizes"])[:-1], ax)]
    if op == "reshape":
        return [Val(tuple(p["names"]), x.value.reshape(p["sizes"]))]
    if op == "transpose":
        return [Val(tuple(p["names"]), np.transpose(x.value, [x.names.index(n) for n in p["names"]]))]
    if op == "rename":
        return [Val(tuple(p["new"] if n == p["old"] else n for n in x.names), x.value)]
    if op == "broadcast":
        return [Val(tuple(p["names"]), np.broadcast_to(_align(x, p["names"]), p["sizes"]).copy())]
    if op in ("relayout", "stop_gradient"):
        return [Val(x.names, x.value)]
    if op == "cast32":
        return [Val(x.names, x.value.astype(np.float32).astype(np.float64))]
    if op == "argmax_onehot":
        ax = x.names.index(p["dim"])
        idx = np.argmax(x.value, ax)
        return [Val(tuple(n for n in x.names if n != p["dim"]) + (p["dim"],),
                    (idx[..., None] == np.arange(x.sizes[ax])).astype(np.float64))]
    if op == "top_k":
        ax = x.names.index(p["dim"])
        v = np.take(-np.sort(-x.value, ax), np.arange(p["k"]), ax)
        return [Val(tuple(p["k_name"] if n == p["dim"] else n for n in x.names), v)]
    if op == "gather":
        w, t = ins
        idx = np.argmax(t.value, t.names.index(p["d"]))
        inames = tuple(n for n in t.names if n != p["d"])
        hot = (idx[..., None] == np.arange(w.size_of(p["v"]))).astype(np.float64)
        return [Val(tuple(p["out"]), np.einsum(_subs([inames + (p["v"],), w.names], p["out"]), hot, w.value))]
    if op == "conv1d":
        f, d = p["filt"], p["dilation"]
        a = np.moveaxis(x.value, -2, 0)  # [L, ..., C]
        length = a.shape[0]
        ap = np.pad(a, [(d, d)] + [(0, 0)] * (a.ndim - 1))
        y = sum(np.einsum("...c,co->...o", ap[t * d:t * d + length], f[t]) for t in range(f.shape[0]))
        return [Val(x.names[:-1] + (p["co"],), np.moveaxis(y, 0, -2))]
    raise AssertionError(op)


# ---------------------------------------------------------------------------- mpimesh, by steps

def _shape(names, sizes) -> mm.Shape:
    return mm.Shape(list(zip(names, sizes)))


def mm_run(step: Step, ins: list, mesh: mm.Mesh) -> list:
    """The same step with mpimesh ops, on `mesh`."""
    p, op = step.p, step.op
    x = ins[0] if ins else None
    if op == "leaf":
        return [mesh.from_numpy(p["value"], _shape(p["names"], p["value"].shape), layout=p["layout"])]
    if op == "einsum":
        if p["form"] == "out":
            y = mm.einsum(ins, output_shape=[d for n in p["out"] for d in [_dim_of(ins, n)]])
        else:
            y = mm.einsum(ins, reduced_dims=list(p["reduced"]))
        return [y * p["scale"] if p["scale"] != 1.0 else y]
    if op == "binary":
        y = ins[1]
        if p["fn"] == "divide":
            return [mm.divide(x, mm.square(y) + 1.0)]
        return [getattr(mm, p["fn"])(x, y)]
    if op == "scalar":
        c = p["c"]
        return [{"add": lambda: x + c, "mul": lambda: x * c, "rsub": lambda: c - x, "pow2": lambda: x ** 2,
                 "max": lambda: mm.maximum(x, c)}[p["fn"]]()]
    if op == "unary":
        fn = p["fn"]
        if fn == "log1p2":
            return [mm.log(mm.square(x) + 1.0)]
        if fn == "sqrt1p2":
            return [mm.sqrt(1.0 + x * x)]
        if fn == "rsqrt1p2":
            return [mm.rsqrt(mm.square(x) + 1.0)]
        return [getattr(mm, fn)(x)]
    if op == "where":
        return [mm.where(mm.greater(x, 0.0), x, ins[1])]
    if op == "reduce":
        fn = getattr(mm, f"reduce_{p['kind']}")
        if p["form"] == "out":
            return [fn(x, output_shape=[x.shape[n] for n in p["out"]])]
        return [fn(x, reduced_dims=list(p["reduced"]))]
    if op == "softmax":
        return [(mm.log_softmax if p["log"] else mm.softmax)(x, list(p["dims"]))]
    if op == "cumsum":
        return [mm.cumsum(x, p["dim"], exclusive=p["exclusive"], reverse=p["reverse"])]
    if op == "shift":
        return [mm.shift(x, p["offset"], p["dim"], p["wrap"])]
    if op == "slice":
        return [mm.slice(x, p["begin"], p["size"], p["dim"])]
    if op == "pad":
        return [mm.pad(x, [p["before"], p["after"]], p["dim"])]
    if op == "concat":
        return [mm.concat(ins, p["dim"])]
    if op == "split":
        return mm.split(x, p["dim"], list(p["sizes"]))
    if op == "reshape":
        return [mm.reshape(x, _shape(p["names"], p["sizes"]))]
    if op == "transpose":
        return [mm.transpose(x, [x.shape[n] for n in p["names"]])]
    if op == "rename":
        return [mm.rename_dimension(x, p["old"], p["new"])]
    if op == "broadcast":
        return [mm.broadcast(x, _shape(p["names"], p["sizes"]))]
    if op == "relayout":
        return [mm.relayout(x, p["layout"])]
    if op == "stop_gradient":
        return [mm.stop_gradient(x)]
    if op == "cast32":  # no gradient through it: float32 rounding of the incoming gradient is a cliff
        return [mm.stop_gradient(mm.cast(mm.cast(x, "float32"), "float64"))]
    if op == "argmax_onehot":
        idx = mm.argmax(x, p["dim"])
        return [mm.one_hot(idx, x.shape[p["dim"]], dtype="float64")]
    if op == "top_k":
        values, _ = mm.top_k(x, p["dim"], mm.Dimension(p["k_name"], p["k"]))
        return [values]
    if op == "gather":
        return [mm.gather(ins[0], mm.argmax(ins[1], p["d"]), p["v"])]
    if op == "conv1d":
        f = p["filt"]
        names = (p["tap"], x.shape.names[-1], p["co"])
        filt = mesh.from_numpy(f, _shape(names, f.shape), layout=p["flayout"])
        return [mm.conv1d(x, filt, dilation=p["dilation"])]
    raise AssertionError(op)


def _dim_of(ins: list, name: str) -> mm.Dimension:
    return next(t.shape[name] for t in ins if name in t.shape)


# -------------------------------------------------------------------------------- the generator

class Generator:
    """Builds a program of `N_OPS` ops from `seed` for a mesh of `mesh_shape`, computing its numpy
    values as it goes (they steer it: no op on a near-tie, values kept in a moderate range)."""

    def __init__(self, seed: int, mesh_shape: mm.Shape):
        self.rng = np.random.default_rng(seed)
        self.mesh = mesh_shape
        self.steps: list = []
        self.vals: list = []
        self.usable: list = []  # pool indices an op may take
        self.fresh = 0

    # helpers -------------------------------------------------------------------------------
    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def perm(self, seq) -> list:
        return [seq[k] for k in self.rng.permutation(len(seq))]

    def name(self, prefix: str) -> str:
        self.fresh += 1
        return f"{prefix}{self.fresh}"

    def layout(self, names, sizes) -> dict:
        """A random valid explicit layout: distinct mesh dims (size-1 ones too), dividing the sizes or not."""
        free = list(self.mesh.names)
        out = {}
        for n, s in zip(names, sizes):
            choices = list(free)
            if choices and self.rng.random() < 0.7:
                m = self.pick(choices)
                out[n] = m
                free.remove(m)
        return out

    def rules(self, names=()) -> dict:
        """Random layout rules: some of the base dims and of `names` on distinct mesh dims (so no
        tensor puts two of its dims on one mesh dim); mostly as many as there are mesh dims."""
        mdims = self.perm(list(self.mesh.names))
        names = self.perm(list(dict.fromkeys(list(names) + list(BASE))))
        k = len(mdims) if self.rng.random() < 0.6 else int(self.rng.integers(0, len(mdims) + 1))
        return {n: m for n, m in zip(names[:k], mdims[:k])}

    @staticmethod
    def ok_size(sizes) -> bool:
        return len(sizes) <= MAX_RANK and math.prod(sizes) <= MAX_ELEMENTS

    def candidates(self, cond=lambda v: True) -> list:
        return [i for i in self.usable if cond(self.vals[i])]

    @staticmethod
    def compatible(*vals) -> bool:
        sizes: dict = {}
        for v in vals:
            for n, s in zip(v.names, v.sizes):
                if sizes.setdefault(n, s) != s:
                    return False
        return True

    @staticmethod
    def gap_ok(a: np.ndarray, axis: int, k: int = 1) -> bool:
        """The k+1 largest values along `axis` (all, if there are fewer) are apart by more than GAP
        (relative), so that the winners and their order cannot flip on rounding."""
        top = -np.sort(-np.moveaxis(a, axis, -1), -1)[..., :k + 1]
        return bool((np.diff(-top, axis=-1) > GAP * (1.0 + np.abs(a).max())).all())

    @staticmethod
    def away_from_zero(a: np.ndarray) -> bool:
        return bool((np.abs(a) > GAP * (1.0 + np.abs(a).max())).all())

    # the ops ---------------------------------------------------------------------------------
    def g_leaf(self):
        k = int(self.rng.integers(1, 4))
        names = self.perm(list(BASE))[:k]
        sizes = [BASE[n] for n in names]
        if not self.ok_size(sizes):
            return None
        value = self.rng.standard_normal(sizes)
        return Step("leaf", (), {"names": tuple(names), "value": value, "layout": self.layout(names, sizes)})

    def g_einsum(self):
        first = self.candidates()
        i = self.pick(first)
        ins = [i]
        for _ in range(int(self.rng.integers(0, 3))):
            more = self.candidates(lambda v: self.compatible(v, *[self.vals[j] for j in ins]))
            if more:
                ins.append(self.pick(more))
        vals = [self.vals[j] for j in ins]
        union: dict = {}
        for v in vals:
            for n, s in zip(v.names, v.sizes):
                union.setdefault(n, s)
        names = list(union)
        if self.rng.random() < 0.5:
            keep = [n for n in names if self.rng.random() < 0.6] or [self.pick(names)]
            out = self.perm(keep)
            form = "out"
        else:
            reduced = [n for n in names if self.rng.random() < 0.4]
            if len(reduced) == len(names):
                reduced = reduced[:-1]
            out = [n for n in names if n not in reduced]
            form = "reduced"
        reduced = [n for n in names if n not in out]
        if not self.ok_size([union[n] for n in out]):
            return None
        scale = 1.0 / math.prod(union[n] for n in reduced) if reduced else 1.0
        return Step("einsum", tuple(ins), {"out": tuple(out), "reduced": tuple(reduced), "form": form,
                                          "scale": scale})

    def g_binary(self):
        i = self.pick(self.candidates())
        x = self.vals[i]
        js = self.candidates(lambda v: self.compatible(x, v))
        j = self.pick(js)
        y = self.vals[j]
        out = x.names + tuple(n for n in y.names if n not in x.names)
        sizes = dict(zip(x.names + y.names, x.sizes + y.sizes))
        if not self.ok_size([sizes[n] for n in out]):
            return None
        fn = self.pick(list(BINARY_NP))
        if fn in ("maximum", "minimum") and not self.away_from_zero(_align(x, out) - _align(y, out)):
            return None  # a near-tie: its gradient could go either way
        return Step("binary", (i, j), {"fn": fn})

    def g_scalar(self):
        i = self.pick(self.candidates())
        fn = self.pick(["add", "mul", "rsub", "pow2", "max"])
        c = float(np.round(self.rng.uniform(-2, 2), 3))
        if fn == "max" and not self.away_from_zero(self.vals[i].value - c):
            return None
        return Step("scalar", (i,), {"fn": fn, "c": c})

    def g_unary(self):
        i = self.pick(self.candidates())
        a = self.vals[i].value
        fn = self.pick(list(UNARY_NP))
        if fn == "exp" and np.abs(a).max() > 5 or fn == "square" and np.abs(a).max() > 10:
            return None
        if fn in ("relu", "abs") and not self.away_from_zero(a):
            return None
        return Step("unary", (i,), {"fn": fn})

    def g_where(self):
        i = self.pick(self.candidates(lambda v: self.away_from_zero(v.value)))
        x = self.vals[i]
        j = self.pick(self.candidates(lambda v: self.compatible(x, v)))
        y = self.vals[j]
        sizes = dict(zip(x.names + y.names, x.sizes + y.sizes))
        if not self.ok_size([sizes[n] for n in dict.fromkeys(x.names + y.names)]):
            return None
        return Step("where", (i, j))

    def g_reduce(self):
        i = self.pick(self.candidates(lambda v: len(v.names) >= 2))
        x = self.vals[i]
        reduced = [n for n in x.names if self.rng.random() < 0.5] or [x.names[0]]
        if len(reduced) == len(x.names):
            reduced = reduced[1:]
        kind = self.pick(["sum", "mean", "max", "min", "logsumexp"])
        if kind in ("max", "min"):  # a unique extreme per output element (its gradient goes there)
            a = np.moveaxis(x.value, [x.names.index(n) for n in reduced], range(len(reduced)))
            a = a.reshape((-1,) + a.shape[len(reduced):])
            if not self.gap_ok(a if kind == "max" else -a, 0):
                return None
        kept = [n for n in x.names if n not in reduced]
        form = self.pick(["out", "reduced"])
        out = self.perm(kept) if form == "out" else kept
        return Step("reduce", (i,), {"kind": kind, "reduced": tuple(reduced), "out": tuple(out), "form": form})

    def g_softmax(self):
        i = self.pick(self.candidates())
        x = self.vals[i]
        dims = [n for n in x.names if self.rng.random() < 0.4] or [self.pick(x.names)]
        return Step("softmax", (i,), {"dims": tuple(dims), "log": bool(self.rng.random() < 0.5)})

    def g_cumsum(self):
        i = self.pick(self.candidates())
        return Step("cumsum", (i,), {"dim": self.pick(self.vals[i].names), "exclusive": bool(self.rng.random() < .5),
                                     "reverse": bool(self.rng.random() < 0.3)})

    def g_shift(self):
        i = self.pick(self.candidates())
        dim = self.pick(self.vals[i].names)
        n = self.vals[i].size_of(dim)
        return Step("shift", (i,), {"dim": dim, "offset": int(self.rng.integers(-n - 2, n + 3)),
                                    "wrap": bool(self.rng.random() < 0.5)})

    def g_slice(self):
        i = self.pick(self.candidates(lambda v: max(v.sizes) >= 16))
        x = self.vals[i]
        dim = self.pick([n for n in x.names if x.size_of(n) >= 16])
        n = x.size_of(dim)
        size = 8 * int(self.rng.integers(1, n // 8))
        return Step("slice", (i,), {"dim": dim, "begin": int(self.rng.integers(0, n - size + 1)), "size": size})

    def g_pad(self):
        i = self.pick(self.candidates())
        x = self.vals[i]
        dim = self.pick(x.names)
        total = 8 * int(self.rng.integers(1, 3))
        before = int(self.rng.integers(0, total + 1))
        sizes = [s + total if n == dim else s for n, s in zip(x.names, x.sizes)]
        if not self.ok_size(sizes):
            return None
        return Step("pad", (i,), {"dim": dim, "before": before, "after": total - before})

    def g_concat(self):
        i = self.pick(self.candidates())
        x = self.vals[i]
        dim = self.pick(x.names)
        ax = x.names.index(dim)
        same = self.candidates(lambda v: v.names == x.names and all(
            s == t for k, (s, t) in enumerate(zip(v.sizes, x.sizes)) if k != ax))
        ins = [i] + [self.pick(same) for _ in range(int(self.rng.integers(1, 3)))]
        total = sum(self.vals[j].size_of(dim) for j in ins)
        if not self.ok_size([total if n == dim else s for n, s in zip(x.names, x.sizes)]):
            return None
        return Step("concat", tuple(ins), {"dim": dim})

    def g_split(self):
        i = self.pick(self.candidates(lambda v: max(v.sizes) >= 16))
        x = self.vals[i]
        dim = self.pick([n for n in x.names if x.size_of(n) >= 16])
        n = x.size_of(dim) // 8
        cuts = sorted(set(int(c) for c in self.rng.integers(1, n, size=int(self.rng.integers(1, 3)))))
        sizes = [8 * (b - a) for a, b in zip([0] + cuts, cuts + [n])]
        return Step("split", (i,), {"dim": dim, "sizes": tuple(sizes)})

    def g_reshape(self):
        i = self.pick(self.candidates())
        x = self.vals[i]
        names, sizes = list(x.names), list(x.sizes)
        if len(names) >= 2 and self.rng.random() < 0.5:
            k = int(self.rng.integers(0, len(names) - 1))
            names[k:k + 2] = [self.name("m")]
            sizes[k:k + 2] = [sizes[k] * sizes[k + 1]]
        else:
            ks = [k for k, s in enumerate(sizes) if s % 64 == 0]
            if not ks or len(names) >= MAX_RANK:
                return None
            k = self.pick(ks)
            names[k:k + 1] = [self.name("s"), self.name("s")]
            sizes[k:k + 1] = [sizes[k] // 8, 8]
        return Step("reshape", (i,), {"names": tuple(names), "sizes": tuple(sizes)})

    def g_transpose(self):
        i = self.pick(self.candidates())
        return Step("transpose", (i,), {"names": tuple(self.perm(list(self.vals[i].names)))})

    def g_rename(self):
        i = self.pick(self.candidates())
        x = self.vals[i]
        old = self.pick(x.names)
        new = self.pick([n for n in BASE if n not in x.names and BASE[n] == x.size_of(old)] + [self.name("r")])
        return Step("rename", (i,), {"old": old, "new": new})

    def g_broadcast(self):
        i = self.pick(self.candidates(lambda v: len(v.names) < MAX_RANK))
        x = self.vals[i]
        new = self.pick([n for n in BASE if n not in x.names] or [self.name("n")])
        names = list(x.names)
        names.insert(int(self.rng.integers(0, len(names) + 1)), new)
        names = self.perm(names) if self.rng.random() < 0.3 else names
        sizes = [x.size_of(n) if n in x.names else BASE.get(n, 8) for n in names]
        if not self.ok_size(sizes):
            return None
        return Step("broadcast", (i,), {"names": tuple(names), "sizes": tuple(sizes)})

    def g_relayout(self):
        i = self.pick(self.candidates())
        x = self.vals[i]
        return Step("relayout", (i,), {"layout": self.layout(x.names, x.sizes)})

    def g_argmax_onehot(self):
        i = self.pick(self.candidates())
        x = self.vals[i]
        dims = [n for n in x.names if self.gap_ok(x.value, x.names.index(n))]
        if not dims:
            return None
        return Step("argmax_onehot", (i,), {"dim": self.pick(dims)})

    def g_top_k(self):
        i = self.pick(self.candidates())
        x = self.vals[i]
        dim = self.pick(x.names)
        k = 8 * int(self.rng.integers(1, x.size_of(dim) // 8 + 1))
        if not self.gap_ok(x.value, x.names.index(dim), k):
            return None
        return Step("top_k", (i,), {"dim": dim, "k": k, "k_name": self.name("k")})

    def g_gather(self):
        w = self.pick(self.candidates())
        wv = self.vals[w]
        v = self.pick(wv.names)
        rest = Val(tuple(n for n in wv.names if n != v), np.zeros([s for n, s in zip(wv.names, wv.sizes) if n != v]))
        ts = []
        for t in self.candidates():
            tv = self.vals[t]
            for d in tv.names:
                idx_names = tuple(n for n in tv.names if n != d)
                idx = Val(idx_names, np.zeros([s for n, s in zip(tv.names, tv.sizes) if n != d]))
                if tv.size_of(d) <= wv.size_of(v) and v not in idx_names and self.compatible(idx, rest):
                    ts.append((t, d))
        if not ts:
            return None
        t, d = self.pick(ts)
        tv = self.vals[t]
        if not self.gap_ok(tv.value, tv.names.index(d)):
            return None
        out = list(dict.fromkeys(tuple(n for n in tv.names if n != d) + rest.names))
        sizes = dict(zip(tv.names + wv.names, tv.sizes + wv.sizes))
        if not self.ok_size([sizes[n] for n in out]):
            return None
        return Step("gather", (w, t), {"v": v, "d": d, "out": tuple(out)})

    def g_conv1d(self):
        i = self.pick(self.candidates(lambda v: len(v.names) >= 2 and v.sizes[-2] >= 8))
        x = self.vals[i]
        co, tap = self.name("o"), self.name("t")
        filt = self.rng.standard_normal((3, x.sizes[-1], 8)) / math.sqrt(3 * x.sizes[-1])
        if not self.ok_size(x.sizes[:-1] + (8,)):
            return None
        return Step("conv1d", (i,), {"filt": filt, "co": co, "tap": tap, "dilation": int(self.rng.integers(1, 3)),
                                     "flayout": self.layout((tap, x.names[-1], co), filt.shape)})

    def g_cast32(self):
        i = self.pick(self.candidates(lambda v: v.leaf))  # exact inputs only: rounding to float32 is a cliff
        return Step("cast32", (i,))

    def g_stop_gradient(self):
        return Step("stop_gradient", (self.pick(self.candidates()),))

    WEIGHTS = {"einsum": 4, "binary": 3, "scalar": 2, "unary": 3, "where": 1, "reduce": 2, "softmax": 2,
               "cumsum": 1, "shift": 2, "slice": 2, "pad": 1, "concat": 1, "split": 1, "reshape": 2,
               "transpose": 1, "rename": 1, "broadcast": 1, "relayout": 2, "argmax_onehot": 1, "top_k": 1,
               "gather": 1, "conv1d": 1, "cast32": 1, "stop_gradient": 1, "leaf": 1}

    def add(self, step: Step) -> None:
        outs = np_run(step, [self.vals[i] for i in step.ins])
        self.steps.append(step)
        for v in outs:
            self.vals.append(v)
            self.usable.append(len(self.vals) - 1)
            big = float(np.abs(v.value).max()) if v.value.size else 0.0
            if big > 16:  # keep values moderate: scale by a power of two (exact), use the scaled one
                self.usable.remove(len(self.vals) - 1)
                c = 2.0 ** -math.ceil(math.log2(big))
                scaled = Step("scalar", (len(self.vals) - 1,), {"fn": "mul", "c": c})
                self.steps.append(scaled)
                self.vals.append(np_run(scaled, [v])[0])
                self.usable.append(len(self.vals) - 1)

    def build(self) -> tuple:
        rules = self.rules()
        while len(self.vals) < 3:
            leaf = self.g_leaf()
            if leaf is not None:
                self.add(leaf)
        ops = list(self.WEIGHTS)
        weights = np.array([self.WEIGHTS[o] for o in ops], float)
        made = 0
        while made < N_OPS:
            op = ops[int(self.rng.choice(len(ops), p=weights / weights.sum()))]
            try:
                step = getattr(self, f"g_{op}")()
            except (IndexError, ValueError):  # no candidate input for this op (an empty choice)
                step = None
            if step is None:
                continue
            if self.rng.random() < 0.25:  # this op under other rules, which may name its inputs' dims
                step.scope = self.rules([n for i in step.ins for n in self.vals[i].names])
            self.add(step)
            made += 1
        return rules, self.steps, self.vals


@lru_cache(maxsize=None)
def program(seed: int, mesh_shape: str) -> tuple:
    return Generator(seed, mm.Shape(mesh_shape)).build()


# ----------------------------------------------------------------------------------- running

SPLIT = [0, 0]  # tensors split over a mesh dim of size > 1, tensors made (this session)


@lru_cache(maxsize=None)
def _self_mesh(shape: str) -> mm.Mesh:
    return mm.Mesh(";".join(f"{d.name}:1" for d in mm.Shape(shape)), comm=MPI.COMM_SELF)


def run(steps: list, rules: dict, mesh: mm.Mesh, grads: bool) -> tuple:
    """Every value of the program on `mesh` (global arrays, each rank alike), and the gradients of
    a weighted sum of them with respect to the inputs (or None)."""
    pool: list = []
    with mm.trace() as tr, mm.layout_scope(mesh, rules):
        for step in steps:
            ins = [pool[i] for i in step.ins]
            if step.scope is not None:
                with mm.layout_scope(mesh, step.scope):
                    outs = mm_run(step, ins, mesh)
            else:
                outs = mm_run(step, ins, mesh)
            pool.extend(outs)
        grad_values = None
        if grads:
            leaves = [t for s, t in zip(_owners(steps), pool) if s.op == "leaf"]
            weights = np.random.default_rng(len(pool)).uniform(0.5, 1.5, len(pool))
            ys = [t * float(w) for t, w in zip(pool, weights) if t.dtype == np.float64]
            grad_values = [g.to_numpy() for g in tr.gradients(ys, leaves)]
    SPLIT[0] += sum(1 for t in pool if any(mesh.shape[m].size > 1 for m in t.layout.values()))
    SPLIT[1] += len(pool)
    return [t.to_numpy() for t in pool], [t.shape for t in pool], grad_values


def _owners(steps: list) -> list:
    """The step that made each pool entry (split makes several)."""
    out = []
    for s in steps:
        out.extend([s] * (len(s.p["sizes"]) if s.op == "split" else 1))
    return out


def _listing(steps: list) -> str:
    """The program, one step a line: `pool indices made = op[pool indices taken] params`."""
    lines, n = [], 0
    for s in steps:
        k = len(s.p["sizes"]) if s.op == "split" else 1
        lines.append(f"  {list(range(n, n + k))} = {s!r}")
        n += k
    return "\n".join(lines)


def compare(label: str, got: list, want: list, errors: list, owners: list) -> None:
    for k, (g, w) in enumerate(zip(got, want)):
        scale = float(np.abs(w).max()) if np.size(w) else 0.0
        try:
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * (1.0 + scale))
        except AssertionError as e:
            errors.append(f"{label}: value {k} (made by {owners[k]!r}) differs:{str(e)[:600]}")


# ------------------------------------------------------------------------------------- tests

@pytest.mark.mpi
@pytest.mark.parametrize("mesh_shape", mesh_shapes())
@pytest.mark.parametrize("seed", SEEDS)
def test_differential(mesh_shape: str, seed: int) -> None:
    """A random program on this mesh = on a one-rank mesh = numpy (values); gradients match too."""
    rules, steps, vals = program(seed, mesh_shape)
    mesh = get_mesh(mesh_shape)
    split_before = SPLIT[0]
    with mm.profile() as prof:
        got, shapes, grads = run(steps, rules, mesh, grads=True)
    if mesh.size > 1:  # the program really ran distributed: split tensors, collectives
        assert SPLIT[0] > split_before and bool(counters.traffic(prof.counters)), prof.counters
    one, one_shapes, one_grads = run(steps, rules, _self_mesh(mesh_shape), grads=True)
    owners = _owners(steps)
    errors: list = []
    for k, (s, v) in enumerate(zip(shapes, vals)):
        if s.names != v.names or s.sizes != v.sizes or one_shapes[k] != s:
            errors.append(f"value {k} (made by {owners[k]!r}): shape {s}, one rank {one_shapes[k]}, "
                          f"numpy {list(zip(v.names, v.sizes))}")
    compare("mesh vs numpy", got, [v.value for v in vals], errors, owners)
    compare("one rank vs numpy", one, [v.value for v in vals], errors, owners)
    leaves = [s for s in owners if s.op == "leaf"]
    compare("gradients, mesh vs one rank", grads, one_grads, errors, leaves)
    listing = _listing(steps)
    assert not errors, (f"{len(errors)} mismatches (seed {seed}, mesh {mesh_shape}, rules {rules}):\n"
                        + "\n".join(errors[:5]) + f"\nprogram:\n{listing}")


@pytest.mark.mpi
def test_programs_identical_on_every_rank() -> None:
    """The generator is deterministic: every rank builds the same programs (what the test above
    relies on), and different seeds build different ones."""
    mine = [repr(program(seed, shape)[:2]) + repr([v.value.sum() for v in program(seed, shape)[2]])
            for shape in mesh_shapes() for seed in SEEDS]
    assert all(other == mine for other in WORLD.allgather(mine)), "ranks built different programs"
    assert len(set(mine)) == len(mine), "two seeds built the same program"
    again = Generator(0, mm.Shape(mesh_shapes()[0])).build()
    assert repr(again[:2]) == repr(program(0, mesh_shapes()[0])[:2])


def test_program_coverage() -> None:
    """The programs that test_differential runs on this rank count use every kind of op."""
    seen = collections.Counter(s.op for shape in mesh_shapes() for seed in SEEDS for s in program(seed, shape)[1])
    missing = set(Generator.WEIGHTS) - set(seen)
    assert not missing, f"no program uses {sorted(missing)}; counts {dict(seen)}"


MUTATIONS = {"shift": ("offset", lambda v: v + 1), "scalar": ("c", lambda v: v * 1.5 + 0.25),
             "cumsum": ("exclusive", lambda v: not v), "einsum": ("scale", lambda v: v * 2.0),
             "unary": ("fn", lambda v: "sin" if v != "sin" else "cos")}


def _mutated(steps: list, vals: list):
    """The first one-parameter change of a step that changes the numpy values: (k, values)."""
    for k, step in enumerate(steps):
        if step.op not in MUTATIONS:
            continue
        key, change = MUTATIONS[step.op]
        bad = [Step(s.op, s.ins, dict(s.p), s.scope) for s in steps]
        bad[k].p[key] = change(bad[k].p[key])
        bad_vals: list = []
        for s in bad:
            bad_vals.extend(np_run(s, [bad_vals[i] for i in s.ins]))
        if any(not np.allclose(b.value, v.value, rtol=1e-6, atol=1e-6) for b, v in zip(bad_vals, vals)):
            return k, bad_vals
    return None


@pytest.mark.mpi
def test_differential_catches_a_wrong_op() -> None:
    """The comparison is able to fail: against the numpy values of the program with one op changed
    (a shift by one more, another constant, the other cumsum, another function...), the mesh's
    values are reported as different, while against the right values they are not."""
    mesh_shape = mesh_shapes()[-1]
    rules, steps, vals = program(0, mesh_shape)
    found = _mutated(steps, vals)
    assert found is not None, "no step of program 0 could be changed"
    k, bad_vals = found
    got, _, _ = run(steps, rules, get_mesh(mesh_shape), grads=False)
    errors: list = []
    compare("mesh vs changed numpy", got, [v.value for v in bad_vals], errors, _owners(steps))
    assert errors, f"changing step {k} ({steps[k]!r}) went unnoticed"
    errors = []
    compare("mesh vs numpy", got, [v.value for v in vals], errors, _owners(steps))
    assert not errors, errors[:3]
