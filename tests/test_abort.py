"""An uncaught exception on one rank ends the whole job promptly, with its traceback printed: once for
the ranks that raised the same, with the program's frames only (under mpiexec, and in one process
without it)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional

import pytest
from mpi4py import MPI

from mpimesh.launch import find_mpiexec, job_env

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                reason="spawns its own 2-rank job; runs in the 1-rank session")


PACKAGE = str(ROOT / "mpimesh") + "/"


def _run(tmp_path: Path, body: str, ranks: Optional[int] = 2, **extra) -> tuple[subprocess.CompletedProcess, float]:
    """Run `body` as a script on `ranks` ranks under mpiexec (None: one process without it), with the
    mpimesh variables of this environment that change what is printed unset, plus `extra`."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env = {k: v for k, v in job_env(PYTHONPATH=str(ROOT), **extra).items()
           if k in extra or k not in ("MPIMESH_DEBUG", "MPIMESH_NO_ABORT")}
    launch = [] if ranks is None else [find_mpiexec(), "-n", str(ranks)]
    start = time.monotonic()
    proc = subprocess.run([*launch, sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=120)
    return proc, time.monotonic() - start


def test_exception_on_one_rank_aborts_all(tmp_path):
    proc, seconds = _run(tmp_path, """
        import mpimesh as mm
        mesh = mm.Mesh("all:2")
        if mesh.rank == 1:
            raise RuntimeError("boom on rank 1")
        mesh.barrier()  # rank 0 would wait here forever without the abort
    """)
    assert proc.returncode != 0
    assert proc.stderr.count("RuntimeError: boom on rank 1") == 1, proc.stderr
    assert "mpimesh: uncaught exception on rank 1; aborting all ranks\nTraceback" in proc.stderr, proc.stderr
    assert seconds < 60  # (rank 0, in the barrier, never answers: rank 1 prints its own after 2 s)


def test_clean_job_exits_zero(tmp_path):
    proc, _ = _run(tmp_path, """
        import mpimesh as mm
        mesh = mm.Mesh("all:2", layout="a:all")
        x = mesh.ones("a:4")
        assert float(mm.reduce_sum(x).to_numpy()) == 4.0
    """)
    assert proc.returncode == 0, proc.stderr


def test_exception_before_any_mesh_aborts_all(tmp_path):
    # The guard is in force from `import mpimesh`: rank 1 dies opening a missing file before any Mesh
    # exists, and rank 0, already waiting in a plain MPI barrier, is taken down too.
    proc, seconds = _run(tmp_path, """
        import mpimesh as mm
        if mm.MPI.COMM_WORLD.Get_rank() == 1:
            open("/nonexistent/mpimesh-input.txt")
        mm.MPI.COMM_WORLD.Barrier()
    """)
    assert proc.returncode != 0
    assert "uncaught exception on rank 1" in proc.stderr
    assert "mpimesh-input.txt" in proc.stderr
    assert seconds < 60


def test_opt_out_keeps_pythons_hook(tmp_path):
    proc, _ = _run(tmp_path, """
        import os, sys
        os.environ["MPIMESH_NO_ABORT"] = "1"
        import mpimesh
        assert not getattr(sys.excepthook, "_mpimesh", False)
    """)
    assert proc.returncode == 0, proc.stderr


def test_a_rank_whose_abort_hangs_ends_itself_and_says_so():
    """`mpimesh.abort.end_self_after`: the watchdog kills a process that outlives its grace."""
    code = "import time; from mpimesh.abort import end_self_after; end_self_after(0.5, 7); time.sleep(60)"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], env=job_env(PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == -9 and time.monotonic() - t0 < 10, (r.returncode, r.stderr)
    assert "mpimesh: rank 7: MPI_Abort did not end this process within 0.5 s" in r.stderr


_BAD_EINSUM = """
    import mpimesh as mm
    mesh = mm.Mesh("all:{n}")
    x, w = mesh.ones("batch:4;hidden:8"), mesh.ones("hidden:8;out:2")
    {before}
    y = mm.einsum([x, w], output_shape="batch:4;hiden:8")
"""
_SAID = "ShapeError: output dim 'hiden' (size 8) is in no input"


def test_the_same_error_on_4_ranks_prints_once(tmp_path):
    """A ShapeError (a typo in an output dim) on every rank: one traceback, for ranks 0-3, with the
    program's line and the message, not mpimesh's internals (4 interleaved tracebacks before, each
    with mpimesh's frames without a launcher)."""
    proc, seconds = _run(tmp_path, _BAD_EINSUM.format(n=4, before="pass"), ranks=4)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 60
    assert out.count(_SAID) == 1, out
    assert "mpimesh: uncaught exception on ranks 0-3 (the same on each); aborting all ranks\nTraceback" in out, out
    assert out.count('job.py", line 6') == 1 and out.count("Traceback") == 1, out
    assert PACKAGE not in out, out


def test_ranks_that_fail_differently_each_print_their_own(tmp_path):
    proc, _ = _run(tmp_path, _BAD_EINSUM.format(n=4, before='if mesh.rank == 2: raise ValueError("only rank two")'),
                   ranks=4)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count(_SAID) == 1 and "uncaught exception on ranks 0-1, 3 (the same on each)" in out, out
    assert out.count("ValueError: only rank two") == 1 and "uncaught exception on rank 2; aborting" in out, out
    assert out.count("Traceback") == 2 and PACKAGE not in out, out


def test_an_mpimesh_error_shows_the_programs_frames_only(tmp_path):
    """2 ranks: one traceback for both, whose one frame is the program's line."""
    proc, _ = _run(tmp_path, _BAD_EINSUM.format(n=2, before="pass"))
    assert proc.returncode != 0
    assert proc.stderr.count(_SAID) == 1 and "on ranks 0-1 (the same on each)" in proc.stderr, proc.stderr
    assert proc.stderr.count('job.py", line 6') == 1 and PACKAGE not in proc.stderr, proc.stderr


def test_one_process_without_a_launcher_is_trimmed(tmp_path):
    """`python job.py`: Python's own output, without mpimesh's frames (mesh.py's line showed before)
    and with no abort."""
    proc, _ = _run(tmp_path, """
        import mpimesh as mm
        mesh = mm.Mesh("all:4")
    """, ranks=None)
    assert proc.returncode == 1 and proc.stderr.startswith("Traceback (most recent call last):\n"), proc.stderr
    assert 'job.py", line 3, in <module>' in proc.stderr and "MeshError: mesh [all:4] has 4 processors" in proc.stderr
    assert PACKAGE not in proc.stderr and "aborting" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 5, proc.stderr  # header, frame, its line, carets, message


def test_an_error_from_inside_mpimesh_names_where_and_debug_shows_all(tmp_path):
    """An error that is not mpimesh's own (here a TypeError) raised inside mpimesh: the program's frames,
    then a line naming the place inside; MPIMESH_DEBUG=1 leaves the traceback whole. A function the
    program hands mpimesh (a remat block) keeps its frames."""
    body = """
        import mpimesh as mm
        mesh = mm.Mesh("all:1")
        x = mesh.ones("a:2")
        with mm.trace():
            y = mm.remat(lambda t: mm.einsum(None, "a:2"))(x)
    """
    proc, _ = _run(tmp_path, body, ranks=None)
    lines = proc.stderr.strip().splitlines()
    assert "TypeError: einsum takes a list of tensors, got a NoneType" in lines[-2], proc.stderr
    assert lines[-1].startswith("(raised inside mpimesh at ops/einsum.py:") and "MPIMESH_DEBUG=1" in lines[-1]
    assert 'job.py", line 6, in <module>' in proc.stderr and 'job.py", line 6, in <lambda>' in proc.stderr
    assert PACKAGE not in proc.stderr, proc.stderr
    proc, _ = _run(tmp_path, body, ranks=None, MPIMESH_DEBUG="1")
    assert f"{PACKAGE}ops/einsum.py" in proc.stderr and f"{PACKAGE}remat.py" in proc.stderr, proc.stderr
    assert "(raised inside mpimesh" not in proc.stderr
