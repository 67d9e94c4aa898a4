"""`mm.compile(fn)`: record a step once, then run its kernels again without the per-op Python.

The first call per signature (each tensor argument's mesh, shape, layout and dtype, other arguments
by value, the rules, bucket size and matmul precision in force) runs `fn` eagerly in a trace; later
calls replay its `Program`'s kernels, bitwise eager's values (on CuPy as CUDA graphs, elementwise chains
fused: `mpimesh.fusion`). `fn` may not read values on the host (a `CompileError` at the read) nor assign
into its arguments; donated tensors (`donate_argnums`) may have results written over them. More: docs/compile.md.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> step = mm.compile(lambda x, w: mm.einsum([x, w], output_shape="b:2") * 2.0)
>>> w = mesh.from_numpy(np.array([1.0, 2.0]), "d:2")
>>> [step(mesh.ones("b:2;d:2") * s, w).to_numpy().tolist() for s in (1.0, 3.0)], step.recordings, step.replays
([[6.0, 6.0], [18.0, 18.0]], 1, 1)
"""
from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from .backend import matmul_precision
from .buckets import bucket_bytes, next_slot, pack_by_destination, slot_step, unpack_destination
from . import counters, flight
from .collectives import guard
from .collectives.guard import user_frame
from .errors import DivergenceError, MpimeshError
from .graphs import for_engine
from .ops.relayout import SUM_PARTIAL
from . import fusion, liveness, rowfusion
from .overlap import prefetch_depth, schedule
from .program import AsyncStep, BucketStep, OpStep, Program, ProgramError
from .tensor import DistTensor, Donated, host_reads
from .trace import current_trace, trace
from .tree import flatten, unflatten

_ASKING = "mm.compile asking whether any rank read values on the host while recording"


class CompileError(ProgramError):
    """A step `mm.compile` cannot record: it reads values on the host, or returns something other
    than tensors (in tuples, lists and dicts)."""


def compile(fn: Callable, cache_size: int = 8, donate_argnums=(), fuse: bool = True) -> "Compiled":  # noqa: A001
    """`fn` recorded once per signature and replayed without per-op Python; the tensors in the
    positional arguments `donate_argnums` (an int or a tuple of them) are given to the step; `fuse`:
    chains of elementwise ops run as one generated kernel each where the backend has one (see the module)."""
    if not callable(fn):
        raise TypeError(f"mm.compile needs a function, got {type(fn).__name__}")
    if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
        raise MpimeshError(f"mm.compile: cache_size must be a whole number >= 1, got {cache_size!r}")
    donate = (donate_argnums,) if isinstance(donate_argnums, int) and not isinstance(donate_argnums, bool) \
        else donate_argnums
    if not isinstance(donate, (tuple, list)) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                     for i in donate):
        raise MpimeshError(f"mm.compile: donate_argnums must be a position (an int >= 0) or a tuple of them, "
                           f"got {donate_argnums!r}")
    if not isinstance(fuse, bool):
        raise MpimeshError(f"mm.compile: fuse must be True or False, got {fuse!r}")
    return Compiled(fn, cache_size, tuple(sorted(set(donate))), fuse)


