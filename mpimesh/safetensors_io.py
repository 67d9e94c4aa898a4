"""Hugging Face safetensors files in and out: `mm.save(path, tensors, format="safetensors")`, `mm.load(path, mesh)`.

`save` writes `model.safetensors`, or shards of at most `max_shard_bytes` (default `SHARD_BYTES`, 5 GB)
and `model.safetensors.index.json`, as `transformers` does; nested dicts give '/'-joined names. Ranks
write their shards in parallel, atomically. `load` reads any `.safetensors` file or directory of them,
each rank only its blocks (`safe_open(...).get_slice(name)[block]`; `last_read` counts the bytes). The
layout of the files, dim names, what is refused: docs/checkpoints.md.

>>> import os, tempfile, numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> path = os.path.join(tempfile.mkdtemp(), "export")
>>> mm.save(path, {"layer": {"w": mesh.from_numpy(np.arange(6.0).reshape(2, 3), "a:2;b:3")}}, format="safetensors")
>>> sorted(os.listdir(path)), mm.load(path, mesh)["layer/w"].shape
(['model.safetensors'], Shape('[a:2, b:3]'))
"""
from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import ExitStack
from typing import Mapping, Optional

import numpy as np

from .async_save import SaveHandle, launch
from .backend import BFLOAT16, to_host
from .checkpoint_sync import (CommOps, agree, bcast_text, bool_arg, distinct_slices, fsync_dir, fsync_file, int_arg,
                              make_tmp, mesh_index, one_mesh, path_arg, reason, slow_save_hook, swap_in, sync)
from .errors import CheckpointError
from .extras import require
from .layout import plan_layout, slice_bounds
from .shape import Shape
from .tensor import DistTensor, host_read
from .tree import is_tensor

SHARD_BYTES = 5 * 10 ** 9  # Hugging Face's default max_shard_size ("5GB")
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
DIMS_KEY = "mpimesh.dims"
CODES = {"BOOL": np.dtype(bool), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "U16": np.dtype(np.uint16),
         "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32),
         "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64), "F16": np.dtype(np.float16), "BF16": BFLOAT16,
         "F32": np.dtype(np.float32), "F64": np.dtype(np.float64), "C64": np.dtype(np.complex64)}
"""The safetensors dtypes that mpimesh tensors hold, and theirs (the float8 and float4 codes are not)."""

last_read = {"bytes": 0, "tensors": 0}
"""What this rank's last safetensors `load` read: bytes of tensor data (its blocks) and tensors."""


def _package(what: str):
    return require("safetensors.numpy", "safetensors", what)


# ---------------------------------------------------------------- save

