"""Bucketed, overlapped gradient sums (`mpimesh.buckets`) and the non-blocking `iallreduce`.

Gradients with buckets must equal those without, bitwise in float64, and both must match numpy's
float64 gradients of the same model on the global arrays; the profile must show fewer allreduce
calls and the non-blocking ones in its `overlap`. `iallreduce` is checked against numpy sums of
every rank's array, the SPMD check and the time-out against a pending request.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.launch import find_mpiexec, job_env
from meshes import mesh_shapes

ROOT = Path(__file__).resolve().parents[1]
N = MPI.COMM_WORLD.Get_size()
B, I, H, O = 7, 5, 6, 3  # batch 7: uneven blocks on 2, 3 and 4 ranks


def _layout(shape: str) -> str:
    """Data-parallel over every mesh dim but the second of a 2-D or 3-D mesh, model-parallel there."""
    names = [d.split(":")[0] for d in shape.split(";")]
    if len(names) == 1:
        return f"batch:{names[0]}"
    if len(names) == 2:
        return f"batch:{names[0]};h:{names[1]}"
    return f"batch:{names[0]};seq:{names[2]};h:{names[1]}"


def _globals():
    rng = np.random.default_rng(7)
    return {"x": rng.standard_normal((B, 2, I)), "w1": rng.standard_normal((I, H)), "b1": rng.standard_normal(H),
            "w2": rng.standard_normal((H, O))}


def _numpy_grads(g):
    """float64 gradients of `loss` below, by hand on the global arrays."""
    x, w1, b1, w2 = g["x"], g["w1"], g["b1"], g["w2"]
    a = np.tanh(x @ w1 + b1)
    y = a @ w2
    dy = 2 * y
    dh = (dy @ w2.T) * (1 - a * a)
    return {"w1": np.einsum("bsi,bsh->ih", x, dh + 1), "b1": dh.sum((0, 1)), "w2": np.einsum("bsh,bso->ho", a, dy)}


def _step(mesh, g, bucket_bytes):
    x = mesh.from_numpy(g["x"], f"batch:{B};seq:2;i:{I}")
    params = {"w1": mesh.from_numpy(g["w1"], f"i:{I};h:{H}"), "b1": mesh.from_numpy(g["b1"], f"h:{H}"),
              "w2": mesh.from_numpy(g["w2"], f"h:{H};o:{O}")}
    with mm.profile() as prof, mm.trace():
        a = mm.tanh(mm.einsum([x, params["w1"]]) + params["b1"])
        y = mm.einsum([a, params["w2"]])
        loss = mm.reduce_sum(y * y) + mm.reduce_sum(mm.einsum([x, params["w1"]]))  # w1 used twice: two terms
        grads = mm.gradients([loss], list(params.values()), bucket_bytes=bucket_bytes)
    return {k: t.to_numpy() for k, t in zip(params, grads)}, prof


def _half_of_all(mesh) -> int:
    """Half the bytes of the four deferred gradients (w2, b1 and w1's two terms) as buckets count
    them (a gradient's global bytes over the ranks that split it, rounded up), plus one: no gradient
    fills that alone, so the walk closes more than one bucket and fewer than four, on any mesh."""
    split = mesh.tensor_layout(f"h:{H}").get("h")  # w1, b1 and w2 are split along h only, if at all
    k = mesh.shape[split].size if split else 1
    sizes = [H * O, H, I * H, I * H]
    return sum(-(-n // k) * 8 for n in sizes) // 2 + 1


def _calls(prof) -> int:
    return sum(v["calls"] for k, v in prof.counters.items() if k.startswith("allreduce/"))


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
def test_bucketed_gradients_equal_unbucketed_bitwise(shape):
    mesh = mm.Mesh(shape, layout=_layout(shape))
    g = _globals()
    want = _numpy_grads(g)
    plain, p0 = _step(mesh, g, 0)
    one, p1 = _step(mesh, g, 1)  # every gradient a bucket of its own
    few, p2 = _step(mesh, g, _half_of_all(mesh))  # several buckets of a few gradients
    big, p3 = _step(mesh, g, None)  # the default, 25 MiB: one bucket per (mesh dims, dtype)
    for k in want:
        np.testing.assert_allclose(plain[k], want[k], rtol=1e-12, atol=1e-12, err_msg=k)
        for got in (one, few, big):
            np.testing.assert_array_equal(got[k], plain[k], err_msg=f"{k} on {shape}")
    assert p0.overlap["requests"] == 0
    model_dim = mesh.shape.names[1] if mesh.shape.rank > 1 else None  # h's: the rest hold the batch
    if any(d.size > 1 for d in mesh.shape if d.name != model_dim):  # data-parallel: gradients await sums
        deferred = p1.overlap["requests"]
        assert deferred == 4  # w2, b1, and w1's two terms, each in a bucket of its own
        assert _calls(p1) == _calls(p0)
        assert 1 < p2.overlap["requests"] < deferred
        assert _calls(p3) < _calls(p2) < _calls(p0)
        assert p3.overlap["requests"] == 1  # every gradient awaits the same sum: one bucket
        assert _calls(p3) == _calls(p0) - deferred + 1
        o = p3.overlap
        assert o["seconds"] >= o["exposed"] >= 0 and abs(o["hidden"] - (o["seconds"] - o["exposed"])) < 1e-9
    else:
        assert p3.overlap["requests"] == 0 and _calls(p3) == _calls(p0)


@pytest.mark.mpi
def test_bucketed_training_step_is_deterministic_float32():
    """A transformer-like step through layers and the optimizer: same parameters either way (float32)."""
    mesh = mm.Mesh(f"all:{N}", layout="batch:all")
    x = mesh.random_normal(f"batch:{2 * N + 1};d:8", seed=1)
    results = []
    for bucket_bytes in (0, 64, None):
        params = {"w": mesh.random_normal("d:8;e:8", seed=2), "v": mesh.random_normal("e:8;d:8", seed=3),
                  "s": mesh.ones("d:8")}
        opt = mm.optim.Adam(1e-2)
        state = opt.init(params)
        for _ in range(2):
            with mm.trace():
                h = mm.relu(mm.einsum([x * params["s"], params["w"]]))
                loss = mm.reduce_mean(mm.square(mm.einsum([h, params["v"]], output_shape=f"batch:{2 * N + 1};d:8") - x))
                grads = mm.gradients([loss], list(params.values()), bucket_bytes=bucket_bytes)
                params, state = opt.update(params, dict(zip(params, grads)), state)
        results.append({k: t.to_numpy() for k, t in params.items()})
    for r in results[1:]:
        for k in r:
            np.testing.assert_array_equal(r[k], results[0][k], err_msg=k)


def _rank_array(r: int, shape, dtype=np.float64):
    return np.random.default_rng(100 + r).standard_normal(shape).astype(dtype)


def _group(mesh, dims) -> list:
    """World ranks of this rank's group over `dims` (mesh rank r = world rank r, row-major coordinates)."""
    sizes, names = mesh.shape.sizes, mesh.shape.names
    me = mesh.coords
    out = []
    for r in range(mesh.size):
        c = dict(zip(names, np.unravel_index(r, sizes)))
        if all(c[n] == me[n] for n in names if n not in dims):
            out.append(r)
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("transport", ["mpi", "staged"])
@pytest.mark.parametrize("shape", mesh_shapes())
def test_iallreduce_matches_numpy_sums(shape, transport):
    mesh = mm.Mesh(shape, transport=transport, backend="numpy")  # host arrays (GPU ones: test_gpu_transports.py)
    coll = mesh.collectives
    names = mesh.shape.names
    dim_sets = [names[:1], names[1:], names]
    with mm.profile() as prof:
        xs = [_rank_array(mesh.rank + 10 * i, (3, 4)) for i in range(len(dim_sets))]
        reqs = [coll.iallreduce(x, dims) for x, dims in zip(xs, dim_sets)]  # all in flight at once
        while not reqs[0].test():
            pass
        got = [r.wait() for r in reversed(reqs)][::-1]  # completed in another order than started
        ints = coll.iallreduce(np.full(5, mesh.rank + 1, np.int64), names, "max").wait()
    for i, (dims, g) in enumerate(zip(dim_sets, got)):
        want = sum(_rank_array(r + 10 * i, (3, 4)) for r in _group(mesh, dims))
        np.testing.assert_allclose(g, want, rtol=1e-13, err_msg=f"over {dims}")
        assert reqs[i].wait() is g  # the same result again
    np.testing.assert_array_equal(ints, np.full(5, N))
    moving = [dims for dims in dim_sets if coll.size(dims) > 1]
    counted = sum(v["calls"] for k, v in prof.counters.items() if k.startswith("allreduce/"))
    assert counted == len(moving) + (N > 1)
    assert prof.overlap["requests"] == counted


@pytest.mark.mpi(min_size=2)
def test_divergent_iallreduce_is_caught_at_its_start(checked):
    mesh = mm.Mesh(f"all:{N}")
    coll = mesh.collectives
    dtype = np.float32 if mesh.rank == 0 else np.float64
    with pytest.raises(mm.DivergenceError) as info:
        coll.iallreduce(np.ones(3, dtype), ["all"])
    assert "float32" in str(info.value) and "float64" in str(info.value) and "non-blocking" in str(info.value)
    req = coll.iallreduce(np.ones(3), ["all"])  # no data moved: the mesh is still usable
    np.testing.assert_array_equal(req.wait(), np.full(3, float(N)))


@pytest.mark.skipif(N != 1, reason="spawns its own 2-rank job; runs in the 1-rank session")
def test_pending_request_times_out(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import time
        import numpy as np
        import mpimesh as mm
        mesh = mm.Mesh("all:2")
        coll = mesh.collectives
        with open(f"warm-{mesh.rank}", "w") as f:  # one file per rank: stdout lines of two ranks may interleave
            f.write(str(coll.iallreduce(np.ones(2), ["all"]).wait()[0]))
        if mesh.rank == 1:
            time.sleep(100)   # never starts the next one
        req = coll.iallreduce(np.ones(2), ["all"])
        req.wait()
    """))
    start = time.monotonic()
    proc = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(script)],
                          env=job_env(PYTHONPATH=str(ROOT), MPIMESH_COLLECTIVE_TIMEOUT="3"),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    seconds = time.monotonic() - start
    assert proc.returncode != 0 and seconds < 60, (proc.returncode, seconds)  # rank 1 sleeps 100 s
    assert "CollectiveTimeoutError" in proc.stderr and "ranks [1] never arrived" in proc.stderr
    assert "allreduce over all" in proc.stderr and "(non-blocking)" in proc.stderr and "job.py:" in proc.stderr
    assert [(tmp_path / f"warm-{r}").read_text() for r in (0, 1)] == ["2.0", "2.0"]


def test_bucket_size_setting():
    assert mm.buckets.bucket_bytes() == 25 << 20  # PyTorch DDP's default
    mm.set_bucket_bytes(1024)
    try:
        assert mm.buckets.bucket_bytes() == 1024
    finally:
        mm.set_bucket_bytes(25 << 20)
    for bad in (-1, 1.5, "25MB", True):
        with pytest.raises(mm.MpimeshError, match="bucket size"):
            mm.set_bucket_bytes(bad)
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    w = mesh.ones("a:2")
    with mm.trace(), pytest.raises(mm.MpimeshError, match="bucket size"):
        mm.gradients([mm.reduce_sum(w)], [w], bucket_bytes=-5)


def _lowp_params(mesh, g):
    """float32 masters of a two-layer `mm.layers` model (laid out by the mesh's rules)."""
    return {"d1": {"kernel": mesh.from_numpy(g["w1"].astype(np.float32), f"i:{I};h:{H}"),
                   "bias": mesh.from_numpy(g["b1"].astype(np.float32), f"h:{H}")},
            "d2": {"kernel": mesh.from_numpy(g["w2"].astype(np.float32), f"h:{H};o:{O}")}}


def _lowp_loss(params, x):
    """`mm.layers.dense` in x's dtype (each float32 master cast to it), the loss in float32."""
    h = mm.relu(mm.layers.dense(params["d1"], x))
    return mm.reduce_sum(mm.square(mm.cast(mm.layers.dense(params["d2"], h), "float32")))


def _lowp_step(mesh, g, dtype, bucket_bytes, release=False):
    params = mm.layers.flatten(_lowp_params(mesh, g))
    x = mm.cast(mesh.from_numpy(g["x"].astype(np.float32), f"batch:{B};seq:2;i:{I}"), dtype)
    with mm.profile() as prof, mm.trace() as tr:
        loss = _lowp_loss(mm.layers.unflatten(params), x)
        grads = mm.gradients([loss], list(params.values()), bucket_bytes=bucket_bytes, retain=not release)
    assert all(t.dtype == np.float32 for t in grads)  # the masters' gradients, through the casts
    return {k: t.to_numpy() for k, t in zip(params, grads)}, prof, tr


def _lowp_numpy_grads(g, dtype):
    """float64 gradients of `_lowp_loss` on the inputs and parameters rounded to `dtype`."""
    r = {k: np.asarray(v, np.float32).astype(dtype).astype(np.float64) for k, v in g.items()}
    pre = r["x"] @ r["w1"] + r["b1"]
    h = np.maximum(pre, 0)
    dy = 2 * (h @ r["w2"])
    dh = (dy @ r["w2"].T) * (pre > 0)
    return {"d1/kernel": np.einsum("bsi,bsh->ih", r["x"], dh), "d1/bias": dh.sum((0, 1)),
            "d2/kernel": np.einsum("bsh,bso->ho", h, dy)}


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", mesh_shapes())
def test_low_precision_gradients_through_casts_are_bucketed_bitwise(shape, dtype):
    """bfloat16/float16 layers on float32 masters: the einsum gives the cast's output's gradient;
    bucketed, it must equal the unbucketed walk bitwise (float32 sums over ranks, rounded once to
    the 16-bit dtype, cast back), with fewer allreduce calls and no blocking 16-bit allreduce."""
    mesh = mm.Mesh(shape, layout=_layout(shape))
    g = _globals()
    np_dtype = mm.backend.as_dtype(dtype)
    want = _lowp_numpy_grads(g, np_dtype)
    plain, p0, _ = _lowp_step(mesh, g, dtype, 0)
    one, p1, _ = _lowp_step(mesh, g, dtype, 1)  # every gradient a bucket of its own
    big, p3, _ = _lowp_step(mesh, g, dtype, None)  # the default: one bucket
    freed, _, _ = _lowp_step(mesh, g, dtype, None)  # the cast rules run after the walk
    tol = 3e-2 if dtype == "bfloat16" else 4e-3
    for k in want:
        scale = np.abs(want[k]).max()
        np.testing.assert_allclose(plain[k], want[k], rtol=0, atol=tol * scale, err_msg=k)
        for got in (one, big, freed):
            np.testing.assert_array_equal(got[k], plain[k], err_msg=f"{k} on {shape}, {dtype}")
    assert p0.overlap["requests"] == 0
    model_dim = mesh.shape.names[1] if mesh.shape.rank > 1 else None
    if any(d.size > 1 for d in mesh.shape if d.name != model_dim):  # data-parallel: gradients await sums
        assert p1.overlap["requests"] == 3  # both kernels and the bias, through their casts
        assert _calls(p1) == _calls(p0)
        assert p3.overlap["requests"] == 1 and _calls(p3) == _calls(p0) - 3 + 1
        for p in (p1, p3):  # float32 partials: no 16-bit allreduce left blocking in the buckets
            assert not any(k.startswith("alltoall/") for k in p.counters if k not in p0.counters)
    else:
        assert p3.overlap["requests"] == 0 and _calls(p3) == _calls(p0)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bucketed_gradient_trace_replays_in_jax(dtype):
    """A bucketed gradient's `"psum"` (and its rounding to bfloat16) replayed through JAX on as
    many host devices as ranks, the batch in uneven blocks on 2-4 ranks: the MPI values."""
    import jaxenv  # noqa: F401  (before jax: host devices)
    jax = pytest.importorskip("jax", reason="jax is not installed (python3 install.py tpu)")
    if len(jax.devices()) < N:
        pytest.skip(f"JAX has {len(jax.devices())} devices, fewer than the {N} ranks")
    mesh = mm.Mesh(f"all:{N}", layout="batch:all")
    g = _globals()
    params = mm.layers.flatten(_lowp_params(mesh, g))
    x = mesh.from_numpy(g["x"].astype(np.float32), f"batch:{B};seq:2;i:{I}")
    with mm.trace() as tr:
        loss = _lowp_loss(mm.layers.unflatten(params), mm.cast(x, dtype))
        grads = mm.gradients([loss], list(params.values()), bucket_bytes=1)
    psums = [op for op in tr.ops if op.name == "psum"]
    assert len(psums) == (3 if N > 1 else 0)
    assert all(op.params.get("dtype") == (None if dtype == "float32" else mm.backend.as_dtype(dtype)) for op in psums)
    inputs = [x, *params.values()]
    ins = [t.to_numpy() for t in inputs]
    want = [t.to_numpy() for t in [loss, *grads]]
    failed = None
    if mesh.rank == 0:  # no collectives in here
        try:
            got = mm.tpu.replay(tr, inputs, [loss, *grads], devices=jax.devices()[:N])(*ins)
            tol = 2e-5 if dtype == "float32" else 2e-2
            for i, (a, w) in enumerate(zip(got, want)):
                a = np.asarray(a)
                assert a.dtype == w.dtype
                np.testing.assert_allclose(a, w, rtol=tol, atol=tol * max(1.0, float(np.abs(w).max())),
                                           err_msg=["loss", *params][i])
        except AssertionError as e:
            failed = str(e)
    failed = MPI.COMM_WORLD.bcast(failed, root=0)  # every rank fails alike
    assert failed is None, failed


def _sgd_steps(mesh, g, dtype, bucket_bytes, compiled=False, steps=3):
    """`steps` SGD steps of the `_lowp_loss` model (float32 masters, layers in `dtype`), eager or
    `mm.compile`d: the parameters and gradients of every step, as numpy arrays, and the last
    step's gradient tensors (views of their buckets, where data-parallel)."""
    x = mm.cast(mesh.from_numpy(g["x"].astype(np.float32), f"batch:{B};seq:2;i:{I}"), dtype)

    def step(params, x):
        with mm.trace():
            loss = _lowp_loss(mm.layers.unflatten(params), x)
            grads = dict(zip(params, mm.gradients([loss], list(params.values()), bucket_bytes=bucket_bytes)))
        return {k: mm.axpy(-1e-3, grads[k], p) for k, p in params.items()}, grads
    run = mm.compile(step) if compiled else step
    params, seen = mm.layers.flatten(_lowp_params(mesh, g)), []
    for _ in range(steps):
        params, grads = run(params, x)
        seen.append({k: t.to_numpy() for k, t in list(params.items()) + [("d" + k, v) for k, v in grads.items()]})
    return seen, grads


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", mesh_shapes())
def test_gradients_written_into_their_buckets_equal_unbucketed_bitwise(shape, dtype):
    """Each gradient's einsum writes its slot of its bucket's buffer, summed there in place: over
    three SGD steps, eager and compiled, the parameters and gradients equal those without buckets
    bitwise (uneven blocks, 1-D/2-D/3-D meshes), and numpy's float32 gradients closely."""
    mesh = mm.Mesh(shape, layout=_layout(shape))
    g = _globals()
    plain, _ = _sgd_steps(mesh, g, dtype, 0)
    if dtype == "float32":
        want = _lowp_numpy_grads(g, np.float32)
        for k in want:
            np.testing.assert_allclose(plain[0]["d" + k], want[k], rtol=1e-5, atol=1e-5 * np.abs(want[k]).max())
    views = {}
    for bucket_bytes in (None, 1, 200):  # one bucket, one per gradient, a few
        for compiled in (False, True):
            got, views[bucket_bytes, compiled] = _sgd_steps(mesh, g, dtype, bucket_bytes, compiled)
            for step, (a, b) in enumerate(zip(got, plain)):
                for k in b:
                    np.testing.assert_array_equal(a[k], b[k], err_msg=f"{k}, step {step}, {bucket_bytes} bytes, "
                                                                      f"compiled {compiled}, {shape} {dtype}")
    data_parallel = any(d.size > 1 for d in mesh.shape if d.name != (mesh.shape.names[1:2] or [None])[0])
    if data_parallel and dtype == "float32":  # one bucket: every gradient a view of its buffer
        for compiled in (False, True):
            bases = [t.local.base for t in views[None, compiled].values()]
            assert bases[0] is not None and all(b is bases[0] for b in bases), compiled


@pytest.mark.mpi
@pytest.mark.parametrize("compiled", [False, True])
def test_bucket_views_of_a_step_survive_the_next_step(compiled):
    """A gradient is a view of its bucket's buffer, and each step (eager walk or compiled replay)
    sums into a buffer of its own: the gradients a step returned keep their values after later
    steps, whether the caller still holds them or not."""
    mesh = mm.Mesh(f"all:{N}", layout="batch:all")
    x = mesh.random_normal(f"batch:{2 * N + 1};d:8", seed=1)
    w = mesh.random_normal("d:8;e:8", seed=2)

    def step(w, scale):
        with mm.trace():
            (g,) = mm.gradients([mm.reduce_sum(mm.square(mm.einsum([x * scale, w])))], [w])
        return g
    run = mm.compile(step) if compiled else step
    kept = [run(w, mesh.ones("d:8") * float(k + 1)) for k in range(4)]
    values = [t.to_numpy().copy() for t in kept]
    for k in range(4):
        run(w, mesh.ones("d:8") * 10.0)
    for k, (t, v) in enumerate(zip(kept, values)):
        np.testing.assert_array_equal(t.to_numpy(), v, err_msg=f"step {k}")
        np.testing.assert_allclose(v, values[0] * (k + 1) ** 2, rtol=1e-4, atol=1e-4 * np.abs(v).max())


@pytest.mark.mpi
def test_bucket_allreduce_runs_in_place(monkeypatch):
    """The bucket's allreduce receives into its own buffer (MPI.IN_PLACE): nothing copied in or out."""
    mesh = mm.Mesh(f"all:{N}", layout="batch:all")
    seen = []
    plain = mesh.collectives.iallreduce

    def spy(x, dims, op="sum", out=None):
        seen.append(out is x)
        return plain(x, dims, op, out)
    monkeypatch.setattr(mesh.collectives, "iallreduce", spy)
    g = _globals()
    got, _ = _step(mesh, g, None)
    assert seen == ([True] if N > 1 else [])


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
def test_float32_parameters_of_float64_activations(shape):
    """A layer norm's float32 scale and bias on float64 activations: the rule casts their float64
    gradients, so they are summed by their einsums (not left to a bucket, whose partial sums a cast
    cannot read); bitwise the unbucketed values, and numpy's float64 gradients rounded once."""
    mesh = mm.Mesh(shape)
    rng = np.random.default_rng(11)
    x_g, c_g = rng.standard_normal((B, 2, H)), rng.standard_normal((B, 2, H))
    s_g, b_g = rng.standard_normal(H).astype(np.float32), rng.standard_normal(H).astype(np.float32)
    grads = {}
    with mm.layout_scope(mesh, f"batch:{mesh.shape.names[0]}"):
        x = mesh.from_numpy(x_g, f"batch:{B};seq:2;h:{H}")
        c = mesh.from_numpy(c_g, f"batch:{B};seq:2;h:{H}")
        scale, bias = mesh.from_numpy(s_g, f"h:{H}"), mesh.from_numpy(b_g, f"h:{H}")
        for bucket_bytes in (1 << 20, 0):
            with mm.trace():
                y = mm.layers.layer_norm({"scale": scale, "bias": bias}, x, "h")
                gs, gb = mm.gradients([mm.reduce_sum(y * c)], [scale, bias], bucket_bytes=bucket_bytes)
            assert gs.dtype == np.float32 and gb.dtype == np.float32
            grads[bucket_bytes] = (gs.to_numpy(), gb.to_numpy())
    for a, b in zip(grads[1 << 20], grads[0]):
        assert a.tobytes() == b.tobytes()
    mean, var = x_g.mean(-1, keepdims=True), x_g.var(-1, keepdims=True)
    yhat = (x_g - mean) / np.sqrt(var + 1e-6)
    np.testing.assert_allclose(grads[0][0], (c_g * yhat).sum((0, 1)).astype(np.float32), rtol=1e-6)
    np.testing.assert_allclose(grads[0][1], c_g.sum((0, 1)).astype(np.float32), rtol=1e-6)
