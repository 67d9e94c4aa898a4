"""`mm.compile(fn, donate_argnums=...)`: a step given its parameters and optimizer state updates
them in place on a replay (their blocks hold the new values: no new arrays), with eager's values
bitwise over several steps, for SGD written with `mm.axpy`, fused SGD with momentum, fused
AdamW and Adafactor (its parameters; its slots are new arrays), on 1-D/2-D/3-D meshes with uneven blocks; a donated tensor raises wherever it is used
afterwards; a block something else still sees (another argument, a result, a view, the caller's
own array) is never written; bad `donate_argnums` are refused with a clear error."""
from __future__ import annotations

import os
import sys
import weakref

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import big, get_mesh, global_array, mesh_shapes, spec  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.backend import to_host  # noqa: E402

pytestmark = pytest.mark.mpi
STEPS = 5
SHAPES = [("w1", "io:6;hidden:10"), ("b1", "hidden:10"), ("w2", "hidden:10;io:6")]


def _loss_and_grads(params, x, y):
    h = mm.relu(mm.einsum([x, params["w1"]], output_shape="batch:12;hidden:10") + params["b1"])
    out = mm.einsum([h, params["w2"]], output_shape="batch:12;io:6")
    loss = mm.reduce_mean(mm.square(out - y))
    names = sorted(params)
    return loss, dict(zip(names, mm.gradients([loss], [params[n] for n in names])))


def _step(opt):
    """An MLP training step: `(params, state, loss)`; opt None: plain SGD with `mm.axpy`."""
    def step(params, state, x, y):
        with mm.trace():
            loss, grads = _loss_and_grads(params, x, y)
            if opt is None:
                return {k: mm.axpy(-0.05, grads[k], p) for k, p in params.items()}, state, loss
            params, state = opt.update(params, grads, state)
        return params, state, loss
    return step


def _blocks(tree) -> list:
    """Weak references to the blocks of the tensors in `tree` (none kept alive by this)."""
    if isinstance(tree, (dict, list)):
        return [r for v in (tree if isinstance(tree, list) else [tree[k] for k in sorted(tree)]) for r in _blocks(v)]
    return [weakref.ref(tree.local)] if tree.shape.rank else []


def _in_place(step) -> bool:
    """Whether `step`'s engine writes every donated block in place: the flat engine does; under CUDA
    graphs (on a GPU) the captured steps read copies of the arguments in static buffers (the donated
    blocks are freed), so only a step run on the host writes one."""
    from mpimesh.graphs import GraphEngine
    return not any(isinstance(e.engine, GraphEngine) for e in step.cache.values())


def _locals(tree) -> list:
    if isinstance(tree, (dict, list)):
        return [a for v in (tree if isinstance(tree, list) else [tree[k] for k in sorted(tree)]) for a in _locals(v)]
    return [tree.local] if tree.shape.rank else []


@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("optimizer", ["axpy", "sgd", "adamw", "adafactor"])
def test_a_donated_step_updates_in_place_with_eagers_values(shape, dtype, optimizer):
    mesh = get_mesh(shape)
    rules = ";".join(f"{d}:{m}" for d, m in zip(("batch", "hidden", "io"), big(mesh)))  # uneven on 4 and 8
    opt = {"axpy": None, "sgd": mm.optim.SGD(0.05, momentum=0.9), "adamw": mm.optim.Adam(1e-2, weight_decay=0.1),
           "adafactor": mm.optim.Adafactor(beta1=0.9)}[optimizer]
    with mm.layout_scope(mesh, rules):
        def fresh():
            params = {n: mm.cast(mesh.from_numpy(global_array(s, i, np.float64), s), dtype)
                      for i, (n, s) in enumerate(SHAPES)}
            return params, ({} if opt is None else opt.init(params))
        eager, donated = fresh(), fresh()
        plain, step = _step(opt), mm.compile(_step(opt), donate_argnums=(0, 1))
        for k in range(STEPS):
            x = mm.cast(mesh.from_numpy(global_array("batch:12;io:6", 10 + k, np.float64), "batch:12;io:6"), dtype)
            y = mm.cast(mesh.from_numpy(global_array("batch:12;io:6", 50 + k, np.float64), "batch:12;io:6"), dtype)
            *eager, eager_loss = plain(*eager, x, y)
            given = donated
            before = _blocks(list(given) if optimizer != "adafactor" else given[0])  # (its slots: new arrays)
            *donated, loss = step(*donated, x, y)
            assert loss.local.tobytes() == eager_loss.local.tobytes(), f"loss at step {k}"
            assert [(a.dtype, a.tobytes()) for a in _locals(eager)] == \
                [(a.dtype, a.tobytes()) for a in _locals(donated)], f"params and state at step {k}"
            in_place = [r() is a for r, a in zip(before, _locals(list(donated) if optimizer != "adafactor"
                                                             else donated[0]))]
            # (step 0 records eagerly; under CUDA graphs only the steps run on the host write in place)
            if _in_place(step) or not k:
                assert all(in_place) if k else not any(in_place), (k, in_place)
            with pytest.raises(mm.MpimeshError, match="donated to the compiled step step"):
                given[0]["w1"] + 1.0
            del given  # (this test holds no block of the next step's arguments)
    assert (step.recordings, step.replays) == (1, STEPS - 1)


