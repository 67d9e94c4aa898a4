"""Pipeline parallelism over a mesh dim (GSPMD's and GPipe's): `pipeline`, `pipeline_value_and_grad`.

The rank at coordinate s of `mesh_dim` holds stage s of the stage-stacked parameters and runs
`stage_fn` for it on the *stage mesh* (`stage_mesh`: `mesh_dim` of size 1, the ranks of its
coordinate), where operator parallelism over the other mesh dims nests. Activations and gradients
move to the neighbouring stage between the ticks of a schedule (`pipeline_schedules.ticks`,
`collectives.p2p.isendrecv`). A pipeline is one op of the open traces. More: docs/pipelines.md.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("stages:1", comm=mm.MPI.COMM_SELF)
>>> scale = mesh.from_numpy(np.array([[2.0, 3.0]]), "stage:1;d:2", "stage:stages")
>>> x = mesh.from_numpy(np.arange(6.0).reshape(3, 2), "b:3;d:2")
>>> pipeline(lambda p, h: h * p["scale"], {"scale": scale}, x, "stages", microbatches=2).to_numpy().tolist()
[[0.0, 3.0], [4.0, 9.0], [8.0, 15.0]]
"""
from __future__ import annotations

import time
import weakref
from typing import Callable, NamedTuple, Optional

from .autodiff import gradients
from .backend import is_float
from .collectives.base import in_flight
from .collectives.p2p import broadcast_from, group_ranks, isendrecv
from .counters import paused
from .dryrun import DryMesh, placeholder
from .errors import CollectiveTimeoutError, MeshError, MpimeshError, ShapeError
from .layout import block_sizes, local_sizes
from .mesh import Mesh, layout_scope
from .opdef import ALL, OpDef
from .ops.relayout import to_layout
from .ops.slicing import concat, split
from .pipeline_schedules import check_schedule, moves, sent, stage_of, ticks
from .shape import Dimension, Shape
from .stack import Stack
from .tensor import DistTensor, full, tensor_arg
from .trace import current_trace, dispatch, release_unneeded, set_apart, trace
from .tree import flatten, named_leaves, unflatten

_stage_meshes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_running = Stack()  # the Microbatch of each stage_fn call under way

last_run: dict = {}
"""This rank's last pipeline op (run or replayed): `op`, `schedule`, `stages` (S), `virtual` (V),
`microbatches` (M), `seconds` (the op's wall time) and `in_transfers` (of them, the time spent in the
transfers between stages, waiting for a neighbour included: the rank's bubble)."""


class Microbatch(NamedTuple):
    """The work of one `stage_fn` call (`microbatch()`): `position`, the stage's place in the order
    stages apply (0 .. S*V-1); `index`, the microbatch's number; `start` and `size`, its rows along
    x's batch dim; `total`, x's rows."""
    position: int
    index: int
    start: int
    size: int
    total: int


def microbatch() -> Optional[Microbatch]:
    """Inside `stage_fn`: the stage and microbatch it runs now (e.g. to draw a microbatch's random
    numbers as its rows of the whole batch would, or to pick a stage's layers); None elsewhere.
    The dry run before any transfer sees microbatch 0 at the rank's first position."""
    return _running.top()


def stage_mesh(mesh: Mesh, mesh_dim: str) -> Mesh:
    """The mesh one stage runs on: `mesh` with `mesh_dim` of size 1, over the ranks that share this
    rank's coordinate along it (made once per mesh and dim: a collective over `mesh` the first time).

    >>> import mpimesh as mm
    >>> stage_mesh(mm.Mesh("stages:1;cols:1", comm=mm.MPI.COMM_SELF), "stages").shape
    Shape('[stages:1, cols:1]')
    """
    per = _stage_meshes.setdefault(mesh, {})
    sub = per.get(mesh_dim)
    if sub is None:
        shape = Shape([Dimension(d.name, 1 if d.name == mesh_dim else d.size) for d in mesh.shape])
        comm = mesh.comm_for([n for n in mesh.shape.names if n != mesh_dim])
        sub = per[mesh_dim] = Mesh(shape, mesh.rules, comm=comm, backend=mesh.backend, device=mesh.device,
                                   transport=mesh.transport)
    return sub


