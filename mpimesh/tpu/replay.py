"""Replay a recorded op trace through JAX, on a `jax.sharding.Mesh` named like the mpimesh mesh.

Each op record's own `lower(ctx, *local_arrays)` runs with `ctx.xp = jax.numpy` and the
collectives of `tpu/collectives.py`, so no op is implemented twice. Mode `"shard_map"` runs the
per-device program inside `shard_map` with mpimesh's collectives; `"gspmd"` writes it as one
global program and lets XLA's SPMD partitioner place them. A trace recorded on a one-processor
mesh is the global program: `layout=` replays it on a JAX mesh of any shape. Uneven blocks are
padded to the largest. `replay` has an example; modes, padding and constants: docs/jax_replay.md."""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import numpy as np

from ..backend import is_float, matmul_precision, to_host
from ..errors import LayoutError, MeshError, MpimeshError, ShapeError
from ..extras import require
from ..layout import LayoutRules, block_sizes, local_sizes, plan_layout, splitting
from ..program import Program, ProgramError
from ..shape import Shape
from ..trace import Released, Trace
from .collectives import JaxCollectives, pad_blocks, unpad_blocks

MODES = ("shard_map", "gspmd")
"""The ways `replay` runs a trace (its `mode`): per-device kernels in `shard_map`, or one global program
whose collectives XLA's SPMD partitioner places (see the module docs)."""


class ReplayError(ProgramError):
    """A trace that cannot be replayed as asked: an op without a kernel, an input that is not
    one of the trace's inputs, an output the trace does not produce, or a kernel that fails
    under JAX."""


def _describe(t) -> str:
    return f"tensor {t.shape} ({t.dtype}, layout {t.layout or '{}'})"


def _uneven_axes(shape: Shape, layout: tuple, mesh_shape: Shape) -> tuple:
    """`(axis, mesh_dim, block sizes)` of each dim split into blocks of unequal length.

    >>> _uneven_axes(Shape("a:7;b:8"), ("x", "y"), Shape("x:4;y:2"))
    ((0, 'x', (2, 2, 2, 1)),)
    """
    out = []
    for axis, (d, m) in enumerate(zip(shape, layout)):
        sizes = block_sizes(d.size, mesh_shape[m].size) if splitting(m, mesh_shape) else ()
        if len(set(sizes)) > 1:
            out.append((axis, m, sizes))
    return tuple(out)


def _fill(dtype, which: str):
    """The lowest or highest value of `dtype` (-inf/inf for floats; False/True for bool)."""
    if np.dtype(dtype) == bool:
        return which == "highest"
    if is_float(dtype):  # bfloat16 too, whose numpy kind is 'V'
        return np.inf if which == "highest" else -np.inf
    info = np.iinfo(dtype)
    return info.max if which == "highest" else info.min


def _whole_here(t) -> bool:
    """This rank's slice of `t` is all of it (every split mesh dim has size 1)."""
    return all(m is None or t.mesh.shape[m].size == 1 for m in t.tensor_layout)