class Compiled:
    """A compiled step: call it as `fn`. `recordings` and `replays` count the calls of each kind;
    `signatures()` lists the signatures held, most recent last."""

    def __init__(self, fn: Callable, cache_size: int, donate: tuple = (), fuse: bool = True):
        self.fn, self.cache_size, self.donate, self.fuse = fn, cache_size, donate, fuse
        self.cache: OrderedDict = OrderedDict()
        self.recordings = self.replays = 0
        self.__name__ = getattr(fn, "__name__", "step")
        self.__doc__ = getattr(fn, "__doc__", None)

    def signatures(self) -> list:
        """The signatures of the programs held, least recently used first."""
        return list(self.cache)

    def programs(self) -> list:
        """The programs held (`mpimesh.program.Program`, shapes only), least recently used first:
        what `mm.cost.estimate(step, machine=...)` prices (the last)."""
        return [e.program for e in self.cache.values() if e.program is not None]

    def __call__(self, *args, **kwargs):
        if current_trace() is not None:  # inside a user's trace: eager, so its ops are recorded there
            return self.fn(*args, **kwargs)
        leaves, tree = flatten((args, kwargs))
        seen: dict = {}  # one tensor passed twice is one input of the recording: part of its signature
        aliases = tuple(seen.setdefault(id(v), i) for i, v in enumerate(leaves) if isinstance(v, DistTensor))
        key = (tree, aliases, _settings(leaves), tuple(_signature(v) for v in leaves))
        donated = self._donated(args, kwargs) if self.donate else []
        entry = self.cache.get(key)
        if entry is None:
            out, entry = self._record(args, kwargs, leaves, tree)
            self.cache[key] = entry
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
            self.recordings += 1
            returned = {id(t) for t in flatten(out)[0]}
            self._give_up([t for t in donated if id(t) not in returned])
            return out
        self.cache.move_to_end(key)
        self.replays += 1
        t0 = flight.clock()
        flight.remember((t0, "replay", self.__name__))
        if not flight.timeline:
            return entry.run(leaves, donated, self._give_up)
        out = entry.run(leaves, donated, self._give_up)
        flight.span(t0, f"replay {self.__name__}", "compiled")
        return out

    def _donated(self, args: tuple, kwargs: dict) -> list:
        """The tensors of the donated arguments that no other argument holds."""
        if self.donate[-1] >= len(args):
            raise MpimeshError(f"mm.compile({self.__name__}): donate_argnums={self.donate} names positional "
                               f"argument {self.donate[-1]}, but the step was called with {len(args)}")
        given = {id(t): t for i in self.donate for t in flatten(args[i])[0] if isinstance(t, DistTensor)}
        others = [a for i, a in enumerate(args) if i not in self.donate] + [kwargs]
        for t in flatten(others)[0]:
            given.pop(id(t), None)
        return list(given.values())

    def _give_up(self, tensors: list) -> None:
        """Mark donated tensors: any later use raises, naming this step."""
        for t in tensors:
            t.local = Donated(f"this {t.shape} {t.local.dtype} tensor was donated to the compiled step "
                              f"{self.__name__} (mm.compile(..., donate_argnums={self.donate})), whose results "
                              f"may now be in its memory: use the tensors that step returned instead "
                              f"(params = step(params, ...))")

    def _record(self, args, kwargs, leaves, tree) -> tuple:
        # fn gets its own tensor objects (the same blocks): a tensor it also reads from a closure is
        # then a constant there, whether or not it was passed in as well
        own: dict = {}
        inner = [own.setdefault(id(v), DistTensor(v.mesh, v.shape, v.tensor_layout, v.local))
                 if isinstance(v, DistTensor) else v for v in leaves]
        args, kwargs = unflatten(tree, inner)
        reads: list = []  # the host reads of this rank: the first raises where it is made
        took = [v for v in leaves if isinstance(v, DistTensor)]

        def read(t, what: str) -> None:
            reads.append((t, what, user_frame()))
            raise CompileError(self._read_refused(reads))
        host_reads.append(read)
        check = guard.settings()["check"]
        guard.set_spmd_check(True)  # (see `_agree`: a rank that read waits in no collective the others skip)
        tr = None
        try:
            try:
                with trace() as tr:
                    out = self.fn(*args, **kwargs)
            except DivergenceError as e:  # every rank raised it at one check: another's read may be why
                if not reads and _ASKING in str(e):
                    raise CompileError(self._read_refused(reads)) from None
                raise
            except Exception:
                if reads:
                    with contextlib.suppress(DivergenceError):  # (the others went on to a collective of the step)
                        self._agree(True, took + list(tr.inputs if tr is not None else ()) + [r[0] for r in reads])
                raise
            anyone = self._agree(bool(reads), took + list(tr.inputs))
        finally:
            host_reads.pop()
            guard.set_spmd_check(check)
        if anyone:
            raise CompileError(self._read_refused(reads))
        after, after_tree = flatten((args, kwargs))
        if after_tree != tree or any(a is not b for a, b in zip(after, inner)):
            raise CompileError(f"mm.compile({self.__name__}): the step assigns into its arguments (a dict or list "
                               f"passed in holds other values after it ran); a replay runs no Python, so it would "
                               f"not do that again: return the new values instead (params = step(params, ...))")
        out_leaves, out_tree = flatten(out)
        for v in out_leaves:
            if v is not None and not isinstance(v, DistTensor):
                raise CompileError(f"mm.compile({self.__name__}): the step returns a {type(v).__name__}; a "
                                   f"compiled step returns tensors (in tuples, lists and dicts) and None")
        entry = _Entry(tr, inner, out_leaves, out_tree, self.fuse)
        theirs = {id(own[id(v)]): v for v in leaves if isinstance(v, DistTensor)}
        return unflatten(out_tree, [theirs.get(id(v), v) for v in out_leaves]), entry  # (arguments as passed)

    @staticmethod
    def _agree(mine: bool, tensors: list) -> bool:
        """Whether any rank's step read values on the host while recording: each rank asks once, where
        its first read raised or else once its recording is done, on the mesh of the first tensor the
        step took or read (one flag). A read on some ranks only (`if rank == 0: print(float(loss))`)
        leaves those ranks asking while the others go on to the step's next collective: so a recording
        runs with the SPMD check on (one more small allreduce per collective, in the recording alone),
        and there every rank raises `DivergenceError`, before any data moves, naming this question
        (`_ASKING`) among where the ranks were; the others then raise `CompileError` too."""
        mesh = next((t.mesh for t in tensors if hasattr(getattr(t, "mesh", None), "collectives")), None)
        if mesh is None:
            return mine
        guard.in_op[0] = _ASKING
        try:
            return mesh.collectives.any_rank(mine)
        finally:
            guard.in_op[0] = ""

    def _read_refused(self, reads: list) -> str:
        """The CompileError's message: the first read of this rank, or the word that another rank read."""
        why = (f"reads the values of a {reads[0][0].shape} {reads[0][0].dtype} tensor on the host ({reads[0][1]}) "
               f"at {reads[0][2]}" if reads else "reads values on the host on another rank (its error names the line)")
        return (f"mm.compile({self.__name__}): the step {why}. A compiled step runs its kernels again without "
                f"running Python, so it cannot read or branch on values: return the tensor and read it after the "
                f"step, or call the function without mm.compile")


