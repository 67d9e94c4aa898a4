"""Elementwise steps folded into the kernels that read them: a residual add and its layer norm, one kernel.

`fold` (after `fusion.fuse`) computes the elementwise step whose output a layer or RMS norm reads as x (its
gradient as g) inside the one-kernel rows as they are read (a *prologue*: `rowwise.ROWS_HOOKS`), and the
step that alone reads the gradient's dx as it is stored (an *epilogue*), from `fusion.source`'s code
(each op's rounding), compiled as the unfused rows are (no multiply-add contraction): bitwise the
unfused values; an update reads its gradients' casts from bfloat16 as it loads them. Where the rows are not
whole or a block not contiguous, the members' own kernels run (docs/compile.md).

>>> import mpimesh as mm; from mpimesh.program import Program; from mpimesh.ops.norm import layer_norm
>>> x = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF).ones("a:2;d:4")
>>> with mm.trace() as tr: y = layer_norm(x + x, ("d",))
>>> [r.name for r in fold(Program(tr, [x], [y]).ops, [id(y)])]
['rows(add+layer_norm)']
"""
from __future__ import annotations

import hashlib

import numpy as np

from . import fusion
from .backend import BFLOAT16, accumulation_dtype, cached_kernel
from .opdef import Aval, OpDef
from .ops import norm, rowwise, updates
from .ops.elementwise import CAST, CAST_NO_GRAD

C_STORAGE = {"float32": "float", "float64": "double", "uint16": "unsigned short", "int32": "int",
             "int64": "long long", "bool": "bool"}
"""`fusion.STORAGE`'s types in C."""
_LN = (rowwise.ROWS_KERNELS, rowwise.ROWS_PARAMS)
_RMS = (norm.RMS_ROWS_KERNELS, norm.RMS_ROWS_PARAMS)
HOOKS = {norm.LAYER_NORM: ("mpimesh_layer_norm_rows", 0, None, *_LN),
         norm.LAYER_NORM_GRAD: ("mpimesh_layer_norm_grad_rows", 1, 0, *_LN),
         norm.RMS_NORM: ("mpimesh_rms_norm_rows", 0, None, *_RMS),
         norm.RMS_NORM_GRAD: ("mpimesh_rms_norm_grad_rows", 1, 0, *_RMS)}
"""op -> (its row kernel, the input a prologue may compute (x, g), the output an epilogue may take (dx) or
None, the kernels' sources and parameters)."""
BUILDERS = {"cupy": rowwise.compile_rows}
"""backend -> `build(xp, source, names, dtype)`: the row kernels of `source` (`rowwise.compile_rows`), or None."""


class RowRecord:
    """A row op with its folded chains as one step: `op`, `inputs`, `outputs` (the row op's, less a dx
    the epilogue took, then the chains' written ones), `members` (the chains' and the row op's records),
    `folded` (the bytes the chains add to the row kernel's: their inputs read and outputs written, less
    the row kernel's own reads and writes they replace; `fusion.traffic`)."""

    __slots__ = ("op", "inputs", "outputs", "params", "flops", "members", "folded")

    def __init__(self, op, inputs, outputs, members, folded):
        self.op, self.inputs, self.outputs, self.params, self.members = op, inputs, outputs, {}, members
        self.flops, self.folded = sum(r.flops for r in members), folded

    @property
    def name(self) -> str:
        return self.op.name


def _chain(rec):
    """`(members, inputs, outputs)` of an elementwise step, or None."""
    if isinstance(rec, fusion.FusedRecord):
        return rec.members, rec.inputs, rec.outputs
    return ([rec], rec.inputs, rec.outputs) if fusion.expression(rec) is not None else None


def _suffix(t, like) -> bool:
    """Whether `t` has `like`'s last dims (all of them, or fewer: broadcast over the leading ones) and
    their layout: its element for `like`'s element e is at `e % (its block's size)`."""
    k = len(t.shape.names)
    return 0 < k <= len(like.shape.names) and tuple(t.shape) == tuple(like.shape)[len(like.shape.names) - k:] \
        and tuple(t.tensor_layout) == tuple(like.tensor_layout)[len(like.shape.names) - k:]


