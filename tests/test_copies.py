"""Copy-free einsum: a contraction multiplies its operands where they lie (views, transposed views
for the GEMM's transpose flags), and the profile counts each array copied only to change memory
order (`"copies"`): none in the Transformer's forward and backward passes, one where an operand's
dims interleave so that no view can serve."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as T  # noqa: E402

only_once = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="1-rank meshes: the 1-rank session")


@only_once
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformer_step_copies_nothing(dtype):
    cfg = T.Config(d_model=32, heads=4, d_kv=8, d_ff=64, layers=2, length=16, batch=4, optimizer="adam", dtype=dtype)
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    opt = T.make_optimizer(cfg)
    params, tokens = T.init_params(mesh, cfg, 0), np.arange(64, dtype=np.int32).reshape(4, 16) % 256
    batch = {"inputs": mesh.from_numpy(tokens, [cfg.dim("batch"), cfg.dim("length")]),
             "targets": mesh.from_numpy((tokens + 1) % 256, [cfg.dim("batch"), cfg.dim("length")])}
    with mm.profile() as prof, mm.trace() as tr:
        T.make_train_step(cfg, opt)(params, opt.init(params), batch)
    assert sum(op.name == "einsum" for op in tr.ops) > 20  # forward and backward contractions ran
    assert prof.counters.get("copies", {"calls": 0})["calls"] == 0, prof.counters["copies"]


@only_once
def test_an_operand_no_view_can_serve_is_copied_and_counted():
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    g = np.random.default_rng(0).standard_normal((3, 4, 5))
    x, w = mesh.from_numpy(g, "a:3;b:4;c:5"), mesh.from_numpy(np.ones((4, 2)), "b:4;d:2")
    with mm.profile() as prof:
        y = mm.einsum([x, w], output_shape="c:5;a:3;d:2")  # x's rows (c, a) interleave with b in memory
    np.testing.assert_allclose(y.to_numpy(), np.einsum("abc,bd->cad", g, np.ones((4, 2))))
    assert prof.counters["copies"]["calls"] == 1 and prof.counters["copies"]["bytes"] == g.nbytes
    v = mesh.from_numpy(np.ones((5, 2)), "c:5;d:2")
    with mm.profile() as prof:
        mm.einsum([x, v], output_shape="a:3;b:4;d:2")  # rows (a, b) adjacent in memory: a view
    assert "copies" not in prof.counters


@only_once
def test_transposed_operands_are_views():
    """x·w, xᵀ·y and the batched q·kᵀ of attention read their operands in place."""
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    rng = np.random.default_rng(1)
    x = mesh.from_numpy(rng.standard_normal((6, 4)), "n:6;i:4")
    y = mesh.from_numpy(rng.standard_normal((6, 3)), "n:6;o:3")
    q = mesh.from_numpy(rng.standard_normal((2, 5, 3, 4)), "b:2;l:5;h:3;k:4")
    kk = mesh.from_numpy(rng.standard_normal((2, 5, 3, 4)), "b:2;m:5;h:3;k:4")
    with mm.profile() as prof:
        dw = mm.einsum([x, y], output_shape="i:4;o:3")
        logits = mm.einsum([q, kk], output_shape="b:2;l:5;h:3;m:5")
    assert "copies" not in prof.counters
    np.testing.assert_allclose(dw.to_numpy(), x.to_numpy().T @ y.to_numpy())
    np.testing.assert_allclose(logits.to_numpy(), np.einsum("blhk,bmhk->blhm", q.to_numpy(), kk.to_numpy()))
