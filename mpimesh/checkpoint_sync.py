"""What the checkpoint formats share: argument checks, the ranks' agreement on what is saved, one error
on every rank, who holds which distinct slice, and the collectives a save commits with: `MeshOps` (the
mesh's own transport, guarded like every collective) on the caller's thread, `CommOps` (a duplicate
communicator, polled with sleeps) on a background save's thread. `sync` and `bcast_text` take either.

>>> import mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> sync(mesh, None), bcast_text(CommOps.of(mesh), "hello", 0)
(None, 'hello')
>>> sync(mesh, "disk full")
Traceback (most recent call last):
mpimesh.errors.CheckpointError: disk full
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from typing import Callable, Mapping, Optional, Union

import numpy as np
from mpi4py import MPI

from . import env
from .errors import CheckpointError, by_rank
from .layout import slice_bounds
from .mesh import AbstractMesh, Mesh
from .shape import Shape
from .tree import from_json, is_tensor, leaf_name, to_json

POLL_SECONDS = 0.002  # CommOps' sleep between tests of a pending request


# ---------------------------------------------------------------- arguments

def path_arg(path, what: str = "path") -> str:
    """`path` (a str or os.PathLike) as a str, else TypeError: checked on every rank, before any rank
    touches the file system."""
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(path, str):
        swapped = ": the path comes first, then the mesh" if isinstance(path, AbstractMesh) else ""
        raise TypeError(f"{what} must be a str or os.PathLike naming a directory, got {type(path).__name__}{swapped}")
    if not path:
        raise CheckpointError(f"{what} is empty")
    return path


def mesh_arg(mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a Mesh, got {type(mesh).__name__}")
    return mesh


def int_arg(value, what: str, least: int) -> int:
    """`value` if it is an int (not a bool) >= `least`, else TypeError or CheckpointError naming `what`.

    >>> int_arg(-1, "step", 0)
    Traceback (most recent call last):
    mpimesh.errors.CheckpointError: step must be an int >= 0, got -1
    """
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int >= {least}, got {type(value).__name__} {value!r}")
    if value < least:
        raise CheckpointError(f"{what} must be an int >= {least}, got {value}")
    return int(value)


def bool_arg(value, what: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def reason(e: Exception) -> str:
    """`e` as the end of the CheckpointError every rank raises for it (its class named unless it is an
    OSError or ours): any exception on one rank becomes every rank's error, never a hang."""
    return str(e) if isinstance(e, (OSError, CheckpointError)) else f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------- the collectives of a save

class MeshOps:
    """A checkpoint's collectives over the mesh's own transport: for the caller's thread alone."""

    def __init__(self, mesh):
        self.mesh, self.rank, self.size = mesh, mesh.rank, mesh.size

    def any_rank(self, flag: bool) -> bool:
        return self.mesh.collectives.any_rank(flag)

    def bcast(self, x: np.ndarray, root: int) -> np.ndarray:
        return self.mesh.collectives.broadcast(x, root)

    def allgather(self, vec: np.ndarray) -> np.ndarray:
        """Every rank's 1-D `vec` (all of one length), as rows in rank order."""
        x = vec.reshape((1,) * self.mesh.shape.rank + vec.shape)
        for axis, m in enumerate(self.mesh.shape.names):
            x = self.mesh.collectives.allgather(x, m, axis)
        return x.reshape(self.size, vec.size)


