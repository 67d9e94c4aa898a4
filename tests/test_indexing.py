"""one_hot, gather, top_k and argmax against numpy on the global arrays, over 1-D/2-D/3-D meshes and
several layouts (split output/vocabulary/reduced dims included; sizes that do not divide the mesh
dims and blocks left empty), their communication, and gradients."""
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


def block_len(mesh: mm.Mesh, size: int, m) -> int:
    """This rank's block length of a dim of `size` split over mesh dim `m` (None: whole)."""
    return len(np.array_split(np.arange(size), mesh.shape[m].size)[mesh.coords[m]]) if m else size


def local_size(mesh: mm.Mesh, sizes: dict, layout: dict) -> int:
    """This rank's element count of a tensor with dims `sizes` laid out by `layout`."""
    return int(np.prod([block_len(mesh, s, layout.get(d)) for d, s in sizes.items()]))


def rule_variants(mesh: mm.Mesh, a: str, b: str) -> list[dict]:
    """Output rules: replicated, `a` split, `b` split, both split (on different mesh dims)."""
    bd = big(mesh)
    out: list[dict] = [{}]
    if bd:
        out += [{a: bd[0]}, {b: bd[-1]}]
    if len(bd) > 1:
        out.append({a: bd[1], b: bd[0]})
    return out


class Errors(_Errors):
    """Mismatches collected over a loop, asserted at the end (so every rank runs every collective)."""

    def result(self, what: str, y, ref: np.ndarray, names: tuple, rules: dict, exact: bool = True) -> None:
        """y has dims `names`, the rules' layout, and the global values `ref`."""
        self.expect(y.shape.names == names, f"{what}: dims {y.shape.names} != {names}")
        want = {d: m for d, m in rules.items() if d in names}
        self.expect(y.layout == want, f"{what}: layout {y.layout} != {want}")
        got = y.to_numpy()
        try:
            if exact:
                np.testing.assert_array_equal(got, ref)
            else:
                np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
        except AssertionError as e:
            self.append(f"{what}: {e}")


