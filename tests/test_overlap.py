"""Prefetch and overlap (`mpimesh.overlap`, `Bucketer.scatter`): where the schedule puts each overlapped
collective's start and wait (hand-made steps, every prefetch depth), a compiled step with sharded
weights (gathers started ahead, reduce-scatters behind the backward, counted as overlapped in the
profile, values bitwise eager's, at most `depth` gathered weights more alive), the reduce-scatters in
buckets (one collective per bucket, the same elements, eager and compiled; a buffer packed by destination
gives each rank its blocks), and an eager walk's reduce-scatters overlapped, equal to blocking ones and
to a float64 numpy reference."""
from __future__ import annotations

import math
import os
import sys
from contextlib import contextmanager

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import get_mesh, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import layers as L  # noqa: E402
from mpimesh.buckets import pack_by_destination, unpack_destination  # noqa: E402
from mpimesh.compiled import _ReplayScatter  # noqa: E402
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


def _sharded(shape: str, seed: int):
    """A 3-layer MLP with weights sharded over the mesh's first dim of more than one rank (None: none),
    uneven blocks, and a batch whose activations outweigh the weights (the einsums gather the weights)."""
    over = next((d.name for d in get_mesh(shape).shape if d.size > 1), None)
    if over is None:
        pytest.skip("no mesh dim of more than one rank: nothing gathered")
    mesh = get_mesh(shape, f"batch:{over}")
    layers, d = 3, 4 * mesh.size + 1
    p = mm.shard_weights(_mlp(mesh, layers, d), over)
    b = 8 * d
    x = mesh.from_numpy(np.random.default_rng(seed).standard_normal((b, d)), f"batch:{b};d0:{d}")
    return over, mesh, layers, d, p, x


@contextmanager
def _bucket_bytes(n):
    before = mm.buckets.bucket_bytes()
    mm.set_bucket_bytes(before if n is None else n)
    try:
        yield
    finally:
        mm.set_bucket_bytes(before)


def _limit(which: str, d: int):
    """Bucket bytes: `"off"` 0 (no buckets: a compiled step overlaps each reduce-scatter alone), `"layer"`
    one layer's gradients (weight and bias, whole) a bucket, `"default"` 25 MiB (every gradient in one)."""
    return {"off": 0, "layer": (d * d + d) * 8, "default": None}[which]


@pytest.mark.parametrize("which", ["off", "layer", "default"])
@pytest.mark.parametrize("shape", mesh_shapes())
def test_a_sharded_step_prefetches_its_gathers_and_overlaps_its_reduce_scatters(shape, which):
    over, mesh, layers, d, p, x = _sharded(shape, 0)
    with _bucket_bytes(_limit(which, d)):
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
    buckets = [s for s in steps if type(s) is BucketStep and s.kind == "start" and type(s.bucket) is _ReplayScatter]
    sharded = sum(over in t.tensor_layout for t in p.values())  # weights and biases (each dim >= k)
    calls = {"off": sharded, "layer": layers, "default": 1}[which]
    assert sharded == 2 * layers and len(gathers) == sharded
    assert len(scatters) + sum(len(b.bucket.ins) for b in buckets) == sharded
    assert len(scatters) + len(buckets) == calls
    assert prof.overlap["requests"] == len(split) // 2 + len(buckets)
    assert prof.transfers[f"reduce_scatter/{over}"]["calls"] == calls  # one per bucket
    assert prof.transfers[f"reduce_scatter/{over}"]["elements"] == sum(t.shape.size for t in p.values())
    where = {id(s): i for i, s in enumerate(steps)}
    einsums = [i for i, s in enumerate(steps) if type(s) is OpStep and s.op.name == "einsum"]
    # prefetch: the second layer's gather starts before the first layer's einsum
    assert where[id(gathers[1])] < einsums[0]
    if which != "default":  # overlap: einsums of the backward run between a reduce-scatter's start and its wait
        first = (scatters or buckets)[0]
        done = next(i for i, s in enumerate(steps) if type(s) is not OpStep and s.kind == "wait" and (
            type(s) is AsyncStep and s.step is getattr(first, "step", None) or
            type(s) is BucketStep and s.bucket is getattr(first, "bucket", None)))
        assert any(where[id(first)] < e < done for e in einsums)


