"""bfloat16 and float16 against float64 numpy references, on whatever number of ranks pytest runs on.

Tolerances, with eps the dtype's machine epsilon (bfloat16 2**-7, float16 2**-10) and u = eps/2:
- data movement (collectives other than sums, relayout, reshape, slicing, gather, checkpoint): bitwise;
- sums across ranks (allreduce, reduce-scatter) of values whose float32 sum is exact: bitwise equal to
  the float64 sum rounded once, and a case where rounding each partial sum would give another value;
- elementwise ops: |got - ref| <= 2 eps |ref| + eps (ref: float64 on the rounded inputs);
- einsum and reductions over K terms: |got - ref| <= u |ref| + K 2**-22 sum|terms| (float32 accumulation,
  one rounding), plus exact cases that a 16-bit accumulation would get wrong;
- softmax, log_softmax, logsumexp: |got - ref| <= eps |ref| + eps / 4;
- gradients through a cast to the low dtype: float32, nonzero, within 4 eps max|ref| of the float64 ones.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from meshes import big, get_mesh, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import checkpoint as ckpt  # noqa: E402
from mpimesh.backend import accumulation_dtype, as_dtype, is_float, result_type, wire_dtype  # noqa: E402
from mpimesh import counters  # noqa: E402

DTYPES = ["bfloat16", "float16"]
EPS = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}
SHAPES = mesh_shapes()
Scale = mm.optim.DynamicLossScale
N = MPI.COMM_WORLD.Get_size()


class Errors(list):
    """Mismatches, asserted on every rank alike: each rank's count is summed over the world."""

    def expect(self, cond, what: str) -> None:
        if not bool(cond):
            self.append(what)

    def within(self, what: str, got, ref, tol) -> None:
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        bad = ~(np.abs(got - ref) <= tol)
        if got.shape != ref.shape or bad.any():
            worst = float(np.max(np.abs(got - ref) - tol)) if got.shape == ref.shape else None
            self.append(f"{what}: {int(bad.sum()) if got.shape == ref.shape else 'shape'} beyond the tolerance "
                        f"(worst excess {worst}); shapes {got.shape} {ref.shape}")

    def bitwise(self, what: str, got, ref, dtype) -> None:
        got, ref = np.asarray(got), np.asarray(ref)
        ok = got.dtype == np.dtype(dtype) and got.shape == ref.shape and np.array_equal(
            got.view(np.uint16), ref.astype(dtype).view(np.uint16))
        self.expect(ok, f"{what}: not bitwise equal ({got.dtype}, {got.shape} vs {ref.shape})")

    def check(self) -> None:
        total = MPI.COMM_WORLD.allreduce(len(self))
        assert total == 0, f"{total} failures over all ranks; here:\n" + "\n".join(self[:6])


def rounded(g: np.ndarray, dt: str) -> np.ndarray:
    """`g` rounded to `dt`, as float64."""
    return g.astype(dt).astype(np.float64)


def data(shape, seed=0, scale=1.0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape) * scale


def dyadic(shape, seed=0) -> np.ndarray:
    """Multiples of 1/8 in [-8, 8): exact in both 16-bit floats, their sums exact in float32."""
    return np.random.default_rng(seed).integers(-64, 64, shape) / 8.0


def mesh_and_dims(shape: str):
    mesh = get_mesh(shape)
    return mesh, big(mesh)


# ------------------------------------------------------------------------------------ policy

def test_dtype_policy() -> None:
    bf = np.dtype(ml_dtypes.bfloat16)
    assert as_dtype("bfloat16") == bf and as_dtype(ml_dtypes.bfloat16) == bf and as_dtype("float16") == np.float16
    assert is_float(bf) and is_float("float16") and is_float("float64") and not is_float("int32")
    assert not is_float("complex64") and not is_float("bool")
    assert accumulation_dtype(bf) == np.float32 and accumulation_dtype("float16") == np.float32
    assert accumulation_dtype("float64") == np.float64 and accumulation_dtype("int32") == np.int32
    assert wire_dtype(bf) == np.uint16 and wire_dtype("float16") == np.uint16 and wire_dtype("f4") == np.float32
    assert result_type(bf, "float16") == np.float32 and result_type(bf, "int8") == bf and result_type(bf, bf) == bf
    with pytest.raises(mm.DTypeError, match="V4"):
        as_dtype("V4")


# ------------------------------------------------------------------------------- collectives

