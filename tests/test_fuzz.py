"""Fuzzing every parser and constructor with random strings and structures (hypothesis).

The contract under test ("never a silent hang"): whatever a user passes as a shape, dims, layout
rules, mesh shape, global array, dtype, fill value or op argument, the call either succeeds (and
then gives the right values) or raises an `mm.MpimeshError` subclass, on every rank alike, before
any communication. Any other exception (TypeError, KeyError, IndexError, numpy's errors...) fails.

How the ranks stay in step: every rank draws the same examples (derandomized hypothesis, no
example database), which `_run` checks by gathering each rank's example (its repr) and outcome
(kind, exception class, message) with `MPI.allgather` and asserting that they are identical.
Every rank evaluates the same assertion on the same gathered list, so a failure fails every rank
on the same example and hypothesis shrinks in lockstep. An error raised after communicating (a
profile open around the call counted a collective) also fails.

Where a precise reference is cheap, it decides what must happen: the shape and rules strings
against a small independent parser, mesh shapes against the rank count, dtypes against numpy,
einsum output shapes against the inputs, and successes are checked against numpy (or, for random
values and convolutions, against the same call on a one-rank mesh).

The number of examples run per parser is counted and printed by the last test of this module.
"""
from __future__ import annotations

import collections
import math
import os
import re
import sys
import traceback
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from meshes import get_mesh, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.backend import is_float, to_host

WORLD = MPI.COMM_WORLD
NRANKS = WORLD.Get_size()
# Examples per parser: a few hundred on one rank, fewer where 2-8 ranks share the machine's cores.
# MPIMESH_FUZZ_EXAMPLES=N runs N per parser (and N/8 per op) for a deeper search.
EXAMPLES = int(os.environ.get("MPIMESH_FUZZ_EXAMPLES", 0)) or {1: 200, 2: 80, 4: 40}.get(NRANKS, 20)
OP_EXAMPLES = max(EXAMPLES // 8, 8)  # per op of the op-argument fuzz (22 ops)

FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck), print_blob=False)
FUZZ_OPS = settings(FUZZ, max_examples=OP_EXAMPLES)

CASES: collections.Counter = collections.Counter()   # parser -> examples run
ERRORS: collections.Counter = collections.Counter()  # parser -> examples that raised an MpimeshError


# ------------------------------------------------------------------------------------ the harness

def _run(parser: str, example, fn: Callable[[], object], must_raise: Optional[bool] = None) -> object:
    """Run `fn()` on every rank and check the contract (see the module docstring).

    `must_raise`: True/False when a reference says whether the input is invalid (None: unknown).
    Returns `fn()`'s result, or None when it raised."""
    CASES[parser] += 1
    result = None
    with mm.profile() as prof:
        try:
            result = fn()
            kind, cls, msg = "ok", "", ""
        except mm.MpimeshError as e:
            kind, cls, msg = "error", type(e).__name__, str(e)
        except Exception as e:  # noqa: BLE001 - anything else is the failure this test looks for
            kind, cls, msg = "OTHER", type(e).__name__, "".join(traceback.format_exception(e))
    talked = kind == "error" and bool(prof.counters)
    mine = (repr(example), kind, cls, msg, talked)
    everyone = WORLD.allgather(mine)
    problems = []
    if len({r[0] for r in everyone}) > 1:
        problems.append(f"the ranks drew different examples: {[r[0] for r in everyone]}")
    if len({r[1:] for r in everyone}) > 1:
        problems.append("the ranks disagree: " + "; ".join(f"rank {i}: {r[1]} {r[2]} {r[3][:300]}"
                                                           for i, r in enumerate(everyone)))
    for i, r in enumerate(everyone):
        if r[1] == "OTHER":
            problems.append(f"rank {i} raised {r[2]}, not an MpimeshError:\n{r[3]}")
            break
    if any(r[4] for r in everyone):
        problems.append(f"{cls} raised after communicating: {msg}")
    if must_raise is True and kind == "ok":
        problems.append("accepted an input the reference says is invalid")
    if must_raise is False and kind == "error":
        problems.append(f"rejected an input the reference says is valid: {cls}: {msg}")
    assert not problems, f"{parser}({example!r}):\n" + "\n".join(problems)
    if kind == "error":
        ERRORS[parser] += 1
    return result


def _close(got, want, what: str = "") -> None:
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype == bool or want.dtype == bool:
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=what)


@lru_cache(maxsize=None)
def _self_mesh(shape: str) -> mm.Mesh:
    """A one-rank mesh over COMM_SELF with the same mesh dim names (all of size 1)."""
    return mm.Mesh(";".join(f"{d.name}:1" for d in mm.Shape(shape)), comm=MPI.COMM_SELF)


def _free(mesh: mm.Mesh) -> None:
    """Give back a throw-away mesh's communicators (a session has a limited number)."""
    for comm in {id(c): c for c in [mesh._guard_comm, mesh._cart, *mesh._subcomms.values()]}.values():
        comm.Free()


# -------------------------------------------------------------------- references for the strings

_SEP = re.compile(r"[;,\s]+")
_NAME = r"[^:;,\s]+"
_PAIR = re.compile(rf"({_NAME}):({_NAME})")


def _ref_pairs(text: str, value: str) -> Optional[list]:
    """An independent reading of `"a:x;b:y"`: the (name, value) pairs, or None if malformed."""
    pairs = []
    for item in _SEP.split(text.strip()):
        if not item:
            continue
        m = _PAIR.fullmatch(item)
        if not m or not re.fullmatch(value, m.group(2)):
            return None
        pairs.append((m.group(1), m.group(2)))
    return pairs


def _ref_shape(text: str) -> Optional[list]:
    """The dims of a shape string, or None if it is invalid (malformed or a repeated name)."""
    t = text.strip()
    if t.startswith("[") and t.endswith("]"):
        t = t[1:-1]
    pairs = _ref_pairs(t, "[0-9]+")
    if pairs is None or len({n for n, _ in pairs}) != len(pairs):
        return None
    return [(n, int(s)) for n, s in pairs]


def _ref_rules(text: str) -> Optional[dict]:
    """The rules of a rules string, or None if invalid (malformed or a dim mapped twice)."""
    pairs = _ref_pairs(text, _NAME)
    if pairs is None:
        return None
    out: dict = {}
    for t, m in pairs:
        if out.setdefault(t, m) != m:
            return None
    return out


def _name_ok(n) -> bool:
    return isinstance(n, str) and bool(re.fullmatch(_NAME, n))


# ------------------------------------------------------------------------------------- strategies

def half(valid, other):
    """`valid` for about half the examples, `other` for the rest (a nested `st.one_of` would be
    flattened into one choice among all its branches)."""
    return st.booleans().flatmap(lambda ok: valid if ok else other)