@pytest.mark.parametrize("shape", mesh_shapes())
def test_an_eager_walk_reduce_scatters_behind_the_backward_in_buckets(shape):
    """`mm.gradients` packs the sharded weights' reduce-scatters into buckets (one collective each: one
    a layer at a layer's bytes, one at the default 25 MiB), starts each without waiting and takes it in
    at the end; the values are those of the blocking per-tensor sums (buckets off), bitwise where the
    sums' order cannot differ (2 ranks), and a float64 numpy reference's to 1e-12."""
    over, mesh, layers, d, p, x = _sharded(shape, 1)
    sharded = sum(over in t.tensor_layout for t in p.values())
    got = {}
    for which, calls in (("off", sharded), ("layer", layers), ("default", 1)):
        with _bucket_bytes(_limit(which, d)), mm.profile() as prof:
            got[which] = _step(layers)(p, x)
        assert prof.transfers[f"reduce_scatter/{over}"]["calls"] == calls, which
        assert prof.transfers[f"reduce_scatter/{over}"]["elements"] == sum(t.shape.size for t in p.values())
        assert prof.overlap["requests"] == (0 if which == "off" else calls)
    want = _reference(p, x, layers)
    k = mesh.shape[over].size
    for which in ("layer", "default"):
        for a, b, (name, w) in zip(got[which][1], got["off"][1], want.items()):
            assert a.tensor_layout == b.tensor_layout
            if k <= 2:
                assert a.to_numpy().tobytes() == b.to_numpy().tobytes(), (which, name)
            np.testing.assert_allclose(a.to_numpy(), w, rtol=1e-12, atol=1e-12 * np.abs(w).max(), err_msg=name)


@pytest.mark.parametrize("shape", mesh_shapes())
def test_a_big_gradient_is_reduce_scattered_alone_at_once(shape, monkeypatch):
    """With `ALONE_BYTES` at a weight's bytes, each weight's gradient is reduce-scattered on its own as soon
    as it is made (a compiled step: one overlapped psum each), the biases' in one bucket: layers + 1 calls,
    eager and compiled, the same values bitwise, a float64 numpy reference's to 1e-12."""
    over, mesh, layers, d, p, x = _sharded(shape, 2)
    monkeypatch.setattr(mm.buckets, "ALONE_BYTES", d * d * 8)
    with mm.profile() as prof:
        eager = _step(layers)(p, x)
    assert prof.transfers[f"reduce_scatter/{over}"]["calls"] == layers + 1
    run = mm.compile(_step(layers))
    run(p, x)
    with mm.profile() as prof:
        got = run(p, x)
    assert prof.transfers[f"reduce_scatter/{over}"]["calls"] == layers + 1
    steps = _engine(run).steps
    assert sum(type(s) is AsyncStep and s.kind == "start" and s.step.op.name == "psum" for s in steps) == layers
    assert [len(s.bucket.ins) for s in steps if type(s) is BucketStep and s.kind == "start"] == [layers]
    want = _reference(p, x, layers)
    for a, b, w in zip(eager[1], got[1], want.values()):
        assert a.to_numpy().tobytes() == b.to_numpy().tobytes()
        np.testing.assert_allclose(a.to_numpy(), w, rtol=1e-12, atol=1e-12 * np.abs(w).max())


def _reference(p, x, layers: int) -> dict:
    """The gradients of `_loss` in float64 numpy (relu layers, loss the sum of squares)."""
    q = {k: v.to_numpy() for k, v in p.items()}
    hs, pre = [x.to_numpy()], []
    for i in range(layers):
        pre.append(hs[-1] @ q[f"l{i}/kernel"] + q[f"l{i}/bias"])
        hs.append(np.maximum(pre[-1], 0))
    g, out = 2 * hs[-1], {}
    for i in reversed(range(layers)):
        g = g * (pre[i] > 0)
        out[f"l{i}/kernel"], out[f"l{i}/bias"] = hs[i].T @ g, g.sum(0)
        g = g @ q[f"l{i}/kernel"].T
    return {k: out[k] for k in p}


def test_packing_by_destination_reduce_scatters_each_block_to_its_rank():
    """`pack_by_destination` and one reduce-scatter of the packed buffer: each rank gets its block of
    every array (cut along its own axis, uneven), summed over the ranks, as numpy float64 sums them."""
    n = mm.MPI.COMM_WORLD.size
    mesh = get_mesh(f"all:{n}")
    shapes, axes = [(2 * n + 1, 3), (4, n + 2, 2), (n,), (5,)], [0, 1, 0, 0]
    every = [[np.random.default_rng(100 * r + j).standard_normal(s) for j, s in enumerate(shapes)] for r in range(n)]
    flat, sizes = pack_by_destination(np, every[mesh.rank], axes, n)
    assert sum(sizes) == flat.size == sum(math.prod(s) for s in shapes)
    part = mesh.collectives.ireduce_scatter(flat, "all", 0, sizes=sizes).wait()
    got = unpack_destination(part, shapes, axes, n, mesh.rank)
    for j, (shape, axis) in enumerate(zip(shapes, axes)):
        whole = sum(a[j] for a in every)
        want = np.array_split(whole, n, axis=axis)[mesh.rank]
        np.testing.assert_allclose(got[j], want, rtol=1e-12, atol=1e-15)
        alone = mesh.collectives.reduce_scatter(every[mesh.rank][j], "all", axis)
        np.testing.assert_allclose(got[j], alone, rtol=1e-12, atol=1e-15)
    with pytest.raises(mm.MpimeshError, match="block lengths .* do not cut axis 0 of length"):
        mesh.collectives.ireduce_scatter(flat, "all", 0, sizes=(1,) * n)


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
