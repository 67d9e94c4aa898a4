"""Layout rules and tensor layouts: which tensor dim is split over which mesh dim (pure Python).

A *tensor layout* has one entry per tensor dim: the mesh dim it is split over, or None. Slice
arithmetic lives here alone (`block`): a dim of size n split over a mesh dim of size k holds, on
coordinate c, block c of `numpy.array_split(range(n), k)`. A rule naming a dim that no tensor has
(a typo) gives a `LayoutRuleWarning` naming the closest dims seen (`check_step`); when and where:
docs/layouts.md.

>>> rules = LayoutRules("batch:rows;hidden:cols")
>>> plan_layout(Shape("batch:8;io:4;hidden:6"), Shape("rows:2;cols:3"), rules)
('rows', None, 'cols')
>>> [block(7, 3, c) for c in range(3)]   # (start, stop) of each block
[(0, 3), (3, 5), (5, 7)]
"""
from __future__ import annotations

import atexit
import contextlib
import difflib
import os
import sys
import warnings
from functools import lru_cache
from typing import Iterable, Mapping, Optional, Sequence, Tuple, Union

from .errors import LayoutError
from .shape import Shape, name_problem, parse_pairs

TensorLayout = Tuple[Optional[str], ...]


class LayoutRules:
    """Global rules `tensor dim name -> mesh dim name`; immutable and hashable.

    >>> LayoutRules([("batch", "rows")]) == LayoutRules("batch:rows")
    True
    """

    __slots__ = ("pairs", "_map", "_hash")
    pairs: tuple[tuple[str, str], ...]
    """The rules as `(tensor_dim, mesh_dim)` pairs in order, each tensor dim once:
    `(('batch', 'rows'), ('hidden', 'cols'))`."""

    def __init__(self, rules: "RulesLike" = ""):
        if rules is None:
            pairs = ()
        elif isinstance(rules, LayoutRules):
            pairs = rules.pairs
        elif isinstance(rules, str):
            pairs = tuple(parse_pairs(rules, "layout rule", LayoutError))
        elif isinstance(rules, Mapping):
            pairs = tuple((k, v) for k, v in rules.items() if v is not None)
        elif isinstance(rules, (bytes, bytearray)) or not isinstance(rules, Iterable):
            raise LayoutError(f"cannot read {rules!r} as layout rules: expected a string like 'batch:rows', "
                              f"a list of (tensor_dim, mesh_dim) pairs or a dict")
        else:
            pairs = tuple(rules)
        mapping: dict[str, str] = {}
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise LayoutError(f"bad layout rule {pair!r}: expected (tensor_dim, mesh_dim)")
            for name in pair:
                why = name_problem(name)
                if why:
                    raise LayoutError(f"bad layout rule {tuple(pair)!r}: {name!r} is not a dim name ({why})")
            tdim, mdim = pair
            if mapping.get(tdim, mdim) != mdim:
                raise LayoutError(f"tensor dim {tdim!r} is mapped to two mesh dims: {mapping[tdim]!r} and {mdim!r}")
            mapping[tdim] = mdim
        object.__setattr__(self, "pairs", tuple(mapping.items()))
        object.__setattr__(self, "_map", mapping)
        object.__setattr__(self, "_hash", hash(self.pairs))  # (a key of the op plans' caches: hashed per op)

    def __setattr__(self, key, value):
        raise AttributeError("LayoutRules is immutable")

    def mesh_dim(self, tensor_dim: str) -> Optional[str]:
        """The mesh dim for `tensor_dim`, or None."""
        return self._map.get(tensor_dim)

    def __eq__(self, other) -> bool:
        return isinstance(other, LayoutRules) and self.pairs == other.pairs

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"LayoutRules({str(self)!r})"

    def __str__(self) -> str:
        return ";".join(f"{t}:{m}" for t, m in self.pairs)


RulesLike = Union[LayoutRules, str, Mapping[str, Optional[str]], Iterable[Sequence[str]]]


