"""MoE layer step (forward + backward) against a dense feed-forward layer with the same per-token FLOPs.

Run (common.py fixes the BLAS environment by itself: one BLAS thread per rank):

    mpiexec -n 2 python benchmarks/moe.py [--repeat N] [--groups 8 --group-size 256 --d-model 256
                                           --experts 8 --d-ff 512]

The MoE step is `mm.layers.moe` (GShard top-2 gating, capacity factor 1.25) on x [group, tokens,
d_model] followed by `mm.gradients` of sum(y) + aux with respect to x, wg, wi and wo, routed by
gathers ("moe": `routing="gather"`) and by one-hot masks and einsums ("one-hot": `routing="one_hot"`).
The dense step is `mm.layers.feed_forward` with d_ff_dense = 2·d_ff (a token visits two experts, so
the nominal per-token FLOPs match) and the gradients of sum(y) w.r.t. x, wi and wo. On N ranks the
groups (the batch) are split over "all" in all three; the MoE puts its experts on "all" too (two
alltoalls each way), the dense layer is data-parallel (an allreduce of its weight gradients). On 1
rank: rank 0 alone over COMM_SELF while the others sleep. Prints the times, the ratios to dense, and
the modelled FLOPs (the MoE's experts process E·C = capacity_factor·S slots per group, fewer than the
2·S choices; the one-hot dispatch and combine are einsums of cost 2·G·S·E·C·M each, the gathers none).
"""
import common  # noqa: F401  (first: clean BLAS environment, may re-exec)

import argparse

from mpi4py import MPI

import mpimesh as mm
from common import WORLD, compare, kernel_report, on_rank0, rank0_print, table
from mpimesh.layers.moe import expert_capacity, init_moe, moe


def steps(comm: MPI.Comm, a) -> dict:
    """Build both layers on a mesh over `comm`; return {name: step function}."""
    n = comm.Get_size()
    mesh = mm.Mesh(f"all:{n}", layout="group:all;experts:all", comm=comm)
    x_shape = f"group:{a.groups};tokens:{a.group_size};d_model:{a.d_model}"
    x = mesh.random_normal(x_shape, 1)
    pm = init_moe(mesh, 0, f"d_model:{a.d_model}", f"experts:{a.experts}", f"d_ff:{a.d_ff}")
    pd = mm.layers.init_feed_forward(mesh, 0, f"d_model:{a.d_model}", f"d_ff_dense:{2 * a.d_ff}")
    counter = [0]

    def moe_step(routing):
        def step():
            counter[0] += 1
            with mm.trace():
                y, aux = moe(pm, x, "group", seed=counter[0], routing=routing)
                return mm.gradients([y, aux], [x, pm["wg"], pm["wi"], pm["wo"]])
        return step

    def dense_step():
        with mm.trace():
            y = mm.layers.feed_forward(pd, x)
            return mm.gradients([y], [x, pd["wi"]["kernel"], pd["wo"]["kernel"]])
    return {"moe": moe_step("gather"), "one_hot": moe_step("one_hot"), "dense": dense_step}


def model_flops(a) -> dict:
    """Forward FLOPs (x3 for a step) of each layer's matmuls (the gathers route without any; the
    one-hot einsums of dispatch and combine cost 2·G·S·E·C·M each)."""
    g, s, m, e, h = a.groups, a.group_size, a.d_model, a.experts, a.d_ff
    c = expert_capacity(s, e, 1.25)
    moe_ = 3 * (2 * 2 * g * e * c * m * h + 2 * g * s * m * e)
    return {"moe": moe_, "one_hot": moe_ + 3 * 2 * 2 * g * s * e * c * m,
            "dense": 3 * 2 * 2 * g * s * m * (2 * h), "capacity": c}


def run(comm: MPI.Comm, a) -> dict:
    fns = steps(comm, a)
    res = compare(fns, repeat=a.repeat, warmup=2, comm=comm)
    return {k: v[1] * 1e3 for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per case (median is kept)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--d-ff", type=int, default=512, help="expert hidden size (dense: twice this)")
    a = ap.parse_args()
    n = WORLD.Get_size()
    fl = model_flops(a)
    rank0_print(kernel_report())
    rank0_print(f"\nMoE step vs dense FFN step (forward + backward), float32: G={a.groups} S={a.group_size} "
                f"M={a.d_model} E={a.experts} H={a.d_ff} (C={fl['capacity']}), dense d_ff={2 * a.d_ff}; "
                f"median of {a.repeat} interleaved runs")
    rows = []
    single = on_rank0(lambda: run(MPI.COMM_SELF, a)) if n > 1 else run(WORLD, a)
    rows.append((1, single))
    if n > 1:
        rows.append((n, run(WORLD, a)))
    out = []
    for ranks, r in rows:
        out.append((ranks, f"{r['moe']:.1f}", f"{r['one_hot']:.1f}", f"{r['dense']:.1f}",
                    f"{r['moe'] / r['dense']:.2f}", f"{r['one_hot'] / r['dense']:.2f}",
                    f"{fl['moe'] / r['moe'] / 1e6 / ranks:.1f}", f"{fl['dense'] / r['dense'] / 1e6 / ranks:.1f}"))
    rank0_print(table(("ranks", "moe ms", "one-hot ms", "dense ms", "moe/dense", "one-hot/dense", "moe GFLOP/s/rank",
                       "dense GFLOP/s/rank"), out))
    rank0_print(f"modelled step FLOPs: moe {fl['moe'] / 1e9:.2f} G (one-hot routing {fl['one_hot'] / 1e9:.2f} G), "
                f"dense {fl['dense'] / 1e9:.2f} G")


if __name__ == "__main__":
    main()
