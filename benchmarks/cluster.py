"""The benchmarks across hosts: a cluster of network-namespace hosts on this machine, MPI over TCP.

    sudo python benchmarks/cluster.py                      # 2 hosts x 2 ranks, links unshaped
    sudo python benchmarks/cluster.py --rate 1gbit         # each host's link shaped (tc tbf)
    sudo python benchmarks/cluster.py --quick              # small and fast (the CI smoke run)

Run with plain `python` as root (it makes the namespaces: `mpimesh.testing.Cluster`). It prints
the transport (MPI library, `UCX_TLS`, and the bytes a 64 MiB allreduce put on each host's link,
against the ring's 2(k-1)/k of the payload), then runs, across the hosts:
  * `benchmarks/cost_model.py` on 4 ranks (mesh rows:2;cols:2, rows across the hosts): the
    Spearman correlation and median error of the cost model's predictions, calibrated there;
  * `benchmarks/scaling.py` on 1, 2 and 4 ranks (1 and 2 on one host, 4 on two), with its
    efficiency table, plots and measured bytes beside the formulas.
Results go to `--out` (default benchmarks/results/cluster/). Delays need `tc netem`, which many
kernels lack: the driver says whether it could add `--delay`.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpimesh.launch import find_mpiexec  # noqa: E402
from mpimesh.testing import Cluster, unavailable  # noqa: E402

TRANSPORT = """
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
x = np.ones(8 << 20)  # 64 MiB
comm.Allreduce(MPI.IN_PLACE, x)
if comm.rank == 0:
    print(MPI.Get_library_version().splitlines()[0], flush=True)
"""


def run(cmd: list, env: dict, timeout: float) -> int:
    print(f"$ {shlex.join(cmd)}", flush=True)
    t0 = time.monotonic()
    code = subprocess.run(cmd, env=env, timeout=timeout).returncode
    print(f"(exit {code}, {time.monotonic() - t0:.1f} s)", flush=True)
    return code


def transport(cluster: Cluster, env: dict, out: str) -> None:
    """What MPI chose between the hosts: the bytes a 64 MiB allreduce over 2 hosts x 1 rank put on
    the links (TCP: about the payload each way; shared memory: nothing)."""
    script = os.path.join(out, "transport.py")
    with open(script, "w") as f:
        f.write(TRANSPORT)
    before = [cluster.bytes(h) for h in range(2)]
    argv = cluster.host_argv(0, [find_mpiexec(), "-f", cluster.hostfile, *cluster.launcher_args(),
                                 "-ppn", "1", "-n", "2", sys.executable, script])
    subprocess.run(argv, env=env, check=True, timeout=120)
    payload = 64 << 20
    sent = []
    for h in range(2):
        rx, tx = (a - b for a, b in zip(cluster.bytes(h), before[h]))
        sent.append(tx)
        print(f"  host h{h}: sent {tx / 2**20:.1f} MiB, received {rx / 2**20:.1f} MiB over its link (a ring "
              f"allreduce of {payload / 2**20:.0f} MiB on 2 ranks sends about that much each way)")
    print(f"  UCX_TLS={env.get('UCX_TLS')}: the hosts talk {'TCP' if min(sent) > payload // 2 else 'NOT over TCP'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--slots", type=int, default=2, help="ranks per host")
    ap.add_argument("--rate", default=None, help="shape each host's link, e.g. 1gbit (tc tbf)")
    ap.add_argument("--quick", action="store_true", help="one repeat, tiny sizes, the MLP only")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cluster"))
    ap.add_argument("--skip", nargs="*", default=[], choices=["cost_model", "scaling"])
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(f"benchmarks/cluster.py: no namespaced hosts here: {why}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    n = args.hosts * args.slots
    codes = []
    with Cluster(args.hosts, args.slots) as cluster:
        print(f"{cluster}: hosts {', '.join(cluster.address)}; netem (delays) "
              f"{'available' if cluster.netem_available() else 'missing from this kernel: no delays'}")
        if args.rate:
            for h in range(args.hosts):
                cluster.shape(h, args.rate)
            print(f"each host's link shaped to {args.rate} (tc tbf)")
        env = cluster.env(PYTHONPATH=ROOT)
        transport(cluster, env, args.out)
        if "cost_model" not in args.skip:
            repeat = ["--repeat", "1", "--no-auto"] if args.quick else []
            codes.append(run(cluster.mpiexec_argv(n, [sys.executable, os.path.join(HERE, "cost_model.py"), *repeat,
                                                      "--out", args.out]), env, 1800))
        if "scaling" not in args.skip:
            template = shlex.join(cluster.host_argv(0, [find_mpiexec(), "-f", cluster.hostfile,
                                                        *cluster.launcher_args()])) + " -n {n}"
            quick = ["--size", "tiny", "--workloads", "mlp", "--repeat", "1", "--mode", "strong"] if args.quick else []
            ranks = ",".join(str(k) for k in (1, args.slots, n) if k <= n)
            codes.append(run([sys.executable, os.path.join(HERE, "scaling.py"), "--launcher", template, "--ranks",
                              ranks, "--out", args.out, *quick], env, 3600))
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main())