class _Plan:
    """What to replay: the program (`mpimesh.program.Program`: the needed op records in order,
    inputs, outputs) and its constants as host arrays, each the whole tensor."""

    def __init__(self, trace, inputs: Sequence, outputs: Sequence, processes: int = 1):
        program = Program(trace, inputs, outputs, ReplayError)
        self.mesh, self.ops = program.mesh, program.ops
        self.inputs, self.outputs, self.input_ids = program.inputs, program.outputs, program.input_ids
        self.tensors = program.tensors()
        self.constants: dict[int, np.ndarray] = {}
        for i, t in program.constants.items():
            if not _whole_here(t):
                rec = program.readers[i]
                by = f"op {rec!r}" if rec is not None else "the outputs"
                raise ReplayError(f"the trace reads a {_describe(t)} (by {by}) that is split over the mesh "
                                  f"and not among the replay inputs: list it in `inputs`")
            self.constants[i] = np.array(to_host(t.local), copy=True)
        self._padding(processes)

    def _padding(self, processes: int) -> None:
        """Each tensor's uneven axes (`uneven`) and padded local shape (`local_shapes`: coordinate
        0's block, the largest); ReplayError for an op that cannot run on padded blocks, and, on
        every rank alike, for uneven blocks replayed across `processes` > 1 JAX processes."""
        ms = self.mesh.shape
        tensors = self.tensors
        self.uneven = {i: _uneven_axes(t.shape, t.tensor_layout, ms) for i, t in tensors.items()}
        t = next((t for i, t in tensors.items() if self.uneven[i]), None)
        if t is not None and processes > 1:  # (decided from shapes and layouts: the same on every rank)
            raise ReplayError(f"the trace has a {_describe(t)} with {_blocks(t, self.uneven[id(t)][0])}: across "
                              f"{processes} JAX processes every rank builds the replay, but the kernels of uneven "
                              f"blocks are the largest block's (rank 0's); record the step on one rank "
                              f"(mm.Mesh('all:1', comm=MPI.COMM_SELF)) and replay it with layout=, which lays "
                              f"uneven dims out by itself, or split that dim evenly")
        self.local_shapes = {i: local_sizes(t.shape, ms, t.tensor_layout, dict.fromkeys(ms.names, 0))
                             for i, t in tensors.items()}
        for rec in self.ops:
            t = next((t for t in rec.inputs + rec.outputs if self.uneven[id(t)]), None)
            if t is not None and rec.op.fill is None:
                raise ReplayError(f"op {rec!r} has a {_describe(t)} with {_blocks(t, self.uneven[id(t)][0])}; the "
                                  f"JAX replay holds such blocks padded to the largest, and this op cannot run on "
                                  f"padded blocks yet: lay that dim out evenly (or not at all) in the trace")
        for i, t in tensors.items():
            if self.uneven[i] and not isinstance(t, Released) and tuple(t.local.shape) != self.local_shapes[i]:
                raise ReplayError(f"this rank holds a {_describe(t)} block of shape {tuple(t.local.shape)}, not "
                                  f"the largest, {self.local_shapes[i]}: the trace's kernels keep the recording "
                                  f"rank's block sizes, so build a replay of uneven blocks on rank 0")
        self.fills = {id(rec): rec.op.fill for rec in self.ops  # (what the op's kernel needs in the padding)
                      if rec.op.fill in ("lowest", "highest") and any(self.uneven[id(t)] for t in rec.inputs)}
        self.barriers = _barriers(self.ops)


def _barriers(ops: list) -> dict:
    """`{id(first op): ids of the tensors it reads from before it}` of each `mm.remat` block's second
    run (ops marked `rerun`): the replay passes those through `lax.optimization_barrier` (what
    `jax.checkpoint` does), or XLA would merge the second run with the first, which computes the
    same values, and keep the first's activations for the backward pass."""
    runs: dict[int, list] = {}
    for rec in ops:
        if rec.rerun is not None:
            runs.setdefault(id(rec.rerun), []).append(rec)
    barriers = {}
    for recs in runs.values():
        made = {id(t) for rec in recs for t in rec.outputs}
        barriers[id(recs[0])] = list(dict.fromkeys(id(t) for rec in recs for t in rec.inputs if id(t) not in made))
    return barriers


def _blocks(t, uneven: tuple) -> str:
    axis, m, sizes = uneven
    return (f"dim {t.shape[axis].name}:{t.shape[axis].size} split over mesh dim {m!r} of size {len(sizes)} "
            f"into blocks {sizes}")


def _padded(ctx: JaxCollectives, a, uneven: tuple, fill):
    """`a` with `fill` in the padding of each uneven axis."""
    for axis, m, sizes in uneven:
        a = ctx.fill_padding(a, axis, m, sizes, fill)
    return a