def int_array(shape: str, low: int, high: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(low, high, mm.Shape(shape).sizes).astype(np.int32)


# -------------------------------------------------------------------------------------- one_hot

@pytest.mark.parametrize("mshape", SHAPES)
def test_one_hot(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    idx = int_array("b:8;s:8", -2, 18, 1)  # some out of range: rows of off_value
    ref = np.where(idx[..., None] == np.arange(16), 3.0, -1.0)
    for rules in rule_variants(mesh, "b", "v"):
        for li in layouts(mesh, ["b", "s"], limit=4):
            i = mesh.from_numpy(idx, "b:8;s:8", layout=li)
            with mm.layout_scope(mesh, rules):
                y = mm.one_hot(i, mm.Dimension("v", 16), on_value=3.0, off_value=-1.0, dtype="float64")
                y01 = mm.one_hot(i, "v:16", dtype="int32")
            errs.result(f"rules={rules} i={li}", y, ref, ("b", "s", "v"), rules)
            errs.expect(y.dtype == np.float64 and y01.dtype == np.int32, f"dtypes {y.dtype} {y01.dtype}")
            errs.result(f"0/1 rules={rules} i={li}", y01, (ref > 0).astype(np.int32), ("b", "s", "v"), rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_one_hot_split_output_dim_no_communication(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    idx = int_array("b:8", 0, 16, 2)
    for m in big(mesh):
        i = mesh.from_numpy(idx, "b:8", layout={})
        with mm.layout_scope(mesh, {"v": m}), mm.profile() as prof:
            y = mm.one_hot(i, "v:16")
        errs.expect(collectives(prof) == {}, f"m={m}: {collectives(prof)}")
        errs.result(f"m={m}", y, np.eye(16, dtype=np.float32)[idx], ("b", "v"), {"v": m})
    errs.check()


# --------------------------------------------------------------------------------------- gather

def gather_ref(w: np.ndarray, idx: np.ndarray) -> np.ndarray:
    ok = (idx >= 0) & (idx < w.shape[0])
    return np.where(ok[..., None], w[np.clip(idx, 0, w.shape[0] - 1)], 0.0)


@pytest.mark.parametrize("mshape", SHAPES)
def test_gather(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    w = global_array("v:16;d:8", 3)
    idx = int_array("b:8;s:8", -1, 17, 4)  # -1 and 16 are out of range: zeros
    ref = gather_ref(w, idx)
    for rules in rule_variants(mesh, "b", "d"):
        for lw in layouts(mesh, ["v", "d"], limit=5):
            for li in layouts(mesh, ["b", "s"], limit=3):
                x = mesh.from_numpy(w, "v:16;d:8", layout=lw)
                i = mesh.from_numpy(idx, "b:8;s:8", layout=li)
                with mm.layout_scope(mesh, rules):
                    y = mm.gather(x, i, "v")
                errs.result(f"rules={rules} w={lw} i={li}", y, ref, ("b", "s", "d"), rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_gather_batched(mshape: str) -> None:
    """A dim in both weights and indices is a batch dim: each index picks from its own entry."""
    mesh, errs = get_mesh(mshape), Errors()
    w = global_array("n:8;v:8;d:8", 5)
    idx = int_array("s:8;n:8", 0, 8, 6)
    ref = np.stack([w[np.arange(8), idx[s]] for s in range(8)])  # [s, n, d]
    for rules in [{}] + [{"n": m} for m in big(mesh)[:1]] + [{"d": m} for m in big(mesh)[-1:]]:
        for lw in layouts(mesh, ["n", "v", "d"], limit=4):
            for li in layouts(mesh, ["s", "n"], limit=2):
                x = mesh.from_numpy(w, "n:8;v:8;d:8", layout=lw)
                i = mesh.from_numpy(idx, "s:8;n:8", layout=li)
                with mm.layout_scope(mesh, rules):
                    y = mm.gather(x, i, mm.Dimension("v", 8))
                errs.result(f"rules={rules} w={lw} i={li}", y, ref, ("s", "n", "d"), rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_gather_split_vocab_one_allreduce(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    w = global_array("v:16;d:8", 7)
    idx = int_array("b:8", 0, 16, 8)
    ref = gather_ref(w, idx)
    for m in big(mesh):
        others = [o for o in big(mesh) if o != m]
        for rules in [{}] + [{"b": o} for o in others[:1]] + [{"d": o} for o in others[-1:]]:
            x = mesh.from_numpy(w, "v:16;d:8", layout={"v": m, **({"d": rules["d"]} if "d" in rules else {})})
            i = mesh.from_numpy(idx, "b:8", layout={"b": rules["b"]} if "b" in rules else {})
            with mm.layout_scope(mesh, rules), mm.profile() as prof:
                y = mm.gather(x, i, "v")
            n = local_size(mesh, {"b": 8, "d": 8}, rules)
            want = {f"allreduce/{m}": {"calls": 1, "elements": n, "bytes": 4 * n}}
            errs.expect(collectives(prof) == want, f"m={m} rules={rules}: {collectives(prof)} != {want}")
            errs.result(f"m={m} rules={rules}", y, ref, ("b", "d"), rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_gather_unsplit_vocab_no_communication(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    w, idx = global_array("v:16;d:8", 9), int_array("b:8", 0, 16, 10)
    cases = [{}] + [{"b": m} for m in big(mesh)] + [{"d": m} for m in big(mesh)]
    for rules in cases:
        x = mesh.from_numpy(w, "v:16;d:8", layout={"d": rules["d"]} if "d" in rules else {})
        i = mesh.from_numpy(idx, "b:8", layout={"b": rules["b"]} if "b" in rules else {})
        with mm.layout_scope(mesh, rules), mm.profile() as prof:
            y = mm.gather(x, i, "v")
        errs.expect(collectives(prof) == {}, f"rules={rules}: {collectives(prof)}")
        errs.result(f"rules={rules}", y, gather_ref(w, idx), ("b", "d"), rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES[:2])
def test_gather_gradient(mshape: str) -> None:
    mesh = get_mesh(mshape)
    bd = big(mesh)
    w = global_array("v:8;d:8", 11, np.float64)
    idx = np.array([[1, 3, 1, 7, 2, 2, 2, 0], [0, 3, 9, 1, -1, 5, 6, 6]], dtype=np.int32)  # repeats add up
    cases = [({}, {})] + [({"v": m}, {}) for m in bd[:1]] + [({"d": m}, {"s": m}) for m in bd[-1:]]
    if len(bd) > 1:
        cases.append(({"v": bd[0], "d": bd[1]}, {"s": bd[1]}))
    for lw, li in cases:
        check_gradients(mesh, lambda x, i: mm.square(mm.gather(x, i, "v")), [w, idx], ["v:8;d:8", "b:2;s:8"],
                        [lw, li], wrt=[0])


def scoped(mesh: mm.Mesh, rules: dict, fn):
    """`fn` run under layout rules `rules` (its gradient then runs under them too)."""
    def run(*xs):
        with mm.layout_scope(mesh, rules):
            return fn(*xs)
    return run


@pytest.mark.parametrize("mshape", SHAPES)
def test_gradients_when_the_looked_up_dim_shares_a_mesh_dim_with_the_indices(mshape: str) -> None:
    """Rules such as "s:all;v:all" (data-parallel indices, vocab-split table on one mesh dim), or
    top_k's k and v on one mesh dim: the scatter's one_hot cannot split both, so it keeps v whole
    and the einsum after it splits it."""
    mesh = get_mesh(mshape)
    w = global_array("v:8;d:8", 21, np.float64)
    idx = np.array([[1, 3, 1, 7, 2, 2, 2, 0], [0, 3, 9, 1, -1, 5, 6, 6]], dtype=np.int32)
    data = np.random.default_rng(22).permutation(128).reshape(8, 16) / 8.0  # no ties
    for m in big(mesh):
        check_gradients(mesh, scoped(mesh, {"v": m, "s": m}, lambda x, i: mm.square(mm.gather(x, i, "v"))),
                        [w, idx], ["v:8;d:8", "b:2;s:8"], [{"v": m}, {"s": m}], wrt=[0])
        check_gradients(mesh, scoped(mesh, {"v": m, "k": m}, lambda x: mm.square(mm.top_k(x, "v", "k:8")[0])),
                        [data], ["b:8;v:16"], [{"v": m}])


# ---------------------------------------------------------------------------------- top_k/argmax

def top_k_ref(x: np.ndarray, axis: int, k: int) -> tuple:
    order = np.argsort(-x, axis=axis, kind="stable")
    order = np.take(order, np.arange(k), axis=axis)
    return np.take_along_axis(x, order, axis=axis), order.astype(np.int32)


def tied(shape: str, seed: int) -> np.ndarray:
    """Small integers as floats: many ties."""
    return np.random.default_rng(seed).integers(0, 5, mm.Shape(shape).sizes).astype(np.float32)


@pytest.mark.parametrize("mshape", SHAPES)
@pytest.mark.parametrize("k", [1, 3, 8, 32])
def test_top_k_2d(mshape: str, k: int) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    for data in (tied("b:8;v:32", 12), global_array("b:8;v:32", 13)):
        rv, ri = top_k_ref(data, 1, k)
        rules_list = [{}] + [{"b": m} for m in big(mesh)[-1:]] + ([{"k": m} for m in big(mesh)[:1]] if k == 8 else [])
        for rules in rules_list:
            for lx in layouts(mesh, ["b", "v"], limit=5):
                x = mesh.from_numpy(data, "b:8;v:32", layout=lx)
                with mm.layout_scope(mesh, rules):
                    v, i = mm.top_k(x, "v", mm.Dimension("k", k))
                errs.result(f"k={k} rules={rules} x={lx} values", v, rv, ("b", "k"), rules)
                errs.result(f"k={k} rules={rules} x={lx} indices", i, ri, ("b", "k"), rules)
                errs.expect(i.dtype == np.int32 and v.dtype == np.float32, f"dtypes {v.dtype} {i.dtype}")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_top_k_middle_dim(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    data = tied("b:8;v:16;c:8", 14).astype(np.float64)
    rv, ri = top_k_ref(data, 1, 8)
    bd = big(mesh)
    rules_list = [{}] + [{"k": m, "c": o} for m in bd[:1] for o in bd[1:2]] + [{"c": m} for m in bd[-1:]]
    for rules in rules_list:
        for lx in layouts(mesh, ["b", "v", "c"], limit=5):
            x = mesh.from_numpy(data, "b:8;v:16;c:8", layout=lx)
            with mm.layout_scope(mesh, rules):
                v, i = mm.top_k(x, mm.Dimension("v", 16), "k:8")
            errs.result(f"rules={rules} x={lx} values", v, rv, ("b", "k", "c"), rules)
            errs.result(f"rules={rules} x={lx} indices", i, ri, ("b", "k", "c"), rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_top_k_long_rows_with_ties_and_nans(mshape: str) -> None:
    """Rows long enough for the partition kernel (k much smaller than the local row), with ties at
    the k-th value, integers, and NaNs (which numpy's stable sort of -x puts last)."""
    mesh, errs = get_mesh(mshape), Errors()
    ties = tied("b:8;v:256", 15)
    nans = global_array("b:8;v:256", 16)
    nans[1, ::3] = np.nan
    nans[2, :] = np.nan
    for name, data in (("ties", ties), ("ints", ties.astype(np.int32)), ("nans", nans)):
        for k in (1, 5):
            rv, ri = top_k_ref(data, 1, k)
            for lx in layouts(mesh, ["b", "v"], limit=4):
                x = mesh.from_numpy(data, "b:8;v:256", layout=lx)
                v, i = mm.top_k(x, "v", mm.Dimension("k", k))
                errs.expect(np.array_equal(v.to_numpy(), rv, equal_nan=True), f"{name} k={k} x={lx} values")
                errs.expect(np.array_equal(i.to_numpy(), ri), f"{name} k={k} x={lx} indices")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_top_k_split_dim_exchanges_only_candidates(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    data = tied("b:8;v:64", 15)
    for m in big(mesh):
        others = [o for o in big(mesh) if o != m]
        for k in (2, 16):
            rv, ri = top_k_ref(data, 1, k)
            for rules in [{}] + [{"b": o} for o in others[:1]]:
                x = mesh.from_numpy(data, "b:8;v:64", layout={"v": m, **rules})
                with mm.layout_scope(mesh, rules), mm.profile() as prof:
                    v, i = mm.top_k(x, "v", mm.Dimension("k", k))
                cand = local_size(mesh, {"b": 8}, rules) * min(k, block_len(mesh, 64, m))
                want = {f"allgather/{m}": {"calls": 2, "elements": 2 * cand, "bytes": 8 * cand}}
                errs.expect(collectives(prof) == want, f"m={m} k={k} rules={rules}: {collectives(prof)} != {want}")
                errs.result(f"m={m} k={k} rules={rules} values", v, rv, ("b", "k"), rules)
                errs.result(f"m={m} k={k} rules={rules} indices", i, ri, ("b", "k"), rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_argmax(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    for data in (tied("b:8;v:16;c:8", 16), global_array("b:8;v:16;c:8", 17)):
        ref = np.argmax(data, axis=1).astype(np.int32)  # the first maximum
        for rules in rule_variants(mesh, "b", "c")[:3]:
            for lx in layouts(mesh, ["b", "v"], limit=5):
                x = mesh.from_numpy(data, "b:8;v:16;c:8", layout=lx)
                with mm.layout_scope(mesh, rules):
                    y = mm.argmax(x, "v")
                errs.result(f"rules={rules} x={lx}", y, ref, ("b", "c"), rules)
                errs.expect(y.dtype == np.int32, f"dtype {y.dtype}")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_argmax_split_dim_exchanges_one_candidate(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    data = tied("b:8;v:32", 18)
    ref = np.argmax(data, axis=1).astype(np.int32)
    for m in big(mesh):
        x = mesh.from_numpy(data, "b:8;v:32", layout={"v": m})
        with mm.profile() as prof:
            y = mm.argmax(x, "v")
        n = min(1, block_len(mesh, 32, m))  # one candidate per row from a non-empty block
        want = {f"allgather/{m}": {"calls": 2, "elements": 16 * n, "bytes": (32 + 32) * n}}
        errs.expect(collectives(prof) == want, f"m={m}: {collectives(prof)} != {want}")
        errs.result(f"m={m}", y, ref, ("b",), {})
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES[:2])
def test_top_k_gradient(mshape: str) -> None:
    mesh = get_mesh(mshape)
    bd = big(mesh)
    data = np.random.default_rng(19).permutation(128).reshape(8, 16) / 8.0  # no ties
    cases = [{}] + [{"v": m} for m in bd] + [{"b": m} for m in bd[:1]]
    for lx in cases:
        check_gradients(mesh, lambda x: mm.square(mm.top_k(x, "v", "k:3")[0]), [data], ["b:8;v:16"], [lx])


# ------------------------------------------------------------------- uneven and empty blocks

UNEVEN = (2, 5, 7, 10)  # no divisor of 3 or 4 ranks; 2 leaves blocks empty on 3 or more


@pytest.mark.parametrize("mshape", SHAPES)
def test_one_hot_uneven_and_empty_blocks(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    for v in UNEVEN:
        idx = int_array("b:5;s:3", -1, v + 1, v)
        ref = (idx[..., None] == np.arange(v)).astype(np.float32)
        for rules in rule_variants(mesh, "b", "v"):
            for li in layouts(mesh, ["b", "s"], limit=3):
                i = mesh.from_numpy(idx, "b:5;s:3", layout=li)
                with mm.layout_scope(mesh, rules), mm.profile() as prof:
                    y = mm.one_hot(i, f"v:{v}")
                if li == {d: m for d, m in rules.items() if d != "v"}:
                    errs.expect(collectives(prof) == {}, f"v={v} rules={rules}: {collectives(prof)}")
                errs.result(f"v={v} rules={rules} i={li}", y, ref, ("b", "s", "v"), rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_gather_uneven_and_empty_blocks(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    for v in UNEVEN:
        w = global_array(f"v:{v};d:3", v)
        idx = int_array("b:5;s:2", -1, v + 1, v + 1)
        ref = gather_ref(w, idx)
        for rules in rule_variants(mesh, "b", "d"):
            for lw in layouts(mesh, ["v", "d"], limit=4):
                for li in layouts(mesh, ["b", "s"], limit=2):
                    x = mesh.from_numpy(w, f"v:{v};d:3", layout=lw)
                    i = mesh.from_numpy(idx, "b:5;s:2", layout=li)
                    with mm.layout_scope(mesh, rules):
                        y = mm.gather(x, i, "v")
                    errs.result(f"v={v} rules={rules} w={lw} i={li}", y, ref, ("b", "s", "d"), rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_gather_batched_uneven(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    w = global_array("n:5;v:7;d:2", 31)
    idx = int_array("s:3;n:5", 0, 7, 32)
    ref = np.stack([w[np.arange(5), idx[s]] for s in range(3)])  # [s, n, d]
    for rules in [{}] + [{"n": m} for m in big(mesh)[:1]] + [{"s": m} for m in big(mesh)[-1:]]:
        for lw in layouts(mesh, ["n", "v", "d"], limit=4):
            for li in layouts(mesh, ["s", "n"], limit=3):
                x = mesh.from_numpy(w, "n:5;v:7;d:2", layout=lw)
                i = mesh.from_numpy(idx, "s:3;n:5", layout=li)
                with mm.layout_scope(mesh, rules):
                    y = mm.gather(x, i, "v")
                errs.result(f"rules={rules} w={lw} i={li}", y, ref, ("s", "n", "d"), rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_gather_uneven_vocab_one_allreduce(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    w, idx = global_array("v:5;d:3", 33), int_array("b:7", 0, 5, 34)
    for m in big(mesh):
        others = [o for o in big(mesh) if o != m]
        for rules in [{}] + [{"b": o} for o in others[:1]]:
            x = mesh.from_numpy(w, "v:5;d:3", layout={"v": m})
            i = mesh.from_numpy(idx, "b:7", layout=rules)
            with mm.layout_scope(mesh, rules), mm.profile() as prof:
                y = mm.gather(x, i, "v")
            n = local_size(mesh, {"b": 7, "d": 3}, rules)
            want = {f"allreduce/{m}": {"calls": 1, "elements": n, "bytes": 4 * n}} if n else {}
            errs.expect(collectives(prof) == want, f"m={m} rules={rules}: {collectives(prof)} != {want}")
            errs.result(f"m={m} rules={rules}", y, gather_ref(w, idx), ("b", "d"), rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_top_k_and_argmax_uneven_and_empty_blocks(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    bd = big(mesh)
    for v in UNEVEN:
        for data in (tied(f"b:5;v:{v}", v), global_array(f"b:5;v:{v}", v + 2)):
            for k in sorted({1, 2, v}):
                rv, ri = top_k_ref(data, 1, k)
                rules_list = [{}] + [{"b": m} for m in bd[-1:]] + [{"k": m} for m in bd[:1]]
                for rules in rules_list:
                    for lx in layouts(mesh, ["b", "v"], limit=4):
                        x = mesh.from_numpy(data, f"b:5;v:{v}", layout=lx)
                        with mm.layout_scope(mesh, rules):
                            values, indices = mm.top_k(x, "v", f"k:{k}")
                        what = f"v={v} k={k} rules={rules} x={lx}"
                        errs.result(f"{what} values", values, rv, ("b", "k"), rules)
                        errs.result(f"{what} indices", indices, ri, ("b", "k"), rules)
            for lx in layouts(mesh, ["b", "v"], limit=4):
                x = mesh.from_numpy(data, f"b:5;v:{v}", layout=lx)
                for rules in ({}, {"b": bd[-1]} if bd else {}):
                    with mm.layout_scope(mesh, rules):
                        y = mm.argmax(x, "v")
                    errs.result(f"argmax v={v} rules={rules} x={lx}", y, np.argmax(data, 1).astype(np.int32),
                                ("b",), rules)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_uneven_split_dim_exchanges_only_real_candidates(mshape: str) -> None:
    """Over v:5 (or v:2, empty blocks on 3+ ranks) each rank sends min(k, its block length)
    candidates per row; a rank with an empty block sends nothing."""
    mesh, errs = get_mesh(mshape), Errors()
    for v in (2, 5):
        data = tied(f"b:3;v:{v}", 35)
        for m in big(mesh):
            x = mesh.from_numpy(data, f"b:3;v:{v}", layout={"v": m})
            for k in sorted({1, 2, v}):
                rv, ri = top_k_ref(data, 1, k)
                with mm.profile() as prof:
                    values, indices = mm.top_k(x, "v", f"k:{k}")
                cand = 3 * min(k, block_len(mesh, v, m))
                want = {f"allgather/{m}": {"calls": 2, "elements": 2 * cand, "bytes": 8 * cand}}
                errs.expect(collectives(prof) == want, f"v={v} m={m} k={k}: {collectives(prof)} != {want}")
                errs.result(f"v={v} m={m} k={k} values", values, rv, ("b", "k"), {})
                errs.result(f"v={v} m={m} k={k} indices", indices, ri, ("b", "k"), {})
            with mm.profile() as prof:
                y = mm.argmax(x, "v")
            cand = 3 * min(1, block_len(mesh, v, m))
            want = {f"allgather/{m}": {"calls": 2, "elements": 2 * cand, "bytes": 8 * cand}}
            errs.expect(collectives(prof) == want, f"argmax v={v} m={m}: {collectives(prof)} != {want}")
            errs.result(f"argmax v={v} m={m}", y, np.argmax(data, 1).astype(np.int32), ("b",), {})
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_empty_dims(mshape: str) -> None:
    """Dims of size 0: empty outputs of the right shape; argmax over one has no answer."""
    mesh = get_mesh(mshape)
    m = (big(mesh) or [None])[0]
    lay = {"b": m} if m else {}
    i = mesh.from_numpy(np.zeros(0, np.int32), "b:0", layout=lay)
    assert mm.one_hot(i, "v:3").to_numpy().shape == (0, 3)
    assert mm.gather(mesh.ones("v:3;d:2", layout={"v": m} if m else {}), i, "v").to_numpy().shape == (0, 2)
    x = mesh.from_numpy(np.zeros((0, 3)), "b:0;v:3", layout=lay)
    assert mm.argmax(x, "v").to_numpy().shape == (0,)
    assert mm.top_k(x, "v", "k:2")[1].to_numpy().shape == (0, 2)
    assert mm.one_hot(mesh.from_numpy(np.zeros(2, np.int32), "b:2"), "v:0").to_numpy().shape == (2, 0)
    with pytest.raises(mm.ShapeError, match="v:0"):
        mm.argmax(mesh.from_numpy(np.zeros((2, 0)), "b:2;v:0"), "v")


@pytest.mark.parametrize("mshape", SHAPES[:2])
def test_uneven_gradients(mshape: str) -> None:
    mesh = get_mesh(mshape)
    bd = big(mesh)
    w = global_array("v:5;d:3", 36, np.float64)
    idx = np.array([[1, 4, 1, 7], [0, 3, -1, 2]], dtype=np.int32)
    data = np.random.default_rng(37).permutation(21).reshape(3, 7) / 4.0  # no ties
    for m in [None] + bd:
        lay = {"v": m} if m else {}
        check_gradients(mesh, lambda x, i: mm.square(mm.gather(x, i, "v")), [w, idx], ["v:5;d:3", "b:2;s:4"],
                        [lay, {"s": m} if m else {}], wrt=[0])
        for rules in [{}] + ([{"k": m}, {"b": m}] if m else []):
            check_gradients(mesh, scoped(mesh, rules, lambda x: mm.square(mm.top_k(x, "v", "k:3")[0])),
                            [data], ["b:3;v:7"], [lay])


def test_errors() -> None:
    mesh = get_mesh(SHAPES[0])
    x, i = mesh.ones("b:2;v:4"), mesh.from_numpy(np.zeros(2, np.int32), "b:2")
    with pytest.raises(mm.ShapeError, match="k:5"):
        mm.top_k(x, "v", "k:5")
    with pytest.raises(mm.ShapeError, match="b:2 must be a new dim"):
        mm.top_k(x, "v", "b:2")
    with pytest.raises(mm.ShapeError, match="reduced dim v:0 of shape .* is empty"):
        mm.top_k(mesh.ones("b:2;v:0"), "v", "k:1")
    with pytest.raises(mm.ShapeError, match="'w'"):
        mm.argmax(x, "w")
    with pytest.raises(mm.ShapeError, match="size 4"):
        mm.argmax(x, "v:3")
    with pytest.raises(mm.ShapeError, match="b:2"):
        mm.one_hot(i, "b:2")
    with pytest.raises(mm.ShapeError, match="needs a size"):
        mm.one_hot(i, "v")
    with pytest.raises(mm.MpimeshError, match="integer"):
        mm.gather(x, x, "v")
    with pytest.raises(mm.ShapeError, match="'z'"):
        mm.gather(x, i, "z")
    with pytest.raises(mm.ShapeError, match="'b'"):
        mm.gather(x, mesh.from_numpy(np.zeros(3, np.int32), "b:3"), "v")


@pytest.mark.parametrize("mshape", SHAPES)
@pytest.mark.parametrize("dtype, vocab", [(np.int8, 300), (np.uint8, 600), (np.int16, 200), (np.int8, 200)])
def test_gather_with_narrow_index_dtypes(mshape: str, dtype, vocab: int) -> None:
    """int8/uint8/int16 indices over a split vocabulary: each rank's block start (150, 300, ...) did not
    fit the index dtype (numpy's OverflowError on some ranks only), and int8 -100 - 100 wrapped into a
    block (row 156 looked up); out-of-range ids look up zeros, as on one rank."""
    mesh, errs = get_mesh(mshape), Errors()
    info = np.iinfo(dtype)
    w = global_array(f"v:{vocab};d:2", 7)
    idx = np.array([info.min, -100, -1, 0, 3, 127, info.max, 150, 151, 299], np.int64)
    idx = idx[(idx >= info.min) & (idx <= info.max)].astype(dtype)
    ref = gather_ref(w, idx.astype(np.int64))
    for lw in layouts(mesh, ["v", "d"], limit=4):
        x = mesh.from_numpy(w, f"v:{vocab};d:2", layout=lw)
        i = mesh.from_numpy(idx, f"b:{idx.size}")
        errs.result(f"{np.dtype(dtype)} v={vocab} w={lw}", mm.gather(x, i, "v"), ref, ("b", "d"), {})
    errs.check()


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.int8, np.uint8])
def test_top_k_at_the_ends_of_integer_ranges(dtype) -> None:
    """The most negative int and unsigned values past 2**63 (top_k negated int64 keys, which overflows
    at the minimum, and cast uint64 to int64, which wraps): the largest win, as argmax says, against
    numpy's stable sort."""
    mesh = get_mesh(f"all:{mm.MPI.COMM_WORLD.Get_size()}")
    info = np.iinfo(dtype)
    g = np.array([[info.min, 0, 5, info.max, info.max - 1, info.min + 1, 1, info.max // 2 + 3]], dtype)
    x = mesh.from_numpy(g, "r:1;v:8", layout="v:all")
    for k in (1, 3, 8):
        values, positions = mm.top_k(x, "v", mm.Dimension("k", k))
        order = np.argsort(-g.astype(object)[0], kind="stable")[:k].astype(np.int64)
        np.testing.assert_array_equal(positions.to_numpy()[0], order, err_msg=f"{np.dtype(dtype)} k={k}")
        np.testing.assert_array_equal(values.to_numpy()[0], g[0][order])
    assert mm.argmax(x, "v").to_numpy()[0] == 3
