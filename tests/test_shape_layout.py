"""Dimension, Shape, LayoutRules and the pure layout arithmetic (no communication needed)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import mpimesh as mm
from mpimesh.layout import layout_from_spec, local_sizes, plan_layout, slice_bounds, validate_layout


# ---------------------------------------------------------------- Dimension and Shape

def test_dimension_equality() -> None:
    a = mm.Dimension("io", 32)
    assert a.name == "io" and a.size == 32
    assert a == mm.Dimension("io", 32)
    assert a != mm.Dimension("io", 16)
    assert a != mm.Dimension("oi", 32)
    assert hash(a) == hash(mm.Dimension("io", 32))


@pytest.mark.parametrize("spec", [
    "batch:8;io:32;hidden:4",
    "batch:8,io:32,hidden:4",
    "batch:8 io:32 hidden:4",
    " batch:8; io:32 ,hidden:4 ",
    [mm.Dimension("batch", 8), mm.Dimension("io", 32), mm.Dimension("hidden", 4)],
    [("batch", 8), ("io", 32), ("hidden", 4)],
    (("batch", 8), mm.Dimension("io", 32), ["hidden", 4]),
])
def test_shape_constructors(spec) -> None:
    s = mm.Shape(spec)
    assert s.dims == (mm.Dimension("batch", 8), mm.Dimension("io", 32), mm.Dimension("hidden", 4))
    assert s.names == ("batch", "io", "hidden")
    assert s.sizes == (8, 32, 4)
    assert s.size == 8 * 32 * 4
    assert s.rank == 3
    assert s["io"] == mm.Dimension("io", 32)
    assert "io" in s and "nope" not in s
    assert list(s) == list(s.dims)
    assert [d.name for d in s] == ["batch", "io", "hidden"]
    assert s == mm.Shape("batch:8;io:32;hidden:4")
    assert hash(s) == hash(mm.Shape("batch:8;io:32;hidden:4"))


def test_shape_equality_and_hash() -> None:
    a, b = mm.Shape("a:2;b:3"), mm.Shape([("a", 2), ("b", 3)])
    assert a == b and hash(a) == hash(b)
    assert a != mm.Shape("b:3;a:2")  # order matters
    assert a != mm.Shape("a:2;b:4")
    assert a != mm.Shape("a:2")
    table = {a: "x"}
    assert table[b] == "x"
    assert len({a, b, mm.Shape("b:3;a:2")}) == 2


def test_shape_str_repr_roundtrip() -> None:
    s = mm.Shape("batch:8;io:32")
    assert str(s) == "[batch:8, io:32]"
    assert mm.Shape(str(s)) == s
    assert eval(repr(s), {"Shape": mm.Shape}) == s
    assert mm.Shape(str(mm.Shape(""))) == mm.Shape([])


def test_scalar_shape() -> None:
    s = mm.Shape([])
    assert s.rank == 0 and s.size == 1 and s.names == () and list(s) == []
    assert s == mm.Shape("")


def test_shape_missing_dim() -> None:
    with pytest.raises(mm.ShapeError, match="nope"):
        mm.Shape("a:2")["nope"]


@pytest.mark.parametrize("spec", ["a:2;a:3", "a:2;b:3;a:2", [("x", 2), ("x", 2)]])
def test_shape_repeated_names(spec) -> None:
    with pytest.raises(mm.ShapeError) as info:
        mm.Shape(spec)
    assert isinstance(info.value, ValueError) and isinstance(info.value, mm.MpimeshError)
    assert "repeat" in str(info.value) and ("'a'" in str(info.value) or "'x'" in str(info.value))


@pytest.mark.parametrize("spec", ["a2", "a:", ":3", "a:b", "a:2:3", [("a", -1)], [("a", 2.5)], [(3, 2)]])
def test_shape_malformed(spec) -> None:
    with pytest.raises(mm.ShapeError):
        mm.Shape(spec)


# ---------------------------------------------------------------- LayoutRules

@pytest.mark.parametrize("spec", [
    "batch:rows;hidden:cols",
    "batch:rows,hidden:cols",
    "batch:rows hidden:cols",
    [("batch", "rows"), ("hidden", "cols")],
    {"batch": "rows", "hidden": "cols"},
    {"batch": "rows", "hidden": "cols", "io": None},
])
def test_layout_rules_parsing(spec) -> None:
    rules = mm.LayoutRules(spec)
    assert rules == mm.LayoutRules("batch:rows;hidden:cols")
    assert hash(rules) == hash(mm.LayoutRules("batch:rows;hidden:cols"))
    assert rules.mesh_dim("batch") == "rows"
    assert rules.mesh_dim("hidden") == "cols"
    assert rules.mesh_dim("io") is None
    assert mm.LayoutRules(rules) == rules


def test_layout_rules_empty() -> None:
    for spec in ("", [], {}):
        assert mm.LayoutRules(spec).mesh_dim("batch") is None


@pytest.mark.parametrize("spec", ["batch:rows;batch:cols", [("batch", "rows"), ("batch", "cols")]])
def test_layout_rules_tensor_dim_on_two_mesh_dims(spec) -> None:
    with pytest.raises(mm.LayoutError) as info:
        mm.LayoutRules(spec)
    msg = str(info.value)
    assert "batch" in msg and "rows" in msg and "cols" in msg
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("spec", ["batch", "batch:rows:cols", [("batch",)], [("batch", "")]])
def test_layout_rules_malformed(spec) -> None:
    with pytest.raises(mm.LayoutError):
        mm.LayoutRules(spec)


# ---------------------------------------------------------------- plan_layout / validate_layout

MESH = mm.Shape("rows:2;cols:4")


def test_plan_layout() -> None:
    shape = mm.Shape("batch:8;io:6;hidden:12")
    assert plan_layout(shape, MESH, mm.LayoutRules("batch:rows;hidden:cols")) == ("rows", None, "cols")
    assert plan_layout(shape, MESH, mm.LayoutRules("")) == (None, None, None)
    # rules for dims the tensor lacks are ignored
    assert plan_layout(shape, MESH, mm.LayoutRules("other:rows;io:rows")) == (None, "rows", None)


def test_plan_layout_unknown_mesh_dim() -> None:
    with pytest.raises(mm.LayoutError) as info:
        plan_layout(mm.Shape("batch:8"), MESH, mm.LayoutRules("batch:planes"))
    assert "batch" in str(info.value) and "planes" in str(info.value)


def test_plan_layout_two_tensor_dims_on_one_mesh_dim() -> None:
    with pytest.raises(mm.LayoutError) as info:
        plan_layout(mm.Shape("batch:8;hidden:8"), MESH, mm.LayoutRules("batch:cols;hidden:cols"))
    msg = str(info.value)
    assert "batch" in msg and "hidden" in msg and "cols" in msg and "4" in msg


def test_plan_layout_not_divisible() -> None:
    """Sizes need not divide (wave 2): the layout is planned, and blocks follow numpy.array_split."""
    assert plan_layout(mm.Shape("batch:8;hidden:6"), MESH, mm.LayoutRules("hidden:cols")) == (None, "cols")
    assert [local_sizes(mm.Shape("hidden:6"), MESH, ("cols",), {"rows": 0, "cols": c}) for c in range(4)] == \
        [(2,), (2,), (1,), (1,)]


def test_validate_layout() -> None:
    shape = mm.Shape("a:4;b:8")
    assert validate_layout(shape, MESH, ("rows", "cols")) == ("rows", "cols")
    assert validate_layout(shape, MESH, (None, None)) == (None, None)
    with pytest.raises(mm.LayoutError, match="planes"):
        validate_layout(shape, MESH, ("planes", None))
    with pytest.raises(mm.LayoutError, match="'a'.*'b'.*'rows'"):
        validate_layout(shape, MESH, ("rows", "rows"))
    assert validate_layout(mm.Shape("a:2;b:8"), MESH, ("cols", None)) == ("cols", None)  # empty blocks too


# ---------------------------------------------------------------- local_sizes / slice_bounds

def _all_layouts(shape: mm.Shape, mesh_shape: mm.Shape):
    for choice in itertools.product([None] + list(mesh_shape.names), repeat=shape.rank):
        used = [m for m in choice if m]
        if len(used) == len(set(used)):
            yield tuple(choice)


@pytest.mark.parametrize("shape_spec", ["a:8;b:4;c:16", "a:7;b:2;c:5", "a:3;b:1;c:10"])
@pytest.mark.parametrize("mesh_spec", ["x:1", "x:2", "x:3", "rows:2;cols:4", "p:2;q:3;r:2"])
def test_local_sizes_and_slice_bounds(mesh_spec: str, shape_spec: str) -> None:
    mesh_shape, shape = mm.Shape(mesh_spec), mm.Shape(shape_spec)
    g = np.arange(shape.size).reshape(shape.sizes)
    for layout in _all_layouts(shape, mesh_shape):
        for coords in itertools.product(*[range(k) for k in mesh_shape.sizes]):
            c = dict(zip(mesh_shape.names, coords))
            # independent: block c of numpy.array_split along each split dim (possibly empty)
            want = g
            for axis, m in enumerate(layout):
                if m is not None:
                    want = np.array_split(want, mesh_shape[m].size, axis=axis)[c[m]]
            got = g[slice_bounds(shape, mesh_shape, layout, c)]
            np.testing.assert_array_equal(got, want)
            assert got.shape == local_sizes(shape, mesh_shape, layout, c)
        if all(m is None or shape[n].size % mesh_shape[m].size == 0 for n, m in zip(shape.names, layout)):
            assert local_sizes(shape, mesh_shape, layout) == want.shape  # even: any rank's, without coords
        else:
            with pytest.raises(mm.LayoutError, match="coords"):
                local_sizes(shape, mesh_shape, layout)


def test_slice_bounds_examples() -> None:
    shape, mesh_shape = mm.Shape("a:6;b:8"), mm.Shape("rows:3;cols:2")
    assert local_sizes(shape, mesh_shape, ("rows", "cols")) == (2, 4)
    assert slice_bounds(shape, mesh_shape, ("rows", "cols"), {"rows": 2, "cols": 1}) == (slice(4, 6), slice(4, 8))
    assert slice_bounds(shape, mesh_shape, (None, "rows"), {"rows": 1, "cols": 0})[1] != slice(0, 8)
    assert local_sizes(shape, mesh_shape, ("cols", None)) == (3, 8)


# ---------------------------------------------------------------- layout_from_spec

@pytest.mark.parametrize("spec", [
    "c:rows;a:cols", "a:cols,c:rows", [("a", "cols"), ("c", "rows")], {"a": "cols", "c": "rows", "b": None},
    mm.LayoutRules("a:cols;c:rows"), ("cols", None, "rows"),
])
def test_layout_from_spec(spec) -> None:
    shape = mm.Shape("a:8;b:4;c:16")
    assert layout_from_spec(shape, MESH, spec) == ("cols", None, "rows")


def test_layout_from_spec_empty() -> None:
    shape = mm.Shape("a:8;b:4")
    assert layout_from_spec(shape, MESH, "") == (None, None)
    assert layout_from_spec(shape, MESH, {}) == (None, None)


def test_layout_from_spec_errors() -> None:
    shape = mm.Shape("a:8;b:6")
    with pytest.raises(mm.LayoutError) as info:  # a tensor dim not in the shape
        layout_from_spec(shape, MESH, "z:rows")
    assert "'z'" in str(info.value) and "a:8" in str(info.value) and "b:6" in str(info.value)
    with pytest.raises(mm.LayoutError, match="planes"):
        layout_from_spec(shape, MESH, "a:planes")
    with pytest.raises(mm.LayoutError, match="'a'.*'b'"):
        layout_from_spec(shape, MESH, "a:rows;b:rows")
    assert layout_from_spec(shape, MESH, "b:cols") == (None, "cols")  # 6 over 4: uneven, accepted
    with pytest.raises(mm.LayoutError, match="rows.*cols"):
        layout_from_spec(shape, MESH, "a:rows;a:cols")
