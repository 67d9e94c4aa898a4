"""mm.reshape / rename_dimension / transpose / broadcast against numpy on the global arrays, over
1-D/2-D/3-D meshes and many layouts, including dims their mesh dims do not divide (unequal and
empty `numpy.array_split` blocks); a reshape whose split dims lead their groups, with blocks that
hold the same elements before and after, moves no data; gradients."""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from gradcheck import check_gradients  # noqa: E402
from meshes import (  # noqa: E402
    big, collectives, Errors as _Errors, expected_local, get_mesh, global_array, layouts, mesh_shapes)

import mpimesh as mm  # noqa: E402
from mpimesh.backend import to_host  # noqa: E402
from mpimesh.ops.reshape import reshape_groups  # noqa: E402

SHAPES = mesh_shapes()


class Errors(_Errors):
    """Mismatches collected over a loop, asserted at the end (so every rank runs every collective)."""

    def result(self, what: str, y, ref: np.ndarray, rules: dict) -> None:
        """y has ref's values, its dim names and the layout the rules give."""
        names = y.shape.names
        want_layout = {d: m for d, m in rules.items() if d in names}
        if y.layout != want_layout:
            self.append(f"{what}: layout {y.layout} != {want_layout}")
        if y.shape.sizes != ref.shape:
            self.append(f"{what}: shape {y.shape} != {ref.shape}")
            return
        want = expected_local(ref, names, y.layout, y.mesh)
        if to_host(y.local).shape != want.shape or not np.array_equal(to_host(y.local), want):
            self.append(f"{what}: wrong local values")

# ------------------------------------------------------------------------------- reshape_groups

def test_reshape_groups() -> None:
    assert reshape_groups((2, 3, 4), (6, 2, 2)) == (((0, 1), (0,)), ((2,), (1, 2)))
    assert reshape_groups((8, 4), (32,)) == (((0, 1), (0,)),)
    assert reshape_groups((32,), (8, 4)) == (((0,), (0, 1)),)
    assert reshape_groups((4, 6), (6, 4)) == (((0, 1), (0, 1)),)
    assert reshape_groups((2, 3), (2, 3)) == (((0,), (0,)), ((1,), (1,)))
    assert reshape_groups((8, 1, 4), (8, 4)) == (((0,), (0,)), ((1, 2), (1,)))
    assert reshape_groups((8, 4, 2), (8, 8)) == (((0,), (0,)), ((1, 2), (1,)))
    assert reshape_groups((), ()) == ()


@pytest.mark.parametrize("old,new", [((2, 3, 4, 5), (6, 20)), ((6, 20), (2, 3, 4, 5)), ((4, 4, 4), (2, 8, 4)),
                                     ((3, 8, 2, 1), (24, 2)), ((1, 1, 6), (6, 1)), ((12,), (2, 2, 3)),
                                     ((2, 6, 10), (4, 3, 5, 2))])


def test_reshape_groups_partition(old: tuple, new: tuple) -> None:
    groups = reshape_groups(old, new)
    assert [i for gi, _ in groups for i in gi] == list(range(len(old)))
    assert [j for _, gj in groups for j in gj] == list(range(len(new)))
    for gi, gj in groups:
        assert math.prod(old[i] for i in gi) == math.prod(new[j] for j in gj)


# ------------------------------------------------------------------------------------- reshape