class _Entry:
    """One signature's program and how to map arguments onto it and results back."""

    def __init__(self, tr, leaves: list, out_leaves: list, out_tree, fuse: bool = True):
        arg_ids = {}
        for i, v in enumerate(leaves):
            if isinstance(v, DistTensor):
                arg_ids.setdefault(id(v), i)
        read = {id(t) for t in tr.inputs}
        self.input_leaves = [i for t_id, i in arg_ids.items() if t_id in read]  # the arguments the step reads
        inputs = [leaves[i] for i in self.input_leaves]
        known = read | {id(t) for rec in tr.ops for t in rec.outputs}  # (else made by no op: a constant)
        made = [t for t in out_leaves if t is not None and id(t) not in arg_ids and id(t) in known]
        self.out_tree = out_tree
        # per result leaf: ("arg", leaf index) passed through, ("out", k) the program's k-th output,
        # ("const", tensor) one no recorded op made (a closure's, `mesh.from_numpy`'s), None
        self.outs, seen = [], {}
        for t in out_leaves:
            if t is None:
                self.outs.append(None)
            elif id(t) in arg_ids:
                self.outs.append(("arg", arg_ids[id(t)]))
            elif id(t) not in known:
                self.outs.append(("const", t))
            else:
                self.outs.append(("out", seen.setdefault(id(t), len(seen))))
        unique = list({id(t): t for t in made}.values())
        if not unique:
            self.engine, self.metas, self.program = None, [], None
            return
        try:
            program = Program(tr, inputs, unique, CompileError, "mm.compile")
        except ProgramError as e:
            raise CompileError(str(e)) from None
        self.engine = for_engine(_Engine(program, fuse))
        self.program = program.strip()  # the engine has its constants' arrays
        self.metas = [(t.mesh, t.shape, t.tensor_layout) for t in unique]

    def run(self, leaves: list, donated: list = (), give_up=None):
        """The step's results for the arguments `leaves`; the `donated` tensors are given up
        (`give_up`) before the engine runs, so that it holds their blocks' only references."""
        results = []
        if donated:
            returned = {id(leaves[o[1]]) if o[0] == "arg" else id(o[1]) for o in self.outs  # (returned as they
                        if o is not None and o[0] != "out"}                                  # are: kept)
            donated = [t for t in donated if id(t) not in returned]
        if self.engine is not None:
            blocks = [leaves[i].local for i in self.input_leaves]
            if donated:
                give_up(donated)
            arrays = self.engine.run(blocks)
            results = [DistTensor(mesh, shape, layout, a) for (mesh, shape, layout), a in zip(self.metas, arrays)]
        elif donated:
            give_up(donated)
        flat = [None if o is None else leaves[o[1]] if o[0] == "arg" else results[o[1]] if o[0] == "out"
                else DistTensor(o[1].mesh, o[1].shape, o[1].tensor_layout, o[1].local) for o in self.outs]
        return unflatten(self.out_tree, flat)


