"""The speed bar: one training step of the Mesh-TensorFlow paper's two-layer MLP, float32.

Run (common.py fixes the BLAS environment by itself: one BLAS thread per rank):

    mpiexec -n 2 python benchmarks/mlp_step.py [--repeat N] [--batch 512 --d-io 1024 --d-hidden 4096]

The step is apps/two_layer.py's `train_step` with `input_grad=False`: forward y = relu(x·w + bias)·v,
gradients of w, bias and v of 0.5·sum((y - target)²)/batch, and SGD. It runs
  * model-parallel (`hidden:all`, one allreduce of y per step) and data-parallel (`batch:all`,
    allreduces of dw, dv, dbias) on all ranks, and
  * on 1 rank (rank 0 alone over COMM_SELF, the other ranks wait).
Beside each mpimesh time, the same run times two plain references on the same per-rank shapes:
"matmul": the step's five local matmuls in numpy into preallocated arrays (the local compute
alone, what this CPU's BLAS can do), and "numpy+MPI": a hand-written step with preallocated
buffers, in-place elementwise ops and raw mpi4py `Allreduce` (what careful hand-written code
gets); and "numpy, no MPI", the same step without its allreduces: the local step alone, below
which no step with communication can go (the verdicts print its ratio too). Data-parallel on one
node, two more hand-written references: the gradients summed through shared memory as mpimesh sums
its buckets ("with shared-memory sums": mpimesh's algorithm without mpimesh), and that with a
ZeRO-1 style sharded SGD ("a sharded update": rank j updates block j of each parameter as it sums
it, and writes it into every rank's copy); the three summed references give the same values, bitwise.
Runs are interleaved; the median of N is reported (a run's time is its slowest rank's).
The communication share is the time spent completing mpimesh's collectives (waiting for the other
rank, and the shared-memory sums of gradient buckets) over the step time, from separately
instrumented runs. "ratio" is mpimesh's
median over the matmuls' median; "(of min)" the same of the fastest runs, which other jobs on a
loaded machine disturb least.

The step runs eagerly ("eager") and compiled ("compiled": `mm.compile`, recorded once and replayed
without per-op Python, its parameters donated (`donate_argnums`): each step's new parameters are
the next step's, updated in place as the hand-written steps update theirs). The bars: the
model-parallel step within 1.1x of its own local matmuls eagerly, within 1.03x compiled; the
data-parallel step within 1.08x, eager and compiled (its gradients are written into their buckets
and summed there in place: no copy in or out, as the hand-written step's in-place `Allreduce`s),
each measured in the same run. No
verdict is given against absolute times: those published for Mesh-TensorFlow and JAX came from
another machine, and only ratios carry over between machines.
"""
import common  # noqa: F401  (first: clean BLAS environment, may re-exec)

import argparse
import mmap
import os
import statistics
import sys
import time
from typing import Callable, Dict, Optional

import numpy as np
from mpi4py import MPI

import mpimesh as mm
from mpimesh.collectives import shm
from mpimesh.layout import block_span
from common import WORLD, compare, kernel_report, load_average, rank0_print, table, verdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import two_layer as tl  # noqa: E402

TARGET_RATIO = 1.1  # model-parallel step / its local matmuls alone
COMPILED_RATIO = 1.03  # the same step compiled (mm.compile) / its local matmuls
DATA_PARALLEL_RATIO = 1.08  # the data-parallel step, eager and compiled / its local matmuls
LR = 1e-4  # small: repeated steps on one batch must not drift into huge or denormal values


def matmul_reference(b: int, dio: int, dh: int) -> Callable[[], None]:
    """The step's five local matmuls (forward x·w, h·v; backward hᵀ·dy, dy·vᵀ, xᵀ·dh) into
    preallocated arrays: the local compute alone, nothing else."""
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal(s, np.float32) for s in ((b, dio), (b, dio)))
    w, v = rng.standard_normal((dio, dh), np.float32), rng.standard_normal((dh, dio), np.float32)
    hb, yb, dvb, dwb = (np.empty(s, np.float32) for s in ((b, dh), (b, dio), (dh, dio), (dio, dh)))
    hb2 = np.empty_like(hb)

    def run() -> None:
        np.matmul(x, w, out=hb)
        np.matmul(hb, v, out=yb)
        np.matmul(hb.T, dy, out=dvb)
        np.matmul(dy, v.T, out=hb2)
        np.matmul(x.T, hb2, out=dwb)
    return run


