"""Pipelines priced by the cost model: `pipeline_estimate` (and `bubble`), as `mpimesh.pipeline` runs them.

One stage's forward and backward on a microbatch are recorded dry on the stage mesh and priced by
`estimate`. A rank's work: its runs and, per run, two transfers to its neighbours (α + bytes / β of
`mesh_dim`'s link); the step: the busiest rank's work over 1 - `bubble`, plus what runs around the
schedule. Memory per stage: arguments, gradients, the microbatches its schedule holds at once
(`pipeline_schedules.most_in_flight`) times what a run keeps (with remat: its input), one run's peak.
More: docs/cost_model.md.

>>> import mpimesh as mm
>>> e = pipeline_estimate(lambda p, h: h * p["s"], {"s": ArgSpec("stage:4;d:256", "float32")},
...                       ArgSpec("b:64;d:256", "float32"), "x:4", "x", 8, mm.cost.TPUV2)
>>> round(e["bubble"], 4), e["transfer_bytes"], e["stages"][0]["collectives"]["sendrecv/x"]["calls"]
(0.2727, 8192, 20)
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from ..autodiff import gradients
from ..backend import is_float
from ..counters import paused
from ..dryrun import DryMesh, placeholder, shaped
from ..errors import LayoutError, MpimeshError, ShapeError
from ..layout import block_sizes
from ..mesh import layout_scope
from ..ops.relayout import to_layout
from ..ops.slicing import concat, split
from ..pipeline_schedules import check_schedule, most_in_flight, moves, sent, stage_of, ticks
from ..shape import Dimension, Shape
from ..trace import Released, release_unneeded, set_apart, trace
from ..tree import flatten, is_tensor, named_leaves, unflatten
from .machine import Machine
from .model import ArgSpec, collective_seconds, estimate, record, shape_and_rules, view_of


def bubble(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The share of a pipelined step its ranks spend idle: (S-1) / (M+S-1), divided by V with V virtual
    stages per rank (the interleaved schedule).

    >>> bubble(2, 4), bubble(2, 8, 2), bubble(1, 3)
    (0.2, 0.05555555555555555, 0.0)
    """
    return (stages - 1) / (microbatches + stages - 1) / virtual


def _spec(where: str, what: str, t) -> ArgSpec:
    if isinstance(t, ArgSpec):
        return t
    if is_tensor(t):
        return ArgSpec(t.shape, t.dtype)
    raise TypeError(f"{where}: {what} must be a DistTensor or a mm.cost.ArgSpec, got {type(t).__name__}")


def _nbytes(block) -> int:
    return math.prod(block.shape) * np.dtype(block.dtype).itemsize


def _without(layout: tuple, mesh_dim: str) -> tuple:
    return tuple(None if m == mesh_dim else m for m in layout)


def _add(into: dict, collectives: dict, times: int = 1) -> None:
    for key, c in collectives.items():
        mine = into.setdefault(key, {"calls": 0, "elements": 0, "bytes": 0})
        for k in mine:
            mine[k] += times * c[k]