def _fits(chain, like) -> bool:
    """Whether `chain`'s outputs have `like`'s dims and layout (its row kernel's blocks), its inputs those
    or their last ones (`_suffix`), one input at least all of them."""
    full = [t.shape == like.shape and t.tensor_layout == like.tensor_layout for t in chain[1]]
    return any(full) and all(f or _suffix(t, like) for f, t in zip(full, chain[1])) \
        and all(t.shape == like.shape and t.tensor_layout == like.tensor_layout for t in chain[2]) \
        and all(np.dtype(t.dtype) in fusion.STORAGE for t in chain[1] + tuple(chain[2]))


def fold(ops, outputs, backend: str = "cupy") -> list:
    """`ops` (`fusion.fuse`'s steps; `outputs` the program's output ids) with each layer norm (gradient)
    that can take its producer's chain (prologue) or its dx's one reader's (epilogue) one `RowRecord`,
    and each optimizer update with its gradients' casts from bfloat16 (`_widening`) one `RowRecord`."""
    readers, made = fusion._readers(ops, outputs), {id(t): k for k, rec in enumerate(ops) for t in rec.outputs}
    taken, at = set(), {}
    for k, rec in enumerate(ops):
        hook = HOOKS.get(rec.op)
        if hook is None:
            casts = _widening(ops, k, readers, made)
            if casts:
                taken |= {k, *casts}
                at[k] = _update_record(rec, [ops[c] for c in casts])
            continue
        if k in taken:
            continue
        t = rec.inputs[hook[1]]
        p = made.get(id(t))
        pro = None
        if p is not None and p not in taken and _chain(ops[p]) and _fits(_chain(ops[p]), t) \
                and all(r >= k for u in ops[p].outputs for r in readers.get(id(u), ()) if r != k):
            pro = p
        epi = None
        if hook[2] is not None:
            dx = rec.outputs[hook[2]]
            rs = readers.get(id(dx), [])
            if len(rs) == 1 and rs[0] < len(ops) and rs[0] not in taken and _chain(ops[rs[0]]) \
                    and _fits(_chain(ops[rs[0]]), dx) and all(made.get(id(u), -1) < k for u in ops[rs[0]].inputs
                                                              if u is not dx):
                epi = rs[0]
        if pro is None and epi is None:
            continue
        taken |= {k} | {i for i in (pro, epi) if i is not None}
        at[k] = _row_record(rec, hook, None if pro is None else ops[pro], None if epi is None else ops[epi],
                            readers, k, backend)
    return [at.get(k, rec) for k, rec in enumerate(ops) if k not in taken or k in at]


def _widening(ops, k: int, readers: dict, made: dict) -> list:
    """The indices of the casts (bfloat16 to float32, read by this op alone) of the gradients of update
    op `ops[k]` (`updates.gradient_inputs`), where its parameters and gradients are all float32 and its
    `dtype` None or float32: CuPy's update kernel widens those gradients as it reads them, exactly as
    the cast does (`updates.kernel_source`); elsewhere the update widens them first, as `cast`."""
    rec = ops[k]
    gs = updates.gradient_inputs(rec.op, rec.params, len(rec.inputs))
    f32 = np.dtype(np.float32)
    if not gs or rec.params["dtype"] not in (None, f32) \
            or any(np.dtype(rec.inputs[i].dtype) != f32 for g in gs for i in (g - 1, g)):
        return []
    casts = []
    for g in gs:
        c = made.get(id(rec.inputs[g]))
        src = None if c is None else ops[c]
        if src is not None and src.op in (CAST, CAST_NO_GRAD) and np.dtype(src.inputs[0].dtype) == BFLOAT16 \
                and readers.get(id(rec.inputs[g])) == [k]:
            casts.append(c)
    return casts