NAMES = st.sampled_from(["a", "b", "c", "rows", "cols", "planes", "all", "x"])
ODD_NAMES = st.one_of(NAMES, st.text(alphabet="ab :;,[]\t-_", max_size=4), st.integers(-1, 3), st.none(),
                      st.just(b"a"), st.booleans())
SIZES = st.one_of(st.integers(0, 9), st.integers(-3, -1), st.integers(), st.floats(), st.booleans(), st.none(),
                  st.sampled_from(["4", "04", " 4", "+4", "4.0", "", "x", "\u0664", "1_0"]),
                  st.complex_numbers(max_magnitude=10), st.just(np.int64(4)), st.just(np.float64(2.0)),
                  st.just(np.bool_(True)), st.just(4.0))
SCALAR_JUNK = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6),
                        st.binary(max_size=4), st.complex_numbers(max_magnitude=1e3))
DIM_LIKE = st.one_of(st.builds(mm.Dimension, ODD_NAMES, SIZES), st.tuples(ODD_NAMES, SIZES),
                     st.lists(st.one_of(ODD_NAMES, SIZES), max_size=3), ODD_NAMES, SIZES)
SPEC_TEXT = st.text(alphabet="abcx0123456789:;, -[]\t.+_", max_size=24)


def shape_strings(names=NAMES, sizes=st.integers(0, 9)):
    """Mostly well-formed `name:size` lists with random separators (repeats and odd sizes too)."""
    item = st.tuples(names, st.one_of(sizes, SIZES), st.sampled_from([";", ",", " ", "; ", ";;", "\t", ":"]))
    text = st.lists(item, max_size=4).map(lambda items: "".join(f"{n}:{z}{sep}" for n, z, sep in items))
    return st.tuples(text, st.sampled_from(["{}", "[{}]", " {} "])).map(lambda t: t[1].format(t[0]))


VALID_SHAPES = st.lists(st.tuples(NAMES, st.integers(0, 9)), max_size=4, unique_by=lambda d: d[0]).flatmap(
    lambda ds: st.sampled_from([";".join(f"{n}:{z}" for n, z in ds), " ".join(f"{n}:{z}" for n, z in ds),
                                f"[{', '.join(f'{n}:{z}' for n, z in ds)}]", ds, [mm.Dimension(*d) for d in ds]]))
SHAPE_SPECS = half(VALID_SHAPES, st.one_of(shape_strings(), SPEC_TEXT, st.text(max_size=8),
                                           st.lists(DIM_LIKE, max_size=4), st.tuples(DIM_LIKE, DIM_LIKE), SCALAR_JUNK,
                                           st.dictionaries(NAMES, SIZES, max_size=2)))


@lru_cache(maxsize=None)  # building strategies is slow; each is built once
def rules_strategy(mesh_names=("rows", "cols", "all", "nope")):
    names = st.one_of(NAMES, st.sampled_from(list(mesh_names)))
    pairs = st.tuples(names, names)
    odd_pairs = st.one_of(pairs, st.tuples(ODD_NAMES, ODD_NAMES), st.lists(names, max_size=3), names,
                          st.tuples(names, st.none()))
    text = st.builds(lambda ps, sep: sep.join(f"{t}:{m}" for t, m in ps), st.lists(pairs, max_size=3),
                     st.sampled_from([";", ",", " ", ";;", ": "]))
    tdims = st.sampled_from(["a", "b", "c"])
    plain = st.dictionaries(tdims, st.sampled_from(list(mesh_names)), max_size=3)  # well-formed rules
    well_formed = st.one_of(plain, plain.map(lambda d: ";".join(f"{t}:{m}" for t, m in d.items())),
                            plain.map(lambda d: list(d.items())))
    return half(well_formed, st.one_of(
        text, SPEC_TEXT, st.lists(odd_pairs, max_size=3), st.lists(pairs, max_size=3),
        st.dictionaries(names, st.one_of(names, st.none(), st.integers(0, 2)), max_size=3),
        SCALAR_JUNK, st.tuples(st.one_of(st.none(), names), st.one_of(st.none(), names))))


MESH_SHAPE = st.sampled_from(mesh_shapes())


# ------------------------------------------------------------------------------- Shape and dims

@pytest.mark.mpi
@FUZZ
@given(spec=SHAPE_SPECS)
def test_fuzz_shape(spec) -> None:
    """`mm.Shape(spec)`: strings are checked against an independent parser; an accepted shape has
    valid distinct names, non-negative int sizes, and survives `Shape(str(s))`."""
    must = None
    if isinstance(spec, str):
        ref = _ref_shape(spec)
        must = ref is None

    def fn():
        s = mm.Shape(spec)
        assert all(_name_ok(n) for n in s.names), s.names
        assert len(set(s.names)) == s.rank
        assert all(type(z) is int and z >= 0 for z in s.sizes), s.sizes
        assert s.size == math.prod(s.sizes)
        assert mm.Shape(str(s)) == s and mm.Shape(list(s)) == s
        if isinstance(spec, str):
            assert list(zip(s.names, s.sizes)) == ref, (s, ref)
        return s
    _run("Shape", spec, fn, must)


def _ref_size(z) -> Optional[int]:
    """A dim size as the contract reads it (a non-negative int, an integral float, a digit string)."""
    if isinstance(z, (bool, np.bool_)):
        return None
    if isinstance(z, (int, np.integer)):
        return int(z) if z >= 0 else None
    if isinstance(z, (float, np.floating)):
        return int(z) if math.isfinite(z) and float(z).is_integer() and z >= 0 else None
    if isinstance(z, str):
        return int(z) if re.fullmatch("[0-9]+", z) else None
    return None


def _ref_dims(spec) -> Optional[list]:
    """The (name, size or None) pairs a dim-names argument denotes, or None if it denotes none."""
    def one(d):
        if isinstance(d, str):
            return (d, None) if ":" not in d else None
        if isinstance(d, (tuple, list)) and len(d) == 2 and _name_ok(d[0]) and _ref_size(d[1]) is not None:
            return d[0], _ref_size(d[1])
        return None
    if isinstance(spec, str):
        if ":" in spec:
            dims = _ref_shape(spec)
            return None if dims is None else [(n, z) for n, z in dims]
        return [(spec, None)]
    if isinstance(spec, mm.Dimension):
        return [one(spec)] if one(spec) else None
    if isinstance(spec, (list, tuple)):
        dims = [one(d) for d in spec]
        return None if any(d is None for d in dims) else dims
    return None


