"""Checkpoints of nests: dicts, lists and tuples of tensors and plain values (ints, floats, str, bool,
None) round trip bit for bit onto every mesh and rank count; flat dicts are saved as before nests (an
old checkpoint, tests/data/checkpoint-v1, loads as it was); a key holding '/' and a nest are never
confused; an Adam state resumes bit for bit; what a checkpoint cannot hold, ranks that disagree, a
damaged tree and a checkpoint of another model's shapes are refused or blamed on every rank, naming
the tensor (test_checkpoint.py has the helpers and the flat checkpoints' tests)."""
from __future__ import annotations

import collections
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from meshes import global_array, mesh_shapes  # noqa: E402
from test_checkpoint import (N, SHAPES, arrays, listed, load_everywhere, on_rank0, raises_on_every_rank,  # noqa: E402
                             ranks, reseal, rules_for, shared_dir, sub_mesh, tensors, world)  # (shared_dir: a fixture)

import mpimesh as mm  # noqa: E402
from mpimesh import checkpoint as ckpt  # noqa: E402
from mpimesh.tree import tensors as tree_tensors  # noqa: E402


class T(str):
    """A leaf of NEST naming one of SHAPES' tensors."""


NEST = {"params": {"l1/kernel": T("w"), "emb": T("x"), "a~b": T("s")},  # mm.layers.flatten's keys hold '/'
        "opt": {"step": 7, "lr": 1e-3, "m": [T("x"), (T("idx"), -0.0)], "flags": [True, None, "adam", False]},
        "a/b": T("flag"), "a~1b": T("w"), "a": {"b": 2.5, "inf": float("-inf"), "nan": float("nan")},
        "big": 2 ** 70, "i64": np.int64(-3), "f32": np.float32(0.1), "empty": {}, "none": [], "unit": ()}
NAMES = ["params/l1~1kernel", "params/emb", "params/a~0b", "opt/m/0", "opt/m/1/0", "a~1b", "a~01b"]


def build(nest, leaf):
    """`nest` with each T leaf as `leaf(name)`."""
    if isinstance(nest, dict):
        return {k: build(v, leaf) for k, v in nest.items()}
    if isinstance(nest, (list, tuple)):
        return type(nest)(build(v, leaf) for v in nest)
    return leaf(nest) if isinstance(nest, T) else nest


def assert_nest(got, want, glob: dict, where: str = "") -> None:
    """`got` has `want`'s nesting, types and key order; T leaves are tensors whose global values are
    glob's bit for bit; plain values are equal and of the same Python type (numpy's scalars as Python's;
    floats by repr: nan, -0.0 and inf too)."""
    if isinstance(want, T):
        assert isinstance(got, mm.DistTensor) and got.dtype == glob[want].dtype, where
        assert got.shape == mm.Shape(SHAPES[want]), where
        assert got.to_numpy().tobytes() == glob[want].tobytes(), where
    elif isinstance(want, (dict, list, tuple)):
        assert type(got) is type(want), (where, type(got))
        keys = list(want) if isinstance(want, dict) else range(len(want))
        assert (list(got) if isinstance(got, dict) else list(range(len(got)))) == list(keys), where
        for k in keys:
            assert_nest(got[k], want[k], glob, f"{where}/{k}")
    else:
        want = want.item() if isinstance(want, np.generic) else want
        assert type(got) is type(want) and repr(got) == repr(want), (where, got, want)


def index_of(path) -> dict:
    return json.loads((Path(path) / "index.json").read_text())