def _update_record(rec, casts: list) -> RowRecord:
    """The update `rec` reading the bfloat16 gradients of `casts` (its `dtype` float32: `updates.widened`)."""
    narrow = {id(c.outputs[0]): c.inputs[0] for c in casts}
    inputs = tuple(narrow.get(id(u), u) for u in rec.inputs)
    op = OpDef(f"{rec.op.name}({'+'.join(r.name for r in casts)})", rec.op.kernel, kernels=dict(rec.op.kernels),
               into=rec.op.into, flops=rec.op.flops, scratch=rec.op.scratch)  # (its kernels take them as they are)
    out = RowRecord(op, inputs, rec.outputs, casts + [rec], 0)
    out.params = dict(rec.params, dtype=np.dtype(np.float32))
    return out


def _row_record(rec, hook, pro, epi, readers, k, backend) -> RowRecord:
    entry, pi, _, sources, kernel_params = hook
    pc, ec = _chain(pro) if pro else None, _chain(epi) if epi else None
    x = rec.inputs[pi]
    p_out = [] if pc is None else [u for u in pc[2] if any(r != k for r in readers.get(id(u), ()))]
    dx = None if ec is None else rec.outputs[hook[2]]
    e_in = [] if ec is None else [u for u in ec[1] if u is not dx]
    row_in = [u for u in rec.inputs if pc is None or u is not x]
    inputs = tuple({id(u): u for u in (list(pc[1]) if pc else []) + row_in + e_in}.values())
    outs = tuple([u for u in rec.outputs if u is not dx] + p_out + (list(ec[2]) if ec else []))
    source, params = _source(entry, sources[entry], kernel_params[entry], pi, pc, x, p_out, ec, dx, e_in)
    folded = (sum(map(fusion._nbytes, (list(pc[1]) if pc else []) + p_out)) - (fusion._nbytes(x) if pc else 0)
              + sum(map(fusion._nbytes, e_in + (list(ec[2]) if ec else []))) - (fusion._nbytes(dx) if ec else 0))
    members = (list(pc[0]) if pc else []) + [rec] + (list(ec[0]) if ec else [])
    steps = [s for s in (pro, rec, epi) if s is not None]
    spec = (source, params, hashlib.sha1(source.encode()).hexdigest()[:10])
    kernel = _kernel(spec, rec, x, pc, p_out, dx, ec, e_in, inputs, outs, steps, backend)
    op = OpDef(f"rows({'+'.join(r.name for r in members)})", kernel, kernels={backend: kernel})
    return RowRecord(op, inputs, outs, members, folded)


