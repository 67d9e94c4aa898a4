"""mm.conv2d and mm.conv1d against a direct numpy loop-over-taps reference (explicit padding), for
SAME/VALID, strides 1 and 2, dilation 1 and 2, with batch, one or both spatial dims, in- and
out-channels split, in equal blocks and in numpy.array_split blocks of sizes that do not divide
(input and output blocks that do not line up, blocks shorter than the halo, empty blocks); the
halo traffic; gradients."""
from __future__ import annotations

import itertools
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from gradcheck import check_gradients  # noqa: E402
from meshes import big, get_mesh, global_array, mesh_shapes, spec, transfers  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh import counters  # noqa: E402

pytestmark = pytest.mark.mpi
SHAPES = mesh_shapes()


def out_size(n: int, f: int, s: int, d: int, padding: str) -> tuple[int, int, int]:
    """(output size, pad before, pad after) as TensorFlow defines SAME and VALID."""
    extent = (f - 1) * d + 1
    if not isinstance(padding, str):  # explicit (before, after)
        return (n + sum(padding) - extent) // s + 1, padding[0], padding[1]
    if padding == "VALID":
        return (n - extent) // s + 1, 0, 0
    o = -(-n // s)
    total = max((o - 1) * s + extent - n, 0)
    return o, total // 2, total - total // 2


def np_conv(x: np.ndarray, w: np.ndarray, strides, padding: str, dilation) -> np.ndarray:
    """Direct reference: zero-pad x explicitly, then sum over filter taps of strided slices @ tap."""
    nsp = w.ndim - 2
    lead = x.ndim - nsp - 1
    pads = [padding] * nsp if isinstance(padding, str) else padding
    geo = [out_size(x.shape[lead + i], w.shape[i], strides[i], dilation[i], pads[i]) for i in range(nsp)]
    xpad = np.pad(x, [(0, 0)] * lead + [(pb, pa) for _, pb, pa in geo] + [(0, 0)])
    out = np.zeros(x.shape[:lead] + tuple(o for o, _, _ in geo) + (w.shape[-1],))
    for tap in itertools.product(*[range(f) for f in w.shape[:nsp]]):
        idx = tuple(slice(t * d, t * d + (o - 1) * s + 1, s) for t, d, s, (o, _, _) in zip(tap, dilation, strides, geo))
        out += np.tensordot(xpad[(slice(None),) * lead + idx], w[tap], axes=([-1], [0]))
    return out


def test_reference_against_naive_loops():
    """The tap reference agrees with a per-output-element loop (pure numpy, any rank count)."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((7, 2)), rng.standard_normal((3, 2, 2))
    for s, d, pad in ((1, 1, "SAME"), (2, 2, "SAME"), (2, 1, "VALID"), (3, 2, "SAME")):
        o, pb, _ = out_size(7, 3, s, d, pad)
        want = np.zeros((o, 2))
        for j in range(o):
            for t in range(3):
                i = j * s - pb + t * d
                if 0 <= i < 7:
                    want[j] += x[i] @ w[t]
        np.testing.assert_allclose(np_conv(x, w, (s,), pad, (d,)), want, rtol=1e-12)


# (filter h, filter w, strides, padding, dilation)
CONFIGS = [
    (3, 3, (1, 1), "SAME", (1, 1)),
    (3, 3, (2, 2), "SAME", (1, 1)),
    (2, 2, (1, 1), "SAME", (1, 1)),   # asymmetric SAME padding (0 before, 1 after)
    (3, 3, (1, 1), "SAME", (2, 2)),
    (3, 3, (2, 2), "SAME", (2, 2)),
    (3, 3, (1, 2), "SAME", (2, 1)),
    (4, 4, (3, 3), "SAME", (1, 1)),   # stride does not divide the size: per-rank windows differ
    (3, 3, (1, 1), "VALID", (1, 1)),  # 14 outputs: splits only over 2 ranks, windows differ
    (2, 2, (2, 2), "VALID", (1, 1)),
    (5, 2, (1, 2), "VALID", (1, 1)),  # 12 x 8 outputs
    (3, 3, (1, 1), "VALID", (4, 4)),  # 8 outputs, halo of 4 rows/cols per side
]
X2 = "b:8;h:16;w:16;ci:4"
X2_UNEVEN = "b:3;h:11;w:10;ci:4"  # over 3, 4 or 8 ranks: unequal blocks, some shorter than a halo


def rule_sets(mesh: mm.Mesh) -> list[dict]:
    b = big(mesh)
    if not b:
        return [{}]
    m0, m1 = b[0], b[-1]
    out = [{}, {"h": m0}, {"w": m1}, {"b": m0, "co": m1} if m0 != m1 else {"co": m0}]
    if len(b) >= 2:
        out += [{"h": m0, "w": m1}, {"b": m1, "h": m0}, {"w": m0, "ci": m1}]
    else:
        out += [{"w": m0, "b": m0}, {"ci": m0}]
    if len(b) >= 3:
        out.append({"b": b[0], "h": b[1], "w": b[2]})
    return [r for r in out if len(set(r.values())) == len(r)]


@pytest.mark.parametrize("xs", [X2, X2_UNEVEN])
@pytest.mark.parametrize("mesh_shape", SHAPES)
def test_conv2d_forward(mesh_shape, xs):
    mesh = get_mesh(mesh_shape)
    x = global_array(xs, seed=1)
    nb, ci = mm.Shape(xs)["b"].size, mm.Shape(xs)["ci"].size
    errs = []
    for fh, fw, strides, padding, dilation in CONFIGS:
        w = global_array(f"fh:{fh};fw:{fw};ci:{ci};co:8", seed=2)
        want = np_conv(x.astype(np.float64), w.astype(np.float64), strides, padding, dilation)
        oh, ow = want.shape[1:3]
        for rules in rule_sets(mesh):
            what = f"{xs} {fh}x{fw} s={strides} {padding} d={dilation} rules={rules}"
            with mm.layout_scope(mesh, spec(rules)):
                xt = mesh.from_numpy(x, xs)
                wt = mesh.from_numpy(w, f"fh:{fh};fw:{fw};ci:{ci};co:8")
                y = mm.conv2d(xt, wt, strides=strides, padding=padding, dilation=dilation)
            want_layout = {d: m for d, m in rules.items() if d != "ci"}
            if y.shape != mm.Shape(f"b:{nb};h:{oh};w:{ow};co:8") or y.layout != want_layout:
                errs.append(f"{what}: shape {y.shape} layout {y.layout}")
                continue
            try:
                np.testing.assert_allclose(y.to_numpy(), want, rtol=1e-4, atol=1e-4)
            except AssertionError as e:
                errs.append(f"{what}: {e}")
    assert not errs, f"{len(errs)} failures:\n" + "\n".join(errs[:4])


@pytest.mark.parametrize("mesh_shape", SHAPES)
def test_conv1d_forward(mesh_shape):
    """Lengths 32 (equal blocks on 2, 4, 8 ranks), 13 and 5 (unequal; 5 over 8 leaves 3 empty)."""
    mesh = get_mesh(mesh_shape)
    errs = []
    for n in (32, 13, 5):
        xs = f"b:2;len:{n};ci:3"
        x = global_array(xs, seed=3)
        for f, s, padding, d in ((3, 1, "SAME", 1), (3, 2, "SAME", 2), (4, 1, "SAME", 1), (5, 1, "VALID", 1),
                                 (2, 2, "VALID", 1), (3, 1, "VALID", 2), (3, 3, "SAME", 1), (9, 1, "SAME", 3),
                                 (2, 1, ((3, 0),), 1), (1, 4, ((0, 6),), 1)):
            w = global_array(f"tap:{f};ci:3;co:2", seed=4)
            want = np_conv(x.astype(np.float64), w.astype(np.float64), (s,), padding, (d,))
            o = want.shape[1]
            for m in [None] + big(mesh):
                rules = {"len": m} if m else {}
                with mm.layout_scope(mesh, spec(rules)):
                    xt = mesh.from_numpy(x, xs)
                    wt = mesh.from_numpy(w, f"tap:{f};ci:3;co:2")
                    y = mm.conv1d(xt, wt, stride=s, padding=padding, dilation=d)
                what = f"len={n} f={f} s={s} {padding} d={d} {rules}"
                if y.shape != mm.Shape(f"b:2;len:{o};co:2") or y.layout != rules:
                    errs.append(f"{what}: {y.shape} {y.layout}")
                    continue
                try:
                    np.testing.assert_allclose(y.to_numpy(), want, rtol=1e-4, atol=1e-4)
                except AssertionError as e:
                    errs.append(f"{what}: {e}")
    assert not errs, f"{len(errs)} failures:\n" + "\n".join(errs[:4])


@pytest.mark.parametrize("stride", [1, 2])
def test_bfloat16_with_an_empty_in_channels_block(stride):
    """In-channels split so that the last rank's block is empty: its zeros join the allreduce in the
    dtype of the other ranks' partial sums (float32 where ml_dtypes multiplies bfloat16 matrices with
    `@`, the stride-1 kernels; bfloat16 from `tensordot`, the strided ones). Before, they were
    bfloat16 next to float32: wrong sums on some ranks, a crash on 4. Forward and both gradients,
    against float64 numpy of the bfloat16-rounded inputs."""
    mesh = get_mesh(SHAPES[0])
    ci = max(1, mesh.size - 1)
    xs, fs = f"b:2;len:6;ci:{ci}", f"tap:3;ci:{ci};co:2"
    x, w = (global_array(s, seed=i).astype(mm.backend.as_dtype("bfloat16")) for i, s in enumerate((xs, fs)))
    with mm.layout_scope(mesh, f"ci:{mesh.shape.names[0]}"):
        xt, wt = mesh.from_numpy(x, xs), mesh.from_numpy(w, fs)
        with mm.trace():
            y = mm.conv1d(xt, wt, stride=stride)
            gx, gw = mm.gradients([y], [xt, wt])
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want = np_conv(x64, w64, (stride,), "SAME", (1,))
    np.testing.assert_allclose(y.to_numpy().astype(np.float64), want, rtol=0.02, atol=0.05)
    eps = 1e-6  # the gradients of sum(y): by central differences of the float64 reference (linear in each)
    for got, arr, f in ((gx, x64, lambda a: np_conv(a, w64, (stride,), "SAME", (1,))),
                        (gw, w64, lambda a: np_conv(x64, a, (stride,), "SAME", (1,)))):
        fd = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            d = np.zeros_like(arr)
            d[i] = eps
            fd[i] = (f(arr + d).sum() - f(arr - d).sum()) / (2 * eps)
        np.testing.assert_allclose(got.to_numpy().astype(np.float64), fd, rtol=0.02, atol=0.1)


def test_explicit_padding():
    """Explicit (before, after) padding pairs, with the spatial dims split where possible."""
    mesh = get_mesh(SHAPES[-1])
    b = big(mesh)
    rules = {"h": b[0], "w": b[-1]} if len(b) >= 2 else ({"h": b[0]} if b else {})
    w = global_array("fh:3;fw:2;ci:4;co:8", seed=14)
    for xs in (X2, X2_UNEVEN):
        x = global_array(xs, seed=13)
        for padding in (((1, 1), (0, 1)), ((2, 0), (1, 0)), ((0, 2), (4, 5))):
            for strides in ((1, 1), (2, 3)):
                want = np_conv(x.astype(np.float64), w.astype(np.float64), strides, padding, (1, 1))
                with mm.layout_scope(mesh, spec(rules)):
                    y = mm.conv2d(mesh.from_numpy(x, xs), mesh.from_numpy(w, "fh:3;fw:2;ci:4;co:8"), strides,
                                  padding=padding)
                assert y.shape == mm.Shape(f"b:{x.shape[0]};h:{want.shape[1]};w:{want.shape[2]};co:8")
                np.testing.assert_allclose(y.to_numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh_shape", SHAPES)
def test_halo_traffic(mesh_shape):
    """3x3 SAME stride 1: one row (batch_local * width * channels) per existing neighbour along
    height, and on a 2-D split one column of the widened slab per neighbour along width."""
    mesh = get_mesh(mesh_shape)
    b = big(mesh)
    if not b:
        pytest.skip("no mesh dim of size > 1")
    w = mesh.from_numpy(global_array("fh:3;fw:3;ci:4;co:8", seed=5), "fh:3;fw:3;ci:4;co:8")
    for rules in ({"h": b[0]}, {"h": b[0], "w": b[-1]}, {"b": b[-1], "h": b[0]}):
        if len(set(rules.values())) < len(rules):
            continue
        with mm.layout_scope(mesh, spec(rules)):
            x = mesh.from_numpy(global_array(X2, seed=6), X2)
            with mm.profile() as prof:
                y = mm.conv2d(x, w)
        bl, nh, nw = x.local.shape[:3]
        mh, mw = rules["h"], rules.get("w")
        kh, ch = mesh.shape[mh].size, mesh.coords[mh]
        want = {f"permute/{mh}": bl * nw * 4 * ((ch > 0) + (ch < kh - 1))}
        if mw:
            kw, cw = mesh.shape[mw].size, mesh.coords[mw]
            want[f"permute/{mw}"] = bl * (nh + 2) * 4 * ((cw > 0) + (cw < kw - 1))
        got = {k: v["elements"] for k, v in transfers(counters.traffic(prof.counters)).items()}
        assert got == want, (rules, got, want)
        assert prof.counters["flops"]["flops"] == 2 * y.local.size * 9 * 4


def test_errors():
    mesh = get_mesh(SHAPES[0])
    x = mesh.from_numpy(global_array(X2), X2)
    with pytest.raises(mm.ShapeError, match="ci:3"):
        mm.conv2d(x, mesh.ones("fh:3;fw:3;ci:3;co:2"))
    with pytest.raises(mm.ShapeError, match="tap dims"):
        mm.conv2d(x, mesh.ones("fh:3;ci:4;co:2"))
    with pytest.raises(mm.ShapeError, match="too small"):
        mm.conv2d(x, mesh.ones("fh:17;fw:3;ci:4;co:2"), padding="VALID")
    with pytest.raises(mm.MpimeshError, match="padding"):
        mm.conv2d(x, mesh.ones("fh:3;fw:3;ci:4;co:2"), padding="FULL")
    with pytest.raises(mm.MpimeshError, match="strides"):
        mm.conv2d(x, mesh.ones("fh:3;fw:3;ci:4;co:2"), strides=(1, 0))
    with pytest.raises(mm.ShapeError, match="'b'"):
        mm.conv2d(x, mesh.ones("fh:3;fw:3;ci:4;b:2"))
    k = mesh.ones("fh:3;fw:3;ci:4;co:2")
    with pytest.raises(mm.ShapeError, match=r"the bias \[zz:3\] has dims the output .* lacks"):  # it was broadcast
        mm.layers.conv2d({"kernel": k, "bias": mesh.zeros("zz:3")}, x)
    with pytest.raises(mm.MpimeshError, match=r"params lack 'kernel'; they have \['bias'\]"):
        mm.layers.conv2d({"bias": mesh.zeros("co:2")}, x)
    with pytest.raises(TypeError, match="conv2d: x is a ndarray"):
        mm.layers.conv2d({"kernel": k}, global_array(X2))


def grad_layouts(mesh: mm.Mesh, dims: tuple) -> list[dict]:
    b = big(mesh)
    if not b:
        return [{}]
    two = {dims[0]: b[0], dims[1]: b[1]} if len(b) >= 2 else {dims[1]: b[0]}
    return [{dims[0]: b[0]}, two]


@pytest.mark.parametrize("mesh_shape", SHAPES)
def test_conv2d_gradients(mesh_shape):
    """Equal blocks (16 x 16 on 1, 2, 4, 8 ranks) and unequal ones (7 x 5: empty blocks on 8 ranks)."""
    mesh = get_mesh(mesh_shape)
    fs = "fh:3;fw:3;ci:2;co:2"
    w = global_array(fs, seed=8, dtype=np.float64)
    for nh, nw in ((16, 16), (7, 5)):
        xs = f"b:2;h:{nh};w:{nw};ci:2"
        x = global_array(xs, seed=7, dtype=np.float64)
        for rules in grad_layouts(mesh, ("h", "w")):
            for strides, dilation in (((1, 1), (1, 1)), ((2, 2), (2, 1))):
                oh, ow = (out_size(n, 3, s, d, "SAME")[0] for n, s, d in zip((nh, nw), strides, dilation))
                ys = f"b:2;h:{oh};w:{ow};co:2"
                r = global_array(ys, seed=9, dtype=np.float64)
                with mm.layout_scope(mesh, spec(rules)):
                    check_gradients(mesh, lambda a, f, q, s=strides, d=dilation: mm.conv2d(a, f, s, "SAME", d) * q,
                                    [x, w, r], [xs, fs, ys], wrt=[0, 1])


@pytest.mark.parametrize("mesh_shape", SHAPES)
def test_conv1d_gradients(mesh_shape):
    """conv1d gradients, including windows that differ per rank (VALID), strided outputs whose
    blocks do not line up with the input's (length 11), and a split in-channels dim."""
    mesh = get_mesh(mesh_shape)
    for n in (16, 11):
        xs = f"b:2;len:{n};ci:8"
        x = global_array(xs, seed=10, dtype=np.float64)
        for rules in grad_layouts(mesh, ("len", "ci")):
            k = mesh.shape[rules["len"]].size if "len" in rules else 1
            f, d = (3, 4) if k == 8 else (5, 1)  # VALID outputs 8 or 12 (16), 3 or 7 (11)
            for tap, stride, padding, dil in ((f, 1, "VALID", d), (4, 2, "SAME", 1), (3, 3, "VALID", 1)):
                fs = f"tap:{tap};ci:8;co:3"
                o = out_size(n, tap, stride, dil, padding)[0]
                ys = f"b:2;len:{o};co:3"
                w, r = global_array(fs, seed=11, dtype=np.float64), global_array(ys, seed=12, dtype=np.float64)
                with mm.layout_scope(mesh, spec(rules)):
                    check_gradients(mesh,
                                    lambda a, fl, q, s=stride, p=padding, dl=dil: mm.conv1d(a, fl, s, p, dl) * q,
                                    [x, w, r], [xs, fs, ys], wrt=[0, 1])


def test_conv_second_order():
    """The gradient ops are differentiable: d/dw of |d conv / dx|^2."""
    mesh = get_mesh(SHAPES[0])
    b = big(mesh)
    rules = f"len:{b[0]}" if b else ""
    xs, fs, ys = "b:2;len:16;ci:2", "tap:3;ci:2;co:2", "b:2;len:16;co:2"
    arrays = [global_array(s, seed=i, dtype=np.float64) for i, s in enumerate((xs, fs, ys))]

    def f(a, w, q):
        with mm.trace():
            y = mm.conv1d(a, w) * q
            gx, gw = mm.gradients([y], [a, w], retain=True)  # (kept: the second pass reads what the first did)
        return mm.reduce_sum(gx * gx) + mm.reduce_sum(gw * gw)
    with mm.layout_scope(mesh, rules):
        check_gradients(mesh, f, arrays, [xs, fs, ys], wrt=[0, 1])
