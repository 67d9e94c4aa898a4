"""`mm.shard_weights` (GSPMD's weight sharding, ZeRO-3, FSDP): the rule that picks each tensor's dim,
training with sharded weights equal to the replicated run (float64, 10 steps, SGD, Adam and Adafactor,
an MLP and the Transformer, dense and MoE, uneven blocks), compiled equal to eager bitwise, the gradient
reduce-scattered (no allreduce of a weight), gather plus reduce-scatter moving one allreduce's bytes,
parameters and optimizer state held once over the ranks, a weight-heavy Transformer step's peak at most 0.4x
the data-parallel one's (4 ranks and more), and clear errors."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import get_mesh, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import layers as L  # noqa: E402
from mpimesh.buckets import bucket_bytes  # noqa: E402
from mpimesh.errors import LayoutError, MpimeshError  # noqa: E402
from mpimesh.tree import named_leaves  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as T  # noqa: E402

pytestmark = pytest.mark.mpi
STEPS = 10
OPTIMIZERS = {"sgd": lambda: mm.optim.SGD(0.05, momentum=0.9), "adam": lambda: mm.optim.Adam(0.01),
              "adafactor": lambda: mm.optim.Adafactor(0.05)}


def _first(mesh) -> str:
    """The mesh's first dim of more than one rank (the data-parallel one here), else its first."""
    return next((d.name for d in mesh.shape if d.size > 1), mesh.shape.names[0])


def _rules(mesh) -> str:
    """Data parallel over the first big mesh dim, the hidden dim model-parallel over a second one."""
    dims = [d.name for d in mesh.shape if d.size > 1]
    return f"batch:{_first(mesh)}" + (f";hidden:{dims[1]}" if len(dims) > 1 else "")


# ------------------------------------------------------------------------------------------ the rule

def test_the_rule_picks_the_largest_dividing_dim_and_leaves_what_cannot_split():
    mesh = get_mesh(f"all:{mm.MPI.COMM_WORLD.size}")
    k = mesh.shape["all"].size
    params = {"a": {"w": mesh.zeros(f"d:{3 * k};f:{4 * k}"), "b": mesh.zeros(f"f:{4 * k}")},
              "odd": mesh.zeros(f"d:{2 * k + 1};e:{k}"),  # the largest dim does not divide: e does
              "tiny": mesh.zeros(f"s:{max(k - 1, 1)}"), "ids": mesh.zeros(f"v:{8 * k}", dtype="int32"),
              "chosen": mesh.zeros(f"d:{3 * k};f:{4 * k}")}
    out = mm.shard_weights(params, "all", dims={"chosen": "d"})
    split = {k: v.layout for k, v in L.flatten(out).items()}
    many = k > 1
    assert split == {"a/w": {"f": "all"} if many else {}, "a/b": {"f": "all"} if many else {},
                     "odd": {"e": "all"} if many else {}, "tiny": {}, "ids": {}, "chosen": {"d": "all"} if many else {}}
    for name, t in L.flatten(params).items():  # values unchanged
        np.testing.assert_array_equal(L.flatten(out)[name].to_numpy(), t.to_numpy())


def test_uneven_blocks_when_no_dim_divides():
    n = mm.MPI.COMM_WORLD.size
    mesh = get_mesh(f"all:{n}")
    w = mesh.from_numpy(np.arange((n + 1.0) * (2 * n + 1)).reshape(n + 1, 2 * n + 1), f"d:{n + 1};f:{2 * n + 1}")
    (got,) = mm.shard_weights([w], "all")
    assert got.layout == ({"f": "all"} if n > 1 else {})  # neither divides: the larger
    np.testing.assert_array_equal(got.to_numpy(), w.to_numpy())


def test_two_mesh_dims_and_a_dim_already_split():
    if mm.MPI.COMM_WORLD.size != 4:
        pytest.skip("a 2x2 mesh")
    mesh = get_mesh("rows:2;cols:2")
    w = mesh.zeros("d:8;f:6", layout="f:cols")
    assert mm.shard_weights({"w": w}, "rows+cols")["w"].layout == {"d": "rows", "f": "cols"}
    assert mm.shard_weights({"w": w}, "rows", dims={"w": ["d"]})["w"].layout == {"d": "rows", "f": "cols"}
    with pytest.raises(LayoutError, match=r"'w''s dim f:6 is split over 'cols' already"):
        mm.shard_weights({"w": w}, "rows", dims={"w": "f"})


