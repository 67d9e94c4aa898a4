"""Import before jax in a test module: 8 host devices, and quick compiles (XLA's compile time
dominates the JAX tests; the numerics are the same): little LLVM optimisation, and no fusion
emitters. Flags already in XLA_FLAGS are kept.

An XLA that meets a flag it does not know ends the process (where JAX's CUDA plugin is installed,
collecting the JAX tests ended pytest with no output). So only the flags the installed backends
accept are added: tried once, in a child process (`import jax`, its devices, one compiled op), all
together and, if that fails, each on its own; a flag that fails alone is left out. The verdict is
kept in MPIMESH_TEST_XLA_FLAGS, so that child processes do not try again.

>>> accepted([], "")
[]
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from typing import List

KEPT = "MPIMESH_TEST_XLA_FLAGS"  # the flags this module found accepted (maybe none), for child processes
_PROBE = "import jax, jax.numpy as jnp; jax.devices(); jax.jit(lambda x: x + 1)(jnp.ones(2)).block_until_ready()"


def _ok(flags: List[str], have: str) -> subprocess.Popen:
    """A child process that exits 0 if JAX works with XLA_FLAGS=`have` plus `flags`."""
    env = dict(os.environ, XLA_FLAGS=" ".join([have, *flags]).strip())
    return subprocess.Popen([sys.executable, "-c", _PROBE], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _passed(proc: subprocess.Popen) -> bool:
    try:
        return proc.wait(timeout=300) == 0
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def accepted(flags: List[str], have: str) -> List[str]:
    """`flags` less those that make JAX fail next to `have` (the XLA_FLAGS already set)."""
    if not flags or _passed(_ok(flags, have)):
        return flags
    alone = [(f, _ok([f], have)) for f in flags]  # in parallel
    return [f for f, proc in alone if _passed(proc)]


def _xla_flags() -> str:
    have = os.environ.get("XLA_FLAGS", "")
    if KEPT not in os.environ:
        flags = {"xla_force_host_platform_device_count": "8", "xla_backend_optimization_level": "0",
                 "xla_llvm_disable_expensive_passes": "true", "xla_cpu_use_fusion_emitters": "false"}
        wanted = [f"--{k}={v}" for k, v in flags.items() if k not in have]
        found = importlib.util.find_spec("jax") is not None  # without JAX the test modules skip
        os.environ[KEPT] = " ".join(accepted(wanted, have) if found else wanted)
    kept = [f for f in os.environ[KEPT].split() if f[2:].split("=")[0] not in have]  # a child has them already
    return " ".join([have, *kept]).strip()


os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = _xla_flags()
