"""The mesh's creation methods (`mesh.from_numpy`, `zeros`, `ones`, `full`, `random_normal`,
`random_uniform`), attached to `Mesh` and `DryMesh` here, above the op layer.

`mesh.py` sits below the ops: a mesh is a shape, rules and communicators, and planning code uses
it (or an `AbstractMesh`) without loading any op. Tensor creation belongs with tensors
(`tensor.from_numpy`, `tensor.full`) and the random ops (`ops/random.py`); the methods the API
spells on the mesh are bound here, and `mpimesh/__init__` imports this module, so every
`import mpimesh...` has them.

>>> import mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> float(mesh.full("a:2", 3.0).to_numpy().sum()), mesh.zeros.__qualname__
(6.0, 'Mesh.zeros')
"""
from __future__ import annotations

from .dryrun import DryMesh
from .mesh import Mesh
from .ops.random import random_normal, random_uniform
from .tensor import from_numpy, full


def _from_numpy(self, array, shape, layout=None):
    """Every rank passes the same global `array`; each keeps only its slice (see `mm.from_numpy`)."""
    return from_numpy(self, array, shape, layout)


def _zeros(self, shape, dtype="float32", layout=None):
    """A tensor of zeros (the op "full")."""
    return full(self, shape, 0, dtype, layout)


def _ones(self, shape, dtype="float32", layout=None):
    """A tensor of ones (the op "full")."""
    return full(self, shape, 1, dtype, layout)


def _full(self, shape, value, dtype="float32", layout=None):
    """A tensor filled with `value` (the op "full")."""
    return full(self, shape, value, dtype, layout)


def _random_normal(self, shape, seed, mean=0.0, stddev=1.0, dtype="float32", layout=None):
    """Normal values that depend only on `seed` and `shape`, never on the mesh or layout."""
    return random_normal(self, shape, seed, mean, stddev, dtype, layout)


def _random_uniform(self, shape, seed, minval=0.0, maxval=1.0, dtype="float32", layout=None):
    """Uniform values in [minval, maxval) that depend only on `seed` and `shape`."""
    return random_uniform(self, shape, seed, minval, maxval, dtype, layout)


METHODS = {"from_numpy": _from_numpy, "zeros": _zeros, "ones": _ones, "full": _full,
           "random_normal": _random_normal, "random_uniform": _random_uniform}

for _name, _fn in METHODS.items():
    _fn.__name__, _fn.__qualname__ = _name, f"Mesh.{_name}"
    setattr(Mesh, _name, _fn)
    setattr(DryMesh, _name, _fn)
