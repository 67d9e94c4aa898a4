"""mm.layers' GShard mixture of experts: the distributed layer (experts split over the mesh dim of
the groups, as many ways as the run has ranks, evenly or not: 5 experts over 2 or 3 ranks, 3 over
4, some ranks holding no expert or no group) against a loop-by-loop numpy reference with the same
random draws, alltoall counts of both passes, hand-built capacity-overflow and aux-loss cases, and
finite-difference gradients."""
from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from gradcheck import check_gradients
from meshes import global_array, mesh_shapes
from mpimesh.layers.moe import expert_capacity, init_moe, moe

G, S, M, E, H = 8, 16, 8, 8, 16
X = f"group:{G};tokens:{S};d_model:{M}"
F64 = "float64"
_self_mesh = []


def self_mesh() -> mm.Mesh:
    """A 1-rank mesh of this process alone (for the reference's random draws)."""
    if not _self_mesh:
        _self_mesh.append(mm.Mesh("all:1", comm=MPI.COMM_SELF))
    return _self_mesh[0]


def split_dims(shape: str) -> tuple:
    """(mesh dim for groups and experts: the largest; another mesh dim of size > 1 or None)."""
    big = sorted((d for d in mm.Shape(shape) if d.size > 1), key=lambda d: -d.size)
    return (big[0].name if big else mm.Shape(shape).names[0]), (big[1].name if len(big) > 1 else None)


def configs() -> list:
    """(mesh shape, rules, expert_mesh_dim for init_moe): experts on the groups' mesh dim by the
    rules, with d_ff split over a second mesh dim when there is one; and on the 1-D mesh, rules
    naming only the groups with the experts placed by `init_moe(expert_mesh_dim=...)`."""
    out = []
    for shape in mesh_shapes():
        m, o = split_dims(shape)
        out.append((shape, f"group:{m};experts:{m}" + (f";d_ff:{o}" if o else ""), None))
    m, _ = split_dims(mesh_shapes()[0])
    out.append((mesh_shapes()[0], f"group:{m}", m))
    return out


# ---- the reference: the same algorithm, one group and one token at a time -------------------------------
def softmax(a):
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference(x, wg, wi, wo, u, capacity, policy="random", threshold=0.2, loss_coef=1e-2):
    """GShard top-2 MoE on x [G, S, M] by loops: (y [G, S, M], aux loss)."""
    n_groups, n_tokens, _ = x.shape
    n_exp = wg.shape[1]
    y = np.zeros_like(x)
    aux = 0.0
    for g in range(n_groups):
        gates = softmax(x[g] @ wg)
        first = np.zeros(n_exp)  # tokens routed first to each expert (kept or not)
        choices = []
        for s in range(n_tokens):
            e1 = int(np.argmax(gates[s]))
            rest = gates[s].copy()
            rest[e1] = 0.0
            e2 = int(np.argmax(rest))
            d = gates[s, e1] + gates[s, e2] + 1e-9
            choices.append((e1, e2, gates[s, e1] / d, gates[s, e2] / d))
            first[e1] += 1
        aux += np.mean(first / n_tokens * gates.mean(0))
        fill = np.zeros(n_exp, int)
        for s, (e1, _, g1, _) in enumerate(choices):
            if fill[e1] < capacity:
                y[g, s] += g1 * (np.maximum(x[g, s] @ wi[e1], 0) @ wo[e1])
            fill[e1] += 1
        fill = np.minimum(fill, capacity)  # the second choices queue after the kept first ones
        for s, (_, e2, _, g2) in enumerate(choices):
            keep = {"all": True, "none": False, "threshold": g2 > threshold,
                    "random": u[g, s] < g2 / threshold}[policy]
            if keep:
                if fill[e2] < capacity:
                    y[g, s] += g2 * (np.maximum(x[g, s] @ wi[e2], 0) @ wo[e2])
                fill[e2] += 1
    return y, loss_coef * n_exp * n_exp * aux / n_groups


