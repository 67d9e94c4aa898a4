"""mm.reduce_sum/mean/max/min/logsumexp against numpy on the global arrays, over 1-D/2-D/3-D meshes
and many layouts; logsumexp's numerical stability; allreduces only over split reduced dims."""
from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import (  # noqa: E402
    big, collectives, Errors, expected_local, get_mesh, global_array, layouts, mesh_shapes)

import mpimesh as mm  # noqa: E402
from mpimesh.backend import to_host  # noqa: E402

SHAPES = mesh_shapes()
XSHAPE = "a:8;b:8;c:8"
NAMES = ("a", "b", "c")


def np_logsumexp(x: np.ndarray, axis: tuple) -> np.ndarray:
    """Stable float64 reference."""
    x = x.astype(np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.squeeze(np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m, axis=axis)


NP_OPS = {
    "reduce_sum": lambda x, ax: np.sum(x.astype(np.float64) if x.dtype.kind == "f" else x, axis=ax),
    "reduce_mean": lambda x, ax: np.mean(x.astype(np.float64), axis=ax),
    "reduce_max": lambda x, ax: np.max(x, axis=ax),
    "reduce_min": lambda x, ax: np.min(x, axis=ax),
    "reduce_logsumexp": np_logsumexp,
}

# (output_shape, reduced_dim) -> the output dim names
SPECS = [
    ("a:8;c:8", None, ("a", "c")),
    ("c:8;a:8", None, ("c", "a")),
    ([mm.Dimension("b", 8)], None, ("b",)),
    ("b:8;a:8;c:8", None, ("b", "a", "c")),  # nothing reduced: a pure transpose
    (None, "b", ("a", "c")),
    (None, mm.Dimension("b", 8), ("a", "c")),
    (None, ["a", "c"], ("b",)),
    (None, ["a", mm.Dimension("b", 8)], ("c",)),
    (None, None, ()),
]


def reference(op: str, x: np.ndarray, out: tuple) -> np.ndarray:
    axes = tuple(i for i, n in enumerate(NAMES) if n not in out)
    y = np.asarray(NP_OPS[op](x, axes))
    kept = [n for n in NAMES if n in out]
    return np.transpose(y, [kept.index(n) for n in out])


def run(op: str, x, output_shape, reduced_dims):
    return getattr(mm, op)(x, output_shape=output_shape, reduced_dims=reduced_dims)


def check(errs: Errors, what: str, y, ref: np.ndarray, out: tuple, rules: dict, dtype, tol: float) -> None:
    mesh = y.mesh
    errs.expect(y.shape.names == out, f"{what}: shape {y.shape} != {out}")
    errs.expect(y.dtype == np.dtype(dtype), f"{what}: dtype {y.dtype} != {np.dtype(dtype)}")
    want_layout = {d: m for d, m in rules.items() if d in out}
    errs.expect(y.layout == want_layout, f"{what}: layout {y.layout} != {want_layout}")
    local, want = to_host(y.local), expected_local(ref, out, y.layout, mesh)
    errs.expect(local.shape == want.shape, f"{what}: local shape {local.shape} != {want.shape}")
    if local.shape == want.shape:
        errs.close(what, local, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("op", list(NP_OPS))
@pytest.mark.parametrize("mshape", SHAPES)
def test_reduce_values(mshape: str, op: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    xa = global_array(XSHAPE, 1)
    bd = big(mesh)
    rules_list = [{}] + [{"b": m, "c": bd[0]} for m in bd[1:2]] + [{"a": m} for m in bd[:1]] * (len(bd) < 2)
    for rules in rules_list:
        for lay in layouts(mesh, list(NAMES), limit=4):
            x = mesh.from_numpy(xa, XSHAPE, layout=lay)
            for output_shape, reduced_dim, out in SPECS:
                with mm.layout_scope(mesh, rules):
                    y = run(op, x, output_shape, reduced_dim)
                check(errs, f"{op} out={output_shape} red={reduced_dim} x={lay} rules={rules}", y,
                      reference(op, xa, out), out, rules, np.float32, 1e-5)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_reduce_float64_and_int32(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    xf = global_array(XSHAPE, 2, np.float64)
    xi = np.random.default_rng(3).integers(-50, 50, size=(8, 8, 8)).astype(np.int32)
    for lay in layouts(mesh, list(NAMES), limit=4):
        x = mesh.from_numpy(xf, XSHAPE, layout=lay)
        for op in NP_OPS:
            for output_shape, reduced_dim, out in (SPECS[0], SPECS[6], SPECS[-1]):
                y = run(op, x, output_shape, reduced_dim)
                check(errs, f"f64 {op} {out} x={lay}", y, reference(op, xf, out), out, {}, np.float64, 1e-12)
        x = mesh.from_numpy(xi, XSHAPE, layout=lay)
        for op in ("reduce_sum", "reduce_max", "reduce_min"):
            for output_shape, reduced_dim, out in (SPECS[1], SPECS[7], SPECS[-1]):
                y = run(op, x, output_shape, reduced_dim)
                check(errs, f"i32 {op} {out} x={lay}", y, reference(op, xi, out), out, {}, np.int32, 0)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_scalar_to_numpy(mshape: str) -> None:
    mesh = get_mesh(mshape)
    xa = global_array(XSHAPE, 4, np.float64)
    lay = dict(zip(NAMES, big(mesh)))
    x = mesh.from_numpy(xa, XSHAPE, layout=lay)
    ys = {op: getattr(mm, op)(x) for op in NP_OPS}
    got = {op: y.to_numpy() for op, y in ys.items()}
    for op, y in ys.items():  # a 0-d array, never a numpy scalar, whatever the mesh
        assert isinstance(y.local, mesh.xp.ndarray) and y.local.shape == () and y.shape == mm.Shape([]), op
    for op, value in got.items():
        assert np.shape(value) == ()
        np.testing.assert_allclose(value, reference(op, xa, ()), rtol=1e-12, atol=1e-12, err_msg=op)


@pytest.mark.parametrize("mshape", SHAPES)
def test_allreduce_only_over_split_reduced_dims(mshape: str) -> None:
    """Output laid out as x's kept dims: the only collective is an allreduce over the mesh dims of
    the split reduced dims (two for logsumexp: max, then sum), one output-sized buffer each."""
    mesh, errs = get_mesh(mshape), Errors()
    xa = global_array(XSHAPE, 5)
    order = list(mesh.shape.names)
    for lay in layouts(mesh, list(NAMES), limit=7):
        x = mesh.from_numpy(xa, XSHAPE, layout=lay)
        for output_shape, reduced_dim, out in (SPECS[0], SPECS[6], SPECS[3], SPECS[-1]):
            rules = {d: m for d, m in lay.items() if d in out}
            split = sorted((m for d, m in lay.items() if d not in out), key=order.index)
            local_out = 1
            for d in out:
                local_out *= 8 // (mesh.shape[rules[d]].size if d in rules else 1)
            for op in NP_OPS:
                with mm.layout_scope(mesh, rules), mm.profile() as prof:
                    y = run(op, x, output_shape, reduced_dim)
                calls = 2 if op == "reduce_logsumexp" else 1
                want = ({f"allreduce/{'+'.join(split)}": {"calls": calls, "elements": calls * local_out,
                                                          "bytes": 4 * calls * local_out}} if split else {})
                errs.expect(collectives(prof) == want, f"{op} out={out} x={lay}: {collectives(prof)} != {want}")
                check(errs, f"{op} out={out} x={lay}", y, reference(op, xa, out), out, rules, np.float32, 1e-5)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_size_one_mesh_dims_never_allreduce(mshape: str) -> None:
    mesh = get_mesh(mshape)
    ones = [d.name for d in mesh.shape if d.size == 1]
    xa = global_array(XSHAPE, 6)
    x = mesh.from_numpy(xa, XSHAPE, layout=dict(zip(("b", "c"), ones)))
    with mm.profile() as prof:
        y = mm.reduce_sum(x, reduced_dims=["b", "c"])
    assert collectives(prof) == {}
    np.testing.assert_allclose(to_host(y.local), xa.astype(np.float64).sum(axis=(1, 2)), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ logsumexp stability

@pytest.mark.parametrize("mshape", SHAPES)
def test_logsumexp_large_and_small_values(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    base = global_array(XSHAPE, 7)
    for shift in (1e4, -1e4, 80.0):
        xa = (base + np.float32(shift)).astype(np.float32)
        for lay in layouts(mesh, list(NAMES), limit=5):
            x = mesh.from_numpy(xa, XSHAPE, layout=lay)
            for output_shape, reduced_dim, out in (SPECS[4], SPECS[6], SPECS[-1]):
                y = mm.reduce_logsumexp(x, output_shape=output_shape, reduced_dims=reduced_dim)
                errs.expect(bool(np.all(np.isfinite(to_host(y.local)))), f"shift {shift} {out} x={lay}: {to_host(y.local)}")
                check(errs, f"shift {shift} {out} x={lay}", y, reference("reduce_logsumexp", xa, out), out, {},
                      np.float32, 1e-5)
    errs.check()


@pytest.mark.filterwarnings("error::RuntimeWarning")  # -inf rows give -inf quietly
@pytest.mark.parametrize("mshape", SHAPES)
def test_logsumexp_minus_inf(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    xa = global_array(XSHAPE, 8)
    xa[3] = -np.inf            # a whole a-row: -inf
    xa[5, :4, :] = -np.inf     # half of a row: finite, though some ranks hold only -inf
    xa[6, :, 1] = -np.inf      # one column of a row
    for lay in layouts(mesh, list(NAMES), limit=6):
        x = mesh.from_numpy(xa, XSHAPE, layout=lay)
        for output_shape, reduced_dim, out in (SPECS[0], ("a:8", None, ("a",)), (None, ["b", "c"], ("a",))):
            y = mm.reduce_logsumexp(x, output_shape=output_shape, reduced_dims=reduced_dim)
            got = np.asarray(y.to_numpy())
            ref = reference("reduce_logsumexp", xa, out)
            errs.expect(not np.any(np.isnan(got)), f"{out} x={lay}: nan in {got}")
            errs.expect(bool(np.all(np.isneginf(got[3]))), f"{out} x={lay}: row 3 is {got[3]}, not -inf")
            errs.close(f"{out} x={lay}", got, ref, rtol=1e-5, atol=1e-5)
    whole = mesh.from_numpy(np.full((8, 8, 8), -np.inf, np.float32), XSHAPE, layout=dict(zip(NAMES, big(mesh))))
    s = np.asarray(mm.reduce_logsumexp(whole).to_numpy())
    errs.expect(bool(np.isneginf(s)), f"logsumexp of all -inf is {s}, not -inf")
    errs.check()


def test_bad_arguments_raise() -> None:
    mesh = get_mesh(SHAPES[0])
    x = mesh.ones(XSHAPE)
    for op in NP_OPS:
        fn = getattr(mm, op)
        with pytest.raises(mm.ShapeError):
            fn(x, output_shape="a:8", reduced_dims="b")
        with pytest.raises(mm.ShapeError, match="z"):
            fn(x, reduced_dims="z")
        with pytest.raises(mm.ShapeError, match="z"):
            fn(x, output_shape="a:8;z:2")
        with pytest.raises(mm.ShapeError, match="a"):
            fn(x, output_shape="a:4")


def test_both_spellings_reduced_dim_and_reduced_dims() -> None:
    """`reduced_dim=` (the contract's spelling for the reductions) and `reduced_dims=` (einsum's) are
    one argument of einsum and every reduction: the same values, no warning (the contract's names are
    fixed), and both at once refused."""
    mesh = get_mesh(SHAPES[0])
    g = np.arange(512.0).reshape(8, 8, 8)
    x = mesh.from_numpy(g, XSHAPE)
    for op in [*NP_OPS, "einsum"]:
        fn = (lambda t, **kw: mm.einsum([t], **kw)) if op == "einsum" else getattr(mm, op)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            old = fn(x, reduced_dim=["a", "c"]).to_numpy()
        new = fn(x, reduced_dims=["a", "c"]).to_numpy()
        np.testing.assert_array_equal(old, new)
        ref = g.sum((0, 2)) if op in ("einsum", "reduce_sum") else reference(op, g, ("b",))
        np.testing.assert_allclose(new, ref, rtol=1e-12)
        with pytest.raises(mm.ShapeError, match="not both"):
            fn(x, reduced_dims="a", reduced_dim="a")


@pytest.mark.parametrize("mshape", SHAPES)
def test_reduce_over_an_empty_dim(mshape: str) -> None:
    """Over a dim of size 0: the mean is NaN and the sum 0, as numpy's (it was a ZeroDivisionError),
    on every layout, the kept dims split or not."""
    mesh, errs = get_mesh(mshape), Errors()
    xa = np.zeros((4, 0, 3))
    for lay in layouts(mesh, ["a", "e", "c"], limit=4):
        x = mesh.from_numpy(xa, "a:4;e:0;c:3", layout=lay)
        for op, ref in (("reduce_mean", np.full((4, 3), np.nan)), ("reduce_sum", np.zeros((4, 3)))):
            got = getattr(mm, op)(x, reduced_dims="e").to_numpy()
            errs.expect(got.shape == (4, 3), f"{op} x={lay}: shape {got.shape}")
            errs.expect(np.array_equal(got, ref, equal_nan=True), f"{op} x={lay}: {got}")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_nans_bools_and_complex_numbers(mshape: str) -> None:
    """numpy's answers on every rank and layout: a NaN anywhere makes the max and min NaN (MPI's
    max and min keep or drop it by the order they meet it: ranks disagreed, 3 became 2); a sum of
    bools counts them (int32) and their mean is a fraction (an einsum of bools gave their or, or
    MPI's SUM refused bools); the max and min of bools are their or and and; complex numbers have
    no order: a DTypeError on every rank, whatever the layout (MPI refused them, split)."""
    mesh, errs = get_mesh(mshape), Errors()
    rng = np.random.default_rng(7)
    xf = rng.standard_normal((5, 3, 7))
    xf[1, 2, 6], xf[4, 0, 0], xf[:, 1, 3] = np.nan, np.nan, np.nan
    xb = rng.random((5, 3, 7)) < 0.3
    xb[:, 2, :] = False
    for lay in layouts(mesh, ["a", "b", "c"], limit=6):
        for xa, ops in ((xf, ("reduce_max", "reduce_min")), (xf.astype(np.float32), ("reduce_max", "reduce_min")),
                        (xb, ("reduce_sum", "reduce_mean", "reduce_max", "reduce_min"))):
            x = mesh.from_numpy(xa, "a:5;b:3;c:7", layout=lay)
            for op in ops:
                for axes, kept in (((0, 2), "b:3"), ((0, 1, 2), ""), ((1,), "a:5;c:7")):
                    got = getattr(mm, op)(x, output_shape=kept)
                    want = {"reduce_sum": np.sum, "reduce_mean": np.mean, "reduce_max": np.max,
                            "reduce_min": np.min}[op](xa, axis=axes)
                    dtype = np.int32 if op == "reduce_sum" and xa.dtype == bool else want.dtype
                    value = got.to_numpy()
                    errs.expect(value.dtype == dtype and np.allclose(value, want, rtol=1e-15, atol=0, equal_nan=True),
                                f"{op} {xa.dtype} over {axes} x={lay}: {value} ({value.dtype}), numpy {want}")
        xc = mesh.from_numpy(xf[:, :, :3] + 1j, "a:5;b:3;c:3", layout={k: v for k, v in lay.items() if k != "c"})
        for op in ("reduce_max", "reduce_min"):
            with pytest.raises(mm.DTypeError, match=rf"{op}: x is a \[a:5, b:3, c:3\] complex128 tensor, and complex "
                                                    r"numbers have no order"):
                getattr(mm, op)(xc, reduced_dims="a")
    e = mm.einsum([mesh.from_numpy(xb, "a:5;b:3;c:7", layout=dict(zip("abc", big(mesh))))], output_shape="b:3")
    errs.expect(np.array_equal(e.to_numpy(), np.einsum("abc->b", xb)), f"einsum of bools: {e.to_numpy()}")
    errs.check()