@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dt", DTYPES)
def test_collectives(shape, dt) -> None:
    """Sums in float32 rounded once (bitwise), data movement bitwise, bytes at the dtype's width."""
    mesh, dims = mesh_and_dims(shape)
    coll, errs = mesh.collectives, Errors()
    if not dims:
        return
    m, k = dims[0], mesh.shape[dims[0]].size
    c = mesh.coords[m]
    g = dyadic((k, 7, 5), seed=1)
    x = g[c].astype(dt)
    errs.bitwise("allreduce sum", coll.allreduce(x, (m,)), g.sum(0), dt)
    errs.bitwise("allreduce max", coll.allreduce(x, (m,), "max"), g.max(0), dt)
    errs.bitwise("allreduce min", coll.allreduce(x, (m,), "min"), g.min(0), dt)
    everything = tuple(dims)
    flat = int(np.ravel_multi_index(tuple(mesh.coords[d] for d in everything),
                                    tuple(mesh.shape[d].size for d in everything)))
    gg = dyadic((mesh.size, 3, 4), seed=2)
    errs.bitwise("allreduce over all dims", coll.allreduce(gg[flat].astype(dt), everything), gg.sum(0), dt)
    for axis in (0, 1):  # 7 and 5 rows: uneven over 2, 3 and 4 ranks
        block = np.array_split(np.arange(g.shape[1 + axis]), k)[c]
        got = coll.reduce_scatter(x, m, axis)
        errs.bitwise(f"reduce_scatter axis {axis}", got, np.take(g.sum(0), block, axis=axis), dt)
        got = coll.allgather(np.take(g[0].astype(dt), block, axis=axis), m, axis, g.shape[1 + axis])
        errs.bitwise(f"allgather axis {axis}", got, g[0], dt)
    got = coll.alltoall(x, m, 0, 1, 5 * k)
    want = np.concatenate([np.array_split(g[j], k, axis=0)[c] for j in range(k)], axis=1)
    errs.bitwise("alltoall", got, want, dt)
    errs.bitwise("permute", coll.permute(x, m, 1), g[(c - 1) % k], dt)
    errs.bitwise("exscan", coll.exscan(x, m), g[:c].sum(0) if c else np.zeros_like(g[0]), dt)
    # round once: 1 plus (k-1) times 3/8 ulp is 1 + ulp for k >= 3; rounding after each add would stay at 1
    ulp = EPS[dt]
    v = np.array([1.0 if c == 0 else 0.375 * ulp] * 3).astype(dt)
    errs.bitwise("allreduce rounds once", coll.allreduce(v, (m,)), np.full(3, 1 + (k - 1) * 0.375 * ulp), dt)
    # non-blocking: the same float32 sums rounded once, two in flight at once, completed out of order
    reqs = [coll.iallreduce(x, (m,)), coll.iallreduce(v, (m,), out=v.copy())]
    reqs[0].test()  # a poll lets the first step progress; it never starts the second
    errs.bitwise("iallreduce rounds once", reqs[1].wait(), np.full(3, 1 + (k - 1) * 0.375 * ulp), dt)
    errs.bitwise("iallreduce sum", reqs[0].wait(), g.sum(0), dt)
    with counters.counting() as cnt:
        coll.allreduce(x, (m,))
        coll.allreduce(g[c].astype(np.float32), (m,))
        coll.iallreduce(x, (m,)).wait()
    errs.expect(cnt == {f"allreduce/{m}": {"calls": 3, "elements": 105, "bytes": 2 * 35 * 2 + 35 * 4}},
                f"profile counts {cnt}: a 16-bit allreduce counts 2 bytes an element")
    # float32 partials into a 16-bit result (a split einsum's): summed in float32, rounded once, the
    # result's words moved by the second half: 3 bytes an element (half at each width)
    parts = np.array([1.0 if c == 0 else 0.375 * ulp] * 3, np.float32)
    with counters.counting() as cnt:
        got = coll.allreduce(parts, (m,), dtype=as_dtype(dt))
    errs.bitwise("allreduce(dtype=) rounds once", got, np.full(3, 1 + (k - 1) * 0.375 * ulp), dt)
    errs.bitwise("allreduce(dtype=) sum", coll.allreduce(g[c].astype(np.float32), (m,), dtype=as_dtype(dt)),
                 g.sum(0), dt)
    errs.expect(cnt == {f"allreduce/{m}": {"calls": 1, "elements": 3, "bytes": 3 * 3}},
                f"profile counts {cnt}: float32 partials of a 16-bit result count 3 bytes an element")
    errs.check()


# ------------------------------------------------------------------------------- elementwise

