"""mm.trace(): which ops it records (kind, inputs, outputs, params, in order), its inputs, nesting,
and tr.gradients / mm.gradients against numpy on the global arrays."""
from __future__ import annotations

import os
import sys

import time

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
import jaxenv  # noqa: E402,F401  (XLA flags for 8 host devices, before jax is imported)
from meshes import big, get_mesh, global_array, mesh_shapes, transfers  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.trace import Released, current_trace  # noqa: E402

pytestmark = pytest.mark.mpi
SHAPES = mesh_shapes()


def same(a, b) -> bool:
    """Identity of two sequences of tensors (DistTensor's == is elementwise, so never use `in`)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def ident(ts) -> list[int]:
    return [id(t) for t in ts]


@pytest.mark.parametrize("shape", SHAPES)
def test_records_ops_in_order(shape):
    mesh = get_mesh(shape)  # no rules: everything replicated, so no relayouts are inserted
    xa, wa = global_array("a:8;k:4", 1, np.float64), global_array("k:4;b:8", 2, np.float64)
    x, w = mesh.from_numpy(xa, "a:8;k:4"), mesh.from_numpy(wa, "k:4;b:8")
    with mm.trace() as tr:
        h = mm.einsum([x, w])
        e = mm.exp(h)
        s = e * 2.0
        r = mm.reduce_max(s, reduced_dims="b")
        t = mm.transpose(e, "b:8;a:8")
    assert [op.name for op in tr.ops] == ["einsum", "exp", "multiply", "reduce_max", "transpose"]
    assert len(tr) == 5
    ein, ex, mul, rmax, tp = tr.ops
    assert same(ein.inputs, [x, w]) and same(ein.outputs, [h])
    assert same(ex.inputs, [h]) and same(ex.outputs, [e])
    assert same(mul.inputs, [e]) and same(mul.outputs, [s])
    assert mul.params == {"scalar": 2.0, "side": "right"}
    assert same(rmax.inputs, [s]) and same(rmax.outputs, [r]) and rmax.params["axes"] == (1,)
    assert same(tp.inputs, [e]) and same(tp.outputs, [t]) and tp.params["perm"] == (1, 0)
    assert "->" in ein.params["subscripts"] and ein.params["reduce_mesh_dims"] == ()
    assert all(callable(op.op.kernel) for op in tr.ops)
    assert all(callable(op.grad) for op in tr.ops)
    assert "einsum" in repr(tr) and "exp" in repr(ex)
    np.testing.assert_allclose(r.to_numpy(), (2 * np.exp(xa @ wa)).max(axis=1), rtol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_comparison_records_no_gradient_rule(shape):
    mesh = get_mesh(shape)
    x = mesh.from_numpy(global_array("a:8", 3, np.float64), "a:8")
    with mm.trace() as tr:
        c = x > 0.0
        f = mm.cast(c, "float64")
    assert [op.name for op in tr.ops] == ["greater", "cast"]
    assert tr.ops[0].grad is None and tr.ops[1].grad is None
    assert c.dtype == np.bool_ and f.dtype == np.float64


@pytest.mark.parametrize("shape", SHAPES)
def test_relayouts_are_recorded(shape):
    mesh = get_mesh(shape)
    m = big(mesh)
    if not m:
        pytest.skip("no mesh dim of size > 1")
    x = mesh.from_numpy(global_array("a:8;b:8", 4, np.float64), "a:8;b:8", layout={"a": m[0]})
    with mm.layout_scope(mesh, {"b": m[0]}), mm.trace() as tr:
        y = mm.tanh(x)
        z = mm.relayout(y, {"a": m[-1]})
    assert [op.name for op in tr.ops] == ["relayout", "tanh", "relayout"]
    r1, th, r2 = tr.ops
    assert same(r1.inputs, [x]) and same(th.outputs, [y]) and same(r2.outputs, [z])
    assert th.inputs[0] is r1.outputs[0] and r2.inputs[0] is y
    assert r1.params["layout"] == y.tensor_layout and r2.params["layout"] == z.tensor_layout
    assert tr.inputs[0] is x and len(tr.inputs) == 1
    np.testing.assert_allclose(z.to_numpy(), np.tanh(global_array("a:8;b:8", 4, np.float64)), rtol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_inputs_are_outside_tensors_in_first_use_order(shape):
    mesh = get_mesh(shape)
    x, w, v = mesh.ones("a:8;k:4", "float64"), mesh.ones("k:4;b:8", "float64"), mesh.ones("b:8", "float64")
    unused = mesh.ones("a:8", "float64")
    pre = mm.exp(x)  # produced before the trace: an input too
    with mm.trace() as tr:
        h = mm.einsum([w, x])
        h2 = h + v
        h3 = h2 * h
        h4 = h3 * pre
        mm.reduce_sum(h4 + w)  # w again: listed once
    assert ident(tr.inputs) == ident([w, x, v, pre])
    assert all(id(t) not in ident(tr.inputs) for t in (h, h2, h3, h4, unused))


@pytest.mark.parametrize("shape", SHAPES)
def test_ops_outside_the_trace_are_not_recorded(shape):
    mesh = get_mesh(shape)
    x = mesh.ones("a:8", "float64")
    before = mm.exp(x)
    assert current_trace() is None
    with mm.trace() as tr:
        assert current_trace() is tr
        inside = mm.sin(before)
    after = mm.cos(inside)
    assert current_trace() is None
    assert [op.name for op in tr.ops] == ["sin"]
    assert ident(tr.inputs) == ident([before])
    assert all(id(after) not in ident(op.outputs) for op in tr.ops)


def test_trace_closed_after_exception():
    mesh = get_mesh(SHAPES[0])
    x = mesh.ones("a:8", "float64")
    with pytest.raises(RuntimeError):
        with mm.trace():
            mm.exp(x)
            raise RuntimeError("boom")
    assert current_trace() is None


@pytest.mark.parametrize("shape", SHAPES)
def test_nested_traces(shape):
    mesh = get_mesh(shape)
    x = mesh.from_numpy(np.linspace(0.5, 2.0, 8), "a:8")
    with mm.trace() as outer:
        y = mm.log(x)
        with mm.trace() as inner:
            assert current_trace() is inner
            z = mm.sqrt(y * y + 1.0)
        assert current_trace() is outer
        u = mm.exp(z)
    assert current_trace() is None
    assert [op.name for op in outer.ops] == ["log", "multiply", "add", "sqrt", "exp"]
    assert [op.name for op in inner.ops] == ["multiply", "add", "sqrt"]
    # The inner trace shares the very records of the outer one.
    assert all(a is b for a, b in zip(inner.ops, outer.ops[1:4]))
    assert ident(outer.inputs) == ident([x])
    assert ident(inner.inputs) == ident([y])  # produced outside the inner trace
    assert same(outer.ops[-1].outputs, [u])


@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_in_nested_trace_recorded_in_both(shape):
    mesh = get_mesh(shape)
    xa = np.linspace(0.5, 2.0, 8)
    x = mesh.from_numpy(xa, "a:8")
    with mm.trace() as outer:
        y = mm.exp(x)
        with mm.trace() as inner:
            z = y * y
            n_outer, n_inner = len(outer), len(inner)
            (g,) = mm.gradients([z], [y])  # uses the innermost trace
        assert len(inner) > n_inner and len(outer) - n_outer == len(inner) - n_inner
    np.testing.assert_allclose(g.to_numpy(), 2 * np.exp(xa), rtol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_tr_gradients_matches_mm_gradients(shape):
    mesh = get_mesh(shape)
    xa, wa = global_array("a:8;k:4", 5, np.float64), global_array("k:4;b:8", 6, np.float64)
    x, w = mesh.from_numpy(xa, "a:8;k:4"), mesh.from_numpy(wa, "k:4;b:8")
    with mm.trace() as tr:
        y = mm.tanh(mm.einsum([x, w]))
        gx1, gw1 = mm.gradients([y], [x, w])
        gx2, gw2 = tr.gradients([y], [x, w])
    dh = 1 - np.tanh(xa @ wa) ** 2
    for g1, g2, want in ((gx1, gx2, dh @ wa.T), (gw1, gw2, xa.T @ dh)):
        np.testing.assert_allclose(g1.to_numpy(), want, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(g2.to_numpy(), want, rtol=1e-10, atol=1e-12)
    # After the block, tr.gradients still differentiates its recorded ops.
    (gx3,) = tr.gradients([y], [x])
    np.testing.assert_allclose(gx3.to_numpy(), dh @ wa.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_of_several_nonscalar_ys(shape):
    mesh = get_mesh(shape)
    xa = np.linspace(-1.0, 1.5, 16).reshape(2, 8)
    x = mesh.from_numpy(xa, "a:2;b:8")
    with mm.trace():
        y1 = mm.sin(x)        # [a, b]: sum of all its elements
        y2 = mm.reduce_sum(x * x, reduced_dims="a")  # [b]
        (g,) = mm.gradients([y1, y2], [x])
    np.testing.assert_allclose(g.to_numpy(), np.cos(xa) + 2 * xa, rtol=1e-12)


def test_gradients_outside_trace_raises():
    mesh = get_mesh(SHAPES[0])
    x = mesh.ones("a:8", "float64")
    y = mm.exp(x)
    with pytest.raises(mm.MpimeshError, match=r"trace"):
        mm.gradients([y], [x])
    with pytest.raises(ValueError):  # MpimeshError is a ValueError
        mm.gradients([y], [x])


@pytest.fixture(name="debug")
def debug_fixture():
    from mpimesh.trace import debugging, set_debug
    was = debugging()
    set_debug(True)
    try:
        yield
    finally:
        set_debug(was)


def _op(x, out_layout, kernel, n_out=1):
    """A hand-made op through dispatch: `kernel` maps x's local array to the outputs."""
    from mpimesh.opdef import OpDef
    from mpimesh.trace import dispatch
    return dispatch(OpDef("handmade", lambda ctx, a: kernel(a)), [x], [(x.shape, out_layout)] * n_out)


