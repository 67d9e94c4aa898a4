"""A pipeline's transfers overlap its compute: stages run ahead of the ticks, and ops move the
transfers in flight (`collectives.base.in_flight`, tested by `trace.dispatch` between ops).

The run-ahead test makes the last stage sleep in each forward: a stage that completed each tick's
transfers before the next (lock-step) could not end its last forward before the slow stage began its
second (1 MiB activations: more than MPI buffers for a receiver not yet there); one that waits only for
what its own steps need ends all its forwards first. Values: the step's loss and gradients against
float64 numpy on the whole batch.
"""
from __future__ import annotations

import gc
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.collectives.base import Request, in_flight
from mpimesh.pipeline import microbatch

B, D, F, M, NAP = 64, 8192, 4, 4, 0.05  # a microbatch's activation: 16 x 8192 float64, 1 MiB


def test_ops_test_the_transfers_in_flight_until_done():
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    x = mesh.from_numpy(np.arange(3.0), "a:3")
    tests = []
    req = Request(lambda: tests.append(1) or len(tests) >= 3, lambda: None, then=lambda: "arrived")
    in_flight.append(req)
    try:
        for _ in range(5):
            x = x * 2.0
    finally:
        in_flight.clear()
    assert len(tests) == 3 and req.wait() == "arrived"  # one test per op while in flight, none after
    np.testing.assert_array_equal(x.to_numpy(), np.arange(3.0) * 32)


def test_stages_run_ahead_of_the_ticks():
    size = MPI.COMM_WORLD.Get_size()
    if size % 2:
        pytest.skip("two stages: an even rank count")
    mesh = mm.Mesh(f"stages:2;batch:{size // 2}", layout="stage:stages")
    rng = np.random.default_rng(3)
    w1, w2 = rng.standard_normal((2, D, F)) / np.sqrt(D), rng.standard_normal((2, F, D))
    x0, t0 = rng.standard_normal((B, D)), rng.standard_normal((B, D))
    p = {"w1": mesh.from_numpy(w1, f"stage:2;d:{D};f:{F}"), "w2": mesh.from_numpy(w2, f"stage:2;f:{F};d:{D}")}
    x, t = mesh.from_numpy(x0, f"b:{B};d:{D}"), mesh.from_numpy(t0, f"b:{B};d:{D}")
    log = []

    def stage(p, h):
        mb = microbatch()
        if mb is not None and mb.position == 1:
            log.append(("start", mb.index, time.monotonic()))
            time.sleep(NAP)
        a = mm.tanh(mm.einsum([h, p["w1"]], output_shape=mm.Shape([h.shape["b"], p["w1"].shape["f"]])))
        y = mm.einsum([a, p["w2"]], output_shape=h.shape)
        if mb is not None and mb.position == 0:
            log.append(("end", mb.index, time.monotonic()))
        return y

    def loss(h, tg):
        return mm.reduce_sum(mm.square(h - tg))

    mm.pipeline_value_and_grad(stage, loss, p, x, t, "stages", M, schedule="gpipe")  # (warm: communicators)
    log.clear()
    got, grads, _ = mm.pipeline_value_and_grad(stage, loss, p, x, t, "stages", M, schedule="gpipe")
    times = MPI.COMM_WORLD.allgather(log)
    last_forward = max(s for ev in times for kind, mb, s in ev if kind == "end" and mb == M - 1)
    second_begun = min(s for ev in times for kind, mb, s in ev if kind == "start" and mb == 1)
    assert last_forward < second_begun, (last_forward, second_begun)

    hs, acts = [x0], []  # the reference: both stages on the whole batch, float64
    for s in range(2):
        acts.append(np.tanh(hs[-1] @ w1[s]))
        hs.append(acts[-1] @ w2[s])
    np.testing.assert_allclose(float(got.to_numpy()), np.sum((hs[2] - t0) ** 2), rtol=1e-12)
    g, want1, want2 = 2 * (hs[2] - t0), np.zeros_like(w1), np.zeros_like(w2)
    for s in (1, 0):
        want2[s] = acts[s].T @ g
        ga = (g @ w2[s].T) * (1 - acts[s] ** 2)
        want1[s] = hs[s].T @ ga
        g = ga @ w1[s].T
    np.testing.assert_allclose(grads["w1"].to_numpy(), want1, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads["w2"].to_numpy(), want2, rtol=1e-10, atol=1e-12)


def test_an_error_mid_schedule_ends_the_neighbours_waits():
    """The first stage raises at microbatch 2's forward; the second, waiting for that activation, raises
    within seconds (not at the time-out), and the mesh is unusable on every rank with a clear error:
    transfers left posted would take the next pipeline's activations."""
    size = MPI.COMM_WORLD.Get_size()
    if size % 2:
        pytest.skip("two stages: an even rank count")
    mesh = mm.Mesh(f"stages:2;batch:{size // 2}", layout="stage:stages")
    rng = np.random.default_rng(4)
    p = {"w": mesh.from_numpy(rng.standard_normal((2, 3)), "stage:2;e:3")}
    x = mesh.from_numpy(rng.standard_normal((8, 3)), "b:8;e:3")

    def stage(p, h):
        mb = microbatch()
        if mb is not None and mb.index == 2 and mb.position == 0:
            raise ValueError("bad microbatch")
        return h * p["w"]

    def loss(h, t):
        return mm.reduce_sum(mm.square(h - t))

    first = mesh.coords["stages"] == 0
    t0 = time.monotonic()
    with pytest.raises(ValueError if first else mm.CollectiveTimeoutError,
                       match="bad microbatch" if first else "abandoned this mesh: a pipeline over 'stages' ended by "
                                                            "ValueError: bad microbatch"):
        mm.pipeline_value_and_grad(stage, loss, p, x, x, "stages", M, schedule="gpipe")
    assert time.monotonic() - t0 < 20
    MPI.COMM_WORLD.Barrier()
    with pytest.raises(mm.CollectiveTimeoutError, match="unusable.*a pipeline over 'stages' ended by ValueError"):
        mm.pipeline_value_and_grad(stage, loss, p, x, x, "stages", M, schedule="gpipe")
    kept = mesh.comm_for("stages")  # (a receive of stage 1 is still posted on it)
    del mesh, p, x
    gc.collect()
    mesh = mm.Mesh(f"all:{size}")  # (a new mesh frees the dropped ones' communicators: not that one)
    assert kept.Get_size() == 2  # never freed, so no new communicator reuses its context and its receive
    me = MPI.COMM_WORLD.rank
    got = mesh.collectives.permute(np.full(4, float(me)), "all", size // 2, True)
    np.testing.assert_array_equal(got, float((me - size // 2) % size))
