"""Checkpoints: save on one mesh and layout, load on another (values vs numpy), atomic replace,
corrupted, truncated, inconsistent or mismatched (`shapes=`) checkpoints failing with CheckpointError
on every rank, and directories of numbered checkpoints (save_step, steps, prune). Ranks that disagree on
what they save, arguments of the wrong type or value, and unexpected errors on one rank all raise the
same error on every rank; the dict's order does not matter."""
from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from meshes import global_array, layouts, mesh_shapes, spec  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.backend import to_host  # noqa: E402
from mpimesh import counters  # noqa: E402
from mpimesh import checkpoint as ckpt  # noqa: E402

N = MPI.COMM_WORLD.Get_size()
SHAPES = {"x": "a:8;b:16;c:8", "w": "b:16;h:24", "idx": "a:8;c:8", "s": "", "flag": "h:24"}
DTYPES = {"x": np.float32, "w": np.float64, "idx": np.int32, "s": np.float64, "flag": np.bool_}
_MESHES: dict = {}


def world(shape: str) -> mm.Mesh:
    if shape not in _MESHES:
        _MESHES[shape] = mm.Mesh(shape)
    return _MESHES[shape]


def arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """Reference global arrays (identical on every rank)."""
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        g = global_array(shape, seed + i, np.float64) * 100
        out[name] = (g > 0) if DTYPES[name] is np.bool_ else g.astype(DTYPES[name])
    return out


def split_dims(mesh: mm.Mesh) -> list[str]:
    return [d.name for d in mesh.shape if d.size > 1]


def tensors(mesh: mm.Mesh, glob: dict, layout: str) -> dict:
    """The global arrays as tensors on `mesh`, each laid out by the rules `layout`."""
    rules = mm.LayoutRules(layout)
    out = {}
    for name, g in glob.items():
        shape = mm.Shape(SHAPES[name])
        lay = {d: m for d, m in rules.pairs if d in shape}
        out[name] = mesh.from_numpy(g, shape, lay)
    return out


def rules_for(mesh: mm.Mesh, dims: list[str]) -> str:
    """Put `dims` on the mesh's split dims in order (as many as there are)."""
    return ";".join(f"{d}:{m}" for d, m in zip(dims, split_dims(mesh)))


@pytest.fixture(scope="module")
def shared_dir():
    """A temporary directory every rank agrees on (rank 0 makes it, its name is broadcast)."""
    mesh = world(f"all:{N}")
    name = tempfile.mkdtemp(prefix="mpimesh-ckpt-") if mesh.rank == 0 else ""
    name = ckpt._bcast_text(mesh, name, 0)
    yield Path(name)
    mesh.barrier()
    if mesh.rank == 0:
        shutil.rmtree(name, ignore_errors=True)


def on_rank0(mesh: mm.Mesh, fn) -> None:
    """Run a file edit on rank 0 only, between barriers (so every rank sees it before going on)."""
    mesh.barrier()
    if mesh.rank == 0:
        fn()
    mesh.barrier()


def assert_values(loaded: dict, glob: dict) -> None:
    assert list(loaded) == list(glob)
    for name, g in glob.items():
        t = loaded[name]
        assert t.dtype == g.dtype and t.shape == mm.Shape(SHAPES[name]), name
        np.testing.assert_array_equal(t.to_numpy(), g, err_msg=name)


PAIRS = [(a, b) for a in mesh_shapes() for b in mesh_shapes() + ["self"]]


@pytest.mark.parametrize("chunk_bytes", [ckpt.CHUNK_BYTES, 40])
@pytest.mark.parametrize("src,dst", PAIRS)
def test_save_load_reshard(shared_dir, src, dst, chunk_bytes):
    """Saved from mesh `src` with batch-like dims split, loaded onto `dst` with other dims split."""
    glob = arrays(seed=len(src) + len(dst))
    a = world(src)
    path = shared_dir / f"reshard-{src}-{dst}-{chunk_bytes}"
    mm.save(str(path), tensors(a, glob, rules_for(a, ["a", "h"])), chunk_bytes=chunk_bytes)
    if dst == "self":
        b, rules = mm.Mesh("all:1", comm=MPI.COMM_SELF), "b:all"
    else:
        b = world(dst)
        rules = rules_for(b, ["b", "c", "h"])
    loaded = mm.load(str(path), b, rules)
    for name, t in loaded.items():
        assert t.layout == {d: m for d, m in mm.LayoutRules(rules).pairs if d in t.shape}, name
    assert_values(loaded, glob)


# Sizes that do not divide 2, 3 or 4 ranks, a dim of 2 (empty blocks on 3 and more ranks) and one of 0.
UNEVEN = {"u": "p:5;q:7", "e": "p:5;r:2", "t": "r:2;q:7;m:10", "z": "q:7;n:0"}
UNEVEN_DTYPES = {"u": np.float64, "e": np.int32, "t": np.float32, "z": np.float64}