class _Engine:
    """The program as a flat list of typed steps (`program.OpStep`, `program.BucketStep`) over a list
    of arrays (the inputs' slots first, then the constants', then each op's outputs'). An op step's
    `into`: `(output index, input slot)` pairs, where the kernel can write that output over that
    input (`OpDef.into`) and the op is the input's last reader; the output is written there when, as
    the op runs, the engine holds the input array's only reference (`_sole`: a donated block, or a
    temporary) and the array owns its memory.

    A gradient bucket (the bucketed records of one `mpimesh.buckets` bucket) is a flat buffer made
    each run before the einsum of its first member (`"make"`), that each member's einsum writes its
    slot of (its step's `write`), then `"start"` where its last member was recorded (one
    non-blocking allreduce in place, as eager) and `"wait"` before the first op that reads one of
    them. `fuse`: the program's elementwise chains as one step each (`mpimesh.fusion`), and those a
    layer norm reads or whose dx they read folded into its row kernel (`mpimesh.rowfusion`), where the
    mesh's backend has their kernels. `run(arrays)` gives the outputs' arrays."""

    def __init__(self, program: Program, fuse: bool = True):
        self.mesh = program.mesh
        ops = fusion.fuse(program.ops, program.output_ids, self.mesh.backend) \
            if fuse and fusion.applies(self.mesh.backend) else program.ops
        if fuse and self.mesh.backend in rowfusion.BUILDERS:
            ops = rowfusion.fold(ops, program.output_ids, self.mesh.backend)
        slots: dict[int, int] = {}

        def slot(i: int) -> int:
            return slots.setdefault(i, len(slots))
        for i in program.input_ids:
            slot(i)
        self.constants = [(slot(i), t.local) for i, t in program.constants.items()]
        reads = []
        for rec in ops:
            reads.append([slot(id(t)) for t in rec.inputs])
            for t in rec.outputs:
                slot(id(t))
        keep = {slots[i] for i in program.output_ids} | {s for s, _ in self.constants}  # (inputs: freed)
        frees = liveness.frees(reads, keep)
        buckets = _buckets(ops, slots, program.mesh)
        scatters = sorted((b for b in buckets if type(b) is _ReplayScatter), key=lambda b: b.start_at)
        depth = prefetch_depth()
        for older, b in zip(scatters, scatters[depth + 1:]):  # at most depth + 1 in flight, as eager
            older.wait_at = min(older.wait_at, b.start_at)
        starts = {b.start_at: b for b in buckets}
        waits: dict[int, list] = {}
        for b in buckets:
            waits.setdefault(b.wait_at, []).append(b)
        members = {k for b in buckets for k in b.members}
        makes: dict[int, list] = {}
        for b in buckets:
            if b.writers:
                makes.setdefault(min(b.writers), []).append(b)
        writers = {k: (b, j) for b in buckets for j, k in enumerate(b.writers)}
        self.steps: list = []
        for k, rec in enumerate(ops):
            self.steps += [BucketStep("wait", b) for b in waits.get(k, ())]
            self.steps += [BucketStep("make", b) for b in makes.get(k, ())]
            ins, outs, dead = [slots[id(t)] for t in rec.inputs], [slots[id(t)] for t in rec.outputs], frees.get(k, [])
            if k in writers:
                b, j = writers[k]
                self.steps.append(OpStep(rec.op, rec.params, ins, outs, dead, rec.flops, (), b.slot_of(j)))
            elif k not in members:
                into = tuple((j, ins[i]) for j, i in rec.op.into.items() if ins[i] in dead and ins.count(ins[i]) == 1)
                self.steps.append(OpStep(rec.op, rec.params, ins, outs, dead, rec.flops, into))
            if k in starts:
                self.steps.append(BucketStep("start", starts[k]))
        self.steps += [BucketStep("wait", b) for b in waits.get(len(ops), ())]
        self.steps = schedule(self.steps, depth)
        self.n_slots = len(slots)
        self.n_inputs = len(program.input_ids)
        self.outputs = [slots[i] for i in program.output_ids]

    def run(self, arrays: list) -> list:
        """The outputs' arrays for the inputs' `arrays` (the list is emptied: the engine's slots
        hold the only references a donated block has, and drop them after its last reader)."""
        env = self.start_env(arrays)
        arrays.clear()
        self.run_steps(self.steps, env, {})
        return [env[s] for s in self.outputs]

    def start_env(self, arrays: list) -> list:
        """The slots of one run: the inputs' arrays, the constants', the rest empty."""
        env: list[Any] = [None] * self.n_slots
        env[:self.n_inputs] = arrays
        for s, a in self.constants:
            env[s] = a
        return env

    def run_steps(self, steps, env: list, flying: dict, ctx=None, count: bool = True) -> None:
        """Run `steps` over `env`; `flying`: the bucket allreduces under way, by bucket; `ctx`: the
        collectives the kernels see (None: the mesh's); `count`: FLOPs into the open profile, and
        each step a span of the open timeline."""
        if count and flight.timeline:
            for step in steps:
                ins = [_shape(env[s]) for s in step.ins] if type(step) is OpStep else None  # (before it frees them)
                t0 = flight.clock()
                self._run_steps((step,), env, flying, ctx, count)
                _step_span(t0, step, env, ins)
        else:
            self._run_steps(steps, env, flying, ctx, count)

    def _run_steps(self, steps, env: list, flying: dict, ctx, count: bool) -> None:
        run = self.mesh.run
        counting = count and counters._open
        for step in steps:
            if type(step) is OpStep:
                ins, outs = step.ins, step.outs
                if step.write is not None:
                    flat, at, shape = step.write
                    view = env[flat][at:at + math.prod(shape)].reshape(shape)
                    result = run(step.op, step.params, [env[s] for s in ins], 1, ctx, out=view)
                    view = None
                elif step.into and (mine := frozenset(j for j, s in step.into if _sole(env, s))):
                    result = run(step.op, step.params, [env[s] for s in ins], len(outs), ctx, into=mine)
                else:
                    result = run(step.op, step.params, [env[s] for s in ins], len(outs), ctx)
                for s, r in zip(outs, result):
                    env[s] = r
                result = r = None  # (the slots alone hold the outputs: a later op may write over them)
                for s in step.frees:
                    env[s] = None
                if step.flops and counting:
                    counters.record_flops(step.flops)
                for request in flying.values():  # MPI moves data only inside its calls
                    request.test()
            elif type(step) is AsyncStep:
                op = step.step
                if step.kind == "start":
                    flying[id(op)] = step.begin(ctx or self.mesh.collectives, *[env[s] for s in op.ins])
                else:
                    env[op.outs[0]] = flying.pop(id(op)).wait()
                    for s in op.frees:
                        env[s] = None
            elif step.kind == "make":
                env[step.bucket.flat] = step.bucket.make(ctx or self.mesh.collectives)
            elif step.kind == "start":
                flying[id(step.bucket)] = step.bucket.start(self.mesh, env)
            else:
                step.bucket.finish(flying.pop(id(step.bucket)), env)


