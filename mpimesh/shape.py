"""Named dimensions and shapes (pure Python, no MPI).

>>> s = Shape("batch:8;io:32")
>>> s.names, s.sizes, s.size
(('batch', 'io'), (8, 32), 256)
>>> s["io"]
Dimension(name='io', size=32)
"""
from __future__ import annotations

import math
import numbers
import operator
import re
from functools import lru_cache
from typing import Iterable, Iterator, NamedTuple, Optional, Sequence, Union

from .errors import ShapeError


class Dimension(NamedTuple):
    """A named tensor dimension; equal when name and size are equal.

    >>> Dimension("io", 32).size
    32
    """

    name: str
    size: int


ShapeLike = Union["Shape", str, Iterable[Union[Dimension, Sequence]]]

_SEP = re.compile(r"[;,\s]+")


def parse_pairs(text: str, what: str, error: type) -> list[tuple[str, str]]:
    """Split `"a:x;b:y"` (separators `;` `,` or whitespace) into `[("a", "x"), ("b", "y")]`.

    >>> parse_pairs("batch:rows, hidden: cols", "layout", ValueError)
    [('batch', 'rows'), ('hidden', 'cols')]
    """
    pairs = []
    for item in _SEP.split(_AROUND_COLON.sub(":", text.strip())):  # ("rows: 2" is rows:2)
        if not item:
            continue
        parts = item.split(":")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise error(f"bad {what} entry {item!r} in {text!r}: expected 'name:value'")
        pairs.append((parts[0], parts[1]))
    return pairs


_AROUND_COLON = re.compile(r"[ \t]*:[ \t]*")
_BAD_NAME_CHARS = re.compile(r"[:;,\s]")
_DIGITS = re.compile(r"[0-9]+")


def name_problem(name) -> Optional[str]:
    """Why `name` cannot name a dim (tensor or mesh), or None if it can: a name is a non-empty
    string without ':', ';', ',' or whitespace (those separate entries in shape and rules strings).

    >>> name_problem("batch"), name_problem(""), name_problem("a:b")
    (None, 'a name must be a non-empty string', "a name must not contain ':', ';', ',' or whitespace")
    """
    if not isinstance(name, str) or not name:
        return "a name must be a non-empty string"
    if _BAD_NAME_CHARS.search(name):
        return "a name must not contain ':', ';', ',' or whitespace"
    return None


def _size(name: str, size) -> int:
    """`size` as a non-negative int: an int (numpy's too), an integral float, or a string of digits."""
    if isinstance(size, str):
        if _DIGITS.fullmatch(size):
            return int(size)
    elif not isinstance(size, bool) and type(size).__name__ != "bool_":
        try:
            value = operator.index(size)
        except TypeError:
            value = None
            if isinstance(size, numbers.Real):
                f = float(size)
                if math.isfinite(f) and f.is_integer():
                    value = int(f)
        if value is not None and value >= 0:
            return value
    raise ShapeError(f"dimension {name!r} has invalid size {size!r}: expected a non-negative integer")


def _to_dim(d) -> Dimension:
    if isinstance(d, (str, bytes, bytearray)):
        raise ShapeError(f"cannot read {d!r} as a dimension: expected Dimension or (name, size)")
    try:
        name, size = d
    except (TypeError, ValueError):
        raise ShapeError(f"cannot read {d!r} as a dimension: expected Dimension or (name, size)") from None
    why = name_problem(name)
    if why:
        raise ShapeError(f"bad dimension name {name!r} (size {size!r}): {why}")
    size_i = _size(name, size)
    if isinstance(d, Dimension) and type(size) is int:
        return d
    return Dimension(name, size_i)


