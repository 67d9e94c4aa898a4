"""Dense, layer norm, RMS norm, embedding and feed-forward layers: compositions of public ops, no
communication code of their own. Functional: an `init_*` function makes a layer's parameters (a dict of
DistTensors laid out by the rules in force) from an integer seed with `mesh.random_normal`, the same
values on any mesh and layout; the layer function takes `(params, x, ...)`. Parameter dicts nest;
`flatten`/`unflatten` turn a tree of them into the flat `{"a/b/c": tensor}` dict optimizers and
checkpoints take. Mixed precision: parameters stay float32 (the optimizer's masters); a layer computes
in its input's dtype, casting each parameter to it (`like`), so their gradients, through the cast, are
float32; `embedding` takes the activations' `dtype`; the norms' statistics are float32 whatever the input.

>>> import mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> p = mm.layers.init_dense(mesh, 0, "io:4", "hidden:8")
>>> mm.layers.dense(p, mesh.ones("batch:2;io:4")).shape, sorted(p)
(Shape('[batch:2, hidden:8]'), ['bias', 'kernel'])
"""
from __future__ import annotations

import zlib
from typing import Callable, Mapping, Optional, Union

from ..backend import is_float
from ..errors import MpimeshError, ShapeError
from ..ops.activation import bias_activation
from ..ops.einsum import einsum
from ..ops.elementwise import cast, gelu, relu, tanh
from ..ops.indexing import gather
from ..ops.norm import layer_norm as normalize
from ..ops.norm import rms_norm as normalize_rms
from ..ops.random import derive_seed
from ..shape import Dimension, Shape, ShapeLike, dim_names, union_shape

Params = dict
DimLike = Union[Dimension, str, tuple]

ACTIVATIONS: dict[str, Callable] = {"relu": relu, "gelu": gelu, "tanh": tanh}


def subseed(seed, name: str):
    """A seed for the parameter `name` of a layer seeded with `seed` (deterministic, 31 bits): an
    int from an int; from a seed tensor (a 0-d integer tensor), a seed tensor made by an op
    (`ops.random.derive_seed`), so that a compiled step derives new seeds from each seed it is given.

    >>> subseed(0, "kernel") == subseed(0, "kernel") != subseed(1, "kernel")
    True
    """
    if hasattr(seed, "tensor_layout"):
        return derive_seed(seed, name)
    return zlib.crc32(f"{int(seed)}/{name}".encode()) & 0x7FFFFFFF


def like(w, x):
    """Parameter `w` cast to the dtype of activation `x` where both are floats of different dtypes
    (a float32 master used in bfloat16 compute); `w` itself otherwise.

    >>> import mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> like(mesh.ones("a:2"), mesh.ones("b:2", "bfloat16")).dtype
    dtype(bfloat16)
    """
    if w.dtype != x.dtype and is_float(w.dtype) and is_float(x.dtype):
        return cast(w, x.dtype)
    return w


