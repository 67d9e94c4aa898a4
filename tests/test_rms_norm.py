"""rms_norm (`mm.layers.rms_norm`, `mpimesh.ops.norm.rms_norm`), the op added to prove that an op is
its `OpDef` alone (issue 41): values and gradients against float64 numpy on the global arrays
(float64, float32, bfloat16; the normalised dim split and whole, uneven blocks; 1-D to 3-D meshes),
finite differences, its collectives, the compiled replay bitwise equal to eager, the JAX replay on
uneven blocks, the cost model's flops, its CUDA sources run on the CPU against the numpy kernels, and
its errors. (tests/test_opdefs.py checks its dry run against rank 0.)"""
from __future__ import annotations

import importlib
import math
import time

import jaxenv  # noqa: F401  (first: XLA flags for host devices, before jax is imported)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import cuda_source  # noqa: E402
from gradcheck import check_gradients  # noqa: E402
from meshes import collectives, get_mesh, layouts, mesh_shapes  # noqa: E402
from test_cuda_sources import _row_kernels_on_the_cpu  # noqa: E402  (ROW_SOURCES compiled for the CPU)

import mpimesh as mm  # noqa: E402
from mpimesh import backend  # noqa: E402
from mpimesh.backend import resolve_backend  # noqa: E402

norm = importlib.import_module("mpimesh.ops.norm")
rowwise = importlib.import_module("mpimesh.ops.rowwise")

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
SPEC, SIZES = "b:5;l:3;d:7", {"b": 5, "l": 3, "d": 7}  # 5, 3, 7: uneven over 2, 3 and 4 ranks
EPS = 1e-6
VARIANTS = {"d, scale d": (("d",), "d:7"), "l and d, scale d": (("l", "d"), "d:7"), "d, no scale": (("d",), None),
            "d, scale l and d": (("d",), "l:3;d:7")}  # (a scale along a dim not normalised too)
TOL = {"float64": 1e-12, "float32": 2e-6, "bfloat16": 1e-2}


def reference(x, scale, w, dims: tuple, scale_dims: tuple = ()) -> tuple:
    """Float64 `(y, dx, dscale)` of `sum(rms_norm(x) * w)` on global arrays (x's axes b, l, d), from
    the formulas: y = x r s with r = 1 / sqrt(mean(x**2) + eps); dx = r (w s - yhat mean(w s yhat))."""
    axes = tuple("bld".index(d) for d in dims)
    x, w = x.astype(np.float64), w.astype(np.float64)
    s = 1.0 if scale is None else scale.astype(np.float64).reshape([SIZES[d] if d in scale_dims else 1 for d in "bld"])
    r = 1 / np.sqrt((x * x).mean(axis=axes, keepdims=True) + EPS)
    yhat = x * r
    gs = w * s
    dx = r * (gs - yhat * (gs * yhat).mean(axis=axes, keepdims=True))
    summed = tuple(i for i, d in enumerate("bld") if d not in scale_dims)
    return yhat * s, dx, None if scale is None else (w * yhat).sum(axis=summed)


