"""Layout-independent random tensors: element i of the global array is a hash of (seed, i).

Each rank hashes only the global indices of its own slice (a SplitMix64-style finaliser over a
counter), so the values are the same on 1 rank and on 8, whatever the layout. Both are ops with no
inputs ("random_uniform", "random_normal"): a trace records them with their seed, and a JAX replay
runs the same kernel.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> a = mesh.random_uniform("a:2;b:3", seed=7).to_numpy()
>>> b = mesh.random_uniform("a:2;b:3", seed=7, layout="b:all").to_numpy()
>>> bool((a == b).all()), bool(((0 <= a) & (a < 1)).all())
(True, True)
"""
from __future__ import annotations

import math
import numbers
import operator
import zlib

import numpy as np

from ..backend import as_dtype, finfo, is_float
from ..errors import DTypeError, MpimeshError
from ..layout import slice_bounds
from ..shape import Shape, ShapeLike
from ..opdef import OpDef, size
from ..tensor import block_sizes
from ..trace import dispatch
from .relayout import to_layout

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(z):
    """SplitMix64's finaliser on a uint64 array (wrapping arithmetic: numpy warns of the wrap only
    for a 0-d array, the slice of a scalar tensor, so that warning is off)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_key(seed: int, stream: int) -> np.uint64:
    """The hash's key for `seed` and `stream` (added to each scaled index before mixing)."""
    z = np.array([(seed * 0xD1B54A32D192ED03 + stream * _GOLDEN + 0x632BE59BD9B4E019) & _MASK], np.uint64)
    return _mix(z)[0]


def global_index(xp, shape: Shape, mesh_shape: Shape, layout, coords, sizes: tuple) -> "np.ndarray":
    """The row-major global flat index of every element of the slice at `coords` (uint64), whose
    sizes are `sizes` (Python ints, also where a JAX replay traces the coordinates).

    >>> global_index(np, Shape("a:2;b:5"), Shape("x:3"), (None, "x"), {"x": 2}, (2, 1)).tolist()
    [[4], [9]]
    """
    starts, strides = index_terms(shape, mesh_shape, layout, coords)
    idx = xp.zeros((1,) * shape.rank, dtype=np.uint64)
    for axis in reversed(range(shape.rank)):
        # arange(size) + start, not arange(start, stop): under a JAX replay `start` is traced
        start = xp.asarray(starts[axis], dtype=np.uint64)
        ar = (xp.arange(sizes[axis], dtype=np.uint64) + start) * np.uint64(strides[axis])
        idx = idx + ar.reshape((1,) * axis + (-1,) + (1,) * (shape.rank - axis - 1))
    return idx


def index_terms(shape: Shape, mesh_shape: Shape, layout, coords) -> tuple[list, list]:
    """`(starts, strides)`: where the slice at `coords` starts along each axis of the global tensor,
    and the global row-major stride of each axis; an element's global flat index is the sum over
    axes of (its local index + start) * stride.

    >>> index_terms(Shape("a:2;b:5"), Shape("x:3"), (None, "x"), {"x": 2})
    ([0, 4], [5, 1])
    """
    bounds = slice_bounds(shape, mesh_shape, layout, coords)
    strides, stride = [0] * shape.rank, 1
    for axis in reversed(range(shape.rank)):
        strides[axis] = stride
        stride *= shape.sizes[axis]
    return [b.start for b in bounds], strides


def key(xp, seed, stream: int):
    """`hash_key(seed, stream)` for an int seed, or computed by `xp` from a seed tensor's 0-d array
    (the same uint64 for the same value, so a seed tensor draws what its value as an int draws)."""
    if isinstance(seed, int):
        return hash_key(seed, stream)
    with np.errstate(over="ignore"):
        z = xp.asarray(seed).astype(np.uint64) * np.uint64(0xD1B54A32D192ED03) \
            + np.uint64((stream * _GOLDEN + 0x632BE59BD9B4E019) & _MASK)
        return _mix(z)


