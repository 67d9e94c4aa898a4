"""Multi-head attention with named dims, as in Mesh-TensorFlow: a composition of public ops.

Keys and values get the input's length dim renamed to the memory-length dim, so the logits
`[..., length, heads, memory_length]` have both. With heads split every op runs on local heads and
only the output projection is an allreduce; with batch split nothing is communicated. The causal
mask (-1e9 past the query's position) is applied inside the softmax (`causal=length`), from global
positions, with no mask tensor; `causal_bias` makes the same mask as a tensor.

>>> import mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> p = mm.layers.init_attention(mesh, 0, "d_model:8", "heads:2", "d_kv:4")
>>> x = mesh.random_normal("batch:2;length:5;d_model:8", seed=1)
>>> mm.layers.multihead_attention(p, x, causal=True).shape
Shape('[batch:2, length:5, d_model:8]')
"""
from __future__ import annotations

from ..backend import as_dtype
from ..errors import MpimeshError, ShapeError
from ..ops.einsum import einsum
from ..ops.elementwise import cast, less
from ..ops.nn import MASK_VALUE, mask_value, softmax  # noqa: F401 (MASK_VALUE: this module's name for it)
from ..ops.reshape import rename_dimension
from ..shape import Dimension, Shape
from ..tensor import arange
from .core import DimLike, Params, as_dim, dense, subseed



def init_attention(mesh, seed: int, model_dim: DimLike, heads_dim: DimLike, kv_dim: DimLike,
                   dtype="float32") -> Params:
    """Projections `q, k, v: [model, heads, d_kv]` (stddev 1/sqrt(model)) and
    `o: [heads, d_kv, model]` (stddev 1/sqrt(heads·d_kv)), without biases."""
    m, h, k = as_dim(model_dim), as_dim(heads_dim), as_dim(kv_dim)
    p = {}
    for name in ("q", "k", "v"):
        p[name] = {"kernel": mesh.random_normal([m, h, k], subseed(seed, name), stddev=m.size ** -0.5, dtype=dtype)}
    p["o"] = {"kernel": mesh.random_normal([h, k, m], subseed(seed, "o"), stddev=(h.size * k.size) ** -0.5,
                                           dtype=dtype)}
    return p


def causal_bias(mesh, length: Dimension, memory_length: Dimension, dtype="float32"):
    """`[length, memory_length]`: MASK_VALUE where the memory position is after the query
    position, else 0 (from two `mm.range`s; no communication). A dtype that cannot hold
    MASK_VALUE (float16) gets its lowest finite value instead. (The dims in the logits' order:
    adding it broadcasts along contiguous rows.)

    >>> import mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> b = causal_bias(mesh, mm.Dimension("length", 3), mm.Dimension("memory_length", 3))
    >>> (b.to_numpy() < 0).astype(int).tolist()
    [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    """
    future = less(arange(mesh, length), arange(mesh, memory_length))
    dt = as_dtype(dtype)
    return cast(future, dt) * mask_value(dt)


def _names(dims) -> list:
    """"name:size" of each Dimension, sorted."""
    return sorted(f"{d.name}:{d.size}" for d in dims)


def multihead_attention(params: Params, x, length_dim: str = "length", memory=None,
                        memory_length_dim: str = "memory_length", causal: bool = False, bias=None):
    """Multi-head dot-product attention of `x` over itself (or over `memory`).

    Args:
      params: from `init_attention` (`q`, `k`, `v`, `o` kernels; the model dim is the one
        shared with x, the heads and d_kv dims the kernel's others, which x must not have).
      x: queries `[..., length, model]`.
      length_dim: the name of x's (and memory's) sequence dim.
      memory: keys/values source `[..., length, model]`: x's dims, the length's size aside;
        default x (self-attention).
      memory_length_dim: the name the keys' sequence dim takes (a name x and the kernels lack).
      causal: mask memory positions after the query position (needs equal lengths).
      bias: an extra additive bias broadcast onto the logits `[..., heads, length, memory_length]` (by dim name).
    Returns:
      `[..., length, model]`, x's dims.
    """
    missing = [n for n in ("q", "k", "v", "o") if n not in params]
    if missing:
        raise MpimeshError(f"multihead_attention: params lack {missing}; they have {list(params)} "
                           f"(see init_attention)")
    if length_dim not in x.shape:
        raise ShapeError(f"multihead_attention: length dim {length_dim!r} is not in x {x.shape}")
    src = x if memory is None else memory
    if length_dim not in src.shape:
        raise ShapeError(f"multihead_attention: length dim {length_dim!r} is not in memory {src.shape}")
    xd, md = (set(t.shape.without([length_dim]).dims) for t in (x, src))
    if xd != md:
        raise ShapeError(f"multihead_attention: memory {src.shape} must have the dims of x {x.shape}, the length "
                         f"{length_dim!r} aside; extra in memory: {_names(md - xd)}, missing from memory: "
                         f"{_names(xd - md)}")
    wq = params["q"]["kernel"]
    shared = [n for n in wq.shape.names if n in x.shape]
    if len(shared) > 1:
        raise ShapeError(f"multihead_attention: x {x.shape} must share only the model dim with the q kernel "
                         f"{wq.shape}, but shares {shared}: x must not have the heads or d_kv dims")
    if memory_length_dim in x.shape or memory_length_dim in wq.shape:
        raise ShapeError(f"multihead_attention: memory_length_dim {memory_length_dim!r} must be a new name, but "
                         f"x {x.shape} or the q kernel {wq.shape} has it")
    kv_dim = wq.shape[-1]
    q = dense(params["q"], x) * (kv_dim.size ** -0.5)              # [..., length, heads, d_kv]
    k = rename_dimension(dense(params["k"], src), length_dim, memory_length_dim)
    v = rename_dimension(dense(params["v"], src), length_dim, memory_length_dim)
    mem = k.shape[memory_length_dim]
    # [..., heads, length, memory_length]: the batched GEMM's own order (the heads beside the other batch
    # dims), so that neither this product nor weights·v below copies a logits-sized array to reorder it
    length = x.shape[length_dim]
    logits = einsum([q, k], output_shape=q.shape.without([kv_dim.name, length_dim]) + Shape([length, mem]))
    if causal:
        if length.size != mem.size:
            raise ShapeError(f"multihead_attention: causal needs equal lengths, got {length_dim}:{length.size} "
                             f"and {memory_length_dim}:{mem.size}")
    weights = softmax(logits, memory_length_dim, bias=bias, causal=length_dim if causal else None)  # one op
    o = einsum([weights, v], output_shape=q.shape)                  # [..., length, heads, d_kv]
    return dense(params["o"], o)
