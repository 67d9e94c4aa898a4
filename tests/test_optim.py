"""mm.optim against numpy reference implementations written from the papers, step by step,
on 1-D/2-D/3-D meshes and several parameter layouts (state must follow each parameter's layout)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import global_array, layouts, mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.backend import to_host  # noqa: E402

# Dims split in tests are multiples of 8: even on 2, 4 and 8 ranks, uneven on 3. "u" and "o" do not
# divide 2, 3 or 4 ranks, and r:2 leaves blocks empty on 3 ranks and more.
SHAPES = {"w": "io:8;hidden:16", "b": "hidden:16", "e": "vocab:16;io:8;heads:3", "s": "a:8;k:2",
          "u": "p:5;q:7;r:2", "o": "m:10;q:7"}
SPLITTABLE = ["io", "hidden", "vocab", "a"]
UNEVEN = ["p", "q", "r", "m"]
STEPS = 5


# ---------------------------------------------------------------- numpy references (float64)
def ref_sgd(lr, momentum):
    def step(p, g, st, t):
        if momentum:
            st["v"] = momentum * st.get("v", 0.0) + g
            return p - lr * st["v"]
        return p - lr * g
    return step


def ref_adam(lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    """Kingma & Ba, Algorithm 1; decoupled weight decay as in Loshchilov & Hutter (AdamW)."""
    def step(p, g, st, t):
        st["m"] = b1 * st.get("m", 0.0) + (1 - b1) * g
        st["v"] = b2 * st.get("v", 0.0) + (1 - b2) * g ** 2
        m_hat, v_hat = st["m"] / (1 - b1 ** t), st["v"] / (1 - b2 ** t)
        return p - lr * wd * p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return step


def rms(x):
    return np.sqrt(np.mean(x ** 2))


def ref_adafactor(min_dim=128, lr=None, decay=None, beta1=0.0, clip=1.0, param_scale=True,
                  eps1=1e-30, eps2=1e-3, clipped=None):
    """Shazeer & Stern (2018), Algorithms 4/5 with relative step size, update clipping and
    parameter scaling; second moments of the two largest axes factored as R C / mean(R) with
    row/column means (per index of the remaining axes)."""
    def step(p, g, st, t):
        rho = (min(0.01, 1 / np.sqrt(t)) * (1.0 if param_scale else 0.05)) if lr is None else lr
        beta2 = 1 - t ** -0.8 if decay is None else decay
        alpha = rho * max(eps2, rms(p)) if param_scale else rho
        g2 = g ** 2 + eps1
        order = sorted(range(g.ndim), key=lambda i: -g.shape[i])
        if g.ndim >= 2 and g.shape[order[1]] >= min_dim:
            a0, a1 = order[0], order[1]
            # move the factored axes last: (..., n0, n1)
            gm = np.moveaxis(g2, (a0, a1), (-2, -1))
            st["row"] = beta2 * st.get("row", 0.0) + (1 - beta2) * gm.mean(-1)   # indexed by axis a0
            st["col"] = beta2 * st.get("col", 0.0) + (1 - beta2) * gm.mean(-2)   # indexed by axis a1
            v = st["row"][..., :, None] * st["col"][..., None, :] / st["row"].mean(-1)[..., None, None]
            u = g / np.sqrt(np.moveaxis(v, (-2, -1), (a0, a1)))
        else:
            st["v"] = beta2 * st.get("v", 0.0) + (1 - beta2) * g2
            u = g / np.sqrt(st["v"])
        if clip is not None:
            if clipped is not None and rms(u) > clip:
                clipped.append(t)
            u = u / max(1.0, rms(u) / clip)
        d = alpha * u
        if beta1:
            st["m"] = beta1 * st.get("m", 0.0) + (1 - beta1) * d
            d = st["m"]
        return p - d
    return step


# ---------------------------------------------------------------- harness
def grad_array(name: str, step: int) -> np.ndarray:
    """Gradients that vary per step, in scale too (a jump after small steps triggers clipping)."""
    scale = [1.0, 0.1, 0.01, 5.0, 0.5][step % 5]
    return scale * global_array(SHAPES[name], seed=1000 + 17 * step + sorted(SHAPES).index(name), dtype=np.float64)


def restrict(layout: dict, shape: str) -> dict:
    names = mm.Shape(shape).names
    return {d: m for d, m in layout.items() if d in names}


def make(mesh, arrays: dict, layout: dict, dtype=np.float64) -> dict:
    return {n: mesh.from_numpy(a.astype(dtype), SHAPES[n], layout=restrict(layout, SHAPES[n]))
            for n, a in arrays.items()}


def check_state_layouts(opt, params, state):
    for slot, tensors in state.items():
        if slot == "step":
            assert tensors.shape == mm.Shape(()) and tensors.tensor_layout == ()
            continue
        for name, t in tensors.items():
            p = params[name]
            assert set(t.shape.names) <= set(p.shape.names)
            want = tuple(p.tensor_layout[p.shape.index(n)] for n in t.shape.names)
            assert t.tensor_layout == want, (slot, name, t.layout, p.layout)
            assert t.dtype == p.dtype


def run(mesh, opt, ref, names, layout, steps=STEPS, dtype=np.float64, rtol=1e-10, grad_layout=None):
    """`steps` updates of mm and of the numpy reference, compared after every step. Returns the
    final mm state and the reference states."""
    arrays = {n: global_array(SHAPES[n], seed=7 + i, dtype=np.float64) for i, n in enumerate(names)}
    params = make(mesh, arrays, layout, dtype)
    state = opt.init(params)
    check_state_layouts(opt, params, state)
    ref_states = {n: {} for n in names}
    for k in range(steps):
        garrs = {n: grad_array(n, k) for n in names}
        grads = make(mesh, garrs, layout if grad_layout is None else grad_layout, dtype)
        params, state = opt.update(params, grads, state)
        for n in names:
            arrays[n] = ref(arrays[n], garrs[n], ref_states[n], k + 1)
            np.testing.assert_allclose(params[n].to_numpy(), arrays[n], rtol=rtol, atol=rtol * 1e-3,
                                       err_msg=f"param {n} after step {k + 1}, layout {params[n].layout}")
            assert params[n].tensor_layout == mesh.from_numpy(arrays[n], SHAPES[n],
                                                              restrict(layout, SHAPES[n])).tensor_layout
        check_state_layouts(opt, params, state)
    assert int(state["step"].to_numpy()) == steps
    return params, state, ref_states


def configs(limit: int = 3, dims=SPLITTABLE):
    """(mesh, layout) pairs: every mesh shape of this rank count, a few layouts of the split dims.
    The mesh's own rules differ from the params' layouts, so state must follow the params."""
    for shape in mesh_shapes():
        mesh = mm.Mesh(shape)
        rules = {"io": mesh.shape.names[-1]} if mesh.shape[-1].size > 1 else {}
        mesh = mm.Mesh(shape, layout=rules)
        for lay in layouts(mesh, dims, limit=limit):
            yield mesh, lay


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd(momentum):
    for mesh, lay in configs():
        opt = mm.optim.SGD(0.1, momentum=momentum)
        _, state, _ = run(mesh, opt, ref_sgd(0.1, momentum), ["w", "b", "e"], lay)
        assert sorted(state) == (["step", "v"] if momentum else ["step"])


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adam(wd):
    for mesh, lay in configs():
        opt = mm.optim.Adam(0.01, weight_decay=wd)
        _, state, refs = run(mesh, opt, ref_adam(0.01, wd=wd), ["w", "b", "e"], lay)
        for n in ("w", "b", "e"):
            np.testing.assert_allclose(state["m"][n].to_numpy(), refs[n]["m"], rtol=1e-10)
            np.testing.assert_allclose(state["v"][n].to_numpy(), refs[n]["v"], rtol=1e-10)


@pytest.mark.parametrize("which", ["sgd", "adam", "adafactor"])
def test_uneven_layouts(which):
    """Params whose split dims do not divide the mesh (5, 7, 10; r:2 with empty blocks): the same
    updates and state as the numpy reference on one rank, each state tensor cut like its param."""
    opt, ref = {
        "sgd": (mm.optim.SGD(0.1, momentum=0.9), ref_sgd(0.1, 0.9)),
        "adam": (mm.optim.Adam(0.01, weight_decay=0.05), ref_adam(0.01, wd=0.05)),
        "adafactor": (mm.optim.Adafactor(min_dim_size_to_factor=4, beta1=0.5),
                      ref_adafactor(min_dim=4, beta1=0.5)),
    }[which]
    for mesh, lay in configs(limit=5, dims=UNEVEN):
        params, state, refs = run(mesh, opt, ref, ["u", "o"], lay, steps=3, rtol=1e-9)
        for name, p in params.items():  # this rank's blocks are numpy.array_split's
            want = p.to_numpy()
            for axis, d in enumerate(p.shape.names):
                if d in lay:
                    want = np.array_split(want, mesh.shape[lay[d]].size, axis=axis)[mesh.coords[lay[d]]]
            np.testing.assert_array_equal(to_host(p.local), want)
        if which == "adam":
            for n in ("u", "o"):
                np.testing.assert_allclose(state["v"][n].to_numpy(), refs[n]["v"], rtol=1e-9)
        if which == "adafactor":  # u: d0 = q (7), d1 = p (5); o: d0 = m (10), d1 = q (7)
            assert state["vr"]["u"].shape == mm.Shape("p:5;r:2") and state["vc"]["o"].shape == mm.Shape("m:10")
            np.testing.assert_allclose(state["vr"]["u"].to_numpy(), refs["u"]["col"].T, rtol=1e-9)
            np.testing.assert_allclose(state["vc"]["o"].to_numpy(), refs["o"]["row"], rtol=1e-9)


def test_adam_float32_and_schedule():
    """float32 params; a learning-rate schedule given as a function of the step tensor."""
    mesh = mm.Mesh(mesh_shapes()[1])
    lay = layouts(mesh, SPLITTABLE, limit=3)[-1]
    opt = mm.optim.Adam(lambda t: 0.02 * mm.minimum(t / 3.0, 1.0), beta1=0.8, beta2=0.99, epsilon=1e-6)

    def ref(p, g, st, t):
        return ref_adam(0.02 * min(t / 3.0, 1.0), b1=0.8, b2=0.99, eps=1e-6)(p, g, st, t)
    params, _, _ = run(mesh, opt, ref, ["w", "e"], lay, dtype=np.float32, rtol=2e-5)
    assert params["w"].dtype == np.float32


def test_adafactor_factored_and_unfactored():
    """Defaults except a small min_dim_size_to_factor: w and e (3-D) factored, b (1-D) and s (second
    largest dim too small) unfactored; factored stats laid out like the param's remaining dims."""
    for mesh, lay in configs():
        clipped: list = []
        opt = mm.optim.Adafactor(min_dim_size_to_factor=8)
        _, state, refs = run(mesh, opt, ref_adafactor(min_dim=8, clipped=clipped), ["w", "b", "e", "s"], lay, rtol=1e-9)
        assert clipped, "the test gradients should trigger update clipping"
        assert sorted(state["vr"]) == ["e", "w"] and sorted(state["vc"]) == ["e", "w"]
        assert sorted(state["v"]) == ["b", "s"] and "m" not in state
        # w: d0 = hidden (16), d1 = io (8); e: d0 = vocab, d1 = io, heads kept in both
        assert state["vr"]["w"].shape == mm.Shape("io:8") and state["vc"]["w"].shape == mm.Shape("hidden:16")
        assert state["vr"]["e"].shape == mm.Shape("io:8;heads:3")
        assert state["vc"]["e"].shape == mm.Shape("vocab:16;heads:3")
        np.testing.assert_allclose(state["vc"]["w"].to_numpy(), refs["w"]["row"], rtol=1e-9)
        np.testing.assert_allclose(state["vr"]["w"].to_numpy(), refs["w"]["col"], rtol=1e-9)
        np.testing.assert_allclose(state["v"]["s"].to_numpy(), refs["s"]["v"], rtol=1e-9)


