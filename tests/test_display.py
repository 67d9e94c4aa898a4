"""What a user sees of a tensor: its repr (names, dtype, layout, mesh and the gathered values of a small
tensor) and `mm.visualize` (the grid and the per-rank lines), checked against the global array and
every rank's actual local block, on every mesh shape and many layouts, uneven ones (blocks of unequal
size, some empty) included."""
from __future__ import annotations

import re

import numpy as np
import pytest
from mpi4py import MPI

from meshes import Errors, global_array, layouts, mesh_fixture, spec  # noqa: F401

import mpimesh as mm
from mpimesh.backend import to_host
from mpimesh import counters

pytestmark = pytest.mark.mpi
SHAPE = "a:4;b:6;c:8"
SHAPES = [SHAPE, "a:2;b:5;c:7", "a:3;b:0;c:2"]  # uneven on 2, 3, 4 ranks; empty blocks on 3+ ranks; no values
_NUMBER = r"-?\d+\.?\d*(?:e[-+]?\d+)?"


def _values(text: str) -> np.ndarray:
    return np.array([float(v) for v in re.findall(_NUMBER, text)])


@pytest.mark.parametrize("shape", SHAPES)
def test_repr_shows_names_layout_mesh_and_values(mesh, shape):
    ref = global_array(shape, seed=3).round(3)
    errors = Errors()
    for lay in layouts(mesh, ["a", "b", "c"], limit=12):
        t = mesh.from_numpy(ref, shape, layout=spec(lay))
        head, body = repr(t).split("\n", 1)
        want = ", ".join(f"{k}: {v}" for k, v in lay.items())
        errors.expect(head == f"DistTensor {mm.Shape(shape)} float32, layout {{{want}}}, mesh {mesh.shape}",
                      f"{lay}: header {head!r}")
        errors.close(f"{lay}: values", _values(body).reshape(ref.shape), ref, rtol=1e-6)
    errors.check()


def test_repr_of_a_large_tensor_gathers_nothing(mesh):
    split = [d.name for d in mesh.shape if d.size > 1]
    big = mesh.ones("a:64;b:64", layout=f"a:{split[0]}" if split else "")
    with mm.profile() as prof:
        text = repr(big)
    # (on a GPU the rank's own block comes to the host to be printed: a copy, not a gather)
    assert not {k: v for k, v in counters.traffic(prof.counters).items() if k not in ("d2h", "h2d")}
    if split:
        assert text.endswith("(4096 values, not gathered: t.to_numpy() on every rank shows them)"), text
    else:  # replicated: numpy's summary of the local copy
        assert "..." in text and _values(text.split("\n", 1)[1]).min() == 1.0


def _array_split_block(n: int, k: int, c: int) -> tuple[int, int]:
    """(start, stop) of block `c` of `numpy.array_split(range(n), k)`."""
    sizes = [len(p) for p in np.array_split(np.arange(n), k)]
    return sum(sizes[:c]), sum(sizes[:c + 1])


def _blocks(text: str, names: list[str]) -> dict[int, tuple]:
    """rank -> ((start, stop) per dim) from visualize's per-rank lines."""
    out = {}
    for r, ranges in re.findall(r"^  rank (\d+) \([^)]*\): (.*)$", text, re.M):
        got = dict(re.findall(r"(\w+)\[(\d+:\d+)\]", ranges))
        out[int(r)] = tuple(tuple(map(int, got[n].split(":"))) for n in names)
    return out


def _cells(text: str) -> tuple[dict[int, tuple[str, str]], list[set[int]]]:
    """rank -> (row label, column label) from visualize's grid, and the ranks of each cell."""
    lines = text.split("\n")
    grid = [ln for ln in lines[2:] if ln.strip() and not ln.startswith("  rank")]
    header = [] if grid[0].lstrip().startswith("+") else re.split(r"\s{2,}", grid.pop(0).strip())
    out, groups = {}, []
    for line in grid:
        if line.lstrip().startswith("+"):
            continue
        label, *cells = [p.strip() for p in line.split("|")[:-1]]
        for col, cell in zip(header or [""], cells):
            groups.append({int(r) for r in re.findall(r"\d+", cell)})
            for r in groups[-1]:
                out[int(r)] = (label, col)
    return out, groups


@pytest.mark.parametrize("shape", SHAPES)
def test_visualize_matches_every_ranks_block(mesh, shape):
    ref = global_array(shape, seed=4)
    names = ["a", "b", "c"]
    errors = Errors()
    for lay in layouts(mesh, names, limit=12):
        t = mesh.from_numpy(ref, shape, layout=spec(lay))
        text = mm.visualize(t)
        locals_ = MPI.COMM_WORLD.allgather(to_host(t.local))
        coords = MPI.COMM_WORLD.allgather(mesh.coords)
        blocks, (cells, groups) = _blocks(text, names), _cells(text)
        errors.expect(sorted(blocks) == list(range(mesh.size)) == sorted(cells), f"{lay}: ranks in\n{text}")
        # one cell per distinct block: the ranks that agree on the coords of the split mesh dims
        owners: dict = {}
        for r, c in enumerate(coords):
            owners.setdefault(tuple(c[m] for m in lay.values()), set()).add(r)
        errors.expect(sorted(map(sorted, groups)) == sorted(map(sorted, owners.values())),
                      f"{lay}: cells {groups}, want {list(owners.values())}\n{text}")
        for r, block in blocks.items():
            held = ref[tuple(slice(a, b) for a, b in block)]
            errors.expect(held.shape == locals_[r].shape and np.array_equal(held, locals_[r]),
                          f"{lay}: rank {r} holds {block}?\n{text}")
            want = [_array_split_block(ref.shape[i], mesh.shape[lay[n]].size, coords[r][lay[n]])
                    if n in lay else (0, ref.shape[i]) for i, n in enumerate(names)]
            errors.expect(list(block) == want, f"{lay}: rank {r} shows {block}, numpy.array_split gives {want}")
            empty = re.search(rf"^  rank {r} .*\(empty\)$", text, re.M) is not None
            errors.expect(empty == (held.size == 0), f"{lay}: rank {r} (empty) marker wrong\n{text}")
            split = [i for i, n in enumerate(names) if n in lay]
            label = lambda axes: " ".join(f"{names[i]}[{block[i][0]}:{block[i][1]}]" for i in axes)  # noqa: E731
            want = (label(split[:1]) or "(not split)", label(split[1:]))
            errors.expect(cells.get(r) == want, f"{lay}: rank {r} in cell {cells.get(r)}, want {want}\n{text}")
    errors.check()