@pytest.mark.mpi
@FUZZ
@given(mesh_shape=MESH_SHAPE, spec=half(
    st.sampled_from(["a", "c", ["a", "b"], "b:16", mm.Dimension("c", 2), ("a", 8), ["c"], "a:8;c:2", [],
                     ["b", ("c", 2)], "a:8 b:16", ["c", "a", "b"]]),
    st.one_of(st.sampled_from(["b:9", ("a", 3), ["a", "a"], "z", ["a", "a:4"]]), NAMES,
              st.lists(st.one_of(NAMES, DIM_LIKE), max_size=3),
              shape_strings(sizes=st.sampled_from([8, 16, 2, 3])),
              DIM_LIKE, SCALAR_JUNK)),
       which=st.sampled_from(["reduce_sum", "reduce_max", "softmax", "einsum", "reduce_mean"]),
       lay=st.sampled_from([{}, {"a": 0}, {"b": 0}, {"a": 0, "b": 1}, {"b": -1}]))
def test_fuzz_reduced_dims(mesh_shape, spec, which, lay) -> None:
    """Dim-name arguments (`reduced_dim`, `reduced_dims`) of reductions, einsum and softmax, over
    an input split by a random layout: valid exactly when they name distinct dims of the input
    (with its sizes, where a size is given); then the result is numpy's, over exactly those dims."""
    mesh = get_mesh(mesh_shape)
    big = [d.name for d in mesh.shape if d.size > 1]
    layout = {d: big[k] for d, k in lay.items() if big and (len(lay) == 1 or len(big) > 1)}
    g = np.arange(8 * 16 * 2, dtype=np.float64).reshape(8, 16, 2) / 50.0
    x = mesh.from_numpy(g, "a:8;b:16;c:2", layout=layout)
    sizes = {"a": 8, "b": 16, "c": 2}
    if spec is None:  # the default: reductions reduce everything, einsum keeps everything
        dims, valid = {"softmax": None, "einsum": []}.get(which, list(sizes.items())), which != "softmax"
    else:
        dims = _ref_dims(spec)
        valid = dims is not None and len({n for n, _ in dims}) == len(dims) and all(
            n in sizes and z in (None, sizes[n]) for n, z in dims) and (which != "softmax" or bool(dims))
    axes = tuple("abc".index(n) for n, _ in dims) if valid else ()

    def fn():
        if which == "softmax":
            y = mm.softmax(x, spec)
            e = np.exp(g - g.max(axis=axes, keepdims=True))
            want = e / e.sum(axis=axes, keepdims=True)
        else:
            y = mm.einsum([x], reduced_dims=spec) if which == "einsum" else getattr(mm, which)(x, reduced_dims=spec)
            want = {"reduce_sum": np.sum, "einsum": np.sum, "reduce_max": np.max,
                    "reduce_mean": np.mean}[which](g, axis=axes)
        _close(y.to_numpy(), want)
    _run(f"dim names ({which})", (mesh_shape, spec, layout), fn, not valid)


# --------------------------------------------------------------------------------- layout rules

@pytest.mark.mpi
@FUZZ
@given(mesh_shape=MESH_SHAPE, spec=rules_strategy())
def test_fuzz_layout_rules(mesh_shape, spec) -> None:
    """`mm.LayoutRules(spec)` and `mm.layout_scope(mesh, spec)`: strings against the reference
    parser; accepted rules survive `LayoutRules(str(r))`, and a scope accepts exactly the rules
    whose mesh dims the mesh has."""
    mesh = get_mesh(mesh_shape)
    must = None
    if isinstance(spec, str):
        ref = _ref_rules(spec)
        must = ref is None

    def parse():
        r = mm.LayoutRules(spec)
        assert all(_name_ok(t) and _name_ok(m) for t, m in r.pairs), r.pairs
        assert mm.LayoutRules(str(r)) == r and mm.LayoutRules(r.pairs) == r
        if isinstance(spec, str):
            assert dict(r.pairs) == ref, (r, ref)
        return r
    rules = _run("LayoutRules", spec, parse, must)

    def scope():
        with mm.layout_scope(mesh, spec) as r:
            assert mesh.layout == r
            for t in "abc":  # one dim at a time: rules may put several tensor dims on one mesh dim
                assert mesh.tensor_layout(f"{t}:8") == ({t: r.mesh_dim(t)} if r.mesh_dim(t) else {})
        assert mesh.layout == mesh.rules
    known = None if rules is None else all(m in mesh.shape for _, m in rules.pairs)
    _run("layout_scope", spec, scope, None if rules is None else not known)


@pytest.mark.mpi
@FUZZ
@given(mesh_shape=MESH_SHAPE, spec=rules_strategy(("rows", "cols", "planes", "all", "nope")))
def test_fuzz_mesh_layout(mesh_shape, spec) -> None:
    """`mm.Mesh(shape, layout=spec)` accepts exactly the rules `layout_scope` accepts."""
    mesh = get_mesh(mesh_shape)
    try:
        with mm.layout_scope(mesh, spec):
            pass
        valid = True
    except mm.MpimeshError:
        valid = False

    def fn():
        m = mm.Mesh(mesh_shape, layout=spec)
        try:
            assert m.layout == mm.LayoutRules(spec) and m.shape == mesh.shape and m.coords == mesh.coords
        finally:
            _free(m)
    _run("Mesh(layout=)", spec, fn, not valid)


# ----------------------------------------------------------------------------------- mesh shapes

def mesh_specs():
    """Mesh shapes near the rank count: right and wrong products, zero and negative sizes, repeated
    and bad names, non-strings."""
    n = NRANKS
    sizes = st.one_of(st.sampled_from([d for d in (1, 2, 4, 8) if n % d == 0] + [0, 3, n, 2 * n]),
                      st.integers(-2, 2 * n), SIZES)
    dims = st.lists(st.tuples(st.one_of(NAMES, ODD_NAMES), sizes), max_size=4)
    factors = [f for f in ([n], [1, n], [2, n // 2], [n // 2, 2], [1, 1, n], [2, 2, n // 4], [n, 1, 1]) if
               math.prod(f) == n and min(f) >= 1]  # the right product
    right = st.tuples(st.sampled_from(factors), st.permutations(["rows", "cols", "planes"])).map(
        lambda t: ";".join(f"{m}:{z}" for m, z in zip(t[1], t[0])))
    return half(st.one_of(right, right.map(lambda text: text.replace(";", " "))),
                st.one_of(dims.map(lambda ds: ";".join(f"{a}:{b}" for a, b in ds)), dims, SPEC_TEXT, SCALAR_JUNK))


@pytest.mark.mpi
@FUZZ
@given(spec=mesh_specs())
def test_fuzz_mesh_shape(spec) -> None:
    """`mm.Mesh(spec)` over COMM_WORLD: valid iff the spec is a valid shape whose sizes are >= 1
    and multiply to the rank count; an accepted mesh has row-major coordinates."""
    try:
        shape = mm.Shape(spec)
        valid = shape.size == NRANKS and all(s >= 1 for s in shape.sizes)
    except mm.ShapeError:
        valid = False

    def fn():
        m = mm.Mesh(spec)
        try:
            assert m.shape == mm.Shape(spec) and m.size == NRANKS and m.rank == WORLD.Get_rank()
            flat = 0
            for d in m.shape:
                assert 0 <= m.coords[d.name] < d.size
                flat = flat * d.size + m.coords[d.name]
            assert flat == m.rank
        finally:
            _free(m)
    _run("Mesh(shape)", spec, fn, not valid)


# ------------------------------------------------------------------------------------ from_numpy

_LAYOUT_SPECS = {
    shape: st.one_of(st.none(), rules_strategy(tuple(mm.Shape(shape).names) + ("nope",)),
                     st.dictionaries(st.sampled_from(["a", "b", "c", "z"]), st.sampled_from(mm.Shape(shape).names),
                                     max_size=2))
    for shape in mesh_shapes()}
_SMALL, _BUMP = st.integers(0, 3), st.sampled_from([-1, 1, 4])
_HOW = st.sampled_from(["same", "same", "grow", "extra", "drop", "swap"])
_KIND = st.sampled_from(["array", "array", "array", "list", "ragged", "junk", "strings", "objects"])
_DECLARED = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from([0, 1, 2, 3, 4, 8])), max_size=3)