class _Pipe:
    """What `pipeline_estimate` knows of the pipelined step from its arguments' shapes."""

    def __init__(self, where, stage_fn, stage_params, x, mesh, mesh_dim, microbatches, rules, schedule, virtual,
                 remat, loss_fn, targets, batch_dim, stage_dim):
        if not callable(stage_fn) or (loss_fn is not None and not callable(loss_fn)):
            raise TypeError(f"{where}: stage_fn and loss_fn must be functions")
        self.shape, self.rules = shape_and_rules(where, mesh, rules)
        if mesh_dim not in self.shape.names:
            raise LayoutError(f"{where}: mesh_dim {mesh_dim!r} is not a dim of mesh {self.shape}")
        if schedule is None:
            schedule = "1f1b" if loss_fn is not None else "gpipe"
        check_schedule(schedule, virtual)
        if loss_fn is None and schedule != "gpipe":
            raise MpimeshError(f"{where}: without loss_fn the step is mm.pipeline and its gradient, which run the "
                               f"'gpipe' schedule; got schedule={schedule!r} (give loss_fn and targets to price "
                               f"mm.pipeline_value_and_grad)")
        if remat and loss_fn is not None:
            raise MpimeshError(f"{where}: remat prices mm.pipeline(..., remat=True) and its gradient (no loss_fn); "
                               f"mm.pipeline_value_and_grad keeps each stage's activations")
        if (loss_fn is None) != (targets is None):
            raise MpimeshError(f"{where}: loss_fn and targets go together (both, or neither)")
        self.where, self.stage_fn, self.loss_fn, self.mesh_dim, self.remat = where, stage_fn, loss_fn, mesh_dim, remat
        self.schedule, self.S, self.V = schedule, self.shape[mesh_dim].size, virtual
        self.K = self.S * self.V
        self.sub = Shape([Dimension(d.name, 1 if d.name == mesh_dim else d.size) for d in self.shape])
        self.x = _spec(where, "x", x)
        self.t = None if targets is None else _spec(where, "targets", targets)
        self.batch_dim = self.x.shape[0].name if batch_dim is None and self.x.shape.rank else batch_dim
        if self.batch_dim not in self.x.shape.names:
            raise ShapeError(f"{where}: batch_dim {self.batch_dim!r} is not a dim of x {self.x.shape}")
        B = self.x.shape[self.batch_dim].size
        if self.t is not None and (self.batch_dim not in self.t.shape.names or self.t.shape[self.batch_dim].size != B):
            raise ShapeError(f"{where}: targets {self.t.shape} must have batch dim {self.batch_dim}:{B}, as x has")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or not 1 <= microbatches <= B:
            raise MpimeshError(f"{where}: microbatches must be an int from 1 to the size of batch dim "
                               f"{self.batch_dim!r}, {B}; got {microbatches!r}")
        self.M, self.sizes = microbatches, block_sizes(B, microbatches)
        leaves, self.structure = flatten(stage_params)
        names = [n for n, _ in named_leaves(stage_params)]
        if not leaves:
            raise MpimeshError(f"{where}: stage_params must be a dict (nested allowed) of tensors or ArgSpecs")
        self.params = [self._slice(n, _spec(where, f"stage_params[{n!r}]", p), stage_dim)
                       for n, p in zip(names, leaves)]

    def _slice(self, name: str, spec: ArgSpec, stage_dim: str) -> ArgSpec:
        """One stage's slice of a stage-stacked parameter."""
        if stage_dim not in spec.shape.names:
            raise ShapeError(f"{self.where}: stage_params[{name!r}] {spec.shape} has no stage dim {stage_dim!r}")
        if spec.shape[stage_dim].size != self.K:
            raise ShapeError(f"{self.where}: stage_params[{name!r}] {spec.shape}: stage dim {stage_dim!r} must have "
                             f"the size of mesh dim {self.mesh_dim!r} times virtual_stages, {self.K}")
        return ArgSpec(Shape([d for d in spec.shape if d.name != stage_dim]), spec.dtype)

    def mb(self, spec: ArgSpec, n: int) -> ArgSpec:
        return ArgSpec(Shape([Dimension(d.name, n) if d.name == self.batch_dim else d for d in spec.shape]), spec.dtype)

    def run(self, p, h, t):
        """One stage's output (`t`: the last stage's targets, then its loss), laid out as h."""
        out = to_layout(self.stage_fn(p, h), h.tensor_layout)
        return out if t is None else self.loss_fn(out, t)

    def recordings(self, n: int, last: bool) -> tuple:
        """`(forward, forward and backward)` recordings of one run on a microbatch of `n` rows (`last`:
        the last position's, with the loss)."""
        h = self.mb(self.x, n)
        extra = self.mb(self.t, n) if last else h  # targets, or the cotangent from the next stage

        def forward(p, h, extra):
            return self.run(p, h, extra if last else None)

        def both(p, h, extra):
            with trace() as tr:
                out = forward(p, h, extra)
                release_unneeded()
                wanted = [h] + [q for q in flatten(p)[0] if is_float(q.dtype)]
                return gradients([out], wanted, None if last else [extra], tr=tr)
        args = (unflatten(self.structure, self.params), h, extra)
        return record(forward, args, self.sub, self.rules), record(both, args, self.sub, self.rules)

    def kept(self, n: int, last: bool) -> tuple:
        """`(bytes, output dtype)`: what one run on `n` rows keeps for its backward (its input, and the
        outputs its trace holds once nothing else needs them: `release_unneeded`); with remat its input."""
        dry = DryMesh(self.sub, self.rules)
        with paused(), set_apart(), layout_scope(dry, self.rules):
            p = unflatten(self.structure, [placeholder(dry, s.shape, s.dtype) for s in self.params])
            h = placeholder(dry, self.mb(self.x, n).shape, self.x.dtype)
            t = placeholder(dry, self.mb(self.t, n).shape, self.t.dtype) if last else None
            with trace() as tr:
                out = self.run(p, h, t)
                release_unneeded()
            if self.remat:
                return _nbytes(h.local), out.dtype
            held = {}
            for op in tr.ops:
                ins = [shaped(i.local_shape, i.dtype) if isinstance(i, Released) else i.local for i in op.inputs]
                for o in op.outputs:
                    if not isinstance(o, Released) and view_of(op, ins, o.local) is None:
                        held[id(o)] = _nbytes(o.local)
            return _nbytes(h.local) + sum(held.values()), out.dtype

    def block(self, spec: ArgSpec, layout=None) -> int:
        """Bytes of coordinate 0's block of `spec` on the stage mesh (laid out by `layout`, default the rules)."""
        dry = DryMesh(self.sub, self.rules)
        return _nbytes(shaped(dry.block_shape(spec.shape, dry.layout_of(spec.shape, layout)), spec.dtype))

    def ends(self, spec: ArgSpec, join: bool):
        """The recording of cutting `spec` (laid out as x) into the microbatches on the stage mesh, as the first
        stage cuts x (the last the targets or the cotangent), and with `join` joining them again (as the
        first stage joins dx, the last y)."""
        def cut(a):
            pieces = [to_layout(t, a.tensor_layout) for t in split(a, self.batch_dim, list(self.sizes))]
            return to_layout(concat(pieces, self.batch_dim), a.tensor_layout) if join else pieces
        return record(cut, (spec,), self.sub, self.rules)

    def edges(self) -> tuple:
        """`(recording, x's layout on the stage mesh)`: the relayouts into the pipeline, on the whole mesh, of
        x and of targets (or of the output's cotangent, laid out as x) to their layouts without `mesh_dim`."""
        second = self.x if self.t is None else self.t

        def enter(x, t):
            return [to_layout(a, _without(a.tensor_layout, self.mesh_dim)) for a in (x, t)]
        rec = record(enter, (self.x, second), self.shape, self.rules)
        return rec, _without(DryMesh(self.shape, self.rules).layout_of(self.x.shape), self.mesh_dim)


