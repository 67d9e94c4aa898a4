"""Nests of values: tuples (named ones too), lists and dicts, walked in one order everywhere.

`mm.compile` flattens a step's arguments and results, `mm.remat` finds the tensors of its
function's, and the cost model swaps tensors for shapes: all through `flatten` and `unflatten`, so
that a namedtuple or a dict means the same to each. Everything else is a leaf.

>>> import collections
>>> P = collections.namedtuple("P", "w b")
>>> leaves, structure = flatten({"p": P(1, 2), "xs": [3]})
>>> leaves, unflatten(structure, [10, 20, 30])
([1, 2, 3], {'p': P(w=10, b=20), 'xs': [30]})

A checkpoint keeps a nest as JSON (`to_json`, `from_json`): dicts with str keys, lists and tuples,
its tensors named by their paths (`leaf_name`), plain values (int, float, str, bool, None) in place.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np


def flatten(tree) -> tuple:
    """`(leaves, structure)`: the leaves in order (dicts in their keys' order), and what
    `unflatten` needs to build the same nest again."""
    leaves: list = []
    return leaves, _walk(tree, leaves)


def unflatten(structure, leaves: Iterable):
    """The nest `structure` (from `flatten`) with `leaves` in its leaves' places, in order."""
    return _build(structure, iter(leaves))


# Module functions, not closures: a recursive closure is a reference cycle, which would keep the
# leaves (a compiled step's results, views of pooled gradient buffers) until the cycle collector ran.
def _walk(x, leaves: list):
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_walk(v, leaves) for v in x))
    if isinstance(x, dict):  # (a subclass's type kept: an OrderedDict, a defaultdict and its factory)
        kind = dict if type(x) is dict else (defaultdict, x.default_factory) if isinstance(x, defaultdict) else type(x)
        return (dict, tuple((k, _walk(v, leaves)) for k, v in x.items()), kind)
    leaves.append(x)
    return None


def _build(structure, leaves: Iterator):
    if structure is None:
        return next(leaves)
    kind, items = structure[:2]
    if kind is dict:
        d = {k: _build(v, leaves) for k, v in items}
        made = structure[2]
        return d if made is dict else defaultdict(made[1], d) if isinstance(made, tuple) else made(d)
    values = [_build(v, leaves) for v in items]
    return kind(*values) if hasattr(kind, "_fields") else kind(values)


def map_leaves(tree, fn: Callable):
    """`tree` with `fn` applied to each leaf."""
    leaves, structure = flatten(tree)
    return unflatten(structure, [fn(v) for v in leaves])


def is_tensor(x) -> bool:
    """A distributed tensor: a `DistTensor`, or a dry run's placeholder of one."""
    return hasattr(x, "tensor_layout") and hasattr(x, "mesh")


def tensors(tree) -> list:
    """The tensors among `tree`'s leaves, in order."""
    return [v for v in flatten(tree)[0] if is_tensor(v)]


# ---------------------------------------------------------------- nests as JSON (checkpoints)

def leaf_name(keys: Sequence) -> str:
    """The name of the leaf at `keys` (dict keys and list positions from the top): the keys joined by
    '/', each escaped as in a JSON Pointer (RFC 6901: '~' as '~0', '/' as '~1'), so a key that holds a
    '/' and two nested keys never share a name.

    >>> leaf_name(["state", "m", "w"]), leaf_name(["a/b", 0]), leaf_name(["a", "b", 0])
    ('state/m/w', 'a~1b/0', 'a/b/0')
    """
    return "/".join(str(k).replace("~", "~0").replace("/", "~1") for k in keys)


def named_leaves(tree, keys: tuple = ()) -> list[tuple[str, object]]:
    """`(leaf_name, leaf)` of each leaf of `tree` (dicts, lists and tuples are nodes), in order.

    >>> named_leaves({"p": {"w": 1}, "xs": [2, 3]})
    [('p/w', 1), ('xs/0', 2), ('xs/1', 3)]
    """
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in named_leaves(v, keys + (k,))]
    if isinstance(tree, (list, tuple)):
        return [x for i, v in enumerate(tree) for x in named_leaves(v, keys + (i,))]
    return [(leaf_name(keys), tree)]


