"""A layout rule whose tensor dim no tensor has (a typo: `hiden:cols`) splits nothing, silently; so it
warns (`LayoutRuleWarning`), once, from one process, naming the rule, the mesh and the closest dims
seen: at the end of the first traced step that ran under it, or at exit. Rules that matched, or whose
dim tensors had but split unevenly, do not warn. Each test uses dim names of its own: the dims seen
are kept for the whole process."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh import layout
from mpimesh.launch import find_mpiexec, job_env

from meshes import get_mesh, mesh_shapes

ROOT = Path(__file__).resolve().parents[1]
RANK = MPI.COMM_WORLD.Get_rank()


@pytest.fixture(autouse=True)
def fresh_watch(monkeypatch):
    """No rule noted or checked yet, and no step ended (as in a new process)."""
    monkeypatch.setattr(layout, "_watch", layout._Watch())


def _two_dims(mesh: mm.Mesh) -> tuple[str, str]:
    names = mesh.shape.names
    return names[0], names[-1] if len(names) > 1 else names[0]


def _caught(fn) -> list[str]:
    """The messages of the `LayoutRuleWarning`s that `fn()` gives."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in got if issubclass(w.category, layout.LayoutRuleWarning)]


def _step(x, w):
    with mm.trace():
        return mm.einsum([x, w])


@pytest.mark.parametrize("shape", mesh_shapes())
def test_misspelled_rule_warns_once_at_the_end_of_the_first_step(shape):
    rows = shape.split(";")[0].split(":")[0]
    cols = shape.split(";")[-1].split(":")[0]
    tag = shape.replace(":", "").replace(";", "_")
    batch, hidden, typo = f"batch_{tag}", f"hidden_{tag}", f"hiden_{tag}"
    mesh = mm.Mesh(shape, layout=f"{batch}:{rows};{typo}:{cols}")
    x = mesh.from_numpy(np.arange(32.0).reshape(4, 8), f"{batch}:4;{hidden}:8")
    w = mesh.from_numpy(np.ones((8, 2)), f"{hidden}:8;out_{tag}:2")
    assert _caught(lambda: None) == []  # nothing before a step ends
    got = _caught(lambda: _step(x, w))
    y = _step(x, w)
    assert hidden not in x.layout and hidden not in w.layout, "the typo split nothing"
    np.testing.assert_allclose(y.to_numpy(), np.arange(32.0).reshape(4, 8).sum(1, keepdims=True) * np.ones((1, 2)))
    if RANK == 0:
        (line,) = got
        assert line.startswith(f"layout rule {typo}:{cols} of mesh {mesh.shape} matched no tensor by the end of the "
                               f"first traced step: no tensor had a dim '{typo}' (did you mean '{hidden}'"), line
        assert f"{batch}:" not in line  # the rule that matched is not named
    else:
        assert got == []
    assert _caught(lambda: _step(x, w)) == []  # once: not at the next step,
    assert _caught(layout._at_exit) == []  # nor at exit


def test_rules_that_matched_do_not_warn():
    mesh = get_mesh(mesh_shapes()[-1])
    a, b = _two_dims(mesh)
    with mm.layout_scope(mesh, f"rows_m:{a};cols_m:{b}" if a != b else f"rows_m:{a}"):
        x = mesh.from_numpy(np.arange(24.0).reshape(4, 6), "rows_m:4;cols_m:6")
        w = mesh.from_numpy(np.ones((6, 3)), "cols_m:6;out_m:3")
        got = _caught(lambda: _step(x, w))
    assert got == [] and _caught(layout._at_exit) == []


def test_a_dim_split_unevenly_is_no_typo():
    """Tensors had the dim, though no size the mesh dim divides (split unevenly, on more than 1 rank)."""
    mesh = get_mesh(mesh_shapes()[0])
    m = mesh.shape.names[0]
    with mm.layout_scope(mesh, f"odd_u:{m}"):
        x = mesh.from_numpy(np.arange(7.0), "odd_u:7")
        got = _caught(lambda: _step(x, x))
    assert got == [] and _caught(layout._at_exit) == []


