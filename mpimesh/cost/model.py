"""The cost model: a step recorded dry (`record`), priced on a `Machine` (`estimate`).

A `Recording` holds per op its local FLOPs and bytes, the collectives as the MPI transport counts
them, and its blocks' lifetimes (peak memory); it keeps the function, so `estimate` can run it again
dry on any mesh shape under any rules (a plain `mm.trace()` is priced as it ran). Prices are seconds
per rank at coordinate 0 (the largest blocks): each op's roofline plus a fixed cost, each collective
`α + f · b / β`, less the gathers and reduce-scatters a compiled step hides behind compute
(`hidden_seconds`). More: docs/cost_model.md.

>>> allreduce = collective_seconds("allreduce", 4, 1000, Machine(1e12, 1e-6, 1e9, 1e9))
>>> round(allreduce * 1e6, 3)  # α + 2·3/4 · 1000 B / 1 GB/s
2.5
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np

from .. import counters, liveness
from ..backend import as_dtype, is_float
from ..dryrun import DryMesh, placeholder, shaped
from ..errors import LayoutError, MpimeshError
from ..mesh import AbstractMesh, layout_scope, mesh_shape_of
from ..overlap import prefetch_depth
from ..program import Program
from ..trace import Released, Trace, open_traces, trace
from ..layout import LayoutRules, weight_layout
from ..shape import Shape
from ..tree import is_tensor, map_leaves, tensors
from .machine import Machine


def collective_seconds(kind: str, k: int, nbytes: float, machine: Machine, mesh_dims=(), calls: int = 1) -> float:
    """Seconds of `calls` collectives of `kind` over a group of `k` processors whose inputs on this
    rank total `nbytes` (the profile's bytes), on `machine`'s links of `mesh_dims`."""
    if k <= 1:
        return 0.0
    alpha, beta = machine.group(mesh_dims)
    factor = {"allreduce": 2 * (k - 1) / k, "exscan": 2 * (k - 1) / k, "alltoall": (k - 1) / k,
              "reduce_scatter": (k - 1) / k, "allgather": k - 1, "permute": 1.0, "sendrecv": 1.0,
              "broadcast": 2 * (k - 1) / k}.get(kind)
    if factor is None:
        raise MpimeshError(f"no cost for collective kind {kind!r}")
    return calls * alpha + factor * nbytes / beta


class ArgSpec:
    """A tensor argument of a recorded function: its shape and dtype (laid out by the rules of each
    run)."""

    __slots__ = ("shape", "dtype")
    shape: Shape
    """The tensor's global `Shape`."""
    dtype: np.dtype
    """Its element type: `dtype('float32')`."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = Shape(shape), as_dtype(dtype)

    def __repr__(self) -> str:
        return f"ArgSpec({self.shape}, {self.dtype})"


def _map(tree, leaf):
    """`tree` (dicts, lists, tuples) with `leaf` applied to each of its `DistTensor`s and `ArgSpec`s."""
    return map_leaves(tree, lambda v: leaf(v) if isinstance(v, ArgSpec) or is_tensor(v) else v)


def _nbytes(t) -> int:
    return math.prod(t.local.shape) * np.dtype(t.dtype).itemsize


class OpCost:
    """One op of a recording: its name, local FLOPs, local bytes in and out, whether it is a GEMM
    (`OpDef.gemm`), the collectives it ran (`comm`: `{"<kind>/<mesh dims>": (bytes, calls)}`), and
    whether a compiled step overlaps them (`overlap`: `"gather"`, `"scatter"` or None; `hidden_seconds`)."""

    __slots__ = ("name", "flops", "nbytes", "gemm", "comm", "overlap")
    name: str
    """The op's name: `"einsum"`, `"tanh"`, ..."""
    flops: int
    """Floating-point operations on this rank's blocks, as the op's definition counts them."""
    nbytes: int
    """Bytes of this rank's blocks of the op's inputs and outputs together."""
    gemm: bool
    """Whether the op is a matrix product (priced with the machine's fixed cost per GEMM)."""
    comm: dict
    """The collectives counted while the op ran (a bucket's at its first member): `{key: (bytes, calls)}`."""
    overlap: Optional[str]
    """`"gather"` (one allgather: a compiled step prefetches it), `"scatter"` (a gradient's reduce-scatter:
    overlapped with the rest of the backward), or None (the op's collectives block)."""

    def __init__(self, name: str, flops: int, nbytes: int, gemm: bool = False, comm: Optional[dict] = None,
                 overlap: Optional[str] = None):
        self.name, self.flops, self.nbytes, self.gemm = name, flops, nbytes, gemm
        self.comm, self.overlap = comm or {}, overlap

    def __repr__(self) -> str:
        return f"OpCost({self.name!r}, flops={self.flops}, nbytes={self.nbytes})"


class Recording:
    """A program run dry on `mesh_shape` under `rules` (see `record`).

    Attributes:
      state_bytes: this rank's blocks of the arguments (parameters, optimizer state, batch).
      activation_bytes: the peak of the op outputs alive at once.
      weights: the mesh dims (`"rows"`, `"rows+cols"`) the float tensors of the weight arguments were
        additionally split over, as `mm.shard_weights` splits them (`""`: none; see `record`).
      weight_args: the positions of the weight arguments in `args`.
    """

    def __init__(self, fn, args, mesh_shape: Shape, rules: LayoutRules, weights: str = "", weight_args=()):
        self.fn, self.args, self.mesh_shape, self.rules = fn, args, mesh_shape, rules
        self.weights, self.weight_args = weights, tuple(weight_args)
        self.ops: list[OpCost] = []
        """An `OpCost` per op, in order."""
        self.collectives: dict = {}
        """The profile's counters, `{"<kind>/<mesh dims>": {"calls", "elements", "bytes"}}`:
        `{"allreduce/rows": {"calls": 1, "elements": 1, "bytes": 4}}`."""
        self.state_bytes = self.activation_bytes = 0
        self.dims: dict[str, int] = {}
        """`{tensor dim name: size}` of every tensor of the run."""
        self.shapes: set = set()
        """The dim-name tuples of the run's tensors: `{("batch", "io"), ("io", "out")}`."""
        self._runs: dict = {}

    @property
    def bytes_per_rank(self) -> int:
        """Memory per rank at the peak: `state_bytes + activation_bytes`."""
        return self.state_bytes + self.activation_bytes

    def rerun(self, rules=None, mesh_shape=None, weights: Optional[str] = None) -> "Recording":
        """This program recorded on `mesh_shape` under `rules` with `weights` sharded (each None:
        this recording's; see `record`); kept."""
        rules = self.rules if rules is None else LayoutRules(rules)
        mesh_shape = self.mesh_shape if mesh_shape is None else mesh_shape_of(mesh_shape)
        weights = self.weights if weights is None else weights
        if (rules, mesh_shape, weights) == (self.rules, self.mesh_shape, self.weights):
            return self
        if self.fn is None:
            raise MpimeshError(f"this trace is priced as it was recorded (rules {str(self.rules)!r} on mesh "
                               f"{self.mesh_shape}); to price rules {str(rules)!r} on mesh {mesh_shape}"
                               f"{f' with weights sharded over {weights}' if weights else ''}, record the step "
                               f"with mm.cost.record(fn, args, mesh), which can run it again dry")
        key = (str(rules), str(mesh_shape), weights)
        if key not in self._runs:
            self._runs[key] = record(self.fn, self.args, mesh_shape, rules, weights=weights,
                                     weight_args=self.weight_args)
        if rules != self.rules:
            _check_rule_dims("estimate", rules, self._runs[key])
        return self._runs[key]

    def __repr__(self) -> str:
        return (f"Recording({len(self.ops)} ops on mesh {self.mesh_shape}, rules {str(self.rules)!r}, "
                + (f"weights sharded over {self.weights}, " if self.weights else "")
                + f"{self.bytes_per_rank} bytes per rank)")


class _Lifetimes:
    """Op outputs' lifetimes by tensor identity (an id reused by a later output is a new tensor).

    An output lives to its last use; one made while a trace of the program was open lives (held
    by that trace's records) until the trace closes, or until autodiff releases it. An output that
    is a view of an input (see `view_of`) adds no bytes: it keeps its input's block alive."""

    def __init__(self):
        self.live: dict[int, int] = {}  # id -> index into spans
        self.spans: list[list] = []  # [first op, last op, bytes, tensors not released yet]
        self.held: dict[int, list[int]] = {}  # id of the trace holding them -> span indices
        self.uses: list[list[int]] = []  # per op: the spans it reads

    def use(self, t, i: int) -> None:
        j = self.live.get(id(t))
        if j is not None:
            self.uses.extend([] for _ in range(i + 1 - len(self.uses)))
            self.uses[i].append(j)

    def make(self, t, i: int, holder: Optional[int] = None, base=None, nbytes: Optional[int] = None) -> None:
        """`t` made by op `i` (`nbytes`: its block's, default from `t.local`); `base`: the tensor
        whose block it is a view of (None: its own)."""
        j = None if base is None else self.live.get(id(base))
        if j is None:
            j = len(self.spans)
            self.spans.append([i, i, 0 if base is not None else _nbytes(t) if nbytes is None else nbytes, 0])
        self.live[id(t)] = j
        self.spans[j][3] += 1
        if holder is not None:
            self.held.setdefault(holder, []).append(j)

    def release(self, t_id: int, i: int) -> None:
        """Autodiff gave the tensor's values back at op `i` (its trace keeps only its shape); the
        block goes once every tensor viewing it has gone."""
        j = self.live.pop(t_id, None)
        if j is not None:
            self.spans[j][1] = max(self.spans[j][1], i)
            self.spans[j][3] -= 1

    def close(self, holder: int, i: int) -> None:
        """The trace `holder` closed before op `i`: what it held and autodiff kept lives to there."""
        for j in self.held.pop(holder, ()):
            if self.spans[j][3] > 0:
                self.spans[j][1] = max(self.spans[j][1], i - 1)

    def scratch(self, i: int, nbytes: int) -> None:
        """`nbytes` of kernel temporaries during op `i` alone."""
        if nbytes:
            self.spans.append([i, i, int(nbytes), 0])

    def peak(self, n: int) -> int:
        for j, i in liveness.last_uses(self.uses).items():  # a block lives at least to its last reader
            self.spans[j][1] = max(self.spans[j][1], i)
        delta = np.zeros(n + 2, np.int64)
        for first, last, b, _ in self.spans:
            delta[first] += b
            delta[last + 1] -= b
        return int(np.cumsum(delta).max(initial=0))


def view_of(rec, ins: list, out) -> Optional[int]:
    """The input whose block op record `rec`'s output `out` is a view of (numpy shares the memory),
    or None: the op says so (`OpDef.view`), for one input of the output's size and dtype. `ins` and
    `out` need `.shape` and `.dtype`."""
    if rec.op.view is None or len(ins) != 1 or math.prod(ins[0].shape) != math.prod(out.shape) or \
            np.dtype(ins[0].dtype) != np.dtype(out.dtype):
        return None
    return rec.op.view(rec.params, ins, [out])


def overlap_kind(rec) -> Optional[str]:
    """How a compiled step runs op record `rec`'s collective (`mpimesh.overlap`): `"gather"` for an op that
    can start without blocking and is a relayout (an allgather), `"scatter"` for one that is a sum (a
    reduce-scatter), None otherwise."""
    if rec.op.start is None or rec.op.start(rec.params) is None:
        return None
    return "scatter" if rec.op.partial_inputs else "gather"


class _CommDelta:
    """The collectives counted since the last call (`counts`: an open counter dict)."""

    def __init__(self, counts: dict):
        self.counts, self.seen = counts, {}

    def __call__(self) -> dict:
        out = {}
        for key, c in counters.traffic(self.counts).items():
            was = self.seen.get(key, (0, 0))
            now = (c["bytes"], c["calls"])
            if now != was:
                out[key] = (now[0] - was[0], now[1] - was[1])
                self.seen[key] = now
        return out


class _Watched(set):
    """The recording trace's set of produced ids: autodiff's release discards from it (noted)."""

    def __init__(self, on_discard):
        super().__init__()
        self.on_discard = on_discard

    def discard(self, x) -> None:
        if x in self:
            self.on_discard(x)
        super().discard(x)


def _recording_trace(rec: Recording, counts: dict, arg_ids: set):
    """A `Trace` that, as each op is appended, notes its FLOPs (from the open counters), bytes
    and the lifetimes of its inputs and outputs."""

    class RecordingTrace(Trace):
        def __init__(self):
            super().__init__()
            self.flops_seen = 0
            self.life = _Lifetimes()
            self._produced = _Watched(lambda t_id: self.life.release(t_id, len(rec.ops)))
            self.open: set = set()  # ids of the program's traces open at the last op
            self.comm = _CommDelta(counts)

        def _append(self, op) -> None:
            super()._append(op)
            i = len(rec.ops)
            users = [tr for tr in open_traces() if tr is not self]
            now = {id(tr) for tr in users}
            for closed in self.open - now:
                self.life.close(closed, i)
            self.open = now
            flops = counts.get("flops", {}).get("flops", 0)
            nbytes = 0
            for t in op.inputs:
                nbytes += _nbytes(t)
                if id(t) not in arg_ids:
                    self.life.use(t, i)
            ins = [x.local for x in op.inputs]
            self.life.scratch(i, op.op.count_scratch(op.params, ins, [t.local for t in op.outputs]))
            for t in op.outputs:
                nbytes += _nbytes(t)
                v = view_of(op, ins, t.local)
                self.life.make(t, i, id(users[0]) if users else None, None if v is None else op.inputs[v])
                rec.shapes.add(t.shape.names)
                for d in t.shape:
                    rec.dims[d.name] = max(rec.dims.get(d.name, 0), d.size)
            rec.ops.append(OpCost(op.name, flops - self.flops_seen, nbytes, op.op.gemm, self.comm(), overlap_kind(op)))
            self.flops_seen = flops

        def finish(self, out) -> int:
            """The peak of live outputs, once `fn` has returned `out`."""
            n = len(rec.ops)
            for holder in list(self.life.held):
                self.life.close(holder, n)
            for t in tensors(out):
                self.life.use(t, n)
            return self.life.peak(n)
    return RecordingTrace()


def check_step(where: str, fn, args) -> None:
    """TypeError unless `fn` is callable and `args` a tuple or list (`fn(*args)` is the step)."""
    if not callable(fn):
        raise TypeError(f"{where}: fn must be callable (the step), got {fn!r:.60} ({type(fn).__name__})")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"{where}: args must be a tuple or list of fn's arguments (fn(*args) is the step), got "
                        f"{args!r:.60} ({type(args).__name__}); for one argument write (x,)")


