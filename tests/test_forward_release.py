"""The forward pass keeps only what the backward pass reads: while a trace is open, a tensor that
no recorded gradient rule reads gives its array back once nothing but the trace holds it
(`mm.trace.saving` declares what each rule reads). The gradients are bitwise those of a run that
holds every intermediate, on 1-D/2-D/3-D meshes with uneven blocks, for every op family that
declares; the forward peak is what the rules need, counted from the arrays' sizes."""
from __future__ import annotations

import os
import sys
import tracemalloc

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import big, get_mesh, global_array, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.ops.activation import bias_activation  # noqa: E402
from mpimesh.ops.nn import softmax_cross_entropy  # noqa: E402
from mpimesh.ops.norm import layer_norm  # noqa: E402
from mpimesh.trace import Released  # noqa: E402

pytestmark = pytest.mark.mpi


def _model(p, tokens, targets, hold, narrow=True):
    """A small Transformer-like step touching every op family whose rule declares what it reads;
    `hold(t)` returns t (and may keep it alive); `narrow`: a round trip through float32."""
    h = hold(mm.gather(p["emb"], tokens, "vocab"))                      # gather
    h = hold(layer_norm(h, ("d",), p["scale"], p["bias"]))              # layer norm
    q = hold(mm.einsum([h, p["wq"]], output_shape="b:3;l:5;k:6"))       # einsum
    k = hold(mm.rename_dimension(q, "l", "m"))                          # reshape
    logits = hold(mm.einsum([q, k], output_shape="b:3;l:5;m:5") * 0.5)  # multiply by a scalar
    w = hold(mm.softmax(logits, "m", bias=p["mask"], causal="l"))       # softmax, masked
    a = hold(mm.einsum([w, k], output_shape="b:3;l:5;k:6"))
    a = hold(mm.transpose(a, "l:5;b:3;k:6"))                            # transpose
    f = hold(bias_activation(a, p["fb"], "gelu"))                       # bias + activation
    f = hold(mm.dropout(f, 0.25, seed=7))                               # dropout
    f = hold(mm.axpy(0.5, f, a))                                        # axpy
    f = hold(mm.cast(mm.cast(f, "float32"), "float64")) if narrow else f  # cast
    left, right = mm.split(f, "k", [2, 4])                              # split, concat
    f = hold(mm.concat([hold(mm.exp(left) / 3.0), hold(mm.tanh(right))], "k"))  # exp, divide, tanh
    f = hold(mm.shift(f, 1, "l", wrap=False))                           # shift
    f = hold(mm.cumsum(f, "k"))                                         # cumsum
    f = hold(mm.pad(mm.slice(f, 1, 4, "k"), [1, 1], "k"))              # slice, pad
    f = hold(mm.where(mm.greater(f, 0.0), f, hold(mm.sigmoid(f))))      # where, comparison, sigmoid
    f = hold(f + hold(mm.broadcast(p["fb"], f.shape)))                  # broadcast, add
    out = hold(mm.einsum([f, p["wo"]], output_shape="b:3;l:5;vocab:7"))
    loss = softmax_cross_entropy(out, targets, "vocab")                 # cross-entropy
    return mm.reduce_mean(hold(loss - mm.sqrt(mm.square(hold(mm.negative(loss))) + 1.0)))


def _params(mesh):
    shapes = {"emb": "vocab:7;d:4", "scale": "d:4", "bias": "d:4", "wq": "d:4;k:6", "mask": "l:5;m:5",
              "fb": "k:6", "wo": "k:6;vocab:7"}
    return {n: mesh.from_numpy(global_array(s, i, np.float64), s) for i, (n, s) in enumerate(shapes.items())}


def _run(mesh, rules, holding):
    params = _params(mesh)
    tokens = mesh.from_numpy(np.arange(15).reshape(3, 5) % 7, "b:3;l:5")
    targets = mesh.from_numpy((np.arange(15).reshape(3, 5) * 3) % 7, "b:3;l:5")
    kept = []

    def hold(t):
        if holding:
            kept.append(t)
        return t
    names = sorted(params)
    with mm.layout_scope(mesh, rules), mm.trace() as tr:
        loss = _model(params, tokens, targets, hold)
        grads = mm.gradients([loss], [params[n] for n in names])
    stubs = sum(isinstance(t, Released) for rec in tr.ops for t in rec.inputs + rec.outputs)
    return [loss.to_numpy()] + [g.to_numpy() for g in grads], stubs