@st.composite
def from_numpy_cases(draw):
    """A global array, a declared shape that may not match it, and a layout spec."""
    mesh_shape = draw(MESH_SHAPE)
    declared = draw(_DECLARED)
    sizes = [z for _, z in declared]
    how = draw(_HOW)
    if how == "grow" and declared:
        i = draw(_SMALL) % len(declared)
        declared[i] = (declared[i][0], declared[i][1] + draw(_BUMP))
    elif how == "extra":
        declared.append(("z", draw(_SMALL)))
    elif how == "drop" and declared:
        declared.pop()
    elif how == "swap":
        declared.reverse()
    kind = draw(_KIND)
    if kind == "array":
        array = np.arange(math.prod(sizes), dtype=np.float64).reshape(sizes)
    elif kind == "list":
        array = np.arange(math.prod(sizes), dtype=np.int64).reshape(sizes).tolist()
    elif kind == "ragged":
        array = [[1.0, 2.0], [3.0]]
    elif kind == "strings":
        array = np.full(sizes, "s")
    elif kind == "objects":
        array = np.full(sizes, None, dtype=object)
    else:
        array = draw(SCALAR_JUNK)
    if draw(st.booleans()):  # a layout over the declared dims, on distinct mesh dims
        mdims = draw(st.permutations(mm.Shape(mesh_shape).names))
        layout = {n: m for (n, _), m, on in zip(declared, mdims, draw(st.lists(st.booleans(), min_size=3,
                                                                                max_size=3))) if on}
    else:
        layout = draw(_LAYOUT_SPECS[mesh_shape])
    return mesh_shape, kind, array, declared, layout


@pytest.mark.mpi
@FUZZ
@given(case=from_numpy_cases())
def test_fuzz_from_numpy(case) -> None:
    """`mesh.from_numpy(array, shape, layout)`: a global shape that differs from the array's is a
    ShapeError; an accepted tensor holds this rank's block and gives the array back."""
    mesh_shape, kind, array, declared, layout = case
    mesh = get_mesh(mesh_shape)
    try:
        mismatch = np.shape(array) != mm.Shape(declared).sizes
    except (mm.ShapeError, ValueError):  # a repeated name; a ragged list
        mismatch = None

    def fn():
        t = mesh.from_numpy(array, declared, layout=layout)
        g = np.asarray(array)
        assert t.shape == mm.Shape(declared) and t.dtype == g.dtype.newbyteorder("=")
        if isinstance(layout, tuple) and len(layout) == t.shape.rank and all(
                v is None or isinstance(v, str) for v in layout):
            want = {n: m for n, m in zip(t.shape.names, layout) if m is not None}
        else:
            want = dict(mm.LayoutRules(layout).pairs)
        assert t.layout == want, (t.layout, want)
        index = []
        for d in t.shape:  # this rank's block: numpy.array_split's cut, independently of the library
            m = t.layout.get(d.name)
            part = np.array_split(np.arange(d.size), mesh.shape[m].size)[mesh.coords[m]] if m else np.arange(d.size)
            index.append(slice(part[0], part[-1] + 1) if len(part) else slice(0, 0))
        np.testing.assert_array_equal(to_host(t.local), g[tuple(index)])
        np.testing.assert_array_equal(t.to_numpy(), g)
    bad_dtype = kind in ("strings", "objects")
    _run("from_numpy", case, fn, True if mismatch or (bad_dtype and mismatch is False) else None)


# ----------------------------------------------------------------------------------------- dtypes

DTYPE_SPECS = half(
    st.sampled_from(["float32", "float64", "int32", "int8", "uint8", "bool", "complex64", "float16", "f8", "<f4",
                     np.float64, np.dtype("int16"), ">f8"]),
    st.one_of(st.sampled_from(["float32", "float64", "float", "f4", "<f8", ">i2", "int8", "int", "uint64", "bool",
                               "?", "complex64", "float16", "bfloat16", "object", "O", "U3", "S2", "V4", "datetime64",
                               "m8[s]", "f4,f4", "(2,)f4", "", "flaot32", "float32 ", "Float32", "i4,", "c16", "half"]),
              st.sampled_from([np.float32, np.int8, np.bool_, float, int, bool, complex, str, bytes, object,
                               np.dtype("float64"), np.dtype("U2"), [("a", "f4")]]),
              st.text(alphabet="fiucbOUSVMm?<>|0123468,()[]", max_size=5),
              SCALAR_JUNK))


def _ref_dtype(spec) -> Optional[np.dtype]:
    """The dtype a tensor gets for `spec`, or None if it must be refused."""
    if spec is None:
        return None
    try:
        dt = np.dtype(spec)
    except Exception:  # noqa: BLE001 - whatever numpy refuses
        return None
    ok = (dt.kind in "biufc" or dt == np.dtype(ml_dtypes.bfloat16)) and dt.fields is None and dt.subdtype is None
    return dt.newbyteorder("=") if ok else None  # tensors hold native byte order ('>i2' is int16)


@pytest.mark.mpi
@FUZZ
@given(mesh_shape=MESH_SHAPE, spec=DTYPE_SPECS,
       which=st.sampled_from(["zeros", "ones", "cast", "random_normal", "random_uniform", "range", "one_hot"]))
