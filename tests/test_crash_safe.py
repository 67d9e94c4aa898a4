"""Crash-safe training with apps/transformer.py, each test starting MPI jobs of its own: a rank
killed (SIGKILL) in the middle of a save leaves the previous checkpoint whole and `--resume` goes on
from it; resuming on another rank count and mesh gives the uninterrupted loss curve. References: the
same training run in this process (`reference`), and an uninterrupted job."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh import checkpoint, layers
from mpimesh.launch import find_mpiexec, job_env

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "apps" / "transformer.py"
CORPUS = str(ROOT / "tests" / "data" / "corpus.txt")
sys.path.insert(0, str(ROOT / "apps"))
import transformer as T  # noqa: E402

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                reason="starts MPI jobs of its own; runs in the 1-rank session")

CFG = T.Config(d_model=16, heads=8, d_kv=4, d_ff=32, layers=1, length=8, batch=8)
TINY = ["--d_model", "16", "--heads", "8", "--d_kv", "4", "--d_ff", "32", "--layers", "1", "--length", "8",
        "--batch", "8", "--data", CORPUS, "--heldout", "0.3", "--log-every", "1", "--eval-every", "1000",
        "--eval-batches", "1", "--samples", "0", "--save-every", "1"]


def command(n: int, *args: str) -> list[str]:
    return [find_mpiexec(), "-n", str(n), sys.executable, str(APP), *TINY, *args]


def run(n: int, *args: str) -> str:
    """Run the app on `n` ranks to completion; its stdout."""
    proc = subprocess.run(command(n, *args), env=job_env(MPIEXEC_TIMEOUT="60"), capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def logged(path: Path) -> dict[int, float]:
    """`--log-json` lines as {step: loss}."""
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def reference(steps: int) -> tuple[list[float], list[dict]]:
    """The app's training done here on one rank: the loss and the parameters after each step."""
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    train = T.load_corpus(CORPUS, 4 << 20, 0.3)[0]
    opt = T.make_optimizer(CFG)
    params = T.init_params(mesh, CFG, 0)
    state, step_fn, losses, after = opt.init(params), T.make_train_step(CFG, opt), [], []
    for step in range(steps):
        batch = T.make_batch(mesh, train, CFG, T.train_offsets(train, CFG, 0, step))
        params, state, loss = step_fn(params, state, batch, layers.subseed(0, f"step{step}"))
        losses.append(float(loss))
        after.append({k: t.to_numpy() for k, t in params.items()})
    return losses, after


@pytest.mark.parametrize("victim", [0, 1])
def test_kill_during_save_keeps_previous_checkpoint(tmp_path, victim):
    """SIGKILL rank `victim` while it sleeps inside the save of step 2 (MPIMESH_TEST_SLOW_SAVE), its
    part file written, the index not yet: the job ends, step 1 loads with the reference's values,
    and --resume trains steps 2 and 3 with the reference's losses."""
    ck = tmp_path / "ck"
    env = job_env(MPIEXEC_TIMEOUT="60", MPIMESH_TEST_SLOW_SAVE="2")
    started = time.monotonic()
    proc = subprocess.Popen(command(2, "--steps", "3", "--checkpoint", str(ck)), env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        hit = re.search(rf"rank {victim} pid (\d+) sleeps \S+ s inside the save of \S*step-00000002", line)
        if hit:
            os.kill(int(hit[1]), signal.SIGKILL)
            break
    seen += proc.stderr.readlines()
    proc.wait(timeout=60)
    assert hit, "".join(seen)
    assert proc.returncode != 0 and time.monotonic() - started < 60, "".join(seen)

    names = sorted(os.listdir(ck))
    assert names[0].startswith(".step-00000002.tmp-") and names[1:] == ["step-00000001"], names
    assert "index.json" not in os.listdir(ck / names[0])  # the save was cut before its commit
    losses, after = reference(3)
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    saved = layers.flatten(mm.load(str(ck / "step-00000001"), mesh))  # (params, opt and data as a nest)
    assert int(saved["opt/step"].to_numpy()) == 1
    for name, value in after[0].items():
        np.testing.assert_allclose(saved[f"params/{name}"].to_numpy(), value, rtol=1e-4, atol=1e-6, err_msg=name)

    out = run(2, "--steps", "3", "--checkpoint", str(ck), "--resume", "--log-json", str(tmp_path / "log"))
    assert f"resumed from {ck / 'step-00000001'} at step 1" in out
    got = logged(tmp_path / "log")
    assert list(got) == [2, 3]
    np.testing.assert_allclose([got[2], got[3]], losses[1:], rtol=1e-5)
    assert sorted(os.listdir(ck)) == ["step-00000002", "step-00000003"]  # the newest 2, no leftovers


@pytest.mark.parametrize("n,mesh", [(4, "rows:2;cols:2"), (3, "rows:1;cols:3")])
def test_resume_on_another_rank_count_and_mesh(tmp_path, n, mesh):
    """4 steps on 2 ranks (rows:1;cols:2, the paper's layout) against 2 steps there, then steps 3
    and 4 resumed on `n` ranks from its checkpoint: the same losses, step by step. On 3 ranks the
    heads (8) and d_ff (32) split unevenly, and the checkpoint of step 4 written there loads on one
    rank with the reference's parameters."""
    a, b = tmp_path / "a", tmp_path / "b"
    run(2, "--steps", "4", "--log-json", str(a))
    run(2, "--steps", "2", "--checkpoint", str(tmp_path / "ck"), "--log-json", str(b))
    out = run(n, "--steps", "4", "--checkpoint", str(tmp_path / "ck"), "--resume", "--mesh", mesh,
              "--log-json", str(tmp_path / "c"))
    assert f"{n} ranks, mesh {mm.Shape(mesh)}" in out and "at step 2" in out
    straight, resumed = logged(a), {**logged(b), **logged(tmp_path / "c")}
    assert list(straight) == list(resumed) == [1, 2, 3, 4]
    np.testing.assert_allclose(list(resumed.values()), list(straight.values()), rtol=1e-5)
    one = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    assert checkpoint.steps(str(tmp_path / "ck"), one) == [3, 4]
    if n == 3:
        after = reference(4)[1][-1]
        saved = layers.flatten(mm.load(checkpoint.step_path(str(tmp_path / "ck"), 4), one))
        assert int(saved["opt/step"].to_numpy()) == 4
        for name, value in after.items():
            np.testing.assert_allclose(saved[f"params/{name}"].to_numpy(), value, rtol=1e-4, atol=1e-6, err_msg=name)
