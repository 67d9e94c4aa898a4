"""`mm.compile`: a step recorded once and replayed without per-op Python gives eager's values
bitwise (losses, parameters, optimizer state) over 10 steps: the MLP with SGD and Adam, the
Transformer (dense and MoE, Adafactor and Adam) on 1-D/2-D/3-D meshes with uneven blocks; a new
signature records again, the cache is bounded, a host read while recording raises right there,
naming its file and line (on every rank, also where only some ranks read), and a replay's profile
counters are eager's."""
from __future__ import annotations

import os
import re
import sys
import traceback

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from meshes import big, get_mesh, global_array, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import counters  # noqa: E402
from mpimesh.collectives import guard  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as T  # noqa: E402

pytestmark = pytest.mark.mpi
STEPS = 10
CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")


def _same(a, b, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.tensor_layout == b.tensor_layout, what
    assert a.local.tobytes() == b.local.tobytes(), what


def _same_tree(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert list(a) == list(b), what
        for k in a:
            _same_tree(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tree(x, y, f"{what}[{i}]")
    else:
        _same(a, b, what)


def _mlp_step(opt):
    def step(params, state, x, y):
        with mm.trace():
            h = mm.relu(mm.einsum([x, params["w1"]], output_shape="batch:12;hidden:10") + params["b1"])
            out = mm.einsum([h, params["w2"]], output_shape="batch:12;io:6")
            loss = mm.reduce_mean(mm.square(out - y))
            names = sorted(params)
            grads = dict(zip(names, mm.gradients([loss], [params[n] for n in names])))
            params, state = opt.update(params, grads, state)
        return params, state, loss
    return step


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mlp_compiled_equals_eager_bitwise(shape, dtype, optimizer):
    mesh = get_mesh(shape)
    dims = big(mesh)
    rules = ";".join(f"{d}:{m}" for d, m in zip(("batch", "hidden", "io"), dims))  # 12, 10, 6: uneven on 8
    opt = mm.optim.SGD(0.05, momentum=0.9) if optimizer == "sgd" else mm.optim.Adam(1e-2)
    with mm.layout_scope(mesh, rules):
        params = {n: mm.cast(mesh.from_numpy(global_array(s, i, np.float64), s), dtype)
                  for i, (n, s) in enumerate([("w1", "io:6;hidden:10"), ("b1", "hidden:10"),
                                              ("w2", "hidden:10;io:6")])}
        state = opt.init(params)
        eager, compiled = (params, state), (params, state)
        step = mm.compile(_mlp_step(opt))
        plain = _mlp_step(opt)
        for k in range(STEPS):
            x = mm.cast(mesh.from_numpy(global_array("batch:12;io:6", 10 + k, np.float64), "batch:12;io:6"), dtype)
            y = mm.cast(mesh.from_numpy(global_array("batch:12;io:6", 50 + k, np.float64), "batch:12;io:6"), dtype)
            *eager, eager_loss = plain(*eager, x, y)
            *compiled, compiled_loss = step(*compiled, x, y)
            _same(eager_loss, compiled_loss, f"loss at step {k}")
            _same_tree(eager, compiled, f"params and state at step {k}")
    assert (step.recordings, step.replays) == (1, STEPS - 1)


def _corpus() -> np.ndarray:
    with open(CORPUS, "rb") as f:
        return np.frombuffer(f.read(), np.uint8)


TRANSFORMERS = {
    "dense adafactor": dict(optimizer="adafactor"),
    "dense adam": dict(optimizer="adam", lr=3e-3, warmup=4),
    "moe": dict(optimizer="adam", lr=3e-3, warmup=4, moe_every=1, experts=4),
    "float16": dict(optimizer="adam", lr=3e-3, warmup=4, dtype="float16"),  # the loss scale in the state
}


@pytest.mark.parametrize("which", sorted(TRANSFORMERS))
@pytest.mark.parametrize("layout", ["paper", "3d"])
def test_transformer_compiled_equals_eager_bitwise(which, layout):
    n = MPI.COMM_WORLD.Get_size()
    cfg = T.Config(d_model=16, heads=6, d_kv=4, d_ff=36, layers=1, vocab=256, length=8, batch=12,
                   **TRANSFORMERS[which])  # heads 6, d_ff 36, batch 12: uneven on 4 and 8 ranks
    if layout == "paper":
        mesh_shape, rules = T.default_mesh(n), T.PAPER_LAYOUT
    else:
        mesh_shape, rules = mesh_shapes(n)[2], "batch:rows;heads:cols;d_ff:cols;vocab:cols;d_model:planes"
    mesh = get_mesh(mesh_shape, T.moe_layout(rules, cfg.moe_every))
    data = _corpus()
    opt = T.make_optimizer(cfg)
    params = T.init_params(mesh, cfg, seed=3)
    state = T.init_state(cfg, opt, params)
    plain = T.make_train_step(cfg, opt)
    step = mm.compile(plain)
    eager = compiled = (params, state)
    for k in range(STEPS):
        batch = T.make_batch(mesh, data, cfg, T.train_offsets(data, cfg, 5, k))
        *eager, eager_loss = plain(*eager, batch, 7)
        *compiled, compiled_loss = step(*compiled, batch, 7)
        _same(eager_loss, compiled_loss, f"loss at step {k}")
        _same_tree(eager, compiled, f"params and state at step {k}")
    assert (step.recordings, step.replays) == (1, STEPS - 1)


def test_a_new_signature_records_again_and_the_cache_is_bounded():
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    step = mm.compile(lambda x, scale: mm.reduce_sum(x * scale, output_shape=x.shape[:1]), cache_size=2)
    a = mesh.from_numpy(np.arange(6.0).reshape(2, 3), "b:2;d:3")
    b = mesh.from_numpy(np.arange(8.0).reshape(2, 4), "b:2;d:4")  # another shape
    assert step(a, 2.0).to_numpy().tolist() == [6.0, 24.0]
    assert step(a + 1.0, 2.0).to_numpy().tolist() == [12.0, 30.0]  # replayed on new values
    assert step(b, 2.0).to_numpy().tolist() == [12.0, 44.0]  # recorded
    assert step(a, 3.0).to_numpy().tolist() == [9.0, 36.0]  # a new static value: recorded
    assert (step.recordings, step.replays) == (3, 1)
    assert len(step.signatures()) == 2  # the first signature was evicted
    assert step(mm.cast(a, "float32"), 2.0).dtype == np.float32  # a new dtype: recorded
    assert step.recordings == 4


def test_reading_values_on_the_host_while_recording_names_the_line():
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)

    def branches(x):
        if float(mm.reduce_sum(x)) > 0:  # a branch on a value
            return x * 2.0
        return x

    def reads(x):
        print(x.to_numpy())
        return x
    x = mesh.ones("a:3")
    with pytest.raises(mm.CompileError, match=r"\(float\(\)\) at .*test_compile\.py:\d+"):
        mm.compile(branches)(x)
    with pytest.raises(mm.CompileError, match=r"\(to_numpy\(\)\) at .*test_compile\.py:\d+"):
        mm.compile(reads)(x)
    with pytest.raises(mm.CompileError, match="returns a str"):
        mm.compile(lambda x: "done")(x)
    for t in (x, mesh.from_numpy(np.ones((4, 2)), "b:4;c:2", layout={"b": "all"})):  # replicated, and split
        with pytest.raises(mm.CompileError, match=r"\(print\(\) or repr\(\)\) at .*test_compile\.py:\d+"):
            mm.compile(lambda y: print(y * 2.0) or y)(t)  # (it printed once, at the recording; or said to_numpy())
    with mm.trace():
        assert "[2. 2. 2.]" in repr(x * 2.0)  # (outside mm.compile a print is a print)


_PACKAGE = os.path.dirname(os.path.abspath(mm.__file__)) + os.sep
_READS = {"to_numpy()": lambda y: y.to_numpy(),
          "float()": lambda y: float(mm.reduce_sum(y)),
          "print() or repr()": lambda y: print(y)}


@pytest.mark.parametrize("what", list(_READS))
def test_a_host_read_while_recording_raises_at_the_read(what, capsys):
    """Every rank reads (SPMD): the read raises CompileError there, naming it and its line, so the
    traceback's last frame of the program is the read and the step's print after it never runs (it
    ran on every rank, and the error pointed at the call, when the refusal waited for the recording's
    end). The mesh stays usable and the SPMD check is as it was."""
    mesh = get_mesh(mesh_shapes()[0])
    x = mesh.from_numpy(np.arange(6.0), "a:6", layout={"a": mesh.shape.names[0]})
    read = _READS[what]

    def step(x):
        y = x * 2.0
        read(y)
        print("after the read")
        return y
    check = guard.settings()["check"]
    compiled = mm.compile(step)
    with pytest.raises(mm.CompileError) as e:
        compiled(x)
    line = read.__code__.co_firstlineno
    assert re.search(rf"the step reads the values of a \[(a:6)?\] float64 tensor on the host \({re.escape(what)}\) at "
                     rf"{re.escape(__file__)}:{line}\. A compiled step", str(e.value)), str(e.value)
    ours = [f for f in traceback.extract_tb(e.value.__traceback__) if not f.filename.startswith(_PACKAGE)]
    assert (ours[-1].filename, ours[-1].lineno, ours[-1].name) == (__file__, line, "<lambda>"), ours
    assert "after the read" not in capsys.readouterr().out
    assert compiled.recordings == 0 and guard.settings()["check"] == check
    assert step(x).to_numpy().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]  # (uncompiled: a plain run)


def test_a_host_read_on_one_rank_is_refused_on_every_rank():
    """`if rank == 0: print(float(loss))` in a step: only rank 0 raised, the others recorded, replayed
    alone, and timed out in a collective; now every rank raises CompileError, rank 0 naming the line."""
    mesh = mm.Mesh(f"all:{MPI.COMM_WORLD.Get_size()}")
    x = mesh.from_numpy(np.arange(8.0), "a:8", layout={"a": "all"})

    def logs(x):
        loss = mm.reduce_sum(x * x)
        if mesh.rank == 0:
            print(float(loss))
        return x * 2.0  # (an allgather: rank 0 raised at its read, the others meet the SPMD check here)
    step = mm.compile(logs)
    for _ in range(2):  # (nothing is cached on any rank: the second call is refused alike)
        with pytest.raises(mm.CompileError) as e:
            step(x)
        if mesh.rank == 0:
            assert re.search(r"\(float\(\)\) at .*test_compile\.py:\d+", str(e.value)), str(e.value)
        else:
            assert "reads values on the host on another rank" in str(e.value)
    assert step.recordings == step.replays == 0 and not step.signatures()
    assert float(mm.reduce_sum(x * 2.0)) == 56.0  # the mesh is still usable


def test_saving_a_checkpoint_while_recording_names_the_line(tmp_path):
    """mm.save in a compiled step would save once, when recorded: a host read, refused by name."""
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)

    def saves(x):
        y = x * 2.0
        mm.save(str(tmp_path / "ck"), {"y": y})
        return y
    with pytest.raises(mm.CompileError, match=r"\(mm\.save\('.*ck'\)\) at .*test_compile\.py:\d+"):
        mm.compile(saves)(mesh.ones("a:3"))
    assert not (tmp_path / "ck").exists()


