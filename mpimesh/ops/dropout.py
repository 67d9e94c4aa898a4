"""Dropout with a layout-independent mask.

Whether element i of the global tensor is kept is a hash of (seed, i) (the counter-based hash of
`ops/random.py`), so for the same seed and shape the mask is the same on 1 rank or 8, under any
layout, and each rank computes only its own slice of it: no communication.

Its CuPy kernel is one `ElementwiseKernel` (`DROPOUT_SOURCE`, float16/32/64): each element's global
index from its local one, the hash, the mask and the scale, nothing written but the output.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> y = mm.dropout(mesh.ones("a:1000"), 0.25, seed=3).to_numpy()
>>> sorted(set(y.tolist())) == [0.0, np.float32(1 / 0.75)], bool(abs((y > 0).mean() - 0.75) < 0.05)
(True, True)
"""
from __future__ import annotations

import numbers

import numpy as np

from ..backend import cached_kernel, index_constant
from ..errors import MpimeshError
from ..opdef import OpDef, size
from ..trace import dispatch
from .random import check_seed, global_index, index_terms, key, seed_inputs, uniform01
from .relayout import to_layout

_STREAM = 0x44524F50  # "DROP": a stream of the hash that random_uniform/random_normal do not use

DROPOUT_SOURCE = """
    unsigned long long rest = i, g = 0;
    for (int a = rank - 1; a >= 0; --a) {       // the global flat index, from the local one
        unsigned long long c = rest % sizes[a];
        rest /= sizes[a];
        g += (c + starts[a]) * strides[a];
    }
    unsigned long long z = g * 0x9E3779B97F4A7C15ULL + key;   // ops/random.py's uniform01
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    y = (double)(z >> 11) * (1.0 / 9007199254740992.0) >= rate ? (T)(x * scale) : (T)0;
"""
"""The CuPy kernel of `dropout`: the numpy lowering's hash, mask and scale in one pass."""
DROPOUT_PARAMS = ("T x, raw uint64 sizes, raw uint64 starts, raw uint64 strides, int32 rank, uint64 key, "
                  "float64 rate, T scale", "T y")
_KERNEL_DTYPES = ("float16", "float32", "float64")


def _masked(xp, a, rate: float, scale: float, seed, starts: list, strides: list):
    """`DROPOUT_SOURCE` on the local block `a` (compiled on first use; its index terms are tiny
    device arrays, made once: no host copy when a CUDA graph captures it)."""
    kernel = cached_kernel(("dropout",),
                           lambda: xp.ElementwiseKernel(*DROPOUT_PARAMS, DROPOUT_SOURCE, "mpimesh_dropout"))
    terms = [index_constant(xp, tuple(v), np.uint64) for v in (a.shape, starts, strides)]
    return kernel(a, *terms, np.int32(a.ndim), key(xp, seed, _STREAM), rate, a.dtype.type(scale))


def dropout(x, rate: float, seed):
    """x with each element zeroed with probability `rate` and the kept ones scaled by 1/(1-rate).

    The mask depends only on `seed` (an int, or a seed tensor: `mpimesh.ops.random.check_seed`) and
    x's shape. `rate` 0 returns x. Gradient: dy through the same mask and scale.
    """
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
        raise MpimeshError(f"dropout rate must be a number in [0, 1), got {rate!r}")
    rate = float(rate)
    seed = check_seed(seed, "dropout")
    if rate == 0.0:
        return x
    layout = x.mesh.plan(x.shape)
    x = to_layout(x, layout)
    extra = seed_inputs(seed, x.mesh, "dropout")
    (y,) = dispatch(DROPOUT, [x, *extra], [(x.shape, layout)],
                    {"rate": rate, "seed": None if extra else seed, "shape": x.shape, "mesh_shape": x.mesh.shape,
                     "layout": layout})
    return y


def _coords(ctx, layout) -> dict:
    return {m: ctx.coord(m) for m in layout if m}


def _dropout(ctx, a, *s, rate, seed, shape, mesh_shape, layout):
    """x's block `a` masked and scaled; `s`: the seed tensor's block, if the seed is one."""
    xp = ctx.xp
    index = global_index(xp, shape, mesh_shape, layout, _coords(ctx, layout), a.shape)
    keep = uniform01(xp, index, s[0] if s else seed, _STREAM) >= rate
    return xp.where(keep, a * (1.0 / (1.0 - rate)), xp.zeros((), dtype=a.dtype)).astype(a.dtype)


def _dropout_cupy(ctx, a, *s, rate, seed, shape, mesh_shape, layout):
    if a.dtype.name in _KERNEL_DTYPES:
        return _masked(ctx.xp, a, rate, 1.0 / (1.0 - rate), s[0] if s else seed,
                       *index_terms(shape, mesh_shape, layout, _coords(ctx, layout)))
    return _dropout(ctx, a, *s, rate=rate, seed=seed, shape=shape, mesh_shape=mesh_shape, layout=layout)


def _rule(op, dy):
    sd = op.inputs[1] if len(op.inputs) > 1 else op.params["seed"]
    return [dropout(dy, op.params["rate"], sd)] + [None] * (len(op.inputs) - 1)


DROPOUT = OpDef("dropout", _dropout, kernels={"cupy": _dropout_cupy}, grad=_rule, saves=((1,), ()), fill="position",
                # the uniform's scaling to [0, 1), the comparison with the rate, the kept element's scaling
                flops=lambda params, ins, outs: 3 * size(outs[0]))
