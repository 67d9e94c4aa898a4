"""Stage-stacked parameters (`mm.stack_layers`, `mm.unstack_stages`, `stages.stage_entries`) against numpy
on the global arrays, and checkpoints saved per layer from one stage count and loaded under another, or
unpipelined: every value bitwise. L = 48 layers fill 1, 2, 3, 4 or 8 stages, with 1 or 2 virtual stages."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.pipeline_schedules import application_order
from mpimesh.stages import from_entries, layer_index, stage_entries

L = 48
MESHES = {1: ["stages:1"], 2: ["stages:2", "stages:1;cols:2"], 3: ["stages:3", "stages:1;cols:3"],
          4: ["stages:4", "stages:2;cols:2", "stages:1;cols:4"], 8: ["stages:8", "stages:4;cols:2", "stages:2;cols:4"]}


def _meshes() -> list:
    return MESHES.get(MPI.COMM_WORLD.Get_size(), [])


def _mesh(shape: str) -> mm.Mesh:
    return mm.Mesh(shape, layout="d_ff:cols" if "cols" in shape else "")


def _global(i: int) -> dict:
    """Layer i's arrays: distinct values in every element, three dtypes."""
    rng = np.random.default_rng(i)
    return {"w": rng.standard_normal((3, 4)), "b": {"bias": rng.standard_normal(4).astype(np.float32)},
            "n": np.arange(2, dtype=np.int32) + 10 * i}


def _layer(mesh: mm.Mesh, arrays: dict, w_layout=None) -> dict:
    return {"w": mesh.from_numpy(arrays["w"], "d:3;d_ff:4", w_layout),
            "b": {"bias": mesh.from_numpy(arrays["b"]["bias"], "d_ff:4")}, "n": mesh.from_numpy(arrays["n"], "k:2")}


def _leaves(tree: dict) -> dict:
    return {"w": tree["w"], "b/bias": tree["b"]["bias"], "n": tree["n"]}


@pytest.mark.parametrize("shape", _meshes())
@pytest.mark.parametrize("virtual", [1, 2])
def test_stacked_entries_hold_the_layers_in_application_order(shape, virtual):
    mesh = _mesh(shape)
    S = mesh.shape["stages"].size
    K, P = S * virtual, L // (S * virtual)
    arrays = [_global(i) for i in range(L)]
    split_over_stages = ("d:stages;d_ff:cols" if "cols" in shape else "d:stages") if S > 1 else None  # gathered
    layers = [_layer(mesh, a, split_over_stages if i == 1 else None) for i, a in enumerate(arrays)]
    with mm.profile() as prof:
        stacked = mm.stack_layers(layers, "stages", virtual)
    moved = {k: v for k, v in prof.transfers.items() if v["bytes"]}
    assert set(moved) <= {"allgather/stages"}, moved  # only layer 1's w, split over stages, moves
    assert len(stacked) == P
    for j, tree in enumerate(stacked):
        for name, t in _leaves(tree).items():
            want = np.stack([_leaves(arrays[layer_index(e, j, S, virtual, P)])[name] for e in range(K)])
            got = t.to_numpy()
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (name, j)
            assert t.shape.names[0] == "stage" and t.tensor_layout[0] == "stages"
        if "cols" in shape:
            assert tree["w"].layout == {"stage": "stages", "d_ff": "cols"}
    # entry e applies at position application_order(S, V).index(e): layers k*P .. k*P+P-1 of position k
    order = application_order(S, virtual)
    for k, e in enumerate(order):
        assert [layer_index(e, j, S, virtual, P) for j in range(P)] == list(range(k * P, k * P + P))
    with mm.profile() as prof:
        back = mm.unstack_stages(stacked, "stages", virtual)
    assert len(back) == L
    for i, layer in enumerate(back):
        for name, t in _leaves(layer).items():
            want = _leaves(arrays[i])[name]
            assert t.to_numpy().tobytes() == want.tobytes() and "stages" not in t.tensor_layout, (i, name)
    if S > 1:  # one broadcast along stages per layer and tensor, of this rank's block
        per_layer = sum(t.local.nbytes for t in _leaves(back[0]).values())
        assert prof.counters["broadcast/stages"]["calls"] == 3 * L
        assert prof.counters["broadcast/stages"]["bytes"] == L * per_layer


@pytest.mark.parametrize("shape", _meshes())
def test_stage_entries_are_views_and_from_entries_restacks(shape):
    mesh = _mesh(shape)
    S = mesh.shape["stages"].size
    arrays = [_global(i) for i in range(2 * S)]
    (stacked,) = mm.stack_layers([_layer(mesh, a) for a in arrays], "stages", 2)
    entries = stage_entries(stacked["w"], "stages")
    s = mesh.coords["stages"]
    assert len(entries) == 2 and entries[0].mesh.shape["stages"].size == 1
    for v, e in enumerate(entries):
        assert np.shares_memory(e.local, stacked["w"].local)
        np.testing.assert_array_equal(e.to_numpy(), arrays[layer_index(2 * s + v, 0, S, 2, 1)]["w"])
    again = from_entries([e * 2.0 for e in entries], stacked["w"])
    assert again.tensor_layout == stacked["w"].tensor_layout
    np.testing.assert_array_equal(again.to_numpy(), stacked["w"].to_numpy() * 2.0)


