"""Each op's declaration (`mpimesh.opdef.OpDef`) against the op as it runs.

For every case below, the same call runs on a real mesh under `mm.profile()` and dry on a `DryMesh`
of the mesh's shape and rules: the dry run's collectives (kind, mesh dims, calls, elements, bytes),
flops, and each output's dtype and block shape must equal rank 0's (coordinate 0, whose blocks the
dry run follows), on uneven blocks too. The dry run computes nothing: it reads the ops' `abstract`
rules, so a rule that forgets a collective or gets a dtype wrong fails here. The flops are checked
against formulas written here (elementwise: one per element, ...).

A case is `(name, input specs, layout rules, fn, flops formula)`: specs are `(shape, dtype)`, the
inputs made from seeded numpy arrays and laid out by the rules; `fn(*tensors)` returns a tensor or
a tuple of them; `flops(shapes)` the flops rank 0 must count from its blocks' shapes (None: not
checked).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from meshes import mesh_shapes

import mpimesh as mm
from mpimesh.collectives import counters
from mpimesh.dryrun import DryMesh, placeholder

pytestmark = pytest.mark.mpi


def _elements(blocks) -> int:
    return math.prod(blocks[0])


CASES = [
    ("exp", [("a:7;b:5", "float32")], "a:M0", lambda x: mm.exp(x), lambda ins, outs: _elements(outs)),
    ("add, broadcast", [("a:7;b:5", "float32"), ("b:5", "float64")], "a:M0;b:M1", lambda x, y: x + y,
     lambda ins, outs: _elements(outs)),
    ("multiply by a number", [("a:9", "bfloat16")], "a:M0", lambda x: x * 2.0, lambda ins, outs: _elements(outs)),
    ("int32 + float32", [("a:6;b:3", "int32"), ("a:6;b:3", "float32")], "b:M0", lambda x, y: x + y,
     lambda ins, outs: _elements(outs)),
    ("where", [("a:7", "bool"), ("a:7", "float32")], "a:M0", lambda c, x: mm.where(c, x, 0.5), None),
    ("cast", [("a:7;b:2", "float32")], "b:M0", lambda x: mm.cast(x, "bfloat16"), None),
    ("axpy", [("a:7;b:2", "float64"), ("b:2;a:7", "float64")], "a:M0", lambda x, y: mm.axpy(-0.5, x, y),
     lambda ins, outs: 2 * _elements(outs)),
]


def _rules(spec: str, mesh) -> str:
    """`spec` with M0, M1, ... the mesh's dims in order (a rule on a mesh dim it lacks is dropped)."""
    names = mesh.shape.names
    rules = []
    for rule in filter(None, spec.split(";")):
        dim, m = rule.split(":")
        k = int(m[1:])
        if k < len(names):
            rules.append(f"{dim}:{names[k]}")
    return ";".join(rules)


def _inputs(mesh, specs, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for shape, dtype in specs:
        sizes = mm.Shape(shape).sizes
        a = rng.standard_normal(sizes) if dtype != "bool" else rng.random(sizes) > 0.5
        out.append(mesh.from_numpy(a.astype(dtype), shape))
    return out


def _outputs(result) -> list:
    return list(result) if isinstance(result, (tuple, list)) else [result]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("shape", mesh_shapes())
def test_the_dry_run_counts_what_rank_0_does(case, shape):
    name, specs, rule_spec, fn, flops = case
    mesh = mm.Mesh(shape)
    rules = _rules(rule_spec, mesh)
    with mm.layout_scope(mesh, rules):
        xs = _inputs(mesh, specs)
        with mm.profile() as prof:
            real = _outputs(fn(*xs))
    dry = DryMesh(shape, rules)
    ghosts = [placeholder(dry, x.shape, x.dtype, x.tensor_layout) for x in xs]
    with counters.counting() as counts:
        ghost_outs = _outputs(fn(*ghosts))
    if MPI.COMM_WORLD.Get_rank() == 0:
        got = {k: v for k, v in counts.items() if k != "flops"}
        want = {k: v for k, v in prof.counters.items() if k not in ("flops", "copies")}
        assert got == want, (name, shape)
        for r, g in zip(real, ghost_outs):
            assert (g.dtype, g.local.shape) == (r.dtype, r.local.shape), (name, shape)
        if flops is not None:
            expected = flops([x.local.shape for x in xs], [r.local.shape for r in real])
            assert prof.counters.get("flops", {}).get("flops", 0) == expected, name
            assert counts.get("flops", {}).get("flops", 0) == expected, name
