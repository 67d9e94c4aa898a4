"""Softmax cross-entropy over a (possibly split) vocabulary dim, numerically stable.

Integer targets: one op (`mpimesh.ops.nn.softmax_cross_entropy`): the log-partition (a local max
and sum, then an allreduce max and an allreduce sum over the vocab's mesh dim) less the target's
logit (one more allreduce of the output size); its gradient is one op. Soft targets: `log_softmax`
times the targets, summed over vocab. The vocab-sized logits are never gathered. Logits of a 16-bit float are cast to float32 first: the loss is float32 (and the
gradient of the logits, through the cast, has their dtype).

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> logits = mesh.from_numpy(np.array([[0.0, 0.0], [1e4, 0.0]]), "b:2;vocab:2")
>>> loss = mm.layers.softmax_cross_entropy_with_logits(logits, mesh.from_numpy(np.array([1, 0]), "b:2"), "vocab")
>>> np.round(loss.to_numpy(), 4).tolist()
[0.6931, 0.0]
"""
from __future__ import annotations

import numpy as np

from ..backend import accumulation_dtype
from ..errors import ShapeError
from ..ops.elementwise import cast, square
from ..ops.nn import log_softmax, softmax_cross_entropy
from ..ops.reduce import reduce_logsumexp, reduce_sum
from ..shape import dim_names
from ..tensor import tensor_arg


def softmax_cross_entropy_with_logits(logits, targets, vocab_dim, z_loss: float = 0.0):
    """Per-position cross-entropy `logsumexp(logits) - logits[target]` over `vocab_dim`.

    Args:
      logits: `[..., vocab]` floats.
      targets: integer class ids with logits' dims but vocab (hard targets; an id outside
        [0, vocab) picks no logit: its loss is the log-partition alone, so mask such positions),
        or a float distribution with logits' dims (soft targets, Mesh-TensorFlow's convention).
      vocab_dim: the class dim (name or Dimension).
      z_loss: adds `z_loss · logsumexp(logits)²` (Mesh-TensorFlow's auxiliary loss).
    Returns:
      the loss with logits' dims but vocab.
    """
    what = "softmax_cross_entropy_with_logits"
    tensor_arg(what, logits, "logits", floats=True), tensor_arg(what, targets, "targets")
    names = dim_names(vocab_dim, logits.shape, what)
    if len(names) != 1:
        raise ShapeError(f"{what}: vocab_dim must be one dim, got {vocab_dim!r}")
    (v,) = names
    if v not in logits.shape:
        raise ShapeError(f"{what}: vocab dim {v!r} is not in logits {logits.shape}")
    vocab = logits.shape[v]
    rest = logits.shape.without([v])
    if sorted(targets.shape.without([v]).names) != sorted(rest.names):
        raise ShapeError(f"{what}: targets {targets.shape} must have the dims of logits {logits.shape} (the vocab "
                         f"dim {v!r} only for soft targets); a missing dim would be broadcast, not matched")
    if accumulation_dtype(logits.dtype) != logits.dtype:
        logits = cast(logits, accumulation_dtype(logits.dtype))
    if v in targets.shape:  # soft targets
        tensor_arg(what, targets, "targets", floats=True)
        if targets.shape[v] != vocab:
            raise ShapeError(f"softmax_cross_entropy_with_logits: targets {targets.shape} and logits "
                             f"{logits.shape} disagree on {v!r}")
        loss = -reduce_sum(targets * log_softmax(logits, v), reduced_dims=v)
        if z_loss:
            loss = loss + z_loss * square(reduce_logsumexp(logits, reduced_dims=v))
        return loss
    if not np.issubdtype(targets.dtype, np.integer):
        raise ShapeError(f"softmax_cross_entropy_with_logits: targets {targets.shape} of dtype {targets.dtype} "
                         f"lack the vocab dim {v!r}, so they must be integer class ids")
    for d in targets.shape:
        if d not in logits.shape:
            raise ShapeError(f"softmax_cross_entropy_with_logits: target dim {d.name}:{d.size} is not in "
                             f"logits {logits.shape}")
    loss = softmax_cross_entropy(logits, targets, v)  # one op, its gradient one op
    if z_loss:
        loss = loss + z_loss * square(reduce_logsumexp(logits, reduced_dims=v))
    return loss
