"""Counts for issue 41 ("One declaration per op"): how far mpimesh is from the issue's goals.

Usage: `python docs/counts.py [--verbose] [--root DIR]` prints one row per count, its goal and its
value now; `--verbose` lists every match as `file:line`; `--root` counts another checkout (e.g. the
last commit: `git archive HEAD | tar -x -C /tmp/head`). Each count is a function of a checkout's root
returning its matches, so tests can assert the goals. Standard library only: it parses, never imports.
How a count decides what matches is in its function's docstring; the layer order is `LAYERS`.

>>> rows = table(ROOT)
>>> [label for label, _, _, _ in rows][:2]
['op-name string matches in engines', 'liveness computations']
>>> all(isinstance(now, int) for _, _, now, _ in rows)
True
"""
from __future__ import annotations

import argparse
import ast
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]

ENGINES = ("mpimesh/trace.py", "mpimesh/compiled.py", "mpimesh/fusion.py", "mpimesh/rowfusion.py", "mpimesh/graphs.py",
           "mpimesh/tpu/replay.py",
           "mpimesh/dryrun.py", "mpimesh/cost", "mpimesh/autodiff.py", "mpimesh/buckets.py",
           "mpimesh/program.py", "mpimesh/remat.py")
"""The engines: the modules that run, replay, differentiate or price recorded ops (a missing one is skipped)."""

BACKEND_LAYER = ("mpimesh/backend.py",)
"""The one module that may know the array module. `gemm.py` picks its matmul by backend (a per-backend
kernel, which an op definition holds), so it counts; `cublas.py` (ctypes bindings) has no such test."""

LAYERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("errors", ("errors", "version")),
    ("env", ("env", "extras")),
    ("pure", ("shape", "layout", "tree", "liveness", "stack", "pipeline_schedules")),
    ("counters", ("counters", "flight", "collectives.callsite")),
    ("backend", ("promotion", "backend")),
    ("opdef", ("opdef",)),
    ("runtime", ("abort", "threads", "launch", "collectives", "collectives.*")),
    ("mesh", ("mesh",)),
    ("trace", ("trace",)),
    ("tensor", ("tensor",)),
    ("replay", ("program", "overlap", "dryrun", "tpu", "tpu.*")),
    ("ops", ("ops", "ops.*", "partials", "gemm", "cublas", "creation")),
    ("autodiff", ("autodiff", "buckets")),
    ("engines", ("compiled", "fusion", "rowfusion", "graphs", "remat", "pipeline", "stages", "cost", "cost.*")),
    ("optim", ("optim", "sharding")),
    ("layers", ("layers", "layers.*")),
    ("api", ("profile", "timeline", "timeline_plot", "checkpoint", "checkpoint_sync", "async_save", "safetensors_io",
             "repl", "testing", "testing.*", "")),
    ("apps", ("apps.*",)),
)
"""Layers, bottom to top (modules relative to `mpimesh`, "" the package itself): `docs/architecture.md`'s
module map and `/work/shared/ARCHITECTURE.md`'s order (trace, tensor, ops, autodiff with its buckets,
optim, layers, apps). The package `collectives` (its `make` builds a transport) sits with the transports,
above `backend`; `counters` sits below. `opdef` (what an op is: numpy only) sits below the
collectives and the trace. `replay` holds what reads recorded ops without calling one
(`program`, the dry run, the JAX replay); creation ops sit with the ops. An arrow within a layer is
not upward; `cycles` catches loops there."""

_LIVENESS_NAME = re.compile(r"lifetime|liveness|last_?use|last_?read|read_?after|live_?range", re.I)
_LIVENESS_PROSE = re.compile(r"\blast (use|uses|used|reader|readers|read|reads|need|needs)\b|\blifetimes?\b|"
                             r"\bliveness\b|\bmay (release|free)\b|\breleased? once\b|\bread after\b|"
                             r"\bno longer (read|needed|used)\b", re.I)
_MUTATORS = {"add", "setdefault", "update", "discard", "pop", "remove", "append"}
_ARRAY_MODULES = {"numpy", "cupy", "jax", "jax.numpy"}