class Shape:
    """An ordered list of dims with distinct names; immutable and hashable.

    Accepts a Shape, a list of Dimensions or `(name, size)` pairs, or a string `"batch:8;io:32"`.

    >>> Shape([("a", 2), Dimension("b", 3)]).rank
    2
    """

    __slots__ = ("dims", "names", "sizes", "_index", "_hash")
    dims: tuple[Dimension, ...]
    """The dims in order: `(Dimension(name='batch', size=8), Dimension(name='io', size=32))`."""
    names: tuple[str, ...]
    """The dim names in order: `('batch', 'io')`."""
    sizes: tuple[int, ...]
    """The dim sizes in order: `(8, 32)`."""

    def __new__(cls, dims: ShapeLike = ()):
        if isinstance(dims, Shape):
            return dims
        if isinstance(dims, str):
            return _make_shape(dims)
        if type(dims) not in (tuple, list) and (  # (the ABC test is slow: per-op time)
                isinstance(dims, (bytes, bytearray)) or not isinstance(dims, Iterable)):
            raise ShapeError(f"cannot read {dims!r} as a shape: expected a string like 'batch:8;io:32', "
                             f"a Shape, or a list of Dimensions or (name, size) pairs")
        return _make_shape(tuple(_to_dim(d) for d in dims))

    @classmethod
    def _build(cls, dims: tuple) -> "Shape":
        self = object.__new__(cls)
        names = [d.name for d in dims]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ShapeError(f"shape {_fmt(dims)} repeats dim name(s) {dup}")
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "names", tuple(names))
        object.__setattr__(self, "sizes", tuple(d.size for d in dims))
        object.__setattr__(self, "_index", {d.name: i for i, d in enumerate(dims)})
        object.__setattr__(self, "_hash", hash(dims))
        return self

    def __setattr__(self, key, value):
        raise AttributeError("Shape is immutable")

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.sizes)

    @property
    def rank(self) -> int:
        """Number of dims (0 for a scalar's shape)."""
        return len(self.dims)

    def index(self, name: str) -> int:
        """Position of dim `name`; ShapeError if absent."""
        try:
            return self._index[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name, e.g. a list
            raise ShapeError(f"dim {name!r} is not in shape {self}") from None

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.dims[self.index(key)]
        if isinstance(key, slice):
            return Shape(self.dims[key])
        if isinstance(key, bool) or not hasattr(key, "__index__"):
            raise ShapeError(f"shape {self} is indexed by a dim name, a position or a slice, not {key!r}")
        return self.dims[key]

    def __contains__(self, item) -> bool:
        if isinstance(item, Dimension):
            return item.name in self._index and self.dims[self._index[item.name]] == item
        try:
            return item in self._index
        except TypeError:  # unhashable: not a name
            return False

    def __iter__(self) -> Iterator[Dimension]:
        return iter(self.dims)

    def __len__(self) -> int:
        return len(self.dims)

    def __eq__(self, other) -> bool:
        if isinstance(other, Shape):
            return self.dims == other.dims
        try:
            return self.dims == Shape(other).dims
        except (ShapeError, TypeError):
            return NotImplemented

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Shape({str(self)!r})"

    def __str__(self) -> str:
        return _fmt(self.dims)

    def __add__(self, other: ShapeLike) -> "Shape":
        return Shape(self.dims + Shape(other).dims)

    def without(self, names: Iterable[str]) -> "Shape":
        """This shape minus the dims named in `names`."""
        drop = set(names)
        return Shape(tuple(d for d in self.dims if d.name not in drop))


def _fmt(dims) -> str:
    return "[" + ", ".join(f"{d.name}:{d.size}" for d in dims) + "]"


@lru_cache(maxsize=4096)
def _make_shape(dims) -> Shape:
    if isinstance(dims, str):
        text = dims.strip()
        if text.startswith("[") and text.endswith("]"):  # str(shape), so Shape(str(s)) == s
            text = text[1:-1]
        return Shape._build(tuple(_to_dim(p) for p in parse_pairs(text, "shape", ShapeError)))
    return Shape._build(dims)


def union_shape(shapes: Sequence[Shape], what: str = "op") -> Shape:
    """Dims of all shapes in order of first appearance; same name with different size is a ShapeError.

    >>> union_shape([Shape("a:2;b:3"), Shape("b:3;c:4")])
    Shape('[a:2, b:3, c:4]')
    """
    seen: dict[str, Dimension] = {}
    for s in shapes:
        for d in s:
            old = seen.setdefault(d.name, d)
            if old.size != d.size:
                raise ShapeError(f"{what}: dim {d.name!r} has size {old.size} in one input and {d.size} in another")
    return Shape(tuple(seen.values()))


def dim_names(dims, shape: Optional["Shape"] = None, what: str = "op") -> tuple[str, ...]:
    """Names from a name, a Dimension, a Shape (or shape string) or a list of names/Dimensions.
    With `shape`, a dim given with a size must have that size in `shape` (ShapeError otherwise).

    >>> dim_names("io"), dim_names(Dimension("io", 4)), dim_names(["a", ("b", 2)]), dim_names("a:1;b:2")
    (('io',), ('io',), ('a', 'b'), ('a', 'b'))
    """
    if isinstance(dims, Dimension):
        sized = [_to_dim(dims)]
    elif isinstance(dims, str):
        sized = list(Shape(dims)) if ":" in dims else [dims]
    elif isinstance(dims, Shape):
        sized = list(dims)
    elif isinstance(dims, (bytes, bytearray)) or not isinstance(dims, Iterable):
        raise ShapeError(f"cannot read {dims!r} as dim names: expected a name, a Dimension, a Shape or a list of them")
    else:
        sized = [d if isinstance(d, str) else _to_dim(d) for d in dims]
    names = [d if isinstance(d, str) else d.name for d in sized]
    if len(set(names)) != len(names):
        raise ShapeError(f"{what}: dims {names} name {sorted({n for n in names if names.count(n) > 1})} twice")
    if shape is not None:
        for d in sized:
            if isinstance(d, Dimension) and d.name in shape and shape[d.name].size != d.size:
                raise ShapeError(f"{what}: dim {d.name}:{d.size} does not match {d.name}:{shape[d.name].size} "
                                 f"of shape {shape}")
    return tuple(names)
