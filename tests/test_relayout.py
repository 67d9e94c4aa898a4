"""mm.relayout between many pairs of layouts: values unchanged, and the least communication
(slice: nothing; unsplit: one allgather; a mesh dim moving between tensor dims: one alltoall).
Also pure tests of relayout_plan."""
from __future__ import annotations

import functools
import itertools
import os
import sys
from typing import Optional

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import (  # noqa: E402
    big, collectives, divisible_layouts, expected_local, get_mesh, global_array, mesh_shapes)

import mpimesh as mm  # noqa: E402
from mpimesh.backend import to_host  # noqa: E402
from mpimesh.ops.relayout import relayout_plan  # noqa: E402

SHAPES = mesh_shapes()
XSHAPE = "a:8;b:8;c:8"
NAMES = ("a", "b", "c")


def as_tuple(layout: dict, names=NAMES) -> tuple:
    return tuple(layout.get(n) for n in names)


# ------------------------------------------------------------------- an independent cost model

def expected_kinds(src: tuple, dst: tuple, sizes: dict) -> tuple[dict, list]:
    """`({mesh_dim: kind}, cycles)`: the one step each mesh dim of size > 1 needs ("slice",
    "allgather" or "alltoall"), and the cycles of moves (each needs one of its members gathered)."""
    eff = [tuple(m if m and sizes[m] > 1 else None for m in lay) for lay in (src, dst)]
    src, dst = eff
    kinds, moves = {}, {}
    for m in (m for m in sizes if sizes[m] > 1):
        s = src.index(m) if m in src else None
        d = dst.index(m) if m in dst else None
        if s == d:
            continue
        if s is None:
            kinds[m] = "slice"
        elif d is None:
            kinds[m] = "allgather"
        else:
            kinds[m] = "alltoall"
            moves[m] = (s, d)
    cycles, seen = [], set()
    for m in moves:
        if m in seen:
            continue
        chain, cur = [m], m
        while True:
            blocker = src[moves[cur][1]]  # who holds my target axis now
            if blocker is None or blocker not in moves:
                break
            if blocker == m:
                cycles.append(chain)
                seen.update(chain)
                break
            chain.append(blocker)
            cur = blocker
    return kinds, cycles


def simulate(steps: tuple, src: tuple, sizes: dict) -> tuple:
    """Apply plan steps to a layout, asserting each one is legal; the final layout."""
    cur = [m if m and sizes[m] > 1 else None for m in src]
    for step in steps:
        kind, m = step[0], step[1]
        assert sizes[m] > 1, f"step {step} over a size-1 mesh dim"
        if kind == "slice":
            assert cur[step[2]] is None and m not in cur, f"illegal {step} on {cur}"
            cur[step[2]] = m
        elif kind == "allgather":
            assert cur[step[2]] == m, f"illegal {step} on {cur}"
            cur[step[2]] = None
        elif kind == "alltoall":
            _, _, split_axis, concat_axis = step
            assert cur[concat_axis] == m and cur[split_axis] is None, f"illegal {step} on {cur}"
            cur[concat_axis], cur[split_axis] = None, m
        else:
            raise AssertionError(f"unknown step {step}")
    return tuple(cur)


def steps_by_dim(steps: tuple) -> dict:
    out: dict = {}
    for step in steps:
        out.setdefault(step[1], []).append(step[0])
    return out


def check_minimal(by_dim: dict, kinds: dict, cycles: list) -> Optional[str]:
    """None if `by_dim` ({mesh_dim: [kinds of steps]}) is the least communication, else why not."""
    in_cycle = {m: c for c in cycles for m in c}
    for m in set(by_dim) | set(kinds):
        got, want = sorted(by_dim.get(m, [])), kinds.get(m)
        if m in in_cycle:
            if got not in (["alltoall"], ["allgather", "slice"]):
                return f"mesh dim {m} in cycle {in_cycle[m]}: steps {got}"
        elif got != ([want] if want else []):
            return f"mesh dim {m}: steps {got}, want {[want] if want else []}"
    for c in cycles:
        broken = [m for m in c if sorted(by_dim.get(m, [])) == ["allgather", "slice"]]
        if len(broken) != 1:
            return f"cycle {c}: {len(broken)} members gathered, want exactly 1"
    return None