@dataclass(frozen=True)
class Match:
    """One thing a count found: where (`path` relative to the root, `line`) and what."""
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _files(root: Path, where: Sequence[str], skip: Sequence[str] = ()) -> List[Path]:
    out = []
    for w in where:
        p = root / w
        found = [p] if p.suffix == ".py" else sorted(p.rglob("*.py"))
        out += [f for f in found if f.is_file() and not any(_rel(root, f).startswith(s) for s in skip)]
    return out


@lru_cache(maxsize=None)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def _module(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _functions(tree: ast.AST) -> List[ast.AST]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]


def _in_functions(tree: ast.AST) -> set:
    """ids of the nodes inside some function's body."""
    return {id(n) for f in _functions(tree) for n in ast.walk(f) if n is not f}


# -- op names in engines -------------------------------------------------------------------------

def _container_elts(node: ast.AST) -> Optional[list]:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1 and \
            node.func.id in ("frozenset", "set", "tuple", "list", "dict") and not node.keywords:
        node = node.args[0]
    if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        return node.elts
    if isinstance(node, ast.Dict):
        return [k for k in node.keys if k is not None]
    return None


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _is_str_container(node: ast.AST) -> bool:
    """A literal set, tuple, list or dict (its keys) of strings (f-strings and `*spreads` allowed)."""
    elts = _container_elts(node)
    return bool(elts) and any(map(_is_str, elts)) and \
        all(_is_str(e) or isinstance(e, (ast.JoinedStr, ast.Starred)) for e in elts)


def _str_containers(tree: ast.Module, module_level: bool) -> Dict[str, int]:
    """Names bound to string containers (at module level only, or anywhere) -> line."""
    nodes = tree.body if module_level else list(ast.walk(tree))
    out = {}
    for n in nodes:
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        if targets and n.value is not None and _is_str_container(n.value):
            out.update({t.id: n.lineno for t in targets if isinstance(t, ast.Name)})
    return out


class _OpNameVisitor(ast.NodeVisitor):
    """Collects the op-name matches of one engine module (see `op_name_matches`)."""

    def __init__(self, rel: str, containers: Dict[str, int]):
        self.rel, self.containers, self.used = rel, containers, set()
        self.fn: List[str] = []
        self.found: List[Match] = []

    def _add(self, node: ast.AST, why: str) -> None:
        self.found.append(Match(self.rel, node.lineno, f"{why}: {ast.unparse(node)[:100]}"))

    def _op_name(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "name"
        # a bare `name`: an op's, except in a dunder (`__getattr__(self, name)` gets attribute names)
        return isinstance(node, ast.Name) and node.id in ("name", "op_name") and \
            not (self.fn and self.fn[-1].startswith("__"))

    def _container(self, node: ast.AST) -> bool:
        key = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if key in self.containers:
            self.used.add(key)
            return True
        return False

    def _strings(self, node: ast.AST) -> bool:
        return _is_str(node) or _is_str_container(node) or self._container(node)

    def visit_FunctionDef(self, node) -> None:
        self.fn.append(node.name)
        self.generic_visit(node)
        self.fn.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Compare(self, node: ast.Compare) -> None:
        sides = [node.left, *node.comparators]
        for a, op, b in zip(sides, node.ops, sides[1:]):
            if isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) and (
                    (self._op_name(a) and self._strings(b)) or (self._op_name(b) and _is_str(a))):
                self._add(node, "compares an op's name")
            if any(_is_module_of(s) for s in (a, b)):
                self._add(node, "tests a kernel's __module__")
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if self._op_name(node.slice) and (self._container(node.value) or _is_str_container(node.value)):
            self._add(node, "looks up an op's name")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Attribute) and node.args:
            if f.attr in ("get", "pop", "setdefault") and self._op_name(node.args[0]) and self._container(f.value):
                self._add(node, "looks up an op's name")
            elif f.attr in ("startswith", "endswith") and self._op_name(f.value) and self._strings(node.args[0]):
                self._add(node, "compares an op's name")
        self.generic_visit(node)

    def visit_Match(self, node) -> None:  # `match rec.name: case "psum": ...`
        if self._op_name(node.subject):
            for case in node.cases:
                if any(isinstance(p, ast.MatchValue) and _is_str(p.value) for p in ast.walk(case.pattern)):
                    self._add(case.pattern, "matches an op's name")
        self.generic_visit(node)