def _check_rule_dims(where: str, rules: LayoutRules, rec: Recording) -> None:
    """LayoutError where `rules` name a tensor dim that the step of `rec` lacks (a typo would leave
    the dim meant replicated)."""
    unknown = [t for t, _ in rules.pairs if t not in rec.dims]
    if unknown:
        raise LayoutError(f"{where}: rules {str(rules)!r} name tensor dim{'s' * (len(unknown) > 1)} "
                          f"{', '.join(map(repr, unknown))}, which the step does not have (its dims: "
                          f"{list(rec.dims)})")


def record(fn, args, mesh, rules=None, *, weights: str = "", weight_args: Optional[Sequence[int]] = None) -> Recording:
    """Run `fn(*args)` dry on a `DryMesh` of `mesh`'s shape (a mesh, or a mesh shape) under
    `rules` (default: the mesh's rules in force; none for a shape) and record what it costs.
    `args` may nest DistTensors and `ArgSpec`s (each becomes a placeholder laid out by the rules)
    among other values; `fn` must not read values. `weights` (`"rows"`, `"rows+cols"`): mesh dims
    over which the float tensors of the arguments at positions `weight_args` (default: the dicts)
    are also split, by `mm.shard_weights`' rule (`layout.weight_layout`). More: docs/cost_model.md.

    >>> import mpimesh as mm
    >>> def step(x, w):
    ...     return mm.reduce_sum(mm.tanh(mm.einsum([x, w])))
    >>> args = (ArgSpec("batch:8;io:4", "float32"), ArgSpec("io:4;out:2", "float32"))
    >>> rec = record(step, args, "rows:2", "batch:rows")
    >>> [op.name for op in rec.ops], rec.collectives["allreduce/rows"]["calls"], rec.state_bytes
    (['einsum', 'tanh', 'einsum'], 1, 96)
    """
    check_step("record", fn, args)
    mesh_shape, rules = shape_and_rules("record", mesh, rules)
    over = _weight_dims(weights, mesh_shape)
    sharded = weight_positions(args, weight_args)
    specs = _map(args, lambda t: t if isinstance(t, ArgSpec) else ArgSpec(t.shape, t.dtype))
    rec = Recording(fn, specs, mesh_shape, rules, "+".join(over), sharded)
    dry = DryMesh(mesh_shape, rules)

    def weight(s: ArgSpec):
        layout = dry.layout_of(s.shape)
        return placeholder(dry, s.shape, s.dtype, weight_layout(s.shape, layout, mesh_shape, over)
                           if is_float(s.dtype) else layout)
    with layout_scope(dry, rules):
        ghosts = [_map(a, weight if i in sharded and over else lambda s: placeholder(dry, s.shape, s.dtype))
                  for i, a in enumerate(specs)]
    arg_tensors = tensors(ghosts)
    rec.state_bytes = sum(_nbytes(t) for t in arg_tensors)
    for t in arg_tensors:
        rec.shapes.add(t.shape.names)
        for d in t.shape:
            rec.dims[d.name] = max(rec.dims.get(d.name, 0), d.size)
    with counters.counting() as counts:
        with trace(_recording_trace(rec, counts, {id(t) for t in arg_tensors})) as tr:
            out = fn(*ghosts)
    rec.activation_bytes = tr.finish(out)
    rec.collectives = {k: dict(v) for k, v in counters.traffic(counts).items()}
    return rec


