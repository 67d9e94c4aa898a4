"""tests/gpu_check.sh. Without a GPU it stops at once with one line and exit status 2 (skipped where CuPy
sees a GPU). Its steps and their table are checked on the CPU through a stand-in Python that says a GPU
is there and runs each step on the CPU instead: the suite without `--backend cupy` on one small test
file, benchmarks/gpu.py with `--device cpu --size tiny` (fp32 for tf32). The 1-rank session runs both."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from mpimesh.backend import device_count
from mpimesh.launch import job_env

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="child processes; the 1-rank session runs it")

SCRIPT = Path(__file__).resolve().parent / "gpu_check.sh"
ON_CPU = f"""#!/usr/bin/env bash
# A stand-in for python: a GPU is there (empty answer), and every step runs on the CPU.
case "$*" in
    *check_backend*) echo ;;
    *tests/run.py*) args=("$@"); exec {sys.executable} "${{args[@]/cupy/numpy}}" tests/test_top_k_modules.py ;;
    *benchmarks/gpu.py*) exec {sys.executable} "${{@//tf32/fp32}}" --device cpu --size tiny --steps 1 --warmup 0 ;;
    *) exec {sys.executable} "$@" ;;
esac
"""


@pytest.mark.skipif(device_count() > 0, reason="a GPU is here: the script would run its checks")
def test_without_a_gpu_it_stops_at_once(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT)], env=job_env(OUT=str(tmp_path / "out")), capture_output=True,
                          text=True, timeout=60)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("tests/gpu_check.sh: no usable GPU here, nothing checked: ") and "cupy" in lines[0]
    assert not (tmp_path / "out").exists()


def test_steps_logs_and_table(tmp_path):
    pytest.importorskip("torch", reason="PyTorch is not installed (benchmarks/gpu.py needs it)")
    python = tmp_path / "python"
    python.write_text(ON_CPU)
    python.chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT)], env=job_env(OUT=str(out), PYTHON=str(python), MPIMESH_BENCH_LOCK="",
                                                               GPU_CHECK_TESTS="tests/test_top_k_modules.py"),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = ["benchmark", "profile", "suite-1rank", "suite-2ranks"]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{s}.log" for s in steps)
    lines = proc.stdout.splitlines()
    head = lines.index(next(line for line in lines if line.split()[:3] == ["step", "status", "seconds"]))
    rows = [line.split(None, 3) for line in lines[head + 1:head + 5]]
    assert [r[:2] for r in rows] == [[s, "PASS"] for s in steps] and lines[head + 5] == f"logs: {out}", proc.stdout
    assert all(re.fullmatch(r"\d+ passed in [\d.]+s", r[3]) for r in rows[2:]), rows
    one = r"[\d.]+/[\d.]+ ms \([\d.]+x\), compiled [\d.]+ ms \([\d.]+x\)"
    assert re.fullmatch(rf"fp32 {one}; bf16 {one}", rows[0][3]), rows[0]
    one = r"kernels n/a of [\d.]+ ms, \d+ ops, n/a kernels"
    assert re.fullmatch(rf"fp32 eager {one}; fp32 compiled {one}; bf16 eager {one}; bf16 compiled {one}",
                        rows[1][3]), rows[1]
