"""mm.tpu: a trace recorded on N MPI ranks, replayed through JAX on N host devices, gives the MPI
results to float32 rounding (both modes); the compiled HLO holds the collectives mpimesh chose;
bad replays raise mpimesh errors.

Every rank records the trace and computes the global values (`to_numpy`, a collective); then,
with no collective inside, rank 0 builds and runs the JAX replay while the other ranks wait in a
sleeping barrier (JAX compiles dominate; 8 processes compiling at once on a few cores would be
slow). Each op family runs on the session's 1-D, 2-D and 3-D meshes (shard_map) and on the 2-D
mesh (gspmd).
"""
from __future__ import annotations

import os
import re
import time

import jaxenv  # noqa: F401  (first: XLA flags for 8 host devices, before jax is imported)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpimesh as mm  # noqa: E402
from meshes import global_array, mesh_shapes  # noqa: E402

jax = pytest.importorskip("jax", reason="jax is not installed (python3 install.py tpu)")

WORLD = MPI.COMM_WORLD
N, RANK = WORLD.Get_size(), WORLD.Get_rank()
if len(jax.devices()) < N:
    pytest.skip(f"JAX has {len(jax.devices())} devices, fewer than the {N} ranks", allow_module_level=True)
if N == 4:  # 2 and 8 ranks cover its mesh shapes (1-D; 2-D with both dims split; 3-D), 3 and 8 the uneven blocks
    pytest.skip("the replays run on 1, 2, 3 and 8 ranks: 4 adds no mesh shape or block pattern, only a minute of "
                "compiles", allow_module_level=True)
DEVICES = jax.devices()[:N]


