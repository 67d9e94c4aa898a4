"""Import before jax in a test module: 8 host devices, and quick compiles (XLA's compile time
dominates the JAX tests; the numerics are the same): little LLVM optimisation, and no fusion
emitters on a recent jaxlib. Flags already in XLA_FLAGS are kept."""
from __future__ import annotations

import os


def _xla_flags() -> str:
    flags = {"xla_force_host_platform_device_count": "8", "xla_backend_optimization_level": "0",
             "xla_llvm_disable_expensive_passes": "true"}
    try:
        from importlib.metadata import version
        if tuple(int(p) for p in version("jaxlib").split(".")[:2]) >= (0, 7):
            flags["xla_cpu_use_fusion_emitters"] = "false"
    except Exception:  # jaxlib missing (the module skips) or an odd version string
        pass
    have = os.environ.get("XLA_FLAGS", "")
    return " ".join([have] + [f"--{k}={v}" for k, v in flags.items() if k not in have]).strip()


os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = _xla_flags()
