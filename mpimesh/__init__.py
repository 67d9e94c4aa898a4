"""mpimesh: Mesh-TensorFlow's named-dimension model parallelism, eager, on MPI.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", layout="hidden:all", comm=mm.MPI.COMM_SELF)
>>> x = mesh.random_normal("batch:4;io:8", seed=0)
>>> w = mesh.random_normal("io:8;hidden:16", seed=1)
>>> mm.einsum([x, w]).shape
Shape('[batch:4, hidden:16]')
"""
from mpi4py import MPI

from .autodiff import gradients
from .checkpoint import load, save
from .collectives.guard import set_collective_timeout, set_spmd_check
from .errors import (CheckpointError, CollectiveTimeoutError, DivergenceError, LayoutError, MeshError, MpimeshError,
                     ShapeError)
from .layout import LayoutRules
from .mesh import Mesh, layout_scope
from .ops.einsum import einsum
from .ops.elementwise import (abs, add, cast, cos, divide, equal, exp, gelu, greater, greater_equal, less,
                              less_equal, log, maximum, minimum, multiply, negative, not_equal, power,
                              relu, rsqrt, sigmoid, sin, sqrt, square, subtract, tanh, where)
from .ops.reduce import reduce_logsumexp, reduce_max, reduce_mean, reduce_min, reduce_sum
from .ops.relayout import relayout
from .ops.reshape import broadcast, rename_dimension, reshape, transpose
from .ops.shift import halo_exchange, shift
from .ops.conv import conv1d, conv2d
from .ops.slicing import concat, pad, slice, split
from .ops.scan import cumsum
from .ops.dropout import dropout
from .ops.elementwise import stop_gradient
from .ops.indexing import argmax, gather, one_hot, top_k
from .ops.nn import log_softmax, softmax
from .profile import profile, visualize
from .shape import Dimension, Shape
from .tensor import DistTensor, arange as range, from_local, from_numpy
from .trace import trace
from . import tpu
from . import optim
from . import layers

__version__ = "0.1.0"
