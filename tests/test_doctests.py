"""The examples in the package's docstrings run and print what they show. They use COMM_SELF meshes, so
they run in the 1-rank session only (each rank of a larger job would run them alone, again). Every
module must have at least one: a module without examples fails here instead of passing with nothing
checked. `mpimesh.tpu` runs under the JAX test flags."""
from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
from mpi4py import MPI

import jaxenv  # noqa: F401  (before jax: host devices, quick compiles)

import mpimesh

MODULES = sorted(m.name for m in pkgutil.walk_packages(mpimesh.__path__, "mpimesh."))


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="COMM_SELF examples: the 1-rank session runs them")
@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, monkeypatch):
    monkeypatch.setenv("MPIMESH_BACKEND", "numpy")  # the examples show numpy meshes, also under --backend cupy
    if name.startswith("mpimesh.tpu"):
        pytest.importorskip("jax")
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
