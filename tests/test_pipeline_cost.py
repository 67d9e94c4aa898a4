"""Pipelines priced by the cost model (`mm.cost.pipeline_estimate`, `mm.auto_layout(..., pipeline=...)`):
the bubble, the bytes between stages and each schedule's held activations against formulas by hand, the
predicted transfers against `mm.profile` of real pipelined runs, and the layout search proposing a pipeline
when it is the fastest plan or the only one that fits.

The stage: a residual feed-forward block relu(h W1) W2 + h, as in tests/test_pipeline.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.cost import ArgSpec, Machine, TPUV2, pipeline_estimate, with_links
from mpimesh.cost.pipeline import bubble
from mpimesh.dryrun import DryMesh
from mpimesh.pipeline_schedules import most_in_flight, ticks

pytest.importorskip("jax", reason="jax is not installed (python3 install.py tpu): dry runs need it")

WORLD = MPI.COMM_WORLD
B, D, F = 12, 3, 4
TOY = Machine(flops=1e9, latency=1e-5, bandwidth=1e8, memory=2**30, memory_bandwidth=4e9, op_overhead=2e-6,
              einsum_overhead=3e-6)


def block(p, h):
    a = mm.einsum([h, p["w1"]], output_shape=mm.Shape([h.shape["b"], p["w1"].shape["d_ff"]]))
    return mm.einsum([mm.relu(a), p["w2"]], output_shape=h.shape) + h


def sq_loss(h, t):
    return mm.reduce_sum(mm.square(h - t))


def specs(K: int, b: int = B, d: int = D, f: int = F, dtype: str = "float64") -> tuple:
    return ({"w1": ArgSpec(f"stage:{K};d:{d};d_ff:{f}", dtype), "w2": ArgSpec(f"stage:{K};d_ff:{f};d:{d}", dtype)},
            ArgSpec(f"b:{b};d:{d}", dtype))


def valued(x) -> dict:
    return {"loss_fn": sq_loss, "targets": x}


# --------------------------------------------------------------------------- formulas by hand

@pytest.mark.parametrize("S,M,V", [(1, 3, 1), (2, 4, 1), (4, 8, 1), (3, 5, 1), (2, 4, 2), (4, 8, 2), (2, 3, 3)])
def test_the_bubble_is_s_minus_1_over_m_plus_s_minus_1_over_v(S, M, V):
    assert bubble(S, M, V) == pytest.approx((S - 1) / (M + S - 1) / V, rel=1e-15)
    p, x = specs(S * V)
    e = pipeline_estimate(block, p, x, f"stages:{S}", "stages", M, TOY, schedule="interleaved" if V > 1 else "1f1b",
                          virtual_stages=V, **valued(x))
    assert e["bubble"] == bubble(S, M, V)
    work = e["seconds"] - e["bubble_seconds"]  # the bubble's idle time is work x b / (1 - b) of the pipelined part
    assert 0 <= e["bubble_seconds"] <= work * bubble(S, M, V) / (1 - bubble(S, M, V)) * (1 + 1e-12)


@pytest.mark.parametrize("S", [2, 3, 4])
@pytest.mark.parametrize("M", [1, 3, 5])
def test_transfers_move_each_microbatch_once_each_way(S, M):
    """GPipe: every microbatch's block (b_m rows x D float64) forward from each stage but the last and back
    from each but the first; one call per tick that moves something, M + S - 2 ticks each way; then the
    loss (a scalar) summed over the stages and dx (the whole batch) broadcast from the first."""
    p, x = specs(S)
    e = pipeline_estimate(block, p, x, f"stages:{S}", "stages", M, TOY, schedule="gpipe", **valued(x))
    assert e["transfer_bytes"] == math.ceil(B / M) * D * 8
    for s, st in enumerate(e["stages"]):
        sends = (s < S - 1) + (s > 0)
        assert st["collectives"]["sendrecv/stages"] == {"calls": 2 * (M + S - 2), "elements": sends * B * D,
                                                        "bytes": sends * B * D * 8}
        assert st["collectives"]["broadcast/stages"] == {"calls": 1, "elements": B * D, "bytes": B * D * 8}
        assert st["collectives"]["allreduce/stages"] == {"calls": 1, "elements": 1, "bytes": 8}
        assert set(st["collectives"]) == {"sendrecv/stages", "broadcast/stages", "allreduce/stages"}  # (replicated)


def test_the_transfers_are_priced_alpha_plus_bytes_over_beta():
    """Two links for the stages' mesh dim: the step's difference is the transfers' (2 per microbatch, α +
    its bytes / β each, over 1 - bubble), the loss's sum and dx's broadcast (α + 2(S-1)/S bytes / β each)."""
    S, M = 3, 5
    p, x = specs(S)
    links = [(1e-5, 1e8), (3e-4, 2e7)]
    got = [pipeline_estimate(block, p, x, f"stages:{S}", "stages", M, with_links(TOY, {"stages": link}),
                             **valued(x))["seconds"] for link in links]

    def price(alpha, beta):
        rows = [len(r) for r in np.array_split(np.arange(B), M)]
        hops = sum(2 * (alpha + n * D * 8 / beta) for n in rows)
        casts = 2 * alpha + 2 * (S - 1) / S * (8 + B * D * 8) / beta
        return hops / (1 - bubble(S, M)) + casts
    assert got[1] - got[0] == pytest.approx(price(*links[1]) - price(*links[0]), rel=1e-9)
    p, x = specs(1)
    one = pipeline_estimate(block, p, x, "stages:1", "stages", 4, TOY, **valued(x))
    assert one["bubble"] == one["bubble_seconds"] == 0 and "sendrecv/stages" not in one["stages"][0]["collectives"]
    assert one["seconds"] >= 4 * one["stage_seconds"]


@pytest.mark.parametrize("S,M", [(2, 3), (3, 8), (4, 8), (4, 2)])
def test_held_activations_follow_each_schedules_formula(S, M):
    """Per microbatch of b rows a stage keeps its input h, h W1, relu(h W1) and its output (b (2D + 2F)
    float64); the last stage of a valued pipeline also h - t (its square's input) and the loss. GPipe holds
    M microbatches, 1F1B min(S - s, M) on stage s, GPipe with remat only the M inputs (b D each)."""
    b = B // M if B % M == 0 else math.ceil(B / M)
    p, x = specs(S)
    kept, last = b * (2 * D + 2 * F) * 8, b * (2 * D + 2 * F) * 8 + b * D * 8 + 8
    for schedule in ("gpipe", "1f1b"):
        e = pipeline_estimate(block, p, x, f"stages:{S}", "stages", M, TOY, schedule=schedule, **valued(x))
        for s, st in enumerate(e["stages"]):
            held = M if schedule == "gpipe" else min(S - s, M)
            assert st["in_flight"] == held == most_in_flight(ticks(schedule, S, M), s)
            assert st["activation_bytes"] == held * (last if s == S - 1 else kept), (schedule, s)
            assert st["memory"]["parameters"] == st["memory"]["gradients"] == 2 * D * F * 8
            assert st["bytes_per_rank"] == sum(st["memory"].values())
    for remat, per in ((False, kept), (True, b * D * 8)):
        e = pipeline_estimate(block, p, x, f"stages:{S}", "stages", M, TOY, remat=remat)
        assert [st["activation_bytes"] for st in e["stages"]] == [M * per] * S
    assert e["stage_seconds"] > pipeline_estimate(block, p, x, f"stages:{S}", "stages", M, TOY)["stage_seconds"]


# --------------------------------------------------------------------------- against real runs

def _real(shape: str, rules: str):
    n = WORLD.Get_size()
    size = math.prod(int(d.split(":")[1]) for d in shape.split(";"))
    if size != n:
        pytest.skip(f"mesh {shape} needs {size} ranks")
    return mm.Mesh(shape, layout=rules)


@pytest.mark.parametrize("shape,rules", [("stages:2", "stage:stages"), ("stages:4", "stage:stages"),
                                         ("stages:2;cols:2", "stage:stages;d_ff:cols"),
                                         ("stages:2;batch:2", "stage:stages;b:batch")])
def test_predicted_transfers_equal_the_profile_of_a_real_run(shape, rules):
    """Every schedule (and `mm.pipeline` with its gradient, with and without remat), 5 uneven microbatches:
    the model's counters for this rank's stage equal `mm.profile`'s, on the ranks at coordinate 0 of the
    other mesh dims (the dry run counts coordinate 0's blocks: with the batch split, the largest)."""
    mesh = _real(shape, rules)
    S = mesh.shape["stages"].size
    s, rest = mesh.coords["stages"], [c for d, c in mesh.coords.items() if d != "stages"]
    bad = []
    for schedule, V in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), (None, 1), ("remat", 1)):
        rng = np.random.default_rng(0)
        w = {"w1": rng.standard_normal((S * V, D, F)), "w2": rng.standard_normal((S * V, F, D))}
        p = {"w1": mesh.from_numpy(w["w1"], f"stage:{S * V};d:{D};d_ff:{F}"),
             "w2": mesh.from_numpy(w["w2"], f"stage:{S * V};d_ff:{F};d:{D}")}
        x = mesh.from_numpy(rng.standard_normal((B, D)), f"b:{B};d:{D}")
        with mm.profile() as prof:
            if schedule in (None, "remat"):
                with mm.trace():
                    y = mm.pipeline(block, p, x, "stages", 5, remat=schedule == "remat")
                    mm.gradients([y], [p["w1"], x])  # (ones as its cotangent: no reduction outside)
            else:
                mm.pipeline_value_and_grad(block, sq_loss, p, x, x, "stages", 5, schedule=schedule, virtual_stages=V)
        kw = {"remat": True} if schedule == "remat" else \
            {} if schedule is None else dict(schedule=schedule, virtual_stages=V, **valued(x))
        e = pipeline_estimate(block, p, x, mesh, "stages", 5, TPUV2, **kw)
        want = e["stages"][s]["collectives"]
        if prof.transfers != want and not any(rest):
            bad.append((schedule, prof.transfers, want))
    assert not sum(WORLD.allgather(bad), [])
    if S > 1 and not any(rest):  # each microbatch forward from all but the last stage, back from all but the first
        rows = [mesh.block_shape(f"b:{n};d:{D}", x.tensor_layout)[0] for n in (3, 3, 2, 2, 2)]
        assert want["sendrecv/stages"]["bytes"] == ((s < S - 1) + (s > 0)) * sum(rows) * D * 8

