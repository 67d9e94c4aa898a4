"""tests/jaxenv.py adds only the XLA flags that the installed backends accept: a flag XLA does not know
ends the process that imports jax (where JAX's CUDA plugin is installed, collecting tests/test_tpu.py
ended pytest with exit status 1 and no output). Simulated here by a backend that rejects the CPU
backend's fusion flag, as that plugin does; the flags come out without it and JAX runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

import jaxenv

pytest.importorskip("jax", reason="JAX is not installed")
pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="child processes; the 1-rank session runs it")

HERE = Path(__file__).resolve().parent
DEVICES = "--xla_force_host_platform_device_count=8"
FUSION = "--xla_cpu_use_fusion_emitters=false"
KEPT = "MPIMESH_TEST_XLA_FLAGS"  # jaxenv's verdict, inherited by child processes
# Loaded at start-up from PYTHONPATH: `import jax` ends the process, as XLA does, if XLA_FLAGS has the flag.
REJECTS_FUSION = f'''
import os, sys

class _Backend:
    def find_spec(self, name, path=None, target=None):
        if name == "jax" and "{FUSION.split("=")[0]}" in os.environ.get("XLA_FLAGS", ""):
            sys.stderr.write("parse_flags_from_env.cc] Unknown flag in XLA_FLAGS: {FUSION}\\n")
            os._exit(1)

sys.meta_path.insert(0, _Backend())
'''


def _env(tmp_path: Path, **extra: str) -> dict:
    (tmp_path / "sitecustomize.py").write_text(REJECTS_FUSION)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", KEPT)}
    return dict(env, PYTHONPATH=os.pathsep.join([str(tmp_path), str(HERE)]), **extra)


def test_a_flag_xla_does_not_know_is_left_out():
    assert jaxenv.accepted([DEVICES, "--xla_mpimesh_no_such_flag=1"], "") == [DEVICES]


def test_flags_a_backend_rejects_are_left_out(tmp_path):
    code = "import jaxenv, os, jax; print(len(jax.devices())); print(os.environ['XLA_FLAGS'])"
    proc = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    devices, flags = proc.stdout.split("\n")[:2]
    assert devices == "8" and DEVICES in flags.split() and "xla_cpu_use_fusion_emitters" not in flags, proc.stdout


def test_the_verdict_is_kept_for_child_processes(tmp_path):
    """A child takes the parent's verdict (here: no flag accepted) instead of trying again, and does not
    repeat flags that XLA_FLAGS already has."""
    code = "import jaxenv, os; print(os.environ['XLA_FLAGS'])"
    env = _env(tmp_path, XLA_FLAGS="--xla_dump_to=/dev/null")
    env[KEPT] = ""
    kept_none = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert kept_none.stdout.strip() == "--xla_dump_to=/dev/null", kept_none.stderr[-2000:]
    env.update({KEPT: DEVICES, "XLA_FLAGS": DEVICES})
    inherited = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert inherited.stdout.strip() == DEVICES, inherited.stderr[-2000:]
