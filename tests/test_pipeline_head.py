"""`mm.pipeline_value_and_grad` with a model's head on the last stage (`loss_params`) and auxiliary
losses from the stages (`stage_fn` returning `(h, aux)`), against a float64 numpy reference of the
whole batch; `pipeline.microbatch()` inside `stage_fn` and `pipeline.last_run` after it.

The stage: `a = h W1`, `h + relu(a) W2`, aux `c * sum(a)`; the head: `sum((h U - t)^2) / (B E)`.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.dryrun import DryMesh
from mpimesh.pipeline import Microbatch, last_run, microbatch
from mpimesh.pipeline_schedules import application_order

SHAPES = ["stages:1", "stages:2", "stages:3", "stages:4", "stages:2;cols:2", "stages:2;batch:2"]
B, D, F, E, C = 10, 3, 4, 2, 0.125


def _mesh(shape: str) -> mm.Mesh:
    size = int(np.prod([int(d.split(":")[1]) for d in shape.split(";")]))
    if MPI.COMM_WORLD.Get_size() != size:
        pytest.skip(f"mesh {shape} needs {size} ranks")
    rules = ["stage:stages"] + (["d_ff:cols", "e:cols"] if "cols" in shape else []) + (
        ["b:batch"] if "batch:" in shape else [])
    return mm.Mesh(shape, layout=";".join(rules))


seen: list = []


def _stage(p, h):
    seen.append((microbatch(), not isinstance(h.mesh, DryMesh)))  # (the dry run's h: on a DryMesh)
    a = mm.einsum([h, p["w1"]], output_shape=mm.Shape([h.shape["b"], p["w1"].shape["d_ff"]]))
    return mm.einsum([mm.relu(a), p["w2"]], output_shape=h.shape) + h, mm.reduce_sum(a) * C


def _head(h, t, q):
    z = mm.einsum([h, q["u"]], output_shape=t.shape) - t
    return mm.reduce_sum(z * z) * (1.0 / (B * E))


def _reference(w1, w2, u, x, t):
    """Loss, dW1, dW2, dU, dx of the whole batch, the stages applied in order."""
    h, tape, aux = x, [], 0.0
    for a1, a2 in zip(w1, w2):
        a = h @ a1
        tape.append((h, a))
        aux += C * a.sum()
        h = np.maximum(a, 0) @ a2 + h
    z = h @ u - t
    loss = (z * z).sum() / (B * E) + aux
    g = 2 * z / (B * E)
    du, dy = h.T @ g, g @ u.T
    g1, g2 = np.zeros_like(w1), np.zeros_like(w2)
    for k in reversed(range(len(w1))):
        hk, a = tape[k]
        g2[k] = np.maximum(a, 0).T @ dy
        da = (dy @ w2[k].T) * (a > 0) + C
        g1[k] = hk.T @ da
        dy = da @ w1[k].T + dy
    return loss, g1, g2, du, dy


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("schedule,virtual,microbatches", [("gpipe", 1, 3), ("1f1b", 1, 1), ("1f1b", 1, 3),
                                                           ("interleaved", 2, 3)])
def test_head_and_aux_losses_equal_the_whole_batch(shape, schedule, virtual, microbatches):
    mesh = _mesh(shape)
    S = mesh.shape["stages"].size
    K = S * virtual
    rng = np.random.default_rng(K + microbatches)
    w1, w2 = rng.standard_normal((K, D, F)), rng.standard_normal((K, F, D)) * 0.5
    u, x0, t0 = rng.standard_normal((D, E)), rng.standard_normal((B, D)), rng.standard_normal((B, E))
    params = {"w1": mesh.from_numpy(w1, f"stage:{K};d:{D};d_ff:{F}"),
              "w2": mesh.from_numpy(w2, f"stage:{K};d_ff:{F};d:{D}")}
    head = {"u": mesh.from_numpy(u, f"d:{D};e:{E}", "d:stages" if S > 1 else None)}  # split over stages: gathered
    x, t = mesh.from_numpy(x0, f"b:{B};d:{D}"), mesh.from_numpy(t0, f"b:{B};e:{E}")
    seen.clear()
    loss, grads, dx, hgrads = mm.pipeline_value_and_grad(_stage, _head, params, x, t, "stages", microbatches,
                                                         schedule=schedule, virtual_stages=virtual, loss_params=head)
    order = application_order(S, virtual)
    want, r1, r2, ru, rdx = _reference(w1[order], w2[order], u, x0, t0)
    close = dict(rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(float(loss), want, **close)
    np.testing.assert_allclose(grads["w1"].to_numpy()[order], r1, **close)
    np.testing.assert_allclose(grads["w2"].to_numpy()[order], r2, **close)
    np.testing.assert_allclose(hgrads["u"].to_numpy(), ru, **close)
    np.testing.assert_allclose(dx.to_numpy(), rdx, **close)
    assert hgrads["u"].tensor_layout == head["u"].tensor_layout
    # microbatch(): the dry run first (microbatch 0 at this rank's first position), then each of this
    # rank's positions on each microbatch once, with its rows
    s = mesh.coords["stages"]
    sizes = [len(r) for r in np.array_split(np.arange(B), microbatches)]
    starts = np.cumsum([0] + sizes)[:-1]
    assert seen[0] == (Microbatch(s, 0, 0, sizes[0], B), False)
    ran = sorted(tuple(mb) for mb, real in seen[1:] if real)
    assert ran == sorted((v * S + s, m, int(starts[m]), sizes[m], B)
                         for v in range(virtual) for m in range(microbatches))
    assert microbatch() is None
    assert last_run["op"] == "pipeline_value_and_grad" and last_run["schedule"] == schedule
    assert (last_run["stages"], last_run["virtual"], last_run["microbatches"]) == (S, virtual, microbatches)
    assert 0 <= last_run["in_transfers"] <= last_run["seconds"]


def test_aux_and_loss_params_errors_are_named():
    n = MPI.COMM_WORLD.Get_size()
    mesh = _mesh({8: "stages:4;cols:2"}.get(n, f"stages:{n}"))
    S = mesh.shape["stages"].size
    params = {"w1": mesh.ones(f"stage:{S};d:{D};d_ff:{F}"), "w2": mesh.ones(f"stage:{S};d_ff:{F};d:{D}")}
    x = mesh.ones(f"b:{B};d:{D}")
    with pytest.raises(mm.MpimeshError, match="aux losses need mm.pipeline_value_and_grad"):
        mm.pipeline(_stage, params, x, "stages", 2)
    with pytest.raises(mm.MpimeshError, match=r"aux must be a scalar tensor \(no dims\) or None, got \[b:5, d:3\]"):
        mm.pipeline_value_and_grad(lambda p, h: (h, h), lambda h, t: mm.reduce_sum(h), params, x, x, "stages", 2)
    other = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    with pytest.raises(mm.MpimeshError, match=r"loss_params\['u'\] lives on mesh \[all:1\]"):
        mm.pipeline_value_and_grad(_stage, _head, params, x, x, "stages", 2, loss_params={"u": other.ones("d:3")})
