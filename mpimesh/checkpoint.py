"""Checkpoints: each rank writes its own slices, atomically; loading reshards onto any mesh.

`save(path, tree)` writes a nest of dicts, lists and tuples of DistTensors and plain values; `load`
gives it back on any mesh and layout, checked against `shapes=` when given. `save_step` and `steps`
keep numbered checkpoints in one directory; `verify` and `newest_intact` find an intact one. No
pickle; a failure on any rank raises the same `CheckpointError` on every rank. The format and how
writes stay atomic: docs/checkpoints.md.

>>> import numpy as np, os, tempfile, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> mm.save(path, {"w": mesh.from_numpy(np.arange(6.0).reshape(2, 3), "a:2;b:3"), "epoch": 3})
>>> back = mm.load(path, mesh); back["w"].to_numpy()[1], back["epoch"]
(array([3., 4., 5.]), 3)
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import sys
import time
import zlib
from typing import Mapping, Optional

import numpy as np

from . import env
from .backend import BFLOAT16, to_host
from .errors import CheckpointError, by_rank
from .layout import LayoutRules, RulesLike, check_rules, plan_layout, slice_bounds
from .mesh import AbstractMesh, Mesh
from .shape import Shape, ShapeLike
from .tensor import DistTensor, host_read
from .tree import from_json, is_tensor, leaf_name, named_leaves, to_json

FORMAT, INDEX = "mpimesh-checkpoint", "index.json"
VERSION, NESTED = 1, 2  # the index's version: a flat dict of tensors (as before nests); a nest (with `tree`)
INDEX_CRC, INDEX_KEYS = "index_crc32", {"format", "version", "mesh", "files", "tensors", "tree"}
CHUNK_BYTES = 4 << 20  # one CRC-32 per chunk of about this many bytes
STEP_DIR = re.compile(r"step-(\d{8,})")  # save_step's checkpoints
LEFTOVER = re.compile(r"\.step-\d{8,}\.(tmp|old)-[0-9a-f]+")  # an interrupted save's or a deletion's


# ---------------------------------------------------------------- arguments

def _path(path, what: str = "path") -> str:
    """`path` (a str or os.PathLike) as a str, else TypeError: checked on every rank, before any rank
    touches the file system."""
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(path, str):
        swapped = ": the path comes first, then the mesh" if isinstance(path, AbstractMesh) else ""
        raise TypeError(f"{what} must be a str or os.PathLike naming a directory, got {type(path).__name__}{swapped}")
    if not path:
        raise CheckpointError(f"{what} is empty")
    return path


def _mesh(mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a Mesh, got {type(mesh).__name__}")
    return mesh


def _int(value, what: str, least: int) -> int:
    """`value` if it is an int (not a bool) >= `least`, else TypeError or CheckpointError naming `what`.

    >>> _int(-1, "step", 0)
    Traceback (most recent call last):
    mpimesh.errors.CheckpointError: step must be an int >= 0, got -1
    """
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int >= {least}, got {type(value).__name__} {value!r}")
    if value < least:
        raise CheckpointError(f"{what} must be an int >= {least}, got {value}")
    return int(value)


# ---------------------------------------------------------------- agreement between ranks

def _bcast_text(mesh, text: str, root: int) -> str:
    """`text` of mesh rank `root`, on every rank."""
    data = np.frombuffer(text.encode(), np.uint8)
    n = int(mesh.collectives.broadcast(np.array([data.size], np.int64), root)[0])
    buf = data if mesh.rank == root else np.zeros(n, np.uint8)
    return bytes(mesh.collectives.broadcast(buf, root)).decode()


def _sync(mesh, err: Optional[str]) -> None:
    """If any rank has an error, raise the lowest such rank's message as CheckpointError everywhere."""
    if not mesh.collectives.any_rank(err is not None):
        return
    mine = np.array([mesh.rank if err is not None else mesh.size], np.int64)
    root = int(mesh.collectives.allreduce(mine, mesh.shape.names, "min")[0])
    msg = _bcast_text(mesh, err or "", root)
    raise CheckpointError(msg if mesh.size == 1 else f"{msg} (rank {root})")


def _reason(e: Exception) -> str:
    """`e` as the end of the CheckpointError every rank raises for it (its class named unless it is an
    OSError or ours): any exception on one rank becomes every rank's error, never a hang."""
    return str(e) if isinstance(e, (OSError, CheckpointError)) else f"{type(e).__name__}: {e}"