def save(path, tensors: Mapping[str, object], *, mesh=None, max_shard_bytes: Optional[int] = None,
         blocking: bool = True) -> Optional[SaveHandle]:
    """Write `tensors` (a dict of DistTensors, nested dicts allowed) as safetensors files in the
    directory `path` (see the module's docstring). A collective, like `mm.save`, whose arguments it takes."""
    st = _package("mm.save(..., format='safetensors')")
    path = path_arg(path)
    limit = SHARD_BYTES if max_shard_bytes is None else int_arg(max_shard_bytes, "max_shard_bytes", 1)
    blocking = bool_arg(blocking, "blocking")
    items = _flat(tensors)
    mesh = one_mesh(items, mesh)
    for name, t in items:
        _code(np.dtype(t.dtype), name)
    for _, t in items[:1]:  # (a compiled step would save once, never in a replay)
        host_read(t, f"mm.save({path!r})")
    settings = {"format": "safetensors", "max_shard_bytes": str(limit), "blocking": str(blocking)}
    items = agree(mesh, os.path.abspath(path), settings, items, None)
    shards = _shards([t.shape.size * np.dtype(t.dtype).itemsize for _, t in items], limit)
    files = ([SINGLE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    writers = _writers([sum(items[k][1].shape.size * np.dtype(items[k][1].dtype).itemsize for k in s)
                        for s in shards], mesh.size)
    writer_of = {k: writers[i] for i, s in enumerate(shards) for k in s}
    ops = CommOps.of(mesh)
    try:
        whole = _gather(mesh, ops, items, writer_of)
        target, tmp = make_tmp(mesh, path, check_replaceable)
    except BaseException:
        ops.free()
        raise
    if blocking:
        ops.free()
        ops = None
    rank = mesh.rank

    def write() -> Optional[str]:
        """This rank's shards, each fsynced."""
        try:
            for i, shard in enumerate(shards):
                if writers[i] == rank:
                    names = [items[k][0] for k in shard]
                    dims = {items[k][0]: list(items[k][1].shape.names) for k in shard}
                    st.save_file({n: whole[n] for n in names}, os.path.join(tmp, files[i]),
                                 metadata={"format": "pt", DIMS_KEY: json.dumps(dims)})
                    fsync_file(os.path.join(tmp, files[i]))
            slow_save_hook(rank, target)
        except Exception as e:
            return f"cannot write safetensors {target!r}: {reason(e)}"
        return None

    def commit(ops, err: Optional[str]) -> None:
        """Once every rank has written: rank 0 writes the index (with shards) and swaps the directory in."""
        try:
            sync(ops, err)
            if ops.rank == 0:
                try:
                    if len(shards) > 1:
                        index = {"metadata": {"total_size": sum(t.shape.size * np.dtype(t.dtype).itemsize
                                                                for _, t in items)},
                                 "weight_map": {items[k][0]: files[i] for i, s in enumerate(shards) for k in s}}
                        with open(os.path.join(tmp, INDEX), "w") as f:
                            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
                            f.flush()
                            os.fsync(f.fileno())
                    fsync_dir(tmp)
                    swap_in(tmp, target, check_replaceable)
                except Exception as e:
                    err = f"cannot save safetensors {target!r}: {reason(e)}"
            sync(ops, err)
        finally:
            if ops.rank == 0 and os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)  # only after a failure: success renamed it

    return launch(mesh, target, write, commit, ops)


def _flat(tensors, keys: tuple = ()) -> list:
    """`[(name, tensor)]` of a dict of tensors and dicts, names '/'-joined, else CheckpointError."""
    if not isinstance(tensors, Mapping):
        raise CheckpointError(f"safetensors files hold a dict of DistTensors (nested dicts allowed), got "
                              f"{type(tensors).__name__}" + (f" at {'/'.join(keys)!r}" if keys else ""))
    out = []
    for key, value in tensors.items():
        name = "/".join(keys + (key,)) if isinstance(key, str) else None
        if name is None or name == "__metadata__":
            raise CheckpointError(f"cannot save {key!r} in safetensors files: a tensor's name is a str other than "
                                  f"'__metadata__'")
        if isinstance(value, Mapping):
            out += _flat(value, keys + (key,))
        elif is_tensor(value):
            out.append((name, value))
        else:
            raise CheckpointError(f"cannot save {name!r} in safetensors files: they hold tensors only (in nested "
                                  f"dicts), got {type(value).__name__}")
    if not keys:
        seen: set = set()
        twice = [n for n, _ in out if n in seen or seen.add(n)]
        if twice:
            raise CheckpointError(f"cannot save safetensors files: the name {twice[0]!r} comes twice ('/'-joined "
                                  f"keys of nested dicts and a key holding '/' meet)")
    return out


def _code(dtype: np.dtype, name: str) -> str:
    """The safetensors code of `dtype`, else CheckpointError naming the tensor."""
    code = next((c for c, d in CODES.items() if d == dtype), None)
    if code is None:
        raise CheckpointError(f"tensor {name!r} is {dtype}, which safetensors files cannot hold; they hold "
                              f"{', '.join(str(d) for d in CODES.values())}")
    return code


def _shards(sizes: list[int], limit: int) -> list[list[int]]:
    """The tensors (by position) of each shard, in order: each filled up to `limit` bytes, a larger
    tensor alone (Hugging Face's split).

    >>> _shards([4, 4, 9, 1, 2], 8)
    [[0, 1], [2], [3, 4]]
    """
    out, size = [[]], 0
    for k, n in enumerate(sizes):
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(k)
        size += n
    return out


def _writers(shard_bytes: list[int], ranks: int) -> list[int]:
    """The rank that writes each shard: the largest first, each to the least loaded rank.

    >>> _writers([5, 1, 4, 4], 2)
    [0, 0, 1, 1]
    """
    load, out = [0] * ranks, [0] * len(shard_bytes)
    for i in sorted(range(len(shard_bytes)), key=lambda i: -shard_bytes[i]):
        out[i] = min(range(ranks), key=lambda r: load[r])
        load[out[i]] += shard_bytes[i]
    return out


def _gather(mesh, ops: CommOps, items: list, writer_of: dict) -> dict:
    """`{name: global array}` of the tensors this rank writes: each distinct block sent by the rank
    holding it (point-to-point on `ops`' communicator). A collective; an error on any rank raises on all."""
    me, err, mine = mesh.rank, None, {}
    try:  # this rank's blocks on the host, as bytes (MPI knows no bfloat16)
        for k, (name, t) in enumerate(items):
            if me == writer_of[k] or any(mesh_index(mesh.shape, c) == me
                                         for c, _ in distinct_slices(t.shape, mesh.shape, t.tensor_layout)):
                mine[k] = np.asarray(to_host(t.local), order="C")  # (ascontiguousarray makes a 0-d array 1-d)
    except Exception as e:
        err = f"cannot save safetensors: {reason(e)}"
    sync(mesh, err)
    whole, requests, received = {}, [], []
    for k, (name, t) in enumerate(items):
        w = writer_of[k]
        if me == w:
            whole[name] = np.empty(t.shape.sizes, np.dtype(t.dtype))
        for coords, bounds in distinct_slices(t.shape, mesh.shape, t.tensor_layout):
            holder = mesh_index(mesh.shape, coords)
            if not all(b.stop > b.start for b in bounds) or me not in (holder, w):
                continue
            if holder == w:
                whole[name][bounds] = mine[k]
            elif holder == me:
                requests.append(ops.comm.Isend(mine[k].reshape(-1).view(np.uint8), dest=w, tag=k % 32768))
            else:
                buf = np.empty([b.stop - b.start for b in bounds], np.dtype(t.dtype))
                requests.append(ops.comm.Irecv(buf.reshape(-1).view(np.uint8), source=holder, tag=k % 32768))
                received.append((whole[name], bounds, buf))
    if requests:
        requests[0].Waitall(requests)
    for full, bounds, buf in received:
        full[bounds] = buf
    return whole


def _is_ours(name: str) -> bool:
    return name in (SINGLE, INDEX, "config.json") or bool(SHARD.fullmatch(name))


def check_replaceable(target: str) -> None:
    """CheckpointError unless `target` is missing, an empty directory or one of our exports (and a config.json)."""
    if not os.path.lexists(target):
        return
    if os.path.isdir(target) and not os.path.islink(target):
        other = [n for n in sorted(os.listdir(target)) if not _is_ours(n)]
        if not other:
            return
        what = f"it holds {other[:3]}" + (f" and {len(other) - 3} more" if len(other) > 3 else "")
    else:
        what = "not a directory"
    raise CheckpointError(f"{target!r} exists and is not a safetensors export ({what}); refusing to replace it")


# ---------------------------------------------------------------- load

def holds_safetensors(target: str) -> bool:
    """Whether `target` is a `.safetensors` file or a directory holding some (what `load` reads)."""
    if os.path.isfile(target):
        return target.endswith(".safetensors")
    return os.path.isdir(target) and any(n.endswith(".safetensors") for n in os.listdir(target))


def load(target: str, mesh, rules, shapes: Optional[Mapping]) -> dict:
    """`{name: DistTensor}` of the safetensors file or directory `target` (absolute, the same on every
    rank) on `mesh` laid out by `rules`; `shapes`: the tensors to read and their dims. A collective."""
    st = _package("mm.load of safetensors files")
    err, text = None, ""
    if mesh.rank == 0:
        try:
            text = json.dumps(_catalogue(st, target))
        except CheckpointError as e:
            err = str(e)
        except Exception as e:
            err = f"cannot read safetensors {target!r}: {reason(e)}"
    sync(mesh, err)
    specs = _choose(json.loads(bcast_text(mesh, text, 0)), shapes, target)  # identical on every rank
    layouts = [plan_layout(shape, mesh.shape, rules) for _, _, shape, _ in specs]  # LayoutError: everywhere
    out, err, nbytes = {}, None, 0
    with ExitStack() as files:
        opened: dict = {}
        try:
            for (name, file, shape, dtype), tl in zip(specs, layouts):
                bounds = slice_bounds(shape, mesh.shape, tl, mesh.coords)
                if all(b.stop > b.start for b in bounds):
                    if file not in opened:
                        opened[file] = files.enter_context(st.safe_open(file, framework="numpy"))
                    local = np.asarray(opened[file].get_slice(name)[bounds], order="C")
                    nbytes += local.nbytes
                else:  # (safetensors refuses to slice a dim of size 0)
                    local = np.empty([b.stop - b.start for b in bounds], dtype)
                out[name] = (shape, tl, local)
        except Exception as e:
            err = f"cannot load safetensors {target!r}: {reason(e)}"
    sync(mesh, err)
    last_read.update(bytes=nbytes, tensors=len(out))
    for name, (shape, tl, local) in out.items():
        out[name] = t = DistTensor(mesh, shape, tl, mesh.xp.asarray(local))
        t._origin = (target, name)
    return out


def _catalogue(st, target: str) -> list:
    """`[[name, file, dtype code, sizes, dim names or None]]` of the tensors at `target` (rank 0 reads
    the index and the files' headers)."""
    if os.path.isfile(target):
        root, weight_map = os.path.dirname(target), None
        files = [os.path.basename(target)]
    else:
        root, names = target, sorted(os.listdir(target))
        indexes = [n for n in names if n.endswith(".safetensors.index.json")]
        singles = [n for n in names if n.endswith(".safetensors")]
        if len(indexes) > 1 or (not indexes and len(singles) > 1 and SINGLE not in singles):
            raise CheckpointError(f"{target!r} holds {indexes or singles}: which to load? (one index, or "
                                  f"{SINGLE})")
        weight_map = None
        if indexes:
            with open(os.path.join(target, indexes[0])) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                    isinstance(v, str) and os.path.basename(v) == v and v.endswith(".safetensors")
                    for v in weight_map.values()):
                raise CheckpointError(f"safetensors index {os.path.join(target, indexes[0])!r} has no weight_map "
                                      f"of tensor names to file names of this directory")
            files = sorted(set(weight_map.values()))
        else:
            files = [SINGLE if SINGLE in singles else singles[0]]
    out = []
    for file in files:
        path = os.path.join(root, file)
        with st.safe_open(path, framework="numpy") as f:
            dims = json.loads((f.metadata() or {}).get(DIMS_KEY, "{}"))
            held = list(f.keys())
            wanted = held if weight_map is None else [n for n, v in weight_map.items() if v == file]
            missing = sorted(set(wanted) - set(held))
            if missing:
                raise CheckpointError(f"safetensors index of {target!r} puts {missing[:3]} in {file!r}, which does "
                                      f"not hold {'it' if len(missing) == 1 else 'them'}")
            for name in wanted:
                s = f.get_slice(name)
                out.append([name, path, s.get_dtype(), list(s.get_shape()), dims.get(name)])
    return out


