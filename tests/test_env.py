"""Every MPIMESH_* variable is read by one parser (mpimesh/env.py): the spellings it accepts, the values it
refuses (an MpimeshError naming the variable, its value and what it accepts), and, for real variables read
at import, that off/false really turn a feature off and that garbage gives that error at the first Mesh
(in a fresh process, as the variables are read at import) instead of failing the import. A misspelled
variable's name warns at import, naming the closest known one; env.KNOWN lists every name the sources use."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mpi4py import MPI

import mpimesh as mm
from mpimesh import backend, env
from mpimesh.collectives import placement
from mpimesh.launch import find_mpiexec, job_env

ROOT = Path(__file__).resolve().parents[1]
VAR = "MPIMESH_TEST_ENV_PARSER"
FLAG_ERROR = "expected 1/0, true/false, yes/no or on/off"
one_rank = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="starts processes of its own")


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "True", " yes ", "Yes", "on", "ON", "\ton\n"])
def test_flag_on(monkeypatch, raw):
    monkeypatch.setenv(VAR, raw)
    assert env.flag(VAR, False) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "FALSE", "no", " NO ", "off", "Off", "OFF"])
def test_flag_off(monkeypatch, raw):
    monkeypatch.setenv(VAR, raw)
    assert env.flag(VAR, True) is False


@pytest.mark.parametrize("raw", [None, "", "   "])
def test_unset_or_blank_gives_the_default(monkeypatch, raw):
    if raw is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, raw)
    assert env.flag(VAR, "dflt") == "dflt" and env.whole(VAR, 7) == 7 and env.number(VAR, 0.5) == 0.5
    assert env.choice(VAR, "numpy", ("numpy", "cupy")) == "numpy" and env.text(VAR, "x") == "x"


@pytest.mark.parametrize("raw", ["maybe", "2", "-1", "y", "n", "enable", "disable", "o n", "1.0"])
def test_flag_refuses_anything_else(monkeypatch, raw):
    monkeypatch.setenv(VAR, raw)
    with pytest.raises(mm.MpimeshError) as e:
        env.flag(VAR, False)
    assert str(e.value) == f"{VAR}={raw!r}: {FLAG_ERROR}"


def test_whole(monkeypatch):
    for raw, want in [("5", 5), (" 12 ", 12), ("+3", 3), ("0", 0), ("-4", -4)]:
        monkeypatch.setenv(VAR, raw)
        assert env.whole(VAR, None) == want
    monkeypatch.setenv(VAR, "OFF")
    assert env.whole(VAR, 1, words={"off": None}) is None
    for raw in ["abc", "1.5", "1e3", "0x10", "", "-", "½", "٣"]:
        monkeypatch.setenv(VAR, raw)
        if raw:
            with pytest.raises(mm.MpimeshError, match=f"^{VAR}={raw!r} is not a whole number$"):
                env.whole(VAR, 1)
    for raw in ["0", "-2"]:
        monkeypatch.setenv(VAR, raw)
        with pytest.raises(mm.MpimeshError, match=f"^{VAR}={raw!r} is not a whole number >= 1$"):
            env.whole(VAR, None, minimum=1)
    monkeypatch.setenv(VAR, "9")
    with pytest.raises(mm.MpimeshError, match=r"is not a whole number in \[1, 8\] \(or off\)$"):
        env.whole(VAR, None, minimum=1, maximum=8, words={"off": None})
    with pytest.raises(mm.MpimeshError, match=f"^{VAR}='9' is not a count of widgets$"):
        env.whole(VAR, None, maximum=3, what="a count of widgets")


def test_number(monkeypatch):
    for raw, want in [("0.5", 0.5), (" 1e-3 ", 1e-3), ("3", 3.0), ("-2.5", -2.5)]:
        monkeypatch.setenv(VAR, raw)
        assert env.number(VAR, None) == want
    for raw in ["nan", "inf", "-inf", "abc", "1,5", "0.5s"]:
        monkeypatch.setenv(VAR, raw)
        with pytest.raises(mm.MpimeshError, match=f"^{VAR}={raw!r} is not a number$"):
            env.number(VAR, None)
    monkeypatch.setenv(VAR, "0")
    with pytest.raises(mm.MpimeshError, match=f"^{VAR}='0' is not a number > 0$"):
        env.number(VAR, None, above=0)
    monkeypatch.setenv(VAR, "1.5")
    with pytest.raises(mm.MpimeshError, match=r"is not a number in \[0, 1\] \(or off/none\)$"):
        env.number(VAR, None, minimum=0, maximum=1, words={"off": 0.0, "none": 0.0})
    monkeypatch.setenv(VAR, "None")
    assert env.number(VAR, 0.9, minimum=0, maximum=1, words={"off": 0.0, "none": 0.0}) == 0.0


def test_choice_and_text(monkeypatch):
    monkeypatch.setenv(VAR, " CuPy ")
    assert env.choice(VAR, "numpy", ("numpy", "cupy")) == "cupy"
    monkeypatch.setenv(VAR, "tpu")
    with pytest.raises(mm.MpimeshError, match=r"^unknown backend 'tpu' \(from MPIMESH_TEST_ENV_PARSER\): "
                                              r"choose one of \['numpy', 'cupy'\]$"):
        env.choice(VAR, "numpy", ("numpy", "cupy"), what="backend")
    monkeypatch.setenv(VAR, " host:123 ")
    assert env.text(VAR) == "host:123"
    assert env.text(VAR, check=lambda s: s.startswith("host")) == "host:123"
    with pytest.raises(mm.MpimeshError, match=f"^{VAR}=' host:123 ' is not a name$"):
        env.text(VAR, check=str.isalpha, what="a name")


def test_early_keeps_the_error_for_first_use(monkeypatch):
    monkeypatch.setenv(VAR, "maybe")
    monkeypatch.setattr(env, "_kept", {})
    assert env.early(env.flag, VAR, True) is True  # the default, for now
    env.raise_kept("MPIMESH_SHM")  # not this variable's: nothing
    with pytest.raises(mm.MpimeshError, match=f"^{VAR}='maybe': {FLAG_ERROR}$"):
        env.raise_kept(VAR)
    with pytest.raises(mm.MpimeshError, match=f"^{VAR}='maybe'"):
        env.raise_kept()
    monkeypatch.setenv(VAR, "off")
    assert env.early(env.flag, VAR, True) is False  # read again, good now: the error is gone
    env.raise_kept()


@pytest.mark.parametrize("raw,want", [("off", False), ("OFF", False), ("False", False), ("no", False), ("0", False),
                                      ("on", True), ("1", True), ("Yes", True)])
def test_cuda_aware_mpi(monkeypatch, raw, want):
    monkeypatch.setenv("MPIMESH_CUDA_AWARE_MPI", raw)
    assert placement.cuda_aware_mpi() is want


def test_cuda_aware_mpi_refuses_garbage(monkeypatch):
    monkeypatch.setenv("MPIMESH_CUDA_AWARE_MPI", "maybe")
    with pytest.raises(mm.MpimeshError, match=f"MPIMESH_CUDA_AWARE_MPI='maybe': {FLAG_ERROR}"):
        placement.cuda_aware_mpi()


def test_backend_and_memory_variables(monkeypatch):
    monkeypatch.setenv("MPIMESH_BACKEND", " NumPy ")
    assert backend.resolve_backend(None) == "numpy"
    monkeypatch.setenv("MPIMESH_BACKEND", "tpu")
    with pytest.raises(mm.MpimeshError, match=r"unknown backend 'tpu' \(from MPIMESH_BACKEND\)"):
        backend.resolve_backend(None)
    monkeypatch.setenv("MPIMESH_KEEP_MEMORY", "off")
    backend.keep_freed_memory.cache_clear()
    try:
        assert backend.keep_freed_memory() is False
        monkeypatch.setenv("MPIMESH_KEEP_MEMORY", "sometimes")
        backend.keep_freed_memory.cache_clear()
        with pytest.raises(mm.MpimeshError, match=f"MPIMESH_KEEP_MEMORY='sometimes': {FLAG_ERROR}"):
            backend.keep_freed_memory()
    finally:
        monkeypatch.delenv("MPIMESH_KEEP_MEMORY")
        backend.keep_freed_memory.cache_clear()
        backend.keep_freed_memory()


def test_jax_coordinator_is_host_and_port(monkeypatch):
    from mpimesh.tpu import distributed
    monkeypatch.setenv("MPIMESH_JAX_COORDINATOR", " 10.0.0.1:1234 ")
    assert distributed._coordinator(MPI.COMM_SELF) == "10.0.0.1:1234"
    for bad in ("10.0.0.1", "host:", ":99", "host:port", "host:70000"):
        monkeypatch.setenv("MPIMESH_JAX_COORDINATOR", bad)
        with pytest.raises(mm.MpimeshError, match=f"MPIMESH_JAX_COORDINATOR={bad!r} is not host:port"):
            distributed._coordinator(MPI.COMM_SELF)


# Variables read at import: a fresh process per environment. Each accessor says what is in force, or its error.
PROBE = """
import json, sys
import mpimesh as mm
from mpimesh import buckets, threads
from mpimesh.collectives import guard, shm
trace = sys.modules["mpimesh.trace"]  # mm.trace is the function