def _is_module_of(node: ast.AST) -> bool:
    """`x.__module__` or `getattr(x, "__module__", ...)`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "__module__"
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and \
        len(node.args) >= 2 and _is_str(node.args[1]) and node.args[1].value == "__module__"


def op_name_matches(root: Path = ROOT) -> List[Match]:
    """Engine code that tells ops apart by name (goal 0: they read the op's definition instead).

    In `ENGINES`: comparisons (`==`, `!=`, `in`, `startswith`, `match`) of an op-name expression
    (`<anything>.name`, or a variable `name`/`op_name` outside dunder methods) with a string literal, a
    literal container of strings, or a name bound to one; lookups `CONTAINER[name]`, `.get(name)`;
    every module-level string container such a match uses (one match at its definition); and tests
    of a kernel's `__module__`."""
    found: List[Match] = []
    everywhere = {k: v for f in _files(root, ["mpimesh"]) for k, v in _str_containers(_parse(f), True).items()}
    for path in _files(root, ENGINES):
        tree, rel = _parse(path), _rel(root, path)
        own = _str_containers(tree, True)
        v = _OpNameVisitor(rel, {**everywhere, **_str_containers(tree, False)})
        v.visit(tree)
        found += v.found
        found += [Match(rel, own[k], f"keeps op names in {k}") for k in sorted(v.used) if k in own]
    return sorted(set(found), key=lambda m: (m.path, m.line, m.what))


# -- liveness ------------------------------------------------------------------------------------

def _calls(node: ast.AST) -> set:
    return {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in ast.walk(node)
            if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}


def _keeps_ids(node: ast.AST) -> bool:
    """Takes tensors' identities (`id(...)`) and stores into a container (a subscript or a mutator)."""
    stores = any(isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) for n in ast.walk(node))
    calls = _calls(node)
    return "id" in calls and (stores or bool(calls & _MUTATORS))


def liveness_computations(root: Path = ROOT) -> List[Match]:
    """Classes and functions that compute when tensors are last used (goal 1: the program's analysis).

    In `mpimesh/` (not `collectives/` or `testing/`, where liveness is of ranks and hosts), a definition
    counts when its name says liveness (`lifetime`, `liveness`, `last_use`, `read_after`, ...), or
    when its docstring does ("last use", "last reader", "lifetimes", "may release", "released once",
    ...) and it keeps state by tensor identity (calls `id()` and stores into a container). Not counted:
    one nested in a counted one (its class counts), and one that calls another counted one or a
    function of `mpimesh/liveness.py` (a user of that analysis, e.g. the cost model's pricing loop
    creating a `_Lifetimes`)."""
    cands: List[Tuple[str, ast.AST, str]] = []
    for path in _files(root, ["mpimesh"], skip=("mpimesh/collectives", "mpimesh/testing")):
        rel = _rel(root, path)
        for node in ast.walk(_parse(path)):
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = " ".join((ast.get_docstring(node) or "").split())
            if _LIVENESS_NAME.search(node.name):
                cands.append((rel, node, f"{node.name} (its name)"))
            elif _LIVENESS_PROSE.search(doc) and _keeps_ids(node):
                cands.append((rel, node, f"{node.name} (docstring: {_LIVENESS_PROSE.search(doc).group(0)!r})"))
    inner = {id(n) for _, c, _ in cands for n in ast.walk(c) if n is not c}
    outer = [c for c in cands if id(c[1]) not in inner]
    shared = root / "mpimesh" / "liveness.py"  # the one analysis: calling any of it makes a user
    names = {c[1].name for c in outer} | ({n.name for n in _parse(shared).body if isinstance(n, ast.FunctionDef)}
                                          if shared.exists() else set())
    return [Match(rel, node.lineno, why) for rel, node, why in outer
            if not (_calls(node) & (names - {node.name} - {n.name for n in ast.walk(node) if hasattr(n, "name")}))]


# -- which backend ---------------------------------------------------------------------------------