@pytest.mark.parametrize("shape", SHAPES)
def test_debug_catches_a_kernel_whose_local_shape_disagrees_with_its_layout(shape, debug):
    probe = get_mesh(shape)
    m = max(probe.shape.names, key=lambda n: probe.shape[n].size)  # the mesh dim that splits most
    mesh = get_mesh(shape, f"a:{m}")
    x = mesh.from_numpy(np.arange(32.0).reshape(8, 4), "a:8;k:4")
    k = mesh.shape[m].size
    # Declares x's own layout but keeps one row too many: only debug mode can see it.
    rows = len(np.array_split(range(8), k)[mesh.coords[m]]) + 1  # this rank's block (uneven on 3 ranks), plus one
    with pytest.raises(mm.LayoutError, match=r"'handmade' output 0 .* local shape is \(%d, 4\)" % rows):
        _op(x, x.tensor_layout, lambda a: np.concatenate([a, a[:1]]))
    # Declares the dim replicated but returns the local slice: wrong whenever a is really split.
    if k > 1:
        with pytest.raises(mm.LayoutError, match=r"its layout gives \(8, 4\)"):
            _op(x, (None, None), lambda a: a)
    (y,) = _op(x, x.tensor_layout, lambda a: a * 2)  # a correct op passes and computes
    np.testing.assert_array_equal(y.to_numpy(), 2 * np.arange(32.0).reshape(8, 4))


