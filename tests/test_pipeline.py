"""Pipelines (`mm.pipeline`, `mm.pipeline_value_and_grad`) against a sequential float64 numpy reference.

The stage is a residual feed-forward block, `relu(h W1) W2 + h`, its d_ff dim split over `cols` where
the mesh has it; x's batch split over `batch` where the mesh has it (data-parallel pipelines).
Gradients by the block's hand-written backward on the global arrays.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.pipeline_schedules import _table, application_order, most_in_flight, span, ticks

SHAPES = ["stages:1", "stages:2", "stages:3", "stages:4", "stages:2;cols:2", "stages:2;batch:2", "stages:4;cols:2",
          "stages:2;batch:2;cols:2"]
B, D, F = 12, 3, 4


def _mesh(shape: str) -> mm.Mesh:
    size = int(np.prod([int(d.split(":")[1]) for d in shape.split(";")]))
    if MPI.COMM_WORLD.Get_size() != size:
        pytest.skip(f"mesh {shape} needs {size} ranks")
    names = [d.split(":")[0] for d in shape.split(";")]
    rules = ["stage:stages"] + (["d_ff:cols"] if "cols" in names else []) + (["b:batch"] if "batch" in names else [])
    return mm.Mesh(shape, layout=";".join(rules))


def _stage(p, h):
    a = mm.einsum([h, p["w1"]], output_shape=mm.Shape([h.shape["b"], p["w1"].shape["d_ff"]]))
    return mm.einsum([mm.relu(a), p["w2"]], output_shape=h.shape) + h


def _loss(h, t):  # a mean over the microbatch: its value depends on where microbatches are cut
    return mm.reduce_sum(mm.square(h - t)) * (1.0 / h.shape.size)


def _ref_forward(w1, w2, h):
    """Outputs and what the backward needs, per stage in order."""
    tape = []
    for a1, a2 in zip(w1, w2):
        a = h @ a1
        tape.append((h, a, a1, a2))
        h = np.maximum(a, 0) @ a2 + h
    return h, tape


def _ref_backward(tape, dy, g1, g2, order):
    for (h, a, a1, a2), i in zip(reversed(tape), reversed(order)):
        r = np.maximum(a, 0)
        g2[i] += r.T @ dy
        da = (dy @ a2.T) * (a > 0)
        g1[i] += h.T @ da
        dy = da @ a1.T + dy
    return dy


def _data(K: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((K, D, F)), rng.standard_normal((K, F, D)) * 0.5, rng.standard_normal((B, D)),
            rng.standard_normal((B, D)))


def _params(mesh, w1, w2):
    K = w1.shape[0]
    return {"w1": mesh.from_numpy(w1, f"stage:{K};d:{D};d_ff:{F}"),
            "w2": mesh.from_numpy(w2, f"stage:{K};d_ff:{F};d:{D}")}


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("microbatches", [1, 2, 3, 8])
@pytest.mark.parametrize("remat", [False, True])
def test_pipeline_and_its_gradient_equal_the_stages_in_order(shape, microbatches, remat):
    mesh = _mesh(shape)
    S = mesh.shape["stages"].size
    w1, w2, x0, c = _data(S)
    params, x = _params(mesh, w1, w2), mesh.from_numpy(x0, f"b:{B};d:{D}")
    cot = mesh.from_numpy(c, f"b:{B};d:{D}")
    with mm.trace():
        y = mm.pipeline(_stage, params, x, "stages", microbatches, remat=remat)
        loss = mm.reduce_sum(y * cot)
        g1, g2, dx = mm.gradients([loss], [params["w1"], params["w2"], x])
    want, tape = _ref_forward(w1, w2, x0)
    assert y.shape == x.shape and y.tensor_layout == x.tensor_layout
    _close(y.to_numpy(), want)
    r1, r2 = np.zeros_like(w1), np.zeros_like(w2)
    rdx = _ref_backward(tape, c, r1, r2, list(range(S)))
    _close(g1.to_numpy(), r1)
    _close(g2.to_numpy(), r2)
    _close(dx.to_numpy(), rdx)
    assert g1.tensor_layout == params["w1"].tensor_layout


def _reference_value_and_grad(w1, w2, x0, t0, microbatches, order):
    r1, r2, dxs, loss = np.zeros_like(w1), np.zeros_like(w2), [], 0.0
    for rows in np.array_split(np.arange(B), microbatches):
        out, tape = _ref_forward(w1[order], w2[order], x0[rows])
        loss += np.sum((out - t0[rows]) ** 2) / out.size
        g1, g2 = np.zeros_like(w1), np.zeros_like(w2)
        dxs.append(_ref_backward(tape, 2 * (out - t0[rows]) / out.size, g1, g2, list(range(len(order)))))
        r1[order] += g1
        r2[order] += g2
    return loss, r1, r2, np.concatenate(dxs)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("microbatches", [1, 2, 3, 8])
@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 1)])
def test_value_and_grad_equal_the_sequential_reference(shape, microbatches, schedule, virtual):
    mesh = _mesh(shape)
    S = mesh.shape["stages"].size
    w1, w2, x0, t0 = _data(S * virtual, seed=microbatches)
    params, x = _params(mesh, w1, w2), mesh.from_numpy(x0, f"b:{B};d:{D}")
    t = mesh.from_numpy(t0, f"b:{B};d:{D}")
    loss, grads, dx = mm.pipeline_value_and_grad(_stage, _loss, params, x, t, "stages", microbatches,
                                                 schedule=schedule, virtual_stages=virtual)
    want, r1, r2, rdx = _reference_value_and_grad(w1, w2, x0, t0, microbatches, application_order(S, virtual))
    _close(float(loss), want)
    _close(grads["w1"].to_numpy(), r1)
    _close(grads["w2"].to_numpy(), r2)
    _close(dx.to_numpy(), rdx)
    assert grads["w2"].tensor_layout == params["w2"].tensor_layout and dx.tensor_layout == x.tensor_layout


def _sgd_steps(step, params, x, t, steps: int = 3) -> list:
    """`steps` SGD steps of `step` (params, x, t) -> (loss, grads): every loss and the last parameters."""
    out = []
    for _ in range(steps):
        loss, grads = step(params, x, t)
        params = {k: params[k] - grads[k] * 1e-3 for k in params}
        out.append(loss)
    return out + list(params.values())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", ["gpipe", "1f1b", "interleaved", "pipeline", "pipeline-remat"])
def test_compiled_steps_replay_pipelines_bitwise(shape, form):
    mesh = _mesh(shape)
    S, V = mesh.shape["stages"].size, 2 if form == "interleaved" else 1
    w1, w2, x0, t0 = _data(S * V)
    params, x = _params(mesh, w1, w2), mesh.from_numpy(x0, f"b:{B};d:{D}")
    t = mesh.from_numpy(t0, f"b:{B};d:{D}")

    def step(params, x, t):
        if form.startswith("pipeline"):
            with mm.trace():
                y = mm.pipeline(_stage, params, x, "stages", 3, remat=form.endswith("remat"))
                loss = _loss(y, t)
                grads = dict(zip(params, mm.gradients([loss], list(params.values()))))
            return loss, grads
        loss, grads, _ = mm.pipeline_value_and_grad(_stage, _loss, params, x, t, "stages", 3, schedule=form,
                                                    virtual_stages=V)
        return loss, grads
    compiled = mm.compile(lambda params, x, t: step(params, x, t))
    eager, got = _sgd_steps(step, params, x, t), _sgd_steps(compiled, params, x, t)
    assert compiled.recordings == 1 and compiled.replays == 2
    for a, b in zip(eager, got):
        assert a.to_numpy().tobytes() == b.to_numpy().tobytes()


def test_the_spmd_check_sees_every_rank_at_the_same_transfers():
    n = MPI.COMM_WORLD.Get_size()
    mesh = _mesh({4: "stages:2;cols:2", 8: "stages:2;batch:2;cols:2"}.get(n, f"stages:{n}"))
    S = mesh.shape["stages"].size
    w1, w2, x0, t0 = _data(S)
    params, x = _params(mesh, w1, w2), mesh.from_numpy(x0, f"b:{B};d:{D}")
    mm.set_spmd_check(True)
    try:
        loss, _, _ = mm.pipeline_value_and_grad(_stage, _loss, params, x, mesh.from_numpy(t0, f"b:{B};d:{D}"),
                                                "stages", 3)
    finally:
        mm.set_spmd_check(False)
    _close(float(loss), _reference_value_and_grad(w1, w2, x0, t0, 3, list(range(S)))[0])


def test_activations_move_once_per_microbatch_between_neighbours():
    n = MPI.COMM_WORLD.Get_size()
    if n not in (2, 4):
        pytest.skip("2 or 4 stages")
    mesh = _mesh(f"stages:{n}")
    w1, w2, x0, t0 = _data(n)
    params, x = _params(mesh, w1, w2), mesh.from_numpy(x0, f"b:{B};d:{D}")
    with mm.profile() as prof:
        mm.pipeline(_stage, params, x, "stages", 3)
    sent = prof.counters["sendrecv/stages"]["bytes"]
    s = mesh.coords["stages"]
    assert sent == (B * D * 8 if s < n - 1 else 0)  # every microbatch once to the next stage, the last sends none


def test_1f1b_holds_at_most_s_microbatches_and_gpipe_all():
    for S in (2, 3, 4):
        for M in (1, 3, 8):
            assert max(most_in_flight(ticks("1f1b", S, M), s) for s in range(S)) == min(S, M)
            assert max(most_in_flight(ticks("gpipe", S, M), s) for s in range(S)) == M


def test_interleaved_ticks_take_megatrons_time_and_never_more_than_one_step_a_tick():
    """With a backward twice a forward and ticks in lock-step, GPipe and 1F1B take 3 (M + S - 1) forwards of
    a stage; interleaved, its steady state's forward and backward paired in one tick, Megatron-LM's
    3 (M + (S - 1) / V) where M fills groups of S (one step a tick: 30.5 against 25.5 at S = 2, M = 8, V = 2,
    as lock-step ticks pairing one rank's forward with the other's backward wait for the backward)."""
    for S in (2, 3, 4):
        for M in (S, 2 * S, 3 * S):
            for schedule in ("gpipe", "1f1b"):
                assert span(ticks(schedule, S, M), S) == 3 * (M + S - 1)
            for V in (2, 3):
                assert span(ticks("interleaved", S, M, V), S, V) == pytest.approx(3 * (M + (S - 1) / V), rel=1e-12)
    single = {(S, M, V): span(_table("interleaved", S, M, V, True, True, paired=False), S, V)
              for S in (2, 3, 4) for M in range(1, 9) for V in (2, 3)}
    assert all(span(ticks("interleaved", *key), key[0], key[2]) <= t for key, t in single.items())
    assert single[(2, 8, 2)] == 30.5


def _bad(mesh, **kw):
    S = mesh.shape["stages"].size
    w1, w2, x0, t0 = _data(S)
    args = dict(stage_fn=_stage, stage_params=_params(mesh, w1, w2), x=mesh.from_numpy(x0, f"b:{B};d:{D}"),
                mesh_dim="stages", microbatches=2)
    args.update(kw)
    return mm.pipeline(**args)


def test_bad_input_is_named():
    n = MPI.COMM_WORLD.Get_size()
    mesh = _mesh({8: "stages:4;cols:2"}.get(n, f"stages:{n}"))
    S = mesh.shape["stages"].size
    w = np.ones((S, D, F))
    with pytest.raises(mm.MpimeshError, match="no stage dim 'stage'"):
        _bad(mesh, stage_params={"w": mesh.from_numpy(np.ones((D, F)), f"d:{D};d_ff:{F}")})
    with pytest.raises(mm.MpimeshError, match=f"stage dim 'stage' has size {S + 1}, but it must be.*{S}"):
        _bad(mesh, stage_params={"w": mesh.from_numpy(np.ones((S + 1, D)), f"stage:{S + 1};d:{D}")})
    if S > 1:
        with pytest.raises(mm.MpimeshError, match="must be split over mesh dim 'stages'"):
            _bad(mesh, stage_params={"w": mesh.from_numpy(w, f"stage:{S};d:{D};d_ff:{F}", "")})
    for m in (0, B + 1, 2.5):
        with pytest.raises(mm.MpimeshError, match=f"microbatches must be an int from 1 to .*'b', {B}"):
            _bad(mesh, microbatches=m)
    with pytest.raises(mm.MpimeshError, match=r"stage_fn must return a tensor of its input's shape"):
        _bad(mesh, stage_fn=lambda p, h: mm.reduce_sum(h, reduced_dims=["d"]))
    with pytest.raises(mm.MpimeshError, match="mesh_dim 'rows' is not a dim of mesh"):
        _bad(mesh, mesh_dim="rows")
    x = mesh.from_numpy(np.ones((B, D)), f"b:{B};d:{D}")
    with pytest.raises(mm.MpimeshError, match="unknown schedule 'zb'"):
        mm.pipeline_value_and_grad(_stage, _loss, {"w1": None}, x, x, "stages", 2, schedule="zb")
    with pytest.raises(mm.MpimeshError, match="virtual_stages=2 needs schedule='interleaved'"):
        mm.pipeline_value_and_grad(_stage, _loss, {"w1": None}, x, x, "stages", 2, virtual_stages=2)
    w1, w2, _, _ = _data(S)
    with pytest.raises(mm.MpimeshError, match="loss_fn must return a scalar"):
        mm.pipeline_value_and_grad(_stage, lambda h, t: h - t, _params(mesh, w1, w2), x, x, "stages", 2)


def test_held_activations_follow_each_schedules_formula():
    """tracemalloc's bytes (Python objects too, hence the slack): with remat only each stage's
    input per microbatch stays between forward and backward, without it also the block's a and
    relu(a); 1F1B's peak is below GPipe's by the activations of the M - (S - s) microbatches
    that stage s holds fewer."""
    import gc
    import tracemalloc
    n = MPI.COMM_WORLD.Get_size()
    if n not in (1, 2, 4):
        pytest.skip("1, 2 or 4 stages")
    mesh = _mesh(f"stages:{n}")
    b, d, f, M = 64, 64, 256, 8
    rng = np.random.default_rng(0)
    params = {"w1": mesh.from_numpy(rng.standard_normal((n, d, f)), f"stage:{n};d:{d};d_ff:{f}"),
              "w2": mesh.from_numpy(rng.standard_normal((n, f, d)), f"stage:{n};d_ff:{f};d:{d}")}
    x = mesh.from_numpy(rng.standard_normal((b, d)), f"b:{b};d:{d}")
    inputs, acts, y_bytes = b * d * 8, b * (d + 2 * f) * 8, b * d * 8
    held = {}
    for remat in (False, True):
        gc.collect()
        tracemalloc.start()
        with mm.trace():
            y = mm.pipeline(_stage, params, x, "stages", M, remat=remat)
            gc.collect()
            held[remat] = tracemalloc.get_traced_memory()[0] - y_bytes
        tracemalloc.stop()
        del y
    assert held[True] <= 1.25 * inputs + 32 * 1024, (held, inputs)
    assert acts <= held[False] <= 1.5 * acts, (held, acts)
    peak = {}
    for schedule in ("gpipe", "1f1b"):
        gc.collect()
        tracemalloc.start()
        mm.pipeline_value_and_grad(_stage, _loss, params, x, x, "stages", M, schedule=schedule)
        peak[schedule] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    s = mesh.coords["stages"]  # (stage 0 cuts x into all its microbatches first: their inputs are held anyway)
    per_mb = b // M * (2 * f + (d if s else 0)) * 8
    fewer = M - most_in_flight(ticks("1f1b", n, M), s)  # GPipe holds all M here
    assert 0.8 * fewer * per_mb <= peak["gpipe"] - peak["1f1b"] <= 1.4 * fewer * per_mb + 16 * 1024, (peak, per_mb)
