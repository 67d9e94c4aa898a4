"""Rematerialisation: `mm.remat(fn)` keeps only `fn`'s inputs and outputs for the backward pass.

Inside an open trace `fn`'s arrays are freed once only the trace holds them; `mm.gradients` runs `fn`
again (`jax.checkpoint`) and differentiates that run (below: the forward, the sum's gradient, the second
run, its gradient). `fn` must run the same ops on the same tensors both times. More: docs/autodiff.md.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> x = mesh.from_numpy(np.array([0.5, 1.0]), "a:2")
>>> with mm.trace() as tr:
...     y = mm.reduce_sum(remat(lambda t: mm.exp(mm.exp(t)))(x))
...     (g,) = mm.gradients([y], [x])
>>> [op.name for op in tr.ops], bool(np.allclose(g.to_numpy(), np.exp(np.exp([0.5, 1.0]) + [0.5, 1.0])))
(['exp', 'exp', 'einsum', 'full', 'einsum', 'broadcast', 'exp', 'exp', 'multiply', 'multiply'], True)
"""
from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, Optional

from .errors import CollectiveTimeoutError, DivergenceError, MpimeshError
from .mesh import layout_scope
from .trace import Released, _open_traces, _regions, release_unneeded, trace
from .stack import Stack
from .tree import tensors

_policy = Stack()  # innermost last: which regions run as remat (auto_layout's `remat_policy`)


@contextmanager
def remat_policy(chosen: Optional[Callable[[int], bool]]) -> Iterator[list]:
    """Inside the block, the k-th `mm.remat` call (0, 1, ..., counted from the block's start)
    rematerialises only if `chosen(k)`; the others run as plain calls. None: all of them (the
    default). Yields the list of the indices that did remat. `mm.auto_layout` prices plans with it.

    >>> with remat_policy(lambda k: k % 2 == 0) as done:
    ...     pass
    >>> done
    []
    """
    state = {"chosen": chosen, "next": 0, "done": []}
    with _policy.push(state):
        yield state["done"]


def _chosen() -> bool:
    state = _policy.top()
    if state is None:
        return True
    k, state["next"] = state["next"], state["next"] + 1
    if state["chosen"] is None or state["chosen"](k):
        state["done"].append(k)
        return True
    return False


class Region:
    """One `mm.remat` call inside an open trace: the function and arguments to run again, the
    tensors it read from outside (held, so they stay until its backward pass), its outputs, and the
    signature of its ops (to check the second run against). `parent`: the region it ran in."""

    __slots__ = ("fn", "args", "kwargs", "mesh", "rules", "inputs", "outputs", "flat", "ops", "parent", "forgotten")

    def __init__(self, fn, args, kwargs, parent):
        self.fn, self.args, self.kwargs, self.parent = fn, args, kwargs, parent
        self.mesh = next((t.mesh for t in tensors((args, kwargs))), None)
        self.rules = self.mesh.layout if self.mesh is not None else None
        self.inputs, self.outputs, self.flat, self.ops = [], [], [], []
        self.forgotten = False

    def root(self) -> "Region":
        """The outermost region this one ran in (itself if none)."""
        r = self
        while r.parent is not None:
            r = r.parent
        return r

    def close(self, ops: list, out) -> None:
        """`fn` returned `out` after running `ops`: note what the backward pass needs."""
        produced, seen = set(), set()
        for op in ops:
            for t in op.inputs:
                if id(t) not in produced and id(t) not in seen and not isinstance(t, Released):
                    seen.add(id(t))
                    self.inputs.append(t)
            produced.update(id(t) for t in op.outputs)
        self.flat = tensors(out)
        self.outputs = [t for t in self.flat if id(t) in produced]
        self.ops = _signature(ops)

    def run_again(self) -> tuple:
        """Run `fn` again under the layout rules it first ran under: `(outputs, ops)`, the new
        outputs in the order of `self.outputs` and the ops they took, recorded in the open traces."""
        if self.forgotten:
            raise MpimeshError(f"mm.remat({_name(self.fn)}): its inputs were let go by an earlier "
                               f"mm.gradients, so it cannot run again for a second backward pass; differentiate "
                               f"the first time with mm.gradients(..., retain=True) (PyTorch's retain_graph=True)")
        scope = layout_scope(self.mesh, self.rules) if self.mesh is not None else nullcontext()
        tr = None
        try:
            with scope, trace() as tr:
                out = self.fn(*self.args, **self.kwargs)
                release_unneeded()  # what no gradient rule reads goes before the backward allocates
        except (MemoryError, CollectiveTimeoutError, DivergenceError):
            raise  # (not the block's doing: the message of each says what happened)
        except Exception as e:
            raise MpimeshError(self._differs(tr.ops if tr is not None else [], e)) from e
        ops = tr.ops
        for rec in ops:
            rec.rerun = rec.rerun or self  # (an inner region's second runs keep their own mark)
        if _signature(ops) != self.ops:
            raise MpimeshError(self._differs(ops, None))
        flat = tensors(out)
        ids = {id(t) for t in self.outputs}
        return [b for a, b in zip(self.flat, flat) if id(a) in ids], ops

    def _differs(self, ops: list, error: Optional[BaseException]) -> str:
        """The message for a re-run that took `ops` and then raised `error` (None: it returned, but
        its ops differ from the forward's): the first op that differs, and the likely cause."""
        again, first = _signature(ops), self.ops
        k = next((k for k, (a, b) in enumerate(zip(first, again)) if a != b), min(len(first), len(again)))
        if k < len(first) and k < len(again):
            a, b = first[k], again[k]
            if a[:2] != b[:2]:
                what = f"the forward ran {_op(a)}, the re-run {_op(b)}"
            elif a[2] != b[2]:
                seen = {id(t): t for t in self.inputs}  # the forward's tensors from outside (held: the ids are theirs)
                seen.update((id(t), t) for rec in ops for t in rec.inputs)
                args = {id(t) for t in tensors((self.args, self.kwargs))}
                j = next(j for j, (x, y) in enumerate(zip(a[2], b[2])) if x != y)
                what = (f"{_op(a)}, whose input {j} in the forward was {_source(a[2][j], seen, args)}, in the "
                        f"re-run {'another: ' if a[2][j] and b[2][j] else ''}{_source(b[2][j], seen, args)}")
            else:
                what = (f"{_op(a)} with {_params(a)} in the forward and {_params(b)} in the re-run (a number "
                        f"drawn on the host each run?)")
            diff = f"at op {k} it differs from the forward: {what}"
        elif k < len(first):
            diff = (f"it raised before its op {k}, where the forward ran {_op(first[k])}" if error is not None else
                    f"it ran {len(again)} ops, the forward {len(first)} (the next was {_op(first[k])})")
        elif k < len(again):
            diff = f"it ran more ops than the forward's {len(first)}: op {k} is {_op(again[k])}"
        else:
            diff = f"it raised after the forward's {k} ops, which it ran alike"
        raised = f"raised {type(error).__name__}: {error}; " if error is not None else "computed something else: "
        return (f"mm.remat({_name(self.fn)}): its re-run in the backward pass {raised}{diff}. Likely cause: a "
                f"variable the function reads changed between the forward and the backward (Python closures bind "
                f"late: bind it as a default argument, `lambda t, i=i: ...`, or pass it in); the function must "
                f"compute the same ops from the same tensors both times")

    def forget(self) -> None:
        """Its backward pass is done and its values released: let its inputs and outputs go."""
        self.args, self.kwargs, self.inputs, self.outputs, self.flat, self.forgotten = (), {}, [], [], [], True


