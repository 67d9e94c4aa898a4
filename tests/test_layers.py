"""mm.layers against numpy references on the global arrays, under several layouts and meshes,
plus gradient checks (layer_norm, attention, cross-entropy) and communication counts."""
from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from gradcheck import check_gradients
from meshes import global_array, mesh_shapes, transfers

B, L, D, H, K, F, V = 8, 8, 8, 8, 4, 16, 16
X = f"batch:{B};length:{L};d_model:{D}"
RTOL, ATOL = 2e-5, 2e-5


def rule_sets(shape: str) -> list[str]:
    """Layout rules for a mesh shape: replicated, data-parallel, model-parallel (heads, d_ff,
    vocab), d_model split, sequence split, and 2-D/3-D combinations."""
    mesh_shape = mm.Shape(shape)
    m = [d.name for d in mesh_shape if d.size > 1]
    out = [""]
    if m:
        a = m[0]
        out += [f"batch:{a}", f"heads:{a};d_ff:{a};vocab:{a}", f"d_model:{a}", f"length:{a}"]
    if len(m) >= 2:
        a, b = m[:2]
        out += [f"batch:{a};heads:{b};d_ff:{b};vocab:{b}", f"batch:{a};d_model:{b};memory_length:{b}"]
    if len(m) >= 3:
        a, b, c = m[:3]
        out += [f"batch:{a};heads:{b};d_ff:{b};vocab:{b};d_kv:{c}", f"batch:{a};length:{b};d_model:{c}"]
    return out


def configs():
    for shape in mesh_shapes():
        for rules in rule_sets(shape):
            yield shape, rules


def softmax(a, axis):
    e = np.exp(a - a.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def np_attention(x, wq, wk, wv, wo, causal):
    q = np.einsum("bld,dhk->blhk", x, wq) / math.sqrt(wq.shape[-1])
    k = np.einsum("bmd,dhk->bmhk", x, wk)
    v = np.einsum("bmd,dhk->bmhk", x, wv)
    logits = np.einsum("blhk,bmhk->blhm", q, k)
    if causal:
        n = x.shape[1]
        logits = logits + np.where(np.arange(n)[None, :] > np.arange(n)[:, None], -1e9, 0.0)[None, :, None, :]
    o = np.einsum("blhm,bmhk->blhk", softmax(logits, -1), v)
    return np.einsum("blhk,hkd->bld", o, wo)


def np_gelu(a):
    return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))


def np_layer_norm(x, scale, bias, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + bias


def np_xent(logits, targets):
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * max(1.0, float(np.abs(want).max())), err_msg=what)


# ----------------------------------------------------------------------------------- forward

def test_dense():
    x, w, b = global_array(X, 0), global_array(f"d_model:{D};heads:{H};d_kv:{K}", 1), global_array(f"heads:{H};d_kv:{K}", 2)
    want = np.einsum("bld,dhk->blhk", x, w) + b
    for shape, rules in configs():
        mesh = mm.Mesh(shape, layout=rules)
        p = {"kernel": mesh.from_numpy(w, f"d_model:{D};heads:{H};d_kv:{K}"),
             "bias": mesh.from_numpy(b, f"heads:{H};d_kv:{K}")}
        y = mm.layers.dense(p, mesh.from_numpy(x, X))
        assert y.shape == mm.Shape(f"batch:{B};length:{L};heads:{H};d_kv:{K}")
        close(y.to_numpy(), want, f"{shape} {rules}")


def test_dense_explicit_reduced_dims_and_errors():
    mesh = mm.Mesh(mesh_shapes()[0], layout="")
    x = mesh.ones("e:2;d:4")
    y = mm.layers.dense({"kernel": mesh.ones("e:2;d:4;f:3")}, x, reduced_dims=["d"])  # e: a batch dim
    assert y.shape == mm.Shape("e:2;f:3")
    np.testing.assert_allclose(y.to_numpy(), np.full((2, 3), 4.0))
    with pytest.raises(mm.ShapeError, match="shares no dim"):
        mm.layers.dense({"kernel": mesh.ones("a:2;f:3")}, x)
    with pytest.raises(mm.ShapeError, match="'q'"):
        mm.layers.dense({"kernel": mesh.ones("d:4;f:3")}, x, reduced_dims=["q"])


