"""The apps explain themselves and refuse bad input in one line per job, before any work starts:
--help shows every default, no flag twice, and the model's own tensor dims; a layout naming a dim
the model lacks, a bad flag or a bad value is one line on stderr and exit status 2."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from mpimesh.launch import find_mpiexec, job_env

ROOT = Path(__file__).resolve().parents[1]
APPS = {"two_layer": ["batch", "io", "hidden"],
        "segment": ["batch", "height", "width", "channels", "logit"],
        "transformer": ["batch", "length", "d_model", "heads", "d_kv", "d_ff", "vocab"]}

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts jobs of its own")


def _run(app: str, *args: str, ranks: int = 2) -> subprocess.CompletedProcess:
    """The app's job; its stderr without Open MPI's launcher's own notices (blocks between lines of
    dashes: "Primary job terminated normally, but 1 process returned a non-zero exit code ..."),
    which follow any rank's non-zero exit there (MPICH's launcher adds none)."""
    cmd = [find_mpiexec(), "-n", str(ranks), sys.executable, str(ROOT / "apps" / f"{app}.py"), *args]
    proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    proc.stderr = re.sub(r"^-{40,}\n.*?^-{40,}\n", "", proc.stderr, flags=re.S | re.M)
    return proc


@pytest.mark.parametrize("app", sorted(APPS))
def test_help_shows_defaults_dims_and_no_flag_twice(app):
    proc = subprocess.run([sys.executable, str(ROOT / "apps" / f"{app}.py"), "--help"], capture_output=True,
                          text=True, timeout=60, env=job_env())
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    options = re.findall(r"^  (-[-\w]+(?:[ =][A-Z_]+)?(?:, -[-\w]+(?:[ =][A-Z_]+)?)*)", text, re.M)
    for line in options:
        flags = [f.split()[0] for f in line.split(", ")]
        assert len(set(flags)) == len(flags), f"{app}: {line!r} lists a flag twice"
    blocks = re.split(r"\n(?=  -)", text.split("\noptions:\n", 1)[1].split("\nlayouts:\n", 1)[0])
    for block in blocks:
        flag = block.split()[0]
        if flag in ("-h,", "--help") or "store_" in block:
            continue
        takes_value = bool(re.match(r"\s*--[-\w]+ [A-Z_]", block))
        if takes_value:
            assert "(default:" in block, f"{app}: {flag} does not show its default"
    epilog = text.split("\nlayouts:\n", 1)[1]
    for dim in APPS[app]:
        assert re.search(rf"^\s+{dim}\b", epilog, re.M), f"{app}: the epilog does not list dim {dim!r}"


@pytest.mark.parametrize("app,flag", [("two_layer", "--layouts"), ("segment", "--layout"),
                                      ("transformer", "--layout")])
def test_layout_naming_a_dim_the_model_lacks_is_one_line(app, flag):
    proc = _run(app, flag, "nonexistent_dim:all", "--mesh", "all:2") if app != "two_layer" else \
        _run(app, flag, "nonexistent_dim:all")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "nonexistent_dim" in lines[0] and all(d in lines[0] for d in APPS[app][:3])
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("app", sorted(APPS))
def test_bad_flag_is_one_line(app):
    proc = _run(app, "--no-such-flag")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert "--no-such-flag" in proc.stderr


@pytest.mark.parametrize("app,args", [("two_layer", ["--batch", "0"]), ("segment", ["--blur", "4"]),
                                      ("segment", ["--steps", "0"])])
def test_bad_value_is_one_line(app, args):
    proc = _run(app, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert args[0] in proc.stderr


TINY = ["--d-model", "16", "--heads", "2", "--d-kv", "8", "--d-ff", "32", "--layers", "1", "--length", "16",
        "--batch", "4", "--data", str(ROOT / "tests" / "data" / "corpus.txt"), "--samples", "0",
        "--eval-batches", "1", "--heldout", "0.3"]


def test_transformer_on_3_ranks_runs_uneven_blocks():
    """3 ranks: the default mesh rows:1;cols:3 cuts heads (2), d_ff (32) and vocab (256) unevenly, one
    rank holding no head at all, and the step runs (the values are checked in tests/test_transformer.py)."""
    proc = _run("transformer", *TINY, "--steps", "1", ranks=3)
    assert proc.returncode == 0, proc.stderr
    assert "3 ranks, mesh [rows:1, cols:3]" in proc.stdout, proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_transformer_device_gpu_without_cupy_names_the_extra():
    proc = _run("transformer", *TINY, "--steps", "1", "--device", "gpu")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = set(proc.stderr.strip().splitlines())  # one line per rank, alike
    assert "backend 'cupy' needs CuPy" in line and "install.py gpu" in line, line


def test_transformer_binary_data_says_why(tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 64)
    proc = _run("transformer", "--data", str(blob), "--steps", "1")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "1 of 1 files skipped as binary" in line


def test_transformer_says_above_when_worse_than_the_baseline():
    proc = _run("transformer", *TINY, "--steps", "1", ranks=1)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("final held-out loss"))
    bpb, base = (float(v) for v in
                 __import__("re").search(r"= ([\d.]+) bits per byte.*baseline ([\d.]+)", line).groups())
    assert bpb > base and "bits above the unigram baseline" in line and "-" not in line.split("bits per byte,")[1]
    assert "BLAS threads per rank" in proc.stdout


def _one_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    """The job's one error line (exit status 2, no traceback), which holds every one of `words`."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "loss" not in proc.stdout, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert all(w in line for w in words), line
    return line