def test_fuzz_dtype(mesh_shape, spec, which) -> None:
    """Every `dtype=` argument: accepted exactly when numpy reads it as a bool, integer, float
    (bfloat16 included) or complex dtype; the tensor then has that dtype and the right values."""
    mesh = get_mesh(mesh_shape)
    want = _ref_dtype(spec)

    def fn():
        if which in ("zeros", "ones"):
            t = getattr(mesh, which)("a:8;b:2", dtype=spec)
            ref = np.full((8, 2), 0 if which == "zeros" else 1, want)
        elif which == "cast":
            g = np.linspace(0, 3, 16).reshape(8, 2)
            t = mm.cast(mesh.from_numpy(g, "a:8;b:2"), spec)
            ref = g.astype(want)
        elif which == "range":
            t = mm.range(mesh, mm.Dimension("a", 8), dtype=spec)
            ref = np.arange(8, dtype=want)
        elif which == "one_hot":
            i = mesh.from_numpy(np.array([3, 0, 7, 9, 1, 2, 5, 6], np.int32), "a:8")
            t = mm.one_hot(i, mm.Dimension("v", 8), dtype=spec)
            ref = (np.array([3, 0, 7, 9, 1, 2, 5, 6])[:, None] == np.arange(8)).astype(want)
        else:
            t = getattr(mesh, which)("a:8;b:2", seed=5, dtype=spec)
            ref = getattr(_self_mesh(mesh_shape), which)("a:8;b:2", seed=5, dtype=spec).to_numpy()
        assert t.dtype == want, (t.dtype, want)
        got = t.to_numpy()
        assert got.dtype == want
        np.testing.assert_array_equal(got, ref)
    # Refused besides: a bool range (it cannot count 0..7), bool uniforms (no range to draw from), and
    # normal values of anything but floats and complex numbers.
    must = (want is None or (which in ("range", "random_uniform") and want.kind == "b")
            or (which == "random_normal" and not (is_float(want) or want.kind == "c")))
    _run(f"dtype ({which})", spec, fn, must)


FILL_VALUES = st.one_of(st.integers(-300, 300), st.integers(), st.floats(), st.complex_numbers(max_magnitude=1e3),
                        st.booleans(), st.none(), st.text(max_size=4), st.lists(st.integers(0, 3), max_size=3),
                        st.sampled_from([np.float32(1.5), np.int64(7), np.array(2.0), np.array([1.0, 2.0]),
                                         np.bool_(False), 10 ** 40, -(10 ** 40), 1e300, float("nan"), float("inf")]))


def _ref_fill(value, dt: np.dtype):
    """What `full` must hold for `value` in dtype `dt`, or None if it must refuse the value: it
    takes one number that `dt` holds (a whole number in range for an integer dtype, no overflow
    for a float, no imaginary part for a real dtype)."""
    if value is None or isinstance(value, (str, bytes, list)) or np.ndim(value) != 0:
        return None
    if isinstance(value, (bool, np.bool_)):
        v = bool(value)
    elif isinstance(value, (int, np.integer)):
        v = int(value)
    else:
        v = complex(value)
        if v.imag == 0 and not np.iscomplexobj(value):
            v = v.real
    if isinstance(v, complex) and dt.kind != "c":
        if v.imag != 0:
            return None
        v = v.real
    if dt.kind == "b":
        return np.asarray(bool(v), dt)
    if dt.kind in "iu":
        if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
            return None
        info = np.iinfo(dt)
        return np.asarray(int(v), dt) if info.min <= int(v) <= info.max else None
    if isinstance(v, int) and not np.iinfo(np.int64).min <= v <= np.iinfo(np.int64).max:
        if abs(v) > 2 ** 1023:
            return None
        v = float(v)
    with np.errstate(over="raise", invalid="raise"):
        try:
            return np.asarray(v).astype(dt)
        except FloatingPointError:
            return None


@pytest.mark.mpi
@FUZZ
@given(mesh_shape=MESH_SHAPE, value=FILL_VALUES,
       dtype=st.sampled_from(["float32", "float64", "float16", "int8", "int32", "uint8", "bool", "complex64"]))
def test_fuzz_full(mesh_shape, value, dtype) -> None:
    """`mesh.full(shape, value, dtype)`: one number the dtype can hold, or a DTypeError."""
    mesh = get_mesh(mesh_shape)
    ref = _ref_fill(value, np.dtype(dtype))

    def fn():
        t = mesh.full("a:8;b:2", value, dtype)
        assert t.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(t.to_numpy(), np.full((8, 2), ref))
    _run("full(value)", (value, dtype), fn, ref is None)


# ----------------------------------------------------------------------------------------- einsum

X_DIMS, Y_DIMS = {"a": 4, "b": 8}, {"b": 8, "c": 2}


def einsum_specs():
    """Output shapes over the input dims (mostly with their sizes), unknown dims, wrong sizes, junk."""
    names = st.sampled_from(["a", "b", "c", "z"])
    dim = st.one_of(names.map(lambda n: (n, {**X_DIMS, **Y_DIMS}.get(n, 3))),
                    st.tuples(names, st.sampled_from([2, 4, 8, 3])))
    dims = st.lists(dim, max_size=4)
    right = st.lists(st.sampled_from(["a", "b", "c"]), max_size=3, unique=True).map(
        lambda ns: [(n, {**X_DIMS, **Y_DIMS}[n]) for n in ns])
    return half(st.one_of(right, right.map(lambda ds: ";".join(f"{n}:{z}" for n, z in ds)), st.none()),
                st.one_of(dims.map(lambda ds: ";".join(f"{n}:{z}" for n, z in ds)), dims, SPEC_TEXT, SCALAR_JUNK,
                          st.lists(names, max_size=2)))


@pytest.mark.mpi
@FUZZ
@given(mesh_shape=MESH_SHAPE, spec=einsum_specs(), lay=st.integers(0, 3))
def test_fuzz_einsum_output(mesh_shape, spec, lay) -> None:
    """`mm.einsum([x, y], output_shape=spec)`: valid iff `spec` is a shape whose dims are all in the
    inputs with their sizes; the result is numpy's einsum."""
    mesh = get_mesh(mesh_shape)
    big = [d.name for d in mesh.shape if d.size > 1]
    xl = {"b": big[lay % len(big)]} if big and lay else {}
    gx = np.linspace(-1, 1, 32).reshape(4, 8)
    gy = np.linspace(0, 2, 16).reshape(8, 2)
    x = mesh.from_numpy(gx, "a:4;b:8", layout=xl)
    y = mesh.from_numpy(gy, "b:8;c:2")
    try:
        out = mm.Shape("a:4;c:2" if spec is None else spec)  # None: the default output
        valid = all({**X_DIMS, **Y_DIMS}.get(d.name) == d.size for d in out)
    except mm.ShapeError:
        out, valid = None, False

    def fn():
        z = mm.einsum([x, y], output_shape=spec)
        assert z.shape == out
        _close(z.to_numpy(), np.einsum(f"ab,bc->{''.join(out.names)}", gx, gy))
    _run("einsum(output_shape)", spec, fn, not valid)


# ------------------------------------------------------------------------------- op arguments

