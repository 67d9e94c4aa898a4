"""DistTensor creation, round trips, random tensors, operators and elementwise functions vs numpy."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from meshes import global_array, layouts, mesh_fixture  # noqa: E402,F401 (mesh_fixture is the `mesh` fixture)

import mpimesh as mm  # noqa: E402
from mpimesh.backend import to_host  # noqa: E402

WORLD = MPI.COMM_WORLD
SHAPE = mm.Shape("a:8;b:16;c:8")  # uneven over 3 ranks
# sizes that do not divide 2, 3 or 4 ranks; b:2 leaves blocks empty on 3 and more ranks, c:0 on all
ODD = mm.Shape("a:5;b:2;c:7")
EMPTY = mm.Shape("a:3;c:0")


@pytest.fixture(scope="module")
def ref_mesh() -> mm.Mesh:
    """A one-rank mesh on COMM_SELF: the reference for mesh-independent values."""
    return mm.Mesh("all:1", comm=MPI.COMM_SELF)


def local_of(g: np.ndarray, shape: mm.Shape, mesh: mm.Mesh, layout: dict) -> np.ndarray:
    """This rank's slice of global `g`, by hand: cut each laid-out axis into k blocks like
    numpy.array_split (the first n % k one longer, some possibly empty), take ours."""
    for axis, name in enumerate(shape.names):
        m = layout.get(name)
        if m is not None:
            g = np.array_split(g, mesh.shape[m].size, axis=axis)[mesh.coords[m]]
    return g


def all_ranks(flag: bool) -> bool:
    out = np.zeros(1, np.int32)
    WORLD.Allreduce(np.array([int(flag)], np.int32), out, op=MPI.MIN)
    return bool(out[0])


# ---------------------------------------------------------------- creation

@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
@pytest.mark.parametrize("shape", [SHAPE, ODD, EMPTY])
def test_from_numpy_roundtrip(mesh: mm.Mesh, dtype, shape) -> None:
    g = (global_array(str(shape), seed=1) * 100).astype(dtype)
    for lay in layouts(mesh, list(shape.names), limit=8) + [{"c": mesh.shape.names[-1]}]:
        t = mesh.from_numpy(g, shape, layout=lay)
        assert t.shape == shape and t.layout == lay and t.dtype == dtype and t.mesh is mesh
        np.testing.assert_array_equal(to_host(t.local), local_of(g, shape, mesh, lay))
        with mm.profile() as prof:
            out = t.to_numpy()
        assert out.dtype == dtype and out.shape == g.shape
        np.testing.assert_array_equal(out, g)
        # the gathers send this rank's block, then the gathered block along the next split axis
        sent, x = 0, t.local
        for axis, name in enumerate(shape.names):
            if name in lay and mesh.shape[lay[name]].size > 1:
                sent += x.size
                x = local_of(g, shape, mesh, {d: m for d, m in lay.items() if shape.index(d) > axis})
        assert prof.elements("allgather") == sent, (lay, prof.counters)


@pytest.mark.mpi
def test_from_numpy_layout_spellings(mesh: mm.Mesh) -> None:
    m = mesh.shape.names[0]
    g = global_array("a:8;b:16")
    for spec in (f"b:{m}", [("b", m)], {"b": m}, mm.LayoutRules(f"b:{m}")):
        t = mesh.from_numpy(g, "a:8;b:16", layout=spec)
        assert t.layout == {"b": m}
        np.testing.assert_array_equal(to_host(t.local), local_of(g, t.shape, mesh, {"b": m}))
    with mm.layout_scope(mesh, f"a:{m}"):  # default: the rules in force
        t = mesh.from_numpy(g, "a:8;b:16")
    assert t.layout == {"a": m}
    np.testing.assert_array_equal(t.to_numpy(), g)


@pytest.mark.mpi
def test_from_numpy_shape_mismatch(mesh: mm.Mesh) -> None:
    try:
        mesh.from_numpy(np.zeros((8, 15)), "a:8;b:16")
        ok = False
    except mm.ShapeError as e:
        ok = "(8, 15)" in str(e) and "b:16" in str(e)
    assert all_ranks(ok)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", [SHAPE, ODD, EMPTY])
def test_from_local(mesh: mm.Mesh, shape) -> None:
    g = global_array(str(shape), seed=2)
    for lay in layouts(mesh, list(shape.names), limit=6):
        local = local_of(g, shape, mesh, lay).copy()
        t = mm.from_local(local, shape, mesh, layout=lay)
        assert t.layout == lay
        np.testing.assert_array_equal(t.to_numpy(), g)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", [SHAPE, ODD])
def test_from_local_wrong_shape_on_one_rank(mesh: mm.Mesh, shape) -> None:
    """One rank passes a block one row too long (or, uneven, another rank's block): every rank raises."""
    g = global_array(str(shape), seed=3)
    last = mesh.size - 1
    for lay in layouts(mesh, list(shape.names), limit=4):
        local = local_of(g, shape, mesh, lay)
        if mesh.rank == last:  # only one rank is wrong
            local = np.zeros((local.shape[0] + 1,) + local.shape[1:], local.dtype)
        try:
            mm.from_local(local, shape, mesh, layout=lay)
            ok = False
        except mm.ShapeError as e:
            ok = f"a:{shape[0].size}" in str(e)
        assert all_ranks(ok), lay
    if mesh.size > 1:  # every rank passes the first rank's block: wrong wherever blocks differ
        m = mesh.shape.names[0] if mesh.shape[0].size > 1 else mesh.shape.names[-1]
        first = np.array_split(g, mesh.shape[m].size, axis=0)[0]
        try:
            mm.from_local(first, shape, mesh, layout={"a": m})
            ok = shape[0].size % mesh.shape[m].size == 0
        except mm.ShapeError as e:
            ok = shape[0].size % mesh.shape[m].size != 0 and "a:" in str(e)
        assert all_ranks(ok)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", [SHAPE, ODD, EMPTY])
def test_zeros_ones_full(mesh: mm.Mesh, shape) -> None:
    for lay in layouts(mesh, list(shape.names), limit=4):
        z, o = mesh.zeros(shape, layout=lay), mesh.ones(shape, layout=lay)
        f = mesh.full(shape, 2.5, "float64", layout=lay)
        i = mesh.full(shape, 7, dtype=np.int32, layout=lay)
        for t, value, dtype in ((z, 0, np.float32), (o, 1, np.float32), (f, 2.5, np.float64), (i, 7, np.int32)):
            assert t.layout == lay and t.dtype == dtype
            assert t.local.shape == local_of(np.empty(shape.sizes), shape, mesh, lay).shape
            np.testing.assert_array_equal(t.to_numpy(), np.full(shape.sizes, value, dtype))


@pytest.mark.mpi
@pytest.mark.parametrize("n", [16, 7, 2])
def test_range(mesh: mm.Mesh, n: int) -> None:
    dim = mm.Dimension("a", n)
    for lay in layouts(mesh, ["a"]):
        r = mm.range(mesh, dim, layout=lay)
        assert r.shape == mm.Shape([dim]) and r.dtype == np.int32 and r.layout == lay
        np.testing.assert_array_equal(to_host(r.local), local_of(np.arange(n), r.shape, mesh, lay))
        np.testing.assert_array_equal(r.to_numpy(), np.arange(n))
        f = mm.range(mesh, dim, dtype="float32", layout=lay)
        assert f.dtype == np.float32
        np.testing.assert_array_equal(f.to_numpy(), np.arange(n, dtype=np.float32))


# ---------------------------------------------------------------- random

@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["normal", "uniform"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_random_layout_independent(mesh: mm.Mesh, ref_mesh: mm.Mesh, kind: str, dtype: str) -> None:
    def make(on, lay):
        if kind == "normal":
            return on.random_normal(SHAPE, seed=11, mean=1.0, stddev=3.0, dtype=dtype, layout=lay)
        return on.random_uniform(SHAPE, seed=11, minval=-2.0, maxval=5.0, dtype=dtype, layout=lay)
    ref = make(ref_mesh, None).to_numpy()
    assert ref.dtype == np.dtype(dtype) and len(np.unique(ref)) > SHAPE.size // 2
    for lay in layouts(mesh, list(SHAPE.names), limit=6):
        t = make(mesh, lay)
        assert t.layout == lay
        np.testing.assert_array_equal(to_host(t.local), local_of(ref, SHAPE, mesh, lay))
        np.testing.assert_array_equal(t.to_numpy(), ref)
    m = mesh.shape.names[-1]
    with mm.layout_scope(mesh, f"b:{m}"):
        t = make(mesh, None)
    assert t.layout == {"b": m}
    np.testing.assert_array_equal(t.to_numpy(), ref)


@pytest.mark.mpi
def test_random_arguments(mesh: mm.Mesh) -> None:
    """Whole-number uniforms are the floor of the float draw, in [minval, maxval) also below 0 (they
    were truncated toward 0); a bool or an empty range, a normal of whole numbers and a seed past 64
    bits (it aliased another modulo 2**64) are refused."""
    f = mesh.random_uniform(SHAPE, seed=3, minval=-3.0, maxval=3.0, dtype="float64").to_numpy()
    i = mesh.random_uniform(SHAPE, seed=3, minval=-3.0, maxval=3.0, dtype="int32").to_numpy()
    np.testing.assert_array_equal(i, np.floor(f).astype(np.int32))
    assert i.min() >= -3 and i.max() <= 2 and (i < 0).any()
    for fn, kind, words in ((lambda: mesh.random_uniform(SHAPE, seed=1, dtype="bool"), mm.DTypeError, "bool"),
                            (lambda: mesh.random_uniform(SHAPE, seed=1, minval=2.0, maxval=1.0), mm.MpimeshError,
                             "minval 2.0 is above maxval 1.0"),
                            (lambda: mesh.random_normal(SHAPE, seed=1, dtype="int32"), mm.DTypeError, "int32"),
                            (lambda: mesh.random_normal(SHAPE, seed=2 ** 64 + 5), mm.MpimeshError, "fit in 64 bits")):
        with pytest.raises(kind, match=words):
            fn()


@pytest.mark.mpi
def test_random_moments(mesh: mm.Mesh) -> None:
    shape = mm.Shape("a:256;b:256")  # 64k samples
    lay = {"a": mesh.shape.names[0]}
    z = mesh.random_normal(shape, seed=3, layout=lay).to_numpy().astype(np.float64)
    assert abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.02
    assert abs(np.mean(z ** 3)) < 0.05 and abs(np.mean(z ** 4) - 3) < 0.1  # skew 0, kurtosis 3
    assert 0.67 < np.mean(np.abs(z) < 1) < 0.70  # 68.3% within one sigma
    z = mesh.random_normal(shape, seed=4, mean=3.0, stddev=2.0, layout=lay).to_numpy().astype(np.float64)
    assert abs(z.mean() - 3) < 0.04 and abs(z.std() - 2) < 0.04
    u = mesh.random_uniform(shape, seed=5, layout=lay).to_numpy().astype(np.float64)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    assert np.all(np.histogram(u, bins=16, range=(0, 1))[0] > shape.size / 16 * 0.9)
    u = mesh.random_uniform(shape, seed=6, minval=-3.0, maxval=5.0, layout=lay).to_numpy().astype(np.float64)
    assert u.min() >= -3 and u.max() < 5
    assert abs(u.mean() - 1) < 0.08 and abs(u.var() - 64 / 12) < 0.2


@pytest.mark.mpi
@pytest.mark.parametrize("dtype,lo,hi", [("float16", 0.0, 1.0), ("float32", 1000.0, 1001.0), ("float64", -1.0, 0.0)])
def test_random_uniform_half_open(mesh: mm.Mesh, dtype: str, lo: float, hi: float) -> None:
    """Values stay below maxval even where rounding to a narrow dtype would reach it."""
    u = mesh.random_uniform("a:256;b:256", seed=9, minval=lo, maxval=hi, dtype=dtype,
                            layout={"b": mesh.shape.names[0]}).to_numpy()
    assert u.dtype == np.dtype(dtype)
    assert float(u.min()) >= lo and float(u.max()) < hi


@pytest.mark.mpi
def test_random_seeds_differ(mesh: mm.Mesh) -> None:
    lay = {"a": mesh.shape.names[0]}
    a = mesh.random_normal(SHAPE, seed=1, layout=lay).to_numpy()
    b = mesh.random_normal(SHAPE, seed=2, layout=lay).to_numpy()
    c = mesh.random_uniform(SHAPE, seed=1, layout=lay).to_numpy()
    d = mesh.random_uniform(SHAPE, seed=2, layout=lay).to_numpy()
    assert np.mean(a != b) > 0.99 and np.mean(c != d) > 0.99
    assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.1
    # the same seed twice is the same tensor
    np.testing.assert_array_equal(a, mesh.random_normal(SHAPE, seed=1, layout=lay).to_numpy())


# ---------------------------------------------------------------- operators

def _combos(mesh: mm.Mesh):
    """(x layout, y layout, output rules) triples with differing x and y layouts."""
    lx = layouts(mesh, ["a", "b"], limit=3)
    ly = layouts(mesh, ["b", "c"], limit=3)[::-1]
    m = mesh.shape.names[-1]
    rules = ["", f"c:{m}", f"b:{m}"]
    return list(zip(lx, ly, rules))


X = global_array("a:8;b:16", seed=20)
Y = global_array("b:16;c:8", seed=21)
XP = np.abs(X) + 0.5  # positive, for / ** log sqrt
YP = np.abs(Y) + 0.5


def _check(t: mm.DistTensor, want: np.ndarray, shape: str, exact: bool = False) -> None:
    assert t.shape == mm.Shape(shape)
    got = t.to_numpy()
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.mpi
def test_binary_operators(mesh: mm.Mesh) -> None:
    xb, yb = XP[:, :, None], YP[None, :, :]  # x's dims, then y's new dims
    for lx, ly, rules in _combos(mesh):
        x = mesh.from_numpy(XP, "a:8;b:16", layout=lx)
        y = mesh.from_numpy(YP, "b:16;c:8", layout=ly)
        with mm.layout_scope(mesh, rules):
            out = "a:8;b:16;c:8"
            z = x + y
            assert z.layout == mesh.tensor_layout(out)
            _check(z, xb + yb, out)
            _check(x - y, xb - yb, out)
            _check(x * y, xb * yb, out)
            _check(x / y, xb / yb, out)
            _check(x ** y, xb ** yb, out)
            _check(y - x, (YP[:, :, None] - XP.T[:, None, :]), "b:16;c:8;a:8")  # y's dims first
            for got, want in ((x < y, xb < yb), (x <= y, xb <= yb), (x > y, xb > yb), (x >= y, xb >= yb),
                              (x == y, xb == yb), (x != y, xb != yb)):
                _check(got, want, out, exact=True)
            _check(x == x, np.ones(X.shape, bool), "a:8;b:16", exact=True)


@pytest.mark.mpi
def test_operators_dim_order_and_subset(mesh: mm.Mesh) -> None:
    """y's dims in another order, and y's dims a subset of x's."""
    for lx, ly, rules in _combos(mesh):
        x = mesh.from_numpy(XP, "a:8;b:16", layout=lx)
        yt = mesh.from_numpy(np.ascontiguousarray(YP.T), "c:8;b:16", layout=ly)
        b = mesh.from_numpy(YP[:, 0], "b:16", layout={k: v for k, v in ly.items() if k == "b"})
        with mm.layout_scope(mesh, rules):
            _check(x * yt, XP[:, :, None] * YP[None, :, :], "a:8;b:16;c:8")
            _check(yt - x, YP.T[:, :, None] - XP.T[None, :, :], "c:8;b:16;a:8")
            _check(x - b, XP - YP[:, 0][None, :], "a:8;b:16")
            _check(b - x, YP[:, 0][:, None] - XP.T, "b:16;a:8")


@pytest.mark.mpi
def test_scalar_operators(mesh: mm.Mesh) -> None:
    for lx, _, rules in _combos(mesh)[1:]:
        x = mesh.from_numpy(XP, "a:8;b:16", layout=lx)
        with mm.layout_scope(mesh, rules):
            s = "a:8;b:16"
            _check(x + 2.0, XP + 2.0, s)
            _check(2.0 + x, 2.0 + XP, s)
            _check(x - 2.0, XP - 2.0, s)
            _check(2.0 - x, 2.0 - XP, s)
            _check(x * 3.0, XP * 3.0, s)
            _check(3.0 * x, 3.0 * XP, s)
            _check(x / 4.0, XP / 4.0, s)
            _check(4.0 / x, 4.0 / XP, s)
            _check(x ** 2, XP ** 2, s)
            _check(2.0 ** x, 2.0 ** XP, s)
            _check(np.float32(3) * x, np.float32(3) * XP, s)
            _check(-x, -XP, s, exact=True)
            _check(x < 1.0, XP < 1.0, s, exact=True)
            _check(1.0 < x, 1.0 < XP, s, exact=True)
            _check(x >= 1.0, XP >= 1.0, s, exact=True)
            _check(1.0 >= x, 1.0 >= XP, s, exact=True)
            _check(x == float(XP[0, 0]), XP == XP[0, 0], s, exact=True)
            _check(x != float(XP[0, 0]), XP != XP[0, 0], s, exact=True)
            assert (x + 1.0).layout == mesh.tensor_layout(s)


@pytest.mark.mpi
def test_axpy(mesh: mm.Mesh) -> None:
    """alpha * x + y against numpy, x and y in differing layouts (y's dims in another order), alpha a
    number or a 0-d tensor; float32 in, float32 out; bad input refused on every rank."""
    yt = np.ascontiguousarray(XP.T)
    for lx, ly, rules in _combos(mesh):
        x = mesh.from_numpy(X, "a:8;b:16", layout=lx)
        y = mesh.from_numpy(yt, "b:16;a:8", layout={k: v for k, v in ly.items() if k == "b"})
        with mm.layout_scope(mesh, rules):
            z = mm.axpy(-0.25, x, y)
            assert z.layout == mesh.tensor_layout("a:8;b:16")
            _check(z, np.float32(-0.25) * X + XP, "a:8;b:16")
            _check(mm.axpy(mesh.from_numpy(np.array(3.0, np.float32), []), x, y), 3 * X + XP, "a:8;b:16")
    rng = np.random.default_rng(5)  # blocks over several of the kernel's chunks, and a part chunk
    big_x, big_y = (rng.standard_normal((1000, 700)).astype(np.float32) for _ in range(2))
    for layout in ({}, {"r": mesh.shape.names[0]}):
        bx = mesh.from_numpy(big_x, "r:1000;c:700", layout=layout)
        by = mesh.from_numpy(big_y, "r:1000;c:700", layout=layout)
        np.testing.assert_array_equal(mm.axpy(-0.3, bx, by).to_numpy(), np.float32(-0.3) * big_x + big_y)
    s, t = mesh.from_numpy(np.array(2.0), []), mesh.from_numpy(np.array(3.0), [])  # 0-d x and y
    _check(mm.axpy(0.5, s, t), np.array(4.0), "")
    b16, f16 = mm.cast(mesh.from_numpy(X, "a:8;b:16"), "bfloat16"), mm.cast(mesh.from_numpy(XP, "a:8;b:16"), "float16")
    z = mm.axpy(0.5, b16, f16)  # (numpy finds no common dtype: it was a raw DTypePromotionError) float32, as +
    assert z.dtype == (b16 + f16).dtype == np.float32
    np.testing.assert_array_equal(z.to_numpy(), np.float32(0.5) * b16.to_numpy().astype(np.float32)
                                  + f16.to_numpy().astype(np.float32))
    x, y = mesh.from_numpy(X, "a:8;b:16"), mesh.from_numpy(Y, "b:16;c:8")
    for fn, kind, words in ((lambda: mm.axpy(2.0, x, y), mm.ShapeError, "the same dims"),
                            (lambda: mm.axpy(x, x, x), mm.ShapeError, "0-d tensor"),
                            (lambda: mm.axpy(2.0, X, x), TypeError, "x must be a DistTensor")):
        try:
            fn()
            ok = False
        except kind as e:
            ok = words in str(e)
        assert all_ranks(ok)


@pytest.mark.mpi
def test_0d_tensors_stay_0d(mesh: mm.Mesh) -> None:
    """A 0-d tensor's block is a 0-d array through where (nested: a where of wheres), broadcast and
    arithmetic, each value numpy's (a loss scale's update is all 0-d)."""
    s, t = mesh.from_numpy(np.array(4.0), []), mesh.from_numpy(np.array(-1.0), [])
    yes = mm.greater(s, 0.0)
    inner = mm.where(yes, s * 2.0, t)
    outer = mm.where(mm.less(t, 0.0), mm.where(yes, inner, t), s * 0.5)
    for got, want in ((inner, 8.0), (outer, 8.0), (mm.where(mm.less(s, 0.0), s, 7), 7.0),
                      (mm.broadcast(t, mm.Shape([])), -1.0), (mm.where(yes, 1, t) + s, 5.0)):
        assert got.shape.rank == 0 and got.local.shape == () and float(got.to_numpy()) == want, (got, want)


@pytest.mark.mpi
def test_operator_size_mismatch(mesh: mm.Mesh) -> None:
    x = mesh.from_numpy(X, "a:8;b:16")
    y = mesh.from_numpy(np.ones((8, 8)), "b:8;c:8")
    for fn in (lambda: x + y, lambda: y * x, lambda: x < y, lambda: mm.maximum(x, y)):
        try:
            fn()
            ok = False
        except mm.ShapeError as e:
            ok = "'b'" in str(e) and "16" in str(e) and "8" in str(e)
        assert all_ranks(ok)


# ---------------------------------------------------------------- elementwise functions

def _np_gelu(a):
    return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))