@pytest.mark.parametrize("src", mesh_shapes())
def test_nest_round_trip_onto_every_mesh_and_rank_count(shared_dir, src):
    """A nest of dicts, lists, tuples, tensors (split, uneven, 0-d, bool, int) and plain values saved
    from `src` loads back the same, bit for bit, onto every mesh of this rank count, onto 1 rank, and
    onto the first k ranks for each k < N (e.g. rows:2;cols:2 onto all:3), which save it again under
    another layout, and that loads back onto all N ranks."""
    mesh, glob = world(src), arrays(11)
    path = str(shared_dir / f"nest-{src}")
    mm.save(path, build(NEST, lambda n: tensors(mesh, glob, rules_for(mesh, ["b", "h", "c"]))[n]), chunk_bytes=24)
    index = index_of(path)
    assert index["version"] == 2 and [t["name"] for t in index["tensors"]] == NAMES
    for dst in mesh_shapes():
        for rules in ["", rules_for(world(dst), ["a", "c"]), rules_for(world(dst), ["h", "b", "a"])]:
            assert_nest(mm.load(path, world(dst), rules), NEST, glob)
    assert_nest(mm.load(path, mm.Mesh("all:1", comm=MPI.COMM_SELF), "b:all"), NEST, glob)
    for k in range(1, N):
        small = sub_mesh(k)  # the first k ranks, and the other N - k by themselves
        first = MPI.COMM_WORLD.rank < k
        loaded = mm.load(path, small, "c:all;h:all")
        assert_nest(loaded, NEST, glob)
        again = f"{path}-from-{k}" + ("" if first else "-rest")
        mm.save(again, loaded, chunk_bytes=16)
        mesh.barrier()
        assert_nest(mm.load(f"{path}-from-{k}", mesh, rules_for(mesh, ["a", "b"])), NEST, glob)
    origin = mm.load(path, mesh)["params"]["l1/kernel"].origin
    assert origin == (os.path.abspath(path), "params/l1~1kernel")
    assert mesh.zeros("a:2").origin is None


def test_flat_keys_and_nests_are_never_confused(shared_dir):
    """A flat dict of tensors is saved as before nests (version 1, names as given): its key 'a/b'
    loads as one key. A nest names its tensors by path, escaping '/' and '~': {'a': {'b': t}} holds
    'a/b', a key 'a/b' beside it 'a~1b'; each loads back in its place. mm.layers.flatten's keys go in
    a nest unchanged."""
    mesh = world(f"all:{N}")
    u, v = (mesh.from_numpy(np.arange(5.0) * s, "n:5", "n:all") for s in (1, -2))

    def values(tree):
        return {k: values(x) if isinstance(x, dict) else x.to_numpy().tolist() if isinstance(x, mm.DistTensor)
                else x for k, x in tree.items()}
    cases = [({"a/b": u, "a": v}, 1, ["a/b", "a"]),
             ({"a": {"b": u}}, 2, ["a/b"]),
             ({"a/b": u, "a": {"b": v}}, 2, ["a~1b", "a/b"]),
             ({"a~1b": u, "a/b": v}, 1, ["a~1b", "a/b"]),
             ({"a~1b": u, "a/b": v, "n": 0}, 2, ["a~01b", "a~1b"]),
             ({"params": mm.layers.flatten({"l1": {"kernel": u, "bias": v}})}, 2,
              ["params/l1~1kernel", "params/l1~1bias"])]
    for i, (nest, version, names) in enumerate(cases):
        path = str(shared_dir / f"flat-keys-{i}")
        mm.save(path, nest)
        index = index_of(path)
        assert index["version"] == version and ("tree" in index) == (version == 2), nest
        assert [t["name"] for t in index["tensors"]] == names
        back = mm.load(path, mesh, "")
        assert values(back) == values(nest) and [t.origin[1] for t in tree_tensors(back)] == names


def test_old_flat_checkpoint_loads(shared_dir):
    """tests/data/checkpoint-v1 was written by mpimesh before nests (on 2 ranks, 'params/w1' split
    unevenly over them): it loads as the flat dict it was, on any mesh, with shapes= as before; a flat
    dict saved now writes the same bytes."""
    old = Path(__file__).resolve().parent / "data" / "checkpoint-v1"
    w1, m = np.arange(15.0).reshape(3, 5) / 7, (np.arange(15) * 0.5 - 3).astype(np.float32).reshape(3, 5)
    for mesh in [world(s) for s in mesh_shapes()] + [mm.Mesh("all:1", comm=MPI.COMM_SELF)]:
        back = mm.load(str(old), mesh, rules_for(mesh, ["io", "hidden"]),
                       shapes={"params/w1": "io:3;hidden:5", "m/w1": [("io", 3), ("hidden", 5)], "step": ""})
        assert list(back) == ["params/w1", "m/w1", "step"]
        np.testing.assert_array_equal(back["params/w1"].to_numpy(), w1)
        assert back["m/w1"].dtype == np.float32 and back["m/w1"].to_numpy().tobytes() == m.tobytes()
        assert back["step"].dtype == np.int32 and int(back["step"].to_numpy()) == 42
    if N == 2:
        mesh = world("all:2")
        path = shared_dir / "v1-again"
        mm.save(str(path), {"params/w1": mesh.from_numpy(w1, "io:3;hidden:5", "hidden:all"),
                            "m/w1": mesh.from_numpy(m, "io:3;hidden:5", "io:all"),
                            "step": mesh.from_numpy(np.array(42, np.int32), "")}, chunk_bytes=32)
        for f in sorted(os.listdir(old)):
            assert (path / f).read_bytes() == (old / f).read_bytes(), f