def test_bad_input_is_named():
    mesh = get_mesh(f"all:{mm.MPI.COMM_WORLD.size}")
    p = {"w": mesh.zeros("d:4;f:4")}
    with pytest.raises(LayoutError, match=r"'rows' is not a dim of the mesh \[all:"):
        mm.shard_weights(p, "rows")
    with pytest.raises(MpimeshError, match=r"dims names \['v'\], which are not parameters; they are: w"):
        mm.shard_weights(p, "all", dims={"v": "d"})
    with pytest.raises(MpimeshError, match=r"'w' \(\[d:4, f:4\]\) has no dim 'e'"):
        mm.shard_weights(p, "all", dims={"w": "e"})
    with pytest.raises(MpimeshError, match=r"dims\['w'\] gives 2 dims \('d', 'f'\) for the 1 mesh dims all"):
        mm.shard_weights(p, "all", dims={"w": ("d", "f")})
    with pytest.raises(MpimeshError, match="over must name mesh dims"):
        mm.shard_weights(p, "")


# ------------------------------------------------------------------------------------------ the MLP

def _mlp(mesh, seed: int = 0) -> dict:
    hidden = 5 * mesh.size + 1  # uneven blocks over any mesh dim
    return L.flatten({"l1": L.init_dense(mesh, seed, "io:12", f"hidden:{hidden}", dtype="float64"),
                      "l2": L.init_dense(mesh, seed + 1, f"hidden:{hidden}", "out:7", dtype="float64")})


def _data(mesh):
    rng = np.random.default_rng(3)
    return (mesh.from_numpy(rng.standard_normal((4 * mesh.size + 2, 12)), f"batch:{4 * mesh.size + 2};io:12"),
            mesh.from_numpy(rng.standard_normal((4 * mesh.size + 2, 7)), f"batch:{4 * mesh.size + 2};out:7"))


def _mlp_loss(p, x, y):
    h = L.dense(L.unflatten(p)["l1"], x, activation="relu")
    d = L.dense(L.unflatten(p)["l2"], h) - y
    return mm.reduce_mean(d * d)


def _train(mesh, opt, shard: str, compiled: bool = False, steps: int = STEPS):
    """Losses, parameters, optimizer state and the profile of `steps` steps of the MLP."""
    p = _mlp(mesh)
    if shard:
        p = mm.shard_weights(p, shard)
    state = opt.init(p)

    def step(p, state, x, y):
        with mm.trace():
            loss = _mlp_loss(p, x, y)
            grads = mm.gradients([loss], list(p.values()))
        p, state = opt.update(p, dict(zip(p, grads)), state)
        return p, state, loss
    run = mm.compile(step) if compiled else step
    x, y = _data(mesh)
    losses = []
    with mm.profile() as prof:
        for _ in range(steps):
            p, state, loss = run(p, state, x, y)
            losses.append(loss.to_numpy())
    return np.array(losses), p, state, prof


def _arrays(tree) -> dict:
    return {k: v.to_numpy() for k, v in named_leaves(tree)}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shape", mesh_shapes())
def test_mlp_training_equals_the_replicated_run(shape, name):
    mesh = get_mesh(shape, _rules(get_mesh(shape)))
    ref = _train(mesh, OPTIMIZERS[name](), "")
    got = _train(mesh, OPTIMIZERS[name](), _first(mesh))
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-12, atol=0)
    for part in (1, 2):
        want, have = _arrays(ref[part]), _arrays(got[part])
        assert want.keys() == have.keys()
        for k in want:
            np.testing.assert_allclose(have[k], want[k], rtol=1e-11, atol=1e-14, err_msg=k)
    over, k = _first(mesh), mesh.shape[_first(mesh)].size
    if k > 1:  # every weight with a free dim long enough sharded, its slots too
        for name, t in got[1].items():
            free = any(m in (None, over) and d.size >= k for d, m in zip(t.shape, t.tensor_layout))
            assert (over in t.tensor_layout) == free, (name, t.layout)
            if name in got[2].get("m", {}):
                assert got[2]["m"][name].tensor_layout == t.tensor_layout


@pytest.mark.parametrize("shape", mesh_shapes())
def test_compiled_equals_eager_bitwise(shape):
    mesh = get_mesh(shape, _rules(get_mesh(shape)))
    eager = _train(mesh, mm.optim.Adam(0.01), _first(mesh), steps=4)
    comp = _train(mesh, mm.optim.Adam(0.01), _first(mesh), compiled=True, steps=4)
    assert eager[0].tobytes() == comp[0].tobytes()
    for k, v in _arrays(eager[1]).items():
        assert v.tobytes() == _arrays(comp[1])[k].tobytes(), k


def _wire(transfers: dict) -> dict:
    """Elements each rank sends per collective kind (ring algorithms): an allgather its block k-1
    times, a reduce-scatter (k-1)/k of its input, an allreduce twice that; the counters keep an
    allgather's input block and the others' whole input (`mm.profile`)."""
    out: dict = {}
    for key, v in transfers.items():
        kind, dims = key.split("/")
        k = np.prod([_MESH.shape[d].size for d in dims.split("+")])
        share = {"allgather": k - 1, "reduce_scatter": (k - 1) / k, "allreduce": 2 * (k - 1) / k}.get(kind, 0)
        out[kind] = out.get(kind, 0) + v["elements"] * share
    return out


