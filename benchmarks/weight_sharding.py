"""Weight sharding (`mm.shard_weights`: GSPMD's, ZeRO-3, FSDP) against data parallelism, in the same run.

    mpiexec -n 2 python benchmarks/weight_sharding.py            # speed: the MLP and the Transformer
    mpiexec -n 4 python benchmarks/weight_sharding.py --memory   # + bytes per rank and peak memory

Speed: `benchmarks/mlp_step.py`'s data-parallel step (apps/two_layer.py, `batch:all`, SGD) and the
Transformer's (apps/transformer.py, a weight-heavy configuration, Adam), each eager and compiled, with its
weights replicated (data parallel) and sharded over the same mesh dim; the median of interleaved runs,
the ratio sharded / replicated (bars: the MLP at most 1.10x, the Transformer 1.15x), the bytes each rank
sends per step (ring algorithms: allgather + reduce-scatter, and the all-to-alls of layers that use a sharded
weight where it lies, such as the embedding, against the allreduce) and the share of the time in collectives
that ran hidden behind compute (compiled steps prefetch gathers and overlap reduce-scatters:
docs/weight_sharding.md). Memory (`--memory`): parameter, gradient and optimizer bytes per rank against
replicated / N, and the Transformer step's peak of live arrays (`mm.profile(memory=True)`), replicated,
sharded, and sharded with `mm.remat` per block (which gathers each weight again in the backward:
FSDP's reshard-after-forward). Prints figures and ratios, no verdict against another machine's.
"""
import common  # noqa: F401  (first: clean BLAS environment, may re-exec)

import argparse
import os
import sys
from dataclasses import replace

import numpy as np

import mpimesh as mm
from common import WORLD, compare, kernel_report, load_average, rank0_print, table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "apps"))
import transformer as T  # noqa: E402
import two_layer as tl  # noqa: E402

WIRE = {"allgather": lambda k: k - 1, "reduce_scatter": lambda k: (k - 1) / k, "allreduce": lambda k: 2 * (k - 1) / k,
        "alltoall": lambda k: (k - 1) / k, "permute": lambda k: 1}


def sent_bytes(prof, mesh) -> float:
    """Bytes a rank sends per collective (ring algorithms) from `mm.profile`'s counters, which keep an
    allgather's input block and the other collectives' whole input."""
    total = 0.0
    for key, v in prof.transfers.items():
        kind, dims = key.split("/")
        k = int(np.prod([mesh.shape[d].size for d in dims.split("+")]))
        total += v["bytes"] * WIRE.get(kind, lambda k: 0)(k)
    return total


def mlp_case(mesh, sizes, shard: bool, compiled: bool):
    """The data-parallel two-layer step (SGD) as a callable, and its state."""
    params = tl.init_params(mesh, sizes, 0)
    if shard:
        params = mm.shard_weights(params, "all")
    x, target = tl.make_data(mesh, sizes)

    def step(params):
        return tl.train_step(params, x, target, 1e-4, input_grad=False).params
    run = mm.compile(step, donate_argnums=0) if compiled else step
    box = [params]

    def once():
        box[0] = run(box[0])
    return once


def transformer_case(mesh, cfg, shard: bool, compiled: bool, remat: bool = False):
    cfg = replace(cfg, remat=cfg.layers if remat else 0)
    params = T.init_params(mesh, cfg)
    if shard:
        params = mm.shard_weights(params, "all")
    opt = mm.optim.Adam(1e-3)
    state = opt.init(params)
    step = T.make_train_step(cfg, opt)
    run = mm.compile(step) if compiled else step
    ids = np.random.default_rng(5).integers(0, cfg.vocab, (cfg.batch, cfg.length + 1))
    shape = f"batch:{cfg.batch};length:{cfg.length}"
    batch = {"inputs": mesh.from_numpy(ids[:, :-1], shape), "targets": mesh.from_numpy(ids[:, 1:], shape)}
    box = [params, state]

    def once():
        box[0], box[1], _ = run(box[0], box[1], batch)
    return once, box