def test_bad_nests_on_every_rank(shared_dir):
    """What a checkpoint cannot hold raises the same CheckpointError on every rank, naming where it is,
    before anything is written; ranks whose plain values differ are refused naming the entry."""
    mesh = world(f"all:{N}")
    root = shared_dir / "bad-nests"
    on_rank0(mesh, root.mkdir)
    path = str(root / "ck")
    t = mesh.zeros("a:4")
    P = collections.namedtuple("P", "w b")
    for nest, message in [
            ({"p": {1: t}}, "key 1 of 'p' is of type int: the keys of a checkpoint's dicts must be str"),
            ({"p": [t, np.zeros(3)]}, "'p/1' is of type ndarray; a checkpoint holds DistTensors, ints, floats, "
                                      "str, bool and None in dicts, lists and tuples: make it a DistTensor "
                                      "(mesh.from_numpy)"),
            ({"p": P(t, t)}, "'p' is the namedtuple P: save it as a dict (its _asdict())"),
            ({"p": {"q/r": object()}}, "'p/q~1r' is of type object; a checkpoint holds DistTensors, ints, floats, str, "
                                       "bool and None in dicts, lists and tuples"),
            ({3: t, "n": 1}, "key 3 of the top level is of type int: the keys of a checkpoint's dicts must be str")]:
        raises_on_every_rank(mm.CheckpointError, lambda: mm.save(path, nest), f"cannot save: {message}")
    raises_on_every_rank(mm.CheckpointError, lambda: mm.save(path, {"n": 1}),
                         "save of a dict without tensors needs mesh=")
    raises_on_every_rank(mm.CheckpointError, lambda: mm.save(path, {"p": [t, mm.Mesh(f"all:{N}").zeros("a:4")]}),
                         f"tensor 'p/1' lives on another Mesh object ([all:{N}]) than tensor 'p/0' ([all:{N}]): "
                         f"save tensors of one mesh")
    if N > 1:
        odd = mesh.rank == N - 1
        raises_on_every_rank(mm.CheckpointError, lambda: mm.save(path, {"t": t, "epoch": [2 if odd else 1]}),
                             f"cannot save checkpoint {path!r}: the ranks disagree on entry 'epoch/0': "
                             f"{ranks(list(range(N - 1)))}: int 1; rank {N - 1}: int 2")
        raises_on_every_rank(mm.CheckpointError, lambda: mm.save(path, {"t": t, "x": (1,) if odd else [1]}),
                             f"cannot save checkpoint {path!r}: the ranks disagree on entry 'x': "
                             f"{ranks(list(range(N - 1)))}: list of 1; rank {N - 1}: tuple of 1")
    assert listed(mesh, str(root)) == []
    mm.save(path, {"n": 1.5, "s": ["x"]}, mesh=mesh)  # no tensor at all
    assert mm.load(path, mesh) == {"n": 1.5, "s": ["x"]}


@pytest.mark.parametrize("damage,words", [
    ("tensor", r"its tree names tensors \['p/0', 'p~1x'\], it holds \['p/0', 'p/1'\]"),
    ("kind", r"malformed entry \(ValueError: node \{'set': \[\]\} is none of dict"),
    ("version", r"version 1 with a tree, this mpimesh reads version 1 without and 2 with one"),
    ("no-tree", r"version 2 without a tree"),
    ("value", r"malformed entry \(ValueError: node \{'value': \[1\]\}")])