UNARY = {"exp": (mm.exp, np.exp), "tanh": (mm.tanh, np.tanh), "sigmoid": (mm.sigmoid, lambda a: 1 / (1 + np.exp(-a))),
         "gelu": (mm.gelu, lambda a: 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3)))),
         "relu": (mm.relu, lambda a: np.maximum(a, 0)), "square": (mm.square, np.square),
         "negative": (mm.negative, np.negative), "abs": (mm.abs, np.abs), "sin": (mm.sin, np.sin),
         "rsqrt(|x|+1)": (lambda t: mm.rsqrt(mm.abs(t) + 1), lambda a: 1 / np.sqrt(np.abs(a) + 1)),
         "x * 1.5": (lambda t: t * 1.5, lambda a: a * 1.5), "0.3 - x": (lambda t: 0.3 - t, lambda a: 0.3 - a),
         "x / 3": (lambda t: t / 3.0, lambda a: a / 3.0), "x ** 2": (lambda t: t ** 2, lambda a: a ** 2),
         "where(x > 0, x, 0.1)": (lambda t: mm.where(mm.greater(t, 0), t, 0.1), lambda a: np.where(a > 0, a, 0.1))}


@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dt", DTYPES)
def test_elementwise(shape, dt) -> None:
    mesh, dims = mesh_and_dims(shape)
    errs, eps = Errors(), EPS[dt]
    g = data((6, 7), seed=3)
    layout = {"v": dims[0]} if dims else {}
    x = mesh.from_numpy(g.astype(dt), "b:6;v:7", layout=layout)
    a = rounded(g, dt)
    for name, (op, ref) in UNARY.items():
        y = op(x)
        errs.expect(y.dtype == np.dtype(dt), f"{name}: dtype {y.dtype}")
        r = ref(a)
        errs.within(name, y.to_numpy(), r, 2 * eps * np.abs(r) + eps)
    w = data((7, 4), seed=4)
    y = mesh.from_numpy(w.astype(dt), "v:7;h:4")
    for name, z, r in (("x + y", x + y, a[:, :, None] + rounded(w, dt)[None]),
                       ("x * y", x * y, a[:, :, None] * rounded(w, dt)[None]),
                       ("maximum", mm.maximum(x, y), np.maximum(a[:, :, None], rounded(w, dt)[None]))):
        errs.expect(z.dtype == np.dtype(dt), f"{name}: dtype {z.dtype}")
        errs.within(name, z.to_numpy(), r, eps * np.abs(r))
    z = x * mesh.from_numpy(w.astype(np.float32), "v:7;h:4")  # numpy's promotion: float32
    errs.expect(z.dtype == np.float32, f"{dt} * float32 gives {z.dtype}, not float32")
    c = mm.cast(mesh.from_numpy(g, "b:6;v:7", layout=layout), dt)
    errs.bitwise("cast from float64", c.to_numpy(), g, dt)
    errs.expect(mm.cast(c, "float64").to_numpy().tolist() == a.tolist(), "cast back to float64")
    errs.check()


# ----------------------------------------------------------------------- einsum, reductions