def uniform01(xp, index, seed, stream: int = 0):
    """Float64 uniforms in [0, 1) for each global index; `seed` an int or a seed tensor's array."""
    with np.errstate(over="ignore"):  # wrapping arithmetic (see _mix)
        bits = _mix(index * np.uint64(_GOLDEN) + key(xp, seed, stream))
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def check_seed(seed, what: str):
    """`seed` as an int (numpy's ints too), or a seed tensor (a 0-d integer DistTensor, replicated:
    its value is read by the op's kernel, so a compiled step draws new numbers from a new value); an
    MpimeshError for anything else."""
    if hasattr(seed, "tensor_layout"):
        if seed.shape.rank or seed.dtype.kind not in "iu":
            raise MpimeshError(f"{what}: a seed tensor must be a 0-d integer tensor, got shape {seed.shape} "
                               f"and dtype {seed.dtype}")
        return seed
    if isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise MpimeshError(f"{what}: the seed must be an integer or a 0-d integer tensor, got {seed!r}")
    if not -2 ** 63 <= operator.index(seed) < 2 ** 64:  # (wider seeds would alias others modulo 2**64)
        raise MpimeshError(f"{what}: the seed must fit in 64 bits, got {seed}")
    return operator.index(seed)


def seed_inputs(seed, mesh, what: str) -> list:
    """The op's inputs for `seed`: none for an int, the seed tensor (replicated) for a tensor."""
    if isinstance(seed, int):
        return []
    if seed.mesh is not mesh:
        raise MpimeshError(f"{what}: the seed tensor lives on another mesh than the op's")
    return [to_layout(seed, ())]


def derive_seed(seed, name: str):
    """A seed tensor for `name` from seed tensor `seed` (a hash of both, 31 bits; `layers.subseed`
    for seed tensors): an op, so a compiled step derives it anew from each seed it is given.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> s = mesh.from_numpy(np.array(5), ())
    >>> a, b = derive_seed(s, "kernel").to_numpy(), derive_seed(s, "bias").to_numpy()
    >>> int(a) != int(b), a.dtype
    (True, dtype('int64'))
    """
    seed = check_seed(seed, "derive_seed")
    (t,) = dispatch(DERIVE_SEED, seed_inputs(seed, seed.mesh, "derive_seed"), [(Shape(()), ())],
                    {"name": name, "salt": zlib.crc32(name.encode())})
    return t


def _derive_seed(ctx, s, *, name, salt):
    return (key(ctx.xp, s, salt) & np.uint64(0x7FFFFFFF)).astype(np.int64)


DERIVE_SEED = OpDef("derive_seed", _derive_seed, fill="position",
                    abstract=lambda ctx, shapes, s, **params: (np.dtype(np.int64),))


def _real(value, what: str) -> float:
    """`value` as a float (a Python or numpy real number); a DTypeError for anything else."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise DTypeError(f"{what} must be a real number, got {value!r}")
    try:
        f = float(value)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise DTypeError(f"{what} must be finite, got {value!r}")
    return f


def _random(op: OpDef, mesh, shape: ShapeLike, layout, seed, params: dict):
    """The op `op` (no inputs, or the seed tensor): each rank fills its block from the global indices it holds."""
    shape = Shape(shape)
    tl = mesh.layout_of(shape, layout)
    inputs = seed_inputs(seed, mesh, op.name)
    (t,) = dispatch(op, inputs, [(shape, tl)], {"shape": shape, **params, "seed": None if inputs else seed,
                                                "layout": tl, "mesh_shape": mesh.shape}, mesh=mesh)
    return t


def _index(ctx, shape: Shape, layout, mesh_shape: Shape):
    """The global flat indices of this rank's block (`global_index`)."""
    coords = {m: ctx.coord(m) for m in layout if m}
    return global_index(ctx.xp, shape, mesh_shape, layout, coords, block_sizes(ctx, shape, layout))