_MESH = None


def test_gradients_are_reduce_scattered_and_move_one_allreduce_of_bytes():
    """1-D mesh, sizes that divide: per step the sharded run sends as many elements (gather plus
    reduce-scatter) as the replicated run's allreduce of the gradients; no weight is allreduced."""
    global _MESH
    n = mm.MPI.COMM_WORLD.size
    if n == 1:
        pytest.skip("no communication on one rank")
    mesh = _MESH = get_mesh(f"all:{n}", "batch:all")
    before = bucket_bytes()
    mm.set_bucket_bytes(1 << 30)  # one bucket: the replicated run's gradients in one allreduce
    try:
        p = L.flatten({"l1": L.init_dense(mesh, 0, f"io:{2 * n}", f"hidden:{4 * n}", dtype="float64"),
                       "l2": L.init_dense(mesh, 1, f"hidden:{4 * n}", f"out:{2 * n}", dtype="float64")})
        x = mesh.from_numpy(np.ones((16 * n, 2 * n)), f"batch:{16 * n};io:{2 * n}")  # activations outweigh
        y = mesh.from_numpy(np.ones((16 * n, 2 * n)), f"batch:{16 * n};out:{2 * n}")  # weights: gathered
        sent = {}
        for shard in ("", "all"):
            q = mm.shard_weights(p, shard) if shard else p
            with mm.profile() as prof, mm.trace():
                loss = _mlp_loss(q, x, y)
                mm.gradients([loss], list(q.values()))
            sent[shard] = _wire(prof.transfers)
            if shard:
                assert set(prof.transfers) == {"allgather/all", "reduce_scatter/all", "allreduce/all"}
                assert prof.transfers["allreduce/all"]["elements"] == 1  # the loss alone
                weights = sum(t.shape.size for t in p.values())
                assert prof.transfers["reduce_scatter/all"]["elements"] == weights
                assert prof.transfers["reduce_scatter/all"]["calls"] == 1  # four gradients, one bucket
        loss_only = 2 * (n - 1) / n
        weights_sent = sent["all"]["allgather"] + sent["all"]["reduce_scatter"]
        assert abs(weights_sent - (sent[""]["allreduce"] - loss_only)) <= 0.01 * weights_sent
    finally:
        mm.set_bucket_bytes(before)


def test_each_rank_holds_its_share_of_parameters_and_optimizer_state():
    n = mm.MPI.COMM_WORLD.size
    mesh = get_mesh(f"all:{n}", "batch:all")
    p = L.flatten({"l1": L.init_dense(mesh, 0, f"io:{2 * n}", f"hidden:{4 * n}", dtype="float64"),
                   "l2": L.init_dense(mesh, 1, f"hidden:{4 * n}", f"out:{2 * n}", dtype="float64")})
    opt = mm.optim.Adam(0.01)
    full = sum(t.local.nbytes for t in p.values())
    q = mm.shard_weights(p, "all")
    state = opt.init(q)
    assert sum(t.local.nbytes for t in q.values()) == full / n
    assert sum(t.local.nbytes for s in ("m", "v") for t in state[s].values()) == 2 * full / n


@pytest.mark.parametrize("fmt", ["mpimesh", "safetensors"])
def test_checkpoints_move_between_sharded_and_replicated_layouts_and_rank_counts(tmp_path, fmt):
    n = mm.MPI.COMM_WORLD.size
    world = mm.MPI.COMM_WORLD
    mesh = get_mesh(f"all:{n}", "batch:all")
    rng = np.random.default_rng(3)
    values = {"w": rng.standard_normal((3 * n + 1, 4 * n)), "b": rng.standard_normal(4 * n)}  # uneven rows
    shapes = {"w": f"d:{3 * n + 1};f:{4 * n}", "b": f"f:{4 * n}"}
    p = mm.shard_weights({k: mesh.from_numpy(v, shapes[k]) for k, v in values.items()}, "all", dims={"w": "d"})
    state = mm.optim.Adam(0.01).init(p)
    folder = world.bcast(str(tmp_path), root=0)
    sharded = os.path.join(folder, "sharded")
    save = {"format": "safetensors"} if fmt == "safetensors" else {}
    mm.save(sharded, {"params": p, "m": state["m"]} if fmt == "mpimesh" else p, **save)
    # back on the same ranks replicated, and on one rank alone (each rank its own 1-rank mesh)
    for where in (mesh, mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)):
        got = mm.load(sharded, where, layout="")
        got = got["params"] if fmt == "mpimesh" else got
        for k, v in values.items():
            assert got[k].layout == {} and got[k].mesh is where
            np.testing.assert_array_equal(got[k].to_numpy(), v)
    # saved replicated by rank 0 alone, loaded sharded on every rank as shard_weights lays it out
    alone = os.path.join(folder, "alone")
    if world.rank == 0:
        one = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
        mm.save(alone, {k: one.from_numpy(v, shapes[k]) for k, v in values.items()}, **save)
    world.Barrier()
    back = mm.load(alone, mesh, layout="d:all")  # (w split already; b left for shard_weights)
    resharded = mm.shard_weights(back, "all", dims={"w": "d"})
    for k, v in values.items():
        assert resharded[k].tensor_layout == p[k].tensor_layout or n == 1  # (a size-1 mesh dim splits nothing)
        np.testing.assert_array_equal(resharded[k].local, p[k].local)
        np.testing.assert_array_equal(resharded[k].to_numpy(), v)