def uneven_arrays(seed: int) -> dict[str, np.ndarray]:
    return {n: (global_array(s, seed + i, np.float64) * 100).astype(UNEVEN_DTYPES[n])
            for i, (n, s) in enumerate(UNEVEN.items())}


@functools.lru_cache(maxsize=None)
def sub_mesh(n: int) -> mm.Mesh:
    """A 1-D mesh of the first `n` ranks (the other ranks get one of their own): another rank count."""
    comm = MPI.COMM_WORLD.Split(0 if MPI.COMM_WORLD.rank < n else 1, MPI.COMM_WORLD.rank)
    return mm.Mesh(f"all:{comm.Get_size()}", comm=comm)


def array_split_block(g: np.ndarray, shape: mm.Shape, mesh: mm.Mesh, layout: dict) -> np.ndarray:
    """This rank's block of `g`, cut by hand with numpy.array_split."""
    for axis, name in enumerate(shape.names):
        m = layout.get(name)
        if m is not None:
            g = np.array_split(g, mesh.shape[m].size, axis=axis)[mesh.coords[m]]
    return g


def save_uneven(mesh: mm.Mesh, glob: dict, rules: dict, path: str, chunk_bytes: int) -> None:
    tensors = {}
    for name, g in glob.items():
        shape = mm.Shape(UNEVEN[name])
        tensors[name] = mesh.from_numpy(g, shape, {d: m for d, m in rules.items() if d in shape})
    mm.save(path, tensors, chunk_bytes=chunk_bytes)


def check_uneven_load(path: str, mesh: mm.Mesh, glob: dict) -> None:
    """Load `path` onto `mesh` under a few layouts: every rank's block is numpy.array_split's."""
    for rules in layouts(mesh, ["q", "m", "r", "p", "n"], limit=4):
        loaded = mm.load(path, mesh, spec(rules))
        assert list(loaded) == list(glob)
        for name, g in glob.items():
            t, shape = loaded[name], mm.Shape(UNEVEN[name])
            lay = {d: m for d, m in rules.items() if d in shape}
            assert t.shape == shape and t.dtype == g.dtype and t.layout == lay, (name, rules)
            np.testing.assert_array_equal(to_host(t.local), array_split_block(g, shape, mesh, lay), err_msg=f"{name} {rules}")
            np.testing.assert_array_equal(t.to_numpy(), g, err_msg=f"{name} {rules}")


@pytest.mark.parametrize("chunk_bytes", [ckpt.CHUNK_BYTES, 16])
@pytest.mark.parametrize("src", mesh_shapes())
def test_uneven_layouts_and_rank_counts(shared_dir, src, chunk_bytes):
    """Uneven and empty blocks (array_split's) saved from every layout of `src`, each writer's slice
    of its own size (several chunks of 16 bytes each, in differing numbers), loaded onto every mesh of
    this rank count, onto 1 rank and onto 2; a checkpoint saved on 2 ranks loads onto all of them."""
    mesh = world(src)
    glob = uneven_arrays(len(src) + chunk_bytes)
    for i, rules in enumerate(layouts(mesh, ["p", "q", "r", "m"], limit=4)):
        path = str(shared_dir / f"uneven-{src}-{chunk_bytes}-{i}")
        save_uneven(mesh, glob, rules, path, chunk_bytes)
        index = json.loads(Path(path, "index.json").read_text())
        for spec_ in index["tensors"]:  # each slice's shape is its writer's block
            sizes = [d for _, d in spec_["shape"]]
            for s in spec_["slices"]:
                assert all(n in [len(b) for b in np.array_split(np.arange(d), mesh.shape[spec_["layout"][name]].size)]
                           for (name, d), n in zip(spec_["shape"], s["shape"]) if name in spec_["layout"]), s
            assert sum(math.prod(s["shape"]) for s in spec_["slices"]) == math.prod(sizes), spec_["name"]
        for dst in mesh_shapes():
            check_uneven_load(path, world(dst), glob)
        check_uneven_load(path, mm.Mesh("all:1", comm=MPI.COMM_SELF), glob)
        if N > 2:
            check_uneven_load(path, sub_mesh(2), glob)  # the first 2 ranks, and the rest together
    if N > 1:  # saved on 2 ranks (the rest on N - 2), loaded on N and on 1
        small = sub_mesh(2)
        path = str(shared_dir / f"uneven-from-2-{src}-{chunk_bytes}")
        first = MPI.COMM_WORLD.rank < 2  # on 4 ranks the rest are 2 as well: they must not share `path`
        save_uneven(small, glob, {"p": "all", "m": "all"}, path if first else path + "-rest", chunk_bytes)
        mesh.barrier()
        check_uneven_load(path, mesh, glob)
        check_uneven_load(path, mm.Mesh("all:1", comm=MPI.COMM_SELF), glob)


