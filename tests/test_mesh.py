"""The processor mesh: shape, coordinates, sub-communicators, layout rules and layout scopes."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from meshes import mesh_shapes  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.mesh import AbstractMesh  # noqa: E402

WORLD = MPI.COMM_WORLD


def all_raised(raised: bool) -> bool:
    """True on every rank iff every rank raised (an Allreduce of the flag)."""
    out = np.zeros(1, np.int32)
    WORLD.Allreduce(np.array([int(raised)], np.int32), out, op=MPI.MIN)
    return bool(out[0])


@pytest.fixture(scope="module", params=mesh_shapes())
def mesh_spec(request) -> str:
    return request.param


_CACHE: dict = {}


def get_mesh(spec: str, layout: str = "") -> mm.Mesh:
    """One mesh per (shape, rules) for the whole module: communicators are a finite resource."""
    key = (spec, layout)
    if key not in _CACHE:
        _CACHE[key] = mm.Mesh(spec, layout=layout)
    return _CACHE[key]


def _rules_for(shape: mm.Shape) -> str:
    """Rules putting tensor dims t0, t1, ... on the mesh dims in order."""
    return ";".join(f"t{i}:{m}" for i, m in enumerate(shape.names))


@pytest.mark.mpi
def test_mesh_attributes(mesh_spec: str) -> None:
    mesh = get_mesh(mesh_spec)
    want = mm.Shape(mesh_spec)
    assert mesh.shape == want and isinstance(mesh.shape, mm.Shape)
    assert mesh.size == WORLD.Get_size() == want.size
    assert mesh.rank == WORLD.Get_rank()
    # row-major rank order: rank = ravel(coords)
    assert mesh.coords == dict(zip(want.names, (int(c) for c in np.unravel_index(mesh.rank, want.sizes))))
    assert list(mesh.coords) == list(want.names)
    assert all(0 <= mesh.coords[d.name] < d.size for d in want)
    # every rank has distinct coords
    everyone = WORLD.allgather(tuple(mesh.coords.values()))
    assert len(set(everyone)) == mesh.size
    assert everyone == [tuple(int(c) for c in np.unravel_index(r, want.sizes)) for r in range(mesh.size)]


@pytest.mark.mpi
def test_mesh_layout_rules(mesh_spec: str) -> None:
    shape = mm.Shape(mesh_spec)
    rules = _rules_for(shape)
    mesh = get_mesh(mesh_spec, rules)
    assert isinstance(mesh.layout, mm.LayoutRules)
    assert mesh.layout == mm.LayoutRules(rules)
    t = mm.Shape([(f"t{i}", 8) for i in range(shape.rank)] + [("io", 4)])
    assert mesh.tensor_layout(t) == {f"t{i}": m for i, m in enumerate(shape.names)}
    assert mesh.tensor_layout(str(t).strip("[]").replace(" ", "")) == mesh.tensor_layout(t)
    assert mesh.tensor_layout("io:4") == {}
    assert mesh.tensor_layout(mm.Shape("t0:8")) == {"t0": shape.names[0]}
    assert get_mesh(mesh_spec).layout == mm.LayoutRules("")
    assert get_mesh(mesh_spec).tensor_layout(t) == {}


def _expected_members(mesh_shape: mm.Shape, rank: int, dims: list[str]) -> list[int]:
    """World ranks whose coords agree with `rank`'s outside `dims`, in row-major order."""
    mine = np.unravel_index(rank, mesh_shape.sizes)
    out = []
    for r in range(mesh_shape.size):
        c = np.unravel_index(r, mesh_shape.sizes)
        if all(c[i] == mine[i] for i, n in enumerate(mesh_shape.names) if n not in dims):
            out.append(r)
    return out


def _dim_subsets(names: tuple) -> list[list[str]]:
    subsets: list[list[str]] = [[]]
    for n in names:
        subsets += [s + [n] for s in subsets]
    return subsets


@pytest.mark.mpi
def test_comm_for(mesh_spec: str) -> None:
    mesh = get_mesh(mesh_spec)
    for dims in _dim_subsets(mesh.shape.names):
        comm = mesh.comm_for(dims)
        want = _expected_members(mesh.shape, mesh.rank, dims)
        assert comm.Get_size() == len(want) == mesh.group_size(dims)
        mine = np.array([WORLD.Get_rank()], np.int64)
        members = np.empty(comm.Get_size(), np.int64)
        comm.Allgather(mine, members)
        assert members.tolist() == want
        assert comm.Get_rank() == want.index(mesh.rank)
        # cached: the same object, also when the dims are listed in another order
        assert mesh.comm_for(dims) is comm
        assert mesh.comm_for(list(reversed(dims))) is comm
        assert mesh.comm_for(tuple(dims)) is comm