# --------------------------------------------------------------------------------- pure plan tests

PURE_MESH = mm.Shape("x:2;y:2;z:2;u:1")
PURE_SIZES = dict(zip(PURE_MESH.names, PURE_MESH.sizes))
PURE_SHAPE = mm.Shape("a:4;b:4;c:4")


def all_layouts(names, mesh_dims) -> list[tuple]:
    out = []
    for choice in itertools.product([None, *mesh_dims], repeat=len(names)):
        used = [m for m in choice if m]
        if len(used) == len(set(used)):
            out.append(choice)
    return out


def test_plan_simple_cases() -> None:
    p = functools.partial(relayout_plan, PURE_SHAPE, PURE_MESH)
    assert p((None, None, None), ("x", None, None)) == (("slice", "x", 0),)
    assert p(("x", None, None), (None, None, None)) == (("allgather", "x", 0),)
    assert p(("x", None, None), (None, None, "x")) == (("alltoall", "x", 2, 0),)
    assert p(("x", "y", None), ("x", "y", None)) == ()
    assert p(("u", None, None), (None, None, None)) == ()  # size-1 mesh dims split nothing
    assert p((None, None, None), (None, "u", None)) == ()
    assert p(("x", "u", None), (None, "x", None)) == (("alltoall", "x", 1, 0),)
    # a chain: y must leave b before x can arrive there
    assert p(("x", "y", None), (None, "x", "y")) == (("alltoall", "y", 2, 1), ("alltoall", "x", 1, 0))
    # a gather that frees the target dim of a slice comes first
    assert p(("x", None, None), ("y", None, None)) == (("allgather", "x", 0), ("slice", "y", 0))


def test_plan_swap_is_legal_and_cheap() -> None:
    steps = relayout_plan(PURE_SHAPE, PURE_MESH, ("x", "y", None), ("y", "x", None))
    assert simulate(steps, ("x", "y", None), PURE_SIZES) == ("y", "x", None)
    assert check_minimal(steps_by_dim(steps), *expected_kinds(("x", "y", None), ("y", "x", None), PURE_SIZES)) is None
    assert len(steps) == 3 and sorted(s[0] for s in steps) == ["allgather", "alltoall", "slice"]
    steps = relayout_plan(PURE_SHAPE, PURE_MESH, ("x", "y", "z"), ("z", "x", "y"))  # a 3-cycle
    assert simulate(steps, ("x", "y", "z"), PURE_SIZES) == ("z", "x", "y")
    assert sorted(s[0] for s in steps) == ["allgather", "alltoall", "alltoall", "slice"]


def test_plan_every_pair_is_legal_and_minimal() -> None:
    lays = all_layouts(PURE_SHAPE.names, PURE_MESH.names)
    assert len(lays) == 73
    for src in lays:
        for dst in lays:
            steps = relayout_plan(PURE_SHAPE, PURE_MESH, src, dst)
            eff_dst = tuple(m if m and PURE_SIZES[m] > 1 else None for m in dst)
            assert simulate(steps, src, PURE_SIZES) == eff_dst, (src, dst, steps)
            why = check_minimal(steps_by_dim(steps), *expected_kinds(src, dst, PURE_SIZES))
            assert why is None, f"{src} -> {dst}: {steps}: {why}"


# ------------------------------------------------------------------------------------ MPI tests

def run_pair(mesh: mm.Mesh, xa: np.ndarray, src: dict, dst) -> tuple:
    x = mesh.from_numpy(xa, XSHAPE, layout=src)
    with mm.profile() as prof:
        y = mm.relayout(x, dst)
    return x, y, prof