def test_default_layout_and_scope(shared_dir):
    """Without `layout`, load uses the rules in force on the mesh (its own, or a layout_scope's)."""
    glob = arrays(3)
    src = world(mesh_shapes()[1])
    path = str(shared_dir / "default-layout")
    mm.save(path, tensors(src, glob, rules_for(src, ["c", "b"])))
    dst = mm.Mesh(f"all:{N}", layout="h:all")
    loaded = mm.load(path, dst)
    assert loaded["w"].layout == {"h": "all"}
    assert_values(loaded, glob)
    with mm.layout_scope(dst, "a:all"):
        loaded = mm.load(path, dst)
    assert loaded["x"].layout == {"a": "all"} and loaded["w"].layout == {}
    assert_values(loaded, glob)


def test_each_rank_writes_only_its_slices(shared_dir):
    """Replicas are written once, part files hold only slices, and no tensor data is gathered."""
    mesh = world(mesh_shapes()[1])  # 2-D
    glob = {"x": global_array("a:8;b:16;c:8", 1, np.float64)}
    split = split_dims(mesh)
    path = shared_dir / "writers"
    lay = {"a": split[0]} if split else {}
    with mm.profile() as prof:
        mm.save(str(path), {"x": mesh.from_numpy(glob["x"], "a:8;b:16;c:8", lay)})
    moved = sum(c.get("bytes", 0) for k, c in counters.traffic(prof.counters).items()
                if k not in ("d2h", "h2d"))  # (on a GPU each rank's own block comes to the host to be written)
    assert moved <= 64 * mesh.size  # a few checksums, never the 8 KiB tensor
    parts = sorted(p.name for p in path.iterdir() if p.name != "index.json")
    k = mesh.shape[split[0]].size if split else 1
    assert len(parts) == k
    blocks = np.array_split(glob["x"], k)  # a:8 over 3 ranks: blocks of 3, 3 and 2 rows
    assert [(path / p).stat().st_size for p in parts] == [b.nbytes for b in blocks]
    index = json.loads((path / "index.json").read_text())
    (spec,) = index["tensors"]
    assert spec["dtype"] == "<f8" and spec["layout"] == lay
    assert index["mesh"] == [[d.name, d.size] for d in mesh.shape]
    np.testing.assert_array_equal(mm.load(str(path), mesh, "")["x"].to_numpy(), glob["x"])


def test_overwrite(shared_dir):
    """Saving over an existing checkpoint replaces it whole, leaving no temporary directories."""
    mesh = world(f"all:{N}")
    root = shared_dir / "overwrite"
    on_rank0(mesh, lambda: root.mkdir())
    path = str(root / "ck")
    mm.save(path, tensors(mesh, arrays(0), "a:all"))
    new = {"w": arrays(7)["w"]}
    mm.save(path, {"w": mesh.from_numpy(new["w"], SHAPES["w"], "h:all")})
    loaded = mm.load(path, mesh, "b:all")
    assert list(loaded) == ["w"]
    np.testing.assert_array_equal(loaded["w"].to_numpy(), new["w"])
    assert sorted(os.listdir(root)) == ["ck"]


def test_refuses_to_replace_other_files(shared_dir):
    mesh = world(f"all:{N}")
    path = shared_dir / "not-a-checkpoint"
    on_rank0(mesh, lambda: (path.mkdir(), (path / "notes.txt").write_text("keep me")))
    with pytest.raises(mm.CheckpointError, match="not an mpimesh checkpoint"):
        mm.save(str(path), tensors(mesh, arrays(), ""))
    assert (path / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(shared_dir / "not-a-checkpoint")) == ["notes.txt"]


def test_failed_save_keeps_old_checkpoint(shared_dir, monkeypatch):
    """A save that fails at the final rename leaves the previous checkpoint intact and no temp dir."""
    mesh = world(f"all:{N}")
    root = shared_dir / "failed"
    on_rank0(mesh, lambda: root.mkdir())
    path = str(root / "ck")
    glob = arrays(1)
    mm.save(path, tensors(mesh, glob, "c:all"))

    def broken(tmp, target):
        raise OSError("disk on fire")

    monkeypatch.setattr(ckpt, "_swap_in", broken)
    with pytest.raises(mm.CheckpointError, match="disk on fire"):
        mm.save(path, tensors(mesh, arrays(2), "c:all"))
    monkeypatch.undo()
    mesh.barrier()
    assert sorted(os.listdir(root)) == ["ck"]
    assert_values(mm.load(path, mesh, "h:all"), glob)


def test_stray_temp_dir_is_not_a_checkpoint(shared_dir):
    """A crashed save's temporary directory (no index yet) is neither loaded nor confused with `path`."""
    mesh = world(f"all:{N}")
    root = shared_dir / "stray"
    stray = root / ".ck.tmp-0123456789abcdef"

    def crash():
        stray.mkdir(parents=True)
        (stray / "part-00000.bin").write_bytes(b"\0" * 100)

    on_rank0(mesh, crash)
    path = str(root / "ck")
    with pytest.raises(mm.CheckpointError, match="no checkpoint"):
        mm.load(path, mesh)
    with pytest.raises(mm.CheckpointError, match="index"):
        mm.load(str(stray), mesh)
    glob = arrays(4)
    mm.save(path, tensors(mesh, glob, "b:all"))
    assert_values(mm.load(path, mesh, "a:all"), glob)
    assert stray.is_dir()