def pipeline_estimate(stage_fn: Callable, stage_params, x, mesh, mesh_dim: str, microbatches: int,
                      machine: Machine, *, rules=None, schedule: Optional[str] = None, virtual_stages: int = 1,
                      remat: bool = False, loss_fn: Optional[Callable] = None, targets=None,
                      batch_dim: Optional[str] = None, stage_dim: str = "stage") -> dict:
    """Price one step of a pipeline over `mesh_dim` on `machine`, per rank: `mm.pipeline_value_and_grad`
    with `loss_fn` and `targets` (`schedule` default "1f1b"), else `mm.pipeline` and its gradient (GPipe;
    `remat` as its). Arguments as theirs, tensors as DistTensors or `ArgSpec`s laid out by the rules; `mesh`
    a mesh or its shape and `rules` (default the mesh's) as `record` takes them. A dict: `seconds`,
    `compute_seconds`, `comm_seconds` (transfers, collectives), `bubble_seconds`, `bubble`, `bytes_per_rank`
    (the stage with the most), `stage_seconds` (a run's forward and backward, the largest), `transfer_bytes`
    (a microbatch's block between neighbours, the largest), `kept_bytes` (what a run keeps for its
    backward), and `stages`: per stage a dict of `collectives` (its `mm.profile` counters), `in_flight`,
    `activation_bytes` (in_flight · kept_bytes), `memory` (its parts) and `bytes_per_rank`. More:
    docs/cost_model.md.
    """
    where = "pipeline_estimate"
    if not isinstance(machine, Machine):
        raise MpimeshError(f"{where} needs a mm.cost.Machine (calibrate(mesh), or TPUV2, ...), got {machine!r}")
    pipe = _Pipe(where, stage_fn, stage_params, x, mesh, mesh_dim, microbatches, rules, schedule, virtual_stages,
                 remat, loss_fn, targets, batch_dim, stage_dim)
    S, V, K, M, valued = pipe.S, pipe.V, pipe.K, pipe.M, loss_fn is not None
    runs, kept = {}, {}
    for n in sorted(set(pipe.sizes)):
        for last in (False, True) if valued else (False,):
            fwd, both = pipe.recordings(n, last)
            recs = (fwd, both) if remat else (both,)
            runs[(n, last)] = ([estimate(r, None, None, machine) for r in recs], [r.collectives for r in recs],
                               both.activation_bytes)
            kept[(n, last)] = pipe.kept(n, last)
    edges, x_layout = pipe.edges()
    e_edges = estimate(edges, None, None, machine)
    ends = [pipe.ends(pipe.x, True), pipe.ends(pipe.t, False) if valued else pipe.ends(pipe.x, True)]
    e_ends = [estimate(r, None, None, machine)["seconds"] for r in ends]
    mb_bytes = [pipe.block(pipe.mb(pipe.x, n), x_layout) for n in pipe.sizes]
    x_block, itemsize = pipe.block(pipe.x, x_layout), pipe.x.dtype.itemsize
    alpha, beta = machine.link(mesh_dim)
    tables = [ticks(pipe.schedule, S, M, V)] if valued else \
        [ticks("gpipe", S, M, backward=False), ticks("gpipe", S, M, forward=False)]
    # along mesh_dim after the schedule: the loss (a scalar, summed over the stages) and dx broadcast
    # (pipeline_value_and_grad), or y and dx broadcast (mm.pipeline and its gradient)
    if valued:
        loss_bytes = np.dtype(kept[(pipe.sizes[0], True)][1]).itemsize
        casts = {"calls": 1, "elements": x_block // itemsize, "bytes": x_block}
        sums = {"calls": 1, "elements": 1, "bytes": loss_bytes}
    else:
        casts = {"calls": 2, "elements": 2 * x_block // itemsize, "bytes": 2 * x_block}
        sums = None
    params = V * sum(pipe.block(p) for p in pipe.params)
    grads = V * sum(pipe.block(p) for p in pipe.params if is_float(p.dtype))
    stages, work, compute = [], [], []
    for s in range(S):
        coll: dict = {}
        _add(coll, edges.collectives)
        roles = [r for r, at in zip(ends, (0, S - 1)) if s == at]  # the first stage's cuts and joins, the last's
        for r in roles:
            _add(coll, r.collectives)
        busy = comp = 0.0
        mine = [(n, valued and stage_of(s, v, S) == K - 1) for n in pipe.sizes for v in range(V)]
        for key in mine:
            priced, colls, _ = runs[key]
            busy += sum(e["seconds"] for e in priced) + (2 * (alpha + mb_bytes[pipe.sizes.index(key[0])] / beta)
                                                         if S > 1 else 0.0)
            comp += sum(e["compute_seconds"] for e in priced)
            for c in colls:
                _add(coll, c)
        if S > 1:
            _add(coll, {f"sendrecv/{mesh_dim}": _sends(tables, s, S, V, mb_bytes, itemsize),
                        f"broadcast/{mesh_dim}": casts})
            if sums is not None:
                _add(coll, {f"allreduce/{mesh_dim}": sums})
        in_flight = most_in_flight(sum(tables, ()), s)
        held = max(kept[key][0] for key in mine)
        memory = {"parameters": params, "gradients": grads, "activations": in_flight * held,
                  "run_peak": max(runs[key][2] for key in mine),
                  "inputs_outputs": edges.bytes_per_rank + x_block + sum(r.activation_bytes for r in roles)}
        stages.append({"collectives": coll, "in_flight": in_flight, "activation_bytes": in_flight * held,
                       "memory": memory, "bytes_per_rank": sum(memory.values())})
        work.append(busy)
        compute.append(comp)
    busiest = int(np.argmax(work))
    share = bubble(S, M, V)
    piped = work[busiest] / (1 - share)
    around = e_edges["seconds"] + max(e_ends) + collective_seconds("broadcast", S, casts["bytes"], machine,
                                                                   (mesh_dim,), casts["calls"])
    if sums is not None:
        around += collective_seconds("allreduce", S, sums["bytes"], machine, (mesh_dim,))
    return {"seconds": piped + around, "compute_seconds": compute[busiest] + e_edges["compute_seconds"],
            "comm_seconds": work[busiest] - compute[busiest] + around - e_edges["compute_seconds"],
            "bubble_seconds": piped - work[busiest], "bubble": share,
            "bytes_per_rank": max(st["bytes_per_rank"] for st in stages),
            "stage_seconds": max(sum(e["seconds"] for e in r[0]) for r in runs.values()),
            "transfer_bytes": max(mb_bytes), "kept_bytes": max(k[0] for k in kept.values()), "stages": stages}


def _sends(tables: list, s: int, S: int, V: int, mb_bytes: list, itemsize: int) -> dict:
    """The profile's counters of rank `s`'s `sendrecv`s over the tick `tables`: one call per tick that
    moves something (every rank takes part), its bytes those of the microbatches it hands on."""
    calls = nbytes = 0
    for table in tables:
        for row in table:
            for kind, moved, ends in zip("FB", moves(row, S, V), (S * V - 1, 0)):
                step = sent(row[s], kind)
                if moved:
                    calls += 1
                    if step is not None and stage_of(s, step.virtual, S) != ends:
                        nbytes += mb_bytes[step.mb]
    return {"calls": calls, "elements": nbytes // itemsize, "bytes": nbytes}


def stage_step(stage_fn: Callable, stage_params, x, mesh, mesh_dim: str, microbatches: int, *,
               schedule: Optional[str] = None, virtual_stages: int = 1, remat: bool = False,
               loss_fn: Optional[Callable] = None, targets=None, batch_dim: Optional[str] = None,
               stage_dim: str = "stage") -> tuple:
    """`(recording, stage mesh shape)`: one run's forward and backward on the largest microbatch, recorded
    replicated on the stage mesh (what a layout search assigns mesh dims to; arguments as `pipeline_estimate`)."""
    pipe = _Pipe("auto_layout", stage_fn, stage_params, x, mesh, mesh_dim, microbatches, "", schedule, virtual_stages,
                 remat, loss_fn, targets, batch_dim, stage_dim)
    return pipe.recordings(pipe.sizes[0], False)[1], pipe.sub