def _body(plan: _Plan, ctx: JaxCollectives):
    """The per-device program: every needed op's own kernel, in trace order."""
    from jax.lax import optimization_barrier

    def body(*arrays):
        xp = ctx.xp
        env: dict[int, Any] = {i: xp.asarray(c) for i, c in plan.constants.items()}
        env.update(zip(plan.input_ids, arrays))
        for rec in plan.ops:
            ids = plan.barriers.get(id(rec))
            if ids:  # a remat block's second run starts: see `_barriers`
                env.update(zip(ids, optimization_barrier(tuple(env[i] for i in ids))))
            args = [env[id(t)] for t in rec.inputs]
            if id(rec) in plan.fills:  # e.g. -inf where a max or softmax would see zeros
                args = [_padded(ctx, a, plan.uneven[id(t)], _fill(a.dtype, plan.fills[id(rec)]))
                        for a, t in zip(args, rec.inputs)]
            try:
                result = rec.op.kernel_for("jax")(ctx, *args, **rec.params)
            except MpimeshError:
                raise
            except Exception as e:
                raise ReplayError(f"replaying op {rec!r} under JAX failed: {type(e).__name__}: {e}") from e
            if len(rec.outputs) == 1:
                result = (result,)
            for t, r in zip(rec.outputs, result):
                r = xp.asarray(r)
                want = plan.local_shapes[id(t)]
                if tuple(r.shape) != want:
                    raise ReplayError(f"op {rec!r}: its kernel gave a local array of shape {tuple(r.shape)} "
                                      f"under JAX, expected {want}")
                r = r if r.dtype == t.dtype else r.astype(t.dtype)
                env[id(t)] = _padded(ctx, r, plan.uneven[id(t)], 0)  # padding is zero between ops
        return tuple(env[id(t)] for t in plan.outputs)
    return body


def _pad(xp, g, uneven: tuple):
    """Global array -> each uneven axis cut into its blocks, each padded to the largest."""
    for axis, _, sizes in uneven:
        g = pad_blocks(xp, g, axis, sizes)
    return g


def _unpad(xp, g, uneven: tuple):
    """Inverse of `_pad`."""
    for axis, _, sizes in uneven:
        g = unpad_blocks(xp, g, axis, sizes)
    return g


def _to_blocks(xp, g, layout: tuple, mesh_shape, uneven: tuple = ()):
    """Global array -> per-device blocks: axes (mesh dims..., local dims...); replicated along
    the mesh dims that split none of its dims; uneven blocks padded to the largest."""
    shape, mesh_axis = [], {}
    for size, m in zip(g.shape, layout):
        if m is None:
            shape.append(size)
        else:
            k = mesh_shape[m].size
            mesh_axis[m] = len(shape)
            shape += [k, max(block_sizes(size, k))]
    g = _pad(xp, g, uneven)
    missing = [m for m in mesh_shape.names if m not in mesh_axis]
    for j, m in enumerate(missing):
        mesh_axis[m] = len(shape) + j
    b = g.reshape(tuple(shape) + (1,) * len(missing))
    local = [a for a in range(len(shape)) if a not in mesh_axis.values()]
    b = xp.transpose(b, [mesh_axis[m] for m in mesh_shape.names] + local)
    return xp.broadcast_to(b, mesh_shape.sizes + b.shape[mesh_shape.rank:])


def _from_blocks(xp, b, layout: tuple, mesh_shape, global_shape: tuple, uneven: tuple = ()):
    """Inverse of `_to_blocks` (replicated copies: the first device's)."""
    used = [m for m in mesh_shape.names if m in layout]
    b = b[tuple(slice(None) if m in layout else 0 for m in mesh_shape.names)]
    perm = []
    for d, m in enumerate(layout):
        if m is not None:
            perm.append(used.index(m))
        perm.append(len(used) + d)
    b = xp.transpose(b, perm)  # (k, padded block) pairs for the split dims: merged
    padded = tuple(n if m is None else mesh_shape[m].size * max(block_sizes(n, mesh_shape[m].size))
                   for n, m in zip(global_shape, layout))
    return _unpad(xp, b.reshape(padded), uneven)


def _jax_mesh(mesh_shape, devices):
    """A `jax.sharding.Mesh` with the mpimesh mesh's axis names and sizes."""
    import jax
    if isinstance(devices, jax.sharding.Mesh):
        got = dict(devices.shape)
        if tuple(devices.axis_names) != mesh_shape.names or tuple(got[n] for n in devices.axis_names) != \
                mesh_shape.sizes:
            raise MeshError(f"the JAX mesh {got} does not match the trace's mesh {mesh_shape}")
        return devices
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) != mesh_shape.size:
        raise MeshError(f"the trace's mesh {mesh_shape} has {mesh_shape.size} processors, but {len(devs)} "
                        f"JAX devices were given (jax.devices() has {len(jax.devices())})")
    return jax.sharding.Mesh(np.array(devs, dtype=object).reshape(mesh_shape.sizes), mesh_shape.names)