def _agree(mesh, target: str, chunk_bytes: int, items: list, tree: Optional[dict]) -> list:
    """`items` in rank 0's order, once every rank passes the same `target`, `chunk_bytes`, tensors
    (names, shapes, dtypes, layouts; in any order) and other entries of the nest `tree` (lists,
    tuples, plain values); else CheckpointError on every rank naming the first difference and what
    each rank has."""
    mine = {"path": repr(target), "chunk_bytes": str(chunk_bytes),
            **{f"tensor {name!r}": f"{t.shape} {np.dtype(t.dtype)} layout {t.layout}" for name, t in items},
            **({} if tree is None else _entries(tree))}
    text = json.dumps([[name for name, _ in items], mine])
    order, first = json.loads(_bcast_text(mesh, text, 0))
    if not mesh.collectives.any_rank(mine != first):
        by_name = dict(items)
        return [(name, by_name[name]) for name in order]
    every = [json.loads(_bcast_text(mesh, text, r))[1] for r in range(mesh.size)]
    fixed = ["path", "chunk_bytes"]
    key = next(k for k in fixed + sorted({k for d in every for k in d} - set(fixed))
               if len({d.get(k) for d in every}) > 1)
    has = by_rank([d.get(key, "no such tensor" if key.startswith("tensor ") else "no such entry") for d in every])
    raise CheckpointError(f"cannot save checkpoint {first['path']}: the ranks disagree on {key}: {has}")


def _entries(node: dict, keys: tuple = ()) -> dict:
    """`{"entry 'name'": what}` for the nodes of a nest's JSON other than its dicts and tensors: a list or
    tuple (its length), a plain value (its type and value).

    >>> _entries(to_json({"a": [1, "x"], "b": {"c": None}}, lambda x: False)[0])
    {"entry 'a'": 'list of 2', "entry 'a/0'": 'int 1', "entry 'a/1'": "str 'x'", "entry 'b/c'": 'NoneType None'}
    """
    (kind, body), = node.items()
    if kind == "dict":
        return {k: v for key, child in body for k, v in _entries(child, keys + (key,)).items()}
    if kind in ("list", "tuple"):
        out = {f"entry {leaf_name(keys)!r}": f"{kind} of {len(body)}"}
        for i, child in enumerate(body):
            out.update(_entries(child, keys + (i,)))
        return out
    if kind == "tensor":
        return {}
    value = from_json(node, str)
    return {f"entry {leaf_name(keys)!r}": f"{type(value).__name__} {value!r}"}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the plan: who writes what

def _mesh_index(mesh_shape: Shape, coords: Mapping[str, int]) -> int:
    """Row-major position of `coords` in the mesh."""
    i = 0
    for d in mesh_shape:
        i = i * d.size + coords[d.name]
    return i


def _slices(shape: Shape, mesh_shape: Shape, tl) -> list[tuple[dict, tuple]]:
    """The distinct slices of a tensor: (writer coords, global bounds) in row-major writer order."""
    split = [m for m in mesh_shape.names if m in tl]
    out = []
    for pos in np.ndindex(*[mesh_shape[m].size for m in split]):
        coords = {m: 0 for m in mesh_shape.names}
        coords.update(zip(split, pos))
        out.append((coords, slice_bounds(shape, mesh_shape, tl, coords)))
    return out


