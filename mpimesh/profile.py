"""Measurement: per-collective and flop counters for a block, and a picture of a tensor's slices.

>>> import mpimesh as mm, numpy as np
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> with mm.profile() as prof:
...     y = mm.einsum([mesh.ones("a:2;b:3"), mesh.ones("b:3")])
>>> prof.counters["flops"]
{'calls': 1, 'flops': 12}
"""
from __future__ import annotations

import resource
import sys
import tracemalloc
from contextlib import contextmanager, nullcontext
from itertools import product
from typing import Iterator

from . import counters
from .layout import slice_bounds
from .stack import Stack
from .timeline import recording
from .timeline_plot import plot_timeline


class Profile:
    """What this rank did inside a `profile()` block.

    `counters["<kind>/<mesh dims>"]` is `{"calls", "elements", "bytes"}` per collective (elements: this
    rank's input buffer); `counters["flops"]` is `{"calls", "flops"}`; `"d2h"` and `"h2d"` count copies
    between GPU and host made by ops (a staged transport's: `"d2h/<mesh dims>"`, `"h2d/<mesh dims>"`).

    `peak_bytes`, once the block has ended: `"host"` (resident set), `"arrays"` (live allocations,
    numpy's included, with `profile(memory=True)`), and on CuPy `"gpu"` (the high-water mark of the
    bytes its memory pool handed out: used, not cached) and `"gpu_cached"` (the pool's total).

    `overlap` sums the non-blocking collectives completed in the block (the buckets of
    `mm.gradients`): `{"requests", "seconds", "exposed", "hidden"}`: seconds from each one's start to
    its completion, exposed the part this rank spent blocked on it, hidden the rest (a completion is
    seen when polled, after each gradient rule: hidden time is counted to the nearest op)."""

    def __init__(self, data: dict):
        self.counters = data
        self.overlap: dict = getattr(data, "overlap", {"requests": 0, "seconds": 0.0, "exposed": 0.0, "hidden": 0.0})
        self.peak_bytes: dict = {}

    @property
    def transfers(self) -> dict:
        """The counters of transfers only (collectives, host-device copies): not `"flops"`, nor
        `"copies"` (arrays copied on a rank to change their memory order)."""
        return counters.traffic(self.counters)

    def elements(self, kind: str = "allreduce") -> int:
        """Total elements this rank fed to collectives of `kind`."""
        return sum(v["elements"] for k, v in self.counters.items() if k.split("/")[0] == kind)

    def report(self) -> str:
        """A readable table of the counters."""
        rows = [("collective", "calls", "elements", "bytes")]
        for key in sorted(k for k in self.counters if k != "flops"):
            c = self.counters[key]
            rows.append((key, str(c["calls"]), str(c["elements"]), _human(c["bytes"])))
        if "flops" in self.counters:
            f = self.counters["flops"]
            rows.append(("flops", str(f["calls"]), f"{f['flops']:.3e}", ""))
        if self.overlap["requests"]:
            o = self.overlap
            rows.append(("overlap (non-blocking)", str(o["requests"]), "",
                         f"{o['exposed']:.4f} s exposed, {o['hidden']:.4f} s hidden"))
        for where, n in self.peak_bytes.items():
            rows.append((f"peak memory ({where})", "", "", _human(n)))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                         for r in rows)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_open_peaks = Stack()  # the running peaks of the profiles open now, outermost first


def _memory_mark(arrays: bool = False) -> dict:
    """Start measuring peak memory; returns the marks for `_memory_peak`. Host: the process's
    resident-set high-water mark (`VmHWM`), reset through `/proc/self/clear_refs` where Linux allows
    it (the allocator may keep freed memory, so this can stay high). `arrays`: also the peak of
    live Python allocations, numpy's arrays included, by `tracemalloc` (exact, but it slows
    allocation while it runs). GPU (once CuPy is in use): the high-water mark of the bytes CuPy's
    memory pool hands out (`_UsedPeak`, a CuPy memory hook; comparable to PyTorch's
    `max_memory_allocated`), and the pool's total, cached blocks included."""
    marks = {"host": _host_peak(reset=True)}
    if arrays:
        if not tracemalloc.is_tracing():
            tracemalloc.start()
            marks["started"] = True
        tracemalloc.reset_peak()
        marks["arrays"] = 0
    cp = sys.modules.get("cupy")
    if cp is not None:
        marks["gpu"] = _UsedPeak.start(cp)
    return marks


