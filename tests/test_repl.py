"""The SPMD REPL driven as a user would: statements piped into `mpiexec -n 4 python -m mpimesh.repl`,
and typed into a pseudo-terminal (the `mpimesh-repl -n N` front end, and a bare mpiexec) with
multi-line input, Ctrl-C at the prompt and during a statement, an error on one rank, Ctrl-D and
exit(), and rank 0 stuck in a collective (Ctrl-C, SIGTERM). Values are checked against numpy computed
here; tracebacks show the statements' frames, not mpimesh's; every job must end with all its ranks."""
from __future__ import annotations

import ast
import contextlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pexpect
import psutil
import pytest
from mpi4py import MPI

from mpimesh.launch import find_mpiexec, is_open_mpi, job_env
from mpimesh.repl import Session, format_reports

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "mpimesh") + "/"
ENV = job_env(PYTHONPATH=str(ROOT), MPIEXEC_TIMEOUT="120", MPIMESH_DEBUG="0")  # (tests/run.py's 1: whole tracebacks)
spawns = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                            reason="starts its own MPI job; runs in the 1-rank session")

X = np.arange(24.0).reshape(4, 6)
W = (np.arange(18.0).reshape(6, 3) - 7) / 4


def setup(mesh_shape: str) -> list[str]:
    """Statements that define x, w and their einsum y on a mesh of `mesh_shape`."""
    return [f'mesh = mm.Mesh("{mesh_shape}", layout="batch:rows;hidden:cols")', *_TENSORS]


_TENSORS = [
    f'x = mesh.from_numpy(np.array({X.tolist()}), "batch:4;hidden:6")',
    f'w = mesh.from_numpy(np.array({W.tolist()}), "hidden:6;out:3")',
    'y = mm.einsum([x, w], "batch:4;out:3")',
]


def _spawn(args: list[str]) -> pexpect.spawn:
    child = pexpect.spawn(args[0], args[1:], env=ENV, cwd=str(ROOT), encoding="utf-8", timeout=60,
                          dimensions=(50, 200))
    child.expect(">>> ")
    return child


def _ended(child: pexpect.spawn) -> int:
    """Wait for the job to end; its exit status."""
    child.expect(pexpect.EOF, timeout=60)
    child.close()
    return child.exitstatus


def _rank_0_alone_in_a_collective(child: pexpect.spawn) -> list[psutil.Process]:
    """Make rank 0 of the 2-rank session `child` enter a collective that rank 1 skips (rank 1 reports
    and waits for the next statement); the job's processes (launcher, ranks), for `_left_running`."""
    child.sendline('mesh = mm.Mesh("rows:2")')
    child.expect(">>> ")
    child.sendline('if rank == 0: print("rank 0 alone"); mesh.collectives.allreduce(np.ones(2), ["rows"])')
    child.sendline("")
    child.expect("\nrank 0 alone")
    time.sleep(1)  # in MPI now, where Python's signal handlers never run
    return psutil.Process(child.pid).children(recursive=True)