def test_one_tensor_passed_twice_is_its_own_signature():
    """f(x, x) records one input for both; f(y, x) after it must record again, not replay with y
    in both places (it gave [30, 30, 30] for [21, 22, 23]). A NaN argument replays like any value."""
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    step = mm.compile(lambda a, b: a * 2.0 + b)
    x, y = mesh.from_numpy(np.array([1.0, 2.0, 3.0]), "a:3"), mesh.full("a:3", 10.0, "float64")
    assert step(x, x).to_numpy().tolist() == [3.0, 6.0, 9.0]
    assert step(y, x).to_numpy().tolist() == [21.0, 22.0, 23.0]
    assert step(x, y).to_numpy().tolist() == [12.0, 14.0, 16.0]  # replays the (a, b) recording
    assert step(y, y).to_numpy().tolist() == [30.0, 30.0, 30.0]  # replays the (a, a) one
    assert (step.recordings, step.replays) == (2, 2)
    scaled = mm.compile(lambda a, s: a * s)
    for nan in (float("nan"), np.float32("nan"), np.float16("nan")):
        for _ in range(3):
            assert np.isnan(scaled(x, nan).to_numpy()).all()
    assert (scaled.recordings, scaled.replays) == (3, 6)


def test_numbers_are_told_apart_by_their_bits():
    """-0.0 == 0.0 (and hashes alike), but x * -0.0 is -0.0: a replay of 0.0's program would give +0.0."""
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    step = mm.compile(lambda a, s: a * s)
    x = mesh.ones("a:3", "float64")
    for s in (0.0, -0.0, 0.0, -0.0, np.float64(-0.0), np.float32(-0.0)):
        got, want = step(x, s).to_numpy(), (x * s).to_numpy()
        assert got.tobytes() == want.tobytes() and np.signbit(got).all() == np.signbit(s), s
    assert (step.recordings, step.replays) == (4, 2)


