"""The API reference (docs/build_api.py, pdoc) builds without warnings and documents every public name of
`mm`, `mm.layers`, `mm.optim`, `mm.tpu`, `mm.cost` and `mm.threads`, and every public member of their
classes, each with a docstring; and the checks themselves report a name that is not there or has no
docstring. Runs in the 1-rank session only (it builds files, no MPI work)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from mpi4py import MPI

import mpimesh as mm

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="builds the docs once, in the 1-rank run")

ROOT = Path(__file__).resolve().parent.parent


def _load_build_api():
    spec = importlib.util.spec_from_file_location("build_api", ROOT / "docs" / "build_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def api():
    return _load_build_api()


@pytest.fixture(scope="module")
def built(api, tmp_path_factory):
    pytest.importorskip("pdoc")
    out = tmp_path_factory.mktemp("api")
    warnings = api.build(out)
    return out, warnings


def test_builds_without_warnings(built):
    out, warnings = built
    assert warnings == []
    assert (out / "index.html").is_file() and (out / "mpimesh.html").is_file()


def test_every_public_name_is_documented(api, built):
    out, _ = built
    assert api.missing(out) == []
    # spot checks of where the entries are: top-level names on mpimesh.html (its __all__), class members,
    # and a layer, re-exported by mm.layers, on the page of the module that defines it
    assert api.locate(out, mm, "einsum") == (out / "mpimesh.html", "einsum")
    assert api.locate(out, mm, "range") == (out / "mpimesh.html", "range")
    assert "Mesh.random_normal" in api.anchors(out / "mpimesh.html")
    assert api.locate(out, mm.layers, "dense") == (out / "mpimesh" / "layers" / "core.html", "dense")
    assert api.locate(out, mm.optim, "Adafactor") == (out / "mpimesh" / "optim.html", "Adafactor")
    assert api.locate(out, mm.tpu, "replay") == (out / "mpimesh" / "tpu.html", "replay")
    assert api.locate(out, mm, "layers") == (out / "mpimesh" / "layers.html", "")


def test_the_check_reports_what_is_missing(api, built, monkeypatch):
    out, _ = built

    def not_in_the_docs():
        """A layer added after the reference was built."""

    class Late:
        """A class added after the build."""

    monkeypatch.setattr(mm.layers, "not_in_the_docs", not_in_the_docs, raising=False)
    monkeypatch.setattr(mm.Mesh, "not_in_the_docs", lambda self: None, raising=False)
    monkeypatch.setattr(mm, "__all__", [*mm.__all__, "Late"])
    monkeypatch.setattr(mm, "Late", Late, raising=False)
    monkeypatch.setattr(mm, "imported_only", not_in_the_docs, raising=False)  # public, not in __all__
    assert api.locate(out, mm.layers, "not_in_the_docs") is None
    assert sorted(api.missing(out)) == ["mpimesh.Late", "mpimesh.Mesh.not_in_the_docs",
                                        "mpimesh.imported_only (imported but not in mpimesh.__all__)",
                                        "mpimesh.layers.not_in_the_docs"]


def test_every_public_name_has_a_docstring(api, built):
    out, _ = built
    assert api.undocumented() == []
    # a variable re-exported by a package (mm.cost.TPUV2, assigned in cost/machine.py) shows the
    # docstring of the module that assigns it on the package's page
    assert "One TPUv2 core" in (out / "mpimesh" / "cost.html").read_text(encoding="utf-8")


def test_the_check_reports_what_has_no_docstring(api, built, monkeypatch):
    def late(x):
        return x

    def no_docstring(self):
        return None

    monkeypatch.setattr(mm, "__all__", [*mm.__all__, "late"])
    monkeypatch.setattr(mm, "late", late, raising=False)
    monkeypatch.setattr(mm.Mesh, "no_docstring", no_docstring, raising=False)
    assert sorted(api.undocumented()) == ["mpimesh.Mesh.no_docstring", "mpimesh.late"]
