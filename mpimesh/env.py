"""The one parser of mpimesh's environment variables: every `MPIMESH_*` variable is read through it.

`flag` reads a yes/no setting, `whole` a whole number, `number` a real number, `choice` one name
of a list, `text` a free string. Each takes the variable's name and its default: an unset
variable, or one set to the empty string or to spaces only, gives the default; surrounding spaces
and the case of words are ignored. Anything else raises `MpimeshError` naming the variable, its
value and what it accepts, so a typo is never read as some other setting (`off` as on, `-2` as
unset). Every rank sees the same environment under `mpiexec`, so every rank raises alike.

A variable read while `import mpimesh` runs is read with `early`: a bad value gives the default
for now and its error is kept, to be raised at first use (`raise_kept`: by every `Mesh`, and by
the accessor of that setting), where the abort hook is in place and the message is the
traceback's last line, instead of failing the import itself.

>>> import os
>>> os.environ["MPIMESH_EXAMPLE"] = " Off "
>>> flag("MPIMESH_EXAMPLE", True)
False
>>> os.environ["MPIMESH_EXAMPLE"] = "maybe"
>>> flag("MPIMESH_EXAMPLE", True)
Traceback (most recent call last):
...
mpimesh.errors.MpimeshError: MPIMESH_EXAMPLE='maybe': expected 1/0, true/false, yes/no or on/off
>>> os.environ["MPIMESH_EXAMPLE"] = "-5"
>>> whole("MPIMESH_EXAMPLE", 7, minimum=0, what="a whole number of bytes >= 0")
Traceback (most recent call last):
...
mpimesh.errors.MpimeshError: MPIMESH_EXAMPLE='-5' is not a whole number of bytes >= 0
>>> del os.environ["MPIMESH_EXAMPLE"]
>>> whole("MPIMESH_EXAMPLE", 7), flag("MPIMESH_EXAMPLE", True), choice("MPIMESH_EXAMPLE", "numpy", ("numpy", "cupy"))
(7, True, 'numpy')

The variables (README.md and the modules' docstrings say more), with when they are read:

| variable | read by | meaning | accepts (default) |
|---|---|---|---|
| `MPIMESH_BACKEND` | `backend.py`, each `Mesh` | array module for `Mesh(backend=None)` | `numpy`, `cupy` (`numpy`) |
| `MPIMESH_KEEP_MEMORY` | `backend.py`, first mesh | glibc's malloc keeps freed memory | flag (on) |
| `MPIMESH_GPU_MEMORY_FRACTION` | `backend.py`, CuPy meshes | cap of a GPU's CuPy pool | [0, 1], `0`/`off`: no cap (0.9) |
| `MPIMESH_NO_ABORT` | `abort.py`, import and `Mesh` | keep Python's excepthook | flag (off) |
| `MPIMESH_THREADS` | `threads.py`, import | BLAS/OpenMP threads per rank | whole number >= 1 (cores // local ranks) |
| `MPIMESH_SPMD_CHECK` | `collectives/guard.py`, import | check before each collective | flag (off) |
| `MPIMESH_COLLECTIVE_TIMEOUT` | `collectives/guard.py`, import | time-out, seconds | > 0, `0`/`off`/`none`: none (600) |
| `MPIMESH_SHM` | `collectives/shm.py`, import | in-node sums through shared memory | flag (on) |
| `MPIMESH_CUDA_AWARE_MPI` | `collectives/placement.py`, CuPy meshes | MPI reads GPU memory | flag (ask MPI) |
| `MPIMESH_DEBUG` | `trace.py`, import | check each op's local outputs | flag (off) |
| `MPIMESH_BUCKET_BYTES` | `buckets.py`, import | gradient bucket size | whole number >= 0, 0: none (25 MiB) |
| `MPIMESH_CUDA_GRAPHS` | `graphs.py`, compiled steps on CuPy | CUDA graphs for compiled steps | flag (on) |
| `MPIMESH_JAX_COORDINATOR` | `tpu/distributed.py`, `initialize` | JAX's coordinator | `host:port` (rank 0 picks) |
| `MPIMESH_CACHE_DIR` | `cost/cache.py`, calibration | where calibrations are kept | a path (`$XDG_CACHE_HOME/mpimesh`) |
| `MPIMESH_RECALIBRATE` | `cost/cache.py`, calibration | measure again, not from the cache | flag (off) |

A flag accepts 1/0, true/false, yes/no and on/off. `MPIMESH_AUTO_THREADS` is no setting:
`threads.py` writes it to mark a default it chose. `MPIMESH_TEST_SLOW_SAVE`, read by
`checkpoint.py`, slows a save down for the crash tests.

Pure Python: it imports nothing of mpimesh but `errors.py`, so every module may import it.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, Mapping, Optional, Sequence

from .errors import MpimeshError

__all__ = ["flag", "whole", "number", "choice", "text", "early", "raise_kept"]

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
    where unset or blank; anything else raises `MpimeshError`."""
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
    else raises `MpimeshError` saying what it accepts (`what`, by default "a whole number" and the range)."""
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
