"""mpimesh collectives against raw mpi4py buffer calls, float32, 4 KiB .. 64 MiB per rank.

Run (common.py fixes the BLAS environment by itself):

    mpiexec -n 2 python benchmarks/collectives.py [--repeat N] [--max-mib 64]

On a mesh "all:2", each of allreduce, allgather (axis 0), alltoall, reduce_scatter and permute
(offset 1, wrapping) from `mesh.collectives` runs against the mpi4py buffer call a careful user
would write (`comm.Allreduce(x, out)` etc. with a preallocated output) on the same input buffer,
and the same mpimesh call given that preallocated output (`out=`). Runs are interleaved and the
minimum of N is kept; GB/s is this rank's input bytes per second.
Target: mpimesh/raw >= 0.95 from 1 MiB up, with and without `out=`.
"""
import common  # noqa: F401  (first: clean BLAS environment, may re-exec)

import argparse
from typing import Callable, Dict, Tuple

import numpy as np
from mpi4py import MPI

import mpimesh as mm
from common import WORLD, compare, fmt_bytes, kernel_report, rank0_print, table, verdict

TARGET, TARGET_FROM = 0.95, 1 << 20


def cases(mesh: mm.Mesh, comm: MPI.Comm, nbytes: int) -> Dict[str, Tuple[Callable, Callable, Callable]]:
    """For each collective: (raw mpi4py call, mpimesh call, mpimesh call into the raw call's output)
    on the same float32 input."""
    n, k = nbytes // 4, comm.Get_size()
    rank = comm.Get_rank()
    x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    coll = mesh.collectives
    same = np.empty_like(x)
    gathered = np.empty(k * n, np.float32)
    scattered = np.empty(n // k, np.float32)
    dest, src = (rank + 1) % k, (rank - 1) % k
    return {
        "allreduce": (lambda: comm.Allreduce(x, same, op=MPI.SUM),
                      lambda: coll.allreduce(x, ("all",)),
                      lambda: coll.allreduce(x, ("all",), out=same)),
        "allgather": (lambda: comm.Allgather(x, gathered),
                      lambda: coll.allgather(x, "all", 0),
                      lambda: coll.allgather(x, "all", 0, out=gathered)),
        "alltoall": (lambda: comm.Alltoall(x, same),
                     lambda: coll.alltoall(x, "all", 0, 0),
                     lambda: coll.alltoall(x, "all", 0, 0, out=same)),
        "reduce_scatter": (lambda: comm.Reduce_scatter_block(x, scattered, op=MPI.SUM),
                           lambda: coll.reduce_scatter(x, "all", 0),
                           lambda: coll.reduce_scatter(x, "all", 0, out=scattered)),
        "permute": (lambda: comm.Sendrecv(x, dest, 0, same, src, 0),
                    lambda: coll.permute(x, "all", 1),
                    lambda: coll.permute(x, "all", 1, out=same)),
    }


def check(mesh: mm.Mesh, comm: MPI.Comm) -> None:
    """The mpimesh result equals the raw result for every collective (small buffer)."""
    n, k, rank = 1024, comm.Get_size(), comm.Get_rank()
    x = np.arange(n, dtype=np.float32) + 1000 * rank
    coll = mesh.collectives
    ref = np.empty_like(x)
    comm.Allreduce(x, ref)
    assert np.array_equal(coll.allreduce(x, ("all",)), ref)
    ref = np.empty(k * n, np.float32)
    comm.Allgather(x, ref)
    assert np.array_equal(coll.allgather(x, "all", 0), ref)
    ref = np.empty_like(x)
    comm.Alltoall(x, ref)
    assert np.array_equal(coll.alltoall(x, "all", 0, 0), ref)
    ref = np.empty(n // k, np.float32)
    comm.Reduce_scatter_block(x, ref)
    assert np.array_equal(coll.reduce_scatter(x, "all", 0), ref)
    ref = np.empty_like(x)
    comm.Sendrecv(x, (rank + 1) % k, 0, ref, (rank - 1) % k, 0)
    assert np.array_equal(coll.permute(x, "all", 1), ref)
    assert np.array_equal(coll.permute(x, "all", 1, out=np.empty_like(x)), ref)
    out = np.empty(k * n, np.float32)
    comm.Allgather(x, ref := np.empty(k * n, np.float32))
    assert coll.allgather(x, "all", 0, out=out) is out and np.array_equal(out, ref)
    y = x.copy()
    comm.Allreduce(x, ref := np.empty_like(x))
    assert coll.allreduce(y, ("all",), out=y) is y and np.array_equal(y, ref)  # in place


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15, help="timed runs per size (min is kept)")
    ap.add_argument("--max-mib", type=int, default=64, help="largest buffer, MiB")
    ap.add_argument("--only", nargs="*", default=None, help="collectives to run (default: all)")
    args = ap.parse_args()

    rank0_print(kernel_report())
    if WORLD.Get_size() != 2:
        rank0_print(f"note: meant for 2 ranks, running on {WORLD.Get_size()}")
    mesh = mm.Mesh(f"all:{WORLD.Get_size()}")
    comm = WORLD.Dup()
    check(mesh, comm)

    sizes = [4096 * 4 ** i for i in range(12) if 4096 * 4 ** i <= args.max_mib << 20]
    rows, worst = [], {}
    for name in args.only or ("allreduce", "allgather", "alltoall", "reduce_scatter", "permute"):
        for nbytes in sizes:
            raw, ours, into = cases(mesh, comm, nbytes)[name]
            inner = max(1, (1 << 22) // nbytes)  # >= ~4 MiB moved per timed run

            def loop(f, m=inner):
                def run():
                    for _ in range(m):
                        f()  # each result dropped at once, as in a real loop
                return run

            res = compare({"raw": loop(raw), "mpimesh": loop(ours), "out=": loop(into)}, args.repeat, warmup=2,
                          comm=comm)
            gbs = {k: nbytes * inner / v[0] / 1e9 for k, v in res.items()}
            ratio, ratio_out = gbs["mpimesh"] / gbs["raw"], gbs["out="] / gbs["raw"]
            rows.append((name, fmt_bytes(nbytes), f"{gbs['raw']:.2f}", f"{gbs['mpimesh']:.2f}", f"{ratio:.3f}",
                         f"{gbs['out=']:.2f}", f"{ratio_out:.3f}"))
            for key, r in ((name, ratio), (f"{name} out=", ratio_out)):
                if nbytes >= TARGET_FROM and r < worst.get(key, (np.inf, ""))[0]:
                    worst[key] = (r, fmt_bytes(nbytes))
    rank0_print(f"\nfloat32 buffers, {WORLD.Get_size()} ranks, min of {args.repeat} interleaved runs; "
                "GB/s = this rank's input bytes / time")
    rank0_print(table(("collective", "size", "raw GB/s", "mpimesh GB/s", "ratio", "out= GB/s", "out= ratio"), rows))
    rank0_print()
    for name, (ratio, at) in worst.items():
        rank0_print(verdict(f"{name} mpimesh/raw >= {TARGET} from 1 MiB", ratio >= TARGET,
                            f"worst ratio {ratio:.3f} at {at}"))


if __name__ == "__main__":
    main()