def _memory_peak(marks: dict) -> dict:
    """`{"host": bytes[, "arrays": bytes][, "gpu": used bytes, "gpu_cached": pool bytes]}`: the
    peaks since `_memory_mark`."""
    out = {"host": _host_peak(reset=False)}
    if "arrays" in marks:
        out["arrays"] = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0
    if "gpu" in marks:
        out["gpu"] = marks["gpu"].peak
        out["gpu_cached"] = int(marks["gpu"].pool.total_bytes())
    return out


def _memory_done(marks: dict) -> None:
    """Stop what `_memory_mark` started."""
    if marks.get("started"):
        tracemalloc.stop()
    if "gpu" in marks:
        marks["gpu"].stop()


class _UsedPeak:
    """The high-water mark of the bytes CuPy's default memory pool hands out while it is on: a
    memory hook (`cupy.cuda.MemoryHook`) adding each allocation's size and taking each free's off,
    from the pool's `used_bytes` when it starts. Made by `start`, which builds the hook class once
    (CuPy is imported only where it is already in use). CuPy's hooks are per thread and by name:
    each mark has its own name, so profiles nest; allocations by other threads are not seen."""

    _hook_class = None

    @classmethod
    def start(cls, cp) -> "_UsedPeak":
        if cls._hook_class is None:
            class Hook(cp.cuda.MemoryHook):
                def __init__(self, used: int):
                    self.name = f"mpimesh_used_peak_{id(self)}"
                    self.used = self.peak = used

                def malloc_postprocess(self, **kw):
                    self.used += kw["mem_size"]
                    self.peak = max(self.peak, self.used)

                def free_postprocess(self, **kw):
                    self.used -= kw["mem_size"]
            cls._hook_class = Hook
        mark = cls()
        mark.pool = cp.get_default_memory_pool()
        mark.hook = cls._hook_class(int(mark.pool.used_bytes()))
        mark.hook.__enter__()
        return mark

    @property
    def peak(self) -> int:
        return int(self.hook.peak)

    def stop(self) -> None:
        self.hook.__exit__(None, None, None)


def _host_peak(reset: bool) -> int:
    """The resident-set high-water mark in bytes (after resetting it, when asked and allowed)."""
    try:
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@contextmanager
def profile(memory: bool = False, timeline=None) -> Iterator[Profile]:
    """Count the collectives and local compute this rank runs inside the block, and its peak memory
    (`memory=True`: also the exact peak of live arrays, at some cost in speed). `timeline`: a file
    path: also record when each op and collective ran, on every rank, and when the block ends,
    rank 0 of `MPI.COMM_WORLD` writes them there as one Chrome trace (every rank of the job enters
    and leaves the block: `mpimesh.timeline`, docs/timeline.md); `profile.plot(path)` draws it."""
    for running in _open_peaks:  # an inner profile resets the high-water marks: fold them in first
        _fold(running, _memory_peak(running["marks"]))
    running = {"marks": _memory_mark(memory or any("arrays" in r["marks"] for r in _open_peaks)), "peak": {}}
    prof = None
    try:
        with _open_peaks.push(running), counters.counting() as data, \
                (nullcontext() if timeline is None else recording(timeline)):
            prof = Profile(data)
            yield prof
    finally:
        _fold(running, _memory_peak(running["marks"]))
        _memory_done(running["marks"])
        if prof is not None:
            prof.peak_bytes = running["peak"]