def _data(dtype: str, scale_spec, seed: int = 11) -> tuple:
    """x (as `dtype` rounds it), the upstream gradient w (likewise), the scale (float32 beside 16-bit x)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((5, 3, 7)) * 2 + 0.5).astype(dtype)
    w = rng.standard_normal((5, 3, 7)).astype(dtype)
    pdt = "float32" if dtype == "bfloat16" else dtype
    scale = None if scale_spec is None else (rng.standard_normal(mm.Shape(scale_spec).sizes) + 1).astype(pdt)
    return x, w, scale


def _close(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=what)


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_values_and_gradients_equal_float64_numpy(shape, dtype, variant):
    """y and the gradients of x and the scale, on every layout of b, l, d over the mesh (d split on
    some, uneven), against the float64 formulas; y and dx in x's dtype, dscale in the scale's."""
    dims, scale_spec = VARIANTS[variant]
    mesh = get_mesh(shape)
    x, w, scale = _data(dtype, scale_spec)
    want = reference(x, scale, w, dims, () if scale_spec is None else mm.Shape(scale_spec).names)
    lays = layouts(mesh, ["b", "l", "d"], limit=8)
    assert any("d" in lay for lay in lays) or mesh.size == 1
    for lay in lays:
        with mm.layout_scope(mesh, lay), mm.trace():
            xt, wt = mesh.from_numpy(x, SPEC), mesh.from_numpy(w, SPEC)
            p = {} if scale is None else {"scale": mesh.from_numpy(scale, scale_spec)}
            y = mm.layers.rms_norm(p, xt, list(dims))
            grads = mm.gradients([y], [xt, *p.values()], grad_ys=[wt])
        assert (y.dtype, grads[0].dtype) == (xt.dtype, xt.dtype)
        for what, got, ref in zip(("y", "dx", "dscale"), [y, *grads], want):
            _close(got.to_numpy(), ref, TOL[dtype], f"{lay} {what}")
        if scale is not None:
            assert grads[1].dtype == p["scale"].dtype and grads[1].tensor_layout == p["scale"].tensor_layout


@pytest.mark.parametrize("shape", mesh_shapes()[:2])
def test_gradients_equal_finite_differences(shape):
    """mm.gradients of rms_norm against central differences (float64), d split where the mesh allows."""
    mesh = get_mesh(shape)
    lays = [lay for lay in layouts(mesh, ["b", "d"]) if "d" in lay][:2] or [{}]
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((4, 7)) + 0.3, rng.standard_normal(7) + 1, rng.standard_normal((4, 7))]
    for lay in lays:
        with mm.layout_scope(mesh, lay):
            check_gradients(mesh, lambda x, s, r: mm.layers.rms_norm({"scale": s}, x, "d") * r, arrays,
                            ["b:4;d:7", "d:7", "b:4;d:7"], wrt=[0, 1])


@pytest.mark.parametrize("shape", mesh_shapes())
def test_a_split_normalised_dim_costs_one_allreduce_each_way(shape):
    """d split over mesh dim m: the forward's sum of squares and the backward's one sum are one
    allreduce over m each (of a row's worth per rank); d whole: no collective at all (the scale's
    gradient sums over b and l, which are not split here)."""
    mesh = get_mesh(shape)
    x, w, scale = _data("float32", "d:7")
    for m in [None] + [d.name for d in mesh.shape if d.size > 1]:
        with mm.layout_scope(mesh, {"d": m} if m else {}), mm.trace():
            xt, wt, st = mesh.from_numpy(x, SPEC), mesh.from_numpy(w, SPEC), mesh.from_numpy(scale, "d:7")
            with mm.profile() as fwd:
                y = mm.layers.rms_norm({"scale": st}, xt, "d")
            with mm.profile() as bwd:
                mm.gradients([y], [xt, st], grad_ys=[wt])
        want = {} if m is None else {f"allreduce/{m}": {"calls": 1, "elements": 15, "bytes": 60}}
        assert (collectives(fwd), collectives(bwd)) == (want, want), m


def _step(x, w, scale):
    with mm.trace():
        y = mm.layers.rms_norm({"scale": scale}, x, "d")
        dx, ds = mm.gradients([y], [x, scale], grad_ys=[w])
    return y, dx, ds


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_equals_eager_bitwise(shape, dtype):
    """`mm.compile` of a step with rms_norm and its gradients (the scale's data-parallel sum in a
    bucket where b is split) gives eager's bits on every step, d split and whole."""
    mesh = get_mesh(shape)
    names = [d.name for d in mesh.shape if d.size > 1]
    for rules in [""] + ([f"d:{names[0]}", f"b:{names[0]}" + (f";d:{names[1]}" if len(names) > 1 else "")]
                         if names else []):
        with mm.layout_scope(mesh, rules):
            step = mm.compile(_step)
            for k in range(3):
                x, w, scale = _data(dtype, "d:7", seed=20 + k)
                args = (mesh.from_numpy(x, SPEC), mesh.from_numpy(w, SPEC), mesh.from_numpy(scale, "d:7"))
                for a, b, what in zip(_step(*args), step(*args), ("y", "dx", "dscale")):
                    assert a.tensor_layout == b.tensor_layout and a.dtype == b.dtype
                    assert np.array_equal(a.local.view(np.uint8), b.local.view(np.uint8)), (rules, k, what)
        assert (step.recordings, step.replays) == (1, 2)