@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dt", DTYPES)
def test_einsum_and_reductions(shape, dt) -> None:
    mesh, dims = mesh_and_dims(shape)
    errs, u = Errors(), EPS[dt] / 2
    K = 23
    ga, gb = data((6, K), seed=5), data((K, 5), seed=6)
    lay_a = {"i": dims[0]} if dims else {}  # the contracted dim split: a sum across ranks
    lay_b = {"i": dims[0], "h": dims[1]} if len(dims) > 1 else lay_a
    x = mesh.from_numpy(ga.astype(dt), f"b:6;i:{K}", layout=lay_a)
    w = mesh.from_numpy(gb.astype(dt), f"i:{K};h:5", layout=lay_b)
    a, b = rounded(ga, dt), rounded(gb, dt)
    y = mm.einsum([x, w], output_shape="b:6;h:5")
    errs.expect(y.dtype == np.dtype(dt), f"einsum dtype {y.dtype}")
    ref, mag = a @ b, np.abs(a) @ np.abs(b)
    errs.within("einsum", y.to_numpy(), ref, u * np.abs(ref) + K * 2.0 ** -22 * mag)
    # batched (matmul path) and an opt_einsum path with a diagonal
    y3 = mm.einsum([x, w, x], output_shape="b:6;h:5")
    ref3 = np.einsum("bi,ih,bi->bh", a, b, a)
    mag3 = np.einsum("bi,ih,bi->bh", np.abs(a), np.abs(b), np.abs(a))
    errs.within("three-input einsum", y3.to_numpy(), ref3, u * np.abs(ref3) + K * 2.0 ** -22 * mag3)
    # round once: 1 + (K-1) * 3/8 ulp; a 16-bit accumulation would stay at 1
    ulp = EPS[dt]
    ones = mesh.from_numpy(np.ones(K).astype(dt), f"i:{K}", layout={"i": dims[0]} if dims else {})
    small = np.full(K, 0.375 * ulp)
    small[0] = 1.0
    s = mesh.from_numpy(small.astype(dt), f"i:{K}", layout={"i": dims[0]} if dims else {})
    exact = 1.0 + (K - 1) * 0.375 * ulp
    errs.bitwise("einsum rounds once", mm.einsum([ones, s], output_shape="").to_numpy(), np.array(exact), dt)
    errs.bitwise("reduce_sum rounds once", mm.reduce_sum(s).to_numpy(), np.array(exact), dt)
    # reductions of x over the split dim i, and over everything
    for name, got, r, m in (
            ("reduce_sum", mm.reduce_sum(x, reduced_dims="i"), a.sum(1), np.abs(a).sum(1)),
            ("reduce_mean", mm.reduce_mean(x, reduced_dims="i"), a.mean(1), np.abs(a).mean(1)),
            ("reduce_sum all", mm.reduce_sum(x), a.sum(), np.abs(a).sum()),
            ("reduce_mean all", mm.reduce_mean(x), a.mean(), np.abs(a).mean())):
        errs.expect(got.dtype == np.dtype(dt), f"{name}: dtype {got.dtype}")
        errs.within(name, got.to_numpy(), r, u * np.abs(r) + K * 2.0 ** -22 * m)
    errs.bitwise("reduce_max", mm.reduce_max(x, reduced_dims="i").to_numpy(), a.max(1), dt)
    errs.bitwise("reduce_min", mm.reduce_min(x, reduced_dims="b").to_numpy(), a.min(0), dt)
    lse = mm.reduce_logsumexp(x, reduced_dims="i")
    r = np.log(np.exp(a).sum(1))
    errs.expect(lse.dtype == np.dtype(dt), f"logsumexp dtype {lse.dtype}")
    errs.within("reduce_logsumexp", lse.to_numpy(), r, 2 * u * np.abs(r) + 2.0 ** -20)
    for name, op, ref_fn in (("softmax", mm.softmax, lambda v: np.exp(v) / np.exp(v).sum(1, keepdims=True)),
                             ("log_softmax", mm.log_softmax,
                              lambda v: v - np.log(np.exp(v).sum(1, keepdims=True)))):
        got = op(x, "i")
        r = ref_fn(a)
        errs.expect(got.dtype == np.dtype(dt), f"{name}: dtype {got.dtype}")
        errs.within(name, got.to_numpy(), r, EPS[dt] * np.abs(r) + EPS[dt] / 4)
    errs.check()


# ------------------------------------------------------------------- data movement, indexing

@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dt", DTYPES)
def test_data_movement(shape, dt) -> None:
    """relayout, reshape, transpose, slice, concat, pad, gather, one_hot, top_k, argmax: bitwise."""
    mesh, dims = mesh_and_dims(shape)
    errs = Errors()
    g = data((6, 7, 3), seed=7)
    a = g.astype(dt)
    first = {"v": dims[0]} if dims else {}
    x = mesh.from_numpy(a, "b:6;v:7;c:3", layout=first)
    other = {"b": dims[-1]} if dims else {}
    errs.bitwise("relayout", mm.relayout(x, other).to_numpy(), a, dt)
    errs.bitwise("reshape", mm.reshape(x, "b:6;vc:21").to_numpy(), a.reshape(6, 21), dt)
    errs.bitwise("transpose", mm.transpose(x, "c:3;b:6;v:7").to_numpy(), a.transpose(2, 0, 1), dt)
    errs.bitwise("slice", mm.slice(x, 2, 4, "v").to_numpy(), a[:, 2:6], dt)
    errs.bitwise("concat", mm.concat([x, x], "c").to_numpy(), np.concatenate([a, a], 2), dt)
    errs.bitwise("pad", mm.pad(x, [1, 2], "v").to_numpy(), np.pad(a, ((0, 0), (1, 2), (0, 0))), dt)
    errs.bitwise("shift", mm.shift(x, 1, "v", wrap=True).to_numpy(), np.roll(a, 1, 1), dt)
    table = mesh.from_numpy(g[:, :, 0].T.astype(dt), "vocab:7;d:6", layout={"vocab": dims[0]} if dims else {})
    ids = np.array([[3, 0, 6], [6, 2, 2]])
    rows = mm.gather(table, mesh.from_numpy(ids, "p:2;q:3"), "vocab")
    errs.bitwise("gather", rows.to_numpy(), g[:, :, 0].T[ids], dt)
    oh = mm.one_hot(mesh.from_numpy(ids, "p:2;q:3"), mm.Dimension("vocab", 7), dtype=dt)
    errs.bitwise("one_hot", oh.to_numpy(), (ids[..., None] == np.arange(7)).astype(np.float64), dt)
    vals, idx = mm.top_k(x, "v", mm.Dimension("k", 2))
    order = np.argsort(-a.astype(np.float64), axis=1, kind="stable")[:, :2]
    errs.bitwise("top_k values", vals.to_numpy(), np.take_along_axis(a.astype(np.float64), order, 1), dt)
    errs.expect(np.array_equal(mm.argmax(x, "v").to_numpy(), a.astype(np.float64).argmax(1)), "argmax")
    errs.check()


