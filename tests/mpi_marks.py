"""What the suite takes from pytest-mpi, for machines without it (tests/run.py loads this plugin
there, `-p mpi_marks`, in place of `--with-mpi`): the `mpi` marker registered, and a test marked
`mpi(min_size=N)` skipped on fewer than N ranks. The suite uses nothing else of pytest-mpi (no
`mpi_tmp_path`, no `--only-mpi`); every test runs, marked or not, as under `--with-mpi`.

>>> from types import SimpleNamespace as NS
>>> item = NS(iter_markers=lambda name: [NS(kwargs={"min_size": 3})])
>>> ranks_short(item, size=2)
'needs 3 MPI ranks, only 2 here'
>>> ranks_short(item, size=4) is None
True
"""
from __future__ import annotations

from typing import Optional

import pytest


def ranks_short(item, size: int) -> Optional[str]:
    """Why `item` cannot run on `size` ranks (its `mpi(min_size=N)` marks), or None."""
    for mark in item.iter_markers(name="mpi"):
        need = mark.kwargs.get("min_size")
        if need is not None and size < need:
            return f"needs {need} MPI ranks, only {size} here"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mpi: runs under mpiexec on every rank; mpi(min_size=N): on N ranks or more")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if any(True for _ in item.iter_markers(name="mpi")):
        from mpi4py import MPI  # here, not at the top: collecting must not initialise MPI
        why = ranks_short(item, MPI.COMM_WORLD.Get_size())
        if why is not None:
            pytest.skip(why)
