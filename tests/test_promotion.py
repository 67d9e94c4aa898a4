"""`mm.result_type` (the table of `mpimesh.promotion`) and the ops that follow it, on whatever number of
ranks pytest runs on.

- the table is JAX's: `jax.numpy.promote_types` with 64-bit types on, for every pair of its dtypes, and
  `jax.numpy.result_type` for triples (skipped without jax); symmetric, bool its identity, each dtype its
  own promotion, integers beside a float giving the float, several dtypes in any order alike; and it
  never asks numpy (its answers stand with `numpy.result_type` broken);
- every op combining tensors of two dtypes gives their `mm.result_type` and the values of a float64 numpy
  reference on the global arrays, computed from the operands rounded to that dtype (as JAX computes:
  bfloat16 0.5 + int32 257 is 256, 257 rounded to bfloat16 first; numpy's float64 would give 258) and
  rounded once to it, on every mesh shape with the dims split; gradients flow through;
- Python numbers are weak (`x_bf16 * 2` stays bfloat16), numpy numbers strong;
- `mm.compile`'s replay gives eager's dtypes and values bitwise; the JAX replay and a dry run (JAX's own
  promotion) give eager's dtypes, the replay its values.
"""
from __future__ import annotations

import itertools
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
import jaxenv  # noqa: E402,F401  (before jax: host devices, quick compiles)
from meshes import big, get_mesh, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import promotion  # noqa: E402
from mpimesh.backend import finfo, is_float  # noqa: E402
from mpimesh.ops.activation import bias_activation  # noqa: E402

N = MPI.COMM_WORLD.Get_size()
NAMES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "bfloat16",
         "float32", "float64", "complex64", "complex128"]
INTS = NAMES[1:9]
FLOATS = ["float16", "bfloat16", "float32", "float64"]


def _jnp():
    """jax.numpy and a context with 64-bit types on (mpimesh's JAX replay runs in one)."""
    pytest.importorskip("jax", reason="jax is not installed (python3 install.py tpu)")
    import jax.numpy as jnp
    from mpimesh.tpu.replay import _x64
    return jnp, _x64


# ------------------------------------------------------------------------------------------- the table

def test_the_table_is_jaxs_for_every_pair() -> None:
    jnp, x64 = _jnp()
    assert sorted(map(str, promotion.DTYPES)) == sorted(NAMES)
    with x64():
        wrong = [(a, b, str(mm.result_type(a, b)), str(jnp.promote_types(a, b)))
                 for a, b in itertools.product(NAMES, NAMES) if mm.result_type(a, b) != jnp.promote_types(a, b)]
    assert wrong == []


def test_several_dtypes_promote_as_jaxs_result_type() -> None:
    jnp, x64 = _jnp()
    with x64():
        wrong = [(t, str(mm.result_type(*t)), str(jnp.result_type(*t)))
                 for t in itertools.combinations_with_replacement(NAMES, 3)
                 if mm.result_type(*t) != jnp.result_type(*t)]
    assert wrong == []
    assert mm.result_type("int64", "uint64", "float16") == np.float16  # not float64, as pairs in order would give


def test_the_awkward_pairs() -> None:
    """Where JAX and numpy part (numpy 2.4 with ml_dtypes 0.7 in the right column)."""
    bf = np.dtype(promotion.BFLOAT16)
    for a, b, want in [("int32", "float32", "float32"),  # numpy: float64
                       ("bfloat16", "int32", bf), ("bfloat16", "int64", bf),  # numpy: float64
                       ("bfloat16", "int16", bf), ("bfloat16", "float16", "float32"),
                       ("int64", "float16", "float16"), ("uint64", "int8", "float64"), ("int64", "uint64", "float64"),
                       ("uint8", "int8", "int16"), ("uint32", "int32", "int64"), ("bool", "uint16", "uint16"),
                       ("int64", "complex64", "complex64"), ("float64", "complex64", "complex128")]:
        assert mm.result_type(a, b) == np.dtype(want), (a, b, mm.result_type(a, b))


