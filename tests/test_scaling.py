"""benchmarks/scaling.py: each workload's measured communication equals its formula and a count
made here by hand; result rows carry every CSV field; speedup and efficiency follow their
definitions; bad command lines end with a message naming the field; the driver runs end to end
(1-rank session). The cost model's side (benchmarks/cluster_spec.py): rows marked oversubscribed
where ranks outnumber cores; the predictions on a described cluster equal the ring allreduce and
roofline formulas computed here by hand, within a node and across nodes.

The in-process cases run the worker's own `run_case` on COMM_WORLD at the `tiny` sizes, for the
data, model and 2-D layouts, strong and weak.
"""
from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh.cost.cache import read_machine, write_machine

ROOT = Path(__file__).resolve().parents[1]
N = MPI.COMM_WORLD.Get_size()
F32 = 4
THREE_D = "batch:rows;hidden:cols;io:planes"  # the paper's 3-D layout: every einsum dim split
CASES = [(w, lay) for w in ("einsum", "mlp", "transformer") for lay in ("data", "model", "2d")] + \
    [("einsum", "3d"), ("mlp", "3d")]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def scaling():
    """benchmarks/scaling.py, imported with the BLAS variables already pinned (else common.py
    would re-execute this interpreter) and the benchmark lock off (tests never wait for it)."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            mp.setenv(var, "1")
        for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
            mp.delenv(var, raising=False)
        mp.setenv("MPIMESH_BENCH_LOCK", "")
        mp.syspath_prepend(str(ROOT / "benchmarks"))
        import scaling as module
    return module


_MESHES: dict = {}


def _mesh(shape: str) -> mm.Mesh:
    if shape not in _MESHES:
        _MESHES[shape] = mm.Mesh(shape, backend="numpy")  # (the benchmark models host MPI traffic)
    return _MESHES[shape]


def _ways(mesh_shape: str) -> dict:
    return {d.name: d.size for d in mm.Shape(mesh_shape)}


def hand_count(workload: str, layout: str, s: dict, mesh_shape: str) -> dict:
    """Allreduced elements per rank and mesh dim, counted from the model by hand (Table 1 for
    the MLP with the input gradient; zero terms dropped)."""
    k = _ways(mesh_shape)
    n, r, c, p = k.get("all", 1), k.get("rows", 1), k.get("cols", 1), k.get("planes", 1)
    out: dict = {}
    if workload == "einsum":
        b, h = s["batch"], s["hidden"]
        out = {"data": {}, "model": {"allreduce/all": b * h}, "2d": {"allreduce/cols": b // r * h},
               "3d": {"allreduce/planes": b // r * h // c}}[layout]
    elif workload == "mlp":
        b, io, h = s["batch"], s["io"], s["hidden"]
        out = {"data": {"allreduce/all": 2 * io * h + h}, "model": {"allreduce/all": 2 * b * io},
               "2d": {"allreduce/rows": 2 * io * h // c + h // c, "allreduce/cols": 2 * b * io // r},
               "3d": {"allreduce/planes": 2 * b * h // (r * c), "allreduce/cols": 2 * b * io // (r * p),
                      "allreduce/rows": 2 * io * h // (p * c) + h // c}}[layout]
    else:
        d, h, kv, f, L, V, ln = (s[x] for x in ("d_model", "heads", "d_kv", "d_ff", "layers", "vocab", "length"))

        def params(m: int) -> int:  # elements of all parameters with heads, d_ff and vocab split m ways
            return V * d // m + ln * d + L * (4 * d + 4 * d * h * kv // m + 2 * d * f // m) + 2 * d + d * V // m

        def model(tokens: int) -> int:
            # embedding fwd, logits bwd; per layer: attention out + FFN out fwd, q k v + FFN in bwd;
            # cross-entropy max, sum, target; Adafactor: 2 scalars for each of the 2 + 6L split
            # params, and a d_model-sized factored mean for embed, logits, wi, wo (d0 split)
            return tokens * d * (2 + 6 * L) + 3 * tokens + 2 * (2 + 6 * L) + 4 * d
        if layout == "data":
            out = {"allreduce/all": params(1) + 1}
        elif layout == "model":
            out = {"allreduce/all": model(s["batch"] * ln)}
        else:
            out = {"allreduce/rows": params(c) + 1, "allreduce/cols": model(s["batch"] // r * ln)}
    active = {"all": n, "rows": r, "cols": c, "planes": p}
    return {key: v for key, v in out.items() if active[key.split("/")[1]] > 1}


@pytest.mark.parametrize("mode", ["strong", "weak"])
@pytest.mark.parametrize("workload, layout", CASES)
def test_comm_equals_formula_and_hand_count(scaling, workload, layout, mode):
    rules = THREE_D if layout == "3d" else scaling.WORKLOADS[workload].presets[layout]
    sizes = scaling.sizes_for(workload, "tiny", mode, N, {})
    assert sizes["batch"] == scaling.WORKLOADS[workload].sizes["tiny"]["batch"] * (N if mode == "weak" else 1)
    case = scaling.Case(workload, mode, layout, rules, scaling.mesh_for("auto", rules, N), N, sizes)
    try:
        scaling.check_case(case)
    except scaling.UnfitError as e:  # e.g. batch 64 over 3 ranks: the step runs, but the formulas count equal blocks
        assert any(N % k for k in (2, 4, 8)), e
        pytest.skip(str(e))
    mesh = _mesh(case.mesh)
    expected = hand_count(workload, layout, sizes, case.mesh)
    row = scaling.run_case(case, mesh, repeat=1, warmup=0)
    assert scaling.WORKLOADS[workload].formula(mesh, rules, sizes).elements == expected
    assert row["comm_bytes_measured"] == F32 * sum(expected.values())
    assert row["comm_bytes_formula"] == row["comm_bytes_measured"] and row["comm_match"]
    assert row["comm_keys"] == sorted(expected)
    assert (row["comm_calls"] > 0) == bool(expected)


def test_result_row_has_every_field(scaling, tmp_path):
    rules = scaling.WORKLOADS["mlp"].presets["model"]
    sizes = scaling.sizes_for("mlp", "tiny", "strong", N, {})
    case = scaling.Case("mlp", "strong", "model", rules, f"all:{N}", N, sizes)
    row = scaling.run_case(case, _mesh(case.mesh), repeat=2, warmup=1)
    driver_fields = {"speedup", "efficiency", "cores", "oversubscribed", "predicted_ms", "predicted_compute_ms",
                     "predicted_comm_ms", "predicted_over_measured", "predicted_speedup", "predicted_efficiency"}
    assert set(scaling.CSV_FIELDS) - set(row) == driver_fields
    assert (row["workload"], row["mode"], row["layout"], row["rules"], row["mesh"], row["ranks"]) == \
        ("mlp", "strong", "model", "hidden:all", f"all:{N}", N)
    assert row["sizes"] == "batch=16 io=8 hidden=32"
    assert 0 < row["step_ms_min"] <= row["step_ms_median"]
    assert len(row["loadavg"].split()) == 3 and row["blas_kernel"]
    # the step's matmuls: forward x·w, h·v; backward dv, dh, dw, dx: 6 x 2·b·io·h/N flops per rank (at
    # least the smallest block of hidden's when N does not divide 32)
    assert row["gflop_per_rank"] * 1e9 >= 6 * 2 * 16 * 8 * (32 // N)
    scaling.add_scaling([row])
    machine = read_machine(str(_machine_file(_mine(tmp_path, "m.json"))))
    scaling.add_predictions([row], {("mlp", "strong", "model", N): case}, {1: machine}, cores=2)
    path = _mine(tmp_path, "rows.csv")
    scaling.write_csv([row], str(path))
    with open(path) as f:
        (written,) = list(csv.DictReader(f))
    assert list(written) == scaling.CSV_FIELDS
    assert (written["speedup"], written["efficiency"], written["comm_match"]) == ("1", "1", "True")
    assert (written["cores"], written["oversubscribed"], written["predicted_efficiency"]) == ("2", str(N > 2), "1")


def test_speedup_and_efficiency(scaling):
    rows = [{"workload": "w", "mode": m, "layout": "l", "ranks": n, "step_ms_median": t}
            for m in ("strong", "weak") for n, t in ((2, 8.0), (4, 5.0), (8, 4.0))]
    scaling.add_scaling(rows)
    got = [(r["mode"], r["ranks"], round(r["speedup"], 6), round(r["efficiency"], 6)) for r in rows]
    assert got == [("strong", 2, 1.0, 1.0), ("strong", 4, 1.6, 0.8), ("strong", 8, 2.0, 0.5),
                   ("weak", 2, 1.0, 1.0), ("weak", 4, 3.2, 1.6), ("weak", 8, 8.0, 2.0)]


CLUSTER_ERRORS = {
    "cores=16, link=12.5GB, latency=5us": "link='12.5GB' is not a number with a unit",
    "cores=16, link=12.5GB/s": "missing field latency",
    "link=1GB/s, latency=5us": "missing field cores (or gpus)",
    "cores=4, link=1GB/s, latency=5us, speed=3": "unknown field 'speed'",
    "cores=two, link=1GB/s, latency=5us": "cores='two' must be a positive integer",
    "cores=4, link=1GB/s, latency=fast": "latency='fast' is not a number with a unit",
    "cores=4, link=1GB/s, latency=5us, node_link=2GB/s": "give node_link and node_latency together",
    "cores=4, gpus=4, link=1GB/s, latency=5us": "give cores or gpus, not both",
    "cores=4, link=0GB/s, latency=5us": "link='0GB/s' must be > 0",
}


@pytest.mark.parametrize("argv, message", [(["--cluster", spec], m) for spec, m in CLUSTER_ERRORS.items()] + [
    (["--predict-ranks", "8,x"], "--predict-ranks '8,x': expected comma-separated integers"),
    (["--machine", "/nonexistent/machine.json"], "--machine /nonexistent/machine.json: No such file"),
    (["--workloads", "einsum,bogus"], "unknown workload 'bogus'"),
    (["--workloads", "transformer", "--layouts", "model=hidden:all"],
     "names dim 'hidden', which workload 'transformer'"),
    (["--ranks", "1,3", "--workloads", "mlp", "--layouts", "data"],
     "'batch' (size 256) is not divisible by mesh dim 'all' (size 3)"),
    (["--ranks", "1,two"], "expected comma-separated integers"),
    (["--workloads", "einsum", "--mesh", "all:{n}", "--layouts", "model=io:rows"],
     "dim 'io' is laid out on mesh dim 'rows', but the mesh has dims ['all']"),
    (["--layouts", "wide"], "layout 'wide' has no rules for workload 'einsum'"),
    (["--mode", "strong,sideways"], "unknown mode 'sideways'"),
    (["--layouts", "transformer/model"], "expected NAME, NAME=RULES or WORKLOAD/NAME=RULES"),
    (["--rounds", "0"], "--rounds 0 must be >= 1"),
    (["--launcher", "srun -n 4"], "must contain {n}"),
    (["--set", "mlp.depth=3"], "mlp has no size 'depth'"),
])
def test_bad_input_is_one_message(scaling, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        scaling.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_skip_unfit_leaves_out_what_does_not_divide(scaling, capsys):
    args = scaling.parse_args(["--ranks", "1,3", "--workloads", "mlp", "--layouts", "data", "--skip-unfit"])
    assert [(c.mode, c.ranks, c.sizes["batch"]) for n in (1, 3) for c in args.plans[n]] == \
        [("strong", 1, 256), ("weak", 1, 256), ("weak", 3, 768)]
    assert "skipped: mlp, strong scaling, 3 ranks" in capsys.readouterr().out


def _driver(scaling, tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling.py"), *argv], env=scaling.child_env(),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.skipif(N != 1, reason="spawns its own MPI jobs; runs in the 1-rank session")
def test_driver_end_to_end(scaling, tmp_path):
    out = tmp_path / "results"
    proc = _driver(scaling, tmp_path, "--ranks", "1,2", "--size", "tiny", "--repeat", "1", "--warmup", "0",
                   "--rounds", "2", "--out", str(out), "--predict-ranks", "4,8", "--cluster",
                   "cores=4, link=1GB/s, latency=5us")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" --worker ") == 4  # 2 rounds x 2 rank counts, best round kept per case
    # no --machine: each job whose ranks have a core each calibrated, every round; each kept beside the results
    cores = scaling.cs.usable_cores()
    calibrated = scaling.calibration_ranks([1, 2], cores)
    assert calibrated == [n for n in (1, 2) if n <= cores]
    assert proc.stdout.count(" --calibrate ") == 2 * len(calibrated)
    for n in calibrated:
        saved = json.loads((out / f"scaling_machine_n{n}.json").read_text())
        assert saved["key"]["mesh"] == f"[all:{n}]" and read_machine(str(out / f"scaling_machine_n{n}.json")).flops > 0
    with open(out / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == scaling.CSV_FIELDS
    keys = sorted((r["workload"], r["mode"], r["layout"], int(r["ranks"])) for r in rows)
    assert keys == sorted((w, m, lay, n) for w in ("einsum", "mlp", "transformer") for m in ("strong", "weak")
                          for lay in ("data", "model") for n in (1, 2))
    by = {(r["workload"], r["mode"], r["layout"], int(r["ranks"])): r for r in rows}
    for (w, m, lay, n), r in by.items():
        assert r["comm_match"] == "True" and r["comm_bytes_measured"] == r["comm_bytes_formula"], r
        assert (r["cores"], r["oversubscribed"]) == (str(cores), str(n > cores))
        assert float(r["predicted_ms"]) == pytest.approx(float(r["predicted_compute_ms"]) +
                                                         float(r["predicted_comm_ms"]), rel=1e-3)
        assert float(r["predicted_over_measured"]) == pytest.approx(float(r["predicted_ms"]) /
                                                                    float(r["step_ms_median"]), rel=2e-3)
        assert (float(r["predicted_comm_ms"]) > 0) == (int(r["comm_bytes_measured"]) > 0)
        t1, tn = float(by[(w, m, lay, 1)]["step_ms_median"]), float(r["step_ms_median"])
        speedup = t1 / tn * (n if m == "weak" else 1)
        assert float(r["speedup"]) == pytest.approx(speedup, rel=2e-3)
        assert float(r["efficiency"]) == pytest.approx(speedup / n, rel=2e-3)
    assert int(by[("einsum", "strong", "model", 2)]["comm_bytes_measured"]) == F32 * 64 * 64
    assert int(by[("mlp", "weak", "data", 2)]["comm_bytes_measured"]) == F32 * (2 * 8 * 32 + 32)
    assert int(by[("mlp", "weak", "model", 2)]["comm_bytes_measured"]) == F32 * 2 * (16 * 2) * 8
    assert int(by[("transformer", "strong", "data", 1)]["comm_bytes_measured"]) == 0
    with open(out / "scaling_cluster.csv") as f:
        predicted = list(csv.DictReader(f))
    assert list(predicted[0]) == scaling.CLUSTER_FIELDS
    assert {(int(r["ranks"]), int(r["nodes"])) for r in predicted} == {(4, 1), (8, 2)}
    # a weak data-parallel curve's batch grows with the ranks: priced at both rank counts for every workload
    assert {(r["workload"], int(r["ranks"])) for r in predicted if (r["mode"], r["layout"]) == ("weak", "data")} == \
        {(w, n) for w in ("einsum", "mlp", "transformer") for n in (4, 8)}
    for w in ("einsum", "mlp", "transformer"):
        for m in ("strong", "weak"):
            data = (out / f"scaling_{w}_{m}.png").read_bytes()
            width, height = struct.unpack(">II", data[16:24])
            assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR" and width > 300 and height > 200
            assert data[-8:-4] == b"IEND"


@pytest.mark.skipif(N != 1, reason="runs the driver as a program; the 1-rank session does")
def test_driver_bad_input_no_traceback(scaling, tmp_path):
    proc = _driver(scaling, tmp_path, "--workloads", "transformer", "--layouts", "model=hidden:all")
    assert proc.returncode == 2
    assert "names dim 'hidden'" in proc.stderr and "Traceback" not in proc.stderr
    proc = _driver(scaling, tmp_path, "--cluster", "cores=8, link=10Gbps, latency=5us")
    assert proc.returncode == 2
    assert "link='10Gbps' is not a number with a unit" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "results").exists()


# ------------------------------------------------------------------------- the cost model's side

ALPHA_NODE, BETA_NODE = 4e-5, 2e9  # the hand machine's own link (what calibrate measures on a node)
FLOPS, MEMORY_BW, EINSUM_FIXED = 1e9, 1e10, 1e-6


def _machine_file(path: Path, **fields) -> Path:
    m = mm.cost.Machine(flops=FLOPS, latency=ALPHA_NODE, bandwidth=BETA_NODE, memory=2**30,
                        memory_bandwidth=MEMORY_BW, einsum_overhead=EINSUM_FIXED, op_overhead=2e-6,
                        links=(("all", ALPHA_NODE, BETA_NODE),))
    write_machine(str(path), m)
    if fields:
        saved = json.loads(path.read_text())
        saved["machine"].update(fields)
        path.write_text(json.dumps(saved))
    return path


def _mine(tmp_path: Path, name: str) -> Path:
    return tmp_path / f"{MPI.COMM_WORLD.Get_rank()}-{name}"  # (ranks may share tmp_path)


def test_oversubscribed_where_ranks_outnumber_cores(scaling, tmp_path):
    cs = scaling.cs
    assert cs.usable_cores() == len(os.sched_getaffinity(0))
    assert [(n, c) for n in range(1, 9) for c in (1, 2, 4) if cs.oversubscribed(n, c)] == \
        [(n, c) for n in range(1, 9) for c in (1, 2, 4) if n > c]
    machine = read_machine(str(_machine_file(_mine(tmp_path, "m.json"))))
    sizes = scaling.sizes_for("einsum", "tiny", "strong", 1, {})
    cases = {("einsum", "strong", "data", n): scaling.Case("einsum", "strong", "data", "batch:all", f"all:{n}", n,
                                                          sizes) for n in (1, 2, 4)}
    rows = [{"workload": "einsum", "mode": "strong", "layout": "data", "ranks": n, "step_ms_median": 1.0}
            for n in (1, 2, 4)]
    for cores in (1, 2, 4):
        scaling.add_predictions(rows, cases, {1: machine}, cores)
        marked = [(r["ranks"], r["cores"], r["oversubscribed"]) for r in rows]
        assert marked == [(n, cores, n > cores) for n in (1, 2, 4)]


def test_cluster_predictions_follow_the_formulas(scaling, tmp_path):
    """einsum y = x·w at tiny sizes (batch 64, io 32, hidden 64) on nodes of 2 cores: io split
    (layout `model`, mesh all:n) allreduces this rank's [64, 64] float32 output, priced as a ring
    α + 2(k-1)/k · bytes / β; within a node the machine's own link, across nodes α + latency and the
    slower of its β and the link. The 2-D layout (batch:rows;io:cols) reduces over cols, which stays
    within a node on 4 ranks (2x2) and crosses nodes on 8 (2x4)."""
    machine_path = _machine_file(_mine(tmp_path, "m.json"))
    args = scaling.parse_args(["--ranks", "1", "--workloads", "einsum", "--layouts", "model", "2d", "--mode",
                               "strong", "--size", "tiny", "--machine", str(machine_path), "--predict-ranks", "2,4,8",
                               "--cluster", "cores=2, link=1GB/s, latency=10us"])
    machine = read_machine(str(machine_path))
    cases = {(c.workload, c.mode, c.layout, c.ranks): c for c in args.plans[1]}
    rows = [{"workload": "einsum", "mode": "strong", "layout": lay, "ranks": 1, "step_ms_median": 1.0}
            for lay in ("model", "2d")]
    scaling.add_predictions(rows, cases, {1: machine}, cores=2)
    predicted, left_out = scaling.extrapolate(rows, cases, args, machine)
    assert left_out == []
    got = {(r["layout"], r["ranks"]): r for r in predicted}
    assert sorted(got) == [(lay, n) for lay in ("2d", "model") for n in (2, 4, 8)]
    b, io, h, link, latency = 64, 32, 64, 1e9, 10e-6

    def ring(k: int, nbytes: int, across: bool) -> float:
        alpha, beta = (ALPHA_NODE + latency, min(BETA_NODE, link)) if across else (ALPHA_NODE, BETA_NODE)
        return alpha + 2 * (k - 1) / k * nbytes / beta

    def roofline(rows_: int, inner: int) -> float:  # one einsum [rows_, inner] x [inner, h]
        nbytes = F32 * (rows_ * inner + inner * h + rows_ * h)
        return max(2 * rows_ * inner * h / FLOPS, nbytes / MEMORY_BW) + EINSUM_FIXED
    expected = {("model", 2): (roofline(b, io // 2), ring(2, F32 * b * h, False), "all:2", 1),
                ("model", 4): (roofline(b, io // 4), ring(4, F32 * b * h, True), "all:4", 2),
                ("model", 8): (roofline(b, io // 8), ring(8, F32 * b * h, True), "all:8", 4),
                ("2d", 2): (roofline(b, io // 2), ring(2, F32 * b * h, False), "rows:1;cols:2", 1),
                ("2d", 4): (roofline(b // 2, io // 2), ring(2, F32 * b // 2 * h, False), "rows:2;cols:2", 2),
                ("2d", 8): (roofline(b // 2, io // 4), ring(4, F32 * b // 2 * h, True), "rows:2;cols:4", 4)}
    for key, (compute, comm, mesh, nodes) in expected.items():
        r = got[key]
        assert (r["mesh"], r["nodes"]) == (mesh, nodes), key
        assert r["predicted_compute_ms"] == pytest.approx(1e3 * compute, rel=1e-9), key
        assert r["predicted_comm_ms"] == pytest.approx(1e3 * comm, rel=1e-9), key
        assert r["predicted_ms"] == pytest.approx(1e3 * (compute + comm), rel=1e-9), key
    # one case written out: io split 4 ways across 2 nodes, a 16 KiB output allreduced
    assert got[("model", 4)]["predicted_comm_ms"] == pytest.approx(1e3 * (50e-6 + 1.5 * 16384 / 1e9))
    # strong efficiency against the model's own 1-rank time: t1 / (n · tn)
    t1 = rows[0]["predicted_ms"]
    assert got[("model", 8)]["efficiency"] == pytest.approx(t1 / (8 * got[("model", 8)]["predicted_ms"]))


def test_rings_share_a_node_link(scaling):
    """rows:4;cols:2 on nodes of 2: cols stays within a node, the 2 rings over rows leaving a node at
    once share its link."""
    cs = scaling.cs
    m = mm.cost.Machine(flops=FLOPS, latency=ALPHA_NODE, bandwidth=BETA_NODE, memory=2**30)
    spec = cs.parse_cluster("cores=2, link=1GB/s, latency=10us")
    assert cs.mesh_links(spec, "rows:4;cols:2") == {"cols": (False, 1), "rows": (True, 2)}
    on = cs.on_cluster(m, spec, "rows:4;cols:2")
    assert on.link("cols") == (ALPHA_NODE, BETA_NODE)
    assert on.link("rows") == pytest.approx((ALPHA_NODE + 10e-6, 0.5e9))
    given = cs.on_cluster(m, cs.parse_cluster("gpus=8, link=50GB/s, latency=2us, node_link=400GB/s, "
                                              "node_latency=3us"), "all:16")
    assert given.link("all") == pytest.approx((5e-6, 50e9)) and cs.nodes(spec, 5) == 3


@pytest.mark.parametrize("fields, message", [({"flops": -1.0}, "Machine: flops must be > 0"),
                                             ({"flop": 1.0}, "unknown field 'flop'")])
def test_bad_machine_file_names_the_field(scaling, capsys, tmp_path, fields, message):
    path = _machine_file(_mine(tmp_path, "bad.json"), **fields)
    with pytest.raises(SystemExit) as e:
        scaling.parse_args(["--machine", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"machine file {path}" in err and message in err