def _step_span(t0: float, step, env: list, ins) -> None:
    """A replayed step's timeline span from `t0`: an op's (`ins`: its inputs' shapes), or a gradient
    bucket's make, start or wait."""
    if type(step) is OpStep:
        flight.span(t0, step.op.name, "op", {"flops": step.flops, "shapes": ins,
                                             "out_shapes": [_shape(env[s]) for s in step.outs], "compiled": True})
    elif type(step) is AsyncStep:
        flight.span(t0, f"{step.step.op.name} {step.kind}", "overlap", {"compiled": True})
    else:
        b = step.bucket
        flight.span(t0, f"bucket {step.kind}", "bucket", {"bytes": b.size * b.dtype.itemsize, "mesh_dims": list(b.dims),
                                                          "members": len(b.members)})


def _shape(a) -> list:
    """An array's shape as a list ([] for a slot already freed)."""
    return list(getattr(a, "shape", ()))


def _sole(env: list, s: int) -> bool:
    """Whether `env` holds the only reference to slot s's array (no tensor, view or caller's
    variable holds it: numpy's own test before it reuses a temporary), a writable array that owns
    its memory: then an op may write its output over it."""
    if not liveness.held_only_by(env, s):  # (first: a name bound to it here would count)
        return False
    a = env[s]
    return getattr(a, "base", 0) is None and getattr(getattr(a, "flags", None), "writeable", True)