def random_uniform(mesh, shape: ShapeLike, seed, minval=0.0, maxval=1.0, dtype="float32", layout=None):
    """Uniform values in [minval, maxval) that depend only on `seed` (an int, or a seed tensor: see
    `check_seed`) and `shape`."""
    dt = as_dtype(dtype)
    seed = check_seed(seed, "random_uniform")
    minval, maxval = _real(minval, "random_uniform: minval"), _real(maxval, "random_uniform: maxval")
    if dt.kind == "b":
        raise DTypeError("random_uniform: dtype bool has no range to draw from: draw floats and compare "
                         "(mesh.random_uniform(...) < p)")
    if maxval < minval:
        raise MpimeshError(f"random_uniform: minval {minval} is above maxval {maxval}")
    lo, top = (int(np.iinfo(dt).min), int(np.iinfo(dt).max)) if dt.kind in "iu" else \
        (-float(finfo(dt).max), float(finfo(dt).max))
    if minval < lo or maxval > top + (dt.kind in "iu"):  # (astype would wrap or saturate: values outside the range)
        raise DTypeError(f"random_uniform: [{minval}, {maxval}) does not fit dtype {dt.name}, which holds {lo} to "
                         f"{top}: narrow the range or widen the dtype")
    return _random(RANDOM_UNIFORM, mesh, shape, layout, seed, {"minval": minval, "maxval": maxval, "dtype": dt})


def _uniform(ctx, *s, shape, minval, maxval, dtype, seed, layout, mesh_shape):
    y = minval + (maxval - minval) * uniform01(ctx.xp, _index(ctx, shape, layout, mesh_shape), s[0] if s else seed)
    y = (ctx.xp.floor(y) if dtype.kind in "iu" else y).astype(dtype)  # whole numbers: floor, in [minval, maxval)
    if is_float(dtype) and maxval > minval:  # rounding to dtype may reach maxval: clamp below it
        top = dtype.type(maxval)
        top = top if top < maxval else np.nextafter(top, dtype.type(-np.inf))
        y = ctx.xp.minimum(y, top)
    return y


def random_normal(mesh, shape: ShapeLike, seed, mean=0.0, stddev=1.0, dtype="float32", layout=None):
    """Normal values (Box-Muller) that depend only on `seed` (an int or a seed tensor) and `shape`."""
    dt = as_dtype(dtype)
    if not (is_float(dt) or dt.kind == "c"):
        raise DTypeError(f"random_normal: dtype {dt.name} cannot hold normal values: draw a float dtype")
    seed = check_seed(seed, "random_normal")
    mean, stddev = _real(mean, "random_normal: mean"), _real(stddev, "random_normal: stddev")
    return _random(RANDOM_NORMAL, mesh, shape, layout, seed, {"mean": mean, "stddev": stddev, "dtype": dt})


def _normal(ctx, *s, shape, mean, stddev, dtype, seed, layout, mesh_shape):
    xp, index, seed = ctx.xp, _index(ctx, shape, layout, mesh_shape), s[0] if s else seed
    u1 = 1.0 - uniform01(xp, index, seed, 0)  # in (0, 1]: log is finite
    u2 = uniform01(xp, index, seed, 1)
    z = xp.sqrt(-2.0 * xp.log(u1)) * xp.cos(2.0 * math.pi * u2)
    return (mean + stddev * z).astype(dtype)


# Flops per element: uniform: the uniform's scaling to [0, 1), then minval + width * u (the rounding, floor
# and clamp not counted); normal: two uniforms' scalings, 1 - u1, log, -2 *, sqrt, 2 pi *, cos, their
# product, then mean + stddev * z.
RANDOM_UNIFORM = OpDef("random_uniform", _uniform, fill="position", flops=lambda params, ins, outs: 3 * size(outs[0]))
RANDOM_NORMAL = OpDef("random_normal", _normal, fill="position", flops=lambda params, ins, outs: 11 * size(outs[0]))
