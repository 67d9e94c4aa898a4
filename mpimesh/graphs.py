"""CUDA graphs for a compiled step on CuPy: `GraphEngine` captures the kernels between two host steps
(collectives, bucket allreduces, libraries that refuse capture) once, then launches each as one graph.

Values are eager's, bitwise. On numpy, or with `MPIMESH_CUDA_GRAPHS=0`, `for_engine` keeps the flat
engine. While captured, a kernel sees a `_Probe`: a transfer says it is a host step. More: docs/compile.md.

>>> import types
>>> probe = _Probe(types.SimpleNamespace(coord=lambda mesh_dim: 0))
>>> try:
...     print(probe.coord("rows")); probe.allreduce
... except _NeedsHost as e:
...     print("a host step:", e)
0
a host step: allreduce
"""
from __future__ import annotations

from . import env
from .backend import on_gpu
from . import counters, flight
from . import liveness
from .program import BucketStep, OpStep

_TRANSFERS = frozenset({"allreduce", "iallreduce", "allgather", "alltoall", "reduce_scatter", "permute",
                        "exscan", "any_rank", "guard"})


_CAPTURE_ERRORS = frozenset({"CUDARuntimeError", "CUDADriverError", "CUBLASError", "CublasCallError"})


class _NeedsHost(Exception):
    """A kernel asked for a collective while its op was being captured."""


class _Probe:
    """The collectives a kernel is handed while its op is captured: the local helpers (`coord`,
    `span`, `block`, ...) are the mesh's, a transfer raises `_NeedsHost`."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name: str):
        if name in _TRANSFERS:
            raise _NeedsHost(name)
        return getattr(self._inner, name)


class CudaCapture:
    """Stream capture on CuPy: a stream of the step's own and a private memory pool."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.stream = cupy.cuda.Stream()  # blocking: ordered with the legacy default stream's work
        self.pool = cupy.cuda.MemoryPool()

    def scope(self):
        """The block in which the step's work is issued (the stream made current)."""
        return self.stream

    def static(self, a):
        """A buffer like `a`, from the private pool, holding a copy of it."""
        with self.cupy.cuda.using_allocator(self.pool.malloc):
            return a.copy()

    def copy(self, dst, src) -> None:
        self.cupy.copyto(dst, src)

    def capture(self, body, env: list, writes: list):
        """`body()`'s work as a graph, its allocations from the private pool (`env` and `writes`:
        the slots it binds and those read after it, for an engine that must emulate capture)."""
        with self.cupy.cuda.using_allocator(self.pool.malloc):
            self.stream.begin_capture()
            try:
                body()
            except BaseException:
                try:
                    self.stream.end_capture()
                except Exception:  # an invalidated capture also says so when it ends
                    pass
                raise
            return self.stream.end_capture()

    def launch(self, graph) -> None:
        graph.launch(stream=self.stream)

    def failed(self, error: BaseException) -> bool:
        """Whether `error`, raised while capturing, means the step must run on the host: it asked for
        a collective, synced with the host (a CUDA error), or called a library that refuses capture
        (CuPy's own cuBLAS routines: NotImplementedError)."""
        return isinstance(error, (_NeedsHost, NotImplementedError)) or type(error).__name__ in _CAPTURE_ERRORS


def for_engine(engine):
    """The engine to run a compiled step with: `GraphEngine` over it on CuPy (unless
    `MPIMESH_CUDA_GRAPHS=0`, or this CuPy has no graph capture), else `engine` itself."""
    if not on_gpu(engine.mesh.xp) or not env.flag("MPIMESH_CUDA_GRAPHS", True):
        return engine
    cupy = engine.mesh.xp
    if not hasattr(cupy.cuda, "Graph") or not hasattr(cupy.cuda.Stream, "begin_capture"):
        return engine
    return GraphEngine(engine, CudaCapture(cupy))