def test_a_donated_tensor_raises_wherever_it_is_used():
    mesh = get_mesh(mesh_shapes()[1])
    step = mm.compile(lambda p, g: mm.axpy(-1.0, g, p), donate_argnums=0)
    g = mesh.ones("a:4;b:6")
    for k in range(2):  # the recording, then a replay
        p = mesh.full("a:4;b:6", 5.0, "float64") if k == 0 else new
        new = step(p, mm.cast(g, "float64"))
        np.testing.assert_array_equal(new.to_numpy(), np.full((4, 6), 4.0 - k))
        for use in (lambda: p + 1.0, lambda: p.to_numpy(), lambda: mm.reduce_sum(p), lambda: p.dtype,
                    lambda: step(p, g), lambda: to_host(p.local) + 1, lambda: to_host(p.local), lambda: p.local[0],
                    lambda: p.local == 0):
            with pytest.raises(mm.MpimeshError, match=r"this \[a:4, b:6\] float64 tensor was donated .*"
                                                      r"donate_argnums=\(0,\).*use the tensors that step returned"):
                use()
        assert "donated to the compiled step" in repr(p)


def test_what_something_else_still_sees_is_not_written():
    mesh = get_mesh(mesh_shapes()[0])
    g = mesh.from_numpy(np.arange(12.0).reshape(3, 4), "a:3;b:4")

    def both(p, q, g):  # p's update, and what p was (a view of p's block where reshape makes one)
        return mm.axpy(-1.0, g, p), mm.reshape(p, "ab:12"), q * 1.0
    step = mm.compile(both, donate_argnums=0)
    for k in range(3):
        p = mesh.full("a:3;b:4", 7.0, "float64")
        kept = p * 1.0
        # the same tensor donated and passed in a position that is not: neither written nor given up
        new, old, also = step(p, p, g)
        np.testing.assert_array_equal(new.to_numpy(), 7.0 - np.arange(12.0).reshape(3, 4))
        np.testing.assert_array_equal(old.to_numpy(), np.full(12, 7.0))
        np.testing.assert_array_equal(also.to_numpy(), kept.to_numpy())
        np.testing.assert_array_equal(p.to_numpy(), kept.to_numpy())

    passed = mm.compile(lambda p, g: (p, mm.axpy(-1.0, g, p)), donate_argnums=0)  # p returned as it is
    for _ in range(2):
        p = mesh.full("a:3;b:4", 7.0, "float64")
        same, new = passed(p, g)
        assert same is p
        np.testing.assert_array_equal(p.to_numpy(), np.full((3, 4), 7.0))
        np.testing.assert_array_equal(new.to_numpy(), 7.0 - np.arange(12.0).reshape(3, 4))


def test_a_block_the_caller_holds_is_not_written_but_one_given_up_is():
    mesh = get_mesh("all:%d" % mm.MPI.COMM_WORLD.Get_size())
    step = mm.compile(lambda p, g: mm.axpy(-1.0, g, p), donate_argnums=0)
    g = mesh.ones("a:5", "float64")
    step(mesh.zeros("a:5", "float64"), g)  # recorded
    mine = np.zeros(5)
    new = step(mm.from_local(mine, "a:5", mesh), g)
    np.testing.assert_array_equal(mine, np.zeros(5))
    assert new.local is not mine and new.local.tolist() == [-1.0] * 5
    block = weakref.ref(new.local)
    newer = step(new, g)
    assert newer.local is block() if _in_place(step) else block() is None
    assert newer.local.tolist() == [-2.0] * 5


def test_inside_a_trace_donation_is_ignored():
    mesh = get_mesh(mesh_shapes()[0])
    step = mm.compile(lambda p: mm.square(p), donate_argnums=0)
    p = mesh.full("a:4", 3.0, "float64")
    with mm.trace():
        y = step(p)
        (g,) = mm.gradients([y], [p])
    np.testing.assert_array_equal(g.to_numpy(), np.full(4, 6.0))
    np.testing.assert_array_equal(p.to_numpy(), np.full(4, 3.0))