@pytest.mark.mpi
def test_mesh_size_mismatch() -> None:
    n = WORLD.Get_size()
    for spec in (f"all:{n + 1}", f"rows:2;cols:{n}", f"all:{2 * n}"):
        try:
            mm.Mesh(spec)
            raised, msg = False, ""
        except mm.MeshError as e:
            raised, msg = True, str(e)
        assert all_raised(raised), spec
        assert str(mm.Shape(spec).size) in msg and str(n) in msg
        size = mm.Shape(spec).size  # how to launch it (over COMM_WORLD), and "1 rank" in the singular
        assert f"launch {size} ranks (mpiexec -n {size} python" in msg and (f"has {n} rank:" if n == 1 else
                                                                          f"has {n} ranks:") in msg, msg


def test_spaces_around_the_colon_are_allowed():
    """"rows: 2" was refused as an entry 'rows:' with a misleading 'expected name:value'."""
    assert mm.Shape("rows: 2; cols :3") == mm.Shape("rows:2;cols:3")
    assert mm.LayoutRules("batch : rows, hidden:\tcols") == mm.LayoutRules("batch:rows;hidden:cols")
    assert mm.Mesh("all :1", comm=MPI.COMM_SELF).shape == mm.Shape("all:1")


@pytest.mark.mpi
@pytest.mark.parametrize("spec", ["rows=2", "rows:two", "rows:2;rows:2", "rows:2:3", ":2", "rows:-1"])
def test_mesh_malformed_string(spec: str) -> None:
    try:
        mm.Mesh(spec)
        raised, msg = False, ""
    except mm.MeshError as e:
        raised, msg = True, str(e)
    assert all_raised(raised)
    assert spec in msg
    with pytest.raises(ValueError):  # MeshError is a ValueError
        mm.Mesh(spec)


@pytest.mark.mpi
def test_mesh_rules_unknown_mesh_dim(mesh_spec: str) -> None:
    try:
        mm.Mesh(mesh_spec, layout="batch:nope")
        raised, msg = False, ""
    except mm.LayoutError as e:
        raised, msg = True, str(e)
    assert all_raised(raised)
    assert "nope" in msg and "batch" in msg


@pytest.mark.mpi
def test_layout_scope(mesh_spec: str) -> None:
    shape = mm.Shape(mesh_spec)
    first = shape.names[0]
    mesh = get_mesh(mesh_spec, f"batch:{first}")
    t = mm.Shape("batch:8;hidden:8")
    outer = mesh.layout
    assert mesh.tensor_layout(t) == {"batch": first}
    with mm.layout_scope(mesh, f"hidden:{first}") as rules:
        assert rules == mm.LayoutRules(f"hidden:{first}")
        assert mesh.layout == rules
        assert mesh.tensor_layout(t) == {"hidden": first}
        with mm.layout_scope(mesh, ""):
            assert mesh.tensor_layout(t) == {}
        assert mesh.tensor_layout(t) == {"hidden": first}
        y = mesh.ones(t)
        assert y.layout == {"hidden": first}
    assert mesh.layout is outer
    assert mesh.tensor_layout(t) == {"batch": first}
    # restored on exception too
    with pytest.raises(RuntimeError):
        with mm.layout_scope(mesh, f"hidden:{first}"):
            assert mesh.tensor_layout(t) == {"hidden": first}
            raise RuntimeError("boom")
    assert mesh.layout is outer
    assert mesh.tensor_layout(t) == {"batch": first}


@pytest.mark.mpi
def test_layout_scope_unknown_mesh_dim(mesh_spec: str) -> None:
    mesh = get_mesh(mesh_spec)
    try:
        with mm.layout_scope(mesh, "batch:nope"):
            pass
        raised = False
    except mm.LayoutError as e:
        raised = "nope" in str(e)
    assert all_raised(raised)
    assert mesh.layout == mm.LayoutRules("")


@pytest.mark.mpi
def test_mesh_over_comm_self() -> None:
    mesh = mm.Mesh("all:1", comm=MPI.COMM_SELF)
    assert mesh.size == 1 and mesh.rank == 0 and mesh.coords == {"all": 0}
    assert mesh.comm_for(["all"]).Get_size() == 1


