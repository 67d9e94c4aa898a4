"""Reverse-mode autodiff over the op trace.

`gradients(ys, xs)` walks the open trace backwards, calling each op's gradient rule (mpimesh ops:
the backward is distributed and recorded too) under the layout rules the op ran with, and frees
what no rule still needs. Ops without a rule pass no gradient. More: docs/autodiff.md.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.array([1.0, 2.0, 3.0]), "a:3")
>>> with mm.trace():
...     y = mm.reduce_sum(x * x)
...     (g,) = mm.gradients([y], [x])
>>> g.to_numpy().tolist()
[2.0, 4.0, 6.0]
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Sequence

from . import liveness, partials
from .buckets import Bucketer, _checked, bucket_bytes
from .backend import is_float
from .errors import DTypeError, MeshError, MpimeshError, ShapeError
from .mesh import layout_scope
from .ops.elementwise import add
from .ops.relayout import to_layout
from .tensor import full
from .trace import Released, Trace, current_trace, release_unneeded, take_over


def _ones_like(t):
    return full(t.mesh, t.shape, 1, t.dtype, t.tensor_layout)


def _zeros_like(t):
    return full(t.mesh, t.shape, 0, t.dtype, t.tensor_layout)


def _tensors(what: str, ts) -> list:
    """`ts` (a list of tensors, or one tensor) as a list, each a float tensor, else a clear error."""
    ts = [ts] if hasattr(ts, "tensor_layout") else ts
    if isinstance(ts, (str, bytes)) or not hasattr(ts, "__iter__"):
        raise TypeError(f"mm.gradients: {what} must be a list of tensors, got a {type(ts).__name__}")
    ts = list(ts)
    for i, t in enumerate(ts):
        if not hasattr(t, "tensor_layout"):
            raise TypeError(f"mm.gradients: {what}[{i}] is a {type(t).__name__}, not a DistTensor")
        if not is_float(t.dtype):
            raise DTypeError(f"mm.gradients: {what}[{i}] is a {t.shape} {t.dtype} tensor: gradients are of and "
                             f"with respect to float tensors (mm.cast it, as JAX asks too)")
    return ts


def _cotangents(ys: list, grad_ys: list) -> list:
    """`grad_ys` checked against `ys` (one each, same mesh, shape and dtype), laid out like them."""
    if len(grad_ys) != len(ys):
        raise MpimeshError(f"mm.gradients: {len(grad_ys)} grad_ys for {len(ys)} ys: give one per y")
    out = []
    for i, (y, g) in enumerate(zip(ys, grad_ys)):
        if g.mesh is not y.mesh:
            raise MeshError(f"mm.gradients: grad_ys[{i}] lives on mesh {g.mesh.shape}, ys[{i}] on {y.mesh.shape}")
        if g.shape != y.shape:
            raise ShapeError(f"mm.gradients: grad_ys[{i}] has shape {g.shape}, ys[{i}] has {y.shape}")
        if g.dtype != y.dtype:
            raise DTypeError(f"mm.gradients: grad_ys[{i}] has dtype {g.dtype}, ys[{i}] has {y.dtype} "
                             f"(mm.cast it)")
        out.append(to_layout(g, y.tensor_layout))
    return out


def _rules_of(op):
    """A scope putting the layout rules the op ran under in force (none if they already are)."""
    mesh = op.inputs[0].mesh if op.inputs else None
    if op.rules is None or mesh is None or mesh.layout == op.rules:
        return nullcontext()
    return layout_scope(mesh, op.rules)


def gradients(ys: Sequence, xs: Sequence, grad_ys: Optional[Sequence] = None, *, tr: Optional[Trace] = None,
              retain: bool = False, bucket_bytes: Optional[int] = None) -> list:
    """Gradients of the sum of all elements of `ys` with respect to each of `xs`.

    Each gradient has the shape and layout of its x; an x that `ys` do not depend on gets zeros.
    Must run inside `mm.trace()` (or pass the trace, `tr=`); ys and xs are float tensors of that
    trace, in lists (or one tensor each); the result is a list. `grad_ys`: one cotangent per y, of
    its shape and dtype (TensorFlow's `grad_ys`, the argument of JAX's `vjp` function): the gradients
    of the sum of all elements of `y * grad_y`, without computing that product. Default: ones.

    The walk releases each intermediate's values once no remaining rule needs them, so second-order
    gradients fail unless `retain=True` (PyTorch's `retain_graph`). `bucket_bytes`: the size of the
    buckets in which parameters' data-parallel gradient sums overlap the walk (None:
    `mm.set_bucket_bytes`'s, 25 MiB unless set; 0: none); the values are the same as without.
    More: docs/autodiff.md.
    """

    tr = tr if tr is not None else current_trace()
    if tr is None:
        raise MpimeshError("mm.gradients needs an open trace: call it inside the `with mm.trace():` block that ran "
                           "the forward pass (or pass that trace: mm.gradients(ys, xs, tr=tr))")
    ys, xs = _tensors("ys", ys), _tensors("xs", xs)
    if not ys:
        raise MpimeshError("mm.gradients: ys is empty: give the tensors to differentiate (e.g. [loss])")
    release_unneeded()  # what the forward pass left that no rule reads goes before the backward allocates
    ops = list(tr.ops)  # the backward ops are appended to the trace as they run
    made = {id(t) for op in ops for t in op.outputs} | {id(x) for x in xs}
    for i, y in enumerate(ys):
        if id(y) not in made:
            raise MpimeshError(f"mm.gradients: ys[{i}] ({y.shape} {y.dtype}) was not computed in this trace (the "
                               f"innermost open one, unless tr= names another): its ops ran outside it, so its "
                               f"gradient would be 0; run them inside `with mm.trace():`")
    seeds = [_ones_like(y) for y in ys] if grad_ys is None else _cotangents(ys, _tensors("grad_ys", grad_ys))
    reach = {id(x) for x in xs}
    for op in ops:  # no gradient flows out of an op without a rule (stop_gradient, a comparison)
        if op.grad is not None and any(id(t) in reach for t in op.inputs):
            reach.update(id(t) for t in op.outputs)
    grads: dict[int, object] = {}
    memory = None if retain else _Release(tr, ops, reach, ys, xs)
    limit = _bucket_limit(bucket_bytes)
    leaves, through = _bucket_leaves(ops, xs) if limit else ({}, {})
    terms: dict[int, list] = {}  # a leaf's gradient terms in arrival order, summed once all buckets are in

    def accumulate(t, g):
        if g is None or id(t) not in reach:
            return
        if id(t) in leaves:
            terms.setdefault(id(t), []).append(_summed(g))
            return
        old = grads.get(id(t))
        grads[id(t)] = g if old is None else add(_summed(old), _summed(g))

    gathered = _gathered(ops) - partials.summable
    partials.summable.update(gathered)
    try:
        with Bucketer(leaves, limit, ops) as buckets:
            for y, seed in zip(ys, seeds):
                accumulate(y, seed)
            st = _State(tr, grads, reach, accumulate, terms, leaves if limit else None, buckets, not retain,
                        {id(x) for x in xs})
            _walk(ops, through, memory, st)
            buckets.finish()
    finally:
        partials.summable.difference_update(gathered)
    for x in xs:
        if id(x) in terms:
            grads[id(x)] = _total(terms, id(x))
    out = []
    for x in xs:
        g = grads.get(id(x))
        out.append(_zeros_like(x) if g is None else to_layout(g, x.tensor_layout))
    return out


class _State:
    """What one `gradients` walk shares with the walks of its remat regions' second runs."""

    def __init__(self, tr, grads, reach, accumulate, terms, leaves, buckets, release, wanted):
        self.tr, self.grads, self.reach, self.accumulate = tr, grads, reach, accumulate
        self.terms, self.leaves, self.buckets, self.release = terms, leaves, buckets, release
        self.wanted = wanted  # the ids of the xs: their gradients stay where `gradients` reads them
        self.done: set = set()  # the remat regions whose backward has run


def _walk(ops: list, through: dict, memory, st: _State) -> None:
    """Run the gradient rules of `ops` backwards (a module function: a closure calling itself would
    hold the walk's tensors in a reference cycle). The ops of a `mm.remat` region run no rule: where
    the walk meets the region, the region runs again and that second run's ops are walked instead."""
    grads = st.grads
    regions: dict[int, list] = {}  # a remat region's ops here (whose outputs the records hold, as grads' keys)
    for op in ops:
        if op.region is not None:
            regions.setdefault(id(op.region.root()), []).append(op)
    for i in reversed(range(len(ops))):
        op = ops[i]
        if op.region is not None:
            region = op.region.root()
            if id(region) not in st.done:
                st.done.add(id(region))
                if any(id(o) in grads for rec in regions[id(region)] for o in rec.outputs):
                    _rematerialise(region, st)
        elif i in through:  # its rule runs once its output's gradient is summed: keep its place
            if through[i][0] in st.terms:
                st.terms.setdefault(through[i][1], []).append((op, through[i][0]))
        elif op.grad is not None and any(id(o) in grads for o in op.outputs):
            _apply(op, grads, st.reach, st.accumulate)
            st.buckets.poll()
        if memory is not None:
            memory.after(i, grads)


def _rematerialise(region, st: _State) -> None:
    """The backward pass of a remat region: run it again, hand its new outputs the gradients of the
    first run's, and walk the new ops back to the region's inputs."""
    outs, ops = region.run_again()
    for old, new in zip(region.outputs, outs):  # (an output among the xs keeps its gradient too)
        g = st.grads.get(id(old)) if id(old) in st.wanted else st.grads.pop(id(old), None)
        if g is not None:
            st.grads[id(new)] = g
            st.reach.add(id(new))
    for op in ops:
        if op.grad is not None and any(id(t) in st.reach for t in op.inputs):
            st.reach.update(id(t) for t in op.outputs)
    through = _through(ops, st.leaves) if st.leaves is not None else {}
    memory = _Release(st.tr, ops, st.reach, outs, region.inputs, seen=len(st.tr.ops)) if st.release else None
    gathered = _gathered(ops) - partials.summable
    partials.summable.update(gathered)
    try:
        _walk(ops, through, memory, st)
    finally:
        partials.summable.difference_update(gathered)
    for t in outs:  # done with: their ids may be reused once they are gone
        st.grads.pop(id(t), None)
        st.reach.discard(id(t))
    if st.release:
        region.forget()


def _gathers(op) -> bool:
    """Whether `op` is a relayout that gathers its input over a mesh dim (a sharded weight before its
    einsum): its output's gradient is left awaiting its sum, which the rule reduce-scatters."""
    if not op.op.partial_grads or len(op.inputs) != 1:
        return False
    (x,), (y,) = op.inputs, op.outputs
    return any(m and m not in y.tensor_layout and x.mesh.shape[m].size > 1 for m in x.tensor_layout)


def _gathered(ops: list) -> set:
    """The ids of the outputs of `ops` that gather (`_gathers`)."""
    return {id(op.outputs[0]) for op in ops if op.grad is not None and _gathers(op)}


def _summed(g):
    """`g` with any sum over ranks it awaits taken (gradients are added, and most rules read, whole values)."""
    return to_layout(g, g.tensor_layout) if g.partial else g


def _bucket_leaves(ops: list, xs: list) -> tuple:
    """`(leaves, through)`: the tensors whose gradients may wait in buckets, by id, those of `xs` that
    no op of the walk produced and, transitively, the outputs of `OpDef.linear` ops of those (a
    parameter relayouted before its einsum, or a float32 master cast to bfloat16 in a layer);
    `through` maps each such op's index to (output id, input id). Its rule then runs once on its
    output's summed gradient, as in the unbucketed walk, so the values do not change."""
    produced = {id(o) for op in ops for o in op.outputs}
    leaves = {id(x): x for x in xs if id(x) not in produced}
    return leaves, _through(ops, leaves)


def _through(ops: list, leaves: dict) -> dict:
    """`through` of `_bucket_leaves` for `ops`, adding their outputs to `leaves` (the ops of a remat
    region are left out: its second run's are walked)."""
    through = {}
    for i, op in enumerate(ops):
        if (op.op.linear and op.grad is not None and op.region is None and len(op.inputs) == 1
                and id(op.inputs[0]) in leaves and id(op.outputs[0]) not in leaves and not _gathers(op)):
            through[i] = (id(op.outputs[0]), id(op.inputs[0]))
            leaves[id(op.outputs[0])] = op.outputs[0]
    return through


def _total(terms: dict, t_id: int):
    """A bucketed leaf's gradient: its terms added in the order, and by the ops, of the unbucketed
    walk (a module function, not a closure: a closure calling itself would hold the walk's tensors
    in a reference cycle until the garbage collector runs)."""
    gs = [_through_grad(g, terms) if isinstance(g, tuple) else g for g in terms[t_id]]
    g = gs[0]
    for h in gs[1:]:
        g = add(g, h)
    return g


def _through_grad(placed: tuple, terms: dict):
    """The gradient a relayout of `_bucket_leaves` passes its input, from its output's summed one."""
    op, out_id = placed
    with _rules_of(op):
        (g,) = op.grad(op, _total(terms, out_id))
    return g


def _bucket_limit(n: Optional[int]) -> int:
    return bucket_bytes() if n is None else _checked(n)


def _apply(op, grads: dict, reach: set, accumulate) -> None:
    """Run `op`'s gradient rule on its outputs' gradients and accumulate into its inputs'."""
    dys = [grads.get(id(o)) for o in op.outputs]
    if not op.op.partial_grads:
        dys = [None if d is None else _summed(d) for d in dys]
    if len(dys) > 1:
        dys = [d if d is not None else _zeros_like(o) for d, o in zip(dys, op.outputs)]
    op.needs = tuple(id(t) in reach for t in op.inputs)
    try:
        with _rules_of(op):  # the backward of a layout_scope'd op is laid out like its forward
            for t, g in zip(op.inputs, op.grad(op, *dys)):
                accumulate(t, g)
    finally:
        op.needs = None


class _Release:
    """Which tensors of a trace autodiff may release, and when.

    A forward tensor is needed until the earliest (in trace order) op that refers to it and whose
    gradient rule may still run; once the backward walk is past that op its gradient is dropped, and
    its values are released if only the trace's records hold it (a tensor the user holds, a trace
    input, or one of `ys`/`xs` is never touched). Tensors of the backward ops appended meanwhile
    are needed by no rule of this walk: they go as soon as only records hold them.
    """

    def __init__(self, tr: Trace, ops: list, reach: set, ys: list, xs: list, seen: Optional[int] = None):
        self.tr, self.reach = tr, reach
        self.keep = {id(t) for t in list(ys) + list(xs) + list(tr.inputs)}
        self.tensors: dict[int, object] = {}
        self.holders: dict[int, list] = {}
        self.refs: dict[int, int] = {}
        self.pending: set[int] = set()  # ids no rule needs any more: released once only records hold them
        self.due: dict[int, list[int]] = {}  # op index -> ids whose last need is that op
        self.waiting: set[int] = set()  # ids in `due`
        for rec in ops:
            self._index(rec)
        back = {id(y) for y in ys}
        for op in reversed(ops):
            if any(id(o) in back for o in op.outputs):
                back.update(id(t) for t in op.inputs)
        runs = [op.grad is not None and any(id(o) in reach and id(o) in back for o in op.outputs) for op in ops]
        walked = liveness.last_uses([id(t) for t in op.inputs + op.outputs] if run else ()  # (in walk order)
                                    for op, run in zip(reversed(ops), reversed(runs)))
        last = {t_id: len(ops) - 1 - k for t_id, k in walked.items()}  # the earliest op whose rule reads it
        for i in self.tensors:
            if i in last:
                self.due.setdefault(last[i], []).append(i)
                self.waiting.add(i)
            elif i not in self.keep:
                self.pending.add(i)  # needed by no rule: only its holders matter
        self.stubs: dict[int, list[int]] = {}  # op index -> tensors released in the forward pass whose
        for op in ops:  # gradient goes once the walk is past that op (their values went before)
            for t in op.inputs + op.outputs:
                if isinstance(t, Released) and id(t) in last:
                    self.stubs.setdefault(last.pop(id(t)), []).append(id(t))
        self.seen = len(ops) if seen is None else seen  # tr.ops from there on: backward ops
        self._sweep()

    def _index(self, rec) -> None:
        for t in rec.inputs + rec.outputs:
            if isinstance(t, Released):
                continue
            i = id(t)
            if i not in self.tensors:
                take_over(i)  # this walk releases it from now on
                self.tensors[i] = t
                self.holders[i] = []
                self.refs[i] = 0
            if rec not in self.holders[i]:
                self.holders[i].append(rec)
            self.refs[i] += 1

    def after(self, i: int, grads: dict) -> None:
        """The backward walk has run op `i`: drop what no remaining rule needs."""
        for t_id in self.stubs.pop(i, ()):
            grads.pop(t_id, None)
        for t_id in self.due.pop(i, ()):
            self.waiting.discard(t_id)
            if t_id not in self.keep:
                grads.pop(t_id, None)
                self.pending.add(t_id)
        for rec in self.tr.ops[self.seen:]:  # the backward ops recorded meanwhile
            self._index(rec)
            self.pending.update(id(t) for t in rec.inputs + rec.outputs
                                if id(t) not in self.keep and id(t) not in self.waiting and id(t) in self.tensors)
        self.seen = len(self.tr.ops)
        self._sweep()

    def _sweep(self) -> None:
        for t_id in list(self.pending):
            if liveness.held_only_by(self.tensors, t_id, self.refs[t_id]):
                self.tr.release(self.tensors.pop(t_id), self.holders.pop(t_id))
                del self.refs[t_id]
                self.pending.discard(t_id)
                self.reach.discard(t_id)  # its id may be reused by a new tensor from now on


def _trace_gradients(self: Trace, ys, xs) -> list:
    """Gradients of the sum of `ys` with respect to each of `xs` (see `mm.gradients`)."""
    return gradients(ys, xs, tr=self)


Trace.gradients = _trace_gradients  # type: ignore[attr-defined]