# --------------------------------------------------------------------------- auto_layout

def _plain_step(L: int):
    """The unpipelined model: L blocks in turn, the loss, the gradients of every weight."""
    def step(params, x, t):
        with mm.trace():
            h = x
            for i in range(L):
                h = block({"w1": params[f"w1_{i}"], "w2": params[f"w2_{i}"]}, h)
            return mm.gradients([sq_loss(h, t)], list(params.values()))
    return step


def _both(L: int, b: int, d: int, f: int, microbatches) -> tuple:
    params = {}
    for i in range(L):
        params[f"w1_{i}"] = ArgSpec(f"d:{d};d_ff:{f}", "float32")
        params[f"w2_{i}"] = ArgSpec(f"d_ff:{f};d:{d}", "float32")
    stacked, x = specs(L, b, d, f, "float32")
    return (params, x, x), dict(stage_fn=block, stage_params=stacked, x=x, microbatches=microbatches, **valued(x))


def test_auto_layout_proposes_a_pipeline_when_it_is_fastest():
    """A slow link (100 MB/s): model parallelism allreduces a [b, d] activation twice per layer, data
    parallelism every weight, and replicated the ranks all compute everything; a pipeline sends each
    microbatch's [b/M, d] once each way per boundary. On a fast link (no latency, 1 TB/s) the pipeline's
    bubble loses to plain model parallelism."""
    args, pipe = _both(4, 32, 512, 2048, [4, 8])
    slow = Machine(flops=1e11, latency=1e-5, bandwidth=1e8, memory=2**30, memory_bandwidth=1e13)
    plan = mm.auto_layout(_plain_step(4), args, DryMesh("x:4"), machine=slow, pipeline=pipe)
    assert plan.pipeline is not None and plan.pipeline["mesh_dim"] == "x", plan.report()
    assert plan.pipeline["why"] == "the fastest plan" and "stage:x" in plan.rules
    assert plan.pipeline["bubble"] == bubble(4, plan.pipeline["microbatches"])
    e = pipeline_estimate(block, pipe["stage_params"], pipe["x"], "x:4", "x", plan.pipeline["microbatches"], slow,
                          rules=plan.rules, **valued(pipe["x"]))
    assert (plan.seconds, plan.bytes_per_rank) == (e["seconds"], e["bytes_per_rank"])
    plain = [c for c in plan.candidates if "pipeline" not in c[0]]
    assert plain and plain[0][1] > plan.seconds  # an unpipelined plan was priced, and is slower
    assert "the fastest plan: a pipeline over x (1f1b" in plan.report()
    fast = Machine(flops=1e11, latency=0.0, bandwidth=1e12, memory=2**30, memory_bandwidth=1e13)
    assert mm.auto_layout(_plain_step(4), args, DryMesh("x:4"), machine=fast, pipeline=pipe).pipeline is None