@pytest.mark.mpi
@pytest.mark.parametrize("dt", DTYPES)
def test_random_and_dropout(dt) -> None:
    """random_* in dt are the float64 draws of the same seed, rounded (uniform's clamped below maxval);
    dropout keeps x / (1 - rate) rounded, or 0."""
    mesh, dims = mesh_and_dims(SHAPES[1])
    errs = Errors()
    lay = {"a": dims[0]} if dims else {}
    for kind in ("random_normal", "random_uniform"):
        lo = getattr(mesh, kind)("a:64;b:3", seed=11, dtype=dt, layout=lay)
        hi = getattr(mesh, kind)("a:64;b:3", seed=11, dtype="float64", layout=lay)
        ref = hi.to_numpy().astype(dt).astype(np.float64)
        if kind == "random_uniform":  # rounding up to maxval 1 is clamped to the float below it
            ref = np.minimum(ref, 1 - EPS[dt] / 2)
        errs.bitwise(kind, lo.to_numpy(), ref, dt)
    u = mesh.random_uniform("a:4000", seed=1, minval=0.0, maxval=1.0, dtype=dt).to_numpy().astype(np.float64)
    errs.expect(u.max() < 1.0 and u.min() >= 0.0, f"uniform {dt} outside [0, 1): {u.min()}, {u.max()}")
    g = data((40, 5), seed=12)
    x = mesh.from_numpy(g.astype(dt), "a:40;b:5", layout=lay)
    y = mm.dropout(x, 0.25, seed=3)
    errs.expect(y.dtype == np.dtype(dt), f"dropout dtype {y.dtype}")
    got, kept = y.to_numpy().astype(np.float64), rounded(g, dt) / 0.75
    ok = (got == 0) | (np.abs(got - kept) <= EPS[dt] * np.abs(kept))
    errs.expect(ok.all() and 0.5 < (got != 0).mean() < 0.95, f"dropout: {int((~ok).sum())} bad values")
    errs.check()


@pytest.mark.mpi
def test_checkpoint_round_trip() -> None:
    """bfloat16 and float16 tensors saved on one layout load bitwise on another; the index names bfloat16."""
    mesh, dims = mesh_and_dims(SHAPES[-1])
    name = tempfile.mkdtemp(prefix="mpimesh-lp-") if mesh.rank == 0 else ""
    name = ckpt._bcast_text(mesh, name, 0)
    try:
        g = data((7, 5), seed=13)
        src = {"x": dims[0]} if dims else {}
        tensors = {dt: mesh.from_numpy(g.astype(dt), "x:7;y:5", layout=src) for dt in DTYPES}
        path = str(Path(name) / "ck")
        mm.save(path, tensors)
        rules = f"y:{dims[-1]}" if dims else ""
        back = mm.load(path, mesh, layout=rules)
        errs = Errors()
        for dt in DTYPES:
            errs.bitwise(f"checkpoint {dt}", back[dt].to_numpy(), g, dt)
        index = (Path(path) / "index.json").read_text()
        errs.expect('"bfloat16"' in index, "the index spells bfloat16 by name")
        errs.check()
    finally:
        MPI.COMM_WORLD.Barrier()
        if mesh.rank == 0:
            shutil.rmtree(name, ignore_errors=True)


# ---------------------------------------------------------------------------------- gradients

