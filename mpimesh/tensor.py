"""The distributed tensor and its creation from global or local arrays.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", layout="batch:all", comm=mm.MPI.COMM_SELF)
>>> t = mesh.from_numpy(np.arange(6.0).reshape(2, 3), "batch:2;io:3")
>>> t.layout, t.local.shape, float((t + 1).to_numpy().sum())
({'batch': 'all'}, (2, 3), 21.0)
"""
from __future__ import annotations

import numpy as np

from .backend import as_dtype, to_host
from .errors import ShapeError
from .layout import TensorLayout, layout_dict, layout_from_spec, local_sizes, slice_bounds
from .shape import Dimension, Shape, ShapeLike


PREVIEW_MAX = 1000  # a repr shows the values of tensors with at most this many elements


class DistTensor:
    """A tensor with named dims whose data is split over a mesh; each rank holds `local`.

    Attributes:
      shape: the global `Shape`.
      mesh: the `Mesh` it lives on.
      local: this rank's slice, axes in `shape` order.
    """

    __slots__ = ("mesh", "shape", "tensor_layout", "local", "__weakref__")
    __array_ufunc__ = None  # numpy scalars on the left defer to our operators

    def __init__(self, mesh, shape: Shape, tensor_layout: TensorLayout, local):
        self.mesh, self.shape, self.tensor_layout, self.local = mesh, shape, tensor_layout, local

    @property
    def layout(self) -> dict[str, str]:
        """`{tensor_dim_name: mesh_dim_name}` for the split dims."""
        return layout_dict(self.shape, self.tensor_layout)

    @property
    def dtype(self) -> np.dtype:
        return self.local.dtype

    def to_numpy(self) -> np.ndarray:
        """The global array, on every rank (a collective over the split mesh dims)."""
        x = self.local
        coll = self.mesh.collectives
        for axis, m in enumerate(self.tensor_layout):
            if m is not None:
                x = coll.allgather(x, m, axis)
        return to_host(x)

    def __repr__(self) -> str:
        """The global shape with names, dtype, layout and mesh, then the values if the tensor is
        small (at most `PREVIEW_MAX` elements) or replicated. A small split tensor's values are gathered, so like
        `to_numpy` its repr is a collective: every rank must take it (the REPL and `%%px` do).

        >>> import mpimesh as mm
        >>> mm.Mesh("all:1", comm=mm.MPI.COMM_SELF).ones("a:2;b:3")
        DistTensor [a:2, b:3] float32, layout {}, mesh [all:1]
        [[1. 1. 1.]
         [1. 1. 1.]]
        """
        from .collectives.counters import paused
        layout = ", ".join(f"{k}: {v}" for k, v in self.layout.items())
        head = f"DistTensor {self.shape} {self.dtype}, layout {{{layout}}}, mesh {self.mesh.shape}"
        if not self.layout:  # every rank holds every value: numpy's own summary, no communication
            return f"{head}\n{np.array2string(to_host(self.local), threshold=PREVIEW_MAX)}"
        if self.shape.size > PREVIEW_MAX:
            return f"{head}\n({self.shape.size} values, not gathered: t.to_numpy() on every rank shows them)"
        with paused():  # the display's gather is not the program's traffic
            values = self.to_numpy()
        return f"{head}\n{np.array2string(values, threshold=PREVIEW_MAX)}"

    def __bool__(self):
        raise TypeError("the truth value of a DistTensor is ambiguous: use mm.reduce_max/min and to_numpy()")

    def __len__(self) -> int:
        return self.shape[0].size if self.shape.rank else 0

    def __float__(self) -> float:
        if self.shape.size != 1:
            raise ShapeError(f"float() needs a one-element tensor, got shape {self.shape}")
        return float(self.to_numpy().reshape(()))


def _binop(name: str, swap: bool = False):
    def method(self, other):
        from .ops import elementwise
        fn = getattr(elementwise, name)
        return fn(other, self) if swap else fn(self, other)
    method.__name__ = name
    return method


for _name, _op in [("__add__", "add"), ("__sub__", "subtract"), ("__mul__", "multiply"),
                   ("__truediv__", "divide"), ("__pow__", "power"), ("__lt__", "less"),
                   ("__le__", "less_equal"), ("__gt__", "greater"), ("__ge__", "greater_equal"),
                   ("__eq__", "equal"), ("__ne__", "not_equal")]:
    setattr(DistTensor, _name, _binop(_op))
for _name, _op in [("__radd__", "add"), ("__rsub__", "subtract"), ("__rmul__", "multiply"),
                   ("__rtruediv__", "divide"), ("__rpow__", "power")]:
    setattr(DistTensor, _name, _binop(_op, swap=True))


def _neg(self):
    from .ops.elementwise import negative
    return negative(self)


DistTensor.__neg__ = _neg  # type: ignore[assignment]
DistTensor.__hash__ = object.__hash__  # type: ignore[assignment]


def _layout(mesh, shape: Shape, layout) -> TensorLayout:
    return mesh.plan(shape) if layout is None else layout_from_spec(shape, mesh.shape, layout)


def from_numpy(mesh, array, shape: ShapeLike, layout=None) -> DistTensor:
    """Every rank passes the same global `array`; each keeps only its slice.

    `layout` (rules string, list or dict; default: the rules in force) says which dims are split.
    """
    shape = Shape(shape)
    array = np.asarray(array)
    if array.shape != shape.sizes:
        raise ShapeError(f"from_numpy: array of shape {array.shape} does not match shape {shape}")
    tl = _layout(mesh, shape, layout)
    local = array[slice_bounds(shape, mesh.shape, tl, mesh.coords)]
    return DistTensor(mesh, shape, tl, mesh.xp.array(local, copy=True))


def from_local(local, shape: ShapeLike, mesh, layout=None) -> DistTensor:
    """Assemble a tensor from each rank's own slice (a collective: a wrong slice shape on any
    rank raises ShapeError on every rank)."""
    shape = Shape(shape)
    tl = _layout(mesh, shape, layout)
    want = local_sizes(shape, mesh.shape, tl)
    got = tuple(getattr(local, "shape", ()))
    if mesh.collectives.any_rank(got != want):
        raise ShapeError(f"from_local: each rank's slice of {shape} with layout {layout_dict(shape, tl)} "
                         f"must have shape {want}; rank {mesh.rank} has {got} (or another rank differs)")
    return DistTensor(mesh, shape, tl, mesh.xp.asarray(local))


def full(mesh, shape: ShapeLike, value, dtype="float32", layout=None) -> DistTensor:
    """A tensor filled with `value`."""
    shape = Shape(shape)
    tl = _layout(mesh, shape, layout)
    return DistTensor(mesh, shape, tl, mesh.xp.full(local_sizes(shape, mesh.shape, tl), value, as_dtype(dtype)))


def arange(mesh, dim: Dimension, dtype="int32", layout=None) -> DistTensor:
    """`0 .. dim.size-1` along `dim` (the API's `mm.range`)."""
    shape = Shape([dim])
    tl = _layout(mesh, shape, layout)
    (bounds,) = slice_bounds(shape, mesh.shape, tl, mesh.coords)
    return DistTensor(mesh, shape, tl, mesh.xp.arange(bounds.start, bounds.stop, dtype=as_dtype(dtype)))
