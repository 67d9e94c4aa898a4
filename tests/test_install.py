"""The README's first two commands, run exactly as written, where a newcomer would run them.

They are read from README.md's first code block and run with ``shell=True`` in a copy of this checkout
(``git ls-files``: tracked and new, not ignored, files), in three scenarios:

- the machine's own distribution Python (``/usr/bin/python3`` whose prefix is ``/usr``: Debian's or
  Ubuntu's, pip in ``/usr/lib/python3/dist-packages``, PEP 668), as it is, first on ``PATH``: what a
  new user of this machine gets. Skipped where there is none;
- a fresh Debian/Ubuntu without python3-venv: ``python3`` is a "system Python" that refuses ``pip
  install`` (PEP 668) and whose ``venv`` has no ensurepip. The commands must make ``.venv``;
- an already-active venv (``VIRTUAL_ENV`` set, its bin/ first on PATH): they must install into it and
  make no ``.venv``.

The second scenario's system Python is the distribution Python where there is one (else this
interpreter's installation) copied into tmp_path, minimally, laid out as CPython finds itself:
``bin/python3.X`` (the binary itself, not a symlink, so that the prefix is found from the copy:
CPython looks upward from the executable's folder for ``lib/python3.X/os.py``, and for
``lib/python3.X/lib-dynload``), ``bin/python3`` -> it, ``lib/python3.X/`` the stdlib without
``site-packages``, ``ensurepip`` and ``test``, plus an ``EXTERNALLY-MANAGED`` file, pip copied to
where that Python keeps it (``lib/python3/dist-packages`` on Debian, ``lib/python3.X/site-packages``
for python.org and pyenv builds), and ``lib/libpython3.X.so*`` if the binary is linked against it (a
binary whose RUNPATH is absolute, like pyenv's, loads the original, which is the same file). Files
are hard links where possible (fast).

The transformer command runs as written once (one to three minutes on two shared cores), in the
first scenario that runs, and must end with held-out bits per byte below the unigram baseline; the
others append ``--steps 10`` (and shorter evaluation) to it, since only where it installs differs.
The test command runs with ``MPIMESH_TEST_RANKS=1`` and `` tests/test_shape_layout.py`` appended
(tests/run.py passes its arguments to pytest; a path replaces tests/), so it does not run the whole
suite, or this test, again.

Those three are slow: 3 to 8 minutes on 2 shared cores (a transformer run, six installs from pip's
cache), so only the 1-rank session runs this file (tests/run.py's default ``MPIMESH_TEST_TIMEOUT`` of
900 s allows for it). ``pytest -m "not slow"`` leaves them out and keeps the fast tests of install.py's
command line: the pins (``constraints/python3.X.txt``) passed to pip by default, ``--latest`` leaving them
out, a Python without pins installing unpinned after one warning, unknown options and extras refused. Those
run install.py against a stub venv whose ``python`` only records its arguments.
"""
from __future__ import annotations

import faulthandler
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from mpi4py import MPI

from mpimesh.launch import job_env

ROOT = Path(__file__).resolve().parent.parent
VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"
INNER = "MPIMESH_TEST_INSTALL_INNER"  # set for the commands, so a suite they run skips this test

pytestmark = [
    pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="runs its own MPI jobs; the 1-rank session does"),
    pytest.mark.skipif(os.environ.get(INNER) == "1", reason="already inside test_install's commands"),
    pytest.mark.skipif(os.name != "posix", reason="simulates a Debian/Ubuntu system Python"),
]


def readme_commands() -> List[str]:
    """The command lines of README.md's first code block: install-and-run the app, install-and-test."""
    block = re.search(r"^```\w*\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    assert block, "README.md has no code block"
    lines = [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) == 2 and "apps/transformer.py" in lines[0] and "tests/run.py" in lines[1], lines
    return lines


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst)


