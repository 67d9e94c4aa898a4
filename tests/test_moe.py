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
from mpimesh.layers.moe import _one_hot_routing, _top2_gates, expert_capacity, init_moe, moe
from mpimesh.ops.routing import combine_slots, dispatch_slots, top2_slots

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


def routes(gates, u, capacity, policy="random", threshold=0.2):
    """Top-2 routing of gates [G, S, E] by loops: (e1, e2, g1, g2, slot_1, slot_2) [G, S], a slot
    e·C + p, or -1 where the choice is dropped."""
    n_groups, n_tokens, n_exp = gates.shape
    e1, e2, s1, s2 = (np.full((n_groups, n_tokens), -1) for _ in range(4))
    g1, g2 = np.zeros((n_groups, n_tokens)), np.zeros((n_groups, n_tokens))
    for g in range(n_groups):
        for s in range(n_tokens):
            e1[g, s] = int(np.argmax(gates[g, s]))
            rest = gates[g, s].copy()
            rest[e1[g, s]] = 0.0
            e2[g, s] = int(np.argmax(rest))
            d = gates[g, s, e1[g, s]] + gates[g, s, e2[g, s]] + 1e-9
            g1[g, s], g2[g, s] = gates[g, s, e1[g, s]] / d, gates[g, s, e2[g, s]] / d
        fill = np.zeros(n_exp, int)
        for s in range(n_tokens):
            if fill[e1[g, s]] < capacity:
                s1[g, s] = e1[g, s] * capacity + fill[e1[g, s]]
            fill[e1[g, s]] += 1
        fill = np.minimum(fill, capacity)  # the second choices queue after the kept first ones
        for s in range(n_tokens):
            keep = {"all": True, "none": False, "threshold": g2[g, s] > threshold,
                    "random": u[g, s] < g2[g, s] / threshold}[policy]
            if keep:
                if fill[e2[g, s]] < capacity:
                    s2[g, s] = e2[g, s] * capacity + fill[e2[g, s]]
                fill[e2[g, s]] += 1
    return e1, e2, g1, g2, s1, s2


def reference(x, wg, wi, wo, u, capacity, policy="random", threshold=0.2, loss_coef=1e-2):
    """GShard top-2 MoE on x [G, S, M] by loops: (y [G, S, M], aux loss)."""
    n_exp = wg.shape[1]
    gates = softmax(x @ wg)
    e1, e2, g1, g2, s1, s2 = routes(gates, u, capacity, policy, threshold)
    y = np.zeros_like(x)
    for (g, s), _ in np.ndenumerate(e1):
        for e, gate, slot in ((e1[g, s], g1[g, s], s1[g, s]), (e2[g, s], g2[g, s], s2[g, s])):
            if slot >= 0:
                y[g, s] += gate * (np.maximum(x[g, s] @ wi[e], 0) @ wo[e])
    first = (e1[..., None] == np.arange(n_exp)).mean(1)  # tokens routed first to each expert, kept or not
    return y, loss_coef * n_exp * n_exp * np.mean(first * gates.mean(1))


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


@pytest.mark.parametrize("routing", ["gather", "one_hot"])
@pytest.mark.parametrize("config", range(4))
def test_matches_reference(config, routing):
    if config >= len(configs()):
        pytest.skip("fewer configurations on this rank count")
    shape, rules, emd = configs()[config]
    mesh, p, xa, x = setup(shape, rules, emd, seed=config)
    m, _ = split_dims(shape)
    assert p["wi"].layout.get("experts") == m and p["wo"].layout.get("experts") == m and "experts" not in p["wg"].layout
    w = {k: t.to_numpy() for k, t in p.items()}
    for kw, cap in CASES:
        y, aux = moe(p, x, "group", routing=routing, **kw)
        assert y.shape == x.shape and y.tensor_layout == mesh.plan(x.shape) and aux.shape.rank == 0
        ry, raux = reference(xa, w["wg"], w["wi"], w["wo"], draws(kw["seed"]), cap,
                             kw.get("second_policy", "random"), kw.get("second_threshold", 0.2),
                             kw.get("loss_coef", 1e-2))
        np.testing.assert_allclose(y.to_numpy(), ry, rtol=1e-10, atol=1e-12, err_msg=str(kw))
        np.testing.assert_allclose(float(aux), raux, rtol=1e-10, err_msg=str(kw))


