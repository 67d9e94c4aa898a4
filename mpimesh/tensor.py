"""The distributed tensor and its creation from global or local arrays.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", layout="batch:all", comm=mm.MPI.COMM_SELF)
>>> t = mesh.from_numpy(np.arange(6.0).reshape(2, 3), "batch:2;io:3")
>>> t.layout, t.local.shape, float((t + 1).to_numpy().sum())
({'batch': 'all'}, (2, 3), 21.0)
"""
from __future__ import annotations

import math
import zlib

import numpy as np

from .backend import as_dtype, check_dtype, is_float, to_host
from .counters import paused
from .errors import DTypeError, MpimeshError, ShapeError, by_rank
from .layout import TensorLayout, layout_dict, local_sizes, slice_bounds
from .opdef import OpDef
from .shape import Dimension, Shape, ShapeLike
from .stack import Stack
from .trace import dispatch, note_host_read, partials_alive, tensor_type


PREVIEW_MAX = 1000  # a repr shows the values of tensors with at most this many elements

host_reads = Stack()  # while `mm.compile` records a step: its hook, told of every read of values on the host


def host_read(t, what: str) -> None:
    """`t`'s values are read on the host (`what`): told to a recording `mm.compile` (which refuses
    it there and then) and noted in the open traces (`trace.note_host_read`)."""
    if host_reads:
        host_reads[-1](t, what)
    note_host_read(t, what)


