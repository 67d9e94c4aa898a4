"""A recorded step as a program: the op records that given outputs need, in trace order, and which
tensors are its inputs, outputs and constants; what `mm.compile`'s engine and the JAX replay run.

Tensors are known by identity, so one an open trace released still links its ops. More: docs/compile.md.

>>> import mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.ones("a:2")
>>> with mm.trace() as tr:
...     y = mm.exp(x) * 2.0
...     unused = mm.sin(x)
>>> p = Program(tr, [x], [y])
>>> [op.name for op in p.ops], p.constants
(['exp', 'multiply'], {})
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .errors import MpimeshError
from .opdef import OpDef
from .trace import Released


class ProgramError(MpimeshError):
    """A trace, inputs and outputs that make no program (the message names the tensor and why)."""


def describe(t) -> str:
    """`[a:2, b:3] float32 tensor laid out {a: rows}`: how messages name a tensor of a trace."""
    layout = ", ".join(f"{d.name}: {m}" for d, m in zip(t.shape, t.tensor_layout) if m)
    return f"[{t.shape}] {t.dtype} tensor laid out {{{layout}}}"


def _no_values_read(trace, ops: list, inputs: set, error, what: str) -> None:
    """`error` if the trace read on the host the values of a tensor that depends on the program's
    `inputs` (ids) before an op the program runs: a number taken from it (`float(loss)` in a scale,
    a branch) is fixed in the program, which runs no Python. Reads after its last op are fine."""
    if not ops or not trace.host_reads:
        return
    at = {id(rec): k for k, rec in enumerate(trace.ops)}
    last = max(at[id(rec)] for rec in ops)
    reach = {i: None for i in inputs}  # id -> a tensor of the trace that depends on the inputs
    for rec in trace.ops:
        if any(id(t) in reach for t in rec.inputs):
            reach.update((id(t), t) for t in rec.outputs)
    for i, shape, dtype, how, where, recorded in trace.host_reads:
        t = reach.get(i, False)
        if t is not False and recorded <= last and (t is None or (t.shape, t.dtype) == (shape, dtype)):
            raise error(f"{what}: the trace read the values of a {shape} {dtype} tensor computed from the "
                        f"{what}'s inputs on the host ({how}) at {where}, before ops the {what} runs: a number "
                        f"taken from it there is fixed in the recording, so the {what} would compute with the "
                        f"old one. Compute with ops on the tensor instead, or read values once the ops are done")


class Program:
    """The ops of `trace` that `outputs` depend on, in order (`ops`); `inputs` given by the caller
    (each an input of the trace: read by it, not produced); `constants`: the other tensors of the
    trace that the ops read but do not produce, `{id: tensor}` (their values are fixed at the
    recording). `error`: the exception class to raise (a replay's own), `what`: its name in messages.
    """

    def __init__(self, trace, inputs: Sequence, outputs: Sequence, error=ProgramError, what: str = "replay"):
        inputs, outputs = list(inputs), list(outputs)
        if not outputs:
            raise error(f"{what} needs at least one output tensor")
        ref = trace.ops[0].outputs[0] if trace.ops else (inputs or outputs)[0]  # an op may have no inputs
        self.mesh = ref.mesh
        trace_inputs = {id(t) for t in trace.inputs}
        given: dict[int, int] = {}
        for i, t in enumerate(inputs):
            if not hasattr(t, "tensor_layout"):
                raise error(f"{what} input {i} is a {type(t).__name__}, not a DistTensor")
            if id(t) not in trace_inputs:
                raise error(f"{what} input {i}, a {describe(t)}, is not an input of the trace "
                            f"(the trace never reads it, or produces it itself)")
            if id(t) in given:
                raise error(f"{what} input {i}, a {describe(t)}, is listed twice (also as input {given[id(t)]})")
            given[id(t)] = i
        for t in inputs + outputs:
            if getattr(t, "mesh", None) is not self.mesh:
                raise error(f"{what}: a {describe(t)} lives on another mesh than the trace's {self.mesh}")
        need = {id(t) for t in outputs}  # only the ops the outputs depend on, walking back from them
        keep = []
        for rec in reversed(trace.ops):
            if any(id(t) in need for t in rec.outputs):
                keep.append(rec)
                need.update(id(t) for t in rec.inputs)
        self.ops = keep[::-1]
        produced = {id(t) for rec in self.ops for t in rec.outputs}
        _no_values_read(trace, self.ops, set(given), error, what)
        self.constants: dict[int, object] = {}
        self.readers: dict[int, object] = {}  # a constant's first reader (an op record, or None: the outputs)
        for t, rec in [(t, rec) for rec in self.ops for t in rec.inputs] + [(t, None) for t in outputs]:
            i = id(t)
            if i in produced or i in given or i in self.constants:
                continue
            if i not in trace_inputs:
                raise error(f"{what} output {describe(t)} is neither produced by the trace nor one of its inputs")
            self.constants[i] = t
            self.readers[i] = rec
        self.inputs, self.outputs = inputs, outputs
        self.input_ids = [id(t) for t in inputs]
        self.output_ids = [id(t) for t in outputs]

    def strip(self) -> "Program":
        """Keep only what describes each tensor (`trace.Released` stand-ins: shape, layout, dtype,
        local shape), none of their arrays, so a program kept for pricing holds no memory."""
        stub = {i: t if isinstance(t, Released) else Released(t) for i, t in self.tensors().items()}
        for rec in self.ops:
            rec.inputs = tuple(stub[id(t)] for t in rec.inputs)
            rec.outputs = tuple(stub[id(t)] for t in rec.outputs)
        self.inputs = [stub[i] for i in self.input_ids]
        self.outputs = [stub[i] for i in self.output_ids]
        self.constants = {id(stub[i]): stub[i] for i in self.constants}
        self.readers = {id(stub[i]): rec for i, rec in self.readers.items()}
        self.input_ids = [id(t) for t in self.inputs]
        self.output_ids = [id(t) for t in self.outputs]
        return self

    def tensors(self) -> dict:
        """`{id: tensor}` of every tensor the program names (inputs, constants, ops' inputs and outputs)."""
        out = {id(t): t for t in self.inputs + self.outputs}
        for rec in self.ops:
            out.update((id(t), t) for t in rec.inputs + rec.outputs)
        return out


@dataclass
class OpStep:
    """An engine step: run `op`'s kernel with `params` on the arrays in slots `ins`, into slots
    `outs`; then free the slots `frees`. `into`: `(output, input slot)` pairs the kernel may write
    that output over (`OpDef.into`, where this op is the input's last reader); `write`: `(buffer
    slot, offset, shape)` of a gradient bucket's buffer its one output is written into, or None."""

    op: OpDef
    params: dict
    ins: list
    outs: list
    frees: list = field(default_factory=list)
    flops: int = 0
    into: tuple = ()
    write: Any = None

    def reads(self) -> list:
        """The slots the step reads (its inputs, and the buffer it writes a part of)."""
        return self.ins if self.write is None else self.ins + [self.write[0]]

    def writes(self) -> list:
        """The slots the step fills."""
        return self.outs


@dataclass
class BucketStep:
    """A gradient bucket's step: `"make"` its flat buffer (into slot `bucket.flat`), `"start"` its
    one allreduce in place, or `"wait"` for it (its members' slots then hold their sums)."""

    kind: str
    bucket: Any

    def reads(self) -> list:
        return [] if self.kind == "make" else [*self.bucket.ins, self.bucket.flat]

    def writes(self) -> list:
        return [self.bucket.flat] if self.kind == "make" else self.bucket.outs if self.kind == "wait" else []


@dataclass
class AsyncStep:
    """A collective op run without blocking (`OpDef.start`): `"start"` its transfer from the slots
    `step.ins` (`begin`, the op's starter), `"wait"` for it: its output's slot then holds the result
    and `step.frees` are freed."""

    kind: str
    step: OpStep
    begin: Any = None

    def reads(self) -> list:
        return self.step.ins if self.kind == "start" else []

    def writes(self) -> list:
        return self.step.outs if self.kind == "wait" else []
