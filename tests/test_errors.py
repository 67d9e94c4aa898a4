"""Every error of the API contract: the right class, raised on every rank, naming the offending dims
and sizes, and raised before any communication (a profile open around the call counts nothing).

Each rank catches whatever its call raises and sets a flag; then all ranks Allreduce the flags and
assert that every rank raised the expected error (so a rank that did not raise cannot hang the rest).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from meshes import mesh_fixture  # noqa: E402,F401 (mesh_fixture is the `mesh` fixture)

import mpimesh as mm  # noqa: E402
from mpimesh.backend import to_host  # noqa: E402
from mpimesh.layout import plan_layout  # noqa: E402

WORLD = MPI.COMM_WORLD


def raises_everywhere(exc: type, fn: Callable[[], object], *needles: str) -> str:
    """Assert that `fn()` raises `exc` (an MpimeshError and ValueError) on every rank, with every
    needle in its message, and that nothing was communicated. Returns this rank's message."""
    err: BaseException | None = None
    with mm.profile() as prof:
        try:
            fn()
        except Exception as e:  # anything: a rank must never skip the Allreduce below
            err = e
    msg = str(err) if err is not None else "<nothing raised>"
    ok = (isinstance(err, exc) and isinstance(err, mm.MpimeshError) and isinstance(err, ValueError)
          and all(n in msg for n in needles) and not prof.counters)
    flags = np.zeros(1, np.int32)
    WORLD.Allreduce(np.array([int(ok)], np.int32), flags, op=MPI.MIN)
    assert ok, f"expected {exc.__name__} with {needles}, got {type(err).__name__}: {msg}; counters {prof.counters}"
    assert flags[0] == 1, "another rank did not raise the expected error"
    return msg


def _big_dim(mesh: mm.Mesh):
    """The largest mesh dim, if it has size > 1."""
    d = max(mesh.shape, key=lambda d: d.size)
    return d if d.size > 1 else None


# ---------------------------------------------------------------- MeshError

@pytest.mark.mpi
def test_mesh_size_mismatch() -> None:
    n = WORLD.Get_size()
    raises_everywhere(mm.MeshError, lambda: mm.Mesh(f"all:{n + 1}"), "all:", str(n + 1), str(n))
    raises_everywhere(mm.MeshError, lambda: mm.Mesh(f"rows:{n};cols:2"), f"rows:{n}", "cols:2", str(2 * n))


@pytest.mark.mpi
@pytest.mark.parametrize("spec", ["rows:2;cols", "rows=2", "rows:two", "rows:2;rows:2", "rows:1:1"])
def test_mesh_bad_string(spec: str) -> None:
    raises_everywhere(mm.MeshError, lambda: mm.Mesh(spec), spec)


# ---------------------------------------------------------------- LayoutError

@pytest.mark.mpi
def test_unknown_mesh_dim(mesh: mm.Mesh) -> None:
    g = np.zeros((8, 16), np.float32)
    names = str(list(mesh.shape.names))
    raises_everywhere(mm.LayoutError, lambda: mesh.from_numpy(g, "a:8;b:16", layout="a:nope"), "'nope'", names)
    raises_everywhere(mm.LayoutError, lambda: mm.Mesh(str(mesh.shape), layout="a:nope"), "nope", "a", names)
    x = mesh.from_numpy(g, "a:8;b:16")
    raises_everywhere(mm.LayoutError, lambda: mm.relayout(x, {"b": "nope"}), "'nope'", names)

    def scoped():
        with mm.layout_scope(mesh, "b:nope"):
            pass
    raises_everywhere(mm.LayoutError, scoped, "'nope'", names)
    assert mesh.layout == mm.LayoutRules("")