def check_rules(rules: LayoutRules, mesh_shape: Shape) -> None:
    """LayoutError if a rule names a mesh dim that `mesh_shape` lacks."""
    for tdim, mdim in rules.pairs:
        if mdim not in mesh_shape:
            raise LayoutError(f"layout rule {tdim}:{mdim} names mesh dim {mdim!r}, "
                              f"but the mesh has dims {list(mesh_shape.names)}")


@lru_cache(maxsize=8192)
def plan_layout(shape: Shape, mesh_shape: Shape, rules: LayoutRules) -> TensorLayout:
    """The tensor layout that `rules` give a tensor of `shape` on a mesh of `mesh_shape`."""
    _planned.add(rules)
    return validate_layout(shape, mesh_shape, tuple(rules.mesh_dim(n) for n in shape.names))


def validate_layout(shape: Shape, mesh_shape: Shape, layout: TensorLayout) -> TensorLayout:
    """Check a tensor layout: known mesh dims, each used once (sizes need not divide: see `block`)."""
    _seen.update(shape.names)
    used: dict[str, str] = {}
    for dim, mdim in zip(shape, layout):
        if mdim is None:
            continue
        if mdim not in mesh_shape:
            raise LayoutError(f"dim {dim.name!r} is laid out on mesh dim {mdim!r}, "
                              f"but the mesh has dims {list(mesh_shape.names)}")
        if mdim in used:
            raise LayoutError(f"tensor dims {used[mdim]!r} and {dim.name!r} of shape {shape} are both "
                              f"laid out on mesh dim {mdim!r} (size {mesh_shape[mdim].size})")
        used[mdim] = dim.name
    return tuple(layout)


class LayoutRuleWarning(UserWarning):
    """A layout rule whose tensor dim no tensor had: most likely a misspelled dim name (the rule splits nothing)."""


_seen: set = set()  # the name of every tensor dim laid out so far (by `validate_layout`)
_planned: set = set()  # every LayoutRules that laid out a tensor (by `plan_layout`)


class _Watch:
    """The rules noted (`note_rules`) and which of them are still to be checked against `_seen`."""

    def __init__(self):
        self.noted: set = set()  # (rules, mesh shape)
        self.pending: dict = {}  # (rules, mesh shape) not checked yet -> whether this process warns for them
        self.warned: set = set()  # (tensor dim, mesh dim, mesh shape) of each rule warned about
        self.stepped = False  # a traced step ended and checked the rules it ran under


_watch = _Watch()


def note_rules(rules: LayoutRules, mesh_shape: Shape, speaks: bool) -> None:
    """Note the rules of a mesh or a layout scope on a mesh of `mesh_shape`, to be checked against the
    dims of the tensors laid out (`check_step`). `speaks`: whether this process warns for them."""
    key = (rules, mesh_shape)
    if rules.pairs and key not in _watch.noted:
        _watch.noted.add(key)
        _watch.pending[key] = speaks


def check_step(rules_in_force: Iterable[LayoutRules]) -> None:
    """The end of a traced step whose ops ran under `rules_in_force`: at the first that ran under noted
    rules, warn for those of them whose tensor dim no tensor had (the other rules wait for exit)."""
    if _watch.stepped or not _watch.pending:
        return
    used = set(rules_in_force)
    keys = [key for key in _watch.pending if key[0] in used]
    if keys:
        _watch.stepped = True
        _check(keys, "by the end of the first traced step")


def _check(keys: list, when: str) -> None:
    for key in keys:
        speaks = _watch.pending.pop(key)
        rules, mesh_shape = key
        for tdim, mdim in rules.pairs:
            rule = (tdim, mdim, mesh_shape)
            if speaks and tdim not in _seen and rule not in _watch.warned:
                _watch.warned.add(rule)
                _warn(f"layout rule {tdim}:{mdim} of mesh {mesh_shape} matched no tensor {when}: no tensor had "
                      f"a dim {tdim!r}{_closest(tdim)}, so the rule split nothing")