def _resolve(root: Path, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module of `from X import ...` in `path`."""
    if not node.level:
        return node.module or ""
    pkg = _module(root, path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    pkg = pkg[:len(pkg) - (node.level - 1)]
    return ".".join(pkg + ([node.module] if node.module else []))


def _bindings(root: Path, path: Path, tree: ast.Module) -> Tuple[Dict[str, str], Dict[str, str]]:
    """(local name -> module it binds, local name -> `module.attr` it binds) for every import in `tree`."""
    mods, attrs = {}, {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                mods[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom):
            base = _resolve(root, path, n)
            for a in n.names:
                attrs[a.asname or a.name] = f"{base}.{a.name}"
                mods[a.asname or a.name] = f"{base}.{a.name}"  # (a submodule, or else never used as one)
    return mods, attrs


def backend_name_calls(root: Path = ROOT) -> List[Match]:
    """Calls of `mpimesh.backend.name` (`name(xp)`, `backend.name(...)`, any alias) outside `BACKEND_LAYER`."""
    found = []
    for path in _files(root, ["mpimesh"], skip=BACKEND_LAYER):
        tree = _parse(path)
        mods, attrs = _bindings(root, path, tree)
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            if (isinstance(f, ast.Name) and attrs.get(f.id) == "mpimesh.backend.name") or (
                    isinstance(f, ast.Attribute) and f.attr == "name" and isinstance(f.value, ast.Name)
                    and mods.get(f.value.id) == "mpimesh.backend"):
                found.append(Match(_rel(root, path), n.lineno, ast.unparse(n)))
    return found


def _mentions_dunder_name(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Attribute) and n.attr == "__name__") or
               (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr" and
                len(n.args) >= 2 and _is_str(n.args[1]) and n.args[1].value == "__name__") for n in ast.walk(node))


def array_module_tests(root: Path = ROOT) -> List[Match]:
    """Tests of which array module is in use outside `BACKEND_LAYER`: `x is np` / `x is not numpy`
    (any name bound to numpy or cupy), and `xp.__name__ == "cupy"` / `getattr(xp, "__name__", "") ==
    "numpy"` (a `__name__` compared with an array module's name)."""
    found = []
    for path in _files(root, ["mpimesh"], skip=BACKEND_LAYER):
        tree = _parse(path)
        mods, _ = _bindings(root, path, tree)
        arrays = {k for k, m in mods.items() if m in ("numpy", "cupy")}
        for n in ast.walk(tree):
            if not isinstance(n, ast.Compare):
                continue
            sides = [n.left, *n.comparators]
            for a, op, b in zip(sides, n.ops, sides[1:]):
                if isinstance(op, (ast.Is, ast.IsNot)) and any(isinstance(s, ast.Name) and s.id in arrays
                                                               for s in (a, b)):
                    found.append(Match(_rel(root, path), n.lineno, ast.unparse(n)))
                elif isinstance(op, (ast.Eq, ast.NotEq)) and any(
                        _mentions_dunder_name(s) and _is_str(t) and t.value in _ARRAY_MODULES
                        for s, t in ((a, b), (b, a))):
                    found.append(Match(_rel(root, path), n.lineno, ast.unparse(n)))
    return found


def backend_string_tests(root: Path = ROOT) -> List[Match]:
    """`<x>.backend == "cupy"`-style tests (a mesh's backend name) outside `BACKEND_LAYER`: not in the
    issue's count, listed because they ask the same question."""
    found = []
    for path in _files(root, ["mpimesh"], skip=BACKEND_LAYER):
        for n in ast.walk(_parse(path)):
            if isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], (ast.Eq, ast.NotEq)):
                a, b = n.left, n.comparators[0]
                if any(isinstance(s, ast.Attribute) and s.attr == "backend" and _is_str(t) and t.value in _ARRAY_MODULES
                       for s, t in ((a, b), (b, a))):
                    found.append(Match(_rel(root, path), n.lineno, ast.unparse(n)))
    return found


# -- docstrings ----------------------------------------------------------------------------------

