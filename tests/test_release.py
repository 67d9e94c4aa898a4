"""`mm.gradients(...)`: intermediates give their values back as the backward walk
passes them, with the same gradients, a lower peak, and a trace that still replays."""
from __future__ import annotations

import os
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import jaxenv  # noqa: E402,F401 (before jax)
from meshes import get_mesh, global_array, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.trace import Released  # noqa: E402

pytestmark = pytest.mark.mpi


def _model(x, w1, w2, labels):
    """An MLP with layer-norm-like scaling and a softmax cross-entropy: every op family's rule."""
    h = mm.relu(mm.einsum([x, w1]))
    h = h * mm.rsqrt(mm.reduce_mean(mm.square(h), reduced_dims="hidden") + 1e-3)
    logits = mm.einsum([h, w2])
    logp = mm.log_softmax(logits, "vocab")
    return -mm.reduce_mean(mm.reduce_sum(logp * mm.one_hot(labels, logits.shape["vocab"], dtype="float64"),
                                         reduced_dims="vocab"))


@pytest.mark.parametrize("shape", mesh_shapes())
def test_same_gradients_bitwise_and_released_intermediates(shape):
    mesh = get_mesh(shape)
    rules = {1: "batch:all", 2: "batch:rows;hidden:cols", 3: "batch:rows;hidden:cols;vocab:planes"}[mesh.shape.rank]
    x = mesh.from_numpy(global_array("batch:8;io:16", 0, np.float64), "batch:8;io:16")
    w1 = mesh.from_numpy(global_array("io:16;hidden:16", 1, np.float64), "io:16;hidden:16")
    w2 = mesh.from_numpy(global_array("hidden:16;vocab:8", 2, np.float64), "hidden:16;vocab:8")
    labels = mesh.from_numpy(np.arange(8) % 8, "batch:8")
    results, stubs = {}, {}
    for release in (False, True):
        with mm.layout_scope(mesh, rules), mm.trace() as tr:
            loss = _model(x, w1, w2, labels)
            grads = mm.gradients([loss], [x, w1, w2], retain=not release)
        results[release] = [g.to_numpy() for g in grads] + [loss.to_numpy()]
        stubs[release] = sum(isinstance(t, Released) for rec in tr.ops for t in rec.inputs + rec.outputs)
    assert stubs[True] > stubs[False]  # (without release, only what no gradient rule reads goes)
    for a, b in zip(results[False], results[True]):
        assert a.tobytes() == b.tobytes()


def test_release_lowers_the_peak():
    """A chain of 8 elementwise ops on 4 MiB tensors: without release every activation and every
    gradient lives until the end; with it, about two of each at a time."""
    mesh = get_mesh("all:1") if mm.MPI.COMM_WORLD.Get_size() == 1 else mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    if mesh.backend != "numpy":
        pytest.skip("tracemalloc sees host memory only (the GPU's peak: tests/test_gpu_memory_peak.py)")
    x = mesh.from_numpy(np.linspace(-1, 1, 1 << 19), "a:524288")
    peaks = {}
    for release in (False, True):
        tracemalloc.start()
        with mm.trace():
            h = x
            for _ in range(8):
                h = mm.tanh(h * 1.1)
            loss = mm.reduce_sum(h)
            del h
            (g,) = mm.gradients([loss], [x], retain=not release)
        peaks[release] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del g, loss
    mib = {k: v / 2**20 for k, v in peaks.items()}
    assert peaks[True] < 0.6 * peaks[False], mib


def test_released_trace_still_replays():
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    x = mesh.from_numpy(np.linspace(0.1, 1.0, 6).astype(np.float32), "a:6")
    with mm.trace() as tr:
        loss = mm.reduce_sum(mm.exp(mm.sin(x) * x))
        (g,) = mm.gradients([loss], [x])
    import jax
    f = mm.tpu.replay(tr, [x], [loss, g], devices=jax.devices()[:1])
    got_loss, got_g = f(x.to_numpy())
    np.testing.assert_allclose(got_loss, loss.to_numpy(), rtol=1e-6)
    np.testing.assert_allclose(got_g, g.to_numpy(), rtol=1e-6)


def test_differentiating_released_ops_again_says_why():
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    x = mesh.from_numpy(np.array([0.5, 1.0]), "a:2")
    with mm.trace():
        (g,) = mm.gradients([mm.sin(mm.exp(x))], [x])
        with pytest.raises(mm.MpimeshError, match="were released"):
            mm.gradients([g], [x])
        (g2,) = mm.gradients([mm.sin(mm.exp(x))], [x], retain=True)  # kept: second order works
        (gg,) = mm.gradients([g2], [x])
    e = np.exp([0.5, 1.0])
    np.testing.assert_allclose(gg.to_numpy(), -np.sin(e) * e * e + np.cos(e) * e, rtol=1e-12)


def test_profile_reports_peak_memory():
    n = 5_000_000  # 40 MB of float64, allocated and freed inside the block
    with mm.profile(memory=True) as outer:
        a = np.ones(n)
        del a
        with mm.profile() as inner:  # an inner profile resets the high-water marks: the outer keeps its own
            b = np.ones(1000)
        del b
    assert 8 * n <= outer.peak_bytes["arrays"] < 8 * n + (4 << 20)
    assert inner.peak_bytes["arrays"] < 8 * n // 10
    assert outer.peak_bytes["host"] >= outer.peak_bytes["arrays"]  # the resident set holds them all
    assert "peak memory (arrays)" in outer.report()
    with mm.profile() as plain:
        pass
    assert set(plain.peak_bytes) - {"gpu", "gpu_cached"} == {"host"}  # (a GPU's pool where CuPy is in use)


def test_defaults_free_as_the_backward_goes():
    """Issue 41's table (`benchmarks/backward_memory.py`): with `mm.gradients`' defaults, `mm.remat` per
    block lowers the whole step's peak to at most 0.4x of the step without it, and the backward's own
    part of the peak (less what the forward left and the gradients returned) does not grow with
    depth; `retain=True` keeps every intermediate, as before (about twice the step's peak)."""
    if mm.MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("one process: the 1-rank session runs it")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from backward_memory import residual_blocks, step_peaks
    peaks = {}
    for depth in (8, 16, 32):
        x, params = residual_blocks(depth)
        for remat in (False, True):
            peaks[depth, remat] = step_peaks(x, params, remat, retain=False)
    for depth in (16, 32):  # (the issue's 16 blocks; at 8 the parameters' gradients weigh more: about 0.43)
        assert peaks[depth, True]["step"] <= 0.4 * peaks[depth, False]["step"], depth
    for remat in (False, True):
        assert peaks[32, remat]["backward"] <= peaks[8, remat]["backward"] + 64 * 1024, remat
    x, params = residual_blocks(16)
    assert step_peaks(x, params, False, retain=True)["step"] > 1.8 * peaks[16, False]["step"]
