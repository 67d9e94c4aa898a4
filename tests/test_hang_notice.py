"""No silent hang, even before the time-out: a rank whose collective has waited `MPIMESH_HANG_NOTICE`
seconds (30 by default) prints, once, where every rank of the mesh is: the public call and the
program's line, or "outside mpimesh"; and the time-out's error names the public call and, for a
call that looks local (`mm.save`, `to_numpy`), that every rank must make it.

The naming is checked in this process on every mpimesh frame a public call reaches (through a
profile hook); the notice and the error in jobs of their own (from the 1-rank session) in which
rank 0 alone calls `mm.save` or `to_numpy`, the PyTorch habit `if rank == 0: save(...)`.
"""
from __future__ import annotations

import gc
import importlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.collectives import callsite, guard
from mpimesh.launch import find_mpiexec, job_env

ROOT = Path(__file__).resolve().parents[1]
only_in_1_rank_session = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                            reason="starts processes of its own; runs in the 1-rank session")


# ---------------------------------------------------------------- which public call, which line

def _hook(seen: set):
    """A profile hook: `callsite.where_called` from every mpimesh frame that an mpimesh frame
    calls, into `seen` (where a collective asks, deep inside a public call)."""
    def hook(frame, event, arg):
        if (event == "call" and callsite._where_file(frame.f_code.co_filename) == 2
                and callsite._where_file(frame.f_back.f_code.co_filename) == 2):
            seen.add(callsite.where_called(frame))
    return hook


def _calls(fn) -> set:
    """What `_hook` sees while `fn()` runs (no garbage collection meanwhile: a finaliser it ran, such as
    an earlier test's mesh's `_release`, would be seen as a call of the program)."""
    seen: set = set()
    gc.collect()
    gc.disable()
    sys.setprofile(_hook(seen))
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return seen


def _here(fn) -> str:
    return f"{__file__}:{fn.__code__.co_firstlineno}"


@pytest.fixture
def mesh():
    return mm.Mesh("all:1", comm=MPI.COMM_SELF, layout="a:all")


def test_each_mpimesh_frame_names_the_programs_call_and_line(mesh, tmp_path):
    x = mesh.from_numpy(np.arange(4.0), "a:4")
    w = mesh.ones("a:4;b:2")
    cases = [  # (the call, as the program makes it; its public name; whether every rank must make it)
        (lambda: mm.save(str(tmp_path / "c"), {"x": x}), "mm.save", True),
        (lambda: mm.load(str(tmp_path / "c"), mesh), "mm.load", True),
        (lambda: x.to_numpy(), "DistTensor.to_numpy", True),
        (lambda: float(mm.reduce_sum(x)), None, None),  # two calls: checked below
        (lambda: repr(x), "DistTensor.__repr__", True),
        (lambda: mm.einsum([x, w], output_shape="b:2"), "mm.einsum", False),
        (lambda: x + x, "mm.add", False),
        (lambda: 2 - x, "DistTensor.__rsub__", False),  # one wrapper's code, shared by every r-method
        (lambda: mesh.ones("a:4"), "Mesh.ones", False),  # bound onto Mesh by creation.py
        (lambda: x.layout, "DistTensor.layout", False),  # a property
        (lambda: mm.checkpoint.prune(str(tmp_path / "r"), mesh, 1), "mm.checkpoint.prune", True),
    ]
    for fn, name, every in cases:
        if name is not None:
            assert _calls(fn) == {(name, _here(fn), every)}, name
    fn = cases[3][0]
    assert _calls(fn) == {("mm.reduce_sum", _here(fn), False), ("DistTensor.__float__", _here(fn), True)}


def test_a_context_managers_generator_is_named_by_its_with(mesh):
    """`with mm.profile():` runs mpimesh's generator under contextlib's frames: passed through, to
    the program's `with` line."""
    seen: set = set()
    hook = _hook(seen)
    sys.setprofile(hook)
    try:
        line = sys._getframe().f_lineno + 1
        with mm.profile():
            sys.setprofile(None)
            mesh.ones("a:2")  # (not seen)
            sys.setprofile(hook)
    finally:
        sys.setprofile(None)
    assert seen == {("mm.profile", f"{__file__}:{line}", False)}


def test_outside_mpimesh_there_is_no_public_call():
    line = sys._getframe().f_lineno + 1
    assert callsite.where_called() == ("mpimesh", f"{__file__}:{line}", False)
    assert callsite.called("mm.save", "t.py:3", True) == "mm.save (t.py:3), which every rank must call"


@pytest.mark.parametrize("path", sorted(callsite.EVERY_RANK))
def test_every_every_rank_call_exists_and_says_it_is_collective(path):
    """Each of `EVERY_RANK` names a function or method that exists and whose docstring says that
    every rank takes part (a renamed or moved function would silently lose the message's rule)."""
    module, _, name = path.rpartition(".")
    while module not in sys.modules:  # (a method: the class's module is a shorter prefix)
        module, _, cls = module.rpartition(".")
        name = f"{cls}.{name}"
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    doc = obj.__doc__ or ""
    assert "every rank" in doc or "a collective" in doc.lower(), (path, doc)


