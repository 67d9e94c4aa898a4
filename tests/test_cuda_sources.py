"""The CUDA sources of mpimesh's CuPy kernels (the multi-tensor Adam and SGD updates, dropout, bias
plus activation and its gradient, softmax's reductions and outputs), run on the CPU: each source compiled by the host's C++ compiler
(tests/cuda_source.py) stands in for CuPy's `ElementwiseKernel`, and the op is made to take its
CuPy branch, so the arguments it passes are checked too (their order, their dtypes: CuPy refuses
T arrays of two dtypes). Each must give bitwise the values of the numpy composition (within a few
units in the last place where the host's tanh may round differently from numpy's), on split and
uneven layouts (compiled without multiply-add contraction: nvcc's FMAs may change the last bit on
a GPU, which this cannot see). Skipped where no C++ compiler is installed."""
from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
import cuda_source  # noqa: E402
from meshes import Errors, get_mesh, layouts, mesh_shapes  # noqa: E402
from test_updates import OPTIMIZERS, SHAPES, both_ways  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import backend  # noqa: E402
from mpimesh.backend import resolve_backend  # noqa: E402
from mpimesh.opdef import OpDef  # noqa: E402

updates = importlib.import_module("mpimesh.ops.updates")
dropout_op = importlib.import_module("mpimesh.ops.dropout")
act_mod = importlib.import_module("mpimesh.ops.activation")

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(cuda_source.compiler() is None, reason="no C++ compiler to run the kernels' sources"),
              pytest.mark.skipif(resolve_backend(None) != "numpy", reason="the sources on the CPU; a GPU runs the kernels")]

KERNELS = {"adam": (*updates.ADAM_PARAMS, updates.ADAM_SOURCE), "sgd": (*updates.SGD_PARAMS, updates.SGD_SOURCE)}


def cupy_kernels(monkeypatch, *ops) -> None:
    """From now on `ops` (OpDefs) run their CuPy kernel (`OpDef.kernels["cupy"]`) on numpy."""
    for op in ops:
        monkeypatch.setitem(op.kernels, "numpy", op.kernels["cupy"])