class Donated:
    """What a tensor donated to a compiled step holds instead of its block (`mm.compile`'s
    `donate_argnums`): every use of it raises `MpimeshError` with `why` (the block's memory may
    now hold the step's results), on every rank alike, since every rank donates the same tensors."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        object.__setattr__(self, "why", why)

    def __getattr__(self, name: str):
        raise MpimeshError(self.why)

    def __array__(self, *args, **kwargs):
        raise MpimeshError(self.why)

    def _refuse(self, *args, **kwargs):
        raise MpimeshError(self.why)

    __len__ = __iter__ = __getitem__ = __setitem__ = __float__ = __int__ = __bool__ = __index__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __pow__ = __neg__ = __matmul__ = __rmatmul__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _refuse
    __hash__ = object.__hash__


@tensor_type
class DistTensor:
    """A tensor with named dims whose data is split over a mesh; each rank holds `local`."""

    # _origin is set by mm.load alone, unset elsewhere (read it as `origin`): no cost to other tensors
    __slots__ = ("mesh", "shape", "tensor_layout", "local", "_origin", "__weakref__")
    __array_ufunc__ = None  # numpy scalars on the left defer to our operators
    partial: tuple = ()
    """The mesh dims its values still await a sum over (DTensor's `Partial`): none, but for a
    `PartialTensor`."""

    def __init__(self, mesh, shape: Shape, tensor_layout: TensorLayout, local):
        self.mesh = mesh
        """The `Mesh` it lives on."""
        self.shape = shape
        """The global `Shape`, e.g. `Shape('batch:8;io:32')`."""
        self.tensor_layout = tensor_layout
        """Per dim of `shape`, the mesh dim it is split over or None: `('rows', None)` (`layout` as a dict)."""
        self.local = local
        """This rank's block (a numpy array; CuPy under the cupy backend), axes in `shape` order."""

    @property
    def layout(self) -> dict[str, str]:
        """`{tensor_dim_name: mesh_dim_name}` for the split dims."""
        return layout_dict(self.shape, self.tensor_layout)

    @property
    def dtype(self) -> np.dtype:
        """The element type, `local`'s: `dtype('float32')`."""
        return self.local.dtype

    @property
    def origin(self) -> tuple[str, str] | None:
        """`(checkpoint path, name in it)` of a tensor `mm.load` returned, else None: errors name them."""
        return getattr(self, "_origin", None)

    def to_numpy(self) -> np.ndarray:
        """The global array, on every rank (a collective over the split mesh dims: every rank must call it)."""
        if getattr(self.mesh, "dry", False):
            raise MpimeshError(f"this [{self.shape}] {self.dtype} tensor is on {self.mesh!r}: a dry run's "
                               f"tensors have shapes and layouts, no values")
        host_read(self, "to_numpy()")
        x = self.local
        coll = self.mesh.collectives
        for axis, m in enumerate(self.tensor_layout):
            if m is not None:
                x = coll.allgather(x, m, axis, self.shape[axis].size)
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
        layout = ", ".join(f"{k}: {v}" for k, v in self.layout.items())
        if isinstance(self.local, Donated):
            return f"DistTensor {self.shape}, layout {{{layout}}}, mesh {self.mesh.shape}\n({self.local.why})"
        head = f"DistTensor {self.shape} {self.dtype}, layout {{{layout}}}, mesh {self.mesh.shape}"
        if getattr(self.mesh, "dry", False):
            return f"{head}\n(a dry run: no values)"
        if host_reads and (not self.layout or self.shape.size <= PREVIEW_MAX):  # (values are read below: a
            host_reads[-1](self, "print() or repr()")                            # recording mm.compile refuses it)
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
        """The value of a one-element tensor (a collective, as `to_numpy`: every rank must call it)."""
        if self.shape.size != 1:
            raise ShapeError(f"float() needs a one-element tensor, got shape {self.shape}")
        host_read(self, "float()")
        return float(self.to_numpy().reshape(()))


DistTensor.__hash__ = object.__hash__  # type: ignore[assignment]


@tensor_type
class PartialTensor(DistTensor):
    """A tensor whose blocks hold this rank's terms of a sum over mesh dims `partial` not yet taken
    (DTensor's `Partial` placement): an einsum's local sums left to a gradient bucket. Only ops whose
    definition takes such inputs (`OpDef.partial_inputs`: the sum itself, `ops.relayout.sum_partial`)
    read it; `to_layout` sums it first.

    >>> import mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> t = PartialTensor(mesh, mm.Shape("a:2"), (None,), mesh.xp.ones(2), ("all",))
    >>> t.partial, repr(t).splitlines()[0]
    (('all',), 'DistTensor [a:2] float64, layout {}, partial over all, mesh [all:1]')
    """

    __slots__ = ("partial", "rounds_to")

    def __init__(self, mesh, shape: Shape, tensor_layout: TensorLayout, local, partial: tuple):
        super().__init__(mesh, shape, tensor_layout, local)
        self.partial = tuple(partial)
        self.rounds_to = None  # the 16-bit dtype its sum is rounded to (float32 terms of 16-bit operands)
        partials_alive[0] += 1

    def __del__(self):
        partials_alive[0] -= 1

    def to_numpy(self) -> np.ndarray:
        raise MpimeshError(f"this {self.shape} {self.dtype} tensor's values still await a sum over mesh dims "
                           f"{'+'.join(self.partial)}: sum it first (mm.relayout), or read the gradient "
                           f"mm.gradients returns")

    def __repr__(self) -> str:
        layout = ", ".join(f"{k}: {v}" for k, v in self.layout.items())
        return (f"DistTensor {self.shape} {self.dtype}, layout {{{layout}}}, partial over {'+'.join(self.partial)}, "
                f"mesh {self.mesh.shape}\n(each rank's terms of a sum not yet taken)")


def _layout(mesh, shape: Shape, layout) -> TensorLayout:
    return mesh.layout_of(shape, layout)


def tensor_arg(op: str, x, what: str = "x", floats: bool = False):
    """`x` if it is a tensor (of a float dtype, with `floats`), else a TypeError naming `op` and the
    argument `what` (a DTypeError for a tensor of another dtype): one check at each op's door,
    instead of an AttributeError from deep inside it."""
    if not (isinstance(x, DistTensor) or hasattr(x, "tensor_layout")):
        raise TypeError(f"{op}: {what} is a {type(x).__name__}, not a DistTensor (mesh.from_numpy makes one)")
    if floats and not is_float(x.dtype):
        raise DTypeError(f"{op}: {what} is a {x.shape} {x.dtype} tensor, and {op} needs floats: "
                         f"cast it first (mm.cast({what}, 'float32'))")
    return x


def block_sizes(ctx, shape: Shape, layout: TensorLayout) -> tuple:
    """The local sizes of `ctx`'s block of a tensor of `shape` laid out by `layout`, for a kernel
    that makes a tensor (`full`, the random ops): this rank's block on MPI, the largest block (the
    padded length) in a JAX replay; always Python ints."""
    return tuple(ctx.span(d.size, m)[1] for d, m in zip(shape, layout))


def from_numpy(mesh, array, shape: ShapeLike, layout=None) -> DistTensor:
    """Every rank passes the same global `array`; each keeps only its slice.

    `layout` (rules string, list or dict; default: the rules in force) says which dims are split.
    """
    shape = Shape(shape)
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):  # a list, a scalar: numpy reads it
        try:
            array = np.asarray(array)
        except (TypeError, ValueError) as e:  # a ragged list, say
            raise ShapeError(f"from_numpy: cannot read the value as an array of shape {shape}: {e}") from None
    if tuple(array.shape) != shape.sizes:
        raise ShapeError(f"from_numpy: array of shape {tuple(array.shape)} does not match shape {shape}")
    dt = check_dtype(np.dtype(array.dtype), f"from_numpy: the array's dtype (shape {shape})").newbyteorder("=")
    tl = _layout(mesh, shape, layout)
    local = array[slice_bounds(shape, mesh.shape, tl, mesh.coords)]
    return DistTensor(mesh, shape, tl, mesh.xp.array(local, dtype=dt, copy=True))