def test_layer_norm():
    x = global_array(X, 3) * 3 + 1
    scale, bias = global_array(f"d_model:{D}", 4), global_array(f"d_model:{D}", 5)
    want = np_layer_norm(x.astype(np.float64), scale, bias)
    for shape, rules in configs():
        mesh = mm.Mesh(shape, layout=rules)
        p = {"scale": mesh.from_numpy(scale, f"d_model:{D}"), "bias": mesh.from_numpy(bias, f"d_model:{D}")}
        y = mm.layers.layer_norm(p, mesh.from_numpy(x, X), "d_model")
        assert y.shape == mm.Shape(X)
        close(y.to_numpy(), want, f"{shape} {rules}")


def test_embedding_with_vocab_split_or_not():
    w = global_array(f"vocab:{V};d_model:{D}", 6)
    ids = np.random.default_rng(7).integers(0, V, size=(B, L)).astype(np.int32)
    for shape, rules in configs():
        mesh = mm.Mesh(shape, layout=rules)
        y = mm.layers.embedding({"weights": mesh.from_numpy(w, f"vocab:{V};d_model:{D}")},
                                mesh.from_numpy(ids, f"batch:{B};length:{L}"))
        assert y.shape == mm.Shape(X)
        close(y.to_numpy(), w[ids], f"{shape} {rules}")


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_feed_forward(activation):
    x, wi, wo = global_array(X, 8), global_array(f"d_model:{D};d_ff:{F}", 9), global_array(f"d_ff:{F};d_model:{D}", 10)
    act = (lambda a: np.maximum(a, 0)) if activation == "relu" else np_gelu
    want = act(x.astype(np.float64) @ wi) @ wo
    for shape, rules in configs():
        mesh = mm.Mesh(shape, layout=rules)
        p = {"wi": {"kernel": mesh.from_numpy(wi, f"d_model:{D};d_ff:{F}")},
             "wo": {"kernel": mesh.from_numpy(wo, f"d_ff:{F};d_model:{D}")}}
        y = mm.layers.feed_forward(p, mesh.from_numpy(x, X), activation)
        close(y.to_numpy(), want, f"{shape} {rules}")
    with pytest.raises(ValueError, match="swish"):
        mm.layers.feed_forward(p, mesh.from_numpy(x, X), "swish")


ATT = {"q": f"d_model:{D};heads:{H};d_kv:{K}", "k": f"d_model:{D};heads:{H};d_kv:{K}",
       "v": f"d_model:{D};heads:{H};d_kv:{K}", "o": f"heads:{H};d_kv:{K};d_model:{D}"}


def _att_arrays(seed=11):
    return {n: global_array(s, seed + i) * 0.7 for i, (n, s) in enumerate(ATT.items())}


@pytest.mark.parametrize("causal", [False, True])
def test_multihead_attention(causal):
    x, w = global_array(X, 12), _att_arrays()
    want = np_attention(x.astype(np.float64), w["q"], w["k"], w["v"], w["o"], causal)
    for shape, rules in configs():
        mesh = mm.Mesh(shape, layout=rules)
        p = {n: {"kernel": mesh.from_numpy(a, ATT[n])} for n, a in w.items()}
        y = mm.layers.multihead_attention(p, mesh.from_numpy(x, X), causal=causal)
        assert y.shape == mm.Shape(X)
        close(y.to_numpy(), want, f"{shape} {rules}")