class _Plan:
    """What every rank knows of one pipeline call from shapes alone."""

    def __init__(self, what, stage_fn, stage_params, x, mesh_dim, microbatches, batch_dim, stage_dim, virtual,
                 loss_fn=None, targets=None, loss_params=None):
        if not callable(stage_fn):
            raise TypeError(f"{what}: stage_fn must be a function, got {type(stage_fn).__name__}")
        x = tensor_arg(what, x)
        mesh = x.mesh
        if not isinstance(mesh_dim, str) or mesh_dim not in mesh.shape.names:
            raise MeshError(f"{what}: mesh_dim {mesh_dim!r} is not a dim of mesh {mesh.shape}")
        self.mesh, self.mesh_dim, self.stage_fn, self.loss_fn = mesh, mesh_dim, stage_fn, loss_fn
        self.S, self.V = mesh.shape[mesh_dim].size, virtual
        self.K = self.S * self.V
        self.names = [name for name, _ in named_leaves(stage_params)]
        flat, self.structure = flatten(stage_params)
        if not flat or len(flat) != len(self.names):
            raise MpimeshError(f"{what}: stage_params must be a dict (nested allowed) of tensors, got "
                               f"{type(stage_params).__name__}{' with no tensors' if not flat else ''}")
        self.leaves, self.views = list(flat), []
        for name, p in zip(self.names, self.leaves):
            self.views.append(self._view(what, name, tensor_arg(what, p, f"stage_params[{name!r}]"), stage_dim))
        self.batch_dim = x.shape[0].name if batch_dim is None else batch_dim
        if x.shape.rank == 0 or self.batch_dim not in x.shape.names:
            raise ShapeError(f"{what}: batch_dim {self.batch_dim!r} is not a dim of x {x.shape}")
        B = x.shape[self.batch_dim].size
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or not 1 <= microbatches <= B:
            raise MpimeshError(f"{what}: microbatches must be an int from 1 to the size of batch dim "
                               f"{self.batch_dim!r}, {B}; got {microbatches!r}")
        self.M, self.sizes = microbatches, block_sizes(B, microbatches)
        self.starts = [sum(self.sizes[:m]) for m in range(self.M)]
        self.x_shape, self.dtype = x.shape, x.dtype
        self.x_layout = _without(x.tensor_layout, mesh_dim)
        if targets is not None:
            targets = tensor_arg(what, targets, "targets")
            if self.batch_dim not in targets.shape.names or targets.shape[self.batch_dim].size != B:
                raise ShapeError(f"{what}: targets {targets.shape} must have batch dim {self.batch_dim}:{B}, as x "
                                 f"{x.shape} has")
            self.t_shape, self.t_layout = targets.shape, _without(targets.tensor_layout, mesh_dim)
        self.sub = stage_mesh(mesh, mesh_dim)
        self.rules = mesh.layout
        self.lp_leaves, self.lp_structure = [], None
        if loss_params is not None:
            lp, self.lp_structure = flatten(loss_params)
            for name, p in zip([n for n, _ in named_leaves(loss_params)], lp):
                p = tensor_arg(what, p, f"loss_params[{name!r}]")
                if p.mesh is not mesh:
                    raise MeshError(f"{what}: loss_params[{name!r}] lives on mesh {p.mesh.shape}, x on {mesh.shape}")
                self.lp_leaves.append(to_layout(p, _without(p.tensor_layout, mesh_dim)))
        self.n = len(self.leaves)
        self._probe(what, targets)

    def _view(self, what: str, name: str, p, stage_dim: str) -> tuple:
        """(shape, layout, stage axis) of one stage's slice of parameter `p`."""
        if p.mesh is not self.mesh:
            raise MeshError(f"{what}: stage_params[{name!r}] lives on mesh {p.mesh.shape}, x on {self.mesh.shape}")
        if stage_dim not in p.shape.names:
            raise ShapeError(f"{what}: stage_params[{name!r}] {p.shape} has no stage dim {stage_dim!r}")
        ax = p.shape.index(stage_dim)
        if p.shape[ax].size != self.K:
            many = f"the size of mesh dim {self.mesh_dim!r}, {self.S}" + (f", times virtual_stages {self.V}"
                                                                         if self.V > 1 else "")
            raise ShapeError(f"{what}: stage_params[{name!r}] {p.shape}: stage dim {stage_dim!r} has size "
                             f"{p.shape[ax].size}, but it must be {many}: {self.K}")
        if p.tensor_layout[ax] != self.mesh_dim:
            raise MpimeshError(f"{what}: stage_params[{name!r}] {p.shape}: stage dim {stage_dim!r} must be split "
                               f"over mesh dim {self.mesh_dim!r}, but its layout is {p.layout} (mm.relayout it, "
                               f"or lay it out with '{stage_dim}:{self.mesh_dim}')")
        shape = Shape([d for i, d in enumerate(p.shape) if i != ax])
        return shape, tuple(m for i, m in enumerate(p.tensor_layout) if i != ax), ax

    def mb_shape(self, m: int, shape: Optional[Shape] = None) -> Shape:
        shape = self.x_shape if shape is None else shape
        return Shape([Dimension(d.name, self.sizes[m]) if d.name == self.batch_dim else d for d in shape])

    def mb_block(self, m: int) -> tuple:
        """The local shape of microbatch `m`'s activation on this rank."""
        return local_sizes(self.mb_shape(m), self.sub.shape, self.x_layout, self.sub.coords)

    def params(self, v: int, blocks: tuple) -> object:
        """This rank's virtual stage `v`'s parameters (from the op's input `blocks`), views on the stage
        mesh (no copy)."""
        views = [DistTensor(self.sub, shape, layout, b[(slice(None),) * ax + (v,)])
                 for b, (shape, layout, ax) in zip(blocks, self.views)]
        return unflatten(self.structure, views)

    def loss_params(self, blocks: tuple) -> tuple:
        """`loss_fn`'s extra argument (none without `loss_params`): its tensors' views on the stage mesh."""
        if self.lp_structure is None:
            return ()
        views = [DistTensor(self.sub, p.shape, p.tensor_layout, b) for p, b in zip(self.lp_leaves, blocks[self.n:])]
        return (unflatten(self.lp_structure, views),)

    def run_stage(self, params, h, k: int, m: int) -> tuple:
        """`stage_fn(params, h)` at position `k` on microbatch `m`: `(out laid out as h, aux or None)`."""
        with layout_scope(self.sub, self.rules), _running.push(Microbatch(k, m, self.starts[m], self.sizes[m],
                                                                          self.x_shape[self.batch_dim].size)):
            out, aux = _with_aux(self.stage_fn(params, h))
            return to_layout(out, self.x_layout), aux

    def _probe(self, what: str, targets) -> None:
        """Run `stage_fn` (and `loss_fn`) dry on the first microbatch's shapes: a bad result, or an
        error inside, is raised on every rank before any transfer."""
        dry = DryMesh(self.sub.shape, self.rules)
        first = Microbatch(self.mesh.coords[self.mesh_dim], 0, 0, self.sizes[0], self.x_shape[self.batch_dim].size)
        with paused(), set_apart(), _running.push(first):
            p = unflatten(self.structure, [placeholder(dry, shape, leaf.dtype, layout)
                                           for leaf, (shape, layout, _) in zip(self.leaves, self.views)])
            h = placeholder(dry, self.mb_shape(0), self.dtype, self.x_layout)
            out, aux = _with_aux(self.stage_fn(p, h))
            if not hasattr(out, "tensor_layout") or out.shape != h.shape or out.dtype != h.dtype:
                got = f"{out.shape} {out.dtype}" if hasattr(out, "tensor_layout") else type(out).__name__
                raise ShapeError(f"{what}: stage_fn must return a tensor of its input's shape and dtype, "
                                 f"{h.shape} {h.dtype}, or with an aux loss (h, aux); it returned {got}")
            if aux is not None and self.loss_fn is None:
                raise MpimeshError(f"{what}: stage_fn returned (h, aux): aux losses need mm.pipeline_value_and_grad")
            if aux is not None and (not hasattr(aux, "tensor_layout") or aux.shape.rank):
                raise ShapeError(f"{what}: stage_fn returned (h, aux): aux must be a scalar tensor (no dims) or None, "
                                 f"got {getattr(aux, 'shape', type(aux).__name__)}")
            if self.loss_fn is not None:
                t = placeholder(dry, self.mb_shape(0, self.t_shape), targets.dtype, self.t_layout)
                lp = [placeholder(dry, q.shape, q.dtype, q.tensor_layout) for q in self.lp_leaves]
                loss = self.loss_fn(out, t, *([unflatten(self.lp_structure, lp)] if self.lp_structure else []))
                if not hasattr(loss, "tensor_layout") or loss.shape.rank != 0:
                    raise ShapeError(f"{what}: loss_fn must return a scalar tensor (no dims), got "
                                     f"{getattr(loss, 'shape', type(loss).__name__)}")
                self.loss_dtype = loss.dtype


