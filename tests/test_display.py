"""What a user sees of a tensor: its repr (names, dtype, layout, mesh and the gathered values of a small
tensor) and `mm.visualize` (the grid and the per-rank lines), checked against the global array and
every rank's actual local block, on every mesh shape and many layouts."""
from __future__ import annotations

import re

import numpy as np
import pytest
from mpi4py import MPI

from meshes import Errors, divisible_layouts, global_array, mesh_fixture, spec  # noqa: F401

import mpimesh as mm

pytestmark = pytest.mark.mpi
SHAPE = "a:4;b:6;c:8"
_NUMBER = r"-?\d+\.?\d*(?:e[-+]?\d+)?"


def _values(text: str) -> np.ndarray:
    return np.array([float(v) for v in re.findall(_NUMBER, text)])


def test_repr_shows_names_layout_mesh_and_values(mesh):
    ref = global_array(SHAPE, seed=3).round(3)
    errors = Errors()
    for lay in divisible_layouts(mesh, mm.Shape(SHAPE), limit=8):
        t = mesh.from_numpy(ref, SHAPE, layout=spec(lay))
        head, body = repr(t).split("\n", 1)
        want = ", ".join(f"{k}: {v}" for k, v in lay.items())
        errors.expect(head == f"DistTensor [a:4, b:6, c:8] float32, layout {{{want}}}, mesh {mesh.shape}",
                      f"{lay}: header {head!r}")
        errors.close(f"{lay}: values", _values(body).reshape(ref.shape), ref, rtol=1e-6)
    errors.check()


def test_repr_of_a_large_tensor_gathers_nothing(mesh):
    split = [d.name for d in mesh.shape if d.size > 1]
    big = mesh.ones("a:64;b:64", layout=f"a:{split[0]}" if split else "")
    with mm.profile() as prof:
        text = repr(big)
    assert not [k for k in prof.counters if k != "flops"]
    if split:
        assert text.endswith("(4096 values, not gathered: t.to_numpy() on every rank shows them)"), text
    else:  # replicated: numpy's summary of the local copy
        assert "..." in text and _values(text.split("\n", 1)[1]).min() == 1.0


def _blocks(text: str, names: list[str]) -> dict[int, tuple]:
    """rank -> ((start, stop) per dim) from visualize's per-rank lines."""
    out = {}
    for r, ranges in re.findall(r"^  rank (\d+) \([^)]*\): (.*)$", text, re.M):
        got = dict(re.findall(r"(\w+)\[(\d+:\d+)\]", ranges))
        out[int(r)] = tuple(tuple(map(int, got[n].split(":"))) for n in names)
    return out


def _cells(text: str) -> dict[int, tuple[str, str]]:
    """rank -> (row label, column label) from visualize's grid."""
    lines = text.split("\n")
    grid = [ln for ln in lines[2:] if ln.strip() and not ln.startswith("  rank")]
    header = [] if grid[0].lstrip().startswith("+") else re.split(r"\s{2,}", grid.pop(0).strip())
    out = {}
    for line in grid:
        if line.lstrip().startswith("+"):
            continue
        label, *cells = [p.strip() for p in line.split("|")[:-1]]
        for col, cell in zip(header or [""], cells):
            for r in re.findall(r"\d+", cell):
                out[int(r)] = (label, col)
    return out


def test_visualize_matches_every_ranks_block(mesh):
    ref = global_array(SHAPE, seed=4)
    names = ["a", "b", "c"]
    errors = Errors()
    for lay in divisible_layouts(mesh, mm.Shape(SHAPE), limit=10):
        t = mesh.from_numpy(ref, SHAPE, layout=spec(lay))
        text = mm.visualize(t)
        locals_ = MPI.COMM_WORLD.allgather(t.local)
        blocks, cells = _blocks(text, names), _cells(text)
        errors.expect(sorted(blocks) == list(range(mesh.size)) == sorted(cells), f"{lay}: ranks in\n{text}")
        for r, block in blocks.items():
            held = ref[tuple(slice(a, b) for a, b in block)]
            errors.expect(held.shape == locals_[r].shape and np.array_equal(held, locals_[r]),
                          f"{lay}: rank {r} holds {block}?\n{text}")
            split = [i for i, n in enumerate(names) if n in lay]
            label = lambda axes: " ".join(f"{names[i]}[{block[i][0]}:{block[i][1]}]" for i in axes)  # noqa: E731
            want = (label(split[:1]) or "(not split)", label(split[1:]))
            errors.expect(cells.get(r) == want, f"{lay}: rank {r} in cell {cells.get(r)}, want {want}\n{text}")
    errors.check()