def numpy_mpi_step(comm: MPI.Comm, b: int, b_global: int, dio: int, dh: int,
                   reduce_y: bool, grads: str) -> Callable[[], None]:
    """A hand-written step on this rank's slices (batch b of b_global, hidden dh), in place: with a raw
    `Allreduce` of y when hidden is split (`reduce_y`); the gradients, when batch is split, summed by
    `grads`: "mpi" (raw `Allreduce`s), "shm" (summed through shared memory as mpimesh sums its buckets,
    `SharedSums`), "sharded" (the same, each rank also updating only its block of every parameter,
    `SharedSums.sum`), or "none" (not summed: the local step alone)."""
    rng = np.random.default_rng(comm.Get_rank())
    shared = SharedSums(comm) if grads in ("shm", "sharded") else None
    alloc = shared.empty if shared is not None else (lambda shape: np.empty(shape, np.float32))
    x, t = rng.standard_normal((b, dio), np.float32), rng.standard_normal((b, dio), np.float32)
    own = alloc if grads == "sharded" else (lambda shape: np.empty(shape, np.float32))  # the others write it
    w, v = own((dio, dh)), own((dh, dio))
    init = np.random.default_rng(0)  # the parameters: the same on every rank (the data: each rank its own)
    w[...] = init.standard_normal((dio, dh), np.float32) / np.float32(np.sqrt(dio))
    v[...] = init.standard_normal((dh, dio), np.float32) / np.float32(np.sqrt(dh))
    bias = np.zeros(dh, np.float32)
    hpre, h, dhb = (np.empty((b, dh), np.float32) for _ in range(3))
    y = np.empty((b, dio), np.float32)
    dv, dw, db = alloc((dh, dio)), alloc((dio, dh)), np.empty(dh, np.float32)
    mask = np.empty((b, dh), bool)
    lr, inv_b = np.float32(LR), np.float32(1.0 / b_global)
    pairs = ((w, dw), (v, dv), (bias, db))
    if shared is not None:
        shared.connect()  # every rank maps the others' buffers

    def run() -> None:
        np.matmul(x, w, out=hpre)
        np.add(hpre, bias, out=hpre)
        np.maximum(hpre, 0, out=h)
        np.matmul(h, v, out=y)
        if reduce_y:
            comm.Allreduce(MPI.IN_PLACE, y, op=MPI.SUM)
        np.subtract(y, t, out=y)
        np.multiply(y, inv_b, out=y)  # y is now dy
        np.matmul(h.T, y, out=dv)
        np.matmul(y, v.T, out=dhb)
        np.greater(hpre, 0, out=mask)
        np.multiply(dhb, mask, out=dhb)
        np.sum(dhb, axis=0, out=db)
        np.matmul(x.T, dhb, out=dw)
        todo = pairs
        if grads == "mpi":
            for _, g in pairs:
                comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
        elif shared is not None:
            comm.Allreduce(MPI.IN_PLACE, db, op=MPI.SUM)  # (small; also: every rank's gradients are complete)
            for p, g in pairs[:2]:
                shared.sum(g, p if grads == "sharded" else None, lr)
            comm.Barrier()  # every block is written everywhere
            todo = pairs[2:] if grads == "sharded" else pairs
        for p, g in todo:
            np.multiply(g, lr, out=g)
            np.subtract(p, g, out=p)
    return run


