"""`mm.remat`: the backward pass runs a block again instead of keeping its activations, with the
same values (float64, bitwise), the same random draws, its collectives run and counted again,
fewer arrays alive at the peak, and a clear error for a block that computes something else the
second time."""
from __future__ import annotations

import os
import re
import sys
from dataclasses import replace

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import jaxenv  # noqa: E402,F401 (before jax)
from meshes import get_mesh, global_array, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import layers  # noqa: E402
from mpimesh.errors import MpimeshError  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as T  # noqa: E402

pytestmark = pytest.mark.mpi

# Uneven blocks on every mesh of 2-4 ranks: batch 5, heads 3, d_ff 10, experts 3.
CFG = T.Config(d_model=12, heads=3, d_kv=4, d_ff=10, layers=2, length=6, batch=5, dtype="float64")
RULES = {1: "batch:all;experts:all", 2: "batch:rows;heads:cols;d_ff:cols;experts:rows",
         3: "batch:rows;heads:cols;d_ff:planes;experts:rows"}


def _batch(mesh, cfg):
    ids = np.random.default_rng(5).integers(0, cfg.vocab, (cfg.batch, cfg.length + 1))
    shape = f"batch:{cfg.batch};length:{cfg.length}"
    return {"inputs": mesh.from_numpy(ids[:, :-1], shape), "targets": mesh.from_numpy(ids[:, 1:], shape)}


_FEED_FORWARD = T.feed_forward_sublayer


def _feed_forward_with_dropout(b, x, cfg, i, train, seed, capacity):
    """The app's feed-forward sublayer followed by dropout (rate 0.3) drawn from the step's seed tensor."""
    y, aux = _FEED_FORWARD(b, x, cfg, i, train, seed, capacity)
    return mm.dropout(y, 0.3, layers.subseed(seed, f"dropout{i}")), aux


def _grads(mesh, cfg, seed):
    """Loss, every parameter's gradient (numpy), and the number of ops the trace ran."""
    params = {k: mm.cast(v, "float64") for k, v in T.init_params(mesh, cfg).items()}
    names = list(params)
    with mm.trace() as tr:
        loss = T.loss_fn(params, _batch(mesh, cfg), cfg, True, seed)
        grads = mm.gradients([loss], [params[n] for n in names])
    return loss.to_numpy(), {n: g.to_numpy() for n, g in zip(names, grads)}, len(tr.ops)


@pytest.mark.parametrize("kind", ["dense", "moe", "dropout"])
@pytest.mark.parametrize("shape", mesh_shapes())
def test_transformer_gradients_equal_without_remat_bitwise(shape, kind, monkeypatch):
    mesh = get_mesh(shape)
    cfg = replace(CFG, moe_every=2, experts=3) if kind == "moe" else CFG
    if kind == "dropout":
        monkeypatch.setattr(T, "feed_forward_sublayer", _feed_forward_with_dropout)
    seed = T.step_seed(mesh, 0, 7)
    with mm.layout_scope(mesh, RULES[mesh.shape.rank]):
        loss, grads, n = _grads(mesh, cfg, seed)
        loss_r, grads_r, n_r = _grads(mesh, replace(cfg, remat=CFG.layers), seed)
    assert n_r > n  # the blocks ran twice
    assert loss.tobytes() == loss_r.tobytes()
    for name in grads:
        assert grads[name].tobytes() == grads_r[name].tobytes(), name


