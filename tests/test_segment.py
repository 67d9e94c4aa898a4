"""apps/segment.py and mm.layers.conv: the spatially split network's loss and gradients equal the
unsplit network's (a 1-rank COMM_SELF mesh on every rank) and a numpy forward pass, for 1-D
(height or width) and 2-D (height and width) spatial splits, on images whose sizes divide and on
small ones that do not (blocks shorter than a halo, empty blocks); the halo traffic of one conv
layer is exactly halo x boundary length x channels x batch x itemsize per neighbour; the app runs
end to end on the rank count it is given."""
from __future__ import annotations

import functools
import itertools
import os
import sys

import numpy as np
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "apps"))
from meshes import get_mesh, global_array, mesh_shapes, transfers  # noqa: E402

import mpimesh as mm  # noqa: E402
import segment  # noqa: E402
from mpimesh.ops import conv as conv_ops  # noqa: E402
from mpimesh.layers.conv import conv2d as conv_layer, init_conv2d  # noqa: E402

pytestmark = pytest.mark.mpi
SHAPES = mesh_shapes()
B, H, W, DEPTH, WIDTH = 2, 16, 24, 2, 4  # 8-way splits leave 2 rows >= halo; H over 3 ranks: (6, 5, 5)
SMALL = (5, 7)  # height, width: over 4 ranks blocks (2, 1, 1, 1), over 8 some empty


def configs() -> list[tuple[str, str]]:
    """(mesh shape, rules): 1-D height split, 1-D width split, 2-D height x width split, and
    2-D spatial with the batch on the third mesh dim."""
    out = [(SHAPES[0], "height:all"), (SHAPES[0], "width:all")]
    if len(SHAPES) == 3:  # rank counts with 2-D and 3-D meshes (1, 2, 3, 4, 6, 8)
        out += [(SHAPES[1], "height:rows;width:cols"),
                (SHAPES[2], "batch:planes;height:rows;width:cols")]
    return out


