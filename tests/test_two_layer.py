"""The paper's two-layer example (apps/two_layer.py): Table 1's communication, exactly, and the
step's numbers against numpy.

For each of the five layouts of the paper's section 8, on the app's mesh for this rank count and
on tests/meshes.py's mesh of the same rank (1-D, 2-D or 3-D), one training step runs inside
`mm.profile()`; then
  * each processor's allreduced elements, per mesh dim, equal the Table 1 formula, and nothing
    is allgathered or sent by alltoall;
  * gradients and updated parameters equal a float64 numpy reference of the same step;
  * the gradients match central finite differences of the numpy loss (checks the autodiff
    backward itself, not just its agreement with a second implementation);
  * every layout and mesh gives the same updated parameters.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "apps"))
from meshes import mesh_shapes, transfers  # noqa: E402

import mpimesh as mm  # noqa: E402
import two_layer as tl  # noqa: E402

B, D_IO, D_H = 16, 8, 32
SIZES = tl.Sizes.of(B, D_IO, D_H)
LR = 0.05
N = MPI.COMM_WORLD.Get_size()


def _rank_of(rules: str) -> int:
    """0, 1, 2: the mesh rank (1-D, 2-D, 3-D) a layout's mesh dims ask for."""
    used = {m for _, m in mm.LayoutRules(rules).pairs}
    return 2 if "planes" in used else 1 if used & {"rows", "cols"} else 0


def _cases() -> list[tuple[str, str]]:
    out = []
    for rules in tl.LAYOUTS:
        shapes = [tl.mesh_shape_for(rules, N)]
        same_rank = [s for s in mesh_shapes() if mm.Shape(s).rank == _rank_of(rules) + 1]
        shapes += [s for s in same_rank if s not in shapes]
        out += [(rules, s) for s in shapes]
    return out


CASES = _cases()
_MESHES: dict = {}
_RUNS: dict = {}


def _mesh(shape: str) -> mm.Mesh:
    if shape not in _MESHES:
        _MESHES[shape] = mm.Mesh(shape)
    return _MESHES[shape]


def run(rules: str, shape: str, input_grad: bool = True) -> dict:
    """One profiled step under `rules` on mesh `shape` (cached); global arrays of everything."""
    key = (rules, shape, input_grad)
    if key not in _RUNS:
        mesh = _mesh(shape)
        with mm.layout_scope(mesh, rules):
            params = tl.init_params(mesh, SIZES, seed=3)
            x, target = tl.make_data(mesh, SIZES, seed=7)
            with mm.profile() as prof:
                step = tl.train_step(params, x, target, LR, input_grad)
            _RUNS[key] = {
                "mesh": mesh, "counters": {k: dict(v) for k, v in prof.counters.items()},
                "in_layouts": {k: t.layout for k, t in {**params, "x": x}.items()},
                "layouts": {k: t.layout for k, t in {**step.params, **step.grads}.items()},
                "x": x.to_numpy(), "target": target.to_numpy(), "y": step.y.to_numpy(),
                "params": {k: t.to_numpy() for k, t in params.items()},
                "new": {k: t.to_numpy() for k, t in step.params.items()},
                "grads": {k: t.to_numpy() for k, t in step.grads.items()}}
    return _RUNS[key]


