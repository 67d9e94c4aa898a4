"""benchmarks/gpu.py --profile in its CPU configuration: after the step table, one row per precision
and step (eager, compiled) with the wall time per step, the host's time to issue it, the ops per step
and the host's microseconds per op; the kernel columns read n/a (no GPU activity on the CPU).
Skipped without PyTorch; the 1-rank session runs it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from mpimesh.launch import job_env

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="one process; the 1-rank session runs it")

GPU_PY = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"
HEADER = ["precision", "step", "wall", "ms", "host", "ms", "kernel", "ms", "kernel", "%", "ops/step", "kernels/step",
          "host", "us/op"]


def test_cpu_profile_table():
    proc = subprocess.run([sys.executable, str(GPU_PY), "--device", "cpu", "--size", "tiny",
                           "--precisions", "fp32,bf16", "--steps", "1", "--warmup", "0", "--profile"],
                          env=job_env(MPIMESH_BENCH_LOCK=""), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("profile of one mpimesh step"))
    assert "n/a, cpu run: CPU activity only" in lines[title] and lines[title + 1].split() == HEADER, proc.stdout[-2000:]
    rows = {tuple(r.split()[:2]): r.split()[2:] for r in lines[title + 2:title + 6]}
    assert sorted(rows) == [("bf16", "compiled"), ("bf16", "eager"), ("fp32", "compiled"), ("fp32", "eager")], \
        proc.stdout[-2000:]
    for (p, how), (wall, host, kernel_ms, kernel_pct, ops, kernels, host_us) in rows.items():
        assert float(wall) >= float(host) > 0 and int(ops) > 20 and float(host_us) > 0
        assert kernel_ms == kernel_pct == kernels == "n/a"
    for p in ("fp32", "bf16"):  # the compiled step runs the eager step's ops, without its Python per op
        assert int(rows[p, "compiled"][4]) <= int(rows[p, "eager"][4]), rows
