"""The pins (constraints/python3.X.txt) against the environment of the Python that runs this: compare, or rewrite.

Usage (run with the environment's own Python, which picks the file for its version)::

    .ci/venv-latest/bin/python .ci/pins.py diff     # which installed versions differ from the pins
    .ci/venv-refresh/bin/python .ci/pins.py write   # the pins := this environment's `pip freeze`

``diff`` prints one line per package whose installed version differs from its pin, or that has none
(pins for packages not installed here are not listed: the pins cover extras an environment may lack);
it always exits 0. ``write`` is what ``.ci/refresh_pins`` runs once the whole suite passed in the
environment. Standard library only.
"""
from __future__ import annotations

import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parent.parent
VERSION = "%d.%d" % sys.version_info[:2]
PINS = ROOT / "constraints" / f"python{VERSION}.txt"

HEADER = """\
# The versions mpimesh's test suite passed with on Python {version}: install.py's pins (pip constraints).
#
# `python3 install.py EXTRAS` runs `pip install -c constraints/python3.X.txt -e ".[EXTRAS]"`, 3.X being the
# version of the environment's Python, so the README's commands install exactly these versions, which CI tests.
# `python3 install.py --latest EXTRAS` leaves the pins out: the newest releases pip finds (what CI's canary,
# .ci/canary, tests on every run, to learn when a new release breaks mpimesh).
#
# One file per Python minor version, because exact versions are only installable, and only tested, on some
# Pythons (numpy 2.4 has no wheels for Python 3.9 or 3.10). On a Python with no file here, install.py says
# so in one line and installs the newest releases, unpinned, as before pins existed: a user on another
# Python is never refused. `PYTHON=python3.X .ci/refresh_pins` makes the file for another Python.
#
# Covered: mpimesh's dependencies and the extras mpich, test, bench, docs, notebook, tpu, safetensors (pip
# ignores the pins of packages an install does not need). Not covered: the gpu and gpu-cuda13 extras (CuPy, NCCL: they
# need a GPU, which CI lacks, to be tested), nor pip, setuptools (the build backend) and wheel.
# Packages only some platforms install (colorama on Windows, appnope on macOS) have no pins: unpinned there.
#
# Refresh (after a green run with the newest releases): .ci/refresh_pins makes a fresh venv, runs
# `install.py --latest` with every extra but the GPU ones, the whole suite, and only if it passes writes this
# file from that venv's `pip freeze --exclude-editable` (.ci/pins.py write). Review `git diff`, commit.
#
# Made {date} with Python {full} (prefix {prefix}) on {system} {machine}.{note}
"""


def normal(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): `Jinja2` is `jinja2`, `nest_asyncio2` `nest-asyncio2`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def freeze() -> Dict[str, str]:
    """This environment's distributions (the editable mpimesh left out): normal name -> `name==version` line."""
    out = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                         text=True, check=True).stdout
    lines = [line for line in out.splitlines() if line and not line.startswith("#")]
    odd = [line for line in lines if "==" not in line]
    if odd:  # `name @ file://...`: installed from a path or URL, which a constraints file cannot pin
        sys.exit(f"pins.py: not from an index, so not pinnable: {', '.join(odd)}")
    return {normal(line.split("==")[0]): line for line in lines}


def read(path: Path) -> Dict[str, str]:
    """The pins in `path`: normal name -> version."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[normal(name)] = version.strip()
    return pins


def diff() -> None:
    where = PINS.relative_to(ROOT)
    if not PINS.is_file():
        print(f"[pins] no pins for Python {VERSION} ({where} does not exist): nothing to compare")
        return
    pins, installed = read(PINS), freeze()
    rows = [(line.split("==")[0], pins.get(name, "(not pinned)"), line.split("==")[1])
            for name, line in installed.items() if pins.get(name) != line.split("==")[1]]
    if not rows:
        print(f"[pins] every installed version is the one pinned in {where}")
        return
    print(f"[pins] {len(rows)} installed version(s) differ from {where} (pinned -> installed):")
    width = max(len(r[0]) for r in rows)
    for name, pinned, now in rows:
        print(f"[pins]   {name:<{width}}  {pinned} -> {now}")


def write(note: str) -> None:
    lines = list(freeze().values())
    header = HEADER.format(version=VERSION, date=time.strftime("%Y-%m-%d"), full=platform.python_version(),
                           prefix=sys.base_prefix, system=platform.system(), machine=platform.machine(),
                           note=f"\n# {note}" if note else "")
    PINS.parent.mkdir(exist_ok=True)
    PINS.write_text(header + "\n".join(lines) + "\n")
    print(f"[pins] wrote {len(lines)} pins to {PINS.relative_to(ROOT)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["diff"] and len(sys.argv) == 2:
        diff()
    elif sys.argv[1:2] == ["write"] and len(sys.argv) <= 3:
        write(sys.argv[2] if len(sys.argv) == 3 else "")
    else:
        sys.exit(__doc__)