@pytest.mark.parametrize("mshape", SHAPES)
def test_relayout_pairs_values_and_communication(mshape: str) -> None:
    mesh = get_mesh(mshape)
    sizes = dict(zip(mesh.shape.names, mesh.shape.sizes))
    xa = global_array(XSHAPE, 1)
    lays = divisible_layouts(mesh, mm.Shape(XSHAPE))
    if len(lays) > 12:  # an evenly spread subset, always with {} and the fully split ones
        idx = np.linspace(0, len(lays) - 1, 12).round().astype(int)
        lays = [lays[i] for i in sorted(set(idx))]
    errors = []
    for src in lays:
        for dst in lays:
            x, y, prof = run_pair(mesh, xa, src, dst)
            what = f"{src} -> {dst}"
            if y.layout != dst:
                errors.append(f"{what}: layout {y.layout}")
            if not np.array_equal(to_host(y.local), expected_local(xa, NAMES, dst, mesh)):
                errors.append(f"{what}: wrong values")
            got = {k.split("/")[1]: [k.split("/")[0]] * v["calls"] for k, v in collectives(prof).items()}
            kinds, cycles = expected_kinds(as_tuple(src), as_tuple(dst), sizes)
            # slices are not collectives: count them as done wherever expected
            for m, kind in kinds.items():
                if kind == "slice" or m in {c for cyc in cycles for c in cyc} and got.get(m) == ["allgather"]:
                    got.setdefault(m, []).append("slice")
            why = check_minimal(got, kinds, cycles)
            if why:
                errors.append(f"{what}: {why}; counters {collectives(prof)}")
            if not np.array_equal(to_host(x.local), expected_local(xa, NAMES, src, mesh)):
                errors.append(f"{what}: the input changed")
    assert not errors, f"{len(errors)} failures:\n" + "\n".join(errors[:6])


@pytest.mark.parametrize("mshape", SHAPES)
def test_unsplit_to_split_is_local(mshape: str) -> None:
    mesh = get_mesh(mshape)
    xa = global_array(XSHAPE, 2)
    errors = []
    for m in big(mesh):
        for name in NAMES:
            for rest in ({}, {n: o for n, o in zip([n for n in NAMES if n != name], big(mesh)) if o != m}):
                x, y, prof = run_pair(mesh, xa, rest, {**rest, name: m})
                if prof.counters:
                    errors.append(f"{rest} -> +{name}:{m}: {prof.counters}")
                if not np.array_equal(to_host(y.local), expected_local(xa, NAMES, {**rest, name: m}, mesh)):
                    errors.append(f"{rest} -> +{name}:{m}: wrong values")
    assert not errors, "\n".join(errors[:6])


@pytest.mark.parametrize("mshape", SHAPES)
def test_split_to_unsplit_is_one_allgather(mshape: str) -> None:
    mesh = get_mesh(mshape)
    xa = global_array(XSHAPE, 3)
    errors = []
    for m in big(mesh):
        others = [o for o in big(mesh) if o != m]
        for name in NAMES:
            keep = {n: o for n, o in zip([n for n in NAMES if n != name], others)}
            x, y, prof = run_pair(mesh, xa, {**keep, name: m}, keep)
            n_local = x.local.size
            want = {f"allgather/{m}": {"calls": 1, "elements": n_local, "bytes": 4 * n_local}}
            if collectives(prof) != want:
                errors.append(f"{name}:{m} -> unsplit (keep {keep}): {collectives(prof)} != {want}")
            if not np.array_equal(to_host(y.local), expected_local(xa, NAMES, keep, mesh)):
                errors.append(f"{name}:{m} -> unsplit (keep {keep}): wrong values")
    y = run_pair(mesh, xa, dict(zip(NAMES, big(mesh))), {})[1]
    assert not errors, "\n".join(errors[:6])
    np.testing.assert_array_equal(to_host(y.local), xa)
    np.testing.assert_array_equal(y.to_numpy(), xa)


@pytest.mark.parametrize("mshape", SHAPES)
def test_move_between_tensor_dims_is_one_alltoall(mshape: str) -> None:
    mesh = get_mesh(mshape)
    xa = global_array(XSHAPE, 4)
    errors = []
    for m in big(mesh):
        others = [o for o in big(mesh) if o != m]
        for a, b in itertools.permutations(NAMES, 2):
            c = next(n for n in NAMES if n not in (a, b))
            for keep in ({}, {c: others[0]} if others else {}):
                x, y, prof = run_pair(mesh, xa, {a: m, **keep}, {b: m, **keep})
                n_local = x.local.size
                want = {f"alltoall/{m}": {"calls": 1, "elements": n_local, "bytes": 4 * n_local}}
                what = f"{a}:{m} -> {b}:{m} (keep {keep})"
                if collectives(prof) != want:
                    errors.append(f"{what}: {collectives(prof)} != {want}")
                if not np.array_equal(to_host(y.local), expected_local(xa, NAMES, {b: m, **keep}, mesh)):
                    errors.append(f"{what}: wrong values")
    assert not errors, "\n".join(errors[:6])


