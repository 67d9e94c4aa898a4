"""`calibrate(mesh)`: measure this mesh's `Machine` (see its docstring), in a few seconds.

>>> import mpimesh as mm
>>> m = calibrate(mm.Mesh("all:1", comm=mm.MPI.COMM_SELF), seconds=0.3)
>>> m.flops > 0 and m.op_overhead >= 0
True
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from .. import counters, threads
from ..autodiff import gradients
from ..backend import as_dtype, free_memory, is_float, synchronize, to_host
from ..errors import MpimeshError
from ..ops.einsum import einsum
from ..ops.elementwise import relu, square, subtract, tanh
from ..ops.reduce import reduce_sum
from ..trace import trace
from .machine import Machine
from .model import estimate, record


def _median(fn, reps: int, sync=lambda: None) -> float:
    """The median seconds of `reps` calls of `fn`, after a warm-up call (the median, not the least:
    on a node with more ranks than cores, a step runs at the shared rate, and so should this)."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def calibrate(mesh, seconds: float = 3.0, rounds: int = 3, dtype="float32") -> Machine:
    """Measure this mesh's `Machine` in a few seconds; a collective: every rank returns the same one.

    Each rank times, on replicated tensors of `dtype`, an einsum's FLOP/s and fixed cost, the fixed
    cost of other ops, memory bandwidth, and per mesh dim of size > 1 an allreduce's latency (α) and
    bandwidth (β); the ranks agree on the slowest figures, fitted so that a measured MLP step's time
    is matched (its time beyond the parts' price is a cost per op; a step priced slower than it ran
    scales the compute rates up, at most 2x). `rounds` timed passes follow an untimed one; `seconds`
    bounds the whole, roughly. A busy node is said in the machine's `name`. The collectives made here
    are not counted by an open `mm.profile`. What each figure is measured on: docs/cost_model.md."""
    if not hasattr(mesh, "collectives") or getattr(mesh, "dry", False) or not hasattr(mesh, "comm_for"):
        raise MpimeshError(f"calibrate needs a Mesh with processors, got {mesh!r} (give a Machine by hand instead)")
    reps = max(3, int(seconds * 5 / max(1, rounds)))  # about seconds / 3 in all on one core
    dtype = as_dtype(dtype)
    if not is_float(dtype):
        raise MpimeshError(f"calibrate: dtype must be a float dtype (the one the priced steps compute in), got {dtype}")
    with counters.paused():
        probe = _Probe(mesh, dtype)
        probe.measure(1)  # the warm-up pass
        busy = [_others_running(mesh)]
        passes = []
        for _ in range(max(1, rounds)):
            passes.append(probe.measure(reps))
            busy.append(_others_running(mesh))
        values = np.median(np.asarray(passes), axis=0)
        memory = _free_memory(mesh)
    t_big, t_mem, t_op, t_einsum, t_ref = values[:5]
    flops = 2 * math.prod(probe.big) / max(t_big - t_einsum, 1e-9)
    mem_bw = 2 * probe.x.shape.size * probe.x.dtype.itemsize / t_mem
    links = []
    for i, d in enumerate(probe.dims):
        alpha, t_large = max(values[5 + 2 * i], 1e-7), values[6 + 2 * i]
        k = mesh.shape[d].size
        moved = 2 * (k - 1) / k * 4 * (1 << 20)
        links.append((d, alpha, moved / max(t_large - alpha, 0.5 * t_large, 1e-9)))  # (see the docstring)
    latency = max((a for _, a, _ in links), default=1e-6)
    bandwidth = min((b for _, _, b in links), default=1e12)
    parts = Machine(flops=flops, latency=latency, bandwidth=bandwidth, memory=memory, memory_bandwidth=mem_bw,
                    op_overhead=t_op, einsum_overhead=t_einsum, links=tuple(links))
    ref, ref_args = probe.ref
    rec = record(ref, ref_args, mesh.shape, "")
    priced = estimate(rec, None, None, parts)["seconds"]
    if t_ref >= priced:  # what the parts miss of a traced step is the framework's work between its ops: per op
        extra = (t_ref - priced) / len(rec.ops)
        fitted = replace(parts, op_overhead=t_op + extra, einsum_overhead=t_einsum + extra)
        how = f"+{extra * 1e6:.0f} µs per op"
    else:  # priced slower than it ran: the compute rates, scaled up to match (at most 2x)
        scale = max(0.5, t_ref / priced)
        fitted = replace(parts, flops=flops / scale, memory_bandwidth=mem_bw / scale, op_overhead=t_op * scale,
                         einsum_overhead=t_einsum * scale)
        how = f"compute x{scale:.2f}"
    others = float(np.median(busy))
    load = f"; the node was busy: {others:.1f} other processes running" if others >= 1 else ""
    return replace(fitted, name=f"this machine, calibrated on mesh {mesh.shape} ({mesh.backend}, {dtype}, median of "
                                f"{len(passes)} rounds; {how} from a reference step{load})")