def test_gradient_against_finite_differences():
    """A remat'd block with dropout and a collective-free tanh chain: the gradient of x against
    central differences of the loss computed in numpy from the dropout mask the block drew."""
    mesh = get_mesh(mesh_shapes()[0])
    x_np = global_array("batch:6;d:4", 1, np.float64)
    w_np = global_array("d:4;h:5", 2, np.float64)
    x = mesh.from_numpy(x_np, "batch:6;d:4")
    w = mesh.from_numpy(w_np, "d:4;h:5")
    block = mm.remat(lambda x, w: mm.dropout(mm.tanh(mm.einsum([x, w], output_shape="batch:6;h:5")), 0.5, 11))
    with mm.trace():
        y = mm.reduce_sum(mm.square(block(x, w)))
        gx, gw = mm.gradients([y], [x, w])
    keep = mm.dropout(mesh.ones("batch:6;h:5", "float64"), 0.5, 11).to_numpy()  # the mask, scaled

    def loss(xv, wv):
        return float(np.sum((np.tanh(xv @ wv) * keep) ** 2))
    eps = 1e-6
    for arr, g, other in ((x_np, gx, w_np), (w_np, gw, x_np)):
        num = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            hi, lo = arr.copy(), arr.copy()
            hi[idx] += eps
            lo[idx] -= eps
            args = ((hi, other), (lo, other)) if arr is x_np else ((other, hi), (other, lo))
            num[idx] = (loss(*args[0]) - loss(*args[1])) / (2 * eps)
        np.testing.assert_allclose(g.to_numpy(), num, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("shape", mesh_shapes())
def test_collectives_inside_run_again_and_are_counted(shape):
    """With d_ff and heads split, each block's forward runs allreduces: with remat the step runs
    exactly those of the blocks' forward pass once more (none where the mesh splits only batch)."""
    mesh = get_mesh(shape)
    if mesh.size == 1:
        pytest.skip("no collectives on one rank")
    rules = {1: "heads:all;d_ff:all", 2: RULES[2], 3: RULES[3]}[mesh.shape.rank]
    params = {k: mm.cast(v, "float64") for k, v in T.init_params(mesh, CFG).items()}
    batch = _batch(mesh, CFG)
    calls = {}
    with mm.layout_scope(mesh, rules):
        for remat in (0, CFG.layers):
            cfg = replace(CFG, remat=remat)
            with mm.profile() as prof, mm.trace():
                loss = T.loss_fn(params, batch, cfg, True, 0)
                mm.gradients([loss], list(params.values()), bucket_bytes=0)
            calls[remat] = sum(c["calls"] for c in prof.transfers.values())
        p = layers.unflatten(params)
        x = layers.embedding(p["embed"], batch["inputs"], CFG.dtype) + mm.cast(p["pos"]["weights"], CFG.dtype)
        with mm.profile() as prof:
            for i in range(CFG.layers):
                x, _ = T.block(p[f"layer{i}"], x, CFG, i, True, 0, {})
        forward = sum(c["calls"] for c in prof.transfers.values())
    model_parallel = any(mesh.shape[m].size > 1 for m in ("all", "cols", "planes") if m in mesh.shape.names)
    assert forward > 0 or not model_parallel
    assert calls[CFG.layers] - calls[0] == forward, (calls, forward)


def test_compiled_remat_step_equals_eager():
    """`mm.compile` replays the second runs too: 3 Adam steps, compiled and eager, bitwise."""
    mesh = get_mesh(mesh_shapes()[0])
    cfg = replace(CFG, remat=CFG.layers, optimizer="adam")  # float64 activations of float32 parameters
    out = {}
    with mm.layout_scope(mesh, RULES[1]):
        for compiled in (False, True):
            opt = T.make_optimizer(cfg)
            step = T.make_train_step(cfg, opt)
            step = mm.compile(step) if compiled else step
            params = T.init_params(mesh, cfg)
            state = opt.init(params)
            losses = []
            for k in range(3):
                params, state, loss = step(params, state, _batch(mesh, cfg), T.step_seed(mesh, 0, k))
                losses.append(loss.to_numpy())
            out[compiled] = [np.asarray(losses)] + [params[n].to_numpy() for n in sorted(params)]
    for a, b in zip(out[False], out[True]):
        assert a.tobytes() == b.tobytes()


def _late_bound_cause() -> str:
    return (r"Likely cause: a variable the function reads changed between the forward and the backward \(Python "
            r"closures bind late: bind it as a default argument, `lambda t, i=i: \.\.\.`")


@pytest.mark.parametrize("shape", mesh_shapes())
def test_a_late_bound_block_that_raises_when_run_again_names_remat_and_the_op(shape):
    """The user's loop `h = mm.remat(lambda t: dense(p[f"l{i}"], t))(h)` over layers of other shapes: the
    backward re-runs each block with the last `i`, whose weight has its dims the other way round, and
    bias_activation raised a ShapeError naming neither remat nor the closure. Now the error names
    remat, the function and its line, the first op that differs and the likely cause; the ShapeError
    is chained to it. Bound as a default argument, the gradients equal those without remat."""
    mesh = get_mesh(shape)
    d = mesh.shape.names[0]
    rng = np.random.default_rng(3)
    dims = ["h:6;h2:6", "h2:6;h:6", "h:6;h2:6"]
    p = {f"l{i}": {"kernel": mesh.from_numpy(rng.normal(size=(6, 6)), dims[i], layout={dims[i].split(":")[0]: d}),
                   "bias": mesh.from_numpy(rng.normal(size=6), dims[i].split(";")[1])} for i in range(3)}
    x = mesh.from_numpy(rng.normal(size=(5, 6)), "batch:5;h:6", layout={"batch": d})
    kernels = [p[f"l{i}"]["kernel"] for i in range(3)]
    with mm.trace():
        h = x
        for i in range(3):
            line = sys._getframe().f_lineno + 1
            h = mm.remat(lambda t: layers.dense(p[f"l{i}"], t, activation="tanh"))(h)  # noqa: B023 (the bug under test)
        with pytest.raises(MpimeshError) as e:
            mm.gradients([mm.reduce_sum(h)], kernels)
    said = str(e.value)
    assert re.match(rf"mm\.remat\(.*<lambda>, defined at .*test_remat\.py:{line}\): its re-run in the backward pass "
                    r"raised ShapeError: bias_activation: bias dim h2:6 is not in the input shape \[batch:5, h:6\]; "
                    r"at op \d+ it differs from the forward: the forward ran \w+ of [^;]*, the re-run \w+ of [^;]*"
                    r"\[h:6, h2:6\]\. " + _late_bound_cause(), said), said  # (the last kernel's einsum or relayout)
    assert isinstance(e.value.__cause__, mm.ShapeError)
    got = []
    for wrap in (lambda f: f, mm.remat):
        with mm.trace():
            h = x
            for i in range(3):
                h = wrap(lambda t, i=i: layers.dense(p[f"l{i}"], t, activation="tanh"))(h)
            got.append([g.to_numpy() for g in mm.gradients([mm.reduce_sum(h)], kernels)])
    for a, b in zip(*got):
        assert a.tobytes() == b.tobytes()


def test_a_late_bound_block_that_silently_reads_another_weight_is_an_error():
    """The same shapes both times: the re-run of the first block reads the second weight and would give
    the second weight's gradient to the first (wrong gradients, no exception). The re-run's ops read
    other tensors than the forward's: every rank raises, naming the op and input."""
    mesh = get_mesh(mesh_shapes()[0])
    x = mesh.ones("b:4;d:3", "float64")
    ws = [mesh.from_numpy(global_array("d:3", k, np.float64), "d:3") for k in range(2)]
    with mm.trace():
        h = x
        for i in range(2):
            h = mm.remat(lambda h: mm.tanh(h * ws[i]))(h)  # noqa: B023 (the bug under test)
        with pytest.raises(MpimeshError, match=r"mm\.remat\(.*<lambda>, defined at .*test_remat\.py:\d+\): its re-run "
                                               r"in the backward pass computed something else: at op 0 it differs "
                                               r"from the forward: multiply of \[b:4, d:3\], \[d:3\], whose input 1 in "
                                               r"the forward was a \[d:3\] float64 tensor from outside the block \(not "
                                               r"an argument\), in the re-run another: a \[d:3\] float64 tensor from "
                                               r"outside the block \(not an argument\)\. " + _late_bound_cause()):
            mm.gradients([mm.reduce_sum(h)], ws)
    got = []
    for wrap in (lambda f: f, mm.remat):
        with mm.trace():
            h = x
            for i in range(2):
                h = wrap(lambda h, w=ws[i]: mm.tanh(h * w))(h)
            got.append([g.to_numpy() for g in mm.gradients([mm.reduce_sum(h)], ws)])
    for a, b in zip(*got):
        assert a.tobytes() == b.tobytes()


def test_a_block_with_a_number_drawn_on_the_host_is_an_error():
    """A scale drawn by numpy in the block differs in its second run: the gradient would be the
    second draw's, so every rank raises, naming the numbers. Not a function: a TypeError."""
    mesh = get_mesh(mesh_shapes()[0])
    x = mesh.ones("b:4;d:3", "float64")
    rng = np.random.default_rng(0)  # the same draws on every rank
    with mm.trace():
        y = mm.remat(lambda t: t * float(rng.normal()))(x)
        with pytest.raises(MpimeshError, match=r"multiply of \[b:4, d:3\] with scalar=0\.12.* in the forward and "
                                               r"scalar=-0\.13.* in the re-run \(a number drawn on the host"):
            mm.gradients([mm.reduce_sum(y)], [x])
    with pytest.raises(TypeError, match="mm.remat needs a function, got int"):
        mm.remat(3)


@pytest.mark.parametrize("shape", mesh_shapes())
def test_gradients_with_respect_to_a_blocks_outputs(shape):
    """A block's output among the xs (the hidden state between two remat blocks) gets its gradient,
    bitwise the one without remat (it was zeros: the second run took it over)."""
    mesh = get_mesh(shape)
    d = mesh.shape.names[-1]
    x = mesh.from_numpy(global_array("a:5;b:3", 1, np.float64), "a:5;b:3", layout={"a": d})
    got = []
    for wrap in (lambda f: f, mm.remat):
        with mm.trace():
            h = wrap(lambda t: mm.exp(t) * 0.5)(x)
            y = wrap(lambda t: mm.sin(t) * t)(h)
            loss = mm.reduce_sum(y * y)
            got.append([g.to_numpy() for g in mm.gradients([loss], [y, h, x])])
    hv = np.exp(x.to_numpy()) * 0.5
    yv = np.sin(hv) * hv
    np.testing.assert_allclose(got[0][1], 2 * yv * (np.cos(hv) * hv + np.sin(hv)), rtol=1e-12)
    for a, b, what in zip(got[0], got[1], ("y", "h", "x")):
        assert a.tobytes() == b.tobytes(), what


def test_a_second_backward_after_release_is_a_clear_error():
    mesh = get_mesh(mesh_shapes()[0])
    x = mesh.ones("a:3", "float64")
    with mm.trace():
        loss = mm.reduce_sum(mm.remat(lambda t: mm.sin(mm.exp(t)))(x))
        mm.gradients([loss], [x])
        with pytest.raises(MpimeshError, match=r"mm.remat\(.*<lambda>, defined at .*\): its inputs were let go by an "
                                               r"earlier mm.gradients, so it cannot run again.*retain=True"):
            mm.gradients([loss], [x])


def test_outside_a_trace_a_plain_call():
    mesh = get_mesh(mesh_shapes()[0])
    x = mesh.from_numpy(np.array([0.0, 1.0]), "a:2")
    y = mm.remat(mm.exp)(x)
    np.testing.assert_array_equal(y.to_numpy(), np.exp([0.0, 1.0]))


def test_auto_layout_remats_the_fewest_blocks_when_memory_is_short():
    """4 remat-wrapped blocks, priced dry: with room, no remat; with less memory than every plan
    needs without remat, the fewest blocks that let one fit, priced slower and smaller; with too
    little for any, a clear error."""
    from mpimesh.cost import ArgSpec
    from mpimesh.dryrun import DryMesh
    machine = mm.cost.Machine(flops=1e9, latency=1e-5, bandwidth=1e9, memory=2**40)
    block = mm.remat(lambda h, w: mm.tanh(mm.einsum([h, w], output_shape="batch:256;d:64")) * 2.0)

    def step(x, ws):
        with mm.trace():
            h = x
            for w in ws:
                h = block(h, w)
            return mm.gradients([mm.reduce_sum(h * h)], ws)
    args = (ArgSpec("batch:256;d:64", "float32"), [ArgSpec("d:64;d_out:64", "float32") for _ in range(4)])
    step_args = (args[0], [a for a in args[1]])
    mesh = DryMesh("x:2")
    roomy = mm.auto_layout(step, step_args, mesh, machine=machine)
    assert roomy.remat == 0
    short = mm.auto_layout(step, step_args, mesh, memory_per_rank=min(b for _, _, b in roomy.candidates + roomy.too_big) - 1,
                           machine=machine)
    assert 1 <= short.remat <= 4
    assert short.bytes_per_rank < roomy.bytes_per_rank and short.seconds > roomy.seconds
    assert "rematerialised" in short.report()
    with pytest.raises(MpimeshError, match="no layout priced fits .* with 4 mm.remat block"):
        mm.auto_layout(step, step_args, mesh, memory_per_rank=1000, machine=machine)