profile.plot = plot_timeline  # type: ignore[attr-defined]  (mm.profile.plot(path): the timeline's PNG)


def _fold(running: dict, now: dict) -> None:
    for k, v in now.items():
        running["peak"][k] = max(running["peak"].get(k, 0), v)


def visualize(t) -> str:
    """Which global slice each rank holds: a grid of the blocks of the split dims (rows: the first split
    dim, columns: the others), each cell naming its ranks, then one line per rank. Blocks may differ in
    size or be empty (`(empty)`). Pure layout arithmetic, no communication.

    >>> import mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> print(visualize(mesh.ones("a:4;b:2", layout="b:all")))
    DistTensor [a:4, b:2] float32 on mesh [all:1], layout {b: all}
    <BLANKLINE>
             +--------+
     b[0:2]  | rank 0 |
             +--------+
    <BLANKLINE>
      rank 0 (all=0): a[0:4] b[0:2]
    """
    mesh, names = t.mesh, t.shape.names
    layout = ", ".join(f"{k}: {v}" for k, v in t.layout.items())
    holders: dict = {}  # a block's ((coord, start, stop) per dim) -> the ranks holding it
    lines = []
    for rank, coords in enumerate(product(*[range(s) for s in mesh.shape.sizes])):
        c = dict(zip(mesh.shape.names, coords))
        bounds = slice_bounds(t.shape, mesh.shape, t.tensor_layout, c)
        # the coordinate tells apart the empty blocks that share their bounds
        block = tuple((c[m] if m else 0, b.start, b.stop) for m, b in zip(t.tensor_layout, bounds))
        holders.setdefault(block, []).append(rank)
        where = ",".join(f"{k}={v}" for k, v in c.items())
        empty = " (empty)" if any(b.start == b.stop for b in bounds) else ""
        lines.append(f"  rank {rank} ({where}): " + _label(names, block, range(len(names))) + empty)
    head = f"DistTensor {t.shape} {t.dtype} on mesh {mesh.shape}, layout {{{layout}}}"
    return "\n".join([head, "", *_grid(t, holders), "", *lines])


def _label(names, block, axes) -> str:
    """`a[0:2] b[3:6]`: the ranges of `block` ((coord, start, stop) per axis) along `axes`."""
    return " ".join(f"{names[i]}[{block[i][1]}:{block[i][2]}]" for i in axes)


def _grid(t, holders: dict) -> list[str]:
    """The text grid of `visualize`: one row per block of the first split dim, one column per
    combination of blocks of the other split dims (a single cell if nothing is split)."""
    split = [i for i, m in enumerate(t.tensor_layout) if m is not None]
    rows, cols = split[:1], split[1:]
    row_keys = sorted({tuple(b[i] for i in rows) for b in holders})
    col_keys = sorted({tuple(b[i] for i in cols) for b in holders})
    cell = {(tuple(b[i] for i in rows), tuple(b[i] for i in cols)): _ranks(r) for b, r in holders.items()}
    row_names = [_label(t.shape.names, dict(zip(rows, k)), rows) or "(not split)" for k in row_keys]
    col_names = [_label(t.shape.names, dict(zip(cols, k)), cols) for k in col_keys]
    width = max(len(v) for v in list(cell.values()) + col_names) + 2
    left = max(len(k) for k in row_names) + 3
    rule = " " * left + "+" + "+".join("-" * width for _ in col_keys) + "+"
    out = [(" " * (left + 1) + " ".join(k.center(width) for k in col_names)).rstrip()] if cols else []
    out.append(rule)
    for rk, rn in zip(row_keys, row_names):
        out.append(f" {rn}".ljust(left) + "|" + "|".join(f" {cell[rk, ck]}".ljust(width) for ck in col_keys) + "|")
        out.append(rule)
    return out


def _ranks(ranks: list[int]) -> str:
    """`rank 3` or `ranks 0,2,4` (a block replicated over the mesh dims the layout leaves unused)."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