def test_a_step_that_assigns_into_its_arguments_is_refused():
    """A PyTorch-style step that updates a dict passed in would update it once, when recorded, and
    never again in a replay: refused, pointing at returning the new state."""
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    params = {"w": mesh.from_numpy(np.array([1.0, 2.0]), "a:2")}

    def step(p):
        p["w"] = p["w"] * 2.0
    with pytest.raises(mm.CompileError, match=r"assigns into its arguments.*return the new values"):
        mm.compile(step)(params)
    lists = [mesh.ones("a:2")]
    with pytest.raises(mm.CompileError, match="assigns into its arguments"):
        mm.compile(lambda xs: xs.append(xs[0] * 2.0))(lists)


def test_tensors_that_are_not_arguments_are_constants_and_arguments_pass_through():
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    w = mesh.from_numpy(np.array([1.0, 2.0]), "a:2")
    step = mm.compile(lambda x: {"y": x * w, "x": x, "none": None})
    first = step(mesh.ones("a:2"))
    x = mesh.from_numpy(np.array([3.0, 4.0]), "a:2")
    second = step(x)
    assert first["y"].to_numpy().tolist() == [1.0, 2.0] and second["y"].to_numpy().tolist() == [3.0, 8.0]
    assert second["x"] is x and second["none"] is None