@pytest.mark.mpi
def test_two_tensor_dims_on_one_mesh_dim(mesh: mm.Mesh) -> None:
    m = mesh.shape.dims[0]
    g = np.zeros((8, 16), np.float32)
    need = ("'a'", "'b'", f"'{m.name}'", str(m.size))
    raises_everywhere(mm.LayoutError, lambda: mesh.from_numpy(g, "a:8;b:16", layout={"a": m.name, "b": m.name}),
                      *need)
    x = mesh.from_numpy(g, "a:8;b:16")
    raises_everywhere(mm.LayoutError, lambda: mm.relayout(x, f"a:{m.name};b:{m.name}"), *need)

    def planned():
        with mm.layout_scope(mesh, f"a:{m.name};b:{m.name}"):  # fine as rules, fails for a tensor with both
            return x + 1.0
    raises_everywhere(mm.LayoutError, planned, *need)
    raises_everywhere(mm.LayoutError, lambda: mm.LayoutRules(f"a:{m.name};a:other"), "'a'", f"'{m.name}'", "'other'")


@pytest.mark.mpi
def test_size_not_divisible_is_accepted(mesh: mm.Mesh) -> None:
    """A dim that its mesh dim does not divide is cut like numpy.array_split (wave 2), not refused:
    every way in (from_numpy, ones, random_normal, relayout, a layout scope) holds the right block."""
    d = _big_dim(mesh)
    if d is None:  # one rank: check the arithmetic on a virtual mesh
        assert plan_layout(mm.Shape("a:5"), mm.Shape("x:2"), mm.LayoutRules("a:x")) == ("x",)
        return
    c = mesh.coords[d.name]
    g = np.arange(40, dtype=np.float32).reshape(5, 8)
    mine = np.array_split(g, d.size, axis=0)[c]
    x = mesh.from_numpy(g, "a:5;b:8", layout={"a": d.name})
    np.testing.assert_array_equal(to_host(x.local), mine)
    assert mesh.ones("a:5;b:8", layout=f"a:{d.name}").local.shape == mine.shape
    ref = mesh.random_normal("a:5;b:8", seed=0).to_numpy()
    np.testing.assert_array_equal(to_host(mesh.random_normal("a:5;b:8", seed=0, layout=f"a:{d.name}").local),
                                  np.array_split(ref, d.size, axis=0)[c])
    r = mm.relayout(mesh.from_numpy(g, "a:5;b:8"), f"a:{d.name}")
    np.testing.assert_array_equal(to_host(r.local), mine)
    np.testing.assert_array_equal(r.to_numpy(), g)
    with mm.layout_scope(mesh, f"a:{d.name}"):
        e = mm.exp(mesh.from_numpy(g, "a:5;b:8"))
    assert e.layout == {"a": d.name}
    np.testing.assert_allclose(e.to_numpy(), np.exp(g), rtol=1e-6)


@pytest.mark.mpi
def test_layout_names_dim_not_in_shape(mesh: mm.Mesh) -> None:
    """A layout naming a tensor dim the shape lacks is a clear LayoutError, not a KeyError."""
    m = mesh.shape.names[0]
    g = np.zeros((8, 16), np.float32)
    need = ("'z'", "not in shape", "a:8", "b:16")
    raises_everywhere(mm.LayoutError, lambda: mesh.from_numpy(g, "a:8;b:16", layout=f"z:{m}"), *need)
    raises_everywhere(mm.LayoutError, lambda: mesh.from_numpy(g, "a:8;b:16", layout={"a": m, "z": m}), *need)
    x = mesh.from_numpy(g, "a:8;b:16")
    raises_everywhere(mm.LayoutError, lambda: mm.relayout(x, [("z", m)]), *need)


# ---------------------------------------------------------------- ShapeError

@pytest.fixture()
def xy(mesh: mm.Mesh):
    """x [a:8, b:16] split along a, y [b:8, c:8] (b disagrees with x's)."""
    m = mesh.shape.names[-1]
    x = mesh.from_numpy(np.ones((8, 16), np.float32), "a:8;b:16", layout={"a": m})
    y = mesh.from_numpy(np.ones((8, 8), np.float32), "b:8;c:8", layout={"b": m})
    return x, y


