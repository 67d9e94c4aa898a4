"""Layouts change speed, never results: a small composite model (embedding -> conv1d ->
attention-like einsums -> softmax cross-entropy) gives the same loss and gradients under many
layouts and mesh shapes, and its loss matches a plain numpy forward pass."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from meshes import mesh_shapes

B, S, V, D, C, K = 8, 16, 32, 8, 8, 8
SHAPES = {"emb": f"vocab:{V};d:{D}", "filt": f"tap:3;d:{D};c:{C}", "wq": f"c:{C};k:{K}",
          "wk": f"c:{C};k:{K}", "wv": f"c:{C};k:{K}", "wout": f"k:{K};vocab:{V}"}


def _data():
    rng = np.random.default_rng(42)
    params = {n: (rng.standard_normal(mm.Shape(s).sizes) * 0.5).astype(np.float32) for n, s in SHAPES.items()}
    tokens = rng.integers(0, V, size=(B, S)).astype(np.int32)
    targets = rng.integers(0, V, size=(B, S)).astype(np.int32)
    return params, tokens, targets


def _model(p, tokens, targets):
    x = mm.gather(p["emb"], tokens, "vocab")                      # [batch, seq, d]
    h = mm.tanh(mm.conv1d(x, p["filt"]))                           # [batch, seq, c]
    q = mm.einsum([h, p["wq"]], reduced_dims=["c"])                # [batch, seq, k]
    kk = mm.rename_dimension(mm.einsum([h, p["wk"]], reduced_dims=["c"]), "seq", "mseq")
    vv = mm.rename_dimension(mm.einsum([h, p["wv"]], reduced_dims=["c"]), "seq", "mseq")
    att = mm.softmax(mm.einsum([q, kk], reduced_dims=["k"]) * (1.0 / np.sqrt(K)), "mseq")
    o = mm.einsum([att, vv], reduced_dims=["mseq"])                # [batch, seq, k]
    logits = mm.einsum([o, p["wout"]], reduced_dims=["k"])         # [batch, seq, vocab]
    gold = mm.reduce_sum(logits * mm.one_hot(targets, logits.shape["vocab"]), reduced_dims="vocab")
    return mm.reduce_mean(mm.reduce_logsumexp(logits, reduced_dims="vocab") - gold)


def _numpy_loss(p, tokens, targets) -> float:
    x = p["emb"].astype(np.float64)[tokens]
    xp = np.pad(x, ((0, 0), (1, 1), (0, 0)))
    h = np.tanh(sum(np.einsum("bsd,dc->bsc", xp[:, t:t + S], p["filt"][t]) for t in range(3)))
    q, k, v = (h @ p[n] for n in ("wq", "wk", "wv"))
    a = np.einsum("bsk,bmk->bsm", q, k) / np.sqrt(K)
    a = np.exp(a - a.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    logits = np.einsum("bsm,bmk->bsk", a, v) @ p["wout"]
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    gold = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float((lse - gold).mean())


def _run(mesh, layouts=None):
    params, tokens, targets = _data()
    layouts = layouts or {}
    p = {n: mesh.from_numpy(a, SHAPES[n], layout=layouts.get(n)) for n, a in params.items()}
    tok = mesh.from_numpy(tokens, f"batch:{B};seq:{S}")
    tgt = mesh.from_numpy(targets, f"batch:{B};seq:{S}")
    with mm.trace():
        loss = _model(p, tok, tgt)
        grads = mm.gradients([loss], list(p.values()))
    return float(loss.to_numpy()), {n: g.to_numpy() for n, g in zip(p, grads)}


def _configs():
    """(mesh shape, rules, parameter layouts) for the current rank count: data, model, spatial,
    2-D and replicated layouts."""
    n = MPI.COMM_WORLD.Get_size()
    one, two, three = mesh_shapes(n)
    r, c = "rows", "cols"
    return [
        (one, "", {}),                                         # replicated
        (one, "batch:all", {}),                                # data-parallel
        (one, "vocab:all", {"emb": "vocab:all"}),              # model-parallel vocabulary
        (one, "k:all;d:all", {}),                              # model-parallel heads-like k and d
        (one, "seq:all", {"filt": "c:all"}),                   # spatial split: conv halos, seq in softmax
        (two, f"batch:{r};c:{c};mseq:{c}", {"wq": f"k:{c}"}),  # 2-D data + model
        (three, "batch:rows;vocab:cols;seq:planes", {}),       # 3-D
    ]


@pytest.fixture(scope="module")
def reference():
    return _run(mm.Mesh("all:1", comm=MPI.COMM_SELF))


def test_reference_matches_numpy(reference):
    params, tokens, targets = _data()
    assert reference[0] == pytest.approx(_numpy_loss(params, tokens, targets), rel=1e-5)


@pytest.mark.parametrize("config", range(7))
def test_same_loss_and_gradients_under_every_layout(reference, config):
    shape, rules, layouts = _configs()[config]
    loss, grads = _run(mm.Mesh(shape, layout=rules), layouts)
    ref_loss, ref_grads = reference
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name, g in grads.items():
        scale = np.abs(ref_grads[name]).max()
        np.testing.assert_allclose(g, ref_grads[name], rtol=1e-5, atol=1e-5 * scale, err_msg=f"{shape} {rules} {name}")