def take_cupy_branch(monkeypatch):
    """From now on the ops take their CuPy branch, with the kernels' sources compiled for the CPU."""
    compiled = {k: cuda_source.elementwise(*spec) for k, spec in KERNELS.items()}
    for kernels in (updates.SGD_KERNELS, updates.ADAM_KERNELS):  # (a numpy mesh runs the CuPy kernels)
        monkeypatch.setitem(kernels, "numpy", kernels["cupy"])
    compiled.update({(k, True): cuda_source.elementwise(*updates.kernel_source(k, True)) for k in KERNELS})
    monkeypatch.setattr(updates, "_kernel",
                        lambda xp, which, narrow=False: compiled[(which, True) if narrow else which])
    cupy_kernels(monkeypatch, dropout_op.DROPOUT)
    monkeypatch.setitem(backend._kernels, ("dropout",),
                        cuda_source.elementwise(*dropout_op.DROPOUT_PARAMS, dropout_op.DROPOUT_SOURCE))


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_update_kernels_equal_the_unfused_composition(shape, dtype, which, monkeypatch):
    take_cupy_branch(monkeypatch)
    errs = Errors()  # asserted after the last collective, so that a rank's failure hangs none
    for step, slot_names, (p1, s1), (p2, s2), _ in both_ways(get_mesh(shape), which, dtype):
        for name in SHAPES:
            errs.expect(p1[name].local.tobytes() == p2[name].local.tobytes(), f"{name} step {step}")
            for slot in slot_names:
                errs.expect(s1[slot][name].local.tobytes() == s2[slot][name].local.tobytes(),
                            f"{name} slot {slot} step {step}")
    errs.check()


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("dims", ["a:1000", "a:7;b:5", "a:3;b:2;c:5", ""])
def test_dropout_kernel_equals_the_numpy_lowering(shape, dtype, dims, monkeypatch):
    mesh = get_mesh(shape)
    x = np.random.default_rng(1).standard_normal(mm.Shape(dims).sizes).astype(dtype)
    lays = layouts(mesh, mm.Shape(dims).names, limit=5)
    assert len(lays) > 1 or mesh.size == 1 or not dims  # split layouts, uneven and empty blocks among them
    t = mesh.from_numpy(x, dims)

    def run():
        out = []
        for lay in lays:
            with mm.layout_scope(mesh, lay):
                out.append(mm.dropout(t, 0.3, seed=5))
        return out
    want = run()
    take_cupy_branch(monkeypatch)
    errs = Errors()
    for lay, a, b in zip(lays, run(), want):
        errs.expect(a.tensor_layout == b.tensor_layout and a.dtype == b.dtype, f"{lay}: layout or dtype")
        errs.expect(a.local.tobytes() == b.local.tobytes(), f"{lay}: the kernel's values differ")
    y = want[-1].to_numpy()
    errs.check()
    if dims == "a:1000":  # and not vacuously: about 70% kept, each scaled by 1/0.7
        assert 0.6 < np.mean(y != 0) < 0.8
        np.testing.assert_array_equal(y[y != 0], (x * x.dtype.type(1 / 0.7))[y != 0])


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh", None])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_activation_kernels_equal_the_numpy_lowering(shape, dtype, activation, with_bias, monkeypatch):
    """Values and gradients (dx, and the bias's, summed from dx): bitwise for relu and the bare sum;
    to 16 epsilons of the largest value where the host's tanh may round differently from numpy's."""
    mesh = get_mesh(shape)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 7)).astype(dtype)
    x[0, :3] = [0.0, -0.0, 1e-30]  # relu's edges: +0, -0 (numpy's maximum gives +0), a tiny positive
    w = rng.standard_normal((5, 7))
    lays = layouts(mesh, ["n", "h"], limit=4)

    def run():
        out = []
        for lay in lays:
            with mm.layout_scope(mesh, lay), mm.trace():
                xt = mesh.from_numpy(x, "n:5;h:7")
                bt = mesh.from_numpy(np.linspace(-1, 1, 7).astype(dtype), "h:7") if with_bias else None
                y = act_mod.bias_activation(xt, bt, activation)
                grads = mm.gradients([mm.reduce_sum(y * mesh.from_numpy(w.astype(dtype), "n:5;h:7"))],
                                     [xt] + ([bt] if with_bias else []))
                out.append([y.to_numpy(), *(g.to_numpy() for g in grads)])
        return out
    want = run()
    take_cupy_branch(monkeypatch)
    for key in [(a, g, b) for a in act_mod.SOURCES for g in (False, True) for b in (False, True)]:
        monkeypatch.setitem(backend._kernels, ("activation",) + key,
                            cuda_source.elementwise(*act_mod.kernel_params(*key)))
    cupy_kernels(monkeypatch, *(op for pair in act_mod.OPS.values() for op in pair))
    got = run()
    exact = activation in ("relu", None)
    eps = 16 * np.finfo(dtype).eps  # glibc's tanh and numpy's differ by up to 3 units in the last place
    for lay, g_arrays, w_arrays in zip(lays, got, want):
        for what, a, b in zip(("y", "dx", "dbias"), g_arrays, w_arrays):
            if exact:
                assert a.tobytes() == b.tobytes(), (lay, what)
            else:  # relative to the largest value: 1 + tanh cancels where the input is very negative
                np.testing.assert_allclose(a, b, rtol=eps, atol=eps * np.abs(b).max(), err_msg=f"{lay} {what}")