def checked(params, what: str, need: tuple, may: tuple = ()) -> Mapping:
    """`params` if it is a dict with every key of `need` and no key beyond `need` and `may` (a
    misspelt "scale" would be skipped silently), else an error naming the keys.

    >>> checked({"kernel": 1, "bais": 2}, "dense", ("kernel",), ("bias",))
    Traceback (most recent call last):
    mpimesh.errors.MpimeshError: dense: params have ['bais'], none of ['kernel', 'bias']
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"{what}: params must be a dict, got a {type(params).__name__}")
    missing, extra = [k for k in need if k not in params], [k for k in params if k not in need + may]
    if missing:
        raise MpimeshError(f"{what}: params lack {missing}; they have {list(params)}")
    if extra:
        raise MpimeshError(f"{what}: params have {extra}, none of {list(need + may)}")
    return params


def as_dim(d: DimLike) -> Dimension:
    """A Dimension from a Dimension, a `(name, size)` pair or `"name:size"`."""
    s = Shape([d]) if not isinstance(d, str) else Shape(d)
    if s.rank != 1:
        raise ShapeError(f"expected one dim, got {s}")
    return s[0]


def flatten(tree: Mapping, prefix: str = "") -> dict:
    """A nested dict of tensors as one flat dict with `/`-joined keys (insertion order kept).

    >>> flatten({"a": {"w": 1, "b": 2}, "c": 3})
    {'a/w': 1, 'a/b': 2, 'c': 3}
    """
    out: dict = {}
    for k, v in tree.items():
        if "/" in str(k):
            raise ValueError(f"flatten: key {k!r} contains '/'")
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def unflatten(flat: Mapping) -> dict:
    """The inverse of `flatten`.

    >>> unflatten({"a/w": 1, "a/b": 2, "c": 3})
    {'a': {'w': 1, 'b': 2}, 'c': 3}
    """
    out: dict = {}
    for key, v in flat.items():
        node = out
        *path, last = key.split("/")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = v
    return out


# ------------------------------------------------------------------------------------- dense

def init_dense(mesh, seed: int, input_dims: ShapeLike, output_dims: ShapeLike, use_bias: bool = True,
               stddev: Optional[float] = None, dtype="float32") -> Params:
    """`{"kernel": [input_dims..., output_dims...], "bias": [output_dims...]}`; the kernel is
    N(0, stddev²) with stddev = 1/sqrt(product of input sizes) by default, the bias zeros."""
    ins, outs = Shape(input_dims), Shape(output_dims)
    stddev = ins.size ** -0.5 if stddev is None else stddev
    p = {"kernel": mesh.random_normal(ins + outs, subseed(seed, "kernel"), stddev=stddev, dtype=dtype)}
    if use_bias:
        p["bias"] = mesh.zeros(outs, dtype)
    return p


def dense(params: Params, x, reduced_dims=None, activation: Optional[str] = None):
    """`activation(x · kernel (+ bias))`, contracting `reduced_dims` (default: the kernel's dims that
    x has), in x's dtype (the parameters cast to it, see `like`). The bias and the activation
    ("relu", "gelu", "tanh" or None) are one op (`mpimesh.ops.activation`).

    The output has x's other dims, then the kernel's dims that are not reduced and not in x.

    >>> import mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> p = {"kernel": mesh.ones("d_model:3;heads:2;d_kv:4")}
    >>> mm.layers.dense(p, mesh.ones("batch:2;d_model:3")).shape
    Shape('[batch:2, heads:2, d_kv:4]')
    """
    w = checked(params, "dense", ("kernel",), ("bias",))["kernel"]
    if reduced_dims is None:
        reduced = tuple(n for n in w.shape.names if n in x.shape)
    else:
        reduced = dim_names(reduced_dims)
    if not reduced:
        raise ShapeError(f"dense: the kernel {w.shape} shares no dim with the input {x.shape}")
    for n in reduced:
        if n not in x.shape or n not in w.shape:
            raise ShapeError(f"dense: reduced dim {n!r} must be in both the input {x.shape} and the kernel {w.shape}")
    out = union_shape([x.shape.without(reduced), w.shape.without(reduced)], "dense")
    y = einsum([x, like(w, x)], output_shape=out)
    bias = like(params["bias"], y) if "bias" in params else None
    return y if bias is None and activation is None else bias_activation(y, bias, activation)


# -------------------------------------------------------------------------------- layer norm

def init_layer_norm(mesh, dim: DimLike, dtype="float32") -> Params:
    """`{"scale": ones[dim], "bias": zeros[dim]}`."""
    d = as_dim(dim)
    return {"scale": mesh.ones([d], dtype), "bias": mesh.zeros([d], dtype)}


def layer_norm(params: Params, x, dim, epsilon: float = 1e-6):
    """`(x - mean) / sqrt(var + epsilon) * scale + bias`, statistics over `dim` (a name or
    Dimension, or several); when `dim` is split, the sums are one allreduce each. A 16-bit
    float x is normalised in float32 and the result rounded to x's dtype. One op, and one op
    (plus the parameters' sums) for its gradient: `mpimesh.ops.norm`.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> x = mesh.from_numpy(np.array([[1.0, 3.0], [2.0, 2.0]]), "b:2;d:2")
    >>> p = mm.layers.init_layer_norm(mesh, "d:2", dtype="float64")
    >>> np.round(mm.layers.layer_norm(p, x, "d").to_numpy(), 4).tolist()
    [[-1.0, 1.0], [0.0, 0.0]]
    """
    checked(params, "layer_norm", (), ("scale", "bias"))
    if not epsilon >= 0:
        raise MpimeshError(f"layer_norm: epsilon must be >= 0, got {epsilon}")
    return normalize(x, dim_names(dim), params.get("scale"), params.get("bias"), epsilon)


def init_rms_norm(mesh, dim: DimLike, dtype="float32") -> Params:
    """`{"scale": ones[dim]}`."""
    return {"scale": mesh.ones([as_dim(dim)], dtype)}


def rms_norm(params: Params, x, dim, epsilon: float = 1e-6):
    """`x / sqrt(mean(x**2) + epsilon) * scale`, the mean over `dim` (a name or Dimension, or
    several), as LLaMA-family models normalise: no centring, no bias. When `dim` is split, the sum
    of squares is one allreduce. A 16-bit float x is normalised in float32 and the result rounded
    to x's dtype. One op, and one op (plus the scale's sum) for its gradient: `mpimesh.ops.norm`.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> x = mesh.from_numpy(np.array([[3.0, 4.0], [1.0, -1.0]]), "b:2;d:2")
    >>> p = mm.layers.init_rms_norm(mesh, "d:2", dtype="float64")
    >>> np.round(mm.layers.rms_norm(p, x, "d", epsilon=0.0).to_numpy(), 4).tolist()
    [[0.8485, 1.1314], [1.0, -1.0]]
    """
    checked(params, "rms_norm", (), ("scale",))
    if not epsilon >= 0:
        raise MpimeshError(f"rms_norm: epsilon must be >= 0, got {epsilon}")
    return normalize_rms(x, dim_names(dim), params.get("scale"), epsilon)


# --------------------------------------------------------------------------------- embedding

def init_embedding(mesh, seed: int, vocab_dim: DimLike, model_dim: DimLike, stddev: float = 1.0,
                   dtype="float32") -> Params:
    """`{"weights": [vocab_dim, model_dim]}`, N(0, stddev²)."""
    shape = Shape([as_dim(vocab_dim), as_dim(model_dim)])
    return {"weights": mesh.random_normal(shape, subseed(seed, "weights"), stddev=stddev, dtype=dtype)}


def embedding(params: Params, ids, dtype=None):
    """Rows of `params["weights"]` (dims `[vocab, model]`) for integer `ids`: the output has
    ids' dims then the model dim. The vocab dim may be split (one allreduce of the output).
    `dtype`: the activations' dtype (e.g. "bfloat16"; default the weights'), to which each rank
    casts the rows it looks up (with vocab split, the allreduce then moves 16-bit words).

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> p = {"weights": mesh.from_numpy(np.arange(6.0).reshape(3, 2), "vocab:3;d_model:2")}
    >>> mm.layers.embedding(p, mesh.from_numpy(np.array([2, 0]), "length:2")).to_numpy().tolist()
    [[4.0, 5.0], [0.0, 1.0]]
    """
    w = checked(params, "embedding", ("weights",))["weights"]
    return gather(w, ids, w.shape[0].name, dtype=dtype)


# ------------------------------------------------------------------------------ feed-forward

def init_feed_forward(mesh, seed: int, model_dim: DimLike, ff_dim: DimLike, use_bias: bool = False,
                      dtype="float32") -> Params:
    """`{"wi": dense [model, ff], "wo": dense [ff, model]}`."""
    m, f = as_dim(model_dim), as_dim(ff_dim)
    return {"wi": init_dense(mesh, subseed(seed, "wi"), [m], [f], use_bias, dtype=dtype),
            "wo": init_dense(mesh, subseed(seed, "wo"), [f], [m], use_bias, dtype=dtype)}


def feed_forward(params: Params, x, activation: str = "relu"):
    """The Transformer's position-wise block `wo(act(wi(x)))`; with d_ff split, the second
    dense's contraction is the one allreduce.

    >>> import mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> p = mm.layers.init_feed_forward(mesh, 0, "d_model:4", "d_ff:16")
    >>> mm.layers.feed_forward(p, mesh.ones("batch:2;d_model:4"), "gelu").shape
    Shape('[batch:2, d_model:4]')
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"feed_forward: unknown activation {activation!r}; choose from {sorted(ACTIVATIONS)}")
    checked(params, "feed_forward", ("wi", "wo"))
    return dense(params["wo"], dense(params["wi"], x, activation=activation))