def saved(shared_dir, name: str, chunk_bytes: int = 64) -> tuple[mm.Mesh, str, dict]:
    """A fresh checkpoint saved from the 2-D (or 3-D) mesh."""
    mesh = world(mesh_shapes()[-1])
    glob = arrays(5)
    path = str(shared_dir / name)
    mm.save(path, tensors(mesh, glob, rules_for(mesh, ["a", "b", "h"])), chunk_bytes=chunk_bytes)
    return mesh, path, glob


def load_everywhere(path: str, match: str) -> None:
    """Loading fails with `match` on every rank, on a 1-D world mesh with another layout."""
    mesh = world(f"all:{N}")
    for rules in ["c:all", "h:all", ""]:
        with pytest.raises(mm.CheckpointError, match=match):
            mm.load(path, mesh, rules)


def last_part(path: str) -> Path:
    return sorted(p for p in Path(path).iterdir() if p.name.startswith("part-"))[-1]


def test_corrupted_byte(shared_dir):
    mesh, path, _ = saved(shared_dir, "corrupt")
    part = last_part(path)

    def flip():
        data = bytearray(part.read_bytes())
        data[len(data) - 3] ^= 0x10  # read by one rank only on an 'h:all' or 'c:all' load
        part.write_bytes(bytes(data))

    on_rank0(mesh, flip)
    load_everywhere(path, f"checksum mismatch in .*{part.name}.*corrupted")


@pytest.mark.parametrize("which", ["part", "index"])
def test_truncated(shared_dir, which):
    mesh, path, _ = saved(shared_dir, f"truncated-{which}")
    f = last_part(path) if which == "part" else Path(path) / "index.json"
    on_rank0(mesh, lambda: f.write_bytes(f.read_bytes()[:-5]))
    load_everywhere(path, "truncated" if which == "part" else "not valid JSON")


def reseal(meta: dict) -> dict:
    """`meta` with its checksum made again: an edit that reaches the checks behind it."""
    meta.pop("index_crc32", None)
    return {**meta, "index_crc32": ckpt._index_crc(meta)}


def edit(tensors_spec: list, what: str) -> None:
    spec = next(t for t in tensors_spec if t["name"] == "x")
    if what == "size":
        spec["shape"][0][1] = 16
    elif what == "dtype":
        spec["dtype"] = "<f8"
    elif what == "layout":
        spec["layout"] = {} if spec["layout"] else {"zz": "rows"}
    elif what == "offset":
        spec["slices"][-1]["byte_offset"] += 4
    elif what == "checksum":
        spec["slices"][0]["crc32"][0] ^= 1
    elif what == "dup":
        tensors_spec.append(dict(spec))
    elif what == "offset-str":
        spec["slices"][-1]["byte_offset"] = str(spec["slices"][-1]["byte_offset"])
    elif what == "offset-float":
        spec["slices"][0]["offset"] = [float(o) for o in spec["slices"][0]["offset"]]


@pytest.mark.parametrize("what", ["size", "dtype", "layout", "offset", "checksum", "dup", "missing-part",
                                  "missing-index", "missing-dir", "file-name", "version", "offset-str",
                                  "offset-float"])
def test_mismatched_metadata(shared_dir, what):
    mesh, path, glob = saved(shared_dir, f"edited-{what}")
    index = Path(path) / "index.json"

    def change():
        meta = json.loads(index.read_text())
        if what == "missing-part":
            last_part(path).unlink()
        elif what == "missing-index":
            index.unlink()
        elif what == "missing-dir":
            shutil.rmtree(path)
        elif what == "file-name":
            meta["files"]["../escape.bin"] = meta["files"].pop("part-00000.bin")
            for t in meta["tensors"]:
                for s in t["slices"]:
                    s["file"] = "../escape.bin" if s["file"] == "part-00000.bin" else s["file"]
        elif what == "version":
            meta["version"] = 99
        else:
            edit(meta["tensors"], what)
        if index.exists():
            index.write_text(json.dumps(reseal(meta)))

    on_rank0(mesh, change)
    match = {"checksum": "checksum mismatch", "missing-part": "part-", "missing-index": "index",
             "missing-dir": "no checkpoint", "version": "version 99", "file-name": "escape.bin",
             "dup": "repeated", "offset-str": r"tensor 'x': slice \[.*\]: byte_offset is '\d+', expected ints >= 0",
             "offset-float": r"tensor 'x': slice \[0.0, .*\]: offset is \[0.0, .*\], expected ints >= 0",
             }.get(what, "'x'" if what != "offset" else "expected")
    load_everywhere(path, match)
    if mesh.rank == 0 and what.endswith(("-str", "-float")):  # verify says it as load does
        assert re.search(match, ckpt.verify(path))