out = {}
def get(key, read):
    try:
        out[key] = read()
    except mm.MpimeshError as e:
        out[key] = "error: " + str(e)
get("check", lambda: guard.settings()["check"])
get("timeout", lambda: guard.settings()["timeout"])
get("debug", trace.debugging)
get("shm", lambda: shm._settings["enabled"] and shm.enabled())
get("threads", lambda: threads.settings()["threads"])
get("bucket", buckets.bucket_bytes)
get("mesh", lambda: str(mm.Mesh("all:1", comm=mm.MPI.COMM_SELF).shape))
print(json.dumps(out))
"""
NAMES = ("MPIMESH_SPMD_CHECK", "MPIMESH_COLLECTIVE_TIMEOUT", "MPIMESH_DEBUG", "MPIMESH_SHM", "MPIMESH_THREADS",
         "MPIMESH_BUCKET_BYTES", "MPIMESH_NO_ABORT")


def _clean(**extra: str) -> dict:
    base = {k: v for k, v in job_env(PYTHONPATH=str(ROOT)).items() if k not in NAMES}
    return {**base, **extra}


def _probe(**variables: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE], env=_clean(**variables), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr  # the import never fails
    return json.loads(proc.stdout)


@one_rank
def test_off_spellings_turn_features_off():
    got = _probe(MPIMESH_SPMD_CHECK="false", MPIMESH_DEBUG="Off", MPIMESH_SHM="no", MPIMESH_BUCKET_BYTES="0",
                 MPIMESH_THREADS="1", MPIMESH_COLLECTIVE_TIMEOUT="OFF")
    assert got == {"check": False, "timeout": None, "debug": False, "shm": False, "threads": 1, "bucket": 0,
                   "mesh": "[all:1]"}
    got = _probe(MPIMESH_SPMD_CHECK="off", MPIMESH_DEBUG="no", MPIMESH_SHM="FALSE")
    assert (got["check"], got["debug"], got["shm"]) == (False, False, False)


@one_rank
def test_on_spellings_turn_features_on():
    got = _probe(MPIMESH_SPMD_CHECK="ON", MPIMESH_DEBUG=" yes ", MPIMESH_SHM="True", MPIMESH_THREADS="2",
                 MPIMESH_BUCKET_BYTES="4096", MPIMESH_COLLECTIVE_TIMEOUT="90")
    assert got["check"] is True and got["debug"] is True and got["threads"] == 2 and got["bucket"] == 4096
    assert got["timeout"] == 90.0 and got["mesh"] == "[all:1]"
    assert got["shm"] is shm_available()


def shm_available() -> bool:
    import os
    return hasattr(os, "memfd_create")


@one_rank
def test_garbage_is_an_error_at_first_use_not_at_import():
    bad = {"MPIMESH_SPMD_CHECK": "maybe", "MPIMESH_DEBUG": "2", "MPIMESH_SHM": "disable",
           "MPIMESH_THREADS": "abc", "MPIMESH_BUCKET_BYTES": "-5", "MPIMESH_COLLECTIVE_TIMEOUT": "1e999"}
    got = _probe(**bad)
    assert got["check"] == got["timeout"] == ("error: MPIMESH_COLLECTIVE_TIMEOUT='1e999' is not a positive number "
                                              f"of seconds (or 0/off/none); MPIMESH_SPMD_CHECK='maybe': {FLAG_ERROR}")
    assert got["debug"] == f"error: MPIMESH_DEBUG='2': {FLAG_ERROR}"
    assert got["shm"] == f"error: MPIMESH_SHM='disable': {FLAG_ERROR}"
    assert got["threads"] == "error: MPIMESH_THREADS='abc' is not a whole number >= 1"
    assert got["bucket"] == "error: MPIMESH_BUCKET_BYTES='-5' is not a whole number of bytes >= 0 (0: no buckets)"
    for name, value in bad.items():  # the first Mesh names every bad variable
        assert f"{name}={value!r}" in got["mesh"], got["mesh"]


@one_rank
@pytest.mark.parametrize("raw", ["-2", "0", "1.5"])
def test_threads_must_be_a_positive_whole_number(raw):
    got = _probe(MPIMESH_THREADS=raw)
    assert got["threads"] == got["mesh"] == f"error: MPIMESH_THREADS={raw!r} is not a whole number >= 1"
    assert got["check"] is False and got["bucket"] == 25 << 20  # the others are not affected


@one_rank
def test_bad_variable_ends_a_job_on_every_rank(tmp_path):
    """Under mpiexec every rank sees the same garbage: with MPIMESH_NO_ABORT=false the abort hook is in place,
    and the first Mesh raises on every rank (no rank waits for another), which ends the job."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import sys
        import mpimesh as mm
        rank = mm.MPI.COMM_WORLD.Get_rank()
        with open(f"hook-{rank}", "w") as f:  # a file per rank: two ranks' stdout lines may interleave
            f.write(str(getattr(sys.excepthook, "_mpimesh", False)))
        mm.Mesh("all:2")
        open(f"reached-{rank}", "w").close()
    """))
    start = time.monotonic()
    proc = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(script)],
                          env=_clean(MPIMESH_NO_ABORT="false", MPIMESH_SPMD_CHECK="maybe", MPIEXEC_TIMEOUT="60"),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0 and time.monotonic() - start < 60, proc
    assert [(tmp_path / f"hook-{r}").read_text() for r in (0, 1)] == ["True", "True"]
    assert not list(tmp_path.glob("reached-*"))
    assert f"MPIMESH_SPMD_CHECK='maybe': {FLAG_ERROR}" in proc.stderr, proc.stderr
    assert "uncaught exception on rank" in proc.stderr


# Misspelled names. TYPOS: the deliberate ones, here and in mpimesh/env.py's example (the scan skips them).
TYPOS = ("MPIMESH_SPMD_CHEK", "MPIMESH_DEGUB", "MPIMESH_NOT_A_THING_AT_ALL", "MPIMESH_THREAD")


def _sources() -> list:
    """The project's code: Python and shell files, and the CI scripts (no virtual environment inside)."""
    files = [ROOT / "setup.py", ROOT / "install.py"] + [p for p in (ROOT / ".ci").glob("*") if p.is_file()]
    for top in ("mpimesh", "apps", "tests", "benchmarks", "examples", "launch"):
        files += [p for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".sh", ".sbatch")
                  and not {"__pycache__", "site-packages"} & set(p.parts)]
    return [p for p in files if p.is_file()]