def test_a_closures_tensor_stays_a_constant_when_it_is_also_passed_in():
    """The first call passes the very tensor the step also reads from its closure: the closure's
    read is still a constant (it gave q + q for x + p)."""
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    p = mesh.full("a:4", 10.0, "float64")
    step = mm.compile(lambda x: x + p)
    assert step(p).to_numpy().tolist() == [20.0] * 4
    q = mesh.full("a:4", 1.0, "float64")
    assert step(q).to_numpy().tolist() == [11.0] * 4 and (step.recordings, step.replays) == (1, 1)


def test_a_step_may_return_tensors_no_op_made_and_keeps_its_containers():
    """A closure's tensor, or one `from_numpy` made inside the step, is returned as a constant on
    every call; an OrderedDict or a defaultdict comes back as one."""
    import collections
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    mask = mesh.ones("a:4", "float64")

    def fn(x):
        made = mesh.from_numpy(np.arange(4.0), "a:4")
        out = collections.defaultdict(list, y=x * 2.0, mask=mask, made=made)
        return collections.OrderedDict(out=out, r=mm.range(mesh, mm.Dimension("a", 4)))
    step = mm.compile(fn)
    for k in range(3):
        x = mesh.full("a:4", float(k), "float64")
        got, want = step(x), fn(x)
        assert type(got) is collections.OrderedDict and type(got["out"]) is collections.defaultdict
        assert got["out"].default_factory is list
        for a, b in ((got["out"][n], want["out"][n]) for n in ("y", "mask", "made")):
            assert a.to_numpy().tobytes() == b.to_numpy().tobytes()
        assert got["r"].to_numpy().tolist() == [0, 1, 2, 3]
    assert (step.recordings, step.replays) == (1, 2)