@pytest.mark.mpi
def test_meshes_that_are_dropped_give_back_their_communicators() -> None:
    """Building a mesh again and again (a notebook cell run many times, a sweep of shapes): each
    dropped mesh's communicators are freed, so the 800th still builds (MPICH has about 2,000
    communicators: the 682nd failed with a raw MPI error) and sums right."""
    import gc
    n = MPI.COMM_WORLD.Get_size()
    for i in range(800):
        mesh = mm.Mesh(f"x:{n}", layout="a:x")
        assert float(mm.reduce_sum(mesh.ones("a:5")).to_numpy()) == 5.0, i
        del mesh
        if i % 50 == 0:
            gc.collect()


# --------------------------------------------------------------------------- the abstract mesh

@pytest.mark.mpi
def test_abstract_mesh_plans_like_the_mesh(mesh_spec: str) -> None:
    """An AbstractMesh of the same shape and rules plans every layout as the Mesh does, and its
    block shapes are the blocks the ranks really hold (numpy.array_split of each split dim)."""
    rules = _rules_for(mm.Shape(mesh_spec))
    mesh = get_mesh(mesh_spec, rules)
    am = AbstractMesh(mesh_spec, rules)
    assert isinstance(mesh, AbstractMesh) and am.shape == mesh.shape and am.size == mesh.size == WORLD.Get_size()
    assert mesh.abstract().shape == mesh.shape and mesh.abstract().layout == mesh.layout == am.layout
    names = mesh.shape.names
    for sizes in [(7, 5, 3), (8, 4, 2), (1, 2, 9)]:
        t = mm.Shape([(f"t{i}", s) for i, s in enumerate(sizes[:len(names)])] + [("free", 3)])
        assert am.plan(t) == mesh.plan(t) == tuple(names) + (None,)
        assert am.tensor_layout(t) == mesh.tensor_layout(t) == {f"t{i}": m for i, m in enumerate(names)}
        x = mesh.zeros(t)
        assert am.block_shape(t, coords=mesh.coords) == x.local.shape  # this rank's own block
        want = tuple(len(np.array_split(np.arange(d.size), mesh.shape[m].size)[mesh.coords[m]]) if m else d.size
                     for d, m in zip(t, mesh.plan(t)))
        assert x.local.shape == want
        first = tuple(len(np.array_split(np.arange(d.size), mesh.shape[m].size)[0]) if m else d.size
                      for d, m in zip(t, mesh.plan(t)))
        assert am.block_shape(t) == mesh.block_shape(t) == first  # coordinate 0: the largest block
        assert max(WORLD.allgather(x.local.shape)) <= first
        # an explicit layout: only the last dim split, over the first mesh dim
        assert am.layout_of(t, f"free:{names[0]}") == (None,) * len(names) + (names[0],)
        assert am.block_shape(t, f"free:{names[0]}") == tuple(sizes[:len(names)]) + (-(-3 // mesh.shape[0].size),)
    assert am.group_size(names) == mesh.group_size(names) == mesh.size


def test_abstract_mesh_needs_no_processors() -> None:
    """Any mesh shape, whatever the number of ranks; rules and scopes checked as on a Mesh."""
    am = AbstractMesh("rows:16;cols:32", layout="batch:rows;heads:cols;d_ff:cols")
    t = mm.Shape("batch:256;length:256;heads:256;d_k:256")
    assert am.size == 512 and am.tensor_layout(t) == {"batch": "rows", "heads": "cols"}
    assert am.block_shape(t) == (16, 256, 8, 256)
    assert am.block_shape("d_ff:100", coords={"rows": 0, "cols": 31}) == (3,)  # 100 = 4*4 + 28*3
    with mm.layout_scope(am, "batch:cols"):
        assert am.tensor_layout(t) == {"batch": "cols"} and am.block_shape(t) == (8, 256, 256, 256)
    assert am.tensor_layout(t) == {"batch": "rows", "heads": "cols"}
    assert repr(am) == "AbstractMesh('[rows:16, cols:32]', layout='batch:rows;heads:cols;d_ff:cols')"
    with pytest.raises(mm.MeshError, match="size 0"):
        AbstractMesh("rows:0")
    with pytest.raises(mm.MeshError, match="bad mesh shape"):
        AbstractMesh("rows")
    with pytest.raises(mm.LayoutError, match="'nope'"):
        AbstractMesh("rows:2", layout="batch:nope")
    with pytest.raises(mm.LayoutError, match="both"):
        am.layout_of(t, "batch:rows;heads:rows")


# --------------------------------------------------------------------------- the module graph

PACKAGE = Path(mm.__file__).resolve().parent


def _module_imports(name: str) -> set[str]:
    """The mpimesh modules that module `name` imports, at the top or inside functions (lazily).
    `from pkg import sub` of a submodule is an import of `pkg.sub` alone (pkg/__init__ runs first,
    but what the module uses is the submodule); `from pkg import thing` is an import of pkg."""
    path = PACKAGE.joinpath(*name.split(".")[1:])
    is_pkg = path.is_dir()
    path = path / "__init__.py" if is_pkg else path.with_suffix(".py")
    package = name if is_pkg else name.rsplit(".", 1)[0]
    known = _all_modules()
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & known  # `from . import creation`
            if len(subs) < len(node.names):
                out.add(base)
            out.update(subs)
    return {m for m in out if m == "mpimesh" or m.startswith("mpimesh.")}


def _all_modules() -> set[str]:
    mods = {"mpimesh"}
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE).with_suffix("").parts
        mods.add(".".join(("mpimesh",) + (rel[:-1] if rel[-1] == "__init__" else rel)))
    return mods


def module_closure(name: str) -> set[str]:
    """Every mpimesh module that importing `name` can load, lazy imports included, except the
    package's own `__init__` (which loads the whole public API for `import mpimesh`)."""
    known = _all_modules()
    seen, todo = set(), [name]
    while todo:
        m = todo.pop()
        if m in seen or m == "mpimesh" or m not in known:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts))]  # its parent packages
        todo += _module_imports(m)
    return seen