def test_bad_arguments(shared_dir):
    mesh = world(f"all:{N}")
    other = mm.Mesh(f"all:{N}")
    path = str(shared_dir / "bad-args")
    with pytest.raises(mm.CheckpointError, match="dict"):
        mm.save(path, [mesh.zeros("a:8")])
    with pytest.raises(mm.CheckpointError, match="'v'"):
        mm.save(path, {"u": mesh.zeros("a:8"), "v": other.zeros("a:8")})
    with pytest.raises(mm.CheckpointError, match="mesh="):
        mm.save(path, {})
    mm.save(path, {}, mesh=mesh)
    assert mm.load(path, mesh) == {}
    mm.save(path, {"u": mesh.zeros("a:8", dtype="float32")})
    with pytest.raises(mm.LayoutError, match="planes"):
        mm.load(path, mesh, "a:planes")


@pytest.mark.parametrize("change,match", [
    ({"x": "a:8;b:32;c:8", "w": "b:32;h:24"}, r"tensor 'x': checkpoint has b:16, expected b:32 \(and 1 more tensors\)$"),
    ({"x": "a:8;b:16;c:4"}, r"tensor 'x': checkpoint has c:8, expected c:4$"),
    ({"x": "a:8;b:16", "v": "a:8"}, r"tensor 'x': checkpoint has \[a:8, b:16, c:8\], expected \[a:8, b:16\]$"),
    ({"v": "a:8"}, r"it lacks \['v'\]$"),
    ({"idx": None, "s": None}, r"it has unexpected \['idx', 's'\]$"),
])
def test_load_checks_expected_shapes(shared_dir, change, match):
    """`shapes=`: sizes that differ are named (tensor, dim, both sizes) before missing or extra names,
    from the index alone, on every rank."""
    mesh, path, glob = saved(shared_dir, "shapes")
    assert_values(mm.load(path, mesh, shapes=SHAPES), glob)
    want = {k: v for k, v in {**SHAPES, **change}.items() if v is not None}
    with pytest.raises(mm.CheckpointError, match=f"checkpoint {re.escape(repr(path))} does not fit: {match}"):
        mm.load(path, world(f"all:{N}"), "c:all", shapes=want)


def listed(mesh: mm.Mesh, root: str) -> list[str]:
    """The names in `root`, read between barriers (rank 0 deletes files in the next collective)."""
    mesh.barrier()
    names = sorted(os.listdir(root))
    mesh.barrier()
    return names


def test_step_directory_keeps_the_newest_complete(shared_dir):
    """save_step keeps the newest `keep` checkpoints and removes interrupted saves' leftovers; steps
    lists the complete ones only; a directory of other things is refused before anything is written."""
    mesh = world(f"all:{N}")
    root = str(shared_dir / "steps")
    glob = arrays(6)
    for step in (5, 10, 15):
        assert ckpt.save_step(root, step, tensors(mesh, glob, "a:all"), keep=2) == ckpt.step_path(root, step)
    on_rank0(mesh, lambda: (Path(root, ".step-00000020.tmp-0123abcd").mkdir(), Path(root, "step-00000030").mkdir()))
    assert ckpt.steps(root, mesh) == [10, 15]  # neither the crashed save nor a step-* without an index
    assert_values(mm.load(ckpt.step_path(root, 15), mesh), glob)
    ckpt.save_step(root, 20, tensors(mesh, glob, "a:all"), keep=2)
    assert listed(mesh, root) == ["step-00000015", "step-00000020", "step-00000030"]
    ckpt.prune(root, mesh, keep=0)
    assert listed(mesh, root) == ["step-00000030"]
    on_rank0(mesh, lambda: Path(root, "notes.txt").write_text("keep me"))
    for call in (lambda: ckpt.steps(root, mesh), lambda: ckpt.save_step(root, 25, tensors(mesh, glob, ""))):
        with pytest.raises(mm.CheckpointError, match=r"not a directory of checkpoints: it holds \['notes.txt'\]"):
            call()
    assert listed(mesh, root) == ["notes.txt", "step-00000030"]


def raises_on_every_rank(exc: type, fn, message: str) -> None:
    """`fn()` raises `exc` with exactly `message` on every rank: each rank's outcome is gathered, so a
    rank that raised something else, or nothing, fails the test on every rank instead of hanging it."""
    try:
        fn()
        got = (None, "<nothing raised>")
    except Exception as e:  # anything: every rank must reach the allgather
        got = (type(e).__name__, str(e))
    every = MPI.COMM_WORLD.allgather(got)
    assert every == [(exc.__name__, message)] * N, every


def ranks(rs: list[int]) -> str:
    """How the message names ranks: the first four, then how many more."""
    more = f" and {len(rs) - 4} more" if len(rs) > 4 else ""
    return f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs[:4]))}{more}"