@pytest.mark.parametrize("args,words", [
    (["--length", "10000"], ["--length 10000", "20288 training and 8695 held-out", "--max-bytes", "--heldout"]),
    (["--length", "25000"], ["--length 25000", "--max-bytes", "--heldout"]),
    (["--max-bytes", "5000"], ["3500 training and 1500 held-out", "--max-bytes 5000", "--heldout 0.3"]),
    (["--log-json", "/nonexistent/dir/x.json"], ["--log-json", "no directory '/nonexistent/dir'"]),
    (["--log-json", "/"], ["--log-json '/'", "is a directory"]),
    (["--temperature", "nan"], ["--temperature nan", "finite"]),
    (["--temperature", "-1"], ["--temperature -1.0", "at least 0"]),
    (["--experts", "5"], ["--experts 5 needs --moe-every"]),
    (["--moe-every", "-1", "--experts", "4"], ["--moe-every -1", "at least 0"]),
    (["--moe-every", "2", "--experts", "4"], ["--moe-every 2 with --layers 1"]),
    (["--remat", "-5"], ["--remat -5", "at least 0"]),
    (["--max-bytes", "-1"], ["--max-bytes -1", "at least 1"]),
    (["--warmup", "-3"], ["--warmup -3", "at least 0"]),
    (["--seed", "-1"], ["--seed -1", "at least 0"]),
    (["--recalibrate"], ["--recalibrate needs --layout auto"]),
    (["--resume", "-1", "--checkpoint", "ck"], ["--resume -1", "--resume ./-1"]),
    (["--optimizer", "adam", "--lr", "-1"], ["--lr -1.0", "finite number >= 0"]),
    (["--lr", "nan"], ["--lr nan", "finite number >= 0"]),
    (["--checkpoint", "/proc/mpimesh-nowhere"], ["--checkpoint '/proc/mpimesh-nowhere'", "cannot write there",
                                                 "rank 0: No such file or directory"])])
def test_transformer_refuses_bad_values_naming_the_flag(args, words):
    _one_line(_run("transformer", *TINY, "--steps", "1", *args), *words)