def test_attention_with_memory_and_causal_length_mismatch():
    mesh = mm.Mesh(mesh_shapes()[0])
    w = _att_arrays()
    p = {n: {"kernel": mesh.from_numpy(a, ATT[n])} for n, a in w.items()}
    x, mem = global_array(X, 13), global_array(f"batch:{B};length:{L};d_model:{D}", 14)
    y = mm.layers.multihead_attention(p, mesh.from_numpy(x, X), memory=mesh.from_numpy(mem, X))
    q = np.einsum("bld,dhk->blhk", x, w["q"]) / math.sqrt(K)
    k, v = np.einsum("bmd,dhk->bmhk", mem, w["k"]), np.einsum("bmd,dhk->bmhk", mem, w["v"])
    o = np.einsum("blhm,bmhk->blhk", softmax(np.einsum("blhk,bmhk->blhm", q, k), -1), v)
    close(y.to_numpy(), np.einsum("blhk,hkd->bld", o, w["o"]), "memory")
    short = mesh.from_numpy(mem[:, :4], f"batch:{B};length:4;d_model:{D}")
    with pytest.raises(mm.ShapeError):  # length 8 vs memory_length 4
        mm.layers.multihead_attention(p, mesh.from_numpy(x, X), memory=short, causal=True)


def test_attention_errors():
    """Memory with other dims than x, x with the heads or d_kv dim, missing params and a clashing
    memory_length_dim are refused by name, on every rank, before any op runs."""
    mesh = mm.Mesh(mesh_shapes()[0], layout=rule_sets(mesh_shapes()[0])[-1])
    p = {n: {"kernel": mesh.from_numpy(a, ATT[n])} for n, a in _att_arrays().items()}
    x = mesh.ones(X)
    att = mm.layers.multihead_attention
    with pytest.raises(mm.ShapeError, match=r"extra in memory: \['z:2'\], missing from memory: \[\]"):
        att(p, x, memory=mesh.ones(f"batch:{B};length:3;d_model:{D};z:2"))
    with pytest.raises(mm.ShapeError, match=r"extra in memory: \['batch:4'\], missing from memory: \['batch:8'\]"):
        att(p, x, memory=mesh.ones(f"batch:4;length:3;d_model:{D}"))
    for extra in (f"heads:{H}", "d_kv:3"):
        name = extra.split(":")[0]
        with pytest.raises(mm.ShapeError, match=rf"shares \['d_model', '{name}'\]: x must not have the heads or d_kv"):
            att(p, mesh.ones(f"{extra};length:{L};d_model:{D}"))
    with pytest.raises(mm.MpimeshError, match=r"params lack \['k', 'v', 'o'\]; they have \['q'\]"):
        att({"q": p["q"]}, x)
    for name in ("batch", "length", "heads"):
        with pytest.raises(mm.ShapeError, match=rf"memory_length_dim '{name}' must be a new name"):
            att(p, x, memory_length_dim=name)


def test_attention_memory_in_another_order_and_length():
    """Memory of another length, its dims in another order, keys' length named by memory_length_dim."""
    w = _att_arrays()
    ms = f"length:3;batch:{B};d_model:{D}"
    x, mem = global_array(X, 19), global_array(ms, 20)
    q = np.einsum("bld,dhk->blhk", x, w["q"]) / math.sqrt(K)
    k, v = np.einsum("mbd,dhk->bmhk", mem, w["k"]), np.einsum("mbd,dhk->bmhk", mem, w["v"])
    o = np.einsum("blhm,bmhk->blhk", softmax(np.einsum("blhk,bmhk->blhm", q, k), -1), v)
    want = np.einsum("blhk,hkd->bld", o, w["o"])
    for shape, rules in configs():
        mesh = mm.Mesh(shape, layout=rules)
        p = {n: {"kernel": mesh.from_numpy(a, ATT[n])} for n, a in w.items()}
        y = mm.layers.multihead_attention(p, mesh.from_numpy(x, X), memory=mesh.from_numpy(mem, ms),
                                          memory_length_dim="mem")
        assert y.shape == mm.Shape(X)
        close(y.to_numpy(), want, f"{shape} {rules}")