def test_a_replay_counts_what_eager_counts():
    mesh = get_mesh(mesh_shapes()[0])
    rules = f"batch:{mesh.shape.names[0]}"
    opt = mm.optim.Adam(1e-2)
    with mm.layout_scope(mesh, rules):
        params = {n: mesh.from_numpy(global_array(s, i, np.float64), s)
                  for i, (n, s) in enumerate([("w1", "io:6;hidden:10"), ("b1", "hidden:10"),
                                              ("w2", "hidden:10;io:6")])}
        state = opt.init(params)
        x = mesh.from_numpy(global_array("batch:12;io:6", 1, np.float64), "batch:12;io:6")
        step = mm.compile(_mlp_step(opt))
        with counters.counting() as eager:
            step(params, state, x, x)  # recorded: runs eagerly
        with counters.counting() as replay:
            step(params, state, x, x)
    assert step.replays == 1
    assert counters.traffic(replay) == counters.traffic(eager) and replay["flops"] == eager["flops"]
    if mesh.size > 1:
        assert any(k.startswith("allreduce") for k in counters.traffic(eager))


def test_the_cost_model_prices_a_compiled_step_as_its_replay_runs():
    """`mm.cost.estimate(step)` dry-runs the compiled step's program: the bytes each collective
    moves are those the replay's profile counts, the state is the arguments' largest blocks."""
    pytest.importorskip("jax", reason="the cost model's dry run needs jax")
    mesh = get_mesh(mesh_shapes()[0])
    if mesh.backend != "numpy" and mesh.size > 1:  # (a known gap of the model)
        pytest.skip("on a GPU a bucket's slots are 256-byte aligned and a staged transport counts its copies; "
                    "the dry run counts neither")
    opt = mm.optim.Adam(1e-2)
    machine = mm.cost.Machine(flops=1e9, latency=1e-5, bandwidth=1e8, memory=2**30)
    step = mm.compile(_mlp_step(opt))
    with pytest.raises(mm.MpimeshError, match="has not run yet"):
        mm.cost.estimate(step, machine=machine)
    with mm.layout_scope(mesh, f"batch:{mesh.shape.names[0]}"):
        params = {n: mesh.from_numpy(global_array(s, i, np.float64), s)
                  for i, (n, s) in enumerate([("w1", "io:6;hidden:10"), ("b1", "hidden:10"),
                                              ("w2", "hidden:10;io:6")])}
        state = opt.init(params)
        x = mesh.from_numpy(global_array("batch:12;io:6", 1, np.float64), "batch:12;io:6")
        step(params, state, x, x)
        with counters.counting() as replay:
            step(params, state, x, x)
    e = mm.cost.estimate(step, machine=machine)
    measured = counters.traffic(replay)
    assert {k: c["bytes"] for k, c in e["collectives"].items()} == {k: c["bytes"] for k, c in measured.items()}
    leaves = list(params.values()) + [t for v in state.values() for t in (v.values() if isinstance(v, dict) else [v])
                                      if isinstance(t, mm.DistTensor)] + [x]
    largest = sum(MPI.COMM_WORLD.allreduce(t.local.nbytes, op=MPI.MAX) for t in leaves)
    assert e["state_bytes"] == largest
    assert e["ops"] == len(step.programs()[-1].ops) and 0 < e["activation_bytes"]
    from mpimesh.trace import Released
    assert all(isinstance(t, Released) for op in step.programs()[-1].ops for t in op.inputs + op.outputs)


def test_inside_a_trace_the_step_runs_eagerly_so_gradients_flow_through_it():
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    step = mm.compile(lambda x: mm.exp(x) * 2.0)
    x = mesh.from_numpy(np.array([0.0, 1.0]), "a:2")
    step(x)
    with mm.trace():
        (g,) = mm.gradients([mm.reduce_sum(step(x))], [x])
    np.testing.assert_allclose(g.to_numpy(), 2.0 * np.exp([0.0, 1.0]), rtol=1e-15)
    assert step.replays == 0


