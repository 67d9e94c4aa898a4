"""Mesh shapes and layouts for tests, for whatever number of ranks pytest runs on.

>>> mesh_shapes(4)
['all:4', 'rows:2;cols:2', 'rows:1;cols:2;planes:2']
"""
from __future__ import annotations

import functools
import itertools
from typing import Iterator

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.collectives import guard
from mpimesh.tree import tensors

_SHAPES = {
    1: ["all:1", "rows:1;cols:1", "rows:1;cols:1;planes:1"],
    2: ["all:2", "rows:1;cols:2", "rows:2;cols:1;planes:1"],
    3: ["all:3", "rows:1;cols:3", "rows:3;cols:1;planes:1"],
    4: ["all:4", "rows:2;cols:2", "rows:1;cols:2;planes:2"],
    6: ["all:6", "rows:2;cols:3", "rows:3;cols:1;planes:2"],
    8: ["all:8", "rows:2;cols:4", "rows:2;cols:2;planes:2"],
}


def mesh_shapes(n: int | None = None) -> list[str]:
    """1-D, 2-D and 3-D mesh shapes with `n` (default: all) ranks."""
    n = MPI.COMM_WORLD.Get_size() if n is None else n
    if n in _SHAPES:
        return _SHAPES[n]
    return [f"all:{n}"]


def meshes(layout: str = "") -> Iterator[mm.Mesh]:
    """One mesh per shape of `mesh_shapes()` over COMM_WORLD (the same on every rank)."""
    for shape in mesh_shapes():
        yield mm.Mesh(shape, layout=layout)


def layouts(mesh: mm.Mesh, dims: list[str], limit: int | None = None) -> list[dict]:
    """Every way to put some of `dims` on distinct mesh dims of size > 1 (always including `{}`),
    in a fixed order; `limit` keeps an evenly spread subset."""
    mdims = [d.name for d in mesh.shape if d.size > 1]
    out = []
    for choice in itertools.product([None] + mdims, repeat=len(dims)):
        used = [m for m in choice if m]
        if len(used) == len(set(used)):
            out.append({d: m for d, m in zip(dims, choice) if m})
    if limit and len(out) > limit:
        idx = np.linspace(0, len(out) - 1, limit).round().astype(int)
        out = [out[i] for i in sorted(set(idx))]
    return out


def divisible_layouts(mesh: mm.Mesh, shape: mm.Shape, limit: int | None = None) -> list[dict]:
    """`layouts` restricted to those whose split dims are divisible by their mesh dims."""
    return [lay for lay in layouts(mesh, list(shape.names))
            if all(shape[d].size % mesh.shape[m].size == 0 for d, m in lay.items())][: limit or None]


def global_array(shape: str, seed: int = 0, dtype=np.float32) -> np.ndarray:
    """A reproducible random global array for `shape` (identical on every rank)."""
    s = mm.Shape(shape)
    return np.random.default_rng(seed).standard_normal(s.sizes).astype(dtype)


@functools.lru_cache(maxsize=None)
def get_mesh(shape: str, rules: str = "", transport: str | None = None, backend: str | None = None) -> mm.Mesh:
    """One mesh per (shape, rules, transport, backend) for the session (created in the same order on
    every rank): communicators are a finite resource. `backend="numpy"`: a host mesh also under
    `--backend cupy`, for tests that hand the collectives host arrays."""
    return mm.Mesh(shape, layout=rules, transport=transport, backend=backend)


@pytest.fixture(scope="module", params=mesh_shapes(), name="mesh")
def mesh_fixture(request) -> mm.Mesh:
    """A module-scoped `mesh` fixture over every shape of `mesh_shapes()`; import it into a test module."""
    return get_mesh(request.param)


TRANSPORT_MODES = ["mpi", "staged", "mpi+guard", "staged+timeout"]


def transport_mesh(shape: str, mode: str) -> Iterator[mm.Mesh]:
    """The body of a `mesh` fixture over (shape, mode): `mode` a host transport, plus "+guard" (the SPMD
    check on) or "+timeout" (a 120 s collective time-out); both return to their defaults afterwards.
    A numpy mesh, also under `--backend cupy`: its users hand the collectives host arrays (the GPU
    transports: tests/test_gpu_transports.py)."""
    mesh = get_mesh(shape, "", mode.split("+")[0], "numpy")
    mm.set_spmd_check(mode.endswith("+guard"))
    if "+" in mode:
        mm.set_collective_timeout(120)
    try:
        yield mesh
    finally:
        guard.reset()


def big(mesh: mm.Mesh) -> list[str]:
    """Mesh dims of size > 1, in mesh order."""
    return [d.name for d in mesh.shape if d.size > 1]


def spec(rules: dict) -> str:
    """`{"a": "rows"}` -> `"a:rows"`: layout rules as a string."""
    return ";".join(f"{d}:{m}" for d, m in rules.items())


def expected_local(ref: np.ndarray, names: tuple, layout: dict, mesh: mm.Mesh) -> np.ndarray:
    """This rank's block of the global `ref` under `layout` (independent slice arithmetic)."""
    out = ref
    for axis, name in enumerate(names):
        m = layout.get(name)
        if m:  # block c of numpy.array_split, the contract's cut (blocks may be uneven or empty)
            out = np.array_split(out, mesh.shape[m].size, axis=axis)[mesh.coords[m]]
    return out


def local_size(mesh: mm.Mesh, sizes: dict, layout: dict) -> int:
    """Elements of this rank's block of a tensor with dim `sizes` under `layout` (numpy.array_split
    lengths, independent of mpimesh's arithmetic)."""
    n = 1
    for d, s in sizes.items():
        m = layout.get(d)
        n *= len(np.array_split(np.arange(s), mesh.shape[m].size)[mesh.coords[m]]) if m else s
    return n


def collectives(prof) -> dict:
    """The profile's collective counters (everything but flops, copies and, on a GPU, host-device
    copies: a staged transport's `d2h/<dims>`, `h2d/<dims>`, and constants sent once)."""
    return transfers(prof.transfers)


def transfers(counts: dict) -> dict:
    """`counts` without host-device copies (`d2h`, `h2d`, `d2h/<dims>`, ...)."""
    return {k: v for k, v in counts.items() if k.split("/")[0] not in ("d2h", "h2d")}


class Errors(list):
    """Mismatches collected over a loop, asserted at the end (so every rank runs every collective)."""

    def close(self, what: str, got, want, rtol: float, atol: float = 0.0) -> None:
        try:
            np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=atol)
        except AssertionError as e:
            self.append(f"{what}: {e}")

    def expect(self, cond: bool, what: str) -> None:
        if not cond:
            self.append(what)

    def check(self) -> None:
        assert not self, f"{len(self)} failures:\n" + "\n".join(self[:6])


def adam_mlp_step(opt):
    """The cost tests' training step: a two-layer MLP (`params` w1, w2; `batch` x, y), its mean
    squared error, gradients and `opt`'s update, traced."""
    def step(params, state, batch):
        with mm.trace():
            h = mm.relu(mm.einsum([batch["x"], params["w1"]]))
            loss = mm.reduce_mean(mm.square(mm.einsum([h, params["w2"]]) - batch["y"]))
            grads = dict(zip(params, mm.gradients([loss], list(params.values()))))
            params, state = opt.update(params, grads, state)
        return params, state, loss
    return step


def local_bytes(tree) -> int:
    """The bytes of this rank's blocks of the tensors in `tree`."""
    return sum(t.local.nbytes for t in tensors(tree))
