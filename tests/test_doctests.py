"""The examples in the package's docstrings run and print what they show (they use COMM_SELF meshes,
so every rank runs them alone)."""
from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import mpimesh

MODULES = sorted(m.name for m in pkgutil.walk_packages(mpimesh.__path__, "mpimesh.")
                 if not m.name.startswith("mpimesh.tpu"))  # jax: tested in test_tpu.py


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