@pytest.mark.parametrize("shape", mesh_shapes())
def test_gradients_bitwise_whether_or_not_intermediates_are_held(shape):
    mesh = get_mesh(shape)
    dims = big(mesh)
    rules = ";".join(f"{d}:{m}" for d, m in zip(("l", "k", "d"), dims))  # uneven: l 5, k 6, d 4 blocks
    held, held_stubs = _run(mesh, rules, True)
    dropped, dropped_stubs = _run(mesh, rules, False)
    assert dropped_stubs > held_stubs + 10, (held_stubs, dropped_stubs)  # (backward temporaries go in both)
    for a, b in zip(held, dropped):
        assert a.tobytes() == b.tobytes()


def test_gradients_match_finite_differences_with_intermediates_released():
    """The declarations are right, not merely self-consistent: the dropped run's gradient of the
    embedding against central differences of the loss."""
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    tokens = mesh.from_numpy(np.arange(15).reshape(3, 5) % 7, "b:3;l:5")
    targets = mesh.from_numpy((np.arange(15).reshape(3, 5) * 3) % 7, "b:3;l:5")
    params = _params(mesh)
    with mm.trace():
        loss = _model(params, tokens, targets, lambda t: t, narrow=False)
        (g,) = mm.gradients([loss], [params["wq"]])
    base = params["wq"].to_numpy()

    def at(w):
        p = dict(params, wq=mesh.from_numpy(w, "d:4;k:6"))
        return float(_model(p, tokens, targets, lambda t: t, narrow=False).to_numpy())
    eps, fd = 1e-6, np.zeros_like(base)
    for i in np.ndindex(base.shape):
        up, down = base.copy(), base.copy()
        up[i] += eps
        down[i] -= eps
        fd[i] = (at(up) - at(down)) / (2 * eps)
    np.testing.assert_allclose(g.to_numpy(), fd, rtol=1e-5, atol=1e-8)


def test_forward_peak_is_what_the_rules_read():
    """8 rounds of `h = tanh(h * 1.1)` on 4 MiB arrays: tanh's rule reads its output, the scalar
    product's reads nothing, so the forward keeps the 8 tanh outputs and frees the products
    (without this it kept 16 arrays: 64 MiB)."""
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF, backend="numpy")  # (tracemalloc sees host memory only)
    n = 1 << 19
    size = 8 * n
    x = mesh.from_numpy(np.linspace(-1, 1, n), f"a:{n}")
    tracemalloc.start()
    with mm.trace() as tr:
        h = x
        for _ in range(8):
            h = mm.tanh(h * 1.1)
        forward_peak = tracemalloc.get_traced_memory()[1]
        released = [isinstance(op.outputs[0], Released) for op in tr.ops]
        loss = mm.reduce_sum(h)
        (g,) = mm.gradients([loss], [x])
    tracemalloc.stop()
    assert [op.name for op in tr.ops[:16]] == ["multiply", "tanh"] * 8
    assert released[:16] == [True, False] * 7 + [False, False]  # the last product: checked two ops on
    assert 8 * size <= forward_peak < (8 + 3) * size, forward_peak / size
    chain = np.ones(n)  # the chain rule, in float64 numpy
    v = np.linspace(-1, 1, n)
    for _ in range(8):
        y = np.tanh(v * 1.1)
        chain = chain * (1.1 * (1 - y * y))
        v = y
    np.testing.assert_allclose(g.to_numpy(), chain, rtol=1e-12)


def test_a_tensor_the_user_holds_is_never_released():
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    x = mesh.from_numpy(np.array([0.5, 1.0, 2.0]), "a:3")
    with mm.trace() as tr:
        y = x * 2.0
        z = mm.reduce_sum(mm.exp(y + 1.0))
        for _ in range(40):  # more than one batch of checks
            z = z + 0.0
        forward = len(tr.ops)
        mm.gradients([z], [x])
    assert y.to_numpy().tolist() == [1.0, 2.0, 4.0]
    assert any(t is y for rec in tr.ops for t in rec.outputs)
    released = [rec.name for rec in tr.ops[:forward] if isinstance(rec.outputs[0], Released)]
    assert "add" in released and "multiply" not in released
