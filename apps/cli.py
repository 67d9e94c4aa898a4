"""What the apps share on the command line: help that explains layouts on the app's own dims and shows
every default, layout rules checked against the model's dims, and one-line errors from rank 0.

>>> p = parser("demo", {"batch": "examples per step", "hidden": "the hidden layer's units"},
...            example="batch:rows;hidden:cols")
>>> _ = p.add_argument("--steps", type=int, default=3, help="training steps")
>>> _ = p.add_argument("--data", default=None, help="a text file (default: the stdlib's sources)")
>>> help = p.format_help(); "(default: 3)" in help, "hidden:cols" in help, help.count("default: ")
(True, True, 2)
>>> try:
...     check_layout("batch:all;nope:all", {"batch": "", "hidden": ""})
... except UsageError as e:
...     print(e)
--layout 'batch:all;nope:all' names dim 'nope', which this model does not have; its dims are batch, hidden
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
from typing import Callable, Dict, Optional

import mpimesh as mm


class UsageError(Exception):
    """A bad flag or input file, found before any work starts (the same on every rank)."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each help text, unless it says "(default: ...)" itself or the flag takes
    no value; the description and epilog kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.nargs == 0 or "(default" in text:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line per job, not one usage block per rank
        _fail(f"{self.prog}: error: {message} (--help lists the flags)")


def _rank() -> int:
    return mm.MPI.COMM_WORLD.Get_rank()


def _fail(line: str, status: int = 2):
    if _rank() == 0:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    sys.exit(status)


MESH = '--mesh, e.g. "rows:2;cols:2"'


def layout_help(dims: Dict[str, str], example: str, mesh: str = MESH) -> str:
    """The epilog: what layout rules are, on this app's dims (`mesh`: where the mesh comes from)."""
    width = max(len(d) for d in dims)
    rows = "\n".join(f"  {d:<{width}}  {what}" for d, what in dims.items())
    return (f"layouts:\n  Ranks form a mesh with named dims ({mesh}). Layout rules "
            f"such as\n  \"{example}\" say which tensor dims are split over which mesh dims;\n  dims the rules "
            f"do not name are replicated. Layouts change speed and memory,\n  never results. This model's "
            f"tensor dims:\n{rows}")


def parser(description: str, dims: Dict[str, str], example: str, mesh: str = MESH) -> argparse.ArgumentParser:
    """An ArgumentParser with defaults in the help, the layout epilog, and one-line errors."""
    return _Parser(description=description, epilog=layout_help(dims, example, mesh), formatter_class=_Formatter)


def check_at_least(args: argparse.Namespace, low: float, *names: str, above: bool = False) -> None:
    """Refuse every flag of `names` (`args`' attributes) whose value is not a finite number of at
    least `low` (`above`: greater than `low`), naming each.

    >>> try:
    ...     check_at_least(argparse.Namespace(lr=float("nan"), steps=-1, seed=0), 0, "lr", "steps", "seed", above=True)
    ... except UsageError as e:
    ...     print(e)
    --lr nan, --steps -1, --seed 0: must be finite and above 0
    """
    values = {n: getattr(args, n) for n in names}
    bad = {n: v for n, v in values.items() if not (math.isfinite(v) and (v > low if above else v >= low))}
    if bad:
        flags = ", ".join(f"--{n.replace('_', '-')} {v}" for n, v in bad.items())
        finite = "" if all(map(math.isfinite, bad.values())) else "finite and "
        raise UsageError(f"{flags}: must be {finite}{'above' if above else 'at least'} {low:g}")


def check_layout(rules: str, dims: Dict[str, str], flag: str = "--layout") -> None:
    """Refuse rules naming a tensor dim the model does not have (they would silently replicate it)."""
    try:
        pairs = mm.LayoutRules(rules).pairs
    except mm.MpimeshError as e:
        raise UsageError(f"{flag} {rules!r}: {e}") from None
    for dim, _ in pairs:
        if dim not in dims:
            raise UsageError(f"{flag} {rules!r} names dim {dim!r}, which this model does not have; "
                             f"its dims are {', '.join(dims)}")


def progress_bar(frac: float, width: int = 20) -> str:
    """A text bar of `width` cells, `frac` of them filled.

    >>> progress_bar(0.25, 8)
    '[##......]'
    """
    n = int(round(min(max(frac, 0.0), 1.0) * width))
    return "[" + "#" * n + "." * (width - n) + "]"


def eta_text(seconds: float) -> str:
    """Seconds left as `ETA m:ss` (`ETA h:mm:ss` from an hour on).

    >>> eta_text(83.4), eta_text(3725), eta_text(0)
    ('ETA 1:23', 'ETA 1:02:05', 'ETA 0:00')
    """
    m, s = divmod(int(round(max(seconds, 0.0))), 60)
    h, m = divmod(m, 60)
    return f"ETA {h}:{m:02d}:{s:02d}" if h else f"ETA {m}:{s:02d}"


def main_guard(main: Callable) -> Callable:
    """`main` for the command line (in-process callers get the exceptions): a UsageError,
    MpimeshError or OSError (raised on every rank alike, since the apps check their input before
    they start) becomes one line from rank 0 and exit status 2; Ctrl-C, "interrupted" and 130. A
    time-out or divergence is left to end the job with its traceback (its ranks may never meet again)."""
    @functools.wraps(main)
    def run(argv: Optional[list] = None):
        try:
            return main(argv)
        except (mm.CollectiveTimeoutError, mm.DivergenceError):
            raise
        except (UsageError, mm.MpimeshError, OSError) as e:
            _fail(f"{sys.argv[0].rsplit('/', 1)[-1]}: error: {e}")
        except KeyboardInterrupt:  # Ctrl-C reaches every rank: one line, not a traceback from each
            _fail(f"{sys.argv[0].rsplit('/', 1)[-1]}: interrupted", 130)
    return run