def block_len(mesh: mm.Mesh, size: int, m) -> int:
    """This rank's block length of a dim of `size` split over mesh dim `m`."""
    return len(np.array_split(np.arange(size), mesh.shape[m].size)[mesh.coords[m]])


def draws(seed: int, n_groups: int = G, n_tokens: int = S) -> np.ndarray:
    return self_mesh().random_uniform(f"group:{n_groups};tokens:{n_tokens}", seed, dtype=F64).to_numpy()


def setup(shape: str, rules: str, expert_mesh_dim, seed: int = 0):
    mesh = mm.Mesh(shape, layout=rules)
    p = init_moe(mesh, seed, f"d_model:{M}", f"experts:{E}", f"d_ff:{H}", expert_mesh_dim, dtype=F64)
    xa = global_array(X, seed + 10, np.float64)
    return mesh, p, xa, mesh.from_numpy(xa, X)


CASES = [  # (moe kwargs, capacity)
    ({"seed": 3}, expert_capacity(S, E, 1.25)),
    ({"seed": 4, "train": False}, expert_capacity(S, E, 2.0)),
    ({"seed": 5, "capacity_factor": 0.5, "min_capacity": 1}, 1),  # heavy overflow
    ({"seed": 6, "second_policy": "all", "capacity_factor": 1.0, "min_capacity": 2}, 2),
    ({"seed": 7, "second_policy": "threshold", "second_threshold": 0.3, "loss_coef": 0.1}, 4),
]


@pytest.mark.parametrize("config", range(4))
def test_matches_reference(config):
    if config >= len(configs()):
        pytest.skip("fewer configurations on this rank count")
    shape, rules, emd = configs()[config]
    mesh, p, xa, x = setup(shape, rules, emd, seed=config)
    m, _ = split_dims(shape)
    assert p["wi"].layout.get("experts") == m and p["wo"].layout.get("experts") == m and "experts" not in p["wg"].layout
    w = {k: t.to_numpy() for k, t in p.items()}
    for kw, cap in CASES:
        y, aux = moe(p, x, "group", **kw)
        assert y.shape == x.shape and y.tensor_layout == mesh.plan(x.shape) and aux.shape.rank == 0
        ry, raux = reference(xa, w["wg"], w["wi"], w["wo"], draws(kw["seed"]), cap,
                             kw.get("second_policy", "random"), kw.get("second_threshold", 0.2),
                             kw.get("loss_coef", 1e-2))
        np.testing.assert_allclose(y.to_numpy(), ry, rtol=1e-10, atol=1e-12, err_msg=str(kw))
        np.testing.assert_allclose(float(aux), raux, rtol=1e-10, err_msg=str(kw))


def test_reference_sees_overflow_and_random_drops():
    """The reference cases do exercise dropped tokens and dropped second experts."""
    mesh = self_mesh()
    p = init_moe(mesh, 0, f"d_model:{M}", f"experts:{E}", f"d_ff:{H}", dtype=F64)
    w = {k: t.to_numpy() for k, t in p.items()}
    xa = global_array(X, 10, np.float64)
    full, _ = reference(xa, w["wg"], w["wi"], w["wo"], draws(3), S, "all")
    tight, _ = reference(xa, w["wg"], w["wi"], w["wo"], draws(3), 1, "all")
    rand, _ = reference(xa, w["wg"], w["wi"], w["wo"], draws(3), S, "random")
    assert np.sum(np.all(tight == 0, axis=-1)) > 0  # tokens that skipped the layer
    assert not np.allclose(full, rand)  # some second experts dropped by the random policy


