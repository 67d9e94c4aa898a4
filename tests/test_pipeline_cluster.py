"""A pipeline across two hosts over TCP (`mpimesh.testing.Cluster`), model parallelism inside each host.

Four layers of relu(h W1) W2 + h as 2 stages of 2 over the host dim (`stages:2;cols:2`, d_ff over the
2 ranks of a host), against the same model laid out model-parallel across the hosts (`all:4`, d_ff over
all four). Each job counts the bytes on host 0's link (/proc/net/dev in its namespace) over 3 steps.
Pipelined, only the activation transfers and the two broadcasts cross: per step each rank of host 0
sends its stage's output for every microbatch (the whole batch, B x D float64) and dx, and receives
the gradients (B x D) and the loss: the formula, plus TCP/IP's headers and acknowledgements. Model-parallel,
every layer allreduces a [B, D] activation across the hosts, forward and backward. Both counts printed;
the losses of the two layouts agree. Runs in the 1-rank session; skipped where namespaces cannot be made.
"""
from __future__ import annotations

import json
import sys
from importlib.util import find_spec

import numpy as np
import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.testing import Cluster, cleanup_leftovers, unavailable

from test_cluster import _run

WHY = unavailable()
pytestmark = [pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1,
                                 reason="spawns its own jobs; runs in the 1-rank session"),
              pytest.mark.skipif(WHY is not None, reason=f"no namespaced hosts: {WHY}")]

B, D, F, M, STEPS = 256, 512, 256, 4, 3

JOB = f"""
import json, os, sys
import numpy as np
from mpi4py import MPI
import mpimesh as mm

B, D, F, M, STEPS = {B}, {D}, {F}, {M}, {STEPS}
rng = np.random.default_rng(0)
w = [(rng.standard_normal((D, F)) / D ** 0.5, rng.standard_normal((F, D)) / F ** 0.5) for _ in range(4)]
x0, t0 = rng.standard_normal((B, D)), rng.standard_normal((B, D))


def link():
    for line in open("/proc/net/dev"):  # (per network namespace: this host's)
        name, _, rest = line.partition(":")
        if name.strip() == "eth0":
            return int(rest.split()[0]), int(rest.split()[8])


def ffn(w1, w2, h):
    a = mm.einsum([h, w1], output_shape=mm.Shape([h.shape["b"], w1.shape["d_ff"]]))
    return mm.einsum([mm.relu(a), w2], output_shape=h.shape) + h


def loss_fn(h, t):
    return mm.reduce_sum(mm.square(h - t))


if sys.argv[1] == "pipeline":
    mesh = mm.Mesh("stages:2;cols:2", layout="stage:stages;d_ff:cols")
    p = {{k: mesh.from_numpy(np.stack([w[2 * s + i][j] for s in range(2)]), "stage:2;" + dims)
          for i in range(2) for j, (k, dims) in enumerate([(f"w1{{i}}", f"d:{{D}};d_ff:{{F}}"),
                                                           (f"w2{{i}}", f"d_ff:{{F}};d:{{D}}")])}}

    def stage(p, h):
        return ffn(p["w11"], p["w21"], ffn(p["w10"], p["w20"], h))

    def step(x, t):
        return mm.pipeline_value_and_grad(stage, loss_fn, p, x, t, "stages", M)[0]
else:
    mesh = mm.Mesh("all:4", layout="d_ff:all")
    p = [(mesh.from_numpy(a, f"d:{{D}};d_ff:{{F}}"), mesh.from_numpy(b, f"d_ff:{{F}};d:{{D}}")) for a, b in w]

    def step(x, t):
        with mm.trace():
            h = x
            for w1, w2 in p:
                h = ffn(w1, w2, h)
            loss = loss_fn(h, t)
            mm.gradients([loss], [v for pair in p for v in pair])
        return loss
x, t = mesh.from_numpy(x0, f"b:{{B}};d:{{D}}"), mesh.from_numpy(t0, f"b:{{B}};d:{{D}}")
loss = float(step(x, t).to_numpy())  # warm: communicators made, every path taken once
MPI.COMM_WORLD.Barrier()
before = link()
for _ in range(STEPS):
    step(x, t)
MPI.COMM_WORLD.Barrier()
after = link()
if MPI.COMM_WORLD.rank == 0:
    with open(os.environ["OUT"], "w") as f:
        json.dump({{"received": after[0] - before[0], "sent": after[1] - before[1], "loss": loss}}, f)
"""


def _stage(p, h):
    """The job's stage (two of its layers), for the cost model."""
    for i in range(2):
        a = mm.einsum([h, p[f"w1{i}"]], output_shape=mm.Shape([h.shape["b"], p[f"w1{i}"].shape["d_ff"]]))
        h = mm.einsum([mm.relu(a), p[f"w2{i}"]], output_shape=h.shape) + h
    return h


def test_a_pipeline_across_hosts_moves_only_its_activations(tmp_path):
    cleanup_leftovers()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    got = {}
    with Cluster(hosts=2, slots=2) as cluster:
        for layout in ("pipeline", "model"):
            out = tmp_path / f"{layout}.json"
            r = _run(cluster, 4, [sys.executable, str(script), layout], timeout=60, OUT=str(out))
            assert r.returncode == 0, r.stdout[-3000:]
            got[layout] = json.loads(out.read_text())
    block = B * D * 8  # the whole batch's activations, float64: each rank of a stage holds all of d
    sent = STEPS * 2 * (block + block)  # per step, 2 ranks: the stage's output per microbatch, then dx
    received = STEPS * 2 * (block + 8)  # the gradients per microbatch, then the loss
    if find_spec("jax"):  # the cost model's transfers for each stage's ranks: the same bytes
        from mpimesh.cost import ArgSpec, TPUV2, pipeline_estimate
        stacked = {f"w{j}{i}": ArgSpec(f"stage:2;{dims}", "float64") for i in range(2)
                   for j, dims in ((1, f"d:{D};d_ff:{F}"), (2, f"d_ff:{F};d:{D}"))}
        x = ArgSpec(f"b:{B};d:{D}", "float64")
        e = pipeline_estimate(_stage, stacked, x, "stages:2;cols:2", "stages", M, TPUV2, rules="stage:stages;d_ff:cols",
                              loss_fn=lambda h, t: mm.reduce_sum(mm.square(h - t)), targets=x)
        assert [st["collectives"]["sendrecv/stages"]["bytes"] for st in e["stages"]] == [block, block]
    print(f"\nhost 0's link over {STEPS} steps: pipelined sent {got['pipeline']['sent']:,} B (formula {sent:,}), "
          f"received {got['pipeline']['received']:,} B (formula {received:,}); model-parallel sent "
          f"{got['model']['sent']:,} B, received {got['model']['received']:,} B")
    for way, want in (("sent", sent), ("received", received)):
        assert want <= got["pipeline"][way] <= 1.03 * want + (64 << 10), (way, got, want)
        assert got["model"][way] > 1.5 * got["pipeline"][way], (way, got)  # 8 [B, D] allreduces across hosts
    np.testing.assert_allclose(got["pipeline"]["loss"], got["model"]["loss"], rtol=1e-12)