def _row_kernels_on_the_cpu(rowwise):
    """`rowwise.row_kernel` with each source of `ROW_SOURCES` compiled for the CPU: an
    elementwise kernel as it is; a reduction's map as an elementwise kernel, then numpy's sum."""
    compiled = {}
    for which, (ins, out, body) in rowwise.ROW_SOURCES.items():
        name = out.split()[-1]
        compiled[which] = cuda_source.elementwise(ins, out, body if which not in rowwise._REDUCTIONS
                                                  else f"{name} = {body};")

    def kernel(xp, which, *arrays, axes=(), out=None):
        y = compiled[which](*arrays)
        if which in rowwise._REDUCTIONS:
            return np.sum(y, axis=axes, keepdims=True)
        if out is None:
            return y
        out[...] = y
        return out
    return kernel


def _module_ops(module) -> list:
    """`module`'s OpDefs that have a CuPy kernel."""
    return [v for v in vars(module).values() if isinstance(v, OpDef) and "cupy" in v.kernels]


def _on_row_kernels(module, run, monkeypatch) -> tuple:
    """`run()` again with `module`'s ops on their CuPy kernels, with the CPU-compiled kernels of
    `ROW_SOURCES` (not the one-kernel rows): its results, and the kernels used, in order."""
    used = []
    kernel = _row_kernels_on_the_cpu(importlib.import_module("mpimesh.ops.rowwise"))
    cupy_kernels(monkeypatch, *_module_ops(module))
    monkeypatch.setattr(module, "rows_fit", lambda xp, a, axes: False)
    monkeypatch.setattr(module, "row_kernel", lambda *a, **k: used.append(a[1]) or kernel(*a, **k))
    return run(), used


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("causal", [False, True])
def test_row_kernels_equal_the_numpy_lowering(shape, dtype, op, causal, monkeypatch):
    """softmax and log_softmax on CuPy's two kernels each way (a reduction, then the output):
    values and gradients equal numpy's lowering to a few units in the last place (the row sums in
    another order, the host's exp), on split and uneven layouts, the reduced dim split too."""
    nn = importlib.import_module("mpimesh.ops.nn")
    mesh = get_mesh(shape)
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 5, 5)) * 4).astype(dtype)
    w = rng.standard_normal((3, 5, 5))
    lays = layouts(mesh, ["b", "q", "k"], limit=5)

    def run():
        out = []
        for lay in lays:
            with mm.layout_scope(mesh, lay), mm.trace():
                xt = mesh.from_numpy(x, "b:3;q:5;k:5")
                y = getattr(mm, op)(xt, "k", causal="q" if causal else None)
                (g,) = mm.gradients([mm.reduce_sum(y * mesh.from_numpy(w.astype(dtype), "b:3;q:5;k:5"))], [xt])
                out.append([y.to_numpy(), g.to_numpy()])
        return out
    want = run()
    got, used = _on_row_kernels(nn, run, monkeypatch)
    assert set(used) == {"sum_exp", op, f"{op}_grad"} | ({"row_dot"} if op == "softmax" else set()), used
    eps = 8 * np.finfo(dtype).eps
    for lay, g_arrays, w_arrays in zip(lays, got, want):
        for what, a, b in zip(("y", "dx"), g_arrays, w_arrays):
            np.testing.assert_allclose(a, b, rtol=eps, atol=eps * np.abs(b).max(), err_msg=f"{lay} {what}")


def _one_kernel_rows(module, names: tuple, monkeypatch) -> list:
    """`module`'s one-kernel rows (`rowwise.ROWS_SOURCE`, compiled for the CPU: a warp of one
    thread; the functions `names`) taken where CuPy would take them (elsewhere, CuPy's steps without
    the kernels of `ROW_SOURCES`); the names of those run, in order."""
    rowwise = importlib.import_module("mpimesh.ops.rowwise")
    used: list = []
    cupy_kernels(monkeypatch, *_module_ops(module))
    monkeypatch.setattr(module, "fusable", lambda *arrays: False)
    for dt in rowwise.PRELUDE_TYPES:
        source = rowwise.PRELUDE_TYPES[dt] + rowwise.ROWS_SOURCE
        monkeypatch.setitem(backend._kernels, ("rowwise", "rows", dt),
                            cuda_source.raw_module(source, rowwise.ROWS_PARAMS))
    monkeypatch.setattr(module, "rows_fit", lambda xp, a, axes: a.dtype.name in rowwise.PRELUDE_TYPES and a.size > 0
                        and tuple(axes) == (a.ndim - 1,) and a.flags.c_contiguous)
    for name in names:
        monkeypatch.setattr(module, name,
                            lambda *a, _f=getattr(rowwise, name), _n=name, **k: used.append(_n) or _f(*a, **k))
    return used