def shape_and_rules(where: str, mesh, rules) -> tuple:
    """`(mesh shape, rules)` of `mesh` (a mesh, or a mesh shape) and `rules` (None: the mesh's rules in
    force; none for a shape), as `record` takes them."""
    if isinstance(mesh, (str, Shape, list, tuple)):
        mesh_shape, in_force = mesh_shape_of(mesh), LayoutRules("")
    elif isinstance(mesh, AbstractMesh):
        mesh_shape, in_force = mesh.shape, mesh.layout
    else:
        raise TypeError(f"{where}: mesh must be a Mesh, a DryMesh or a mesh shape ('rows:2;cols:2'), got "
                        f"{mesh!r:.60} ({type(mesh).__name__})")
    return mesh_shape, in_force if rules is None else LayoutRules(rules)


def weight_positions(args, weight_args: Optional[Sequence[int]] = None) -> tuple:
    """The positions in `args` of `record`'s weight arguments: `weight_args` checked, or (None) those
    of the arguments that are dicts.

    >>> weight_positions(({"w": 1}, {"m": {}}, [2])), weight_positions((1, 2), [1])
    ((0, 1), (1,))
    """
    if weight_args is None:
        return tuple(i for i, a in enumerate(args) if isinstance(a, dict))
    if isinstance(weight_args, (str, bytes)) or not hasattr(weight_args, "__iter__"):
        raise TypeError(f"weight_args must be positions in args (a list of ints) or None (the dict arguments), got "
                        f"{weight_args!r:.60} ({type(weight_args).__name__})")
    out = tuple(weight_args)
    bad = [i for i in out if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(args)]
    if bad:
        raise MpimeshError(f"weight_args: {bad} are not positions in the step's {len(args)} arguments")
    return out