def _without(layout: tuple, mesh_dim: str) -> tuple:
    return tuple(None if m == mesh_dim else m for m in layout)


def _with_aux(result) -> tuple:
    """`stage_fn`'s result as `(h, aux)` (aux None where it returned h alone)."""
    return (result[0], result[1]) if isinstance(result, tuple) and len(result) == 2 else (result, None)


class _Clock:
    """A pipeline op's wall time on this rank and its time in the transfers (`last_run`)."""

    def __init__(self):
        self.t0, self.waiting = time.perf_counter(), 0.0

    def wait(self, transfer: Callable, *args):
        t = time.perf_counter()
        try:
            return transfer(*args)
        finally:
            self.waiting += time.perf_counter() - t

    def record(self, op: str, plan: "_Plan", schedule: str) -> None:
        last_run.clear()
        last_run.update(op=op, schedule=schedule, stages=plan.S, virtual=plan.V, microbatches=plan.M,
                        seconds=time.perf_counter() - self.t0, in_transfers=self.waiting)


class _Saved:
    """What a pipeline's forward keeps for its gradient op, per (microbatch, position)."""

    def __init__(self, remat: bool):
        self.remat, self.kept, self.done = remat, {}, False


def _empty(xp, dtype):
    return xp.empty(0, dtype)