def _wait_all() -> None:
    """A barrier whose waiting ranks sleep (busy-polling ranks would starve rank 0's JAX compiles)."""
    req = WORLD.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


@pytest.mark.parametrize("dims", [("d",), ("l", "d")])
def test_jax_replay_of_uneven_blocks_equals_numpy(dims):
    """`mm.tpu.replay` of rms_norm and its gradients on N JAX devices, d and l split over the mesh
    (uneven on 2-4 ranks: each device's block padded with zeros, which must stay out of the mean):
    float64 numpy's values, and MPI's."""
    jax = pytest.importorskip("jax", reason="jax is not installed")
    n = WORLD.Get_size()
    if len(jax.devices()) < n:
        pytest.skip(f"JAX has {len(jax.devices())} devices, fewer than the {n} ranks")
    shape = mesh_shapes()[1]  # (rows:1;cols:N on N ranks)
    mesh = get_mesh(shape)
    names = [d.name for d in mesh.shape if d.size > 1]
    x, w, scale = _data("float64", "d:7", seed=5)
    with mm.layout_scope(mesh, {"d": names[0]} if names else {}):
        ins = [mesh.from_numpy(x, SPEC), mesh.from_numpy(w, SPEC), mesh.from_numpy(scale, "d:7")]
        with mm.trace() as tr:
            y = mm.layers.rms_norm({"scale": ins[2]}, ins[0], list(dims))
            dx, ds = mm.gradients([y], [ins[0], ins[2]], grad_ys=[ins[1]])
    outs = [y, dx, ds]
    mpi = [t.to_numpy() for t in outs]
    want = reference(x, scale, w, dims, ("d",))
    try:
        if WORLD.Get_rank() == 0:  # (no collectives in here)
            got = mm.tpu.replay(tr, ins, outs, devices=jax.devices()[:n])(x, w, scale)
            for g, m, ref, what in zip(got, mpi, want, ("y", "dx", "dscale")):
                _close(np.asarray(g), ref, 1e-12, what)
                _close(np.asarray(g), m, 1e-12, f"{what} against MPI")
    finally:
        _wait_all()


@pytest.mark.parametrize("shape", ["all:2", "rows:2;cols:2"])
def test_the_cost_model_prices_its_flops(shape):
    """`mm.cost.record` of rms_norm and its gradient, dry: the ops and the flops of coordinate 0's
    blocks (b split: 3 of 5 rows there): forward 4 per element (square, sum, * 1/rms, * scale),
    backward 7 (* 1/rms, dy * scale, the sum's two, dx's three), the scale's einsum 2 per product."""
    rules = "b:rows" if "rows" in shape else "b:all"
    args = (mm.cost.ArgSpec(SPEC, "float32"), mm.cost.ArgSpec(SPEC, "float32"), mm.cost.ArgSpec("d:7", "float32"))
    rec = mm.cost.record(_step, args, shape, rules)
    flops = {op.name: op.flops for op in rec.ops}
    local = 3 * 3 * 7
    assert (flops["rms_norm"], flops["rms_norm_grad"], flops["einsum"]) == (4 * local, 7 * local, 2 * local), rec.ops
    assert rec.collectives == {f"allreduce/{rules[2:]}": {"calls": 1, "elements": 7, "bytes": 28}}


# ------------------------------------------------------------------- CuPy's kernels, on the CPU

needs_compiler = pytest.mark.skipif(cuda_source.compiler() is None, reason="no C++ compiler to run the sources")
on_the_cpu = pytest.mark.skipif(resolve_backend(None) != "numpy", reason="on a GPU the kernels themselves run")


def _run_all(mesh, x, w, scale, dims: tuple, lays: list) -> list:
    out = []
    for lay in lays:
        with mm.layout_scope(mesh, lay), mm.trace():
            xt, wt = mesh.from_numpy(x, SPEC), mesh.from_numpy(w, SPEC)
            p = {} if scale is None else {"scale": mesh.from_numpy(scale, "d:7")}
            y = norm.rms_norm(xt, dims, p.get("scale"))
            grads = mm.gradients([y], [xt, *p.values()], grad_ys=[wt])
            out.append([t.to_numpy().astype(np.float64) for t in (y, *grads)])
    return out