@pytest.mark.parametrize("mshape", SHAPES)
def test_leading_split_moves_no_data(mshape: str) -> None:
    """A split dim leading its group keeps its mesh dim through merging and splitting: no collective.
    The sizes are multiples of the mesh dims (a: 8 or 24), except in the last cases, whose unequal
    blocks still hold the same elements (a dim of size 1 merged in, c and e kept as they are)."""
    mesh, errs = get_mesh(mshape), Errors()
    bd = big(mesh)
    cases = []  # (old shape, layout, new shape, rules)
    for m in bd:
        other = [o for o in bd if o != m]
        extra = {"c": other[0]} if other else {}
        a = 8 if all(8 % mesh.shape[d].size == 0 for d in bd) else 24
        cases += [
            (f"a:{a};b:4;c:8", {"a": m, **extra}, f"ab:{4 * a};c:8", {"ab": m, **extra}),
            (f"ab:{4 * a};c:8", {"ab": m, **extra}, f"a:{a};b:4;c:8", {"a": m, **extra}),
            (f"c:8;a:{a};b:4", {"a": m, **extra}, f"c:8;ab:{4 * a}", {"ab": m, **extra}),
            (f"c:8;ab:{4 * a}", {"ab": m}, f"c:8;a:{a};b:2;e:2", {"a": m}),
            (f"a:{a};b:4;c:8", {"a": m}, f"abc:{32 * a}", {"abc": m}),
            (f"a:{a};b:4;c:8;d:2", {"a": m, "c": other[0]} if other else {"a": m},
             f"ab:{4 * a};cd:16", {"ab": m, "cd": other[0]} if other else {"ab": m}),
            ("a:7;b:1;c:5", {"a": m}, "ab:7;c:5", {"ab": m}),
            ("e:2;c:5;a:3;b:2", {"e": m, **extra}, "e:2;c:5;ab:6", {"e": m, **extra}),
        ]
    for old, lay, new, rules in cases:
        xa = global_array(old, 1)
        x = mesh.from_numpy(xa, old, layout=lay)
        with mm.layout_scope(mesh, rules), mm.profile() as prof:
            y = mm.reshape(x, new)
        what = f"{old} {lay} -> {new} {rules}"
        errs.result(what, y, xa.reshape(mm.Shape(new).sizes), rules)
        errs.expect(collectives(prof) == {}, f"{what}: moved data {collectives(prof)}")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_non_leading_split_is_still_correct(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    cases = []
    for m in big(mesh):
        cases += [
            ("a:8;b:8;c:8", {"b": m}, "ab:64;c:8", {"ab": m}),
            ("ab:64;c:8", {"ab": m}, "a:8;b:8;c:8", {"b": m}),
            ("a:8;b:8;c:8", {"c": m}, "a:8;bc:64", {"bc": m}),
            ("a:8;b:8;c:8", {"a": m}, "a:8;bc:64", {"bc": m}),
            ("a:2;b:16;c:8", {"b": m}, "ab:32;c:8", {"ab": m}),  # leading old dim too small to keep m
            ("a:4;b:6;c:8", {"a": m}, "x:6;y:4;c:8", {"y": m}),
            ("a:4;b:6;c:8", {"c": m}, "x:6;y:4;c:8", {"x": m}),
        ]
        cases += [  # blocks whose elements differ before and after (e.g. a:5 over 3: 2, 2, 1 of 2 = 4, 4, 2 vs 4, 3, 3)
            ("a:5;b:2;c:3", {"a": m}, "ab:10;c:3", {"ab": m}),
            ("ab:10;c:3", {"ab": m}, "a:5;b:2;c:3", {"a": m}),
            ("a:2;b:3;c:7", {"c": m}, "x:3;y:2;c:7", {"x": m}),
            ("a:2;b:1", {"a": m}, "ab:2", {"ab": m}),
            ("a:3;b:0", {"a": m}, "x:0;y:5", {"y": m}),
        ]
    cases.append(("a:4;b:6;c:8", {}, "x:6;y:4;c:8", {}))
    for old, lay, new, rules in cases:
        xa = global_array(old, 2)
        x = mesh.from_numpy(xa, old, layout=lay)
        with mm.layout_scope(mesh, rules):
            y = mm.reshape(x, new)
        errs.result(f"{old} {lay} -> {new} {rules}", y, xa.reshape(mm.Shape(new).sizes), rules)
        errs.expect(np.array_equal(to_host(x.local), expected_local(xa, x.shape.names, lay, mesh)), f"{old}: input changed")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_reshape_many_layouts(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    old = mm.Shape("a:8;b:8;c:4")
    xa = global_array("a:8;b:8;c:4", 3, np.float64)
    news = ["ab:64;c:4", "a:8;bc:32", "abc:256", "c:4;d:64", "a:8;b:8;c:4", "p:2;q:4;r:8;s:4"]
    bd = big(mesh)
    for lay in layouts(mesh, list(old.names), limit=6):
        x = mesh.from_numpy(xa, old, layout=lay)
        for new in news:
            first = mm.Shape(new).names[0]
            for rules in [{}] + [{first: m} for m in bd[:1]] + [dict(zip(mm.Shape(new).names[::-1], bd))]:
                with mm.layout_scope(mesh, rules):
                    y = mm.reshape(x, new)
                errs.result(f"{lay} -> {new} {rules}", y, xa.reshape(mm.Shape(new).sizes), rules)
                errs.expect(y.dtype == np.float64, f"dtype {y.dtype}")
    errs.check()


def test_reshape_size_mismatch_raises() -> None:
    mesh = get_mesh(SHAPES[0])
    x = mesh.ones("a:8;b:4")
    with pytest.raises(mm.ShapeError, match="32"):
        mm.reshape(x, "ab:30")
    with pytest.raises(mm.ShapeError):
        mm.reshape(x, "a:8;b:8")
    with pytest.raises(mm.ShapeError):
        mm.reshape(x, "a:4;a:8")  # repeated name


# ----------------------------------------------------------------------------- rename_dimension

@pytest.mark.parametrize("mshape", SHAPES)
def test_rename_dimension(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    xa = global_array("a:8;b:8", 4)
    bd = big(mesh)
    for m in bd or [None]:
        lay = {"a": m} if m else {}
        x = mesh.from_numpy(xa, "a:8;b:8", layout=lay)
        # the new name's rule keeps the mesh dim: nothing moves
        with mm.layout_scope(mesh, {"z": m} if m else {}), mm.profile() as prof:
            y = mm.rename_dimension(x, "a", "z")
        errs.expect(y.shape == mm.Shape("z:8;b:8"), f"shape {y.shape}")
        errs.result(f"a:{m} -> z:{m}", y, xa, {"z": m} if m else {})
        errs.expect(collectives(prof) == {}, f"rename a:{m} -> z:{m} moved data: {collectives(prof)}")
        # the new name has another rule (or none): the layout follows the rules
        for rules in [{}] + [{"z": o} for o in bd if o != m] + [{"b": o} for o in bd[-1:]]:
            with mm.layout_scope(mesh, rules):
                y = mm.rename_dimension(x, "a", "z")
            errs.result(f"a:{m} -> z under {rules}", y, xa, rules)
        with mm.layout_scope(mesh, {"b": m} if m else {}):
            y = mm.rename_dimension(x, "b", "q")
        errs.result(f"rename b->q from {lay}", y, xa, {})
    errs.check()
    x = mesh.ones("a:8;b:8")
    with pytest.raises(mm.ShapeError):
        mm.rename_dimension(x, "nope", "z")
    with pytest.raises(mm.ShapeError):
        mm.rename_dimension(x, "a", "b")


# ---------------------------------------------------------------------------- transpose/broadcast

@pytest.mark.parametrize("mshape", SHAPES)
def test_transpose(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    old = mm.Shape("a:8;b:3;c:5")  # b and c unequal over 2, 3 or 4 ranks (b over 4: one block empty)
    xa = global_array("a:8;b:3;c:5", 5)
    bd = big(mesh)
    perms = [("c", "a", "b"), ("b", "c", "a"), ("a", "c", "b"), ("a", "b", "c")]
    for lay in layouts(mesh, list(old.names), limit=6):
        x = mesh.from_numpy(xa, old, layout=lay)
        for perm in perms:
            new = [old[n] for n in perm]
            ref = np.transpose(xa, [old.names.index(n) for n in perm])
            for rules in [{}, lay, dict(zip(("b", "c", "a"), bd))]:
                with mm.layout_scope(mesh, rules):
                    y = mm.transpose(x, new)
                errs.result(f"{lay} -> {perm} {rules}", y, ref, rules)
    errs.check()
    with pytest.raises(mm.ShapeError):
        mm.transpose(x, "a:8;b:3")
    with pytest.raises(mm.ShapeError):
        mm.transpose(x, "a:8;b:3;c:4")


@pytest.mark.parametrize("mshape", SHAPES)
def test_broadcast(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    old = mm.Shape("a:8;c:5")  # c, b, d unequal over 2, 3 or 4 ranks (some blocks empty)
    xa = global_array("a:8;c:5", 6)
    bd = big(mesh)
    targets = ["a:8;b:3;c:5", "c:5;b:3;a:8", "d:2;a:8;c:5", "a:8;c:5", "b:0;a:8;c:5"]
    for lay in layouts(mesh, list(old.names), limit=5):
        x = mesh.from_numpy(xa, old, layout=lay)
        for target in targets:
            new = mm.Shape(target)
            ref = np.broadcast_to(np.transpose(xa, [old.names.index(n) for n in new.names if n in old])
                                  .reshape([d.size if d.name in old else 1 for d in new]), new.sizes)
            for rules in [{}, lay, dict(zip(("b", "c", "a"), bd))]:
                with mm.layout_scope(mesh, rules):
                    y = mm.broadcast(x, target)
                errs.result(f"{lay} -> {target} {rules}", y, ref, rules)
    errs.check()
    with pytest.raises(mm.ShapeError, match="a"):
        mm.broadcast(x, "c:5;b:4")  # drops a
    with pytest.raises(mm.ShapeError, match="c"):
        mm.broadcast(x, "a:8;c:4")  # c changes size


# ------------------------------------------------------------------------------------------ gradients

@pytest.mark.parametrize("mshape", SHAPES)
def test_gradients_uneven(mshape: str) -> None:
    """reshape (kept, and gathered and cut again), transpose and broadcast where the mesh dims do not
    divide the dims (some blocks empty), against finite differences."""
    mesh = get_mesh(mshape)
    bd = big(mesh)
    m = bd[0] if bd else None
    lay = {"a": m, "c": bd[-1]} if len(bd) > 1 else {"a": m} if m else {}
    rules = {"ab": m, "x": m, "c": bd[-1]} if len(bd) > 1 else {"ab": m, "x": m} if m else {}
    a = global_array("a:5;b:2;c:3", 11, np.float64)
    w = global_array("c:3;ab:10;d:2", 12, np.float64)
    with mm.layout_scope(mesh, rules):
        wt = mesh.from_numpy(w, "c:3;ab:10;d:2")
        kw = {"directions": 1}
        check_gradients(mesh, lambda x: mm.reshape(x, "ab:10;c:3") ** 2, [a], ["a:5;b:2;c:3"], [lay], **kw)
        check_gradients(mesh, lambda x: mm.reshape(x, "a:5;y:6") * mm.reshape(x, "x:5;y:6"), [a],
                        ["a:5;b:2;c:3"], [lay], **kw)
        check_gradients(mesh, lambda x: mm.transpose(x, "c:3;b:2;a:5") ** 2, [a], ["a:5;b:2;c:3"], [lay], **kw)
        check_gradients(mesh, lambda x: mm.broadcast(mm.reshape(x, "ab:10;c:3"), "c:3;ab:10;d:2") * wt, [a],
                        ["a:5;b:2;c:3"], [lay], **kw)
