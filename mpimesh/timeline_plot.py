"""`mm.profile.plot(json_path, png_path=None)`: a picture of a timeline, one row per rank.

Draws the JSON of `mm.profile(timeline=...)` with matplotlib (the `bench` extra): ops grey, the
collectives they ran coloured by kind, waits hatched red naming the rank waited for, and under
each row a strip of the non-blocking allreduces in flight.

>>> import json, os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "t.json")
>>> spans = [("einsum", "op", 0, 900, {}), ("allreduce all", "collective", 100, 700, {"kind": "allreduce"}),
...          ("wait for rank 1", "wait", 100, 600, {"rank": 1})]
>>> json.dump({"traceEvents": [{"name": n, "cat": c, "ph": "X", "ts": t, "dur": d, "pid": 0, "tid": 0, "args": a}
...                            for n, c, t, d, a in spans]}, open(path, "w"))
>>> plot_timeline(path) == path[:-5] + ".png" and os.path.getsize(path[:-5] + ".png") > 0
True
"""
from __future__ import annotations

import json
import os
from typing import Optional

from .errors import MpimeshError
from .extras import require

COLORS = {"allreduce": "#d95f02", "allgather": "#1b9e77", "alltoall": "#7570b3", "reduce_scatter": "#e7298a",
          "permute": "#66a61e", "exscan": "#a6761d", "op": "#b8b8b8", "bucket": "#2ca25f", "copy": "#1f78b4",
          "graph": "#6a3d9a", "compiled": "#e8e8e8", "other": "#e6ab02"}
_ROW, _STRIP = 0.62, 0.2  # heights of a rank's row and of its strip of transfers in flight
_LAYERS = ("compiled", "op", "bucket", "copy", "graph", "collective", "wait")  # categories, drawn in this order


def plot_timeline(json_path, png_path: Optional[str] = None, title: Optional[str] = None) -> str:
    """Draw the timeline at `json_path` into `png_path` (default: beside it, `.png`); the PNG's path."""
    with open(json_path) as f:
        try:
            events = json.load(f)["traceEvents"]
        except (ValueError, KeyError, TypeError) as e:
            raise MpimeshError(f"{json_path}: not a trace-event JSON with \"traceEvents\" ({e})") from None
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: -e["dur"])  # (wide under narrow)
    if not spans:
        raise MpimeshError(f"{json_path}: the timeline holds no spans to draw")
    png_path = png_path or os.path.splitext(os.fspath(json_path))[0] + ".png"
    ranks = sorted({e["pid"] for e in spans})
    start = min(e["ts"] for e in spans)
    total = (max(e["ts"] + e["dur"] for e in spans) - start) / 1e3
    fig = require("matplotlib.figure", "bench", "mm.profile.plot").Figure(figsize=(14, 1.0 + 0.75 * len(ranks)),
                                                                          dpi=110)
    ax = fig.subplots()
    ax.set_xlim(0, total)
    drawn: dict = {}
    for layer in _LAYERS:  # (parents first: a collective is drawn over the op that ran it, a wait over both)
        for e in spans:
            if e.get("cat", "op") == layer or (layer == "op" and e.get("cat") not in _LAYERS):
                _bar(ax, e, (e["ts"] - start) / 1e3, e["dur"] / 1e3, ranks.index(e["pid"]), drawn, total)
    ax.set_ylim(len(ranks) - 0.5, -0.6)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("time from the first event (ms)")
    ax.set_title(title or f"mpimesh timeline: {os.path.basename(os.fspath(json_path))}, {len(ranks)} ranks "
                 "(red hatched: waiting for the rank named; thin strips: non-blocking allreduces in flight)",
                 fontsize=9)
    fig.legend(list(drawn.values()), list(drawn), loc="lower center", ncol=min(len(drawn), 8), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.1 if len(drawn) <= 8 else 0.16, 1, 1))
    fig.savefig(png_path)
    return png_path


def _bar(ax, e: dict, x: float, width: float, row: int, drawn: dict, total: float) -> None:
    """One span as a bar in its rank's row (or strip, on the comm track), its legend entry noted in `drawn`."""
    cat, args = e.get("cat", "op"), e.get("args") or {}
    if e.get("tid", 0) == 1:
        y, h = row + _ROW / 2 + _STRIP / 2 + 0.02, _STRIP
    else:
        y, h = row, _ROW
    if cat == "wait":
        label, style = "waiting for another rank", {"facecolor": "none", "edgecolor": "#d7191c", "hatch": "////",
                                                    "linewidth": 0.0}
    elif cat == "collective":
        kind = args.get("kind", "other")
        label = f"{kind} (in flight)" if e.get("tid", 0) == 1 else kind
        style = {"color": COLORS.get(kind, COLORS["other"]), "alpha": 0.55 if e.get("tid", 0) == 1 else 0.95}
    else:
        label = {"op": "op", "bucket": "gradient bucket (replay)", "copy": "host-device copy",
                 "graph": "CUDA graph launch", "compiled": "compiled step (replay)"}.get(cat, "op")
        style = {"color": COLORS.get(cat, COLORS["op"])}
    bars = ax.broken_barh([(x, max(width, 1e-4))], (y - h / 2, h), **style)
    drawn.setdefault(label, bars)
    if cat == "wait" and "rank" in args and width > 0.04 * total:
        ax.text(x + width / 2, y, f"waits for rank {args['rank']}", ha="center", va="center", fontsize=7,
                color="#d7191c")