@pytest.mark.parametrize("shape", mesh_shapes())
def test_random_ops_draw_fresh_numbers_in_every_replay_from_seed_tensors(shape):
    """A seed tensor is an argument like any other: each replay draws from its value, the numbers
    eager draws from it, which are those of the same seed given as an int."""
    mesh = get_mesh(shape)
    dims = big(mesh)
    rules = ";".join(f"{d}:{m}" for d, m in zip(("b", "d"), dims))  # 5 and 7: uneven
    with mm.layout_scope(mesh, rules):
        x = mesh.from_numpy(global_array("b:5;d:7", 0, np.float64), "b:5;d:7")

        def step(x, seed):
            noise = mesh.random_normal("b:5;d:7", mm.layers.subseed(seed, "noise"), dtype="float64")
            return mm.dropout(x + noise, 0.5, seed), mesh.random_uniform("d:7", seed, dtype="float64")
        compiled = mm.compile(step)
        masks = set()
        for k in range(4):
            seed = mesh.from_numpy(np.array(100 + k, np.int64), ())
            (a, u), (b, v) = compiled(x, seed), step(x, seed)
            _same(a, b, f"dropout at step {k}")
            _same(u, v, f"uniforms at step {k}")
            assert v.to_numpy().tolist() == mesh.random_uniform("d:7", 100 + k, dtype="float64").to_numpy().tolist()
            masks.add(tuple((a.to_numpy() == 0).ravel()))
    assert len(masks) == 4 and compiled.replays == 3


def test_a_seed_must_be_an_integer_or_a_0d_integer_tensor():
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    with pytest.raises(mm.MpimeshError, match=r"0-d integer tensor, got shape \[a:2\] and dtype int64"):
        mesh.random_uniform("a:2", mesh.from_numpy(np.array([1, 2]), "a:2"))
    with pytest.raises(mm.MpimeshError, match="dtype float32"):
        mm.dropout(mesh.ones("a:2"), 0.5, mesh.ones(()))


def test_a_replays_collectives_are_guarded_by_the_spmd_check():
    """Rank 0 replays a step while the others record another one (a static argument differs): the
    first collective where they part is a DivergenceError on every rank, as in eager code."""
    mesh = get_mesh(mesh_shapes()[0])
    if mesh.size == 1:
        pytest.skip("needs 2 ranks or more")
    x = mesh.from_numpy(np.arange(16.0), "a:16", layout={"a": mesh.shape.names[0]})
    step = mm.compile(lambda x, k: mm.reduce_sum(x if k == 1 else mm.cast(x, "float32")))
    assert float(step(x, 1)) == 120.0
    mm.set_spmd_check(True)
    try:
        with pytest.raises(mm.DivergenceError):
            step(x, 1 if mesh.rank == 0 else 2)
        assert float(step(x, 1)) == 120.0  # no data moved: the mesh is still usable, and the replay runs
    finally:
        mm.set_spmd_check(False)
    assert step.replays == (2 if mesh.rank == 0 else 1)  # the others recorded their second call


def test_the_conv_app_compiled_equals_eager_bitwise():
    """apps/segment.py's step (3x3 convolutions with halo exchanges over a 2-D mesh, sizes 13 and 11
    split unevenly, Adam): compiled and eager from the same start, 10 steps."""
    import segment as S
    n = MPI.COMM_WORLD.Get_size()
    mesh = get_mesh(S.balanced_2d(n), "height:rows;width:cols")
    params = S.init_params(mesh, 1, depth=2, width=4)
    opt = mm.optim.Adam(1e-2)
    state = opt.init(params)
    step = mm.compile(S.train_step)
    eager = compiled = (params, state)
    xs, ts = S.image_shape(2, (13, 11))
    for k in range(STEPS):
        x, t = S.make_batch(k, 2, (13, 11))
        x, t = mesh.from_numpy(x, xs), mesh.from_numpy(t, ts)
        *eager, loss_e, acc_e = S.train_step(eager[0], opt, eager[1], x, t)
        *compiled, loss_c, acc_c = step(compiled[0], opt, compiled[1], x, t)
        _same(loss_e, loss_c, f"loss at step {k}")
        _same(acc_e, acc_c, f"accuracy at step {k}")
        _same_tree(eager, compiled, f"params and state at step {k}")
    assert (step.recordings, step.replays) == (1, STEPS - 1)
