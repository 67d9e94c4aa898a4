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


# ------------------------------------------------------------------------------ weight sharding (pod_memory)

import pod_memory as pm  # noqa: E402
from mpimesh.cost.model import collective_seconds  # noqa: E402

# 3 layers of: q, k, v, out 8 x 8 (4 x 64), wi_0, wi_1 8 x 16, wo 16 x 8 (3 x 128), bias 2 x 2, 2 scales of 8:
# 256 + 384 + 4 + 16 = 660 per layer; embedding 10 x 8 = 80, final scale 8: P = 3 * 660 + 88 = 2068
SMALL = pm.DenseLM(d_model=8, d_ff=16, heads=2, d_kv=4, vocab=10, length=4, layers=3, rel_buckets=2)
LAYOUT = {lay.name: lay for lay in pm.LAYOUTS}


def test_parameter_counts_equal_lingvos_published_totals():
    assert SMALL.layer_parameters() == 660 and SMALL.parameters() == 2068 and SMALL.tensors() == 32
    # lingvo's tasks/lm/params/synthetic_packed_input.py: "Total params: 137,702,416,384" (DenseLm128B8x8,
    # 64 layers) and "Total params: 1,100,041,175,040" (DenseLm1T16x16)
    assert pm.DenseLM(layers=64).parameters() == 137_702_416_384
    big = pm.DenseLM(d_model=16384, d_ff=131072, heads=256, layers=128, length=512)
    assert big.parameters() == 1_100_041_175_040


def test_memory_terms_by_hand_on_a_2_by_4_mesh():
    # Adafactor's floats per layer: q, k, v, out 4 x (8 + 8), wi_0, wi_1 2 x (8 + 16), wo 24, bias 4, scales 16:
    # 156; x 3 layers + embedding 10 + 8 + final scale 8 = 494
    assert SMALL.adafactor_floats() == 494
    # per token per layer: 4 x 8 d_model-sized; 4 x 8 (q, k, v, context) + 2 x 4 (probabilities) + 3 x 16 = 88
    assert SMALL.saved_per_token() == (32, 88)
    rows, cols, batch = 2, 4, 6  # 3 sequences per row
    # Mesh-TF: everything / Y = 4. Activations per layer and sequence: 2 bytes x (32 + 88 / 4) x 4 tokens = 432;
    # outside: (2 x 2 x 8 + 8 x 10 / 4) x 4 = 208; x 3 sequences: 3 x (3 x 432 + 208) = 4512. Casts: 2 layers of
    # 660 / 4 in 2 bytes = 660. Temporaries: the update's 2 float32 blocks of wi_0 (128 / 4): 256
    assert pm.memory(SMALL, LAYOUT["Mesh-TF 2-D"], rows, cols, batch) == {
        "parameters": 2068, "gradients": 2068, "optimizer": 494, "activations": 4512, "gathered": 660,
        "temporaries": 256}
    # GSPMD: parameters, gradients, state / 8; activations 2 x (32 / 4 + 88 / 4) x 4 = 240 per layer and
    # sequence, outside (2 x 2 x 8 / 4 + 20) x 4 = 112: 3 x (3 x 240 + 112) = 2496; temporaries: one layer's
    # float32 gradient before its reduce-scatter, 4 x 660 / 4 = 660, + 2 x 4 x 128 / 8 = 128
    gspmd = {"parameters": 1034, "gradients": 1034, "optimizer": 247, "activations": 2496, "gathered": 660,
             "temporaries": 788}
    assert pm.memory(SMALL, LAYOUT["GSPMD 2-D"], rows, cols, batch) == gspmd
    assert pm.memory(SMALL, LAYOUT["GSPMD 2-D, kept"], rows, cols, batch) == dict(gspmd, gathered=3 * 2 * 660 / 4)
    assert pm.memory(SMALL, LAYOUT["ZeRO-2"], rows, cols, batch) == dict(gspmd, parameters=2068, activations=4512)
    assert pm.memory(SMALL, LAYOUT["ZeRO-3"], rows, cols, batch) == dict(gspmd, activations=4512)
    assert pm.memory(SMALL, LAYOUT["Mesh-TF 2-D"], rows, cols, batch, optimizer="adam")["optimizer"] == 2 * 2068
    with pytest.raises(ValueError, match="batch 5 .* 2 rows"):
        pm.memory(SMALL, LAYOUT["GSPMD 2-D"], rows, cols, 5)