def test_a_damaged_tree_is_refused(shared_dir, damage, words):
    """An index whose tree (resealed: its checksum made again) names another tensor, holds a node of
    an unknown kind or a list as a value, or whose version does not match whether it has a tree, is
    refused on every rank and by verify."""
    mesh = world(f"all:{N}")
    path = str(shared_dir / f"damaged-tree-{damage}")
    mm.save(path, {"p": [mesh.zeros("a:3"), mesh.ones("a:2")], "n": 1})
    index = Path(path) / "index.json"

    def spoil():
        d = json.loads(index.read_text())
        node = d["tree"]["dict"]
        if damage == "tensor":
            node[0][1]["list"][1]["tensor"] = "p~1x"
        elif damage == "kind":
            node[1][1] = {"set": []}
        elif damage == "version":
            d["version"] = 1
        elif damage == "no-tree":
            del d["tree"]
        else:
            node[1][1]["value"] = [1]
        index.write_text(json.dumps(reseal(d)))
    on_rank0(mesh, spoil)
    load_everywhere(path, f"inconsistent checkpoint index .*{words}")
    assert re.search(words, ckpt.verify(path))


def test_shapes_of_a_nest(shared_dir):
    """`shapes=` for a nest has its nesting: shapes (str, Shape) or tensors of those shapes in the
    tensors' places, plain values ignored; what differs is named by the tensor's path."""
    mesh = world(f"all:{N}")
    params = {"l1/w": mesh.zeros("i:4;o:6"), "b": mesh.zeros("o:6")}
    opt = mm.optim.Adam(0.1)
    path = str(shared_dir / "nest-shapes")
    mm.save(path, {"params": params, "state": opt.init(params), "epoch": 3})
    template = {"params": params, "state": opt.init(params), "epoch": None}
    assert mm.load(path, mesh, shapes=template)["epoch"] == 3
    assert mm.load(path, mesh, shapes={"params": {"l1/w": "i:4;o:6", "b": mm.Shape("o:6")},
                                       "state": opt.init(params)})["state"]["m"]["b"].shape == mm.Shape("o:6")
    other = {"l1/w": mesh.zeros("i:4;o:8"), "b": mesh.zeros("o:8")}
    for want, message in [
            ({"params": other, "state": opt.init(other)},
             r"tensor 'params/l1~1w': checkpoint has o:6, expected o:8 \(and 5 more tensors\)"),
            ({"params": params, "state": mm.optim.SGD(0.1, momentum=0.9).init(params), "more": [params["b"]]},
             r"it lacks \['more/0'\] and has unexpected \['state/m/l1~1w', 'state/m/b'\]"),
            ({"params": params}, r"it has unexpected \['state/step', 'state/m/l1~1w', 'state/m/b'\] and 2 more")]:
        raises_on_every_rank(mm.CheckpointError, lambda: mm.load(path, mesh, shapes=want),
                             f"checkpoint {os.path.abspath(path)!r} does not fit: {message}".replace("\\", ""))


def adam_grads(mesh: mm.Mesh, params: dict, step: int) -> dict:
    """Fixed float64 gradients for `step`, in each parameter's layout."""
    return {k: mesh.from_numpy(global_array(str(p.shape), 100 * step + i, np.float64), p.shape, p.layout)
            for i, (k, p) in enumerate(params.items())}


def test_adam_resumes_from_a_nest(shared_dir):
    """Adam's state from opt.init, saved in a nest with the params (keys holding '/', uneven float64
    tensors) after 2 steps, loaded onto every mesh and another layout: the next 2 steps give the same
    params, moments and step, bit for bit, as the uninterrupted run."""
    mesh = world(f"all:{N}")
    glob = {"l1/kernel": global_array("i:5;o:7", 1, np.float64), "l1/bias": global_array("o:7", 2, np.float64),
            "out": global_array("o:7;k:3", 3, np.float64)}
    params = {k: mesh.from_numpy(g, mm.Shape(s), {"o": "all"})
              for (k, g), s in zip(glob.items(), ["i:5;o:7", "o:7", "o:7;k:3"])}
    opt = mm.optim.Adam(0.05, weight_decay=0.01)
    state = opt.init(params)
    for step in (1, 2):
        params, state = opt.update(params, adam_grads(mesh, params, step), state)
    path = str(shared_dir / "adam-nest")
    mm.save(path, {"params": params, "opt": state, "epoch": 2, "lr": 0.05})
    straight = (params, state)
    for step in (3, 4):
        straight = opt.update(*straight[:1], adam_grads(mesh, straight[0], step), straight[1])
    want = [t.to_numpy() for t in tree_tensors(straight)]
    for dst in mesh_shapes():
        for rules in ["", rules_for(world(dst), ["i", "o", "k"]), rules_for(world(dst), ["k", "i"])]:
            back = mm.load(path, world(dst), rules)
            assert (back["epoch"], back["lr"]) == (2, 0.05)
            resumed = (back["params"], back["opt"])
            for step in (3, 4):
                resumed = opt.update(resumed[0], adam_grads(world(dst), resumed[0], step), resumed[1])
            got = [t.to_numpy() for t in tree_tensors(resumed)]
            assert len(got) == len(want) == 10 and int(resumed[1]["step"].to_numpy()) == 4
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), (dst, rules)