@pytest.mark.parametrize("bad", [-1, True, "0", 1.5, (0, None), {0: 1}])
def test_bad_donate_argnums_are_refused(bad):
    with pytest.raises(mm.MpimeshError, match=r"donate_argnums must be a position \(an int >= 0\) or a tuple of "
                                              r"them, got " + __import__("re").escape(repr(bad))):
        mm.compile(lambda p: p, donate_argnums=bad)


def test_donating_an_argument_the_step_was_not_given_is_refused_on_every_rank():
    mesh = get_mesh(mesh_shapes()[0])
    step = mm.compile(lambda p, q=None: p * 2.0, donate_argnums=(0, 1))
    with pytest.raises(mm.MpimeshError, match=r"donate_argnums=\(0, 1\) names positional argument 1, but the "
                                              r"step was called with 1"):
        step(mesh.ones("a:3"))


def test_a_closure_tensor_returned_and_fed_back_as_donated_is_kept():
    """The step returns a tensor of its closure as it is (a reset value), and the caller feeds the
    results back, donated: that tensor stays usable, and so do later replays' results (the replay
    gave it up, and every later call returned a given-up tensor). Values against numpy."""
    mesh = get_mesh("all:%d" % mm.MPI.COMM_WORLD.Get_size())
    reset = mesh.from_numpy(np.zeros(4), "a:4", layout={"a": "all"})
    x = mesh.from_numpy(np.ones(4), "a:4", layout={"a": "all"})
    step = mm.compile(lambda s, x: {"total": s["total"] + x, "aux": reset}, donate_argnums=0)
    state = {"total": mesh.from_numpy(np.ones(4), "a:4"), "aux": reset}  # (total: laid out as the sum is)
    for k in range(4):
        state = step(state, x)
        np.testing.assert_array_equal(state["total"].to_numpy(), np.full(4, 2.0 + k))
        np.testing.assert_array_equal(state["aux"].to_numpy(), np.zeros(4))
    np.testing.assert_array_equal(reset.to_numpy(), np.zeros(4))
    assert step.replays == 3


@pytest.mark.parametrize("shape", mesh_shapes())
def test_elementwise_ops_write_over_what_the_replay_alone_holds(shape):
    """A chain of elementwise ops on a donated tensor: a replay writes each result over the block
    it alone holds (the donated one, then each temporary: the result is the donated block), with
    numpy's values bitwise, uneven blocks; an op whose result has another dtype or more dims than
    that operand, and a block the caller holds, are not written over."""
    mesh = get_mesh(shape)
    dims = big(mesh)
    layout = dict(zip(["a", "b"], dims))
    P, Q = global_array("a:5;b:7", seed=3), np.abs(global_array("a:5;b:7", seed=4)) + 0.5
    B = global_array("b:7", seed=5).astype(np.float64)

    def chain(p, q, bias):
        h = mm.maximum((p * 2.0 + q) - 1.5, q) / q * (q > 1.2)
        wide, first = mm.cast(h, "float64") + bias, bias + h  # (float64; bias's dims first)
        return 3.0 - h, wide, first  # (the last reader of h)
    step = mm.compile(chain, donate_argnums=0)
    h = np.maximum((P * np.float32(2.0) + Q) - np.float32(1.5), Q) / Q * (Q > 1.2)
    want = 3.0 - h
    q = mesh.from_numpy(Q, "a:5;b:7", layout=layout)
    bias = mesh.from_numpy(B, "b:7", layout={k: v for k, v in layout.items() if k == "b"})
    for k in range(3):  # the recording, then replays
        p = mesh.from_numpy(P, "a:5;b:7", layout=layout)
        block = weakref.ref(p.local)
        with mm.layout_scope(mesh, spec(layout)):  # (the ops' layout: p's block is theirs)
            out, wide, first = step(p, q, bias)
        np.testing.assert_array_equal(out.to_numpy(), want.astype(np.float32))
        np.testing.assert_array_equal(wide.to_numpy(), h.astype(np.float64) + B)
        assert first.shape.names == ("b", "a")
        np.testing.assert_array_equal(first.to_numpy(), (B + h).T)
        if k and _in_place(step):
            assert out.local is block(), "the replay made a new array where it held the donated block"
        np.testing.assert_array_equal(q.to_numpy(), Q)
        np.testing.assert_array_equal(bias.to_numpy(), B)