def test_adafactor_options():
    """beta1 > 0 (first moment), no parameter scaling, no clipping, constant lr and decay rate."""
    mesh = mm.Mesh(mesh_shapes()[-1])
    for lay in layouts(mesh, SPLITTABLE, limit=3):
        opt = mm.optim.Adafactor(learning_rate=0.05, decay_rate=0.9, beta1=0.5, clipping_threshold=None,
                                 multiply_by_parameter_scale=False, min_dim_size_to_factor=8)
        ref = ref_adafactor(min_dim=8, lr=0.05, decay=0.9, beta1=0.5, clip=None, param_scale=False)
        _, state, refs = run(mesh, opt, ref, ["w", "b", "e"], lay, rtol=1e-9)
        np.testing.assert_allclose(state["m"]["e"].to_numpy(), refs["e"]["m"], rtol=1e-9)
    # the relative step without parameter scaling is 0.05 * min(0.01, 1/sqrt(t))
    opt = mm.optim.Adafactor(multiply_by_parameter_scale=False, factored=False)
    run(mesh, opt, ref_adafactor(min_dim=10 ** 9, param_scale=False), ["w", "b"], {}, steps=3, rtol=1e-9)


def test_adafactor_default_threshold():
    """With Mesh-TensorFlow's min_dim_size_to_factor (128), a 16x8 param is not factored."""
    mesh = mm.Mesh(mesh_shapes()[0])
    opt = mm.optim.Adafactor()
    assert opt.factored_dims(mm.Shape("a:128;b:256")) == (mm.Dimension("b", 256), mm.Dimension("a", 128))
    assert opt.factored_dims(mm.Shape("a:127;b:256")) is None
    _, state, _ = run(mesh, opt, ref_adafactor(), ["w"], {"hidden": mesh.shape.names[0]}, steps=2, rtol=1e-9)
    assert list(state["v"]) == ["w"] and not state["vr"] and not state["vc"]