@pytest.mark.parametrize("shape", SHAPES)
def test_dispatch_checks_specs_even_without_debug(shape):
    mesh = get_mesh(shape)
    x = mesh.from_numpy(np.ones((8, 4)), "a:8;k:4")
    m = mesh.shape.names[0]
    with pytest.raises(mm.LayoutError, match="1 entries for the 2 dims"):
        _op(x, (None,), lambda a: a)
    with pytest.raises(mm.LayoutError, match="mesh dim 'nope'"):
        _op(x, ("nope", None), lambda a: a)
    with pytest.raises(mm.LayoutError, match="uses a mesh dim twice"):
        _op(x, (m, m), lambda a: a)
    with pytest.raises(mm.MpimeshError, match="declares 2 outputs, but its kernel returned 1"):
        _op(x, (None, None), lambda a: a, n_out=2)


# --------------------------------------------------------------------------- creation ops

def _created(mesh):
    """Tensors made by each creation op inside a trace, on uneven blocks where the mesh allows
    (7 and 5 over 2 or 3 ranks), and an op on them."""
    m0, m1 = mesh.shape.names[0], mesh.shape.names[-1]
    both = f"a:{m0};b:{m1}" if m1 != m0 else f"a:{m0}"
    with mm.trace() as tr:
        out = {"zeros": mesh.zeros("a:7;b:5", layout=f"a:{m0}"),
               "ones": mesh.ones("a:7;b:5", "int32", layout=f"b:{m1}"),
               "full": mesh.full("a:7;b:5", 2.5, "float64", layout=both),
               "normal": mesh.random_normal("a:7;b:5", seed=5, mean=1.0, stddev=2.0, layout=both),
               "uniform": mesh.random_uniform("a:7;b:5", seed=6, minval=-1.0, maxval=2.0, layout=f"b:{m0}")}
        out["combined"] = out["normal"] * out["uniform"] + out["full"] - out["zeros"]
    return tr, out


