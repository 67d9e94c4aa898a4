"""The CUDA-graph engine of `mm.compile` (`mpimesh.graphs`): on a GPU (`--backend cupy`) with real
CUDA graphs, and on numpy through a capturer that behaves as CUDA stream capture does: a captured
graph, launched, runs its kernels again on the buffers they were captured with and writes the
buffers they made in place, so a value read from anywhere but those buffers, or a static buffer not
refreshed, shows as a wrong value. Over 10 steps the values equal eager's bitwise (MLP with Adam and
buckets, the Transformer dense and MoE, uneven blocks, 1-D/2-D/3-D meshes), and only the steps that
need the host run outside graphs."""
from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import get_mesh, mesh_shapes  # noqa: E402
from test_compile import STEPS, _mlp_step, _same, _same_tree  # noqa: E402
from test_compile import test_random_ops_draw_fresh_numbers_in_every_replay_from_seed_tensors as random_ops  # noqa: E402
from test_compile import test_transformer_compiled_equals_eager_bitwise as transformer  # noqa: E402

import mpimesh as mm  # noqa: E402
import mpimesh.compiled as compiled  # noqa: E402
from mpimesh.backend import name as backend_name  # noqa: E402
from mpimesh.graphs import GraphEngine, _NeedsHost  # noqa: E402
from mpimesh.program import OpStep  # noqa: E402

pytestmark = pytest.mark.mpi


class _Graph:
    def __init__(self, body, env, before, made):
        self.body, self.env, self.before, self.made = body, env, before, made
        self.launches = 0

    def launch(self):
        """The captured kernels again, on the captured buffers, into the captured outputs."""
        self.launches += 1
        now = list(self.env)
        self.env[:] = self.before
        self.body()
        fresh = {s: self.env[s] for s in self.made}
        self.env[:] = now
        for s, buf in self.made.items():
            if buf.flags.writeable:  # a read-only view: its base is written
                np.copyto(buf, fresh[s])


class _Capture:
    """`mpimesh.graphs.CudaCapture`'s interface on numpy (see the module)."""

    def __init__(self):
        self.graphs: list = []

    def scope(self):
        return contextlib.nullcontext()

    def static(self, a):
        return np.array(a, copy=True)

    def copy(self, dst, src):
        np.copyto(dst, src)

    def capture(self, body, env, writes):
        before = list(env)
        body()
        self.graphs.append(_Graph(body, env, before, {s: env[s] for s in writes}))
        return self.graphs[-1]

    def launch(self, graph):
        graph.launch()

    def failed(self, error):
        return isinstance(error, _NeedsHost)


@pytest.fixture
def graphs(monkeypatch):
    """Every compiled step's engine a `GraphEngine`: on CuPy (a GPU) the real one, capturing CUDA
    graphs (`for_engine`), its launches counted; on numpy one with the capturer above. Yields the engines."""
    made, real = [], compiled.for_engine

    def engine(flat):
        if backend_name(flat.mesh.xp) == "cupy":
            made.append(real(flat))
            assert isinstance(made[-1], GraphEngine), "CUDA graphs are off on CuPy (MPIMESH_CUDA_GRAPHS?)"
            _count_launches(made[-1].cap)
        else:
            made.append(GraphEngine(flat, _Capture()))
        return made[-1]
    monkeypatch.setattr(compiled, "for_engine", engine)
    return made


def _count_launches(cap) -> None:
    """`cap.graphs`: the graphs `cap` (a `CudaCapture`) made, each with its `launches` counted."""
    cap.graphs, capture, launch = [], cap.capture, cap.launch

    def counted_capture(body, env, writes):
        graph = capture(body, env, writes)
        cap.graphs.append(graph)
        graph_launches[id(graph)] = 0
        return graph

    def counted_launch(graph):
        graph_launches[id(graph)] += 1
        launch(graph)
    graph_launches: dict = {}
    cap.capture, cap.launch = counted_capture, counted_launch
    cap.launches = graph_launches


def _launches(engine, graph) -> int:
    return engine.cap.launches[id(graph)] if hasattr(engine.cap, "launches") else graph.launches


def _check_plan(engine: GraphEngine) -> None:
    """Graphs were made and launched in every replay after the capture; each host step needs the
    host (a bucket's allreduce, or an op whose kernel asked for a collective; never an op that
    syncs with the host, which would cut a graph on a GPU); graphs hold the rest."""
    assert engine.segments >= 1 and all(_launches(engine, g) == engine.runs - 1 for g in engine.cap.graphs)
    host = [e for e in engine.plan if e[0] == "host"]
    for _, step, why in host:
        assert why == "bucket" if not isinstance(step, OpStep) else why.startswith("_NeedsHost: "), (step, why)
    ops = sum(1 for step in engine.engine.steps if isinstance(step, OpStep))
    assert sum(1 for _, step, _ in host if isinstance(step, OpStep)) < ops
    assert engine.host_steps == len(host) and engine.segments == len(engine.plan) - len(host)


