"""mm.einsum against numpy on the global arrays, over 1-D/2-D/3-D meshes and many layouts, and the
communication it does (one allreduce over the mesh dims of split contracted dims, nothing else)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshes import (  # noqa: E402
    big, collectives, Errors, expected_local, get_mesh, global_array, layouts, local_size, mesh_shapes)

import mpimesh as mm  # noqa: E402
from mpimesh.backend import to_host  # noqa: E402

SHAPES = mesh_shapes()


def tol(dtype) -> dict:
    return {"rtol": 1e-4, "atol": 1e-4} if np.dtype(dtype) == np.float32 else {"rtol": 1e-11, "atol": 1e-11}


def check_result(errs: Errors, what: str, y, ref: np.ndarray, out_names: tuple, rules: dict, dtype) -> None:
    """y has the expected shape, dtype, rules-given layout and local block of `ref`."""
    mesh = y.mesh
    errs.expect(y.shape.names == out_names, f"{what}: shape {y.shape} names != {out_names}")
    errs.expect(y.dtype == np.dtype(dtype), f"{what}: dtype {y.dtype} != {dtype}")
    want_layout = {d: m for d, m in rules.items() if d in out_names}
    errs.expect(y.layout == want_layout, f"{what}: layout {y.layout} != {want_layout}")
    local = to_host(y.local)
    want = expected_local(ref, out_names, y.layout, mesh)
    errs.expect(local.shape == want.shape, f"{what}: local shape {local.shape} != {want.shape}")
    if local.shape == want.shape:
        errs.close(what, local, want, **tol(dtype))


def rule_variants(mesh: mm.Mesh, dims: tuple) -> list[dict]:
    """Output rules: replicated, first output dim split, last output dim split, both split."""
    bd = big(mesh)
    out: list[dict] = [{}]
    if bd:
        out += [{dims[0]: bd[0]}, {dims[-1]: bd[-1]}]
    if len(bd) > 1:
        out.append({dims[0]: bd[1], dims[-1]: bd[0]})
    return out


# ---------------------------------------------------------------------------------------- values

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mshape", SHAPES)
def test_matmul_many_layouts(mshape: str, dtype) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a, b = global_array("b:8;i:16", 1, dtype), global_array("i:16;h:8", 2, dtype)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    for rules in rule_variants(mesh, ("b", "h")):
        for la in layouts(mesh, ["b", "i"], limit=5):
            for lb in layouts(mesh, ["i", "h"], limit=4):
                x = mesh.from_numpy(a, "b:8;i:16", layout=la)
                w = mesh.from_numpy(b, "i:16;h:8", layout=lb)
                with mm.layout_scope(mesh, rules):
                    y = mm.einsum([x, w])
                check_result(errs, f"rules={rules} x={la} w={lb}", y, ref, ("b", "h"), rules, dtype)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_matmul_to_numpy_and_inputs_untouched(mshape: str) -> None:
    mesh = get_mesh(mshape)
    bd = big(mesh)
    a, b = global_array("b:8;i:16", 3), global_array("i:16;h:8", 4)
    la = {"i": bd[0]} if bd else {}
    x = mesh.from_numpy(a, "b:8;i:16", layout=la)
    w = mesh.from_numpy(b, "i:16;h:8")
    y = mm.einsum([x, w], "b:8;h:8")
    got, xa, wb = y.to_numpy(), x.to_numpy(), w.to_numpy()
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(xa, a)
    np.testing.assert_array_equal(wb, b)
    assert x.layout == la and w.layout == {}


@pytest.mark.parametrize("mshape", SHAPES)
def test_batched_matmul(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a, b = global_array("n:8;b:8;i:8", 5), global_array("n:8;i:8;h:8", 6)
    ref = np.einsum("nbi,nih->nbh", a.astype(np.float64), b)
    rules_list = [{}] + [{"n": m} for m in big(mesh)[:1]] + [{"b": m} for m in big(mesh)[-1:]]
    for rules in rules_list:
        for la in layouts(mesh, ["n", "b", "i"], limit=4):
            for lb in layouts(mesh, ["n", "i", "h"], limit=3):
                x = mesh.from_numpy(a, "n:8;b:8;i:8", layout=la)
                w = mesh.from_numpy(b, "n:8;i:8;h:8", layout=lb)
                with mm.layout_scope(mesh, rules):
                    y1 = mm.einsum([x, w], output_shape="n:8;b:8;h:8")
                    y2 = mm.einsum([x, w], reduced_dims=["i"])  # every dim but i, in order
                for name, y in (("output_shape", y1), ("reduced_dims", y2)):
                    check_result(errs, f"{name} rules={rules} x={la} w={lb}", y, ref, ("n", "b", "h"),
                                 rules, np.float32)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_outer_product(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a, b = global_array("a:8", 7), global_array("b:16", 8)
    ref = np.outer(a.astype(np.float64), b)
    for rules in rule_variants(mesh, ("a", "b")):
        for la in layouts(mesh, ["a"]):
            for lb in layouts(mesh, ["b"]):
                x, w = mesh.from_numpy(a, "a:8", layout=la), mesh.from_numpy(b, "b:16", layout=lb)
                with mm.layout_scope(mesh, rules):
                    with mm.profile() as prof:
                        y = mm.einsum([x, w])
                check_result(errs, f"rules={rules} x={la} w={lb}", y, ref, ("a", "b"), rules, np.float32)
                # nothing is contracted: never an allreduce
                errs.expect(prof.elements("allreduce") == 0, f"outer product allreduced: {prof.counters}")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_three_operands(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a, b, c = (global_array("a:8;b:8", 9), global_array("b:8;c:16", 10), global_array("c:16;d:8", 11))
    ref = np.einsum("ab,bc,cd->ad", a.astype(np.float64), b, c)
    ref_t = ref.T
    bd = big(mesh)
    rules_list = [{}] + [{"d": m} for m in bd[:1]] + ([{"a": bd[0], "d": bd[1]}] if len(bd) > 1 else [])
    for rules in rules_list:
        for la in layouts(mesh, ["a", "b"], limit=3):
            for lb in layouts(mesh, ["b", "c"], limit=2):
                for lc in layouts(mesh, ["c", "d"], limit=2):
                    xs = [mesh.from_numpy(a, "a:8;b:8", layout=la), mesh.from_numpy(b, "b:8;c:16", layout=lb),
                          mesh.from_numpy(c, "c:16;d:8", layout=lc)]
                    with mm.layout_scope(mesh, rules):
                        y = mm.einsum(xs)  # default: a and d appear once
                        yt = mm.einsum(xs, output_shape=[mm.Dimension("d", 8), mm.Dimension("a", 8)])
                    what = f"rules={rules} {la} {lb} {lc}"
                    check_result(errs, what, y, ref, ("a", "d"), rules, np.float32)
                    check_result(errs, what + " transposed", yt, ref_t, ("d", "a"), rules, np.float32)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_contraction_to_scalar(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a, b = global_array("a:8;b:16", 12, np.float64), global_array("a:8;b:16", 13, np.float64)
    ref = np.array((a * b).sum())
    for la in layouts(mesh, ["a", "b"], limit=5):
        for lb in layouts(mesh, ["a", "b"], limit=3):
            x = mesh.from_numpy(a, "a:8;b:16", layout=la)
            w = mesh.from_numpy(b, "a:8;b:16", layout=lb)
            y_default = mm.einsum([x, w])  # every dim appears twice: a scalar
            y_empty = mm.einsum([x, w], output_shape=[])
            y_red = mm.einsum([x, w], reduced_dims=["a", "b"])
            for name, y in (("default", y_default), ("[]", y_empty), ("reduced_dims", y_red)):
                errs.expect(isinstance(y.local, mesh.xp.ndarray), f"{name}: local is {type(y.local)}")
                check_result(errs, f"{name} x={la} w={lb}", y, ref, (), {}, np.float64)
                errs.close(f"{name} to_numpy", y.to_numpy(), ref, rtol=1e-12)
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_transposed_output_and_partial_reduction(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a, b = global_array("b:8;i:16;j:8", 14), global_array("i:16;h:8", 15)
    ref_hb = np.einsum("bij,ih->hb", a.astype(np.float64), b)
    ref_jhb = np.einsum("bij,ih->jhb", a.astype(np.float64), b)
    ref_default = np.einsum("bij,ih->bjh", a.astype(np.float64), b)
    for rules in rule_variants(mesh, ("h", "b")):
        for la in layouts(mesh, ["b", "i", "j"], limit=5):
            x = mesh.from_numpy(a, "b:8;i:16;j:8", layout=la)
            w = mesh.from_numpy(b, "i:16;h:8", layout={})
            with mm.layout_scope(mesh, rules):
                y1 = mm.einsum([x, w], output_shape="h:8;b:8")
                y2 = mm.einsum([x, w], output_shape="j:8;h:8;b:8")
                y3 = mm.einsum([x, w], reduced_dims=[mm.Dimension("i", 16)])
                y4 = mm.einsum([x, w])  # default: b, j (only in x), h (only in w)
            what = f"rules={rules} x={la}"
            check_result(errs, what + " hb", y1, ref_hb, ("h", "b"), rules, np.float32)
            check_result(errs, what + " jhb", y2, ref_jhb, ("j", "h", "b"), rules, np.float32)
            check_result(errs, what + " reduced", y3, ref_default, ("b", "j", "h"), rules, np.float32)
            check_result(errs, what + " default", y4, ref_default, ("b", "j", "h"), rules, np.float32)
    errs.check()


def test_default_output_order() -> None:
    mesh = get_mesh(SHAPES[0])
    x = mesh.ones("p:2;q:3;r:4")
    w = mesh.ones("r:4;s:5;p:2")
    z = mesh.ones("t:6")
    assert mm.einsum([x, w]).shape == mm.Shape("q:3;s:5")
    assert mm.einsum([x, w, z]).shape == mm.Shape("q:3;s:5;t:6")
    assert mm.einsum([w, x]).shape == mm.Shape("s:5;q:3")
    assert mm.einsum([x]).shape == x.shape  # one input: every dim appears once
    assert mm.einsum([x, w], reduced_dims="r").shape == mm.Shape("p:2;q:3;s:5")
    np.testing.assert_allclose(mm.einsum([x, w, z]).to_numpy(), np.full((3, 5, 6), 8.0))


def test_bad_output_raises() -> None:
    mesh = get_mesh(SHAPES[0])
    x, w = mesh.ones("b:2;i:3"), mesh.ones("i:3;h:4")
    with pytest.raises(mm.ShapeError, match="z"):
        mm.einsum([x, w], output_shape="b:2;z:4")
    with pytest.raises(mm.ShapeError, match="h"):
        mm.einsum([x, w], output_shape="b:2;h:5")
    with pytest.raises(mm.ShapeError, match="i"):
        mm.einsum([x, mesh.ones("i:4;h:4")])


# --------------------------------------------------------------------------------- communication

@pytest.mark.parametrize("mshape", SHAPES)
def test_split_contracted_dim_allreduces_once(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    bd = big(mesh)
    if not bd:
        pytest.skip("no mesh dim of size > 1")
    a, b = global_array("b:8;i:16", 16), global_array("i:16;h:8", 17)
    ref = a.astype(np.float64) @ b
    sizes = {"b": 8, "i": 16, "h": 8}
    for m in bd:
        others = [o for o in bd if o != m]
        rules_list: list[dict] = [{}] + [{"b": o} for o in others[:1]]
        if len(others) > 1:
            rules_list.append({"b": others[0], "h": others[-1]})
        for rules in rules_list:
            la = {"i": m, **({"b": rules["b"]} if "b" in rules else {})}
            lb = {"i": m, **({"h": rules["h"]} if "h" in rules else {})}
            x = mesh.from_numpy(a, "b:8;i:16", layout=la)
            w = mesh.from_numpy(b, "i:16;h:8", layout=lb)
            with mm.layout_scope(mesh, rules), mm.profile() as prof:
                y = mm.einsum([x, w])
            check_result(errs, f"m={m} rules={rules}", y, ref, ("b", "h"), rules, np.float32)
            out_local = local_size(mesh, {"b": 8, "h": 8}, rules)
            want = {f"allreduce/{m}": {"calls": 1, "elements": out_local, "bytes": 4 * out_local}}
            errs.expect(collectives(prof) == want, f"m={m} rules={rules}: {collectives(prof)} != {want}")
            flops = 2 * local_size(mesh, sizes, {**la, **lb})
            errs.expect(prof.counters.get("flops", {}).get("flops") == flops,
                        f"m={m} rules={rules}: flops {prof.counters.get('flops')} != {flops}")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_two_split_contracted_dims_one_allreduce(mshape: str) -> None:
    mesh = get_mesh(mshape)
    bd = big(mesh)
    if len(bd) < 2:
        pytest.skip("needs two mesh dims of size > 1")
    m0, m1 = bd[0], bd[1]
    a, b = global_array("b:8;i:8;j:8", 18), global_array("j:8;i:8;h:8", 19)
    x = mesh.from_numpy(a, "b:8;i:8;j:8", layout={"i": m1, "j": m0})
    w = mesh.from_numpy(b, "j:8;i:8;h:8", layout={"i": m1, "j": m0})
    with mm.profile() as prof:
        y = mm.einsum([x, w], "b:8;h:8")
    got = to_host(y.local)
    np.testing.assert_allclose(got, np.einsum("bij,jih->bh", a.astype(np.float64), b), rtol=1e-4, atol=1e-4)
    # one allreduce over both mesh dims, named in mesh order
    assert collectives(prof) == {f"allreduce/{m0}+{m1}": {"calls": 1, "elements": 64, "bytes": 256}}
    k = mesh.shape[m0].size * mesh.shape[m1].size
    assert prof.counters["flops"] == {"calls": 1, "flops": 2 * 8 * 64 * 8 // k}


@pytest.mark.parametrize("mshape", SHAPES)
def test_no_split_contracted_dim_no_allreduce(mshape: str) -> None:
    mesh, errs = get_mesh(mshape), Errors()
    a, b = global_array("b:8;i:16", 20), global_array("i:16;h:8", 21)
    ref = a.astype(np.float64) @ b
    cases = [({}, {}, {})]
    for m in big(mesh):
        cases += [({"b": m}, {}, {"b": m}), ({}, {"h": m}, {"h": m}), ({"b": m}, {}, {})]
    # a contracted dim "split" over a size-1 mesh dim is not split at all
    cases += [({"i": d.name}, {"i": d.name}, {}) for d in mesh.shape if d.size == 1]
    for la, lb, rules in cases:
        x = mesh.from_numpy(a, "b:8;i:16", layout=la)
        w = mesh.from_numpy(b, "i:16;h:8", layout=lb)
        with mm.layout_scope(mesh, rules), mm.profile() as prof:
            y = mm.einsum([x, w])
        check_result(errs, f"x={la} w={lb} rules={rules}", y, ref, ("b", "h"), rules, np.float32)
        errs.expect(prof.elements("allreduce") == 0, f"x={la} w={lb} rules={rules}: {prof.counters}")
        if rules == {**la, **lb}:  # inputs already as the output needs: nothing at all moves
            errs.expect(collectives(prof) == {}, f"x={la} w={lb} rules={rules}: {collectives(prof)}")
            flops = 2 * local_size(mesh, {"b": 8, "i": 16, "h": 8}, rules)
            errs.expect(prof.counters["flops"] == {"calls": 1, "flops": flops},
                        f"x={la} w={lb}: flops {prof.counters['flops']} != {flops}")
    errs.check()


@pytest.mark.parametrize("mshape", SHAPES)
def test_output_mesh_dim_taken_from_contracted_dim(mshape: str) -> None:
    """The rules put the output on the mesh dim the contracted dim was split over: the contracted
    dim is gathered instead, so no allreduce, and the result is still right."""
    mesh, errs = get_mesh(mshape), Errors()
    a, b = global_array("b:8;i:16", 22), global_array("i:16;h:8", 23)
    ref = a.astype(np.float64) @ b
    for m in big(mesh):
        for rules in ({"h": m}, {"b": m}):
            x = mesh.from_numpy(a, "b:8;i:16", layout={"i": m})
            w = mesh.from_numpy(b, "i:16;h:8", layout={"i": m})
            with mm.layout_scope(mesh, rules), mm.profile() as prof:
                y = mm.einsum([x, w])
            check_result(errs, f"m={m} rules={rules}", y, ref, ("b", "h"), rules, np.float32)
            errs.expect(prof.elements("allreduce") == 0, f"m={m} rules={rules}: {prof.counters}")
    errs.check()


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_sums_of_elementwise_products_take_multiply_and_sum_on_a_gpu(shape, monkeypatch, dtype):
    """A bias's or a gain's gradient ("abc->c", "abc,abc->c") is a sum of an elementwise product: on
    CuPy it runs as one multiply and one sum (cupy.einsum took a slow cuBLAS GEMV there, which a CUDA
    graph cannot capture). CuPy's kernel runs here on the numpy mesh's blocks, against numpy's einsum
    on the global arrays, in float64, over layouts that split the summed dims (an allreduce follows)."""
    import mpimesh.ops.einsum as einsum_module
    from mpimesh.ops.einsum import sum_plan
    mesh = get_mesh(shape)
    assert sum_plan("ab,bc->ac") is None and sum_plan("aab->b") is None and sum_plan("ab,a->b") is None
    calls, columns = [], []
    real = einsum_module.summed_product
    monkeypatch.setitem(einsum_module.EINSUM.kernels, "numpy", einsum_module.EINSUM.kernels["cupy"])
    monkeypatch.setattr(einsum_module, "summed_product", lambda *a: calls.append(1) or real(*a))
    # the column-sum kernel (its CUDA source: tests/test_cuda_sources.py) as numpy computes it
    monkeypatch.setattr(einsum_module, "fused_rows", lambda xp, *arrays: arrays[0].dtype.name in ("float32", "float64"))
    monkeypatch.setattr(einsum_module, "column_sums", lambda xp, arrays, rows, cols: columns.append(len(arrays)) or
                        np.prod(arrays, axis=0).reshape(rows, cols).sum(axis=0))
    errs, einsums, sizes = Errors(), 0, {"a": 6, "b": 4, "c": 5}
    a = global_array("a:6;b:4;c:5", seed=1, dtype=np.float64)
    b = global_array("c:5;a:6;b:4", seed=2, dtype=np.float64)
    abc, cab = "a:6;b:4;c:5", "c:5;a:6;b:4"
    cases = [("c", [a], [abc], "a,b,c->c"), ("b;c", [a], [abc], "abc->bc"), ("", [a], [abc], "abc->"),
             ("c", [a, b], [abc, cab], "abc,cab->c"), ("c;a", [a, b], [abc, cab], "abc,cab->ca"),
             ("c", [a, a[::-1]], [abc, abc], "abc,abc->c")]
    for out, arrays, shapes, subs in cases:
        for lay in layouts(mesh, ["a", "b", "c"], limit=4):
            xs = [mm.cast(mesh.from_numpy(g, s, layout=lay), dtype) for g, s in zip(arrays, shapes)]
            y = mm.einsum(xs, output_shape=";".join(f"{d}:{sizes[d]}" for d in out.split(";") if d) or [])
            einsums += 1
            want = np.einsum(subs.replace("a,b,c", "abc"), *[mm.cast(x, "float64").to_numpy() for x in xs])
            errs.close(f"{subs} {lay}", mm.cast(y, "float64").to_numpy(), want,
                       rtol=1e-12 if dtype == "float64" else 2e-2, atol=1e-12 if dtype == "float64" else 2e-2)
    errs.check()
    assert len(calls) == einsums, (len(calls), einsums)
    assert set(columns) == {1, 2}, columns  # "abc->c" and "abc,abc->c": the operands in one order


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
def test_column_sums_over_an_empty_block_on_a_gpu(shape, monkeypatch):
    """A bias's or a gain's gradient on CuPy ("abc->c", "abc,abc->c": the column-sum kernel of
    `mpimesh.ops.rowwise`) where this rank's block of the summed dims is empty (a:1 split over several
    ranks; a:0 on any): zeros there, and the sum over ranks is numpy's (issue 44: the empty partial was
    reshaped to the output's block, a ValueError). CuPy's einsum kernel runs on the numpy mesh's blocks,
    the column-sum kernel's CUDA source compiled for the CPU (tests/cuda_source.py)."""
    import cuda_source

    import mpimesh.ops.einsum as einsum_module
    from mpimesh import backend
    from mpimesh.ops.rowwise import COLUMN_SUM_SOURCES
    if cuda_source.compiler() is None:
        pytest.skip("no C++ compiler to run the kernel's source")
    mesh = get_mesh(shape)
    monkeypatch.setitem(einsum_module.EINSUM.kernels, "numpy", einsum_module.EINSUM.kernels["cupy"])
    monkeypatch.setattr(einsum_module, "fused_rows", lambda xp, *arrays: arrays[0].dtype.name in ("float32", "float64"))
    for n, source in COLUMN_SUM_SOURCES.items():
        monkeypatch.setitem(backend._kernels, ("rowwise", "columns", n), cuda_source.elementwise(*source))
    rows, real = [], einsum_module.column_sums
    monkeypatch.setattr(einsum_module, "column_sums",
                        lambda xp, arrays, n, cols: rows.append(n) or real(xp, arrays, n, cols))
    errs = Errors()
    for spec in ("a:1;b:3;c:5", "a:0;b:3;c:5"):
        a, b = global_array(spec, seed=5, dtype=np.float64), global_array(spec, seed=6, dtype=np.float64)
        for lay in layouts(mesh, ["a", "b", "c"], limit=6):
            x, w = (mesh.from_numpy(g, spec, layout=lay) for g in (a, b))
            for subs, xs, want in (("abc->c", [x], a.sum((0, 1))), ("abc,abc->c", [x, w], (a * b).sum((0, 1)))):
                errs.close(f"{spec} {subs} {lay}", mm.einsum(xs, output_shape="c:5").to_numpy(), want, rtol=1e-12,
                           atol=1e-12)
    errs.check()
    assert 0 in rows and any(rows), rows  # empty blocks, and others, took the kernel


