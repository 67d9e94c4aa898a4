"""`apps/transformer.py --backend jax`: one training step recorded by mpimesh, replayed by JAX.

One process, or one per rank under a launcher, joined by `jax.distributed`
(`mpimesh.tpu.distributed`), their devices one global `jax.sharding.Mesh` of the `--mesh` shape.
Every process records the step on a 1-rank mesh (the global program, checked to be the same
everywhere) and replays it with the `--layout` rules: XLA's SPMD partitioner places the
collectives. Each call feeds the step's outputs (parameters, optimizer state) back as its inputs;
the step's seed is an input too, so dropout and MoE draw `--backend mpi`'s numbers. Each process
builds only the batch rows its devices hold. More: docs/transformer.md."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

import mpimesh as mm
from mpimesh.tpu import distributed


MAX_LOCAL_DEVICES = 64  # host devices per process: with hundreds, XLA's CPU collectives stall


def jax_mesh(mesh_shape: str, comm=None):
    """The global jax Mesh of `mesh_shape` over every process's devices (`comm`'s ranks, one JAX
    process each, each with an equal share of the processors, 1 to MAX_LOCAL_DEVICES), and which
    dims span processes."""
    comm = comm or mm.MPI.COMM_WORLD
    ms = mm.Shape(mesh_shape)
    if min(ms.sizes, default=0) < 1:
        raise mm.MeshError(f"--mesh {mesh_shape!r}: every mesh dim needs a size of at least 1")
    if ms.size % comm.Get_size():
        raise mm.MeshError(f"--mesh {mesh_shape!r}: --backend jax: the mesh has {ms.size} processors, which "
                           f"{comm.Get_size()} processes cannot share equally")
    local = ms.size // comm.Get_size()
    if local > MAX_LOCAL_DEVICES:
        raise mm.MeshError(f"--mesh {mesh_shape!r}: --backend jax: {local} devices for each of {comm.Get_size()} "
                           f"process(es), at most {MAX_LOCAL_DEVICES} (run more processes, or a smaller mesh)")
    distributed.initialize(comm, local)
    mesh = distributed.global_mesh(ms)
    return mesh, distributed.spans(mesh)


def use_compile_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path` (every compiled program, however quick)."""
    import jax
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def flat_state(state: dict) -> list:
    """The optimizer state's tensors in a fixed order: the step, then each slot's by name."""
    return [state["step"]] + [state[k][n] for k in sorted(state) if k != "step" for n in sorted(state[k])]


def unflat_state(template: dict, tensors: Sequence) -> dict:
    """Inverse of `flat_state` (the structure taken from `template`)."""
    it = iter(tensors)
    out = {"step": next(it)}
    for k in sorted(template):
        if k != "step":
            out[k] = {n: next(it) for n in sorted(template[k])}
    return out


class JaxTrainStep:
    """The app's train step, recorded once on `params`' 1-rank mesh and replayed by JAX on `mesh`
    (a `jax.sharding.Mesh`, possibly over several processes).

    `step(rows, seed)`: `rows(start, stop)` gives the batch's inputs and targets `[stop - start,
    length]` (only the rows this process's devices hold are asked for), `seed` the step's seed; it
    returns the loss and keeps the new parameters and optimizer state on the devices. `state()`
    gives them back as DistTensors on the recording mesh (every process gets all of them),
    `load()` sets them. `seconds`: `{"trace", "compile"}` (XLA's compile is short when JAX's cache has it).
    """

    def __init__(self, train_step: Callable, params: dict, opt_state: dict, batch: dict, seed,
                 mesh, rules: str, comm=None):
        import jax
        self.rec_mesh = batch["inputs"].mesh
        if self.rec_mesh.shape.size != 1:
            raise mm.MeshError(f"--backend jax records on a 1-rank mesh, got {self.rec_mesh.shape}")
        self.names, self.template, self.mesh = list(params), opt_state, mesh
        with mm.trace() as tr:
            new_params, new_state, loss = train_step(params, opt_state, batch, seed)
        self.seeded = any(t is seed for t in tr.inputs)  # a step with no random op does not read it
        self.ins = [batch["inputs"], batch["targets"], *([seed] if self.seeded else []), *params.values(),
                    *flat_state(opt_state)]
        self.first = len(self.ins) - len(params) - len(flat_state(opt_state))  # the first parameter's input
        outs = [loss, *[new_params[n] for n in self.names], *flat_state(new_state)]
        distributed.check_same(comm or mm.MPI.COMM_WORLD, describe(tr))
        # the parameters and state are fed back each step: their buffers are reused
        self.replay = mm.tpu.replay(tr, self.ins, outs, devices=mesh, layout=rules,
                                    donate=range(self.first, len(self.ins))).compile()
        self.seconds, self.from_cache = self.replay.seconds, self.replay.from_cache
        self.multi = jax.process_count() > 1
        self.load(params, opt_state)

    def load(self, params: dict, opt_state: dict) -> None:
        """Put `params` and `opt_state` (DistTensors, the same on every process) on the devices."""
        host = [t.to_numpy() for t in [*[params[n] for n in self.names], *flat_state(opt_state)]]
        self.arrays = self.replay.put(host, first=self.first)

    def step(self, rows: Callable, seed: int):
        """One training step (see the class); the loss as a float."""
        import jax
        batch = []
        for k in range(2):
            shape = self.replay._shapes[k][0]
            sharding = self.replay.in_shardings[k]
            batch.append(jax.make_array_from_callback(
                shape, sharding, lambda index, k=k: rows(*_span(index[0], shape[0]))[k][(slice(None),) + index[1:]]))
        out = self.replay(*batch, *([np.array(seed, np.int64)] if self.seeded else []), *self.arrays)
        self.arrays = list(out[1:])
        return float(np.asarray(out[0].addressable_data(0)))

    def state(self) -> tuple:
        """`(params, opt_state)` as DistTensors on the recording mesh (a collective over the processes)."""
        from jax.experimental import multihost_utils
        mesh = self.rec_mesh
        host = [np.asarray(multihost_utils.process_allgather(a, tiled=True)) if self.multi else np.asarray(a)
                for a in self.arrays]
        tensors = [mesh.from_numpy(a, t.shape) for a, t in zip(host, self.ins[self.first:])]
        params = dict(zip(self.names, tensors[:len(self.names)]))
        return params, unflat_state(self.template, tensors[len(self.names):])


def _span(index: slice, n: int) -> tuple:
    start, stop, _ = index.indices(n)
    return start, stop


def describe(trace) -> str:
    """The recording, op by op (name, input and output shapes and layouts), to compare across processes."""
    return "\n".join(f"{op.name} {[(str(t.shape), t.tensor_layout, str(t.dtype)) for t in op.inputs]} -> "
                     f"{[(str(t.shape), t.tensor_layout, str(t.dtype)) for t in op.outputs]}" for op in trace.ops)