# ---------------------------------------------------------------- settings

def test_set_hang_notice_checks_its_value():
    try:
        mm.set_hang_notice(2)
        assert guard.settings()["notice"] == 2.0
        mm.set_hang_notice(None)
        assert guard.settings()["notice"] is None
        for bad in (0, -1, float("inf"), "5", True):
            with pytest.raises(mm.MpimeshError, match="hang notice must be a positive number of seconds or None"):
                mm.set_hang_notice(bad)
        assert guard.settings()["notice"] is None  # unchanged by the refused calls
    finally:
        guard.reset()


PROBE = """
import json
import mpimesh as mm
from mpimesh.collectives import guard
out = {"notice": guard._settings["notice"]}
try:
    mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
except mm.MpimeshError as e:
    out["mesh"] = str(e)
print(json.dumps(out))
"""


@only_in_1_rank_session
@pytest.mark.parametrize("raw,notice,error", [(None, 30.0, None), ("off", None, None), (" 0 ", None, None),
                                              ("2.5", 2.5, None), ("soon", 30.0, "is not a positive number"),
                                              ("-3", 30.0, "is not a positive number")])
def test_the_variable(raw, notice, error):
    env = {k: v for k, v in job_env(PYTHONPATH=str(ROOT)).items() if k != "MPIMESH_HANG_NOTICE"}
    if raw is not None:
        env["MPIMESH_HANG_NOTICE"] = raw
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    got = json.loads(proc.stdout)
    assert got["notice"] == notice
    if error:  # the import went on with the default; the first Mesh names the variable
        assert f"MPIMESH_HANG_NOTICE={raw!r} {error}" in got["mesh"], got
    else:
        assert "mesh" not in got


# ---------------------------------------------------------------- jobs with a rank-0-only call

HEADER = re.compile(r"^mpimesh: rank (\d+) has waited more than ([\d.]+) s in (.*)$", re.M)
WHERE = re.compile(r"^mpimesh:   ranks? ([\d, -]+): (.*)$", re.M)


def _job(tmp_path: Path, ranks: int, body: str, **env) -> tuple[subprocess.CompletedProcess, str, dict]:
    """Run `body` on `ranks` ranks (numpy meshes; the SPMD check off, as a program starts); the
    job's result, its script's path, and `{mark: line}` for each `# <mark>` comment in it."""
    script = tmp_path / "job.py"
    text = textwrap.dedent(body)
    script.write_text(text)
    lines = {m: i + 1 for i, line in enumerate(text.splitlines()) for m in re.findall(r"# <(\w+)>", line)}
    clean = {k: v for k, v in job_env(PYTHONPATH=str(ROOT), MPIMESH_BACKEND="numpy").items()
             if k not in ("MPIMESH_SPMD_CHECK", "MPIMESH_NO_ABORT", "MPIMESH_COLLECTIVE_TIMEOUT")}
    proc = subprocess.run([find_mpiexec(), "-n", str(ranks), sys.executable, str(script)],
                          env={**clean, **env}, capture_output=True, text=True, timeout=120)
    return proc, str(script), lines


def _notice(stderr: str, ranks: int) -> tuple[int, dict]:
    """The one notice in `stderr`: (the rank that printed it, {rank: where it says that rank is}),
    every rank of the mesh named once."""
    headers = HEADER.findall(stderr)
    assert len(headers) == 1, stderr
    printer, _, mine = headers[0]
    block = stderr[stderr.index("has waited more than"):]
    where = {int(printer): mine}
    for spec, text in WHERE.findall(block):
        for part in spec.split(", "):
            a, _, b = part.partition("-")
            for r in range(int(a), int(b or a) + 1):
                assert r not in where, (r, block)
                where[r] = text
    assert sorted(where) == list(range(ranks)), block
    return int(printer), where


SAVE_ALONE = """
    import os, tempfile, time
    import mpimesh as mm
    mesh = mm.Mesh("all:{ranks}", layout="a:all")
    x = mesh.ones("a:{n}")
    print(f"warm {{float(mm.reduce_sum(x))}}", flush=True)  # every rank takes part once
    if mesh.rank == 0:
        {call}  # <alone>
    time.sleep(100)  # the others go on with their own work
"""


@only_in_1_rank_session
@pytest.mark.parametrize("ranks,call,name,kind", [
    (2, 'mm.save(os.path.join(tempfile.mkdtemp(), "ckpt"), {"x": x})', "mm.save", r"(any_rank|broadcast)"),
    (3, 'mm.save(os.path.join(tempfile.mkdtemp(), "ckpt"), {"x": x})', "mm.save", r"(any_rank|broadcast)"),
    (2, "print(x.to_numpy())", "DistTensor.to_numpy", "allgather"),
    (3, "print(x.to_numpy())", "DistTensor.to_numpy", "allgather")])
