"""The fusion pass (`mpimesh.fusion`): which elementwise ops it groups, the kernels it generates (their
CUDA source compiled for the CPU as tests/cuda_source.py does, standing in for CuPy's
`ElementwiseKernel` on a numpy mesh) against the unfused eager run, bitwise, in float32, bfloat16 and
float64 with edge values (signed zeros, NaN, infinities, subnormals), forward and backward, on 1-D to
3-D meshes with uneven blocks; and the elementwise passes and bytes of the Transformer step before
and after fusion (`benchmarks/fusion.py` prints them)."""
from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
import cuda_source  # noqa: E402
from meshes import Errors, get_mesh, layouts, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import backend, fusion, rowfusion  # noqa: E402
from mpimesh.backend import resolve_backend  # noqa: E402
from mpimesh.ops import norm, rowwise, updates  # noqa: E402
from mpimesh.ops.activation import bias_activation  # noqa: E402
from mpimesh.program import OpStep, Program  # noqa: E402
from mpimesh.tree import flatten  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "apps"))
import transformer as T  # noqa: E402

_spec = importlib.util.spec_from_file_location("benchmarks_fusion", os.path.join(ROOT, "benchmarks", "fusion.py"))
fusion_counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fusion_counts)

pytestmark = pytest.mark.mpi
on_cpu = [pytest.mark.skipif(cuda_source.compiler() is None, reason="no C++ compiler to run the generated sources"),
          pytest.mark.skipif(resolve_backend(None) != "numpy", reason="the sources on the CPU; a GPU runs the kernels")]


@pytest.fixture
def cpu_kernels(monkeypatch):
    """A numpy mesh's compiled steps fuse, their generated sources compiled for the CPU."""
    monkeypatch.setitem(fusion.BUILDERS, "numpy",
                        lambda xp, ins, outs, body, preamble, name: cuda_source.elementwise(ins, outs, body, preamble))


@pytest.fixture
def cpu_rows(monkeypatch):
    """Layer and RMS norm (forwards, backwards) and the optimizer updates take their CuPy path on a numpy mesh,
    eager and compiled: the one-kernel rows (`rowwise.ROWS_SOURCE`), the update kernels and the kernels
    `rowfusion` generates, compiled for the CPU (elsewhere, CuPy's steps without the kernels of
    `rowwise.ROW_SOURCES`). Gives the list of the generated and the narrow update kernels' launches."""
    for op in (norm.LAYER_NORM, norm.LAYER_NORM_GRAD, norm.RMS_NORM, norm.RMS_NORM_GRAD):
        monkeypatch.setitem(op.kernels, "numpy", op.kernels["cupy"])
    monkeypatch.setattr(norm, "fusable", lambda *arrays: False)
    monkeypatch.setattr(backend, "_kernels", dict(backend._kernels))  # (this test's builds: its launches counted)
    for dt in rowwise.PRELUDE_TYPES:
        monkeypatch.setitem(backend._kernels, ("rowwise", "rows", dt),
                            cuda_source.raw_module(rowwise.PRELUDE_TYPES[dt] + rowwise.ROWS_SOURCE,
                                                   rowwise.ROWS_PARAMS))
        monkeypatch.setitem(backend._kernels, ("norm", "rms_rows", dt),
                            cuda_source.raw_module(rowwise.PRELUDE_TYPES[dt] + norm.RMS_ROWS_SOURCE,
                                                   norm.RMS_ROWS_PARAMS))
    launched = []
    for kernels in (updates.SGD_KERNELS, updates.ADAM_KERNELS):  # (and the updates' CuPy kernels)
        monkeypatch.setitem(kernels, "numpy", kernels["cupy"])
    built = {(k, n): cuda_source.elementwise(*updates.kernel_source(k, n)) for k in ("adam", "sgd") for n in (0, 1)}
    monkeypatch.setattr(updates, "_kernel", lambda xp, which, narrow=False: (
        lambda *a: launched.append(f"{which} narrow" * narrow) or built[which, narrow](*a)))

    def build(xp, source, params, dtype):
        kernels = cuda_source.raw_module(rowwise.PRELUDE_TYPES[dtype] + source, params)
        return {k: (lambda *a, _f=f, _k=k: launched.append(_k) or _f(*a)) for k, f in kernels.items()}
    monkeypatch.setitem(rowfusion.BUILDERS, "numpy", build)
    return launched