# ---- communication ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", range(4))
def test_two_alltoalls_each_way(config):
    if config >= len(configs()):
        pytest.skip("fewer configurations on this rank count")
    shape, rules, emd = configs()[config]
    mesh, p, _, x = setup(shape, rules, emd)
    m, _ = split_dims(shape)
    want = 2 if mesh.shape[m].size > 1 else 0
    with mm.trace():
        with mm.profile() as fwd:
            y, aux = moe(p, x, "group", seed=1)
        with mm.profile() as bwd:
            grads = mm.gradients([y, aux], [x, p["wg"], p["wi"], p["wo"]])
    for prof in (fwd, bwd):
        a2a = {k: v for k, v in prof.counters.items() if k.startswith("alltoall/")}
        assert sum(v["calls"] for v in a2a.values()) == want, a2a
        if want:
            assert set(a2a) == {f"alltoall/{m}"}, a2a
            # Each moves one [E, G, C, M] expert buffer: this rank's slice of it, split by G
            # one way and by E the other (blocks of unequal length where 8 does not divide).
            cap = expert_capacity(S, E, 1.25)
            want_elems = (E * block_len(mesh, G, m) + block_len(mesh, E, m) * G) * cap * M
            assert a2a[f"alltoall/{m}"]["elements"] == want_elems
        assert not any(k.startswith("allgather/") for k in prof.counters), prof.counters
    for g, t in zip(grads, [x, p["wg"], p["wi"], p["wo"]]):
        assert g.tensor_layout == t.tensor_layout


# ---- uneven blocks ----------------------------------------------------------------------------------------
UNEVEN = [  # (G, S, M, E, H): E and G not divisible by 2, 3, 4 or 8 ranks; ranks with no expert
    (3, 8, 4, 5, 6),
    (5, 6, 4, 3, 4),
    (2, 4, 3, 2, 4),
]


def uneven_rules() -> list:
    """(mesh shape, rules): experts and groups on the largest mesh dim, d_ff on another if any."""
    out = []
    for shape in mesh_shapes()[:2]:
        m, o = split_dims(shape)
        out.append((shape, f"group:{m};experts:{m}" + (f";d_ff:{o}" if o else "")))
    return out


@pytest.mark.parametrize("dims", range(len(UNEVEN)))
def test_uneven_experts_and_groups(dims):
    g, s, m_, e, h = UNEVEN[dims]
    xs = f"group:{g};tokens:{s};d_model:{m_}"
    xa = global_array(xs, 40 + dims, np.float64)
    for shape, rules in uneven_rules():
        mesh = mm.Mesh(shape, layout=rules)
        md, _ = split_dims(shape)
        p = init_moe(mesh, dims, f"d_model:{m_}", f"experts:{e}", f"d_ff:{h}", dtype=F64)
        w = {k: t.to_numpy() for k, t in p.items()}
        for layout in (None, {}):  # x by the rules (groups split), and replicated
            x = mesh.from_numpy(xa, xs, layout=layout)
            for kw, cf in (({"seed": 3}, 1.25), ({"seed": 4, "second_policy": "all", "capacity_factor": 0.5,
                                                 "min_capacity": 1}, 0.5)):
                with mm.profile() as prof:
                    y, aux = moe(p, x, "group", **kw)
                cap = expert_capacity(s, e, cf, kw.get("min_capacity", 4))
                ry, raux = reference(xa, w["wg"], w["wi"], w["wo"], draws(kw["seed"], g, s), cap,
                                     kw.get("second_policy", "random"))
                np.testing.assert_allclose(y.to_numpy(), ry, rtol=1e-10, atol=1e-12, err_msg=f"{shape} {kw}")
                np.testing.assert_allclose(float(aux), raux, rtol=1e-10, err_msg=f"{shape} {kw}")
                a2a = {k: v for k, v in prof.counters.items() if k.startswith("alltoall/")}
                if mesh.shape[md].size > 1:
                    want = (e * block_len(mesh, g, md) + block_len(mesh, e, md) * g) * cap * m_
                    assert a2a == {f"alltoall/{md}": {"calls": 2, "elements": want, "bytes": 8 * want}}, a2a
                else:
                    assert a2a == {}, a2a