def _x64():
    """A context in which JAX uses 64-bit types, as numpy does."""
    import jax
    state = getattr(jax, "enable_x64", None)
    if state is not None and callable(state):
        return state(True)
    from jax.experimental import enable_x64  # older JAX
    return enable_x64()


_JAX_PRECISIONS = {"highest": "float32", "tf32": "tensorfloat32"}  # mm.set_matmul_precision's, as JAX names them


def _matmul_precision():
    """A context in which JAX traces float32 dots at `mm.matmul_precision()`: precision HIGHEST
    ("float32") or HIGH ("tensorfloat32", TF32 on a GPU). It is part of jit's cache key: a changed
    setting traces again (a `compile()`d replay keeps the one it was compiled with)."""
    import jax
    return jax.default_matmul_precision(_JAX_PRECISIONS[matmul_precision()])


def _shard_map(fn, mesh, in_specs, out_specs):
    import jax
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map  # older JAX
    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


class Replay:
    """A trace replayed through JAX: call it with the global arrays of the inputs.

    Attributes:
      mesh: the `jax.sharding.Mesh`.
      mode: "shard_map" or "gspmd".
    """

    def __init__(self, plan: _Plan, mesh, mode: str, layout=None, donate: Sequence[int] = ()):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec
        self.mode, self.mesh = mode, mesh
        self._shapes = [(t.shape.sizes, t.dtype) for t in plan.inputs]
        jax_shape = Shape([(n, int(k)) for n, k in mesh.shape.items()])

        ms = plan.mesh.shape

        def spec(t) -> tuple:  # the trace's own layout, or the rules' on the jax mesh
            return t.tensor_layout if layout is None else _spec(t.shape, jax_shape, layout)
        in_specs = tuple(PartitionSpec(*spec(t)) for t in plan.inputs)
        out_specs = tuple(PartitionSpec(*spec(t)) for t in plan.outputs)
        # A jit's arguments and results are sharded only along dims their mesh dim divides.
        bound = jax_shape if layout is not None else ms
        self.in_shardings = tuple(NamedSharding(mesh, PartitionSpec(*_even(t.shape, s, bound)))
                                  for t, s in zip(plan.inputs, in_specs))
        """A `NamedSharding` per input, in order (a dim its mesh dim does not divide is replicated)."""
        self.out_shardings = tuple(NamedSharding(mesh, PartitionSpec(*_even(t.shape, s, bound)))
                                   for t, s in zip(plan.outputs, out_specs))
        """A `NamedSharding` per output, in order (a dim its mesh dim does not divide is replicated)."""
        self._compiled = None
        pads = [plan.uneven[id(t)] for t in plan.inputs], [plan.uneven[id(t)] for t in plan.outputs]
        if layout is not None:  # the global program; XLA partitions it by the shardings
            fn = _body(plan, JaxCollectives(ms))
            if [s.spec for s in self.in_shardings + self.out_shardings] != list(in_specs + out_specs):
                fn = _constrained(fn, mesh, in_specs, out_specs)  # XLA pads the dims that do not divide
        elif mode == "shard_map":
            per_device = _shard_map(_body(plan, JaxCollectives(ms)), mesh, in_specs, out_specs)

            def fn(*arrays):  # each uneven dim padded to k equal blocks around the per-device program
                xp = jax.numpy
                outs = per_device(*[_pad(xp, a, u) for a, u in zip(arrays, pads[0])])
                return tuple(_unpad(xp, b, u) for b, u in zip(outs, pads[1]))
        else:
            per_device = _body(plan, JaxCollectives(ms, vmapped=True))
            for name in reversed(ms.names):  # axis_size: a trace that makes its tensors has no inputs
                per_device = jax.vmap(per_device, axis_name=name, axis_size=ms[name].size)
            in_layouts = [t.tensor_layout for t in plan.inputs]
            outs = [(t.tensor_layout, t.shape.sizes) for t in plan.outputs]

            def fn(*arrays):
                xp = jax.numpy
                blocks = per_device(*[_to_blocks(xp, a, lay, ms, u)
                                      for a, lay, u in zip(arrays, in_layouts, pads[0])])
                return tuple(_from_blocks(xp, b, lay, ms, shape, u)
                             for b, (lay, shape), u in zip(blocks, outs, pads[1]))
        self.jitted = jax.jit(fn, in_shardings=self.in_shardings, out_shardings=self.out_shardings,
                              donate_argnums=tuple(donate))
        """The `jax.jit` function of the global input arrays (call it inside a 64-bit context, see the
        module docs; calling the replay does that)."""

    def _args(self, arrays: Sequence, start: int = 0) -> list:
        """`arrays` checked and cast as inputs `start`, `start + 1`, ... to the end."""
        if len(arrays) != len(self._shapes) - start:
            raise ShapeError(f"this replay takes {len(self._shapes) - start} input arrays"
                             + (f" from input {start} on" if start else "") + f", got {len(arrays)}")
        out = []
        for i, (a, (shape, dtype)) in enumerate(zip(arrays, self._shapes[start:]), start):
            if tuple(np.shape(a)) != shape:
                raise ShapeError(f"replay input {i} has shape {tuple(np.shape(a))}, the trace's tensor has {shape}")
            if getattr(a, "dtype", None) != dtype:
                a = a.astype(dtype) if hasattr(a, "astype") and not isinstance(a, np.ndarray) else \
                    np.asarray(a, dtype)
            out.append(a)
        return out

    def __call__(self, *arrays) -> tuple:
        """The global output arrays (JAX arrays, sharded as the outputs' layouts) for global inputs:
        host arrays (the same on every process), or JAX arrays sharded any way (an output of this or
        another replay fed back), each placed as its input is sharded first (`put`)."""
        args = self.put(arrays)
        with _x64(), _matmul_precision():
            return (self._compiled or self.jitted)(*args)

    def compile(self) -> "Replay":
        """Compile now, for the inputs' shapes, dtypes and shardings (else the first call does);
        `seconds` then holds `{"trace": ..., "compile": ...}`: tracing the kernels into a JAX
        program and lowering it, and XLA compiling it, or loading it from JAX's persistent cache
        (`from_cache` says which)."""
        import jax
        avals = [jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
                 for (shape, dtype), sh in zip(self._shapes, self.in_shardings)]
        hits = []

        def listen(event: str, **_) -> None:
            if event == "/jax/compilation_cache/cache_hits":
                hits.append(event)
        jax.monitoring.register_event_listener(listen)
        try:
            with _x64(), _matmul_precision():
                t0 = time.perf_counter()
                lowered = self.jitted.lower(*avals)
                t1 = time.perf_counter()
                self._compiled = lowered.compile()
        finally:
            jax.monitoring.unregister_event_listener(listen)
        self.seconds = {"trace": t1 - t0, "compile": time.perf_counter() - t1}
        self.from_cache = bool(hits)
        return self

    def put(self, arrays: Sequence, first: int = 0) -> list:
        """Global arrays of inputs `first`, `first + 1`, ... placed on the devices as those inputs
        are sharded (e.g. parameters kept on the devices between calls that donate them)."""
        import jax
        args = self._args(list(arrays), start=first)
        with _x64():
            return [jax.device_put(a, sh) for a, sh in zip(args, self.in_shardings[first:])]

    def lower(self, *arrays):
        """`jax.jit(...).lower(...)` for these inputs: `.compile().as_text()` is the optimised HLO."""
        args = self._args(arrays)
        with _x64(), _matmul_precision():
            return self.jitted.lower(*args)