def _execute(ctx, plan: _Plan, table: list, forward: Callable, backward: Callable, first_acts=None) -> None:
    """Run this rank's steps of `table`. `forward(step, k, h)` gives the activation for position k+1
    (None past the last); `backward(step, k, dy)` the gradient for position k-1 (None before the first).
    After each tick where some rank made an activation (a gradient) for another, every rank starts one
    `isendrecv` along `mesh_dim`, offset +1 (-1): all start the same transfers in the same order (every
    rank knows the table). A rank waits for what it receives only when a step of its own needs it, and
    for what it sends at the end: ranks run ahead of the ticks instead of in lock-step, and the
    transfers move while they compute (`collectives.base.progress`, between ops)."""
    S, K, md, xp = plan.S, plan.K, plan.mesh_dim, plan.sub.xp
    s = ctx.coord(md)
    acts, cots, sends = {}, {}, []  # arriving activations and gradients by (microbatch, position); sends
    started = len(in_flight)

    def start(send, offset: int, arriving: dict, key) -> None:
        """Start one transfer along `md`: `send` (None: nothing) to coordinate s+offset, and from
        s-offset microbatch `key[0]`'s block into `arriving[key]` (key None: nothing)."""
        req = isendrecv(ctx, _empty(xp, plan.dtype) if send is None else send.local, md, offset,
                        (0,) if key is None else plan.mb_block(key[0]))
        if key is None:
            sends.append(req)
        else:
            arriving[key] = req
        in_flight.append(req)

    try:
        for row in table:
            send_f = send_b = None
            for step in row[s]:  # (one step, or interleaved's forward and backward)
                k = stage_of(s, step.virtual, S)
                if step.kind == "F":
                    got = first_acts(step.mb) if k == 0 else _arrived(plan, acts.pop((step.mb, k)), step.mb)
                else:
                    got = cots.pop((step.mb, k), None)
                    got = None if got is None else _arrived(plan, got, step.mb)
                try:
                    if step.kind == "F":
                        send_f = forward(step, k, got)
                    else:
                        send_b = backward(step, k, got)
                except CollectiveTimeoutError as e:  # in a collective of the stage mesh, whose ranks it numbers
                    raise CollectiveTimeoutError(
                        f"{e} (In stage {k} of the pipeline over {md!r}, at microbatch {step.mb}'s "
                        f"{'forward' if step.kind == 'F' else 'backward'}: the ranks of its stage mesh are ranks "
                        f"{group_ranks(plan.mesh, [d for d in plan.mesh.shape.names if d != md])} of the "
                        f"mesh.)") from None
            forward_moves, backward_moves = moves(row, S, plan.V)
            if forward_moves:
                prev = sent(row[(s - 1) % S], "F")
                kp = stage_of((s - 1) % S, prev.virtual, S) if prev is not None else K
                start(send_f, 1, acts, (prev.mb, kp + 1) if prev is not None and kp < K - 1 else None)
            if backward_moves:
                nxt = sent(row[(s + 1) % S], "B")
                kn = stage_of((s + 1) % S, nxt.virtual, S) if nxt is not None else 0
                start(send_b, -1, cots, (nxt.mb, kn - 1) if nxt is not None and kn > 0 else None)
        for req in sends:
            plan.clock.wait(req.wait)
    except BaseException as e:
        if S > 1:
            if not ctx.guard.broken:  # its neighbours would wait for transfers it will not start
                what = f"a pipeline over {md!r} ended by {type(e).__name__}: {e}"[:200]
                ctx.guard.abandon(f"{what} (its transfers in flight would match the mesh's next ones)", what)
            ctx.mesh.keep_communicators()  # (nor those of a mesh built later)
        raise
    finally:
        del in_flight[started:]