@pytest.mark.parametrize("first,size", [(0, 3), (3, 5), (7, 1)])
def test_groups_of_a_batch_draw_the_batchs_numbers(first, size):
    """`draws=(first, G)`: groups first .. first+size-1 of a batch of G (a pipeline's microbatch) route
    with the whole batch's random draws, those rows of them: the loop reference on those rows."""
    shape, rules, emd = configs()[0]
    mesh, p, xa, _ = setup(shape, rules, emd, seed=1)
    rows = xa[first:first + size]
    x = mesh.from_numpy(rows, f"group:{size};tokens:{S};d_model:{M}")
    kw = {"seed": 3, "second_threshold": 1.0, "capacity_factor": 4.0}  # the draws decide many second choices
    y, _ = moe(p, x, "group", draws=(first, G), **kw)
    w = {k: t.to_numpy() for k, t in p.items()}
    ry, _ = reference(rows, w["wg"], w["wi"], w["wo"], draws(3)[first:first + size], expert_capacity(S, E, 4.0),
                      threshold=1.0)
    np.testing.assert_allclose(y.to_numpy(), ry, rtol=1e-10, atol=1e-12)
    alone, _ = moe(p, x, "group", **kw)  # without draws: the first `size` rows' numbers, another routing
    assert first == 0 or not np.allclose(alone.to_numpy(), ry)


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
@pytest.mark.parametrize("routing", ["gather", "one_hot"])
@pytest.mark.parametrize("config", range(4))
def test_two_alltoalls_each_way(config, routing):
    if config >= len(configs()):
        pytest.skip("fewer configurations on this rank count")
    shape, rules, emd = configs()[config]
    mesh, p, _, x = setup(shape, rules, emd)
    m, _ = split_dims(shape)
    want = 2 if mesh.shape[m].size > 1 else 0
    with mm.trace() as tr:
        with mm.profile() as fwd:
            y, aux = moe(p, x, "group", seed=1, routing=routing)
        with mm.profile() as bwd:
            grads = mm.gradients([y, aux], [x, p["wg"], p["wi"], p["wo"]])
    names = {op.name for op in tr.ops}
    masks = [t for op in tr.ops for t in op.outputs if {"tokens", "experts", "expert_capacity"} <= set(t.shape.names)]
    gathers = {"top2_slots", "dispatch_slots", "combine_slots"}
    if routing == "gather":  # no [G, S, E, C] tensor, forward or backward
        assert gathers <= names and not masks, (names, masks)
    else:
        assert not gathers & names and masks
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


# ---- the two routings ------------------------------------------------------------------------------------
def _routing_configs() -> list:
    """(mesh shape, rules, G, S, M, E, H): the session's layouts, and uneven groups and experts."""
    out = [(shape, rules, G, S, M, E, H) for shape, rules, _ in configs()[:2]]
    out += [(shape, rules) + UNEVEN[i] for i, (shape, rules) in enumerate(uneven_rules())]
    return out


@pytest.mark.parametrize("config", range(4))
def test_routings_agree(config):
    """gather and one_hot: the same y, aux and gradients (float64 to 1e-12; bfloat16 activations over
    float64 masters to bfloat16 rounding), in every policy, with dropped tokens."""
    if config >= len(_routing_configs()):
        pytest.skip("fewer configurations on this rank count")
    shape, rules, g, s, m_, e, h = _routing_configs()[config]
    mesh = mm.Mesh(shape, layout=rules)
    p = init_moe(mesh, config, f"d_model:{m_}", f"experts:{e}", f"d_ff:{h}", dtype=F64)
    x = mesh.from_numpy(global_array(f"group:{g};tokens:{s};d_model:{m_}", 50 + config, np.float64),
                        f"group:{g};tokens:{s};d_model:{m_}")
    wrt = [x, p["wg"], p["wi"], p["wo"]]
    for kw in ({"seed": 3}, {"seed": 5, "capacity_factor": 0.5, "min_capacity": 1},
               {"seed": 6, "second_policy": "threshold", "second_threshold": 0.3, "loss_coef": 0.1},
               {"seed": 7, "second_policy": "none"}):
        for dtype, tol in ((F64, 1e-12), ("bfloat16", 2.0 ** -5)):
            got = []
            for routing in ("gather", "one_hot"):
                with mm.trace():
                    xd = mm.cast(x, dtype)
                    y, aux = moe(p, xd, "group", routing=routing, **kw)
                    loss = mm.reduce_sum(mm.sin(mm.cast(y, F64))) + mm.cast(aux, F64)
                    got.append([t.to_numpy().astype(np.float64) for t in [y, aux] + mm.gradients([loss], wrt)])
            for a, b, name in zip(*got, ["y", "aux", "dx", "dwg", "dwi", "dwo"]):
                scale = max(1.0, float(np.max(np.abs(b)))) if dtype != F64 else 1.0
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale, err_msg=f"{name} {dtype} {kw}")


