"""The transformer app's data position: a checkpoint holds the data stream's state (its position, seed
and what it draws from), `--resume` goes on with the batches an uninterrupted run would have seen. A
job killed (SIGKILL, one rank) at step 5 of 8 on 2 and 4 ranks, resumed from its newest complete
checkpoint, logs the uninterrupted job's losses bit for bit (the float64 numbers of `--log-json`); a
resume under another --seed, --batch or corpus is refused; a checkpoint from before data positions
resumes at its step. The jobs are started here (the 1-rank session); the in-process tests run on every
session's ranks."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh import checkpoint
from mpimesh.launch import find_mpiexec, job_env

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "apps" / "transformer.py"
CORPUS = str(ROOT / "tests" / "data" / "corpus.txt")
sys.path.insert(0, str(ROOT / "apps"))
import transformer as T  # noqa: E402

TINY = ["--d_model", "16", "--heads", "8", "--d_kv", "4", "--d_ff", "32", "--layers", "1", "--length", "8",
        "--batch", "8", "--data", CORPUS, "--heldout", "0.3", "--log-every", "1", "--eval-every", "1000",
        "--eval-batches", "1", "--samples", "0", "--save-every", "1"]
one_rank_session = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                      reason="starts MPI jobs of its own; runs in the 1-rank session")


def command(n: int, *args: str) -> list[str]:
    return [find_mpiexec(), "-n", str(n), sys.executable, str(APP), *TINY, *args]


def run(n: int, *args: str) -> str:
    proc = subprocess.run(command(n, *args), env=job_env(MPIEXEC_TIMEOUT="120"), capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def logged(path: Path) -> dict[int, float]:
    """`--log-json` lines as {step: loss} (JSON keeps a float64 exactly)."""
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


@one_rank_session
@pytest.mark.parametrize("n", [2, 4])
def test_kill_and_resume_gives_the_uninterrupted_losses_bitwise(tmp_path, n):
    run(n, "--steps", "8", "--log-json", str(tmp_path / "a"))
    straight = logged(tmp_path / "a")
    ck = tmp_path / "ck"
    proc = subprocess.Popen(command(n, "--steps", "8", "--checkpoint", str(ck), "--log-json", str(tmp_path / "b")),
                            env=job_env(MPIEXEC_TIMEOUT="120"), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if re.match(r"step\s+5/8", line):
            break
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if str(APP) in " ".join(p.cmdline())]
    assert len(ranks) == n, "".join(seen)
    ranks[-1].kill()  # SIGKILL, one rank: the job ends
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    killed = logged(tmp_path / "b")
    done = checkpoint.steps(str(ck), mm.Mesh("all:1", comm=MPI.COMM_SELF))
    assert done and 1 <= done[-1] < 8 and max(killed) >= 5, (done, killed)
    out = run(n, "--steps", "8", "--checkpoint", str(ck), "--resume", "--log-json", str(tmp_path / "c"))
    assert f"resumed from {ck / f'step-{done[-1]:08d}'} at step {done[-1]}" in out, out
    resumed = logged(tmp_path / "c")
    assert list(resumed) == list(range(done[-1] + 1, 9))
    both = {**killed, **resumed}
    assert [both[s].hex() for s in range(1, 9)] == [straight[s].hex() for s in range(1, 9)]


def _shared(tmp_path) -> str:
    return MPI.COMM_WORLD.bcast(str(tmp_path), root=0)


def test_the_checkpoint_holds_the_data_position(tmp_path):
    ck = os.path.join(_shared(tmp_path), "ck")
    T.main(TINY + ["--checkpoint", ck, "--steps", "3"])
    mesh = mm.Mesh(f"all:{MPI.COMM_WORLD.Get_size()}")
    data = mm.load(checkpoint.step_path(ck, 3), mesh)["data"]
    train = T.load_corpus(CORPUS, 4 << 20, 0.3)[0]
    assert data == {"position": 3, "seed": 0, "batch": 8, "length": 8, "corpus_bytes": len(train),
                    "corpus_crc32": T.Batches(train, T.Config(), 0).crc}


@pytest.mark.parametrize("flag,said", [
    (["--seed", "1"], r"seed 0 \(now 1\)"),
    (["--batch", "4"], r"batch 8 \(now 4\)"),
    (["--heldout", "0.5"], r"corpus_bytes 20288 \(now \d+\), corpus_crc32 \d+ \(now \d+\)")])
def test_a_resume_drawing_other_batches_is_refused(tmp_path, flag, said):
    ck = os.path.join(_shared(tmp_path), "ck")
    T.main(TINY + ["--checkpoint", ck, "--steps", "2"])
    with pytest.raises(T.UsageError, match=rf"^--resume: the checkpoint's data stream differs from this run's: {said}; "
                                         r"resume with the --seed"):
        T.main(TINY + ["--checkpoint", ck, "--steps", "4", "--resume"] + flag)


def test_a_checkpoint_from_before_data_positions_resumes_at_its_step(tmp_path):
    """A flat checkpoint of parameters and optimizer state only (as the app saved before): --resume
    goes on at its step with the uninterrupted run's losses."""
    shared = _shared(tmp_path)
    T.main(TINY + ["--steps", "4", "--log-json", os.path.join(shared, "a")])
    T.main(TINY + ["--checkpoint", os.path.join(shared, "new"), "--steps", "2"])
    mesh = mm.Mesh(f"all:{MPI.COMM_WORLD.Get_size()}")
    cfg = T.Config(d_model=16, heads=8, d_kv=4, d_ff=32, layers=1, length=8, batch=8)
    params = T.init_params(mesh, cfg)
    state = T.make_optimizer(cfg).init(params)
    params, state, step = T.load_checkpoint(checkpoint.step_path(os.path.join(shared, "new"), 2), mesh, params, state)
    old = os.path.join(shared, "old")
    checkpoint.save_step(old, step, T.checkpoint_tensors(params, state))  # flat: no data position
    T.main(TINY + ["--checkpoint", old, "--steps", "4", "--resume", "--log-json", os.path.join(shared, "b")])
    if MPI.COMM_WORLD.rank == 0:
        straight, resumed = logged(Path(shared, "a")), logged(Path(shared, "b"))
        assert list(resumed) == [3, 4] and [resumed[3], resumed[4]] == [straight[3], straight[4]]