def _arrived(plan: _Plan, req, mb: int) -> DistTensor:
    """Microbatch `mb`'s activation (or gradient) on the stage mesh, once its transfer `req` completes."""
    return DistTensor(plan.sub, plan.mb_shape(mb), plan.x_layout, plan.clock.wait(req.wait))


def _pieces(plan: _Plan, local, shape: Shape, layout: tuple) -> list:
    """A tensor of x's mesh whose block is `local`, cut into the microbatches on the stage mesh (where
    the batch dim is whole in the block, copies of its slices: `split` took 0.1-0.3 ms a microbatch)."""
    ax = shape.index(plan.batch_dim)
    if layout[ax] is None:
        cut = (slice(None),) * ax
        return [DistTensor(plan.sub, plan.mb_shape(m, shape), layout, local[cut + (slice(a, a + n),)].copy())
                for m, (a, n) in enumerate(zip(plan.starts, plan.sizes))]
    whole = DistTensor(plan.sub, shape, layout, local)
    with layout_scope(plan.sub, plan.rules):
        return [to_layout(t, layout) for t in split(whole, plan.batch_dim, list(plan.sizes))]


def _joined(ctx, plan: _Plan, pieces: dict, root: int):
    """The microbatches `pieces` (on coordinate `root` of `mesh_dim`) joined, as every rank's block."""
    ax = plan.x_shape.index(plan.batch_dim)
    if ctx.coord(plan.mesh_dim) != root:
        block = plan.sub.xp.empty(local_sizes(plan.x_shape, plan.sub.shape, plan.x_layout, plan.sub.coords),
                                  plan.dtype)
    elif plan.x_layout[ax] is None and all(pieces[m].tensor_layout == plan.x_layout for m in range(plan.M)):
        block = plan.sub.xp.concatenate([pieces[m].local for m in range(plan.M)], axis=ax)  # (as `_pieces` cuts)
    else:
        with layout_scope(plan.sub, plan.rules):
            whole = concat([pieces[m] for m in range(plan.M)], plan.batch_dim)
            block = to_layout(whole, plan.x_layout).local
    return plan.clock.wait(broadcast_from, ctx, block, plan.mesh_dim, root)


