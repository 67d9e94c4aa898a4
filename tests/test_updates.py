"""The multi-tensor optimizer updates (`mpimesh.ops.updates`, `mpimesh.ops.adafactor`): one op for
all parameters of a dtype, equal to the unfused composition (the same optimizer updating op by op):
bitwise for SGD and Adam, to rounding for Adafactor (its sums are `xp.sum`s, not einsums), in
float64 and float32, with bfloat16 parameters updated in float32, a scheduled learning rate,
parameters split unevenly over 1-D/2-D/3-D meshes, over several steps; and the trace holds one
update op. SGD and Adam run one formula both ways (`sgd_step`, `adam_step`) in other operations (numpy
in place and in chunks, mpimesh ops): the formulas are checked against numpy references written from
the papers in test_optim.py, and against the CUDA sources, bitwise, in test_cuda_sources.py."""
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
ADAFACTORS = {  # w, u factored (min_dim_size_to_factor 4), b and s not
    "adafactor": lambda: mm.optim.Adafactor(min_dim_size_to_factor=4),
    "adafactor beta1": lambda: mm.optim.Adafactor(min_dim_size_to_factor=4, beta1=0.5, clipping_threshold=0.5),
    "adafactor plain": lambda: mm.optim.Adafactor(learning_rate=0.05, decay_rate=0.9, clipping_threshold=None,
                                                  multiply_by_parameter_scale=False, min_dim_size_to_factor=4),
    "adafactor unfactored": lambda: mm.optim.Adafactor(factored=False, beta1=0.9),
}


def both_ways(mesh, which: str, dtype: str, steps: int = 3):
    """Optimizer `which` over SHAPES' parameters, fused and op by op from the same start, for
    `steps` steps: yields `(step, slot names, (params, state) fused, (params, state) op by op, the
    fused step's trace)`."""
    fused = {**OPTIMIZERS, **ADAFACTORS}[which]()
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


TOLERANCES = {"float64": 1e-12, "float32": 2e-5, "bfloat16": 2e-5}  # Adafactor's; bfloat16: its float32 slots


def _agree(which: str, dtype: str, a, b, what) -> None:
    """SGD and Adam: bitwise. Adafactor: to rounding (judged against the tensor's largest value too:
    m holds differences); a bfloat16 parameter to one ulp (the same float32 value rounded)."""
    assert a.dtype == b.dtype and a.tensor_layout == b.tensor_layout, what
    if which in OPTIMIZERS and a.mesh.backend == "numpy":
        assert a.local.tobytes() == b.local.tobytes(), what
        return
    if which in OPTIMIZERS:  # a GPU: the fused kernel's multiply-adds may contract (FMA), the last bit apart
        ulp = {"float64": 2.2e-16, "float32": 1.2e-7, "bfloat16": 7.8e-3}[str(a.dtype)]
        np.testing.assert_allclose(a.to_numpy().astype(np.float64), b.to_numpy().astype(np.float64), rtol=4 * ulp,
                                   err_msg=what)
        return
    x, y = a.to_numpy().astype(np.float64), b.to_numpy().astype(np.float64)
    if a.dtype.itemsize == 2:
        np.testing.assert_allclose(x, y, rtol=2.0 ** -7, atol=0, err_msg=str(what))
    else:
        rtol = TOLERANCES[dtype]
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * np.abs(y).max(), err_msg=str(what))


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("which", sorted(OPTIMIZERS) + sorted(ADAFACTORS))
def test_fused_update_equals_the_unfused_composition(shape, dtype, which):
    mesh = get_mesh(shape)
    for step, _, (p1, s1), (p2, s2), tr in both_ways(mesh, which, dtype):
        assert sum(op.name.endswith("_update") for op in tr.ops) == 1  # one op for every parameter
        assert not any(op.name == "einsum" for op in tr.ops)  # (Adafactor: no per-parameter statistics ops)
        for name in SHAPES:
            _agree(which, dtype, p1[name], p2[name], (which, dtype, name, step))
            for slot, t in ((k, v[name]) for k, v in s1.items() if k != "step" and name in v):
                _agree(which, dtype, t, s2[slot][name], (which, dtype, name, slot, step))
    assert int(s1["step"].to_numpy()) == int(s2["step"].to_numpy()) == 3


def test_ops_per_update():
    """An Adam or Adafactor step over 40 parameters: one update op (and the step's cast and rates),
    not a dozen or more per parameter."""
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    params = {f"w{i}": mesh.ones(f"a{i}:3;b:2") for i in range(40)}
    grads = {k: v * 0.5 for k, v in params.items()}
    # Adam: ~15 ops per parameter op by op; Adafactor (a{i} 3 and b 2 factored): ~20, and its rates
    for opt, name, most, fewest in ((mm.optim.Adam(1e-3), "adam_update", 4, 40 * 10),
                                    (mm.optim.Adafactor(min_dim_size_to_factor=2), "adafactor_update", 8, 40 * 15)):
        state = opt.init(params)
        with mm.trace() as fused_tr:
            opt.update(params, grads, state)
        with mm.trace() as plain_tr:
            unfused(opt).update(params, grads, state)
        assert [op.name for op in fused_tr.ops].count(name) == 1
        assert len(fused_tr.ops) <= most and len(plain_tr.ops) >= fewest, (name, len(fused_tr.ops), len(plain_tr.ops))