@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dt", DTYPES)
def test_gradients_through_a_cast(shape, dt) -> None:
    """A float32 tensor cast to dt: its gradient is float32, nonzero and matches float64's, through
    softmax, einsum, gather and top_k."""
    mesh, dims = mesh_and_dims(shape)
    errs, eps = Errors(), EPS[dt]
    lay = {"v": dims[0]} if dims else {}
    g, c = data((6, 7), seed=14), dyadic((6, 7), seed=15) / 8
    x = mesh.from_numpy(g.astype(np.float32), "b:6;v:7", layout=lay)
    wt = mesh.from_numpy(c.astype(np.float32), "b:6;v:7")
    with mm.trace():
        loss = mm.reduce_sum(mm.softmax(mm.cast(x, dt), "v") * wt)
        (gx,) = mm.gradients([loss], [x])
    s = np.exp(rounded(g, dt)) / np.exp(rounded(g, dt)).sum(1, keepdims=True)
    ref = s * (c - (c * s).sum(1, keepdims=True))
    errs.expect(gx.dtype == np.float32, f"softmax: gradient dtype {gx.dtype}")
    got = gx.to_numpy()
    errs.expect(np.abs(got).max() > 0, "softmax: zero gradient")
    errs.within("softmax gradient", got, ref, 4 * eps * np.abs(ref).max())
    # einsum: d/dW of sum((x16 . W16) * c2)
    w = data((7, 4), seed=16)
    W = mesh.from_numpy(w.astype(np.float32), "v:7;h:4", layout=lay)
    c2 = dyadic((6, 4), seed=17) / 8
    C2 = mesh.from_numpy(c2.astype(dt), "b:6;h:4")
    with mm.trace():
        loss = mm.reduce_sum(mm.einsum([mm.cast(x, dt), mm.cast(W, dt)], output_shape="b:6;h:4") * C2)
        gW, gx2 = mm.gradients([loss], [W, x])
    for name, t, r in (("einsum dW", gW, rounded(g, dt).T @ c2), ("einsum dx", gx2, c2 @ rounded(w, dt).T)):
        errs.expect(t.dtype == np.float32, f"{name}: gradient dtype {t.dtype}")
        errs.within(name, t.to_numpy(), r, 4 * eps * np.abs(r).max())
        errs.expect(np.abs(t.to_numpy()).max() > 0, f"{name}: zero gradient")
    # gather: the table's gradient sums the output gradients of the rows it gave
    table = mesh.from_numpy(w.astype(np.float32), "vocab:7;d:4", layout={"vocab": dims[0]} if dims else {})
    ids = np.array([3, 0, 3, 6, 3])
    c3 = dyadic((5, 4), seed=18) / 8
    with mm.trace():
        rows = mm.gather(mm.cast(table, dt), mesh.from_numpy(ids, "p:5"), "vocab")
        loss = mm.reduce_sum(rows * mesh.from_numpy(c3.astype(dt), "p:5;d:4"))
        (gt,) = mm.gradients([loss], [table])
    ref = np.zeros((7, 4))
    np.add.at(ref, ids, c3)
    errs.expect(gt.dtype == np.float32, f"gather: gradient dtype {gt.dtype}")
    errs.within("gather gradient", gt.to_numpy(), ref, eps * np.abs(ref))
    # top_k: the gradient lands on the chosen positions
    with mm.trace():
        vals, _ = mm.top_k(mm.cast(x, dt), "v", mm.Dimension("k", 2))
        loss = mm.reduce_sum(vals * mesh.from_numpy(np.array([1.0, 0.5]).astype(dt), "k:2"))
        (gk,) = mm.gradients([loss], [x])
    order = np.argsort(-rounded(g, dt), axis=1, kind="stable")[:, :2]
    ref = np.zeros((6, 7))
    np.put_along_axis(ref, order, np.array([[1.0, 0.5]]), 1)
    errs.expect(gk.dtype == np.float32, f"top_k: gradient dtype {gk.dtype}")
    errs.within("top_k gradient", gk.to_numpy(), ref, 0.0)
    errs.check()


# ------------------------------------------------------------------------- layers, training

def _classifier_data(mesh, lay):
    rng = np.random.default_rng(20)
    xs = rng.standard_normal((32, 8))
    labels = (xs @ rng.standard_normal((8, 4))).argmax(1)
    return (mesh.from_numpy(xs.astype(np.float32), "batch:32;d:8", layout=lay),
            mesh.from_numpy(labels.astype(np.int32), "batch:32", layout=lay))