@pytest.mark.parametrize("shape", SHAPES)
def test_creation_ops_are_recorded(shape):
    mesh = get_mesh(shape)
    tr, out = _created(mesh)
    created = tr.ops[:5]
    assert [op.name for op in created] == ["full", "full", "full", "random_normal", "random_uniform"]
    assert all(op.inputs == () and len(op.outputs) == 1 for op in created)
    assert all(op.outputs[0] is out[k] for op, k in zip(created, ("zeros", "ones", "full", "normal", "uniform")))
    assert all(op.params["shape"] == mm.Shape("a:7;b:5") for op in created)
    assert [(op.params["value"], str(op.params["dtype"])) for op in created[:3]] == \
        [(0.0, "float32"), (1, "int32"), (2.5, "float64")]
    assert {k: created[3].params[k] for k in ("seed", "mean", "stddev")} == {"seed": 5, "mean": 1.0, "stddev": 2.0}
    assert {k: created[4].params[k] for k in ("seed", "minval", "maxval")} == {"seed": 6, "minval": -1.0, "maxval": 2.0}
    assert tr.inputs == []  # made inside the trace: produced, not read
    # values: numpy's, and for the random ops a one-process mesh's (layout-independent values)
    solo = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    np.testing.assert_array_equal(out["zeros"].to_numpy(), np.zeros((7, 5), np.float32))
    np.testing.assert_array_equal(out["ones"].to_numpy(), np.ones((7, 5), np.int32))
    np.testing.assert_array_equal(out["full"].to_numpy(), np.full((7, 5), 2.5))
    normal = solo.random_normal("a:7;b:5", seed=5, mean=1.0, stddev=2.0).to_numpy()
    uniform = solo.random_uniform("a:7;b:5", seed=6, minval=-1.0, maxval=2.0).to_numpy()
    np.testing.assert_array_equal(out["normal"].to_numpy(), normal)
    np.testing.assert_array_equal(out["uniform"].to_numpy(), uniform)
    assert out["ones"].dtype == np.int32 and out["combined"].dtype == np.float64
    np.testing.assert_allclose(out["combined"].to_numpy(), normal.astype(np.float64) * uniform + 2.5, rtol=1e-6)


def test_dispatch_without_inputs_needs_a_mesh():
    from mpimesh.opdef import OpDef
    from mpimesh.trace import dispatch
    with pytest.raises(mm.MpimeshError, match="'made' has no inputs: dispatch needs its mesh"):
        dispatch(OpDef("made", lambda ctx: ctx.xp.zeros(2)), [], [(mm.Shape("a:2"), (None,))])


def _sleeping_barrier() -> None:
    req = MPI.COMM_WORLD.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


@pytest.mark.parametrize("shape", SHAPES)
def test_replay_of_created_tensors_matches_mpi(shape):
    """A trace that makes its tensors (no inputs at all) replays through JAX to the MPI values:
    rank 0 replays (shard_map and gspmd) while the others wait; every rank sees the verdict."""
    jax = pytest.importorskip("jax", reason="jax is not installed (python3 install.py tpu)")
    world = MPI.COMM_WORLD
    if len(jax.devices()) < world.Get_size():
        pytest.skip(f"JAX has {len(jax.devices())} devices, fewer than the {world.Get_size()} ranks")
    mesh = get_mesh(shape)
    tr, out = _created(mesh)
    want = {k: t.to_numpy() for k, t in out.items()}
    error = None
    if world.Get_rank() == 0:  # no collectives in here
        try:
            for mode in ("shard_map", "gspmd"):
                fn = mm.tpu.replay(tr, [], list(out.values()), mode=mode, devices=jax.devices()[:world.Get_size()])
                for (k, w), g in zip(want.items(), fn()):
                    g = np.asarray(g)
                    assert g.dtype == w.dtype and g.shape == w.shape, f"{k} [{mode}]: {g.dtype}{g.shape}"
                    np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6, err_msg=f"{k} [{mode}]")
        except Exception as e:  # noqa: BLE001 (reported on every rank below)
            error = f"{type(e).__name__}: {e}"
    _sleeping_barrier()
    error = world.bcast(error, root=0)
    assert error is None, error


# --------------------------------------------------------------------------- dry runs