def _grad_step(plan: _Plan, tr, ys: list, dys: Optional[list], params, h, grads: dict, v: int, extra=()):
    """Differentiate one stage's recorded run (outputs `ys`, cotangents `dys`, None: ones): add its
    parameters' gradients into `grads[v]` and those of `extra` (`loss_fn`'s) into `grads["loss"]`; h's."""
    leaves = flatten(params)[0] + list(extra)
    wanted = [h] + [p for p in leaves if is_float(p.dtype)]
    got = gradients(ys, wanted, dys, tr=tr)
    it = iter(got[1:])
    per = [next(it) if is_float(p.dtype) else None for p in leaves]
    for key, part in ((v, per[:len(per) - len(extra)]), ("loss", per[len(per) - len(extra):])):
        if key in grads and part:
            with layout_scope(plan.sub, plan.rules):
                grads[key] = [a if b is None else (b if a is None else to_layout(a + b, a.tensor_layout))
                              for a, b in zip(grads[key], part)]  # (the sum laid out as the parameter)
        elif part:
            grads[key] = part
    return got[0]


def _stacked(plan: _Plan, grads: dict, blocks: tuple) -> list:
    """Each parameter's gradient blocks, the virtual stages stacked on its stage axis."""
    xp, out = plan.sub.xp, []
    for i, (b, (_, _, ax)) in enumerate(zip(blocks, plan.views)):
        parts = [grads[v][i] for v in range(plan.V)]
        out.append(xp.zeros_like(b) if parts[0] is None else xp.stack([g.local for g in parts], axis=ax))
    return out


# The ops --------------------------------------------------------------------------------------------
def _forward_kernel(ctx, x, *blocks, plan: _Plan, saved: Optional[_Saved]):
    """`pipeline`'s forward schedule: this rank's stages on each microbatch; y's block on every rank.
    With `saved`, each stage's recorded run (or, with remat, its input) is kept for the gradient."""
    outputs, plan.clock = {}, _Clock()
    if saved is not None:  # (a compiled step's replay runs this op again with the recording's params)
        saved.kept, saved.done = {}, False

    def forward(step, k, h):
        params = plan.params(step.virtual, blocks)
        if saved is None or saved.remat:
            out, _ = plan.run_stage(params, h, k, step.mb)
            if saved is not None:
                saved.kept[(step.mb, k)] = h
        else:
            with trace() as tr:
                out, _ = plan.run_stage(params, h, k, step.mb)
                release_unneeded()
            saved.kept[(step.mb, k)] = (tr, params, h, out)
        if k == plan.K - 1:
            outputs[step.mb] = out
            return None
        return out

    with set_apart():
        pieces = _pieces(plan, x, plan.x_shape, plan.x_layout) if ctx.coord(plan.mesh_dim) == 0 else None
        _execute(ctx, plan, ticks("gpipe", plan.S, plan.M, backward=False), forward, None,
                 lambda m: pieces[m])
        y = _joined(ctx, plan, outputs, plan.S - 1)
        plan.clock.record("pipeline", plan, "gpipe")
        return y


def _backward_kernel(ctx, dy, x, *blocks, plan: _Plan, saved: _Saved):
    """`pipeline`'s gradient: the backward schedule in reverse microbatch order (GPipe's), from the
    kept runs (or runs again from the kept inputs, with remat). dx's block, then the parameters'."""
    if saved.done:
        raise MpimeshError("mm.pipeline: its gradient was taken already, and its stages' values went with it: "
                           "differentiate a pipeline once per forward")
    grads, dxs, plan.clock = {}, {}, _Clock()

    def backward(step, k, g):
        if saved.remat:
            h = saved.kept.pop((step.mb, k))
            with trace() as tr:
                params = plan.params(step.virtual, blocks)
                out, _ = plan.run_stage(params, h, k, step.mb)
        else:
            tr, params, h, out = saved.kept.pop((step.mb, k))
        dh = _grad_step(plan, tr, [out], [g if k < plan.K - 1 else seeds[step.mb]], params, h, grads, step.virtual)
        if k == 0:
            dxs[step.mb] = dh
            return None
        return dh

    with set_apart():
        last = ctx.coord(plan.mesh_dim) == plan.S - 1
        seeds = _pieces(plan, dy, plan.x_shape, plan.x_layout) if last else None
        _execute(ctx, plan, ticks("gpipe", plan.S, plan.M, forward=False), None, backward)
        saved.done, saved.kept = True, {}
        dx = _joined(ctx, plan, dxs, 0)
        plan.clock.record("pipeline_grad", plan, "gpipe")
        return (dx,) + tuple(_stacked(plan, grads, blocks))


