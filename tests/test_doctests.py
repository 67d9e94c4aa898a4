"""The examples in the package's docstrings run and print what they show (they use COMM_SELF meshes,
so every rank runs them alone). Every module must have at least one: a module without examples fails
here instead of passing with nothing checked. `mpimesh.tpu` runs under the JAX test flags."""
from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import jaxenv  # noqa: F401  (before jax: host devices, quick compiles)

import mpimesh

MODULES = sorted(m.name for m in pkgutil.walk_packages(mpimesh.__path__, "mpimesh."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if name.startswith("mpimesh.tpu"):
        pytest.importorskip("jax")
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
