"""mm.gradients: every differentiable op of elementwise/einsum/reduce/reshape/relayout checked against
float64 central finite differences (tests/gradcheck.py) under two layouts each, plus the autodiff
contract: zeros where there is no path, accumulation, shapes and layouts of gradients, recorded and
distributed backward ops."""
from __future__ import annotations

import os
import sys
from typing import Callable, NamedTuple

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from gradcheck import check_gradients  # noqa: E402
from meshes import big, get_mesh, global_array, layouts, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402

pytestmark = pytest.mark.mpi
SHAPES = mesh_shapes()
F64 = "float64"


# ---- input generators (global arrays, identical on every rank) -------------------------------------
def normal(rng: np.random.Generator, s: tuple) -> np.ndarray:
    return rng.standard_normal(s)


def positive(rng: np.random.Generator, s: tuple) -> np.ndarray:
    return rng.uniform(0.5, 2.0, s)


def nonzero(rng: np.random.Generator, s: tuple) -> np.ndarray:
    """|x| >= 0.3: away from the kinks of relu/abs and the poles of 1/x."""
    return rng.choice([-1.0, 1.0], s) * rng.uniform(0.3, 1.5, s)


def distinct(rng: np.random.Generator, s: tuple) -> np.ndarray:
    """All values distinct, spaced 0.01 apart: no max/min ties under perturbation."""
    return (rng.permutation(int(np.prod(s))) * 0.01 - 0.4).reshape(s)


def grid(rng: np.random.Generator, s: tuple) -> np.ndarray:
    """Multiples of 0.1."""
    return rng.integers(-15, 15, s) * 0.1


def offgrid(rng: np.random.Generator, s: tuple) -> np.ndarray:
    """0.05 away from every multiple of 0.1, so never tied with `grid` values."""
    return rng.integers(-15, 15, s) * 0.1 + 0.05


def boolean(rng: np.random.Generator, s: tuple) -> np.ndarray:
    return rng.random(s) < 0.5


class Case(NamedTuple):
    f: Callable
    shapes: tuple
    gens: tuple
    dims: str = ""  # extra dims (e.g. outputs) the layout rules may split
    split: str = ""  # an input dim that should be split when the mesh allows
    wrt: tuple = None
    check: dict = {}


def _shuffled(x) -> dict:
    """A layout for x that differs from its own: its dims, last first, on the big mesh dims rotated."""
    b = big(x.mesh)
    if not b:
        return {}
    b = b[1:] + b[:1]
    return {d: m for d, m in zip(reversed(x.shape.names), b)}


AB, BC = "a:8;b:16", "b:16;c:8"
ABC = "a:8;b:16;c:8"
CASES: dict[str, Case] = {}
for _name, _fn, _gen in [("relu", mm.relu, nonzero), ("gelu", mm.gelu, normal), ("exp", mm.exp, normal),
                         ("log", mm.log, positive), ("sqrt", mm.sqrt, positive), ("rsqrt", mm.rsqrt, positive),
                         ("tanh", mm.tanh, normal), ("sigmoid", mm.sigmoid, normal),
                         ("square", mm.square, normal), ("abs", mm.abs, nonzero), ("sin", mm.sin, normal),
                         ("cos", mm.cos, normal), ("negative", mm.negative, normal),
                         ("neg_operator", lambda x: -x, normal)]:
    CASES[_name] = Case(_fn, (AB,), (_gen,))

