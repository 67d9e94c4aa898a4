"""benchmarks/simulate.py's modelling, against formulas worked out here: XLA-style fusion (bytes
of a fused region by hand; never more traffic than unfused), and remat (`Config(remat=layers)`:
FLOPs and alltoall bytes grow by exactly one forward pass of the blocks, compute time by its
price, peak activations shrink)."""
from __future__ import annotations

import math
import os
import sys

import pytest

pytest.importorskip("jax", reason="jax is not installed (python3 install.py tpu): dry runs need it")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import mpimesh as mm  # noqa: E402
import simulate  # noqa: E402
from mpimesh.cost import ArgSpec, Machine, op_seconds  # noqa: E402
from simulate import app  # noqa: E402

TOY = Machine(flops=1e9, latency=1e-5, bandwidth=1e8, memory=2**30, memory_bandwidth=4e9)
X = ArgSpec("batch:8;io:4", "float32")  # 128 bytes
W = ArgSpec("io:4;out:2", "float32")


def _fusions(fn, args, mesh="rows:1", rules=""):
    rec, ops = simulate.recorded(fn, args, mesh, rules)
    fused = simulate.kernels(rec, ops, True)
    return rec, [k.nbytes for k in fused if k.name == "fusion"], [k for k in fused if k.name != "fusion"]


def test_a_chain_of_elementwise_ops_reads_its_input_once_and_writes_its_output_once():
    rec, regions, own = _fusions(lambda x, w: mm.einsum([mm.tanh(mm.exp(x) * 2.0), w]), (X, W))
    assert [op.name for op in rec.ops] == ["exp", "multiply", "tanh", "einsum"]
    assert sum(op.nbytes for op in rec.ops[:3]) == 6 * 128  # unfused: each op reads and writes 128 bytes
    assert regions == [128 + 128]  # fused: x in, tanh's output out
    assert [k.name for k in own] == ["einsum"] and own[0].nbytes == rec.ops[3].nbytes


def test_a_matmul_ends_a_region_and_an_output_read_later_is_written():
    # exp(x) feeds the einsum and the final add: written once; tanh's region reads x only
    def fn(x, w):
        e = mm.exp(x)
        return mm.tanh(mm.einsum([e, w])), e + 1.0
    rec, regions, own = _fusions(fn, (X, W))
    assert [op.name for op in rec.ops] == ["exp", "einsum", "tanh", "add"]
    out = 8 * 2 * 4  # the einsum's output [batch:8, out:2]
    # {exp}: x in, e out; {tanh, add} (no tensor links them: two regions): einsum's out in, tanh out;
    # e in, add's output out
    assert sorted(regions) == sorted([128 + 128, out + out, 128 + 128])


def test_a_collective_is_not_fused():
    rec, regions, own = _fusions(lambda x: mm.exp(mm.reduce_sum(mm.tanh(x), reduced_dims=["batch"])),
                                 (X,), "rows:2", "batch:rows")
    assert any(k.name == "einsum" for k in own)  # the sum over the split batch: an allreduce
    assert regions == [64 + 64, 16 + 16]  # tanh of this rank's [batch:4, io:4]; exp of the summed [io:4]


TINY = app.Config(d_model=32, heads=2, d_kv=8, d_ff=64, layers=3, vocab=64, length=16, batch=8, moe_every=2,
                  experts=4, dtype="bfloat16")
MESH, RULES, CAP = "all:4", "batch:all;experts:all", (2.0, 1)


def _forward(cfg):
    """The loss alone, recorded: FLOPs, alltoall bytes and compute seconds of the forward pass."""
    dry = simulate.DryMesh(MESH, RULES)
    with mm.layout_scope(dry, RULES):
        params = app.init_params(dry, cfg)
        batch = {k: simulate.placeholder(dry, f"batch:{cfg.batch};length:{cfg.length}", "int32")
                 for k in ("inputs", "targets")}
    rec = mm.cost.record(lambda p, b: app.loss_fn(p, b, cfg, moe_capacity=CAP), (params, batch), dry, RULES)
    return rec


def _alltoall(rec) -> int:
    return sum(c["bytes"] for k, c in rec.collectives.items() if k.startswith("alltoall"))


def test_remat_adds_one_forward_pass_of_the_blocks_and_keeps_less():
    plain, _ = simulate.recording(TINY, MESH, RULES, CAP)
    remat, ops = simulate.recording(simulate._with(TINY, remat=True), MESH, RULES, CAP)
    blocks = [_forward(simulate._with(TINY, layers=n)) for n in (TINY.layers, 0)]  # the blocks: L layers less none
    def gemm_flops(r):  # (every op counts flops now; a block's few scalar adds outside its remat run again too)
        return sum(op.flops for op in r.ops if op.gemm)
    flops = gemm_flops(blocks[0]) - gemm_flops(blocks[1])
    assert gemm_flops(remat) - gemm_flops(plain) == flops > 0
    everything = [sum(op.flops for op in r.ops) for r in (plain, remat, *blocks)]
    assert math.isclose(everything[1] - everything[0], everything[2] - everything[3], rel_tol=1e-5)
    assert _alltoall(remat) - _alltoall(plain) == _alltoall(blocks[0]) - _alltoall(blocks[1]) > 0
    seconds = [sum(op_seconds(op, TOY) for op in r.ops) for r in (plain, remat, *blocks)]
    assert math.isclose(seconds[1] - seconds[0], seconds[2] - seconds[3], rel_tol=1e-5)
    assert remat.state_bytes == plain.state_bytes
    big = simulate._with(TINY, batch=64, length=64)  # activations, not the optimizer update, at the peak
    peaks = [simulate.recording(simulate._with(big, remat=r), MESH, RULES, CAP)[0].activation_bytes for r in (0, 3)]
    assert peaks[1] < 0.8 * peaks[0], peaks
    fused = sum(k.nbytes for k in simulate.kernels(remat, ops, True))
    assert fused < sum(op.nbytes for op in remat.ops)