def _closest(name: str) -> str:
    close = difflib.get_close_matches(name, _seen, n=3, cutoff=0.6)
    if close:
        return f" (did you mean {' or '.join(repr(c) for c in close)}?)"
    if not _seen:
        return " (no tensor was laid out)"
    names = sorted(_seen)
    return f" (the tensors' dims: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''})"


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warn(message: str) -> None:
    """`LayoutRuleWarning` pointing at the user's code that ended the step (at exit: at the program)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                 or frame.f_code.co_filename == contextlib.__file__):
        frame = frame.f_back
    if frame is None:
        main = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "<mpimesh>"
        warnings.warn_explicit(message, LayoutRuleWarning, main, 0, module="__main__")
    else:
        warnings.warn_explicit(message, LayoutRuleWarning, frame.f_code.co_filename, frame.f_lineno,
                               module=frame.f_globals.get("__name__", "__main__"))


@atexit.register
def _at_exit() -> None:
    """Check the rules that laid out tensors but no step ran under (not those of a mesh that a program
    ending early, on bad input, built and never used)."""
    keys = [key for key in _watch.pending if key[0] in _planned]
    if keys:
        _check(keys, "in the whole run")


def layout_from_spec(shape: Shape, mesh_shape: Shape, spec) -> TensorLayout:
    """A tensor layout from a rules string/list/dict/LayoutRules or an explicit tuple.

    Dims that the spec does not name are replicated.

    >>> layout_from_spec(Shape("a:4;b:6"), Shape("x:2"), "b:x")
    (None, 'x')
    """
    if isinstance(spec, tuple) and spec and all(s is None or isinstance(s, str) for s in spec):
        if len(spec) != shape.rank:
            raise LayoutError(f"tensor layout {spec!r} has {len(spec)} entries, but shape {shape} has "
                              f"{shape.rank} dims (give one mesh dim or None per dim)")
        return validate_layout(shape, mesh_shape, spec)
    rules = LayoutRules(spec)
    for tdim, _ in rules.pairs:
        if tdim not in shape:
            raise LayoutError(f"layout {str(rules)!r} names dim {tdim!r}, which is not in shape {shape}")
    check_rules(rules, mesh_shape)
    return plan_layout(shape, mesh_shape, rules)


def pick_dim(shape: Shape, layout: TensorLayout, k: int) -> Optional[str]:
    """The dim of a tensor of `shape` laid out as `layout` that `mm.shard_weights` splits over a mesh
    dim of `k` ranks: the largest unsplit one that `k` divides, else the largest unsplit one at least
    `k` long; None where there is none.

    >>> pick_dim(Shape("d:4;f:6"), (None, None), 2), pick_dim(Shape("d:5;f:3"), (None, None), 2)
    ('f', 'd')
    >>> pick_dim(Shape("d:4;f:6"), (None, "cols"), 2), pick_dim(Shape("s:1"), (None,), 2)
    ('d', None)
    """
    free = [i for i, d in enumerate(shape) if layout[i] is None and d.size >= k > 1]
    even = [i for i in free if shape[i].size % k == 0]
    pick = even or free
    return shape.names[max(pick, key=lambda i: (shape[i].size, -i))] if pick else None


def weight_layout(shape: Shape, layout: TensorLayout, mesh_shape: Shape, over: Sequence[str]) -> TensorLayout:
    """`layout` additionally split over each mesh dim of `over` by `pick_dim`, as `mm.shard_weights`
    lays out a float parameter when not told its dims (a mesh dim the layout uses already, or with no
    dim to split, is left out).

    >>> weight_layout(Shape("d:4;f:6"), (None, None), Shape("rows:2;cols:3"), ("rows", "cols"))  # d: uneven
    ('cols', 'rows')
    """
    out = list(layout)
    for m in over:
        if m not in out:
            dim = pick_dim(shape, tuple(out), mesh_shape[m].size)
            if dim is not None:
                out[shape.index(dim)] = m
    return tuple(out)


def block(size: int, k: int, c):
    """`(start, stop)` of block `c` when `size` elements are cut into `k` blocks like
    `numpy.array_split` (the first `size % k` blocks one longer; blocks may be empty). `c` may be
    a traced value (a JAX replay's axis index): the arithmetic has no branch on it.

    >>> [block(7, 3, c) for c in range(3)], block(2, 4, 3), block(8, 4, 1)
    ([(0, 3), (3, 5), (5, 7)], (2, 2), (2, 4))
    """
    q, r = divmod(size, k)
    if r == 0:
        return c * q, c * q + q

    def first(j):  # j * q + min(j, r)
        return j * q + (j + r - abs(j - r)) // 2
    return first(c), first(c + 1)


def block_span(size: int, k: int, c) -> tuple:
    """`(start, length)` of block `c` (`block`'s). The length is a Python int even where `c` is a
    traced value, as long as the blocks are equal.

    >>> block_span(7, 3, 2), block_span(8, 4, 1)
    ((5, 2), (2, 2))
    """
    start, stop = block(size, k, c)
    q, r = divmod(size, k)
    return start, q if r == 0 else stop - start


def block_sizes(size: int, k: int) -> tuple[int, ...]:
    """The sizes of the `k` blocks of `size` elements (`block`'s, in coordinate order).

    >>> block_sizes(7, 3), block_sizes(2, 4)
    ((3, 2, 2), (1, 1, 0, 0))
    """
    q, r = divmod(size, k)
    return tuple(q + (1 if c < r else 0) for c in range(k))


def splitting(mesh_dim: Optional[str], mesh_shape: Shape) -> Optional[str]:
    """`mesh_dim` if it really splits a tensor dim, None if it is None or of size 1.

    >>> splitting("x", Shape("x:2;y:1")), splitting("y", Shape("x:2;y:1")), splitting(None, Shape("x:2"))
    ('x', None, None)
    """
    return mesh_dim if mesh_dim is not None and mesh_shape[mesh_dim].size > 1 else None


def local_sizes(shape: Shape, mesh_shape: Shape, layout: TensorLayout,
                coords: Optional[Mapping[str, int]] = None) -> tuple[int, ...]:
    """Sizes of the slice of the rank at `coords` (any rank's when every split divides evenly).

    >>> local_sizes(Shape("a:4;b:6"), Shape("x:2"), (None, "x"))
    (4, 3)
    """
    out = []
    for d, m in zip(shape, layout):
        if m is None:
            out.append(d.size)
            continue
        k = mesh_shape[m].size
        if coords is None and d.size % k:
            raise LayoutError(f"dim {d.name!r} (size {d.size}) is split unevenly over mesh dim {m!r} (size {k}): "
                              f"its slice size depends on the rank, so pass that rank's coords")
        start, stop = block(d.size, k, coords[m] if coords is not None else 0)
        out.append(stop - start)
    return tuple(out)


def slice_bounds(shape: Shape, mesh_shape: Shape, layout: TensorLayout,
                 coords: Mapping[str, int]) -> tuple[slice, ...]:
    """The global index ranges held by the rank at `coords`.

    >>> slice_bounds(Shape("a:4;b:6"), Shape("x:2"), (None, "x"), {"x": 1})
    (slice(0, 4, None), slice(3, 6, None))
    """
    out = []
    for d, m in zip(shape, layout):
        if m is None:
            out.append(slice(0, d.size))
        else:
            out.append(slice(*block(d.size, mesh_shape[m].size, coords[m])))
    return tuple(out)


def layout_dict(shape: Shape, layout: TensorLayout) -> dict[str, str]:
    """`{tensor_dim: mesh_dim}` for the split dims."""
    return {n: m for n, m in zip(shape.names, layout) if m is not None}