def _wait_all() -> None:
    """A barrier whose waiting ranks sleep (busy-polling ranks would starve rank 0's compiles)."""
    req = WORLD.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def _compare(got, want: np.ndarray, what: str, tol: float = 2e-5) -> None:
    """`tol`: relative to the result's largest magnitude (float32 rounding by default; values that
    went through 16-bit floats, rounded once from float32 sums taken in another order, may differ
    by a few of their ulps)."""
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, MPI gave {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, MPI gave {want.dtype}"
    if mm.backend.is_float(want.dtype) or want.dtype.kind == "c":
        scale = max(1.0, float(np.abs(want.astype(np.float64)).max())) if want.size else 1.0
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol * scale,
                                   err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def check_replay(tr, inputs: list, outputs: dict, modes=("shard_map",), grad_tol: float = 2e-5) -> None:
    """Rank 0 replays `outputs` (name -> tensor) of `tr` in each mode and compares with MPI
    (`grad_tol`: `_compare`'s tolerance for the gradients, the outputs named `d_*`)."""
    ins = [t.to_numpy() for t in inputs]
    want = [t.to_numpy() for t in outputs.values()]
    try:
        if RANK == 0:  # no collectives in here
            for mode in modes:
                fn = mm.tpu.replay(tr, inputs, list(outputs.values()), mode=mode, devices=DEVICES)
                got = fn(*ins)
                assert len(got) == len(want)
                for g, w, name in zip(got, want, outputs):
                    _compare(g, w, f"{name} [{mode}]", grad_tol if name.startswith("d_") else 2e-5)
    finally:
        _wait_all()


def _mesh(i: int, rules: str = "") -> mm.Mesh:
    """The i-th mesh of this session (1-D, 2-D, 3-D); `rules` name mesh dims M0, M1, M2 (by
    position; a rule whose mesh dim the mesh lacks is dropped)."""
    shape = mesh_shapes()[i]
    names = mm.Shape(shape).names
    keep = [f"{t}:{names[int(m[1:])]}" for t, m in (r.split(":") for r in rules.split(";") if r)
            if int(m[1:]) < len(names)]
    return mm.Mesh(shape, layout=";".join(keep))


# ---------------------------------------------------------------------------------- op families

def _add_gradients(out: dict, wrt: dict) -> None:
    """Gradients w.r.t. `wrt` of the sum of squares of the float outputs (in the open trace):
    every gradient rule's ops get replayed too."""
    terms = [mm.reduce_sum(mm.square(t)) for t in out.values() if t.dtype.kind == "f"]
    loss = terms[0]
    for t in terms[1:]:
        loss = loss + t
    out["loss"] = loss
    for name, g in zip(wrt, mm.gradients([loss], list(wrt.values()))):
        out[f"d_{name}"] = g


def _dense(mesh, grads: bool = True):
    """Elementwise, einsum with a split reduced dim, reductions, relayouts, reshapes; gradients."""
    x = mesh.from_numpy(global_array("b:8;i:16", 1), "b:8;i:16")
    w = mesh.from_numpy(global_array("i:16;h:8", 2), "i:16;h:8")
    bias = mesh.from_numpy(global_array("h:8", 3), "h:8")
    out = {}
    with mm.trace() as tr:
        y = mm.einsum([x, w], "b:8;h:8")
        out["einsum"] = y
        z = mm.gelu(y + bias)
        out["gelu_add"] = z
        out["where"] = mm.where(z > 0.1, z, y * 2.0)
        out["cast"] = mm.cast(z > 0, "int32")
        out["minmax"] = mm.maximum(mm.minimum(z, 0.5), -0.5)
        a = mm.abs(x) + 1.0
        out["unary"] = (mm.log(a) + mm.sqrt(a) + mm.rsqrt(a) + mm.tanh(x) + mm.sigmoid(x) + mm.square(x)
                        + mm.sin(x) + mm.cos(x) + mm.relu(-x) + mm.exp(x * 0.1))
        out["binary"] = mm.power(a, 1.5) / a - (2.0 - x)
        out["compare"] = (mm.cast(x >= 0, "float32") + mm.cast(mm.not_equal(x, 0.5), "float32")
                          + mm.cast(mm.less(x, 0.2), "float32") + mm.cast(mm.less_equal(x, -0.2), "float32")
                          + mm.cast(mm.equal(x, x), "float32") + mm.cast(mm.greater(x, 1.0), "float32"))
        out["reduce_sum"] = mm.reduce_sum(x, reduced_dims="i")
        out["reduce_mean"] = mm.reduce_mean(x)
        out["reduce_max"] = mm.reduce_max(x, reduced_dims="b")
        out["reduce_min"] = mm.reduce_min(x, reduced_dims="i")
        out["logsumexp"] = mm.reduce_logsumexp(x, reduced_dims="i")
        names = mesh.shape.names
        out["relayout_swap"] = mm.relayout(x, {"i": names[0]})  # alltoall
        out["relayout_gather"] = mm.relayout(x, {})
        out["relayout_slice"] = mm.relayout(out["relayout_gather"], {"b": names[-1], "i": names[0]}
                                            if len(names) > 1 else {"i": names[0]})
        out["reshape"] = mm.reshape(x, "b:8;i1:4;i2:4")
        out["merge"] = mm.reshape(mm.transpose(x, "i:16;b:8"), "ib:128")
        out["broadcast"] = mm.broadcast(bias, "b:8;h:8")
        out["rename"] = mm.rename_dimension(x, "b", "c")
        if grads:
            _add_gradients(out, {"x": x, "w": w, "bias": bias})
    return tr, [x, w, bias], out


def _windows(mesh, grads: bool = True):
    """slice, pad, concat, split, shift, halo exchange and cumsum along a split dim; gradients. The
    sizes divide every mesh dim of 1-8 ranks (equal blocks; test_uneven_windows_replay_matches_mpi
    replays these ops on uneven and empty blocks)."""
    x = mesh.from_numpy(global_array("b:12;s:24", 4), "b:12;s:24")
    x2 = mesh.from_numpy(global_array("b:12;s:24", 5), "b:12;s:24")
    ints = mesh.from_numpy(np.arange(288, dtype=np.int32).reshape(12, 24) % 7, "b:12;s:24")
    out = {}
    with mm.trace() as tr:
        out["slice"] = mm.slice(x, 3, 8, "s")
        out["pad"] = mm.pad(x, [2, 6], "s")
        out["concat"] = mm.concat([x, x2], "s")
        out["split0"], out["split1"] = mm.split(x, "s", [8, 16])
        out["shift"] = mm.shift(x, 3, "s", wrap=False)
        out["shift_far"] = mm.shift(x, -9, "s", wrap=False)
        out["roll"] = mm.shift(x, -5, "s", wrap=True)
        out["halo"] = mm.halo_exchange(x, "s", 3)
        out["cumsum"] = mm.cumsum(x, "s")
        out["cumsum_rev_excl"] = mm.cumsum(x, "s", exclusive=True, reverse=True)
        out["cumsum_int"] = mm.cumsum(ints, "s")
        if grads:
            _add_gradients(out, {"x": x, "x2": x2})
    return tr, [x, x2, ints], out


def _conv(mesh, grads: bool = True):
    """conv2d with both spatial dims split (SAME, stride 2, dilation, explicit padding), conv1d; gradients.
    The spatial sizes divide every mesh dim of 1-8 ranks."""
    x = mesh.from_numpy(global_array("b:2;h:24;w:24;ci:3", 6), "b:2;h:24;w:24;ci:3")
    f = mesh.from_numpy(global_array("fh:3;fw:3;ci:3;co:4", 7), "fh:3;fw:3;ci:3;co:4")
    x1 = mesh.from_numpy(global_array("b:2;h:24;ci:3", 8), "b:2;h:24;ci:3")
    f1 = mesh.from_numpy(global_array("tap:3;ci:3;co:4", 9), "tap:3;ci:3;co:4")
    out = {}
    with mm.trace() as tr:
        out["conv2d"] = mm.conv2d(x, f)
        out["conv2d_stride2"] = mm.conv2d(x, f, strides=2)
        out["conv2d_dilated"] = mm.conv2d(x, f, dilation=2)
        out["conv2d_valid"] = mm.conv2d(x, f, padding=((0, 2), (0, 2)))
        out["conv1d"] = mm.conv1d(x1, f1)
        if grads:
            _add_gradients(out, {"x": x, "f": f, "x1": x1, "f1": f1})
    return tr, [x, f, x1, f1], out


def _nn(mesh, grads: bool = True):
    """one_hot, gather, top_k, argmax with the vocabulary split; softmax, log_softmax, dropout; gradients."""
    logits = mesh.from_numpy(global_array("b:4;v:16", 10), "b:4;v:16")
    emb = mesh.from_numpy(global_array("v:16;d:8", 11), "v:16;d:8")
    ids = mesh.from_numpy(np.random.default_rng(12).integers(0, 16, (4, 8)).astype(np.int32), "b:4;s:8")
    out = {}
    with mm.trace() as tr:
        out["one_hot"] = mm.one_hot(ids, mm.Dimension("v", 16))
        out["gather"] = mm.gather(emb, ids, "v")
        out["top_k_values"], out["top_k_indices"] = mm.top_k(logits, "v", "k:3")
        out["argmax"] = mm.argmax(logits, "v")
        out["softmax"] = mm.softmax(logits, "v")
        out["log_softmax"] = mm.log_softmax(logits, "v")
        out["dropout"] = mm.dropout(logits, 0.3, seed=5)
        out["stop_gradient"] = mm.stop_gradient(logits)
        if grads:
            _add_gradients(out, {"logits": logits, "emb": emb})
    return tr, [logits, emb, ids], out


B, S, V, D, C, K = 24, 8, 16, 8, 8, 8  # the batch (next to conv1d) divides every mesh dim of 1-8 ranks
SHAPES = {"emb": f"vocab:{V};d:{D}", "filt": f"tap:3;d:{D};c:{C}", "wq": f"c:{C};k:{K}",
          "wk": f"c:{C};k:{K}", "wv": f"c:{C};k:{K}", "wout": f"k:{K};vocab:{V}"}


def _params(mesh):
    rng = np.random.default_rng(42)
    p = {n: mesh.from_numpy((rng.standard_normal(mm.Shape(s).sizes) * 0.5).astype(np.float32), s)
         for n, s in SHAPES.items()}
    tokens = mesh.from_numpy(rng.integers(0, V, (B, S)).astype(np.int32), f"batch:{B};seq:{S}")
    targets = mesh.from_numpy(rng.integers(0, V, (B, S)).astype(np.int32), f"batch:{B};seq:{S}")
    return p, tokens, targets


def _loss(p, tokens, targets):
    """Embedding, conv1d, attention, softmax cross-entropy."""
    x = mm.gather(p["emb"], tokens, "vocab")
    h = mm.tanh(mm.conv1d(x, p["filt"]))
    q = mm.einsum([h, p["wq"]], reduced_dims=["c"])
    kk = mm.rename_dimension(mm.einsum([h, p["wk"]], reduced_dims=["c"]), "seq", "mseq")
    vv = mm.rename_dimension(mm.einsum([h, p["wv"]], reduced_dims=["c"]), "seq", "mseq")
    att = mm.softmax(mm.einsum([q, kk], reduced_dims=["k"]) * (1.0 / np.sqrt(K)), "mseq")
    logits = mm.einsum([mm.einsum([att, vv], reduced_dims=["mseq"]), p["wout"]], reduced_dims=["k"])
    gold = mm.reduce_sum(logits * mm.one_hot(targets, logits.shape["vocab"]), reduced_dims="vocab")
    return mm.reduce_mean(mm.reduce_logsumexp(logits, reduced_dims="vocab") - gold)


def _model(mesh, grads: bool = True):
    """A small model's loss and (always) its gradients."""
    p, tokens, targets = _params(mesh)
    with mm.trace() as tr:
        loss = _loss(p, tokens, targets)
        ds = mm.gradients([loss], list(p.values()))
    out = {"loss": loss, **{f"d_{n}": g for n, g in zip(p, ds)}}
    return tr, [tokens, targets, *p.values()], out


def _low(mesh, grads: bool = True):
    """bfloat16 activations over float32 masters: a contraction over a split dim (float32 partial
    sums across ranks, one rounding), a batched einsum, softmax, a reduction; gradients back
    through the casts to the float32 masters."""
    x = mesh.from_numpy(global_array("b:8;i:16", 1), "b:8;i:16")
    w = mesh.from_numpy(global_array("i:16;h:8", 2), "i:16;h:8")
    out = {}
    with mm.trace() as tr:
        xb, y = mm.cast(x, "bfloat16"), mm.einsum([mm.cast(x, "bfloat16"), mm.cast(w, "bfloat16")], "b:8;h:8")
        out["einsum"] = y
        q = mm.reshape(xb, "b:8;g:2;j:8")
        out["batched"] = mm.einsum([q, mm.rename_dimension(q, "j", "k")], "b:8;j:8;k:8")
        out["softmax"] = mm.softmax(y, "h")
        out["reduce_sum"] = mm.reduce_sum(y, reduced_dims="b")
        out["float32"] = mm.cast(out["softmax"], "float32") * mm.cast(out["reduce_sum"], "float32")
        if grads:
            _add_gradients(out, {"x": x, "w": w})
    return tr, [x, w], out


FAMILIES = {"dense": (_dense, "b:M0;i:M1;h:M2"), "bfloat16": (_low, "b:M0;i:M1;h:M2"), "windows": (_windows, "s:M0;b:M1"),
            "conv": (_conv, "h:M0;w:M1;co:M2"), "nn": (_nn, "v:M0;b:M1"),
            "model": (_model, "batch:M0;vocab:M1;k:M2")}
# bfloat16 gradients pass through several roundings, each of which may go the other way: 2 ulps
# (2^-7 apart near 1) of the largest value. Forward values, rounded once, are compared to float32's 2e-5.
GRAD_TOL = {"bfloat16": 2.0 ** -6}


@pytest.mark.parametrize("mesh_index", [0, 1, 2])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_matches_mpi(family, mesh_index):
    make, rules = FAMILIES[family]
    # gradients (their ops too) on the 2-D mesh; forward ops only on the others, for time
    tr, inputs, outputs = make(_mesh(mesh_index, rules), grads=mesh_index == 1)
    check_replay(tr, inputs, outputs, grad_tol=GRAD_TOL.get(family, 2e-5))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gspmd_mode_matches_mpi(family):
    make, rules = FAMILIES[family]
    tr, inputs, outputs = make(_mesh(1, rules))
    check_replay(tr, inputs, outputs, modes=("gspmd",), grad_tol=GRAD_TOL.get(family, 2e-5))


needs_ranks = pytest.mark.skipif(N == 1, reason="a mesh of one rank has no collectives")
needs_ranks_uneven = pytest.mark.skipif(N == 1 or 7 % N == 0, reason="7 rows divide evenly over N ranks")


# ------------------------------------------------------------------------------- uneven blocks
# Sizes that no mesh dim of 2, 3, 4, 6 or 8 divides (b:7 over 8 and e:2 over 3 leave empty blocks):
# every device holds its block padded to the largest, and the padding must never show.

def _full(x, dim: str) -> bool:
    """No block of `x` along `dim` is empty (max, min, logsumexp and softmax are left out here where
    one would be; tests/test_nn.py and tests/test_uneven_property.py cover empty blocks on MPI)."""
    m = x.tensor_layout[x.shape.index(dim)]
    return m is None or x.shape[dim].size >= x.mesh.shape[m].size


def _dense_uneven(mesh, grads: bool = True):
    """Elementwise, einsum contracting an uneven dim, reductions (sum, mean, max, min, logsumexp),
    softmax, cumsum, relayouts, reshape, transpose, broadcast over uneven blocks; gradients."""
    x = mesh.from_numpy(global_array("b:7;i:9", 21) - 1.0, "b:7;i:9")  # mostly negative: a max sees padding
    w = mesh.from_numpy(global_array("i:9;h:5", 22), "i:9;h:5")
    bias = mesh.from_numpy(global_array("h:5", 23), "h:5")
    out = {}
    with mm.trace() as tr:
        y = mm.einsum([x, w], "b:7;h:5")
        out["einsum"] = y
        z = mm.gelu(y + bias)
        out["where"] = mm.where(z > 0.1, z, y * 2.0)
        out["unary"] = mm.exp(x) + mm.log(mm.abs(x) + 1.0) + mm.rsqrt(mm.abs(x) + 1.0) + mm.sigmoid(x)
        out["reduce_sum"] = mm.reduce_sum(x, reduced_dims="i")
        out["reduce_mean"] = mm.reduce_mean(x)
        if _full(x, "b"):
            out["reduce_max"] = mm.reduce_max(x, reduced_dims="b")
            out["reduce_max_all"] = mm.reduce_max(x)
            out["log_softmax"] = mm.log_softmax(x, ["b", "i"])
        out["reduce_min"] = mm.reduce_min(-x, reduced_dims="i")
        out["logsumexp"] = mm.reduce_logsumexp(x * 3.0, reduced_dims="i")
        out["softmax"] = mm.softmax(x, "i")
        out["cumsum"] = mm.cumsum(x, "b")
        out["cumsum_rev_excl"] = mm.cumsum(x, "i", exclusive=True, reverse=True)
        names = mesh.shape.names
        out["relayout_swap"] = mm.relayout(x, {"i": names[0]})
        out["relayout_gather"] = mm.relayout(x, {})
        out["relayout_slice"] = mm.relayout(out["relayout_gather"], {"b": names[-1], "i": names[0]}
                                            if len(names) > 1 else {"i": names[0]})
        out["reshape"] = mm.reshape(x, "b:7;i1:3;i2:3")
        out["transpose"] = mm.transpose(x, "i:9;b:7")
        out["broadcast"] = mm.broadcast(bias, "b:7;h:5")
        out["cast"] = mm.cast(mm.reduce_sum(mm.cast(x > 0, "int32"), reduced_dims="b"), "int64")
        if grads:
            _add_gradients(out, {"x": x, "w": w, "bias": bias})
    return tr, [x, w, bias], out


def _tiny_uneven(mesh, grads: bool = True):
    """Dims shorter than their mesh dims (empty blocks), and one of size 0."""
    x = mesh.from_numpy(global_array("e:2;f:3", 24) - 2.0, "e:2;f:3")
    u = mesh.from_numpy(global_array("one:1;f:3", 25), "one:1;f:3")
    n = mesh.from_numpy(np.zeros((0, 3), np.float32), "none:0;f:3")
    out = {}
    with mm.trace() as tr:
        out["exp"] = mm.exp(x)
        out["sum"] = mm.reduce_sum(x, reduced_dims="e")
        if _full(x, "e"):
            out["max"] = mm.reduce_max(x, reduced_dims="e")
            out["softmax"] = mm.softmax(x, "e")
        out["cumsum"] = mm.cumsum(x, "e", reverse=True)
        out["einsum"] = mm.einsum([x, u], "e:2;one:1")
        out["gathered"] = mm.relayout(x, {})
        out["empty_sum"] = mm.reduce_sum(n, reduced_dims="none")
        if grads:
            _add_gradients(out, {"x": x, "u": u})
    return tr, [x, u, n], out


def _vocab_uneven(mesh, grads: bool = True):
    """A vocabulary of 257 split over the mesh: logits, softmax cross-entropy, argmax-free; gradients."""
    h = mesh.from_numpy(global_array("b:5;d:8", 26), "b:5;d:8")
    emb = mesh.from_numpy(global_array("v:257;d:8", 27), "v:257;d:8")
    gold = mesh.from_numpy(np.eye(257, dtype=np.float32)[np.random.default_rng(28).integers(0, 257, 5)], "b:5;v:257")
    out = {}
    with mm.trace() as tr:
        logits = mm.einsum([h, emb], "b:5;v:257") - 3.0
        out["logits"] = logits
        out["max"] = mm.reduce_max(logits, reduced_dims="v")
        out["softmax"] = mm.softmax(logits, "v")
        out["xent"] = mm.reduce_mean(mm.reduce_logsumexp(logits, reduced_dims="v")
                                     - mm.reduce_sum(logits * gold, reduced_dims="v"))
        out["log_softmax"] = mm.log_softmax(logits, "v")
        if grads:
            _add_gradients(out, {"h": h, "emb": emb})
    return tr, [h, emb, gold], out


def _nn_uneven(mesh, grads: bool = True):
    """one_hot, gather, top_k, argmax and dropout with a vocabulary of 7 and a batch of 5 split
    unevenly (and top_k's k); integer top_k/argmax with ties; a random input; gradients."""
    logits = mesh.from_numpy(global_array("b:5;v:7", 32) - 3.0, "b:5;v:7")  # mostly negative: zeros would win
    emb = mesh.from_numpy(global_array("v:7;d:5", 33), "v:7;d:5")
    ids = np.random.default_rng(34).integers(-1, 9, (5, 4)).astype(np.int32)  # -1, 7 and 8 pick nothing
    ids = mesh.from_numpy(ids, "b:5;s:4")
    ints = mesh.from_numpy(-1 - np.arange(35, dtype=np.int32).reshape(5, 7) % 3, "b:5;v:7")  # ties, all < 0
    noise = mesh.random_normal("b:5;v:7", seed=35)  # random tensors are made eagerly: a replay input
    out = {}
    with mm.trace() as tr:
        out["one_hot"] = mm.one_hot(ids, mm.Dimension("v", 7))
        out["gather"] = mm.gather(emb, ids, "v")
        out["top_k"], out["top_k_indices"] = mm.top_k(logits, "v", "k:3")
        out["top_k_two"], out["top_k_two_indices"] = mm.top_k(logits, "v", "two:2")  # fewer than a block holds
        out["top_k_all"], out["top_k_all_indices"] = mm.top_k(logits * noise, "v", "k:7")
        out["argmax"] = mm.argmax(logits, "v")
        out["top_k_int"], out["top_k_int_indices"] = mm.top_k(ints, "v", "two:2")
        out["argmax_int"] = mm.argmax(ints, "v")
        out["dropout"] = mm.dropout(logits, 0.4, seed=5)
        if grads:
            _add_gradients(out, {"logits": logits, "emb": emb, "noise": noise})
    return tr, [logits, emb, ids, ints, noise], out


def _nn_tiny(mesh, grads: bool = True):
    """The same ops along a dim of 2, which mesh dims of 3 and more cut into empty blocks."""
    x = mesh.from_numpy(global_array("b:3;e:2", 36) - 3.0, "b:3;e:2")
    table = mesh.from_numpy(global_array("e:2;d:3", 37), "e:2;d:3")
    ids = mesh.from_numpy(np.array([[1, 0], [2, 1], [0, -1]], np.int32), "b:3;t:2")
    out = {}
    with mm.trace() as tr:
        out["one_hot"] = mm.one_hot(ids, mm.Dimension("e", 2))
        out["gather"] = mm.gather(table, ids, "e")
        out["top_k"], out["top_k_indices"] = mm.top_k(x, "e", "j:2")
        out["argmax"] = mm.argmax(x, "e")
        out["dropout"] = mm.dropout(x, 0.5, seed=6)
        if grads:
            _add_gradients(out, {"x": x, "table": table})
    return tr, [x, table, ids], out


def _moe(mesh, grads: bool = True):
    """GShard's top-2 MoE routed by gathers (top2_slots, dispatch_slots with its jax `.at[].set`,
    combine_slots) over 5 groups and 3 experts, which most mesh dims split unevenly; some tokens
    overflow; gradients."""
    p = mm.layers.init_moe(mesh, 0, "d_model:4", "experts:3", "d_ff:6")
    x = mesh.from_numpy(global_array("group:5;tokens:6;d_model:4", 38), "group:5;tokens:6;d_model:4")
    out = {}
    with mm.trace() as tr:
        out["y"], out["aux"] = mm.layers.moe(p, x, "group", second_policy="all", capacity_factor=1.0,
                                             min_capacity=2, routing="gather")
        if grads:
            _add_gradients(out, {"x": x, **p})
    return tr, [x, *p.values()], out


MODES_UNEVEN = {0: ("shard_map", "gspmd"), 1: ("shard_map",), 2: ("shard_map", "gspmd")}
UNEVEN = {"dense": (_dense_uneven, "b:M0;i:M1;h:M2"), "tiny": (_tiny_uneven, "e:M0;one:M1;none:M2"),
          "vocab": (_vocab_uneven, "v:M0;b:M1"), "nn": (_nn_uneven, "v:M0;k:M0;b:M1"),
          "nn_tiny": (_nn_tiny, "e:M0;j:M0;b:M1"), "moe": (_moe, "group:M0;experts:M0;d_ff:M1")}


@pytest.mark.parametrize("mesh_index", [0, 1, 2])
@pytest.mark.parametrize("family", list(UNEVEN))
def test_uneven_replay_matches_mpi(family, mesh_index):
    """Uneven and empty blocks: both modes, gradients included, equal MPI's values (which the
    uneven-layout suites check against numpy)."""
    make, rules = UNEVEN[family]
    tr, inputs, outputs = make(_mesh(mesh_index, rules))
    check_replay(tr, inputs, outputs, modes=MODES_UNEVEN[mesh_index])



def test_uneven_matches_numpy():
    """The replay of uneven blocks against numpy itself (float64), not only against MPI."""
    mesh = _mesh(0, "v:M0")
    a = global_array("b:7;v:11", 29).astype(np.float64) - 1.0
    x = mesh.from_numpy(a, "b:7;v:11")
    with mm.trace() as tr:
        outs = {"max": mm.reduce_max(x, reduced_dims="v"), "softmax": mm.softmax(x, "v"), "cumsum": mm.cumsum(x, "v")}
    try:
        if RANK == 0:
            got = mm.tpu.replay(tr, [x], list(outs.values()), devices=DEVICES)(a)
            e = np.exp(a - a.max(1, keepdims=True))
            for g, w, name in zip(got, [a.max(1), e / e.sum(1, keepdims=True), np.cumsum(a, 1)], outs):
                np.testing.assert_allclose(np.asarray(g), w, rtol=1e-12, atol=1e-12, err_msg=name)
    finally:
        _wait_all()


def test_uneven_unsupported_op_is_refused():
    """An op whose kernel is not known to run on padded blocks (here one made up for the test)
    refuses uneven blocks with a ReplayError naming the dim and blocks; it replays with even blocks."""
    from mpimesh.opdef import OpDef
    from mpimesh.trace import OpRecord, Trace
    mesh = _mesh(0, "s:M0")
    k = mesh.shape[mesh.shape.names[0]].size
    for size in (7, 24):  # uneven on 2-8 ranks but 7; even on all
        x = mesh.from_numpy(global_array(f"b:2;s:{size}", 30), f"b:2;s:{size}")
        with mm.trace() as tr:
            y = mm.exp(x)
        made_up = Trace()
        unpadded = OpDef("made_up", lambda ctx, a: a + 1, fill=None)
        made_up._append(OpRecord(unpadded, tr.ops[0].inputs, tr.ops[0].outputs, {}))
        if size % k:  # no compile: every rank checks
            with pytest.raises(mm.tpu.ReplayError, match=rf"op made_up\(.*dim s:{size} split over mesh dim "
                                                          rf".* into blocks \(.*cannot run on padded blocks"):
                mm.tpu.replay(made_up, [x], [y], devices=DEVICES)
        else:
            mm.tpu.replay(made_up, [x], [y], devices=DEVICES)


@needs_ranks_uneven
def test_uneven_replay_must_be_built_on_rank_zero():
    mesh = _mesh(0, "b:M0")
    x = mesh.from_numpy(global_array("b:7;i:2", 31), "b:7;i:2")
    with mm.trace() as tr:
        y = mm.exp(x)
    if x.local.shape[0] == 7 // N + 1:  # the largest block (rank 0's)
        mm.tpu.replay(tr, [x], [y], devices=DEVICES)
    else:
        with pytest.raises(mm.tpu.ReplayError, match=r"not the largest.*build a replay of uneven blocks on rank 0"):
            mm.tpu.replay(tr, [x], [y], devices=DEVICES)


def _step(opt, p, state, tokens, targets):
    """One training step: loss, gradients, optimizer update."""
    loss = _loss(p, tokens, targets)
    grads = mm.gradients([loss], list(p.values()))
    new_p, new_state = opt.update(p, dict(zip(p, grads)), state)
    return loss, new_p, new_state


def _flat(p: dict, state: dict) -> list:
    return [*p.values(), state["step"], *state["m"].values(), *state["v"].values()]


def test_training_step_replay_serves_every_step():
    """A recorded Adam step (forward, gradients, update), replayed in a loop, follows MPI's steps."""
    mesh = _mesh(1, FAMILIES["model"][1])
    p, tokens, targets = _params(mesh)
    opt = mm.optim.Adam(lambda t: 0.05 * mm.minimum(t / 2.0, 1.0), weight_decay=0.01)
    state = opt.init(p)
    with mm.trace() as tr:
        loss, p1, s1 = _step(opt, p, state, tokens, targets)
    with mm.trace():  # the next steps run eagerly on MPI (gradients need a trace)
        loss2, p2, s2 = _step(opt, p1, s1, tokens, targets)
    with mm.trace():
        loss3, p3, s3 = _step(opt, p2, s2, tokens, targets)
    ins = [tokens, targets, *_flat(p, state)]
    data = [t.to_numpy() for t in ins]
    want = [[t.to_numpy() for t in [lo, *_flat(pp, ss)]] for lo, pp, ss in
            ((loss, p1, s1), (loss2, p2, s2), (loss3, p3, s3))]
    try:
        if RANK == 0:
            fn = mm.tpu.replay(tr, ins, [loss, *_flat(p1, s1)], devices=DEVICES)
            for step, w in enumerate(want, 1):
                got = fn(*data)
                for i, (g, x) in enumerate(zip(got, w)):
                    _compare(g, x, f"step {step}, output {i}")
                data = data[:2] + [np.asarray(g) for g in got[1:]]
    finally:
        _wait_all()


def test_transformer_training_step_replay():
    """apps/transformer.py's training step (forward, gradients, Adafactor), tiny, on its default
    mesh and the paper's layout: the replay equals the MPI step."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
    import transformer as T
    cfg = T.Config(d_model=16, heads=4, d_kv=4, d_ff=32, layers=1, length=8, batch=8)
    mesh = mm.Mesh(T.default_mesh(N), layout=T.PAPER_LAYOUT)
    params = T.init_params(mesh, cfg)
    opt = T.make_optimizer(cfg)
    state = opt.init(params)
    data = np.random.default_rng(0).integers(0, 256, 4096).astype(np.uint8)
    batch = T.make_batch(mesh, data, cfg, T.train_offsets(data, cfg, 0, 0))
    names = list(params)

    def flat(s: dict) -> list:
        return [s["step"]] + [s[k][n] for k in sorted(s) if k != "step" for n in sorted(s[k])]
    with mm.trace() as tr:
        loss = T.loss_fn(params, batch, cfg)
        grads = mm.gradients([loss], [params[n] for n in names])
        new_params, new_state = opt.update(params, dict(zip(names, grads)), state)
    inputs = [batch["inputs"], batch["targets"], *params.values(), *flat(state)]
    outputs = {"loss": loss, **{n: new_params[n] for n in names},
               **{f"state{i}": t for i, t in enumerate(flat(new_state))}}
    check_replay(tr, inputs, outputs)


def _every_collective(ctx, x, names: tuple):
    """Every collective of `ctx` over every mesh dim, flattened into one vector."""
    out = []
    for m in names:
        out += [ctx.allreduce(x, (m,), op) for op in ("sum", "max", "min")]
        out += [ctx.allgather(x, m, 1), ctx.alltoall(x, m, 1, 0), ctx.reduce_scatter(x, m, 1),
                ctx.reduce_scatter(x, m, 1, "max"), ctx.block(x, m, 1), x * 0 + ctx.coord(m)]
        out += [ctx.permute(x, m, off, wrap) for off in (-2, -1, 1, 3) for wrap in (True, False)]
        out += [ctx.exscan(x, m, op) for op in ("sum", "max", "min")]
    out.append(ctx.allreduce(x, names, "sum"))
    return ctx.xp.concatenate([ctx.xp.reshape(o, (-1,)) for o in out])


@pytest.mark.parametrize("mesh_index", [0, 1, 2])
def test_collectives_match_mpi(mesh_index):
    """The JAX collectives (under shard_map, and under vmap as in gspmd mode) equal the MPI ones."""
    from jax.sharding import PartitionSpec as P

    from mpimesh.tpu.collectives import JaxCollectives
    from mpimesh.tpu.replay import _jax_mesh, _shard_map, _x64
    mesh = mm.Mesh(mesh_shapes()[mesh_index], backend="numpy")  # (host arrays into its collectives, also on a GPU)
    names = mesh.shape.names
    local = (np.arange(96, dtype=np.float32).reshape(4, 24) * 0.5 + 100 * mesh.rank) % 37  # 24: equal blocks
    mine = _every_collective(mesh.collectives, local, names)
    every = np.empty((N,) + mine.shape, mine.dtype)
    WORLD.Allgather(np.ascontiguousarray(mine), every)  # world rank = mesh rank (no reordering)
    try:
        if RANK == 0:
            data = np.stack([(np.arange(96, dtype=np.float32).reshape(4, 24) * 0.5 + 100 * r) % 37
                             for r in range(N)])  # [device, 4, 24], devices row-major over the mesh
            jmesh = _jax_mesh(mesh.shape, DEVICES)
            spec = P(names, None)
            fn = _shard_map(lambda a: _every_collective(JaxCollectives(mesh.shape), a, names), jmesh, spec, P(names))
            with _x64():
                got = np.asarray(jax.jit(fn)(data.reshape(N * 4, 24))).reshape(every.shape)
            np.testing.assert_array_equal(got, every, err_msg="shard_map")

            def per_device(a):
                return _every_collective(JaxCollectives(mesh.shape, vmapped=True), a, names)
            for m in reversed(names):
                per_device = jax.vmap(per_device, axis_name=m)
            with _x64():
                got = np.asarray(jax.jit(per_device)(data.reshape(mesh.shape.sizes + (4, 24))))
            np.testing.assert_array_equal(got.reshape(every.shape), every, err_msg="vmap")
    finally:
        _wait_all()


# ------------------------------------------------------------------------------- compiled HLO

def _replica_groups(text: str, op: str) -> list:
    """The replica groups of every `op` instruction of HLO `text`, each a set of frozensets."""
    found = []
    for line in text.splitlines():
        if f" {op}(" not in line and f" {op}-start(" not in line:
            continue
        m = re.search(r"replica_groups=(\{[\d,{} ]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", line)
        assert m, f"no replica_groups in: {line}"
        spec = m.group(1)
        if spec.startswith("{"):
            groups = [g for g in re.findall(r"\{([\d, ]*)\}", spec)]
            found.append({frozenset(int(i) for i in g.split(",") if i.strip()) for g in groups})
        else:  # iota form [groups,size]<=[dims]T(perm)
            shape, dims, perm = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec).groups()
            ids = np.arange(int(np.prod([int(d) for d in dims.split(",")]))).reshape([int(d) for d in dims.split(",")])
            if perm:
                ids = ids.transpose([int(p) for p in perm.split(",")])
            ids = ids.reshape([int(s) for s in shape.split(",")])
            found.append({frozenset(int(i) for i in row) for row in ids})
    return found


def _groups_over(mesh: mm.Mesh, mesh_dim: str) -> set:
    """Device ids (row-major over the mesh) that differ only in `mesh_dim`."""
    ids = np.arange(mesh.size).reshape(mesh.shape.sizes)
    ids = np.moveaxis(ids, mesh.shape.names.index(mesh_dim), -1).reshape(-1, mesh.shape[mesh_dim].size)
    return {frozenset(int(i) for i in row) for row in ids}




@needs_ranks
@pytest.mark.parametrize("mesh_index", [0, 1])
def test_hlo_split_contraction_has_allreduce(mesh_index):
    mesh = mm.Mesh(mesh_shapes()[mesh_index])
    m = mesh.shape.names[-1]  # the contracted dim's mesh dim (of size > 1 on these meshes)
    x = mesh.from_numpy(global_array("b:4;i:24", 1), "b:4;i:24", layout={"i": m})
    w = mesh.from_numpy(global_array("i:24;h:8", 2), "i:24;h:8", layout={"i": m})
    with mm.trace() as tr:
        y = mm.einsum([x, w], "b:4;h:8")
    try:
        if RANK == 0:
            fn = mm.tpu.replay(tr, [x, w], [y], devices=DEVICES)
            text = fn.lower(global_array("b:4;i:24", 1), global_array("i:24;h:8", 2)).compile().as_text()
            groups = _replica_groups(text, "all-reduce")
            assert groups, "no all-reduce in the compiled HLO"
            assert _groups_over(mesh, m) in groups, f"no all-reduce over {m}: {groups}"
            assert "all-to-all" not in text and "all-gather" not in text
    finally:
        _wait_all()


@needs_ranks
def test_hlo_relayout_across_dims_has_all_to_all():
    mesh = mm.Mesh(mesh_shapes()[0])
    m = mesh.shape.names[0]
    a = global_array("a:24;b:24", 3)
    x = mesh.from_numpy(a, "a:24;b:24", layout={"a": m})
    with mm.trace() as tr:
        y = mm.relayout(x, {"b": m})
    try:
        if RANK == 0:
            fn = mm.tpu.replay(tr, [x], [y], devices=DEVICES)
            text = fn.lower(a).compile().as_text()
            assert _groups_over(mesh, m) in _replica_groups(text, "all-to-all"), "no all-to-all over the mesh"
            assert "all-gather" not in text and "all-reduce" not in text
            _compare(fn(a)[0], a, "relayout")
    finally:
        _wait_all()


# --------------------------------------------------------------------------------------- errors

def test_errors():
    mesh = _mesh(0, "a:M0")
    x = mesh.from_numpy(global_array("a:24;b:4", 1), "a:24;b:4")  # even on every session's mesh
    other = mesh.from_numpy(global_array("c:8", 2), "c:8")
    with mm.trace() as tr:
        y = mm.exp(x)
        z = mm.reduce_sum(y, reduced_dims="a")
    # None of these compiles or communicates: every rank checks them.
    wrong = jax.devices()[:N + 1] if N < 8 else jax.devices()[:4]
    with pytest.raises(mm.MeshError, match=f"has {N} processors, but {len(wrong)} JAX devices"):
        mm.tpu.replay(tr, [x], [z], devices=wrong)
    with pytest.raises(mm.tpu.ReplayError, match=r"is not an input of the trace"):
        mm.tpu.replay(tr, [x, other], [z], devices=DEVICES)
    with pytest.raises(mm.tpu.ReplayError, match=r"is not an input of the trace"):
        mm.tpu.replay(tr, [y], [z], devices=DEVICES)  # produced inside the trace
    with pytest.raises(mm.tpu.ReplayError, match=r"neither produced by the trace"):
        mm.tpu.replay(tr, [x], [other], devices=DEVICES)
    with pytest.raises(mm.MpimeshError, match="mode must be one of"):
        mm.tpu.replay(tr, [x], [z], mode="pjit", devices=DEVICES)
    for args, kw, words in (((None, [x], [z]), {}, "trace must be a trace"),
                            ((tr, x, [z]), {}, "inputs must be a list"),
                            ((tr, [x], [z]), {"devices": "cpu"}, "devices must be JAX devices"),
                            ((tr, [x], [z]), {"donate": "a"}, "donate must be a list")):
        with pytest.raises(TypeError, match=words):
            mm.tpu.replay(*args, **kw)
    with pytest.raises(mm.tpu.ReplayError, match=r"donate names input positions 0\.\.0, got 3"):
        mm.tpu.replay(tr, [x], [z], devices=DEVICES, donate=[3])
    if mesh.size > 1:  # a split tensor the trace reads must be an input
        with pytest.raises(mm.tpu.ReplayError, match=r"split over the mesh and not among the replay inputs"):
            mm.tpu.replay(tr, [], [z], devices=DEVICES)
    from mpimesh.opdef import OpDef
    with pytest.raises(TypeError, match=r"op 'exp': its kernel is None, not a function"):
        OpDef("exp", None)
    fn = mm.tpu.replay(tr, [x], [z], devices=DEVICES)
    with pytest.raises(mm.ShapeError, match=r"input 0 has shape \(4, 24\), the trace's tensor has \(24, 4\)"):
        fn(np.zeros((4, 24), np.float32))
    assert issubclass(mm.tpu.ReplayError, mm.MpimeshError)


def test_values_read_on_the_host_before_the_ops_are_refused():
    """`x * float(sum(x))` in a trace: the replay would keep the recorded sum (it gave 6 for 4 on
    ones). Refused, naming the line; a value read once the replay's ops are done is fine."""
    mesh = _mesh(0, "a:M0")
    xa = global_array("a:24;b:4", 3)
    x = mesh.from_numpy(xa, "a:24;b:4")
    with mm.trace() as tr:
        y = x * float(mm.reduce_sum(x))
    with pytest.raises(mm.tpu.ReplayError, match=r"read the values of a \[\] float\d+ tensor computed from the "
                                                 r"replay's inputs on the host \(float\(\)\) at .*test_tpu\.py:\d+"):
        mm.tpu.replay(tr, [x], [y], devices=DEVICES)
    with mm.trace() as tr:
        z = mm.exp(x) * 2.0
        total = float(mm.reduce_sum(z))  # after the replay's last op
    (got,) = mm.tpu.replay(tr, [x], [z], devices=DEVICES)(np.ones_like(xa))
    np.testing.assert_allclose(np.asarray(got), np.full(xa.shape, 2 * np.e), rtol=1e-5)
    np.testing.assert_allclose(total, 2 * np.exp(xa).sum(), rtol=1e-4)


def test_import_does_not_load_jax():
    import subprocess
    import sys
    code = "import sys, mpi4py; mpi4py.rc.initialize = False; import mpimesh; assert 'jax' not in sys.modules, 'mpimesh imported jax'"
    if RANK == 0:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI", "HYDRA", "PMIX"))}
        subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    _wait_all()


# ------------------------------------------------- windows over uneven blocks (shift, halo, conv)
# s:7, h:7, w:5 split over 2, 3 or 4 devices, e:2 over 3 or 4 (empty blocks): the replay allgathers
# the dim and takes each device's window (see mm.ops.shift), and must give MPI's values.

def _split_big(i: int, first: str, second: str = "") -> mm.Mesh:
    """The i-th mesh of this session with the dims of `first` (';'-separated names) on its largest
    mesh dim and those of `second` on the next largest."""
    shape = mm.Shape(mesh_shapes()[i])
    big = sorted(shape.names, key=lambda m: -shape[m].size)
    rules = [f"{d}:{big[0]}" for d in first.split(";")]
    if second and len(big) > 1:
        rules += [f"{d}:{big[1]}" for d in second.split(";")]
    return mm.Mesh(mesh_shapes()[i], layout=";".join(rules))


def _shift_uneven(mesh_index: int, grads: bool = True):
    """shift (wrap or not, farther than a block), halo exchange (wider than the short and empty
    blocks, wrapped) along uneven dims; gradients (the opposite shift, the halo transpose)."""
    mesh = _split_big(mesh_index, "s;e")
    x = mesh.from_numpy(global_array("b:2;s:7", 40), "b:2;s:7")
    e = mesh.from_numpy(global_array("e:2;c:3", 41), "e:2;c:3")
    out = {}
    with mm.trace() as tr:
        out["shift"] = mm.shift(x, 2, "s", wrap=False)
        out["shift_far"] = mm.shift(x, -5, "s", wrap=False)
        out["roll"] = mm.shift(x, 4, "s", wrap=True)
        out["roll_back"] = mm.shift(x, -1, "s", wrap=True)
        out["shift_empty"] = mm.shift(e, 1, "e", wrap=False)
        out["roll_empty"] = mm.shift(e, -1, "e", wrap=True)
        out["halo"] = mm.halo_exchange(x, "s", 1)
        out["halo_wide"] = mm.halo_exchange(x, "s", 3)
        out["halo_wrap"] = mm.halo_exchange(x, "s", 2, wrap=True)
        out["halo_empty"] = mm.halo_exchange(e, "e", 1, wrap=True)
        if grads:
            _add_gradients(out, {"x": x, "e": e})
    return tr, [x, e], out


def _conv_uneven(mesh_index: int, grads: bool = True):
    """conv1d and conv2d along uneven dims (SAME, VALID, stride 2 whose output blocks do not line
    up with the input's, dilation, explicit padding; an input of 2 over more devices); gradients."""
    mesh = _split_big(mesh_index, "s;h;e", "w")
    x1 = mesh.from_numpy(global_array("b:2;s:7;ci:2", 42), "b:2;s:7;ci:2")
    f1 = mesh.from_numpy(global_array("tap:3;ci:2;co:3", 43), "tap:3;ci:2;co:3")
    x2 = mesh.from_numpy(global_array("b:1;h:7;w:5;ci:2", 44), "b:1;h:7;w:5;ci:2")
    f2 = mesh.from_numpy(global_array("fh:3;fw:2;ci:2;co:3", 45), "fh:3;fw:2;ci:2;co:3")
    xe = mesh.from_numpy(global_array("b:1;e:2;ci:2", 46), "b:1;e:2;ci:2")
    out = {}
    with mm.trace() as tr:
        out["conv1d"] = mm.conv1d(x1, f1)
        out["conv1d_stride2"] = mm.conv1d(x1, f1, stride=2)
        out["conv1d_valid_stride2"] = mm.conv1d(x1, f1, stride=2, padding="VALID")
        out["conv1d_dilated"] = mm.conv1d(x1, f1, padding="VALID", dilation=2)
        out["conv2d"] = mm.conv2d(x2, f2)
        out["conv2d_stride2"] = mm.conv2d(x2, f2, strides=2)
        out["conv2d_valid"] = mm.conv2d(x2, f2, strides=(2, 1), padding="VALID")
        out["conv2d_explicit"] = mm.conv2d(x2, f2, padding=((0, 2), (1, 0)))
        out["conv_empty"] = mm.conv1d(xe, f1)
        out["conv_empty_stride2"] = mm.conv1d(xe, f1, stride=2)
        if grads:
            _add_gradients(out, {"x1": x1, "f1": f1, "x2": x2, "f2": f2, "xe": xe})
    return tr, [x1, f1, x2, f2, xe], out


@needs_ranks
@pytest.mark.parametrize("mesh_index", [0, 1, 2])
@pytest.mark.parametrize("family", ["shift", "conv"])
def test_uneven_windows_replay_matches_mpi(family, mesh_index):
    """shift, halo exchange, conv1d and conv2d on uneven and empty blocks: both modes, gradients
    included, equal MPI's values (which tests/test_shift.py and tests/test_conv.py check against numpy)."""
    make = {"shift": _shift_uneven, "conv": _conv_uneven}[family]
    tr, inputs, outputs = make(mesh_index)
    check_replay(tr, inputs, outputs, modes=MODES_UNEVEN[mesh_index])


@pytest.mark.skipif(N != 1, reason="one device: runs in the 1-rank session")
def test_remat_second_runs_pass_a_barrier():
    """`mm.remat` blocks replay as `jax.checkpoint` ones: each second run reads its inputs through one
    `optimization_barrier`, so XLA cannot merge it with the first run (which computes the same
    values) and keep the first's activations; the values are the eager step's (float64)."""
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    x = mesh.from_numpy(global_array("b:6;d:4", 31).astype(np.float64), "b:6;d:4")
    ws = [(mesh.from_numpy(global_array("d:4;f:5", 32 + k).astype(np.float64), "d:4;f:5"),
           mesh.from_numpy(global_array("f:5;d:4", 40 + k).astype(np.float64), "f:5;d:4")) for k in range(3)]
    flat = [w for pair in ws for w in pair]

    def block(h, w1, w2):
        return h + mm.einsum([mm.tanh(mm.einsum([h, w1])), w2], output_shape=h.shape)
    texts, values = {}, {}
    for remat in (False, True):
        with mm.trace() as tr:
            h = x
            for w1, w2 in ws:
                h = (mm.remat(block) if remat else block)(h, w1, w2)
            loss = mm.reduce_sum(h * h)
            grads = mm.gradients([loss], flat)
        fn = mm.tpu.replay(tr, [x, *flat], [loss, *grads], devices=DEVICES[:1])
        data = [t.to_numpy() for t in [x, *flat]]
        texts[remat] = fn.lower(*data).as_text()
        values[remat] = [np.asarray(v) for v in fn(*data)]
        for got, want in zip(values[remat], [loss, *grads]):
            np.testing.assert_allclose(got, want.to_numpy(), rtol=1e-12, atol=1e-12)
    assert texts[False].count("optimization_barrier") == 0
    assert texts[True].count("optimization_barrier") == len(ws), texts[True].count("optimization_barrier")
    for a, b in zip(values[False], values[True]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
