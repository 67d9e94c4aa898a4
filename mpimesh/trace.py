"""The op record, the op trace, and `dispatch`: the one function through which every op runs.

An op hands `dispatch` its definition (`mpimesh.opdef.OpDef`), its inputs (already in the layouts
its kernel needs), the shapes and layouts of its outputs and its params; the mesh runs the kernel
(on MPI ranks, under a JAX replay, or dry: `mpimesh.dryrun`), and the open traces record it.

>>> import mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.ones("a:2")
>>> with mm.trace() as tr:
...     y = mm.exp(x)
>>> [op.name for op in tr.ops], tr.inputs[0] is x
(['exp'], True)
"""
from __future__ import annotations

from contextlib import contextmanager
from time import perf_counter as _clock
from typing import Iterator, Optional, Sequence

from . import env, liveness
from . import counters, flight
from .collectives import guard
from .collectives.base import in_flight, progress
from .collectives.guard import user_frame
from .errors import LayoutError, MpimeshError
from .layout import check_step, local_sizes
from .opdef import Aval, OpDef

_debug = {"on": env.early(env.flag, "MPIMESH_DEBUG", False)}  # a bad value: raised by the first Mesh


def set_debug(enabled: bool) -> None:
    """Check every op's local outputs against their shapes and layouts (`MPIMESH_DEBUG=1` at start).

    Off, `dispatch` still checks what costs nothing per element: one output per spec, each layout
    a layout of its shape on this mesh. On, it also checks each local array's shape against the
    slice its layout gives this rank, and raises `LayoutError` naming the op, dim and sizes: an
    op whose kernel and declared layout disagree is caught where it runs, not ops later.

    >>> set_debug(True); debugging()
    True
    >>> set_debug(False)
    """
    _debug["on"] = bool(enabled)


def debugging() -> bool:
    """Whether `set_debug` is on."""
    env.raise_kept("MPIMESH_DEBUG")
    return _debug["on"]


class OpRecord:
    """One op that ran: its definition (`op`, an `OpDef`), inputs, outputs, params, and the layout
    rules in force when it ran (its gradient ops run under the same rules). While autodiff runs its
    gradient rule, `needs[i]` says whether input i wants a gradient, so a rule may skip (return None
    for) inputs nothing differentiates. `region`: the `mm.remat` call it ran in (its values are not
    kept: the backward pass runs the region again), or None; `rerun`: the region whose second run (in
    the backward pass) it belongs to, or None."""

    __slots__ = ("op", "inputs", "outputs", "params", "rules", "needs", "region", "rerun")

    def __init__(self, op: OpDef, inputs, outputs, params, rules=None):
        self.op, self.inputs, self.outputs, self.params, self.rules = op, inputs, outputs, params, rules
        self.needs = None
        self.region = _regions[-1] if _regions else None
        self.rerun = None

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def grad(self):
        return self.op.grad

    @property
    def flops(self) -> int:
        """The local floating-point operations its kernel does on this rank (`OpDef.flops`)."""
        return self.op.count_flops(self.params, [block(t) for t in self.inputs], [block(t) for t in self.outputs])

    def __repr__(self) -> str:
        ins = ", ".join(str(t.shape) for t in self.inputs)
        outs = ", ".join(str(t.shape) for t in self.outputs)
        return f"{self.name}({ins}) -> {outs}"


def block(t) -> Aval:
    """This rank's block of tensor `t` (a `DistTensor` or a `Released` stand-in) as an `Aval`."""
    shape = t.local_shape if isinstance(t, Released) else getattr(t.local, "shape", ())
    return Aval(shape, t.dtype)


class Released:
    """What a trace keeps of a tensor once nothing needs its values: shape, layout, dtype and mesh
    (enough to replay or print the trace), never the array."""

    __slots__ = ("mesh", "shape", "tensor_layout", "dtype", "local_shape", "partial")

    def __init__(self, t):
        self.mesh, self.shape, self.tensor_layout, self.dtype = t.mesh, t.shape, t.tensor_layout, t.dtype
        self.partial = t.partial
        self.local_shape = tuple(t.local.shape)
        """The shape its array had on this rank."""

    @property
    def layout(self) -> dict:
        """`{tensor_dim_name: mesh_dim_name}` for the split dims, as `DistTensor.layout`."""
        return {d.name: m for d, m in zip(self.shape, self.tensor_layout) if m is not None}

    @property
    def local(self):
        raise MpimeshError(f"the values of this {self.shape} {self.dtype} tensor were released: nothing "
                           f"held it but the trace, and no gradient rule reads it")