def test_module_closure_sees_lazy_imports() -> None:
    """The scan is not vacuous: it finds the collectives' function-local import of a transport,
    and the creation module's imports of the random ops."""
    assert "mpimesh.collectives.mpi" in module_closure("mpimesh.collectives")
    assert {"mpimesh.mesh", "mpimesh.ops.random", "mpimesh.tensor"} <= module_closure("mpimesh.creation")


def test_mesh_module_sits_below_the_op_layer() -> None:
    """mesh.py loads no op, tensor, trace or autodiff module (the creation methods are attached by
    mpimesh.creation), so planning code can use a mesh without the op layer."""
    closure = module_closure("mpimesh.mesh")
    above = sorted(m for m in closure if m.startswith("mpimesh.ops") or m in {
        "mpimesh.tensor", "mpimesh.trace", "mpimesh.autodiff", "mpimesh.creation", "mpimesh.buckets"})
    assert not above, f"mpimesh.mesh imports the op layer: {above}"
    assert {"mpimesh.layout", "mpimesh.shape", "mpimesh.collectives"} <= closure
    for method in ("from_numpy", "zeros", "ones", "full", "random_normal", "random_uniform"):
        assert callable(getattr(mm.Mesh, method)) and getattr(mm.Mesh, method).__qualname__ == f"Mesh.{method}"


def import_loops() -> list[list[str]]:
    """The import loops of the package (strongly connected groups of modules, each module's
    function-local imports included), the package's own `__init__` left out: it imports the
    public API, and nothing inside imports it."""
    mods = _all_modules() - {"mpimesh"}
    graph = {m: _module_imports(m) & mods for m in mods}
    order, low, on, stack, loops = {}, {}, set(), [], []

    def visit(v):  # Tarjan's algorithm
        order[v] = low[v] = len(order)
        stack.append(v)
        on.add(v)
        for w in graph[v] - {v}:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                loops.append(sorted(group))
    for v in sorted(mods):
        if v not in order:
            visit(v)
    return loops


def test_the_package_has_no_import_loop() -> None:
    """Layers import only downward, function-local imports included: the op record and dispatch,
    then tensors, then the ops, then autodiff with its buckets, then optimizers and layers."""
    assert import_loops() == []
    below = {"mpimesh.trace": {"mpimesh.tensor", "mpimesh.autodiff", "mpimesh.buckets", "mpimesh.dryrun"},
             "mpimesh.tensor": {"mpimesh.autodiff", "mpimesh.buckets", "mpimesh.ops.elementwise"},
             "mpimesh.ops.einsum": {"mpimesh.autodiff", "mpimesh.buckets", "mpimesh.optim", "mpimesh.layers"},
             "mpimesh.ops.elementwise": {"mpimesh.autodiff", "mpimesh.buckets", "mpimesh.ops.reduce"},
             "mpimesh.autodiff": {"mpimesh.optim", "mpimesh.layers", "mpimesh.cost"}}
    for module, above in below.items():
        assert not module_closure(module) & above, (module, sorted(module_closure(module) & above))


def test_the_loop_check_finds_a_loop(monkeypatch) -> None:
    """The check is not vacuous: a function-local import of autodiff from trace is a loop."""
    real = _module_imports
    monkeypatch.setitem(globals(), "_module_imports",
                        lambda name: real(name) | ({"mpimesh.autodiff"} if name == "mpimesh.trace" else set()))
    assert any({"mpimesh.trace", "mpimesh.autodiff"} <= set(loop) for loop in import_loops())