def test_cross_entropy_hard_and_soft_targets_stable():
    logits = global_array(f"batch:{B};length:{L};vocab:{V}", 15) * 4
    logits[0, 0] += 1e4  # would overflow a naive exp
    targets = np.random.default_rng(16).integers(0, V, size=(B, L)).astype(np.int32)
    soft = softmax(global_array(f"batch:{B};length:{L};vocab:{V}", 17), -1).astype(np.float32)
    want = np_xent(logits.astype(np.float64), targets)
    m = logits.max(-1, keepdims=True).astype(np.float64)
    logp = logits - (np.log(np.exp(logits - m).sum(-1, keepdims=True)) + m)
    want_soft = -(soft * logp).sum(-1)
    lse = (np.log(np.exp(logits - m).sum(-1, keepdims=True)) + m)[..., 0]
    for shape, rules in configs():
        mesh = mm.Mesh(shape, layout=rules)
        lg = mesh.from_numpy(logits, f"batch:{B};length:{L};vocab:{V}")
        loss = mm.layers.softmax_cross_entropy_with_logits(lg, mesh.from_numpy(targets, f"batch:{B};length:{L}"), "vocab")
        assert loss.shape == mm.Shape(f"batch:{B};length:{L}")
        got = loss.to_numpy()
        assert np.isfinite(got).all()
        close(got, want, f"hard {shape} {rules}")
        sl = mm.layers.softmax_cross_entropy_with_logits(
            lg, mesh.from_numpy(soft, f"batch:{B};length:{L};vocab:{V}"), mm.Dimension("vocab", V), z_loss=1e-4)
        close(sl.to_numpy(), want_soft + 1e-4 * lse ** 2, f"soft {shape} {rules}")
    with pytest.raises(mm.ShapeError, match="integer"):
        mm.layers.softmax_cross_entropy_with_logits(lg, mesh.ones(f"batch:{B};length:{L}"), "vocab")
    with pytest.raises(mm.ShapeError, match="'vocab2'"):
        mm.layers.softmax_cross_entropy_with_logits(lg, mesh.ones(f"batch:{B};length:{L}"), "vocab2")
    xent = mm.layers.softmax_cross_entropy_with_logits
    ids = mesh.from_numpy(targets, f"batch:{B};length:{L}")
    for call, kind, words in (
            (lambda: xent(lg, mesh.from_numpy(targets[:, 0], f"batch:{B}"), "vocab"), mm.ShapeError,
             "a missing dim would be broadcast"),  # it was: each batch row's target for every position
            (lambda: xent(lg, targets, "vocab"), TypeError, "targets is a ndarray"),
            (lambda: xent(mm.cast(lg, "int32"), ids, "vocab"), mm.DTypeError, "logits is a .* int32 tensor"),
            (lambda: xent(lg, mm.cast(mesh.from_numpy(soft, f"batch:{B};length:{L};vocab:{V}"), "int32"), "vocab"),
             mm.DTypeError, "targets is a .* int32 tensor"),
            (lambda: xent(lg, ids, ["vocab", "length"]), mm.ShapeError, "vocab_dim must be one dim"),
            (lambda: xent(lg, ids, mm.Dimension("vocab", V + 1)), mm.ShapeError, f"vocab:{V + 1}")):
        with pytest.raises(kind, match=words):
            call()


def test_init_is_layout_independent():
    ref_mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)

    def init(mesh):
        return mm.layers.flatten({
            "att": mm.layers.init_attention(mesh, 1, f"d_model:{D}", f"heads:{H}", f"d_kv:{K}"),
            "ffn": mm.layers.init_feed_forward(mesh, 2, f"d_model:{D}", f"d_ff:{F}", use_bias=True),
            "emb": mm.layers.init_embedding(mesh, 3, f"vocab:{V}", f"d_model:{D}"),
            "ln": mm.layers.init_layer_norm(mesh, f"d_model:{D}")})
    ref = {k: t.to_numpy() for k, t in init(ref_mesh).items()}
    assert len({float(a.ravel()[0]) for k, a in ref.items() if k.endswith("kernel")}) == 6  # distinct seeds
    for shape, rules in configs():
        got = init(mm.Mesh(shape, layout=rules))
        assert list(got) == list(ref)
        for k, t in got.items():
            np.testing.assert_array_equal(t.to_numpy(), ref[k], err_msg=f"{k} {shape} {rules}")
    assert mm.layers.unflatten(mm.layers.flatten({"a": {"b": 1}})) == {"a": {"b": 1}}