def test_auto_layout_proposes_a_pipeline_when_it_is_the_only_plan_that_fits():
    """Activations outweigh the weights: 1F1B holds 2 of 8 microbatches per stage, where every unpipelined
    layout holds the whole batch's activations of both layers (split in two at best)."""
    args, pipe = _both(2, 4096, 16, 1024, 8)
    m = Machine(flops=1e11, latency=1e-5, bandwidth=1e8, memory=2**30, memory_bandwidth=1e10)
    free = mm.auto_layout(_plain_step(2), args, DryMesh("x:2"), math.inf, machine=m, pipeline=pipe)
    piped = min(b for label, _, b in free.candidates if "pipeline" in label)
    plain = min(b for label, _, b in free.candidates if "pipeline" not in label)
    assert piped < plain / 2
    plan = mm.auto_layout(_plain_step(2), args, DryMesh("x:2"), (piped + plain) / 2, machine=m, pipeline=pipe)
    assert plan.pipeline["why"] == "the only plan that fits" and plan.bytes_per_rank == piped
    assert "the only plan that fits: a pipeline over x (1f1b, 8 microbatches; bubble 11.1%)" in plan.report()
    with pytest.raises(mm.MpimeshError, match="no layout priced fits .*; nor does a pipeline: the smallest needs"):
        mm.auto_layout(_plain_step(2), args, DryMesh("x:2"), piped / 2, machine=m, pipeline=pipe)


