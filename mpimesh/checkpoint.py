"""Checkpoints: each rank writes its own slices, atomically; loading reshards onto any mesh.

`save(path, tree)` writes a nest of dicts, lists and tuples of DistTensors and plain values; `load`
gives it back on any mesh and layout, checked against `shapes=` when given. `save_step` and `steps`
keep numbered checkpoints in one directory; `verify` and `newest_intact` find an intact one. No
pickle; a failure on any rank raises the same `CheckpointError` on every rank. The format and how
writes stay atomic: docs/checkpoints.md. `blocking=False`: `async_save`; safetensors: `safetensors_io`.

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
import zlib
from typing import Callable, Mapping, Optional

import numpy as np

from . import safetensors_io
from .async_save import SaveHandle, launch, wait_pending
from .backend import BFLOAT16, to_host
from .checkpoint_sync import (CommOps, Ops, agree as _agree, bcast_text as _bcast_text, bool_arg,
                              distinct_slices as _slices, fsync_dir as _fsync_dir, int_arg as _int, make_tmp,
                              mesh_arg as _mesh, mesh_index as _mesh_index, nest as _nest, path_arg as _path,
                              reason as _reason, slow_save_hook, swap_in, sync as _sync)
from .errors import CheckpointError
from .layout import LayoutRules, RulesLike, check_rules, plan_layout, slice_bounds
from .shape import Shape, ShapeLike
from .tensor import DistTensor, host_read
from .tree import from_json, is_tensor, named_leaves

FORMAT, INDEX = "mpimesh-checkpoint", "index.json"
VERSION, NESTED = 1, 2  # the index's version: a flat dict of tensors (as before nests); a nest (with `tree`)
INDEX_CRC, INDEX_KEYS = "index_crc32", {"format", "version", "mesh", "files", "tensors", "tree"}
CHUNK_BYTES = 4 << 20  # one CRC-32 per chunk of about this many bytes
STEP_DIR = re.compile(r"step-(\d{8,})")  # save_step's checkpoints
LEFTOVER = re.compile(r"\.step-\d{8,}\.(tmp|old)-[0-9a-f]+")  # an interrupted save's or a deletion's


# ---------------------------------------------------------------- the plan: who writes what

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

FORMATS = ("mpimesh", "safetensors")


def save(path: str, tensors: Mapping[str, object], *, mesh=None, chunk_bytes: int = CHUNK_BYTES,
         format: str = "mpimesh", max_shard_bytes: Optional[int] = None,
         blocking: bool = True) -> Optional[SaveHandle]:
    """Write the dict `tensors` to the directory `path`: DistTensors (one mesh) and plain values (int,
    float, str, bool, None), nested in dicts, lists and tuples. A collective: every rank passes the same
    arguments, names, shapes, dtypes, layouts and plain values, else CheckpointError on every rank before
    anything is written. Each rank writes its distinct slices; the checkpoint appears at `path` at once,
    replacing a checkpoint there. `mesh`: needed only without tensors. `format="safetensors"`: Hugging
    Face's files (`safetensors_io`). `blocking=False`: a `SaveHandle` at once (`async_save`).

    >>> import tempfile, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> params, opt = {"l1/kernel": mesh.ones("a:2;b:3")}, mm.optim.Adam(0.1)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt"); mm.save(path, {"params": params, "state": opt.init(params)})
    >>> mm.load(path, mesh)["state"]["m"]["l1/kernel"].origin[1]   # (names escaped as in a JSON Pointer)
    'state/m/l1~1kernel'
    """
    if format not in FORMATS:
        raise CheckpointError(f"format must be one of {', '.join(map(repr, FORMATS))}, got {format!r}")
    blocking = bool_arg(blocking, "blocking")
    wait_pending()
    if format == "safetensors":
        return safetensors_io.save(path, tensors, mesh=mesh, max_shard_bytes=max_shard_bytes, blocking=blocking)
    if max_shard_bytes is not None:
        raise CheckpointError("max_shard_bytes is for format='safetensors' (an mpimesh checkpoint writes one "
                              "part file per rank)")
    return _save(path, tensors, mesh, chunk_bytes, blocking)


def _save(path: str, tensors: Mapping[str, object], mesh, chunk_bytes: int, blocking: bool,
          after: Optional[Callable[[], Optional[str]]] = None) -> Optional[SaveHandle]:
    """`save` in our format; `after()` (rank 0, once the checkpoint is in place) returns an error or None."""
    path = _path(path)
    chunk_bytes = _int(chunk_bytes, "chunk_bytes", 1)
    tree, items, mesh = _nest(tensors, mesh)
    for _, t in items[:1]:  # (a compiled step would save once, never in a replay)
        host_read(t, f"mm.save({str(path)!r})")
    settings = {"format": "mpimesh", "chunk_bytes": str(chunk_bytes), "blocking": str(blocking)}
    items = _agree(mesh, os.path.abspath(path), settings, items, tree)
    plan = _plan(items, mesh.shape, chunk_bytes, tree)
    ops = None if blocking else CommOps.of(mesh)

    # This rank's distinct slices, copied (a background save writes the values of now), then the temp dir.
    me, rank, err, blocks = _mesh_index(mesh.shape, mesh.coords), mesh.rank, None, []
    try:
        for (_, t), spec in zip(items, plan["tensors"]):
            if any(s["_pos"] == me for s in spec["slices"]):
                host = to_host(t.local)
                data = (np.ascontiguousarray(host, _le(t.dtype)) if blocking or host is not t.local
                        else np.array(host, _le(t.dtype), order="C", copy=True))
                blocks.append((data.reshape(-1), spec["chunk_elements"]))
    except Exception as e:
        err = f"cannot save checkpoint {path!r}: {_reason(e)}"
    try:
        target, tmp = make_tmp(mesh, path, _check_replaceable, err)
    except CheckpointError:
        if ops is not None:
            ops.free()
        raise
    crcs: list = []

    def write() -> Optional[str]:
        """This rank's part file (if it writes any slice), fsynced, and its chunks' checksums."""
        try:
            if blocks:
                with open(os.path.join(tmp, f"part-{me:05d}.bin"), "wb") as f:
                    for data, chunk_elements in blocks:
                        view = memoryview(data.view(np.uint8))
                        crcs.append(_chunk_crcs(view, chunk_elements * data.itemsize))
                        f.write(view)
                    f.flush()
                    os.fsync(f.fileno())
            slow_save_hook(rank, target)
        except Exception as e:
            return f"cannot write checkpoint {target!r}: {_reason(e)}"
        return None

    def commit(ops: Ops, err: Optional[str]) -> None:
        """Once every rank has written: rank 0 writes the index (the commit marker) and swaps it in."""
        try:
            _sync(ops, err)
            _fill_crcs(ops, plan, me, crcs)
            err = None
            if ops.rank == 0:
                try:
                    with open(os.path.join(tmp, INDEX), "w") as f:
                        json.dump({**plan, INDEX_CRC: _index_crc(plan)}, f, indent=1)
                        f.flush()
                        os.fsync(f.fileno())
                    _fsync_dir(tmp)
                    _swap_in(tmp, target)
                except Exception as e:
                    err = f"cannot save checkpoint {target!r}: {_reason(e)}"
                if err is None and after is not None:
                    err = after()
            _sync(ops, err)
        finally:
            if ops.rank == 0 and os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)  # only after a failure: success renamed it

    return launch(mesh, target, write, commit, ops)


def _fill_crcs(ops: Ops, plan: dict, me: int, crcs: list[list[int]]) -> None:
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
    x = ops.allgather(vec)  # row-major mesh position -> checksums
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
    swap_in(tmp, target, _check_replaceable)


# ---------------------------------------------------------------- load

def load(path: str, mesh, layout: Optional[RulesLike] = None,
         shapes: Optional[Mapping[str, ShapeLike]] = None) -> dict:
    """What was saved at `path`, as saved (the same nest of dicts, lists and tuples, DistTensors and
    plain values), each tensor on `mesh` laid out by `layout` (default: the rules in force on `mesh`),
    whatever mesh it was saved from. A collective: every rank must call it. A missing, damaged or
    inconsistent checkpoint, or one whose tensors differ from `shapes` (the saved nest with a shape or a
    tensor at each tensor's place), raises CheckpointError on every rank. Each tensor returned has
    `origin`: (the checkpoint's absolute path, the tensor's name in it). A `.safetensors` file, or a
    directory of them without our `index.json`, is read by `safetensors_io.load` (a flat dict).

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
    wait_pending()
    err, text = None, ""
    if mesh.rank == 0:
        target = os.path.abspath(path)
        try:
            if safetensors_io.holds_safetensors(target) and not os.path.isfile(os.path.join(target, INDEX)):
                text = json.dumps([target, None])
            elif not os.path.isdir(target):
                raise CheckpointError(f"no checkpoint at {target!r}: not a directory")
            else:
                with open(os.path.join(target, INDEX), "rb") as f:
                    text = json.dumps([target, f.read().decode("utf-8", "replace")])
        except CheckpointError as e:
            err = str(e)
        except Exception as e:
            err = f"cannot read checkpoint index {os.path.join(target, INDEX)!r}: {_reason(e)}"
    _sync(mesh, err)
    target, text = json.loads(_bcast_text(mesh, text, 0))
    if text is None:
        return safetensors_io.load(target, mesh, rules, shapes)
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
    its leaves by path (a nest's; for a flat checkpoint, a nest whose paths are its names) that are
    shapes (a Shape, a str) or tensors (their shapes)."""
    nested = nested or any(isinstance(v, Mapping) for v in shapes.values())
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
              chunk_bytes: int = CHUNK_BYTES, blocking: bool = True):
    """`save(step_path(root, step), tensors)`, then delete all but the newest `keep` complete
    checkpoints in `root` and the leftovers of interrupted saves (after the new one is complete).
    A collective; returns the new checkpoint's path (`blocking=False`: its `SaveHandle`, whose `path`
    it is, and the deletion comes after the background commit). `step` is an int >= 0 and `keep` an
    int >= 1 (the new checkpoint is always kept), checked before anything is written.

    >>> import tempfile, mpimesh as mm
    >>> mesh, root = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF), os.path.join(tempfile.mkdtemp(), "run")
    >>> for step in (10, 20, 30):
    ...     _ = save_step(root, step, {"w": mesh.zeros("a:2")})
    >>> steps(root, mesh), sorted(os.listdir(root))
    ([20, 30], ['step-00000020', 'step-00000030'])
    """
    path, keep, blocking = step_path(root, step), _int(keep, "keep", 1), bool_arg(blocking, "blocking")
    root = _path(root, "root")
    mesh = _nest(tensors, mesh)[2]
    wait_pending()
    steps(root, mesh)  # refuses a directory of other things before writing into it
    handle = _save(path, tensors, mesh, chunk_bytes, blocking, after=lambda: _prune_here(root, keep, step))
    return path if blocking else handle


def prune(root: str, mesh, keep: int, new: Optional[int] = None) -> None:
    """Delete all but the newest `keep` complete checkpoints in `root` and the leftovers of
    interrupted saves (rank 0 deletes; a collective). Each checkpoint is first renamed to a
    leftover name, so an interrupted deletion never leaves a partial `step-*` directory. `keep` is an
    int >= 0 (0: delete them all). `new`: a step just saved, kept whatever its number, with the
    newest `keep - 1` others (a run resumed from an older step saves below the newest)."""
    root, mesh, keep = _path(root, "root"), _mesh(mesh), _int(keep, "keep", 0)
    _sync(mesh, _prune_here(root, keep, new) if mesh.rank == 0 else None)


def _prune_here(root: str, keep: int, new: Optional[int]) -> Optional[str]:
    """`prune`'s deletions, on this process alone: None, or why they failed."""
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
        return f"cannot delete old checkpoints in {root!r}: {_reason(e)}"
    return None


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
