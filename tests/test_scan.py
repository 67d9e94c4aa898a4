"""mm.cumsum against numpy on the global arrays (inclusive, exclusive, reversed), over 1-D/2-D/3-D
meshes and several layouts including the scanned dim split, evenly or not (sizes 0 to 7: unequal
and empty blocks); its communication (one exscan of the block totals over the split dim's mesh
dim, never an allgather of the data); gradients."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from gradcheck import check_gradients  # noqa: E402
from meshes import (  # noqa: E402
    big, collectives, Errors, expected_local, get_mesh, global_array, layouts, mesh_shapes)

import mpimesh as mm  # noqa: E402
from mpimesh.backend import to_host  # noqa: E402

pytestmark = pytest.mark.mpi
SHAPES = mesh_shapes()


def ref_cumsum(a: np.ndarray, axis: int, exclusive: bool, reverse: bool) -> np.ndarray:
    """numpy reference, in float64 (or the int dtype)."""
    b = np.flip(a, axis) if reverse else a
    c = np.cumsum(b.astype(np.float64) if b.dtype.kind == "f" else b, axis=axis)
    if exclusive:
        c = c - b
    return np.flip(c, axis) if reverse else c


def rule_variants(mesh: mm.Mesh, dim: str, other: str) -> list[dict]:
    bd = big(mesh)
    out: list[dict] = [{}] + [{dim: m} for m in bd]
    if len(bd) > 1:
        out.append({dim: bd[1], other: bd[0]})
    elif bd:
        out.append({other: bd[0]})
    return out


MODES = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32])
@pytest.mark.parametrize("mshape", SHAPES)
def test_cumsum(mshape: str, dtype) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a = global_array("a:8;i:16", 1, np.float64)
    a = (a * 10).astype(dtype) if np.dtype(dtype).kind == "i" else a.astype(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-12}
    for rules in rule_variants(mesh, "i", "a"):
        for lay in layouts(mesh, ["a", "i"], limit=4):
            x = mesh.from_numpy(a, "a:8;i:16", layout=lay)
            for exclusive, reverse in MODES:
                with mm.layout_scope(mesh, rules):
                    y = mm.cumsum(x, "i", exclusive=exclusive, reverse=reverse)
                what = f"excl={exclusive} rev={reverse} x={lay} rules={rules}"
                ref = ref_cumsum(a, 1, exclusive, reverse)
                errs.expect(y.layout == rules and y.dtype == a.dtype and y.shape == x.shape,
                            f"{what}: {y.layout} {y.dtype} {y.shape}")
                got = to_host(y.local)
                want = expected_local(ref, ("a", "i"), rules, mesh)
                errs.expect(got.shape == want.shape and np.allclose(got, want, **tol), f"{what}: values differ")
    errs.check()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mshape", SHAPES)
def test_a_16_bit_cumsum_sums_in_float32(mshape: str, dtype) -> None:
    """3001 values in [0.5, 1.5]: a bfloat16 running sum stalled at 512 on one rank (1024 on two: each
    block's), the layout changed the answer. Summed in float32 and rounded once: within one 16-bit
    rounding of the float64 reference, and the same on every layout."""
    mesh, errs = get_mesh(mshape), Errors()
    a = np.random.default_rng(7).uniform(0.5, 1.5, (2, 3001)).astype(dtype if dtype == "float16" else np.float32)
    x = mm.cast(mesh.from_numpy(a, "a:2;i:3001"), dtype)
    a = x.to_numpy()
    eps = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
    seen = None
    for lay in layouts(mesh, ["a", "i"], limit=4):
        xl = mesh.from_numpy(a, "a:2;i:3001", layout=lay)
        for exclusive, reverse in MODES:
            y = mm.cumsum(xl, "i", exclusive=exclusive, reverse=reverse).to_numpy()
            ref = ref_cumsum(a.astype(np.float64), 1, exclusive, reverse)
            errs.expect(y.dtype == a.dtype and np.all(np.abs(y.astype(np.float64) - ref) <= eps * np.abs(ref) + 1e-6),
                        f"{dtype} x={lay} excl={exclusive} rev={reverse}: max error "
                        f"{np.max(np.abs(y.astype(np.float64) - ref))}")
            if (exclusive, reverse) == (False, False):
                errs.expect(seen is None or np.array_equal(y, seen), f"{dtype} x={lay}: another layout, other values")
                seen = y
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_cumsum_3d_each_axis(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a = global_array("p:8;q:8;r:8", 2, np.float64)
    names = ("p", "q", "r")
    for axis, dim in enumerate(names):
        for lay in layouts(mesh, list(names), limit=5):
            with mm.layout_scope(mesh, lay):
                x = mesh.from_numpy(a, "p:8;q:8;r:8")
                for exclusive, reverse in MODES[::3] if axis != 1 else MODES:
                    y = mm.cumsum(x, mm.Dimension(dim, 8), exclusive, reverse)
                    got = y.to_numpy()
                    errs.expect(np.allclose(got, ref_cumsum(a, axis, exclusive, reverse), rtol=1e-12, atol=1e-12),
                                f"{dim} excl={exclusive} rev={reverse} layout={lay}")
    errs.check()


def test_cumsum_bool_counts() -> None:
    mesh = get_mesh(SHAPES[-1])
    bd = big(mesh)
    a = global_array("i:16", 3) > 0
    x = mesh.from_numpy(a, "i:16", layout={"i": bd[0]} if bd else {})
    with mm.layout_scope(mesh, x.layout):
        np.testing.assert_array_equal(mm.cumsum(x, "i").to_numpy(), np.cumsum(a))


# --------------------------------------------------------------------------------- communication

@pytest.mark.parametrize("mshape", SHAPES)
def test_split_dim_uses_one_exscan(mshape: str) -> None:
    """Forward (inclusive or exclusive) over a split dim: exactly one exscan of the block totals
    (one element per position of the other local dims), no allgather; over an unsplit dim: nothing."""
    errs = Errors()
    mesh0 = get_mesh(mshape)
    a = global_array("a:8;i:16", 4, np.float64)
    for m in big(mesh0):
        others = [o for o in big(mesh0) if o != m]
        rules = {"i": m, **({"a": others[0]} if others else {})}
        mesh = get_mesh(mshape, ";".join(f"{d}:{v}" for d, v in rules.items()))
        x = mesh.from_numpy(a, "a:8;i:16")
        a_local = len(expected_local(np.arange(8), ("a",), rules, mesh))
        for exclusive in (False, True):
            with mm.profile() as prof:
                y = mm.cumsum(x, "i", exclusive=exclusive)
            errs.expect(np.allclose(y.to_numpy(), ref_cumsum(a, 1, exclusive, False)), f"m={m} excl={exclusive}")
            want = {f"exscan/{m}": {"calls": 1, "elements": a_local, "bytes": 8 * a_local}}
            errs.expect(collectives(prof) == want, f"m={m} excl={exclusive}: {collectives(prof)} != {want}")
        with mm.profile() as prof:
            y = mm.cumsum(x, "i", reverse=True)  # the totals only (k per position), never the data
        errs.expect(prof.elements("allgather") == a_local and prof.elements("exscan") == 0,
                    f"reverse m={m}: {collectives(prof)}")
        with mm.profile() as prof:
            y = mm.cumsum(x, "a")
        i_local = len(expected_local(np.arange(16), ("i",), rules, mesh))
        want = {f"exscan/{rules['a']}": {"calls": 1, "elements": i_local, "bytes": 8 * i_local}} if "a" in rules else {}
        errs.expect(collectives(prof) == want, f"cumsum over a, rules={rules}: {collectives(prof)} != {want}")
        errs.expect(np.allclose(y.to_numpy(), np.cumsum(a, 0)), f"cumsum over a m={m}")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_cumsum_uneven_sizes(mshape: str) -> None:
    """Scanned dims of sizes 0 to 7 (and an empty other dim), every layout: unequal blocks, and
    blocks empty on some ranks, whose totals of zero still take part in the exscan."""
    mesh, errs = get_mesh(mshape), Errors()
    for n in range(8):
        for na in (0, 3):
            a = global_array(f"a:{na};i:{n}", n, np.float64)
            for lay in layouts(mesh, ["a", "i"]):
                with mm.layout_scope(mesh, lay):
                    x = mesh.from_numpy(a, f"a:{na};i:{n}")
                    for exclusive, reverse in MODES:
                        y = mm.cumsum(x, "i", exclusive, reverse)
                        want = expected_local(ref_cumsum(a, 1, exclusive, reverse), ("a", "i"), lay, mesh)
                        errs.expect(y.local.shape == want.shape and np.allclose(to_host(y.local), want, rtol=1e-12, atol=1e-12),
                                    f"n={n} a={na} excl={exclusive} rev={reverse} layout={lay}")
    errs.check()


def test_bad_dim() -> None:
    mesh = get_mesh(SHAPES[0])
    x = mesh.ones("a:2;i:4")
    with pytest.raises(mm.ShapeError, match="'z'"):
        mm.cumsum(x, "z")
    with pytest.raises(mm.ShapeError, match="i:5"):
        mm.cumsum(x, mm.Dimension("i", 5))


# --------------------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("mshape", [SHAPES[0], SHAPES[-1]])
def test_gradients(mshape: str) -> None:
    bd = big(get_mesh(mshape))
    a = global_array("a:2;i:16", 5, np.float64)
    w = global_array("a:2;i:16", 6, np.float64)
    for rules, lay in [("", {})] + ([(f"i:{bd[-1]}", {"i": bd[0]})] if bd else []):
        mesh = get_mesh(mshape, rules)
        wt = mesh.from_numpy(w, "a:2;i:16")
        for exclusive, reverse in MODES:
            check_gradients(mesh, lambda x: mm.cumsum(x, "i", exclusive, reverse) * wt, [a], ["a:2;i:16"], [lay],
                            directions=1)


@pytest.mark.parametrize("mshape", SHAPES)
def test_gradients_uneven(mshape: str) -> None:
    """The scanned dim split unevenly (size 5; size 2 leaves blocks empty over 3 or more ranks)."""
    bd = big(get_mesh(mshape))
    for n in (5, 2):
        a = global_array(f"a:2;i:{n}", 7, np.float64)
        w = global_array(f"a:2;i:{n}", 8, np.float64)
        for rules, lay in [(f"i:{m}", {"i": m}) for m in bd[-1:]] + [("", {"i": bd[0]} if bd else {})]:
            mesh = get_mesh(mshape, rules)
            wt = mesh.from_numpy(w, f"a:2;i:{n}")
            for exclusive, reverse in MODES:
                check_gradients(mesh, lambda x: mm.cumsum(x, "i", exclusive, reverse) * wt, [a], [f"a:2;i:{n}"],
                                [lay], directions=1)
