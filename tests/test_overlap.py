"""Prefetch and overlap (`mpimesh.overlap`, `Bucketer.scatter`): where the schedule puts each overlapped
collective's start and wait (hand-made steps, every prefetch depth), a compiled step with sharded
weights (gathers started ahead, reduce-scatters behind the backward, counted as overlapped in the
profile, values bitwise eager's, at most `depth` gathered weights more alive), and an eager walk's
reduce-scatters overlapped, equal to blocking ones."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import get_mesh, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import layers as L  # noqa: E402
from mpimesh.opdef import OpDef  # noqa: E402
from mpimesh.overlap import schedule  # noqa: E402
from mpimesh.program import AsyncStep, BucketStep, OpStep  # noqa: E402

pytestmark = pytest.mark.mpi

GATHER = OpDef("gather", lambda ctx, x: x, start=lambda params: None if params.get("blocking") else (lambda ctx, x: x))
USE = OpDef("use", lambda ctx, *xs: xs[0])


def _names(steps) -> list:
    return [f"{s.kind} {s.step.outs[0]}" if type(s) is AsyncStep else
            f"{s.op.name} {s.outs[0]}" if type(s) is OpStep else f"bucket {s.kind}" for s in steps]


def _layers(n: int) -> list:
    """n layers: gather weight slot 100+i into slot 10+i, then use it on the activation (slot 20+i)."""
    steps, h = [], 0
    for i in range(n):
        steps += [OpStep(GATHER, {}, [100 + i], [10 + i]), OpStep(USE, {}, [10 + i, h], [20 + i])]
        h = 20 + i
    return steps


@pytest.mark.parametrize("depth, order", [
    (0, ["start 10", "wait 10", "use 20", "start 11", "wait 11", "use 21", "start 12", "wait 12", "use 22"]),
    (1, ["start 10", "start 11", "wait 10", "use 20", "start 12", "wait 11", "use 21", "wait 12", "use 22"]),
    (2, ["start 10", "start 11", "start 12", "wait 10", "use 20", "wait 11", "use 21", "wait 12", "use 22"]),
])
def test_gathers_start_depth_ahead_and_wait_before_their_reader(depth, order):
    assert _names(schedule(_layers(3), depth)) == order


def test_a_start_waits_for_its_input_and_an_unread_result_for_the_end():
    # the second gather reads the first's result (ready only at its wait); the third's result is never read
    steps = [OpStep(GATHER, {}, [1], [2]), OpStep(USE, {}, [0], [3]), OpStep(GATHER, {}, [2], [4]),
             OpStep(USE, {}, [3], [5]), OpStep(GATHER, {}, [5], [6]), OpStep(USE, {}, [4], [7])]
    assert _names(schedule(steps, 1)) == ["start 2", "use 3", "wait 2", "start 4", "use 5", "start 6", "wait 4",
                                          "use 7", "wait 6"]


@pytest.mark.parametrize("depth, order", [
    (0, ["use 5", "start 1", "use 6", "wait 1", "start 2", "use 7", "wait 2", "start 3", "wait 3"]),
    (1, ["use 5", "start 1", "use 6", "start 2", "use 7", "wait 1", "start 3", "wait 2", "wait 3"]),
])
def test_at_most_depth_plus_one_transfers_are_in_flight(depth, order):
    # gradients' reduce-scatters whose results nothing reads: each waits only for the in-flight bound
    steps = []
    for i in (1, 2, 3):
        steps += [OpStep(USE, {}, [0], [4 + i]), OpStep(GATHER, {}, [4 + i], [i])]
    assert _names(schedule(steps, depth)) == order


def test_ops_without_a_starter_and_bucket_outputs_are_left_in_place():
    class Bucket:
        ins, outs, flat = [3], [4], 9
    steps = [OpStep(GATHER, {"blocking": True}, [0], [1]), OpStep(USE, {}, [1], [3]), BucketStep("start", Bucket),
             BucketStep("wait", Bucket), OpStep(GATHER, {}, [4], [5]), OpStep(USE, {}, [5], [6])]
    assert _names(schedule(steps, 1)) == ["gather 1", "use 3", "bucket start", "bucket wait", "start 5", "wait 5",
                                          "use 6"]
    assert schedule(steps[:2], 1) == steps[:2]


def _mlp(mesh, layers: int, d: int):
    return L.flatten({f"l{i}": L.init_dense(mesh, i, f"d{i}:{d}", f"d{i + 1}:{d}", dtype="float64")
                      for i in range(layers)})


def _loss(p, x, layers: int, remat: bool):
    h = x
    for i in range(layers):
        block = (lambda q, h, i=i: L.dense(q, h, activation="relu"))
        h = (mm.remat(block) if remat else block)(L.unflatten(p)[f"l{i}"], h)
    return mm.reduce_sum(h * h)


def _step(layers: int, remat: bool = False):
    def step(p, x):
        with mm.trace():
            loss = _loss(p, x, layers, remat)
            grads = mm.gradients([loss], list(p.values()))
        return loss, grads
    return step


def _engine(compiled):
    (entry,) = compiled.cache.values()
    return getattr(entry.engine, "engine", entry.engine)  # (CUDA graphs wrap the flat engine)


@pytest.mark.parametrize("shape", mesh_shapes())
def test_a_sharded_step_prefetches_its_gathers_and_overlaps_its_reduce_scatters(shape):
    over = next((d.name for d in get_mesh(shape).shape if d.size > 1), None)
    if over is None:
        pytest.skip("no mesh dim of more than one rank: nothing gathered")
    mesh = get_mesh(shape, f"batch:{over}")
    layers, d = 3, 4 * mesh.size + 1  # uneven blocks
    p = mm.shard_weights(_mlp(mesh, layers, d), over)
    b = 8 * d  # activations outweigh the weights: the einsums gather the weights (not the activations)
    x = mesh.from_numpy(np.random.default_rng(0).standard_normal((b, d)), f"batch:{b};d0:{d}")
    eager = _step(layers)(p, x)
    run = mm.compile(_step(layers))
    run(p, x)
    with mm.profile() as prof:
        got = run(p, x)
    assert eager[0].to_numpy().tobytes() == got[0].to_numpy().tobytes()
    for a, b in zip(eager[1], got[1]):
        assert a.tensor_layout == b.tensor_layout and a.to_numpy().tobytes() == b.to_numpy().tobytes()
    steps = _engine(run).steps
    split = [s for s in steps if type(s) is AsyncStep]
    gathers = [s for s in split if s.step.op.name == "relayout" and s.kind == "start"]
    scatters = [s for s in split if s.step.op.name == "psum" and s.kind == "start"]
    sharded = sum(over in t.tensor_layout for t in p.values())  # weights and biases (each dim >= k)
    assert sharded == 2 * layers and len(gathers) == sharded and len(scatters) == sharded
    assert prof.overlap["requests"] == len(split) // 2
    assert prof.transfers[f"reduce_scatter/{over}"]["calls"] == sharded
    where = {id(s): i for i, s in enumerate(steps)}
    einsums = [i for i, s in enumerate(steps) if type(s) is OpStep and s.op.name == "einsum"]
    # prefetch: the second layer's gather starts before the first layer's einsum
    assert where[id(gathers[1])] < einsums[0]
    # overlap: einsums of the backward run between a reduce-scatter's start and its wait
    waits = {id(s.step): i for i, s in enumerate(steps) if type(s) is AsyncStep and s.kind == "wait"}
    first = where[id(scatters[0])]
    assert any(first < e < waits[id(scatters[0].step)] for e in einsums)


@pytest.mark.parametrize("shape", mesh_shapes())
def test_an_eager_walk_reduce_scatters_behind_the_backward(shape):
    """`mm.gradients` starts each sharded weight's reduce-scatter without waiting and takes it in at the
    end (with buckets on, the default); the values are those of the blocking sums (buckets off)."""
    over = next((d.name for d in get_mesh(shape).shape if d.size > 1), None)
    if over is None:
        pytest.skip("no mesh dim of more than one rank: nothing gathered")
    mesh = get_mesh(shape, f"batch:{over}")
    layers, d = 3, 4 * mesh.size + 1
    p = mm.shard_weights(_mlp(mesh, layers, d), over)
    b = 8 * d
    x = mesh.from_numpy(np.random.default_rng(1).standard_normal((b, d)), f"batch:{b};d0:{d}")
    got = {}
    for limit in (None, 0):
        before = mm.buckets.bucket_bytes()
        mm.set_bucket_bytes(before if limit is None else limit)
        try:
            with mm.profile() as prof:
                got[limit] = _step(layers)(p, x)
        finally:
            mm.set_bucket_bytes(before)
        sharded = sum(over in t.tensor_layout for t in p.values())
        assert prof.transfers[f"reduce_scatter/{over}"]["calls"] == sharded
        assert prof.overlap["requests"] == (sharded if limit is None else 0)
    for a, b in zip(got[None][1], got[0][1]):
        assert a.tensor_layout == b.tensor_layout and a.to_numpy().tobytes() == b.to_numpy().tobytes()


def test_prefetch_depth_bounds_the_gathered_weights_alive(monkeypatch):
    """With a block rematerialised per layer, each weight is gathered again in the backward; the step's
    peak of live arrays is at most its sharded gradients, a weight in use and its whole gradient, one
    more gathered weight per step of prefetch depth, and the few activations remat keeps."""
    n = mm.MPI.COMM_WORLD.size
    if n == 1:
        pytest.skip("no gathers on one rank")
    mesh = get_mesh(f"all:{n}", "batch:all")
    layers, d = 6, 48 * n
    p = mm.shard_weights(_mlp(mesh, layers, d), "all")
    x = mesh.from_numpy(np.ones((n, d)), f"batch:{n};d0:{d}")
    gathered = d * d * 8  # one layer's weight, whole
    peaks = {}
    for depth in (0, 1, 2):
        monkeypatch.setenv("MPIMESH_PREFETCH", str(depth))
        run = mm.compile(_step(layers, remat=True))
        run(p, x)
        with mm.profile(memory=True) as prof:
            run(p, x)
        peaks[depth] = prof.peak_bytes["arrays"]
        assert sum(s.kind == "start" for s in _engine(run).steps if type(s) is AsyncStep) >= 2 * layers
    grads = sum(t.local.nbytes for t in p.values())  # the step's results: sharded like the weights
    saved = 4 * layers * x.local.nbytes  # the blocks' inputs (remat) and a few activations alive at once
    for depth, peak in peaks.items():  # a weight in use, its whole gradient, and `depth` transfers ahead
        assert peak <= grads + (depth + 2) * gathered + saved, (depth, peaks)
    assert peaks[1] - peaks[0] <= gathered * 1.05, peaks
    assert peaks[2] - peaks[0] <= 2 * gathered * 1.05, peaks