def _before_and_after(module, names: tuple, run, whole: int, monkeypatch) -> tuple:
    """`(got, want)`: `run()` on the one-kernel rows and on numpy's lowering; the kernels `names`
    ran (in that order) for each of the `whole` layouts whose rows are whole on the ranks (a rank
    whose block is empty, on 3 ranks, runs neither path)."""
    want = run()
    used = _one_kernel_rows(module, names, monkeypatch)
    got = run()
    assert used == list(names) * (len(used) // 2), used
    assert MPI.COMM_WORLD.allreduce(len(used), op=MPI.MAX) == 2 * whole, used
    return got, want


@pytest.mark.filterwarnings("ignore:invalid value encountered", "ignore:divide by zero")  # (the row of -inf)
@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("causal", [False, True])
def test_one_kernel_rows_equal_the_numpy_lowering(shape, dtype, op, causal, monkeypatch):
    """softmax and log_softmax on CuPy by one kernel each way where the rows are whole on a rank
    (the causal mask inside, bfloat16 read and written as it is): values and gradients equal numpy's
    lowering to a few units in the last place, on split and uneven layouts (the batch and query
    dims split: the mask's positions offset); where the reduced dim is split, the two-kernel path.
    Rows of -inf give NaN, as numpy's lowering does."""
    nn = importlib.import_module("mpimesh.ops.nn")
    mesh = get_mesh(shape)
    rng = np.random.default_rng(6)
    spec = "b:2;q:6;h:3;k:6"  # (the query dim not next to the reduced one: its row stride is 3)
    x = (rng.standard_normal((2, 6, 3, 6)) * 4).astype(np.float32)
    x[1, 2, 1] = -np.inf  # a row of -inf
    w = rng.standard_normal(x.shape)
    lays = layouts(mesh, ["b", "q", "k"], limit=6)

    def run():
        out = []
        for lay in lays:
            with mm.layout_scope(mesh, lay), mm.trace():
                xt = mm.cast(mesh.from_numpy(x, spec), dtype)
                y = getattr(mm, op)(xt, "k", causal="q" if causal else None)
                (g,) = mm.gradients([mm.reduce_sum(y * mm.cast(mesh.from_numpy(w, spec), dtype))], [xt])
                out.append([y.to_numpy().astype(np.float64), g.to_numpy().astype(np.float64)])
        return out
    got, want = _before_and_after(nn, ("softmax_rows", "softmax_grad_rows"), run,
                                  sum("k" not in lay for lay in lays), monkeypatch)
    eps = 8 * (2.0 ** -8 if dtype == "bfloat16" else np.finfo(dtype).eps)
    scale = {"y": 1.0, "dx": np.abs(w).max() * x.shape[-1]}  # (dx: g - sum(g * y) cancels: the sum's error)
    for lay, g_arrays, w_arrays in zip(lays, got, want):
        for what, a, b in zip(("y", "dx"), g_arrays, w_arrays):
            assert (np.isnan(a) == np.isnan(b)).all(), (lay, what)
            finite = np.isfinite(b)
            np.testing.assert_allclose(a[finite], b[finite], rtol=eps, atol=eps * scale[what] * np.abs(b[finite]).max(),
                                       err_msg=f"{lay} {what}")


def test_the_row_kernels_bfloat16_words_are_ml_dtypes_roundings():
    """The one-kernel rows' bfloat16 load and store (`rowwise.PRELUDE_TYPES`): every float32 read
    back exactly, and rounded to the nearest bfloat16, ties to even, as ml_dtypes rounds (NaN stays
    NaN, infinities and subnormals kept)."""
    rowwise = importlib.import_module("mpimesh.ops.rowwise")
    spec = {"round_trip": "const float* x, T* y, A* back, long long n"}
    source = ('extern "C" __global__ void round_trip(%s) {\n  long long i = (long long)blockIdx.x * blockDim.x + '
              'threadIdx.x;\n  if (i < n) { y[i] = store(x[i]); back[i] = load(y[i]); }\n}\n' % spec["round_trip"])
    kernel = cuda_source.raw_module(rowwise.PRELUDE_TYPES["bfloat16"] + source, spec)["round_trip"]
    bf16 = np.dtype("bfloat16")
    rng = np.random.default_rng(8)
    words = rng.integers(0, 2 ** 32, 4000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2 ** 16, 200, dtype=np.uint32) << 16) | 0x8000  # exactly half-way
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-45, 3.4e38, 1.0, 1 + 2 ** -8], np.float32)
    x = np.concatenate([words.view(np.float32), ties.view(np.float32), special])
    y, back = np.empty(x.size, np.uint16), np.empty(x.size, np.float32)
    kernel((x.size // 64 + 1,), (64,), (x, y, back, np.int64(x.size)))
    with np.errstate(invalid="ignore"):  # (numpy warns casting NaN)
        want = x.astype(bf16)
    nan = np.isnan(x)
    assert np.isnan(y.view(bf16)[nan].astype(np.float32)).all()
    assert (y[~nan] == want[~nan].view(np.uint16)).all()
    np.testing.assert_array_equal(back[~nan], want[~nan].astype(np.float32))


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("params", ["", "scale", "scale,bias"])
def test_one_kernel_layer_norm_rows_equal_the_numpy_lowering(shape, dtype, params, monkeypatch):
    """layer_norm on CuPy by one kernel each way where the normalised dim is the last, whole on a
    rank (the parameters float32 beside bfloat16 x, as mixed precision keeps them): values and
    gradients (x's, the scale's, the bias's) equal numpy's lowering to a few units in the last
    place on split and uneven layouts; where the normalised dim is split, the kernels per step."""
    norm = importlib.import_module("mpimesh.ops.norm")
    mesh = get_mesh(shape)
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((4, 3, 37)) * 3 + 1).astype(np.float32)
    w = rng.standard_normal(x.shape)
    lays = layouts(mesh, ["b", "l", "d"], limit=5)
    pdt = "float32" if dtype == "bfloat16" else dtype

    def run():
        out = []
        for lay in lays:
            with mm.layout_scope(mesh, lay), mm.trace():
                xt = mm.cast(mesh.from_numpy(x, "b:4;l:3;d:37"), dtype)
                ps = {n: mesh.from_numpy(np.linspace(0.5, 1.5, 37).astype(pdt) + (n == "bias"), "d:37")
                      for n in params.split(",") if n}
                y = norm.layer_norm(xt, ("d",), ps.get("scale"), ps.get("bias"))
                grads = mm.gradients([mm.reduce_sum(y * mm.cast(mesh.from_numpy(w, "b:4;l:3;d:37"), dtype))],
                                     [xt, *ps.values()])
                out.append([y.to_numpy().astype(np.float64), *(g.to_numpy().astype(np.float64) for g in grads)])
        return out
    got, want = _before_and_after(norm, ("layer_norm_rows", "layer_norm_grad_rows"), run,
                                  sum("d" not in lay for lay in lays), monkeypatch)
    eps = 16 * (2.0 ** -8 if dtype == "bfloat16" else np.finfo(dtype).eps)
    for lay, g_arrays, w_arrays in zip(lays, got, want):
        for what, a, b in zip(("y", "dx", "d" + params.split(",")[0], "dbias"), g_arrays, w_arrays):
            np.testing.assert_allclose(a, b, rtol=eps, atol=eps * np.abs(b).max(), err_msg=f"{lay} {what}")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("operands", [1, 2])
@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 7), (128, 3), (300, 8), (1000, 1), (0, 7)])
def test_column_sum_kernel_equals_numpys_sums(dtype, operands, rows, cols, monkeypatch):
    """A bias's or a gain's gradient on CuPy: the column sums of x (or of x * w) over [rows, cols],
    by chunks of rows then their partials (more than one chunk from 129 rows on); no rows (a rank's
    empty block): zeros, `[cols]` like the others (issue 44: an empty `[0]` partial)."""
    from types import SimpleNamespace
    rowwise = importlib.import_module("mpimesh.ops.rowwise")
    monkeypatch.delitem(backend._kernels, ("rowwise", "columns", operands), raising=False)
    fake = SimpleNamespace(ElementwiseKernel=lambda ins, outs, body, name: cuda_source.elementwise(ins, outs, body),
                           zeros=np.zeros)
    rng = np.random.default_rng(rows * cols)
    arrays = [rng.standard_normal((rows, cols)).astype(dtype) for _ in range(operands)]
    got = rowwise.column_sums(fake, arrays, rows, cols)
    assert got.shape == (cols,) and got.dtype == dtype
    want = np.prod(np.array(arrays, np.float64), axis=0).sum(axis=0)
    np.testing.assert_allclose(got, want, rtol=32 * np.finfo(dtype).eps, atol=32 * np.finfo(dtype).eps * rows)


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("params", ["", "scale", "bias", "scale,bias"])
def test_layer_norm_kernels_equal_the_numpy_lowering(shape, dtype, params, monkeypatch):
    """layer_norm on CuPy's kernels (the mean, the centred squares' sum, the output; the normalised x,
    the two sums and dx backwards): values and gradients (x's, the scale's and the bias's) equal
    numpy's lowering to a few units in the last place, the normalised dim split on some layouts."""
    norm = importlib.import_module("mpimesh.ops.norm")
    mesh = get_mesh(shape)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((4, 3, 6)) * 3 + 1).astype(dtype)
    w = rng.standard_normal((4, 3, 6))
    lays = layouts(mesh, ["b", "l", "d"], limit=5)

    def run():
        out = []
        for lay in lays:
            with mm.layout_scope(mesh, lay), mm.trace():
                xt = mesh.from_numpy(x, "b:4;l:3;d:6")
                ps = {n: mesh.from_numpy(np.linspace(0.5, 1.5, 6).astype(dtype) + (n == "bias"), "d:6")
                      for n in params.split(",") if n}
                y = norm.layer_norm(xt, ("d",), ps.get("scale"), ps.get("bias"))
                grads = mm.gradients([mm.reduce_sum(y * mesh.from_numpy(w.astype(dtype), "b:4;l:3;d:6"))],
                                     [xt, *ps.values()])
                out.append([y.to_numpy(), *(g.to_numpy() for g in grads)])
        return out
    want = run()
    got, used = _on_row_kernels(norm, run, monkeypatch)
    which = "layer_norm" + ("_" + "s" * ("scale" in params) + "b" * ("bias" in params) if params else "")
    assert set(used) == {"centred_squares", which, "normalised", "scaled_sum", "scaled_dot", "layer_norm_grad"}, used
    eps = 16 * np.finfo(dtype).eps
    for lay, g_arrays, w_arrays in zip(lays, got, want):
        for what, a, b in zip(("y", "dx", "d" + params.split(",")[0], "dbias"), g_arrays, w_arrays):
            np.testing.assert_allclose(a, b, rtol=eps, atol=eps * np.abs(b).max(), err_msg=f"{lay} {what}")
