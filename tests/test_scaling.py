"""benchmarks/scaling.py: each workload's measured communication equals its formula and a count
made here by hand; result rows carry every CSV field; speedup and efficiency follow their
definitions; bad command lines end with a message; the driver runs end to end (1-rank session).

The in-process cases run the worker's own `run_case` on COMM_WORLD at the `tiny` sizes, for the
data, model and 2-D layouts, strong and weak.
"""
from __future__ import annotations

import csv
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

import mpimesh as mm

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
    assert set(scaling.CSV_FIELDS) - set(row) == {"speedup", "efficiency"}
    assert (row["workload"], row["mode"], row["layout"], row["rules"], row["mesh"], row["ranks"]) == \
        ("mlp", "strong", "model", "hidden:all", f"all:{N}", N)
    assert row["sizes"] == "batch=16 io=8 hidden=32"
    assert 0 < row["step_ms_min"] <= row["step_ms_median"]
    assert len(row["loadavg"].split()) == 3 and row["blas_kernel"]
    # the step's matmuls: forward x·w, h·v; backward dv, dh, dw, dx: 6 x 2·b·io·h/N flops per rank (at
    # least the smallest block of hidden's when N does not divide 32)
    assert row["gflop_per_rank"] * 1e9 >= 6 * 2 * 16 * 8 * (32 // N)
    scaling.add_scaling([row])
    path = tmp_path / f"rows{MPI.COMM_WORLD.Get_rank()}.csv"
    scaling.write_csv([row], str(path))
    with open(path) as f:
        (written,) = list(csv.DictReader(f))
    assert list(written) == scaling.CSV_FIELDS
    assert (written["speedup"], written["efficiency"], written["comm_match"]) == ("1", "1", "True")


def test_speedup_and_efficiency(scaling):
    rows = [{"workload": "w", "mode": m, "layout": "l", "ranks": n, "step_ms_median": t}
            for m in ("strong", "weak") for n, t in ((2, 8.0), (4, 5.0), (8, 4.0))]
    scaling.add_scaling(rows)
    got = [(r["mode"], r["ranks"], round(r["speedup"], 6), round(r["efficiency"], 6)) for r in rows]
    assert got == [("strong", 2, 1.0, 1.0), ("strong", 4, 1.6, 0.8), ("strong", 8, 2.0, 0.5),
                   ("weak", 2, 1.0, 1.0), ("weak", 4, 3.2, 1.6), ("weak", 8, 8.0, 2.0)]


@pytest.mark.parametrize("argv, message", [
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
                   "--rounds", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" --worker ") == 4  # 2 rounds x 2 rank counts, best round kept per case
    with open(out / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == scaling.CSV_FIELDS
    keys = sorted((r["workload"], r["mode"], r["layout"], int(r["ranks"])) for r in rows)
    assert keys == sorted((w, m, lay, n) for w in ("einsum", "mlp", "transformer") for m in ("strong", "weak")
                          for lay in ("data", "model") for n in (1, 2))
    by = {(r["workload"], r["mode"], r["layout"], int(r["ranks"])): r for r in rows}
    for (w, m, lay, n), r in by.items():
        assert r["comm_match"] == "True" and r["comm_bytes_measured"] == r["comm_bytes_formula"], r
        t1, tn = float(by[(w, m, lay, 1)]["step_ms_median"]), float(r["step_ms_median"])
        speedup = t1 / tn * (n if m == "weak" else 1)
        assert float(r["speedup"]) == pytest.approx(speedup, rel=2e-3)
        assert float(r["efficiency"]) == pytest.approx(speedup / n, rel=2e-3)
    assert int(by[("einsum", "strong", "model", 2)]["comm_bytes_measured"]) == F32 * 64 * 64
    assert int(by[("mlp", "weak", "data", 2)]["comm_bytes_measured"]) == F32 * (2 * 8 * 32 + 32)
    assert int(by[("mlp", "weak", "model", 2)]["comm_bytes_measured"]) == F32 * 2 * (16 * 2) * 8
    assert int(by[("transformer", "strong", "data", 1)]["comm_bytes_measured"]) == 0
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
    assert not (tmp_path / "results").exists()
