"""tests/gpu_check.sh. Without a GPU it stops at once with one line and exit status 2 (skipped where CuPy
sees a GPU). Its steps and their table are checked on the CPU through a stand-in Python that says a GPU
is there and runs each step on the CPU instead: the tests without `--backend cupy` on one small test
file (or, to check the table's verdicts, a step that fails or sleeps), benchmarks/gpu.py with `--device
cpu --size tiny` (fp32 for tf32; only where PyTorch is installed). pytest-mpi is hidden from the script's
test steps (MPIMESH_TEST_NO_PYTEST_MPI=1), as on the GPU machines' image. The 1-rank session runs these."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from mpimesh.backend import device_count
from mpimesh.launch import job_env

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="child processes; the 1-rank session runs it")

SCRIPT = Path(__file__).resolve().parent / "gpu_check.sh"
STEPS = ["tests-1rank", "tests-2ranks", "benchmark"]
# A stand-in for python: a GPU is there (empty answer), and every step runs on the CPU; FAKE_STEPS=fail makes
# each step exit 3 at once, FAKE_STEPS=sleep the benchmark sleep (the tests pass at once).
ON_CPU = f"""#!/usr/bin/env bash
case "${{FAKE_STEPS-}} $*" in
    *check_backend*) echo ;;
    "fail "*tests/run.py* | "fail "*benchmarks/gpu.py*) echo "a failing step"; exit 3 ;;
    "sleep "*tests/run.py*) echo "= 1 passed in 0.01s ="; exit 0 ;;
    "sleep "*benchmarks/gpu.py*) exec sleep 100 ;;
    *tests/run.py*) args=("$@"); exec {sys.executable} "${{args[@]/cupy/numpy}}" ;;
    *benchmarks/gpu.py*) exec {sys.executable} "${{@//tf32/fp32}}" --device cpu --size tiny --steps 1 --warmup 0 ;;
    *) exec {sys.executable} "$@" ;;