def remat(fn: Callable) -> Callable:
    """`fn` rematerialised: its activations recomputed in the backward pass instead of kept (see
    the module doc). Outside an open trace, a plain call.

    >>> import mpimesh as mm
    >>> block = remat(lambda x, w: mm.relu(mm.einsum([x, w], output_shape="b:2;h:2")))
    >>> block.__wrapped__ is not None
    True
    """
    if not callable(fn):
        raise TypeError(f"mm.remat needs a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def rematerialised(*args, **kwargs):
        if not _open_traces or not _chosen():
            return fn(*args, **kwargs)
        region = Region(fn, args, kwargs, _regions[-1] if _regions else None)
        tr = _open_traces[-1]
        start = len(tr.ops)
        _regions.append(region)
        try:
            out = fn(*args, **kwargs)
        finally:
            _regions.pop()
        region.close(tr.ops[start:], out)
        release_unneeded()  # its activations go now, not ops later
        return out
    return rematerialised


def _signature(ops: list) -> list:
    """Per op: its name, its inputs' shapes, per input the tensor's id if it came from outside the
    ops (None if an earlier op of `ops` made it), and its number and string params (a scale drawn on
    the host anew would differ; a nan as its repr, equal to itself). Two runs' signatures are equal
    if they ran alike. (A tensor released meanwhile has one `Released` stand-in in every record: its
    id still links them.)"""
    made: set = set()
    out = []
    for op in ops:
        ins = op.inputs
        out.append((op.name, tuple([t.shape for t in ins]), tuple([None if id(t) in made else id(t) for t in ins]),
                    tuple([(k, v if v == v else repr(v)) for k, v in op.params.items() if isinstance(v, _PARAMS)])))
        made.update(map(id, op.outputs))
    return out


_PARAMS = (int, float, complex, str)


def _op(entry: tuple) -> str:
    """`einsum of [a:2, b:3], [b:3]`: a `_signature` entry, for a message."""
    return f"{entry[0]} of {_shapes(entry) or 'nothing'}"


def _source(i, seen: dict, args: set) -> str:
    """What an input of a `_signature` entry is: made inside the block (`i` None), an argument of
    the block, or another tensor from outside it (a closure's, a global's); `seen`: tensors by id."""
    if i is None:
        return "made inside the block"
    t = seen.get(i)
    what = f"a {t.shape} {t.dtype} tensor" if t is not None else "a tensor"
    return f"{what}, an argument of the block" if i in args else f"{what} from outside the block (not an argument)"


def _params(entry: tuple) -> str:
    """The params of a `_signature` entry, for an error message."""
    return ", ".join(f"{k}={v!r}" for k, v in entry[3])


def _shapes(entry: tuple) -> str:
    """The input shapes of a `_signature` entry, for an error message."""
    return ", ".join(str(shape) for shape in entry[1])


def _name(fn) -> str:
    """`name, defined at file:line` of a function (its name alone for other callables)."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    code = getattr(getattr(fn, "func", fn), "__code__", None)  # (a functools.partial: its function's)
    return f"{name}, defined at {code.co_filename}:{code.co_firstlineno}" if code is not None else name