def test_table_properties() -> None:
    for a, b in itertools.product(NAMES, NAMES):
        assert mm.result_type(a, b) == mm.result_type(b, a), (a, b)
    for a in NAMES:
        assert mm.result_type(a) == mm.result_type(a, a) == np.dtype(a)
        assert mm.result_type("bool", a) == np.dtype(a)
    for i, f in itertools.product(INTS, FLOATS):
        assert mm.result_type(i, f) == np.dtype(f), (i, f)
    for t in itertools.combinations(NAMES, 3):
        assert len({mm.result_type(*p) for p in itertools.permutations(t)}) == 1, t
    for a, b in itertools.product(INTS, INTS):  # an integer result holds both operands' ranges
        r = mm.result_type(a, b)
        if r.kind in "iu":
            for d in (a, b):
                assert np.iinfo(r).min <= np.iinfo(d).min and np.iinfo(d).max <= np.iinfo(r).max, (a, b, r)


def test_the_table_never_asks_numpy(monkeypatch) -> None:
    def refuse(*args):
        raise AssertionError("numpy.result_type was asked")
    monkeypatch.setattr(np, "result_type", refuse)
    promotion._result.cache_clear()
    try:
        assert mm.result_type("bfloat16", "int32") == promotion.BFLOAT16
        assert mm.result_type("int32", "float32", "uint8") == np.float32
    finally:
        promotion._result.cache_clear()


def test_bad_input() -> None:
    with pytest.raises(mm.DTypeError, match="at least one dtype"):
        mm.result_type()
    with pytest.raises(mm.DTypeError, match="'nonsense'"):
        mm.result_type("float32", "nonsense")
    assert mm.result_type(">f4", "<i2") == np.float32  # byte order does not matter
    assert mm.result_type("float32", np.longdouble) == np.longdouble  # outside the table: numpy's rule


# ------------------------------------------------------------------------------------------- the ops

PAIRS = [("bfloat16", "int32"), ("bfloat16", "int64"), ("int32", "float32"), ("float16", "bfloat16"),
         ("uint8", "int8"), ("bool", "int16"), ("int64", "uint64"), ("int16", "float16"), ("uint32", "float64"),
         ("bool", "bfloat16"), ("float32", "bfloat16"), ("int64", "complex64")]
SHAPE = "a:6;b:4"