def _plan(items, mesh_shape: Shape, chunk_bytes: int, tree: Optional[dict]) -> dict:
    """The index without checksums (and each slice's writer position): the same on every rank."""
    cursor: dict[int, int] = {}
    tensors = []
    for name, t in items:
        dtype = _le(t.dtype)
        ce = max(1, chunk_bytes // dtype.itemsize)
        slices = []
        for coords, bounds in _slices(t.shape, mesh_shape, t.tensor_layout):
            pos = _mesh_index(mesh_shape, coords)
            nbytes = math.prod(b.stop - b.start for b in bounds) * dtype.itemsize
            slices.append({"file": f"part-{pos:05d}.bin", "offset": [b.start for b in bounds],
                           "shape": [b.stop - b.start for b in bounds],
                           "byte_offset": cursor.get(pos, 0), "nbytes": nbytes, "_pos": pos})
            cursor[pos] = cursor.get(pos, 0) + nbytes
        tensors.append({"name": name, "shape": [[d.name, d.size] for d in t.shape], "dtype": _dtype_name(dtype),
                        "layout": t.layout, "chunk_elements": ce, "slices": slices})
    files = {f"part-{p:05d}.bin": n for p, n in sorted(cursor.items())}
    index = {"format": FORMAT, "version": VERSION if tree is None else NESTED,
             "mesh": [[d.name, d.size] for d in mesh_shape], "files": files, "tensors": tensors}
    return index if tree is None else {**index, "tree": tree}


def _le(dtype) -> np.dtype:
    """The little-endian spelling of a numeric dtype (bfloat16: its 16-bit words as numpy holds them)."""
    dtype = np.dtype(dtype)
    if dtype == BFLOAT16:
        return dtype
    if dtype.kind not in "biufc":
        raise CheckpointError(f"cannot checkpoint dtype {dtype}: only bool, integer, float (bfloat16 included) "
                              f"and complex")
    return dtype.newbyteorder("<")


def _dtype_name(dtype: np.dtype) -> str:
    """How the index spells `dtype`: numpy's `str` ('<f4'), or "bfloat16", which `np.dtype` reads back
    once ml_dtypes is imported (its `str`, '<V2', would read back as raw bytes).

    >>> _dtype_name(np.dtype("<f4")), _dtype_name(BFLOAT16)
    ('<f4', 'bfloat16')
    """
    return "bfloat16" if dtype == BFLOAT16 else dtype.str


def _index_crc(index: dict) -> int:
    """The CRC-32 of `index` (without its own checksum) as canonical JSON: sorted keys, no spaces."""
    return zlib.crc32(json.dumps(index, sort_keys=True, separators=(",", ":")).encode())


def _chunk_crcs(data: memoryview, chunk: int) -> list[int]:
    return [zlib.crc32(data[i:i + chunk]) for i in range(0, len(data), chunk)]


# ---------------------------------------------------------------- save

def save(path: str, tensors: Mapping[str, object], *, mesh=None, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Write the dict `tensors` to the directory `path`: DistTensors (one mesh) and plain values (int,
    float, str, bool, None), nested in dicts (str keys), lists and tuples. A collective: every rank must
    call it with the same `path` (as rank 0 sees it), `chunk_bytes`, tensor names, shapes, dtypes and
    layouts, and plain values; ranks that differ raise CheckpointError on every rank before anything is
    written. Each rank writes its own distinct slices; the checkpoint appears at `path` all at once,
    replacing a checkpoint there (any other file or non-empty directory is refused). `mesh` is needed
    only when there is no tensor.

    >>> import tempfile, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> params, opt = {"l1/kernel": mesh.ones("a:2;b:3")}, mm.optim.Adam(0.1)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt"); mm.save(path, {"params": params, "state": opt.init(params)})
    >>> mm.load(path, mesh)["state"]["m"]["l1/kernel"].origin[1]   # (names escaped as in a JSON Pointer)
    'state/m/l1~1kernel'
    """
    path = _path(path)
    chunk_bytes = _int(chunk_bytes, "chunk_bytes", 1)
    tree, items, mesh = _nest(tensors, mesh)
    for _, t in items[:1]:  # (a compiled step would save once, never in a replay)
        host_read(t, f"mm.save({str(path)!r})")
    items = _agree(mesh, os.path.abspath(path), chunk_bytes, items, tree)
    plan = _plan(items, mesh.shape, chunk_bytes, tree)

    # Rank 0 checks the target and makes the temporary directory; every rank learns its name.
    err, info = None, ""
    if mesh.rank == 0:
        try:
            target = os.path.abspath(path)
            parent, base = os.path.split(target)
            _check_replaceable(target)
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, f".{base}.tmp-{secrets.token_hex(8)}")
            os.mkdir(tmp)
            info = json.dumps([target, tmp])
        except Exception as e:  # any error: every rank raises it
            err = f"cannot save checkpoint {path!r}: {_reason(e)}"
    _sync(mesh, err)
    target, tmp = json.loads(_bcast_text(mesh, info, 0))
    try:
        # Every rank writes its part file (if it writes any slice) and fsyncs it.
        me, err, crcs = _mesh_index(mesh.shape, mesh.coords), None, []
        try:
            mine = [(t, spec) for (_, t), spec in zip(items, plan["tensors"])
                    if any(s["_pos"] == me for s in spec["slices"])]
            if mine:
                with open(os.path.join(tmp, f"part-{me:05d}.bin"), "wb") as f:
                    for t, spec in mine:
                        data = np.ascontiguousarray(to_host(t.local), dtype=_le(t.dtype)).reshape(-1)
                        view = memoryview(data.view(np.uint8))
                        crcs.append(_chunk_crcs(view, spec["chunk_elements"] * data.itemsize))
                        f.write(view)
                    f.flush()
                    os.fsync(f.fileno())
            _test_pause(mesh, target)
        except Exception as e:
            err = f"cannot write checkpoint {target!r}: {_reason(e)}"
        _sync(mesh, err)
        _fill_crcs(mesh, plan, me, crcs)

        # Rank 0 writes the index and swaps the directory into place.
        err = None
        if mesh.rank == 0:
            try:
                with open(os.path.join(tmp, INDEX), "w") as f:
                    json.dump({**plan, INDEX_CRC: _index_crc(plan)}, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                _fsync_dir(tmp)
                _swap_in(tmp, target)
            except Exception as e:
                err = f"cannot save checkpoint {target!r}: {_reason(e)}"
        _sync(mesh, err)
    finally:
        if mesh.rank == 0 and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)  # only after a failure: success renamed it


def _nest(tensors: Mapping[str, object], mesh) -> tuple[Optional[dict], list, object]:
    """`(the nest as JSON or None for a flat dict of tensors, its tensors as (name, tensor), their mesh)`
    after checking that `tensors` is a dict (of dicts, lists and tuples) of tensors on one mesh and
    plain values."""
    if not isinstance(tensors, Mapping):
        raise CheckpointError(f"save needs a dict (of DistTensors, or a nest of dicts, lists and tuples of "
                              f"them and of plain values), got {type(tensors).__name__}")
    items, tree = list(tensors.items()), None
    if not all(isinstance(name, str) and is_tensor(t) for name, t in items):
        try:
            tree, items = to_json(dict(tensors), is_tensor)
        except TypeError as e:
            raise CheckpointError(f"cannot save: {e}") from None
    other = "mesh=" if mesh is not None else f"tensor {items[0][0]!r}" if items else ""
    mesh = mesh if mesh is not None else (items[0][1].mesh if items else None)
    if mesh is None:
        raise CheckpointError("save of a dict without tensors needs mesh=")
    _mesh(mesh)
    for name, t in items:
        if t.mesh is not mesh:  # (a Mesh's repr names this rank: the shapes alone say the same on every rank)
            raise CheckpointError(f"tensor {name!r} lives on another Mesh object ({t.mesh.shape}) than {other} "
                                  f"({mesh.shape}): save tensors of one mesh")
    return tree, items, mesh


def _test_pause(mesh, target: str) -> None:
    """`MPIMESH_TEST_SLOW_SAVE=SECONDS`: say who is where and sleep, so a test can kill a rank mid-save."""
    seconds = env.number("MPIMESH_TEST_SLOW_SAVE", 0.0, minimum=0.0)
    if seconds > 0:
        sys.stderr.write(f"mpimesh: MPIMESH_TEST_SLOW_SAVE: rank {mesh.rank} pid {os.getpid()} sleeps "
                         f"{seconds} s inside the save of {target}\n")  # one write: one line, not interleaved
        sys.stderr.flush()
        time.sleep(seconds)


def _fill_crcs(mesh, plan: dict, me: int, crcs: list[list[int]]) -> None:
    """Gather every writer's chunk checksums onto every rank and put them into `plan`'s slices.

    Each tensor gets as many entries per rank as its largest slice has chunks (slices of an uneven
    layout differ in size), so every rank contributes a vector of the same length."""
    def chunks(spec: dict, s: dict) -> int:
        return math.ceil(math.prod(s["shape"]) / spec["chunk_elements"])

    per = [max(chunks(spec, s) for s in spec["slices"]) for spec in plan["tensors"]]
    vec, it = np.zeros(sum(per), np.int64), iter(crcs)
    starts = np.cumsum([0] + per)
    for k, spec in enumerate(plan["tensors"]):
        if any(s["_pos"] == me for s in spec["slices"]):
            mine = next(it)
            vec[starts[k]:starts[k] + len(mine)] = mine
    x = vec.reshape((1,) * mesh.shape.rank + vec.shape)
    for axis, m in enumerate(mesh.shape.names):
        x = mesh.collectives.allgather(x, m, axis)
    x = x.reshape(mesh.size, vec.size)  # row-major mesh position -> checksums
    for k, spec in enumerate(plan["tensors"]):
        for s in spec["slices"]:
            s["crc32"] = [int(c) for c in x[s.pop("_pos"), starts[k]:starts[k] + chunks(spec, s)]]


def _is_checkpoint(path: str) -> bool:
    try:
        with open(os.path.join(path, INDEX)) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _check_replaceable(target: str) -> None:
    if os.path.lexists(target) and not (os.path.isdir(target) and not os.path.islink(target)
                                        and (not os.listdir(target) or _is_checkpoint(target))):
        raise CheckpointError(f"{target!r} exists and is not an mpimesh checkpoint; refusing to replace it")


def _swap_in(tmp: str, target: str) -> None:
    """Rename `tmp` to `target`; an existing checkpoint there is renamed away first, then removed."""
    parent, base = os.path.split(target)
    old = None
    if os.path.lexists(target):
        _check_replaceable(target)
        old = os.path.join(parent, f".{base}.old-{secrets.token_hex(8)}")
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- load

def load(path: str, mesh, layout: Optional[RulesLike] = None,
         shapes: Optional[Mapping[str, ShapeLike]] = None) -> dict:
    """What was saved at `path`, as saved (the same nest of dicts, lists and tuples, DistTensors and
    plain values), each tensor on `mesh` laid out by `layout` (default: the rules in force on `mesh`),
    whatever mesh it was saved from. A collective: every rank must call it. A missing, damaged or
    inconsistent checkpoint, or one whose tensors differ from `shapes` (the saved nest with a shape or a
    tensor at each tensor's place), raises CheckpointError on every rank. Each tensor returned has
    `origin`: (the checkpoint's absolute path, the tensor's name in it).

    >>> import numpy as np, tempfile, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt"); mm.save(path, {"w": mesh.ones("a:2;b:3")})
    >>> mm.load(path, mesh, shapes={"w": "a:2;b:4"})
    Traceback (most recent call last):
    mpimesh.errors.CheckpointError: checkpoint '...ckpt' does not fit: tensor 'w': checkpoint has b:3, expected b:4
    """
    path, mesh = _path(path), _mesh(mesh)
    if shapes is not None and not isinstance(shapes, Mapping):
        raise TypeError(f"shapes must be a dict of name -> shape, got {type(shapes).__name__}")
    rules = mesh.layout if layout is None else LayoutRules(layout)
    check_rules(rules, mesh.shape)
    err, text = None, ""
    if mesh.rank == 0:
        target = os.path.abspath(path)
        try:
            if not os.path.isdir(target):
                raise CheckpointError(f"no checkpoint at {target!r}: not a directory")
            with open(os.path.join(target, INDEX), "rb") as f:
                text = json.dumps([target, f.read().decode("utf-8", "replace")])
        except CheckpointError as e:
            err = str(e)
        except Exception as e:
            err = f"cannot read checkpoint index {os.path.join(target, INDEX)!r}: {_reason(e)}"
    _sync(mesh, err)
    target, text = json.loads(_bcast_text(mesh, text, 0))
    specs, tree = _parse_index(text, os.path.join(target, INDEX))  # identical on every rank
    if shapes is not None:
        _check_shapes(specs, _expected(shapes, nested=tree is not None), target)

    layouts = [plan_layout(spec["shape"], mesh.shape, rules) for spec in specs]  # LayoutError: everywhere
    out, err, files = {}, None, {}
    try:
        for spec, tl in zip(specs, layouts):
            local = _read_block(target, spec, slice_bounds(spec["shape"], mesh.shape, tl, mesh.coords), files)
            out[spec["name"]] = (spec["shape"], tl, local)
    except CheckpointError as e:
        err = str(e)
    except Exception as e:
        err = f"cannot load checkpoint {target!r}: {_reason(e)}"
    finally:
        for f in files.values():
            f.close()
    _sync(mesh, err)
    for name, (shape, tl, local) in out.items():
        out[name] = t = DistTensor(mesh, shape, tl, mesh.xp.asarray(local))
        t._origin = (target, name)
    return out if tree is None else from_json(tree, out.__getitem__)


def _expected(shapes: Mapping, nested: bool) -> dict[str, Shape]:
    """`{name: Shape}` of the tensors `shapes` expects: its top-level entries (a flat checkpoint's), or
    its leaves by path (a nest's) that are shapes (a Shape, a str) or tensors (their shapes)."""
    pairs = named_leaves(dict(shapes)) if nested else list(shapes.items())
    return {name: v.shape if is_tensor(v) else Shape(v) for name, v in pairs
            if not nested or is_tensor(v) or isinstance(v, (Shape, str))}


def _check_shapes(specs: list[dict], want: dict[str, Shape], where: str) -> None:
    """CheckpointError unless `specs` hold exactly the tensors of `want`: sizes first, then names."""
    have = {spec["name"]: spec["shape"] for spec in specs}
    differ = [(name, have[name], w) for name, w in want.items() if name in have and have[name] != w]
    if differ:
        name, h, w = differ[0]
        if h.names == w.names:  # only the dims that differ: "d_model:64, expected d_model:128"
            pairs = [(a, b) for a, b in zip(h, w) if a.size != b.size]
            h, w = (", ".join(f"{d.name}:{d.size}" for d in side) for side in zip(*pairs))
        more = f" (and {len(differ) - 1} more tensors)" if len(differ) > 1 else ""
        raise CheckpointError(f"checkpoint {where!r} does not fit: tensor {name!r}: checkpoint has {h}, "
                              f"expected {w}{more}")
    missing, extra = [n for n in want if n not in have], [n for n in have if n not in want]
    if missing or extra:
        few = (lambda names: f"{names[:3]}" + (f" and {len(names) - 3} more" if len(names) > 3 else ""))
        parts = ([f"lacks {few(missing)}"] if missing else []) + ([f"has unexpected {few(extra)}"] if extra else [])
        raise CheckpointError(f"checkpoint {where!r} does not fit: it {' and '.join(parts)}")


def _read_block(root: str, spec: dict, bounds: tuple, files: dict) -> np.ndarray:
    """This rank's block `bounds` of one tensor, from the overlapping chunks of its saved slices."""
    dtype, ce, name = spec["dtype"], spec["chunk_elements"], spec["name"]
    local = np.empty([b.stop - b.start for b in bounds], dtype.newbyteorder("="))
    for s in spec["slices"]:
        lo = [max(b.start, o) for b, o in zip(bounds, s["offset"])]
        hi = [min(b.stop, o + n) for b, o, n in zip(bounds, s["offset"], s["shape"])]
        if any(a >= b for a, b in zip(lo, hi)) or not local.size:
            continue
        shape = s["shape"] or [1]
        row = math.prod(shape[1:])
        r0, r1 = (lo[0] - s["offset"][0], hi[0] - s["offset"][0]) if s["shape"] else (0, 1)
        c0, c1 = r0 * row // ce, math.ceil(r1 * row / ce)  # the chunks covering rows r0..r1
        e0, e1 = c0 * ce, min(c1 * ce, math.prod(shape))
        path = os.path.join(root, s["file"])
        f = files.get(path)
        if f is None:
            try:
                f = files[path] = open(path, "rb")
            except OSError as e:
                raise CheckpointError(f"cannot read checkpoint file {path!r} (tensor {name!r}): "
                                      f"{e.strerror or e}") from None
            size = os.fstat(f.fileno()).st_size
            if size != spec["_files"][s["file"]]:
                raise CheckpointError(f"checkpoint file {path!r} has {size} bytes, the index says "
                                      f"{spec['_files'][s['file']]} (truncated or overwritten)")
        f.seek(s["byte_offset"] + e0 * dtype.itemsize)
        data = f.read((e1 - e0) * dtype.itemsize)
        if len(data) != (e1 - e0) * dtype.itemsize:
            raise CheckpointError(f"checkpoint file {path!r} is truncated (tensor {name!r})")
        step = ce * dtype.itemsize
        for c, crc in zip(range(c0, c1), _chunk_crcs(memoryview(data), step)):
            if crc != s["crc32"][c]:
                raise CheckpointError(f"checksum mismatch in {path!r}, tensor {name!r}, slice at offset "
                                      f"{s['offset']}, chunk {c}: the file is corrupted")
        flat = np.frombuffer(data, dtype)[r0 * row - e0:r1 * row - e0]
        src = (slice(None),) + tuple(slice(a - o, b - o) for a, b, o in zip(lo[1:], hi[1:], s["offset"][1:]))
        dst = tuple(slice(a - b.start, c - b.start) for a, c, b in zip(lo, hi, bounds))
        local[dst] = flat.reshape([r1 - r0] + shape[1:])[src].reshape(local[dst].shape)
    return local


MAX_RANKS = 1 << 24  # an index naming a larger mesh is damaged (its slices would be enumerated)


def _parse_index(text: str, where: str) -> tuple[list[dict], Optional[dict]]:
    """Validate the index: `(a list of tensor specs (with Shape and dtype parsed), the nest's JSON or None
    for a flat dict)`, else CheckpointError."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"inconsistent checkpoint index {where!r}: {msg}")

    try:
        index = json.loads(text)
    except ValueError as e:
        raise bad(f"not valid JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise bad(f"not an {FORMAT} index")
    if index.get("version") not in (VERSION, NESTED) or ("tree" in index) != (index["version"] == NESTED):
        raise bad(f"version {index.get('version')!r}{' with' if 'tree' in index else ' without'} a tree, this "
                  f"mpimesh reads version {VERSION} without and {NESTED} with one")
    crc = index.pop(INDEX_CRC, None)  # (absent: an index written before the index had a checksum)
    unknown = sorted(set(index) - INDEX_KEYS)
    if unknown:
        raise bad(f"unknown fields {unknown} (the index is damaged, or from a newer mpimesh)")
    if crc is not None and crc != _index_crc(index):
        raise bad(f"its checksum {crc!r} does not match its content (crc32 {_index_crc(index)}): the index is "
                  f"damaged or was edited")
    try:
        mesh_shape = Shape([tuple(p) for p in index["mesh"]])
        files = {str(k): int(v) for k, v in index["files"].items()}
        if mesh_shape.size > MAX_RANKS:
            raise bad(f"mesh {mesh_shape} has {mesh_shape.size} processors, more than {MAX_RANKS}")
        specs, names = [], set()
        for t in index["tensors"]:
            name = t["name"]
            if not isinstance(name, str) or name in names:
                raise bad(f"tensor name {name!r} is repeated or not a string")
            names.add(name)
            shape = Shape([tuple(p) for p in t["shape"]])
            dtype = _le(np.dtype(t["dtype"]))
            if set(t["layout"]) - set(shape.names):
                raise bad(f"tensor {name!r}: layout {t['layout']} names dims not in {shape}")
            want = _slices(shape, mesh_shape, plan_layout(shape, mesh_shape, LayoutRules(t["layout"])))
            ce = int(t["chunk_elements"])
            if len(t["slices"]) != len(want) or ce < 1:
                raise bad(f"tensor {name!r} has {len(t['slices'])} slices, its layout "
                          f"{t['layout']} on mesh {mesh_shape} gives {len(want)}")
            for s, (_, bounds) in zip(t["slices"], want):
                fields = {k: s[k] for k in ("offset", "shape", "byte_offset", "nbytes", "crc32")}
                wrong = next((k for k, v in fields.items()  # (lists of ints: offset, shape, crc32; else one int)
                              if isinstance(v, list) != (k in ("offset", "shape", "crc32"))
                              or not all(type(i) is int and i >= 0 for i in (v if isinstance(v, list) else [v]))), None)
                if wrong:
                    raise bad(f"tensor {name!r}: slice {s['offset']}: {wrong} is {s[wrong]!r}, expected ints >= 0")
                n = math.prod(s["shape"])
                if (s["offset"] != [b.start for b in bounds] or s["shape"] != [b.stop - b.start for b in bounds]
                        or s["nbytes"] != n * dtype.itemsize or len(s["crc32"]) != math.ceil(n / ce)
                        or s["file"] not in files):
                    raise bad(f"tensor {name!r}: slice {s.get('offset')} of shape {s.get('shape')} "
                              f"does not match shape {shape}, dtype {dtype} and layout {t['layout']}")
            specs.append({"name": name, "shape": shape, "dtype": dtype, "chunk_elements": ce,
                          "slices": t["slices"], "_files": files})
        _check_files(specs, files, bad)
        tree = index.get("tree")
        if tree is not None:
            used: list[str] = []
            if "dict" not in tree:
                raise bad("its tree is not a dict")
            from_json(tree, used.append)
            if sorted(used) != sorted(names):
                raise bad(f"its tree names tensors {sorted(used)[:5]}, it holds {sorted(names)[:5]}")
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, SyntaxError, OverflowError, RecursionError) as e:
        raise bad(f"malformed entry ({type(e).__name__}: {e})") from None  # (SyntaxError: a dtype string)
    return specs, tree


def _check_files(specs: list[dict], files: dict, bad) -> None:
    """Every listed file is a plain name whose slices tile it exactly, without gaps or overlaps."""
    spans: dict[str, list] = {f: [] for f in files}
    for spec in specs:
        for s in spec["slices"]:
            spans[s["file"]].append((int(s["byte_offset"]), int(s["nbytes"]), spec["name"]))
    for f, size in files.items():
        if os.path.basename(f) != f or f in (".", "..") or not f.endswith(".bin"):
            raise bad(f"file name {f!r} is not a part file of this directory")
        end = 0
        for start, n, name in sorted(spans[f]):
            if start != end:
                raise bad(f"file {f!r}: slice of tensor {name!r} at byte {start}, expected {end}")
            end += n
        if end != size:
            raise bad(f"file {f!r}: its slices cover {end} bytes, the index says {size}")


# ---------------------------------------------------------------- a directory of numbered checkpoints

def step_path(root: str, step: int) -> str:
    """The checkpoint of `step` (an int >= 0) in `root`: `root/step-NNNNNNNN`."""
    return os.path.join(_path(root, "root"), f"step-{_int(step, 'step', 0):08d}")


def steps(root: str, mesh) -> list[int]:
    """The steps of the complete checkpoints in `root`, oldest first ([] if `root` is missing or
    empty), the same on every rank. A collective; `root` holding anything but checkpoints and the
    leftovers of interrupted saves (a file, say) raises CheckpointError on every rank."""
    root, mesh = _path(root, "root"), _mesh(mesh)
    err, found = None, []
    if mesh.rank == 0:
        try:
            found = _scan(root)[0]
        except CheckpointError as e:
            err = str(e)
        except Exception as e:
            err = f"cannot list checkpoints in {root!r}: {_reason(e)}"
    _sync(mesh, err)
    return json.loads(_bcast_text(mesh, json.dumps(found), 0))


def verify(path: str) -> Optional[str]:
    """Why the checkpoint at `path` cannot be loaded (no index, an inconsistent one, a missing,
    truncated or corrupted file), or None if it is intact. Reads every byte and checks every
    checksum, on the calling process alone (not a collective).

    >>> import tempfile, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt"); mm.save(path, {"w": mesh.ones("a:3")})
    >>> verify(path) is None
    True
    >>> with open(os.path.join(path, "part-00000.bin"), "r+b") as f:
    ...     _ = f.write(b"?")
    >>> verify(path)
    "checksum mismatch in '...part-00000.bin', tensor 'w', slice at offset [0], chunk 0: the file is corrupted"
    """
    target = os.path.abspath(_path(path))
    files: dict = {}
    try:
        with open(os.path.join(target, INDEX), "rb") as f:
            specs = _parse_index(f.read().decode("utf-8", "replace"), os.path.join(target, INDEX))[0]
        for spec in specs:
            for s in spec["slices"]:
                _read_block(target, spec, tuple(slice(o, o + n) for o, n in zip(s["offset"], s["shape"])), files)
    except OSError as e:
        return f"cannot read checkpoint {target!r}: {e}"
    except CheckpointError as e:
        return str(e)
    finally:
        for f in files.values():
            f.close()
    return None


def newest_intact(root: str, mesh, before: Optional[int] = None) -> Optional[int]:
    """The step of the newest complete checkpoint in `root` (older than step `before`, if given)
    that `verify` passes, or None. A collective: rank 0 checks, newest first, and tells the others."""
    before = None if before is None else _int(before, "before", 0)
    found = [s for s in steps(root, mesh) if before is None or s < before]
    best, err = -1, None
    if mesh.rank == 0:
        try:
            best = next((s for s in reversed(found) if verify(step_path(root, s)) is None), -1)
        except Exception as e:
            err = f"cannot check checkpoints in {root!r}: {_reason(e)}"
    _sync(mesh, err)
    best = int(mesh.collectives.broadcast(np.array([best], np.int64), 0)[0])
    return None if best < 0 else best


def save_step(root: str, step: int, tensors: Mapping[str, object], *, keep: int = 2, mesh=None,
              chunk_bytes: int = CHUNK_BYTES) -> str:
    """`save(step_path(root, step), tensors)`, then delete all but the newest `keep` complete
    checkpoints in `root` and the leftovers of interrupted saves (after the new one is complete).
    A collective; returns the new checkpoint's path. `step` is an int >= 0 and `keep` an int >= 1
    (the new checkpoint is always kept), checked before anything is written.

    >>> import tempfile, mpimesh as mm
    >>> mesh, root = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF), os.path.join(tempfile.mkdtemp(), "run")
    >>> for step in (10, 20, 30):
    ...     _ = save_step(root, step, {"w": mesh.zeros("a:2")})
    >>> steps(root, mesh), sorted(os.listdir(root))
    ([20, 30], ['step-00000020', 'step-00000030'])
    """
    path, keep = step_path(root, step), _int(keep, "keep", 1)
    mesh = _nest(tensors, mesh)[2]
    steps(root, mesh)  # refuses a directory of other things before writing into it
    save(path, tensors, mesh=mesh, chunk_bytes=chunk_bytes)
    prune(root, mesh, keep, new=step)
    return path


def prune(root: str, mesh, keep: int, new: Optional[int] = None) -> None:
    """Delete all but the newest `keep` complete checkpoints in `root` and the leftovers of
    interrupted saves (rank 0 deletes; a collective). Each checkpoint is first renamed to a
    leftover name, so an interrupted deletion never leaves a partial `step-*` directory. `keep` is an
    int >= 0 (0: delete them all). `new`: a step just saved, kept whatever its number, with the
    newest `keep - 1` others (a run resumed from an older step saves below the newest)."""
    root, mesh, keep = _path(root, "root"), _mesh(mesh), _int(keep, "keep", 0)
    err = None
    if mesh.rank == 0:
        try:
            done, leftovers = _scan(root)
            others = [s for s in done if s != new]
            for step in others[:max(0, len(others) - (keep if new is None else keep - 1))]:
                old = f".step-{step:08d}.old-{secrets.token_hex(8)}"
                os.replace(step_path(root, step), os.path.join(root, old))
                leftovers.append(old)
            for name in leftovers:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except Exception as e:
            err = f"cannot delete old checkpoints in {root!r}: {_reason(e)}"
    _sync(mesh, err)


def _scan(root: str) -> tuple[list[int], list[str]]:
    """(the steps of the complete checkpoints in `root` sorted, the leftovers' names)."""
    if not os.path.lexists(root):
        return [], []
    if not os.path.isdir(root):
        raise CheckpointError(f"{root!r} is not a directory of checkpoints: it is a file")
    done, leftovers, other = [], [], []
    for name in sorted(os.listdir(root)):
        m = STEP_DIR.fullmatch(name)
        if m and _is_checkpoint(os.path.join(root, name)):
            done.append(int(m[1]))
        elif LEFTOVER.fullmatch(name):
            leftovers.append(name)
        elif not m:
            other.append(name)
    if other:
        raise CheckpointError(f"{root!r} is not a directory of checkpoints: it holds {other[:3]}"
                              f"{f' and {len(other) - 3} more' if len(other) > 3 else ''}; refusing to use it")
    return sorted(done), leftovers