def _on_cupy_kernels(monkeypatch) -> None:
    """From now on rms_norm's ops run their CuPy kernels on numpy blocks."""
    for op in (norm.RMS_NORM, norm.RMS_NORM_GRAD):
        monkeypatch.setitem(op.kernels, "numpy", op.kernels["cupy"])


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("with_scale", [True, False])
@needs_compiler
@on_the_cpu
def test_one_kernel_rows_equal_the_numpy_kernels(shape, dtype, with_scale, monkeypatch):
    """`norm.RMS_ROWS_SOURCE` compiled for the CPU (a warp of one thread) where CuPy takes it (d the
    last dim, whole on the rank): y, dx and dscale equal the numpy kernels' to a few units in the last
    place on every layout, and float64 numpy's formulas; where d is split, CuPy's steps without the
    one-kernel rows (which must not run there)."""
    mesh = get_mesh(shape)
    x, w, scale = _data(dtype, "d:7" if with_scale else None, seed=9)
    lays = layouts(mesh, ["b", "l", "d"], limit=6)
    want = _run_all(mesh, x, w, scale, ("d",), lays)
    used: list = []
    _on_cupy_kernels(monkeypatch)
    monkeypatch.setattr(norm, "fusable", lambda *arrays: False)
    for dt in rowwise.PRELUDE_TYPES:
        kernels = cuda_source.raw_module(rowwise.PRELUDE_TYPES[dt] + norm.RMS_ROWS_SOURCE, norm.RMS_ROWS_PARAMS)
        monkeypatch.setitem(backend._kernels, ("norm", "rms_rows", dt),
                            {k: (lambda *a, _f=f, _k=k: used.append(_k) or _f(*a)) for k, f in kernels.items()})
    monkeypatch.setattr(norm, "rows_fit", lambda xp, a, axes: a.dtype.name in rowwise.PRELUDE_TYPES and a.size > 0
                        and tuple(axes) == (a.ndim - 1,) and a.flags.c_contiguous)
    got = _run_all(mesh, x, w, scale, ("d",), lays)
    whole = sum("d" not in lay for lay in lays)  # (a rank whose block is empty runs neither kernel)
    assert used == ["mpimesh_rms_norm_rows", "mpimesh_rms_norm_grad_rows"] * (len(used) // 2), used
    assert WORLD.allreduce(len(used), op=MPI.MAX) == 2 * whole, used
    ref = reference(x, scale, w, ("d",), ("d",))
    eps = 16 * (2.0 ** -8 if dtype == "bfloat16" else np.finfo(dtype).eps)
    for lay, g_arrays, w_arrays in zip(lays, got, want):
        for what, a, b, r in zip(("y", "dx", "dscale"), g_arrays, w_arrays, ref):
            np.testing.assert_allclose(a, b, rtol=eps, atol=eps * np.abs(b).max(), err_msg=f"{lay} {what}")
            _close(a, r, TOL[dtype], f"{lay} {what} against float64")


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("variant", ["d, scale d", "l and d, scale d", "d, no scale"])
@needs_compiler
@on_the_cpu
def test_few_kernel_path_equals_the_numpy_kernels(shape, dtype, variant, monkeypatch):
    """CuPy's steps where the one-kernel rows do not serve: `rowwise.ROW_SOURCES`'s kernels with a
    mean of 0 (the sum of squares, y; the normalised x, the one sum, dx), compiled for the CPU, equal
    the numpy kernels to a few units in the last place, the normalised dims split on some layouts."""
    dims, scale_spec = VARIANTS[variant]
    mesh = get_mesh(shape)
    x, w, scale = _data(dtype, scale_spec, seed=10)
    lays = layouts(mesh, ["b", "l", "d"], limit=5)
    want = _run_all(mesh, x, w, scale, dims, lays)
    used: list = []
    kernel = _row_kernels_on_the_cpu(rowwise)
    _on_cupy_kernels(monkeypatch)
    monkeypatch.setattr(norm, "rows_fit", lambda xp, a, axes: False)
    monkeypatch.setattr(norm, "row_kernel", lambda *a, **k: used.append(a[1]) or kernel(*a, **k))
    got = _run_all(mesh, x, w, scale, dims, lays)
    assert set(used) == {"row_dot", "layer_norm_s" if scale is not None else "layer_norm", "normalised", "scaled_dot",
                         "layer_norm_grad"}, used
    eps = 16 * np.finfo(dtype).eps
    for lay, g_arrays, w_arrays in zip(lays, got, want):
        for what, a, b in zip(("y", "dx", "dscale"), g_arrays, w_arrays):
            np.testing.assert_allclose(a, b, rtol=eps, atol=eps * np.abs(b).max(), err_msg=f"{lay} {what}")


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_one_kernel_rows_on_a_gpu(dtype):
    """On CuPy, rms_norm over a 1000-long last dim, whole on each rank: one kernel each way (a warp's
    shuffles summing the row), against float64 numpy (bfloat16 x, a float32 scale)."""
    mesh = get_mesh(mesh_shapes()[0])
    if mesh.backend != "cupy":
        pytest.skip("CuPy's kernels (their sources run on the CPU above)")
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((2, 64, 1000)) * 3 + 1).astype(np.float32)
    w = rng.standard_normal(x.shape).astype(np.float32)
    scale = rng.standard_normal(1000).astype(np.float32)
    xr, wr = ((a.astype("bfloat16") if dtype == "bfloat16" else a).astype(np.float64) for a in (x, w))
    r = 1 / np.sqrt((xr * xr).mean(-1, keepdims=True) + EPS)
    yhat, gs = xr * r, wr * scale
    dx = r * (gs - yhat * (gs * yhat).mean(-1, keepdims=True))
    tol = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 3e-2}[dtype]
    with mm.layout_scope(mesh, f"b:{mesh.shape.names[0]}"), mm.trace():
        st = mesh.from_numpy(scale.astype("float64" if dtype == "float64" else "float32"), "d:1000")
        xt = mm.cast(mesh.from_numpy(x, "b:2;l:64;d:1000"), dtype)
        y = mm.layers.rms_norm({"scale": st}, xt, "d")
        gx, gsc = mm.gradients([y], [xt, st], grad_ys=[mm.cast(mesh.from_numpy(w, "b:2;l:64;d:1000"), dtype)])
    assert backend._kernels.get(("norm", "rms_rows", dtype)) is not None, "the one-kernel rows did not compile"
    for got, want in ((y, yhat * scale), (gx, dx), (gsc, (wr * yhat).sum((0, 1)))):
        np.testing.assert_allclose(got.to_numpy().astype(np.float64), want, rtol=tol, atol=tol * np.abs(want).max())