def _values(dtype: str, seed: int, nonzero: bool) -> np.ndarray:
    """Small whole numbers (exact in every dtype here, so are their sums and products): unsigned 0..8
    (1..8), else -4..4 (without 0); booleans (all True for `nonzero`)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype) if dtype != "bfloat16" else promotion.BFLOAT16
    if dt == bool:
        return np.ones((6, 4), bool) if nonzero else rng.integers(0, 2, (6, 4)).astype(bool)
    if dt.kind == "u":
        return rng.integers(1 if nonzero else 0, 9, (6, 4)).astype(dt)
    v = rng.integers(-4, 5, (6, 4))
    if nonzero:
        v = np.where(v == 0, 3, v)
    return v.astype(dt)


def _ref(fn, a: np.ndarray, b: np.ndarray, want: np.dtype) -> np.ndarray:
    """`fn` of the operands rounded to `want`, in float64 (complex128), rounded once to `want` (the
    comparisons: bool)."""
    wide = np.complex128 if want.kind == "c" else np.float64
    r = fn(a.astype(want).astype(wide), b.astype(want).astype(wide))
    return r if r.dtype == bool else r.astype(want)


def _close(got: np.ndarray, ref: np.ndarray, what: str, ulps: float = 0.0) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape, (what, got.dtype, ref.dtype, got.shape, ref.shape)
    if ulps and is_float(got.dtype):
        eps = float(finfo(got.dtype).eps)
        np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=ulps * eps, atol=0,
                                   err_msg=what)
    else:
        np.testing.assert_array_equal(got, ref, err_msg=what)


ELEMENTWISE = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide,
               "minimum": np.minimum, "maximum": np.maximum, "power": np.power, "less": np.less,
               "greater_equal": np.greater_equal, "equal": np.equal}
ORDERED = {"minimum", "maximum", "power", "less", "greater_equal"}  # not of complex numbers


def _split(mesh) -> str:
    dims = big(mesh)
    return ";".join(f"{d}:{m}" for d, m in zip("ab", dims))


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "+".join(p))
def test_elementwise_ops_follow_the_table(shape, pair) -> None:
    da, db = pair
    mesh = get_mesh(shape, _split(get_mesh(shape)))
    want = mm.result_type(da, db)
    a, b = _values(da, 1, False), _values(db, 2, True)
    x, y = mesh.from_numpy(a, SHAPE), mesh.from_numpy(b, SHAPE)
    for name, fn in ELEMENTWISE.items():
        if name in ORDERED and want.kind == "c":
            continue
        bb = np.abs(b.astype(np.int64)).astype(b.dtype) % 3 if name == "power" and b.dtype != bool else b
        yy = y if bb is b else mesh.from_numpy(bb, SHAPE)
        # an integer result of divide is float64 (numpy's true division of integers, kept)
        w = np.dtype(np.float64) if name == "divide" and want.kind in "biu" else want
        for u, v, p, q in ((x, yy, a, bb), (yy, x, bb, a)) if name not in ("power", "divide") else ((x, yy, a, bb),):
            z = getattr(mm, name)(u, v)
            assert z.dtype == (bool if name in ("less", "greater_equal", "equal") else w), (name, z.dtype)
            _close(z.to_numpy(), _ref(fn, p, q, w), f"{name} {pair}", ulps=1.0 if name == "divide" else 0.0)
    c = mesh.from_numpy(_values("bool", 3, False), SHAPE)
    cond = c.to_numpy()
    z = mm.where(c, x, y)
    assert z.dtype == want
    _close(z.to_numpy(), _ref(lambda p, q: np.where(cond, p, q), a, b, want), f"where {pair}")
    z = mm.concat([x, y], "a")
    assert z.dtype == want
    _close(z.to_numpy(), _ref(lambda p, q: np.concatenate([p, q]), a, b, want), f"concat {pair}")
    z = mm.einsum([x, mm.rename_dimension(y, "a", "c")], "b:4")  # sum over a and c: 36 products of small numbers
    assert z.dtype == want
    _close(z.to_numpy(), _ref(lambda p, q: np.einsum("ab,cb->b", p, q), a, b, want), f"einsum {pair}")


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
def test_rounding_to_the_promoted_dtype_comes_first(shape) -> None:
    """Values that tell the two orders apart: an integer is rounded to the float it meets, then the op
    runs (JAX, PyTorch); numpy's float64 would round only the result."""
    mesh = get_mesh(shape, _split(get_mesh(shape)))
    half = mesh.from_numpy(np.full((6, 4), 0.5, promotion.BFLOAT16), SHAPE)
    i257 = mesh.from_numpy(np.full((6, 4), 257, np.int32), SHAPE)
    assert (half + i257).dtype == promotion.BFLOAT16
    assert (half + i257).to_numpy().astype(np.float64).tolist() == [[256.0] * 4] * 6  # 257 -> 256, + 0.5 -> 256
    big_int = mesh.from_numpy(np.full((6, 4), 2 ** 24 + 1, np.int32), SHAPE)
    one = mesh.from_numpy(np.ones((6, 4), np.float32), SHAPE)
    assert (big_int + one).dtype == np.float32
    assert float((big_int + one).to_numpy()[0, 0]) == 2.0 ** 24  # numpy: 2**24 + 2
    assert bool(mm.equal(big_int, one * float(2 ** 24)).to_numpy().all())  # compared in float32, as in JAX
    w = mesh.from_numpy(np.full((4, 3), 1.0, np.float32), "b:4;c:3")
    z = mm.einsum([big_int, w], "a:6;c:3")
    assert z.dtype == np.float32 and float(z.to_numpy()[0, 0]) == 4 * 2.0 ** 24  # each product rounded first


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
def test_scalars_are_weak_and_numpy_numbers_strong(shape) -> None:
    mesh = get_mesh(shape, _split(get_mesh(shape)))
    g = _values("float32", 4, False)
    xb, xh, xf = (mesh.from_numpy(g.astype(d), SHAPE) for d in (promotion.BFLOAT16, np.float16, np.float32))
    xi = mesh.from_numpy(g.astype(np.int32), SHAPE)
    for z, want in [(xb * 2, xb.dtype), (2 * xb, xb.dtype), (xb * 2.0, xb.dtype), (xb / 3, xb.dtype),
                    (xh + 1.5, np.float16), (xf * 2.0, np.float32), (2.0 - xf, np.float32), (xf * 2, np.float32),
                    (xi * 2, np.int32)]:
        assert z.dtype == want, (z.dtype, want)
    s = np.float32(2.0)
    for z in (xi * s, s * xi, xi + s):
        assert z.dtype == np.float32  # numpy: float64
    np.testing.assert_array_equal((xi * s).to_numpy(), g.astype(np.int32).astype(np.float32) * 2)
    z = xb + np.int32(257)
    assert z.dtype == promotion.BFLOAT16  # 257 rounded to bfloat16 (256) first
    np.testing.assert_array_equal(z.to_numpy(), (g.astype(promotion.BFLOAT16).astype(np.float64) + 256)
                                  .astype(promotion.BFLOAT16))
    assert (xb + np.float16(1.0)).dtype == np.float32
    assert mm.where(xf > 0, xi, np.float32(0.5)).dtype == np.float32


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
def test_other_ops_combining_dtypes(shape) -> None:
    """axpy, conv, the fused bias + activation and softmax's bias, and gradients through a mixed product."""
    mesh = get_mesh(shape, _split(get_mesh(shape)))
    a, b = _values("float32", 5, False), _values("int32", 6, True)
    x, yi = mesh.from_numpy(a, SHAPE), mesh.from_numpy(b, SHAPE)
    z = mm.axpy(0.5, x, yi)
    assert z.dtype == np.float32
    np.testing.assert_array_equal(z.to_numpy(), (0.5 * a + b).astype(np.float32))
    xb = mesh.from_numpy(a.astype(promotion.BFLOAT16), SHAPE)
    z = mm.axpy(0.5, xb, mesh.from_numpy(b.astype(np.float16), SHAPE))
    assert z.dtype == np.float32
    np.testing.assert_array_equal(z.to_numpy(), (0.5 * a + b).astype(np.float32))
    z = mm.axpy(mesh.from_numpy(np.array(0.5, np.float32), []), mesh.from_numpy(b.astype(np.int16), SHAPE), xb)
    assert z.dtype == np.float32  # a float32 alpha times int16: float32; + bfloat16: float32 (numpy: float64)
    np.testing.assert_array_equal(z.to_numpy(), (0.5 * b + a.astype(promotion.BFLOAT16)).astype(np.float32))
    bias = mesh.from_numpy(np.arange(-2, 2, dtype=np.int32), "b:4")
    for act in ("relu", None):
        z = bias_activation(x, bias, act)
        assert z.dtype == np.float32, act
        ref = a + np.arange(-2, 2)
        np.testing.assert_allclose(z.to_numpy(), np.maximum(ref, 0) if act else ref, rtol=0, atol=0)
    z = mm.softmax(x, "b", bias=bias)
    assert z.dtype == np.float32
    e = np.exp(a + np.arange(-2, 2) - (a + np.arange(-2, 2)).max(axis=1, keepdims=True))
    np.testing.assert_allclose(z.to_numpy(), e / e.sum(axis=1, keepdims=True), rtol=1e-6)
    xc = mesh.from_numpy(np.arange(8, dtype=np.int32).reshape(4, 2), "l:4;ci:2")
    f = mesh.from_numpy(np.ones((2, 2, 3), np.float32), "t:2;ci:2;co:3")
    z = mm.conv1d(xc, f, padding="VALID")
    assert z.dtype == np.float32
    np.testing.assert_array_equal(z.to_numpy()[:, 0], [0 + 1 + 2 + 3, 2 + 3 + 4 + 5, 4 + 5 + 6 + 7])
    assert mm.conv1d(mm.cast(xc, "bfloat16"), mm.cast(f, "bfloat16")).dtype == promotion.BFLOAT16
    z = mm.conv1d(mesh.from_numpy(np.full((4, 1), 2 ** 24 + 1, np.int32), "l:4;ci:1"),
                  mesh.from_numpy(np.full((1, 1, 1), 3.0, np.float32), "t:1;ci:1;co:1"))
    assert z.to_numpy()[:, 0].tolist() == [3 * 2.0 ** 24] * 4  # 2**24 + 1 rounded first (numpy: 3 * 2**24 + 4)
    with mm.trace():
        (gx,) = mm.gradients([mm.reduce_sum(x * yi)], [x])
    assert gx.dtype == np.float32
    np.testing.assert_array_equal(gx.to_numpy(), b.astype(np.float32))
    with mm.trace():
        (gb,) = mm.gradients([mm.reduce_sum(mm.cast(xb * yi, "float32"))], [xb])
    assert gb.dtype == promotion.BFLOAT16
    np.testing.assert_array_equal(gb.to_numpy().astype(np.float64), b.astype(np.float64))