def _map(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def one_node(comm: MPI.Comm) -> bool:
    """Whether the ranks of `comm` share a node (so `SharedSums` can map each other's memory)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    alone = node.Get_size() == comm.Get_size()
    node.Free()
    return comm.allreduce(alone and hasattr(os, "memfd_create"), op=MPI.LAND)


class SharedSums:
    """In-place sums of float32 arrays over the ranks of `comm` (one node) through shared memory, as
    `mpimesh/collectives/shm.py` sums gradient buckets: rank j sums block j of every rank's array,
    256 KB at a time, and writes the sum into all of them. With a parameter, ZeRO-1 style (no
    optimizer state to shard for SGD): rank j also updates block j of the parameter right after
    summing it (while it is in cache) and writes it into every rank's copy, so each rank updates
    1/k of each parameter instead of all of it. The arrays are memfds of this object's own (not
    mpimesh's pool, whose buffers mpimesh's steps use), mapped by the others through /proc."""

    def __init__(self, comm: MPI.Comm):
        self.comm, self.mine, self.peers = comm, [], {}

    def empty(self, shape: tuple) -> np.ndarray:
        nbytes = int(np.prod(shape)) * 4
        fd = os.memfd_create("mlp-step-reference")
        os.ftruncate(fd, nbytes)
        a = np.frombuffer(mmap.mmap(fd, nbytes), np.float32).reshape(shape)
        self.mine.append((a, fd))  # the descriptor stays open: the others open it by its number
        return a

    def connect(self) -> None:
        """Map every other rank's arrays (a collective)."""
        every = self.comm.allgather((os.getpid(), [fd for _, fd in self.mine]))
        me = self.comm.Get_rank()
        for i, (a, _) in enumerate(self.mine):
            self.peers[id(a)] = [a if q == me else np.frombuffer(_map(f"/proc/{pid}/fd/{fds[i]}"), np.float32)
                                 .reshape(a.shape) for q, (pid, fds) in enumerate(every)]
        self.scratch = np.empty(shm._BLOCK // 4, np.float32)

    def sum(self, g: np.ndarray, p: Optional[np.ndarray], lr: np.float32) -> None:
        """Sum `g` over the ranks in place (this rank's block); with `p`, update that block of `p`
        by SGD in every rank's copy."""
        k, j = self.comm.Get_size(), self.comm.Get_rank()
        gs = [a.reshape(-1) for a in self.peers[id(g)]]
        ps = [a.reshape(-1) for a in self.peers[id(p)]] if p is not None else None
        start, n = block_span(gs[0].size, k, j)
        for a in range(start, start + n, self.scratch.size):
            e = min(a + self.scratch.size, start + n)
            parts = [q[a:e] for q in gs]
            total = shm.tree_reduce(parts, np.add)  # (parts[0])
            for part in parts[1:]:
                np.copyto(part, total)
            if ps is not None:
                step = np.multiply(total, lr, out=self.scratch[:e - a])
                mine = np.subtract(ps[j][a:e], step, out=ps[j][a:e])
                for i, q in enumerate(ps):
                    if i != j:
                        np.copyto(q[a:e], mine)


def comm_share(mesh: mm.Mesh, step: Callable[[], object], runs: int) -> float:
    """Median fraction of the step spent completing mpimesh's collectives: waiting for them, and the
    shared-memory sums (`collectives/shm.py`: `ShmAllreduce.second`, which a bucket's request runs
    as it is waited for, just before it completes)."""
    coll = mesh.collectives
    spent, depth = [0.0], [0]

    def timing(plain):
        def timed(*a, **k):
            if depth[0]:  # one inside another (a shared-memory sum's records)
                return plain(*a, **k)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return plain(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
                depth[0] -= 1
        return timed
    coll._complete = timing(coll._complete)  # every transfer of the MPI transport completes here
    second = shm.ShmAllreduce.second
    shm.ShmAllreduce.second = timing(second)
    shares = []
    try:
        for _ in range(runs):
            mesh.barrier()
            spent[0] = 0.0
            t0 = time.perf_counter()
            step()
            shares.append(spent[0] / (time.perf_counter() - t0))
    finally:
        del coll._complete  # back to the class's method
        shm.ShmAllreduce.second = second
    return float(statistics.median(shares))


def bench_mode(name: str, rules: str, comm: MPI.Comm, s: "tl.Sizes", repeat: int) -> Dict[str, float]:
    """Time the mpimesh step under `rules` on a 1-D mesh over `comm`, and both references."""
    n = comm.Get_size()
    mesh = mm.Mesh(f"all:{n}", comm=comm)
    b, dio, dh = s.batch.size, s.io.size, s.hidden.size
    with mm.layout_scope(mesh, rules):
        params = tl.init_params(mesh, s, seed=0)
        x, target = tl.make_data(mesh, s)

        def ours() -> None:
            tl.train_step(params, x, target, LR, input_grad=False)
        step = mm.compile(lambda p, x, t: tl.train_step(p, x, t, LR, input_grad=False), donate_argnums=0)
        state = {k: v * 1.0 for k, v in params.items()}  # (its own: the eager step keeps `params`)

        def compiled() -> None:
            state.update(step(dict(state), x, target).params)
        lb = b // n if rules == "batch:all" else b
        lh = dh // n if rules == "hidden:all" else dh
        split_batch = rules == "batch:all" and n > 1
        fns = {"mpimesh": ours, "compiled": compiled, "matmul": matmul_reference(lb, dio, lh),
               "numpy+MPI": numpy_mpi_step(comm, lb, b, dio, lh, rules == "hidden:all" and n > 1,
                                           "mpi" if split_batch else "none"),
               "local": numpy_mpi_step(comm, lb, b, dio, lh, False, "none")}
        if split_batch and one_node(comm):
            fns.update({g: numpy_mpi_step(comm, lb, b, dio, lh, False, g) for g in ("shm", "sharded")})
        res = compare(fns, repeat=repeat, warmup=2, comm=comm)
        share = comm_share(mesh, ours, max(3, repeat // 2)) if n > 1 else 0.0
    flops = 5 * 2 * lb * dio * lh
    out = {k: 1e3 * v[1] for k, v in res.items()}
    out.update(share=share, gflops=flops / res["mpimesh"][1] / 1e9, min=1e3 * res["mpimesh"][0],
               min_ratio=res["mpimesh"][0] / res["matmul"][0],
               compiled_min_ratio=res["compiled"][0] / res["matmul"][0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10, help="timed runs per case (median is kept)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--d-io", type=int, default=1024)
    ap.add_argument("--d-hidden", type=int, default=4096)
    ap.add_argument("--no-single", action="store_true", help="skip the 1-rank run")
    args = ap.parse_args()
    s = tl.Sizes.of(args.batch, args.d_io, args.d_hidden)
    n = WORLD.Get_size()
    rank0_print(kernel_report())
    rank0_print(f"\ntwo-layer MLP step, b={args.batch} d_io={args.d_io} d_h={args.d_hidden}, float32, "
                f"forward + grads of w, bias, v + SGD; {n} ranks; median of {args.repeat} interleaved runs")
    modes = []
    if n > 1:
        modes += [("model-parallel", "hidden:all", WORLD), ("data-parallel", "batch:all", WORLD)]
    if not args.no_single or n == 1:
        modes.append(("1 rank", "", WORLD if n == 1 else MPI.COMM_SELF))
    rows, results = [], {}
    for name, rules, comm in modes:
        if comm is MPI.COMM_SELF:
            r = bench_mode(name, rules, comm, s, args.repeat) if WORLD.Get_rank() == 0 else None
            r = WORLD.bcast(r, root=0)  # the others wait here (a few floats: pickle is fine)
        else:
            r = bench_mode(name, rules, comm, s, args.repeat)
        results[name] = r
        ranks = 1 if comm is MPI.COMM_SELF else n
        rows.append((name, rules or "[]", ranks, f"{r['mpimesh']:.1f}", f"{r['min']:.1f}", f"{r['matmul']:.1f}",
                     f"{r['mpimesh'] / r['matmul']:.2f}", f"{r['min_ratio']:.2f}", f"{r['compiled']:.1f}",
                     f"{r['compiled'] / r['matmul']:.2f}", f"{r['numpy+MPI']:.1f}",
                     f"{r['mpimesh'] / r['numpy+MPI']:.2f}", f"{100 * r['share']:.0f}%", f"{r['gflops']:.0f}"))
    rank0_print(table(("mode", "layout", "ranks", "eager ms", "(min)", "matmul ms", "ratio", "(of min)",
                       "compiled ms", "ratio", "numpy+MPI ms", "ratio", "comm", "GFLOP/s/rank"), rows))
    if "model-parallel" in results:
        r = results["model-parallel"]
        ratio = r["mpimesh"] / r["matmul"]
        rank0_print(verdict(f"mlp_step model-parallel on {n} ranks within {TARGET_RATIO}x of its local matmuls",
                            ratio <= TARGET_RATIO, f"median ratio {ratio:.2f}, of the fastest runs "
                            f"{r['min_ratio']:.2f}; load average {load_average()}"))
        ratio = r["compiled"] / r["matmul"]
        rank0_print(verdict(f"mlp_step model-parallel on {n} ranks, compiled (mm.compile), within "
                            f"{COMPILED_RATIO}x of its local matmuls", ratio <= COMPILED_RATIO,
                            f"median ratio {ratio:.2f}, of the fastest runs {r['compiled_min_ratio']:.2f}; "
                            f"numpy with no MPI {r['local'] / r['matmul']:.2f}"))
    if "data-parallel" in results:
        r = results["data-parallel"]
        shared = (f", with shared-memory sums {r['shm'] / r['matmul']:.2f}, and a sharded update "
                  f"{r['sharded'] / r['matmul']:.2f}") if "shm" in r else ""
        for kind, key, of_min in (("eager", "mpimesh", "min_ratio"), ("compiled", "compiled", "compiled_min_ratio")):
            ratio = r[key] / r["matmul"]
            rank0_print(verdict(f"mlp_step data-parallel on {n} ranks, {kind}, within {DATA_PARALLEL_RATIO}x of its "
                                f"local matmuls", ratio <= DATA_PARALLEL_RATIO,
                                f"median ratio {ratio:.2f}, of the fastest runs {r[of_min]:.2f}; hand-written "
                                f"numpy+MPI {r['numpy+MPI'] / r['matmul']:.2f}{shared}, numpy with no MPI "
                                f"{r['local'] / r['matmul']:.2f}"))


if __name__ == "__main__":
    main()