def _program(fn, *inputs):
    with mm.trace() as tr:
        out = fn(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    return Program(tr, list(inputs), outs)


def _named(p) -> list:
    return [[p.ops[k].name for k in g] for _, g in fusion.plan(p.ops, p.output_ids)]


def test_plan_fuses_a_chain_and_writes_out_what_others_read():
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    x, y, b = mesh.ones("a:3;b:4"), mesh.ones("a:3;b:4"), mesh.ones("b:4")
    p = _program(lambda x, y, b: mm.relu(x * y + b) * 2.0, x, y, b)
    assert _named(p) == [["multiply", "add", "relu", "multiply"]]
    (fused,) = fusion.fuse(p.ops, p.output_ids, "cupy")
    assert [t.shape.names for t in fused.inputs] == [("a", "b"), ("a", "b"), ("b",)] and len(fused.outputs) == 1
    # t, read by a sum between its producer and the last multiply, is written out: the group runs before the sum
    p = _program(lambda x, y: (lambda t: (mm.reduce_sum(t), -(t * 3.0)))(x * y + 1.0), x, y)
    assert _named(p) == [["multiply", "add", "multiply", "negative"]]
    fused = fusion.fuse(p.ops, p.output_ids, "cupy")
    assert [r.name for r in fused] == ["fused(multiply+add+multiply+negative)", "einsum"] and len(fused[0].outputs) == 2
    # the last multiply reads the sum of t: no place runs all three, the sum between them
    p = _program(lambda x, y: (lambda t: t * mm.reduce_sum(t))(x * y + 1.0), x, y)
    assert _named(p) == [["multiply", "add"]]
    # an intermediate the program returns is written out as well
    p = _program(lambda x, y: (lambda t: (t, t - y))(x + y), x, y)
    (fused,) = fusion.fuse(p.ops, p.output_ids, "cupy")
    assert [id(t) for t in fused.outputs] == [id(p.ops[0].outputs[0]), id(p.ops[1].outputs[0])]
    # other dims, an op without an exact C form (exp: the libraries differ) and mixed dtypes stay apart
    p = _program(lambda x, b: mm.exp(mm.reduce_sum(x * 2.0, output_shape="b:4") + b) * 3.0, x, b)
    assert _named(p) == []
    p = _program(lambda x: mm.cast(x, "bfloat16") * 2.0 + mm.cast(x, "float64") * 3.0, x)
    assert _named(p) == [["cast", "multiply"], ["cast", "multiply"]]


def test_generated_source_rounds_bfloat16_after_each_op():
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    x = mm.cast(mesh.ones("a:2"), "bfloat16")
    p = _program(lambda x: mm.cast((x + x) * 0.05, "float32"), x)
    (fused,) = fusion.fuse(p.ops, p.output_ids, "cupy")
    ins, outs, body, preamble = fusion.source(fused.members, fused.inputs, fused.outputs)
    assert (ins, outs) == ("uint16 in0", "float32 out0") and "store(float f)" in preamble
    assert body.count("bf16::load(bf16::store(") == 2 and "((float)0.050048828125)" in body  # 0.05 as bfloat16


def _edges(n: int, dtype, seed: int) -> np.ndarray:
    """n values of `dtype`: normal ones, then signed zeros, NaN, infinities, a subnormal, large ones."""
    a = np.random.default_rng(seed).standard_normal(n) * 3
    special = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40, -3e38, 2.5, -1.0, 1e-30]
    a[:len(special)] = special[:n]
    with np.errstate(over="ignore"):
        return a.astype(dtype)