def np_conv_same(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """SAME stride-1 convolution of x [b, h, w, ci] with w [fh, fw, ci, co], float64."""
    fh, fw = w.shape[:2]
    ph, pw = (fh - 1) // 2, (fw - 1) // 2
    xp = np.pad(x, [(0, 0), (ph, fh - 1 - ph), (pw, fw - 1 - pw), (0, 0)])
    out = np.zeros(x.shape[:3] + (w.shape[-1],))
    for i, j in itertools.product(range(fh), range(fw)):
        out += np.tensordot(xp[:, i:i + x.shape[1], j:j + x.shape[2]], w[i, j], axes=([-1], [0]))
    return out


def np_loss(params: dict, x: np.ndarray, t: np.ndarray) -> float:
    """The network and its sigmoid cross-entropy in numpy (float64)."""
    n = len(params) // 2
    a = x.astype(np.float64)
    for i in range(n):
        a = np_conv_same(a, params[f"conv{i}/kernel"]) + params[f"conv{i}/bias"]
        if i < n - 1:
            a = np.maximum(a, 0)
    return float(np.mean(np.maximum(a, 0) - a * t + np.log1p(np.exp(-np.abs(a)))))


def run(mesh: mm.Mesh, x: np.ndarray, t: np.ndarray):
    """(loss, {name: gradient}, {name: parameter}) as global arrays, one network step on `mesh`."""
    xs, ts = segment.image_shape(B, x.shape[1:3])
    params = segment.init_params(mesh, 3, DEPTH, WIDTH)
    # non-zero biases, so their gradients and the bias add are exercised
    params = {k: (v + 0.1 * mesh.random_normal(v.shape, 7 + i) if k.endswith("bias") else v)
              for i, (k, v) in enumerate(params.items())}
    xd, td = mesh.from_numpy(x, xs), mesh.from_numpy(t, ts)
    loss, acc, grads = segment.loss_and_grads(params, xd, td)
    return (float(loss), {k: g.to_numpy() for k, g in grads.items()},
            {k: p.to_numpy() for k, p in params.items()}, xd)


@functools.lru_cache(maxsize=None)
def reference(size: tuple = (H, W)):
    """The unsplit network on a 1-rank mesh (every rank computes it alone)."""
    x, t = segment.make_batch(11, B, size)
    loss, grads, params, _ = run(mm.Mesh("all:1", comm=mm.MPI.COMM_SELF), x, t)
    return x, t, loss, grads, params


def test_reference_matches_numpy():
    x, t, loss, _, params = reference()
    assert 0.0 < t.mean() < 1.0 and 0.0 < x.mean() < 1.0  # both classes present
    np.testing.assert_allclose(loss, np_loss(params, x, t), rtol=1e-5)


@pytest.mark.parametrize("size", [(H, W), SMALL])
@pytest.mark.parametrize("block_bytes", [None, 1])
@pytest.mark.parametrize("shape,rules", configs())
def test_split_network_equals_unsplit(shape, rules, block_bytes, size, monkeypatch):
    """block_bytes=1: the stride-1 conv kernels work one output row per block (vs. whole images)."""
    mesh = get_mesh(shape, rules)
    x, t, loss0, grads0, params0 = reference(size)
    if block_bytes:
        monkeypatch.setattr(conv_ops, "_BLOCK_BYTES", block_bytes)
    loss, grads, params, xd = run(mesh, x, t)
    for d in ("height", "width", "batch"):  # the input is split as the rules say
        m = mesh.layout.mesh_dim(d)
        assert xd.layout.get(d) == m, (rules, xd.layout)
    for k in params0:  # layout-independent initialisation
        np.testing.assert_array_equal(params[k], params0[k])
    np.testing.assert_allclose(loss, loss0, rtol=1e-5)
    assert set(grads) == set(grads0) == set(params0)
    for k, g0 in grads0.items():
        scale = np.abs(g0).max()
        assert scale > 0, k
        np.testing.assert_allclose(grads[k], g0, rtol=1e-4, atol=1e-5 * scale, err_msg=f"{k} {shape} {rules}")


def expected_halo_bytes(mesh: mm.Mesh, x: mm.DistTensor, f: int) -> dict:
    """Per mesh dim, the bytes this rank sends for one SAME stride-1 f x f conv of x: for each
    split spatial dim (height first), halo r=(f-1)//2 times the boundary length (the local extent
    of the other spatial dim, widened by its halos when it was exchanged first: the corners)
    times batch, channels and itemsize, once per existing neighbour."""
    r = (f - 1) // 2
    b_local, nh, nw, c = x.local.shape
    ext = {"height": nh, "width": nw}
    want = {}
    for d in ("height", "width"):
        m = x.layout.get(d)
        if not m or mesh.shape[m].size == 1:
            continue
        other = "width" if d == "height" else "height"
        k, coord = mesh.shape[m].size, mesh.coords[m]
        neighbours = (coord > 0) + (coord < k - 1)
        if neighbours:
            want[f"permute/{m}"] = r * ext[other] * b_local * c * x.local.itemsize * neighbours
        ext[d] += 2 * r
    return want


@pytest.mark.parametrize("shape,rules", configs())
def test_halo_bytes_of_one_conv_layer(shape, rules):
    mesh = get_mesh(shape, rules)
    c = 3
    xs = mm.Shape(f"batch:{B};height:{H};width:{W};channels:{c}")
    x = mesh.from_numpy(global_array(str(xs), seed=1), xs)
    for f in (3, 5):
        p = init_conv2d(mesh, f, f, f, "channels:3", "hidden:4")
        with mm.profile() as prof:
            y = conv_layer(p, x, activation="relu")
        got = {k: v["bytes"] for k, v in transfers(prof.counters).items() if k != "flops"}
        assert got == expected_halo_bytes(mesh, x, f), (f, rules, mesh.coords, got)
        want = np.maximum(np_conv_same(x.to_numpy().astype(np.float64), p["kernel"].to_numpy())
                          + p["bias"].to_numpy(), 0)
        np.testing.assert_allclose(y.to_numpy(), want, rtol=1e-4, atol=1e-4)
        assert y.layout == x.layout  # the output is split like the input


def test_conv_layer_options_and_errors():
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    p = init_conv2d(mesh, 0, 3, 2, "ci:2", "co:3", use_bias=False)
    assert set(p) == {"kernel"} and p["kernel"].shape == mm.Shape("fh:3;fw:2;ci:2;co:3")
    x = mesh.from_numpy(global_array("b:1;h:8;w:6;ci:2", seed=2), "b:1;h:8;w:6;ci:2")
    y = conv_layer(p, x, strides=2, activation=mm.tanh)
    assert y.shape == mm.Shape("b:1;h:4;w:3;co:3")
    with pytest.raises(ValueError, match="activation"):
        conv_layer(p, x, activation="swish")
    with pytest.raises(mm.ShapeError):
        init_conv2d(mesh, 0, 3, 3, "c:2", "c:2")
    with pytest.raises(mm.ShapeError, match="ci:5"):
        conv_layer(init_conv2d(mesh, 0, 3, 3, "ci:5", "co:1"), x)


def test_default_mesh_is_the_squarest_2d_shape():
    assert [segment.balanced_2d(n) for n in (1, 2, 3, 4, 6, 7, 8, 12)] == [
        "rows:1;cols:1", "rows:1;cols:2", "rows:1;cols:3", "rows:2;cols:2", "rows:2;cols:3", "rows:1;cols:7",
        "rows:2;cols:4", "rows:3;cols:4"]


def test_app_runs_on_this_rank_count(capsys):
    """The whole app with its default mesh on every rank of COMM_WORLD, on 9 x 9 images (unequal
    blocks over 2, 4, 5 or more ranks)."""
    segment.main(["--size", "9", "--steps", "2", "--print-every", "1", "--depth", "1", "--width", "2"])
    out = capsys.readouterr().out
    if mm.MPI.COMM_WORLD.Get_rank() == 0:
        assert "step    1  loss" in out and "held-out pixel accuracy" in out, out
        assert f"mesh [{segment.balanced_2d(mm.MPI.COMM_WORLD.Get_size()).replace(';', ', ')}]" in out, out
