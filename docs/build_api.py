"""Build the API reference (HTML from the docstrings, with pdoc) and check that it covers the public API.

Usage::

    python docs/build_api.py [OUT]        # default docs/api/ (git-ignored); then open OUT/index.html
    python3 install.py docs -- docs/build_api.py    # the same, installing the `docs` extra (pdoc) first

It imports mpimesh (which initialises MPI: run it as a plain process, or under ``mpiexec -n 1``) and
documents the package as ``pdoc`` sees it: ``mpimesh`` lists every name of ``mpimesh.__all__`` on its own
page, ``mpimesh.layers`` (no ``__all__``) points to one page per layer module, and ``mpimesh.optim``,
``mpimesh.tpu``, ``mpimesh.cost`` and ``mpimesh.threads`` have a page each. JAX is not imported
(``mpimesh.tpu`` imports it only to build a replay).

The exit status is non-zero when:

- a module does not import (pdoc raises), or pdoc warns about anything (a module that fails to load, a
  name in ``__all__`` that does not resolve, an attribute that raises, a docstring include it cannot read);
  pdoc does not validate docstrings beyond that;
- a public name of ``mm``, ``mm.layers``, ``mm.optim``, ``mm.tpu``, ``mm.cost`` or ``mm.threads``, or a
  public member of one of their classes, has no entry (no anchor) in the HTML, or ``mpimesh/__init__.py``
  imports a public name that its ``__all__`` leaves out;
- one of those names or members has no docstring (a property's is its getter's; an attribute's, a
  string literal right after its assignment or class-level annotation, as pdoc reads them).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "api"
PACKAGE = "mpimesh"
# The modules whose public names the reference must cover (and document):
# `mm`, `mm.layers`, `mm.optim`, `mm.tpu`, `mm.cost`, `mm.threads`.
PUBLIC_MODULES = ("mpimesh", "mpimesh.layers", "mpimesh.optim", "mpimesh.tpu", "mpimesh.cost", "mpimesh.threads")
# pdoc's anchors for documented objects: <section id="einsum"> (module level) and
# <div id="Mesh.zeros" class="classattr"> (class members). Headings inside docstrings are <h6 id=...>.
_ANCHOR = re.compile(r'<(?:section|div) id="([^"]+)"')


def build(out: Path, modules: Sequence[str] = (PACKAGE,)) -> List[str]:
    """Write the HTML reference for `modules` and their submodules into `out`.

    Returns pdoc's warnings as strings (empty when clean). An import error propagates. Deprecation
    warnings that importing other libraries may raise are not pdoc's and are left out. The files are
    those `pdoc.pdoc(*modules, output_directory=out)` writes, made from `pdoc_module`'s documentation
    (so a re-exported variable keeps its docstring).
    """
    if str(ROOT) not in sys.path:  # `python docs/build_api.py` from a checkout that is not installed
        sys.path.insert(0, str(ROOT))
    import pdoc.extract
    import pdoc.render

    # Google-style "Args:"/"Returns:"/"Raises:" sections become lists; Markdown and doctests as usual.
    pdoc.render.configure(docformat="google", footer_text="mpimesh API reference")
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        all_modules = {name: pdoc_module(name) for name in pdoc.extract.walk_specs(modules)}
        for name, module in all_modules.items():
            html_file = page(out, name)
            html_file.parent.mkdir(parents=True, exist_ok=True)
            html_file.write_bytes(pdoc.render.html_module(module, all_modules).encode())
        for file, text in (("index.html", pdoc.render.html_index(all_modules)),
                           ("search.js", pdoc.render.search_index(all_modules))):
            if text:
                (out / file).write_bytes(text.encode())
    return [f"{w.category.__name__}: {w.message}" for w in caught
            if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning))]


def public_names(module: ModuleType) -> List[str]:
    """The module's `__all__`, else its names that do not start with `_` and are not modules."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [n for n, v in vars(module).items() if not n.startswith("_") and not inspect.ismodule(v)]


def unexported(module: ModuleType) -> List[str]:
    """Public, non-module names that `module` binds but its `__all__` leaves out (none without `__all__`).

    Only meaningful for a module that is all re-exports, like `mpimesh/__init__.py`: its `__all__` is
    what the reference documents, so a new import missing from it would vanish from the reference.
    """
    names = getattr(module, "__all__", None)
    if names is None:
        return []
    return sorted(n for n, v in vars(module).items()
                  if not n.startswith("_") and not inspect.ismodule(v) and n not in names)


def page(out: Path, module_name: str) -> Path:
    """The HTML file pdoc writes for a module: `mpimesh.layers` -> `OUT/mpimesh/layers.html`."""
    return out / (module_name.replace(".", "/") + ".html")


_anchor_cache: Dict[Tuple[Path, float], Set[str]] = {}


def anchors(html_file: Path) -> Set[str]:
    """The ids of the documented objects in one page (empty if the page does not exist)."""
    if not html_file.is_file():
        return set()
    key = (html_file, html_file.stat().st_mtime)
    if key not in _anchor_cache:
        _anchor_cache[key] = set(_ANCHOR.findall(html_file.read_text(encoding="utf-8")))
    return _anchor_cache[key]