@pytest.mark.parametrize("differ", ["name", "shape", "dtype", "count", "chunk_bytes", "path"])
def test_save_refuses_ranks_that_disagree(shared_dir, differ):
    """The last rank passes another dict, chunk_bytes or path: a CheckpointError on every rank naming
    what differs and what each rank has, before anything is written; then the agreed save loads."""
    if N == 1:
        pytest.skip("needs ranks that can disagree")
    mesh, last = world(f"all:{N}"), N - 1
    root = shared_dir / f"disagree-{differ}"
    on_rank0(mesh, root.mkdir)
    path = str(root / "ck")
    a, b = np.arange(8.0), np.arange(8.0) * 100
    d = {"A": mesh.from_numpy(a, "a:8", "a:all"), "B": mesh.from_numpy(b, "b:8", "b:all")}
    a32 = mesh.from_numpy(a.astype(np.float32), "a:8", "a:all")  # made on every rank, used on the last
    odd = mesh.rank == last
    mine = {"name": {"Z" if k == "A" and odd else k: t for k, t in d.items()},
            "shape": {"A": d["B"] if odd else d["A"], "B": d["B"]},
            "dtype": {"A": a32 if odd else d["A"], "B": d["B"]},
            "count": {"A": d["A"]} if odd else d}.get(differ, d)
    kwargs = {"chunk_bytes": 16 if odd and differ == "chunk_bytes" else 64}
    where = path + "-other" if odd and differ == "path" else path
    a_is = "[a:8] float64 layout {'a': 'all'}"
    has = {"name": (f"tensor 'A': {ranks(list(range(last)))}: {a_is}; rank {last}: no such tensor"),
           "shape": (f"tensor 'A': {ranks(list(range(last)))}: {a_is}; rank {last}: [b:8] float64 layout {{'b': 'all'}}"),
           "dtype": (f"tensor 'A': {ranks(list(range(last)))}: {a_is}; rank {last}: [a:8] float32 layout {{'a': 'all'}}"),
           "count": (f"tensor 'B': {ranks(list(range(last)))}: [b:8] float64 layout {{'b': 'all'}}; "
                     f"rank {last}: no such tensor"),
           "chunk_bytes": f"chunk_bytes: {ranks(list(range(last)))}: 64; rank {last}: 16",
           "path": f"path: {ranks(list(range(last)))}: {path!r}; rank {last}: {path + '-other'!r}"}[differ]
    raises_on_every_rank(mm.CheckpointError, lambda: mm.save(where, mine, **kwargs),
                         f"cannot save checkpoint {path!r}: the ranks disagree on {has}")
    assert listed(mesh, str(root)) == []  # not even a temporary directory
    mm.save(path, d, chunk_bytes=64)
    loaded = mm.load(path, mesh, "")
    np.testing.assert_array_equal(loaded["A"].to_numpy(), a)
    np.testing.assert_array_equal(loaded["B"].to_numpy(), b)


def test_save_is_by_name_whatever_the_dict_order(shared_dir):
    """Ranks whose dicts list the same tensors in other orders save the same checkpoint as if all
    had rank 0's order: each tensor loads back with its own values, in rank 0's order."""
    mesh = world(f"all:{N}")
    glob = arrays(8)
    names = list(glob)
    order = names if mesh.rank % 2 == 0 else names[::-1]
    made = tensors(mesh, glob, "a:all;h:all")
    path = str(shared_dir / "dict-order")
    mm.save(path, {k: made[k] for k in order}, chunk_bytes=40)
    for rules in ["", "b:all", "c:all"]:
        assert_values(mm.load(path, mesh, rules), glob)  # names in rank 0's order, which is glob's
    if mesh.rank == 0:
        assert ckpt.verify(path) is None