X_SHAPE = "a:8;b:16;c:2"
# Each argument is valid about half the time (the first branches), so that accepted calls and their
# values get checked too, and malformed otherwise.
VALID_INT, VALID_DIM = st.integers(-2, 18), st.sampled_from(["a", "b", "c"])
INTS = st.one_of(VALID_INT, VALID_INT, VALID_INT, VALID_INT, st.integers(-20, 20), st.integers(), st.floats(),
                 st.none(), st.text(max_size=3), st.booleans(), st.lists(st.integers(-3, 10), max_size=3),
                 st.sampled_from([np.int64(2), 2.0, np.float64(3.0), np.int8(-1), 1.5]))
DIM_ARGS = st.one_of(VALID_DIM, VALID_DIM, VALID_DIM, VALID_DIM,
                     st.sampled_from(["a", "b", "c", "z", "", "a:8", "b:16", "a:7", "a b"]),
                     st.builds(mm.Dimension, st.sampled_from(["a", "b", "c", "z"]),
                               st.sampled_from([8, 16, 2, 5, -1, 0])),
                     st.tuples(st.sampled_from(["a", "b", "z"]), st.sampled_from([8, 16, 3])),
                     st.lists(st.sampled_from(["a", "b", "c", "z"]), max_size=3), SCALAR_JUNK)
INTS_SMALL = st.one_of(VALID_INT, VALID_INT, VALID_INT, VALID_INT, st.integers(-64, 64), st.floats(), st.none(),
                       st.text(max_size=3), st.booleans(), st.lists(st.integers(-3, 10), max_size=3),
                       st.sampled_from([np.int64(2), 2.0]))  # sizes that stay small: no huge allocations


def _not_huge(spec) -> bool:
    """Keep out shapes too large to allocate: those test the machine, not the parser."""
    try:
        return mm.Shape(spec).size <= 1 << 16
    except mm.MpimeshError:
        return True


NEW_SHAPES = st.one_of(shape_strings(names=st.sampled_from(["a", "b", "c", "d", "e"]),
                                     sizes=st.sampled_from([2, 4, 8, 16, 32, 64, 256, 3])),
                       st.permutations(["a:8", "b:16", "c:2"]).map(";".join), SHAPE_SPECS).filter(_not_huge)


def _axis(d) -> int:
    """The axis of X_SHAPE that a dim argument an op accepted names ("a", "a:8", Dimension, pair)."""
    name = d.split(":")[0] if isinstance(d, str) else d[0]
    return "abc".index(name)


def _shift_ref(g, offset, axis, wrap):
    if wrap:
        return np.roll(g, offset, axis)
    out = np.zeros_like(g)
    n = g.shape[axis]
    for i in range(n):
        if 0 <= i - offset < n:
            out[(slice(None),) * axis + (i,)] = g[(slice(None),) * axis + (i - offset,)]
    return out


def _op_case(op: str, x, g, args: dict, mesh, mesh_shape):
    """Run `op` on x with the fuzzed `args`; on success check the values. Returns a thunk."""
    a = args

    def run():
        if op == "slice":
            y = mm.slice(x, a["begin"], a["size"], a["dim"])
            ax = _axis(a["dim"])
            _close(y.to_numpy(), np.take(g, np.arange(int(a["begin"]), int(a["begin"]) + int(a["size"])), ax))
        elif op == "pad":
            y = mm.pad(x, a["paddings"], a["dim"])
            ax = _axis(a["dim"])
            pads = [(0, 0)] * 3
            pads[ax] = tuple(int(p) for p in a["paddings"])
            _close(y.to_numpy(), np.pad(g, pads))
        elif op == "split":
            ys = mm.split(x, a["dim"], a["num_or_sizes"])
            ax = _axis(a["dim"])
            cuts = np.cumsum([t.shape.sizes[ax] for t in ys])[:-1]
            for t, r in zip(ys, np.split(g, cuts, ax)):
                _close(t.to_numpy(), r)
        elif op == "shift":
            y = mm.shift(x, a["offset"], a["dim"], a["wrap"])
            _close(y.to_numpy(), _shift_ref(g, int(a["offset"]), _axis(a["dim"]), bool(a["wrap"])))
        elif op == "halo_exchange":
            y = mm.halo_exchange(x, a["dim"], a["halo"])
            ax, h = _axis(a["dim"]), int(a["halo"])
            m = mesh.plan(x.shape)[ax]
            k = mesh.shape[m].size if m else 1
            starts = np.cumsum([0] + [len(b) for b in np.array_split(np.arange(g.shape[ax]), k)])
            p = np.pad(g, [(h, h) if i == ax else (0, 0) for i in range(3)])
            ref = np.concatenate([np.take(p, np.arange(starts[c], starts[c + 1] + 2 * h), ax) for c in range(k)], ax)
            _close(y.to_numpy(), ref)
        elif op == "cumsum":
            y = mm.cumsum(x, a["dim"], exclusive=a["exclusive"])
            ax = _axis(a["dim"])
            ref = np.cumsum(g, ax)
            if a["exclusive"]:
                ref = ref - g
            _close(y.to_numpy(), ref)
        elif op == "top_k":
            v, i = mm.top_k(x, a["dim"], a["k_dim"])
            ax, k = _axis(a["dim"]), v.shape.sizes[_axis(a["dim"])]
            _close(v.to_numpy(), np.take(-np.sort(-g, ax), np.arange(k), ax))
        elif op == "argmax":
            y = mm.argmax(x, a["dim"])
            np.testing.assert_array_equal(y.to_numpy(), np.argmax(g, _axis(a["dim"])))
        elif op == "one_hot":
            idx = mesh.from_numpy(np.array([0, 3, 7, 1, 2, 2, 5, 4], np.int32), "i:8")
            y = mm.one_hot(idx, a["dim"])
            n = y.shape.sizes[-1]
            _close(y.to_numpy(), np.array([0, 3, 7, 1, 2, 2, 5, 4])[:, None] == np.arange(n))
        elif op == "gather":
            idx = mesh.from_numpy(np.array([0, 1, 1, 0, 1, 0, 0, 1], np.int32), "i:8")
            y = mm.gather(x, idx, a["dim"])
            ax = _axis(a["dim"])
            ref = np.moveaxis(np.take(g, [0, 1, 1, 0, 1, 0, 0, 1], ax), ax, 0)
            _close(y.to_numpy(), ref)
        elif op == "reshape":
            y = mm.reshape(x, a["shape"])
            _close(y.to_numpy(), g.reshape(y.shape.sizes))
        elif op == "transpose":
            y = mm.transpose(x, a["shape"])
            _close(y.to_numpy(), np.transpose(g, ["abc".index(n) for n in y.shape.names]))
        elif op == "broadcast":
            y = mm.broadcast(x, a["shape"])
            ref = np.transpose(g, ["abc".index(n) for n in y.shape.names if n in "abc"])
            idx = tuple(slice(None) if n in "abc" else None for n in y.shape.names)
            _close(y.to_numpy(), np.broadcast_to(ref[idx], y.shape.sizes))
        elif op == "rename_dimension":
            y = mm.rename_dimension(x, a["old"], a["new"])
            assert y.shape.names == tuple(a["new"] if n == a["old"] else n for n in "abc")
            _close(y.to_numpy(), g)
        elif op == "relayout":
            y = mm.relayout(x, a["layout"])
            _close(y.to_numpy(), g)
        elif op in ("reduce_sum_out", "reduce_max_out"):
            y = getattr(mm, op[:-4])(x, output_shape=a["shape"])
            axes = tuple(i for i, n in enumerate("abc") if n not in y.shape.names)
            r = (np.sum if op == "reduce_sum_out" else np.max)(g, axis=axes)
            kept = [n for n in "abc" if n in y.shape.names]
            _close(y.to_numpy(), np.transpose(r, [kept.index(n) for n in y.shape.names]))
        elif op == "range":
            y = mm.range(mesh, a["dim"])
            np.testing.assert_array_equal(y.to_numpy(), np.arange(y.shape.sizes[0]))
        elif op == "random":
            y = mesh.random_normal(a["shape"], a["seed"], mean=a["mean"])
            _close(y.to_numpy(), _self_mesh(mesh_shape).random_normal(a["shape"], a["seed"],
                                                                      mean=a["mean"]).to_numpy())
        elif op == "dropout":
            y = mm.dropout(x, a["rate"], a["seed"])
            ref = mm.dropout(_self_mesh(mesh_shape).from_numpy(g, X_SHAPE), a["rate"], a["seed"])
            _close(y.to_numpy(), ref.to_numpy())
        elif op == "scalar":
            y = getattr(mm, a["fn"])(x, a["value"])
            ref = {"add": np.add, "multiply": np.multiply, "maximum": np.maximum, "less": np.less}[a["fn"]](
                g, a["value"])
            _close(y.to_numpy(), ref)
        elif op == "conv1d":
            f = np.linspace(-1, 1, 3 * 2 * 4).reshape(3, 2, 4)
            y = mm.conv1d(x, mesh.from_numpy(f, "tap:3;c:2;o:4"), stride=a["stride"], padding=a["padding"],
                          dilation=a["dilation"])
            sm = _self_mesh(mesh_shape)
            ref = mm.conv1d(sm.from_numpy(g, X_SHAPE), sm.from_numpy(f, "tap:3;c:2;o:4"), stride=a["stride"],
                            padding=a["padding"], dilation=a["dilation"])
            assert y.shape == ref.shape
            _close(y.to_numpy(), ref.to_numpy())
        else:
            raise AssertionError(op)
    return run