def test_grads_in_another_layout():
    """Gradients laid out differently from their params: results still in the params' layouts."""
    mesh = mm.Mesh(mesh_shapes()[1])
    lays = layouts(mesh, SPLITTABLE, limit=4)
    opt = mm.optim.Adafactor(min_dim_size_to_factor=8, beta1=0.9)
    run(mesh, opt, ref_adafactor(min_dim=8, beta1=0.9), ["w", "e"], lays[-1], steps=3, rtol=1e-9,
        grad_layout=lays[len(lays) // 2])


def test_communication():
    """SGD and Adam are purely local; Adafactor only allreduces (RMS values, factored means) over the
    mesh dims its parameters are split on, never over the mesh rules' other dims."""
    mesh = mm.Mesh(mesh_shapes()[1], layout={"batch": mesh_shapes()[1].split(";")[0].split(":")[0]})
    split = mesh.shape.names[-1]
    arrays = {n: global_array(SHAPES[n], seed=i, dtype=np.float64) for i, n in enumerate(["w", "b", "e"])}
    params = make(mesh, arrays, {"hidden": split, "vocab": split})
    grads = make(mesh, {n: grad_array(n, 0) for n in arrays}, {"io": split})  # needs a relayout
    grads = {n: mm.relayout(g, params[n].layout) for n, g in grads.items()}
    for opt in (mm.optim.SGD(0.1, momentum=0.9), mm.optim.Adam(0.1),
                mm.optim.Adafactor(min_dim_size_to_factor=8)):
        state = opt.init(params)
        with mm.profile() as prof:
            opt.update(params, grads, state)
        kinds = {k for k in prof.counters if k != "flops"}
        if isinstance(opt, mm.optim.Adafactor):
            assert kinds <= {f"allreduce/{split}"}, kinds
        else:
            assert not kinds, kinds


def test_update_is_traced_and_functional():
    """Every new tensor comes out of a recorded mpimesh op; the inputs are not modified; a None
    gradient leaves its parameter and state untouched; gradients from mm.gradients plug straight in."""
    mesh = mm.Mesh(mesh_shapes()[1])
    lay = {"hidden": mesh.shape.names[-1]}
    x = mesh.from_numpy(global_array("batch:4;io:8", seed=3, dtype=np.float64), "batch:4;io:8")
    params = make(mesh, {"w": global_array(SHAPES["w"], 1, np.float64),
                         "b": global_array(SHAPES["b"], 2, np.float64)}, lay)
    before = {n: p.to_numpy() for n, p in params.items()}
    opt = mm.optim.Adam(0.1)
    state = opt.init(params)
    with mm.trace() as tr:
        loss = mm.reduce_sum(mm.square(mm.einsum([x, params["w"]]) + params["b"]))
        grads = dict(zip(params, mm.gradients([loss], list(params.values()))))
        new_params, new_state = opt.update(params, grads, state)
    produced = {id(t) for op in tr.ops for t in op.outputs}
    assert all(id(t) in produced for t in new_params.values())
    assert all(id(t) in produced for s in ("m", "v") for t in new_state[s].values())
    assert id(new_state["step"]) in produced
    for n, p in params.items():
        np.testing.assert_array_equal(p.to_numpy(), before[n])
    assert int(state["step"].to_numpy()) == 0
    # reference: the gradient of sum((x w + b)^2) in numpy
    xa = x.to_numpy()
    h = xa @ before["w"] + before["b"]
    gw, gb = 2 * xa.T @ h, 2 * h.sum(0)
    for n, g in (("w", gw), ("b", gb)):
        st: dict = {}
        np.testing.assert_allclose(new_params[n].to_numpy(), ref_adam(0.1)(before[n], g, st, 1), rtol=1e-10)
    # a None gradient: that parameter and its state are carried over unchanged
    p2, s2 = opt.update(new_params, {"w": None, "b": grads["b"]}, new_state)
    assert p2["w"] is new_params["w"] and s2["m"]["w"] is new_state["m"]["w"]
    assert p2["b"] is not new_params["b"] and int(s2["step"].to_numpy()) == 2


def test_errors():
    mesh = mm.Mesh(mesh_shapes()[0])
    params = {"w": mesh.zeros("io:8;hidden:16"), "b": mesh.zeros("hidden:16")}
    opt = mm.optim.Adam(0.1)
    state = opt.init(params)
    with pytest.raises(mm.MpimeshError, match=r"params without a gradient: \['b'\]; gradients without a param: \['c'\]"):
        opt.update(params, {"w": mesh.zeros("io:8;hidden:16"), "c": mesh.zeros("hidden:16")}, state)
    with pytest.raises(mm.ShapeError, match=r"param 'w' has shape .*hidden:8.*but the param has shape .*hidden:16"):
        opt.update(params, {"w": mesh.zeros("io:8;hidden:8"), "b": mesh.zeros("hidden:16")}, state)
    with pytest.raises(mm.ShapeError, match="param 'b'"):
        opt.update(params, {"w": mesh.zeros("io:8;hidden:16"), "b": mesh.zeros("vocab:16")}, state)
    with pytest.raises(mm.MpimeshError, match="no slot 'm' for param 'b'"):
        opt.update(params, dict(params), {"step": state["step"], "m": {"w": state["m"]["w"]}, "v": state["v"]})
    with pytest.raises(mm.MpimeshError, match="non-empty dict"):
        opt.init({})
    with pytest.raises(TypeError, match=r"params\['w'\]"):
        opt.init({"w": np.zeros(3)})
    with pytest.raises(mm.MpimeshError, match="beta1"):
        mm.optim.Adam(0.1, beta1=1.0)
    with pytest.raises(mm.MpimeshError, match="momentum"):
        mm.optim.SGD(0.1, momentum=-0.5)


# ---------------------------------------------------------------- input validation
NAN, INF = float("nan"), float("inf")
SGD, Adam, Adafactor, Scale = mm.optim.SGD, mm.optim.Adam, mm.optim.Adafactor, mm.optim.DynamicLossScale
BAD_HYPERPARAMETERS = [  # (constructor, error, message)
    (lambda: SGD(NAN), mm.MpimeshError, r"^SGD: lr must be a finite number >= 0, got nan$"),
    (lambda: SGD(INF), mm.MpimeshError, r"^SGD: lr must be a finite number >= 0, got inf$"),
    (lambda: SGD(-0.1), mm.MpimeshError, r"^SGD: lr must be a finite number >= 0, got -0.1$"),
    (lambda: SGD("0.1"), TypeError, r"^SGD: lr must be a real number or a schedule f\(t\), got '0.1' \(str\)$"),
    (lambda: SGD(None), TypeError, r"^SGD: lr must be .*, got None \(NoneType\)$"),
    (lambda: SGD(True), TypeError, r"^SGD: lr must be .*, got True \(bool\)$"),
    (lambda: SGD(0.1, momentum=NAN), mm.MpimeshError, r"^SGD: momentum must be a finite number in \[0, 1\), got nan"),
    (lambda: SGD(0.1, momentum="0.9"), TypeError, r"^SGD: momentum must be a real number, got '0.9' \(str\)$"),
    (lambda: Adam(NAN), mm.MpimeshError, r"^Adam: lr must be a finite number >= 0, got nan$"),
    (lambda: Adam(-INF), mm.MpimeshError, r"^Adam: lr must be a finite number >= 0, got -inf$"),
    (lambda: Adam(-0.1), mm.MpimeshError, r"^Adam: lr must be a finite number >= 0, got -0.1$"),
    (lambda: Adam("0.1"), TypeError, r"^Adam: lr must be a real number or a schedule f\(t\), got '0.1' \(str\)$"),
    (lambda: Adam(None), TypeError, r"^Adam: lr must be .*, got None \(NoneType\)$"),
    (lambda: Adam(0.1, beta1=NAN), mm.MpimeshError, r"^Adam: beta1 must be a finite number in \[0, 1\), got nan$"),
    (lambda: Adam(0.1, beta2=1.0), mm.MpimeshError, r"^Adam: beta2 must be .* in \[0, 1\), got 1.0$"),
    (lambda: Adam(0.1, epsilon=NAN), mm.MpimeshError, r"^Adam: epsilon must be a finite number >= 0, got nan$"),
    (lambda: Adam(0.1, epsilon="1e-8"), TypeError, r"^Adam: epsilon must be a real number, got '1e-8'"),
    (lambda: Adam(0.1, weight_decay=NAN), mm.MpimeshError, r"^Adam: weight_decay must be .* >= 0, got nan$"),
    (lambda: Adam(0.1, weight_decay=-0.01), mm.MpimeshError, r"^Adam: weight_decay .* got -0.01$"),
    (lambda: Adafactor(learning_rate=-1.0), mm.MpimeshError,
     r"^Adafactor: learning_rate must be a finite number >= 0, got -1.0$"),
    (lambda: Adafactor(learning_rate=NAN), mm.MpimeshError, r"^Adafactor: learning_rate .* got nan$"),
    (lambda: Adafactor(learning_rate="0.01"), TypeError,
     r"^Adafactor: learning_rate must be a real number or a schedule f\(t\) or None, got '0.01' \(str\)$"),
    (lambda: Adafactor(decay_rate=2.0), mm.MpimeshError,
     r"^Adafactor: decay_rate must be a finite number in \[0, 1\), got 2.0$"),
    (lambda: Adafactor(beta1=-0.5), mm.MpimeshError, r"^Adafactor: beta1 must be .* in \[0, 1\), got -0.5$"),
    (lambda: Adafactor(epsilon1=-1.0), mm.MpimeshError, r"^Adafactor: epsilon1 must be .* >= 0, got -1.0$"),
    (lambda: Adafactor(epsilon2=INF), mm.MpimeshError, r"^Adafactor: epsilon2 must be .* >= 0, got inf$"),
    (lambda: Adafactor(clipping_threshold=NAN), mm.MpimeshError,
     r"^Adafactor: clipping_threshold must be a finite number > 0, got nan$"),
    (lambda: Adafactor(clipping_threshold=0.0), mm.MpimeshError, r"^Adafactor: clipping_threshold .* got 0.0$"),
    (lambda: Adafactor(min_dim_size_to_factor=-1), mm.MpimeshError,
     r"^Adafactor: min_dim_size_to_factor must be an int >= 1, got -1$"),
    (lambda: Adafactor(min_dim_size_to_factor=2.5), TypeError,
     r"^Adafactor: min_dim_size_to_factor must be an int, got 2.5 \(float\)$"),
    (lambda: Adafactor(factored=1), TypeError, r"^Adafactor: factored must be True or False, got 1 \(int\)$"),
    (lambda: Adafactor(multiply_by_parameter_scale=None), TypeError,
     r"^Adafactor: multiply_by_parameter_scale must be True or False, got None"),
    (lambda: Scale(scale=NAN), mm.MpimeshError,
     r"^DynamicLossScale: scale must be a finite number > 0, got nan$"),
    (lambda: Scale(growth=0.5), mm.MpimeshError, r"^DynamicLossScale: growth must be .* >= 1, got 0.5$"),
    (lambda: Scale(backoff=1.0), mm.MpimeshError,
     r"^DynamicLossScale: backoff must be .* in \(0, 1\), got 1.0$"),
    (lambda: Scale(interval=2.5), TypeError, r"^DynamicLossScale: interval must be an int, got 2.5"),
    (lambda: Scale(interval="x"), TypeError, r"^DynamicLossScale: interval must be an int, got 'x'"),
    (lambda: Scale(interval=0), mm.MpimeshError, r"^DynamicLossScale: interval must be an int >= 1, got 0$"),
]


@pytest.mark.parametrize("make_bad, error, message", BAD_HYPERPARAMETERS)
def test_bad_hyperparameters(make_bad, error, message):
    """Every hyperparameter of every optimizer is checked at construction: the type (a bool is not
    a number), finite, in range; the error names the optimizer, the argument and the value."""
    with pytest.raises(error, match=message):
        make_bad()


def test_hyperparameter_edges():
    """The valid neighbours of the bad values: lr = 0 (the params stay), an int or numpy lr,
    decay_rate = 0, a schedule returning a Python float; each against the numpy reference."""
    for mesh, lay in configs(limit=2):
        for opt in (mm.optim.SGD(0, momentum=0.9), mm.optim.Adam(0.0, weight_decay=0.1),
                    mm.optim.Adafactor(learning_rate=0.0, min_dim_size_to_factor=1)):
            run(mesh, opt, lambda p, g, st, t: p, ["w", "b"], lay, steps=2)
        run(mesh, mm.optim.SGD(1, momentum=np.float32(0.5)), ref_sgd(1.0, float(np.float32(0.5))), ["w", "b"], lay,
            steps=2)
        run(mesh, mm.optim.Adam(np.float64(0.01), epsilon=0), ref_adam(0.01, eps=0.0), ["w", "b"], lay, steps=2)
        run(mesh, mm.optim.Adam(lambda t: 0.01, beta1=0), ref_adam(0.01, b1=0.0), ["w"], lay, steps=2)
        opt = mm.optim.Adafactor(learning_rate=lambda t: 0.05, decay_rate=0, epsilon1=0, min_dim_size_to_factor=8)
        run(mesh, opt, ref_adafactor(min_dim=8, lr=0.05, decay=0.0, eps1=0.0), ["w", "b"], lay, steps=2, rtol=1e-9)


@pytest.mark.parametrize("fused", [True, False])
def test_bad_schedule_values(fused):
    """A schedule's value is checked where it is used, fused or op by op: a number as at
    construction, or a 0-d float tensor on the params' mesh."""
    mesh = mm.Mesh(mesh_shapes()[0])
    other = mm.Mesh(mesh_shapes()[0])
    params = {"w": mesh.ones("a:8"), "b": mesh.ones("b:3;a:8")}
    grads = {"w": mesh.ones("a:8") * 0.5, "b": mesh.ones("b:3;a:8")}
    cases = [
        (mm.optim.Adam(lambda t: None), TypeError,
         r"^Adam: the value of the lr schedule must be a real number or a 0-d float DistTensor, "
         r"got None \(NoneType\)$"),
        (mm.optim.SGD(lambda t: "x"), TypeError, r"^SGD: the value of the lr schedule must be .*, got 'x' \(str\)$"),
        (mm.optim.Adam(lambda t: mesh.ones("z:3") * 0.1), mm.ShapeError,
         r"^Adam: the value of the lr schedule must be 0-d, got a tensor of shape \[z:3\]$"),
        (mm.optim.SGD(lambda t: mm.cast(t, "int32")), mm.DTypeError,
         r"^SGD: the value of the lr schedule must be a float, got a tensor of dtype int32$"),
        (mm.optim.Adam(lambda t: other.ones("") * 0.1), mm.MeshError,
         r"^Adam: the value of the lr schedule and the params live on two different Mesh objects of the same shape"),
        (mm.optim.SGD(lambda t: float("nan")), mm.MpimeshError,
         r"^SGD: the value of the lr schedule must be a finite number >= 0, got nan$"),
        (mm.optim.Adafactor(learning_rate=lambda t: -0.5), mm.MpimeshError,
         r"^Adafactor: the value of the learning_rate schedule must be a finite number >= 0, got -0.5$"),
        (mm.optim.Adafactor(decay_rate=lambda t: 1.0), mm.MpimeshError,
         r"^Adafactor: the value of the decay_rate schedule must be a finite number in \[0, 1\), got 1.0$"),
    ]
    for opt, error, message in cases:
        if not fused:
            opt._update_all = None  # op by op
        with pytest.raises(error, match=message):
            opt.update(params, grads, opt.init(params))
    # the valid neighbour: a schedule's 0-d float tensor, as the numpy reference
    opt = mm.optim.SGD(lambda t: t * 0.125, momentum=0.5)
    if not fused:
        opt._update_all = None
    state = opt.init(params)
    want = {n: (p.to_numpy().astype(np.float64), {}) for n, p in params.items()}
    for t in (1, 2):
        params, state = opt.update(params, grads, state)
        for n, (p, st) in want.items():
            want[n] = ref_sgd(0.125 * t, 0.5)(p, grads[n].to_numpy().astype(np.float64), st, t), st
            np.testing.assert_allclose(params[n].to_numpy(), want[n][0], rtol=1e-6)


def test_bad_state():
    """State of the wrong kind is refused by every optimizer before any op runs: the step must be
    a 0-d int tensor, each slot a DistTensor of the param's accumulation dtype, all on the params'
    Mesh object; a mismatch of Mesh objects names both tensors."""
    mesh = mm.Mesh(mesh_shapes()[0])
    other = mm.Mesh(mesh_shapes()[0])
    params = {"w": mesh.ones("a:8"), "b": mesh.ones("a:8")}
    grads = {"w": mesh.ones("a:8"), "b": mesh.ones("a:8")}
    opt = mm.optim.Adam(0.1)
    good = opt.init(params)
    same_shape = r"live on two different Mesh objects of the same shape \(Mesh\(.*\)\); an update's tensors must all"
    cases = [
        (dict(good, step=0), TypeError, r"^Adam state\['step'\] must be a DistTensor \(the 0-d int32 tensor init\(\) "
         r"makes; restore it as one\), got 0 \(int\)$"),
        (dict(good, step=mesh.zeros("a:8", dtype="int32")), mm.ShapeError,
         r"^Adam state\['step'\] has shape \[a:8\], expected a 0-d tensor"),
        (dict(good, step=mesh.zeros("", dtype="float32")), mm.DTypeError,
         r"^Adam state\['step'\] has dtype float32, expected an int"),
        (dict(good, step=other.zeros("", dtype="int32")), mm.MeshError,
         r"^Adam state\['step'\] and the params " + same_shape),
        (dict(good, m={"w": mesh.zeros("a:8", dtype="int32"), "b": good["m"]["b"]}), mm.DTypeError,
         r"^Adam state slot 'm' of param 'w' has dtype int32, expected float32 \(the param's is float32\)$"),
        (dict(good, v={"w": good["v"]["w"], "b": np.zeros(8)}), TypeError,
         r"^Adam state slot 'v' of param 'b' is a ndarray, not a DistTensor$"),
        (dict(good, v={"w": good["v"]["w"], "b": other.zeros("a:8")}), mm.MeshError,
         r"^Adam state slot 'v' of param 'b' and params\['b'\] " + same_shape),
    ]
    for state, error, message in cases:
        with pytest.raises(error, match=message):
            opt.update(params, grads, state)
    with pytest.raises(mm.MeshError, match=r"^params\['w'\] and params\['b'\] " + same_shape):
        mm.optim.SGD(0.1).init({"w": mesh.ones("a:8"), "b": other.ones("a:8")})
    with pytest.raises(mm.MeshError, match=r"^grads\['b'\] and params\['b'\] " + same_shape):
        opt.update(params, {"w": grads["w"], "b": other.ones("a:8")}, good)
    new, state = opt.update(params, grads, good)  # the state from init() is still fine
    np.testing.assert_allclose(new["w"].to_numpy(), ref_adam(0.1)(np.ones(8), np.ones(8), {}, 1), rtol=1e-6)


def test_non_float_params_and_grads():
    """Int and bool params (or grads) would be silently truncated: a DTypeError naming the param."""
    mesh = mm.Mesh(mesh_shapes()[0])
    ints = {"w": mesh.from_numpy(np.array([1, 2, 3, 4], np.int32), "a:4")}
    floats = {"w": mesh.from_numpy(np.array([1.0, 2.0, 3.0, 4.0]), "a:4")}
    for opt in (mm.optim.SGD(0.1), mm.optim.Adam(0.1), mm.optim.Adafactor()):
        with pytest.raises(mm.DTypeError, match=r"^params\['w'\] has dtype int32: an optimizer updates float params"):
            opt.init(ints)
        with pytest.raises(mm.DTypeError, match=r"^params\['w'\] has dtype bool"):
            opt.update({"w": mm.cast(ints["w"], "bool")}, floats, opt.init(floats))
        with pytest.raises(mm.DTypeError, match=r"^the gradient of param 'w' has dtype int32: gradients must be"):
            opt.update(floats, ints, opt.init(floats))
    # float32 params with float64 grads: fine, as the numpy reference
    opt = mm.optim.SGD(0.5)
    p32 = {"w": mm.cast(floats["w"], "float32")}
    new, _ = opt.update(p32, floats, opt.init(p32))
    assert new["w"].dtype == np.float32
    np.testing.assert_array_equal(new["w"].to_numpy(), np.float32(np.arange(1.0, 5.0) * 0.5))


def test_loss_scale_checks_its_inputs():
    """DynamicLossScale.step checks params, grads and state (through the optimizer) before its
    overflow check; finite() checks its grads."""
    mesh = mm.Mesh(mesh_shapes()[0])
    params = {"w": mesh.from_numpy(np.array([1.0, 2.0]), "a:2")}
    opt = mm.optim.SGD(0.5)
    state = opt.init(params)
    ls = mm.optim.DynamicLossScale(scale=2.0, interval=1)
    with pytest.raises(mm.MpimeshError, match=r"^grads must be a dict of DistTensors, got list$"):
        ls.step(opt, params, [params["w"]], state)
    with pytest.raises(TypeError, match=r"^grads\['w'\] is a ndarray, not a DistTensor$"):
        ls.step(opt, params, {"w": np.ones(2)}, state)
    with pytest.raises(TypeError, match=r"^Adam state\['step'\] must be a DistTensor"):
        ls.step(mm.optim.Adam(0.1), params, params, dict(mm.optim.Adam(0.1).init(params), step=0))
    with pytest.raises(TypeError, match=r"^DynamicLossScale.step: optimizer must be an mm.optim.Optimizer, got a str$"):
        ls.step("sgd", params, params, state)
    with pytest.raises(TypeError, match=r"^DynamicLossScale: grads must be a dict of DistTensors, got a list$"):
        ls.finite([params["w"]])
    with pytest.raises(TypeError, match=r"^DynamicLossScale: grads\['w'\] is a ndarray, not a DistTensor$"):
        ls.finite({"w": np.ones(2)})
    assert ls.scale == 2.0 and ls.good_steps == 0
    grads = {"w": mesh.from_numpy(np.array([2.0, 4.0]), "a:2")}  # 2x the true gradient
    new, _, applied = ls.step(opt, params, grads, state)
    assert applied and ls.scale == 4.0
    np.testing.assert_array_equal(new["w"].to_numpy(), np.array([1.0, 2.0]) - 0.5 * np.array([1.0, 2.0]))


@pytest.mark.parametrize("shape", ["a:0;b:3", "a:4;b:0", "a:0"])
@pytest.mark.parametrize("kw", [{}, {"beta1": 0.9}])
def test_adafactor_leaves_an_empty_parameter_alone(shape, kw):
    """A parameter with a dim of size 0 beside a normal one: Adafactor raised ZeroDivisionError (its
    RMS of nothing); the empty one stays empty and the other is updated as if alone (as SGD and Adam)."""
    import warnings
    mesh = mm.Mesh(mesh_shapes()[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no 0/0 either)
        params, grads = {"w": mesh.zeros(shape), "v": mesh.ones("c:3")}, {"w": mesh.ones(shape), "v": mesh.ones("c:3")}
        opt = mm.optim.Adafactor(**kw)
        new, _ = opt.update(params, grads, opt.init(params))
        alone, _ = opt.update({"v": params["v"]}, {"v": grads["v"]}, opt.init({"v": params["v"]}))
    assert new["w"].shape == params["w"].shape and new["w"].to_numpy().size == 0
    np.testing.assert_array_equal(new["v"].to_numpy(), alone["v"].to_numpy())
    assert not np.array_equal(new["v"].to_numpy(), np.ones(3))


def test_hyperparameters_past_the_float_range_are_refused_by_name():
    """An int past 1.8e308 raised a raw OverflowError from math.isfinite."""
    for make, words in [(lambda: mm.optim.Adam(10 ** 400), "Adam: lr must be a finite number"),
                        (lambda: mm.optim.SGD(0.1, momentum=10 ** 400), "SGD: momentum must be a finite number"),
                        (lambda: mm.optim.DynamicLossScale(scale=10 ** 400), "scale must be a finite number")]:
        with pytest.raises(mm.MpimeshError, match=words):
            make()
