"""safetensors in and out (`mm.save(..., format="safetensors")`, `mm.load`), against the `safetensors`
package's own numpy functions: a file written by `safetensors.numpy.save_file` loads on every mesh
shape under several layouts with numpy's values and each rank's block cut as `numpy.array_split` cuts
it, reading only that block's bytes; our sharded export reads back with `safetensors.numpy.load_file`
and its index; the round trip is bitwise (bfloat16, NaN payloads and -0.0 included); bad input raises
the same error on every rank."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from meshes import expected_local, get_mesh, layouts, local_size, mesh_shapes, spec  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import async_save, safetensors_io  # noqa: E402
from mpimesh.backend import to_host  # noqa: E402

st = pytest.importorskip("safetensors.numpy")

N = MPI.COMM_WORLD.Get_size()
BF16 = np.dtype(ml_dtypes.bfloat16)
# name: (sizes, dtype). Sizes that 2, 3 and 4 ranks do not divide, a dim of 2 (empty blocks on 3 and
# more ranks), one of 0, a 0-d tensor.
TENSORS = {"w": ((5, 7), np.float32), "emb": ((9, 4), BF16), "h": ((6, 2, 3), np.float16), "ids": ((7,), np.int32),
           "mask": ((2, 5), np.bool_), "b": ((4,), np.uint8), "d": ((3, 5), np.float64), "s": ((), np.float64),
           "z": ((0, 3), np.float32)}


def arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """The global arrays (the same on every rank); floats hold a NaN with a payload, inf and -0.0."""
    rng, out = np.random.default_rng(seed), {}
    for name, (sizes, dtype) in TENSORS.items():
        g = np.asarray(rng.standard_normal(sizes) * 10)
        if np.dtype(dtype) == np.bool_:
            out[name] = g > 0
        elif np.dtype(dtype).kind in "iu":
            out[name] = np.abs(g).astype(dtype)
        else:
            a = g.astype(dtype)
            flat = a.reshape(-1)
            if flat.size >= 3:
                flat[:3] = [np.inf, -0.0, np.nan]
                bits = flat.view(f"u{a.itemsize}")
                bits[2] |= 1  # a NaN payload: kept bit for bit
            out[name] = a
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def default_shape(name: str) -> mm.Shape:
    sizes = TENSORS[name][0]
    return mm.Shape([(f"dim{i}", n) for i, n in enumerate(sizes)])


@pytest.fixture(scope="module")
def shared_dir():
    """A temporary directory every rank agrees on."""
    name = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="mpimesh-st-") if MPI.COMM_WORLD.rank == 0 else None)
    yield Path(name)
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.rank == 0:
        shutil.rmtree(name, ignore_errors=True)


def on_rank0(fn) -> None:
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.rank == 0:
        fn()
    MPI.COMM_WORLD.Barrier()


def raises_on_every_rank(exc: type, fn, pattern: str) -> str:
    """`fn()` raises `exc` with one message on every rank, matching `pattern`; the message."""
    try:
        fn()
        got = ("nothing raised", "")
    except Exception as e:  # anything: every rank must reach the allgather
        got = (type(e).__name__, str(e))
    every = MPI.COMM_WORLD.allgather(got)
    assert len(set(every)) == 1 and every[0][0] == exc.__name__, every
    assert re.search(pattern, every[0][1]), every[0][1]
    return every[0][1]


@pytest.fixture(scope="module")
def hf_file(shared_dir) -> Path:
    """A file written by safetensors.numpy.save_file (no mpimesh metadata), by rank 0."""
    path = shared_dir / "theirs.safetensors"
    on_rank0(lambda: st.save_file(arrays(1), str(path)))
    return path


def _layouts(mesh: mm.Mesh) -> list[dict]:
    return layouts(mesh, ["dim0", "dim1", "dim2"], limit=5)


@pytest.mark.parametrize("shape", mesh_shapes())
def test_a_save_file_file_loads_on_every_mesh_and_layout(hf_file, shape):
    """Each rank's block of each tensor equals numpy.array_split's of the global array, bit for bit,
    and the rank read exactly its blocks' bytes (0-d tensors: one element; empty blocks: nothing)."""
    mesh, glob = get_mesh(shape), arrays(1)
    for rules in _layouts(mesh):
        loaded = mm.load(str(hf_file), mesh, spec(rules))
        assert sorted(loaded) == sorted(glob)
        want_bytes = 0
        for name, g in glob.items():
            t = loaded[name]
            lay = {d: m for d, m in rules.items() if d in t.shape}
            assert t.shape == default_shape(name) and t.layout == lay, (name, t.shape, t.layout)
            assert same_bits(to_host(t.local), expected_local(g, t.shape.names, lay, mesh)), (name, rules)
            assert same_bits(t.to_numpy(), g), name
            want_bytes += local_size(mesh, dict(zip(t.shape.names, t.shape.sizes)), lay) * g.itemsize
        assert safetensors_io.last_read == {"bytes": want_bytes, "tensors": len(glob)}, rules


