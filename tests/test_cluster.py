"""A cluster on one machine (`mpimesh.testing.Cluster`): hosts in network namespaces, MPICH between
them over TCP, and what happens at a node boundary: node-aware placement, the Transformer learning
across hosts with one host's losses, a checkpoint shared by two hosts resumed on one, a link cut
and a host killed in the middle of collectives (the error names the missing ranks within the
time-out plus 10 s, every host exits non-zero, no process or namespace is left behind).

Runs in the 1-rank session (each test starts its own jobs); skipped with one line where namespaces
cannot be made (not root, no iproute2). About a minute in all.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpimesh.launch import find_mpiexec, job_env
from mpimesh.testing import Cluster, cleanup_leftovers, namespaces, tool, unavailable

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "apps" / "transformer.py")
WHY = unavailable()

pytestmark = [pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="spawns its own jobs; runs in the 1-rank session"),
              pytest.mark.skipif(WHY is not None, reason=f"no namespaced hosts: {WHY}")]


@pytest.fixture(scope="module")
def cluster():
    """Two hosts of two ranks each; whatever an earlier, killed run left is removed first."""
    cleanup_leftovers()
    with Cluster(hosts=2, slots=2) as c:
        yield c
    assert not [ns for ns in namespaces() if ns.startswith(c.prefix)], "namespaces left behind"


def _env(cluster, **extra) -> dict:
    env = cluster.env(PYTHONPATH=str(ROOT), **extra)
    for var in ("MPIMESH_COLLECTIVE_TIMEOUT", "MPIMESH_SPMD_CHECK", "MPIMESH_NO_ABORT", "MPIMESH_THREADS",
                "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "MPIMESH_AUTO_THREADS"):
        env.pop(var, None)
    env.update(extra)
    return env


def _output(p: subprocess.Popen, timeout: float, what: str) -> str:
    """`p`'s output once it ends, or a failure (after killing it) if it runs past `timeout`."""
    try:
        return p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"{what} ran past {timeout} s:\n{p.communicate()[0][-3000:]}")


