"""Nests of values: tuples (named ones too), lists and dicts, walked in one order everywhere.

`mm.compile` flattens a step's arguments and results, `mm.remat` finds the tensors of its
function's, and the cost model swaps tensors for shapes: all through `flatten` and `unflatten`, so
that a namedtuple or a dict means the same to each. Everything else is a leaf.

>>> import collections
>>> P = collections.namedtuple("P", "w b")
>>> leaves, structure = flatten({"p": P(1, 2), "xs": [3]})
>>> leaves, unflatten(structure, [10, 20, 30])
([1, 2, 3], {'p': P(w=10, b=20), 'xs': [30]})
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, Iterator


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