def test_sharded_weights_resume_replicated_and_back(tmp_path):
    """`--shard-weights`: a checkpoint of sharded weights resumes replicated, a replicated one resumes
    sharded (each tensor in its template's layout), both continuing the uninterrupted losses (float32:
    sums in another order, so to 1e-5)."""
    shared, n = _shared(tmp_path), MPI.COMM_WORLD.Get_size()
    base = TINY + ["--mesh", f"rows:{n};cols:1"]
    path = lambda name: os.path.join(shared, name)  # noqa: E731
    T.main(base + ["--steps", "4", "--log-json", path("a")])
    T.main(base + ["--checkpoint", path("s"), "--steps", "2", "--shard-weights", "rows"])
    T.main(base + ["--checkpoint", path("s"), "--steps", "4", "--resume", "--log-json", path("b")])
    T.main(base + ["--checkpoint", path("r"), "--steps", "2"])
    T.main(base + ["--checkpoint", path("r"), "--steps", "4", "--resume", "--shard-weights", "rows",
                   "--log-json", path("c")])
    mesh = mm.Mesh(f"rows:{n};cols:1", layout=T.PAPER_LAYOUT)
    cfg = T.Config(d_model=16, heads=8, d_kv=4, d_ff=32, layers=1, length=8, batch=8)
    params = mm.shard_weights(T.init_params(mesh, cfg), "rows")
    state = T.make_optimizer(cfg).init(params)
    newest = checkpoint.steps(path("r"), mesh)[-1]
    got, got_state, step = T.load_checkpoint(checkpoint.step_path(path("r"), newest), mesh, params, state)
    assert step == newest and all(got[k].tensor_layout == params[k].tensor_layout for k in params)
    assert any("rows" in t.tensor_layout for t in got.values()) == (n > 1)
    if MPI.COMM_WORLD.rank == 0:
        straight = logged(Path(shared, "a"))
        for other in ("b", "c"):
            resumed = logged(Path(shared, other))
            assert list(resumed) == [3, 4], other
            assert all(abs(resumed[s] - straight[s]) <= 1e-5 * abs(straight[s]) for s in (3, 4)), (other, resumed)