@pytest.mark.parametrize("args,words", [  # (2 ranks: the default mesh rows:1;cols:2)
    (["--pipeline", "planes"], ["--pipeline 'planes'", "mesh [rows:1, cols:2] has no such dim"]),
    (["--pipeline", "cols", "--layers", "3"], ["--layers 3 do not fill 2 stages", "cols:2 x --virtual-stages 1",
                                               "multiple of 2"]),
    (["--pipeline", "cols", "--layers", "4", "--schedule", "interleaved", "--virtual-stages", "3"],
     ["--layers 4 do not fill 6 stages", "cols:2 x --virtual-stages 3"]),
    (["--pipeline", "cols", "--layers", "2", "--microbatches", "5"], ["--microbatches 5 exceeds --batch 4"]),
    (["--pipeline", "cols", "--layers", "4", "--moe-every", "4", "--experts", "2"],
     ["--moe-every 4", "2 block(s) a stage", "4 layers over 2 stages", "must divide 2"]),
    (["--microbatches", "3"], ["--microbatches need --pipeline MESH_DIM"]),
    (["--pipeline", "cols", "--layers", "2", "--virtual-stages", "2"], ["--virtual-stages 2 needs --schedule "
                                                                       "interleaved (got 1f1b)"]),
    (["--pipeline", "cols", "--layers", "2", "--microbatches", "0"], ["--microbatches 0", "at least 1"]),
    (["--pipeline", "cols", "--layers", "2", "--dtype", "float16"], ["--pipeline does not run with --dtype float16"])])
def test_transformer_pipeline_refuses_bad_combinations_naming_sizes(args, words):
    _one_line(_run("transformer", *TINY, "--steps", "1", *args), *words)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
@pytest.mark.parametrize("mesh,words", [("rows:0;cols:2", ["size of at least 1"]),
                                        ("rows:1000;cols:1", ["1000 devices", "at most 64"])])
def test_transformer_jax_mesh_beyond_the_devices_names_mesh(mesh, words):
    proc = _run("transformer", *TINY, "--steps", "1", "--backend", "jax", "--compile-cache", "none", "--mesh", mesh,
                ranks=1)
    _one_line(proc, f"--mesh {mesh!r}", *words)