def table1(rules: str, mesh: mm.Mesh, input_grad: bool = True) -> int:
    """The paper's Table 1 (and its 3-D extension) for this mesh; a mesh dim of size 1 costs 0."""
    size = {m: mesh.shape[m].size for m in mesh.shape.names}
    one = lambda k: k > 1  # noqa: E731
    g = 2 if input_grad else 1
    if rules == "":
        return 0
    if rules == "batch:all":
        return (2 * D_IO * D_H + D_H) * one(size["all"])
    if rules == "hidden:all":
        return g * B * D_IO * one(size["all"])
    r, c = size["rows"], size["cols"]
    if rules == "batch:rows;hidden:cols":
        return g * B * D_IO // r * one(c) + (2 * D_IO * D_H // c + D_H // c) * one(r)
    p = size["planes"]
    assert rules == "batch:rows;hidden:cols;io:planes"
    return (2 * B * D_H // (r * c) * one(p) + g * B * D_IO // (r * p) * one(c)
            + (2 * D_IO * D_H // (p * c) + D_H // c) * one(r))


# ------------------------------------------------------------------ numpy reference, float64

def np_forward(p: dict, x: np.ndarray):
    h_pre = x @ p["w"] + p["bias"]
    h = np.maximum(h_pre, 0)
    return h @ p["v"], h_pre, h


def np_loss(p: dict, x: np.ndarray, target: np.ndarray) -> float:
    y = np_forward(p, x)[0]
    return 0.5 * float(((y - target) ** 2).sum()) / x.shape[0]


def np_step(p: dict, x: np.ndarray, target: np.ndarray, lr: float):
    """Gradients (w, bias, v, x) and updated parameters, all float64."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    x, target = x.astype(np.float64), target.astype(np.float64)
    y, h_pre, h = np_forward(p, x)
    dy = (y - target) / x.shape[0]
    dh_pre = (dy @ p["v"].T) * (h_pre > 0)
    g = {"w": x.T @ dh_pre, "bias": dh_pre.sum(0), "v": h.T @ dy, "x": dh_pre @ p["w"].T}
    return g, {k: p[k] - lr * g[k] for k in p}


def close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-4) -> None:
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()))


# ------------------------------------------------------------------ tests

def test_meshes_and_formulas():
    assert tl.balanced(4, 3) == [1, 2, 2] and tl.balanced(8, 3) == [2, 2, 2] and tl.balanced(8, 2) == [2, 4]
    assert tl.balanced(1, 3) == [1, 1, 1] and tl.balanced(2, 2) == [1, 2] and tl.balanced(16, 3) == [2, 2, 4]
    assert tl.mesh_shape_for("", 4) == "all:4" and tl.mesh_shape_for("hidden:all", 2) == "all:2"
    assert tl.mesh_shape_for("batch:rows;hidden:cols;io:planes", 4) == "rows:1;cols:2;planes:2"
    mesh = _mesh(tl.mesh_shape_for(tl.LAYOUTS[-1], N))
    want = ["0", "2·d_io·d_h + d_h", "2·b·d_io", "2·b·d_io/r + 2·d_io·d_h/c + d_h/c",
            "2·b·d_h/(r·c) + 2·b·d_io/(r·p) + 2·d_io·d_h/(p·c) + d_h/c"]
    assert [tl.table1_formula(mesh, r) for r in tl.LAYOUTS] == want
    assert tl.table1_formula(mesh, "hidden:all", input_grad=False) == "b·d_io"


@pytest.mark.parametrize("rules,shape", CASES, ids=[f"{r or '[]'}@{s}" for r, s in CASES])
def test_communication_is_table1(rules, shape):
    res = run(rules, shape)
    mesh, counters = res["mesh"], res["counters"]
    comm = {k: v["elements"] for k, v in transfers(counters).items() if k != "flops"}
    assert all(k.startswith("allreduce/") for k in comm), f"unexpected collectives: {sorted(comm)}"
    assert sum(comm.values()) == table1(rules, mesh)
    assert comm == tl.expected_allreduces(mesh, rules, SIZES)  # per mesh dim, as the app prints it
    for k, lay in res["layouts"].items():  # gradients and new parameters keep their tensor's layout
        assert lay == res["in_layouts"][k], k


@pytest.mark.parametrize("rules,shape", CASES, ids=[f"{r or '[]'}@{s}" for r, s in CASES])
def test_step_matches_numpy(rules, shape):
    res = run(rules, shape)
    grads, new = np_step(res["params"], res["x"], res["target"], LR)
    assert set(res["grads"]) == {"w", "bias", "v", "x"}
    for k in grads:
        assert res["grads"][k].dtype == np.float32
        close(res["grads"][k], grads[k])
    for k in new:
        close(res["new"][k], new[k], rtol=1e-5)
    close(res["y"], np_forward({k: v.astype(np.float64) for k, v in res["params"].items()}, res["x"])[0])
    assert np_loss(new, res["x"], res["target"]) < np_loss(res["params"], res["x"], res["target"])


@pytest.mark.parametrize("rules,shape", CASES[::2], ids=[f"{r or '[]'}@{s}" for r, s in CASES[::2]])
def test_gradients_match_finite_differences(rules, shape):
    res = run(rules, shape)
    p = {k: v.astype(np.float64) for k, v in res["params"].items()}
    x, target = res["x"].astype(np.float64), res["target"].astype(np.float64)
    rng = np.random.default_rng(0)
    eps = 1e-6
    for name in ("w", "bias", "v", "x"):
        arr = x if name == "x" else p[name]
        scale = float(np.abs(res["grads"][name]).max())
        for _ in range(4):
            i = tuple(int(rng.integers(n)) for n in arr.shape)
            old = arr[i]
            arr[i] = old + eps
            up = np_loss(p, x, target)
            arr[i] = old - eps
            down = np_loss(p, x, target)
            arr[i] = old
            fd = (up - down) / (2 * eps)
            assert abs(res["grads"][name][i] - fd) <= 1e-4 * scale + 1e-3 * abs(fd), (name, i, fd)


def test_layouts_give_the_same_step():
    base = run(*CASES[0])
    for rules, shape in CASES[1:]:
        res = run(rules, shape)
        for k in base["new"]:
            close(res["new"][k], base["new"][k], rtol=1e-5)
        for k in base["grads"]:
            close(res["grads"][k], base["grads"][k], rtol=1e-4)


@pytest.mark.parametrize("rules", tl.LAYOUTS[2:])
def test_without_input_gradient(rules):
    shape = tl.mesh_shape_for(rules, N)
    res, full = run(rules, shape, input_grad=False), run(rules, shape)
    mesh = res["mesh"]
    comm = {k: v["elements"] for k, v in res["counters"].items() if k != "flops"}
    assert sum(comm.values()) == table1(rules, mesh, input_grad=False)
    assert comm == tl.expected_allreduces(mesh, rules, SIZES, input_grad=False)
    assert set(res["grads"]) == {"w", "bias", "v"}
    for k in res["new"]:
        close(res["new"][k], full["new"][k], rtol=1e-6)