# ------------------------------------------------------------------------------------------ the Transformer

CFG = T.Config(d_model=12, heads=3, d_kv=4, d_ff=10, layers=2, length=6, batch=6, dtype="float64")


def _transformer(mesh, cfg, shard: str, name: str, steps: int = STEPS):
    params = {k: mm.cast(v, "float64") for k, v in T.init_params(mesh, cfg).items()}
    if shard:
        params = mm.shard_weights(params, shard)
    opt = OPTIMIZERS[name]()
    state = opt.init(params)
    step = T.make_train_step(cfg, opt)
    ids = np.random.default_rng(5).integers(0, cfg.vocab, (cfg.batch, cfg.length + 1))
    shape = f"batch:{cfg.batch};length:{cfg.length}"
    batch = {"inputs": mesh.from_numpy(ids[:, :-1], shape), "targets": mesh.from_numpy(ids[:, 1:], shape)}
    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, batch, T.step_seed(mesh, 0, i))
        losses.append(loss.to_numpy())
    return np.array(losses), params


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_transformer_training_equals_the_replicated_run(kind, name):
    n = mm.MPI.COMM_WORLD.size
    shape = "rows:2;cols:2" if n == 4 else f"all:{n}"
    mesh = get_mesh(shape)
    cfg = replace(CFG, moe_every=2, experts=3) if kind == "moe" else CFG
    rules = "batch:rows;heads:cols;d_ff:cols;experts:rows" if n == 4 else "batch:all;experts:all"
    over = "rows" if n == 4 else "all"
    with mm.layout_scope(mesh, rules):
        ref = _transformer(mesh, cfg, "", name, steps=4 if n > 4 else STEPS)
        got = _transformer(mesh, cfg, over, name, steps=4 if n > 4 else STEPS)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-12, atol=0)
    for k, v in ref[1].items():
        np.testing.assert_allclose(got[1][k].to_numpy(), v.to_numpy(), rtol=1e-10, atol=1e-13, err_msg=k)
    if n > 1:
        assert sum(over in t.tensor_layout for t in got[1].values()) >= len(got[1]) - 2  # (tiny ones may stay)


def test_a_weight_heavy_transformers_peak_is_at_most_0_4x_data_parallel():
    """Issue's bar on 4 ranks (and beyond): the step's peak of live arrays (parameters, Adam's slots,
    gradients and activations made in the step) with the weights sharded, against the data-parallel run."""
    n = mm.MPI.COMM_WORLD.size
    if n < 4:
        pytest.skip("the bar is for 4 ranks or more")
    mesh = get_mesh(f"all:{n}", "batch:all")
    cfg = replace(CFG, d_model=128, heads=4, d_kv=32, d_ff=512, layers=2, length=4, batch=n)  # weights dominate
    peaks = {}
    for shard in ("", "all"):
        params = T.init_params(mesh, cfg)
        params = mm.shard_weights(params, shard) if shard else params
        opt = mm.optim.Adam(1e-3)
        state, step = opt.init(params), T.make_train_step(cfg, opt)
        ids = np.random.default_rng(5).integers(0, cfg.vocab, (cfg.batch, cfg.length + 1))
        shape = f"batch:{cfg.batch};length:{cfg.length}"
        batch = {"inputs": mesh.from_numpy(ids[:, :-1], shape), "targets": mesh.from_numpy(ids[:, 1:], shape)}
        params, state, _ = step(params, state, batch)
        with mm.profile(memory=True) as prof:
            params, state, _ = step(params, state, batch)
        held = sum(t.local.nbytes for t in params.values()) + sum(
            t.local.nbytes for s in ("m", "v") for t in state[s].values())
        peaks[shard] = prof.peak_bytes["arrays"] + held  # (the step's new arrays, and what it was handed)
    assert peaks["all"] <= 0.4 * peaks[""], peaks