class _ReplayBucket:
    """The psum records of one gradient bucket, in the order eager filled it. Each run: its flat
    buffer made (`make`, into slot `flat`) before the first einsum that writes a member's slot
    (`writers`, program indices), summed in place after the last member (`start_at`), waited for
    before the first op that reads one of their outputs (`wait_at`; the program's length: only at
    the end). A buffer of its own each run (`Collectives.bucket_buffer`: one no array refers to any
    more): the gradients a run returns are views of it, which the next run does not overwrite."""

    def __init__(self, records: list, slots: dict, ops: list, mesh):
        self.dims = records[0].inputs[0].partial  # (the sum its members await: a `PartialTensor`'s state)
        partials = [rec.inputs[0] for rec in records]
        self.ins = [slots[id(t)] for t in partials]
        self.outs = [slots[id(rec.outputs[0])] for rec in records]
        self.dtype = np.dtype(partials[0].dtype)
        self.dtypes = [rec.outputs[0].dtype for rec in records]
        self.shapes = [t.local_shape if hasattr(t, "local_shape") else tuple(t.local.shape) for t in partials]
        self.at, end, step = [], 0, slot_step(mesh.xp, self.dtype.itemsize)
        for shape in self.shapes:
            self.at.append(end)
            end = next_slot(end, math.prod(shape), step)
        self.size = end
        ends = [at + math.prod(shape) for at, shape in zip(self.at, self.shapes)]
        self.pads = [(e, at) for e, at in zip(ends, self.at[1:] + [end]) if at > e]  # aligned slots (a GPU's)
        self.flat = slots.setdefault(("bucket", id(self)), len(slots))
        index = {id(rec): k for k, rec in enumerate(ops)}
        made = {id(t): k for k, rec in enumerate(ops) for t in rec.outputs}
        self.members = [index[id(rec)] for rec in records]  # program indices (no record is kept)
        self.writers = [made[id(t)] for t in partials]  # the einsums that make the members
        self.start_at = max(self.members)
        outs = set(self.outs)
        self.wait_at = next((k for k in range(self.start_at + 1, len(ops))
                             if any(slots[id(t)] in outs for t in ops[k].inputs)), len(ops))

    def make(self, ctx):
        """The kernel of the `"bucket"` op: this run's flat buffer, its padding between slots zeroed."""
        flat = ctx.bucket_buffer(self.size, self.dtype, self.dims)
        for a, b in self.pads:
            flat[a:b] = 0
        return flat

    def slot_of(self, j: int) -> tuple:
        """`(buffer slot, offset, shape)` where member j's einsum writes its local sums."""
        return self.flat, self.at[j], self.shapes[j]

    def start(self, mesh, env: list):
        flat = env[self.flat]
        for s in self.ins:
            env[s] = None  # views of the buffer, which the allreduce now owns
        return mesh.collectives.iallreduce(flat, self.dims, out=flat)

    def finish(self, request, env: list) -> None:
        flat, env[self.flat] = request.wait(), None  # the gradients' views keep it
        for s, at, shape, dtype in zip(self.outs, self.at, self.shapes, self.dtypes):
            block = flat[at:at + math.prod(shape)].reshape(shape)
            env[s] = block if block.dtype == dtype else block.astype(dtype)