def test_unknown_names_the_closest_known_variable():
    got = env.unknown({"MPIMESH_SPMD_CHEK": "1", "MPIMESH_DEGUB": "0", "mpimesh_threads": "2",
                       "MPIMESH_NOT_A_THING_AT_ALL": "x", "MPIMESH_THREAD": "3", "MPIMESH_DEBUG": "1",
                       "MPIMESH_TEST_RANKS": "1 2", "MPIMESH_AUTO_THREADS": "1", "MPIMESHX": "1", "PATH": "/bin"})
    assert got == ["MPIMESH_DEGUB is not a variable mpimesh reads: did you mean MPIMESH_DEBUG?",
                   "MPIMESH_NOT_A_THING_AT_ALL is not a variable mpimesh reads (mpimesh/env.py lists those it reads)",
                   "MPIMESH_SPMD_CHEK is not a variable mpimesh reads: did you mean MPIMESH_SPMD_CHECK?",
                   "MPIMESH_THREAD is not a variable mpimesh reads: did you mean MPIMESH_THREADS?",
                   "mpimesh_threads is not a variable mpimesh reads: did you mean MPIMESH_THREADS?"]
    assert env.unknown({name: "1" for name in env.KNOWN}) == []


def test_every_variable_the_sources_name_is_known():
    """Code that reads (or writes for a child) an MPIMESH_* variable missing from env.KNOWN would have
    its users warned that it is a typo: every name in the sources must be there."""
    named: dict = {}
    for f in _sources():
        for name in re.findall(r"\bMPIMESH_[A-Z0-9_]*[A-Z0-9]\b", f.read_text(errors="replace")):
            named.setdefault(name, f.relative_to(ROOT))
    assert len(named) > 20, sorted(named)  # (the scan found the sources)
    missing = {n: str(f) for n, f in named.items() if n not in env.KNOWN and n not in TYPOS}
    assert not missing, f"add these to mpimesh/env.py's KNOWN: {missing}"
    table = re.findall(r"^\| `(MPIMESH_\w+)` \|", (ROOT / "docs" / "environment.md").read_text(), re.M)
    assert len(table) >= 15 and set(table) <= set(env.KNOWN), table


