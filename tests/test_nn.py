"""softmax and log_softmax against numpy on the global arrays, over 1-D/2-D/3-D meshes and several
layouts (the reduced dim split included, evenly or not, with blocks left empty), large inputs,
their communication, and gradients."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from gradcheck import check_gradients  # noqa: E402
from meshes import (  # noqa: E402
    big, collectives, Errors as _Errors, get_mesh, global_array, layouts, mesh_shapes)

import mpimesh as mm  # noqa: E402

pytestmark = pytest.mark.mpi
SHAPES = mesh_shapes()


def ref_log_softmax(x: np.ndarray, axes: tuple) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=axes, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axes, keepdims=True))


class Errors(_Errors):
    def result(self, what: str, y, ref: np.ndarray, rules: dict, tol: float) -> None:
        want = {d: m for d, m in rules.items() if d in y.shape.names}
        self.expect(y.layout == want, f"{what}: layout {y.layout} != {want}")
        got = y.to_numpy()
        self.expect(bool(np.isfinite(got).all()), f"{what}: not finite")
        try:
            np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
        except AssertionError as e:
            self.append(f"{what}: {e}")


def rule_variants(mesh: mm.Mesh) -> list[dict]:
    bd = big(mesh)
    out: list[dict] = [{}]
    if bd:
        out += [{"v": bd[0]}, {"b": bd[-1]}]
    if len(bd) > 1:
        out.append({"b": bd[0], "v": bd[1]})
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mshape", SHAPES)
def test_softmax_and_log_softmax(mshape: str, dtype) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    data = (global_array("b:8;v:16", 1, np.float64) * 1e4).astype(dtype)  # exp would overflow naively
    data[0, :] = 2e4  # a row of ties
    data[1, 3] = -np.inf  # a masked entry
    ls = ref_log_softmax(data, (1,))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for rules in rule_variants(mesh):
        for lx in layouts(mesh, ["b", "v"], limit=5):
            x = mesh.from_numpy(data, "b:8;v:16", layout=lx)
            with mm.layout_scope(mesh, rules):
                y = mm.softmax(x, "v")
                z = mm.log_softmax(x, mm.Dimension("v", 16))
            errs.expect(y.dtype == dtype and z.dtype == dtype, f"dtypes {y.dtype} {z.dtype}")
            errs.result(f"softmax rules={rules} x={lx}", y, np.exp(ls), rules, tol)
            zgot, masked = z.to_numpy(), np.isinf(ls)  # the masked entry's log_softmax is -inf
            errs.expect(bool(np.isneginf(zgot[masked]).all()), f"log_softmax rules={rules} x={lx}: masked {zgot[1, 3]}")
            try:
                np.testing.assert_allclose(zgot[~masked], ls[~masked], rtol=tol, atol=tol * 1e4)
            except AssertionError as e:
                errs.append(f"log_softmax rules={rules} x={lx}: {e}")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_two_reduced_dims(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    data = global_array("b:8;v:8;c:8", 2, np.float64) * 100
    ls = ref_log_softmax(data, (1, 2))
    bd = big(mesh)
    rules_list = [{}] + [{"v": m} for m in bd[:1]] + ([{"v": bd[0], "c": bd[1]}] if len(bd) > 1 else [])
    for rules in rules_list:
        for lx in layouts(mesh, ["b", "v", "c"], limit=3):
            x = mesh.from_numpy(data, "b:8;v:8;c:8", layout=lx)
            with mm.layout_scope(mesh, rules):
                y = mm.softmax(x, ["v", "c"])
                z = mm.log_softmax(x, "v:8;c:8")
            errs.result(f"softmax rules={rules} x={lx}", y, np.exp(ls), rules, 1e-12)
            errs.result(f"log_softmax rules={rules} x={lx}", z, ls, rules, 1e-10)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_split_reduced_dim_two_allreduces(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    data = global_array("b:8;v:32", 3) * 1e4
    ls = ref_log_softmax(data, (1,))
    for m in big(mesh):
        others = [o for o in big(mesh) if o != m]
        for rules in [{"v": m}] + [{"v": m, "b": o} for o in others[:1]]:
            x = mesh.from_numpy(data, "b:8;v:32", layout=rules)
            with mm.layout_scope(mesh, rules), mm.profile() as prof:
                y = mm.softmax(x, "v")
                z = mm.log_softmax(x, "v")
            n = 8 // (mesh.shape[rules["b"]].size if "b" in rules else 1)
            want = {f"allreduce/{m}": {"calls": 4, "elements": 4 * n, "bytes": 16 * n}}
            errs.expect(collectives(prof) == want, f"m={m} rules={rules}: {collectives(prof)} != {want}")
            errs.result(f"softmax m={m} rules={rules}", y, np.exp(ls), rules, 1e-5)
            errs.result(f"log_softmax m={m} rules={rules}", z, ls, rules, 1e-5 * 1e4)
        # an unsplit reduced dim needs no communication
        x = mesh.from_numpy(data, "b:8;v:32", layout={"b": m})
        with mm.layout_scope(mesh, {"b": m}), mm.profile() as prof:
            mm.softmax(x, "v")
        errs.expect(collectives(prof) == {}, f"b on {m}: {collectives(prof)}")
    errs.check()


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("mshape", SHAPES[:2])
def test_gradients(mshape: str, op: str) -> None:
    mesh = get_mesh(mshape)
    fn = getattr(mm, op)
    data = global_array("b:8;v:16", 4, np.float64) * 3
    c = global_array("b:8;v:16", 5, np.float64)
    bd = big(mesh)
    cases = [{}] + [{"v": m} for m in bd] + [{"b": m} for m in bd[:1]]
    if len(bd) > 1:
        cases.append({"b": bd[1], "v": bd[0]})
    for lx in cases:
        def f(x, w):
            return fn(x, "v") * w  # a weighted sum: sum(softmax) alone is constant
        check_gradients(mesh, f, [data, c], ["b:8;v:16", "b:8;v:16"], [lx, lx], wrt=[0])


UNEVEN = (2, 5, 7, 10)  # no divisor of 3 or 4 ranks; 2 leaves blocks empty on 3 or more


def block_len(mesh: mm.Mesh, size: int, m) -> int:
    """This rank's block length of a dim of `size` split over mesh dim `m` (None: whole)."""
    return len(np.array_split(np.arange(size), mesh.shape[m].size)[mesh.coords[m]]) if m else size