def test_the_largest_batch_is_whole_sequences_per_row_that_fit():
    fixed, per_row = 1034 + 1034 + 247 + 660 + 788, 2496 / 3  # GSPMD above: a sequence per row costs 832
    gspmd = LAYOUT["GSPMD 2-D"]
    assert pm.max_batch(SMALL, gspmd, 2, 4, fixed + 5 * per_row + 100) == 10
    assert pm.max_batch(SMALL, gspmd, 2, 4, fixed + 5 * per_row) == 10
    assert pm.max_batch(SMALL, gspmd, 2, 4, fixed + 5 * per_row - 1) == 8
    assert pm.max_batch(SMALL, gspmd, 2, 4, fixed - 1) == 0
    assert pm.max_batch(SMALL, gspmd, 2, 4, fixed + 832, acts=(100.0, 32.0)) == 2 * (832 // (3 * 100 + 32))


def test_gathers_and_reduce_scatters_move_one_allreduces_bytes():
    free = Machine(flops=1e9, latency=0.0, bandwidth=1e8, memory=2**30)
    rows, cols = 8, 4

    def seconds(layout):
        got = pm.weight_collectives(SMALL, layout, rows, cols)
        return sum(collective_seconds(k, rows, b, free) for k, b in got.items())
    assert pm.weight_collectives(SMALL, LAYOUT["Mesh-TF 2-D"], rows, cols) == {"allreduce": 4 * 2068 / 4}
    # bfloat16 gathers of 2068 / 32 weights (forward, backward), float32 reduce-scatter of 2068 / 4 gradients
    assert pm.weight_collectives(SMALL, LAYOUT["GSPMD 2-D"], rows, cols) == {
        "allgather": 2 * 2 * 2068 / 32, "reduce_scatter": 4 * 2068 / 4}
    allreduce = seconds(LAYOUT["Mesh-TF 2-D"])
    for name in ("ZeRO-1", "ZeRO-2", "ZeRO-3", "GSPMD 2-D"):
        assert math.isclose(seconds(LAYOUT[name]), allreduce, rel_tol=1e-12), name
    assert math.isclose(seconds(LAYOUT["GSPMD 2-D, kept"]), 0.75 * allreduce, rel_tol=1e-12)


def test_the_nested_layouts_stages_are_the_apps_blocks_and_keep_their_inputs_with_remat():
    """`gspmd_nested`'s stage: 2 of apps/transformer.py's blocks, their parameters stacked over the stages;
    priced as `mm.pipeline` with remat, each stage keeps its M microbatches' inputs ([b/M, length, d_model]
    bfloat16) and sends each on once: b/M x length x d_model x 2 bytes per transfer."""
    cfg = app.Config(d_model=32, heads=2, d_kv=8, d_ff=64, layers=4, vocab=64, length=16, batch=8, dtype="bfloat16")
    stage_fn, specs = simulate.nested_stage(cfg, 2, 2)
    one = app.init_params(mm.dryrun.DryMesh("all:1"), cfg)
    assert {k: (a.shape.names[0], a.shape[0].size, a.shape.names[1:]) for k, a in specs.items()} == \
        {k: ("stage", 2, t.shape.names) for k, t in one.items() if k.startswith(("layer0/", "layer1/"))}
    x = ArgSpec("batch:8;length:16;d_model:32", "bfloat16")
    e = mm.cost.pipeline_estimate(stage_fn, specs, x, "rows:2;cols:2", "rows", 4, TOY,
                                  rules=f"{simulate.NESTED_AROUND};stage:rows", remat=True)
    assert e["transfer_bytes"] == e["kept_bytes"] == 2 * 16 * 32 * 2
    assert [st["activation_bytes"] for st in e["stages"]] == [4 * e["kept_bytes"]] * 2
    assert "allreduce/cols" in e["stages"][0]["collectives"]  # heads and d_ff over cols inside the stage