@pytest.mark.mpi
@pytest.mark.parametrize("dt", DTYPES)
def test_layers_keep_float32_masters(dt) -> None:
    """dense, layer_norm, embedding, attention in dt with float32 parameters: dt outputs, float32
    gradients, values near the float64 computation."""
    mesh, dims = mesh_and_dims(SHAPES[-1])
    errs = Errors()
    p = mm.layers.init_dense(mesh, 0, "d:8", "h:4")
    ln = mm.layers.init_layer_norm(mesh, "d:8")
    x32, _ = _classifier_data(mesh, {"batch": dims[0]} if dims else {})
    x = mm.cast(x32, dt)
    with mm.trace():
        h = mm.layers.layer_norm(ln, x, "d")
        y = mm.layers.dense(p, h)
        loss = mm.reduce_sum(mm.square(mm.cast(y, "float32")))
        grads = mm.gradients([loss], [p["kernel"], p["bias"], ln["scale"]])
    errs.expect(h.dtype == np.dtype(dt) and y.dtype == np.dtype(dt), f"activations {h.dtype}, {y.dtype}")
    for t in grads:
        errs.expect(t.dtype == np.float32 and np.abs(t.to_numpy()).max() > 0, f"gradient {t.dtype}")
    xa = rounded(x32.to_numpy(), dt)
    hr = (xa - xa.mean(1, keepdims=True)) / np.sqrt(xa.var(1, keepdims=True) + 1e-6)
    errs.within("layer_norm", h.to_numpy(), hr, EPS[dt] * (np.abs(hr) + 1))
    yr = rounded(h.to_numpy().astype(np.float64), dt) @ rounded(p["kernel"].to_numpy(), dt)
    errs.within("dense", y.to_numpy(), yr, EPS[dt] * (np.abs(yr) + 1))
    emb = mm.layers.init_embedding(mesh, 1, "vocab:11", "d:8")
    e = mm.layers.embedding(emb, mesh.from_numpy(np.array([1, 10]), "p:2"), dtype=dt)
    errs.bitwise("embedding", e.to_numpy(), emb["weights"].to_numpy()[[1, 10]], dt)
    att = mm.layers.init_attention(mesh, 2, "d:8", "heads:2", "d_kv:4")
    seq = mm.cast(mesh.random_normal("batch:2;length:5;d:8", seed=4), dt)
    o = mm.layers.multihead_attention(att, seq, causal=True)
    errs.expect(o.dtype == np.dtype(dt) and np.isfinite(o.to_numpy().astype(np.float64)).all(),
                f"attention: {o.dtype}, finite {np.isfinite(o.to_numpy().astype(np.float64)).all()}")
    errs.check()


@pytest.mark.mpi
@pytest.mark.parametrize("dt", DTYPES)
def test_training_loss_decreases(dt) -> None:
    """A low-precision classifier (float32 masters, Adam) learns: its loss falls by half; float16
    runs under dynamic loss scaling."""
    mesh, dims = mesh_and_dims(SHAPES[-1])
    lay = {"batch": dims[0]} if dims else {}
    x32, labels = _classifier_data(mesh, lay)
    params = mm.layers.init_dense(mesh, 5, "d:8", "classes:4")
    opt = mm.optim.Adam(0.05)
    state = opt.init(params)
    scaler = mm.optim.DynamicLossScale(scale=2.0 ** 12) if dt == "float16" else None
    losses = []
    for _ in range(30):
        with mm.trace():
            logits = mm.layers.dense(params, mm.cast(x32, dt))
            loss = mm.reduce_mean(mm.layers.softmax_cross_entropy_with_logits(logits, labels, "classes"))
            target = loss if scaler is None else scaler.scaled(loss)
            names = list(params)
            grads = dict(zip(names, mm.gradients([target], [params[n] for n in names])))
        assert logits.dtype == np.dtype(dt) and loss.dtype == np.float32
        assert all(g.dtype == np.float32 for g in grads.values())
        if scaler is None:
            params, state = opt.update(params, grads, state)
        else:
            params, state, applied = scaler.step(opt, params, grads, state)
            assert applied
        losses.append(float(loss.to_numpy()))
    assert all(p.dtype == np.float32 for p in params.values())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.mpi
def test_loss_scale_skips_overflow_on_every_rank() -> None:
    """An inf in one rank's block only: every rank skips the step and halves the scale."""
    mesh, dims = mesh_and_dims(SHAPES[0])
    lay = {"a": dims[0]} if dims else {}
    params = {"w": mesh.from_numpy(np.arange(8.0, dtype=np.float32), "a:8", layout=lay)}
    opt = mm.optim.SGD(0.5)
    state = opt.init(params)
    ls = mm.optim.DynamicLossScale(scale=8.0, interval=2)
    g = np.ones(8, np.float32)
    g[7] = np.inf  # the last rank's block
    new, _, applied = ls.step(opt, params, {"w": mesh.from_numpy(g, "a:8", layout=lay)}, state)
    assert not applied and ls.scale == 4.0
    assert np.array_equal(new["w"].to_numpy(), np.arange(8.0))
    for i in range(2):
        new, state, applied = ls.step(opt, new, {"w": mesh.from_numpy(np.full(8, 4.0, np.float32), "a:8", layout=lay)},
                                      state)
        assert applied
    assert ls.scale == 8.0  # two good steps in a row: grown
    np.testing.assert_array_equal(new["w"].to_numpy(), np.arange(8.0) - 1.0)  # 2 steps of 0.5 * 4 / 4