def _choose(catalogue: list, shapes: Optional[Mapping], target: str) -> list:
    """`[(name, file, Shape, dtype)]` to read: every tensor, or those `shapes` names (their sizes checked,
    their dims named by it); an unknown name, other sizes or a dtype mpimesh cannot hold raise here."""
    by_name = {e[0]: e for e in catalogue}
    if shapes is None:
        want = {}
        for name, _, _, sizes, dims in catalogue:
            ok = isinstance(dims, list) and len(dims) == len(sizes) and all(isinstance(d, str) for d in dims)
            want[name] = Shape(list(zip(dims if ok else [f"dim{i}" for i in range(len(sizes))], sizes)))
    else:
        want = {name: v.shape if is_tensor(v) else Shape(v) for name, v in _flat_shapes(shapes)}
        unknown = [n for n in want if n not in by_name]
        if unknown:
            raise CheckpointError(f"safetensors {target!r} holds no tensor {', '.join(map(repr, unknown[:3]))}"
                                  f"{f' and {len(unknown) - 3} more' if len(unknown) > 3 else ''}; it holds "
                                  f"{len(by_name)}: {', '.join(map(repr, list(by_name)[:5]))}"
                                  f"{', ...' if len(by_name) > 5 else ''}")
        for name, shape in want.items():
            if list(shape.sizes) != by_name[name][3]:
                raise CheckpointError(f"safetensors {target!r}: tensor {name!r} has shape {tuple(by_name[name][3])}, "
                                      f"expected {shape} {shape.sizes}")
    out = []
    for name, shape in want.items():
        code = by_name[name][2]
        if code not in CODES:
            raise CheckpointError(f"safetensors {target!r}: tensor {name!r} has dtype {code}, which mpimesh "
                                  f"tensors cannot hold (they read {', '.join(CODES)})")
        out.append((name, by_name[name][1], shape, CODES[code]))
    return out


def _flat_shapes(shapes: Mapping, keys: tuple = ()) -> list:
    """`[(name, shape or tensor)]` of a dict of them (nested dicts: '/'-joined names)."""
    out = []
    for key, value in shapes.items():
        if isinstance(value, Mapping):
            out += _flat_shapes(value, keys + (str(key),))
        else:
            out.append(("/".join(keys + (str(key),)), value))
    return out