def test_argument_types_on_every_rank(shared_dir):
    """A path, mesh, shapes, chunk_bytes, step, keep or before of the wrong type or value raises on
    every rank, naming the argument, before anything is written (a TypeError from os.path on rank 0
    alone used to leave the others waiting); Path objects and numpy ints are accepted."""
    mesh = world(f"all:{N}")
    root = shared_dir / "arg-types"
    on_rank0(mesh, root.mkdir)
    path = str(root / "ck")
    g = np.arange(6.0).reshape(2, 3)
    d = {"w": mesh.from_numpy(g, "a:2;b:3", "b:all")}
    what = "must be a str or os.PathLike naming a directory, got"
    for exc, fn, msg in [
        (TypeError, lambda: mm.save(None, d), f"path {what} NoneType"),
        (TypeError, lambda: mm.save(7, d), f"path {what} int"),
        (TypeError, lambda: mm.save(path.encode(), d), f"path {what} bytes"),
        (mm.CheckpointError, lambda: mm.save("", d), "path is empty"),
        (TypeError, lambda: mm.save(path, d, chunk_bytes="x"), "chunk_bytes must be an int >= 1, got str 'x'"),
        (TypeError, lambda: mm.save(path, d, chunk_bytes=None), "chunk_bytes must be an int >= 1, got NoneType None"),
        (mm.CheckpointError, lambda: mm.save(path, d, chunk_bytes=0), "chunk_bytes must be an int >= 1, got 0"),
        (TypeError, lambda: mm.save(path, {}, mesh="all:1"), "mesh must be a Mesh, got str"),
        (TypeError, lambda: mm.load(None, mesh), f"path {what} NoneType"),
        (TypeError, lambda: mm.load(mesh, path), f"path {what} Mesh: the path comes first, then the mesh"),
        (TypeError, lambda: mm.load(path, None), "mesh must be a Mesh, got NoneType"),
        (TypeError, lambda: mm.load(path, mesh, shapes=["w"]), "shapes must be a dict of name -> shape, got list"),
        (TypeError, lambda: ckpt.verify(None), f"path {what} NoneType"),
        (TypeError, lambda: ckpt.steps(3, mesh), f"root {what} int"),
        (TypeError, lambda: ckpt.save_step(None, 1, d), f"root {what} NoneType"),
        (TypeError, lambda: ckpt.save_step(str(root), 1, d, keep="2"), "keep must be an int >= 1, got str '2'"),
        (TypeError, lambda: ckpt.prune(str(root), mesh, keep=1.0), "keep must be an int >= 0, got float 1.0"),
        (TypeError, lambda: ckpt.newest_intact(str(root), mesh, before="3"), "before must be an int >= 0, got str '3'"),
    ]:
        raises_on_every_rank(exc, fn, msg)
    assert listed(mesh, str(root)) == []
    mm.save(root / "ck", d, chunk_bytes=np.int64(16))  # a Path and a numpy int
    np.testing.assert_array_equal(mm.load(root / "ck", mesh, "a:all", shapes={"w": "a:2;b:3"})["w"].to_numpy(), g)
    assert listed(mesh, str(root)) == ["ck"]


@pytest.mark.parametrize("step,keep,exc,msg", [
    (5, 0, mm.CheckpointError, "keep must be an int >= 1, got 0"),
    (5, -1, mm.CheckpointError, "keep must be an int >= 1, got -1"),
    (-1, 2, mm.CheckpointError, "step must be an int >= 0, got -1"),
    ("5", 2, TypeError, "step must be an int >= 0, got str '5'"),
    (5.0, 2, TypeError, "step must be an int >= 0, got float 5.0"),
    (True, 2, TypeError, "step must be an int >= 0, got bool True"),
])
def test_save_step_checks_step_and_keep(shared_dir, step, keep, exc, msg):
    """A step that is not an int >= 0 or a keep that is not an int >= 1 raises on every rank before
    anything is written (keep=0 used to delete the new checkpoint, step -1 to make 'step--0000001');
    step 0 and keep 1 work, and a numpy int step too."""
    mesh = world(f"all:{N}")
    root = str(shared_dir / f"step-args-{step!r}-{keep}")
    g = np.arange(10.0)
    d = {"v": mesh.from_numpy(g, "n:10", "n:all")}
    raises_on_every_rank(exc, lambda: ckpt.save_step(root, step, d, keep=keep), msg)
    assert ckpt.steps(root, mesh) == [] and not os.path.exists(root)
    assert ckpt.save_step(root, 0, d, keep=1) == ckpt.step_path(root, 0)
    assert ckpt.save_step(root, np.int64(3), {"v": d["v"] * 2.0}, keep=1) == os.path.join(root, "step-00000003")
    assert ckpt.steps(root, mesh) == [3] and listed(mesh, root) == ["step-00000003"]
    np.testing.assert_array_equal(mm.load(ckpt.step_path(root, 3), mesh)["v"].to_numpy(), g * 2.0)
    raises_on_every_rank(mm.CheckpointError, lambda: ckpt.prune(root, mesh, keep=-1),
                         "keep must be an int >= 0, got -1")
    assert ckpt.newest_intact(root, mesh, before=np.int64(4)) == 3


def test_unexpected_errors_on_one_rank_reach_every_rank(shared_dir, monkeypatch):
    """Any exception inside a block that only rank 0 runs (listing, writing the index, deleting old
    steps), or inside one rank's read, becomes the same CheckpointError on every rank, not a hang."""
    mesh = world(f"all:{N}")
    root = str(shared_dir / "unexpected")
    g = np.arange(12.0).reshape(3, 4)
    d = {"m": mesh.from_numpy(g, "p:3;q:4", "q:all")}
    ckpt.save_step(root, 1, d)
    at = (lambda r: "" if N == 1 else f" (rank {r})")

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    for name, call, message in (
            ("_swap_in", lambda: mm.save(ckpt.step_path(root, 2), d),
             f"cannot save checkpoint {ckpt.step_path(root, 2)!r}"),
            ("_scan", lambda: ckpt.steps(root, mesh), f"cannot list checkpoints in {root!r}"),
            ("_scan", lambda: ckpt.prune(root, mesh, 1), f"cannot delete old checkpoints in {root!r}"),
            ("verify", lambda: ckpt.newest_intact(root, mesh), f"cannot check checkpoints in {root!r}")):
        with monkeypatch.context() as m:
            m.setattr(ckpt, name, boom)
            raises_on_every_rank(mm.CheckpointError, call, f"{message}: RuntimeError: boom{at(0)}")
    with monkeypatch.context() as m:
        read = ckpt._read_block
        m.setattr(ckpt, "_read_block", lambda *a: boom() if mesh.rank == N - 1 else read(*a))
        raises_on_every_rank(mm.CheckpointError, lambda: mm.load(ckpt.step_path(root, 1), mesh),
                             f"cannot load checkpoint {ckpt.step_path(root, 1)!r}: RuntimeError: boom{at(N - 1)}")
    assert listed(mesh, root) == ["step-00000001"]
    assert ckpt.newest_intact(root, mesh) == 1
    np.testing.assert_array_equal(mm.load(ckpt.step_path(root, 1), mesh, "p:all")["m"].to_numpy(), g)


