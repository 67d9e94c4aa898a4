"""mm.tpu.replay(..., layout=rules): a program recorded on a one-processor mesh (the global program),
replayed on jax meshes of several shapes with its inputs and outputs sharded by the rules, gives
the numpy results; donated inputs and `put` serve a training loop; bad requests raise ReplayError.
JAX runs in one process, so only the 1-rank session compiles; every session checks the errors."""
from __future__ import annotations

import jaxenv  # noqa: F401  (first: XLA flags for 8 host devices, before jax is imported)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpimesh as mm  # noqa: E402

ONE = MPI.COMM_WORLD.Get_size() == 1
compiles = pytest.mark.skipif(not ONE, reason="JAX runs in one process: compiled in the 1-rank session")
RNG = np.random.default_rng(5)
X = RNG.standard_normal((8, 12)).astype(np.float32)
W = RNG.standard_normal((12, 16)).astype(np.float32)
V = RNG.standard_normal((16, 12)).astype(np.float32)


def _jax_mesh(shape: str) -> Mesh:
    s = mm.Shape(shape)
    return Mesh(np.array(jax.devices()[:s.size], dtype=object).reshape(s.sizes), s.names)


def _record():
    """An MLP step on a 1-processor mesh: loss and the SGD-updated weights, recorded in a trace."""
    rec = mm.Mesh("rows:1;cols:1", comm=MPI.COMM_SELF)
    x, w, v = (rec.from_numpy(a, s) for a, s in ((X, "batch:8;io:12"), (W, "io:12;hidden:16"),
                                                  (V, "hidden:16;io:12")))
    with mm.trace() as tr:
        y = mm.einsum([mm.relu(mm.einsum([x, w])), v])
        loss = mm.reduce_mean(mm.square(y - x))
        gw, gv = mm.gradients([loss], [w, v])
        new_w, new_v = w - 0.1 * gw, v - 0.1 * gv
    return tr, [x, w, v], [loss, new_w, new_v]


def _numpy_step(x, w, v):
    h = x @ w
    y = np.maximum(h, 0) @ v
    dy = 2 * (y - x) / y.size
    gv = np.maximum(h, 0).T @ dy
    gw = x.T @ ((dy @ v.T) * (h > 0))
    return float(np.mean((y - x) ** 2)), w - 0.1 * gw, v - 0.1 * gv


@compiles
@pytest.mark.parametrize("shape,rules,w_spec", [
    ("rows:2;cols:2", "batch:rows;hidden:cols", (None, "cols")),
    ("all:4", "hidden:all", (None, "all")),
    ("rows:2;cols:4", "batch:rows;io:cols", ("cols", None)),
    ("all:8", "batch:all;hidden:all", (None, None)),  # two dims on one mesh dim: x and y replicated
    ("all:3", "hidden:all", (None, None)),  # 16 over 3: replicated at the jit boundary, split inside
    ("rows:2;cols:3", "batch:rows;hidden:cols", (None, None)),
])
def test_global_program_on_jax_meshes(shape, rules, w_spec):
    tr, ins, outs = _record()
    f = mm.tpu.replay(tr, ins, outs, devices=_jax_mesh(shape), layout=rules)
    loss, w, v = f(X, W, V)
    want_loss, want_w, want_v = _numpy_step(X.astype(np.float64), W, V)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(v), want_v, rtol=1e-4, atol=1e-6)
    if shape != "all:8":
        assert f.in_shardings[1].spec == PartitionSpec(*w_spec) == f.out_shardings[1].spec
        assert w.sharding.is_equivalent_to(f.out_shardings[1], 2)
    else:  # hidden:all fits w [io, hidden]; batch:all and hidden:all cannot both split y
        assert f.in_shardings[1].spec == PartitionSpec(None, "all")


@compiles
def test_training_loop_with_donated_parameters():
    tr, ins, outs = _record()
    f = mm.tpu.replay(tr, ins, outs, devices=_jax_mesh("rows:2;cols:2"), layout="batch:rows;hidden:cols",
                      donate=[1, 2]).compile()
    w, v = f.put([W, V], first=1)
    assert w.sharding.spec == PartitionSpec(None, "cols")
    want_w, want_v = W.astype(np.float64), V.astype(np.float64)
    for _ in range(3):
        loss, w, v = f(X, w, v)
        want_loss, want_w, want_v = _numpy_step(X.astype(np.float64), want_w, want_v)
        np.testing.assert_allclose(float(loss), want_loss, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-3, atol=1e-5)


def test_errors():
    tr, ins, outs = _record()
    with pytest.raises(mm.tpu.ReplayError, match="jax.sharding.Mesh"):
        mm.tpu.replay(tr, ins, outs, devices=jax.devices()[:1], layout="batch:rows")
    with pytest.raises(mm.tpu.ReplayError, match=r"\['planes'\]"):
        mm.tpu.replay(tr, ins, outs, devices=_jax_mesh("rows:1;cols:1"), layout="batch:planes")
    world = mm.Mesh(f"all:{MPI.COMM_WORLD.Get_size()}")
    a = world.ones("a:8")
    with mm.trace() as tr2:
        b = mm.exp(a)
    if not ONE:
        with pytest.raises(mm.tpu.ReplayError, match="one-processor mesh"):
            mm.tpu.replay(tr2, [a], [b], devices=_jax_mesh("all:1"), layout="a:all")
    else:
        assert mm.tpu.replay(tr2, [a], [b], devices=_jax_mesh("all:1"), layout="a:all") is not None


@pytest.mark.mpi
def test_processes_that_recorded_different_programs_are_stopped_before_any_collective():
    """`mpimesh.tpu.distributed.check_same`: equal recordings pass; where one rank's differs, every
    rank raises a MeshError naming the groups of ranks."""
    from mpimesh.tpu.distributed import check_same
    comm = MPI.COMM_WORLD
    check_same(comm, "einsum [a:4] -> [b:2]")
    if comm.Get_size() == 1:
        return
    with pytest.raises(mm.MeshError, match=r"differs across processes \(ranks \[0(, \d+)*\] vs \[\d+\]\)"):
        check_same(comm, "einsum [a:4]" if comm.Get_rank() != comm.Get_size() - 1 else "einsum [a:5]")