# ------------------------------------------------------------------------------------------- replays

def _mixed(x, y, xb, xi):
    """Ops of mixed dtypes, for the replays: x float32, y bfloat16, xb bfloat16, xi int32."""
    return [x + xi, xb * xi, xi < x, mm.where(x > 0, xb, xi), mm.concat([xb, xi], "a"), mm.maximum(xi, y),
            mm.einsum([xi, mm.rename_dimension(x, "a", "c")], "b:4"), xb / xi, xi * np.float32(0.5)]


def _inputs(mesh):
    a, b = _values("float32", 7, False), _values("int32", 8, True)
    return (mesh.from_numpy(a, SHAPE), mesh.from_numpy(a.astype(promotion.BFLOAT16), SHAPE),
            mesh.from_numpy(_values("bfloat16", 9, False), SHAPE), mesh.from_numpy(b, SHAPE))


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
def test_compiled_replay_gives_eagers_dtypes_and_values(shape) -> None:
    mesh = get_mesh(shape, _split(get_mesh(shape)))
    x, y, xb, xi = _inputs(mesh)
    eager = _mixed(x, y, xb, xi)
    step = mm.compile(_mixed)
    for _ in range(2):  # recorded, then replayed
        got = step(x, y, xb, xi)
    for i, (g, e) in enumerate(zip(got, eager)):
        assert g.dtype == e.dtype and g.local.tobytes() == e.local.tobytes(), (i, g.dtype, e.dtype)


