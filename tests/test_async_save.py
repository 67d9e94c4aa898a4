"""Background saves (`mm.save(..., blocking=False)`): what is saved is the tensors' values at the call,
however they change before the write (in place, or a compiled step's donated buffers); the call returns
before the files are written; a second save waits for the first; the training thread's collectives run
meanwhile; a failure is raised by `wait()` on every rank and leaves the previous checkpoint; and a job
killed (SIGKILL) during a background write leaves the previous checkpoint whole and loadable (a job of
its own, in the 1-rank session). References: numpy's global arrays."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from meshes import get_mesh, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import async_save, checkpoint as ckpt  # noqa: E402
from mpimesh.launch import find_mpiexec, job_env  # noqa: E402

N = MPI.COMM_WORLD.Get_size()
SHAPES = {"w": "a:5;b:7", "v": "b:7", "s": "", "n": "a:5;c:3"}


def arrays(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {k: np.asarray(rng.standard_normal(mm.Shape(s).sizes)) for k, s in SHAPES.items()}
    out["n"] = (out["n"] * 100).astype(np.int32)
    return out


@pytest.fixture(scope="module")
def shared_dir():
    name = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="mpimesh-async-") if MPI.COMM_WORLD.rank == 0 else None)
    yield Path(name)
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.rank == 0:
        shutil.rmtree(name, ignore_errors=True)


def tensors(mesh: mm.Mesh, glob: dict) -> dict:
    split = [d.name for d in mesh.shape if d.size > 1]
    rules = dict(zip(["a", "b"], split))
    return {k: mesh.from_numpy(g, SHAPES[k], {d: m for d, m in rules.items() if d in mm.Shape(SHAPES[k])})
            for k, g in glob.items()}


def check(path, mesh: mm.Mesh, glob: dict, rules: str = "") -> None:
    loaded = mm.load(path, mesh, rules)
    assert sorted(loaded) == sorted(glob)
    for k, g in glob.items():
        np.testing.assert_array_equal(loaded[k].to_numpy(), g, err_msg=k)


@pytest.fixture
def slow(monkeypatch):
    """`slow(seconds)`: every save's writer sleeps that long once its files are written."""
    return lambda seconds: monkeypatch.setenv("MPIMESH_TEST_SLOW_SAVE", str(seconds))


@pytest.fixture
def late(monkeypatch):
    """The background thread waits 0.3 s before it writes anything: what the caller does meanwhile
    comes first."""
    run = async_save.SaveHandle._run

    def later(self, *args):
        time.sleep(0.3)
        run(self, *args)
    monkeypatch.setattr(async_save.SaveHandle, "_run", later)


@pytest.mark.parametrize("shape", mesh_shapes())
def test_saved_values_are_those_of_the_call(shared_dir, shape, slow, late, capfd):
    """The tensors are overwritten in place right after the call, before the writer starts: the
    checkpoint holds the old values; and the call returned before the commit."""
    mesh, glob = get_mesh(shape), arrays(1)
    made = tensors(mesh, glob)
    path = shared_dir / f"values-{shape}"
    slow(0.5)
    h = mm.save(path, {"params": made, "epoch": 7}, blocking=False)
    assert isinstance(h, mm.SaveHandle) and h.path == str(path)
    returned_early = not h.done()
    for t in made.values():
        t.local[...] = 0
    h.wait()
    assert returned_early and h.done() and h.seconds > 0.8
    assert MPI.COMM_WORLD.allgather(os.path.isdir(path)) == [True] * N
    back = mm.load(path, mesh)
    assert back["epoch"] == 7
    for k, g in glob.items():
        np.testing.assert_array_equal(back["params"][k].to_numpy(), g, err_msg=k)
    assert ckpt.verify(str(path)) is None  # every checksum right
    capfd.readouterr()