def _one_hot_dispatch(slots, n_exp: int, cap: int) -> np.ndarray:
    """[G, S, E, C] 0/1 from slots [G, S] (e·C + p, -1 dropped) of each choice."""
    d = np.zeros(slots[0].shape + (n_exp * cap,))
    for sl in slots:
        gi, si = np.nonzero(sl >= 0)
        d[gi, si, sl[gi, si]] += 1
    return d.reshape(slots[0].shape + (n_exp, cap))


@pytest.mark.parametrize("dtype", [F64, "float32", "bfloat16"])
def test_kept_and_dropped_choices_identical(dtype):
    """top2_slots keeps and drops exactly the choices of the one-hot masks (the same draws), in every
    policy, and of the loop reference on the same gates."""
    shape = mesh_shapes()[0]
    mesh = mm.Mesh(shape, layout=f"group:{split_dims(shape)[0]}")  # the group phase: experts whole
    n_groups, n_tokens, n_exp = 6, 40, 5
    xs = f"group:{n_groups};tokens:{n_tokens};d_model:{M}"
    x = mm.cast(mesh.from_numpy(global_array(xs, 60, np.float64), xs), dtype)
    wg = mm.cast(mesh.from_numpy(global_array(f"d_model:{M};experts:{n_exp}", 61, np.float64) * 0.5,
                                 f"d_model:{M};experts:{n_exp}", layout={}), dtype)
    dims = [x.shape["group"], x.shape["tokens"], wg.shape["experts"]]
    cap = mm.Dimension("expert_capacity", 6)
    for policy, thr in (("random", 0.2), ("random", 0.6), ("threshold", 0.35), ("all", 0.2), ("none", 0.2)):
        one = _top2_gates(x, wg, *dims, cap, policy, thr, 8, 1e-2, False)
        dispatch, _ = _one_hot_routing(*one[:5], dims[1], cap, policy, thr)
        fused = _top2_gates(x, wg, *dims, cap, policy, thr, 8, 1e-2, True)
        slots = [t.to_numpy() for t in fused[-1].tensors]
        np.testing.assert_array_equal(_one_hot_dispatch(slots, n_exp, cap.size), dispatch.to_numpy(), err_msg=policy)
        assert policy in ("none",) or 0 < np.sum(slots[1] < 0) < slots[1].size, policy  # some kept, some dropped
        if dtype == F64:
            gates = softmax(x.to_numpy() @ wg.to_numpy())
            u = draws(8, n_groups, n_tokens)
            want = routes(gates, u, cap.size, policy, thr)
            gs = f"group:{n_groups};tokens:{n_tokens}"
            e1, e2, sl = top2_slots(mesh.from_numpy(gates, f"{gs};experts:{n_exp}"), "tokens", "experts", cap, policy,
                                    thr, mesh.from_numpy(u, gs) if policy == "random" else None)
            for a, b in zip([e1, e2] + list(sl.tensors), want[:2] + want[4:]):
                np.testing.assert_array_equal(a.to_numpy(), b, err_msg=policy)