def test_a_call_on_rank_0_alone_gets_a_notice_then_the_time_out(tmp_path, ranks, call, name, kind):
    proc, script, lines = _job(tmp_path, ranks, SAVE_ALONE.format(ranks=ranks, n=4 * ranks, call=call),
                               MPIMESH_HANG_NOTICE="1", MPIMESH_COLLECTIVE_TIMEOUT="6")
    assert proc.returncode != 0 and proc.stdout.count("warm") == ranks, proc.stdout + proc.stderr
    rule = f"{name} ({script}:{lines['alone']}), which every rank must call"
    printer, where = _notice(proc.stderr, ranks)
    assert printer == 0  # the others cannot answer, let alone print: rank 0 speaks for them
    assert re.fullmatch(re.escape(rule) + rf": its collective #\d+ {kind} over all .* is not complete\. "
                        r"Where the other ranks of the mesh are:", where[0]), where[0]
    for r in range(1, ranks):
        assert where[r].startswith("outside mpimesh (in no collective of this mesh"), where[r]
    assert "the time-out ends the job once it has waited 6 s" in proc.stderr
    # then the time-out's error: the same call and rule, and where the others are
    error = proc.stderr[proc.stderr.index("CollectiveTimeoutError: "):]
    assert error.startswith(f"CollectiveTimeoutError: rank 0 is in {rule}: its collective #"), error
    assert f"ranks {list(range(1, ranks))} never arrived: rank 1 is outside mpimesh" in error, error
    assert proc.stderr.index("has waited more than 1 s") < proc.stderr.index("CollectiveTimeoutError")


@only_in_1_rank_session
def test_ranks_waiting_in_other_collectives_are_named_in_one_notice(tmp_path):
    """Rank 0 saves alone, ranks 1 and 2 go on to the next step's sum: every rank waits in a
    collective and could give the notice; one does (the one that asked first, or the lowest of
    those that asked at once), naming each rank's call and line once."""
    proc, script, lines = _job(tmp_path, 3, """
        import os, tempfile
        import mpimesh as mm
        mesh = mm.Mesh("all:3", layout="a:all")
        x = mesh.ones("a:12")
        print(f"warm {float(mm.reduce_sum(x))}", flush=True)
        if mesh.rank == 0:
            mm.save(os.path.join(tempfile.mkdtemp(), "ckpt"), {"x": x})  # <save>
        mm.reduce_sum(x)  # <step>
    """, MPIMESH_HANG_NOTICE="1", MPIMESH_COLLECTIVE_TIMEOUT="6")
    assert proc.returncode != 0 and proc.stdout.count("warm 12.0") == 3, proc.stdout + proc.stderr
    printer, where = _notice(proc.stderr, 3)
    saving = f"mm.save ({script}:{lines['save']}), which every rank must call"
    stepping = f"mm.reduce_sum ({script}:{lines['step']})"
    for r in range(3):
        mine = saving if r == 0 else stepping
        if r == printer:
            assert where[r].startswith(f"{mine}: its collective #"), where[r]
        else:
            assert where[r].startswith(f"in {mine}; waiting in its collective #"), where[r]
    assert re.search(r"in mm\.reduce_sum \(.*\); waiting in its collective #\d+ allreduce over all", proc.stderr)
    assert "CollectiveTimeoutError" in proc.stderr


@only_in_1_rank_session
def test_the_notice_leaves_the_collective_alone(tmp_path):
    """Rank 1 joins the save 5 s late, after rank 0's notice (1 s) asked it where it was: the save
    completes with the right values, no time-out set (the default), and the job ends cleanly."""
    proc, script, lines = _job(tmp_path, 2, """
        import os, time
        import numpy as np
        import mpimesh as mm
        mesh = mm.Mesh("all:2", layout="a:all")
        x = mesh.from_numpy(np.arange(8.0), "a:8")
        path = os.path.join(os.environ["OUT"], "ckpt")
        if mesh.rank == 1:
            time.sleep(5)
        mm.save(path, {"x": x})  # <save>
        got = mm.load(path, mesh)["x"].to_numpy()
        print(f"rank {mesh.rank} loaded {got.tolist()}", flush=True)
    """, MPIMESH_HANG_NOTICE="1", OUT=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        assert f"rank {r} loaded {np.arange(8.0).tolist()}" in proc.stdout
    printer, where = _notice(proc.stderr, 2)
    assert printer == 0 and where[1].startswith("outside mpimesh"), where
    assert where[0].startswith(f"mm.save ({script}:{lines['save']}), which every rank must call"), where[0]
    assert "the time-out ends the job once it has waited 600 s" in proc.stderr
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