def _left_running(job: list[psutil.Process], timeout: float) -> list[str]:
    """The command lines of the processes of `job` still running after up to `timeout` s; they are
    killed, so that nothing a test starts outlives it (as tests/test_notebook.py checks its engines)."""
    def running(proc: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):  # gone
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        return False

    deadline = time.monotonic() + timeout
    while (alive := [proc for proc in job if running(proc)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    names = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            names.append(" ".join(proc.cmdline()))
            proc.kill()
    return names


@spawns
def test_piped_statements_on_4_ranks():
    script = "\n".join(setup("rows:2;cols:2") + [
        "y",
        "print(y.to_numpy().tolist())",
        "print('rank', rank)",
        "for i in range(2):",
        "    print('loop', i)",
        "",
        "if rank == 2:",
        "    raise ValueError('bad on rank two')",
        "",
        'mm.einsum([x, w], "batch:4;nope:5")',
        "print('still here', size)",
        "exit()",
    ]) + "\n"
    start = time.monotonic()
    proc = subprocess.run([find_mpiexec(), "-n", "4", sys.executable, "-m", "mpimesh.repl"], input=script,
                          env=ENV, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert time.monotonic() - start < 100
    assert out.count("SPMD REPL on 4 ranks") == 1
    # the repr: names, dtype, layout and mesh, once, and the gathered values
    head = "DistTensor [batch:4, out:3] float64, layout {batch: rows}, mesh [rows:2, cols:2]"
    assert out.count(head) == 1
    preview = out.split(head + "\n")[1].split(">>>")[0]
    numbers = [float(v) for v in re.findall(r"-?\d+\.?\d*(?:e[-+]?\d+)?", preview)]
    np.testing.assert_allclose(np.array(numbers).reshape(4, 3), X @ W, rtol=1e-6)
    printed = next(line for line in out.split("\n") if line.lstrip("> ").startswith("[[") and "," in line)
    np.testing.assert_allclose(np.array(ast.literal_eval(printed.lstrip("> "))), X @ W)
    # rank 0's output once, the others' only where they differ, labelled
    assert re.search(r"(^|> )rank 0$", out, re.M) and out.count("rank 0\n") == 1
    for r in (1, 2, 3):
        assert f"[rank {r}] rank {r}" in out
    assert out.count("loop 0") == 1 and out.count("loop 1") == 1
    # an error on one rank: shown with its number; an error on every rank: shown once, unlabelled
    assert "[rank 2] ValueError: bad on rank two" in out
    assert "[rank 0] ValueError" not in out and "[rank 1] ValueError" not in out
    assert out.count("Error") >= 2 and "nope" in out
    assert not re.search(r"\[ranks? [0-9,]+\] \w*Error: .*nope", out)
    assert PACKAGE not in out, out  # tracebacks show the statements' frames, not mpimesh's
    assert "still here 4" in out


@spawns
@pytest.mark.parametrize("tail, shown", [("for i in range(2):\n    print('loop', i)\n", ["loop 0", "loop 1"]),
                                         ("for i in range(2):\n", ["IndentationError: expected an indented block"])])
def test_input_that_ends_inside_a_block_runs_it(tail, shown):
    """Piped input whose last statement is a block with no blank line after it: the block runs (it
    was dropped without a word), or an unfinished one is its SyntaxError, as Python's own REPL."""
    proc = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, "-m", "mpimesh.repl"],
                          input="print('first')\n" + tail, env=ENV, cwd=str(ROOT), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "first" in proc.stdout and all(proc.stdout.count(w) == 1 for w in shown), proc.stdout + proc.stderr


@pytest.mark.parametrize("launcher, words", [("no_such_launcher_zz -n {n}", "no program 'no_such_launcher_zz'"),
                                             ("srun -n {n} --x={y}", "unknown field {y}"),
                                             ("mpiexec -n {}", "the one field is {n}"),
                                             ('srun -n {n} "', "No closing quotation")])
def test_a_bad_launcher_is_one_error_line(launcher, words):
    proc = subprocess.run([sys.executable, "-m", "mpimesh.repl", "-n", "2", "--launcher", launcher], env=ENV,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("mpimesh-repl: error: --launcher") and words in proc.stderr


@spawns
def test_terminal_front_end_multiline_ctrl_c_and_ctrl_d():
    script = Path(sys.executable).parent / "mpimesh-repl"  # the console script pip installs
    assert script.exists(), f"no {script}: install the package (pip install -e .)"
    child = _spawn([str(script), "-n", "2"])
    try:
        for line in setup("rows:1;cols:2") + ["import time"]:
            child.sendline(line)
            child.expect(">>> ")
        child.sendline("def total(t):")
        child.expect(r"\.\.\. ")
        child.sendline("    return float(mm.reduce_sum(t).to_numpy())")
        child.expect(r"\.\.\. ")
        child.sendline("")
        child.expect(">>> ")
        child.sendline("print(total(y))")
        child.expect(r"(-?\d+\.\d+)\r\n")
        assert float(child.match.group(1)) == pytest.approx((X @ W).sum())
        child.expect(">>> ")
        # Ctrl-C at a continuation prompt drops the unfinished statement
        child.sendline("for i in range(3):")
        child.expect(r"\.\.\. ")
        child.sendintr()
        child.expect("KeyboardInterrupt")
        child.expect(">>> ")
        # Ctrl-C during a statement stops it on every rank, as often as needed
        for _ in range(2):
            child.sendline("time.sleep(60)")
            time.sleep(1.5)
            child.sendintr()
            child.expect("KeyboardInterrupt")
            child.expect(">>> ", timeout=15)
            assert "[rank" not in child.before  # the same on both ranks: shown once
        child.sendline("print('alive', rank + 40)")
        child.expect("alive 40")
        child.expect(">>> ")
        child.sendeof()
        assert _ended(child) == 0
    finally:
        child.terminate(force=True)


@spawns
def test_bare_mpiexec_in_a_terminal():
    if is_open_mpi(find_mpiexec()):
        pytest.skip("Open MPI's mpiexec ends the job at the first Ctrl-C (mpimesh-repl sends SIGUSR1, which it forwards)")
    child = _spawn([find_mpiexec(), "-n", "2", sys.executable, "-m", "mpimesh.repl"])
    try:
        child.sendline("z = 5")
        child.expect(">>> ")
        child.sendintr()  # MPICH forwards the first Ctrl-C to the ranks (and ends the job at a second)
        child.expect("KeyboardInterrupt")
        child.expect(">>> ")
        child.sendline("print(z * size)")
        child.expect("10")
        child.expect(">>> ")
        child.sendline("exit()")
        assert _ended(child) == 0
    finally:
        child.terminate(force=True)


@spawns
def test_ranks_stuck_in_a_collective_end_the_job():
    child = _spawn([sys.executable, "-m", "mpimesh.repl", "-n", "3"])
    try:
        child.sendline("from mpi4py import MPI")
        child.expect(">>> ")
        child.sendline("if rank != 0: MPI.COMM_WORLD.Barrier()  # rank 0 never joins")
        child.sendline("")
        time.sleep(1.5)
        child.sendintr()
        child.expect(r"ranks 1,2 did not stop", timeout=30)
        assert _ended(child) != 0
    finally:
        child.terminate(force=True)


@spawns
def test_ctrl_c_frees_rank_0_from_a_collective_the_others_skipped():
    """The collective is polled, so the interrupt lands in it. Its transfer cannot be cancelled: the
    mesh is unusable from then on, on rank 0 and (told by rank 0) on rank 1, each with a clear error
    instead of a hang; a new mesh works, and the session ends normally."""
    child = _spawn([sys.executable, "-m", "mpimesh.repl", "-n", "2"])
    try:
        _rank_0_alone_in_a_collective(child)
        child.sendintr()  # SIGUSR1 to every rank: rank 1 is idle, rank 0 is in the collective
        child.expect(r"KeyboardInterrupt.*\n>>> ", timeout=5)
        assert child.before.count('File "') == 1 and PACKAGE not in child.before, child.before  # the statement's
        child.sendline('mesh.collectives.allreduce(np.ones(2), ["rows"])')
        child.expect(r"\n>>> ", timeout=10)
        shown = child.before
        assert re.search(r"CollectiveTimeoutError: this mesh is unusable after an earlier failed collective: .*"
                         r"was interrupted before it completed", shown), shown
        assert re.search(r"\[rank 1\] .*CollectiveTimeoutError: this mesh is unusable: rank 0: it abandoned this "
                         r"mesh", shown), shown
        # each rank's traceback is the statement's one frame, not ~20 of mpimesh's
        assert shown.count('File "<stdin>", line 1, in <module>') == shown.count('File "') == 2, shown
        assert PACKAGE not in shown, shown
        child.sendline('print(mm.Mesh("rows:2").collectives.allreduce(np.ones(2), ["rows"]))')
        child.expect(r"\[2\. 2\.\]", timeout=10)
        child.expect(">>> ")
        child.sendline("exit()")
        assert _ended(child) == 0
    finally:
        child.terminate(force=True)


@spawns
def test_sigterm_to_the_front_end_ends_the_job():
    child = _spawn([sys.executable, "-m", "mpimesh.repl", "-n", "2"])
    job: list[psutil.Process] = []
    try:
        job = _rank_0_alone_in_a_collective(child)
        assert len(job) >= 3, job  # the launcher and both ranks
        child.kill(signal.SIGTERM)
        child.expect(r"mpimesh-repl: SIGTERM: ending the job \(2 ranks\)", timeout=5)
        assert _ended(child) == 128 + signal.SIGTERM
        assert not _left_running(job, timeout=5)
    finally:
        child.terminate(force=True)
        _left_running(job, timeout=0)


def test_format_reports_groups_ranks():
    ok = ("same\n", None, None)
    tb = "Traceback (most recent call last):\nKeyError: 'k'\n"
    assert format_reports({0: ok, 1: ok}) == ""
    assert format_reports({0: ok, 1: ("other\n", None, None), 2: ("other\n", None, None), 3: ok}) == \
        "[ranks 1,2] other"
    assert format_reports({0: ("", tb, None), 1: ("", tb, None)}) == tb.rstrip("\n")
    assert format_reports({0: ok, 1: ("", tb, None)}) == \
        "[rank 1] Traceback (most recent call last):\n[rank 1] KeyError: 'k'"
    assert format_reports({0: ok, 1: ("", None, 0)}) == ""


def test_statement_runs_on_every_rank_with_its_output_and_error():
    """Session.run on the pytest job's own ranks (any rank count): output, display and traceback."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGUSR1)}
    try:
        session = Session()
    finally:  # the session's handlers would swallow pytest's Ctrl-C
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    out, err, code = session.run("rank * 10 + 1")
    assert (out, err, code) == (f"{MPI.COMM_WORLD.Get_rank() * 10 + 1}\n", None, None)
    out, err, code = session.run("{}['missing']")
    assert err is not None and err.endswith("KeyError: 'missing'\n") and "repl.py" not in err
    assert session.run("exit(3)")[2] == 3