def test_a_compiled_steps_donated_state(shared_dir, slow):
    """A training step compiled with the parameters and optimizer state donated updates them in place
    (the app's step): saved before the next step runs, the writer sleeping meanwhile, each checkpoint
    holds the state of its step, not a later one."""
    mesh = get_mesh(mesh_shapes()[0])
    opt = mm.optim.Adam(0.1)

    def train_step(params, state):
        with mm.trace():
            loss = mm.reduce_sum(mm.square(params["w"] - 3.0))
            grads = dict(zip(params, mm.gradients([loss], list(params.values()))))
            return opt.update(params, grads, state)

    step = mm.compile(train_step, donate_argnums=(0, 1))
    params = {"w": mesh.from_numpy(np.arange(35.0).reshape(5, 7), SHAPES["w"], {"a": mesh.shape.names[0]})}
    state, expected, root = opt.init(params), [], shared_dir / "donated"
    slow(0.2)
    for i in range(3):
        params, state = step(params, state)
        expected.append((params["w"].to_numpy(), state["m"]["w"].to_numpy()))
        ckpt.save_step(root, i, {"params": params, "state": state}, keep=3, blocking=False)
    mm.load(ckpt.step_path(root, 0), mesh)  # (a load waits for the save under way)
    for i, (w, m) in enumerate(expected):
        back = mm.load(ckpt.step_path(root, i), mesh)
        np.testing.assert_array_equal(back["params"]["w"].to_numpy(), w)
        np.testing.assert_array_equal(back["state"]["m"]["w"].to_numpy(), m)
        assert int(back["state"]["step"].to_numpy()) == i + 1


def test_a_second_save_waits_for_the_first(shared_dir, slow):
    """The second save (blocking or not) starts once the first is committed; save_step prunes after
    its commit; collectives of the training thread run while the writer sleeps."""
    mesh = get_mesh(mesh_shapes()[-1])
    root = shared_dir / "second"
    slow(0.3)
    first = ckpt.save_step(root, 1, tensors(mesh, arrays(1)), keep=1, blocking=False)
    x = mesh.from_numpy(np.arange(12.0).reshape(3, 4), "p:3;q:4", {"q": mesh.shape.names[-1]})
    for _ in range(20):  # the training thread's collectives, while the first save sleeps
        np.testing.assert_array_equal(mm.reduce_sum(x, reduced_dims=["q"]).to_numpy(),
                                      np.arange(12.0).reshape(3, 4).sum(1))
    second = ckpt.save_step(root, 2, tensors(mesh, arrays(2)), keep=1, blocking=False)
    assert first.done()  # the second call waited for it
    second.wait()
    assert ckpt.steps(root, mesh) == [2]  # step 1 pruned after step 2's commit
    check(ckpt.step_path(root, 2), mesh, arrays(2))
    slow(0)
    h = mm.save(root / "x", tensors(mesh, arrays(3)), blocking=False)
    mm.save(root / "y", tensors(mesh, arrays(4)))  # a blocking save waits too
    assert h.done()
    check(root / "x", mesh, arrays(3))


def test_a_failure_reaches_every_rank_and_keeps_the_previous(shared_dir, monkeypatch):
    """The rename fails in the background: `wait()` raises the same CheckpointError on every rank, the
    previous checkpoint stays; a failure nobody waited for is raised by the next save."""
    mesh = get_mesh(mesh_shapes()[0])
    path = shared_dir / "fails"
    mm.save(path, tensors(mesh, arrays(1)))

    def broken(tmp, target):
        raise OSError("disk on fire")

    monkeypatch.setattr(ckpt, "_swap_in", broken)
    h = mm.save(path, tensors(mesh, arrays(2)), blocking=False)
    try:
        h.wait()
        got = ""
    except mm.CheckpointError as e:
        got = str(e)
    at = "" if N == 1 else " (rank 0)"
    assert MPI.COMM_WORLD.allgather(got) == [f"cannot save checkpoint {str(path)!r}: disk on fire{at}"] * N
    with pytest.raises(mm.CheckpointError, match="disk on fire"):
        h.wait()  # again
    unseen = mm.save(path, tensors(mesh, arrays(3)), blocking=False)
    while not unseen.done():  # (done() does not report the error: the next save does)
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.raises(mm.CheckpointError,
                       match=r"^the background save of .*fails' failed: cannot save .*disk on fire"):
        mm.save(path, tensors(mesh, arrays(4)))
    MPI.COMM_WORLD.Barrier()
    check(path, mesh, arrays(1))
    assert not [n for n in os.listdir(shared_dir) if n.startswith(".fails")]  # no temporary directory left
    mm.save(path, tensors(mesh, arrays(5)))  # reported once: the next save goes on
    check(path, mesh, arrays(5))