def _even(shape: Shape, spec, mesh_shape: Shape) -> tuple:
    """`spec` without the mesh dims that do not divide their dim's size (replicated there).

    >>> _even(Shape("a:7;b:8"), ("x", "y"), Shape("x:4;y:2"))
    (None, 'y')
    """
    return tuple(m if m is None or d.size % mesh_shape[m].size == 0 else None for d, m in zip(shape, spec))


def _constrained(fn, mesh, in_specs, out_specs):
    """`fn` whose arguments and results are constrained to `in_specs`/`out_specs` inside the jit
    (where a dim need not divide: XLA pads it)."""
    import jax
    from jax.sharding import NamedSharding

    def put(arrays, specs):
        return [jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs)]

    def constrained(*arrays):
        return tuple(put(fn(*put(arrays, in_specs)), out_specs))
    return constrained


def _spec(shape: Shape, jax_shape: Shape, rules) -> tuple:
    """`shape`'s layout on a jax mesh of `jax_shape` by `rules` (a LayoutError if it cannot be had:
    never a silent replication)."""
    try:
        return plan_layout(shape, jax_shape, LayoutRules(rules))
    except LayoutError as e:
        raise LayoutError(f"replay(layout={str(LayoutRules(rules))!r}) cannot shard a tensor {shape} on the "
                          f"jax mesh {jax_shape}: {e}") from None


