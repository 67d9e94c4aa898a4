"""Property tests: every op family on random dim sizes 0..40 under random layouts, against numpy.

Sizes rarely divide the mesh dims, so blocks are uneven and often empty (a dim of size 2 over 4
ranks). Each example draws one of this rank count's 1-D, 2-D and 3-D meshes, dim sizes, the inputs'
layouts and the output rules; the result must equal numpy on the global float64 arrays, and each
rank's `.local` must be block c of `numpy.array_split` under the result's layout. Hypothesis draws
the same examples on every rank (tests/conftest.py), and each verdict is agreed across ranks before
it is asserted, so a failure on one rank fails all of them instead of hanging the others.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.backend import to_host  # noqa: E402
from meshes import expected_local, get_mesh, mesh_shapes  # noqa: E402

EXAMPLES = {1: 25, 2: 20, 3: 20, 4: 15}.get(MPI.COMM_WORLD.Get_size(), 10)
SIZE = st.integers(0, 40)
POSITIVE = st.integers(1, 40)


def pick(d, dims: tuple):
    """A mesh of this rank count (1-D, 2-D or 3-D), and a function drawing layouts of some of `dims` on it."""
    mesh = get_mesh(d.draw(st.sampled_from(mesh_shapes())))
    mdims = [m.name for m in mesh.shape if m.size > 1]

    def lay(*names: str) -> dict:
        """Layout of a tensor with dims `names` (default: rules over every dim)."""
        out: dict = {}
        for n in names or dims:
            m = d.draw(st.sampled_from([None] + [m for m in mdims if m not in out.values()]))
            if m:
                out[n] = m
        return out
    return mesh, lay


def data(shape: str, seed: int, dtype=np.float64) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(mm.Shape(shape).sizes).astype(dtype)


def agree(ok: bool, what: str) -> None:
    """Assert `ok` on every rank (the ranks' verdicts are combined first)."""
    assert MPI.COMM_WORLD.allreduce(bool(ok), op=MPI.LAND), what


def check(y, want: np.ndarray, what: str, rtol: float = 1e-9) -> None:
    """`y` holds `want` globally, and this rank's block of it under y's layout."""
    got = y.to_numpy()
    local = to_host(y.local)
    block = expected_local(want, y.shape.names, y.layout, y.mesh)
    ok = got.shape == want.shape and np.allclose(got, want, rtol=rtol, atol=rtol) and \
        local.shape == block.shape and np.allclose(local, block, rtol=rtol, atol=rtol)
    agree(ok, f"{what}: layout {y.layout}, global {got.shape} vs {want.shape}, local {local.shape} vs {block.shape}")


def scoped(mesh: mm.Mesh, rules: dict, fn):
    with mm.layout_scope(mesh, rules):
        return fn()


COMMON = settings(max_examples=EXAMPLES)


@COMMON
@given(st.data(), SIZE, SIZE, SIZE)
def test_elementwise_einsum_and_its_gradient(d, a, b, c):
    mesh, lay = pick(d, ("a", "b", "c"))
    X, W, Y = data(f"a:{a};b:{b}", 1), data(f"b:{b};c:{c}", 2), data(f"b:{b}", 3)
    x = mesh.from_numpy(X, f"a:{a};b:{b}", layout=lay("a", "b"))
    w = mesh.from_numpy(W, f"b:{b};c:{c}", layout=lay("b", "c"))
    y = mesh.from_numpy(Y, f"b:{b}", layout=lay("b"))
    rules = lay()
    check(scoped(mesh, rules, lambda: x * y + 1.0), X * Y + 1.0, "x * y + 1")
    with mm.trace():
        out = scoped(mesh, rules, lambda: mm.einsum([x, w], reduced_dims=["b"]))
        G = data(f"a:{a};c:{c}", 4)
        loss = mm.reduce_sum(out * mesh.from_numpy(G, f"a:{a};c:{c}", layout=lay("a", "c")))
        gx, gw = mm.gradients([loss], [x, w])
    check(out, X @ W, "einsum")
    check(gx, G @ W.T, "d einsum / dx")
    check(gw, X.T @ G, "d einsum / dw")


@COMMON
@given(st.data(), POSITIVE, POSITIVE)
def test_reductions_softmax_and_cumsum(d, a, b):
    mesh, lay = pick(d, ("a", "b"))
    X = data(f"a:{a};b:{b}", 5)
    x = mesh.from_numpy(X, f"a:{a};b:{b}", layout=lay("a", "b"))
    rules = lay()
    check(scoped(mesh, rules, lambda: mm.reduce_sum(x, reduced_dims="b")), X.sum(1), "reduce_sum")
    check(scoped(mesh, rules, lambda: mm.reduce_max(x, reduced_dims="a")), X.max(0), "reduce_max")
    check(scoped(mesh, rules, lambda: mm.reduce_mean(x)), np.array(X.mean()), "reduce_mean all")
    e = np.exp(X - X.max(1, keepdims=True))
    check(scoped(mesh, rules, lambda: mm.softmax(x, "b")), e / e.sum(1, keepdims=True), "softmax")
    check(scoped(mesh, rules, lambda: mm.cumsum(x, "a")), X.cumsum(0), "cumsum")
    check(scoped(mesh, rules, lambda: mm.argmax(x, "b")), X.argmax(1), "argmax")
    k = d.draw(st.integers(1, b))
    vals, idx = scoped(mesh, rules, lambda: mm.top_k(x, "b", f"k:{k}"))
    order = np.argsort(-X, axis=1, kind="stable")[:, :k]
    check(vals, np.take_along_axis(X, order, 1), "top_k values")
    check(idx, order, "top_k indices")


@COMMON
@given(st.data(), SIZE, SIZE, SIZE)
def test_relayout_reshape_slice_concat(d, a, b, a2):
    mesh, lay = pick(d, ("a", "b", "ab"))
    X, X2 = data(f"a:{a};b:{b}", 6), data(f"a:{a2};b:{b}", 7)
    x = mesh.from_numpy(X, f"a:{a};b:{b}", layout=lay("a", "b"))
    check(mm.relayout(x, lay("a", "b")), X, "relayout")
    rules = lay()
    check(scoped(mesh, rules, lambda: mm.reshape(x, f"ab:{a * b}")), X.reshape(-1), "reshape merge")
    begin = d.draw(st.integers(0, a))
    size = d.draw(st.integers(0, a - begin))
    check(scoped(mesh, rules, lambda: mm.slice(x, begin, size, "a")), X[begin:begin + size], "slice")
    x2 = mesh.from_numpy(X2, f"a:{a2};b:{b}", layout=lay("a", "b"))
    check(scoped(mesh, rules, lambda: mm.concat([x, x2], "a")), np.concatenate([X, X2]), "concat")


@COMMON
@given(st.data(), SIZE, POSITIVE, st.booleans())
def test_shift_and_halo(d, a, b, wrap):
    mesh, lay = pick(d, ("a", "b"))
    X = data(f"a:{a};b:{b}", 8)
    x = mesh.from_numpy(X, f"a:{a};b:{b}", layout=lay("a", "b"))
    off = d.draw(st.integers(-a, a)) if a else 0
    if wrap:
        want = np.roll(X, off, axis=0)
    else:
        want = np.zeros_like(X)
        if off >= 0:
            want[off:] = X[:a - off]
        else:
            want[:a + off] = X[-off:]
    check(scoped(mesh, lay(), lambda: mm.shift(x, off, "a", wrap)), want, f"shift {off} wrap={wrap}")


@COMMON
@given(st.data(), SIZE, POSITIVE, SIZE)
def test_gather_and_one_hot(d, a, v, c):
    mesh, lay = pick(d, ("a", "v", "c"))
    W = data(f"v:{v};c:{c}", 9)
    I = np.random.default_rng(10).integers(0, v, size=a).astype(np.int32)
    w = mesh.from_numpy(W, f"v:{v};c:{c}", layout=lay("v", "c"))
    i = mesh.from_numpy(I, f"a:{a}", layout=lay("a"))
    rules = lay()
    check(scoped(mesh, rules, lambda: mm.gather(w, i, "v")), W[I], "gather")
    check(scoped(mesh, rules, lambda: mm.one_hot(i, f"v:{v}", dtype="float64")), np.eye(v)[I], "one_hot")


@COMMON
@given(st.data(), st.integers(1, 12), st.integers(1, 30), st.integers(1, 5), st.sampled_from(["SAME", "VALID"]))
def test_conv1d(d, batch, length, taps, padding):
    if padding == "VALID" and length < taps:
        length = taps  # VALID needs at least one output position
    mesh, lay = pick(d, ("batch", "len", "co"))
    X, F = data(f"batch:{batch};len:{length};ci:2", 11), data(f"tap:{taps};ci:2;co:3", 12)
    x = mesh.from_numpy(X, f"batch:{batch};len:{length};ci:2", layout=lay("batch", "len"))
    f = mesh.from_numpy(F, f"tap:{taps};ci:2;co:3", layout=lay("co"))
    lo = (taps - 1) // 2 if padding == "SAME" else 0
    xp = np.pad(X, ((0, 0), (lo, taps - 1 - lo), (0, 0))) if padding == "SAME" else X
    n = xp.shape[1] - taps + 1
    want = sum(np.einsum("bli,io->blo", xp[:, t:t + n], F[t]) for t in range(taps))
    check(scoped(mesh, lay(), lambda: mm.conv1d(x, f, padding=padding)), want, f"conv1d {padding}")