@pytest.mark.parametrize("shape", mesh_shapes())
def test_mlp_in_graphs_equals_eager_bitwise(graphs, shape):
    mesh = get_mesh(shape)
    opt = mm.optim.Adam(1e-2)
    with mm.layout_scope(mesh, "batch:" + mesh.shape.names[0]):  # data-parallel: bucketed gradients
        rng = np.random.default_rng(0)
        params = {n: mesh.from_numpy(rng.standard_normal(size), s)
                  for n, s, size in [("w1", "io:6;hidden:10", (6, 10)), ("b1", "hidden:10", (10,)),
                                     ("w2", "hidden:10;io:6", (10, 6))]}
        state = opt.init(params)
        step, plain = mm.compile(_mlp_step(opt)), _mlp_step(opt)
        eager = ours = (params, state)
        for k in range(STEPS):
            x = mesh.from_numpy(rng.standard_normal((12, 6)), "batch:12;io:6")
            y = mesh.from_numpy(rng.standard_normal((12, 6)), "batch:12;io:6")
            *eager, eager_loss = plain(*eager, x, y)
            *ours, loss = step(*ours, x, y)
            _same(eager_loss, loss, f"loss at step {k}")
            _same_tree(eager, ours, f"params and state at step {k}")
    assert len(graphs) == 1 and graphs[0].runs == STEPS - 1
    _check_plan(graphs[0])


@pytest.mark.parametrize("which", ["dense adam", "moe"])
def test_transformer_in_graphs_equals_eager_bitwise(graphs, which):
    transformer(which, "paper")  # 10 steps, uneven blocks on 4 and 8 ranks
    _check_plan(graphs[0])


@pytest.mark.parametrize("shape", mesh_shapes())
def test_random_ops_in_graphs_draw_fresh_numbers_from_seed_tensors(graphs, shape):
    random_ops(shape)  # eager's numbers in every replay, a new mask each step
    _check_plan(graphs[0])


def test_gradients_in_bucket_buffers_the_graphs_write_are_copied_out(graphs):
    """A gradient is a view of its bucket's buffer, which the graphs write again in every replay:
    the gradients a replay returns keep their values after later replays."""
    from test_buckets import test_bucket_views_of_a_step_survive_the_next_step as survive
    survive(compiled=True)
    for engine in graphs:
        _check_plan(engine)


def test_donated_blocks_are_given_up_under_graphs(graphs, monkeypatch):
    """With donate_argnums the graph engine empties the list of input blocks it is handed, as the
    flat engine does, so that its slots hold a donated block's only reference and it goes after its
    last reader (the capture and the replays kept the list whole: parameters twice in memory for the
    whole step); a block donated to a replay is gone when the call returns; values equal eager's."""
    import gc
    import weakref
    handed = []
    run = GraphEngine.run
    monkeypatch.setattr(GraphEngine, "run", lambda self, arrays: (handed.append(arrays), run(self, arrays))[1])
    mesh = get_mesh(mesh_shapes()[0])
    opt = mm.optim.SGD(0.1, momentum=0.9)
    rng = np.random.default_rng(1)
    params = {"w": mesh.from_numpy(rng.standard_normal((6, 10)), "io:6;hidden:10")}
    x = mesh.from_numpy(rng.standard_normal((4, 6)), "batch:4;io:6")

    def step(p, s, x):
        with mm.trace():
            loss = mm.reduce_sum(mm.square(mm.einsum([x, p["w"]])))
            (g,) = mm.gradients([loss], [p["w"]])
        return opt.update(p, {"w": g}, s)
    fast = mm.compile(step, donate_argnums=(0, 1))
    eager, ours = (params, opt.init(params)), ({"w": params["w"] * 1.0}, opt.init(params))  # (its own: donated)
    for k in range(5):
        eager = step(*eager, x)
        block = weakref.ref(ours[0]["w"].local)
        ours = fast(*ours, x)
        gc.collect()
        _same_tree(eager, ours, f"step {k}")
        if k >= 2:  # the replays (the capture keeps the first call's outputs: recorded)
            assert block() is None, f"step {k}: the donated block is still alive"
    assert len(graphs) == 1 and graphs[0].runs == 4  # (the first call records, eagerly)
    assert len(handed) == 4 and all(arrays == [] for arrays in handed), [len(a) for a in handed]
