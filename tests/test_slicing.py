"""mm.slice / pad / concat / split against numpy on the global arrays, over 1-D/2-D/3-D meshes and
several layouts, including a split dim cut across block boundaries and dims that their mesh dims do
not divide (unequal and empty `numpy.array_split` blocks); the communication they do (a few
permutes of small windows, no allgather, when input and output are split the same way); errors;
gradients."""
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


def check_result(errs: Errors, what: str, y, ref: np.ndarray, rules: dict) -> None:
    """y has the global values `ref` (exactly: data movement), the rules' layout and the right block."""
    want_layout = {d: m for d, m in rules.items() if d in y.shape.names}
    errs.expect(y.layout == want_layout, f"{what}: layout {y.layout} != {want_layout}")
    errs.expect(y.shape.sizes == ref.shape, f"{what}: shape {y.shape} != {ref.shape}")
    errs.expect(y.dtype == ref.dtype, f"{what}: dtype {y.dtype} != {ref.dtype}")
    local = to_host(y.local)
    want = expected_local(ref, y.shape.names, y.layout, y.mesh)
    errs.expect(local.shape == want.shape and np.array_equal(local, want), f"{what}: local block differs")
    got = y.to_numpy()
    errs.expect(got.shape == ref.shape and np.array_equal(got, ref), f"{what}: values differ")


def rule_variants(mesh: mm.Mesh, dim: str) -> list[dict]:
    """Output rules: replicated; `dim` split over each mesh dim (evenly or not); the other dim `a`
    split; both split."""
    bd = big(mesh)
    out: list[dict] = [{}] + [{dim: m} for m in bd]
    if bd:
        out.append({"a": bd[-1]})
    if len(bd) > 1:
        out.append({dim: bd[0], "a": bd[1]})
    return out


SLICES = [(0, 32), (3, 8), (5, 16), (24, 8), (13, 16), (3, 5), (7, 0)]


