"""Each op's declaration (`mpimesh.opdef.OpDef`) against the op as it runs.

For every case below, the same call runs on a real mesh under `mm.profile()` and dry on a `DryMesh`
of the mesh's shape and rules: the dry run's collectives (kind, mesh dims, calls, elements, bytes),
flops, and each output's dtype and block shape must equal rank 0's (coordinate 0, whose blocks the
dry run follows), on uneven blocks too. The dry run computes nothing: it reads the ops' `abstract`
rules, so a rule that forgets a collective or gets a dtype wrong fails here. The flops are checked
against formulas written here (elementwise: one per element, ...).

A case is `(name, input specs, layout rules, fn, flops formula)`: specs are `(shape, dtype)`, the
inputs made from seeded numpy arrays and laid out by the rules; `fn(*tensors)` returns a tensor or
a tuple of them; `flops(shapes)` the flops rank 0 must count from its blocks' shapes (None: not
checked).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from meshes import mesh_shapes

import mpimesh as mm
from mpimesh import counters
from mpimesh.dryrun import DryMesh, placeholder

pytestmark = pytest.mark.mpi


def _elements(blocks) -> int:
    return math.prod(blocks[0])


def _and_gradients(f, wrt):
    """A case's fn: `f`'s outputs, then, in a trace, the gradients of its first output w.r.t. the inputs at `wrt`."""
    def fn(*xs):
        with mm.trace():
            ys = _outputs(f(*xs))
            return (*ys, *mm.gradients([ys[0]], [xs[i] for i in wrt]))
    return fn


def _slots(e1, e2, slots):
    """top2_slots' outputs as a tuple of tensors."""
    return (e1, e2, *slots.tensors)


def _routed(g, x, w):
    """A top-2 routing's expert buffers and their weighted combination back to the tokens."""
    slots = mm.ops.routing.top2_slots(g, "s", "e", "c:3", "all")[2]
    y = mm.ops.routing.dispatch_slots(x, slots, [w, w])
    return mm.ops.routing.combine_slots(y, slots, [w, w]), y


def _conv_flops(taps: int, cin):
    """2 x this rank's outputs x filter taps x its in-channels (a number, or the input's last local dim: None)."""
    return lambda ins, outs: 2 * _elements(outs) * taps * (ins[0][-1] if cin is None else cin)


def _cumsum_flops(size: int):
    """One add per element; where the scanned first dim (of `size`) is split, two more per element."""
    return lambda ins, outs: _elements(ins) * (1 if ins[0][0] == size else 3)


def _every_output(f):
    """A case's fn: every output of the last op `f` runs (those it keeps for its gradient too)."""
    def fn(*xs):
        with mm.trace() as tr:
            f(*xs)
        return tr.ops[-1].outputs
    return fn