def _class_members(cls: type) -> List[str]:
    """Public attributes a class defines itself (methods, properties, class attributes)."""
    return [n for n in vars(cls) if not n.startswith("_")]


def locate(out: Path, module: ModuleType, name: str) -> Optional[Tuple[Path, str]]:
    """Where the reference documents `module.name`: `(html_file, anchor)`, or None if nowhere.

    The name's entry is on the module's own page. A module without `__all__` gets only the objects
    defined in it on its page (pdoc's rule), so a re-exported function or class there is looked up on
    the page of the module that defines it (`mm.layers.dense` -> `mpimesh/layers/core.html#dense`).
    A submodule is documented when its own page exists.
    """
    obj = getattr(module, name, None)
    if inspect.ismodule(obj):
        p = page(out, obj.__name__)
        return (p, "") if p.is_file() and obj.__name__.startswith(PACKAGE + ".") else None
    own = page(out, module.__name__)
    if name in anchors(own):
        return own, name
    if getattr(module, "__all__", None) is None and (inspect.isclass(obj) or inspect.isfunction(obj)):
        home = page(out, obj.__module__)
        if obj.__qualname__ in anchors(home):
            return home, obj.__qualname__
    return None


def missing(out: Path, modules: Sequence[str] = PUBLIC_MODULES) -> List[str]:
    """Every public name of `modules` (and public member of their public classes) absent from the HTML
    in `out`, as `mpimesh.layers.dense` or `mpimesh.Mesh.zeros`; also each public name that
    `mpimesh/__init__.py` imports but leaves out of its `__all__`. Empty when the reference is complete."""
    problems = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        if module_name == PACKAGE:  # all re-exports: what it imports is public (other modules import helpers)
            problems += [f"{module_name}.{n} (imported but not in {module_name}.__all__)" for n in unexported(module)]
        for name in public_names(module):
            found = locate(out, module, name)
            if found is None:
                problems.append(f"{module_name}.{name}")
                continue
            obj = getattr(module, name, None)
            if inspect.isclass(obj):
                html_file, anchor = found
                ids = anchors(html_file)
                problems += [f"{module_name}.{name}.{m}" for m in _class_members(obj) if f"{anchor}.{m}" not in ids]
    return problems


def pdoc_module(name: str):
    """pdoc's documentation of the module `name` (a `pdoc.doc.Module`), with the docstrings of the
    variables it re-exports.

    pdoc reads a variable's docstring (the string literal after its assignment) from the source of the
    module it documents, so a package that re-exports a variable (`mm.cost.TPUV2`, assigned in
    `mpimesh/cost/machine.py`) would show it without one (pdoc issue #365: use pdoc as a library and
    set it). Such a variable takes the docstring from the submodule of `name` that binds the same
    object and documents it, as `locate` finds re-exported classes and functions where they are defined.

    Made afresh on each call (not pdoc's cached `Module.from_name`), from the modules as they are now.
    """
    import pdoc.doc

    module = pdoc.doc.Module(importlib.import_module(name))
    for member in module.members.values():
        if not isinstance(member, pdoc.doc.Variable) or member.docstring.strip():
            continue
        for sub in sorted(n for n in sys.modules if n.startswith(name + ".")):
            if getattr(sys.modules[sub], member.name, None) is member.default_value:
                home = pdoc.doc.Module(sys.modules[sub]).get(member.name)
                if isinstance(home, pdoc.doc.Variable) and home.docstring.strip():
                    member.docstring = home.docstring
                    break
    return module


def _documented_objects(modules: Sequence[str]) -> Iterator[Tuple[str, object]]:
    """(public name, pdoc doc object) for every public name of `modules` and their classes' members."""
    import pdoc.doc

    docs: Dict[str, object] = {}  # module name -> pdoc_module(name), once per call

    def doc_of(module_name: str):
        if module_name not in docs:
            docs[module_name] = pdoc_module(module_name)
        return docs[module_name]

    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in public_names(module):
            obj = getattr(module, name, None)
            if inspect.ismodule(obj):
                continue
            if getattr(module, "__all__", None) is None and (inspect.isclass(obj) or inspect.isfunction(obj)):
                doc = doc_of(obj.__module__).get(obj.__qualname__)
            else:
                doc = doc_of(module_name).get(name)
            if doc is None:
                continue
            yield f"{module_name}.{name}", doc
            if isinstance(doc, pdoc.doc.Class):
                for member in doc.own_members:
                    if not member.name.startswith("_"):
                        yield f"{module_name}.{name}.{member.name}", member


def undocumented(modules: Sequence[str] = PUBLIC_MODULES) -> List[str]:
    """Public names of `modules` (and public members of their classes) without a docstring in the
    reference, as `mpimesh.Shape.rank`. Empty when everything is documented."""
    return [full for full, doc in _documented_objects(modules) if not doc.docstring.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT,
                        help=f"output folder (default: {DEFAULT_OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    problems = [f"pdoc: {w}" for w in build(out)]
    problems += [f"not in the reference: {n}" for n in missing(out)]
    problems += [f"no docstring: {n}" for n in undocumented()]
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        print(f"API reference in {out}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"API reference written to {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