@pytest.mark.mpi
@pytest.mark.parametrize("shape", mesh_shapes())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gradient_in_a_bucket_runs_dry_as_on_rank_0(shape, dtype):
    """A parameter's gradient summed over a split batch waits in a gradient bucket: its einsum writes
    its slot in the bucket's float32 buffer (`out=`) and sums nothing itself (`reduce_mesh_dims` ()),
    a "psum" sums it. A dry run of the same step counts the same collectives as rank 0 and gives the
    gradient its dtype and block; the values are numpy's, in float64."""
    from mpi4py import MPI
    from mpimesh import counters
    from mpimesh.dryrun import DryMesh, placeholder
    mesh = get_mesh(shape)
    rules = f"b:{mesh.shape.names[-1]}"
    a, b = global_array("b:6;i:7", 3), global_array("i:7;h:5", 4)

    def step(x, w):
        with mm.trace() as tr:
            (gw,) = mm.gradients([mm.reduce_sum(mm.einsum([x, w]) * 0.5)], [w])
        return gw, tr

    with mm.layout_scope(mesh, rules), mm.profile() as prof:
        gw, tr = step(*(mm.cast(mesh.from_numpy(g, s), dtype) for g, s in ((a, "b:6;i:7"), (b, "i:7;h:5"))))
    dry = DryMesh(shape, rules)
    with counters.counting() as counts:
        ghost, _ = step(placeholder(dry, "b:6;i:7", dtype), placeholder(dry, "i:7;h:5", dtype))
    bucketed = [op for op in tr.ops if op.name == "einsum" and op.outputs[0].shape.names == ("i", "h")]
    split = mesh.shape[mesh.shape.names[-1]].size > 1
    assert [op.params["reduce_mesh_dims"] for op in bucketed] == [()]
    assert any(op.name == "psum" for op in tr.ops) == split
    wide = mm.cast(mesh.from_numpy(a.astype(dtype).astype(np.float64), "b:6;i:7"), "float64")
    np.testing.assert_allclose(to_host(mm.cast(gw, "float64").to_numpy()),
                               0.5 * wide.to_numpy().sum(axis=0)[:, None] * np.ones((1, 5)),
                               rtol=1e-6 if dtype == "float32" else 1e-2)
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert {k: v for k, v in counts.items() if k != "flops"} == \
            {k: v for k, v in prof.counters.items() if k not in ("flops", "copies")}
        assert (ghost.dtype, ghost.local.shape) == (gw.dtype, gw.local.shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("specs", [("b:3;i:5", "i:5;h:4", "b:3;h:4"), ("i:5;b:3", "i:5;h:4", "h:4;b:3"),
                                   ("g:2;s:5;m:3", "g:2;s:5;e:4", "e:4;g:2;m:3")], ids=["2-d", "transposed", "batched"])
def test_the_cupy_kernel_multiplies_by_cublas(monkeypatch, specs, dtype):
    """CuPy's einsum kernel (`EINSUM.kernels["cupy"]`) runs its GEMMs as one cuBLAS call each
    (`mpimesh.gemm`), never CuPy's own matmul: a 2-D product (float32: its planned operand views),
    one of a transposed operand, a batched one whose output is reordered, and 16-bit operands
    (multiplied as they are into float32 sums, rounded once). On tests/test_gemm.py's host model of
    cuBLAS and fake device arrays, with the params of the same einsum on numpy, against numpy."""
    import types
    from types import SimpleNamespace

    from test_gemm import FAKE_XP, FakeCublas, _device, _values

    from mpimesh import gemm
    from mpimesh.ops.einsum import EINSUM
    cublas = FakeCublas()
    monkeypatch.setattr(gemm, "_cublas", lambda xp=None: cublas)
    cp = types.ModuleType("cupy")
    cp.ascontiguousarray, cp.empty, cp.cuda = FAKE_XP.ascontiguousarray, FAKE_XP.empty, FAKE_XP.cuda
    cp.transpose, cp.result_type = np.transpose, np.result_type
    cp.matmul = lambda *args, **kwargs: pytest.fail("CuPy's own matmul")
    mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    a, b = (_values(mm.Shape(s).sizes, mm.cast(mesh.ones("x:1"), dtype).dtype, seed) for s, seed in zip(specs, (1, 2)))
    with mm.trace() as tr:  # (the params only)
        mm.einsum([mesh.from_numpy(a, specs[0]), mesh.from_numpy(b, specs[1])], specs[2])
    got = EINSUM.kernels["cupy"](SimpleNamespace(xp=cp), _device(a), _device(b), **tr.ops[-1].params)
    subscripts = ",".join("".join(mm.Shape(s).names) for s in specs[:2]) + "->" + "".join(mm.Shape(specs[2]).names)
    want = np.einsum(subscripts, a.astype(np.float64), b.astype(np.float64))  # (exact in float32: multiples of 1/8)
    assert got.dtype == a.dtype and cublas.calls == 1
    np.testing.assert_array_equal(np.asarray(got), want.astype(a.dtype))