_BINARY = [  # name, op, gens for (x, y) with broadcasting, gen for the tensor in the scalar cases, scalar
    ("add", lambda x, y: x + y, (normal, normal), normal, 1.7),
    ("subtract", lambda x, y: x - y, (normal, normal), normal, 1.7),
    ("multiply", lambda x, y: x * y, (normal, normal), normal, 1.7),
    ("divide", lambda x, y: x / y, (normal, nonzero), nonzero, 1.7),
    ("power", lambda x, y: x ** y, (positive, normal), positive, 1.7),
    ("minimum", mm.minimum, (grid, offgrid), grid, 0.33),
    ("maximum", mm.maximum, (grid, offgrid), grid, 0.33),
]
for _name, _op, _gens, _g1, _s in _BINARY:
    CASES[_name] = Case(_op, (AB, BC), _gens)
    CASES[_name + "_scalar_right"] = Case(lambda x, op=_op, s=_s: op(x, s), (AB,), (_g1,))
    CASES[_name + "_scalar_left"] = Case(lambda x, op=_op, s=_s: op(s, x), (AB,), (_g1,))
CASES["multiply_subset"] = Case(lambda x, y: x * y, ("b:16", AB), (normal, normal))
CASES["subtract_transposed"] = Case(lambda x, y: x - y, (AB, "b:16;a:8"), (normal, normal))
CASES["divide_new_dims_first"] = Case(lambda x, y: y / x, ("c:8", AB), (nonzero, normal))
CASES["where"] = Case(mm.where, (AB, AB, "b:16"), (boolean, normal, normal), wrt=(1, 2))
CASES["where_scalar_y"] = Case(lambda c, x: mm.where(c, x, 0.5), (AB, BC), (boolean, normal), wrt=(1,))
CASES["where_scalar_x"] = Case(lambda c, y: mm.where(c, -0.25, y), ("b:16", AB), (boolean, normal), wrt=(1,))
CASES["cast_f32_roundtrip"] = Case(lambda x: mm.cast(mm.cast(x, "float32"), F64) ** 2, (AB,), (normal,),
                                   check={"eps": 1e-2, "rtol": 1e-4})
CASES["einsum_matmul"] = Case(lambda x, w: mm.einsum([x, w]), ("a:8;k:16", "k:16;b:8"), (normal, normal),
                              split="k")
CASES["einsum_3_operands"] = Case(lambda x, w, v: mm.einsum([x, w, v]), ("a:8;k:16", "k:16;b:8", "b:8;c:8"),
                                  (normal, normal, normal), split="k")
CASES["einsum_dim_only_in_x"] = Case(lambda x, w: mm.einsum([x, w], output_shape="a:8;b:8"),
                                     ("a:8;k:16;r:8", "k:16;b:8"), (normal, normal), split="r")
CASES["einsum_batched_transposed"] = Case(lambda x, w: mm.einsum([x, w], output_shape="b:8;n:8;a:8"),
                                          ("n:8;a:8;k:16", "n:8;k:16;b:8"), (normal, normal), split="k")
CASES["einsum_reduced_dims"] = Case(lambda x, y: mm.einsum([x, y], reduced_dims=["b"]), (AB, BC),
                                    (normal, normal), split="b")
CASES["einsum_outer"] = Case(lambda x, y: mm.einsum([x, y]), ("a:8", "c:8"), (normal, normal))
CASES["einsum_same_x_twice"] = Case(lambda x: mm.einsum([x, x]), (AB,), (normal,))
CASES["einsum_gram"] = Case(lambda x: mm.einsum([x, mm.rename_dimension(x, "a", "z")]), (AB,), (normal,),
                             dims="z:8")
_REDUCE = [("reduce_sum", mm.reduce_sum, normal), ("reduce_mean", mm.reduce_mean, normal),
           ("reduce_max", mm.reduce_max, distinct), ("reduce_min", mm.reduce_min, distinct),
           ("reduce_logsumexp", mm.reduce_logsumexp, normal)]
for _name, _op, _gen in _REDUCE:
    CASES[_name + "_dim"] = Case(lambda x, op=_op: op(x, reduced_dims="b"), (ABC,), (_gen,), split="b")
    CASES[_name + "_transposed_out"] = Case(lambda x, op=_op: op(x, output_shape="c:8;a:8"), (ABC,), (_gen,),
                                            split="b")
    CASES[_name + "_all"] = Case(lambda x, op=_op: op(x), (AB,), (_gen,), split="a")