@pytest.mark.parametrize("damage,words", [
    (lambda d: d["tensors"][0].__setitem__("dtype", ",f8"), "SyntaxError"),  # one bit of '<' flipped
    (lambda d: d["tensors"][0]["slices"][0].__setitem__("byte_offset", [0]), "byte_offset is [0], expected ints"),
    (lambda d: d["mesh"][0].__setitem__(1, 10 ** 30), "more than 16777216"),
    (lambda d: d["mesh"][0].__setitem__(1, 10 ** 8), "more than 16777216")])
def test_a_damaged_index_is_a_checkpoint_error(shared_dir, damage, words):
    """Edits of index.json that reached numpy's dtype parser (SyntaxError), int() of a list, or an
    enumeration of a mesh of 10**30 processors (OverflowError; 10**8: out of memory) give a
    CheckpointError on every rank, and `verify` says why instead of raising."""
    mesh, path, _ = saved(shared_dir, f"damaged-index-{words[:8]}")
    index = Path(path) / "index.json"

    def spoil():
        d = json.loads(index.read_text())
        damage(d)
        index.write_text(json.dumps(reseal(d)))
    on_rank0(mesh, spoil)
    load_everywhere(path, f"inconsistent checkpoint index .*{re.escape(words)}")
    assert words in ckpt.verify(path)


@pytest.mark.parametrize("damage", ["rename-tensor", "rename-dim", "dtype", "bit", "unknown-field"])
def test_the_index_has_a_checksum_of_its_own(shared_dir, damage):
    """An index that still parses after damage (a tensor or dim renamed, `<f4` made `<i4`, any one bit
    of a value flipped, the checksum's own name changed) is refused on every rank and by `verify`,
    not loaded with other names or another dtype; an index without the field (written before it
    existed) still loads, to the same values."""
    mesh, path, glob = saved(shared_dir, f"index-crc-{damage}")
    index = Path(path) / "index.json"
    meta = json.loads(index.read_text())
    assert meta["index_crc32"] == zlib.crc32(json.dumps({k: v for k, v in meta.items() if k != "index_crc32"},
                                                        sort_keys=True, separators=(",", ":")).encode())

    def spoil():
        d = json.loads(index.read_text())
        spec = d["tensors"][0]
        if damage == "rename-tensor":
            spec["name"] = spec["name"] + "x"
        elif damage == "rename-dim":
            spec["shape"][0][0] = spec["shape"][0][0].upper()
        elif damage == "dtype":
            spec["dtype"] = spec["dtype"].replace("f", "i")
        elif damage == "bit":
            spec["slices"][0]["byte_offset"] ^= 8
        else:
            d["index_crc33"] = d.pop("index_crc32")
        index.write_text(json.dumps(d))
    on_rank0(mesh, spoil)
    words = "unknown fields" if damage == "unknown-field" else "does not match its content"
    load_everywhere(path, f"inconsistent checkpoint index .*{words}")
    assert words in ckpt.verify(path)

    def unseal():  # as written before the index had its checksum
        index.write_text(json.dumps({k: v for k, v in meta.items() if k != "index_crc32"}))
    on_rank0(mesh, unseal)
    assert ckpt.verify(path) is None
    assert_values(mm.load(path, world(f"all:{N}"), ""), glob)


def test_save_step_keeps_the_step_it_saves_below_the_newest(shared_dir):
    """A run resumed from an older step saves below the newest: that checkpoint is kept (it was
    deleted at once, and the path returned did not exist), with the newest keep - 1 others."""
    mesh = world(f"all:{N}")
    root = str(shared_dir / "older-step")
    d = {"v": mesh.from_numpy(np.arange(10.0), "n:10", "n:all")}
    for step in (10, 20, 30):
        ckpt.save_step(root, step, d, keep=2)
    path = ckpt.save_step(root, 5, {"v": d["v"] * 2.0}, keep=2)
    assert ckpt.steps(root, mesh) == [5, 30] and os.path.isdir(path)
    np.testing.assert_array_equal(mm.load(path, mesh)["v"].to_numpy(), np.arange(10.0) * 2.0)