def _release(t, records) -> None:
    """Replace `t` by one `Released` stand-in in `records` (every record that refers to it)."""
    stub = Released(t)
    for rec in records:
        rec.inputs = tuple(stub if x is t else x for x in rec.inputs)
        rec.outputs = tuple(stub if x is t else x for x in rec.outputs)
    i = id(t)
    for tr in _open_traces:  # its id may be reused by a new tensor from now on
        tr._produced.discard(i)
        tr._seen.discard(i)
        if tr.host_reads:  # (a read of `t` now names its stand-in, which the records hold)
            tr.host_reads = [(id(stub),) + r[1:] if r[0] == i else r for r in tr.host_reads]
    _kept.forget(i)


class Trace:
    """The ops recorded while the trace was open, in order; tensors used but not produced
    inside it are its `inputs`. `tr.gradients(ys, xs)` is `mm.gradients(ys, xs, tr=tr)` (bound by
    `mpimesh.autodiff`, which sits above this module)."""

    def __init__(self):
        self.ops: list[OpRecord] = []
        self._produced: set[int] = set()
        self._seen: set[int] = set()
        self.inputs: list = []
        self.host_reads: list = []  # (tensor id, shape, dtype, what, where, ops recorded by then): `note_host_read`

    def _append(self, rec: OpRecord) -> None:
        for t in rec.inputs:
            i = id(t)
            if i not in self._produced and i not in self._seen:
                self._seen.add(i)
                self.inputs.append(t)
        self._produced.update(id(t) for t in rec.outputs)
        self.ops.append(rec)

    def __len__(self) -> int:
        return len(self.ops)

    def release(self, t, records) -> None:
        """Replace `t` by a `Released` stand-in in `records` (those of this trace that refer to it)."""
        self._produced.discard(id(t))
        self._seen.discard(id(t))
        _release(t, records)

    def __repr__(self) -> str:
        return "Trace(\n" + "\n".join(f"  {r!r}" for r in self.ops) + "\n)"


_open_traces: list[Trace] = []
_regions: list = []  # the `mm.remat` calls running, innermost last (`mpimesh.remat` pushes them)


class _Kept:
    """While `trace()` blocks are open: which recorded tensors some gradient rule reads (`needed`),
    and the others (`held`: id -> [tensor, the records holding it, how many places]), each released
    once only those places hold it. An op's unread tensors are checked two ops later (a temporary
    is gone by then: the op after it took it as an argument and returned); survivors (a name still
    holds them, a function's local until it returns) again every as many ops as there are of them:
    one check per op on average."""

    def __init__(self):
        self.depth = 0
        self.reset()

    def reset(self) -> None:
        self.needed: set = set()
        self.held: dict = {}
        self.recent: list = [[], []]  # the ids of the last two ops, the older first
        self.old: list = []
        self.since = 0  # ops since `old` was checked

    def note(self, rec, grad) -> None:
        saves = rec.op.saved(rec.params) if grad is not None else ((), ())
        ids = []
        for group, keep in ((rec.inputs, saves[0]), (rec.outputs, saves[1])):
            for j, t in enumerate(group):
                i = id(t)
                if group is rec.inputs and i not in self.held and i not in self.needed:
                    self.needed.add(i)  # an input of the trace (no noted op made it): the trace holds it
                elif j in keep:
                    if i not in self.needed:
                        self.needed.add(i)
                        self.held.pop(i, None)
                elif i not in self.needed:
                    entry = self.held.get(i)
                    if entry is None:
                        self.held[i] = [t, [rec], 1]
                    else:
                        if entry[1][-1] is not rec:
                            entry[1].append(rec)
                        entry[2] += 1
                    ids.append(i)
        due = self.recent[0]
        self.recent = [self.recent[1], ids]
        if due:
            self._check(due)
        self.since += 1
        if self.since >= max(4, len(self.old)):  # every len(old) ops: one check per op on average
            old, self.old, self.since = self.old, [], 0
            self._check(old)

    def sweep(self) -> None:
        """Check every tensor not yet released."""
        ids = self.recent[0] + self.recent[1] + self.old
        self.recent, self.old = [[], []], []
        self._check(ids)

    def _check(self, ids: list) -> None:
        """Release those of `ids` that only records hold; keep the others in `old`."""
        for i in dict.fromkeys(ids):
            entry = self.held.get(i)
            if entry is None:
                continue
            if liveness.held_only_by(entry, 0, entry[2]):
                _release(entry[0], entry[1])
            else:
                self.old.append(i)

    def forget(self, i: int) -> None:
        self.needed.discard(i)
        self.held.pop(i, None)