def _pipeline_grad(rec, dy):
    plan, saved = rec.params["plan"], rec.params["saved"]
    if saved is None:
        raise MpimeshError("mm.pipeline ran outside any open trace, so nothing was kept for its gradient")
    dy = to_layout(dy, plan.x_layout)
    x = rec.inputs[0]
    specs = [(x.shape, x.tensor_layout)] + [(p.shape, p.tensor_layout) for p in rec.inputs[1:]]
    return dispatch(PIPELINE_GRAD, [dy, x] + list(rec.inputs[1:]), specs, {"plan": plan, "saved": saved})


PIPELINE = OpDef("pipeline", _forward_kernel, grad=_pipeline_grad, saves=(ALL, ()), fill=None)
PIPELINE_GRAD = OpDef("pipeline_grad", _backward_kernel, fill=None)


def _value_and_grad_kernel(ctx, x, targets, *blocks, plan: _Plan, schedule: str):
    """`pipeline_value_and_grad`'s schedule: the loss, dx's block, the parameters' gradients, then
    those of `loss_params`. The loss is the sum over the ranks along `mesh_dim` of their terms (the
    last stage's losses, every stage's aux losses)."""
    kept, grads, dxs, terms, plan.clock = {}, {}, {}, [], _Clock()
    extra = plan.loss_params(blocks)

    def forward(step, k, h):
        params = plan.params(step.virtual, blocks)
        with trace() as tr:
            out, aux = plan.run_stage(params, h, k, step.mb)
            with layout_scope(plan.sub, plan.rules):
                if k == plan.K - 1:
                    out = plan.loss_fn(out, tpieces[step.mb], *extra)
                    out, aux = (out if aux is None else out + aux), None
                    terms.append(out.local)
                elif aux is not None:
                    terms.append(aux.local)
                ys = [out] if aux is None else [out, aux]
            release_unneeded()
        kept[(step.mb, k)] = (tr, params, h, ys)
        return None if k == plan.K - 1 else out

    def backward(step, k, g):
        tr, params, h, ys = kept.pop((step.mb, k))
        last = k == plan.K - 1
        dys = None if last else [g] + [full(plan.sub, (), 1.0, a.dtype) for a in ys[1:]]
        dh = _grad_step(plan, tr, ys, dys, params, h, grads, step.virtual,
                        flatten(extra[0])[0] if extra and last else ())
        if k == 0:
            dxs[step.mb] = dh
            return None
        return dh

    with set_apart():
        s = ctx.coord(plan.mesh_dim)
        pieces = _pieces(plan, x, plan.x_shape, plan.x_layout) if s == 0 else None
        tpieces = _pieces(plan, targets, plan.t_shape, plan.t_layout) if s == plan.S - 1 else None
        _execute(ctx, plan, ticks(schedule, plan.S, plan.M, plan.V), forward, backward, lambda m: pieces[m])
        xp = plan.sub.xp
        total = xp.zeros((), plan.loss_dtype)
        for term in terms:
            total = total + term
        loss = plan.clock.wait(ctx.allreduce, xp.asarray(total, plan.loss_dtype), (plan.mesh_dim,))
        dx = _joined(ctx, plan, dxs, 0)
        lgrads = _loss_grads(ctx, plan, grads.get("loss"), blocks[plan.n:])
        plan.clock.record("pipeline_value_and_grad", plan, schedule)
        return (loss, dx) + tuple(_stacked(plan, grads, blocks[:plan.n])) + lgrads


def _loss_grads(ctx, plan: _Plan, got: Optional[list], blocks: tuple) -> tuple:
    """The gradients of `loss_params` (`got`, on the last stage) as every rank's blocks."""
    out = []
    for i, b in enumerate(blocks):
        g = got[i] if got is not None else None
        mine = plan.sub.xp.zeros_like(b) if g is None else g.local
        out.append(plan.clock.wait(broadcast_from, ctx, mine, plan.mesh_dim, plan.S - 1))
    return tuple(out)


PIPELINE_VALUE_AND_GRAD = OpDef("pipeline_value_and_grad", _value_and_grad_kernel, fill=None)