def _shared(tmp_path) -> str:
    return MPI.COMM_WORLD.bcast(str(tmp_path), root=0)


@pytest.mark.parametrize("virtual", [1, 2])
def test_checkpoint_saved_per_layer_loads_under_other_stage_counts_and_unpipelined(tmp_path, virtual):
    """Save under each mesh of this rank count (stage-stacked, unstacked first); load under every
    other one with 1 or 2 virtual stages, and on one rank alone, unpipelined: bitwise."""
    arrays = [_global(i) for i in range(L)]
    root = _shared(tmp_path)
    for a, save_shape in enumerate(_meshes()):
        mesh = _mesh(save_shape)
        stacked = mm.stack_layers([_layer(mesh, x) for x in arrays], "stages", virtual)
        path = f"{root}/from{a}"
        mm.save(path, {"layers": mm.unstack_stages(stacked, "stages", virtual), "step": 7})
        alone = mm.load(path, mm.Mesh("all:1", comm=MPI.COMM_SELF))
        assert alone["step"] == 7
        for i, layer in enumerate(alone["layers"]):
            assert layer["w"].to_numpy().tobytes() == arrays[i]["w"].tobytes()
            assert layer["n"].to_numpy().tobytes() == arrays[i]["n"].tobytes()
        for load_shape in _meshes():
            other = _mesh(load_shape)
            S = other.shape["stages"].size
            for v in (1, 2):
                got = mm.stack_layers(mm.load(path, other)["layers"], "stages", v)
                P = L // (S * v)
                for j, tree in enumerate(got):
                    want = np.stack([arrays[layer_index(e, j, S, v, P)]["b"]["bias"] for e in range(S * v)])
                    assert tree["b"]["bias"].to_numpy().tobytes() == want.tobytes(), (save_shape, load_shape, v)


def test_unpipelined_checkpoint_loads_stacked(tmp_path):
    """Per-layer tensors saved from a mesh with no pipeline dim (d_ff split over every rank) load into
    stage-stacked ones."""
    n = MPI.COMM_WORLD.Get_size()
    flat = mm.Mesh(f"all:{n}", layout="d_ff:all")
    arrays = [_global(i) for i in range(L)]
    path = f"{_shared(tmp_path)}/flat"
    mm.save(path, {f"layer{i}": _layer(flat, a) for i, a in enumerate(arrays)})
    for shape in _meshes():
        mesh = _mesh(shape)
        loaded = mm.load(path, mesh)
        (stacked,) = mm.stack_layers([loaded[f"layer{i}"] for i in range(L)], "stages", L // mesh.shape["stages"].size)
        S = mesh.shape["stages"].size
        want = np.stack([arrays[layer_index(e, 0, S, L // S, 1)]["w"] for e in range(L)])
        assert stacked["w"].to_numpy().tobytes() == want.tobytes()


def test_bad_input_is_named():
    shape = _meshes()[0]
    mesh = _mesh(shape)
    S = mesh.shape["stages"].size
    layers = [_layer(mesh, _global(i)) for i in range(L)]
    with pytest.raises(mm.MpimeshError, match=f"{L + 1} layers do not fill {2 * S} stage entries evenly .* size {S} "
                                              f"times virtual_stages 2.* a multiple of {2 * S}"):
        mm.stack_layers(layers + layers[:1], "stages", 2)
    with pytest.raises(mm.MpimeshError, match="mesh_dim 'rows' is not a dim of mesh"):
        mm.stack_layers(layers, "rows")
    odd = layers[:-1] + [{**layers[-1], "w": mesh.from_numpy(np.zeros((3, 5)), "d:3;d_ff:5")}]
    with pytest.raises(mm.MpimeshError, match=rf"layers\[{L - 1}\]\['w'\] is \[d:3, d_ff:5\] float64, but "
                                              rf"layers\[0\]'s"):
        mm.stack_layers(odd, "stages", L // S)
    with pytest.raises(mm.MpimeshError, match=r"layers\[1\] holds .* they take the same place"):
        mm.stack_layers([layers[0], {"w": layers[1]["w"]}] * (L // 2), "stages", L // S)
    with mm.trace():
        with pytest.raises(mm.MpimeshError, match="outside mm.trace"):
            mm.stack_layers(layers, "stages")
    with pytest.raises(mm.MpimeshError, match=rf"stacked\[0\]\['w'\] \[d:3, d_ff:4\] must have a dim 'stage' of "
                                              rf"size {S}"):
        mm.unstack_stages([{"w": layers[0]["w"]}], "stages")