def _weight_dims(weights, mesh_shape: Shape) -> tuple:
    """The mesh dims of `record`'s `weights` ("", "rows" or "rows+cols"), checked against the mesh."""
    if not isinstance(weights, str):
        raise TypeError(f"record: weights must be mesh dims ('rows', 'rows+cols') or '' (none), got {weights!r:.60} "
                        f"({type(weights).__name__})")
    over = tuple(m.strip() for m in weights.split("+")) if weights else ()
    for m in over:
        if m not in mesh_shape:
            raise LayoutError(f"record: weights names {m!r}, which is not a dim of the mesh {mesh_shape}")
    if len(set(over)) != len(over):
        raise MpimeshError(f"record: weights names a mesh dim twice: {weights!r}")
    return over


def from_trace(trace) -> Recording:
    """A plain `mm.trace()` as a `Recording` priced as it ran (it cannot run again): each op's
    kernel re-traced dry on a `DryMesh` of its mesh's shape, coordinate 0's blocks, for its
    collectives; FLOPs of einsums from their subscripts (other ops' FLOPs are not known here);
    outputs held by the trace to its end, those autodiff released to their last use. Bucketed
    gradient sums count as one allreduce each (their "psum" ops), not one per bucket."""
    if not trace.ops:
        raise MpimeshError("estimate: the trace holds no ops")
    return _priced(trace.ops, trace.inputs, lambda t: not isinstance(t, Released))