def speed(mesh, name: str, make, repeat: int) -> list:
    rows = []
    timer = _TIMERS.setdefault(id(mesh), T.CommTimer(mesh))
    for compiled in (False, True):
        fns = {"replicated": make(False, compiled), "sharded": make(True, compiled)}
        times = compare(fns, repeat=repeat)
        traffic, hidden = {}, {}
        for label, fn in fns.items():
            c0 = timer.seconds
            with mm.profile() as prof:
                fn()
            traffic[label] = sent_bytes(prof, mesh)
            comm = timer.seconds - c0 + prof.overlap["seconds"]  # blocking collectives, and non-blocking ones' lives
            hidden[label] = prof.overlap["hidden"] / comm if comm else 0.0
        rep, sh = times["replicated"][1], times["sharded"][1]  # medians
        rows.append([name, "compiled" if compiled else "eager", f"{rep * 1e3:.2f}", f"{sh * 1e3:.2f}",
                     f"{sh / rep:.3f}", f"{traffic['replicated'] / 2**20:.3f}", f"{traffic['sharded'] / 2**20:.3f}",
                     f"{hidden['replicated']:.0%}", f"{hidden['sharded']:.0%}"])
    return rows


_TIMERS: dict = {}  # one per mesh: it wraps the mesh's collectives once


def memory(mesh, cfg) -> None:
    n = mesh.size
    rows = []
    for label, shard, remat in (("replicated (data parallel)", False, False), ("sharded", True, False),
                                ("sharded + remat per block", True, True)):
        once, box = transformer_case(mesh, cfg, shard, False, remat)
        once()
        with mm.profile(memory=True) as prof:
            once()
        held = sum(t.local.nbytes for t in box[0].values())
        slots = sum(t.local.nbytes for s in ("m", "v") for t in box[1][s].values())
        peak = int(prof.peak_bytes["arrays"])
        rows.append([label, f"{held / 2**20:.2f}", f"{slots / 2**20:.2f}", f"{peak / 2**20:.2f}"])
    full = sum(t.shape.size * 4 for t in T.init_params(mesh, cfg).values())
    rank0_print(f"\nTransformer memory per rank on {n} ranks (parameters float32: {full / 2**20:.2f} MiB whole; "
                f"replicated / N = {full / n / 2**20:.2f} MiB); peak: the step's live arrays at their high point")
    rank0_print(table(["layout", "params MiB", "Adam m+v MiB", "step peak MiB"], rows))
    base = float(rows[0][3])
    rank0_print("peak ratios to data parallel: " + ", ".join(f"{r[0]} {float(r[3]) / base:.2f}x" for r in rows[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--memory", action="store_true", help="also bytes per rank and the step's peak")
    args = ap.parse_args()
    n = WORLD.Get_size()
    rank0_print(kernel_report())
    rank0_print(f"load average {load_average()}; {n} ranks")
    mesh = mm.Mesh(f"all:{n}", layout="batch:all")
    sizes = tl.Sizes.of(512, 1024, 4096)
    # weight-heavy: d_model 512, d_ff 2048, 2 layers; activations small (batch 8 x length 32)
    cfg = T.Config(d_model=512, heads=8, d_kv=64, d_ff=2048, layers=2, length=32, batch=8)
    rows = speed(mesh, "MLP b512 1024x4096 SGD", lambda s, c: mlp_case(mesh, sizes, s, c), args.repeat)
    rows += speed(mesh, "Transformer d512 ff2048 Adam", lambda s, c: transformer_case(mesh, cfg, s, c)[0],
                  args.repeat)
    rank0_print("\nstep time (median ms, slowest rank), MiB each rank sends per step, and the share of the time in "
                "collectives that ran hidden behind compute (prefetched gathers, overlapped reduce-scatters, buckets):")
    rank0_print(table(["step", "mode", "replicated", "sharded", "ratio", "sent repl.", "sent shard.", "hidden repl.",
                       "hidden shard."], rows))
    if args.memory:
        memory(mesh, cfg)


if __name__ == "__main__":
    main()