@pytest.mark.mpi
def test_a_loss_scale_held_in_the_state_skips_alike_and_compiles() -> None:
    """`DynamicLossScale.init` puts the scale in the optimizer state: steps with an inf or a nan in
    one rank's block are skipped on every rank, the scale halves and grows as in the Python mode
    (the same params, scale and good-step count, bitwise, AdamW's step count advancing only on
    applied steps), and the step compiles (`mm.compile`, donated state): its replays, skipped
    steps included, give the eager values bitwise."""
    mesh, dims = mesh_and_dims(SHAPES[0])
    lay = {"a": dims[0]} if dims else {}
    opt = mm.optim.Adam(0.25, weight_decay=0.5)
    blocks = []
    for k, bad in enumerate([np.inf, None, None, None, np.nan, None, None, -np.inf, None]):
        g = (np.arange(8.0, dtype=np.float32) - 3.0) * np.float32(2.0 ** (3 - k % 3))
        if bad is not None:
            g[7] = bad  # the last rank's block
        blocks.append(g)

    def fresh():
        return {"w": mesh.from_numpy(np.linspace(-1.0, 1.0, 8, dtype=np.float32), "a:8", layout=lay)}

    py, py_state = Scale(scale=8.0, interval=2), opt.init(fresh())
    held = Scale(scale=8.0, interval=2)
    eager, eager_state = fresh(), held.init(opt.init(fresh()))
    compiled = mm.compile(lambda p, s, g: held.step(opt, p, {"w": g}, s), donate_argnums=(0, 1))
    comp, comp_state = fresh(), held.init(opt.init(fresh()))
    py_params, applied_steps = fresh(), 0
    for k, g in enumerate(blocks):
        grad = mesh.from_numpy(g, "a:8", layout=lay)
        py_params, py_state, applied = py.step(opt, py_params, {"w": grad}, py_state)
        eager, eager_state, ok = held.step(opt, eager, {"w": grad}, eager_state)
        comp, comp_state, comp_ok = compiled(comp, comp_state, grad)
        applied_steps += applied
        assert applied == (g[7] == g[7] and abs(g[7]) != np.inf) and bool(ok.to_numpy()) == applied == \
            bool(comp_ok.to_numpy()), k
        want = py_params["w"].to_numpy()
        for got in (eager["w"].to_numpy(), comp["w"].to_numpy()):
            assert got.tobytes() == want.tobytes(), (k, got, want)
        for s in (eager_state, comp_state):
            assert float(s["loss_scale"]["scale"].to_numpy()) == py.scale, k
            assert int(s["loss_scale"]["good_steps"].to_numpy()) == py.good_steps, k
            assert int(s["step"].to_numpy()) == int(py_state["step"].to_numpy()) == applied_steps, k
            for slot in ("m", "v"):
                assert s[slot]["w"].to_numpy().tobytes() == py_state[slot]["w"].to_numpy().tobytes(), (k, slot)
    assert (compiled.recordings, compiled.replays) == (1, len(blocks) - 1)
    assert held.scale == 8.0 and held.good_steps == 0  # (the Python attributes are not the held scale)
    loss = mesh.from_numpy(np.array(3.0, np.float32), [])
    assert float(held.scaled(loss, eager_state).to_numpy()) == 3.0 * py.scale


def test_a_16_bit_loss_is_scaled_in_float32() -> None:
    """A float16 loss times a scale of 2**16 was inf (the scale rounded to float16 first), in both
    modes: it is scaled in float32, against float64; the gradient into the 16-bit graph stays 16-bit."""
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    for dt in (np.float16, "bfloat16"):
        loss = mm.cast(mesh.from_numpy(np.array(0.001, np.float32), []), dt)
        want = float(np.float64(loss.to_numpy().astype(np.float64)) * 2.0 ** 16)
        ls = Scale(scale=2.0 ** 16)
        for got in (ls.scaled(loss), ls.scaled(loss, ls.init({"step": mesh.zeros([], "int32")}))):
            assert got.dtype == np.float32 and float(got.to_numpy()) == want, (dt, got.to_numpy())
        with mm.trace():
            x = mm.cast(mesh.from_numpy(np.array(0.5, np.float32), []), dt)
            (g,) = mm.gradients([Scale(scale=2.0 ** 15).scaled(x * 0.5)], [x])
        assert g.dtype == x.dtype and float(g.to_numpy()) == 2.0 ** 14


def test_a_held_loss_scale_must_be_inits() -> None:
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    params = {"w": mesh.ones("a:2")}
    opt, ls = mm.optim.SGD(0.1), Scale()
    with pytest.raises(mm.MpimeshError, match=r"^DynamicLossScale.init: state must be an optimizer's state"):
        ls.init({"w": params["w"]})
    bad = dict(opt.init(params), loss_scale={"scale": 2.0})
    with pytest.raises(mm.MpimeshError, match=r"^DynamicLossScale: state\['loss_scale'\] must be the dict init"):
        ls.step(opt, params, params, bad)
    with pytest.raises(mm.MpimeshError, match=r"^DynamicLossScale: state\['loss_scale'\] must be the dict init"):
        ls.scaled(params["w"], bad)