class _ReplayScatter:
    """The psum records of one bucket of reduce-scatters (`buckets._Scatter`), in eager's order: after
    the last member, the members' gradient terms packed by destination and one non-blocking
    reduce-scatter started (`start`); waited for before the first op that reads one of their blocks
    (`wait_at`), or sooner where the in-flight bound calls for it (`_Engine`); each block a view."""

    writers: tuple = ()  # (no einsum writes into it: it packs its members when it starts)

    def __init__(self, records: list, slots: dict, ops: list, mesh):
        ((self.dim, _),) = records[0].params["scatter"]
        self.mesh = mesh
        self.dims, self.axes = (self.dim,), [rec.params["scatter"][0][1] for rec in records]
        partials = [rec.inputs[0] for rec in records]
        self.ins = [slots[id(t)] for t in partials]
        self.outs = [slots[id(rec.outputs[0])] for rec in records]
        self.dtype = np.dtype(partials[0].dtype)
        self.shapes = [t.local_shape if hasattr(t, "local_shape") else tuple(t.local.shape) for t in partials]
        self.size = sum(math.prod(shape) for shape in self.shapes)
        self.flat = slots.setdefault(("scatter", id(self)), len(slots))  # (never filled: `BucketStep` names it)
        index = {id(rec): k for k, rec in enumerate(ops)}
        self.members = [index[id(rec)] for rec in records]
        self.start_at = max(self.members)
        outs = set(self.outs)
        self.wait_at = next((k for k in range(self.start_at + 1, len(ops))
                             if any(slots[id(t)] in outs for t in ops[k].inputs)), len(ops))

    def start(self, mesh, env: list):
        arrays = [env[s] for s in self.ins]
        for s in self.ins:
            env[s] = None  # (packed: the buffer holds them)
        flat, sizes = pack_by_destination(mesh.xp, arrays, self.axes, mesh.shape[self.dim].size)
        return mesh.collectives.ireduce_scatter(flat, self.dim, 0, sizes=sizes)

    def finish(self, request, env: list) -> None:
        k, c = self.mesh.shape[self.dim].size, self.mesh.coords[self.dim]
        for s, block in zip(self.outs, unpack_destination(request.wait(), self.shapes, self.axes, k, c)):
            env[s] = block


def _buckets(ops: list, slots: dict, mesh) -> list:
    """The program's gradient buckets (psum records with a `bucket` param, all members present): of
    allreduces (`_ReplayBucket`) and of reduce-scatters (`_ReplayScatter`)."""
    groups: dict = {}
    for rec in ops:
        tag = rec.params.get("bucket") if rec.op.bucketed or rec.op is SUM_PARTIAL else None
        if tag is not None:
            groups.setdefault(tag[0], []).append((tag[1], tag[2], rec))
    out = []
    for members in groups.values():
        members.sort(key=lambda m: m[0])
        if len(members) == members[0][1]:  # else some were pruned: each psum runs on its own
            kind = _ReplayScatter if members[0][2].op is SUM_PARTIAL else _ReplayBucket
            out.append(kind([m[2] for m in members], slots, ops, mesh))
    return out


def _settings(leaves: list) -> tuple:
    """What else fixes a recording: each mesh's layout rules, the bucket size, the matmul precision."""
    meshes = {id(v.mesh): v.mesh for v in leaves if isinstance(v, DistTensor)}
    return tuple(str(m.layout) for m in meshes.values()), bucket_bytes(), matmul_precision()


def _signature(v) -> tuple:
    if isinstance(v, DistTensor):
        return ("tensor", id(v.mesh), v.shape, v.tensor_layout, str(v.dtype))
    if isinstance(v, (float, complex, np.floating, np.complexfloating)):  # by its bits: -0.0 is not 0.0, and
        return ("value", type(v).__name__, np.asarray(v).tobytes())  # a nan is itself (nan != nan)
    try:
        hash(v)
    except TypeError:
        raise CompileError(f"mm.compile: an argument of type {type(v).__name__} is neither a tensor nor "
                           f"hashable: pass tensors, numbers, strings, and tuples, lists or dicts of them") from None
    return ("value", type(v).__name__, v)