def test_bad_input_is_named():
    p, x = specs(2)
    with pytest.raises(mm.MpimeshError, match="without loss_fn the step is mm.pipeline .* got schedule='1f1b'"):
        pipeline_estimate(block, p, x, "stages:2", "stages", 2, TOY, schedule="1f1b")
    with pytest.raises(mm.MpimeshError, match="remat prices mm.pipeline"):
        pipeline_estimate(block, p, x, "stages:2", "stages", 2, TOY, remat=True, **valued(x))
    with pytest.raises(mm.MpimeshError, match=r"stage dim 'stage' must have the size of mesh dim 'stages' times "
                                              r"virtual_stages, 3"):
        pipeline_estimate(block, p, x, "stages:3", "stages", 2, TOY)
    with pytest.raises(mm.MpimeshError, match="mesh_dim 'rows' is not a dim of mesh"):
        pipeline_estimate(block, p, x, "stages:2", "rows", 2, TOY)
    with pytest.raises(mm.MpimeshError, match="microbatches must be an int from 1 to .*'b', 12"):
        pipeline_estimate(block, p, x, "stages:2", "stages", 13, TOY)
    with pytest.raises(mm.MpimeshError, match="loss_fn and targets go together"):
        pipeline_estimate(block, p, x, "stages:2", "stages", 2, TOY, loss_fn=sq_loss)
    args, pipe = _both(2, 8, 4, 4, 2)
    with pytest.raises(TypeError, match="pipeline must be a dict with stage_fn, stage_params, x and microbatches"):
        mm.auto_layout(_plain_step(2), args, DryMesh("x:2"), machine=TOY, pipeline={"stage_fn": block})
    with pytest.raises(mm.MpimeshError, match=r"no mesh dim of \[x:4\] has the stages' count: .* size\(s\) \[2\]"):
        mm.auto_layout(_plain_step(2), args, DryMesh("x:4"), machine=TOY, pipeline=pipe)