CASES["reduce_mean_two_dims"] = Case(lambda x: mm.reduce_mean(x, reduced_dims=["a", "c"]), (ABC,), (normal,),
                                     split="c")
CASES["reshape_merge"] = Case(lambda x: mm.reshape(x, "ab:128"), (AB,), (normal,), dims="ab:128")
CASES["reshape_regroup"] = Case(lambda x: mm.reshape(x, "c:16;d:8"), (AB,), (normal,), dims="c:16;d:8")
CASES["rename_dimension"] = Case(lambda x: mm.rename_dimension(x, "a", "z"), (AB,), (normal,), dims="z:8")
CASES["transpose"] = Case(lambda x: mm.transpose(x, "c:8;a:8;b:16"), (ABC,), (normal,))
CASES["broadcast_new_dims"] = Case(lambda x: mm.broadcast(x, ABC), ("b:16",), (normal,), dims="a:8;c:8")
CASES["broadcast_reordered"] = Case(lambda x: mm.broadcast(x, "c:8;b:16;a:8"), (AB,), (normal,), dims="c:8")
CASES["relayout"] = Case(lambda x, w: mm.relayout(x, _shuffled(x)) * w, (AB, AB), (normal, normal), wrt=(0,))
CASES["relayout_and_back"] = Case(lambda x: mm.sin(mm.relayout(mm.relayout(x, _shuffled(x)), x.layout)),
                                  (ABC,), (normal,))
CASES["axpy"] = Case(lambda x, y: mm.axpy(-0.7, x, y), (AB, AB), (normal, normal))
CASES["axpy_tensor_alpha"] = Case(lambda a, x, y: mm.axpy(a, x, y), ("", AB, "b:16;a:8"), (normal, normal, normal))
NAMES = list(CASES)


def config(index: int, k: int, case: Case):
    """The mesh, the layout rules in force and each input's layout for variant `k` of a case."""
    mesh = get_mesh(SHAPES[(index + k) % len(SHAPES)])
    dims = {}
    for s in case.shapes + ((case.dims,) if case.dims else ()):
        dims.update(zip(mm.Shape(s).names, mm.Shape(s).sizes))
    in_dims = {n for s in case.shapes for n in mm.Shape(s).names}
    opts = [lay for lay in layouts(mesh, list(dims)) if all(dims[d] % mesh.shape[m].size == 0
                                                            for d, m in lay.items())]
    n = len(opts)
    rules = opts[(5 * index + 3 * k + 1) % n]
    splits = [lay for lay in opts if any(d in in_dims for d in lay) and (not case.split or case.split in lay)]
    inp = splits[(7 * index + k) % len(splits)] if splits else {}
    per_input = [{d: m for d, m in inp.items() if d in mm.Shape(s).names} for s in case.shapes]
    return mesh, rules, per_input


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("name", NAMES)
def test_gradcheck(name, k):
    case = CASES[name]
    mesh, rules, lays = config(NAMES.index(name), k, case)
    rng = np.random.default_rng(NAMES.index(name) * 10 + k)
    arrays = [g(rng, mm.Shape(s).sizes) for g, s in zip(case.gens, case.shapes)]

    def f(*ts):
        return mm.sin(case.f(*ts))  # a non-constant upstream gradient

    with mm.layout_scope(mesh, rules):
        check_gradients(mesh, f, arrays, case.shapes, lays, wrt=case.wrt, directions=1, seed=k, **case.check)


# ---- the autodiff contract ---------------------------------------------------------------------------
def split_config(mesh: mm.Mesh):
    """Input layout {a: first big mesh dim}, rules {b: that dim}: forces relayouts in both passes."""
    b = big(mesh)
    return ({"a": b[0]}, {"b": b[0]}) if b else ({}, {})