def test_transformer_edge_values_run(tmp_path):
    """The smallest accepted values: greedy sampling, an MoE in every layer, --remat without N, a log file."""
    log = tmp_path / "log.jsonl"
    proc = _run("transformer", *TINY, "--steps", "1", "--temperature", "0", "--samples", "1", "--sample-bytes", "2",
                "--moe-every", "1", "--experts", "2", "--remat", "--warmup", "0", "--log-json", str(log), ranks=1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--- sample 1" in proc.stdout and "MoE: layers [0]" in proc.stdout
    assert "tests/data/corpus.txt: 1 files" in proc.stdout
    assert log.read_text().count('"loss"') == 1


def test_transformer_flags_that_change_nothing_say_so():
    proc = _run("transformer", *TINY, "--steps", "1", "--save-every", "3", "--warmup", "7", ranks=1)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--save-every 3 does nothing without --checkpoint" in proc.stderr
    assert "--warmup 7 does nothing with --optimizer adafactor" in proc.stderr
    proc = _run("transformer", *TINY, "--steps", "1", "--warmup", "7", "--optimizer", "adam", ranks=1)
    assert proc.returncode == 0 and "note:" not in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("app,args,words", [
    ("two_layer", ["--layouts", "batch:row"], ["mesh dim 'row'", "all", "rows", "cols", "planes"]),
    ("two_layer", ["--layouts", "batch:all;hidden:cols"], ["names 'all'", "cols"]),
    ("two_layer", ["--lr", "-1"], ["--lr -1.0", "above 0"]),
    ("two_layer", ["--lr", "nan"], ["--lr nan", "finite"]),
    ("two_layer", ["--d-hidden", "0"], ["--d-hidden 0", "at least 1"]),
    ("two_layer", ["--layouts", "batch:rows;hidden:rows"], ["--layouts 'batch:rows;hidden:rows'", "both laid out"]),
    ("segment", ["--noise", "-1"], ["--noise -1.0", "at least 0"]),
    ("segment", ["--seed", "-2"], ["--seed -2", "at least 0"])])
def test_two_layer_and_segment_refuse_bad_values(app, args, words):
    small = ["--batch", "8", "--d-io", "4", "--d-hidden", "8"] if app == "two_layer" else ["--size", "9"]
    _one_line(_run(app, *small, "--steps", "1", *args), *words)


def test_two_layer_help_names_its_meshes_not_a_mesh_flag():
    text = subprocess.run([sys.executable, str(ROOT / "apps" / "two_layer.py"), "--help"], capture_output=True,
                          text=True, timeout=60, env=job_env()).stdout
    assert "--mesh" not in text and "rows:r;cols:c;planes:p" in text


def test_two_layer_given_layout_runs():
    proc = _run("two_layer", "--batch", "8", "--d-io", "4", "--d-hidden", "8", "--steps", "1", "--lr", "0.01",
                "--layouts", "batch:rows;hidden:cols")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MATCH" in proc.stdout and "skipped" not in proc.stdout


def test_two_layer_table_1_counts_uneven_blocks():
    """Sizes the mesh does not divide: Table 1's quotients are rank 0's blocks (rounded up), which
    its counters measure (it said MISMATCH, 1,185 measured against 1,152)."""
    proc = _run("two_layer", "--batch", "5", "--d-io", "16", "--d-hidden", "65", "--steps", "1",
                "--layouts", "batch:rows;hidden:cols", "batch:rows;hidden:cols;io:planes", ranks=4)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tables = [line for line in proc.stdout.splitlines() if "Table 1:" in line]
    assert len(tables) == 2 and all(line.endswith("MATCH") and "MISMATCH" not in line for line in tables), tables
    assert "= 1,185  (r=2, c=2; uneven: rank 0's blocks, rounded up)" in tables[0], tables


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpimesh.launch", *args], env=job_env(), capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("args,words", [(["-n", "0"], ["-n 0", "at least 1"]), (["-n", "-1"], ["-n -1"]),
                                        (["--timeout", "0"], ["--timeout 0", "no limit"]),
                                        (["--timeout", "-5"], ["--timeout -5"]),
                                        (["--launcher-args", '"x'], ["--launcher-args", "No closing quotation"])])