def _program(x, w, v):
    """A forward and backward pass whose layouts need allreduces, an alltoall and allgathers."""
    h = mm.tanh(mm.einsum([x, w]))  # k split when its rule says so: an allreduce
    m0 = x.mesh.shape.names[0]
    hs = mm.relayout(h, {"b": m0})  # a mesh dim moving between tensor dims: an alltoall
    p = mm.softmax(hs * v, "b")
    loss = mm.reduce_sum(mm.square(p))
    return [h, hs, p, loss], mm.gradients([loss], [w, v], bucket_bytes=0)


def _local_shape(t) -> tuple:
    """This rank's block shape of a tensor of a trace (kept by a `Released` stand-in too)."""
    return t.local_shape if isinstance(t, Released) else tuple(t.local.shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_dry_run_counts_what_mpi_counts(shape):
    """The same program on a real mesh (rank 0, coordinate 0 everywhere) and dry on a DryMesh of
    that shape and rules: the same ops, local shapes, dtypes, and counted collectives (kind, mesh
    dims, calls, elements, bytes) and flops; uneven blocks (7, 5 over 2 or 3) included."""
    pytest.importorskip("jax", reason="jax is not installed (python3 install.py tpu)")
    from mpimesh import counters
    from mpimesh.dryrun import DryMesh, placeholder
    probe = get_mesh(shape)
    m0, m1 = probe.shape.names[0], probe.shape.names[-1]
    rules = f"a:{m0};k:{m1}" if m1 != m0 else f"a:{m0}"
    mesh, dry = get_mesh(shape, rules), DryMesh(shape, rules)
    specs = [("a:7;k:5", 1), ("k:5;b:6", 2), ("b:6", 3)]
    real = [mesh.from_numpy(global_array(s, seed), s) for s, seed in specs]
    ghosts = [placeholder(dry, s) for s, _ in specs]
    with counters.counting() as want, mm.trace() as tr_real:
        outs_real, grads_real = _program(*real)
    with counters.counting() as got, mm.trace() as tr_dry:
        outs_dry, grads_dry = _program(*ghosts)
    assert [op.name for op in tr_dry.ops] == [op.name for op in tr_real.ops]
    assert [op.params.keys() for op in tr_dry.ops] == [op.params.keys() for op in tr_real.ops]
    if mesh.size > 1:  # not vacuous: the layouts imply collectives
        assert any(k.startswith("allreduce") for k in got) and (mesh.shape[m0].size == 1 or "alltoall/" + m0 in got)
    verdict = None
    if mesh.rank == 0:  # coordinate 0 on every mesh dim: the dry run's processor
        pairs = [(a, b) for ra, rb in zip(tr_real.ops, tr_dry.ops) for a, b in zip(ra.outputs, rb.outputs)]
        bad = [f"{a.shape}: {_local_shape(a)} {a.dtype} vs {_local_shape(b)} {b.dtype}" for a, b in pairs
               if _local_shape(a) != _local_shape(b) or a.dtype != b.dtype or a.layout != b.layout]
        if bad or got != transfers(want):  # (a GPU's staged transport also counts its host copies)
            verdict = f"local shapes {bad}; counters dry {got} vs MPI {want}"
    verdict = MPI.COMM_WORLD.bcast(verdict, root=0)
    assert verdict is None, verdict
    with pytest.raises(mm.MpimeshError, match="dry run's tensors have shapes and layouts, no values"):
        outs_dry[-1].to_numpy()
    assert repr(outs_dry[-1]).endswith("(a dry run: no values)")


def test_dry_run_needs_a_dry_mesh_and_working_abstract_rules():
    from mpimesh.dryrun import DryMesh, placeholder
    from mpimesh.opdef import OpDef
    from mpimesh.trace import dispatch
    dry = DryMesh("x:4", "a:x")
    assert placeholder(dry, "a:10;b:3").local.shape == (3, 3)  # coordinate 0's block, the largest
    with pytest.raises(mm.MpimeshError, match="not a DryMesh"):
        placeholder(mm.Mesh("all:1", comm=MPI.COMM_SELF), "a:2")
    x = placeholder(dry, "a:8")
    bad = OpDef("eager", lambda ctx, a: np.asarray(a) + 1, abstract=lambda ctx, shapes, a: (a.nope,))
    with pytest.raises(mm.MpimeshError, match="dry run of op 'eager': its abstract rule failed"):
        dispatch(bad, [x], [(x.shape, x.tensor_layout)])