def test_bad_blocking_argument(shared_dir):
    mesh = get_mesh(mesh_shapes()[0])
    with pytest.raises(TypeError, match=r"^blocking must be True or False, got str 'no'$"):
        mm.save(shared_dir / "bad", tensors(mesh, arrays(1)), blocking="no")


KILLED = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import mpimesh as mm
    from mpimesh import checkpoint
    root = sys.argv[1]
    mesh = mm.Mesh("all:2")
    w = mesh.from_numpy(np.arange(40.0).reshape(8, 5), "a:8;b:5", "a:all")
    checkpoint.save_step(root, 1, {"w": w})              # blocking: committed
    os.environ["MPIMESH_TEST_SLOW_SAVE"] = "30"
    h = checkpoint.save_step(root, 2, {"w": w * 10.0}, blocking=False)
    for i in range(10 ** 6):                             # training goes on while the writer sleeps
        w = w + 1.0
        float(mm.reduce_sum(w, reduced_dims=["a"]).to_numpy()[0])
        if i == 5:
            print(f"rank {mesh.rank} trains on", flush=True)
""")


@pytest.mark.skipif(N != 1, reason="starts an MPI job of its own; runs in the 1-rank session")
@pytest.mark.parametrize("victim", [0, 1])
def test_kill_during_a_background_write(tmp_path, victim):
    """SIGKILL rank `victim` while its background writer sleeps inside the save of step 2 (its part file
    written, the index not) and the main thread trains on: the job ends, step 1 is the newest complete
    checkpoint, intact, with its values; its leftovers go at the next save_step."""
    script, root = tmp_path / "job.py", tmp_path / "ck"
    script.write_text(KILLED)
    proc = subprocess.Popen([find_mpiexec(), "-n", "2", sys.executable, str(script), str(root)],
                            env=job_env(MPIEXEC_TIMEOUT="60"), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    pids, training, seen = {}, 0, []
    for line in proc.stderr:
        seen.append(line)
        hit = re.search(r"rank (\d) pid (\d+) sleeps \S+ s inside the save of \S*step-00000002", line)
        if hit:
            pids[int(hit[1])] = int(hit[2])
        if len(pids) == 2:
            break
    for line in proc.stdout:  # the main threads go on training during the background write
        training += line.count("trains on")  # (the ranks' lines may come joined into one)
        if training == 2:
            break
    os.kill(pids[victim], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert pids and training == 2 and proc.returncode != 0, "".join(seen) + err + out
    names = sorted(os.listdir(root))
    assert names[0].startswith(".step-00000002.tmp-") and names[1:] == ["step-00000001"], names
    assert "index.json" not in os.listdir(root / names[0])
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    assert ckpt.steps(str(root), mesh) == [1] and ckpt.newest_intact(str(root), mesh) == 1
    np.testing.assert_array_equal(mm.load(ckpt.step_path(root, 1), mesh)["w"].to_numpy(),
                                  np.arange(40.0).reshape(8, 5))
    ckpt.save_step(root, 2, {"w": mesh.zeros("a:8;b:5")})
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002"]


ENDS = textwrap.dedent("""
    import os, sys
    import numpy as np
    import mpimesh as mm
    mesh = mm.Mesh("all:2")
    os.environ["MPIMESH_TEST_SLOW_SAVE"] = "1"
    mm.save(sys.argv[1], {"w": mesh.from_numpy(np.arange(6.0), "a:6", "a:all")}, blocking=False)
    print(f"rank {mesh.rank} leaves", flush=True)  # the program ends with the save under way
""")


@pytest.mark.skipif(N != 1, reason="starts an MPI job of its own; runs in the 1-rank session")
def test_a_program_that_ends_during_a_save_commits_it_first(tmp_path):
    script, path = tmp_path / "job.py", tmp_path / "ck"
    script.write_text(ENDS)
    proc = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(script), str(path)],
                          env=job_env(MPIEXEC_TIMEOUT="60"), capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0 and proc.stdout.count("leaves") == 2, proc.stdout + proc.stderr
    assert "sleeps 1.0 s inside the save" in proc.stderr
    check(path, mm.Mesh("all:1", comm=MPI.COMM_SELF), {"w": np.arange(6.0)})