@pytest.mark.parametrize("dims", range(2))
def test_uneven_gradients_by_finite_differences(dims):
    g, s, m_, e, h = UNEVEN[dims]
    shape, rules = uneven_rules()[-1]
    mesh = mm.Mesh(shape, layout=rules)
    shapes = [f"group:{g};tokens:{s};d_model:{m_}", f"d_model:{m_};experts:{e}",
              f"experts:{e};d_model:{m_};d_ff:{h}", f"experts:{e};d_ff:{h};d_model:{m_}"]
    arrays = [global_array(sh, 70 + i, np.float64) for i, sh in enumerate(shapes)]
    arrays[1] = arrays[1] * 2.0  # confident gates
    u = draws(11, g, s)
    assert margins(arrays[0], arrays[1], u) > 1e-4, "pick another seed: a near-tie could flip"

    def f(x, wg, wi, wo):
        y, aux = moe({"wg": wg, "wi": wi, "wo": wo}, x, "group", seed=11, loss_coef=0.5, capacity_factor=1.0,
                     min_capacity=2)
        return mm.reduce_sum(mm.sin(y)) + aux

    check_gradients(mesh, f, arrays, shapes, [None, {}, None, None], wrt=[0, 1, 2, 3], directions=2, seed=dims)


# ---- hand-built cases ------------------------------------------------------------------------------------
def expert_fn(wi, wo, e, v):
    return np.maximum(v @ wi[e], 0) @ wo[e]


def hand_mesh():
    n = MPI.COMM_WORLD.Get_size()
    return mm.Mesh(f"all:{n}", layout="group:all;experts:all")


def hand_params(mesh, wg):
    rng = np.random.default_rng(1)
    wi, wo = rng.standard_normal((E, M, H)), rng.standard_normal((E, H, M))
    p = {"wg": mesh.from_numpy(wg, f"d_model:{M};experts:{E}", layout={}),
         "wi": mesh.from_numpy(wi, f"experts:{E};d_model:{M};d_ff:{H}"),
         "wo": mesh.from_numpy(wo, f"experts:{E};d_ff:{H};d_model:{M}")}
    return p, wi, wo


def test_capacity_overflow_all_prefer_one_expert():
    """Every token's first choice is expert 0 and second expert 1: only the first C tokens of each
    group get through (first and second expert alike); the rest output exactly 0."""
    mesh = hand_mesh()
    wg = np.zeros((M, E))
    wg[0, 0], wg[0, 1] = 5.0, 2.0
    xa = np.abs(global_array(X, 2, np.float64)) * 0.1
    xa[..., 0] = 1.0  # logits [5, 2, ~0.1 ...]: e1 = 0, e2 = 1 everywhere
    p, wi, wo = hand_params(mesh, wg)
    x = mesh.from_numpy(xa, X)
    cap = 5
    for policy in ("none", "all"):
        y, aux = moe(p, x, "group", capacity_factor=cap * E / S, min_capacity=1, second_policy=policy)
        yn = y.to_numpy()
        assert np.all(yn[:, cap:] == 0.0)
        gates = softmax(xa @ wg)
        g1 = gates[..., 0] / (gates[..., 0] + gates[..., 1] + 1e-9)
        g2 = gates[..., 1] / (gates[..., 0] + gates[..., 1] + 1e-9)
        want = g1[..., None] * expert_fn(wi, wo, 0, xa)
        if policy == "all":
            want = want + g2[..., None] * expert_fn(wi, wo, 1, xa)
        np.testing.assert_allclose(yn[:, :cap], want[:, :cap], rtol=1e-10, atol=1e-12)
        # aux = coef·E²·mean_e(c_e/S·m_e): c_0 = S, the others 0, so coef·E·mean_s gates[s, 0].
        np.testing.assert_allclose(float(aux), 1e-2 * E * gates[..., 0].mean(), rtol=1e-10)