@pytest.mark.mpi
def test_elementwise_dims_disagree(xy) -> None:
    x, y = xy
    need = ("'b'", "16", "8")
    for fn in (lambda: x + y, lambda: y - x, lambda: x * y, lambda: x / y, lambda: x ** y, lambda: x < y,
               lambda: x == y, lambda: mm.minimum(x, y), lambda: mm.maximum(y, x)):
        raises_everywhere(mm.ShapeError, fn, *need)


@pytest.mark.mpi
def test_einsum_errors(xy, mesh: mm.Mesh) -> None:
    x, y = xy
    z = mesh.ones("b:16;c:8")
    raises_everywhere(mm.ShapeError, lambda: mm.einsum([x, z], output_shape="a:8;q:4"), "'q'", "4")
    raises_everywhere(mm.ShapeError, lambda: mm.einsum([x, z], output_shape="a:4;c:8"), "'a'", "4", "8")
    raises_everywhere(mm.ShapeError, lambda: mm.einsum([x, y]), "'b'", "16", "8")
    raises_everywhere(mm.ShapeError, lambda: mm.einsum([x, z], reduced_dims=["q"]), "'q'")


@pytest.mark.mpi
def test_reshape_size_mismatch(xy) -> None:
    x, _ = xy
    raises_everywhere(mm.ShapeError, lambda: mm.reshape(x, "a:8;b:8"), "a:8", "b:16", "128", "64")
    raises_everywhere(mm.ShapeError, lambda: mm.reshape(x, "ab:127"), "ab:127", "128", "127")


@pytest.mark.mpi
def test_transpose_not_a_permutation(xy) -> None:
    x, _ = xy
    raises_everywhere(mm.ShapeError, lambda: mm.transpose(x, "b:16;c:8"), "c:8", "a:8", "b:16")
    raises_everywhere(mm.ShapeError, lambda: mm.transpose(x, "b:16;a:4"), "a:4", "a:8")
    raises_everywhere(mm.ShapeError, lambda: mm.transpose(x, "b:16"), "b:16", "a:8")


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_logsumexp"])
def test_reduce_missing_dim(xy, op: str) -> None:
    x, _ = xy
    fn = getattr(mm, op)
    raises_everywhere(mm.ShapeError, lambda: fn(x, reduced_dims="z"), "'z'", "a:8", "b:16")
    raises_everywhere(mm.ShapeError, lambda: fn(x, output_shape="z:3"), "z:3", "a:8", "b:16")
    raises_everywhere(mm.ShapeError, lambda: fn(x, output_shape="a:4"), "a:4", "a:8")