@pytest.mark.parametrize("shape", SHAPES)
def test_comparisons_give_no_gradient(shape):
    mesh = get_mesh(shape)
    lay, rules = split_config(mesh)
    xa, ya = global_array(AB, 1, np.float64), global_array("b:16", 2, np.float64)
    x, y = mesh.from_numpy(xa, AB, lay), mesh.from_numpy(ya, "b:16")
    cmps = [mm.less, mm.less_equal, mm.greater, mm.greater_equal, mm.equal, mm.not_equal]
    with mm.layout_scope(mesh, rules), mm.trace():
        for cmp in cmps:
            z = mm.cast(cmp(x, y), F64) * 3.0 + mm.cast(cmp(x, 0.1), F64)
            gx, gy = mm.gradients([z], [x, y])
            for g, t in ((gx, x), (gy, y)):
                assert g.shape == t.shape and g.tensor_layout == t.tensor_layout and g.dtype == t.dtype
                assert not np.any(g.to_numpy()), cmp.__name__
        (g,) = mm.gradients([x * mm.cast(x > 0.0, F64)], [x])  # the comparison path adds nothing
    np.testing.assert_array_equal(g.to_numpy(), (xa > 0).astype(np.float64))


@pytest.mark.parametrize("shape", SHAPES)
def test_gradient_shape_layout_dtype_and_zeros(shape):
    mesh = get_mesh(shape)
    lay, rules = split_config(mesh)
    xa = global_array(AB, 3, np.float64)
    x = mesh.from_numpy(xa, AB, lay)
    u = mesh.from_numpy(global_array("b:16;a:8", 4, np.float64), "b:16;a:8", lay)  # y does not use u
    v = mesh.from_numpy(global_array("c:8", 5), "c:8")  # float32, used but not on y's path
    with mm.layout_scope(mesh, rules), mm.trace():
        side = mm.exp(v) * 2.0
        y = mm.reduce_sum(mm.square(x), reduced_dims="a")
        gx, gu, gv, gs = mm.gradients([y], [x, u, v, side])
    for g, t in ((gx, x), (gu, u), (gv, v), (gs, side)):
        assert g.shape == t.shape and g.tensor_layout == t.tensor_layout and g.dtype == t.dtype
    assert x.layout == lay and gx.layout == lay
    np.testing.assert_allclose(gx.to_numpy(), 2 * xa, rtol=1e-12)
    for g in (gu, gv, gs):
        assert not np.any(g.to_numpy())