def test_second_choices_queue_after_first_choices():
    """Tokens 0..7 choose experts (0, 1), tokens 8..15 choose (1, 0): each expert holds 8 first
    choices; with C = 11 the second choices of tokens 0-2 and 8-10 fit (positions 8, 9, 10)."""
    mesh = hand_mesh()
    wg = np.zeros((M, E))
    wg[0, 0], wg[0, 1], wg[1, 0], wg[1, 1] = 3.0, 1.0, 1.0, 3.0
    xa = np.zeros((G, S, M))
    xa[:, : S // 2, 0] = 1.0
    xa[:, S // 2:, 1] = 1.0
    xa[..., 2:] = np.abs(global_array(X, 3, np.float64))[..., 2:] * 0.01
    p, wi, wo = hand_params(mesh, wg)
    y, aux = moe(p, mesh.from_numpy(xa, X), "group", capacity_factor=11 * E / S, min_capacity=1,
                 second_policy="all")
    gates = softmax(xa @ wg)
    want = np.zeros_like(xa)
    for s in range(S):
        e1, e2 = (0, 1) if s < S // 2 else (1, 0)
        d = gates[:, s, e1] + gates[:, s, e2] + 1e-9
        want[:, s] = (gates[:, s, e1] / d)[:, None] * expert_fn(wi, wo, e1, xa[:, s])
        if s % (S // 2) < 3:
            want[:, s] += (gates[:, s, e2] / d)[:, None] * expert_fn(wi, wo, e2, xa[:, s])
    np.testing.assert_allclose(y.to_numpy(), want, rtol=1e-10, atol=1e-12)
    # c_0 = c_1 = S/2: aux = coef·E²·(1/E)·(½·m_0 + ½·m_1), m_e the group-mean gate of e.
    m = gates.mean(1)
    np.testing.assert_allclose(float(aux), 1e-2 * E * np.mean(0.5 * m[:, 0] + 0.5 * m[:, 1]), rtol=1e-10)


# ---- gradients -------------------------------------------------------------------------------------------
def margins(xa, wg, u, threshold=0.2) -> float:
    """The smallest gap that a small perturbation must not close: top-3 gates, and u vs g2/threshold."""
    gates = np.sort(softmax(xa @ wg), -1)[..., ::-1]
    g1, g2 = gates[..., 0], gates[..., 1]
    return float(min(np.min(g1 - g2), np.min(g2 - gates[..., 2]),
                     np.min(np.abs(u - g2 / (g1 + g2 + 1e-9) / threshold))))


@pytest.mark.parametrize("config", range(2))
def test_gradients_by_finite_differences(config):
    shape, rules, emd = configs()[config]
    gs, ss, ms, es, hs = G, 8, 4, E, 8
    mesh = mm.Mesh(shape, layout=rules)
    shapes = [f"group:{gs};tokens:{ss};d_model:{ms}", f"d_model:{ms};experts:{es}",
              f"experts:{es};d_model:{ms};d_ff:{hs}", f"experts:{es};d_ff:{hs};d_model:{ms}"]
    arrays = [global_array(s, 20 + i, np.float64) for i, s in enumerate(shapes)]
    arrays[1] = arrays[1] * 2.0  # confident gates
    u = draws(9, gs, ss)
    assert margins(arrays[0], arrays[1], u) > 1e-4, "pick another seed: a near-tie could flip"
    layouts = [None, {}, None, None]
    cap = {"capacity_factor": 2.0, "min_capacity": 2}  # C = 2: some tokens overflow

    def f(x, wg, wi, wo):
        y, aux = moe({"wg": wg, "wi": wi, "wo": wo}, x, "group", seed=9, loss_coef=0.5, **cap)
        return mm.reduce_sum(mm.sin(y)) + aux

    check_gradients(mesh, f, arrays, shapes, layouts, wrt=[0, 1, 2, 3], directions=2, seed=config)


# ---- errors ----------------------------------------------------------------------------------------------
def test_errors():
    mesh = hand_mesh()
    p = init_moe(mesh, 0, f"d_model:{M}", f"experts:{E}", f"d_ff:{H}")
    x = mesh.ones(X)
    with pytest.raises(mm.ShapeError, match="three dims"):
        moe(p, mesh.ones(f"group:{G};d_model:{M}"), "group")
    with pytest.raises(mm.ShapeError, match="three dims"):
        moe(p, x, "batch")
    with pytest.raises(mm.MpimeshError, match="second_policy"):
        moe(p, x, "group", second_policy="sometimes")
    assert math.isfinite(float(moe(p, x, "group")[1]))
