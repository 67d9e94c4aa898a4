"""mpimesh: Mesh-TensorFlow's named-dimension model parallelism, eager, on MPI.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", layout="hidden:all", comm=mm.MPI.COMM_SELF)
>>> x = mesh.random_normal("batch:4;io:8", seed=0)
>>> w = mesh.random_normal("io:8;hidden:16", seed=1)
>>> mm.einsum([x, w]).shape
Shape('[batch:4, hidden:16]')
"""
from mpi4py import MPI

from . import abort, env, threads
abort.install()  # from here on, an uncaught exception on one rank ends the whole job
threads.configure_at_import()  # before numpy loads BLAS: cores // ranks on this node
env.warn_unknown()  # a misspelled MPIMESH_* variable would be ignored: warn, naming the closest known one

from .autodiff import gradients
from .backend import matmul_precision, result_type, set_matmul_precision
from .buckets import set_bucket_bytes
from .checkpoint import SaveHandle, load, newest_intact, save, save_step, step_path, steps
from .compiled import CompileError, compile
from .collectives.guard import set_collective_timeout, set_hang_notice, set_spmd_check
from .errors import (CheckpointError, CollectiveTimeoutError, DivergenceError, DTypeError, LayoutError, MeshError,
                     MissingDependencyError, MpimeshError, ShapeError)
from .layout import LayoutRules
from .mesh import Mesh, layout_scope
from . import creation  # noqa: F401  (binds mesh.zeros, mesh.random_normal, ...: see creation.py)
from .ops.einsum import einsum
from .ops.elementwise import (abs, add, axpy, cast, cos, divide, equal, exp, gelu, greater, greater_equal, less,
                              less_equal, log, maximum, minimum, multiply, negative, not_equal, power,
                              relu, rsqrt, sigmoid, sin, sqrt, square, subtract, tanh, where)
from .ops.reduce import reduce_logsumexp, reduce_max, reduce_mean, reduce_min, reduce_sum
from .ops.relayout import relayout
from .ops.einsum import broadcast
from .ops.reshape import rename_dimension, reshape, transpose
from .ops.shift import halo_exchange, shift
from .ops.conv import conv1d, conv2d
from .ops.slicing import concat, pad, slice, split
from .ops.scan import cumsum
from .ops.dropout import dropout
from .ops.elementwise import stop_gradient
from .ops.indexing import argmax, gather, one_hot, top_k
from .ops.nn import log_softmax, softmax
from .profile import profile, visualize
from .remat import remat
from .pipeline import pipeline, pipeline_value_and_grad
from .stages import stack_layers, unstack_stages
from .sharding import shard_weights
from .shape import Dimension, Shape
from .tensor import DistTensor, arange as range, from_local, from_numpy
from .trace import trace
from . import tpu
from . import optim
from . import layers
from . import cost
from .cost import LayoutPlan, auto_layout

from .version import __version__

# The public API: `from mpimesh import *` and the API reference (docs/build_api.py) list exactly these.
# tests/test_api_docs.py fails if a public name imported above is missing here.
__all__ = [
    # names, shapes, meshes, layouts
    "Dimension", "Shape", "Mesh", "LayoutRules", "layout_scope",
    # errors
    "MpimeshError", "LayoutError", "ShapeError", "MeshError", "CheckpointError", "DivergenceError",
    "CollectiveTimeoutError", "DTypeError", "MissingDependencyError",
    # distributed tensors
    "DistTensor", "from_numpy", "from_local", "range",
    # ops
    "einsum", "reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_logsumexp",
    "reshape", "rename_dimension", "transpose", "broadcast", "relayout",
    "slice", "concat", "split", "pad", "shift", "halo_exchange",
    "cumsum", "one_hot", "gather", "top_k", "argmax", "where", "cast", "result_type", "stop_gradient",
    "dropout",
    "relu", "gelu", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "square", "abs", "sin", "cos",
    "minimum", "maximum", "add", "subtract", "multiply", "divide", "power", "negative", "axpy",
    "equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
    "softmax", "log_softmax", "conv1d", "conv2d",
    # autodiff, checkpoints, measurement, safety nets
    "trace", "gradients", "remat", "pipeline", "pipeline_value_and_grad", "stack_layers", "unstack_stages",
    "shard_weights", "set_bucket_bytes", "save", "load", "SaveHandle", "save_step", "steps",
    "step_path", "newest_intact", "profile", "visualize", "set_spmd_check", "set_collective_timeout",
    "set_hang_notice",
    # speed
    "set_matmul_precision", "matmul_precision", "compile", "CompileError",
    # automatic layouts
    "auto_layout", "LayoutPlan",
    # subpackages
    "layers", "optim", "tpu", "threads", "cost",
]