@pytest.mark.parametrize("mshape", SHAPES)
def test_swap(mshape: str) -> None:
    mesh = get_mesh(mshape)
    bd = big(mesh)
    if len(bd) < 2:
        pytest.skip("needs two mesh dims of size > 1")
    xa = global_array(XSHAPE, 5)
    r, c = bd[0], bd[1]
    x, y, prof = run_pair(mesh, xa, {"a": r, "b": c}, {"a": c, "b": r})
    assert y.layout == {"a": c, "b": r}
    np.testing.assert_array_equal(to_host(y.local), expected_local(xa, NAMES, {"a": c, "b": r}, mesh))
    calls = {k: v["calls"] for k, v in collectives(prof).items()}
    assert sum(calls.values()) == 2 and sorted(k.split("/")[0] for k in calls) == ["allgather", "alltoall"]
    assert {k.split("/")[1] for k in calls} == {r, c}
    np.testing.assert_array_equal(y.to_numpy(), xa)


@pytest.mark.parametrize("mshape", SHAPES)
def test_layout_spellings_and_noops(mshape: str) -> None:
    mesh = get_mesh(mshape)
    bd = big(mesh)
    xa = global_array(XSHAPE, 6, np.float64)
    x = mesh.from_numpy(xa, XSHAPE, layout={})
    target = dict(zip(("c", "a"), bd))
    spellings = [";".join(f"{k}:{v}" for k, v in target.items()), list(target.items()), target,
                 mm.LayoutRules(list(target.items()))]
    for spec in spellings:
        y = mm.relayout(x, spec)
        assert y.layout == target and y.dtype == np.float64
        np.testing.assert_array_equal(to_host(y.local), expected_local(xa, NAMES, target, mesh))
    y = mm.relayout(x, target)
    with mm.profile() as prof:
        z = mm.relayout(y, target)  # already laid out so: nothing happens
    assert collectives(prof) == {}
    np.testing.assert_array_equal(to_host(z.local), to_host(y.local))
    ones = [d.name for d in mesh.shape if d.size == 1]
    if ones:  # a size-1 mesh dim splits nothing: moving off it costs nothing
        w = mesh.from_numpy(xa, XSHAPE, layout={"b": ones[0]})
        with mm.profile() as prof:
            v = mm.relayout(w, {})
        assert collectives(prof) == {} and v.layout == {}
        np.testing.assert_array_equal(to_host(v.local), xa)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64, np.float16])
def test_relayout_dtypes(dtype) -> None:
    mesh = get_mesh(SHAPES[-1])
    bd = big(mesh)
    xa = (np.arange(8 * 8 * 8).reshape(8, 8, 8) % 7).astype(dtype)
    src, dst = dict(zip(NAMES, bd)), dict(zip(NAMES[::-1], bd))
    x = mesh.from_numpy(xa, XSHAPE, layout=src)
    y = mm.relayout(mm.relayout(x, dst), {})
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(to_host(y.local), xa)


def test_bad_layouts_raise() -> None:
    mesh = get_mesh(SHAPES[-1])
    x = mesh.ones("a:8;b:8;c:3")
    m = mesh.shape.names[0]
    with pytest.raises(mm.LayoutError, match="nowhere"):
        mm.relayout(x, "a:nowhere")
    with pytest.raises(mm.LayoutError, match="z"):
        mm.relayout(x, f"z:{m}")
    with pytest.raises((mm.LayoutError, ValueError)):
        mm.relayout(x, [("a", m), ("b", m)])
    if any(d.size > 1 and 3 % d.size for d in mesh.shape):  # uneven blocks are not an error (wave 2)
        odd = next(d for d in mesh.shape if d.size > 1 and 3 % d.size)
        y = mm.relayout(x, f"c:{odd.name}")
        assert y.local.shape[2] == len(np.array_split(range(3), odd.size)[mesh.coords[odd.name]])