def test_launch_refuses_bad_values_naming_the_flag(args, words, tmp_path):
    proc = _launch(*args, str(tmp_path / "never_run.py"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("python -m mpimesh.launch: error: ") and all(w in line for w in words), line


def test_launch_runs_the_script(tmp_path):
    script = tmp_path / "hi.py"
    script.write_text("import sys\nfrom mpi4py import MPI\nsys.stdout.write(f'rank {MPI.COMM_WORLD.Get_rank()}\\n')\n")
    proc = _launch("-n", "2", "--timeout", "60", str(script))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0", "rank 1"]


@pytest.mark.parametrize("line", ["localhost slots=2", "localhost:2"])
def test_launch_takes_either_hostfile_syntax(tmp_path, line):
    """Open MPI's `host slots=N` under MPICH too (MPICH's own reader failed on it): the hosts go to the
    launcher as a list in its spelling."""
    hosts, script = tmp_path / "hosts", tmp_path / "hi.py"
    hosts.write_text(f"# one machine\n{line}\n")
    script.write_text("import sys\nfrom mpi4py import MPI\nsys.stdout.write(f'rank {MPI.COMM_WORLD.Get_rank()}\\n')\n")
    proc = _launch("-n", "2", "--timeout", "60", "--hostfile", str(hosts), str(script))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0", "rank 1"]


@pytest.mark.parametrize("line", ["localhost:99999999999999999999", "localhost slots=2 max_slots=4", "localhost:0"])
def test_launch_refuses_a_hostfile_line_it_cannot_pass_on(tmp_path, line):
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{line}\n")
    proc = _launch("-n", "2", "--hostfile", str(hosts), str(tmp_path / "never_run.py"))
    assert proc.returncode == 2 and f"line 1: {line!r} is not" in proc.stderr and "slots from 1 to" in proc.stderr


def test_job_env_leaves_out_the_enclosing_jobs_variables(monkeypatch):
    """What MPICH's and Open MPI's launchers set in a rank goes (a nested Open MPI mpiexec refuses to
    start under them); the user's own settings stay; more ranks than cores are allowed under Open MPI
    unless the user says otherwise."""
    job = {"PMI_RANK": "0", "HYDI_CONTROL_FD": "7", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_MCA_ess_base_jobid": "1", "OMPI_MCA_orte_hnp_uri": "x", "OMPI_MCA_pmix": "^s1", "PRTE_MCA_x": "1",
           "OMPI_UNIVERSE_SIZE": "2", "OMPI_FILE_LOCATION": "/tmp/x", "OMPI_MCA_mpi_oversubscribe": "1"}
    own = {"OMPI_MCA_btl": "self,vader", "OMPI_ALLOW_RUN_AS_ROOT": "1", "MPIMESH_COLLECTIVE_TIMEOUT": "30"}
    for k, v in {**job, **own}.items():
        monkeypatch.setenv(k, v)
    env = job_env(EXTRA="1")
    assert not set(job) & set(env), sorted(set(job) & set(env))
    assert {k: env[k] for k in own} == own and env["EXTRA"] == "1"
    assert env["OMPI_MCA_rmaps_base_oversubscribe"] == "1"
    monkeypatch.setenv("OMPI_MCA_rmaps_base_oversubscribe", "0")
    assert job_env()["OMPI_MCA_rmaps_base_oversubscribe"] == "0"


@pytest.mark.parametrize("args, words", [([], ["a script to run is required"]),
                                         (["-n", "2", "no_such_script.py"], ["'no_such_script.py'", "no such file"])])
def test_launch_names_a_missing_script_once(args, words, tmp_path):
    """No script, or one that is not there: one error line from the launcher (not one per rank from each
    rank's interpreter, nor argparse's 'script, args' when args is optional)."""
    proc = subprocess.run([sys.executable, "-m", "mpimesh.launch", *args], env=job_env(), capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("python -m mpimesh.launch: error: ") and all(w in line for w in words), line
    assert proc.stderr.count("error") == 1, proc.stderr


def test_transformer_help_names_the_log_fields_and_what_layout_auto_needs():
    text = subprocess.run([sys.executable, str(ROOT / "apps" / "transformer.py"), "--help"], capture_output=True,
                          text=True, timeout=60, env=job_env()).stdout
    options = text.split("\noptions:\n", 1)[1]  # (not the usage lines)

    def block(flag: str) -> str:
        return " ".join(re.search(rf"^  {flag}\b(.*?)(?=^  -)", options, re.S | re.M).group(1).split())
    log_help = block("--log-json FILE")
    for field in ("step", "loss", "tokens_per_s", "step_ms", "comm_share", "lr", "peak_bytes", "heldout_loss"):
        assert re.search(rf"\b{field}\b", log_help), f"--log-json's help lacks {field!r}: {log_help}"
    layout_help = block("--layout LAYOUT")
    assert "'auto'" in layout_help and "mm.auto_layout" in layout_help and "jax" not in layout_help, layout_help


def test_transformer_layout_auto_without_jax(tmp_path):
    """`--layout auto` records the step dry on shapes alone (each op's `OpDef`), so it runs with jax missing
    (a package here that refuses to import stands in for it): it calibrates, chooses and trains."""
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text('raise ImportError("jax hidden by the test")\n')
    cmd = [find_mpiexec(), "-n", "2", sys.executable, str(ROOT / "apps" / "transformer.py"), *TINY, "--steps", "1",
           "--layout", "auto"]
    proc = subprocess.run(cmd, env=job_env(PYTHONPATH=str(tmp_path)), capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "layout auto" in proc.stdout.lower() or "auto_layout" in proc.stdout, proc.stdout