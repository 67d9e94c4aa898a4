"""`apps/transformer.py --backend jax`: one training step recorded by mpimesh, replayed by JAX.

The app runs as ONE process. An MPI mesh of the `--mesh` shape would need as many ranks, so the
step is recorded on a 1-rank mesh (`all:1`, COMM_SELF): its trace is then the global program
(every collective of a size-1 mesh dim is a no-op, every coordinate 0). `mm.tpu.replay`'s
shard_map mode maps a trace onto a JAX mesh of the trace's own mesh shape (here one device), so
instead this module replays that global program with `layout=` the `--layout` rules on a
`jax.sharding.Mesh` with the `--mesh` dim names and sizes: XLA's SPMD partitioner places the
collectives. The kernels are the ops' own `lower` functions, run with `jax.numpy`.

Each call feeds the step's outputs (new parameters and optimizer state) back as its inputs. The
MoE layers' random second-expert draws are those of the recorded step (its seed is baked in).
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np

import mpimesh as mm


def jax_devices(n: int) -> list:
    """`n` JAX devices; on CPU asks XLA for `n` host devices (XLA_FLAGS, before jax is imported)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    import jax
    devs = jax.devices()
    if len(devs) < n:
        raise mm.MeshError(f"--backend jax: the mesh has {n} processors but JAX has {len(devs)} devices "
                           f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
    return devs[:n]


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
    """The app's train step, recorded once on `params`' 1-rank mesh and replayed by JAX.

    Call `step(inputs, targets)` with the global byte arrays `[batch, length]`; it returns the
    loss (a JAX scalar) and keeps the new parameters and optimizer state on the JAX devices.
    `state()` gives them back as DistTensors on the recording mesh (`from_numpy`), `load()` sets them.
    """

    def __init__(self, train_step: Callable, params: dict, opt_state: dict, batch: dict, mesh_shape: str,
                 rules: str, devices=None, seed: int = 0):
        import jax
        from jax.sharding import Mesh
        self.rec_mesh = batch["inputs"].mesh
        if self.rec_mesh.shape.size != 1:
            raise mm.MeshError(f"--backend jax records on a 1-rank mesh, got {self.rec_mesh.shape}")
        self.names, self.template = list(params), opt_state
        with mm.trace() as tr:
            new_params, new_state, loss = train_step(params, opt_state, batch, seed)
        self.ins = [batch["inputs"], batch["targets"], *params.values(), *flat_state(opt_state)]
        outs = [loss, *[new_params[n] for n in self.names], *flat_state(new_state)]
        ms = mm.Shape(mesh_shape)
        devs = jax.devices()[:ms.size] if devices is None else list(devices)
        self.mesh = Mesh(np.array(devs, dtype=object).reshape(ms.sizes), ms.names)
        # the parameters and state (inputs 2...) are fed back each step: their buffers are reused
        self.replay = mm.tpu.replay(tr, self.ins, outs, devices=self.mesh, layout=rules,
                                    donate=range(2, len(self.ins))).compile()
        self.load(params, opt_state)

    def load(self, params: dict, opt_state: dict) -> None:
        """Put `params` and `opt_state` (DistTensors) on the JAX devices, sharded by the rules."""
        host = [t.to_numpy() for t in [*[params[n] for n in self.names], *flat_state(opt_state)]]
        self.arrays = self.replay.put(host, first=2)

    def step(self, inputs: np.ndarray, targets: np.ndarray):
        """One training step on the global `[batch, length]` arrays: the loss (a JAX scalar)."""
        out = self.replay(inputs, targets, *self.arrays)
        self.arrays = list(out[1:])
        return out[0]

    def state(self) -> tuple:
        """`(params, opt_state)` as DistTensors on the recording mesh."""
        mesh = self.rec_mesh
        tensors = [mesh.from_numpy(np.asarray(a), t.shape) for a, t in zip(self.arrays, self.ins[2:])]
        params = dict(zip(self.names, tensors[:len(self.names)]))
        return params, unflat_state(self.template, tensors[len(self.names):])
