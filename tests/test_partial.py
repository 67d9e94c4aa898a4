"""Partial sums as a tensor's state (`PartialTensor`, DTensor's `Partial`): a tensor whose blocks hold
each rank's terms of a sum over mesh dims not yet taken. `to_layout` takes the sum (an allreduce, or a
reduce-scatter where the target splits a dim over a mesh dim of the sum: each rank receives only its
block), no other op reads such a tensor, and a bucketed gradient's einsum leaves one (its sum the
bucket's)."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from meshes import mesh_shapes

import mpimesh as mm
from mpimesh.ops.relayout import to_layout
from mpimesh.tensor import PartialTensor

pytestmark = pytest.mark.mpi


def _terms(mesh, shape: str, layout: tuple, over: tuple, seed: int = 0):
    """A partial tensor over `over` whose terms are rank-dependent, and the global sum of the terms."""
    sizes = mm.Shape(shape).sizes
    groups = [np.random.default_rng(seed + r).standard_normal(sizes) for r in range(mesh.size)]
    coords = MPI.COMM_WORLD.allgather(mesh.coords)  # (by world rank: the mesh's own numbering may differ)
    total = np.zeros(sizes)
    for g, c in zip(groups, coords):  # the ranks of one group along the other mesh dims hold the same
        if all(c[m] == mesh.coords[m] for m in mesh.shape.names if m not in over):
            total += g
    full = mesh.from_numpy(groups[MPI.COMM_WORLD.Get_rank()], shape, dict(zip(mm.Shape(shape).names, layout)))
    return PartialTensor(mesh, full.shape, full.tensor_layout, full.local, over), total


@pytest.mark.parametrize("shape", mesh_shapes())
def test_to_layout_takes_the_sum_by_allreduce_or_reduce_scatter(shape):
    mesh = mm.Mesh(shape)
    m = mesh.shape.names[0]
    k = mesh.shape[m].size
    for target in ((None, None), (m, None), (None, m)):
        t, total = _terms(mesh, "a:7;b:5", (None, None), (m,))
        with mm.profile() as prof:
            y = to_layout(t, target)
        assert y.partial == () and y.tensor_layout == target
        np.testing.assert_allclose(y.to_numpy(), total, rtol=1e-12, atol=1e-12)
        if k > 1 and target == (None, None):
            assert prof.counters[f"allreduce/{m}"]["calls"] == 1 and f"reduce_scatter/{m}" not in prof.counters
        elif k > 1:  # each rank gets its block: a reduce-scatter, no allreduce
            assert prof.counters[f"reduce_scatter/{m}"]["calls"] == 1 and f"allreduce/{m}" not in prof.counters


@pytest.mark.parametrize("shape", mesh_shapes())
def test_ops_take_the_sum_first_and_no_kernel_reads_the_terms(shape):
    """An op lays its inputs out first (`to_layout`), which sums a partial tensor: values as of the sum;
    an op that would hand its kernel the terms (no relayout first) is refused, naming the pending sum."""
    from mpimesh.opdef import OpDef
    from mpimesh.trace import dispatch
    mesh = mm.Mesh(shape)
    t, total = _terms(mesh, "a:4", (None,), (mesh.shape.names[0],))
    np.testing.assert_allclose(mm.exp(t).to_numpy(), np.exp(total), rtol=1e-12)
    with pytest.raises(mm.MpimeshError, match=r"op 'raw': its input \[a:4\] float64 still awaits a sum over mesh dims"):
        dispatch(OpDef("raw", lambda ctx, a: a), [t], [(t.shape, t.tensor_layout)])
    with pytest.raises(mm.MpimeshError, match="still await a sum"):
        t.to_numpy()
    assert "partial over" in repr(t)


def test_a_bucketed_gradient_einsum_leaves_a_partial_tensor():
    """Data parallel: w's gradient is summed over the batch's mesh dim in a bucket; the einsum that
    makes it records a partial tensor, and the bucket's sum (psum) takes it."""
    n = MPI.COMM_WORLD.Get_size()
    mesh = mm.Mesh(f"all:{n}", layout="batch:all")
    x = mesh.from_numpy(np.arange(8.0 * 3).reshape(8, 3), "batch:8;io:3")
    w = mesh.from_numpy(np.ones((3, 2)), "io:3;out:2")
    with mm.trace() as tr:
        loss = mm.reduce_sum(mm.einsum([x, w]))
        (g,) = mm.gradients([loss], [w])
    np.testing.assert_allclose(g.to_numpy(), np.repeat(np.arange(24.0).reshape(8, 3).sum(0)[:, None], 2, 1))
    psums = [rec for rec in tr.ops if rec.op.bucketed]
    if n > 1:
        assert psums and all(rec.inputs[0].partial == ("all",) for rec in psums)
    else:
        assert not psums  # (nothing to sum over one rank)