class _Probe:
    """The tensors and timings of one calibration (see `calibrate`); `measure(reps)` is one pass."""

    def __init__(self, mesh, dtype=np.float32):
        xp = mesh.xp

        def ones(shape: str):  # (2**-6: float16's sums of products stay finite)
            return mesh.full(shape, 2.0 ** -6, dtype=dtype, layout="")
        self.mesh, self.sync = mesh, lambda: synchronize(xp)
        self.big = (2048, 256, 256)  # a dense layer's matmul: [batch, d_in] x [d_in, d_out]
        self.a = ones(f"calib_a:{self.big[0]};calib_b:{self.big[1]}")
        self.b = ones(f"calib_b:{self.big[1]};calib_c:{self.big[2]}")
        self.x = ones(f"calib_x:{(16 << 20) // np.dtype(dtype).itemsize}")  # 16 MiB (emulated dtypes: slower)
        self.u, self.v = ones("calib_a:2;calib_b:3"), ones("calib_b:3;calib_c:2")
        self.ref = _reference_step(ones)
        self.dims = [d.name for d in mesh.shape if d.size > 1]
        self.p = ones("calib_a:512;calib_b:256")
        self.q = ones("calib_b:256;calib_c:256")
        self.one, self.many = xp.ones(1, np.float32), xp.ones(1 << 20, np.float32)

    def measure(self, reps: int) -> np.ndarray:
        """One pass: [t_big, t_mem, t_op, t_einsum, t_ref, (α time, β time) per mesh dim], the slowest
        rank's each."""
        mesh, sync, xp = self.mesh, self.sync, self.mesh.xp
        t_big = _median(lambda: einsum([self.a, self.b]), reps, sync)
        t_mem = _median(lambda: self.x * 1.5, reps, sync)
        t_einsum = _median(lambda: einsum([self.u, self.v]), 20 * reps)
        t_op = _tiny_step_overhead(self.u, self.v, t_einsum, 5 * reps)
        ref, ref_args = self.ref
        t_ref = _median(lambda: ref(*ref_args), reps, sync)
        values = [t_big, t_mem, t_op, t_einsum, t_ref]
        for d in self.dims:  # α: an allreduce after a burst of compute (ranks arrive as in a step), less the burst
            burst = _median(lambda: einsum([self.p, self.q]), 2 * reps, sync)
            values.append(max(0.0, _median(lambda: (einsum([self.p, self.q]),
                                                    mesh.collectives.allreduce(self.one, [d])), 2 * reps, sync) - burst))
            values.append(_median(lambda: mesh.collectives.allreduce(self.many, [d]), reps))
        values = np.asarray(values, np.float64)
        if mesh.size > 1:  # the slowest rank's figures, the same on every rank
            values = np.asarray(to_host(mesh.collectives.allreduce(xp.asarray(values), list(mesh.shape.names), "max")))
        return values


def _others_running(mesh) -> float:
    """Processes running on this node now besides the mesh's ranks on it (`procs_running` of
    /proc/stat, which counts this rank too), the most over the mesh's ranks; 0 where /proc is missing."""
    try:
        with open("/proc/stat") as f:
            running = next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
    except (OSError, StopIteration, ValueError):
        running = 0
    others = max(0.0, running - (threads.settings()["local_ranks"] or 1)) if running else 0.0
    if mesh.size > 1:
        others = float(to_host(mesh.collectives.allreduce(np.array([others]), list(mesh.shape.names), "max"))[0])
    return others


def _reference_step(ones):
    """A replicated two-layer MLP training step of mid-size tensors (made by `ones(shape)`): `(step, args)`."""

    def step(x, w1, w2):
        with trace():
            y = einsum([relu(einsum([x, w1])), w2])
            g1, g2 = gradients([reduce_sum(square(y - x))], [w1, w2])
            return subtract(w1, g1 * 0.01), subtract(w2, g2 * 0.01)
    return step, (ones("calib_a:512;calib_b:256"), ones("calib_b:256;calib_c:512"), ones("calib_c:512;calib_b:256"))


def _tiny_step_overhead(x, w, t_einsum: float, reps: int) -> float:
    """Seconds per op other than einsum of a tiny training step (forward, `mm.gradients`, update):
    the fixed cost of an op in a step, autodiff's bookkeeping and the trace included."""

    def step():
        with trace() as tr:
            y = tanh(einsum([x, w]))
            loss = reduce_sum(y * y)
            (g,) = gradients([loss], [w])
            subtract(w, g * 0.1)
        return tr
    ops = step().ops
    n_einsum = sum(op.op.gemm for op in ops)
    return max(0.0, (_median(step, reps) - n_einsum * t_einsum) / max(1, len(ops) - n_einsum))


def _free_memory(mesh) -> float:
    """Bytes each rank may use: the GPU's free memory, else the host's available memory over the
    ranks of this node (`MemAvailable`; 16 GiB where /proc is missing). The minimum over ranks."""
    free = free_memory(mesh.xp)
    if free is None:
        try:
            with open("/proc/meminfo") as f:
                avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
        except (OSError, StopIteration):
            avail = 16 * 2**30
        node = mesh.comm_for(mesh.shape.names).Split_type(MPI.COMM_TYPE_SHARED) if mesh.size > 1 else None
        free = avail / (node.Get_size() if node is not None else 1)
        if node is not None:
            node.Free()
    comm = mesh.comm_for(mesh.shape.names)
    return float(comm.allreduce(free, op=MPI.MIN))