def test_rules_no_step_ran_under_wait_for_exit():
    """A step checks the rules its ops ran under; a rule noted but not used in it (another scope, a
    calibration's own step) waits for exit, where it warns once, with every tensor dim seen then."""
    mesh = get_mesh(mesh_shapes()[0])
    m = mesh.shape.names[0]
    with mm.layout_scope(mesh, f"unused_w:{m}"):
        mesh.from_numpy(np.arange(4.0), "other_w:4")  # (laid out under it: it is checked at exit)
    with mm.layout_scope(mesh, f"idle_w:{m}"):  # nothing laid out under it: never checked (a program that
        pass                                     # ends on bad input before its first tensor says nothing)
    with mm.layout_scope(mesh, f"step_w:{m}"):
        x = mesh.from_numpy(np.arange(4.0), "step_w:4")
        assert _caught(lambda: _step(x, x)) == []
    mesh.from_numpy(np.arange(4.0), "unusd_w:4")  # (a dim seen after the step, before exit)
    got = _caught(layout._at_exit)
    if RANK == 0:
        assert got == [f"layout rule unused_w:{m} of mesh {mesh.shape} matched no tensor in the whole run: no "
                       f"tensor had a dim 'unused_w' (did you mean 'unusd_w'?), so the rule split nothing"]
    else:
        assert got == []
    with mm.layout_scope(mesh, f"later_w:{m}"):  # noted after the first step: exit too, never at a step
        x = mesh.from_numpy(np.arange(4.0), "step_w:4")
        assert _caught(lambda: _step(x, x)) == []
    assert len(_caught(layout._at_exit)) == (RANK == 0)
    assert _caught(layout._at_exit) == []


def test_meshes_of_one_rank_on_each_process_warn_from_the_first():
    mesh = mm.Mesh("solo:1", layout="solo_dim:solo", comm=MPI.COMM_SELF)
    x = mesh.from_numpy(np.arange(3.0), "sol_dim:3")
    got = _caught(lambda: _step(x, x))
    assert len(got) == (RANK == 0) and all("solo_dim:solo of mesh [solo:1]" in g for g in got), got


def test_an_exception_in_the_step_checks_nothing():
    mesh = get_mesh(mesh_shapes()[0])
    m = mesh.shape.names[0]

    def failing():
        with mm.layout_scope(mesh, f"raised_x:{m}"), pytest.raises(mm.MpimeshError):
            with mm.trace():
                x = mesh.from_numpy(np.arange(4.0), "r_x:4")
                mm.einsum([x, x], output_shape="nope:2")
    assert _caught(failing) == [] and layout._watch.pending and not layout._watch.stepped


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts a job of its own")
def test_at_exit_one_line_for_a_job_of_4_ranks(tmp_path):
    """A program that never traces a step: the warning comes at exit, from rank 0 alone."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import mpimesh as mm
        mesh = mm.Mesh("rows:2;cols:2", layout="batch:rows;hiden:cols")
        x = mesh.random_normal("batch:4;hidden:8", seed=0)
        print(mesh.rank, x.layout)
    """))
    proc = subprocess.run([find_mpiexec(), "-n", "4", sys.executable, str(script)],
                          env=job_env(PYTHONPATH=str(ROOT), MPIEXEC_TIMEOUT="60"), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("{'batch': 'rows'}") == 4, proc.stdout  # (the lines of 4 ranks may interleave)
    (line,) = [ln for ln in proc.stderr.splitlines() if "LayoutRuleWarning" in ln]
    assert line == (f"{script}:0: LayoutRuleWarning: layout rule hiden:cols of mesh [rows:2, cols:2] matched no "
                    f"tensor in the whole run: no tensor had a dim 'hiden' (did you mean 'hidden'?), so the rule "
                    f"split nothing"), proc.stderr