def long_docstrings(root: Path = ROOT, limit: int = 15) -> List[Match]:
    """Module, class and function docstrings in `mpimesh/` and `apps/` spanning more than `limit` source
    lines (from the opening quotes' line to the closing quotes' line)."""
    found = []
    for path in _files(root, ["mpimesh", "apps"]):
        for n in ast.walk(_parse(path)):
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body and \
                    isinstance(n.body[0], ast.Expr) and _is_str(n.body[0].value):
                doc = n.body[0].value
                lines = doc.end_lineno - doc.lineno + 1
                if lines > limit:
                    what = f"module {_module(root, path)}" if isinstance(n, ast.Module) else n.name
                    found.append(Match(_rel(root, path), doc.lineno, f"{what}: {lines} lines"))
    return found


# -- imports -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arrow:
    """`src` imports `dst` (modules named from the root: `mpimesh.trace`, `apps.transformer`)."""
    path: str
    line: int
    src: str
    dst: str
    local: bool  # inside a function
    statement: str
    implied: bool = False  # a package the import runs on its way to the module it names


def _ancestors(mod: str) -> List[str]:
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_arrows(root: Path = ROOT) -> List[Arrow]:
    """Every import of an `mpimesh` module by `mpimesh/` or `apps/`, function-local ones included. Importing
    `a.b.c` also runs the packages `a` and `a.b`: arrows to those too (not to the importer's own packages,
    already running, unless imported by name). Imports under `if TYPE_CHECKING:` would count as well
    (there are none)."""
    files = _files(root, ["mpimesh", "apps"])
    known = {_module(root, f) for f in files}
    arrows = []
    for path in files:
        tree, src = _parse(path), _module(root, path)
        local = _in_functions(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                named = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = _resolve(root, path, n)
                subs = [f"{base}.{a.name}" for a in n.names if f"{base}.{a.name}" in known]
                named = subs + ([base] if len(subs) < len(n.names) else [])
            else:
                continue
            dsts: Dict[str, bool] = {}
            for m in named:
                if m.split(".")[0] == "mpimesh":
                    dsts.update({p: dsts.get(p, True) for p in _ancestors(m) if p not in _ancestors(src)})
                    dsts[m] = False
            for d, implied in dsts.items():
                if d != src:
                    arrows.append(Arrow(_rel(root, path), n.lineno, src, d, id(n) in local, ast.unparse(n), implied))
    return arrows


def layer_of(module: str) -> Optional[int]:
    """The index in `LAYERS` of a module (`mpimesh.trace`, `apps.cli`), or None when no layer holds it.

    >>> [LAYERS[layer_of(m)][0] for m in ("mpimesh.counters", "mpimesh.collectives.mpi", "mpimesh")]
    ['counters', 'runtime', 'api']
    """
    name = module[len("mpimesh."):] if module.startswith("mpimesh.") else "" if module == "mpimesh" else module
    for i, (_, mods) in enumerate(LAYERS):
        if name in mods:
            return i
    best = None
    for i, (_, mods) in enumerate(LAYERS):
        for m in mods:
            if m.endswith(".*") and name.startswith(m[:-1]) and (best is None or len(m) > best[1]):
                best = (i, len(m))
    return None if best is None else best[0]


def upward_imports(root: Path = ROOT) -> List[Match]:
    """Imports whose module sits in a higher layer of `LAYERS` than the importer (function-local ones
    included), and modules that no layer places (each needs a place before it can be judged)."""
    found, arrows = [], import_arrows(root)
    for f in _files(root, ["mpimesh", "apps"]):
        if layer_of(_module(root, f)) is None:
            found.append(Match(_rel(root, f), 1, f"{_module(root, f)} is in no layer of LAYERS"))
    for a in arrows:
        s, d = layer_of(a.src), layer_of(a.dst)
        if s is not None and d is not None and d > s:
            runs = " (the package, which this import runs)" if a.implied else ""
            where = "in a function, " if a.local else ""
            found.append(Match(a.path, a.line, f"{a.src} ({LAYERS[s][0]}) -> {a.dst}{runs} ({LAYERS[d][0]}): "
                                               f"{where}`{a.statement}`"))
    return found


def cycles(root: Path = ROOT) -> List[Match]:
    """Import cycles among modules (function-local imports included): one match per strongly connected
    set of modules, showing one loop through it."""
    graph: Dict[str, Dict[str, Arrow]] = {}
    for a in import_arrows(root):
        graph.setdefault(a.src, {}).setdefault(a.dst, a)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    comps: List[List[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for comp in comps:
        if len(comp) > 1:
            loop = _loop(graph, set(comp), min(comp))
            first = graph[loop[0]][loop[1]]
            found.append(Match(first.path, first.line, " -> ".join(loop)))
    return found


def _loop(graph: Dict[str, Dict[str, Arrow]], comp: set, start: str) -> List[str]:
    """A shortest path start -> ... -> start within `comp` (breadth first)."""
    prev: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def _optional(root: Path) -> set:
    """Optional packages: cupy, jax, torch; those `mpimesh/extras.py`'s docstring names, `require()`
    asks for, and `pyproject.toml`'s optional dependencies list."""
    names = {"cupy", "cupyx", "cupy_backends", "jax", "jaxlib", "torch"}
    extras = root / "mpimesh" / "extras.py"
    if extras.is_file():
        tree = _parse(extras)
        head = re.search(r"\(([^)]*)\)", (ast.get_docstring(tree) or "").split("\n")[0])
        names |= {w.strip() for w in head.group(1).split(",")} if head else set()
    for f in _files(root, ["mpimesh"]):
        for n in ast.walk(_parse(f)):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "require" and \
                    n.args and _is_str(n.args[0]):
                names.add(n.args[0].value.split(".")[0])
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        section = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[|\Z)", pyproject.read_text(), re.S | re.M)
        for dist in re.findall(r"\"([A-Za-z0-9_.-]+)", section.group(1) if section else ""):
            names.add(dist.replace("-", "_").lower())
    return names


def local_imports(root: Path = ROOT, mpimesh_only: bool = False) -> List[Match]:
    """Import statements inside functions in `mpimesh/`, but for optional packages (`_optional`); with
    `mpimesh_only`, those of mpimesh's own modules."""
    optional, found = _optional(root), []
    for path in _files(root, ["mpimesh"]):
        tree = _parse(path)
        for f in _functions(tree):
            for n in ast.walk(f):
                if isinstance(n, ast.ImportFrom):
                    top = _resolve(root, path, n).split(".")[0]
                elif isinstance(n, ast.Import):
                    top = n.names[0].name.split(".")[0]
                else:
                    continue
                if top not in optional and (top == "mpimesh" or not mpimesh_only):
                    found.append(Match(_rel(root, path), n.lineno, ast.unparse(n)))
    return sorted(set(found), key=lambda m: (m.path, m.line))


COUNTS: Tuple[Tuple[str, Optional[int], Callable[[Path], List[Match]]], ...] = (
    ("op-name string matches in engines", 0, op_name_matches),
    ("liveness computations", 1, liveness_computations),
    ("backend name() calls outside backend.py", 0, backend_name_calls),
    ("xp is np / __name__ == 'cupy' tests outside backend.py", 0, array_module_tests),
    ("  (not counted by the issue) .backend == 'cupy' tests", None, backend_string_tests),
    ("docstrings over 15 lines", 0, long_docstrings),
    ("upward import arrows", 0, upward_imports),
    ("import cycles", 0, cycles),
    ("function-local imports (not of optional packages)", 0, local_imports),
    ("  of which of mpimesh modules", 0, lambda root: local_imports(root, mpimesh_only=True)),
)
"""(label, goal or None, count function) per row of the table."""


def table(root: Path = ROOT) -> List[Tuple[str, Optional[int], int, List[Match]]]:
    """(label, goal, count now, matches) for each of `COUNTS`."""
    rows = []
    for label, goal, count in COUNTS:
        matches = count(root)
        rows.append((label, goal, len(matches), matches))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verbose", "-v", action="store_true", help="list each match as file:line")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to count (default: %(default)s)")
    args = ap.parse_args(argv)
    rows = table(args.root.resolve())
    width = max(len(label) for label, _, _, _ in rows)
    print(f"{'count':<{width}}  {'goal':>4}  {'now':>4}")
    for label, goal, now, matches in rows:
        print(f"{label:<{width}}  {'-' if goal is None else goal:>4}  {now:>4}")
        if args.verbose:
            for m in matches:
                print(f"    {m}")


if __name__ == "__main__":
    main()