@pytest.mark.skipif(N != 1, reason="one JAX device: the 1-rank session replays")
def test_jax_replay_and_dry_run_give_eagers_dtypes() -> None:
    pytest.importorskip("jax", reason="jax is not installed (python3 install.py tpu)")
    import jax
    from mpimesh.dryrun import DryMesh, placeholder
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    ins = _inputs(mesh)
    with mm.trace() as tr:
        eager = _mixed(*ins)
    got = mm.tpu.replay(tr, list(ins), eager, devices=jax.devices()[:1])(*(t.to_numpy() for t in ins))
    dry = DryMesh("all:1")
    shadows = [placeholder(dry, SHAPE, t.dtype) for t in ins]
    for i, (g, e, d) in enumerate(zip(got, eager, _mixed(*shadows))):
        assert d.dtype == e.dtype, (i, d.dtype, e.dtype)  # JAX's own promotion, nothing cast
        g = np.asarray(g)
        assert g.dtype == e.dtype, (i, g.dtype, e.dtype)
        _close(g, e.to_numpy(), f"replay of op {i}", ulps=1.0)


def test_promotion_costs_nothing_when_dtypes_agree() -> None:
    """Two tensors of one dtype, or of two that numpy promotes as the table does, run the op's kernel
    without casts; other pairs give the casts, found once per pair (`_checked`: one cached look-up per op)."""
    from mpimesh.ops import elementwise as ew
    same = mm.multiply.opdefs[0]
    f32, bf, i32 = np.dtype("float32"), promotion.BFLOAT16, np.dtype("int32")
    assert ew._checked(same, f32, f32) == (None, None)
    assert ew._checked(same, f32, bf)[1] is None
    casts = ew._checked(same, i32, f32)[1]
    assert casts is not None and ew._checked(same, i32, f32)[1] is casts
    got = same.kernel(ew._PROBE, np.array([2 ** 24 + 1], i32), np.array([1.0], f32), casts=casts)
    assert got.tolist() == [2.0 ** 24]
    assert promotion.operand_casts((f32, f32)) is None and promotion.operand_casts((f32, bf)) is None


def test_an_integer_meeting_a_float_is_cast_to_it_first() -> None:
    """Even where numpy promotes as the table does (int8 with float16), an integer operand is handed over
    cast to the float: a kernel that widens its float operands itself (einsum's 16-bit path, to float32)
    then still sees the integer as JAX rounds it. Integers meeting integers keep numpy's exact casts."""
    f16 = np.dtype("float16")
    assert promotion.operand_casts(("int8", "float16")) == (f16, None)
    assert promotion.operand_casts(("float16", "bool")) == (None, f16)
    assert promotion.operand_casts(("int8", "int16")) is None and promotion.operand_casts(("bool", "int8")) is None
    assert promotion.operand_casts(("int32", "float32")) == (np.dtype("float32"), None)
    assert promotion.cast_operands([np.ones(2, np.int8), np.ones(2, f16)], (f16, None))[0].dtype == f16