esac
"""
ROW = re.compile(r"(\S+)\s+(PASS|KILLED|TIMEOUT|FAIL\(\d+\)|NO FILES)\s+(\d+)\s+(.*)")


def stand_in(tmp_path: Path, out: Path, tests: str = "tests/test_top_k_modules.py", **env: str) -> tuple:
    """(the command, its environment): the script under the stand-in Python, logs in `out`."""
    python = tmp_path / "python"
    python.write_text(ON_CPU)
    python.chmod(0o755)
    return ["bash", str(SCRIPT)], job_env(OUT=str(out), PYTHON=str(python), MPIMESH_BENCH_LOCK="",
                                          MPIMESH_TEST_NO_PYTEST_MPI="1", GPU_CHECK_TESTS=tests, **env)


def table(stdout: str, out: Path) -> dict:
    """The printed table's rows, {step: [status, seconds, key figure]} (in the order the steps ended, as
    in $OUT/rows.txt: the two test steps run side by side)."""
    lines = stdout.splitlines()
    head = max(i for i, line in enumerate(lines) if line.split()[:3] == ["step", "status", "seconds"])
    end = lines.index(f"logs: {out}", head)
    rows = [list(ROW.fullmatch(line).groups()) for line in lines[head + 1:end]]
    assert [r.split("|") for r in (out / "rows.txt").read_text().splitlines()] == rows, stdout
    assert len({r[0] for r in rows}) == len(rows), rows
    return {r[0]: r[1:] for r in rows}


def missing_import_file(tmp_path: Path) -> Path:
    path = tmp_path / "test_needs_more.py"
    path.write_text("import numpy\nimport no_such_module_here\n\n\ndef test_never_run():\n    pass\n")
    return path


@pytest.mark.skipif(device_count() > 0, reason="a GPU is here: the script would run its checks")
def test_without_a_gpu_it_stops_at_once(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT)], env=job_env(OUT=str(tmp_path / "out"), PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=60)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("tests/gpu_check.sh: no usable GPU here, nothing checked: ") and "cupy" in lines[0]
    assert not (tmp_path / "out").exists()


def test_python3_by_default_and_jax_on_the_cpu():
    """On the GPU machines' image `python` is not there, and JAX's GPU backend would take 75% of the GPU."""
    text = SCRIPT.read_text()
    assert "\nPYTHON=${PYTHON:-python3}\n" in text and "\nexport JAX_PLATFORMS=cpu " in text


def test_tests_left_out_and_a_failing_step(tmp_path):
    """The test steps run tests/run.py without pytest-mpi on 1 and 2 ranks (the small file's tests pass
    on each, marked `mpi` as they are); a file whose imports are missing is left out with one line; a
    step that exits 3 reads FAIL(3) and the script exits 1."""
    out = tmp_path / "out"
    missing = missing_import_file(tmp_path)
    # (the benchmark with an argument benchmarks/gpu.py refuses: exit 2)
    cmd, env = stand_in(tmp_path, out, f"tests/test_top_k_modules.py {missing}", GPU_CHECK_BENCH_ARGS="--fail-here")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    rows = table(proc.stdout, out)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {k: r[0] for k, r in rows.items()} == {"tests-1rank": "PASS", "tests-2ranks": "PASS", "benchmark": "FAIL(2)"}
    assert all(re.fullmatch(r"7 passed in [\d.]+s", rows[k][2]) for k in STEPS[:2]), rows
    assert [line for line in proc.stderr.splitlines() if "left out" in line] == \
        [f"left out {missing}: no module no_such_module_here here"], proc.stderr
    assert "test_needs_more" not in (out / "tests-1rank.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{s}.log" for s in STEPS] + ["rows.txt"])


def test_every_file_left_out_runs_no_tests(tmp_path):
    """Where every listed file is left out, no test step runs (tests/run.py would run all of tests/):
    both read NO FILES, and the script exits 1; a failing benchmark reads FAIL(3)."""
    out = tmp_path / "out"
    cmd, env = stand_in(tmp_path, out, str(missing_import_file(tmp_path)), FAKE_STEPS="fail")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert {k: r[0] for k, r in table(proc.stdout, out).items()} == \
        {"tests-1rank": "NO FILES", "tests-2ranks": "NO FILES", "benchmark": "FAIL(3)"}


def test_stopped_mid_run_the_rows_so_far_stay(tmp_path):
    """TERM while the benchmark runs: the benchmark is stopped (no process of it left), its row reads
    KILLED, the rows before it stay, the table is printed and the script exits 143."""
    out = tmp_path / "out"
    cmd, env = stand_in(tmp_path, out, FAKE_STEPS="sleep")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rows = out / "rows.txt"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (rows.exists() and len(rows.read_text().splitlines()) == 2):
        time.sleep(0.1)
    time.sleep(1)  # (the benchmark under way)
    proc.send_signal(signal.SIGTERM)
    try:
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()  # (if it did not stop)
    assert proc.returncode == 143, stdout + stderr
    got = table(stdout, out)
    assert {k: r[0] for k, r in got.items()} == {"tests-1rank": "PASS", "tests-2ranks": "PASS", "benchmark": "KILLED"}
    assert int(got["benchmark"][1]) < 10 and list(got)[-1] == "benchmark", got
    left = subprocess.run(["pgrep", "-f", "sleep 100"], capture_output=True, text=True).stdout.split()
    mine = [pid for pid in left if str(tmp_path) in Path(f"/proc/{pid}/environ").read_text(errors="replace")]
    assert mine == [], mine


def test_steps_logs_and_table(tmp_path):
    pytest.importorskip("torch", reason="PyTorch is not installed (benchmarks/gpu.py needs it)")
    out = tmp_path / "out"
    proc = subprocess.run(*stand_in(tmp_path, out), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{s}.log" for s in STEPS] + ["rows.txt"])
    rows = table(proc.stdout, out)
    assert {k: r[0] for k, r in rows.items()} == {s: "PASS" for s in STEPS}, proc.stdout
    assert all(re.fullmatch(r"7 passed in [\d.]+s", rows[k][2]) for k in STEPS[:2]), rows
    one = r"[\d.]+/[\d.]+ ms \([\d.]+x\), compiled [\d.]+ ms \([\d.]+x\)"
    prof = r"kernels n/a of [\d.]+ ms, \d+ ops, n/a kernels"
    assert re.fullmatch(rf"fp32 {one}; bf16 {one}; fp32 eager {prof}; fp32 compiled {prof}; bf16 eager {prof}; "
                        rf"bf16 compiled {prof}", rows["benchmark"][2]), rows
