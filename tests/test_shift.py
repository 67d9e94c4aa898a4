"""mm.shift and mm.halo_exchange against numpy on the global arrays: shifts across slice edges,
offsets larger than a slice and than the dim, wrap and zero fill; halos wider than a neighbour's
slice; sizes that do not divide (blocks of numpy.array_split, some empty, and a dim of size 0);
the permute traffic; gradients."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from gradcheck import check_gradients  # noqa: E402
from meshes import big, get_mesh, global_array, mesh_shapes, spec, transfers  # noqa: E402

import mpimesh as mm  # noqa: E402

pytestmark = pytest.mark.mpi
SHAPES = mesh_shapes()
SHAPE = "a:8;b:16"
# sizes that rarely divide: blocks of 7 over 3 are (3, 2, 2), of 2 over 4 (1, 1, 0, 0), of 5 over 8 have 3 empty
UNEVEN = ["a:3;b:7", "a:5;b:2", "a:2;b:5", "a:3;b:0"]


def rule_sets(mesh: mm.Mesh) -> list[dict]:
    """Layouts to try: unsplit, b split (on each big mesh dim), a and b split."""
    b = big(mesh)
    out = [{}] + [{"b": m} for m in b]
    if len(b) >= 2:
        out.append({"a": b[0], "b": b[1]})
    elif b:
        out.append({"a": b[0]})
    return out


def np_shift(x: np.ndarray, offset: int, axis: int, wrap: bool) -> np.ndarray:
    """out[i] = x[i - offset], by explicit indexing."""
    n = x.shape[axis]
    if n == 0:
        return x.copy()
    src = np.arange(n) - offset
    if wrap:
        return np.take(x, src % n, axis=axis)
    valid = (src >= 0) & (src < n)
    out = np.take(x, np.clip(src, 0, n - 1), axis=axis)
    mask = valid.reshape([-1 if i == axis else 1 for i in range(x.ndim)])
    return np.where(mask, out, 0)


def np_halo(x: np.ndarray, axis: int, halo: int, k: int, wrap: bool) -> np.ndarray:
    """The k blocks of x along `axis` (numpy.array_split's), each widened by `halo` global
    neighbours per side."""
    n_all = x.shape[axis]
    starts = np.cumsum([0] + [len(p) for p in np.array_split(np.arange(n_all), k)])
    blocks = []
    for start, stop in zip(starts[:-1], starts[1:]):
        idx = start - halo + np.arange(stop - start + 2 * halo)
        valid = (idx >= 0) & (idx < n_all)
        if n_all == 0:
            vals = np.zeros(x.shape[:axis] + (idx.size,) + x.shape[axis + 1:], x.dtype)
        else:
            vals = np.take(x, idx % n_all if wrap else np.clip(idx, 0, n_all - 1), axis=axis)
        if not wrap:
            vals = np.where(valid.reshape([-1 if i == axis else 1 for i in range(x.ndim)]), vals, 0)
        blocks.append(vals)
    return np.concatenate(blocks, axis=axis)


def sizes(shape: str) -> tuple[int, int]:
    return tuple(mm.Shape(shape).sizes)


@pytest.mark.parametrize("shape", [SHAPE] + UNEVEN)
@pytest.mark.parametrize("mesh_shape", SHAPES)
def test_shift_forward(mesh_shape, shape):
    mesh = get_mesh(mesh_shape)
    x = global_array(shape, seed=1)
    na = sizes(shape)[0]
    offsets = (-21, -5, -1, 0, 1, 2, 3, 5, 9, 15, 16, 37) if shape == SHAPE else (-8, -3, -1, 1, 2, 4, 6, 13)
    errs = []
    for rules in rule_sets(mesh):
        with mm.layout_scope(mesh, spec(rules)):
            t = mesh.from_numpy(x, shape)
            for offset in offsets:
                for wrap in (True, False):
                    for dim, axis in (("b", 1), (mm.Dimension("a", na), 0)):
                        y = mm.shift(t, offset, dim, wrap)
                        want = np_shift(x, offset, axis, wrap)
                        got = y.to_numpy()
                        if y.layout != rules or not np.array_equal(got, want):
                            errs.append(f"{shape} {rules} offset={offset} wrap={wrap} dim={dim}: layout {y.layout}")
    assert not errs, "\n".join(errs[:5])


@pytest.mark.parametrize("mesh_shape", SHAPES)
def test_shift_traffic(mesh_shape):
    """A shift by n + 1 of a dim split in equal blocks of n sends the block in two pieces to two ranks."""
    mesh = get_mesh(mesh_shape)
    b = big(mesh)
    if not b:
        pytest.skip("no mesh dim of size > 1")
    m = b[-1]
    k = mesh.shape[m].size
    shape = "a:8;b:24"  # 24 divides over 2, 3, 4, 6 and 8
    n = 24 // k
    with mm.layout_scope(mesh, f"b:{m}"):
        t = mesh.from_numpy(global_array(shape), shape)
        with mm.profile() as prof:
            mm.shift(t, n + 1, "b", wrap=True)
    counts = transfers({key: v for key, v in prof.counters.items() if key != "flops"})
    assert set(counts) == {f"permute/{m}"}, counts
    # a:8 rows; n-1 columns come from 1 coordinate back, 1 column from 2 back (local when k == 2)
    assert counts[f"permute/{m}"]["elements"] == 8 * (n - 1) + (8 if k > 2 else 0)
    assert counts[f"permute/{m}"]["calls"] == (2 if k > 2 else 1)


@pytest.mark.parametrize("mesh_shape", SHAPES)
def test_halo_exchange_forward(mesh_shape):
    mesh = get_mesh(mesh_shape)
    errs = []
    for shape in [SHAPE] + UNEVEN:
        x = global_array(shape, seed=2)
        na, nb = sizes(shape)
        for rules in rule_sets(mesh):
            k = mesh.shape[rules["b"]].size if "b" in rules else 1
            with mm.layout_scope(mesh, spec(rules)):
                t = mesh.from_numpy(x, shape)
                # wider than a slice of 2 (8 ranks) or 4 (4 ranks), than empty slices, or the dim
                for halo in ((0, 1, 2, 3, 5, 17) if shape == SHAPE else (1, 2, 3, 8)):
                    for wrap in (False, True):
                        y = mm.halo_exchange(t, "b", halo, wrap=wrap)
                        want = np_halo(x, 1, halo, k, wrap)
                        if y.shape != mm.Shape(f"a:{na};b:{nb + 2 * halo * k}") or y.layout != rules:
                            errs.append(f"{shape} {rules} halo={halo}: shape {y.shape} layout {y.layout}")
                        elif not np.array_equal(y.to_numpy(), want):
                            errs.append(f"{shape} {rules} halo={halo} wrap={wrap}: values differ")
    assert not errs, "\n".join(errs[:5])


@pytest.mark.parametrize("mesh_shape", SHAPES)
def test_halo_exchange_traffic(mesh_shape):
    """A halo of 1 sends one boundary column to each existing neighbour, nothing more, with equal
    blocks (b:16 over 2, 4, 8) and unequal ones (b:2k+1: one block of 3, the others of 2)."""
    mesh = get_mesh(mesh_shape)
    b = big(mesh)
    if not b:
        pytest.skip("no mesh dim of size > 1")
    m = b[0]
    k, c = mesh.shape[m].size, mesh.coords[m]
    neighbours = (c > 0) + (c < k - 1)
    for shape in ("a:8;b:16", f"a:8;b:{2 * k + 1}"):
        with mm.layout_scope(mesh, f"b:{m}"):
            t = mesh.from_numpy(global_array(shape), shape)
            with mm.profile() as prof:
                mm.halo_exchange(t, "b", 1)
            with mm.profile() as prof_shift:
                mm.shift(t, 1, "b", wrap=False)
        assert prof.counters[f"permute/{m}"]["elements"] == 8 * neighbours, shape
        assert set(transfers(prof.counters)) == {f"permute/{m}"}
        assert prof_shift.counters[f"permute/{m}"]["elements"] == 8 * (c < k - 1), shape


def test_errors():
    mesh = get_mesh(SHAPES[0])
    t = mesh.from_numpy(global_array(SHAPE), SHAPE)
    with pytest.raises(mm.ShapeError, match="'c'"):
        mm.shift(t, 1, "c", wrap=False)
    with pytest.raises(mm.ShapeError, match="b:8"):
        mm.shift(t, 1, mm.Dimension("b", 8), wrap=False)
    with pytest.raises(mm.MpimeshError, match="halo"):
        mm.halo_exchange(t, "b", -1)
    with pytest.raises(mm.MpimeshError, match="offset"):
        mm.shift(t, 1.5, "b", wrap=True)


@pytest.mark.parametrize("mesh_shape", SHAPES)
def test_gradients(mesh_shape):
    mesh = get_mesh(mesh_shape)
    for shape in (SHAPE, "a:3;b:7", "a:5;b:2"):
        x = global_array(shape, seed=3, dtype=np.float64)
        na, nb = sizes(shape)
        for rules in rule_sets(mesh)[-2:]:
            k = mesh.shape[rules["b"]].size if "b" in rules else 1
            with mm.layout_scope(mesh, spec(rules)):
                for offset, wrap in ((3, False), (-7, True), (21, True)):
                    r = global_array(shape, seed=4, dtype=np.float64)
                    check_gradients(mesh, lambda t, w, o=offset, wr=wrap: mm.shift(t, o, "b", wr) * w,
                                    [x, r], [shape, shape], wrt=[0])
                for halo, wrap in ((1, False), (5, True)):
                    hshape = f"a:{na};b:{nb + 2 * halo * k}"
                    r = global_array(hshape, seed=5, dtype=np.float64)
                    check_gradients(mesh, lambda t, w, h=halo, wr=wrap: mm.halo_exchange(t, "b", h, wr) * w,
                                    [x, r], [shape, hshape], wrt=[0])


def test_second_order_halo():
    """The transpose of halo_exchange is differentiable too (its gradient is halo_exchange)."""
    mesh = get_mesh(SHAPES[0])
    b = big(mesh)
    rules = f"b:{b[0]}" if b else ""
    k = mesh.shape[b[0]].size if b else 1
    x = global_array(SHAPE, seed=6, dtype=np.float64)
    hshape = f"a:8;b:{16 + 4 * k}"
    with mm.layout_scope(mesh, rules):
        def f(t, w):
            with mm.trace():
                y = mm.halo_exchange(t, "b", 2)
                (g,) = mm.gradients([y * w], [t])
            return g * g
        r = global_array(hshape, seed=7, dtype=np.float64)
        check_gradients(mesh, f, [x, r], [SHAPE, hshape], wrt=[1])