def test_shapes_name_the_dims_and_pick_tensors(hf_file):
    """`shapes=` names the dims (the layout refers to them) and loads those tensors only."""
    mesh, glob = get_mesh(mesh_shapes()[0]), arrays(1)
    loaded = mm.load(str(hf_file), mesh, "vocab:all", shapes={"emb": "vocab:9;d_model:4", "s": ""})
    assert list(loaded) == ["emb", "s"] and loaded["emb"].layout == ({"vocab": "all"})
    assert same_bits(loaded["emb"].to_numpy(), glob["emb"]) and loaded["emb"].dtype == BF16
    assert same_bits(loaded["s"].to_numpy(), glob["s"])
    assert loaded["emb"].origin == (str(hf_file), "emb")


def test_each_rank_reads_only_its_block(shared_dir):
    """A 64 x 48 float32 tensor split over every mesh dim: the ranks' reads add up to the tensor's bytes
    once (no rank reads another's block); replicated, every rank reads it whole."""
    path = shared_dir / "big.safetensors"
    g = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    on_rank0(lambda: st.save_file({"x": g}, str(path)))
    for shape in mesh_shapes():
        mesh = get_mesh(shape)
        names = [d.name for d in mesh.shape if d.size > 1]
        for rules in ([{"dim0": names[0]}] if len(names) == 1 else
                      [{"dim0": names[0], "dim1": names[1]}] if len(names) >= 2 else []) + [{}]:
            x = mm.load(str(path), mesh, spec(rules))["x"]
            mine = safetensors_io.last_read["bytes"]
            every = MPI.COMM_WORLD.allgather(mine)
            assert mine == local_size(mesh, {"dim0": 64, "dim1": 48}, rules) * 4 == x.local.nbytes
            copies = mesh.size // int(np.prod([mesh.shape[m].size for m in rules.values()] or [1]))
            assert sum(every) == g.nbytes * copies, (shape, rules, every)
            assert same_bits(x.to_numpy(), g)