def _run(cluster, n: int, argv: list, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    p = cluster.mpiexec(n, argv, env=_env(cluster, **env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = _output(p, timeout, "the job")
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


PLACEMENT = """
import json, os, socket, sys
import numpy as np
from mpi4py import MPI
import mpimesh as mm
from mpimesh import threads
from mpimesh.collectives import placement
comm = MPI.COMM_WORLD
mesh = mm.Mesh("rows:2;cols:2")  # the first mesh sets the BLAS threads from the node's rank count
x = np.ones(1 << 21)  # 16 MiB summed over all ranks: at least that much crosses each host's link
comm.Allreduce(MPI.IN_PLACE, x)
shares = []
placement.use_device = lambda index: None  # (placement's own names of backend's functions)
placement.cap_gpu_pool = lambda index, ranks: shares.append(ranks)
found = {}
for gpus in (1, 2):  # a fake GPU count per node
    placement.device_count = lambda: gpus
    found[gpus] = placement.choose(comm, "cupy", None, "staged")[0]
local, per_node = placement.node_rank(comm)
with open(os.path.join(os.environ["OUTDIR"], f"placed{comm.rank}.json"), "w") as f:
    json.dump(dict(rank=comm.rank, host=socket.gethostname(), local=local, per_node=per_node,
                   threads=threads.settings(), devices=found, shares=shares, sum=float(x[0])), f)
"""


def test_two_hosts_talk_tcp_and_each_rank_sees_its_node(cluster, tmp_path):
    script = tmp_path / "placement.py"
    script.write_text(PLACEMENT)
    before = [cluster.bytes(h) for h in range(2)]
    r = _run(cluster, 4, [sys.executable, str(script)], OUTDIR=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:]
    placed = [json.loads((tmp_path / f"placed{rank}.json").read_text()) for rank in range(4)]
    assert [p["host"] for p in placed] == ["h0", "h0", "h1", "h1"]
    assert [(p["local"], p["per_node"]) for p in placed] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert all(p["threads"]["local_ranks"] == 2 and p["threads"]["threads"] == max(1, os.cpu_count() // 2)
               for p in placed), [p["threads"] for p in placed]
    assert [p["devices"] for p in placed] == [{"1": 0, "2": 0}, {"1": 0, "2": 1}] * 2  # index % gpus, per node
    assert all(p["shares"] == [2, 1] for p in placed)  # one GPU: shared by its node's 2 ranks, not by 4
    assert all(p["sum"] == 4.0 for p in placed)
    for h in range(2):  # TCP over the veth links: the 16 MiB allreduce crossed each host's link
        received = cluster.bytes(h)[0] - before[h][0]
        sent = cluster.bytes(h)[1] - before[h][1]
        assert received > 8 << 20 and sent > 8 << 20, (h, received, sent)


def _losses(path: Path) -> dict:
    return {d["step"]: d["loss"] for d in (json.loads(line) for line in path.read_text().splitlines())}


def _app(steps: int, log: Path, *more: str) -> list:
    return [sys.executable, APP, "--mesh", "rows:2;cols:2", "--steps", str(steps), "--eval-every", str(steps),
            "--log-every", "10", "--samples", "0", "--log-json", str(log), *more]


def _one_host(argv: list, timeout: float = 180) -> subprocess.CompletedProcess:
    env = job_env(PYTHONPATH=str(ROOT))
    for var in ("MPIMESH_COLLECTIVE_TIMEOUT", "MPIMESH_SPMD_CHECK"):
        env.pop(var, None)
    return subprocess.run([find_mpiexec(), "-n", "4", *argv], env=env, capture_output=True, text=True, timeout=timeout)


STEPS = 60


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """The uninterrupted 60-step run on one host, 4 ranks: losses by step."""
    log = tmp_path_factory.mktemp("one") / "losses.json"
    r = _one_host(_app(STEPS, log))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return _losses(log)


def test_the_transformer_learns_across_two_hosts_with_one_hosts_losses(cluster, one_host, tmp_path):
    """rows:2 spans the hosts (ranks 0, 1 on h0, 2, 3 on h1), cols:2 stays inside each."""
    log = tmp_path / "losses.json"
    before = cluster.bytes(1)
    launch = [sys.executable, "-m", "mpimesh.launch", "-n", "4", "--hostfile", cluster.hostfile,
              "--launcher-args", " ".join(cluster.launcher_args()), *_app(STEPS, log)[1:]]
    r = subprocess.run(cluster.host_argv(0, launch), env=_env(cluster), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = _losses(log)
    assert sorted(losses) == sorted(one_host)
    np.testing.assert_allclose([losses[s] for s in sorted(losses)], [one_host[s] for s in sorted(one_host)], rtol=1e-5)
    m = re.search(r"= ([\d.]+) bits per byte, .* the unigram baseline ([\d.]+)", r.stdout)
    assert m and float(m.group(1)) < float(m.group(2)), r.stdout[-1500:]
    assert cluster.bytes(1)[1] - before[1] > 1 << 20  # the step's traffic crossed the link


def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            pytest.fail(f"waited {timeout} s for {what}")
        time.sleep(0.1)


def _gone(cluster, p: subprocess.Popen, t0: float, timeout: float) -> tuple:
    """Wait for the job's end and its hosts' emptiness: (mpiexec's exit status, seconds, output)."""
    out = _output(p, timeout, "mpiexec, after the fault,")
    seconds = time.monotonic() - t0
    left = cluster.wait_empty(15)
    assert not left, f"left behind {time.monotonic() - t0:.1f} s after the fault: {cluster.describe(left)}"
    return p.returncode, seconds, out


def test_a_checkpoint_shared_by_two_hosts_resumes_on_one_after_a_link_fails(cluster, one_host, tmp_path):
    """Two hosts save into one directory every 10 steps; h1's link goes down after step 25; the
    job ends on both hosts; 4 ranks on one host resume from the newest checkpoint and continue the
    uninterrupted loss curve."""
    log, ckpt = tmp_path / "losses.json", tmp_path / "ckpt"
    argv = _app(STEPS, log, "--checkpoint", str(ckpt), "--save-every", "10")
    p = cluster.mpiexec(4, argv, env=_env(cluster, MPIMESH_COLLECTIVE_TIMEOUT="10"), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: log.exists() and max(_losses(log), default=0) >= 25 or p.poll() is not None, 120, "step 25")
    t0 = time.monotonic()
    cluster.link(1, False)
    try:
        code, seconds, out = _gone(cluster, p, t0, 60)
    finally:
        cluster.link(1, True)
    assert code != 0 and seconds < 10 + 10, (code, seconds, out[-2000:])
    assert "CollectiveTimeoutError" in out and re.search(r"ranks \[[23](, [23])?\] never arrived|no answer from ranks \[2, 3\]", out), out[-3000:]
    done = max(_losses(log))
    assert done < STEPS, "the job finished before the link went down"
    newest = sorted(os.listdir(ckpt))[-1]
    assert int(newest.split("-")[1]) <= done
    relog = tmp_path / "resumed.json"
    r = _one_host(_app(STEPS, relog, "--checkpoint", str(ckpt), "--resume"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    resumed = _losses(relog)
    start = int(newest.split("-")[1])
    assert min(resumed) == start + 10 or min(resumed) > start, sorted(resumed)[:3]
    np.testing.assert_allclose([resumed[s] for s in sorted(resumed)], [one_host[s] for s in sorted(resumed)], rtol=1e-5)


LOOP = """
import os, sys, time
import mpimesh as mm
mesh = mm.Mesh("rows:2;cols:2", layout="batch:rows")
x = mesh.ones("batch:2;d:2097152", dtype="float32")  # each rank one 8 MiB row: the sum crosses hosts
steps = 0
while True:
    t0 = time.monotonic()
    try:
        mm.reduce_sum(x, output_shape="d:2097152")
    except mm.CollectiveTimeoutError as e:
        print(f"rank {mesh.rank} raised after {time.monotonic() - t0:.2f} s", flush=True)
        raise
    steps += 1
    if steps == 3:
        open(os.path.join(os.environ["OUTDIR"], f"running{mesh.rank}"), "w").close()
"""


@pytest.mark.parametrize("fault", ["link", "host"])
def test_a_fault_mid_allreduce_ends_the_job_on_every_host(cluster, tmp_path, fault):
    """`link`: h1's link goes down; `host`: h1 dies (its link silent, every process there killed
    with SIGKILL). The ranks on h0 raise, naming the ranks on h1, within the time-out plus 10 s;
    mpiexec exits non-zero; h1's ranks (link) time out too, and since their abort cannot reach the
    launcher, end themselves after a grace, saying so; nothing is left on either host."""
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(LOOP))
    argv = ["sh", "-c", f'exec "{sys.executable}" "{script}" 2> "{tmp_path}/rank$PMI_RANK.err"']
    p = cluster.mpiexec(4, argv, env=_env(cluster, OUTDIR=str(tmp_path), MPIMESH_COLLECTIVE_TIMEOUT="10"),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: all((tmp_path / f"running{r}").exists() for r in range(4)) or p.poll() is not None, 60,
              "4 ranks in their allreduces")
    t0 = time.monotonic()
    cluster.link(1, False)
    if fault == "host":
        killed = cluster.kill(1)
        assert killed
    try:
        code, seconds, out = _gone(cluster, p, t0, 60)
    finally:
        cluster.link(1, True)
    assert code != 0 and seconds < 10 + 10, (code, seconds, out[-2000:])
    errs = {r: (tmp_path / f"rank{r}.err").read_text() for r in range(4)}
    for r, missing in ((0, 2), (1, 3)):  # each rank's row partner is on the other host
        assert re.search(rf"rank {r}: CollectiveTimeoutError: .*rank {missing}", errs[r]), errs[r][-1500:]
    if fault == "link":  # cut off, they time out as well; their launcher proxy ends them, or the watchdog
        for r in (2, 3):
            assert re.search(rf"rank {r}: CollectiveTimeoutError: .*rank {r - 2}", errs[r]), errs[r][-1500:]



NETWORK = """
import json, os
import mpimesh as mm
from mpimesh.cost import ArgSpec
mesh = mm.Mesh("rows:2;cols:2")  # rows across the hosts, cols inside each
machine = mm.cost.calibrate(mesh)
B, D, H = 512, 256, 2048


def step(x, w1, w2):
    with mm.trace():
        h = mm.relu(mm.einsum([x, w1], output_shape=f"batch:{B};hidden:{H}"))
        y = mm.einsum([h, w2], output_shape=f"batch:{B};io:{D}")
        loss = mm.reduce_mean(mm.square(y - x))
        g1, g2 = mm.gradients([loss], [w1, w2])
        return w1 - 0.01 * g1, w2 - 0.01 * g2, loss


args = (ArgSpec(f"batch:{B};io:{D}", "float32"), ArgSpec(f"io:{D};hidden:{H}", "float32"),
        ArgSpec(f"hidden:{H};io:{D}", "float32"))
plan = mm.auto_layout(step, args, mesh, machine=machine)
e = mm.cost.estimate(plan.recording, plan.rules, mesh.shape, machine)
if mesh.rank == 0:
    with open(os.environ["OUTDIR"] + "/network.json", "w") as f:
        json.dump(dict(links=dict((d, machine.link(d)) for d in ("rows", "cols")), rules=plan.rules,
                       collectives=e["collectives"], report=plan.report()), f)
"""


def test_the_cost_model_sees_the_shaped_link_and_keeps_heavy_traffic_inside_hosts(cluster, tmp_path):
    """Both hosts' links shaped to 200 Mbit/s (`tc tbf`): `calibrate` measures the cross-host
    dim's bandwidth within 25% of each rank's share of it (two ranks of a host send at once), far
    below the in-host dim's; `auto_layout` then sends more bytes over the in-host dim than over
    the cross-host one. Delays need netem, which this kernel may lack (then not checked)."""
    script = tmp_path / "network.py"
    script.write_text(NETWORK)
    rate = 200e6 / 8
    for h in range(2):
        cluster.shape(h, "200mbit")
    try:
        r = _run(cluster, 4, [sys.executable, str(script)], timeout=300, OUTDIR=str(tmp_path))
    finally:
        for h in range(2):
            cluster.unshape(h)
    assert r.returncode == 0, r.stdout[-3000:]
    got = json.loads((tmp_path / "network.json").read_text())
    (_, rows_beta), (_, cols_beta) = got["links"]["rows"], got["links"]["cols"]
    print(f"calibrated: rows {rows_beta / 1e6:.1f} MB/s (shaped share {rate / 2 / 1e6:.1f}), cols "
          f"{cols_beta / 1e6:.1f} MB/s; netem {'available' if cluster.netem_available() else 'missing'}\n{got['report']}")
    assert abs(rows_beta - rate / 2) <= 0.25 * rate / 2, got["links"]
    assert cols_beta > 4 * rows_beta, got["links"]
    over = {dims: sum(c["bytes"] for k, c in got["collectives"].items() if k.split("/")[-1] == dims)
            for dims in ("rows", "cols")}
    assert over["rows"] < over["cols"], (got["rules"], got["collectives"])


def test_the_benchmarks_run_across_hosts(tmp_path):
    """`benchmarks/cluster.py --quick`: the transport report says TCP, the cost model's Spearman and
    median error on the 2-host mesh are printed, and the scaling table's measured bytes match
    their formulas on 1 host and on 2."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cluster.py"), "--quick", "--out", str(tmp_path)],
                       env=job_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "UCX_TLS=tcp,self: the hosts talk TCP" in r.stdout, r.stdout[:2000]
    assert re.search(r"all: Spearman [\d.]+, median relative error \d+%", r.stdout), r.stdout[-3000:]
    # the measured table's rows (15 columns); the cluster predictions' table (11 columns) goes on to 32 ranks
    rows = [line.split() for line in r.stdout.splitlines() if re.match(r"\s+mlp\s+strong\s+\w+\s+\d+\s+[\d.]+\s", line)]
    rows = [row for row in rows if len(row) == 15]
    assert sorted({int(row[3]) for row in rows}) == [1, 2, 4] and all(row[10] == "yes" for row in rows), rows
    assert (tmp_path / "scaling.csv").exists() and (tmp_path / "cost_model.csv").exists()


def test_leftovers_of_a_killed_run_are_removed():
    """A namespace named for a process that is gone, with a process still in it, as a run killed
    with SIGKILL leaves it: `cleanup_leftovers` ends the process and deletes the namespace."""
    dead = 4_000_000  # above pid_max: no such process
    ns = f"mpimesh-{dead}-1-h0"
    ip = tool("ip")
    subprocess.run([ip, "netns", "add", ns], check=True)
    sleeper = subprocess.Popen([ip, "netns", "exec", ns, "sleep", "300"])
    try:
        _wait_for(lambda: subprocess.run([ip, "netns", "pids", ns], capture_output=True, text=True).stdout.strip(),
                  10, "the process in the namespace")
        assert ns in cleanup_leftovers()
        assert sleeper.wait(10) == -9
        assert ns not in namespaces()
    finally:
        sleeper.kill()
        subprocess.run([ip, "netns", "del", ns], capture_output=True)