class GraphEngine:
    """A flat engine's steps as graph segments and host steps (see the module). `segments` and
    `host_steps` count them once captured; `plan` lists them in order, `("graph", ...)` and
    `("host", step, why)`; `cap` is the capturer (`CudaCapture`)."""

    def __init__(self, engine, capture):
        self.engine, self.cap = engine, capture
        self.mesh = engine.mesh
        self.runs = 0
        self.plan: list = []
        self.held: dict = {}  # slot -> the array a graph writes, kept for the graphs' life
        self.segments = self.host_steps = 0
        self.last_read = liveness.last_uses(step.reads() for step in engine.steps)  # slot -> its last reader

    def run(self, arrays: list) -> list:
        self.runs += 1
        if self.runs == 1:  # warm-up on the capture stream
            with self.cap.scope():
                return self._copied_out(self.engine.run(arrays))
        if self.runs == 2:
            return self._capture(arrays)
        return self._replay(arrays)

    def _copied_out(self, outs: list) -> list:
        """The step's results, those in (or viewing) a buffer the graphs write copied: the next
        replay must not overwrite them (a gradient is a view of its bucket's buffer)."""
        held = {id(a) for a in self.held.values()}
        return [a.copy() if id(a) in held or id(getattr(a, "base", None)) in held else a for a in outs]

    def _capture(self, arrays: list) -> list:
        engine, cap = self.engine, self.cap
        env = engine.start_env(arrays)
        arrays.clear()  # (as the flat engine's run: a donated block's only reference is its slot's)
        steps, flying, probe = engine.steps, {}, _Probe(self.mesh.collectives)
        constant = {s for s, _ in engine.constants}
        graph_made: set = set()
        with cap.scope():
            i = 0
            while i < len(steps):
                j = i
                while j < len(steps) and _device_step(steps[j]):
                    j += 1  # bucket steps run on the host
                end, why = self._capture_from(i, j, env, graph_made, constant, probe) if j > i else (i, "bucket")
                if end == i:  # its first step cannot be captured: the host runs it
                    engine.run_steps([steps[i]], env, flying)
                    self.plan.append(("host", steps[i], why))
                    self.host_steps += 1
                    end = i + 1
                i = end
        return self._copied_out([env[s] for s in engine.outputs])

    def _capture_from(self, i: int, j: int, env: list, graph_made: set, constant: set, probe) -> tuple:
        """Capture steps i..j-1, or the longest run of them from i that captures; launch it and
        return where it ended (i: not even step i captures) and why the step there could not be."""
        why = None
        engine, cap = self.engine, self.cap
        while j > i:
            ops = engine.steps[i:j]
            made = {s for step in ops for s in step.writes()}
            reads = sorted({s for step in ops for s in step.reads()} - made)
            copies = [(s, env[s]) for s in reads if s not in graph_made and s not in constant]
            statics = [(s, cap.static(a)) for s, a in copies]
            saved = list(env)
            for s, buf in statics:
                env[s] = buf
            later = self._read_after(j)
            writes = [s for s in sorted(made) if s in later]
            done = [0]

            def body():
                for step in ops:
                    engine.run_steps([step], env, {}, probe, count=False)
                    done[0] += 1
            try:
                graph = cap.capture(body, env, writes)
            except Exception as e:
                if not cap.failed(e):
                    raise
                env[:] = saved
                j, why = i + done[0], f"{type(e).__name__}: {e}"  # the steps before the one that failed
                continue
            cap.launch(graph)
            held = [(s, env[s]) for s in writes]
            self.held.update(held)
            graph_made.update(s for s, _ in held)
            frees = [s for step in ops if type(step) is OpStep for s in step.frees]
            flops = sum(step.flops for step in ops if type(step) is OpStep)
            if flops and counters._open:
                counters.record_flops(flops)
            self.plan.append(("graph", graph, statics, held, frees, flops))
            self.segments += 1
            return j, why
        return i, why

    def _read_after(self, j: int) -> set:
        """Slots read by the steps from j on, or returned."""
        return liveness.used_from(self.last_read, j) | set(self.engine.outputs)

    def _replay(self, arrays: list) -> list:
        engine, cap = self.engine, self.cap
        env = engine.start_env(arrays)
        arrays.clear()  # (a donated block goes after its static copy, or its last reader on the host)
        flying: dict = {}
        with cap.scope():
            for entry in self.plan:
                if entry[0] == "host":
                    engine.run_steps([entry[1]], env, flying)
                    continue
                _, graph, statics, held, frees, flops = entry
                t0 = flight.clock()
                for s, buf in statics:
                    cap.copy(buf, env[s])
                if flight.timeline and statics:  # (spans of the host's side: the GPU runs copies and graph later)
                    flight.span(t0, "copy into the graph's inputs", "copy", {"arrays": len(statics)})
                t1 = flight.clock()
                cap.launch(graph)
                if flight.timeline:
                    flight.span(t1, "CUDA graph launch", "graph", {"flops": flops})
                for s in frees:
                    env[s] = None
                for s, a in held:
                    env[s] = a
                if flops and counters._open:
                    counters.record_flops(flops)
                for request in flying.values():
                    request.test()
        return self._copied_out([env[s] for s in engine.outputs])


def _device_step(step) -> bool:
    """Whether a step runs on the device (an op's kernel, a bucket's buffer made), so a graph may
    capture it; a bucket's allreduce, an overlapped collective (`AsyncStep`) and their waits run on the host."""
    return type(step) is OpStep or type(step) is BucketStep and step.kind == "make"
