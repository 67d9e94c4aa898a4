"""Where the program called mpimesh: the user's `file:line` and the public call it made there.

Read from the stack only when a message needs it (a failed or long-waiting collective, a host read
under a trace), never per op. The user's frame is the innermost one outside the mpimesh package
(`contextlib`'s frames between a `with mm.profile()` and its generator are passed through); the
public call is the mpimesh function or method that frame called, named as the program spells it:
`mm.save`, `DistTensor.to_numpy`, `Mesh.barrier`, `mm.add` (for `x + y`), else by its module
(`mm.checkpoint.prune`).

>>> where_called()  # called from outside mpimesh: no public call
('mpimesh', '<doctest ...>:1', False)
"""
from __future__ import annotations

import contextlib
import os
import sys
from functools import lru_cache
from types import FrameType, FunctionType
from typing import Optional

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_CONTEXTLIB = os.path.abspath(contextlib.__file__)
_TOP = __name__.split(".")[0]  # "mpimesh"

# Public calls that are collectives although they look local (they read, write or show values), by
# where they are defined: a message about a rank waiting in one says that every rank must call it.
# Their docstrings say so too (tests/test_hang_notice.py checks that each exists and says it).
EVERY_RANK = frozenset({
    "mpimesh.checkpoint.save", "mpimesh.checkpoint.load", "mpimesh.checkpoint.save_step",
    "mpimesh.checkpoint.steps", "mpimesh.checkpoint.newest_intact", "mpimesh.checkpoint.prune",
    "mpimesh.tensor.from_local", "mpimesh.tensor.DistTensor.to_numpy", "mpimesh.tensor.DistTensor.__float__",
    "mpimesh.tensor.DistTensor.__repr__", "mpimesh.cost.search.auto_layout", "mpimesh.cost.calibrate.calibrate"})


@lru_cache(maxsize=None)
def _where_file(filename: str) -> int:
    """2 for a file of the mpimesh package, 1 for contextlib's, 0 for the program's."""
    path = os.path.abspath(filename)
    return 2 if path.startswith(_PACKAGE) else 1 if path == _CONTEXTLIB else 0


def _walk(frame: Optional[FrameType]) -> tuple:
    """(the user's frame or None, the outermost mpimesh frame inside it or None), from `frame` outwards."""
    outer = None
    while frame is not None:
        kind = _where_file(frame.f_code.co_filename)
        if not kind:
            break
        if kind == 2:
            outer = frame
        frame = frame.f_back
    return frame, outer


def _line(frame: Optional[FrameType]) -> str:
    return "<mpimesh>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def user_frame() -> str:
    """`file:line` of the innermost frame outside the mpimesh package (the user's call site)."""
    return _line(_walk(sys._getframe(1))[0])


def where_called(frame: Optional[FrameType] = None) -> tuple:
    """(the public mpimesh call the program is in, e.g. `'mm.save'`, or `'mpimesh'` where there is
    none; the program's `file:line` of that call; whether every rank must call it: one of
    `EVERY_RANK`), from the caller's frame or `frame` outwards."""
    user, outer = _walk(sys._getframe(1) if frame is None else frame)
    if outer is None:
        return "mpimesh", _line(user), False
    name, defined = name_of_call(outer)
    return name, _line(user), defined in EVERY_RANK


def _runs(obj, frame: FrameType) -> bool:
    """Whether `obj` (a function, maybe wrapped, or a property) is the function running in `frame`:
    its code, and for a closure (functions made by one factory share their code) its free variables."""
    fn, code = obj.fget if isinstance(obj, property) else obj, frame.f_code
    while getattr(fn, "__code__", None) is not code:
        if not isinstance(fn, (FunctionType, staticmethod, classmethod)):  # (nothing else is asked for more)
            return False
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "__func__", None)  # a decorator's, a static method's
    if not code.co_freevars:
        return True
    here = frame.f_locals
    try:
        return all(name in here and cell.cell_contents is here[name]
                   for name, cell in zip(code.co_freevars, fn.__closure__ or ()))
    except ValueError:  # an empty cell
        return False


def name_of_call(frame: FrameType) -> tuple:
    """(the public name, where it is defined: `module.Class.method` or `module.function`) of the
    function running in `frame`, an mpimesh frame. A method is `Class.method`, found on the class of
    its `self`; a function is named by its shortest public path along its module's (`mm.add`, made
    by a factory in `mm.ops.elementwise`), else by its module and name."""
    code = frame.f_code
    if code.co_argcount and code.co_varnames[0] == "self":
        owner = type(frame.f_locals.get("self"))
        for klass in owner.__mro__:
            name = next((n for n, attr in vars(klass).items() if _runs(attr, frame)), None)
            if name is not None:
                return f"{owner.__name__}.{name}", f"{klass.__module__}.{klass.__qualname__}.{name}"
    module = frame.f_globals.get("__name__", _TOP)
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        space = getattr(sys.modules.get(".".join(parts[:i])), "__dict__", {})
        name = next((n for n, v in space.items() if not n.startswith("_") and _runs(v, frame)), None)
        if name is not None:
            return ".".join(["mm", *parts[1:i], name]), f"{module}.{code.co_name}"
    return ".".join(["mm", *parts[1:], code.co_name]), f"{module}.{code.co_name}"


def called(call: str, line: str, every: bool) -> str:
    """`call (line)`, and ", which every rank must call" where `every`.

    >>> called("mm.save", "train.py:31", True), called("mm.einsum", "train.py:20", False)
    ('mm.save (train.py:31), which every rank must call', 'mm.einsum (train.py:20)')
    """
    return f"{call} ({line}), which every rank must call" if every else f"{call} ({line})"