# ------------------------------------------------------------------------------ communication

def test_attention_communication_follows_layout():
    """Data-parallel: no collective. Heads split: one allreduce of the output (the projection
    over heads), nothing else."""
    w = _att_arrays()
    for shape in mesh_shapes():
        mdims = [d for d in mm.Shape(shape) if d.size > 1]
        if not mdims:
            continue
        m = mdims[0]
        for rules, want in [(f"batch:{m.name}", {}), (f"heads:{m.name}", {f"allreduce/{m.name}": B * L * D})]:
            mesh = mm.Mesh(shape, layout=rules)
            p = {n: {"kernel": mesh.from_numpy(a, ATT[n])} for n, a in w.items()}
            x = mesh.from_numpy(global_array(X, 18), X)
            with mm.profile() as prof:
                mm.layers.multihead_attention(p, x, causal=True)
            got = {k: v["elements"] for k, v in transfers(prof.counters).items() if k != "flops"}
            assert got == want, f"{shape} {rules}: {prof.counters}"


# ---------------------------------------------------------------------------------- gradients

def _grad_meshes():
    one, two = mesh_shapes()[:2]
    m1 = [d.name for d in mm.Shape(one) if d.size > 1]
    m2 = [d.name for d in mm.Shape(two) if d.size > 1]
    a = m1[0] if m1 else None
    out = [(one, f"heads:{a};d_ff:{a};vocab:{a}" if a else "")]
    if len(m2) >= 2:
        out.append((two, f"batch:{m2[0]};heads:{m2[1]};vocab:{m2[1]}"))
    elif a:
        out.append((one, f"batch:{a}"))
    return out


def test_layer_norm_gradients():
    x = global_array("batch:4;d_model:8", 20) * 2 + 0.5
    one = mesh_shapes()[0]
    split_model = [(one, "d_model:all")] if MPI.COMM_WORLD.Get_size() > 1 else []
    for shape, rules in _grad_meshes() + split_model:
        mesh = mm.Mesh(shape, layout=rules)
        r = global_array("batch:4;d_model:8", 21)
        check_gradients(mesh, lambda x, s, b, r: mm.layers.layer_norm({"scale": s, "bias": b}, x, "d_model") * r,
                        [x, global_array("d_model:8", 22), global_array("d_model:8", 23), r],
                        ["batch:4;d_model:8", "d_model:8", "d_model:8", "batch:4;d_model:8"], wrt=[0, 1, 2])


def test_attention_gradients():
    shapes = ["batch:2;length:4;d_model:8", ATT["q"], ATT["k"], ATT["v"], ATT["o"], "batch:2;length:4;d_model:8"]
    arrays = [global_array(s, 30 + i) * (0.5 if i else 1.0) for i, s in enumerate(shapes)]

    def f(x, q, k, v, o, r):
        p = {"q": {"kernel": q}, "k": {"kernel": k}, "v": {"kernel": v}, "o": {"kernel": o}}
        return mm.layers.multihead_attention(p, x, causal=True) * r
    for shape, rules in _grad_meshes():
        check_gradients(mm.Mesh(shape, layout=rules), f, arrays, shapes, wrt=[0, 1, 2, 3, 4], directions=2)


def test_cross_entropy_gradients():
    shape_l = f"batch:4;length:2;vocab:{V}"
    logits = global_array(shape_l, 40) * 3
    targets = np.random.default_rng(41).integers(0, V, size=(4, 2)).astype(np.int32)
    soft = softmax(global_array(shape_l, 42), -1)
    for shape, rules in _grad_meshes():
        mesh = mm.Mesh(shape, layout=rules)
        check_gradients(mesh, lambda lg, t: mm.layers.softmax_cross_entropy_with_logits(lg, t, "vocab", z_loss=0.1),
                        [logits, targets], [shape_l, "batch:4;length:2"], wrt=[0])
        check_gradients(mesh, lambda lg, t: mm.layers.softmax_cross_entropy_with_logits(lg, t, "vocab"),
                        [logits, soft], [shape_l, shape_l], wrt=[0, 1])