def facts(python: Path) -> Dict[str, str]:
    """What `python` says of its installation: prefix, binary, stdlib, pip's folder (or ""), ..."""
    code = ("import json, os, sys, sysconfig\n"
            "try:\n    import pip; where = os.path.dirname(pip.__file__)\nexcept ImportError:\n    where = ''\n"
            "print(json.dumps({'prefix': sys.base_prefix, 'binary': os.path.realpath(sys.executable),\n"
            "    'version': 'python%d.%d' % sys.version_info[:2], 'stdlib': sysconfig.get_paths()['stdlib'],\n"
            "    'pip': where, 'shared': str(sysconfig.get_config_var('Py_ENABLE_SHARED') or ''),\n"
            "    'libdir': sysconfig.get_config_var('LIBDIR') or '', 'ldlibrary': sysconfig.get_config_var('LDLIBRARY') or ''}))")
    out = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, check=True, cwd="/")
    return json.loads(out.stdout)


def distribution_python() -> Optional[Path]:
    """`/usr/bin/python3` if it is a distribution's Python (its prefix is /usr) of a version this
    project supports, else None."""
    exe = Path("/usr/bin/python3")
    if not exe.exists():
        return None
    try:
        found = facts(exe)
    except (OSError, subprocess.CalledProcessError):
        return None
    version = tuple(int(v) for v in found["version"][len("python"):].split("."))
    return exe if found["prefix"] == "/usr" and version >= (3, 9) else None


def base_python() -> Path:
    """The Python a newcomer's machine has: the distribution's, else this interpreter's installation."""
    return distribution_python() or Path(sys.base_prefix, "bin", VERSION)


def fake_system_python(root: Path, python: Path) -> Path:
    """`python`'s installation copied into `root` as a Debian-like system Python without python3-venv
    (see the module docstring); returns its bin folder, which holds `python3`."""
    found = facts(python)
    base, binary, version = Path(found["prefix"]), Path(found["binary"]), found["version"]
    (root / "bin").mkdir(parents=True)
    _link_or_copy(str(binary), str(root / "bin" / version))
    (root / "bin" / "python3").symlink_to(version)
    if found["shared"] == "1" and found["libdir"]:  # libpython3.X.so*, for $ORIGIN/../lib
        (root / "lib").mkdir()
        for lib in Path(found["libdir"]).glob(found["ldlibrary"].split(".so")[0] + ".so*"):
            _link_or_copy(str(lib), str(root / "lib" / lib.name))
    stdlib = Path(found["stdlib"])
    copy = root / stdlib.relative_to(base)
    left_out = {"site-packages", "dist-packages", "ensurepip", "test"}
    shutil.copytree(stdlib, copy, symlinks=True, copy_function=_link_or_copy,
                    ignore=lambda folder, names: left_out & set(names) if folder == str(stdlib) else ())
    pip = Path(found["pip"]) if found["pip"] else None
    if pip is None or base not in pip.parents:
        pytest.skip(f"{python} has no pip of its own under {base} to copy")
    site = root / pip.parent.relative_to(base)  # where this Python keeps pip: site- or dist-packages
    for item in [pip, *pip.parent.glob("pip-*.dist-info")]:  # the system pip, as python3-pip brings
        shutil.copytree(item, site / item.name, symlinks=True, copy_function=_link_or_copy)
    if not (copy / "EXTERNALLY-MANAGED").exists():
        (copy / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=To install Python packages "
                                                 "system-wide, try apt install python3-xyz (simulated).\n")
    return root / "bin"


def copy_checkout(dest: Path) -> Path:
    """The checkout's files (tracked, and new ones git does not ignore) copied to `dest`; outside git, the
    tree less environments and caches."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked archive)
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv", "venv", "__pycache__", "*.egg-info", ".hypothesis", ".pytest_cache", "build"))
        return dest
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # listed but deleted in the working tree: skip
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def shell_env(path_first: List[Path], **extra: str) -> Dict[str, str]:
    """A newcomer's shell: no enclosing MPI job, no active venv (this test's own is taken off PATH),
    `path_first` at the front of PATH."""
    # PIP_COMPILE=0: no .pyc for the installed packages (speed only: it halves the test extras' install).
    env = job_env(**{INNER: "1", "PIP_PROGRESS_BAR": "off", "PIP_COMPILE": "0"})
    for var in ("VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT", "PYTHONHOME", "PYTHONPATH", "CONDA_PREFIX",
                "PIP_USER", "PIP_BREAK_SYSTEM_PACKAGES", "PIP_REQUIRE_VIRTUALENV", "MPIMESH_TEST_RANKS"):
        env.pop(var, None)
    own = {Path(sys.prefix, "bin").resolve(), Path(sys.executable).parent.resolve()}
    rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() not in own]
    env["PATH"] = os.pathsep.join([*map(str, path_first), *rest])
    env.update(extra)
    return env


def run(cmd: str, cwd: Path, env: Dict[str, str], timeout: int = 900) -> str:
    """`cmd` through the shell; its output (stdout and stderr) if it exits 0. A time-out kills its whole
    process group (the shell, mpiexec and the ranks)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, shell=True, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0] + f"\n[killed after {timeout} s]"
    print(f"[{time.monotonic() - start:.0f} s, exit {proc.returncode}] {cmd}", flush=True)  # shown with -s or -rP
    assert proc.returncode == 0, f"`{cmd}` exited {proc.returncode}:\n{out[-6000:]}"
    return out


