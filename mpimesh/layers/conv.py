"""2-D convolution layer: `mm.conv2d` plus a bias and an optional activation, no communication
code of its own. Height and width may be split over mesh dims in blocks of any size: the
convolution gathers its halos from the neighbours, the bias and activation are local, and the
output keeps the input's spatial dim names (laid out like the input). Parameter values depend
only on the seed, never on the mesh or layout.

>>> import mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> p = init_conv2d(mesh, 0, 3, 3, "c_in:2", "c_out:4")
>>> sorted(p), p["kernel"].shape
(['bias', 'kernel'], Shape('[fh:3, fw:3, c_in:2, c_out:4]'))
>>> conv2d(p, mesh.ones("batch:1;height:8;width:8;c_in:2"), activation="relu").shape
Shape('[batch:1, height:8, width:8, c_out:4]')
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

from ..errors import MpimeshError, ShapeError
from ..ops.conv import conv2d as _conv2d_op
from ..shape import Dimension, Shape
from ..tensor import tensor_arg
from .core import ACTIVATIONS, DimLike, Params, as_dim, subseed

__all__ = ["init_conv2d", "conv2d"]


def _tap_dim(f: Union[int, DimLike], name: str) -> Dimension:
    if isinstance(f, int) and not isinstance(f, bool):
        if f < 1:
            raise ShapeError(f"init_conv2d: filter size {name}:{f} must be >= 1")
        return Dimension(name, f)
    return as_dim(f)


def init_conv2d(mesh, seed: int, fh: Union[int, DimLike], fw: Union[int, DimLike], in_dim: DimLike,
                out_dim: DimLike, use_bias: bool = True, stddev: Optional[float] = None,
                dtype="float32") -> Params:
    """`{"kernel": [fh, fw, in_dim, out_dim], "bias": [out_dim]}`.

    `fh`, `fw` are tap counts (dims named "fh", "fw") or Dimensions. The kernel is
    N(0, stddev²) with stddev = 1/sqrt(fh·fw·in_size) by default (from `seed` only, so the same
    values on any mesh and layout); the bias is zeros.
    """
    th, tw = _tap_dim(fh, "fh"), _tap_dim(fw, "fw")
    cin, cout = as_dim(in_dim), as_dim(out_dim)
    shape = Shape([th, tw, cin, cout])  # raises ShapeError on repeated names
    stddev = (th.size * tw.size * cin.size) ** -0.5 if stddev is None else stddev
    p = {"kernel": mesh.random_normal(shape, subseed(seed, "kernel"), stddev=stddev, dtype=dtype)}
    if use_bias:
        p["bias"] = mesh.zeros([cout], dtype)
    return p


def conv2d(params: Params, x, strides: Union[int, Sequence[int]] = (1, 1), padding="SAME",
           dilation: Union[int, Sequence[int]] = (1, 1),
           activation: Union[None, str, Callable] = None):
    """`activation(mm.conv2d(x, kernel) + bias)`.

    x's last three dims are height, width and the kernel's in-channels dim; the output has x's
    leading and spatial dims (sizes as `mm.conv2d`: SAME keeps ceil(size/stride)) and the
    kernel's out-channels dim. `activation` is None, "relu", "gelu", "tanh" or a callable.

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> p = {"kernel": mesh.ones("fh:3;fw:3;ci:1;co:1"), "bias": mesh.full("co:1", -4.0)}
    >>> y = conv2d(p, mesh.ones("h:3;w:3;ci:1"), activation="relu")
    >>> y.to_numpy()[..., 0].tolist()
    [[0.0, 2.0, 0.0], [2.0, 5.0, 2.0], [0.0, 2.0, 0.0]]
    """
    if activation is not None and not callable(activation) and activation not in ACTIVATIONS:
        raise ValueError(f"conv2d: unknown activation {activation!r}; choose from {sorted(ACTIVATIONS)} "
                         "or pass a callable")
    if "kernel" not in params:
        raise MpimeshError(f"conv2d: params lack 'kernel'; they have {list(params)} (see init_conv2d)")
    tensor_arg("conv2d", x)
    y = _conv2d_op(x, params["kernel"], strides=strides, padding=padding, dilation=dilation)
    if "bias" in params:
        b = params["bias"]
        if any(d not in y.shape for d in b.shape):
            raise ShapeError(f"conv2d: the bias {b.shape} has dims the output {y.shape} lacks")
        y = y + b
    if activation is not None:
        y = activation(y) if callable(activation) else ACTIVATIONS[activation](y)
    return y