def from_program(program) -> Recording:
    """A compiled step's program (`mpimesh.program.Program`) as a `Recording` priced as
    `mm.compile`'s engine runs it: only the ops its outputs need, each output from its op to its
    last reader (the outputs to the end), the inputs and constants for the whole step.

    >>> import mpimesh as mm
    >>> from mpimesh.program import Program
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> x = mesh.ones("a:1000")
    >>> with mm.trace() as tr:
    ...     y = mm.exp(mm.exp(x)) * 2.0
    >>> rec = from_program(Program(tr, [x], [y]))
    >>> [op.name for op in rec.ops], rec.state_bytes, rec.activation_bytes  # two 4000-byte blocks at once
    (['exp', 'exp', 'multiply'], 4000, 8000)
    """
    outputs = set(program.output_ids)
    return _priced(program.ops, program.inputs + list(program.constants.values()), lambda t: id(t) in outputs)


def _priced(ops, inputs, to_end) -> Recording:
    """The `Recording` of `ops` as they ran on their mesh (see `from_trace`); `inputs`: the tensors
    held for the whole step; `to_end(t)`: whether output `t` lives to the end, not its last use."""
    mesh = ops[0].outputs[0].mesh
    rules = ops[0].rules if ops[0].rules is not None else LayoutRules("")
    rec = Recording(None, None, mesh.shape, rules)
    dry = DryMesh(mesh.shape, rules)
    life, held = _Lifetimes(), {}

    def local(t):
        return shaped(mesh.block_shape(t.shape, t.tensor_layout), t.dtype)
    state = {id(t) for t in inputs}
    rec.state_bytes = sum(math.prod(local(t).shape) * np.dtype(t.dtype).itemsize for t in inputs)
    with counters.counting() as counts:
        comm = _CommDelta(counts)
        for i, op in enumerate(ops):
            ins = [local(t) for t in op.inputs]
            outs = dry.run_dry(op.op, op.params, ins, [(t.shape, t.tensor_layout) for t in op.outputs])
            nbytes = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in ins)
            life.scratch(i, op.op.count_scratch(op.params, ins, outs))
            for t in op.outputs:
                held[id(t)] = t
                out = local(t)
                size = math.prod(out.shape) * np.dtype(t.dtype).itemsize
                nbytes += size
                v = view_of(op, ins, out)
                life.make(t, i, None, None if v is None else op.inputs[v], size)
                rec.shapes.add(t.shape.names)
                for d in t.shape:
                    rec.dims[d.name] = max(rec.dims.get(d.name, 0), d.size)
            for t in op.inputs:
                if id(t) not in state:
                    life.use(t, i)
            rec.ops.append(OpCost(op.name, op.op.count_flops(op.params, ins, outs), nbytes, op.op.gemm, comm(),
                                  overlap_kind(op)))
    for t_id, j in life.live.items():
        if to_end(held[t_id]):
            life.spans[j][1] = len(ops) - 1
    rec.activation_bytes = life.peak(len(ops))
    rec.collectives = {k: dict(v) for k, v in counters.traffic(counts).items()}
    return rec