def _known_only(**variables: str) -> dict:
    """`_clean`'s environment without a launcher's rank or unknown MPIMESH_* variables, with `variables`."""
    ranks = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")
    base = {k: v for k, v in _clean().items()
            if (not k.upper().startswith("MPIMESH_") or k in env.KNOWN) and k not in ranks}
    return {**base, **variables}


def _import_warnings(**variables: str) -> list:
    """The warning lines of `import mpimesh` in a fresh process with `variables` set."""
    proc = subprocess.run([sys.executable, "-c", "import mpimesh"], env=_known_only(**variables), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [ln for ln in proc.stderr.splitlines() if "Warning" in ln]


@one_rank
def test_a_misspelled_variable_warns_at_import():
    assert _import_warnings(MPIMESH_SPMD_CHEK="1") == [
        "<string>:1: UnknownVariableWarning: MPIMESH_SPMD_CHEK is not a variable mpimesh reads: did you mean "
        "MPIMESH_SPMD_CHECK?"]
    assert _import_warnings(MPIMESH_SPMD_CHECK="1", MPIMESH_DEBUG="0") == []  # known names: no warning
    assert _import_warnings(MPIMESH_SPMD_CHEK="1", PMI_RANK="1") == []  # another rank than 0: it says nothing
    assert len(_import_warnings(MPIMESH_SPMD_CHEK="1", PMI_RANK="0")) == 1


@one_rank
def test_a_misspelled_variable_warns_once_in_a_job(tmp_path):
    """4 ranks, each importing mpimesh and asking again: one line, from rank 0."""
    script = tmp_path / "job.py"
    script.write_text("import mpimesh\nmpimesh.env.warn_unknown()\n")
    proc = subprocess.run([find_mpiexec(), "-n", "4", sys.executable, str(script)],
                          env=_known_only(MPIMESH_DEGUB="1", MPIEXEC_TIMEOUT="60"), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "UnknownVariableWarning" in ln]
    assert lines == [f"{script}:1: UnknownVariableWarning: MPIMESH_DEGUB is not a variable mpimesh reads: did you "
                     f"mean MPIMESH_DEBUG?"], proc.stderr