def run_readme(repo: Path, env: Dict[str, str], app_args: str = "") -> str:
    """Both README commands in `repo` (`app_args` appended to the app's); checks the app's result (below
    the unigram baseline, when it ran its full length) and the tests' summary; returns the output."""
    app, tests = readme_commands()
    out = run(f"{app} {app_args}".rstrip(), repo, env)
    final = re.search(r"final held-out loss [\d.]+ nats = ([\d.]+) bits per byte, .* baseline ([\d.]+);", out)
    assert final, out[-4000:]
    assert app_args or float(final.group(1)) < float(final.group(2)), final.group(0)
    out2 = run(f"{tests} tests/test_shape_layout.py", repo, dict(env, MPIMESH_TEST_RANKS="1"))
    assert re.search(r"^1 passed, 0 failed$", out2, re.M), out2[-4000:]
    return out + out2


def imports_from(python: Path, env: Dict[str, str]) -> Path:
    """Where `python`, started outside any checkout, imports mpimesh from."""
    out = subprocess.run([str(python), "-c", "import mpimesh, os; print(os.path.dirname(mpimesh.__file__))"],
                         env=env, cwd=python.parent, capture_output=True, text=True, check=True).stdout
    return Path(out.strip()).parent


@pytest.fixture
def long_test():
    """Minutes by design (each command has its own timeout): no faulthandler dump after faulthandler_timeout."""
    faulthandler.cancel_dump_traceback_later()


SHORT = "--steps 10 --eval-every 10 --eval-batches 2 --samples 1"  # the app, where only installing differs


@pytest.mark.slow
@pytest.mark.usefixtures("long_test")
@pytest.mark.skipif(distribution_python() is None, reason="no distribution Python (/usr/bin/python3, prefix /usr)")
def test_distribution_python_as_is(tmp_path):
    """What a new user of this machine runs: its own /usr/bin/python3 first on PATH, nothing else done."""
    python = distribution_python()
    assert python is not None
    found = facts(python)
    if not found["pip"] and subprocess.run([str(python), "-c", "import ensurepip"], capture_output=True).returncode:
        pytest.skip(f"{python} has neither pip nor ensurepip (python3-pip and python3-venv both missing)")
    repo = copy_checkout(tmp_path / "mpimesh")
    env = shell_env([python.parent])
    assert run("command -v python3", repo, env).strip() == str(python)
    out = run_readme(repo, env)
    venv = repo / ".venv"
    assert f"install.py: using a new virtual environment {venv}" in out
    assert f"home = {python.parent}" in (venv / "pyvenv.cfg").read_text()
    assert imports_from(venv / "bin" / "python", env) == repo  # editable: the checkout itself
    pins = Path("constraints", f"python{found['version'][len('python'):]}.txt")
    if (repo / pins).exists():  # the tested versions, exactly
        assert f"install.py: the tested versions in {pins}" in out
        diff = run(f"{venv / 'bin' / 'python'} .ci/pins.py diff", repo, env)
        assert f"[pins] every installed version is the one pinned in {pins}" in diff, diff
    shutil.rmtree(tmp_path)  # passed: no need to keep a gigabyte of venv