@pytest.mark.parametrize("mshape", SHAPES)
def test_slice(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a = global_array("a:8;i:32", 1, np.float64)
    for begin, size in SLICES:
        for rules in rule_variants(mesh, "i"):
            for lay in layouts(mesh, ["a", "i"], limit=4):
                x = mesh.from_numpy(a, "a:8;i:32", layout=lay)
                with mm.layout_scope(mesh, rules):
                    y = mm.slice(x, begin, size, "i")
                check_result(errs, f"slice({begin}, {size}) x={lay} rules={rules}", y, a[:, begin:begin + size],
                             rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_slice_first_and_last_axis_3d(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a = global_array("p:16;a:8;q:8", 2, np.float32)
    for dim, axis, begin, size in (("p", 0, 5, 8), ("q", 2, 1, 0), ("q", 2, 0, 8), ("p", 0, 8, 8)):
        for rules in rule_variants(mesh, dim)[:3]:
            for lay in layouts(mesh, ["p", "a", "q"], limit=4):
                x = mesh.from_numpy(a, "p:16;a:8;q:8", layout=lay)
                with mm.layout_scope(mesh, rules):
                    y = mm.slice(x, begin, size, dim)
                ref = np.take(a, np.arange(begin, begin + size), axis=axis)
                check_result(errs, f"slice {dim} ({begin}, {size}) x={lay} rules={rules}", y, ref, rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_pad(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a = global_array("a:8;i:16;c:2", 3, np.float64)
    for before, after in ((0, 0), (3, 5), (8, 0), (0, 16), (1, 1), (21, 3)):
        for rules in rule_variants(mesh, "i"):
            for lay in layouts(mesh, ["a", "i"], limit=4):
                x = mesh.from_numpy(a, "a:8;i:16;c:2", layout=lay)
                with mm.layout_scope(mesh, rules):
                    y = mm.pad(x, [before, after], "i")
                ref = np.pad(a, [(0, 0), (before, after), (0, 0)])
                check_result(errs, f"pad({before}, {after}) x={lay} rules={rules}", y, ref, rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_concat(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    parts = [global_array(f"a:8;i:{n}", 10 + n, np.float64) for n in (8, 16, 8)]
    ref = np.concatenate(parts, axis=1)
    lays = layouts(mesh, ["a", "i"], limit=4)
    for rules in rule_variants(mesh, "i"):
        for t, l0 in enumerate(lays):
            xs = [mesh.from_numpy(p, f"a:8;i:{p.shape[1]}", layout=lays[(t + j) % len(lays)] if j else l0)
                  for j, p in enumerate(parts)]
            with mm.layout_scope(mesh, rules):
                y = mm.concat(xs, "i")
            check_result(errs, f"concat x0={l0} rules={rules}", y, ref, rules)
        one = mesh.from_numpy(parts[0], "a:8;i:8")
        with mm.layout_scope(mesh, rules):
            y = mm.concat([one], "i")
        check_result(errs, f"concat of one rules={rules}", y, parts[0], rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_split(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a = global_array("a:8;i:32", 4, np.float64)
    for spec, sizes in ((4, [8] * 4), (2, [16, 16]), ([8, 16, 8], [8, 16, 8]), ([24, 8], [24, 8]),
                        ([0, 32], [0, 32])):
        refs = np.split(a, np.cumsum(sizes)[:-1], axis=1)
        for rules in rule_variants(mesh, "i"):
            for lay in layouts(mesh, ["a", "i"], limit=4):
                x = mesh.from_numpy(a, "a:8;i:32", layout=lay)
                with mm.layout_scope(mesh, rules):
                    ys = mm.split(x, mm.Dimension("i", 32) if isinstance(spec, int) else "i", spec)
                errs.expect(len(ys) == len(sizes), f"split {spec}: {len(ys)} pieces")
                for n, (y, ref) in enumerate(zip(ys, refs)):
                    check_result(errs, f"split {spec} piece {n} x={lay} rules={rules}", y, ref, rules)
    errs.check()


def test_int_and_bool_dtypes() -> None:
    mesh = get_mesh(SHAPES[-1])
    m = big(mesh)[:1]
    lay = {"i": m[0]} if m else {}
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    x = mesh.from_numpy(a, "a:2;i:16", layout=lay)
    with mm.layout_scope(mesh, lay):
        np.testing.assert_array_equal(mm.slice(x, 3, 8, "i").to_numpy(), a[:, 3:11])
        np.testing.assert_array_equal(mm.pad(x, [2, 6], "i").to_numpy(), np.pad(a, [(0, 0), (2, 6)]))
        b = mesh.from_numpy(a % 3 == 0, "a:2;i:16", layout=lay)
        got = mm.concat([b, mm.slice(b, 0, 8, "i")], "i").to_numpy()
    np.testing.assert_array_equal(got, np.concatenate([a % 3 == 0, a[:, :8] % 3 == 0], 1))
    assert got.dtype == bool


# --------------------------------------------------------------------------------- communication

@pytest.mark.parametrize("mshape", SHAPES)
def test_split_dim_moves_only_windows(mshape: str) -> None:
    """Input and output split over the same mesh dim: a few permutes of small windows, never an
    allgather; a slice aligned with the blocks moves nothing."""
    errs = Errors()
    for m in big(get_mesh(mshape)):
        mesh = get_mesh(mshape, f"i:{m}")
        k = mesh.shape[m].size
        a = global_array("a:8;i:32", 5, np.float64)
        x = mesh.from_numpy(a, "a:8;i:32")
        b = -(-32 // k)  # the largest block (32 over 3 ranks: 11, 11, 10)
        cases = [("slice 3..11", lambda t: mm.slice(t, 3, 8, "i"), a[:, 3:11], -(-8 // k)),
                 ("pad 3, 5", lambda t: mm.pad(t, [3, 5], "i"), np.pad(a, [(0, 0), (3, 5)]), min(b, -(-40 // k))),
                 ("split 8/16/8", lambda t: mm.concat(mm.split(t, "i", [8, 16, 8])[::2], "i"),
                  np.concatenate([a[:, :8], a[:, 24:]], 1), None)]
        for what, f, ref, width in cases:
            with mm.profile() as prof:
                y = f(x)
            check_result(errs, f"{what} m={m}", y, ref, {"i": m})
            coll = collectives(prof)
            # Over 3 ranks the split's 3 windows would send more than an allgather (24 > 32 - 11 per
            # row): it gathers instead.
            if width is None and 32 % k:
                continue
            errs.expect(prof.elements("allgather") == 0 and prof.elements("alltoall") == 0,
                        f"{what} m={m}: gathered: {coll}")
            errs.expect(set(coll) <= {f"permute/{m}"}, f"{what} m={m}: {coll}")
            if width is not None and coll:
                c = coll[f"permute/{m}"]
                errs.expect(c["elements"] <= c["calls"] * 8 * width, f"{what} m={m}: windows too big: {c}")
        # a window that is exactly the input's blocks moves nothing
        with mm.profile() as prof:
            y = mm.concat(mm.split(x, "i", 1), "i")
        check_result(errs, f"split into one m={m}", y, a, {"i": m})
        errs.expect(collectives(prof) == {}, f"split into one m={m}: {collectives(prof)}")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_uneven_windows_move_little(mshape: str) -> None:
    """Sizes that the mesh dim does not divide: still only permutes of windows no wider than the
    largest output block, and in all no more than an allgather would bring."""
    errs = Errors()
    for m in big(get_mesh(mshape)):
        mesh = get_mesh(mshape, f"i:{m}")
        k = mesh.shape[m].size
        for n, begin, size in ((10, 1, 8), (13, 3, 7), (7, 1, 5), (23, 2, 19), (5, 4, 1)):
            a = global_array(f"a:2;i:{n}", n, np.float64)
            x = mesh.from_numpy(a, f"a:2;i:{n}")
            with mm.profile() as prof:
                y = mm.slice(x, begin, size, "i")
            what = f"slice({begin}, {size}) of {n} over {m}:{k}"
            check_result(errs, what, y, a[:, begin:begin + size], {"i": m})
            coll = collectives(prof)
            errs.expect(set(coll) <= {f"permute/{m}"}, f"{what}: {coll}")
            if coll:
                c, width = coll[f"permute/{m}"], -(-size // k)
                errs.expect(c["elements"] <= c["calls"] * 2 * width, f"{what}: windows too big: {c}")
                errs.expect(c["elements"] <= 2 * (n - -(-n // k)), f"{what}: more than an allgather: {c}")
    errs.check()


SIZES = (0, 1, 2, 3, 5, 7, 10)  # over 3 or 4 ranks: unequal blocks; 0, 1, 2: some blocks empty


@pytest.mark.parametrize("mshape", SHAPES)
def test_uneven_sizes(mshape: str) -> None:
    """Every op on dims of sizes that do not divide (or are smaller than) the mesh dim, with the dim
    split in the input, in the output, in both or neither, against numpy."""
    mesh, errs = get_mesh(mshape), Errors()
    for n in SIZES:
        a = global_array(f"a:3;i:{n}", n, np.float64)
        for rules in rule_variants(mesh, "i"):
            for lay in layouts(mesh, ["a", "i"], limit=3):
                x = mesh.from_numpy(a, f"a:3;i:{n}", layout=lay)
                what = f"n={n} x={lay} rules={rules}"
                with mm.layout_scope(mesh, rules):
                    for begin, size in {(0, n), (n // 3, n - n // 3), (1, max(n - 3, 0)), (n - 1, 1), (n, 0)}:
                        if 0 <= begin and size >= 0 and begin + size <= n:
                            check_result(errs, f"slice({begin}, {size}) {what}", mm.slice(x, begin, size, "i"),
                                         a[:, begin:begin + size], rules)
                    for before, after in ((2, 0), (0, 3), (4, 5)):
                        check_result(errs, f"pad({before}, {after}) {what}", mm.pad(x, [before, after], "i"),
                                     np.pad(a, [(0, 0), (before, after)]), rules)
                    cut = [n // 2, 0, n - n // 2]
                    for j, (y, ref) in enumerate(zip(mm.split(x, "i", cut), np.split(a, np.cumsum(cut)[:-1], 1))):
                        check_result(errs, f"split {cut} piece {j} {what}", y, ref, rules)
                    b = global_array(f"a:3;i:{n + 2}", 50 + n, np.float64)
                    z = mesh.from_numpy(b, f"a:3;i:{n + 2}", layout=rules)
                    check_result(errs, f"concat {what}", mm.concat([x, z, x], "i"), np.concatenate([a, b, a], 1),
                                 rules)
    errs.check()


# ------------------------------------------------------------------------------------------ errors

def test_shape_errors() -> None:
    mesh = get_mesh(SHAPES[0])
    x = mesh.ones("a:2;i:8")
    for bad in ((-1, 2), (4, 5), (0, 9), (2, -1)):
        with pytest.raises(mm.ShapeError, match="'i'"):
            mm.slice(x, bad[0], bad[1], "i")
    with pytest.raises(mm.ShapeError, match="'z'"):
        mm.slice(x, 0, 1, "z")
    with pytest.raises(mm.ShapeError, match="'i'"):
        mm.pad(x, [-1, 2], "i")
    with pytest.raises(mm.ShapeError):
        mm.pad(x, [1], "i")
    with pytest.raises(mm.ShapeError, match="a:3"):
        mm.concat([x, mesh.ones("a:3;i:8")], "i")
    with pytest.raises(mm.ShapeError):
        mm.concat([x, mesh.ones("i:8;a:2")], "i")
    with pytest.raises(mm.ShapeError):
        mm.concat([x, mesh.ones("a:2;i:8;c:1")], "i")
    with pytest.raises(mm.ShapeError):
        mm.concat([], "i")
    with pytest.raises(mm.ShapeError, match="3"):
        mm.split(x, "i", 3)
    with pytest.raises(mm.ShapeError, match="'i'"):
        mm.split(x, "i", [4, 5])
    with pytest.raises(mm.ShapeError, match="i:9"):
        mm.split(x, mm.Dimension("i", 9), 3)


# --------------------------------------------------------------------------------------- gradients

def grad_cases(mshape: str) -> list[tuple[str, dict]]:
    """(mesh rules, input layout) pairs: replicated, and the dim split in input and output (on one
    rank: the other dim on the size-1 mesh dim)."""
    bd = big(get_mesh(mshape))
    first = get_mesh(mshape).shape.names[0]
    return [("", {})] + ([(f"i:{bd[-1]}", {"i": bd[-1]})] if bd else [(f"i:{first}", {"a": first})])


@pytest.mark.parametrize("mshape", [SHAPES[0], SHAPES[-1]])
def test_gradients(mshape: str) -> None:
    a = global_array("a:2;i:16", 6, np.float64)
    b = global_array("a:2;i:8", 7, np.float64)
    w = global_array("a:2;i:24", 8, np.float64)
    for rules, lay in grad_cases(mshape):
        mesh = get_mesh(mshape, rules)
        wt = mesh.from_numpy(w, "a:2;i:24")
        kw = {"directions": 1}
        check_gradients(mesh, lambda x: mm.slice(x, 3, 8, "i") * mm.slice(x, 8, 8, "i"), [a], ["a:2;i:16"], [lay],
                        **kw)
        check_gradients(mesh, lambda x: mm.pad(x, [3, 5], "i") * wt, [a], ["a:2;i:16"], [lay], **kw)
        check_gradients(mesh, lambda x, y: mm.concat([x, y], "i") * wt, [a, b], ["a:2;i:16", "a:2;i:8"],
                        [lay, {}], **kw)
        check_gradients(mesh, lambda x: mm.split(x, "i", [8, 16])[0] * mm.slice(wt, 0, 8, "i")
                        + mm.split(x, "i", 3)[2] ** 2, [w], ["a:2;i:24"], [lay], **kw)


@pytest.mark.parametrize("mshape", SHAPES)
def test_gradients_uneven(mshape: str) -> None:
    """Gradients where the dim does not divide its mesh dim (and some blocks are empty)."""
    bd = big(get_mesh(mshape))
    for n in (7, 2):
        a = global_array(f"a:2;i:{n}", 9, np.float64)
        w = global_array(f"a:2;i:{n + 4}", 10, np.float64)
        for rules, lay in [("", {"i": bd[0]} if bd else {})] + [(f"i:{m}", {"i": m}) for m in bd[-1:]]:
            mesh = get_mesh(mshape, rules)
            wt = mesh.from_numpy(w, f"a:2;i:{n + 4}")
            kw = {"directions": 1}
            check_gradients(mesh, lambda x: mm.slice(x, 1, n - 1, "i") * mm.slice(x, 0, n - 1, "i"), [a],
                            [f"a:2;i:{n}"], [lay], **kw)
            check_gradients(mesh, lambda x: mm.pad(x, [3, 1], "i") * wt, [a], [f"a:2;i:{n}"], [lay], **kw)
            check_gradients(mesh, lambda x: mm.concat([x, mm.slice(wt, 0, 4, "i")], "i") * wt, [a],
                            [f"a:2;i:{n}"], [lay], **kw)
            check_gradients(mesh, lambda x: mm.split(x, "i", [1, n - 1])[1] ** 2, [a], [f"a:2;i:{n}"], [lay], **kw)
