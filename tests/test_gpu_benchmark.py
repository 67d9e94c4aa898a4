"""benchmarks/gpu.py's PyTorch twin computes apps/transformer.py's model: in float64 on a tiny model its
loss, every gradient and three Adam steps (warmup included) equal mpimesh's; and the benchmark's CPU
smoke run ends with its table. Skipped without PyTorch (a benchmark-only dependency); the 1-rank
session runs it.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.launch import job_env

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "apps"))
import transformer as app  # noqa: E402

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="one process; the 1-rank session runs it")
CFG = app.Config(d_model=16, heads=2, d_kv=8, d_ff=32, layers=2, length=8, batch=3, optimizer="adam", lr=1e-2,
                 warmup=2, dtype="float64")


def _twin_module():
    spec = importlib.util.spec_from_file_location("torch_twin", ROOT / "benchmarks" / "torch_twin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


twin = _twin_module()


@pytest.fixture(scope="module")
def setup():
    """float64 parameters (mpimesh's initial values), one batch, and the twin built from them."""
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    params = {k: mesh.from_numpy(t.to_numpy().astype(np.float64), t.shape)
              for k, t in app.init_params(mesh, CFG).items()}
    data = np.random.default_rng(3).integers(0, 256, size=4096).astype(np.uint8)
    offsets = app.train_offsets(data, CFG, 0, 0)
    ids, targets = (torch.from_numpy(a).long() for a in app.batch_windows(data, CFG, offsets))
    return params, app.make_batch(mesh, data, CFG, offsets), ids, targets


def _twin(params: dict, attention: str = "explicit"):
    return twin.TorchTwin({k: t.to_numpy() for k, t in params.items()}, attention, dtype=torch.float64)


def test_loss_and_gradients_equal_mpimesh(setup):
    params, batch, ids, targets = setup
    names = list(params)
    with mm.trace():
        loss = app.loss_fn(params, batch, CFG)
        grads = mm.gradients([loss], [params[n] for n in names])
    model = _twin(params)
    theirs = model(ids, targets)
    theirs.backward()
    assert 4.0 < float(loss) < 8.0  # about log(256): an untrained byte model
    assert float(loss) == pytest.approx(theirs.item(), rel=1e-12)
    assert _twin(params, "sdpa")(ids, targets).item() == pytest.approx(theirs.item(), rel=1e-12)
    for name, g in zip(names, grads):
        ours = g.to_numpy()
        assert np.abs(ours).max() > 0, name
        np.testing.assert_allclose(ours, model.p[name].grad.numpy(), rtol=1e-9, atol=1e-13, err_msg=name)


def test_adam_steps_equal_mpimesh(setup):
    params, batch, ids, targets = setup
    opt = app.make_optimizer(CFG)
    step = app.make_train_step(CFG, opt)
    state = opt.init(params)
    model = _twin(params)
    torch_opt, schedule = twin.make_adam(model, CFG.lr, CFG.warmup, (opt.beta1, opt.beta2), opt.epsilon)
    for _ in range(3):  # lr 0.5x, 1x, 1x: the warmup and its end
        params, state, loss = step(params, state, batch)
        torch_opt.zero_grad()
        theirs = model(ids, targets)
        theirs.backward()
        torch_opt.step()
        schedule.step()
        assert float(loss) == pytest.approx(theirs.item(), rel=1e-12)
    for name, p in params.items():
        np.testing.assert_allclose(p.to_numpy(), model.p[name].detach().numpy(), rtol=0, atol=1e-10, err_msg=name)
    moved = max(np.abs(p.to_numpy() - q.to_numpy()).max() for p, q in zip(params.values(), setup[0].values()))
    assert moved == pytest.approx(2.5 * CFG.lr, rel=0.05)  # at most about lr per step: 0.5 + 1 + 1


def test_cpu_smoke_run_prints_the_table():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--size", "tiny"],
                          env=job_env(MPIMESH_BENCH_LOCK=""), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["precision", "eager", "ms"])
    rows = {line.split()[0]: line.split() for line in lines[header + 1:]}
    assert sorted(rows) == ["bf16", "fp32"] and header + 3 == len(lines), proc.stdout[-3000:]
    assert float(rows["fp32"][-1]) <= 1e-5  # the loss difference on the same weights and batch
    # eager, torch, ratio; then compiled and its ratio, judged for fp32 only (a verdict line printed)
    fp32, bf16 = rows["fp32"], rows["bf16"]
    assert float(fp32[7]) / float(fp32[2]) == pytest.approx(float(fp32[8]), rel=0.02) and fp32[11] in ("MET", "MISSED")
    assert bf16[11] == "-" and len(re.findall(r"^VERDICT fp32 compiled step", proc.stdout, re.M)) == 1
    assert len(re.findall(r"same model: .*: ok\)", proc.stdout)) == 2
