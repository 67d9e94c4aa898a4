"""mm.dropout: the mask is the same under every mesh, layout and rank count (compared with a 1-rank
COMM_SELF mesh), sizes that do not divide and empty blocks included, kept values are scaled by
1/(1-rate), the kept fraction is about 1-rate, no communication; gradients. The random tensors it
shares its hash with (mesh.random_uniform/random_normal) are layout-independent too.
mm.stop_gradient: identity forward, zero gradient."""
from __future__ import annotations

import functools
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from gradcheck import check_gradients  # noqa: E402
from meshes import big, Errors, get_mesh, global_array, layouts, mesh_shapes, transfers  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import counters  # noqa: E402

pytestmark = pytest.mark.mpi
SHAPES = mesh_shapes()


@functools.lru_cache(maxsize=None)
def self_mesh() -> mm.Mesh:
    """A 1-rank mesh on every rank: the reference that knows nothing of the others."""
    return mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)


def reference_mask(shape: str, rate: float, seed: int) -> np.ndarray:
    return mm.dropout(self_mesh().ones(shape, dtype="float64"), rate, seed).to_numpy() != 0


@pytest.mark.parametrize("mshape", SHAPES)
def test_mask_same_for_every_layout_and_rank_count(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    shape = "a:8;b:16;c:8"
    a = global_array(shape, 1, np.float64)
    for rate, seed in ((0.5, 0), (0.1, 7), (0.9, 123456789)):
        mask = reference_mask(shape, rate, seed)
        want = np.where(mask, a / (1 - rate), 0.0)
        for lay in layouts(mesh, ["a", "b", "c"], limit=6):
            for rules in ({}, lay):
                x = mesh.from_numpy(a, shape, layout=lay)
                with mm.layout_scope(mesh, rules), mm.profile() as prof:
                    y = mm.dropout(x, rate, seed)
                errs.expect(y.layout == rules and y.shape == x.shape and y.dtype == x.dtype,
                            f"rate={rate} x={lay} rules={rules}: {y.layout} {y.shape} {y.dtype}")
                if rules == lay:
                    errs.expect(not transfers(counters.traffic(prof.counters)), f"communicated: {prof.counters}")
                got = y.to_numpy()
                errs.expect(np.allclose(got, want, rtol=1e-14, atol=0) and np.array_equal(got != 0, mask),
                            f"rate={rate} seed={seed} x={lay} rules={rules}: mask or values differ")
    errs.check()


UNEVEN = "a:5;b:2;c:7"  # no divisor of 3 or 4 ranks; b:2 leaves blocks empty on 3 or more


@pytest.mark.parametrize("mshape", SHAPES)
def test_uneven_and_empty_blocks(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a = global_array(UNEVEN, 5, np.float64)
    mask = reference_mask(UNEVEN, 0.4, 11)
    want = np.where(mask, a / 0.6, 0.0)
    for lay in layouts(mesh, ["a", "b", "c"]):
        x = mesh.from_numpy(a, UNEVEN, layout=lay)
        with mm.layout_scope(mesh, lay), mm.profile() as prof:
            y = mm.dropout(x, 0.4, 11)
        errs.expect(not transfers(prof.transfers), f"x={lay}: communicated: {prof.counters}")
        got = y.to_numpy()
        errs.expect(np.allclose(got, want, rtol=1e-14, atol=0) and np.array_equal(got != 0, mask),
                    f"x={lay}: mask or values differ")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_random_tensors_uneven_and_empty_blocks(mshape: str) -> None:
    """random_uniform/random_normal give the 1-rank values under every layout, uneven ones included."""
    mesh, errs = get_mesh(mshape), Errors()
    uniform = self_mesh().random_uniform(UNEVEN, seed=3, minval=-2.0, maxval=5.0, dtype="float64").to_numpy()
    normal = self_mesh().random_normal(UNEVEN, seed=4, dtype="float32").to_numpy()
    errs.expect(bool(((-2.0 <= uniform) & (uniform < 5.0)).all()) and np.unique(normal).size == normal.size,
                "reference draws out of range or repeated")
    for lay in layouts(mesh, ["a", "b", "c"]):
        u = mesh.random_uniform(UNEVEN, seed=3, minval=-2.0, maxval=5.0, dtype="float64", layout=lay)
        z = mesh.random_normal(UNEVEN, seed=4, dtype="float32", layout=lay)
        errs.expect(u.layout == lay and z.layout == lay, f"layouts {u.layout} {z.layout} != {lay}")
        errs.expect(np.array_equal(u.to_numpy(), uniform), f"random_uniform x={lay} differs")
        errs.expect(np.array_equal(z.to_numpy(), normal), f"random_normal x={lay} differs")
    errs.check()


def test_mask_depends_on_seed_and_keeps_about_1_minus_rate() -> None:
    mesh = get_mesh(SHAPES[-1])
    bd = big(mesh)
    x = mesh.ones("a:64;b:128", layout={"b": bd[0]} if bd else {})
    masks = {}
    for rate in (0.1, 0.5, 0.8):
        for seed in (1, 2):
            y = mm.dropout(x, rate, seed).to_numpy()
            kept = y != 0
            masks[rate, seed] = kept
            assert abs(kept.mean() - (1 - rate)) < 0.02, (rate, seed, kept.mean())
            np.testing.assert_allclose(y[kept], np.float32(1 / (1 - rate)))
    assert (masks[0.5, 1] != masks[0.5, 2]).mean() > 0.4  # seeds give independent masks
    assert not (masks[0.5, 1] & ~masks[0.1, 1]).any()  # same seed: a higher rate drops a superset
    u = mesh.random_uniform("a:64;b:128", seed=1).to_numpy()
    assert abs(np.corrcoef((u >= 0.5).ravel(), masks[0.5, 1].ravel())[0, 1]) < 0.1  # own hash stream


def test_rate_zero_is_identity_and_bad_rates_raise() -> None:
    mesh = get_mesh(SHAPES[0])
    x = mesh.ones("a:8")
    assert mm.dropout(x, 0.0, 3) is x
    for rate in (-0.1, 1.0, 1.5):
        with pytest.raises(mm.MpimeshError, match="rate"):
            mm.dropout(x, rate, 0)
    with pytest.raises(mm.MpimeshError, match="seed"):
        mm.dropout(x, 0.5, 1.5)


@pytest.mark.parametrize("mshape", [SHAPES[0], SHAPES[-1]])
def test_dropout_gradient(mshape: str) -> None:
    mesh0 = get_mesh(mshape)
    bd = big(mesh0)
    a = global_array("a:8;b:8", 2, np.float64)
    w = global_array("a:8;b:8", 3, np.float64)
    cases = [("", {})] + ([(f"b:{bd[0]}", {"a": bd[-1]})] if bd else [])
    errs = Errors()
    for rules, lay in cases:
        mesh = get_mesh(mshape, rules)
        wt = mesh.from_numpy(w, "a:8;b:8")
        check_gradients(mesh, lambda x: mm.dropout(x, 0.3, 5) * wt, [a], ["a:8;b:8"], [lay], directions=2)
        # the gradient is dy through the same mask and scale
        x = mesh.from_numpy(a, "a:8;b:8", layout=lay)
        with mm.trace():
            (g,) = mm.gradients([mm.dropout(x, 0.3, 5) * wt], [x])
        want = np.where(reference_mask("a:8;b:8", 0.3, 5), w / 0.7, 0.0)
        errs.expect(np.allclose(g.to_numpy(), want, rtol=1e-14, atol=0) and g.layout == x.layout,
                    f"rules={rules} x={lay}: gradient differs")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_stop_gradient(mshape: str) -> None:
    mesh = get_mesh(mshape)
    bd = big(mesh)
    a = global_array("a:8;b:8", 4, np.float64)
    for lay in ({}, {"a": bd[0]} if bd else {}):
        x = mesh.from_numpy(a, "a:8;b:8", layout=lay)
        with mm.trace() as tr:
            s = mm.stop_gradient(x)
            y = mm.reduce_sum(s * x)
            g_blocked, g_half = mm.gradients([mm.reduce_sum(mm.exp(s))], [x]) + mm.gradients([y], [x])
        assert "stop_gradient" in [op.name for op in tr.ops]
        np.testing.assert_array_equal(s.to_numpy(), a)
        np.testing.assert_array_equal(g_blocked.to_numpy(), np.zeros_like(a))  # nothing flows through
        np.testing.assert_allclose(g_half.to_numpy(), a, rtol=1e-14)  # d(s*x)/dx with s held constant
        assert g_blocked.layout == x.layout


@pytest.mark.parametrize("dtype, lo, hi", [("int8", 0, 1000), ("uint8", -5, 3), ("float16", 0.0, 1e6),
                                           ("int16", -40000, 0)])
def test_random_uniform_refuses_a_range_its_dtype_cannot_hold(dtype, lo, hi) -> None:
    """int8 [0, 1000) gave values from -128 to 127 (wrapped), uint8 [-5, 3) values up to 255, float16
    [0, 1e6) mostly 65504 (saturated): a DTypeError naming the dtype and range, on every rank, before
    anything is drawn; the widest range that fits is drawn inside it."""
    mesh = self_mesh()
    with pytest.raises(mm.DTypeError, match=rf"random_uniform: \[{lo}.*, {hi}.*\) does not fit dtype {dtype}"):
        mesh.random_uniform("a:100", seed=0, minval=lo, maxval=hi, dtype=dtype)
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    if info is not None:
        v = mesh.random_uniform("a:1000", seed=0, minval=int(info.min), maxval=int(info.max) + 1,
                                dtype=dtype).to_numpy()
        assert v.dtype == np.dtype(dtype) and v.min() >= info.min and v.max() <= info.max
