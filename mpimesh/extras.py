"""Optional packages (jax, cupy, matplotlib, ipyparallel): imported when a feature needs one, and
when missing, one line naming the extra that installs it.

>>> require("json", "test", "this example").__name__
'json'
>>> require("no_such_package_here", "tpu", "mm.tpu.replay")
Traceback (most recent call last):
...
mpimesh.errors.MissingDependencyError: mm.tpu.replay needs no_such_package_here, which is not installed: run `python3 install.py tpu` in the mpimesh checkout (or pip install -e ".[tpu]")
"""
from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError


def require(module: str, extra: str, what: str) -> ModuleType:
    """`import module`, or a `MissingDependencyError` saying that `what` needs it and which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(f"{what} needs {module.split('.')[0]}, which is not installed: run "
                                     f"`python3 install.py {extra}` in the mpimesh checkout (or pip install -e "
                                     f"\".[{extra}]\")") from None
