"""The README's 15-line example runs as shown on 4 ranks: each rank prints its own slice, everything
else once, and the loss equals the same program on one rank."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from mpimesh.launch import find_mpiexec, job_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts jobs of its own")


def _example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Eager distributed tensors", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(tmp_path: Path, code: str, n: int) -> str:
    script = tmp_path / f"example{n}.py"
    script.write_text(code)
    proc = subprocess.run([find_mpiexec(), "-n", str(n), sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120, env=job_env(PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_readme_example_prints_once_and_matches_one_rank(tmp_path):
    code = _example()
    assert "mpiexec -n 4" in code
    out = _run(tmp_path, code, 4)
    # ranks' lines may reach the launcher's stdout glued together: search, don't anchor
    assert sorted(re.findall(r"rank (\d): local \(4, 16\)", out)) == ["0", "1", "2", "3"]
    assert out.count("[batch:8, io:16] {'batch': 'rows'}") == 1
    assert len(re.findall(r"^allreduce/cols\s+1\s+64\b", out, re.M)) == 1
    loss4 = [float(v) for v in re.findall(r"(-?\d+\.\d+(?:e-?\d+)?)$", out, re.M)]
    one = _run(tmp_path, code.replace('"rows:2;cols:2"', '"rows:1;cols:1"'), 1)
    loss1 = [float(v) for v in re.findall(r"(-?\d+\.\d+(?:e-?\d+)?)$", one, re.M)]
    assert len(loss4) == 1 and len(loss1) == 1
    assert loss4[0] == pytest.approx(loss1[0], rel=1e-5)


def _training_example() -> str:
    section = (ROOT / "README.md").read_text().split("## Training:", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _train(folder: Path, n: int, *args: str) -> float:
    """The README's training example on `n` ranks in `folder` (its checkpoint goes there): the loss it prints."""
    folder.mkdir(exist_ok=True)
    (folder / "train.py").write_text(_training_example())
    proc = subprocess.run([find_mpiexec(), "-n", str(n), sys.executable, "train.py", *args], capture_output=True,
                          text=True, timeout=300, env=job_env(PYTHONPATH=str(ROOT)), cwd=folder)
    assert proc.returncode == 0, proc.stderr
    found = re.findall(r"^step (\d+): loss (\S+)$", proc.stdout, re.M)
    assert len(found) == 1, proc.stdout  # printed once, by rank 0
    return float(found[0][1])


def test_readme_training_example_resumes_on_another_mesh(tmp_path):
    """4 ranks on rows:2;cols:2 for 200 steps, then resumed on 2 ranks (rows:1;cols:2) to step 400:
    the loss at step 400 equals one uninterrupted 400-step run on one rank."""
    assert "mpiexec -n 4 python train.py" in _training_example()
    first = _train(tmp_path / "a", 4)
    resumed = _train(tmp_path / "a", 2, "--mesh", "rows:1;cols:2", "--resume", "--steps", "400")
    straight = _train(tmp_path / "b", 1, "--mesh", "rows:1;cols:1", "--steps", "400")
    assert resumed < first  # it went on learning
    assert resumed == pytest.approx(straight, rel=1e-4)
