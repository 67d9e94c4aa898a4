"""Install this checkout (editable) into a virtual environment, then run a command with its Python.

Usage::

    python3 install.py [--latest] [EXTRAS] [-- ARGS...]
    python3 install.py mpich -- -m mpimesh.launch -n 4 apps/transformer.py
    python3 install.py mpich,test -- tests/run.py
    python3 install.py --latest mpich,test -- tests/run.py   # the newest releases, not the tested versions

The environment is the active virtual environment if there is one ($VIRTUAL_ENV set, or python3 is a
venv's), else ``.venv`` beside this file, created if missing. That works where the system Python
refuses ``pip install`` (PEP 668, "externally-managed-environment") and where ``python3 -m venv`` has
no ensurepip (Debian/Ubuntu without python3-venv): the venv is then made ``--without-pip`` and the
system pip (>= 22.3) installs pip into it with ``--python``. Then it runs
``<env python> -m pip install -c constraints/python3.X.txt -e ".[EXTRAS]"`` and, given ``-- ARGS``, execs
``<env python> ARGS`` with the environment's bin/ first on PATH, as if activated. Standard library only;
Python >= 3.9.

Pins: ``constraints/python3.X.txt`` (3.X: the environment's Python) holds the exact versions of every
package the extras bring that the test suite passed with on that Python, so a new release nobody tested
cannot break an install. On a Python with no such file, install.py says so and installs the newest
releases. ``--latest`` leaves the pins out: the newest releases (what CI's canary tests).
``.ci/refresh_pins`` rebuilds the pins from the newest releases once the whole suite passes with them.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OPTIONS = ("--latest", "-h", "--help")
BIN, EXE = ("Scripts", "python.exe") if os.name == "nt" else ("bin", "python")


def fail(message):
    sys.exit(f"install.py: {message}")


def known_extras():
    """The extras pyproject.toml declares (its [project.optional-dependencies] keys; no tomllib on 3.9)."""
    names, inside = [], False
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("["):
            inside = line.strip() == "[project.optional-dependencies]"
        elif inside and "=" in line and not line[:1].isspace():
            names.append(line.split("=", 1)[0].strip())
    return names


def has_pip(python):
    return subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True).returncode == 0


def make_venv(venv):
    """``venv``'s Python and whether it was made now: made (again, if it has no working pip) with ensurepip,
    or where there is none (Debian/Ubuntu without python3-venv) without pip, then pip by the system's pip."""
    python = venv / BIN / EXE
    if python.exists() and has_pip(python):
        return python, False
    if subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], capture_output=True).returncode != 0:
        subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], capture_output=True)
        if python.exists():
            subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "pip"])
    if not python.exists() or not has_pip(python):
        fail(f"cannot make a virtual environment with pip in {venv}: {sys.executable} has no ensurepip and no "
             "pip >= 22.3 (on Debian/Ubuntu: `sudo apt install python3-venv`, then run this again)")
    return python, True


def python_version(python):
    """``"3.X"``: the version of ``python``, the environment's (it picks the pins; it need not be this one)."""
    out = subprocess.run([str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        fail(f"{python} does not run: {out.stderr.strip()[-500:]}")
    return out.stdout.strip()


def pins_for(python, latest):
    """The constraints file to install with (relative to ROOT), or None: ``--latest``, or no pins for its Python."""
    if latest:
        print("install.py: --latest: the newest releases, not the tested versions in constraints/", flush=True)
        return None
    version = python_version(python)
    pins = Path("constraints", f"python{version}.txt")
    if not (ROOT / pins).is_file():
        print(f"install.py: no tested versions for Python {version} ({pins} does not exist): installing the "
              "newest releases, which mpimesh may not have been tested with", file=sys.stderr, flush=True)
        return None
    print(f"install.py: the tested versions in {pins} (--latest: the newest releases)", flush=True)
    return pins


def main(argv):
    head, args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    options, extras = [a for a in head if a.startswith("-")], [a for a in head if not a.startswith("-")]
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        fail(f"unknown option {unknown[0]!r}: the options are --latest (the newest releases, not the tested "
             "versions) and --help")
    if len(extras) > 1 or "-h" in options or "--help" in options:
        print(__doc__, file=sys.stderr if len(extras) > 1 else sys.stdout)
        return 2 if len(extras) > 1 else 0
    unknown = [e for e in (extras[0].split(",") if extras and extras[0] else []) if e.strip() not in known_extras()]
    if unknown:  # (pip only warns, and installs without them)
        fail(f"unknown extra {', '.join(map(repr, unknown))}: the extras are {', '.join(known_extras())}")
    if sys.prefix != sys.base_prefix:  # python3 is a venv's
        venv, python, which = Path(sys.prefix), Path(sys.executable), "the active"
    elif os.environ.get("VIRTUAL_ENV"):  # activated, though python3 is another
        venv = Path(os.environ["VIRTUAL_ENV"])
        python, which = venv / BIN / EXE, "the active"
        if not python.exists():
            fail(f"$VIRTUAL_ENV is {venv}, which has no {BIN}/{EXE}: deactivate it, or activate a working one")
    else:
        venv = ROOT / ".venv"
        python, made = make_venv(venv)
        which = "a new" if made else "the existing"
    print(f"install.py: using {which} virtual environment {venv}", flush=True)
    pins = pins_for(python, "--latest" in options)
    spec = f".[{extras[0]}]" if extras and extras[0] else "."
    command = [str(python), "-m", "pip", "install", *(["-c", str(pins)] if pins else []), "-e", spec]
    if subprocess.run(command, cwd=ROOT).returncode != 0:
        hint = (f" (if pip found no release of a version pinned in {pins} for this machine, --latest installs the "
                "newest releases instead)") if pins else ""
        fail(f'`{" ".join(command[:-1])} "{spec}"` failed (see above){hint}')
    if not args:
        return 0
    env = dict(os.environ, VIRTUAL_ENV=str(venv), PATH=os.pathsep.join([str(venv / BIN), os.environ.get("PATH", "")]))
    if os.name == "nt":
        return subprocess.call([str(python), *args], env=env)
    os.execve(str(python), [str(python), *args], env)  # signals (Ctrl-C) go straight to the command


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