def _transfer_seconds(key: str, nbytes: float, calls: int, mesh_shape: Shape, machine: Machine) -> float:
    """Seconds of the profile counter `key`'s `calls` transfers of `nbytes` in all on `machine`."""
    kind, _, dims = key.partition("/")
    if not dims:  # a host-device copy: memory traffic
        return nbytes / machine.memory_bandwidth
    dims = tuple(dims.split("+"))
    return collective_seconds(kind, math.prod(mesh_shape[d].size for d in dims), nbytes, machine, dims, calls)


def hidden_seconds(kinds: Sequence, compute: Sequence[float], comm: Sequence[float], depth: int) -> float:
    """Seconds of transfers hidden behind compute, as a compiled step overlaps them (`mpimesh.overlap`),
    per op `i`: its overlap kind (`OpCost.overlap`), compute seconds and transfer seconds. A gather, with
    prefetch `depth` >= 1, hides behind the compute since the previous gather (the previous layer's); a
    reduce-scatter behind the compute after it up to the next one (the rest of the backward); each
    hides at most its own time: the sum of min(transfer, window). Deeper prefetch is priced as depth 1.

    >>> hidden_seconds([None, "gather", None, "gather", None, "scatter", None], [2, 0, 3, 0, 4, 0, 1],
    ...                [0, 1, 0, 5, 0, 2, 0], depth=1)  # 0 (no compute before it) + min(5, 3) + min(2, 1)
    4.0
    """
    hidden, last = 0.0, {}  # kind -> (index of the transfer waiting for compute, its seconds, compute since)
    for i, (kind, c, t) in enumerate(zip(kinds, compute, comm)):
        if kind == "gather" and t > 0:
            hidden += min(t, last.pop("gather", 0.0) if depth >= 1 else 0.0)
            last["gather"] = 0.0  # (the compute since this gather: the next one's window)
        elif kind == "scatter" and t > 0:
            if "scatter" in last:
                hidden += min(last["scatter"][0], last["scatter"][1])
            last["scatter"] = [t, 0.0]
        elif kind is None:
            if "gather" in last:
                last["gather"] += c
            if "scatter" in last:
                last["scatter"][1] += c
    if "scatter" in last:
        hidden += min(last["scatter"][0], last["scatter"][1])
    return float(hidden)