# The API ----------------------------------------------------------------------------------------------
def pipeline(stage_fn: Callable, stage_params, x, mesh_dim: str, microbatches: int, batch_dim: Optional[str] = None,
             stage_dim: str = "stage", remat: bool = False):
    """Stages 0, 1, ..., S-1 of `stage_fn` applied in order to `x`, pipelined over mesh dim `mesh_dim`.

    Every tensor of `stage_params` (a dict, nested allowed) has a dim `stage_dim` of the size S of
    `mesh_dim`, split over it: the rank at coordinate s holds stage s. `stage_fn(p, h)` maps one
    stage's parameters (`stage_dim` removed, on the stage mesh: `stage_mesh`) and one microbatch `h` to
    a tensor of h's shape and dtype. `x` is cut into `microbatches` along `batch_dim` (default: its
    first dim; uneven cuts as `numpy.array_split`). Returns a tensor of x's shape and layout.
    Differentiable with `mm.gradients`: the backward runs in reverse pipeline order (GPipe); it keeps
    each stage's activations per microbatch, or with `remat` only each stage's input.
    """
    plan = _Plan("mm.pipeline", stage_fn, stage_params, x, mesh_dim, microbatches, batch_dim, stage_dim, 1)
    saved = _Saved(bool(remat)) if current_trace() is not None else None
    xs = to_layout(x, plan.x_layout)
    (y,) = dispatch(PIPELINE, [xs] + plan.leaves, [(plan.x_shape, plan.x_layout)], {"plan": plan, "saved": saved})
    return to_layout(y, x.tensor_layout)


def pipeline_value_and_grad(stage_fn: Callable, loss_fn: Callable, stage_params, x, targets, mesh_dim: str,
                            microbatches: int, batch_dim: Optional[str] = None, stage_dim: str = "stage",
                            schedule: str = "1f1b", virtual_stages: int = 1, loss_params=None) -> tuple:
    """`(loss, grads, dx)` of a pipeline (see `pipeline`) ending in `loss_fn(h, t)`, one microbatch's
    scalar loss (`targets` cut like `x`): `loss` their sum, `grads` its gradients laid out as
    `stage_params`, `dx` as `x`. `schedule`: `"gpipe"` (every forward, then every backward),
    `"1f1b"` (at most S microbatches in flight per stage) or `"interleaved"` with `virtual_stages`
    V: the stage dim has S*V entries, rank s holding entries s*V .. s*V+V-1, entry s*V+v applied at
    position v*S+s (`pipeline_schedules.application_order`). `stage_fn` may return `(h, aux)`: aux, a
    scalar (an auxiliary loss: a mixture of experts' load balance), is added to the loss.
    `loss_params` (a dict of tensors of x's mesh, nested allowed): passed on as `loss_fn(h, t,
    loss_params)` (the model's head on the last stage); the result is then `(loss, grads, dx,
    loss_grads)`, loss_grads laid out as `loss_params`.
    """
    check_schedule(schedule, virtual_stages)
    if not callable(loss_fn):
        raise TypeError(f"mm.pipeline_value_and_grad: loss_fn must be a function, got {type(loss_fn).__name__}")
    plan = _Plan("mm.pipeline_value_and_grad", stage_fn, stage_params, x, mesh_dim, microbatches, batch_dim,
                 stage_dim, virtual_stages, loss_fn, targets, loss_params)
    xs, ts = to_layout(x, plan.x_layout), to_layout(targets, plan.t_layout)
    ins = plan.leaves + plan.lp_leaves
    specs = [(Shape([]), ()), (plan.x_shape, plan.x_layout)] + [(p.shape, p.tensor_layout) for p in ins]
    loss, dx, *grads = dispatch(PIPELINE_VALUE_AND_GRAD, [xs, ts] + ins, specs, {"plan": plan, "schedule": schedule})
    out = loss, unflatten(plan.structure, grads[:plan.n]), to_layout(dx, x.tensor_layout)
    if loss_params is None:
        return out
    originals = flatten(loss_params)[0]
    return out + (unflatten(plan.lp_structure, [to_layout(g, p.tensor_layout)
                                               for g, p in zip(grads[plan.n:], originals)]),)