def _source(entry, text, own_params, pi, pc, x, p_out, ec, dx, e_in) -> tuple:
    """`(source, params)`: the row kernel `entry` with the chains' code in its hooks (`rowwise.ROWS_HOOKS`)
    and their pointers after its own parameters (the prologue's inputs and written outputs, then the
    epilogue's inputs other than dx and its outputs); a chain's inputs loaded at element `e` (dx: `dxv`)."""
    extra, code, hooked, bf16 = [], [], [], False
    x_hook = "G" if pi else "X"
    for tag, chain, ins, outs in (("p", pc, pc[1] if pc else (), p_out), ("e", ec, e_in, ec[2] if ec else ())):
        if chain is None:
            continue
        order = [x] + [u for u in chain[2] if u is not x] if tag == "p" else list(chain[2])
        i_n, o_n = [f"{tag}i{j}" for j in range(len(ins))], [f"{tag}o{j}" for j in range(len(outs))]
        mine = [f"const {_c(u)}* {v}" + ("" if _whole(u, x) else f", long long {v}_n") for u, v in zip(ins, i_n)]
        mine += [f"{_c(u)}* {v}" for u, v in zip(outs, o_n)]
        extra += mine
        _, _, body, pre = fusion.source(chain[0], tuple(chain[1]), tuple(order))
        bf16 |= bool(pre)
        named = {id(u): f"{v}[e]" if _whole(u, x) else f"{v}[e % {v}_n]" for u, v in zip(ins, i_n)}
        loads = " ".join(f"{_c(u)} in{j} = {'dxv' if u is dx else named[id(u)]};"
                         for j, u in enumerate(chain[1]))
        decl = " ".join(f"{_c(u)} out{j} = 0;" for j, u in enumerate(order))
        written = {id(u): v for u, v in zip(outs, o_n)}
        stores = " ".join(f"{written[id(u)]}[e] = out{j};" for j, u in enumerate(order) if id(u) in written)
        args = ", ".join([a for u, v in zip(ins, i_n) for a in ([v] if _whole(u, x) else [v, v + "_n"])] + o_n)
        if tag == "p":
            code.append(f"__device__ __forceinline__ A mpimesh_prologue(long long e, bool last, {', '.join(mine)}) {{\n"
                        f"  {loads} {decl}\n  {{\n{body}\n  }}\n  if (last) {{ {stores} }}\n  return load(out0);\n}}\n"
                        f"#define {x_hook}_LOAD(j) mpimesh_prologue(row * n + (j), false, {args})\n"
                        f"#define {x_hook}_LAST(j) mpimesh_prologue(row * n + (j), true, {args})\n")
            hooked += [f"{x_hook}_LOAD", f"{x_hook}_LAST"]
        else:
            code.append(f"__device__ __forceinline__ void mpimesh_epilogue(long long e, T dxv, {', '.join(mine)}) {{\n"
                        f"  {loads} {decl}\n  {{\n{body}\n  }}\n  {stores}\n}}\n"
                        f"#define DX_STORE(j, v) mpimesh_epilogue(row * n + (j), store(v), {args})\n")
            hooked.append("DX_STORE")
    defaults = [d for d in rowwise.ROWS_HOOKS.splitlines() if d.split("(")[0].split()[-1] not in hooked]
    params = {entry: own_params + "".join(", " + e for e in extra)}
    preamble = ("namespace bf16 {\n" + rowwise.BF16_CONVERSIONS + "}\n") if bf16 else ""
    return (preamble + rowwise.ROWS_HEAD + "\n".join(defaults) + "\n" + "".join(code)
            + text % params), params


def _whole(u, like) -> bool:
    """Whether tensor `u` has all of `like`'s dims (else its last ones: `_suffix`)."""
    return len(u.shape.names) == len(like.shape.names)


def _c(u) -> str:
    """The C type a kernel's pointer to tensor `u`'s block holds (bfloat16: its bits)."""
    return C_STORAGE[fusion.STORAGE[np.dtype(u.dtype)]]


def _args(arrays, reads: list) -> list:
    """The generated kernel's arguments for the inputs `reads` (`(index, whole)`): each block (bfloat16
    as its bits), a broadcast one's size after it."""
    return [a for i, w in reads for a in ([fusion._bits(arrays[i])] if w else
                                          [fusion._bits(arrays[i]), np.int64(arrays[i].size)])]


def _storage(u):
    return np.dtype(fusion.STORAGE[np.dtype(u.dtype)])


