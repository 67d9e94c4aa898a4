"""The one parser of mpimesh's environment variables: every `MPIMESH_*` variable is read through it.

`flag` (1/0, true/false, yes/no, on/off), `whole`, `number`, `choice` and `text` take a variable's
name and its default: unset or blank gives the default, a value that does not parse an `MpimeshError`
naming the variable, its value and what it accepts. `early` keeps such an error from failing
`import mpimesh` (raised at first use); `KNOWN` lists every variable and `unknown` names the
misspelled ones. The variables and what they set: docs/environment.md. Imports only `errors.py`.

>>> import os
>>> name = "MPIMESH_TEST_ENV_PARSER"  # (the tests' own variable)
>>> os.environ[name] = " Off "
>>> flag(name, True), whole(name, 7, words={"off": 0})
(False, 0)
>>> del os.environ[name]
"""
from __future__ import annotations

import difflib
import math
import os
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

from .errors import MpimeshError

__all__ = ["flag", "whole", "number", "choice", "text", "early", "raise_kept", "KNOWN", "unknown", "warn_unknown",
           "launcher_rank", "UnknownVariableWarning"]

KNOWN: dict[str, str] = {
    # the settings (docs/environment.md's table)
    "MPIMESH_BACKEND": "backend.py", "MPIMESH_KEEP_MEMORY": "backend.py",
    "MPIMESH_GPU_MEMORY_FRACTION": "backend.py", "MPIMESH_NO_ABORT": "abort.py", "MPIMESH_THREADS": "threads.py",
    "MPIMESH_SPMD_CHECK": "collectives/guard.py", "MPIMESH_COLLECTIVE_TIMEOUT": "collectives/guard.py",
    "MPIMESH_HANG_NOTICE": "collectives/guard.py",
    "MPIMESH_SHM": "collectives/shm.py", "MPIMESH_CUDA_AWARE_MPI": "collectives/placement.py",
    "MPIMESH_DEBUG": "trace.py", "MPIMESH_BUCKET_BYTES": "buckets.py", "MPIMESH_PREFETCH": "overlap.py", "MPIMESH_CUDA_GRAPHS": "graphs.py",
    "MPIMESH_JAX_COORDINATOR": "tpu/distributed.py", "MPIMESH_CACHE_DIR": "cost/cache.py",
    "MPIMESH_RECALIBRATE": "cost/cache.py",
    "MPIMESH_FLIGHT_RECORDS": "flight.py", "MPIMESH_FLIGHT_DIR": "flight.py",
    # marks written for child processes, and the benchmarks' own
    "MPIMESH_AUTO_THREADS": "threads.py writes it: a default it chose",
    "MPIMESH_BENCH_REEXEC": "benchmarks/common.py writes it: the process was re-executed",
    "MPIMESH_BENCH_LOCK": "benchmarks/common.py: the lock file of timed runs ('' for none)",
    "MPIMESH_BENCH_ROOT": "benchmarks/common.py: the mpimesh checkout a benchmark imports (default: its own)",
    # the tests'
    "MPIMESH_TEST_SLOW_SAVE": "checkpoint.py: a save sleeps, for the crash tests",
    "MPIMESH_TEST_RANKS": "tests/run.py: rank counts", "MPIMESH_TEST_TIMEOUT": "tests/run.py: seconds per run",
    "MPIMESH_TEST_QUIET_NONZERO": "tests/run.py writes it: ranks > 0 report only failures",
    "MPIMESH_TEST_NO_PYTEST_MPI": "tests/run.py: 1 runs pytest-mpi's stand-in, tests/mpi_marks.py",
    "MPIMESH_TEST_XLA_FLAGS": "tests/jaxenv.py writes it: the XLA flags found accepted",
    "MPIMESH_TEST_INSTALL_INNER": "tests/test_install.py writes it: inside its own run",
    "MPIMESH_TEST_ENV_PARSER": "tests/test_env.py and the examples here: a variable to parse",
    "MPIMESH_DIFF_SEEDS": "tests/test_differential.py: programs per mesh shape",
    "MPIMESH_FUZZ_EXAMPLES": "tests/test_fuzz.py: examples per parser",
}
"""Every `MPIMESH_*` variable that mpimesh, its apps, benchmarks or tests read or write: name -> who
(tests/test_env.py scans the sources for any other)."""