@st.composite
def _valid_splits(draw):
    """A dim of X_SHAPE and either a piece count or sizes that add up to its size."""
    dim = draw(VALID_DIM)
    n = {"a": 8, "b": 16, "c": 2}[dim]
    if draw(st.booleans()):
        return {"dim": dim, "num_or_sizes": draw(st.sampled_from([1, 2, 4, 8, 16, 3]))}
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
    return {"dim": dim, "num_or_sizes": [b - a for a, b in zip([0] + cuts, cuts + [n])]}


OP_ARGS = {
    "slice": st.fixed_dictionaries({"begin": INTS, "size": INTS, "dim": DIM_ARGS}),
    "pad": st.fixed_dictionaries({"paddings": st.one_of(st.lists(st.integers(0, 9), min_size=2, max_size=2),
                                                        st.lists(INTS_SMALL, max_size=3), INTS_SMALL),
                                  "dim": DIM_ARGS}),
    "split": st.one_of(_valid_splits(), st.fixed_dictionaries({"dim": DIM_ARGS, "num_or_sizes": st.one_of(
        INTS, st.lists(st.sampled_from([0, 2, 4, 8, 16, 3, -2]), max_size=4), st.lists(INTS, max_size=2))})),
    "shift": st.fixed_dictionaries({"offset": INTS, "dim": DIM_ARGS, "wrap": st.booleans()}),
    "halo_exchange": st.fixed_dictionaries({"dim": DIM_ARGS, "halo": INTS_SMALL}),
    "cumsum": st.fixed_dictionaries({"dim": DIM_ARGS, "exclusive": st.booleans()}),
    "top_k": st.fixed_dictionaries({"dim": DIM_ARGS, "k_dim": st.one_of(
        st.sampled_from(["k:1", "k:4", "k:8", "k:17", "k:0", "k", "a:2"]), DIM_ARGS)}),
    "argmax": st.fixed_dictionaries({"dim": DIM_ARGS}),
    "one_hot": st.fixed_dictionaries({"dim": st.one_of(st.sampled_from(["v:8", "v:3", "v:0", "i:8", "v"]),
                                                       DIM_ARGS)}),
    "gather": st.fixed_dictionaries({"dim": DIM_ARGS}),
    "reshape": st.fixed_dictionaries({"shape": NEW_SHAPES}),
    "transpose": st.fixed_dictionaries({"shape": NEW_SHAPES}),
    "broadcast": st.fixed_dictionaries({"shape": st.one_of(
        st.sampled_from(["a:8;b:16;c:2;d:4", "d:2;c:2;b:16;a:8", "a:8;d:2;b:16;c:2", "a:8;b:16"]), NEW_SHAPES)}),
    "rename_dimension": st.fixed_dictionaries({"old": DIM_ARGS, "new": st.one_of(
        st.sampled_from(["d", "b", "e:2", " ", "x,y"]), ODD_NAMES)}),
    "relayout": st.fixed_dictionaries({"layout": rules_strategy(("rows", "cols", "planes", "all", "nope"))}),
    "reduce_sum_out": st.fixed_dictionaries({"shape": NEW_SHAPES}),
    "reduce_max_out": st.fixed_dictionaries({"shape": NEW_SHAPES}),
    "range": st.fixed_dictionaries({"dim": DIM_ARGS}),
    "random": st.fixed_dictionaries({"shape": st.one_of(st.sampled_from(["a:8;b:2", "a:4"]),
                                                        SHAPE_SPECS.filter(_not_huge)),
                                     "seed": st.one_of(st.integers(-5, 2 ** 70), INTS),
                                     "mean": st.one_of(st.floats(-3, 3), SCALAR_JUNK)}),
    "dropout": st.fixed_dictionaries({"rate": st.one_of(st.floats(0, 0.99), SCALAR_JUNK),
                                      "seed": st.one_of(st.integers(-5, 2 ** 70), INTS)}),
    "scalar": st.fixed_dictionaries({"fn": st.sampled_from(["add", "multiply", "maximum", "less"]),
                                     "value": st.one_of(st.floats(-4, 4), st.integers(-9, 9), FILL_VALUES,
                                                        SCALAR_JUNK)}),
    "conv1d": st.fixed_dictionaries({"stride": st.one_of(st.integers(1, 3), INTS),
                                     "padding": st.one_of(st.sampled_from(["SAME", "VALID", "same", "FULL"]),
                                                          st.lists(st.tuples(INTS_SMALL, INTS_SMALL), max_size=2),
                                                          INTS_SMALL),
                                     "dilation": st.one_of(st.integers(1, 2), INTS)}),
}

