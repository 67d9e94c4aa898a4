"""mm.trace(): which ops it records (kind, inputs, outputs, params, in order), its inputs, nesting,
and tr.gradients / mm.gradients against numpy on the global arrays."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import big, get_mesh, global_array, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.trace import current_trace  # noqa: E402

pytestmark = pytest.mark.mpi
SHAPES = mesh_shapes()


def same(a, b) -> bool:
    """Identity of two sequences of tensors (DistTensor's == is elementwise, so never use `in`)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def ident(ts) -> list[int]:
    return [id(t) for t in ts]


@pytest.mark.parametrize("shape", SHAPES)
def test_records_ops_in_order(shape):
    mesh = get_mesh(shape)  # no rules: everything replicated, so no relayouts are inserted
    xa, wa = global_array("a:8;k:4", 1, np.float64), global_array("k:4;b:8", 2, np.float64)
    x, w = mesh.from_numpy(xa, "a:8;k:4"), mesh.from_numpy(wa, "k:4;b:8")
    with mm.trace() as tr:
        h = mm.einsum([x, w])
        e = mm.exp(h)
        s = e * 2.0
        r = mm.reduce_max(s, reduced_dim="b")
        t = mm.transpose(e, "b:8;a:8")
    assert [op.name for op in tr.ops] == ["einsum", "exp", "multiply", "reduce_max", "transpose"]
    assert len(tr) == 5
    ein, ex, mul, rmax, tp = tr.ops
    assert same(ein.inputs, [x, w]) and same(ein.outputs, [h])
    assert same(ex.inputs, [h]) and same(ex.outputs, [e])
    assert same(mul.inputs, [e]) and same(mul.outputs, [s])
    assert mul.params == {"scalar": 2.0, "side": "right"}
    assert same(rmax.inputs, [s]) and same(rmax.outputs, [r]) and rmax.params["axes"] == (1,)
    assert same(tp.inputs, [e]) and same(tp.outputs, [t]) and tp.params["perm"] == (1, 0)
    assert "->" in ein.params["subscripts"] and ein.params["reduce_mesh_dims"] == ()
    assert all(callable(op.lower) for op in tr.ops)
    assert all(callable(op.grad) for op in tr.ops)
    assert "einsum" in repr(tr) and "exp" in repr(ex)
    np.testing.assert_allclose(r.to_numpy(), (2 * np.exp(xa @ wa)).max(axis=1), rtol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_comparison_records_no_gradient_rule(shape):
    mesh = get_mesh(shape)
    x = mesh.from_numpy(global_array("a:8", 3, np.float64), "a:8")
    with mm.trace() as tr:
        c = x > 0.0
        f = mm.cast(c, "float64")
    assert [op.name for op in tr.ops] == ["greater", "cast"]
    assert tr.ops[0].grad is None and tr.ops[1].grad is None
    assert c.dtype == np.bool_ and f.dtype == np.float64


@pytest.mark.parametrize("shape", SHAPES)
def test_relayouts_are_recorded(shape):
    mesh = get_mesh(shape)
    m = big(mesh)
    if not m:
        pytest.skip("no mesh dim of size > 1")
    x = mesh.from_numpy(global_array("a:8;b:8", 4, np.float64), "a:8;b:8", layout={"a": m[0]})
    with mm.layout_scope(mesh, {"b": m[0]}), mm.trace() as tr:
        y = mm.tanh(x)
        z = mm.relayout(y, {"a": m[-1]})
    assert [op.name for op in tr.ops] == ["relayout", "tanh", "relayout"]
    r1, th, r2 = tr.ops
    assert same(r1.inputs, [x]) and same(th.outputs, [y]) and same(r2.outputs, [z])
    assert th.inputs[0] is r1.outputs[0] and r2.inputs[0] is y
    assert r1.params["layout"] == y.tensor_layout and r2.params["layout"] == z.tensor_layout
    assert tr.inputs[0] is x and len(tr.inputs) == 1
    np.testing.assert_allclose(z.to_numpy(), np.tanh(global_array("a:8;b:8", 4, np.float64)), rtol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_inputs_are_outside_tensors_in_first_use_order(shape):
    mesh = get_mesh(shape)
    x, w, v = mesh.ones("a:8;k:4", "float64"), mesh.ones("k:4;b:8", "float64"), mesh.ones("b:8", "float64")
    unused = mesh.ones("a:8", "float64")
    pre = mm.exp(x)  # produced before the trace: an input too
    with mm.trace() as tr:
        h = mm.einsum([w, x])
        h2 = h + v
        h3 = h2 * h
        h4 = h3 * pre
        mm.reduce_sum(h4 + w)  # w again: listed once
    assert ident(tr.inputs) == ident([w, x, v, pre])
    assert all(id(t) not in ident(tr.inputs) for t in (h, h2, h3, h4, unused))


@pytest.mark.parametrize("shape", SHAPES)
def test_ops_outside_the_trace_are_not_recorded(shape):
    mesh = get_mesh(shape)
    x = mesh.ones("a:8", "float64")
    before = mm.exp(x)
    assert current_trace() is None
    with mm.trace() as tr:
        assert current_trace() is tr
        inside = mm.sin(before)
    after = mm.cos(inside)
    assert current_trace() is None
    assert [op.name for op in tr.ops] == ["sin"]
    assert ident(tr.inputs) == ident([before])
    assert all(id(after) not in ident(op.outputs) for op in tr.ops)


def test_trace_closed_after_exception():
    mesh = get_mesh(SHAPES[0])
    x = mesh.ones("a:8", "float64")
    with pytest.raises(RuntimeError):
        with mm.trace():
            mm.exp(x)
            raise RuntimeError("boom")
    assert current_trace() is None


@pytest.mark.parametrize("shape", SHAPES)
def test_nested_traces(shape):
    mesh = get_mesh(shape)
    x = mesh.from_numpy(np.linspace(0.5, 2.0, 8), "a:8")
    with mm.trace() as outer:
        y = mm.log(x)
        with mm.trace() as inner:
            assert current_trace() is inner
            z = mm.sqrt(y * y + 1.0)
        assert current_trace() is outer
        u = mm.exp(z)
    assert current_trace() is None
    assert [op.name for op in outer.ops] == ["log", "multiply", "add", "sqrt", "exp"]
    assert [op.name for op in inner.ops] == ["multiply", "add", "sqrt"]
    # The inner trace shares the very records of the outer one.
    assert all(a is b for a, b in zip(inner.ops, outer.ops[1:4]))
    assert ident(outer.inputs) == ident([x])
    assert ident(inner.inputs) == ident([y])  # produced outside the inner trace
    assert same(outer.ops[-1].outputs, [u])


@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_in_nested_trace_recorded_in_both(shape):
    mesh = get_mesh(shape)
    xa = np.linspace(0.5, 2.0, 8)
    x = mesh.from_numpy(xa, "a:8")
    with mm.trace() as outer:
        y = mm.exp(x)
        with mm.trace() as inner:
            z = y * y
            n_outer, n_inner = len(outer), len(inner)
            (g,) = mm.gradients([z], [y])  # uses the innermost trace
        assert len(inner) > n_inner and len(outer) - n_outer == len(inner) - n_inner
    np.testing.assert_allclose(g.to_numpy(), 2 * np.exp(xa), rtol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_tr_gradients_matches_mm_gradients(shape):
    mesh = get_mesh(shape)
    xa, wa = global_array("a:8;k:4", 5, np.float64), global_array("k:4;b:8", 6, np.float64)
    x, w = mesh.from_numpy(xa, "a:8;k:4"), mesh.from_numpy(wa, "k:4;b:8")
    with mm.trace() as tr:
        y = mm.tanh(mm.einsum([x, w]))
        gx1, gw1 = mm.gradients([y], [x, w])
        gx2, gw2 = tr.gradients([y], [x, w])
    dh = 1 - np.tanh(xa @ wa) ** 2
    for g1, g2, want in ((gx1, gx2, dh @ wa.T), (gw1, gw2, xa.T @ dh)):
        np.testing.assert_allclose(g1.to_numpy(), want, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(g2.to_numpy(), want, rtol=1e-10, atol=1e-12)
    # After the block, tr.gradients still differentiates its recorded ops.
    (gx3,) = tr.gradients([y], [x])
    np.testing.assert_allclose(gx3.to_numpy(), dh @ wa.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_of_several_nonscalar_ys(shape):
    mesh = get_mesh(shape)
    xa = np.linspace(-1.0, 1.5, 16).reshape(2, 8)
    x = mesh.from_numpy(xa, "a:2;b:8")
    with mm.trace():
        y1 = mm.sin(x)        # [a, b]: sum of all its elements
        y2 = mm.reduce_sum(x * x, reduced_dim="a")  # [b]
        (g,) = mm.gradients([y1, y2], [x])
    np.testing.assert_allclose(g.to_numpy(), np.cos(xa) + 2 * xa, rtol=1e-12)


def test_gradients_outside_trace_raises():
    mesh = get_mesh(SHAPES[0])
    x = mesh.ones("a:8", "float64")
    y = mm.exp(x)
    with pytest.raises(mm.MpimeshError, match=r"trace"):
        mm.gradients([y], [x])
    with pytest.raises(ValueError):  # MpimeshError is a ValueError
        mm.gradients([y], [x])


@pytest.fixture(name="debug")
def debug_fixture():
    from mpimesh.trace import debugging, set_debug
    was = debugging()
    set_debug(True)
    try:
        yield
    finally:
        set_debug(was)


def _op(x, out_layout, kernel, n_out=1):
    """A hand-made op through dispatch: `kernel` maps x's local array to the outputs."""
    from mpimesh.trace import dispatch
    return dispatch("handmade", [x], [(x.shape, out_layout)] * n_out, lambda ctx, a: kernel(a))


@pytest.mark.parametrize("shape", SHAPES)
def test_debug_catches_a_kernel_whose_local_shape_disagrees_with_its_layout(shape, debug):
    probe = get_mesh(shape)
    m = max(probe.shape.names, key=lambda n: probe.shape[n].size)  # the mesh dim that splits most
    mesh = get_mesh(shape, f"a:{m}")
    x = mesh.from_numpy(np.arange(32.0).reshape(8, 4), "a:8;k:4")
    k = mesh.shape[m].size
    # Declares x's own layout but keeps one row too many: only debug mode can see it.
    rows = len(np.array_split(range(8), k)[mesh.coords[m]]) + 1  # this rank's block (uneven on 3 ranks), plus one
    with pytest.raises(mm.LayoutError, match=r"'handmade' output 0 .* local shape is \(%d, 4\)" % rows):
        _op(x, x.tensor_layout, lambda a: np.concatenate([a, a[:1]]))
    # Declares the dim replicated but returns the local slice: wrong whenever a is really split.
    if k > 1:
        with pytest.raises(mm.LayoutError, match=r"its layout gives \(8, 4\)"):
            _op(x, (None, None), lambda a: a)
    (y,) = _op(x, x.tensor_layout, lambda a: a * 2)  # a correct op passes and computes
    np.testing.assert_array_equal(y.to_numpy(), 2 * np.arange(32.0).reshape(8, 4))


@pytest.mark.parametrize("shape", SHAPES)
def test_dispatch_checks_specs_even_without_debug(shape):
    mesh = get_mesh(shape)
    x = mesh.from_numpy(np.ones((8, 4)), "a:8;k:4")
    m = mesh.shape.names[0]
    with pytest.raises(mm.LayoutError, match="1 entries for the 2 dims"):
        _op(x, (None,), lambda a: a)
    with pytest.raises(mm.LayoutError, match="mesh dim 'nope'"):
        _op(x, ("nope", None), lambda a: a)
    with pytest.raises(mm.LayoutError, match="uses a mesh dim twice"):
        _op(x, (m, m), lambda a: a)
    with pytest.raises(mm.MpimeshError, match="declares 2 outputs, but its kernel returned 1"):
        _op(x, (None, None), lambda a: a, n_out=2)
