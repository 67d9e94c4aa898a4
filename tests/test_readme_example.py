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


def _compiled_example() -> str:
    section = (ROOT / "README.md").read_text().split("## Compiled steps: `mm.compile`", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _losses(tmp_path: Path, code: str, n: int) -> list[float]:
    found = re.findall(r"^step (\d+): loss (\S+)$", _run(tmp_path, code, n), re.M)
    assert [int(k) for k, _ in found] == [1, 200], found  # printed once, by rank 0
    return [float(v) for _, v in found]


def test_readme_compiled_step_matches_eager_and_one_rank(tmp_path):
    """The README's whole compiled step (trace, gradients, optimizer update, dropout seeded per
    replay, parameters donated) learns, prints the eager step's losses on 1 rank, and those of 1 rank
    on 2 (hidden split)."""
    code = _compiled_example()
    assert "mm.compile(train_step, donate_argnums=(0, 1))" in code and "mm.gradients" in code
    compiled1, compiled2 = _losses(tmp_path, code, 1), _losses(tmp_path, code, 2)
    eager1 = _losses(tmp_path, code.replace("mm.compile(train_step, donate_argnums=(0, 1))", "train_step"), 1)
    assert compiled1 == eager1  # bitwise (as printed: 9 digits)
    assert compiled2 == pytest.approx(compiled1, rel=1e-5)
    assert compiled1[1] < 0.3 * compiled1[0]  # it learned


def test_readme_one_mesh_dim_per_tensor_error_is_the_one_raised(tmp_path):
    """The error the README shows for rules that split two dims of one tensor over one mesh dim is,
    word for word, what the einsum it describes raises on each of 2 ranks."""
    section = (ROOT / "README.md").read_text().split("## How layouts map to communication", 1)[1]
    shown = re.search(r"```text\n(mpimesh\.errors\.LayoutError: .*?)\n```", section).group(1)
    script = tmp_path / "rule.py"
    script.write_text('import mpimesh as mm\nmesh = mm.Mesh("rows:2;cols:1", layout="batch:rows;hidden:rows")\n'
                      'x, w = mesh.ones("batch:8;io:4"), mesh.ones("io:4;hidden:6")\nmm.einsum([x, w])\n')
    proc = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=job_env(PYTHONPATH=str(ROOT)))
    assert proc.returncode != 0
    assert proc.stderr.count(shown + "\n") == 1 and "on ranks 0-1 (the same on each)" in proc.stderr, \
        proc.stderr  # raised on both ranks, printed once (mpimesh.abort)