def _kernel(spec, rec, x, pc, p_out, dx, ec, e_in, inputs, outs, steps, backend):
    """The step's kernel: the generated row kernel where the unfused row op takes its one-kernel rows and
    every block the chains read is of the rows' shape and contiguous; else the members' own kernels."""
    source, params, digest = spec
    at = {id(u): j for j, u in enumerate(inputs)}  # (indices now: a program kept for pricing swaps its tensors)
    dtype = np.dtype(x.dtype)
    p, grad, run_rows = dict(rec.params), HOOKS[rec.op][1] == 1, RUNS[rec.op]
    roles = [at.get(id(u)) for u in rec.inputs]  # (the row op's inputs; None: its prologue's output)
    whole = p["vectors"] and tuple(p["axes"]) == (len(p["xd"]) - 1,) and str(dtype) in rowwise.PRELUDE_TYPES
    order = {id(u): j for j, u in enumerate(inputs)}
    runs = []
    for s in steps:
        runs.append((s.op.kernel_for(backend), dict(s.params), [order[id(u)] for u in s.inputs],
                     [order.setdefault(id(u), len(order)) for u in s.outputs]))
    wanted = [order[id(u)] for u in outs]
    stored = [np.dtype(u.dtype) for u in outs]
    p_store, e_store = [_storage(u) for u in p_out], [_storage(u) for u in (ec[2] if ec else ())]
    p_read = [(at[id(u)], _whole(u, x)) for u in (pc[1] if pc else ())]
    e_read = [(at[id(u)], _whole(u, x)) for u in e_in]
    full = next((i for i, w in p_read if w), None)  # (a prologue's input of the rows' shape)

    def sequential(ctx, *arrays):
        values = dict(enumerate(arrays))
        for run, kw, ins, made in runs:
            res = run(ctx, *(values[i] for i in ins), **kw)
            for i, a in zip(made, res if isinstance(res, tuple) else (res,)):
                values[i] = ctx.xp.asarray(a)
        return tuple(values[i] for i in wanted)

    def kernel(ctx, *arrays):
        xp = ctx.xp
        blocks = [(arrays[i], w) for i, w in p_read + e_read]
        own = [None if i is None else arrays[i] for i in roles]
        first = own[0] if grad or pc is None else arrays[full]
        if grad and pc is None:
            blocks.append((own[1], True))  # g: of x's dtype and contiguous, as the unfused kernel takes the rows
            fit = own[1].dtype == dtype
        else:
            fit = True
        shape = first.shape
        fit = fit and whole and first.size > 0 and first.flags.c_contiguous and all(
            b.shape == (shape if w else shape[len(shape) - b.ndim:]) and b.flags.c_contiguous for b, w in blocks)
        base = fit and rowwise.rows_kernels(xp, ("rowwise", "rows"), rowwise.ROWS_SOURCE, rowwise.ROWS_PARAMS, dtype) \
            and (rec.op not in (norm.RMS_NORM, norm.RMS_NORM_GRAD) or norm.rms_rows_kernels(xp, dtype))
        kernels = base and cached_kernel(("rowfusion", backend, digest, source, str(dtype)),
                                         lambda: BUILDERS[backend](xp, source, params, str(dtype)))
        if not kernels:
            return sequential(ctx, *arrays)
        made = [xp.empty(shape, d) for d in p_store]
        e_made = [xp.empty(shape, d) for d in e_store]
        extra = _args(arrays, p_read) + made + _args(arrays, e_read) + e_made
        if not grad:
            result = list(run_rows(xp, Aval(shape, dtype), own, p, (kernels, extra)))
        else:
            d, yhat = run_rows(xp, own, p, (kernels, extra, ec is None))
            result = ([d] if ec is None else []) + [yhat]
        result += made + e_made
        return tuple(a if a.dtype == d else a.view(d) for a, d in zip(result, stored))
    return kernel


def _scale(xp, s: list, acc):
    """A scale's block as the one-kernel rows take it (contiguous, in the arithmetic's dtype), or None."""
    return xp.ascontiguousarray(s[0].astype(acc, copy=False)) if s else None


RUNS = {
    norm.LAYER_NORM: lambda xp, x, own, p, fused: rowwise.layer_norm_rows(
        xp, x, p["epsilon"], *norm.row_parameters(xp, own[1:], p["has"], x.dtype), fused=fused),
    norm.LAYER_NORM_GRAD: lambda xp, own, p, fused: rowwise.layer_norm_grad_rows(
        xp, own[0], own[1], xp.ascontiguousarray(own[2]), xp.ascontiguousarray(own[3]),
        _scale(xp, own[4:], own[2].dtype), fused=fused),
    norm.RMS_NORM: lambda xp, x, own, p, fused: norm.rms_norm_rows(
        xp, x, p["epsilon"], _scale(xp, own[1:], accumulation_dtype(x.dtype)), fused=fused),
    norm.RMS_NORM_GRAD: lambda xp, own, p, fused: norm.rms_norm_grad_rows(
        xp, own[0], own[1], xp.ascontiguousarray(own[2]), _scale(xp, own[3:], own[2].dtype), fused=fused),
}
"""op -> its one-kernel rows called with a generated kernel (`fused`): forwards `(xp, x (an Aval), the op's
input blocks (x's None), params, fused)`, backwards `(xp, the op's input blocks (g's None), params, fused)`."""