def from_local(local, shape: ShapeLike, mesh, layout=None) -> DistTensor:
    """Assemble a tensor from each rank's own slice: its block of every split dim, cut like
    `numpy.array_split` (so slices may differ in shape between ranks, or be empty). A collective
    (every rank must call it): a slice of the wrong shape on any rank raises ShapeError on every
    rank, and slices of differing or non-numeric dtypes DTypeError, each naming the ranks at fault."""
    shape = Shape(shape)
    tl = _layout(mesh, shape, layout)
    want = local_sizes(shape, mesh.shape, tl, mesh.coords)
    got = tuple(getattr(local, "shape", ()))
    dtype = getattr(local, "dtype", None)
    try:
        name = check_dtype(np.dtype(dtype) if dtype is not None else np.asarray(local).dtype).name
        bad_dtype = None
    except (DTypeError, TypeError, ValueError) as e:
        name, bad_dtype = None, str(e)
    mine = (got, want, name, bad_dtype)
    if mesh.size == 1:
        every = [mine]
    else:  # rank 0's dtype, then whether any rank differs or errs (guarded); if so, every rank's record
        mark = np.array([zlib.crc32(str(name).encode())], np.int64)
        other = mark[0] != mesh.collectives.broadcast(mark)[0]
        if not mesh.collectives.any_rank(got != want or bad_dtype is not None or other):
            return DistTensor(mesh, shape, tl, mesh.xp.asarray(local))
        every = mesh.comm_for(mesh.shape.names).allgather(mine)  # (small: pickled)
    where = f"from_local: the slices of {shape} with layout {layout_dict(shape, tl)}"
    wrong = [f"rank {r} passes shape {g}, its block is {w}" for r, (g, w, _, _) in enumerate(every) if g != w]
    if wrong:
        raise ShapeError(f"{where} must be each rank's block: {'; '.join(wrong)}")
    if any(b is not None for *_, b in every):
        raise DTypeError(f"{where} must hold numbers: {by_rank([b or 'numbers' for *_, b in every])}")
    if len({n for _, _, n, _ in every}) > 1:
        raise DTypeError(f"{where} must have one dtype on every rank: {by_rank([n for _, _, n, _ in every])}")
    return DistTensor(mesh, shape, tl, mesh.xp.asarray(local))


def full(mesh, shape: ShapeLike, value, dtype="float32", layout=None) -> DistTensor:
    """A tensor filled with `value`: the op "full" (recorded in a trace, params shape, dtype and
    value), whose kernel makes each rank's block with no communication.

    >>> import mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> with mm.trace() as tr:
    ...     t = full(mesh, "a:2;b:3", 7, "int32")
    >>> tr.ops[0].name, tr.ops[0].params["value"], int(t.to_numpy().sum())
    ('full', 7, 42)
    """
    shape = Shape(shape)
    dt = as_dtype(dtype)
    fill = fill_value(value, dt, f"full({shape})")
    tl = _layout(mesh, shape, layout)
    (t,) = dispatch(FULL, [], [(shape, tl)], {"shape": shape, "dtype": dt, "value": fill.item(), "layout": tl},
                    mesh=mesh)
    return t