@pytest.mark.parametrize("shape", mesh_shapes())
def test_our_sharded_export_reads_with_load_file(shared_dir, shape):
    """Saved from `shape` with dims split: Hugging Face's names and index, each tensor whole in one
    shard of at most max_shard_bytes (or alone), and safetensors.numpy.load_file gives the arrays bit
    for bit; then it loads back on every mesh, dims named as saved."""
    mesh, glob = get_mesh(shape), arrays(2)
    names = [d.name for d in mesh.shape if d.size > 1]
    dims = {name: mm.Shape([(f"{name}{i}", n) for i, n in enumerate(sizes)]) for name, (sizes, _) in TENSORS.items()}
    rules = {f"{name}0": names[i % len(names)] for i, name in enumerate(TENSORS)} if names else {}
    tensors = {"model": {n: mesh.from_numpy(glob[n], dims[n], {d: m for d, m in rules.items() if d in dims[n]})
                         for n in ("w", "emb", "h", "ids", "mask")},
               **{n: mesh.from_numpy(glob[n], dims[n]) for n in ("b", "d", "s", "z")}}
    path = shared_dir / f"export-{shape}"
    limit = 100
    assert mm.save(path, tensors, format="safetensors", max_shard_bytes=limit) is None
    full = {("model/" + n if n in ("w", "emb", "h", "ids", "mask") else n): g for n, g in glob.items()}
    if MPI.COMM_WORLD.rank == 0:
        files = sorted(os.listdir(path))
        index = json.loads((path / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert files == shards + ["model.safetensors.index.json"] and len(shards) > 2, files
        assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", f) for f in shards)
        assert sorted(index["weight_map"]) == sorted(full)
        assert index["metadata"]["total_size"] == sum(g.nbytes for g in glob.values())
        for f in shards:
            back = st.load_file(str(path / f))
            assert set(back) == {n for n, v in index["weight_map"].items() if v == f}
            assert len(back) == 1 or sum(a.nbytes for a in back.values()) <= limit, f
            for n, a in back.items():
                assert same_bits(a, full[n]), n
        assert not [n for n in os.listdir(shared_dir) if n.startswith(f".export-{shape}")]  # no temp dir left
    for other in mesh_shapes():
        loaded = mm.load(path, get_mesh(other), "")
        assert sorted(loaded) == sorted(full)
        for n, g in full.items():
            assert loaded[n].shape == dims[n.split("/")[-1]] and same_bits(loaded[n].to_numpy(), g), n


@pytest.mark.parametrize("src", mesh_shapes())
def test_round_trip_is_bitwise_onto_any_mesh(shared_dir, src):
    """One file (no max_shard_bytes): saved from `src` under one layout, loaded onto every mesh shape
    under others, every tensor bit for bit; a second save replaces the first."""
    mesh = get_mesh(src)
    path = shared_dir / f"round-{src}"
    for seed in (3, 4):
        glob = arrays(seed)
        names = [d.name for d in mesh.shape if d.size > 1]
        rules = dict(zip(["dim1", "dim0"], names))
        mm.save(path, {n: mesh.from_numpy(g, default_shape(n), {d: m for d, m in rules.items()
                                                                  if d in default_shape(n)})
                       for n, g in glob.items()}, format="safetensors")
    on_rank0(lambda: None)
    assert MPI.COMM_WORLD.bcast(sorted(os.listdir(path))) == ["model.safetensors"]
    for dst in mesh_shapes():
        other = get_mesh(dst)
        for rules in _layouts(other)[-2:]:
            loaded = mm.load(path, other, spec(rules))
            for n, g in glob.items():
                assert loaded[n].dtype == g.dtype and same_bits(loaded[n].to_numpy(), g), (n, dst, rules)


def test_background_save_writes_the_values_of_the_call(shared_dir, monkeypatch):
    """blocking=False: the tensors changed in place after the call, before the background thread starts
    (held back 0.3 s), do not change what is saved."""
    run = async_save.SaveHandle._run
    monkeypatch.setattr(async_save.SaveHandle, "_run", lambda self, *a: (time.sleep(0.3), run(self, *a)))
    mesh = get_mesh(mesh_shapes()[-1])
    g = np.arange(30.0).reshape(5, 6)
    t = mesh.from_numpy(g, "a:5;b:6", {"a": mesh.shape.names[0]})
    h = mm.save(shared_dir / "async", {"t": t}, format="safetensors", blocking=False)
    t.local[...] = -1.0
    h.wait()
    assert h.done() and same_bits(mm.load(shared_dir / "async", mesh, "")["t"].to_numpy(), g)


def test_bad_input_raises_on_every_rank(shared_dir, hf_file):
    mesh = get_mesh(mesh_shapes()[0])
    ok = mesh.from_numpy(np.ones((2, 3)), "a:2;b:3")
    target = str(shared_dir / "bad")
    where = re.escape(repr(str(hf_file)))
    raises_on_every_rank(mm.CheckpointError, lambda: mm.load(hf_file, mesh, shapes={"w": "a:5;b:7", "nope": "a:1"}),
                         rf"^safetensors {where} holds no tensor 'nope'; it holds 9: ")
    raises_on_every_rank(mm.CheckpointError, lambda: mm.load(hf_file, mesh, shapes={"w": "a:7;b:5"}),
                         rf"^safetensors {where}: tensor 'w' has shape \(5, 7\), expected \[a:7, b:5\] \(7, 5\)$")
    f8 = shared_dir / "f8.safetensors"
    on_rank0(lambda: st.save_file({"q": np.ones(4, ml_dtypes.float8_e4m3fn), "ok": np.ones(2)}, str(f8)))
    raises_on_every_rank(mm.CheckpointError, lambda: mm.load(f8, mesh),
                         r"tensor 'q' has dtype F8_E4M3, which mpimesh tensors cannot hold \(they read BOOL, ")
    assert mm.load(f8, mesh, shapes={"ok": "a:2"})["ok"].to_numpy().tolist() == [1.0, 1.0]
    c128 = mesh.from_numpy(np.ones(2, np.complex128), "c:2")
    raises_on_every_rank(mm.CheckpointError, lambda: mm.save(target, {"x": ok, "c": c128}, format="safetensors"),
                         r"^tensor 'c' is complex128, which safetensors files cannot hold; they hold bool, ")
    raises_on_every_rank(mm.CheckpointError, lambda: mm.save(target, {"x": ok, "n": {"step": 3}},
                                                             format="safetensors"),
                         r"^cannot save 'n/step' in safetensors files: they hold tensors only .* got int$")
    raises_on_every_rank(mm.CheckpointError, lambda: mm.save(target, {"a": {"b": ok}, "a/b": ok},
                                                             format="safetensors"),
                         r"the name 'a/b' comes twice")
    raises_on_every_rank(mm.CheckpointError, lambda: mm.save(target, {"x": ok}, format="gguf"),
                         r"^format must be one of 'mpimesh', 'safetensors', got 'gguf'$")
    raises_on_every_rank(mm.CheckpointError, lambda: mm.save(target, {"x": ok}, max_shard_bytes=10),
                         r"^max_shard_bytes is for format='safetensors'")
    raises_on_every_rank(mm.CheckpointError, lambda: mm.save(target, {"x": ok}, format="safetensors",
                                                             max_shard_bytes=0),
                         r"^max_shard_bytes must be an int >= 1, got 0$")
    other = shared_dir / "notes"
    on_rank0(lambda: (other.mkdir(), (other / "README.md").write_text("keep")))
    raises_on_every_rank(mm.CheckpointError, lambda: mm.save(other, {"x": ok}, format="safetensors"),
                         r"exists and is not a safetensors export \(it holds \['README.md'\]\); refusing")
    assert (other / "README.md").read_text() == "keep"
    broken = shared_dir / "broken"
    on_rank0(lambda: (broken.mkdir(), (broken / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}})),
        shutil.copy(hf_file, broken / "model-00001-of-00001.safetensors")))
    assert mm.load(broken, mesh)["w"].shape == default_shape("w")
    on_rank0(lambda: (broken / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors", "v": "model-00001-of-00001.safetensors"}})))
    raises_on_every_rank(mm.CheckpointError, lambda: mm.load(broken, mesh),
                         r"puts \['v'\] in 'model-00001-of-00001.safetensors', which does not hold it")
    on_rank0(lambda: (broken / "model-00001-of-00001.safetensors").write_bytes(b"\x08" + bytes(20)))
    raises_on_every_rank(mm.CheckpointError, lambda: mm.load(broken, mesh), r"^cannot read safetensors .*broken")


def test_missing_package_names_the_extra(monkeypatch):
    mesh = get_mesh(mesh_shapes()[0])
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)  # (import fails as if not installed)
    raises_on_every_rank(mm.MissingDependencyError,
                         lambda: mm.save("x", {"a": mesh.ones("a:2")}, format="safetensors"),
                         r"needs safetensors, which is not installed: run `python3 install.py safetensors` .*"
                         r"pip install -e \"\.\[safetensors\]\"")


def test_the_transformer_app_exports_its_model(shared_dir):
    """apps/transformer.py --export DIR: the trained parameters (those of its last checkpoint), bit for bit,
    under their names with their dims, and config.json holding the model's sizes; a DIR holding other
    files is refused before training."""
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "apps"))
    import transformer as T
    tiny = ["--d_model", "16", "--heads", "8", "--d_kv", "4", "--d_ff", "32", "--layers", "1", "--length", "8",
            "--batch", "8", "--data", str(root / "tests" / "data" / "corpus.txt"), "--heldout", "0.3",
            "--eval-batches", "1", "--samples", "0", "--steps", "2"]
    out, ck = shared_dir / "app-export", shared_dir / "app-ck"
    T.main(tiny + ["--checkpoint", str(ck), "--export", str(out)])
    mesh = get_mesh(mesh_shapes()[1])
    cfg = T.Config(d_model=16, heads=8, d_kv=4, d_ff=32, layers=1, length=8, batch=8)
    template = T.init_params(mesh, cfg)
    trained = T.load_checkpoint(str(ck / "step-00000002"), mesh, template, T.make_optimizer(cfg).init(template))[0]
    exported = mm.load(out, mesh)
    assert sorted(exported) == sorted(trained)
    for name, t in trained.items():
        assert exported[name].shape == t.shape and same_bits(exported[name].to_numpy(), t.to_numpy()), name
    if MPI.COMM_WORLD.rank == 0:
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
        config = json.loads((out / "config.json").read_text())
        assert config == {"model_type": "mpimesh-transformer", "d_model": 16, "heads": 8, "d_kv": 4, "d_ff": 32,
                          "layers": 1, "vocab": 256, "length": 8, "activation": "relu", "moe_every": 0, "experts": 0,
                          "dtype": "float32", "parameters_dtype": "float32"}
        assert st.load_file(str(out / "model.safetensors"))["layer0/att/q/kernel"].shape == (16, 8, 4)
    other = shared_dir / "app-notes"
    on_rank0(lambda: (other.mkdir(), (other / "notes.txt").write_text("keep")))
    with pytest.raises(SystemExit):
        T.main(tiny + ["--export", str(other)])
    assert (other / "notes.txt").read_text() == "keep"