def to_json(tree, keep: Callable, keys: tuple = (), kept: Optional[list] = None) -> tuple[dict, list]:
    """`(description, kept)`: the nest `tree` as JSON and the leaves for which `keep(leaf)` holds, as
    `(leaf_name, leaf)`. A dict is `{"dict": [[key, node], ...]}` (str keys only), a list or tuple
    `{"list": [node, ...]}` or `{"tuple": [...]}`, a kept leaf `{"tensor": name}`, an int, float, str,
    bool or None `{"value": v}` (numpy's scalars as Python's; a float that is not finite
    `{"float": "nan"}`, "inf" or "-inf"). Anything else raises TypeError naming where it is.

    >>> to_json({"w": "T", "n": [1, 0.5]}, lambda x: x == "T")
    ({'dict': [['w', {'tensor': 'w'}], ['n', {'list': [{'value': 1}, {'value': 0.5}]}]]}, [('w', 'T')])
    >>> to_json({"x": {1: 2}}, bool)
    Traceback (most recent call last):
    TypeError: key 1 of 'x' is of type int: the keys of a checkpoint's dicts must be str
    """
    kept = [] if kept is None else kept
    where = repr(leaf_name(keys)) if keys else "the top level"
    if isinstance(tree, dict):
        for k in tree:
            if not isinstance(k, str):
                raise TypeError(f"key {k!r} of {where} is of type {type(k).__name__}: the keys of a checkpoint's "
                                f"dicts must be str")
        return {"dict": [[k, to_json(v, keep, keys + (k,), kept)[0]] for k, v in tree.items()]}, kept
    if isinstance(tree, (list, tuple)):
        if hasattr(tree, "_fields"):
            raise TypeError(f"{where} is the namedtuple {type(tree).__name__}: save it as a dict (its _asdict())")
        kind = "tuple" if isinstance(tree, tuple) else "list"
        return {kind: [to_json(v, keep, keys + (i,), kept)[0] for i, v in enumerate(tree)]}, kept
    if keep(tree):
        kept.append((leaf_name(keys), tree))
        return {"tensor": leaf_name(keys)}, kept
    value = tree.item() if isinstance(tree, (np.bool_, np.integer, np.floating)) else tree
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}, kept
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}, kept
    hint = ": make it a DistTensor (mesh.from_numpy)" if isinstance(tree, np.ndarray) else ""
    raise TypeError(f"{where} is of type {type(tree).__name__}; a checkpoint holds DistTensors, ints, floats, str, "
                    f"bool and None in dicts, lists and tuples{hint}")


def from_json(description: dict, leaf: Callable[[str], object]):
    """The nest `to_json` described, each `{"tensor": name}` as `leaf(name)`; ValueError for a
    description `to_json` cannot have made.

    >>> from_json(to_json({"w": "T", "n": (1, float("inf"))}, lambda x: x == "T")[0], str.upper)
    {'w': 'W', 'n': (1, inf)}
    """
    if not isinstance(description, dict) or len(description) != 1:
        raise ValueError(f"node {description!r} is not a dict of one entry")
    (kind, body), = description.items()
    if kind == "dict" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        if any(not isinstance(k, str) for k, _ in body) or len({k for k, _ in body}) != len(body):
            raise ValueError(f"dict keys {[k for k, _ in body][:5]} are not distinct strs")
        return {k: from_json(v, leaf) for k, v in body}
    if kind in ("list", "tuple") and isinstance(body, list):
        values = [from_json(v, leaf) for v in body]
        return values if kind == "list" else tuple(values)
    if kind == "tensor" and isinstance(body, str):
        return leaf(body)
    if kind == "value" and (body is None or isinstance(body, (bool, int, str))
                            or isinstance(body, float) and math.isfinite(body)):
        return body
    if kind == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    raise ValueError(f"node {description!r} is none of dict, list, tuple, tensor, value, float")