CASES = [
    ("exp", [("a:7;b:5", "float32")], "a:M0", lambda x: mm.exp(x), lambda ins, outs: _elements(outs)),
    ("add, broadcast", [("a:7;b:5", "float32"), ("b:5", "float64")], "a:M0;b:M1", lambda x, y: x + y,
     lambda ins, outs: _elements(outs)),
    ("multiply by a number", [("a:9", "bfloat16")], "a:M0", lambda x: x * 2.0, lambda ins, outs: _elements(outs)),
    ("int32 + float32", [("a:6;b:3", "int32"), ("a:6;b:3", "float32")], "b:M0", lambda x, y: x + y,
     lambda ins, outs: _elements(outs)),
    ("where", [("a:7", "bool"), ("a:7", "float32")], "a:M0", lambda c, x: mm.where(c, x, 0.5), None),
    ("cast", [("a:7;b:2", "float32")], "b:M0", lambda x: mm.cast(x, "bfloat16"), None),
    ("axpy", [("a:7;b:2", "float64"), ("b:2;a:7", "float64")], "a:M0", lambda x, y: mm.axpy(-0.5, x, y),
     lambda ins, outs: 2 * _elements(outs)),
    # indexing, scan, shift, conv, routing (issue 41): data movement counts no flops
    ("one_hot, new dim split", [("b:7", "int32")], "b:M0;v:M1",
     lambda i: mm.one_hot(i, "v:5", on_value=2.0, dtype="bfloat16"), lambda ins, outs: 0),
    ("gather, looked-up dim split", [("v:7;d:3", "float32"), ("b:5", "int32")], "v:M0;b:M1",
     lambda w, i: mm.gather(w, i, "v"), lambda ins, outs: 0),
    ("gather to bfloat16, batched", [("v:7;g:2;d:3", "float32"), ("g:2;b:5", "int32")], "v:M0;d:M1",
     lambda w, i: mm.gather(w, i, "v", dtype="bfloat16"), lambda ins, outs: 0),
    ("gather's gradient", [("v:7;d:3", "float32"), ("b:5", "int32")], "v:M0;b:M1",
     _and_gradients(lambda w, i: mm.gather(w, i, "v"), [0]), None),
    ("top_k, reduced dim split", [("b:3;v:11", "float32")], "v:M0;b:M1", lambda x: mm.top_k(x, "v", "k:4"),
     lambda ins, outs: 0),
    ("top_k of ints, k split like v", [("b:3;v:11", "int32")], "v:M0;k:M0", lambda x: mm.top_k(x, "v", "k:4"),
     lambda ins, outs: 0),
    ("top_k's gradient", [("b:3;v:11", "float64")], "v:M0", _and_gradients(lambda x: mm.top_k(x, "v", "k:4")[0], [0]),
     None),
    ("argmax, split", [("b:3;v:11", "bfloat16")], "v:M0;b:M1", lambda x: mm.argmax(x, "v"), lambda ins, outs: 0),
    ("cumsum, split", [("a:7;b:3", "float32")], "a:M0", lambda x: mm.cumsum(x, "a"), _cumsum_flops(7)),
    ("cumsum reversed, exclusive, bfloat16", [("a:7;b:3", "bfloat16")], "a:M0;b:M1",
     lambda x: mm.cumsum(x, "a", exclusive=True, reverse=True), _cumsum_flops(7)),
    ("cumsum of bools", [("a:7", "bool")], "a:M0", lambda x: mm.cumsum(x, "a"), _cumsum_flops(7)),
    ("cumsum's gradient", [("a:7;b:3", "float64")], "a:M0", _and_gradients(lambda x: mm.cumsum(x, "a"), [0]),
     lambda ins, outs: 2 * _cumsum_flops(7)(ins, outs)),
    ("shift, split", [("a:7;b:3", "float32")], "a:M0;b:M1", lambda x: mm.shift(x, 2, "a", wrap=False),
     lambda ins, outs: 0),
    ("shift, wrapped", [("a:7;b:3", "int32")], "a:M0", lambda x: mm.shift(x, -3, "a", wrap=True),
     lambda ins, outs: 0),
    ("shift's gradient", [("a:7;b:3", "float64")], "a:M0", _and_gradients(lambda x: mm.shift(x, 3, "a", False), [0]),
     lambda ins, outs: 0),
    ("halo exchange", [("b:2;a:7", "float32")], "a:M0", lambda x: mm.halo_exchange(x, "a", 2), lambda ins, outs: 0),
    ("halo exchange's gradient, wrapped", [("b:2;a:7", "float64")], "a:M0",
     _and_gradients(lambda x: mm.halo_exchange(x, "a", 2, wrap=True), [0]), lambda ins, outs: 0),
    ("conv1d, length split", [("b:2;len:9;ci:3", "float32"), ("tap:3;ci:3;co:2", "float32")], "len:M0;b:M1",
     lambda x, w: mm.conv1d(x, w), _conv_flops(3, 3)),
    ("conv2d, strided, height and width split", [("b:1;h:7;w:6;ci:2", "float32"), ("fh:3;fw:2;ci:2;co:3", "float32")],
     "h:M0;w:M1", lambda x, w: mm.conv2d(x, w, strides=2, padding="VALID"), _conv_flops(6, 2)),
    ("conv1d bfloat16, in-channels split", [("b:2;len:6;ci:4", "bfloat16"), ("tap:3;ci:4;co:2", "bfloat16")],
     "ci:M0", lambda x, w: mm.conv1d(x, w), _conv_flops(3, None)),
    ("conv1d int32 by float32, dilated", [("b:2;len:7;ci:2", "int32"), ("tap:2;ci:2;co:3", "float32")], "len:M0",
     lambda x, w: mm.conv1d(x, w, dilation=2), _conv_flops(2, 2)),
    ("conv1d's gradients, out-channels split", [("b:2;len:9;ci:3", "float64"), ("tap:3;ci:3;co:2", "float64")],
     "len:M0;co:M1", _and_gradients(lambda x, w: mm.conv1d(x, w), [0, 1]),
     lambda ins, outs: 3 * _conv_flops(3, 3)(ins, outs)),
    ("conv2d's gradients, strided", [("b:1;h:7;w:6;ci:2", "float64"), ("fh:3;fw:2;ci:2;co:3", "float64")],
     "h:M0;w:M1", _and_gradients(lambda x, w: mm.conv2d(x, w, strides=2), [0, 1]),
     lambda ins, outs: 3 * _conv_flops(6, 2)(ins, outs)),
    ("top2_slots", [("g:3;s:8;e:4", "float32")], "g:M0",
     lambda g: _slots(*mm.ops.routing.top2_slots(g, "s", "e", "c:3", "all")),
     lambda ins, outs: 12 * math.prod(ins[0]) + 10 * _elements(outs)),
    ("top2_slots, random policy", [("g:3;s:8;e:4", "float32"), ("g:3;s:8", "float32")], "g:M0",
     lambda g, u: _slots(*mm.ops.routing.top2_slots(g, "s", "e", "c:3", "random", uniform=u)),
     lambda ins, outs: 12 * math.prod(ins[0]) + 12 * _elements(outs)),
    ("dispatch_slots and combine_slots, weighted", [("g:3;s:8;e:4", "float32"), ("g:3;s:8;d:5", "float32"),
                                                    ("g:3;s:8", "float32")], "g:M0;d:M1", _routed,
     lambda ins, outs: 12 * math.prod(ins[0]) + 10 * math.prod(ins[2]) + math.prod(outs[1]) + 2 * 2 * _elements(outs)),
    ("dispatch_slots and combine_slots' gradients", [("g:3;s:8;e:4", "float32"), ("g:3;s:8;d:5", "float32"),
                                                     ("g:3;s:8", "float32")], "g:M0;d:M1",
     _and_gradients(_routed, [1, 2]), None),
    ("MoE layer and its gradients", [("group:4;tokens:8;d_model:6", "float32"), ("d_model:6;experts:4", "float32"),
                                     ("experts:4;d_model:6;d_ff:5", "float32"),
                                     ("experts:4;d_ff:5;d_model:6", "float32")],
     "group:M0;experts:M0", _and_gradients(lambda x, wg, wi, wo: mm.layers.moe({"wg": wg, "wi": wi, "wo": wo}, x,
                                                                                "group", seed=3), [0, 1, 2, 3]), None),
    # the fused optimizer updates (issue 41): the arithmetic of their formulas per element (a sqrt counts one)
    ("sgd_update with momentum", [("a:7;b:5", "float32")] * 3, "a:M0;b:M1",
     lambda p, g, v: sum(mm.ops.updates.sgd_update([(p, g, v)], 0.1, 0.9), ()),
     lambda ins, outs: 4 * math.prod(ins[0])),  # v = 0.9 v + g, p = -0.1 v + p: two multiply-adds
    ("sgd_update of bfloat16 in float32, a scheduled lr", [("", "float32"), ("a:7;b:5", "bfloat16"),
                                                           ("a:7;b:5", "float32"), ("b:5", "bfloat16"),
                                                           ("b:5", "float32")], "a:M0;b:M1",
     lambda lr, p, g, q, h: sum(mm.ops.updates.sgd_update([(p, g), (q, h)], lr, dtype="float32"), ()),
     lambda ins, outs: 2 * (math.prod(ins[1]) + math.prod(ins[3]))),  # p = -lr g + p
    ("adam_update with weight decay, two parameters", [("", "float32")] + [("a:7;b:5", "float32")] * 4
     + [("b:5", "float32")] * 4, "a:M0;b:M1",
     np.errstate(invalid="ignore")(lambda t, *ts: sum(mm.ops.updates.adam_update(
         [ts[:4], ts[4:]], t, 0.01, 0.9, 0.999, 1e-8, 0.1), ())),
     # m: 3 (b1 m, (1 - b1) g, +), v: 4 (g g, b2 v, (1 - b2) g g, +), m / c1, v / c2, sqrt, + eps, /: 5,
     # p = -lr u + p: 2, -lr wd p + p: 2
     lambda ins, outs: 16 * (math.prod(ins[1]) + math.prod(ins[5]))),
    ("adam_update of bfloat16 in float32, a float64 scheduled lr", [("", "float32"), ("", "float64"),
                                                                     ("a:7;b:5", "bfloat16")]
     + [("a:7;b:5", "float32")] * 3, "b:M0",
     np.errstate(invalid="ignore")(lambda t, lr, *ts: sum(mm.ops.updates.adam_update(
         [ts], t, lr, 0.9, 0.999, 1e-8, dtype="float32"), ())),
     lambda ins, outs: 14 * math.prod(ins[2])),
    ("adafactor_update, factored with momentum, and not", [("", "float32"), ("a:7;b:5", "float32"),
                                                           ("a:7;b:5", "float32"), ("b:5", "float32"),
                                                           ("a:7", "float32"), ("a:7;b:5", "float32")]
     + [("b:5", "float32")] * 4, "a:M0;b:M1",
     np.errstate(invalid="ignore", divide="ignore")(lambda lr, p, g, vr, vc, m, q, h, v, n: sum(
         mm.ops.adafactor.adafactor_update([(p, g, vr, vc, m), (q, h, v, n)], [("a", "b"), None], lr, 0.8, 0.5, 1.0,
                                           True, 1e-30, 1e-3), ())),
     # per element of p: g g; p p and its sum; u u and its sum; d = u scale; m = 0.5 m + 0.5 d (3); p - d: 10;
     # factored, the sums of g g along a and b, u = g (r c) (2): 14, per element of vr (b) its update
     # 0.8 vr + 0.2 (sum / 7 + eps1) (5), its row sum, 1 / sqrt(vr / row mean) (3): 9, of vc (a) 5 + 1 / sqrt(vc)
     # (2): 7, the row mean (sum / 5) of vr's one row: 1; not factored: 10, v's update (4), g / sqrt(v) (2): 16
     lambda ins, outs: 14 * math.prod(ins[1]) + 9 * math.prod(ins[3]) + 7 * math.prod(ins[4]) + 1
     + 16 * math.prod(ins[6])),
    ("adafactor_update of a 3-d parameter, a decay tensor, plain", [("", "float64")] + [("a:7;b:5;c:3", "float64")] * 2
     + [("b:5;c:3", "float64"), ("a:7;c:3", "float64")], "b:M0;c:M1",
     np.errstate(invalid="ignore", divide="ignore")(lambda d, p, g, vr, vc: mm.ops.adafactor.adafactor_update(
         [(p, g, vr, vc)], [("a", "b")], 0.05, d, 0.0, None, False, 1e-30, 1e-3)[0]),
     # per element of p: g g, the sums along a and b, u = g (r c) (2), d = 0.05 u, p - d: 7; vr (b, c) 9, vc (a, c)
     # 7, as above; vr's rows (the row means, per c): 1 each
     lambda ins, outs: 7 * math.prod(ins[1]) + 9 * math.prod(ins[3]) + 7 * math.prod(ins[4]) + ins[3][1]),
    # einsum: 2 flops per multiply-add of the local blocks (a reordering: 1 per element); a reduction 1 per input
    # element; data movement 0
    ("einsum, allreduce", [("b:6;i:7", "float32"), ("i:7;h:5", "float32")], "i:M0;h:M1", lambda x, w: mm.einsum([x, w]),
     lambda ins, outs: 2 * ins[0][0] * ins[0][1] * ins[1][1]),
    ("einsum, bfloat16 rounded allreduce", [("b:6;i:7", "bfloat16"), ("i:7;h:5", "bfloat16")], "i:M0",
     lambda x, w: mm.einsum([x, w]), lambda ins, outs: 2 * ins[0][0] * ins[0][1] * ins[1][1]),
    ("einsum, batched", [("g:3;s:5;m:4", "float64"), ("g:3;s:5;e:6", "float64")], "s:M0;g:M1",
     lambda x, y: mm.einsum([x, y], "e:6;g:3;m:4"), lambda ins, outs: 2 * math.prod(ins[0]) * ins[1][2]),
    ("einsum, int32 with float32", [("b:6;i:7", "int32"), ("i:7;h:5", "float32")], "b:M0",
     lambda x, w: mm.einsum([x, w]), lambda ins, outs: 2 * ins[0][0] * ins[0][1] * ins[1][1]),
    ("einsum, a reordering", [("a:7;b:5", "float32")], "a:M0", lambda x: mm.einsum([x], "b:5;a:7"),
     lambda ins, outs: _elements(ins)),
    ("broadcast", [("b:5", "float32")], "a:M0;b:M1", lambda x: mm.broadcast(x, "a:7;b:5"), lambda ins, outs: 0),
    ("reduce_sum over a split dim", [("a:7;b:5", "float32")], "a:M0;b:M1", lambda x: mm.reduce_sum(x, reduced_dim="a"),
     lambda ins, outs: 2 * _elements(ins)),  # (an einsum: opt_einsum counts a sum's adds 2 per element)
    ("reduce_mean, bfloat16", [("a:7;b:5", "bfloat16")], "a:M0", lambda x: mm.reduce_mean(x, reduced_dim="a"), None),
    ("reduce_max over a split dim", [("a:7;b:5", "float32")], "a:M0;b:M1", lambda x: mm.reduce_max(x, reduced_dim="a"),
     lambda ins, outs: _elements(ins)),
    ("reduce_max, bfloat16", [("a:7;b:5", "bfloat16")], "a:M0", lambda x: mm.reduce_max(x, reduced_dim="a"),
     lambda ins, outs: _elements(ins)),
    ("reduce_min, int32, reordered", [("a:7;b:5;c:3", "int32")], "b:M0;c:M1", lambda x: mm.reduce_min(x, "c:3;a:7"),
     lambda ins, outs: _elements(ins)),
    ("reduce_logsumexp, bfloat16", [("a:7;b:5", "bfloat16")], "a:M0;b:M1",  # max, subtract, exp, add; log, add
     lambda x: mm.reduce_logsumexp(x, reduced_dim="a"), lambda ins, outs: 4 * _elements(ins) + 2 * _elements(outs)),
    ("relayout, allgather", [("a:7;b:5", "float32")], "a:M0;b:M1", lambda x: mm.relayout(x, ""), lambda ins, outs: 0),
    ("relayout, alltoall", [("a:7;b:5", "float64")], "a:M0", lambda x: mm.relayout(x, {"b": x.tensor_layout[0]}),
     lambda ins, outs: 0),
    ("reshape", [("a:6;b:4", "float32")], "a:M0", lambda x: mm.reshape(x, "ab:24"), lambda ins, outs: 0),
    ("reshape, split dims kept", [("a:8;b:3", "float32")], "a:M0;ab:M0", lambda x: mm.reshape(x, "ab:24"),
     lambda ins, outs: 0),
    ("transpose", [("a:7;b:5", "int32")], "a:M0;b:M1", lambda x: mm.transpose(x, "b:5;a:7"), lambda ins, outs: 0),
    ("rename_dimension", [("a:7;b:5", "float32")], "a:M0;c:M1", lambda x: mm.rename_dimension(x, "a", "c"),
     lambda ins, outs: 0),
    ("slice along a split dim", [("a:11;b:3", "float32")], "a:M0", lambda x: mm.slice(x, 2, 7, "a"),
     lambda ins, outs: 0),
    ("pad along a split dim", [("a:11;b:3", "bfloat16")], "a:M0", lambda x: mm.pad(x, [2, 3], "a"),
     lambda ins, outs: 0),
    ("concat along a split dim", [("a:7;b:3", "int32"), ("a:5;b:3", "float32")], "a:M0",
     lambda x, y: mm.concat([x, y], "a"), lambda ins, outs: 0),
    ("concat along a whole dim", [("a:7;b:3", "float32"), ("a:5;b:3", "float32")], "b:M0",
     lambda x, y: mm.concat([x, y], "a"), lambda ins, outs: 0),
    ("split along a split dim", [("a:11;b:3", "float64")], "a:M0;b:M1", lambda x: mm.split(x, "a", [3, 8]),
     lambda ins, outs: 0),
    # softmax, layer norm, cross-entropy, bias + activation, dropout, random, full (issue 41): the arithmetic
    # of their formulas per element of x (n), written out
    ("softmax, reduced dim split", [("b:3;v:7", "float32")], "v:M0;b:M1", lambda x: mm.softmax(x, "v"),
     lambda ins, outs: 5 * _elements(ins)),  # max, subtract, exp, sum, divide
    ("log_softmax bfloat16, a float32 bias, causal, query dim split", [("b:2;q:5;k:5", "bfloat16"),
                                                                       ("k:5", "float32")], "q:M0;b:M1",
     lambda x, b: mm.log_softmax(x, "k", bias=b, causal="q"), lambda ins, outs: 7 * _elements(ins)),  # + bias, mask
    ("softmax over two dims, one split unevenly", [("b:3;q:5;k:6", "float64")], "q:M0",
     lambda x: mm.softmax(x, ["q", "k"]), lambda ins, outs: 5 * _elements(ins)),
    ("softmax's gradient, reduced dim split", [("b:3;v:7", "float32")], "v:M0;b:M1",
     _and_gradients(lambda x: mm.softmax(x, "v"), [0]), lambda ins, outs: 9 * _elements(ins)),  # dy y, sum, -, y *
    ("log_softmax's gradient, bfloat16, a bias", [("b:3;v:7", "bfloat16"), ("v:7", "bfloat16")], "v:M0",
     _and_gradients(lambda x, b: mm.log_softmax(x, "v", bias=b), [0]), lambda ins, outs: 10 * _elements(ins)),
    ("layer_norm over a split dim, scale and bias", [("b:3;d:7", "float32"), ("d:7", "float32"), ("d:7", "float32")],
     "d:M0;b:M1", _every_output(lambda x, s, b: mm.ops.norm.layer_norm(x, ("d",), s, b)),
     lambda ins, outs: 7 * _elements(ins)),  # sum, - mean, square, sum, * 1/std, * scale, + bias
    ("layer_norm bfloat16 over two split dims", [("b:3;l:4;d:5", "bfloat16")], "l:M0;d:M1",
     _every_output(lambda x: mm.ops.norm.layer_norm(x, ("l", "d"))), lambda ins, outs: 5 * _elements(ins)),
    ("layer_norm's gradient, split, a scale", [("b:3;d:7", "float64"), ("d:7", "float64")], "d:M0;b:M1",
     # backward: - mean, * 1/std, dy * scale, two sums (3), dx's three terms, * 1/std
     _and_gradients(lambda x, s: mm.ops.norm.layer_norm(x, ("d",), s), [0]), lambda ins, outs: 16 * _elements(ins)),
    ("rms_norm over a split dim, a scale", [("b:3;d:7", "float32"), ("d:7", "float32")], "d:M0;b:M1",
     _every_output(lambda x, s: mm.ops.norm.rms_norm(x, ("d",), s)),
     lambda ins, outs: 4 * _elements(ins)),  # square, sum, * 1/rms, * scale
    ("rms_norm bfloat16 over two split dims", [("b:3;l:4;d:5", "bfloat16")], "l:M0;d:M1",
     _every_output(lambda x: mm.ops.norm.rms_norm(x, ("l", "d"))), lambda ins, outs: 3 * _elements(ins)),
    ("rms_norm's gradient, split, a scale", [("b:3;d:7", "float64"), ("d:7", "float64")], "d:M0;b:M1",
     # backward: * 1/rms, dy * scale, the sum (2), dx's product, difference and * 1/rms
     _and_gradients(lambda x, s: mm.ops.norm.rms_norm(x, ("d",), s), [0]), lambda ins, outs: 11 * _elements(ins)),
    ("rms_norm's gradients, bfloat16 x, float32 scale, batch split", [("b:3;d:7", "bfloat16"), ("d:7", "float32")],
     "b:M0", _and_gradients(lambda x, s: mm.ops.norm.rms_norm(x, ("d",), s), [0, 1]), None),
    ("softmax_cross_entropy, vocab split", [("b:5;v:7", "float32"), ("b:5", "int32")], "v:M0;b:M1",
     _every_output(lambda z, t: mm.ops.nn.softmax_cross_entropy(z, t, "v")),
     lambda ins, outs: 4 * _elements(ins) + 3 * _elements(outs)),  # per logit max, -, exp, sum; per row log, +, -
    ("softmax_cross_entropy bfloat16 and its gradient", [("b:5;v:7", "bfloat16"), ("b:5", "int32")], "v:M0",
     _and_gradients(lambda z, t: mm.ops.nn.softmax_cross_entropy(z, t, "v"), [0]),
     lambda ins, outs: 8 * _elements(ins) + 3 * _elements(outs)),  # backward per logit: -, exp, - one-hot, * dy
    ("bias_gelu, bfloat16 x, float32 bias", [("b:3;h:7", "bfloat16"), ("h:7", "float32")], "h:M0;b:M1",
     lambda x, b: mm.ops.activation.bias_activation(x, b, "gelu"), lambda ins, outs: 10 * _elements(ins)),
    ("bias_add, int32 x, float32 bias", [("b:3;h:7", "int32"), ("h:7", "float32")], "h:M0",
     lambda x, b: mm.ops.activation.bias_activation(x, b, None), lambda ins, outs: _elements(ins)),
    ("bias_relu's gradient", [("b:3;h:7", "float32"), ("h:7", "float32")], "b:M0;h:M1",
     _and_gradients(lambda x, b: mm.ops.activation.bias_activation(x, b, "relu"), [0]),
     lambda ins, outs: 5 * _elements(ins)),  # + bias, max; + bias, > 0, * dy
    ("bias_gelu's and bias_tanh's gradients, no bias", [("b:3;h:7", "float64")], "h:M0",
     _and_gradients(lambda x: mm.ops.activation.bias_activation(x, None, "gelu")
                    + mm.ops.activation.bias_activation(x, None, "tanh"), [0]),
     lambda ins, outs: 35 * _elements(ins)),  # gelu 9 + 19, tanh 1 + 4, the add of the two: 1, of their grads: 1
    ("dropout, uneven blocks", [("a:7;b:5", "float32")], "a:M0;b:M1", lambda x: mm.dropout(x, 0.3, seed=4),
     lambda ins, outs: 3 * _elements(ins)),  # the uniform's scaling, >= rate, * 1 / (1 - rate)
    ("dropout bfloat16 with a seed tensor, and its gradient", [("a:7;b:5", "bfloat16"), ("", "int32")], "a:M0",
     _and_gradients(lambda x, s: mm.dropout(x, 0.3, s), [0]), lambda ins, outs: 6 * _elements(ins)),
    ("random_uniform and random_normal, uneven blocks", [("c:2", "float32")], "a:M0;b:M1",
     lambda x: (x.mesh.random_uniform("a:7;b:5", seed=3), x.mesh.random_normal("a:7;b:5", seed=4, dtype="bfloat16")),
     # uniform: its scaling, minval + width u; normal: 2 scalings, 1 - u1, log, -2 *, sqrt, 2 pi *, cos, *, mean + s z
     lambda ins, outs: 3 * math.prod(outs[0]) + 11 * math.prod(outs[1])),
    ("random_uniform int32 from a seed tensor", [("", "int64")], "b:M0",
     lambda s: s.mesh.random_uniform("a:7;b:5", seed=s, minval=-3, maxval=9, dtype="int32"),
     lambda ins, outs: 3 * _elements(outs)),
    ("derive_seed", [("", "int32")], "", lambda s: mm.ops.random.derive_seed(s, "kernel"), lambda ins, outs: 0),
    ("full, uneven blocks", [("c:2", "float32")], "a:M0;b:M1", lambda x: x.mesh.full("a:7;b:5", 2.5, "float64"),
     lambda ins, outs: 0),
]