_SIZES = {"a": 8, "b": 16, "c": 2}


@st.composite
def _valid_slice(draw):
    dim = draw(VALID_DIM)
    begin = draw(st.integers(0, _SIZES[dim]))
    return {"begin": begin, "size": draw(st.integers(0, _SIZES[dim] - begin)), "dim": dim}


# Valid arguments for each op (half the examples), so that accepted calls get their values checked.
VALID_ARGS = {
    "slice": _valid_slice(),
    "pad": st.fixed_dictionaries({"paddings": st.lists(st.integers(0, 9), min_size=2, max_size=2),
                                  "dim": VALID_DIM}),
    "split": _valid_splits(),
    "shift": st.fixed_dictionaries({"offset": st.integers(-20, 20), "dim": VALID_DIM, "wrap": st.booleans()}),
    "halo_exchange": st.fixed_dictionaries({"dim": VALID_DIM, "halo": st.integers(0, 5)}),
    "cumsum": st.fixed_dictionaries({"dim": VALID_DIM, "exclusive": st.booleans()}),
    "top_k": st.fixed_dictionaries({"dim": VALID_DIM, "k_dim": st.sampled_from(["k:1", "k:2", ("k", 2)])}),
    "argmax": st.fixed_dictionaries({"dim": st.one_of(VALID_DIM, st.sampled_from(["b:16", ("a", 8)]))}),
    "one_hot": st.fixed_dictionaries({"dim": st.sampled_from(["v:8", "v:3", mm.Dimension("v", 5), ("v", 1)])}),
    "gather": st.fixed_dictionaries({"dim": VALID_DIM}),
    "reshape": st.fixed_dictionaries({"shape": st.sampled_from(
        ["ab:128;c:2", "a:8;bc:32", "n:256", "a:4;x:2;b:16;c:2", "a:8;b:16;c:2", "b:16;a:8;c:2", "q:2;r:128"])}),
    "transpose": st.fixed_dictionaries({"shape": st.permutations(["a:8", "b:16", "c:2"]).map(";".join)}),
    "broadcast": st.fixed_dictionaries({"shape": st.sampled_from(
        ["a:8;b:16;c:2;d:4", "d:2;c:2;b:16;a:8", "a:8;d:2;b:16;c:2", "c:2;a:8;b:16"])}),
    "rename_dimension": st.fixed_dictionaries({"old": VALID_DIM, "new": st.sampled_from(["d", "e", "a", "z"])}),
    "relayout": st.fixed_dictionaries({"layout": st.dictionaries(
        VALID_DIM, st.sampled_from(["all", "rows", "cols", "planes"]), max_size=2)}),
    "reduce_sum_out": st.fixed_dictionaries({"shape": st.sampled_from(
        ["a:8", "b:16;a:8", "", "c:2;b:16", "a:8;b:16;c:2", [("c", 2)]])}),
    "reduce_max_out": st.fixed_dictionaries({"shape": st.sampled_from(["a:8", "b:16;a:8", "", "c:2;a:8"])}),
    "range": st.fixed_dictionaries({"dim": st.builds(mm.Dimension, st.sampled_from(["r", "s"]),
                                                     st.integers(0, 20))}),
    "random": st.fixed_dictionaries({"shape": st.sampled_from(["a:8;b:2", "a:4", "x:16"]),
                                     "seed": st.integers(-5, 2 ** 70), "mean": st.floats(-3, 3)}),
    "dropout": st.fixed_dictionaries({"rate": st.floats(0, 0.9), "seed": st.integers(-5, 2 ** 70)}),
    "scalar": st.fixed_dictionaries({"fn": st.sampled_from(["add", "multiply", "maximum", "less"]),
                                     "value": st.one_of(st.floats(-4, 4), st.integers(-9, 9))}),
    "conv1d": st.fixed_dictionaries({"stride": st.integers(1, 3), "dilation": st.integers(1, 2),
                                     "padding": st.sampled_from(["SAME", "VALID", "same", [(1, 2)], ((0, 0),)])}),
}
assert set(VALID_ARGS) == set(OP_ARGS)


@pytest.mark.mpi
@pytest.mark.parametrize("op", sorted(OP_ARGS))
@FUZZ_OPS
@given(data=st.data())
def test_fuzz_op_arguments(op, data) -> None:
    """Random and malformed arguments for each op, on an input split by a random layout; an
    accepted call must give numpy's values (or, for random values, dropout and conv1d, those of the
    same call on a one-rank mesh)."""
    mesh_shape = data.draw(MESH_SHAPE, "mesh")
    mesh = get_mesh(mesh_shape)
    big = [d.name for d in mesh.shape if d.size > 1]
    lay = data.draw(st.sampled_from([{}] + [{"a": m} for m in big] + [{"b": m} for m in big] +
                                    [{"a": m1, "b": m2} for m1 in big for m2 in big if m1 != m2]), "layout")
    g = np.random.default_rng(7).standard_normal((8, 16, 2))
    x = mesh.from_numpy(g, X_SHAPE, layout=lay)
    args = data.draw(st.one_of(VALID_ARGS[op], OP_ARGS[op]), "args")
    _run(f"op {op}", (mesh_shape, lay, args), _op_case(op, x, g, args, mesh, mesh_shape))


# ------------------------------------------------------------------------------- bookkeeping

def test_fuzz_same_examples_on_every_rank() -> None:
    """The premise of the whole module: the derandomized draws are identical on every rank."""
    seen = []

    @FUZZ
    @given(spec=SHAPE_SPECS, rules=rules_strategy(), d=DTYPE_SPECS)
    def draw(spec, rules, d):
        seen.append(repr((spec, rules, d)))
    draw()
    everyone = WORLD.allgather(seen)
    assert len(seen) >= min(EXAMPLES, 20)
    assert all(s == seen for s in everyone), "ranks drew different examples"


def test_fuzz_summary(capsys) -> None:
    """Print how many examples each parser saw (and how many it refused); runs last."""
    if not CASES:
        pytest.skip("no fuzz test ran in this session")
    lines = [f"fuzz cases on {NRANKS} rank(s): {sum(CASES.values())} in all"]
    for parser in sorted(CASES):
        lines.append(f"  {parser:<26} {CASES[parser]:>5} cases, {ERRORS[parser]:>5} refused with an MpimeshError")
    if WORLD.Get_rank() == 0:
        with capsys.disabled():
            sys.stderr.write("\n" + "\n".join(lines) + "\n")
    assert all(CASES[p] > 0 for p in CASES)
