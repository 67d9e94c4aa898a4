"""Fusion of a compiled step's elementwise ops: each chain of them runs as one generated kernel.

`plan` groups ops with a C expression (`OpDef.cexpr`) of one output shape and layout, producer with
consumer, where some place can run the whole group (`place`); `fuse` makes each group one step whose
kernel `source` writes from their expressions, each value rounded as its op rounds it: on CuPy one
`ElementwiseKernel` (`BUILDERS`; no multiply-add contraction: bitwise the unfused values). More: docs/compile.md.

>>> import mpimesh as mm; from mpimesh.program import Program
>>> x = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF).ones("a:4")
>>> with mm.trace() as tr:
...     z = mm.relu(x * x + 1.0) * 2.0
>>> p = Program(tr, [x], [z])
>>> [(at, [p.ops[k].name for k in g]) for at, g in plan(p.ops, p.output_ids)], traffic(fuse(p.ops, p.output_ids))
([(3, ['multiply', 'add', 'relu', 'multiply'])], (1, 32))
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

from .backend import BFLOAT16, align, cached_kernel
from .opdef import C_TYPES, OpDef
from .ops.rowwise import BF16_CONVERSIONS

STORAGE = {np.dtype(k): v for k, v in (("float32", "float32"), ("float64", "float64"), ("bfloat16", "uint16"),
                                       ("int32", "int32"), ("int64", "int64"), ("bool", "bool"))}
"""The dtypes a fused kernel reads and writes, as its parameters hold them (bfloat16 as its bits)."""
VALUE = {np.dtype(k): v for k, v in dict(C_TYPES, int32="int", int64="long long", bool="bool").items()}
"""The C type a fused kernel computes each dtype's values in (the outputs': `opdef.C_TYPES`)."""
_COMPUTED = {np.dtype(k) for k in C_TYPES}
_BF16 = "namespace bf16 {\n" + BF16_CONVERSIONS + "}\n"  # (its own namespace: nothing CuPy includes can clash)


def _cupy_kernel(xp, in_params: str, out_params: str, body: str, preamble: str, name: str):
    """The `ElementwiseKernel`, compiled now on one element of each input, or None where NVRTC refuses it
    (the members' own kernels run then)."""
    kernel = xp.ElementwiseKernel(in_params, out_params, body, name, preamble=preamble, options=("--fmad=false",))
    try:
        kernel(*(xp.zeros(1, np.dtype(p.split()[0])) for p in in_params.split(", ")))
    except Exception:
        return None
    return kernel


BUILDERS = {"cupy": _cupy_kernel}
"""backend -> `build(xp, in_params, out_params, body, preamble, name)`: the fused kernel, called as
CuPy calls an `ElementwiseKernel` (inputs broadcast to the output's shape), or None (the members' own
kernels run). `mm.compile` fuses where its mesh's backend has one."""


def applies(backend: str) -> bool:
    """Whether `fuse` makes kernels for `backend` (`mm.compile` fuses there)."""
    return backend in BUILDERS


def expression(rec):
    """The record's C expression (`OpDef.c_expression`), or None: not an elementwise op of one output
    whose inputs and output a fused kernel holds, or no C form for these params and dtypes."""
    if rec.op.cexpr is None or len(rec.outputs) != 1:
        return None
    out = rec.outputs[0]
    if any(np.dtype(t.dtype) not in STORAGE or not set(t.shape.names) <= set(out.shape.names)
           for t in rec.inputs) or np.dtype(out.dtype) not in _COMPUTED:
        return None
    return rec.op.c_expression(rec.params, [t.dtype for t in rec.inputs], out.dtype)


def _readers(ops, outputs) -> dict:
    """`{tensor id: indices of the ops that read it}`, the program's outputs read at `len(ops)`."""
    readers: dict = {}
    for k, rec in enumerate(ops):
        for t in rec.inputs:
            readers.setdefault(id(t), []).append(k)
    for i in outputs:
        readers.setdefault(i, []).append(len(ops))
    return readers


def place(members: list, ops, readers: dict, made: dict):
    """The index of the op after which `members` (ascending op indices) can all run, or None: after
    every other op that makes one of their inputs, before every other op that reads one of their
    outputs; the last member's place where it can, else just before the first such reader."""
    inside = set(members)
    after = max((made.get(id(t), -1) for m in members for t in ops[m].inputs if made.get(id(t)) not in inside),
                default=-1)
    before = min((r for m in members for t in ops[m].outputs for r in readers.get(id(t), ()) if r not in inside),
                 default=len(ops) + 1)
    return min(members[-1], before - 1) if after < before else None


def plan(ops, outputs=()) -> list:
    """`[(place, group)]`: the groups of two or more op indices (ascending) that `fuse` runs as one
    kernel each, after the op at `place`; `outputs`: the ids of the program's outputs (written out)."""
    readers, made = _readers(ops, outputs), {id(t): k for k, rec in enumerate(ops) for t in rec.outputs}
    group: dict = {}
    for k, rec in enumerate(ops):
        if expression(rec) is None:
            continue
        domain = (rec.outputs[0].shape, rec.outputs[0].tensor_layout)
        mine = [k]
        for t in rec.inputs:
            g = group.get(made.get(id(t)), ())
            if not g or g[0] in mine or (ops[g[0]].outputs[0].shape, ops[g[0]].outputs[0].tensor_layout) != domain:
                continue
            trial = sorted(set(mine) | set(g))
            if place(trial, ops, readers, made) is not None:
                mine = trial
        for m in mine:
            group[m] = mine
    groups = [g for g in {id(g): g for g in group.values()}.values() if len(g) > 1]
    while True:  # a group placed before another whose output it reads runs unfused (each place was found alone)
        placed = [(place(g, ops, readers, made), g) for g in groups]
        late = _first_misplaced(ops, placed, made)
        if late is None:
            return placed
        groups.remove(late)


def _first_misplaced(ops, placed: list, made: dict):
    """The first group of `placed` that would run before a tensor it reads is made, or None."""
    owner = {m: g for _, g in placed for m in g}
    at: dict = {}
    for k, g in placed:
        at.setdefault(k, []).append(g)
    done: set = set()
    for k, rec in enumerate(ops):
        for g in ([] if k in owner else [None]) + at.get(k, []):
            recs = [rec] if g is None else [ops[m] for m in g]
            mine = {id(t) for r in recs for t in r.outputs}
            for t in (t for r in recs for t in r.inputs if id(t) in made and id(t) not in mine):
                if id(t) not in done:
                    return g if g is not None else owner[made[id(t)]]
            done |= mine
    return None


class FusedRecord:
    """A group of elementwise op records as one step: `op` (an `OpDef` with the generated kernel), the
    group's `inputs` (read from outside it) and `outputs` (read after it, or the program's), `params`
    (none), `flops` (the members'), `members` (their records)."""

    __slots__ = ("op", "inputs", "outputs", "params", "flops", "members")

    def __init__(self, op: OpDef, inputs: tuple, outputs: tuple, members: list):
        self.op, self.inputs, self.outputs, self.params, self.members = op, inputs, outputs, {}, members
        self.flops = sum(rec.flops for rec in members)

    @property
    def name(self) -> str:
        return self.op.name


def fuse(ops, outputs, backend: str = "cupy") -> list:
    """`ops` (a program's records, `outputs` the ids of its outputs) with each group of `plan` replaced
    by one `FusedRecord` at its `place`, its kernel made for `backend`."""
    placed, readers = plan(ops, outputs), _readers(ops, outputs)
    inside = {m for _, g in placed for m in g}
    at: dict = {}
    for k, g in placed:
        at.setdefault(k, []).append(_fused([ops[m] for m in g], set(g), readers, backend))
    return [r for k, rec in enumerate(ops) for r in ([] if k in inside else [rec]) + at.get(k, [])]


def _fused(recs: list, members: set, readers: dict, backend: str) -> FusedRecord:
    made = {id(t) for rec in recs for t in rec.outputs}
    inputs = tuple({id(t): t for rec in recs for t in rec.inputs if id(t) not in made}.values())
    outputs = tuple(t for rec in recs for t in rec.outputs if any(r not in members for r in readers.get(id(t), ())))
    in_params, out_params, body, preamble = source(recs, inputs, outputs)
    names = [rec.name for rec in recs]
    digest = hashlib.sha1(body.encode()).hexdigest()[:10]
    spec = (in_params, out_params, body, preamble, f"mpimesh_fused_{len(recs)}_{digest}")
    domain = recs[-1].outputs[0].shape.names
    sequential = _sequential(recs, inputs, outputs, backend)
    op = OpDef(f"fused({'+'.join(names)})", sequential, cexpr=_no_expression,
               kernels={backend: _generated(spec, [t.shape.names for t in inputs], domain,
                                            [np.dtype(t.dtype) for t in outputs], backend, sequential)})
    return FusedRecord(op, inputs, outputs, recs)


def _no_expression(params, ins, out) -> None:
    """A fused step's `cexpr`: an elementwise pass over memory, with no one expression of its own."""
    return None


def source(recs: list, inputs: tuple, outputs: tuple) -> tuple:
    """`(in_params, out_params, body, preamble)` of the kernel that computes `recs` (elementwise op
    records, in order) from `inputs` and writes `outputs`: each input loaded into its C type
    (`VALUE`), each op's expression over its operands converted to its output's C type, its value
    rounded to its dtype (bfloat16: stored and loaded back, as the op's own kernel rounds it)."""
    var: dict = {}
    lines, bf16 = [], False
    for j, t in enumerate(inputs):
        dt = np.dtype(t.dtype)
        bf16 |= dt == BFLOAT16
        var[id(t)] = (f"v{len(var)}", dt)
        lines.append(f"{VALUE[dt]} v{len(var) - 1} = {'bf16::load(in%d)' % j if dt == BFLOAT16 else 'in%d' % j};")
    for rec in recs:
        dt = np.dtype(rec.outputs[0].dtype)
        ct = VALUE[dt]
        operands = [v if VALUE[d] == ct else f"(({ct}){v})" for v, d in (var[id(t)] for t in rec.inputs)]
        v = f"v{len(var)}"
        lines.append(f"{ct} {v} = {expression(rec).format(*operands)};")
        if dt == BFLOAT16:
            bf16 = True
            lines.append(f"{v} = bf16::load(bf16::store({v}));")
        var[id(rec.outputs[0])] = (v, dt)
    for j, t in enumerate(outputs):
        v, dt = var[id(t)]
        lines.append(f"out{j} = {'bf16::store(%s)' % v if dt == BFLOAT16 else v};")
    in_params = ", ".join(f"{STORAGE[np.dtype(t.dtype)]} in{j}" for j, t in enumerate(inputs))
    out_params = ", ".join(f"{STORAGE[np.dtype(t.dtype)]} out{j}" for j, t in enumerate(outputs))
    return in_params, out_params, "\n".join(lines), _BF16 if bf16 else ""


def _bits(a):
    """A bfloat16 block as its bits (how the kernel's parameters hold it), any other as it is."""
    return a.view(np.uint16) if a.dtype == BFLOAT16 else a


def _generated(spec: tuple, in_dims: list, domain: tuple, dtypes: list, backend: str, fallback):
    """The fused step's kernel on `backend`: the inputs' blocks aligned to the output's dims, the kernel
    built from `spec` on first use (one cache for every program: `backend.cached_kernel`); `fallback`
    where the backend refused it."""
    def kernel(ctx, *arrays):
        xp = ctx.xp
        run = cached_kernel(("fusion", backend) + spec, lambda: BUILDERS[backend](xp, *spec))
        if run is None:
            return fallback(ctx, *arrays)
        result = run(*(_bits(align(xp, a, dims, domain)) for a, dims in zip(arrays, in_dims)))
        result = result if isinstance(result, tuple) else (result,)
        result = tuple(r.view(dt) if r.dtype != dt else r for r, dt in zip(result, dtypes))  # (bfloat16's bits)
        return result if len(result) > 1 else result[0]
    return kernel


def _sequential(recs: list, inputs: tuple, outputs: tuple, backend: str):
    """The members' own kernels one after the other (the fused op's generic kernel)."""
    at = {id(t): j for j, t in enumerate(inputs)}
    for k, rec in enumerate(recs):
        at[id(rec.outputs[0])] = len(inputs) + k
    steps = [(rec.op.kernel_for(backend), rec.params, [at[id(t)] for t in rec.inputs]) for rec in recs]
    wanted = [at[id(t)] for t in outputs]

    def kernel(ctx, *arrays):
        values = list(arrays)
        for run, params, ins in steps:
            values.append(ctx.xp.asarray(run(ctx, *(values[i] for i in ins), **params)))
        result = tuple(values[i] for i in wanted)
        return result if len(result) > 1 else result[0]
    return kernel


def traffic(ops) -> tuple:
    """`(passes, bytes)`: the steps of elementwise ops (`OpDef.cexpr` declared, fused steps too) and the
    bytes they move on this rank, each distinct input block read once and each output written once; a
    row kernel's folded chains (`rowfusion.RowRecord.folded`) add their bytes, not a pass."""
    passes = moved = 0
    for rec in ops:
        moved += getattr(rec, "folded", 0)
        if rec.op.cexpr is None:
            continue
        passes += 1
        moved += sum(_nbytes(t) for t in {id(t): t for t in rec.inputs + tuple(rec.outputs)}.values())
    return passes, moved


def _nbytes(t) -> int:
    shape = t.local_shape if hasattr(t, "local_shape") else t.local.shape
    return math.prod(shape) * np.dtype(t.dtype).itemsize