def test_layouts_that_need_one_hot():
    """Tokens split in the group phase (no groups rule): "auto" routes by one-hot einsums and matches
    the reference; "gather" is refused by name."""
    n = MPI.COMM_WORLD.Get_size()
    mesh = mm.Mesh(f"all:{n}", layout="tokens:all;experts:all")
    p = init_moe(mesh, 0, f"d_model:{M}", f"experts:{E}", f"d_ff:{H}", dtype=F64)
    xa = global_array(X, 12, np.float64)
    x = mesh.from_numpy(xa, X)
    with mm.trace() as tr:
        y, aux = moe(p, x, "group", seed=3)
    assert "dispatch_slots" not in {op.name for op in tr.ops}
    w = {k: t.to_numpy() for k, t in p.items()}
    ry, raux = reference(xa, w["wg"], w["wi"], w["wo"], draws(3), expert_capacity(S, E, 1.25))
    np.testing.assert_allclose(y.to_numpy(), ry, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(float(aux), raux, rtol=1e-10)
    with pytest.raises(mm.LayoutError, match="tokens is split over mesh dim 'all'"):
        moe(p, x, "group", routing="gather")


def test_routing_errors():
    mesh = self_mesh()
    gates = mesh.ones("g:2;s:3;e:4")
    with pytest.raises(mm.ShapeError, match=r"tokens 'tok' and experts 'e'"):
        top2_slots(gates, "tok", "e", "c:2", "all")
    with pytest.raises(mm.ShapeError, match=r"capacity dim g:2 must be new"):
        top2_slots(gates, "s", "e", "g:2", "all")
    with pytest.raises(mm.ShapeError, match=r"at least 2 experts, got e:1"):
        top2_slots(mesh.ones("s:3;e:1"), "s", "e", "c:2", "all")
    with pytest.raises(mm.MpimeshError, match="'random' needs uniform draws"):
        top2_slots(gates, "s", "e", "c:2")
    with pytest.raises(mm.ShapeError, match=r"uniform draws \[g:2, s:4\] must have the dims"):
        top2_slots(gates, "s", "e", "c:2", uniform=mesh.ones("g:2;s:4"))
    _, _, slots = top2_slots(gates, "s", "e", "c:2", "all")
    with pytest.raises(mm.ShapeError, match=r"x \[g:2, d:5\] needs the tokens dim 's'"):
        dispatch_slots(mesh.ones("g:2;d:5"), slots)
    with pytest.raises(mm.ShapeError, match="'g'"):
        dispatch_slots(mesh.ones("g:3;s:3;d:5"), slots)
    with pytest.raises(mm.ShapeError, match=r"needs the experts dim e:4 and the capacity dim c:2"):
        combine_slots(mesh.ones("e:4;g:2;c:3;d:5"), slots)
    with pytest.raises(mm.ShapeError, match="a weight must be a float tensor with the slots' dims"):
        combine_slots(mesh.ones("e:4;g:2;c:2;d:5"), slots, (mesh.ones("g:2"), mesh.ones("g:2")))
    with pytest.raises(mm.MpimeshError, match="routing"):
        moe(init_moe(mesh, 0, f"d_model:{M}", f"experts:{E}", f"d_ff:{H}"), mesh.ones(X), "group", routing="dense")


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
    with pytest.raises(mm.ShapeError, match=r"model dim d_model:7, but the params were built for d_model:8"):
        moe(p, mesh.ones(f"group:{G};tokens:{S};d_model:7"), "group")


def test_capacity_errors():
    """A capacity_factor or min_capacity that is not a number, out of range, or gives no slot per expert
    is refused by name, on every rank, before any kernel runs."""
    mesh = hand_mesh()
    p = init_moe(mesh, 0, f"d_model:{M}", f"experts:{E}", f"d_ff:{H}")
    x = mesh.ones(X)
    for cf in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(mm.MpimeshError, match=rf"capacity_factor must be a finite number > 0, got {cf}"):
            moe(p, x, "group", capacity_factor=cf, min_capacity=0)
    with pytest.raises(TypeError, match=r"capacity_factor must be a real number, got '1' \(str\)"):
        moe(p, x, "group", capacity_factor="1")
    with pytest.raises(mm.MpimeshError, match=r"min_capacity must be >= 0, got -3"):
        moe(p, x, "group", capacity_factor=1.0, min_capacity=-3)
    with pytest.raises(TypeError, match=r"min_capacity must be an int, got 2.5 \(float\)"):
        moe(p, x, "group", min_capacity=2.5)
    with pytest.raises(mm.MpimeshError, match=r"capacity_factor 0.25 and min_capacity 0 give an expert capacity of 0 "
                                              r"for 16 tokens per group and 8 experts .*capacity_factor above 8/16"):
        moe(p, x, "group", capacity_factor=0.25, min_capacity=0)
    p16 = init_moe(mesh, 0, f"d_model:{M}", "experts:16", f"d_ff:{H}")
    with pytest.raises(mm.MpimeshError, match=r"raise min_capacity to 1 or capacity_factor above 16/8 = 2"):
        moe(p16, mesh.ones(f"group:{G};tokens:8;d_model:{M}"), "group", capacity_factor=1.0, min_capacity=0)
    assert expert_capacity(8, 16, 2.0, 0) == 1 and expert_capacity(8, 16, 1e308, 0) == 8
    assert expert_capacity(7, 61, math.nextafter(61 / 7, math.inf), 0) == 1  # "above E/S" suffices


def test_capacity_one_without_min_capacity():
    """min_capacity 0 with capacity_factor = E/S: one slot per expert, as the reference gives."""
    shape, rules, emd = configs()[0]
    mesh, p, xa, x = setup(shape, rules, emd)
    w = {k: t.to_numpy() for k, t in p.items()}
    for routing in ("gather", "one_hot"):
        y, aux = moe(p, x, "group", capacity_factor=E / S, min_capacity=0, second_policy="all", routing=routing)
        ry, raux = reference(xa, w["wg"], w["wi"], w["wo"], draws(0), 1, "all")
        np.testing.assert_allclose(y.to_numpy(), ry, rtol=1e-10, atol=1e-12, err_msg=routing)
        np.testing.assert_allclose(float(aux), raux, rtol=1e-10, err_msg=routing)


def test_no_tokens():
    """A group of 0 tokens: an empty output and zero gradients (the dispatch kernel indexed an empty
    token axis); the auxiliary loss is a mean over no token, NaN as numpy's."""
    mesh = hand_mesh()
    p = init_moe(mesh, 0, f"d_model:{M}", f"experts:{E}", f"d_ff:{H}")
    with mm.trace():
        y, aux = moe(p, mesh.ones(f"group:{G};tokens:0;d_model:{M}"), "group")
        (g,) = mm.gradients([mm.reduce_sum(y)], [p["wi"]])
    assert y.shape == mm.Shape(f"group:{G};tokens:0;d_model:{M}") and np.isnan(float(aux))
    np.testing.assert_array_equal(g.to_numpy(), 0.0)


def test_routing_capacity_zero_and_token_sizes():
    """With a capacity dim of size 0, dispatch_slots gives empty buffers and combine_slots zeros (and a
    zero gradient); x's tokens must have the slots' size."""
    mesh = mm.Mesh(mesh_shapes()[0], layout=f"g:{split_dims(mesh_shapes()[0])[0]}")
    gates = mm.softmax(mesh.from_numpy(global_array("g:3;s:8;e:4", 80, np.float64), "g:3;s:8;e:4"), "e")
    xa = global_array("g:3;s:8;d:5", 81, np.float64)
    x = mesh.from_numpy(xa, "g:3;s:8;d:5")
    _, _, slots = top2_slots(gates, "s", "e", mm.Dimension("c", 0), "all")
    assert all(np.all(t.to_numpy() == -1) for t in slots.tensors)
    w = mesh.from_numpy(global_array("g:3;s:8", 82, np.float64), "g:3;s:8")
    with mm.trace():
        ein = dispatch_slots(x, slots)
        y = combine_slots(ein, slots, (w, w))
        grads = mm.gradients([mm.reduce_sum(y * x)], [x, w])
    assert ein.shape == mm.Shape("e:4;g:3;c:0;d:5") and y.shape == x.shape
    for t in [y] + grads:
        np.testing.assert_array_equal(t.to_numpy(), 0.0)
    _, _, slots = top2_slots(gates, "s", "e", mm.Dimension("c", 2), "all")
    with pytest.raises(mm.ShapeError, match=r"dispatch_slots: \[g:3, s:7, d:5\] and the slots' \[g:3, s:8\]: "
                                            r"dim 's' has size 7 in one input and 8 in another"):
        dispatch_slots(mesh.ones("g:3;s:7;d:5"), slots)
    y = combine_slots(dispatch_slots(x, slots), slots)  # the valid neighbour: each token's kept copies, summed
    s1, s2 = (t.to_numpy() for t in slots.tensors)
    kept = (s1 >= 0).astype(float) + (s2 >= 0)
    np.testing.assert_allclose(y.to_numpy(), xa * kept[..., None], rtol=1e-12)