def _chain(x, y, b):
    """Elementwise ops of every fused kind, broadcasts and numbers, an intermediate read by a sum."""
    t = mm.relu(x * y + b) - 0.75 * x
    u = mm.maximum(t, y) / (mm.square(y) + 1.0)
    v = mm.minimum(-u, 0.05) - b
    wide = "float64" if x.dtype == np.float32 else "float32"
    w = mm.cast(mm.cast(v, wide) * 3.0, x.dtype) + mm.cast(mm.greater(x, 0.5), x.dtype)
    return w, mm.reduce_sum(t, output_shape="b:7"), bias_activation(w, b, "relu") * 0.5


def _fused_steps(step, kind: str = "fused(") -> list:
    (entry,) = step.cache.values()
    engine = getattr(entry.engine, "engine", entry.engine)  # (CUDA graphs wrap the flat engine)
    return [s.op.name for s in engine.steps if isinstance(s, OpStep) and kind in s.op.name]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal, a NaN equal to any NaN: IEEE 754 leaves open which operand's NaN an operation of two
    returns (a compiler may swap an addition's operands; a GPU returns one canonical NaN)."""
    nan_a, nan_b = np.isnan(a.astype(np.float64)), np.isnan(b.astype(np.float64))
    return a.shape == b.shape and (nan_a == nan_b).all() and a[~nan_a].tobytes() == b[~nan_b].tobytes()


def _compare(fn, args, errs, what: str, replays: int = 1, kind: str = "fused(") -> int:
    """`fn` compiled (recorded, then replayed fused `replays` times: on CuPy the second captures a CUDA
    graph, the third launches it) against eager, bitwise: the number of fused steps."""
    step = mm.compile(fn)
    step(*args)  # (the recording runs eagerly)
    want = fn(*args)
    for r in range(replays):
        for k, (g, w) in enumerate(zip(step(*args), want)):
            errs.expect(g.dtype == w.dtype and g.tensor_layout == w.tensor_layout, f"{what}: output {k} dtype/layout")
            errs.expect(same_bits(g.local, w.local), f"{what}: output {k} differs from eager (replay {r})")
    return len(_fused_steps(step, kind))


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.skipif(*on_cpu[0].args, **on_cpu[0].kwargs)
@pytest.mark.skipif(*on_cpu[1].args, **on_cpu[1].kwargs)
def test_fused_kernels_equal_the_unfused_ops(shape, dtype):
    _chains_against_eager(get_mesh(shape), dtype, 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_fused_kernels_on_a_gpu(dtype):
    """The generated `ElementwiseKernel`s (NVRTC, `--fmad=false`) against CuPy's unfused ops, through
    CUDA graphs too (three replays: run, captured, launched)."""
    mesh = get_mesh(mesh_shapes()[0])
    if mesh.backend != "cupy":
        pytest.skip("CuPy's kernels (their sources run on the CPU in test_fused_kernels_equal_the_unfused_ops)")
    _chains_against_eager(mesh, dtype, 3)
    assert any(key[:2] == ("fusion", "cupy") for key in mm.backend._kernels)


def _chains_against_eager(mesh, dtype: str, replays: int) -> None:
    errs = Errors()  # asserted after the last collective
    xs, ys, bs = (_edges(n, dtype, s) for n, s in ((35, 1), (35, 2), (7, 3)))
    for lay in layouts(mesh, ["a", "b"], limit=4):  # split, uneven (5 and 7 over 2 to 4 ranks) and empty blocks
        with mm.layout_scope(mesh, lay):
            x, y = mesh.from_numpy(xs.reshape(5, 7), "a:5;b:7"), mesh.from_numpy(ys.reshape(5, 7), "a:5;b:7")
            b = mesh.from_numpy(bs, "b:7")
            with np.errstate(all="ignore"):
                fused = _compare(_chain, (x, y, b), errs, f"{lay} forward", replays)
                errs.expect(fused >= 1, f"{lay}: no fused step")

                def train(x, b):
                    with mm.trace():
                        loss = mm.reduce_sum(_chain(x, y, b)[2] * y)
                        return tuple(mm.gradients([loss], [x, b]))
                fused = _compare(train, (x, b), errs, f"{lay} gradients", replays)
                errs.expect(fused >= 2, f"{lay}: {fused} fused steps with the gradients, expected at least 2")
    errs.check()


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.skipif(*on_cpu[0].args, **on_cpu[0].kwargs)
@pytest.mark.skipif(*on_cpu[1].args, **on_cpu[1].kwargs)
def test_chains_folded_into_norm_rows_equal_the_unfused_ops(shape, dtype, kind, cpu_rows):
    """A residual add and its layer (RMS) norm (prologue, an operand broadcast over the leading dim), a
    chain computing the norm gradient's g (prologue) and the residual gradient's add of its dx
    (epilogue) in one row kernel each, compiled for the CPU, against the unfused eager run (the same
    row kernels, the chains' own ops), bitwise: split, uneven and empty blocks; where the normalised
    dim is split, the members' own kernels."""
    mesh = get_mesh(shape)
    errs = Errors()
    rng = np.random.default_rng(4)
    spec, pdt = "b:5;l:3;d:37", "float32"
    xs, rs, ws, a_s = (rng.standard_normal((5, 3, 37)) * 2 + 0.5 for _ in range(4))
    ps = rng.standard_normal((3, 37))
    lays = layouts(mesh, ["b", "l", "d"], limit=5)
    for lay in lays:
        with mm.layout_scope(mesh, lay):
            x, r, w, a = (mm.cast(mesh.from_numpy(v, spec), dtype) for v in (xs, rs, ws, a_s))
            pos = mm.cast(mesh.from_numpy(ps, "l:3;d:37"), dtype)  # (broadcast over b: read at e % its size)
            sc, bias = (mesh.from_numpy(np.linspace(0.5, 1.5, 37).astype(pdt) + k, "d:37") for k in (0, 1))

            def normalised(s, *params):  # (layer norm with a scale and a bias, rms norm with a scale)
                return norm.layer_norm(s, ("d",), *params) if kind == "layer_norm" else \
                    norm.rms_norm(s, ("d",), *params[:1])

            def forward(x, r):
                s = x + r * 0.5 + pos
                return s, normalised(s, sc, bias)

            def train(x, r, sc, bias):
                with mm.trace():
                    s = x + r
                    y = normalised(s, sc, bias)
                    z = s + (y * a + y) * pos  # (dy: dz * pos * a + dz * pos, g; ds: dz + dx, dx's reader)
                    loss = mm.reduce_sum(normalised(z) * w)
                    return tuple(mm.gradients([loss], [x, r, sc] + [bias] * (kind == "layer_norm")))
            with np.errstate(all="ignore"):
                rows = _compare(forward, (x, r), errs, f"{lay} forward", kind="rows(")
                errs.expect(rows == 1, f"{lay} forward: {rows} row steps")
                rows = _compare(train, (x, r, sc, bias), errs, f"{lay} gradients", kind="rows(")
                errs.expect(rows >= 2, f"{lay} gradients: {rows} row steps, expected at least 2")
    errs.check()
    whole = sum("d" not in lay for lay in lays)  # (each: the forward's kernel, the two layer norms and gradients)
    assert MPI.COMM_WORLD.allreduce(sum(k.startswith("mpimesh_") for k in cpu_rows), op=MPI.MAX) == 5 * whole


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.skipif(*on_cpu[0].args, **on_cpu[0].kwargs)
@pytest.mark.skipif(*on_cpu[1].args, **on_cpu[1].kwargs)
def test_the_transformer_step_fused_equals_eager(dtype, cpu_rows):
    """apps/transformer.py's Adam step on the paper's layout (heads 6, d_ff 36, batch 12: uneven on 4
    ranks), compiled and fused (chains folded into the layer norm rows too), against eager (the same
    row kernels, unfused) over three steps: loss, parameters and state bitwise."""
    cfg = T.Config(d_model=16, heads=6, d_kv=4, d_ff=36, layers=2, length=8, batch=12, optimizer="adam", lr=3e-3,
                   warmup=4, dtype=dtype)
    mesh = get_mesh(T.default_mesh(MPI.COMM_WORLD.Get_size()), T.PAPER_LAYOUT)
    data = np.random.default_rng(1).integers(0, 256, size=4096).astype(np.uint8)
    opt = T.make_optimizer(cfg)
    params = T.init_params(mesh, cfg, seed=3)
    plain = T.make_train_step(cfg, opt)
    step = mm.compile(plain)
    eager = compiled = (params, T.init_state(cfg, opt, params))
    errs = Errors()
    for k in range(3):
        batch = T.make_batch(mesh, data, cfg, T.train_offsets(data, cfg, 5, k))
        eager, compiled = plain(*eager[:2], batch, 7), step(*compiled[:2], batch, 7)
        pairs = zip(flatten(eager)[0], flatten(compiled)[0])
        errs.expect(all(a.local.tobytes() == b.local.tobytes() for a, b in pairs), f"step {k}: compiled differs")
    errs.check()
    # the residual adds and their layer norms, the residual gradients' adds and the layer norm gradients
    assert len(_fused_steps(step, "rows(")) >= 6 and len(_fused_steps(step)) >= 1  # (and the learning rate's)
    assert MPI.COMM_WORLD.allreduce(len(cpu_rows), op=MPI.MAX) > 0
    if dtype == "bfloat16":  # the gradients' casts read by Adam's kernel as it loads them (the two replays)
        (update,) = _fused_steps(step, "adam_update(cast")
        assert MPI.COMM_WORLD.allreduce(cpu_rows.count("adam narrow"), op=MPI.MAX) == 2 * update.count("cast")


@pytest.mark.skipif(*on_cpu[0].args, **on_cpu[0].kwargs)
def test_a_kernel_the_compiler_refuses_leaves_the_members_own_kernels(monkeypatch):
    """CuPy's builder compiles the kernel at once (on one element per input) and gives None where the
    compiler refuses it; the fused step then runs its members' kernels, eager's values."""
    fake = SimpleNamespace(zeros=np.zeros, ElementwiseKernel=lambda ins, outs, body, name, preamble, options:
                           cuda_source.elementwise(ins, outs, body, preamble))
    ins, outs, preamble = "float32 in0, uint16 in1, bool in2", "float32 out0", fusion._BF16
    good = fusion.BUILDERS["cupy"](fake, ins, outs, "out0 = in0 + bf16::load(in1) + (float)in2;", preamble, "k")
    assert good(np.float32([1.5]), np.float32([2.0]).astype("bfloat16").view(np.uint16), np.array([True])).tolist() \
        == [4.5]
    assert fusion.BUILDERS["cupy"](fake, ins, outs, "out0 = in0 +;", preamble, "k") is None
    monkeypatch.setitem(fusion.BUILDERS, "numpy", lambda *args: None)
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    x = mesh.from_numpy(np.array([0.1, -2.0, 3.0], np.float32), "a:3")
    step = mm.compile(lambda x: x * 3.0 + 0.7)
    step(x)
    assert step(x).local.tobytes() == (x * 3.0 + 0.7).local.tobytes()
    assert _fused_steps(step) == ["fused(multiply+add)"]


@pytest.mark.usefixtures("cpu_kernels")
def test_fuse_false_keeps_every_step():
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    x = mesh.ones("a:3")
    assert fusion.applies("numpy")
    for fuse, expected in ((False, []), (True, ["fused(multiply+add)"])):
        step = mm.compile(lambda x: x * 2.0 + 1.0, fuse=fuse)
        step(x), step(x)
        assert _fused_steps(step) == expected
    with pytest.raises(mm.MpimeshError, match="fuse must be True or False"):
        mm.compile(lambda x: x, fuse="yes")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformer_step_counts(dtype):
    """The counts `benchmarks/fusion.py` prints, for the tiny Transformer step (the GPU benchmark's
    structure): fusion removes the passes of the fused chains' intermediates and never adds one; a
    chain folded into a layer norm row kernel removes all of its passes (its bytes stay counted)."""
    before, after, groups = fusion_counts.counts(dtype, "tiny")
    names = [tuple(n.split("+")) for n in groups]
    rows = ("layer_norm", "layer_norm_grad")
    members = sum(len([m for m in g if m not in rows]) for g in names)
    assert after[0] == before[0] - members + sum(not set(g) & set(rows) for g in names) and after[1] < before[1]
    assert ("add", "layer_norm") in names and ("layer_norm_grad", "add") in names  # residual adds, forwards and back