_kept = _Kept()


def take_over(i: int) -> None:
    """The tensor of id `i` is released by its caller from now on (autodiff's walk,
    which holds it meanwhile), no longer by the open traces."""
    if _kept.depth:
        _kept.held.pop(i, None)
        _kept.needed.add(i)


@contextmanager
def set_apart() -> Iterator[None]:
    """Inside the block, ops are recorded in no trace open outside it and belong to no remat region:
    for an op whose kernel runs other ops (a pipeline's stages), which are its own business."""
    global _kept
    traces, regions, kept = _open_traces[:], _regions[:], _kept
    del _open_traces[:], _regions[:]
    _kept = _Kept()
    try:
        yield
    finally:
        _open_traces[:], _regions[:], _kept = traces, regions, kept


def release_unneeded() -> None:
    """Free now every array of the open traces that nothing but them holds and no gradient rule
    reads (`mm.gradients` calls it before its backward pass)."""
    if _kept.depth:
        _kept.sweep()


@contextmanager
def trace(into: Optional[Trace] = None) -> Iterator[Trace]:
    """Record every op run inside the block (into `into`, a `Trace` of the caller's kind, or a new one)."""
    tr = Trace() if into is None else into
    _open_traces.append(tr)
    _kept.depth += 1
    try:
        yield tr
    finally:
        _open_traces.remove(tr)
        _kept.depth -= 1
        if not _kept.depth:
            _kept.reset()
    if not _kept.depth:  # a step ended (not by an exception): rules it ran under that matched no dim warn
        check_step(op.rules for op in tr.ops)


def note_host_read(t, what: str) -> None:
    """A read of `t`'s values on the host (`what`: `to_numpy()`, `float()`, ...) while traces are
    open: noted in each (`Trace.host_reads`: id, shape, dtype, what, where, ops recorded by then), so
    that a program made from the trace refuses to fix a value it computes (`mpimesh.program`)."""
    if _open_traces:
        where = user_frame()
        for tr in _open_traces:
            tr.host_reads.append((id(t), t.shape, t.dtype, what, where, len(tr.ops)))


def current_trace() -> Optional[Trace]:
    """The innermost open trace, or None."""
    return _open_traces[-1] if _open_traces else None


def open_traces() -> tuple:
    """The traces open now, outermost first."""
    return tuple(_open_traces)


_spmd = guard._settings  # (the SPMD check's switch, read per op)
_remember, _timeline = flight.remember, flight.timeline  # (read per op)
_tensor: list = [None, None]  # the tensor classes dispatch makes (`mpimesh.tensor` registers them)
partials_alive = [0]  # partial tensors alive (`PartialTensor` counts them): only then does dispatch look for one
_checked: set = set()  # (layout, rank, mesh dim names) of output specs already found valid


def tensor_type(cls):
    """Register `cls` as the tensor type `dispatch` makes (a class decorator: `DistTensor` sits
    above this module, which never imports it); a subclass with a `partial` slot as the type of
    outputs awaiting a sum (`dispatch(..., partial=)`)."""
    _tensor[1 if "partial" in getattr(cls, "__slots__", ()) else 0] = cls
    return cls


