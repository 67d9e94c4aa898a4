"""Fused ops against their unfused compositions of primitive ops, in float64: values and gradients
(through `mm.gradients` of both), on 1-D/2-D/3-D meshes with the reduced dims split unevenly (sizes
7 and 5 on 2, 3, 4 and 8 ranks) or not. Each fused op is one op in the trace, and so is its input
gradient; the compositions are the formulas the fused kernels replace."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import big, get_mesh, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.layers.attention import causal_bias  # noqa: E402
from mpimesh.ops.nn import softmax_cross_entropy  # noqa: E402
from mpimesh.ops.norm import layer_norm  # noqa: E402

SHAPE = "b:3;l:5;d:7"  # l and d split unevenly; b small


def _rules(mesh, which: str) -> str:
    dims = big(mesh)
    if not dims:
        return ""
    if which == "reduced":  # the reduced dim split (an allreduce inside the op)
        return f"d:{dims[0]}" + (f";l:{dims[1]}" if len(dims) > 1 else "")
    return f"b:{dims[0]}" + (f";l:{dims[1]}" if len(dims) > 1 else "")  # the reduced dim whole


def _data(mesh, shape, seed):
    s = mm.Shape(shape)
    return mesh.from_numpy(np.random.default_rng(seed).standard_normal(s.sizes), s)


def _values_and_grads(fn, inputs, cotangent):
    """`fn(*inputs)` and the gradients of sum(fn(*inputs) * cotangent) w.r.t. the inputs, as numpy."""
    with mm.trace() as tr:
        y = fn(*inputs)
        grads = mm.gradients([y], list(inputs), grad_ys=[cotangent])
    return [y.to_numpy()] + [g.to_numpy() for g in grads], tr


def _close(fused, plain, what):
    for i, (a, b) in enumerate(zip(fused, plain)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=f"{what}: output {i}")


def _count(tr, name):
    return sum(op.name == name for op in tr.ops)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("which", ["reduced", "batch"])
def test_layer_norm(shape, which):
    mesh = get_mesh(shape)
    with mm.layout_scope(mesh, _rules(mesh, which)):
        x, dy = _data(mesh, SHAPE, 1), _data(mesh, SHAPE, 2)
        scale, bias = 1 + 0.1 * _data(mesh, "d:7", 3), _data(mesh, "d:7", 4)

        def plain(x, scale, bias):
            c = x - mm.reduce_mean(x, reduced_dims="d")
            return c * mm.rsqrt(mm.reduce_mean(mm.square(c), reduced_dims="d") + 1e-6) * scale + bias
        fused, tr = _values_and_grads(lambda x, s, b: layer_norm(x, ("d",), s, b, 1e-6), (x, scale, bias), dy)
        _close(fused, _values_and_grads(plain, (x, scale, bias), dy)[0], "layer_norm")
        assert _count(tr, "layer_norm") == 1 and _count(tr, "layer_norm_grad") == 1

        def two_dims(x):  # over two dims, no parameters
            c = x - mm.reduce_mean(x, reduced_dims=["d", "l"])
            return c * mm.rsqrt(mm.reduce_mean(mm.square(c), reduced_dims=["d", "l"]) + 1e-3)
        only_x, _ = _values_and_grads(lambda x: layer_norm(x, ("d", "l"), None, None, 1e-3), (x,), dy)
        _close(only_x, _values_and_grads(two_dims, (x,), dy)[0], "layer_norm over 2 dims")


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("log", [False, True])
def test_softmax_with_bias_and_causal_mask(shape, log):
    """Attention's logits [b, l, m] (m: memory positions) with an additive bias [l, m] and the causal
    mask, against `x + bias + causal_bias(...)` and the softmax written with logsumexp."""
    mesh = get_mesh(shape)
    dims = big(mesh)
    rules = f"m:{dims[0]}" + (f";l:{dims[1]}" if len(dims) > 1 else "") if dims else ""
    with mm.layout_scope(mesh, rules):
        x, dy = _data(mesh, "b:3;l:5;m:5", 5), _data(mesh, "b:3;l:5;m:5", 6)
        bias = 0.5 * _data(mesh, "l:5;m:5", 7)
        op = mm.log_softmax if log else mm.softmax

        def plain(x, bias):
            z = x + bias + causal_bias(mesh, x.shape["l"], x.shape["m"], x.dtype)
            lz = z - mm.reduce_logsumexp(z, reduced_dims="m")
            return lz if log else mm.exp(lz)
        fused, tr = _values_and_grads(lambda x, b: op(x, "m", bias=b, causal="l"), (x, bias), dy)
        _close(fused, _values_and_grads(plain, (x, bias), dy)[0], op.__name__)
        name = "log_softmax" if log else "softmax"
        assert _count(tr, name) == 1 and _count(tr, f"{name}_grad") == 1
        masked = fused[0] if not log else np.exp(fused[0])
        assert (masked[:, np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]] == 0).all()


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
def test_softmax_cross_entropy(shape):
    mesh = get_mesh(shape)
    dims = big(mesh)
    rules = f"vocab:{dims[0]}" + (f";b:{dims[1]}" if len(dims) > 1 else "") if dims else ""
    with mm.layout_scope(mesh, rules):
        logits = 3 * _data(mesh, "b:3;l:5;vocab:7", 8)
        targets = mesh.from_numpy(np.random.default_rng(9).integers(0, 8, (3, 5)), "b:3;l:5")  # 7: out of range
        dy = _data(mesh, "b:3;l:5", 10)

        def plain(z):
            return mm.reduce_logsumexp(z, reduced_dims="vocab") - mm.reduce_sum(
                z * mm.one_hot(targets, z.shape["vocab"], dtype=z.dtype), reduced_dims="vocab")
        fused, tr = _values_and_grads(lambda z: softmax_cross_entropy(z, targets, "vocab"), (logits,), dy)
        _close(fused, _values_and_grads(plain, (logits,), dy)[0], "softmax_cross_entropy")
        assert _count(tr, "softmax_cross_entropy") == 1 and _count(tr, "softmax_cross_entropy_grad") == 1


def test_fused_ops_in_low_precision():
    """bfloat16 inputs: computed in float32 and rounded once, as the compositions (within one ulp)."""
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    x = mm.cast(_data(mesh, SHAPE, 11), "bfloat16")
    ref = layer_norm(mm.cast(x, "float32"), ("d",)).to_numpy()
    got = layer_norm(x, ("d",))
    assert got.dtype == x.dtype
    np.testing.assert_allclose(got.to_numpy().astype(np.float64), ref, rtol=2 ** -7, atol=2 ** -7)
    sm = mm.softmax(x, "d")
    assert sm.dtype == x.dtype
    np.testing.assert_allclose(sm.to_numpy().astype(np.float64),
                               mm.softmax(mm.cast(x, "float32"), "d").to_numpy(), rtol=2 ** -7)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh"])
def test_bias_activation(shape, activation):
    from mpimesh.ops.activation import bias_activation
    mesh = get_mesh(shape)
    with mm.layout_scope(mesh, _rules(mesh, "reduced")):
        x, dy, bias = _data(mesh, SHAPE, 12), _data(mesh, SHAPE, 13), _data(mesh, "d:7", 14)
        act = {"relu": mm.relu, "gelu": mm.gelu, "tanh": mm.tanh}[activation]
        fused, tr = _values_and_grads(lambda x, b: bias_activation(x, b, activation), (x, bias), dy)
        _close(fused, _values_and_grads(lambda x, b: act(x + b), (x, bias), dy)[0], activation)
        assert _count(tr, f"bias_{activation}") == 1 and _count(tr, f"bias_{activation}_grad") == 1


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
def test_edges_of_the_fused_ops_are_the_same_on_every_layout(shape):
    """Found by an audit, each on every layout and rank count: a bias of another dtype than x gets its
    gradient in the wider one (a float32 bias got a bfloat16 gradient through the fused softmax and
    bias_activation, float32 through `x + b`); cross-entropy over an empty vocab is one ShapeError (a
    value when vocab was split, an IndexError when not); layer_norm over an empty dim is an empty
    result (ZeroDivisionError), and of a 0-d tensor over no dims 0 (a raw TypeError)."""
    from mpimesh.ops.activation import bias_activation
    mesh = get_mesh(shape)
    rules = [""] + [f"k:{m}" for m in big(mesh)]
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((3, 5))
    for r in rules:
        with mm.layout_scope(mesh, r):
            x = mm.cast(mesh.from_numpy(xs, "i:3;k:5"), "bfloat16")
            for bias_dtype in ("float32", "bfloat16"):
                b = mm.cast(mesh.from_numpy(rng.standard_normal(5), "k:5"), bias_dtype)
                for fused, plain in ((lambda: mm.softmax(x, "k", bias=b), lambda: mm.softmax(x + b, "k")),
                                     (lambda: bias_activation(x, b, "gelu"), lambda: mm.gelu(x + b))):
                    with mm.trace():
                        (g_fused,) = mm.gradients([mm.reduce_sum(mm.cast(fused(), "float32"))], [b])
                    with mm.trace():
                        (g_plain,) = mm.gradients([mm.reduce_sum(mm.cast(plain(), "float32"))], [b])
                    assert g_fused.dtype == g_plain.dtype == np.dtype(bias_dtype), (r, bias_dtype, g_fused.dtype)
                    np.testing.assert_allclose(g_fused.to_numpy(), g_plain.to_numpy(), rtol=0.05, atol=0.05)
            empty = mesh.from_numpy(np.zeros((2, 0)), "b:2;k:0")
            with pytest.raises(mm.ShapeError, match=r"vocab dim k:0 of logits \[b:2, k:0\] is empty"):
                softmax_cross_entropy(empty, mesh.from_numpy(np.zeros(2, np.int32), "b:2"), "k")
            y = mm.layers.layer_norm({}, mesh.ones("b:3;k:0", "float64"), "k")
            assert y.shape == mm.Shape("b:3;k:0") and y.to_numpy().shape == (3, 0)
            with mm.trace():
                e = mesh.ones("b:3;k:0", "float64")
                (ge,) = mm.gradients([mm.reduce_sum(layer_norm(e, ["k"]))], [e])
            assert ge.to_numpy().shape == (3, 0)
            assert float(mm.layers.layer_norm({}, mesh.from_numpy(np.array(2.0), []), []).to_numpy()) == 0.0