def _full(ctx, *, shape: Shape, dtype, value, layout):
    return ctx.xp.full(block_sizes(ctx, shape, layout), np.asarray(value, dtype), dtype)  # (`fill_value`'s: exact)


FULL = OpDef("full", _full, fill="position")


def fill_value(value, dt: np.dtype, what: str):
    """`value` as a 0-d array of dtype `dt`; a DTypeError if it is not one number that `dt` can hold
    (a string, None, a list, 1000 for int8, 1.5 or nan for an integer dtype, 1e40 for float32, 1j
    for a real dtype).

    >>> fill_value(3, np.dtype("float32"), "full").dtype, fill_value(True, np.dtype("int8"), "full")
    (dtype('float32'), array(1, dtype=int8))
    """
    if isinstance(value, int) and not isinstance(value, bool) and not -2 ** 63 <= value < 2 ** 64:
        if dt.kind in "iu":  # beyond every integer dtype
            raise DTypeError(f"{what}: the value {value} is outside the range of dtype {dt}")
        if not -(2 ** 1024) < value < 2 ** 1024:  # beyond float64
            raise DTypeError(f"{what}: the value {value} overflows dtype {dt}")
        value = float(value)
    try:
        v = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise DTypeError(f"{what}: cannot read {value!r} as a number of dtype {dt} ({e})") from None
    if v.ndim != 0 or v.dtype.kind not in "biufc":
        raise DTypeError(f"{what}: the value must be one number, got {value!r} (numpy dtype {v.dtype}, "
                         f"shape {v.shape})")
    if v.dtype.kind == "c" and dt.kind != "c":
        if v.imag != 0:
            raise DTypeError(f"{what}: the complex value {value!r} does not fit dtype {dt}")
        v = v.real
    if dt.kind == "b":
        return np.asarray(bool(v), dt)
    if dt.kind in "iu":
        if v.dtype.kind == "f":
            f = float(v)
            if not (math.isfinite(f) and f.is_integer()):
                raise DTypeError(f"{what}: the value {value!r} is not an integer, so dtype {dt} cannot hold it")
            n = int(f)
        else:
            n = int(v.item())
        info = np.iinfo(dt)
        if not info.min <= n <= info.max:
            raise DTypeError(f"{what}: the value {value!r} is outside the range [{info.min}, {info.max}] "
                             f"of dtype {dt}")
        return np.asarray(n, dt)
    with np.errstate(over="raise", invalid="raise"):
        try:
            return np.asarray(v.astype(dt))
        except FloatingPointError:
            raise DTypeError(f"{what}: the value {value!r} overflows dtype {dt}") from None


def _largest_whole(dt: np.dtype) -> int:
    """The largest n such that dtype `dt` holds every whole number 0..n exactly."""
    if dt.kind in "iu":
        return int(np.iinfo(dt).max)
    k = 1
    while np.array(2 ** k + 1, dt).real.item() == 2 ** k + 1:  # (exact: a Python int against the stored value)
        k += 1
    return 2 ** k


def arange(mesh, dim: Dimension, dtype="int32", layout=None) -> DistTensor:
    """`0 .. dim.size-1` along `dim` (the API's `mm.range`)."""
    shape = Shape([dim])
    dt = as_dtype(dtype)
    last = shape.sizes[0] - 1
    if dt.kind == "b" or last > _largest_whole(dt):
        raise DTypeError(f"range({shape}): dtype {dt.name} cannot count 0..{last}"
                         f"{'' if dt.kind == 'b' else f' (it holds whole numbers up to {_largest_whole(dt)} exactly)'}")
    tl = _layout(mesh, shape, layout)
    (bounds,) = slice_bounds(shape, mesh.shape, tl, mesh.coords)
    return DistTensor(mesh, shape, tl, mesh.xp.arange(bounds.start, bounds.stop, dtype=dt))