@pytest.mark.parametrize("mshape", SHAPES)
def test_uneven_and_empty_blocks(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    for v in UNEVEN:
        data = global_array(f"b:5;v:{v}", v, np.float64) * 50
        data[0, :] = 7.0  # ties
        data[1, -1] = -np.inf  # a masked entry, in the last block
        ls = ref_log_softmax(data, (1,))
        for rules in rule_variants(mesh):
            for lx in layouts(mesh, ["b", "v"], limit=4):
                x = mesh.from_numpy(data, f"b:5;v:{v}", layout=lx)
                with mm.layout_scope(mesh, rules):
                    y = mm.softmax(x, "v")
                    z = mm.log_softmax(x, "v")
                errs.result(f"softmax v={v} rules={rules} x={lx}", y, np.exp(ls), rules, 1e-12)
                zgot = z.to_numpy()
                errs.expect(bool(np.isneginf(zgot[1, -1])), f"log_softmax v={v}: masked {zgot[1, -1]}")
                errs.close(f"log_softmax v={v} rules={rules} x={lx}", zgot[np.isfinite(ls)], ls[np.isfinite(ls)],
                           1e-12, 1e-12)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_two_reduced_dims_uneven(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    data = global_array("b:3;v:5;c:2", 6, np.float64) * 10
    ls = ref_log_softmax(data, (1, 2))
    bd = big(mesh)
    rules_list = [{}] + [{"c": m} for m in bd[:1]] + ([{"v": bd[1], "c": bd[0]}] if len(bd) > 1 else [])
    for rules in rules_list:
        for lx in layouts(mesh, ["b", "v", "c"], limit=4):
            x = mesh.from_numpy(data, "b:3;v:5;c:2", layout=lx)
            with mm.layout_scope(mesh, rules):
                y = mm.softmax(x, ["v", "c"])
                z = mm.log_softmax(x, ["v", "c"])
            errs.result(f"softmax rules={rules} x={lx}", y, np.exp(ls), rules, 1e-12)
            errs.result(f"log_softmax rules={rules} x={lx}", z, ls, rules, 1e-12)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_uneven_split_reduced_dim_two_allreduces(mshape: str) -> None:
    """The two allreduces carry the rows this rank holds, whether its block of v is short or empty."""
    mesh, errs = get_mesh(mshape), Errors()
    for v in (2, 5):
        data = global_array(f"b:7;v:{v}", 7)
        ls = ref_log_softmax(data, (1,))
        for m in big(mesh):
            others = [o for o in big(mesh) if o != m]
            for rules in [{"v": m}] + [{"v": m, "b": o} for o in others[:1]]:
                x = mesh.from_numpy(data, f"b:7;v:{v}", layout=rules)
                with mm.layout_scope(mesh, rules), mm.profile() as prof:
                    y = mm.softmax(x, "v")
                n = block_len(mesh, 7, rules.get("b"))
                want = {f"allreduce/{m}": {"calls": 2, "elements": 2 * n, "bytes": 8 * n}} if n else {}
                errs.expect(collectives(prof) == want, f"v={v} rules={rules}: {collectives(prof)} != {want}")
                errs.result(f"softmax v={v} rules={rules}", y, np.exp(ls), rules, 1e-5)
    errs.check()


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("mshape", SHAPES[:2])
def test_uneven_gradients(mshape: str, op: str) -> None:
    mesh = get_mesh(mshape)
    fn = getattr(mm, op)
    data = global_array("b:3;v:5", 8, np.float64) * 3
    c = global_array("b:3;v:5", 9, np.float64)
    bd = big(mesh)
    cases = [{}] + [{"v": m} for m in bd] + [{"b": m} for m in bd[:1]]
    if len(bd) > 1:
        cases.append({"b": bd[1], "v": bd[0]})
    for lx in cases:
        check_gradients(mesh, lambda x, w: fn(x, "v") * w, [data, c], ["b:3;v:5", "b:3;v:5"], [lx, lx], wrt=[0])


def test_local_extreme_of_an_empty_block() -> None:
    """The identity of the allreduce that follows: -inf/inf, or the dtype's extreme integers."""
    from mpimesh.ops.nn import local_extreme
    for dt, lo, hi in ((np.float32, -np.inf, np.inf), (np.int16, -2 ** 15, 2 ** 15 - 1), (np.bool_, False, True)):
        a = np.zeros((3, 0, 2), dt)
        got_max, got_min = local_extreme(np, a, (1,)), local_extreme(np, a, (1, 2), "min", keepdims=True)
        assert got_max.shape == (3, 2) and got_max.dtype == dt and (got_max == lo).all()
        assert got_min.shape == (3, 1, 1) and got_min.dtype == dt and (got_min == hi).all()
    a = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(local_extreme(np, a, (1,), "min"), [0.0, 3.0])


def test_errors() -> None:
    mesh = get_mesh(SHAPES[0])
    x = mesh.ones("b:2;v:4")
    with pytest.raises(mm.ShapeError, match="'w'"):
        mm.softmax(x, "w")
    with pytest.raises(mm.ShapeError, match="no reduced dim"):
        mm.log_softmax(x, [])


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_one_kernel_rows_on_a_gpu(dtype) -> None:
    """On CuPy, softmax and log_softmax over the last axis, rows whole on each rank, run one kernel
    each way (`rowwise.ROWS_SOURCE`: a warp per row, its shuffles summing 300-long rows, not a
    multiple of the warp), with the causal mask inside: values and gradients against float64 numpy."""
    mesh = get_mesh(SHAPES[0])
    if mesh.backend != "cupy":
        pytest.skip("CuPy's kernels (their sources run on the CPU in test_cuda_sources.py)")
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((2, 300, 3, 300)) * 3).astype(np.float32)
    w = rng.standard_normal(x.shape).astype(np.float32)
    xr = x.astype("bfloat16").astype(np.float64) if dtype == "bfloat16" else x.astype(np.float64)
    wr = w.astype("bfloat16").astype(np.float64) if dtype == "bfloat16" else w.astype(np.float64)
    future = np.arange(300)[None, None, None, :] > np.arange(300)[None, :, None, None]
    logp = ref_log_softmax(np.where(future, xr - 1e9, xr), (3,))
    tol = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 2e-2}[dtype]
    with mm.layout_scope(mesh, f"b:{mesh.shape.names[0]}"):
        for op, want in (("softmax", np.exp(logp)), ("log_softmax", logp)):
            with mm.trace():
                xt = mm.cast(mesh.from_numpy(x, "b:2;q:300;h:3;k:300"), dtype)
                y = getattr(mm, op)(xt, "k", causal="q")
                (g,) = mm.gradients([mm.reduce_sum(y * mm.cast(mesh.from_numpy(w, "b:2;q:300;h:3;k:300"), dtype))],
                                    [xt])
            assert mm.backend._kernels.get(("rowwise", "rows", dtype)) is not None, \
                "the one-kernel rows did not compile"
            p = np.exp(logp)
            if op == "softmax":
                dx = p * (wr - (wr * p).sum(axis=3, keepdims=True))
            else:
                dx = wr - p * wr.sum(axis=3, keepdims=True)
            np.testing.assert_allclose(y.to_numpy().astype(np.float64), want, rtol=tol, atol=tol)
            np.testing.assert_allclose(g.to_numpy().astype(np.float64), dx, rtol=tol, atol=tol * np.abs(dx).max())