class CommOps:
    """A checkpoint's collectives over a duplicate of the mesh's communicator (None on one rank: no MPI
    call at all), safe on a background thread; `free()` releases it. Made by `of` on every rank (a
    collective, on the caller's thread)."""

    def __init__(self, comm: Optional[MPI.Comm], rank: int, size: int):
        self.comm, self.rank, self.size = comm, rank, size

    @classmethod
    def of(cls, mesh) -> "CommOps":
        if mesh.size == 1:
            return cls(None, 0, 1)
        level = MPI.Query_thread()
        if level < MPI.THREAD_MULTIPLE:  # (the same on every rank: one MPI library, one mpi4py setting)
            raise CheckpointError(f"a background save (blocking=False) needs MPI_THREAD_MULTIPLE; this MPI was "
                                  f"initialised with thread level {level} (mpi4py.rc.thread_level): save with "
                                  f"blocking=True")
        return cls(mesh.comm_for(mesh.shape.names).Dup(), mesh.rank, mesh.size)

    @staticmethod
    def _wait(request: MPI.Request) -> None:
        while not request.Test():
            time.sleep(POLL_SECONDS)

    def any_rank(self, flag: bool) -> bool:
        return bool(self.allgather(np.array([int(bool(flag))], np.int64)).any())

    def bcast(self, x: np.ndarray, root: int) -> np.ndarray:
        out = np.array(x, copy=True, order="C")
        if self.comm is not None:
            self._wait(self.comm.Ibcast(out, root))
        return out

    def allgather(self, vec: np.ndarray) -> np.ndarray:
        vec = np.ascontiguousarray(vec)
        out = np.empty((self.size, vec.size), vec.dtype)
        if self.comm is None:
            out[0] = vec
        else:
            self._wait(self.comm.Iallgather(vec, out))
        return out

    def free(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


Ops = Union[MeshOps, CommOps]


def ops_of(where) -> Ops:
    return where if isinstance(where, (MeshOps, CommOps)) else MeshOps(where)


def bcast_text(where, text: str, root: int) -> str:
    """`text` of rank `root`, on every rank (`where`: a mesh, or its `MeshOps` or `CommOps`)."""
    ops = ops_of(where)
    data = np.frombuffer(text.encode(), np.uint8)
    n = int(ops.bcast(np.array([data.size], np.int64), root)[0])
    return bytes(ops.bcast(data if ops.rank == root else np.zeros(n, np.uint8), root)).decode()


def sync(where, err: Optional[str]) -> None:
    """If any rank has an error, raise the lowest such rank's message as CheckpointError everywhere."""
    ops = ops_of(where)
    if not ops.any_rank(err is not None):
        return
    root = int(np.flatnonzero(ops.allgather(np.array([err is not None], np.int64))[:, 0])[0])
    msg = bcast_text(ops, err or "", root)
    raise CheckpointError(msg if ops.size == 1 else f"{msg} (rank {root})")


# ---------------------------------------------------------------- what is saved, and agreeing on it

def nest(tensors: Mapping[str, object], mesh) -> tuple[Optional[dict], list, object]:
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
    return tree, items, one_mesh(items, mesh)


def one_mesh(items: list, mesh):
    """The mesh every tensor of `items` lives on (`mesh`, where given), else CheckpointError."""
    other = "mesh=" if mesh is not None else f"tensor {items[0][0]!r}" if items else ""
    mesh = mesh if mesh is not None else (items[0][1].mesh if items else None)
    if mesh is None:
        raise CheckpointError("save of a dict without tensors needs mesh=")
    mesh_arg(mesh)
    for name, t in items:
        if t.mesh is not mesh:  # (a Mesh's repr names this rank: the shapes alone say the same on every rank)
            raise CheckpointError(f"tensor {name!r} lives on another Mesh object ({t.mesh.shape}) than {other} "
                                  f"({mesh.shape}): save tensors of one mesh")
    return mesh


def agree(mesh, target: str, settings: Mapping[str, str], items: list, tree: Optional[dict]) -> list:
    """`items` in rank 0's order, once every rank passes the same `target`, `settings` (chunk_bytes, ...),
    tensors (names, shapes, dtypes, layouts; in any order) and other entries of the nest `tree` (lists,
    tuples, plain values); else CheckpointError on every rank naming the first difference and what
    each rank has."""
    mine = {"path": repr(target), **settings,
            **{f"tensor {name!r}": f"{t.shape} {np.dtype(t.dtype)} layout {t.layout}" for name, t in items},
            **({} if tree is None else entries(tree))}
    text = json.dumps([[name for name, _ in items], mine])
    order, first = json.loads(bcast_text(mesh, text, 0))
    if not mesh.collectives.any_rank(mine != first):
        by_name = dict(items)
        return [(name, by_name[name]) for name in order]
    every = [json.loads(bcast_text(mesh, text, r))[1] for r in range(mesh.size)]
    fixed = ["path", *settings]
    key = next(k for k in fixed + sorted({k for d in every for k in d} - set(fixed))
               if len({d.get(k) for d in every}) > 1)
    has = by_rank([d.get(key, "no such tensor" if key.startswith("tensor ") else "no such entry") for d in every])
    raise CheckpointError(f"cannot save checkpoint {first['path']}: the ranks disagree on {key}: {has}")


def entries(node: dict, keys: tuple = ()) -> dict:
    """`{"entry 'name'": what}` for the nodes of a nest's JSON other than its dicts and tensors: a list or
    tuple (its length), a plain value (its type and value).

    >>> entries(to_json({"a": [1, "x"], "b": {"c": None}}, lambda x: False)[0])
    {"entry 'a'": 'list of 2', "entry 'a/0'": 'int 1', "entry 'a/1'": "str 'x'", "entry 'b/c'": 'NoneType None'}
    """
    (kind, body), = node.items()
    if kind == "dict":
        return {k: v for key, child in body for k, v in entries(child, keys + (key,)).items()}
    if kind in ("list", "tuple"):
        out = {f"entry {leaf_name(keys)!r}": f"{kind} of {len(body)}"}
        for i, child in enumerate(body):
            out.update(entries(child, keys + (i,)))
        return out
    if kind == "tensor":
        return {}
    value = from_json(node, str)
    return {f"entry {leaf_name(keys)!r}": f"{type(value).__name__} {value!r}"}


# ---------------------------------------------------------------- who holds which slice

def mesh_index(mesh_shape: Shape, coords: Mapping[str, int]) -> int:
    """Row-major position of `coords` in the mesh (a rank of its communicators)."""
    i = 0
    for d in mesh_shape:
        i = i * d.size + coords[d.name]
    return i


def distinct_slices(shape: Shape, mesh_shape: Shape, tl) -> list[tuple[dict, tuple]]:
    """The distinct slices of a tensor: (holder coords, global bounds) in row-major holder order; among
    ranks holding identical replicas, the holder is the one at coordinate 0 of the dims it is not split over."""
    split = [m for m in mesh_shape.names if m in tl]
    out = []
    for pos in np.ndindex(*[mesh_shape[m].size for m in split]):
        coords = {m: 0 for m in mesh_shape.names}
        coords.update(zip(split, pos))
        out.append((coords, slice_bounds(shape, mesh_shape, tl, coords)))
    return out


# ---------------------------------------------------------------- files

def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def make_tmp(mesh, path: str, check: Callable[[str], None], err: Optional[str] = None) -> tuple[str, str]:
    """`(target, tmp)` on every rank: rank 0 checks that `target` (`path`, absolute) may be replaced
    (`check` raises if not) and makes the temporary directory `.<name>.tmp-<random>` beside it. A
    collective; any rank's `err` (or rank 0's failure) raises on every rank before anything is made."""
    info = ""
    if mesh.rank == 0 and err is None:
        try:
            target = os.path.abspath(path)
            parent, base = os.path.split(target)
            check(target)
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, f".{base}.tmp-{secrets.token_hex(8)}")
            os.mkdir(tmp)
            info = json.dumps([target, tmp])
        except Exception as e:  # any error: every rank raises it
            err = f"cannot save checkpoint {path!r}: {reason(e)}"
    sync(mesh, err)
    target, tmp = json.loads(bcast_text(mesh, info, 0))
    return target, tmp


def swap_in(tmp: str, target: str, check: Callable[[str], None]) -> None:
    """Rename `tmp` to `target`; what is there (`check` raises unless it may be replaced) is renamed away
    first, then removed."""
    parent, base = os.path.split(target)
    old = None
    if os.path.lexists(target):
        check(target)
        old = os.path.join(parent, f".{base}.old-{secrets.token_hex(8)}")
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def slow_save_hook(rank: int, target: str) -> None:
    """`MPIMESH_TEST_SLOW_SAVE=SECONDS`: say who is where and sleep, so a test can kill a rank mid-save
    (its files written, the commit not yet made)."""
    seconds = env.number("MPIMESH_TEST_SLOW_SAVE", 0.0, minimum=0.0)
    if seconds > 0:
        sys.stderr.write(f"mpimesh: MPIMESH_TEST_SLOW_SAVE: rank {rank} pid {os.getpid()} sleeps "
                         f"{seconds} s inside the save of {target}\n")  # one write: one line, not interleaved
        sys.stderr.flush()
        time.sleep(seconds)