_PREFIX = "MPIMESH_"
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


class UnknownVariableWarning(UserWarning):
    """An `MPIMESH_*` variable that mpimesh does not read: a misspelled name (`unknown`)."""

_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")
_FLAG = "1/0, true/false, yes/no or on/off"


def _raw(name: str) -> Optional[str]:
    """The variable's value without surrounding spaces, or None where it is unset or blank."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return raw.strip()


def flag(name: str, default: Any) -> Any:
    """A yes/no variable: True for 1/true/yes/on, False for 0/false/no/off (any case), `default`
    where unset or blank; anything else raises `MpimeshError`.

    >>> import os
    >>> os.environ["MPIMESH_TEST_ENV_PARSER"] = "maybe"
    >>> flag("MPIMESH_TEST_ENV_PARSER", True)
    Traceback (most recent call last):
    ...
    mpimesh.errors.MpimeshError: MPIMESH_TEST_ENV_PARSER='maybe': expected 1/0, true/false, yes/no or on/off
    >>> del os.environ["MPIMESH_TEST_ENV_PARSER"]
    """
    raw = _raw(name)
    if raw is None:
        return default
    word = raw.lower()
    if word in _YES:
        return True
    if word in _NO:
        return False
    raise MpimeshError(f"{name}={os.environ[name]!r}: expected {_FLAG}")


def _words(raw: str, words: Optional[Mapping[str, Any]]):
    """(True, the value) where `raw` is one of `words` (any case), else (False, None)."""
    if words:
        for word, value in words.items():
            if raw.lower() == word.lower():
                return True, value
    return False, None


def _given(name: str, default: Any, words: Optional[Mapping[str, Any]]) -> tuple:
    """`(True, value)` where the variable is unset or blank (`default`) or one of `words`, else
    `(False, its text)`."""
    raw = _raw(name)
    if raw is None:
        return True, default
    found, value = _words(raw, words)
    return (True, value) if found else (False, raw)


def _range(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    return f" >= {minimum}" if minimum is not None else f" <= {maximum}" if maximum is not None else ""


def _refuse(name: str, what: str, words: Optional[Mapping[str, Any]]) -> MpimeshError:
    also = f" (or {'/'.join(words)})" if words else ""
    return MpimeshError(f"{name}={os.environ[name]!r} is not {what}{also}")


def whole(name: str, default: Any, *, minimum: Optional[int] = None, maximum: Optional[int] = None,
          words: Optional[Mapping[str, Any]] = None, what: Optional[str] = None) -> Any:
    """A whole-number variable (decimal digits, an optional sign) within [`minimum`, `maximum`];
    `words` maps words (any case) to values of their own. `default` where unset or blank; anything
    else raises `MpimeshError` saying what it accepts (`what`, by default "a whole number" and the range).

    >>> import os
    >>> os.environ["MPIMESH_TEST_ENV_PARSER"] = "-5"
    >>> whole("MPIMESH_TEST_ENV_PARSER", 7, minimum=0, what="a whole number of bytes >= 0")
    Traceback (most recent call last):
    ...
    mpimesh.errors.MpimeshError: MPIMESH_TEST_ENV_PARSER='-5' is not a whole number of bytes >= 0
    >>> del os.environ["MPIMESH_TEST_ENV_PARSER"]
    """
    done, raw = _given(name, default, words)
    if done:
        return raw
    digits = raw[1:] if raw[:1] in "+-" else raw
    if not (digits.isascii() and digits.isdigit()):
        raise _refuse(name, what or "a whole number" + _range(minimum, maximum), words)
    n = int(raw)
    if (minimum is not None and n < minimum) or (maximum is not None and n > maximum):
        raise _refuse(name, what or "a whole number" + _range(minimum, maximum), words)
    return n


def number(name: str, default: Any, *, minimum: Optional[float] = None, maximum: Optional[float] = None,
           above: Optional[float] = None, words: Optional[Mapping[str, Any]] = None,
           what: Optional[str] = None) -> Any:
    """A finite real-number variable within [`minimum`, `maximum`] and greater than `above`; `words`
    maps words (any case) to values of their own. `default` where unset or blank; anything else
    (nan, inf, out of range, not a number) raises `MpimeshError` saying what it accepts."""
    done, raw = _given(name, default, words)
    if done:
        return raw
    bounds = (f" > {above}" if above is not None else "") + _range(minimum, maximum)
    try:
        x = float(raw)
    except ValueError:
        x = math.nan
    if (not math.isfinite(x) or (minimum is not None and x < minimum) or (maximum is not None and x > maximum)
            or (above is not None and x <= above)):
        raise _refuse(name, what or "a number" + bounds, words)
    return x


def choice(name: str, default: Any, choices: Sequence[str], *, what: str = "value") -> Any:
    """One of `choices` (any case; the spelling of `choices` is returned), `default` where unset or
    blank; anything else raises `MpimeshError` listing them."""
    raw = _raw(name)
    if raw is None:
        return default
    for option in choices:
        if raw.lower() == option.lower():
            return option
    raise MpimeshError(f"unknown {what} {os.environ[name]!r} (from {name}): choose one of {list(choices)}")


def text(name: str, default: Any = None, *, check: Optional[Callable[[str], bool]] = None,
         what: str = "a valid value") -> Any:
    """A free string without surrounding spaces, `default` where unset or blank; where `check` is
    given and says False, `MpimeshError` saying that the value is not `what`."""
    raw = _raw(name)
    if raw is None:
        return default
    if check is not None and not check(raw):
        raise _refuse(name, what, None)
    return raw


_kept: dict = {}  # variable name -> the MpimeshError its value gave when read at import


def early(read: Callable[..., Any], name: str, default: Any, **options) -> Any:
    """`read(name, default, **options)` for a variable read while `import mpimesh` runs: a bad value
    gives `default` and its error is kept for `raise_kept`, so the import itself never fails."""
    try:
        value = read(name, default, **options)
    except MpimeshError as e:
        _kept[name] = e
        return default
    _kept.pop(name, None)
    return value


def raise_kept(*names: str) -> None:
    """Raise `MpimeshError` for the bad values `early` kept: of `names`, or of every variable where
    none are given (one error naming them all)."""
    if not _kept:
        return
    errors = [e for name, e in sorted(_kept.items()) if not names or name in names]
    if errors:
        raise MpimeshError("; ".join(str(e) for e in errors))


def launcher_rank() -> Optional[int]:
    """This process's rank as the launcher (mpiexec, srun) set it in the environment, or None
    outside a launcher: read without MPI, so it works before MPI starts."""
    for name in _RANK_VARS:
        raw = os.environ.get(name, "").strip()
        if raw.isdigit():
            return int(raw)
    return None


def unknown(environ: Mapping[str, str] = os.environ) -> list:
    """A line for each `MPIMESH_*` variable of `environ` (any case) that is not in `KNOWN`, with the
    closest known name where one is close.

    >>> unknown({"MPIMESH_SPMD_CHEK": "1", "MPIMESH_DEBUG": "1", "HOME": "/root"})
    ['MPIMESH_SPMD_CHEK is not a variable mpimesh reads: did you mean MPIMESH_SPMD_CHECK?']
    """
    lines = []
    for name in sorted(environ):
        if not name.upper().startswith(_PREFIX) or name in KNOWN:
            continue
        tail = name.upper()[len(_PREFIX):]  # (the common prefix would make every name look close)
        close = difflib.get_close_matches(tail, [k[len(_PREFIX):] for k in KNOWN], n=1, cutoff=0.6)
        hint = f": did you mean {_PREFIX}{close[0]}?" if close else " (mpimesh/env.py lists those it reads)"
        lines.append(f"{name} is not a variable mpimesh reads{hint}")
    return lines


_checked = [False]


def warn_unknown() -> None:
    """`UnknownVariableWarning` for each line of `unknown()`: once per process (`import mpimesh` calls
    it), on the launcher's rank 0 alone (every rank sees the same environment)."""
    if _checked[0]:
        return
    _checked[0] = True
    if launcher_rank() in (None, 0):
        for line in unknown():
            warnings.warn(line, UnknownVariableWarning, stacklevel=3)  # (the `import mpimesh` line)