UNARY = {
    "relu": (lambda a: np.maximum(a, 0), X),
    "gelu": (_np_gelu, X),
    "exp": (np.exp, X),
    "log": (np.log, XP),
    "sqrt": (np.sqrt, XP),
    "rsqrt": (lambda a: 1 / np.sqrt(a), XP),
    "tanh": (np.tanh, X),
    "sigmoid": (lambda a: 1 / (1 + np.exp(-a)), X * 4),
    "square": (lambda a: a * a, X),
    "abs": (np.abs, X),
    "sin": (np.sin, X),
    "cos": (np.cos, X),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_functions(mesh: mm.Mesh, name: str) -> None:
    ref, data = UNARY[name]
    want = ref(data.astype(np.float64)).astype(np.float32)
    for lx, _, rules in _combos(mesh)[:2]:
        x = mesh.from_numpy(data, "a:8;b:16", layout=lx)
        with mm.layout_scope(mesh, rules):
            y = getattr(mm, name)(x)
            assert y.shape == x.shape and y.dtype == np.float32
            assert y.layout == mesh.tensor_layout(x.shape)
            np.testing.assert_allclose(y.to_numpy(), want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_sigmoid_extremes() -> None:
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    a = np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0], np.float64)
    with np.errstate(over="raise", invalid="raise"):
        got = mm.sigmoid(mesh.from_numpy(a, "a:5")).to_numpy()
    np.testing.assert_allclose(got, [0.0, 1 / (1 + np.exp(50.0)), 0.5, 1 / (1 + np.exp(-50.0)), 1.0], atol=1e-20)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["minimum", "maximum"])
def test_minimum_maximum(mesh: mm.Mesh, name: str) -> None:
    ref = getattr(np, name)
    for lx, ly, rules in _combos(mesh):
        x = mesh.from_numpy(X, "a:8;b:16", layout=lx)
        y = mesh.from_numpy(Y, "b:16;c:8", layout=ly)
        with mm.layout_scope(mesh, rules):
            fn = getattr(mm, name)
            _check(fn(x, y), ref(X[:, :, None], Y[None, :, :]), "a:8;b:16;c:8", exact=True)
            _check(fn(x, 0.0), ref(X, np.float32(0)), "a:8;b:16", exact=True)
            _check(fn(0.0, x), ref(X, np.float32(0)), "a:8;b:16", exact=True)
