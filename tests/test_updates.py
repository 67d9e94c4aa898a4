"""The multi-tensor optimizer updates (`mpimesh.ops.updates`): one op for all parameters of a dtype,
bitwise equal to the unfused composition (the same optimizer updating op by op), in float64 and
float32, with bfloat16 parameters updated in float32, a scheduled learning rate, parameters split
unevenly over 1-D/2-D/3-D meshes, over several steps; and the trace holds one update op."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import get_mesh, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402

# sizes that 2, 3, 4 and 8 ranks split unevenly (and r:2 leaves empty blocks on 3 ranks and more)
SHAPES = {"w": "io:10;hidden:14", "b": "hidden:14", "u": "p:5;q:7;r:2", "s": "io:10"}


def unfused(optimizer):
    """The same optimizer, updating op by op (its `_apply`), as before the fused op."""
    copy = object.__new__(type(optimizer))
    copy.__dict__.update(optimizer.__dict__)
    copy._update_all = None
    return copy


def params_and_grads(mesh, dtype, seed):
    big = [d.name for d in mesh.shape if d.size > 1]
    rules = {"io": big[0], "hidden": big[-1], "p": big[0]} if big else {}
    rng = np.random.default_rng(seed)
    params, grads = {}, {}
    for name, shape in SHAPES.items():
        s = mm.Shape(shape)
        layout = {d: m for d, m in rules.items() if d in s.names}
        if len(set(layout.values())) < len(layout):
            layout = dict(list(layout.items())[:1])
        params[name] = mm.cast(mesh.from_numpy(rng.standard_normal(s.sizes), s, layout=layout), dtype)
        grads[name] = mm.cast(mesh.from_numpy(rng.standard_normal(s.sizes), s, layout=layout),
                              "float32" if dtype == "bfloat16" else dtype)
    return params, grads


OPTIMIZERS = {
    "sgd": lambda: mm.optim.SGD(0.1),
    "sgd momentum": lambda: mm.optim.SGD(0.05, momentum=0.9),
    "sgd scheduled": lambda: mm.optim.SGD(lambda t: 0.1 * mm.minimum(t / 3.0, 1.0), momentum=0.5),
    "adam": lambda: mm.optim.Adam(1e-2),
    "adamw": lambda: mm.optim.Adam(1e-2, beta1=0.8, beta2=0.99, epsilon=1e-6, weight_decay=0.1),
    "adam scheduled": lambda: mm.optim.Adam(lambda t: 3e-3 * mm.minimum(t / 2.0, 1.0)),
}


def both_ways(mesh, which: str, dtype: str, steps: int = 3):
    """Optimizer `which` over SHAPES' parameters, fused and op by op from the same start, for
    `steps` steps: yields `(step, slot names, (params, state) fused, (params, state) op by op, the
    fused step's trace)`."""
    fused = OPTIMIZERS[which]()
    plain = unfused(fused)
    p1, _ = params_and_grads(mesh, dtype, 0)
    p2 = dict(p1)
    s1, s2 = fused.init(p1), plain.init(p2)
    for step in range(steps):
        _, grads = params_and_grads(mesh, dtype, step + 1)
        with mm.trace() as tr:
            p1, s1 = fused.update(p1, grads, s1)
        p2, s2 = plain.update(p2, grads, s2)
        yield step, fused.slot_names, (p1, s1), (p2, s2), tr


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_fused_update_equals_the_unfused_composition(shape, dtype, which):
    mesh = get_mesh(shape)
    for step, slot_names, (p1, s1), (p2, s2), tr in both_ways(mesh, which, dtype):
        assert sum(op.name.endswith("_update") for op in tr.ops) == 1  # one op for every parameter
        for name in SHAPES:
            a, b = p1[name], p2[name]
            assert a.dtype == b.dtype and a.tensor_layout == b.tensor_layout
            assert a.local.tobytes() == b.local.tobytes(), (which, dtype, name, step)
            for slot in slot_names:
                x, y = s1[slot][name], s2[slot][name]
                assert x.dtype == y.dtype and x.tensor_layout == y.tensor_layout
                assert x.local.tobytes() == y.local.tobytes(), (which, dtype, name, slot, step)
    assert int(s1["step"].to_numpy()) == int(s2["step"].to_numpy()) == 3


def test_ops_per_update():
    """An Adam step over 40 parameters: one update op (and the step's cast), not ~15 per parameter."""
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    params = {f"w{i}": mesh.ones(f"a{i}:3;b:2") for i in range(40)}
    grads = {k: v * 0.5 for k, v in params.items()}
    opt = mm.optim.Adam(1e-3)
    state = opt.init(params)
    with mm.trace() as fused_tr:
        opt.update(params, grads, state)
    with mm.trace() as plain_tr:
        unfused(opt).update(params, grads, state)
    assert [op.name for op in fused_tr.ops].count("adam_update") == 1
    assert len(fused_tr.ops) <= 4 and len(plain_tr.ops) >= 40 * 10
