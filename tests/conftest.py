"""Test-session setup shared by every test module.

Under ``tests/run.py`` (which sets ``MPIMESH_TEST_QUIET_NONZERO=1``) every rank runs pytest, but only
rank 0 reports live; the other ranks buffer their report and print it, headed by their rank, only if
their session failed. Without that variable (e.g. a hand-run ``mpiexec -n 2 python -m pytest``) every
rank reports as usual.

Hypothesis runs under the "mpi" profile: every rank must draw the same examples in the same order, or
the ranks' collectives stop matching and the run hangs. So examples are derandomized (seeded by the
test, identical on all ranks), no shared example database is replayed, and the timing-based checks
(deadline, too_slow), which could fail on one rank only, are off.
"""
from __future__ import annotations

import io
import os
import sys
import tempfile

import pytest

# the flight records of the jobs tests end on purpose (time-outs, divergences) go here, not into the checkout
os.environ.setdefault("MPIMESH_FLIGHT_DIR", os.path.join(tempfile.gettempdir(), "mpimesh-test-flight"))

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is only in the [test] extra
    pass
else:
    settings.register_profile("mpi", derandomize=True, database=None, deadline=None,
                              suppress_health_check=list(HealthCheck), print_blob=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "mpi"))

_QUIET = os.environ.get("MPIMESH_TEST_QUIET_NONZERO") == "1"
_buffer = io.StringIO()
_failed = False


def _world_rank() -> int:
    """This process's rank, read from the launcher's environment, so MPI need not be initialised."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if not _QUIET or _world_rank() == 0:
        return
    live = config.pluginmanager.get_plugin("terminalreporter")
    if live is None:  # -p no:terminal
        return
    config.pluginmanager.unregister(live, "terminalreporter")
    config.pluginmanager.register(pytest.TerminalReporter(config, _buffer), "terminalreporter")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _failed
    _failed = exitstatus != 0


def pytest_unconfigure(config: pytest.Config) -> None:
    if _QUIET and _failed and _buffer.getvalue():
        rank, report = _world_rank(), _buffer.getvalue().rstrip("\n")
        # One write, so the launcher does not interleave it with other ranks' output.
        sys.stdout.write(f"\n{'>' * 25} rank {rank} report {'>' * 25}\n{report}\n"
                         f"{'<' * 25} end of rank {rank} report {'<' * 18}\n")
        sys.stdout.flush()


@pytest.fixture(name="checked")
def checked_fixture():
    """The SPMD check on for one test (`mm.set_spmd_check`), as it was again afterwards (a session
    run with MPIMESH_SPMD_CHECK=1 keeps it on)."""
    import mpimesh as mm  # here, not at the top: collecting must not initialise MPI
    from mpimesh.collectives import guard
    was = guard.settings()["check"]
    mm.set_spmd_check(True)
    try:
        yield
    finally:
        mm.set_spmd_check(was)