def _rules(spec: str, mesh) -> str:
    """`spec` with M0, M1, ... the mesh's dims in order (a rule on a mesh dim it lacks is dropped)."""
    names = mesh.shape.names
    rules = []
    for rule in filter(None, spec.split(";")):
        dim, m = rule.split(":")
        k = int(m[1:])
        if k < len(names):
            rules.append(f"{dim}:{names[k]}")
    return ";".join(rules)


def _inputs(mesh, specs, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for shape, dtype in specs:
        sizes = mm.Shape(shape).sizes
        a = rng.standard_normal(sizes) if dtype != "bool" else rng.random(sizes) > 0.5
        out.append(mesh.from_numpy(a.astype(dtype), shape))
    return out


def _outputs(result) -> list:
    return list(result) if isinstance(result, (tuple, list)) else [result]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("shape", mesh_shapes())
def test_the_dry_run_counts_what_rank_0_does(case, shape):
    name, specs, rule_spec, fn, flops = case
    mesh = mm.Mesh(shape)
    rules = _rules(rule_spec, mesh)
    with mm.layout_scope(mesh, rules):
        xs = _inputs(mesh, specs)
        with mm.profile() as prof:
            real = _outputs(fn(*xs))
    dry = DryMesh(shape, rules)
    ghosts = [placeholder(dry, x.shape, x.dtype, x.tensor_layout) for x in xs]
    with counters.counting() as counts:
        ghost_outs = _outputs(fn(*ghosts))
    if MPI.COMM_WORLD.Get_rank() == 0:
        got = {k: v for k, v in counts.items() if k != "flops"}
        want = {k: v for k, v in prof.counters.items() if k not in ("flops", "copies")}
        assert got == want, (name, shape)
        for r, g in zip(real, ghost_outs):
            assert (g.dtype, g.local.shape) == (r.dtype, r.local.shape), (name, shape)
        if flops is not None:
            expected = flops([x.local.shape for x in xs], [r.local.shape for r in real])
            assert prof.counters.get("flops", {}).get("flops", 0) == expected, name
            assert counts.get("flops", {}).get("flops", 0) == expected, name