def op_seconds(op: OpCost, machine: Machine) -> float:
    """One op's local compute time on `machine` (the roofline plus its fixed cost)."""
    fixed = machine.einsum_overhead if op.gemm else machine.op_overhead
    return max(op.flops / machine.flops, op.nbytes / machine.memory_bandwidth) + fixed


def estimate(trace, rules=None, mesh_shape=None, machine: Optional[Machine] = None, *,
             weights: Optional[str] = None, prefetch: Optional[int] = None) -> dict[str, Any]:
    """Price one run of a step on `machine`: a dict with `seconds` (compute plus the communication not
    hidden, per rank), `compute_seconds`, `comm_seconds` (all of it), `hidden_seconds` (the gathers and
    reduce-scatters a compiled step overlaps with compute, `hidden_seconds`; `prefetch`: its depth,
    default `MPIMESH_PREFETCH`'s), `bytes_per_rank`, and the parts (`flops`, `comm_bytes`, `collectives`,
    `state_bytes`, `activation_bytes`, `ops`). `trace`: a `Recording`, run again dry where `rules`,
    `mesh_shape` or `weights` (see `record`) differ from its own; or, priced as it ran, a plain
    `mm.trace()`, a compiled step or a `Program`. More: docs/cost_model.md.

    >>> import mpimesh as mm
    >>> m = Machine(flops=1e9, latency=1e-5, bandwidth=1e8, memory=2**30)
    >>> rec = record(lambda x: mm.reduce_sum(x), [ArgSpec("batch:1000", "float32")], "rows:4", "batch:rows")
    >>> e = estimate(rec, "batch:rows", "rows:4", m)
    >>> e["collectives"], round(e["comm_seconds"] * 1e6, 2)  # α + 2·3/4 · 4 B / β
    ({'allreduce/rows': {'calls': 1, 'elements': 1, 'bytes': 4}}, 10.06)
    """
    if not isinstance(machine, Machine):
        raise MpimeshError(f"estimate needs a mm.cost.Machine (calibrate(mesh), or TPUV2, ...), got {machine!r}")
    if hasattr(trace, "programs") and callable(trace.programs):  # a compiled step: its latest program
        programs = trace.programs()
        if not programs:
            raise MpimeshError(f"estimate: the compiled step {trace.__name__!r} has not run yet (nothing "
                               f"recorded to price): call it once first")
        trace = programs[-1]
    if isinstance(trace, (Trace, Program)):
        rec = from_trace(trace) if isinstance(trace, Trace) else from_program(trace)
        mesh_shape = None if mesh_shape is None else mesh_shape_of(mesh_shape)
        if (rules is not None and LayoutRules(rules) != rec.rules) or \
                (mesh_shape is not None and mesh_shape != rec.mesh_shape) or weights:
            rec.rerun(rules, mesh_shape, weights)  # raises: a plain trace cannot run again
    elif isinstance(trace, Recording):
        rec = trace.rerun(rules, mesh_shape, weights)
    else:
        raise MpimeshError(f"estimate prices a mm.cost.Recording (mm.cost.record), a mm.trace(), a "
                           f"compiled step (mm.compile) or its Program, got {type(trace).__name__}")
    times = [op_seconds(op, machine) for op in rec.ops]
    compute = sum(times)
    comm = sum(_transfer_seconds(key, c["bytes"], c["calls"], rec.mesh_shape, machine)
               for key, c in rec.collectives.items())
    transfers = [sum(_transfer_seconds(key, b, n, rec.mesh_shape, machine) for key, (b, n) in op.comm.items())
                 for op in rec.ops]
    depth = prefetch_depth() if prefetch is None else prefetch
    hidden = hidden_seconds([op.overlap for op in rec.ops], times, transfers, depth)
    return {"seconds": compute + comm - hidden, "compute_seconds": compute, "comm_seconds": comm,
            "hidden_seconds": hidden,
            "bytes_per_rank": rec.bytes_per_rank, "flops": sum(op.flops for op in rec.ops),
            "comm_bytes": sum(c["bytes"] for c in rec.collectives.values()), "collectives": rec.collectives,
            "state_bytes": rec.state_bytes, "activation_bytes": rec.activation_bytes, "ops": len(rec.ops)}