@pytest.mark.parametrize("which", ["state", "params", "factored", "dtype"])
def test_a_checkpoint_for_another_model_is_blamed(shared_dir, which):
    """A state loaded without shapes= whose tensor does not fit its parameter (or a loaded parameter
    that its fresh state does not fit): the optimizer's error names the checkpoint and the tensor on
    every rank, not just the optimizer's slot."""
    mesh = world(f"all:{N}")
    path = str(shared_dir / f"another-model-{which}")
    old = {"w": mesh.zeros("r:4;c:6", dtype="float32" if which == "dtype" else "float64")}
    new = {"w": mesh.zeros("r:4;c:8" if which != "dtype" else "r:4;c:6", dtype="float64")}
    opt = mm.optim.Adafactor(0.01, min_dim_size_to_factor=2) if which == "factored" else mm.optim.Adam(0.01)
    mm.save(path, {"params": old, "state": opt.init(old)})
    back = mm.load(path, mesh, "c:all")
    where = f"checkpoint {os.path.abspath(path)!r}"
    tail = "the checkpoint was saved for another model (or pass shapes= to mm.load to check at load time)"
    params, state = (back["params"], opt.init(new)) if which == "params" else (new, back["state"])
    grads = {"w": params["w"] * 0.0}
    message = {
        "state": f"Adam state slot 'm' of param 'w': tensor 'state/m/w' loaded from {where} has shape [r:4, c:6], "
                 f"but parameter 'w' has [r:4, c:8]: {tail}",
        "params": f"Adam state slot 'm' of param 'w': the state has shape [r:4, c:8], but tensor 'params/w' "
                  f"loaded from {where} has [r:4, c:6]: {tail}",
        "factored": f"Adafactor state slot 'vc' of param 'w': tensor 'state/vc/w' loaded from {where} has shape "
                    f"[c:6], but parameter 'w' has [r:4, c:8], which needs [c:8]: {tail}",
        "dtype": f"Adam state slot 'm' of param 'w' has dtype float32, expected float64 (the param's is float64) "
                 f"(tensor 'state/m/w' loaded from {where}: the checkpoint was saved for another model)"}[which]
    raises_on_every_rank(mm.DTypeError if which == "dtype" else mm.ShapeError,
                         lambda: opt.update(params, grads, state), message)


def test_numbered_nests_through_mm(shared_dir):
    """mm.save_step, mm.steps, mm.newest_intact and mm.step_path (mpimesh.checkpoint's) keep numbered
    nests: the newest two, the newest intact one found past a corrupted newer one, loaded as saved."""
    assert (mm.save_step, mm.steps, mm.newest_intact, mm.step_path) == (
        ckpt.save_step, ckpt.steps, ckpt.newest_intact, ckpt.step_path)
    mesh = world(f"all:{N}")
    root = str(shared_dir / "numbered-nests")
    g = np.arange(7.0)
    for step in (1, 2, 3):
        nest = {"params": {"l/w": mesh.from_numpy(g * step, "n:7", "n:all")}, "step": step, "tag": ["run", 0.5]}
        assert mm.save_step(root, step, nest, keep=2) == mm.step_path(root, step)
    assert mm.steps(root, mesh) == [2, 3] and mm.newest_intact(root, mesh) == 3
    part = Path(mm.step_path(root, 3)) / "part-00000.bin"
    on_rank0(mesh, lambda: part.write_bytes(b"\xff" + part.read_bytes()[1:]))
    assert mm.newest_intact(root, mesh) == 2
    back = mm.load(mm.step_path(root, mm.newest_intact(root, mesh)), mesh, "")
    assert (back["step"], back["tag"]) == (2, ["run", 0.5])
    np.testing.assert_array_equal(back["params"]["l/w"].to_numpy(), g * 2)
