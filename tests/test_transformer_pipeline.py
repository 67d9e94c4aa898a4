"""apps/transformer.py --pipeline (apps/pipelined.py): the Transformer, dense and MoE, with its blocks as
pipeline stages gives the unpipelined app's loss, parameter gradients and updated parameters, to 1e-12 in
float64 (gpipe, 1f1b, interleaved; the embedding data-parallel over the pipeline dim, the head on the last
stage); and the command line resumes a pipelined run unpipelined and back with the uninterrupted run's
losses (its checkpoints hold the blocks per layer)."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as T  # noqa: E402
from apps import pipelined as PL  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")
CFG = T.Config(d_model=8, heads=2, d_kv=4, d_ff=16, layers=4, vocab=256, length=6, batch=6, dtype="float64")
MOE = T.Config(**{**CFG.__dict__, "moe_every": 2, "experts": 4})
MESHES = {1: [("rows:1;cols:1", "rows", "batch:rows;heads:cols;d_ff:cols;vocab:cols")],
          2: [("stages:2", "stages", "")],
          4: [("stages:2;cols:2", "stages", "heads:cols;d_ff:cols;vocab:cols"), ("stages:2;batch:2", "stages",
                                                                                 "batch:batch")]}
CASES = [("gpipe", 1, 3, False), ("1f1b", 1, 2, False), ("interleaved", 2, 4, False), ("gpipe", 1, 2, True),
         ("1f1b", 1, 3, True)]


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    with open(CORPUS, "rb") as f:
        return np.frombuffer(f.read(), np.uint8)


def _meshes() -> list:
    return MESHES.get(MPI.COMM_WORLD.Get_size(), [])


def _unpipelined(mesh, cfg, params, batch, seed) -> tuple:
    names = sorted(params)
    with mm.trace():
        loss = T.loss_fn(params, batch, cfg, True, seed)
        grads = mm.gradients([loss], [params[n] for n in names])
    return float(loss), {n: g.to_numpy() for n, g in zip(names, grads)}


@pytest.mark.parametrize("where", range(2))
@pytest.mark.parametrize("schedule,virtual,microbatches,moe", CASES)
def test_pipelined_step_equals_the_unpipelined_app_step(corpus, where, schedule, virtual, microbatches, moe):
    if where >= len(_meshes()):
        pytest.skip("fewer meshes on this rank count")
    shape, mesh_dim, rules = _meshes()[where]
    cfg = MOE if moe else CFG
    mesh = mm.Mesh(shape, layout=T.moe_layout(rules, cfg.moe_every))
    pipe = PL.Pipe(mesh_dim, microbatches, schedule, virtual)
    PL.check(pipe, mesh, cfg)
    params = {k: mm.cast(v, "float64") for k, v in T.init_params(mesh, cfg, seed=3).items()}
    batch = T.make_batch(mesh, corpus, cfg, T.train_offsets(corpus, cfg, 5, 0))
    seed = T.step_seed(mesh, 0, 7)  # a seed tensor, as the app's steps get (the MoE layers' draws)
    want, want_grads = _unpipelined(mesh, cfg, params, batch, seed)
    stacked = PL.to_stages(params, pipe, mesh, cfg)
    if mesh.shape[mesh_dim].size > 1:
        assert stacked["stages/0/att/q/kernel"].layout["stage"] == mesh_dim and "layer0/att/q/kernel" not in stacked
    loss, grads = PL.value_and_grad(stacked, batch, cfg, pipe, T.MODEL, seed)
    np.testing.assert_allclose(float(loss), want, rtol=1e-12)
    got = PL.from_stages(grads, pipe, mesh, cfg)
    assert sorted(got) == sorted(want_grads)
    for name, g in got.items():
        scale = np.abs(want_grads[name]).max()
        np.testing.assert_allclose(g.to_numpy(), want_grads[name], rtol=1e-12, atol=1e-12 * scale, err_msg=name)
    if moe:  # the MoE layers' gates were trained: their aux loss and draws reached them
        assert np.abs(want_grads["layer1/moe/wg"]).max() > 0
    # one optimizer step (Adafactor: per-tensor RMS and factored moments, each block's own)
    opt = T.make_optimizer(cfg)
    state = opt.init(params)
    unp, _, _ = T.make_train_step(cfg, opt)(params, state, batch, seed)
    pp, ps, _ = PL.make_train_step(cfg, opt, pipe, T.MODEL)(stacked, PL.state_to_stages(state, pipe, mesh, cfg),
                                                            batch, seed)
    assert int(ps["step"].to_numpy()) == 1
    for name, t in PL.from_stages(pp, pipe, mesh, cfg).items():
        np.testing.assert_allclose(t.to_numpy(), unp[name].to_numpy(), rtol=1e-12, atol=1e-13, err_msg=name)


TINY = ["--d_model", "16", "--heads", "2", "--d_kv", "8", "--d_ff", "32", "--layers", "4", "--length", "8",
        "--batch", "8", "--data", CORPUS, "--heldout", "0.3", "--log-every", "1", "--eval-every", "2",
        "--eval-batches", "1", "--save-every", "2", "--samples", "0", "--moe-every", "2", "--experts", "4"]


def _losses(path: str) -> dict:
    with open(path) as f:
        return {d["step"]: d["loss"] for d in map(json.loads, f)}


def test_resume_pipelined_unpipelined_and_back(tmp_path, capsys):
    """Steps 1-2 pipelined, 3-4 unpipelined from its checkpoint, 5-6 pipelined again from that one:
    the uninterrupted unpipelined run's losses (float32: to 1e-5), the bubble printed beside the theory."""
    n = MPI.COMM_WORLD.Get_size()
    if n not in (1, 2, 4):
        pytest.skip("1, 2 or 4 ranks")
    mesh = {1: ["--mesh", "rows:1;cols:1"], 2: ["--mesh", "rows:2;cols:1"], 4: []}[n]
    root = MPI.COMM_WORLD.bcast(str(tmp_path), root=0)
    ck, log = os.path.join(root, "ck"), (lambda name: ["--log-json", os.path.join(root, name)])
    pipe = ["--pipeline", "rows", "--microbatches", "3"]
    T.main(TINY + mesh + ["--steps", "6"] + log("straight.jsonl"))
    T.main(TINY + mesh + pipe + ["--steps", "2", "--checkpoint", ck] + log("a.jsonl"))
    T.main(TINY + mesh + ["--steps", "4", "--checkpoint", ck, "--resume"] + log("b.jsonl"))
    T.main(TINY + mesh + pipe + ["--steps", "6", "--checkpoint", ck, "--resume", "--schedule", "gpipe"]
           + log("c.jsonl"))
    out = capsys.readouterr().out
    if MPI.COMM_WORLD.Get_rank() == 0:
        straight = _losses(os.path.join(root, "straight.jsonl"))
        resumed = {**_losses(os.path.join(root, "a.jsonl")), **_losses(os.path.join(root, "b.jsonl")),
                   **_losses(os.path.join(root, "c.jsonl"))}
        assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
        np.testing.assert_allclose([resumed[k] for k in range(1, 7)], [straight[k] for k in range(1, 7)], rtol=1e-5)
        S = 1 if n == 1 else 2
        theory = 100 * (S - 1) / (3 + S - 1)
        assert out.count("pipeline over rows:") == 4 and f"theory (S-1)/(M+S-1) = {theory:.1f}%" in out, out
        with open(os.path.join(root, "c.jsonl")) as f:
            assert all(0 <= json.loads(line)["bubble"] <= 1 for line in f)