def dispatch(op: OpDef, inputs: Sequence, out_specs: Sequence[tuple], params: Optional[dict] = None, *,
             mesh=None, out=None, partial: tuple = ()) -> list:
    """Run one op on this rank and record it.

    Args:
      op: what the op is (`OpDef`).
      inputs: DistTensors already laid out as its kernel expects; none for an op that creates
        tensors (its kernel then makes this rank's blocks, e.g. `mesh.zeros`).
      out_specs: one `(shape, layout)` per output.
      params: the kernel's keyword arguments (hashable values), kept in the record.
      mesh: the mesh the outputs live on; needed only when there are no inputs (else theirs).
      out: an array for the kernel to write its one output into (`kernel(..., out=out)`; a
        gradient's slot in its bucket, `mpimesh.buckets`).
      partial: the mesh dims its one output's values still await a sum over (a `PartialTensor`).
    Returns:
      The output DistTensors.
    """
    if params is None:
        params = _NO_PARAMS
    if inputs:
        mesh = inputs[0].mesh
    elif mesh is None:
        raise MpimeshError(f"op {op.name!r} has no inputs: dispatch needs its mesh (mesh=...)")
    if partials_alive[0] and not op.partial_inputs:
        for t in inputs:
            if t.partial:
                raise MpimeshError(f"op {op.name!r}: its input {t.shape} {t.dtype} still awaits a sum over mesh dims "
                                   f"{'+'.join(t.partial)}: sum it first (to_layout)")
    for spec in out_specs:
        if inputs and spec[1] is inputs[0].tensor_layout and spec[0] is inputs[0].shape:
            continue  # (an elementwise op's: its input's own, valid on this mesh; per-op time)
        key = (spec[1], len(spec[0].names), mesh.shape.names)  # (what `_check_spec` reads: no Shape hashed)
        if key not in _checked:
            _check_spec(op.name, spec[0], spec[1], mesh)
            _checked.add(key)
    # the mesh runs the kernel: on its processor (`Mesh.run`), or dry (`dryrun.DryMesh.run`)
    arrays = [t.local for t in inputs]
    t0 = _clock() if _timeline else 0.0  # (a timeline's op is a span from t0)
    if mesh.dry:
        result = mesh.run_dry(op, params, arrays, out_specs)
    else:
        _remember(op)  # the flight recorder (`mpimesh.flight`): always on
        if in_flight:  # (transfers started without waiting: MPI moves them inside its calls)
            progress()
        if _spmd["check"]:  # (the SPMD check keys each collective by its op too)
            outer = guard.in_op[0]
            guard.in_op[0] = f"{op.name} of {', '.join(str(t.shape) for t in inputs) or 'nothing'}"
            try:
                result = mesh.run(op, params, arrays, len(out_specs), out=out) if out is not None else \
                    mesh.run(op, params, arrays, len(out_specs))
            finally:
                guard.in_op[0] = outer  # (an op whose kernel runs ops, a pipeline's: its own again)
        elif out is None:
            result = mesh.run(op, params, arrays, len(out_specs))
        else:
            result = mesh.run(op, params, arrays, len(out_specs), out=out)
    if len(result) != len(out_specs):
        raise MpimeshError(f"op {op.name!r} declares {len(out_specs)} outputs, but its kernel returned {len(result)}")
    if partial:
        outputs = [_tensor[1](mesh, out_specs[0][0], out_specs[0][1], result[0], partial)]
    elif len(out_specs) == 1:
        outputs = [_tensor[0](mesh, out_specs[0][0], out_specs[0][1], result[0])]
    else:
        make = _tensor[0]
        outputs = [make(mesh, shape, layout, local) for (shape, layout), local in zip(out_specs, result)]
    if _debug["on"]:
        for i, t in enumerate(outputs):
            _check_local(op.name, i, t)
    if counters.opened:  # a profile counts (and may record a timeline)
        flops = op.count_flops(params, arrays, result)
        if op.flops is not None:
            counters.record_flops(flops)
        if _timeline and not mesh.dry:
            flight.op(t0, op.name, arrays, result, flops)
    if _open_traces:
        rec = OpRecord(op, tuple(inputs), tuple(outputs), params, mesh.layout)
        for tr in _open_traces:
            tr._append(rec)
        if _kept.depth:  # an op of a remat region keeps nothing: its backward runs the region again
            _kept.note(rec, op.grad if rec.region is None else None)
    return outputs


_NO_PARAMS: dict = {}  # (shared: never written)


def _check_spec(name: str, shape, layout, mesh) -> None:
    """An output layout must name one mesh dim (or None) per dim of its shape, each mesh dim once."""
    if len(layout) != shape.rank:
        raise LayoutError(f"op {name!r}: output layout {layout} has {len(layout)} entries for the "
                          f"{shape.rank} dims of [{shape}]")
    split = [m for m in layout if m is not None]
    for m in split:
        if m not in mesh.shape:
            raise LayoutError(f"op {name!r}: output [{shape}] is laid out on mesh dim {m!r}, but the mesh "
                              f"has dims {list(mesh.shape.names)}")
    if len(set(split)) != len(split):
        raise LayoutError(f"op {name!r}: output [{shape}] uses a mesh dim twice in layout {layout}")


def _check_local(name: str, index: int, t) -> None:
    """Debug mode: `t.local` must be exactly this rank's slice of `t` under its layout."""
    want = local_sizes(t.shape, t.mesh.shape, t.tensor_layout, t.mesh.coords)
    got = tuple(t.local.shape)
    if got != want:
        bad = [f"{d.name} {g} (want {w})" for d, g, w in zip(t.shape, got, want) if g != w]
        raise LayoutError(f"op {name!r} output {index} [{t.shape}] layout {t.layout}: rank "
                          f"{t.mesh.rank}'s local shape is {got}, its layout gives {want}"
                          + (f": {', '.join(bad)}" if bad and len(got) == len(want) else ""))