def _arguments(trace, inputs, outputs, devices, donate) -> None:
    """TypeError or ReplayError for arguments of the wrong kind, before anything is planned."""
    if not isinstance(trace, Trace):
        raise TypeError(f"replay: trace must be a trace (with mm.trace() as tr: ...), got a {type(trace).__name__}")
    for what, v in (("inputs", inputs), ("outputs", outputs), ("donate", donate)):
        if hasattr(v, "tensor_layout") or isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
            raise TypeError(f"replay: {what} must be a list, got a {type(v).__name__}")
    if isinstance(devices, (str, bytes)):
        raise TypeError(f"replay: devices must be JAX devices (jax.devices()) or a jax.sharding.Mesh, got {devices!r}")
    n = len(list(inputs))
    for d in donate:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 <= d < n:
            raise ReplayError(f"replay: donate names input positions 0..{n - 1}, got {d!r}")


def replay(trace, inputs: Sequence, outputs: Sequence, mode: str = "shard_map",
           devices: Optional[Any] = None, layout=None, donate: Sequence[int] = ()) -> Replay:
    """A jitted JAX function computing the global values of `outputs` (DistTensors of `trace`) from
    those of `inputs` (the DistTensors it reads). `mode`: "shard_map" or "gspmd"; `devices`: as many
    JAX devices as the mesh has processors, or a `jax.sharding.Mesh` of its axes; `layout`: rules for
    a one-processor trace, replayed on `devices`, a JAX mesh of any shape; `donate`: jax.jit's
    donate_argnums. MeshError for a wrong device count, ReplayError for an op it cannot replay.

    >>> import numpy as np, mpimesh as mm, jax
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> x = mesh.from_numpy(np.arange(3.0, dtype=np.float32), "a:3")
    >>> with mm.trace() as tr:
    ...     y = mm.reduce_sum(mm.exp(x) * 2.0)
    >>> (z,) = mm.tpu.replay(tr, [x], [y], devices=jax.devices()[:1])(np.arange(3.0, dtype=np.float32))
    >>> bool(np.isclose(z, y.to_numpy(), rtol=1e-6))
    True
    """
    require("jax", "tpu", "mm.tpu.replay")
    if mode not in MODES:
        raise MpimeshError(f"replay mode must be one of {MODES}, got {mode!r}")
    _arguments(trace, inputs, outputs, devices, donate)
    import jax
    plan = _Plan(trace, inputs, outputs, processes=jax.process_count() if layout is None else 1)
    if layout is None:
        return Replay(plan, _jax_mesh(plan.mesh.shape, devices), mode, donate=donate)
    if plan.mesh.shape.size != 1:
        raise ReplayError(f"replay with layout= needs a trace recorded on a one-processor mesh (the global "
                          f"program); this trace's mesh is {plan.mesh.shape}")
    if not isinstance(devices, jax.sharding.Mesh):
        raise ReplayError(f"replay with layout= needs devices=jax.sharding.Mesh(...) to lay the program out "
                          f"on, got {type(devices).__name__}")
    rules = LayoutRules(layout)
    unknown = sorted({m for _, m in rules.pairs} - set(devices.shape))
    if unknown:
        raise ReplayError(f"layout {str(rules)!r} names mesh dims {unknown} that the jax Mesh "
                          f"{dict(devices.shape)} lacks")
    return Replay(plan, devices, "gspmd", layout=rules, donate=donate)