@pytest.mark.parametrize("shape", SHAPES)
def test_accumulation(shape):
    mesh = get_mesh(shape)
    lay, rules = split_config(mesh)
    xa = global_array(AB, 6, np.float64)
    x = mesh.from_numpy(xa, AB, lay)
    with mm.layout_scope(mesh, rules), mm.trace():
        g_sq, = mm.gradients([x * x], [x])
        g_sum, = mm.gradients([mm.reduce_sum(x) + mm.reduce_sum(x * 2.0)], [x])
        g_ein, = mm.gradients([mm.einsum([x, x])], [x])
        g_gram, = mm.gradients([mm.einsum([x, mm.rename_dimension(x, "a", "z")])], [x])  # x x^T over b
        g_three, = mm.gradients([mm.sin(x) + mm.relayout(x, _shuffled(x)) * x], [x])
        g_self, = mm.gradients([x, x * 3.0], [x])  # ys may include x itself
        h = x * 2.0
        g_mid, = mm.gradients([mm.exp(h)], [h])  # with respect to an intermediate tensor
    np.testing.assert_allclose(g_sq.to_numpy(), 2 * xa, rtol=1e-12)
    np.testing.assert_allclose(g_sum.to_numpy(), np.full(xa.shape, 3.0), rtol=1e-12)
    np.testing.assert_allclose(g_ein.to_numpy(), 2 * xa, rtol=1e-12)
    np.testing.assert_allclose(g_gram.to_numpy(), np.tile(2 * xa.sum(axis=0), (8, 1)), rtol=1e-12)
    np.testing.assert_allclose(g_three.to_numpy(), np.cos(xa) + 2 * xa, rtol=1e-12)
    np.testing.assert_allclose(g_self.to_numpy(), np.full(xa.shape, 4.0), rtol=1e-12)
    np.testing.assert_allclose(g_mid.to_numpy(), np.exp(2 * xa), rtol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_cast_gradient_dtypes(shape):
    mesh = get_mesh(shape)
    lay, rules = split_config(mesh)
    xa, wa = global_array(AB, 7, np.float32), global_array(AB, 8, np.float64)
    x32, w = mesh.from_numpy(xa, AB, lay), mesh.from_numpy(wa, AB)
    x64 = mesh.from_numpy(xa.astype(np.float64), AB, lay)
    with mm.layout_scope(mesh, rules), mm.trace():
        g32, = mm.gradients([mm.cast(x32, F64) * w], [x32])
        g64, = mm.gradients([mm.cast(mm.cast(x64, "float32") * 2.0, F64) * w], [x64])
        gint, = mm.gradients([mm.cast(mm.cast(x64, "int32"), F64) * w], [x64])  # not differentiable
    assert g32.dtype == np.float32 and g64.dtype == np.float64 and gint.dtype == np.float64
    np.testing.assert_allclose(g32.to_numpy(), wa.astype(np.float32), rtol=1e-6)
    np.testing.assert_allclose(g64.to_numpy(), 2 * wa.astype(np.float32), rtol=1e-6)
    assert not np.any(gint.to_numpy())


@pytest.mark.parametrize("shape", SHAPES)
def test_reduce_max_ties_share_gradient(shape):
    mesh = get_mesh(shape)
    lay, rules = split_config(mesh)
    xa = np.tile(np.array([1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 3.0, -1.0] * 2), (8, 1))  # four ties per row
    x = mesh.from_numpy(xa, AB, {"b": lay["a"]} if lay else {})
    with mm.layout_scope(mesh, rules), mm.trace():
        g_max, = mm.gradients([mm.reduce_max(x, reduced_dims="b")], [x])
        g_min, = mm.gradients([mm.reduce_min(x, reduced_dims="b")], [x])
    np.testing.assert_allclose(g_max.to_numpy(), (xa == 3.0) / 8.0, rtol=1e-12)
    np.testing.assert_allclose(g_min.to_numpy(), (xa == -1.0) / 2.0, rtol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_backward_ops_are_recorded(shape):
    mesh = get_mesh(shape)
    lay, rules = split_config(mesh)
    xa, wa = global_array("a:8;k:16", 9, np.float64), global_array("k:16;b:8", 10, np.float64)
    x, w = mesh.from_numpy(xa, "a:8;k:16", lay), mesh.from_numpy(wa, "k:16;b:8")
    with mm.layout_scope(mesh, rules), mm.trace() as tr:
        y = mm.tanh(mm.einsum([x, w]))
        n = len(tr)
        gx, gw = mm.gradients([y], [x, w])
    new = tr.ops[n:]
    assert new, "mm.gradients recorded no backward ops"
    names = [op.name for op in new]
    assert "einsum" in names and "multiply" in names
    if big(mesh):
        assert "relayout" in names
    # The gradients are outputs of recorded ops, so a later mm.gradients can differentiate them.
    produced = {id(t) for op in new for t in op.outputs}
    assert id(gx) in produced and id(gw) in produced
    dh = 1 - np.tanh(xa @ wa) ** 2
    np.testing.assert_allclose(gx.to_numpy(), dh @ wa.T, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gw.to_numpy(), xa.T @ dh, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_second_order_through_recorded_backward(shape):
    mesh = get_mesh(shape)
    lay, rules = split_config(mesh)
    xa = global_array(AB, 11, np.float64)
    x = mesh.from_numpy(xa, AB, lay)
    with mm.layout_scope(mesh, rules), mm.trace():
        g, = mm.gradients([mm.sin(x) * x], [x], retain=True)  # cos(x) x + sin(x); kept for a second walk
        gg, = mm.gradients([g], [x])  # -sin(x) x + 2 cos(x)
    np.testing.assert_allclose(gg.to_numpy(), -np.sin(xa) * xa + 2 * np.cos(xa), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_backward_of_model_parallel_matmul_allreduces(shape):
    mesh = get_mesh(shape)
    b = big(mesh)
    if not b:
        pytest.skip("needs a mesh dim of size > 1")
    m = b[-1]
    xa, wa = global_array("batch:8;io:16", 12, np.float64), global_array("io:16;hidden:16", 13, np.float64)
    with mm.layout_scope(mesh, {"hidden": m}):
        x = mesh.from_numpy(xa, "batch:8;io:16")  # replicated
        w = mesh.from_numpy(wa, "io:16;hidden:16")  # split over hidden
        with mm.trace():
            with mm.profile() as fwd:
                y = mm.einsum([x, w])
            with mm.profile() as bwd:
                gx, gw = mm.gradients([y], [x, w])
    assert y.layout == {"hidden": m}
    assert not any(k.startswith("allreduce") for k in fwd.counters), fwd.counters
    key = f"allreduce/{m}"
    assert bwd.counters.get(key, {}).get("calls", 0) >= 1, bwd.counters
    assert bwd.counters[key]["elements"] == 8 * 16  # dx[batch, io] is summed over the hidden shards
    assert gw.layout == {"hidden": m} and gx.layout == {}
    np.testing.assert_allclose(gx.to_numpy(), np.ones((8, 16)) @ wa.T, rtol=1e-12)
    np.testing.assert_allclose(gw.to_numpy(), xa.T @ np.ones((8, 16)), rtol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_grad_ys_are_cotangents(shape):
    """gradients([y], xs, grad_ys=[c]) is the gradient of sum(y * c): J^T c, by hand in float64; c in
    another layout than y is laid out like it; several ys add up."""
    mesh = get_mesh(shape)
    lay, rules = split_config(mesh)
    xa, wa = global_array("a:8;k:16", 14, np.float64), global_array("k:16;b:8", 15, np.float64)
    ca, da = global_array("a:8;b:8", 16, np.float64), global_array("a:8;k:16", 17, np.float64)
    x, w = mesh.from_numpy(xa, "a:8;k:16", lay), mesh.from_numpy(wa, "k:16;b:8")
    c = mesh.from_numpy(ca, "a:8;b:8", {"b": lay["a"]} if lay else {})
    with mm.layout_scope(mesh, rules), mm.trace():
        y, z = mm.tanh(mm.einsum([x, w])), mm.square(x)
        gx, gw = mm.gradients([y], [x, w], grad_ys=[c], retain=True)  # (the same ops walked again below)
        gx2, = mm.gradients([y, z], [x], grad_ys=[c, mesh.from_numpy(da, "a:8;k:16")], retain=True)
        gx3, = mm.gradients([y], [x], [c])  # the contract's third positional argument
    with mm.layout_scope(mesh, rules), mm.trace() as tr:
        y = mm.tanh(mm.einsum([x, w]))
        gx4, = mm.gradients([y], [x], tr=tr)  # the trace named
    dh = (1 - np.tanh(xa @ wa) ** 2) * ca
    np.testing.assert_array_equal(gx3.to_numpy(), gx.to_numpy())
    np.testing.assert_allclose(gx4.to_numpy(), (1 - np.tanh(xa @ wa) ** 2) @ wa.T, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gx.to_numpy(), dh @ wa.T, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gw.to_numpy(), xa.T @ dh, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gx2.to_numpy(), dh @ wa.T + 2 * xa * da, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_grad_ys_errors(shape):
    mesh = get_mesh(shape)
    x = mesh.from_numpy(global_array(AB, 18, np.float64), AB)
    other = mm.Mesh(shape)
    with mm.trace():
        y = x * 2.0
        bad = [([], mm.MpimeshError, "0 grad_ys for 1 ys"),
               ([mesh.ones("a:8")], mm.ShapeError, "grad_ys[0] has shape [a:8], ys[0] has [a:8, b:16]"),
               ([mesh.ones(AB, dtype="float32")], mm.DTypeError, "dtype float32, ys[0] has float64"),
               ([other.ones(AB, dtype="float64")], mm.MeshError, "grad_ys[0] lives on mesh"),
               ([np.ones((8, 16))], TypeError, "grad_ys[0] is a ndarray")]
        for grad_ys, kind, words in bad:
            with pytest.raises(kind) as info:
                mm.gradients([y], [x], grad_ys=grad_ys)
            assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_arguments_checked(shape):
    """ys made outside the trace (they gave zeros), nothing to differentiate, non-tensors and
    integer tensors: clear errors on every rank. One tensor for ys or xs is a list of one."""
    mesh = get_mesh(shape)
    xa = global_array(AB, 19, np.float64)
    x = mesh.from_numpy(xa, AB)
    outside = mm.reduce_sum(x * x)
    with mm.trace():
        with pytest.raises(mm.MpimeshError, match=r"ys\[0\] \(\[\] float64\) was not computed in this trace"):
            mm.gradients([outside], [x])
        loss = mm.reduce_sum(x * x)
        with mm.trace():  # a helper's own trace: the loss was made in the outer one
            with pytest.raises(mm.MpimeshError, match="was not computed in this trace"):
                mm.gradients([loss], [x])
        with pytest.raises(mm.MpimeshError, match="ys is empty"):
            mm.gradients([], [x])
        with pytest.raises(TypeError, match=r"xs\[0\] is a ndarray, not a DistTensor"):
            mm.gradients([loss], [xa])
        with pytest.raises(TypeError, match="ys must be a list of tensors, got a float"):
            mm.gradients(3.0, [x])
        xi = mm.cast(x, "int32")
        with pytest.raises(mm.DTypeError, match=r"xs\[0\] is a \[a:8, b:16\] int32 tensor"):
            mm.gradients([mm.reduce_sum(mm.cast(xi, "float64"))], [xi])
        (g,) = mm.gradients(loss, x)  # one tensor each
        np.testing.assert_allclose(g.to_numpy(), 2 * xa, rtol=1e-12)
        with pytest.raises(TypeError, match=r"einsum: input 0 is a ndarray, not a DistTensor \(mesh.from_numpy"):
            mm.einsum([xa, x])
    with pytest.raises(mm.MpimeshError, match=r"call it inside the `with mm.trace\(\):` block that ran the forward"):
        mm.gradients([loss], [x])  # (after the block: the hint said to run the forward pass inside one)
    with mm.trace():
        (gx,) = mm.gradients([x], [x])  # an x among the ys: the identity
        np.testing.assert_array_equal(gx.to_numpy(), np.ones_like(xa))


@pytest.mark.parametrize("shape", SHAPES)
def test_no_gradient_work_behind_stop_gradient(shape):
    """y * stop_gradient(s) with s made from x: the rule computes dz * s for y and nothing for the
    stopped side (one multiply, not two), and the gradient ignores the path through s."""
    mesh = get_mesh(shape)
    lay, rules = split_config(mesh)
    xa = global_array(AB, 19, np.float64)
    x = mesh.from_numpy(xa, AB, lay)
    with mm.layout_scope(mesh, rules), mm.trace() as tr:
        y = mm.sin(x)
        z = y * mm.stop_gradient(mm.exp(x))
        n = len(tr)
        (g,) = mm.gradients([z], [x], grad_ys=[mesh.ones(AB, dtype="float64")])
    backward = [op.name for op in tr.ops[n:]]
    assert backward.count("multiply") == 2, backward  # dz * exp(x), then that * cos(x): the sin rule's
    np.testing.assert_allclose(g.to_numpy(), np.exp(xa) * np.cos(xa), rtol=1e-12)