def test_params_with_missing_or_misspelt_keys():
    """A missing key is named (a bare KeyError before); a misspelt one too (layer_norm skipped a
    "scal" silently); a negative epsilon is refused (NaN before)."""
    mesh = mm.Mesh(mesh_shapes()[0])
    x = mesh.ones("b:2;d:4")
    ln = mm.layers.init_layer_norm(mesh, "d:4")
    for call, words in (
            (lambda: mm.layers.layer_norm({"scal": ln["scale"]}, x, "d"), r"params have \['scal'\], none of"),
            (lambda: mm.layers.layer_norm(ln, x, "d", epsilon=-1.0), "epsilon must be >= 0, got -1.0"),
            (lambda: mm.layers.dense({"bias": ln["bias"]}, x), r"dense: params lack \['kernel'\]"),
            (lambda: mm.layers.embedding({}, x), r"embedding: params lack \['weights'\]"),
            (lambda: mm.layers.feed_forward({"wi": {}}, x), r"feed_forward: params lack \['wo'\]")):
        with pytest.raises(mm.MpimeshError, match=words):
            call()
    np.testing.assert_allclose(mm.layers.layer_norm({}, mesh.from_numpy(np.array([[1.0, 3.0]]), "b:1;d:2"),
                                                    "d").to_numpy(), [[-1.0, 1.0]], rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_one_kernel_layer_norm_on_a_gpu(dtype):
    """On CuPy, layer norm over the last dim, whole on each rank, runs one kernel each way
    (`rowwise.ROWS_SOURCE`: a warp per row, its shuffles summing 1000-long rows): values and the
    gradients of x, scale and bias against float64 numpy (bfloat16 x, float32 parameters)."""
    from meshes import get_mesh
    mesh = get_mesh(mesh_shapes()[0])
    if mesh.backend != "cupy":
        pytest.skip("CuPy's kernels (their sources run on the CPU in test_cuda_sources.py)")
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((2, 64, 1000)) * 3 + 1).astype(np.float32)
    w = rng.standard_normal(x.shape).astype(np.float32)
    scale, bias = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    xr, wr = ((a.astype("bfloat16") if dtype == "bfloat16" else a).astype(np.float64) for a in (x, w))
    mu, var = xr.mean(-1, keepdims=True), xr.var(-1, keepdims=True)
    yhat = (xr - mu) / np.sqrt(var + 1e-6)
    gs = wr * scale
    dx = (gs - gs.mean(-1, keepdims=True) - yhat * (gs * yhat).mean(-1, keepdims=True)) / np.sqrt(var + 1e-6)
    tol = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 3e-2}[dtype]
    with mm.layout_scope(mesh, f"b:{mesh.shape.names[0]}"), mm.trace():
        pdt = "float64" if dtype == "float64" else "float32"
        ps = {n: mesh.from_numpy(v.astype(pdt), "d:1000") for n, v in (("scale", scale), ("bias", bias))}
        xt = mm.cast(mesh.from_numpy(x, "b:2;l:64;d:1000"), dtype)
        y = mm.layers.layer_norm(ps, xt, "d")
        gx, gsc, gb = mm.gradients([mm.reduce_sum(y * mm.cast(mesh.from_numpy(w, "b:2;l:64;d:1000"), dtype))],
                                   [xt, ps["scale"], ps["bias"]])
    assert mm.backend._kernels.get(("rowwise", "rows", dtype)) is not None, "the one-kernel rows did not compile"
    for got, want in ((y, yhat * scale + bias), (gx, dx), (gsc, (wr * yhat).sum((0, 1))), (gb, wr.sum((0, 1)))):
        want = np.asarray(want)
        np.testing.assert_allclose(got.to_numpy().astype(np.float64), want, rtol=tol, atol=tol * np.abs(want).max())