# ----------------------------------------------------------------------------------------- errors

def test_bad_input_is_named():
    """A dim not in x, an integer x, a scale dim not in x, a misspelt key, a negative epsilon: each
    an mpimesh error naming what is wrong, on every rank."""
    mesh = get_mesh(mesh_shapes()[0])
    x = mesh.ones("b:2;d:4")
    p = mm.layers.init_rms_norm(mesh, "d:4")
    assert list(p) == ["scale"] and p["scale"].dtype == np.float32 and p["scale"].to_numpy().tolist() == [1.0] * 4
    for call, error, words in (
            (lambda: mm.layers.rms_norm(p, x, "e"), mm.ShapeError, r"rms_norm: normalised dim 'e' is not in"),
            (lambda: mm.layers.rms_norm(p, mesh.ones("b:2;d:4", "int32"), "d"), mm.DTypeError, "rms_norm needs floats"),
            (lambda: mm.layers.rms_norm({"scale": mesh.ones("f:4")}, x, "d"), mm.ShapeError,
             r"rms_norm: scale dim f:4 is not in the input shape"),
            (lambda: mm.layers.rms_norm({"scal": p["scale"]}, x, "d"), mm.MpimeshError, r"params have \['scal'\]"),
            (lambda: mm.layers.rms_norm(p, x, "d", epsilon=-1.0), mm.MpimeshError, "epsilon must be >= 0, got -1.0")):
        with pytest.raises(error, match=words):
            call()
    y = mm.layers.rms_norm({}, mesh.from_numpy(np.array([[3.0, 4.0]]), "b:1;d:2"), "d", epsilon=0.0)
    np.testing.assert_allclose(y.to_numpy(), [[3 / math.sqrt(12.5), 4 / math.sqrt(12.5)]], rtol=1e-6)