@pytest.mark.mpi
def test_creation_shape_errors(mesh: mm.Mesh) -> None:
    raises_everywhere(mm.ShapeError, lambda: mesh.from_numpy(np.zeros((8, 15)), "a:8;b:16"), "(8, 15)", "b:16")
    raises_everywhere(mm.ShapeError, lambda: mesh.ones("a:8;a:4"), "'a'")
    m = mesh.shape.dims[-1]
    want = (8 // m.size, 16)

    def one_rank_wrong():  # only the last rank passes a wrong slice: every rank must raise
        local = np.zeros(want if mesh.rank != mesh.size - 1 else (want[0] + 1, 16), np.float32)
        return mm.from_local(local, "a:8;b:16", mesh, layout={"a": m.name})
    err: BaseException | None = None
    try:
        one_rank_wrong()
    except Exception as e:
        err = e
    ok = isinstance(err, mm.ShapeError) and str(want) in str(err)
    flags = np.zeros(1, np.int32)
    WORLD.Allreduce(np.array([int(ok)], np.int32), flags, op=MPI.MIN)
    assert ok and flags[0] == 1, str(err)


def test_error_hierarchy() -> None:
    for cls in (mm.MeshError, mm.LayoutError, mm.ShapeError, mm.CheckpointError):
        assert issubclass(cls, mm.MpimeshError) and issubclass(cls, ValueError)
    assert issubclass(mm.MpimeshError, ValueError)


@pytest.mark.mpi
def test_dtypes_an_op_cannot_take(mesh: mm.Mesh) -> None:
    """What numpy refuses for a dtype is a DTypeError naming the op and the tensors, decided from
    dtypes alone (so on every rank, before any kernel runs); ops that need floats say so."""
    m = mesh.shape.names[-1]
    b = mesh.from_numpy(np.arange(8) % 2 == 0, "a:8", layout={"a": m})
    i = mesh.from_numpy(np.arange(1, 9, dtype=np.int32), "a:8", layout={"a": m})
    raises_everywhere(mm.DTypeError, lambda: -b, "negative", "[a:8] bool")
    raises_everywhere(mm.DTypeError, lambda: b - b, "subtract", "[a:8] bool tensor and a [a:8] bool")
    raises_everywhere(mm.DTypeError, lambda: i ** -1, "negative integer power", "cast to a float")
    with mm.layout_scope(mesh, f"a:{m}"):  # the exponent stays split: its one -1 lies on one rank
        exponent = mesh.from_numpy(np.arange(8, dtype=np.int32) - 1, "a:8")
        raises_everywhere(mm.DTypeError, lambda: i ** exponent, "negative integer power", "on some rank")
        raises_everywhere(mm.DTypeError, lambda: 2 ** exponent, "negative integer power")
        np.testing.assert_array_equal((i ** (exponent + 1)).to_numpy(), np.arange(1, 9) ** np.arange(8))
    np.testing.assert_array_equal((i ** 2).to_numpy(), np.arange(1, 9) ** 2)  # what numpy allows still runs
    np.testing.assert_array_equal((b + b).to_numpy(), np.arange(8) % 2 == 0)
    np.testing.assert_allclose((i ** -1.0).to_numpy(), 1.0 / np.arange(1, 9))
    import ml_dtypes  # a 16-bit float to an integer power is a float (it was refused): bfloat16, as mm.result_type
    h = mm.cast(mesh.from_numpy(np.arange(1.0, 9.0), "a:8", layout={"a": m}), "bfloat16")  # says, not numpy's float64
    for e in (np.int64(2), np.int32(-2), i):
        ev = e.to_numpy() if isinstance(e, mm.DistTensor) else e
        want = (np.arange(1.0, 9.0) ** ev.astype(np.float64)).astype(ml_dtypes.bfloat16)  # float64, rounded once
        got = h ** e
        assert got.dtype == want.dtype == mm.result_type(h.dtype, e.dtype), (e, got.dtype)
        np.testing.assert_allclose(got.to_numpy().astype(np.float64), want.astype(np.float64), rtol=2.0 ** -7,
                                   err_msg=str(e))  # (bfloat16's pow is float32's rounded: an ulp apart at most)
    x = mesh.from_numpy(np.arange(16, dtype=np.int32).reshape(2, 8), "b:2;a:8", layout={"a": m})
    for op, fn in (("softmax", lambda: mm.softmax(x, "a")), ("log_softmax", lambda: mm.log_softmax(x, "a")),
                   ("reduce_logsumexp", lambda: mm.reduce_logsumexp(x)),
                   ("layer_norm", lambda: mm.layers.layer_norm(mm.layers.init_layer_norm(mesh, "a:8"), x, "a"))):
        raises_everywhere(mm.DTypeError, fn, op, "[b:2, a:8] int32", "needs floats")


@pytest.mark.mpi
def test_arguments_that_are_not_tensors(mesh: mm.Mesh) -> None:
    """A numpy array where a tensor belongs: a TypeError naming the op, at its door."""
    a = np.ones((5, 7))
    calls = {"cast": lambda: mm.cast(a, "float32"), "exp": lambda: mm.exp(a), "relayout": lambda: mm.relayout(a, ""),
             "reshape": lambda: mm.reshape(a, "n:35"), "transpose": lambda: mm.transpose(a, "n:35"),
             "softmax": lambda: mm.softmax(a, "n"), "slice": lambda: mm.slice(a, 0, 1, "n"),
             "reduce_sum": lambda: mm.reduce_sum(a), "top_k": lambda: mm.top_k(a, "n", "k:1"),
             "argmax": lambda: mm.argmax(a, "n"), "gather": lambda: mm.gather(a, mesh.zeros("i:2", "int32"), "n"),
             "einsum": lambda: mm.einsum(mesh.ones("n:3")), "layout_scope": lambda: mm.layout_scope("all:1", "").__enter__()}
    for op, fn in calls.items():
        with pytest.raises(TypeError) as caught:
            fn()
        assert str(caught.value).startswith(op.split("_scope")[0]) and "DistTensor" in str(caught.value) or \
            op in ("einsum", "layout_scope") and "got a" in str(caught.value), (op, str(caught.value))


@pytest.mark.mpi
def test_range_beyond_its_dtype(mesh: mm.Mesh) -> None:
    """`mm.range` refuses, on every rank, a dtype that cannot count to its dim's size (it wrapped
    around on 1 rank, and raised on only the ranks with the high values on several)."""
    raises_everywhere(mm.DTypeError, lambda: mm.range(mesh, mm.Dimension("n", 300), dtype="int8"), "int8", "0..299",
                      "127")
    raises_everywhere(mm.DTypeError, lambda: mm.range(mesh, mm.Dimension("n", 2050), dtype="float16"), "2048")
    np.testing.assert_array_equal(mm.range(mesh, mm.Dimension("n", 256), dtype="uint8").to_numpy(), np.arange(256))


@pytest.mark.mpi
def test_from_local_names_the_ranks_at_fault() -> None:
    """A slice of the wrong shape, or of another dtype, on one rank: every rank raises, naming that
    rank (not itself) and the dtypes."""
    mesh = mm.Mesh(f"all:{WORLD.Get_size()}")
    n, last = WORLD.Get_size(), WORLD.Get_size() - 1
    rows = 1 + (mesh.rank == last)
    raises_everywhere(mm.ShapeError, lambda: mm.from_local(np.zeros((rows, 6), np.float32), f"a:{n};b:6", mesh,
                                                           "a:all"), f"rank {last} passes shape (2, 6)", "(1, 6)")
    if n > 1:
        dt = np.float64 if mesh.rank == last else np.float32
        others = "rank 0" if last == 1 else f"ranks {', '.join(map(str, range(min(last, 4))))}" + \
            (f" and {last - 4} more" if last > 4 else "")  # at most four ranks named
        raises_everywhere(mm.DTypeError, lambda: mm.from_local(np.zeros((1, 6), dt), f"a:{n};b:6", mesh, "a:all"),
                          f"{others}: float32; rank {last}: float64")


@pytest.mark.mpi
@pytest.mark.skipif(WORLD.Get_size() == 1, reason="ranks that disagree need two")
def test_ranks_that_build_different_meshes() -> None:
    """Meshes of other shapes or rules on some ranks: a MeshError on every rank naming what each
    built (it hung, or summed blocks cut two ways)."""
    n, rank = WORLD.Get_size(), WORLD.Get_rank()
    other = f"rows:1;cols:{n}" if rank == n - 1 else f"rows:{n};cols:1"
    raises_everywhere(mm.MeshError, lambda: mm.Mesh(other), f"mesh [rows:1, cols:{n}]", f"mesh [rows:{n}, cols:1]")
    rules = "io:all" if rank == 0 else "batch:all"
    raises_everywhere(mm.MeshError, lambda: mm.Mesh(f"all:{n}", layout=rules), "'io:all'", "'batch:all'")