@pytest.mark.slow
@pytest.mark.usefixtures("long_test")
def test_fresh_debian_system_python(tmp_path):
    system_bin = fake_system_python(tmp_path / "usr", base_python())
    repo = copy_checkout(tmp_path / "mpimesh")
    env = shell_env([system_bin])
    where = run("command -v python3 && python3 -c 'import sys; print(sys.prefix)'", repo, env).split()
    assert where == [str(system_bin / "python3"), str(tmp_path / "usr")]  # the copy found itself
    refused = subprocess.run("python3 -m pip install six", shell=True, cwd=repo, env=env,
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "externally-managed-environment" in refused.stderr, refused
    no_venv = subprocess.run("python3 -m venv probe", shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert no_venv.returncode != 0 and "ensurepip" in no_venv.stdout + no_venv.stderr, no_venv  # as on Debian
    assert run("python3 -c 'import venv, importlib.util; print(importlib.util.find_spec(\"ensurepip\"))'",
               repo, env) == "None\n"

    # the app as written runs in test_distribution_python_as_is, where there is a distribution Python
    out = run_readme(repo, env, app_args=SHORT if distribution_python() else "")
    venv = repo / ".venv"
    assert f"install.py: using a new virtual environment {venv}" in out
    assert f"install.py: using the existing virtual environment {venv}" in out
    assert f"home = {system_bin}" in (venv / "pyvenv.cfg").read_text()
    assert imports_from(venv / "bin" / "python", env) == repo  # editable: the checkout itself
    shutil.rmtree(tmp_path)


@pytest.mark.slow
@pytest.mark.usefixtures("long_test")
def test_inside_an_active_venv(tmp_path):
    system_bin = fake_system_python(tmp_path / "usr", base_python())
    repo = copy_checkout(tmp_path / "mpimesh")
    active = tmp_path / "myenv"
    made = subprocess.run([str(Path(sys.base_prefix, "bin", VERSION)), "-m", "venv", str(active)],
                          env=shell_env([system_bin]), capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot make a venv with pip from {sys.base_prefix}: {made.stderr.strip()[-200:]}")
    env = shell_env([active / "bin", system_bin], VIRTUAL_ENV=str(active))

    out = run_readme(repo, env, app_args=SHORT)
    assert out.count(f"install.py: using the active virtual environment {active}") == 2
    assert not (repo / ".venv").exists()
    assert imports_from(active / "bin" / "python", env) == repo
    shutil.rmtree(tmp_path)


def test_an_unknown_extra_is_refused_before_anything_is_installed():
    """`install.py mpihc` (a typo) installed without it, pip only warning; now one line naming the
    extras, and nothing made."""
    proc = subprocess.run([sys.executable, str(ROOT / "install.py"), "mpich,mpihc"], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, VIRTUAL_ENV=""))
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("install.py: unknown extra 'mpihc': the extras are mpich, test, docs, bench, "
                                   "notebook, tpu, safetensors, gpu, gpu-cuda13"), proc.stderr


def stub_venv(tmp_path: Path, version: str, pip_status: int = 0) -> Path:
    """A venv whose ``bin/python`` is a stub: to install.py's version probe (``-c``) it answers `version`;
    any other command line it appends to ``tmp_path/log`` (and exits `pip_status` for ``-m pip``)."""
    stub = tmp_path / "venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(f"""#!/bin/sh
if [ "$1" = -c ]; then echo {version}; exit 0; fi
printf '%s\\n' "$*" >> {tmp_path / "log"}
if [ "$1" = -m ]; then exit {pip_status}; fi
""")
    stub.chmod(0o755)
    return stub.parent.parent


def install_py(venv: Path, *argv: str) -> subprocess.CompletedProcess:
    """``install.py argv`` by a Python that is no venv's, with `venv` active ($VIRTUAL_ENV)."""
    base = Path(sys.base_prefix, "bin", VERSION)
    return subprocess.run([str(base), str(ROOT / "install.py"), *argv], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, VIRTUAL_ENV=str(venv)))


def logged(tmp_path: Path) -> List[str]:
    """The command lines the stub python ran with."""
    return (tmp_path / "log").read_text().splitlines() if (tmp_path / "log").exists() else []


def pinned_version() -> str:
    """A Python version ("3.X") that has pins in constraints/."""
    found = sorted((ROOT / "constraints").glob("python3.*.txt"))
    assert found, "no pins in constraints/"
    return found[0].stem[len("python"):]


def test_the_tested_versions_are_installed_by_default(tmp_path):
    """The README's command: pip gets the pins for the environment's Python (the stub's), then the command runs."""
    version = pinned_version()
    proc = install_py(stub_venv(tmp_path, version), "mpich,test", "--", "tests/run.py", "-x")
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    assert logged(tmp_path) == [f"-m pip install -c constraints/python{version}.txt -e .[mpich,test]",
                                "tests/run.py -x"]
    assert f"install.py: the tested versions in constraints/python{version}.txt (--latest: the newest releases)\n" \
        in proc.stdout


@pytest.mark.parametrize("argv", [["--latest", "mpich,test"], ["mpich,test", "--latest"]])
def test_latest_leaves_the_pins_out(tmp_path, argv):
    proc = install_py(stub_venv(tmp_path, pinned_version()), *argv, "--", "tests/run.py")
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    assert logged(tmp_path) == ["-m pip install -e .[mpich,test]", "tests/run.py"]
    assert "install.py: --latest: the newest releases, not the tested versions in constraints/\n" in proc.stdout


def test_a_python_without_pins_installs_the_newest_releases_after_one_warning(tmp_path):
    """Python 3.99 has no pins file: never refused, one line says so, pip gets no constraints."""
    proc = install_py(stub_venv(tmp_path, "3.99"), "mpich")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert logged(tmp_path) == ["-m pip install -e .[mpich]"]
    assert proc.stderr == ("install.py: no tested versions for Python 3.99 (constraints/python3.99.txt does not "
                           "exist): installing the newest releases, which mpimesh may not have been tested with\n")


def test_a_failed_pinned_install_points_to_latest(tmp_path):
    version = pinned_version()
    proc = install_py(stub_venv(tmp_path, version, pip_status=1), "mpich", "--", "tests/run.py")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert logged(tmp_path) == [f"-m pip install -c constraints/python{version}.txt -e .[mpich]"]  # no command run
    assert proc.stderr.strip().endswith(f'-m pip install -c constraints/python{version}.txt -e ".[mpich]"` failed '
                                        f"(see above) (if pip found no release of a version pinned in constraints/"
                                        f"python{version}.txt for this machine, --latest installs the newest "
                                        "releases instead)"), proc.stderr


@pytest.mark.parametrize("option", ["--lastest", "-latest", "--pre"])
def test_an_unknown_option_is_refused_before_anything_is_installed(tmp_path, option):
    proc = install_py(stub_venv(tmp_path, pinned_version()), option, "mpich", "--", "tests/run.py")
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr == (f"install.py: unknown option '{option}': the options are --latest (the newest releases, "
                           "not the tested versions) and --help\n")
    assert logged(tmp_path) == []


def test_help_names_latest():
    proc = subprocess.run([sys.executable, str(ROOT / "install.py"), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "python3 install.py [--latest] [EXTRAS] [-- ARGS...]" in proc.stdout, proc
    assert "``--latest`` leaves the pins out" in proc.stdout


def requirement_names(requirements: List[str]) -> List[str]:
    """`["jax[cpu]", "numpy>=1.23"]` -> `["jax", "numpy"]`, normalised as pip compares names."""
    return [re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", r).group(0)).lower() for r in requirements]


def test_the_pins_cover_every_requirement_but_the_gpu_extras():
    """Each pins file pins (exactly, ``name==version``) every dependency and every non-GPU extra's package:
    a requirement added to pyproject.toml without .ci/refresh_pins fails here."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(requirement_names(project["dependencies"]))
    for extra, requirements in project["optional-dependencies"].items():
        if not extra.startswith("gpu"):
            wanted |= set(requirement_names(requirements))
    files = sorted((ROOT / "constraints").glob("python3.*.txt"))
    assert files
    for path in files:
        lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
        bad = [line for line in lines if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!]+", line)]
        assert not bad, f"{path.name}: not name==version: {bad}"
        missing = wanted - set(requirement_names(lines))
        assert not missing, f"{path.name} pins no version of {sorted(missing)}: run .ci/refresh_pins"
