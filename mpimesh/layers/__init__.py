"""`mm.layers`: neural-network layers built only from public ops (no communication code).

Every layer is an `init_<layer>(mesh, seed, dims...)` that returns its parameters (a dict of
DistTensors, values independent of mesh and layout, laid out by the rules in force) and a
function `<layer>(params, x, ...)`. A new layer is a new module here plus one import line below.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> p = mm.layers.init_embedding(mesh, 0, "vocab:16", "d_model:4")
>>> ids = mesh.from_numpy(np.array([[1, 2, 3]]), "batch:1;length:3")
>>> mm.layers.embedding(p, ids).shape
Shape('[batch:1, length:3, d_model:4]')
"""
from .attention import causal_bias, init_attention, multihead_attention
from .core import (dense, embedding, feed_forward, flatten, init_dense, init_embedding, init_feed_forward,
                   init_layer_norm, init_rms_norm, layer_norm, rms_norm, subseed, unflatten)
from .losses import softmax_cross_entropy_with_logits
from .conv import conv2d, init_conv2d
from .moe import expert_capacity, init_moe, moe
