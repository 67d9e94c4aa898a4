"""Strong and weak scaling of a split einsum, the paper's two-layer MLP step and the Transformer step.

    python benchmarks/scaling.py                          # ranks 1,2,4, small sizes, a few minutes
    python benchmarks/scaling.py --ranks 1,2,4 --workloads einsum,mlp,transformer \\
        --layouts "data=batch:all" "model=hidden:all" "transformer/model=heads:all;d_ff:all;vocab:all" \\
        --mode strong,weak --out benchmarks/results
    python benchmarks/scaling.py --launcher "srun --mpi=pmix -n {n}" --ranks 8,16,32 --size paper
    python benchmarks/scaling.py --machine benchmarks/results/scaling_machine.json \
        --cluster "gpus=8, link=400Gbit/s, latency=2us" --predict-ranks 8,64,512

This driver (plain `python`, not under mpiexec) launches one MPI job per rank count with the
`--launcher` template (default: mpimesh.launch's `find_mpiexec()`, i.e. `<mpiexec> -n {n}`); each job
runs this file with the hidden `--worker FILE` flag, times every case and writes its results as JSON
from rank 0. The driver holds the benchmark lock of common.py while its jobs run (they skip it),
then writes `scaling.csv`, one PNG per workload and mode (`scaling_<workload>_<mode>.png`: step time
and efficiency against ranks, one colour per layout) and prints tables.

Oversubscription: a rank count above the CPUs this process may use (`os.sched_getaffinity`) shares
cores; its rows say so (`cores`, `oversubscribed`) and the plots draw its points hollow on a red band.
The cost model beside each curve (mm.cost: each step recorded dry on a DryMesh of the case's mesh
shape, `mm.cost.record`, priced by `mm.cost.estimate`; docs/cost_model.md):
  this machine  at the measured rank counts, on the machine in `--machine FILE` (JSON as
                mpimesh.cost.cache writes it); without it, each job whose ranks each have a core runs
                `mm.cost.calibrate` first, every round, and the fastest calibration of each rank count
                is kept as OUT/scaling_machine_n<ranks>.json: n ranks are priced on the machine as n
                ranks run it (an oversubscribed count on the most ranks calibrated). Printed:
                measured, predicted (compute and communication) and their ratio per row.
  a cluster     at `--predict-ranks` (default 8 to 1024) on `--cluster SPEC`, nodes of N cores or
                GPUs and their links (benchmarks/cluster_spec.py), each rank computing as the
                machine calibrated on the most ranks: `scaling_cluster.csv`. A curve stops where its layout no
                longer divides the sizes.

Workloads (float32):
  einsum       y = x·w, [batch, io] x [io, hidden] -> [batch, hidden], one mm.einsum.
  mlp          apps/two_layer.py's training step: y = relu(x·w + bias)·v, gradients of w, bias, v
               and x (as in the paper's Table 1), SGD.
  transformer  apps/transformer.py's training step (forward, mm.gradients, Adafactor) on random
               bytes; dims batch, length, memory_length, d_model, heads, d_kv, d_ff, vocab.
A layout that names a dim its workload lacks, or whose dims do not divide a rank count's mesh, is
an error before anything runs (`--skip-unfit` leaves the latter cases out instead).
Modes: strong keeps the global sizes (`--size tiny|small|paper`, `--set mlp.hidden=1024`); weak
multiplies the global batch by the rank count, so each rank's work stays constant.
Speedup and efficiency are against the smallest rank count run, n0 (medians): strong speedup
T(n0)/T(n), efficiency speedup·n0/n; weak efficiency T(n0)/T(n), speedup efficiency·n/n0. On a
shared machine, `--rounds K` runs the sweep K times and keeps each case's lowest median.

Layouts: `NAME` (a preset, below), `NAME=RULES` (for every workload) or `WORKLOAD/NAME=RULES` (one
workload; it wins over `NAME=RULES`). Presets: data = batch:all everywhere; model = io:all for the
einsum (the contracted dim: one allreduce of y), hidden:all for the MLP,
heads:all;d_ff:all;vocab:all for the Transformer; 2d = batch:rows with the model dims on cols.
Mesh (`--mesh`): "auto" (default) is all:{n} for a 1-D layout and apps/two_layer.py's balanced
rows x cols (x planes) for one naming rows/cols/planes; in a template, {n} is the rank count
("rows:2;cols:{n}"); names alone ("rows;cols") get the balanced factorisation of n.

Gradient buckets (`--buckets on|off|both`, default on): `mm.gradients` sums data-parallel
gradients in 25 MiB buckets, overlapped with the backward pass (on), or each on the spot, blocking
(off: layout NAME-nobuckets); both runs every case both ways, e.g. data-parallel strong scaling with
and without buckets side by side. Each row also gives the profiled step's allreduce calls and its
exposed communication (ms in blocking collectives plus ms blocked waiting for non-blocking ones)
beside the ms that the buckets' allreduces ran hidden behind the backward pass.

Communication: the bytes each rank feeds to collectives in one step, from mm.profile()'s counters
(the maximum over ranks), beside a Table 1-style formula. Convention (the counters'): a collective
counts this rank's input buffer once, so an allreduce counts its payload (the local array
reduced), not what a ring or tree algorithm actually moves; 4 bytes per float32 element.
  einsum       io split p ways: b·h/(r·c) (allreduce of the local output), else 0.
  mlp          apps/two_layer.py's Table 1 rows (e.g. hidden:all 2·b·d_io, batch:all 2·d_io·d_h + d_h).
  transformer  T = tokens per rank (batch/r · length), d = d_model, L = layers:
               vocab split: 2·T·d + 3·T (embedding forward, logits backward; cross-entropy max, sum
               and target logit); heads split: 4·L·T·d (per layer: attention output forward; q, k,
               v input gradients backward); d_ff split: 2·L·T·d (FFN output forward, FFN input
               gradient backward); batch split: P + 1 (every parameter gradient as this rank holds
               it, plus the loss); A: Adafactor's RMS(p) and RMS(u) of each split parameter (2
               scalars) plus its factored second-moment means over split dims.
"""
from __future__ import annotations

import common  # noqa: F401  (first: clean BLAS environment, may re-exec)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402
from collections import Counter  # noqa: E402
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence  # noqa: E402

import numpy as np  # noqa: E402
from common import WORLD, fmt_bytes, kernel_report, rank0_print, table, timeit, verdict  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as app  # noqa: E402
import two_layer as tl  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.launch import find_mpiexec, job_env  # noqa: E402
from mpimesh.layout import plan_layout  # noqa: E402  (pure layout maths: the library's own checks)
from mpimesh.extras import require  # noqa: E402
from mpimesh import cost  # noqa: E402
from mpimesh.cost.cache import machine_key, read_machine, write_machine  # noqa: E402
from mpimesh.dryrun import DryMesh, placeholder  # noqa: E402
import cluster_spec as cs  # noqa: E402

BYTES_PER_ELEMENT = 4  # every workload is float32
MODEL_TARGET = 0.25  # the cost model's prediction against the measured median, where each rank has a core
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CSV_FIELDS = ["workload", "mode", "layout", "rules", "mesh", "ranks", "sizes", "step_ms_median", "step_ms_min",
              "speedup", "efficiency", "comm_bytes_measured", "comm_bytes_formula", "comm_match", "comm_calls",
              "formula", "gflop_per_rank", "loadavg", "blas_kernel", "bucket_bytes", "allreduce_calls",
              "exposed_comm_ms", "hidden_comm_ms", "cores", "oversubscribed", "predicted_ms", "predicted_compute_ms",
              "predicted_comm_ms", "predicted_over_measured", "predicted_speedup", "predicted_efficiency"]
CLUSTER_FIELDS = ["workload", "mode", "layout", "rules", "mesh", "ranks", "nodes", "sizes", "predicted_ms",
                  "predicted_compute_ms", "predicted_comm_ms", "comm_bytes", "speedup", "efficiency", "cluster"]


class UsageError(ValueError):
    """Bad command-line input, reported as one message (no traceback)."""


class UnfitError(UsageError):
    """A layout that does not fit one rank count's mesh (sizes not divisible, ...): skipped with
    `--skip-unfit`, an error otherwise."""


class Formula(NamedTuple):
    """Elements each rank feeds to collectives in one step, per counter key (None: no formula for
    this layout), and the formula in symbols."""
    elements: Optional[Dict[str, int]]
    text: str

    def bytes(self) -> Optional[int]:
        return None if self.elements is None else BYTES_PER_ELEMENT * sum(self.elements.values())


class Workload(NamedTuple):
    """A benchmarked computation: sizes per `--size`, layout presets, the shapes of its tensors (for
    checking layouts before launching), its step as `(fn, args)` on a Mesh or a DryMesh (`fn(*args)`
    one step; it returns the new values of its first `carry` arguments) and its communication formula."""
    dims: Sequence[str]
    sizes: Dict[str, Dict[str, int]]
    presets: Dict[str, str]
    shapes: Callable[[Dict[str, int]], List[mm.Shape]]
    step: Callable[[mm.AbstractMesh, Dict[str, int]], tuple]
    formula: Callable[[mm.Mesh, str, Dict[str, int]], Formula]
    carry: int = 0


class Case(NamedTuple):
    """One measurement: a workload under one layout on one mesh, strong or weak."""
    workload: str
    mode: str
    layout: str
    rules: str
    mesh: str
    ranks: int
    sizes: Dict[str, int]
    bucket_bytes: Optional[int] = None  # mm.gradients' bucket size (None: the default, 25 MiB; 0: no buckets)


# ------------------------------------------------------------------------------- formula helpers

def _split(mesh_shape: mm.Shape, rules: mm.LayoutRules, dim: str) -> tuple:
    """(mesh dim, ways) that `dim` is split over; (None, 1) if unsplit or on a mesh dim of size 1."""
    m = rules.mesh_dim(dim)
    return (m, mesh_shape[m].size) if m and mesh_shape[m].size > 1 else (None, 1)


def _over(num: str, dens: Sequence[str]) -> str:
    """'b·h' over ['r', 'c'] -> 'b·h/(r·c)'; no denominators -> 'b·h'."""
    return num if not dens else f"{num}/{dens[0]}" if len(dens) == 1 else f"{num}/({'·'.join(dens)})"


# ---------------------------------------------------------------------------------- the einsum

def einsum_shapes(d: Dict[str, int]) -> List[mm.Shape]:
    return [mm.Shape([("batch", d["batch"]), ("io", d["io"])]), mm.Shape([("io", d["io"]), ("hidden", d["hidden"])]),
            mm.Shape([("batch", d["batch"]), ("hidden", d["hidden"])])]


def einsum_step(mesh: mm.AbstractMesh, d: Dict[str, int]) -> tuple:
    """y = x·w on `mesh` under the layout rules in force: `(fn, (x, w))`.

    >>> fn, args = einsum_step(mm.Mesh("all:1", comm=mm.MPI.COMM_SELF), {"batch": 4, "io": 2, "hidden": 3})
    >>> fn(*args).shape
    Shape('[batch:4, hidden:3]')
    """
    x_shape, w_shape, _ = einsum_shapes(d)
    return (lambda x, w: mm.einsum([x, w])), (mesh.random_normal(x_shape, seed=0), mesh.random_normal(w_shape, seed=1))


def einsum_formula(mesh: mm.Mesh, rules: str, d: Dict[str, int]) -> Formula:
    """One allreduce of the local output over io's mesh dim when io is split, else nothing.

    >>> einsum_formula(mm.Mesh("all:1", comm=mm.MPI.COMM_SELF), "io:all", {"batch": 4, "io": 2, "hidden": 3})
    Formula(elements={}, text='0 (io not split)')
    """
    rules = mm.LayoutRules(rules)
    (_, r), (_, c), (pm, p) = (_split(mesh.shape, rules, n) for n in ("batch", "hidden", "io"))
    if p == 1:
        return Formula({}, "0 (io not split)")
    dens = [s for s, k in (("r", r), ("c", c)) if k > 1]
    return Formula({f"allreduce/{pm}": d["batch"] * d["hidden"] // (r * c)}, _over("b·h", dens))


# ------------------------------------------------------------------------- the two-layer MLP

def _mlp_sizes(d: Dict[str, int]) -> "tl.Sizes":
    return tl.Sizes.of(d["batch"], d["io"], d["hidden"])


def mlp_shapes(d: Dict[str, int]) -> List[mm.Shape]:
    s = _mlp_sizes(d)
    return [mm.Shape(x) for x in ([s.batch, s.io], [s.io, s.hidden], [s.hidden], [s.batch, s.hidden])]


def mlp_step(mesh: mm.AbstractMesh, d: Dict[str, int]) -> tuple:
    """apps/two_layer.py's step (with the input gradient, as in Table 1): `(fn, (params, x, target))`;
    the benchmark runs it on fixed parameters."""
    s = _mlp_sizes(d)
    lr = 4.0 / s.hidden.size  # two_layer.py's default
    return (lambda params, x, target: tl.train_step(params, x, target, lr, input_grad=True)), \
        (tl.init_params(mesh, s, seed=0), *tl.make_data(mesh, s))


def mlp_formula(mesh: mm.Mesh, rules: str, d: Dict[str, int]) -> Formula:
    """Table 1, from apps/two_layer.py, in symbols for the dims split over more than one rank."""
    split = [(t, m) for t, m in mm.LayoutRules(rules).pairs if mesh.shape[m].size > 1]
    return Formula(tl.expected_allreduces(mesh, rules, _mlp_sizes(d)), tl.table1_formula(mesh, split))


# ------------------------------------------------------------------------------ the Transformer

TRANSFORMER_DIMS = ("batch", "length", "memory_length", "d_model", "heads", "d_kv", "d_ff", "vocab")
FORMULA_DIMS = ("batch", "heads", "d_ff", "vocab")  # splits the transformer formula covers


def transformer_config(d: Dict[str, int]) -> "app.Config":
    """apps/transformer.py's Config (Adafactor, relu) for the sizes `d`."""
    return app.Config(**{k: d[k] for k in ("d_model", "heads", "d_kv", "d_ff", "layers", "vocab", "length", "batch")})


def transformer_params(cfg: "app.Config") -> List[mm.Shape]:
    """The parameter shapes of apps/transformer.py's model, derived from its layers (not by building it)."""
    d = cfg.dim
    dm = [d("d_model")]
    per_layer = [dm, dm] + [[d("d_model"), d("heads"), d("d_kv")]] * 3 + [[d("heads"), d("d_kv"), d("d_model")]] + \
        [dm, dm, [d("d_model"), d("d_ff")], [d("d_ff"), d("d_model")]]
    shapes = [[d("vocab"), d("d_model")], [d("length"), d("d_model")]] + per_layer * cfg.layers + \
        [dm, dm, [d("d_model"), d("vocab")]]
    return [mm.Shape(s) for s in shapes]


def transformer_shapes(d: Dict[str, int]) -> List[mm.Shape]:
    cfg = transformer_config(d)
    act = [["batch", "length", "d_model"], ["batch", "length", "heads", "d_kv"], ["batch", "length", "d_ff"],
           ["batch", "length", "heads", "memory_length"], ["batch", "length", "vocab"]]
    return transformer_params(cfg) + [mm.Shape([cfg.dim(n) for n in a]) for a in act]


def transformer_step(mesh: mm.AbstractMesh, d: Dict[str, int]) -> tuple:
    """apps/transformer.py's training step on one fixed batch of random bytes (int32 placeholders on
    a DryMesh): `(fn, (params, state, batch))`, fn returning the new parameters and Adafactor state."""
    cfg = transformer_config(d)
    opt = app.make_optimizer(cfg)
    params = app.init_params(mesh, cfg)
    train_step = app.make_train_step(cfg, opt)
    if getattr(mesh, "dry", False):
        shape = [cfg.dim("batch"), cfg.dim("length")]
        batch = {k: placeholder(mesh, shape, "int32") for k in ("inputs", "targets")}
    else:
        data = np.random.default_rng(1).integers(0, 256, size=1 << 16).astype(np.uint8)
        batch = app.make_batch(mesh, data, cfg, app.train_offsets(data, cfg, 0, 0))
    return (lambda p, state, b: train_step(p, state, b)[:2]), (params, opt.init(params), batch)


def _local(shape: mm.Shape, split: Dict[str, tuple]) -> Dict[str, int]:
    """This rank's size of each dim of `shape`."""
    return {x.name: x.size // split.get(x.name, (None, 1))[1] for x in shape}


def adafactor_elements(mesh_shape: mm.Shape, split: Dict[str, tuple], params: List[mm.Shape],
                       opt: "mm.optim.Adafactor") -> Counter:
    """Adafactor's allreduced elements per counter key: RMS(p) and RMS(u) (one scalar each over
    all of a split parameter's mesh dims), and the factored means over a split d0 or d1:
    mean(g², d0) and mean(g², d1), each the slot's local size, and mean(vr, d1)."""
    out: Counter = Counter()
    for shape in params:
        mdims = {split[x.name][0] for x in shape if x.name in split}
        if not mdims:
            continue
        out["allreduce/" + "+".join(m for m in mesh_shape.names if m in mdims)] += 2
        dims = opt.factored_dims(shape)
        if dims is None:
            continue
        loc = _local(shape, split)
        size, (d0, d1) = math.prod(loc.values()), dims
        if d0.name in split:
            out[f"allreduce/{split[d0.name][0]}"] += size // loc[d0.name]
        if d1.name in split:
            out[f"allreduce/{split[d1.name][0]}"] += size // loc[d1.name] + size // (loc[d0.name] * loc[d1.name])
    return out


def transformer_formula(mesh: mm.Mesh, rules: str, d: Dict[str, int]) -> Formula:
    """Allreduced elements per rank of one training step, per layer and per parameter (see the
    module docstring); None for splits other than batch, heads, d_ff, vocab."""
    cfg, rules = transformer_config(d), mm.LayoutRules(rules)
    split = {n: _split(mesh.shape, rules, n) for n in TRANSFORMER_DIMS}
    split = {n: s for n, s in split.items() if s[1] > 1}
    other = sorted(set(split) - set(FORMULA_DIMS))
    if other:
        return Formula(None, f"n/a (no formula for splitting {', '.join(other)})")
    t, dm, layers = cfg.batch // split.get("batch", (None, 1))[1] * cfg.length, cfg.d_model, cfg.layers
    out: Counter = Counter()
    terms = []
    for dim, elements, text in (("vocab", 2 * t * dm + 3 * t, "2·T·d + 3·T"),
                                ("heads", 4 * layers * t * dm, "4·L·T·d"),
                                ("d_ff", 2 * layers * t * dm, "2·L·T·d")):
        if dim in split:
            out[f"allreduce/{split[dim][0]}"] += elements
            terms.append(text)
    params = transformer_params(cfg)
    if "batch" in split:
        held = sum(math.prod(_local(s, split).values()) for s in params)
        out[f"allreduce/{split['batch'][0]}"] += held + 1
        terms.append(f"P + 1 (P={held:,})")
    extra = adafactor_elements(mesh.shape, split, params, app.make_optimizer(cfg))
    if extra:
        out.update(extra)
        terms.append(f"A (A={sum(extra.values()):,})")
    where = f"; T={t}, d={dm}, L={layers}" if set(split) - {"batch"} else ""
    return Formula(dict(out), (" + ".join(terms) or "0") + where)


WORKLOADS: Dict[str, Workload] = {
    "einsum": Workload(
        ("batch", "io", "hidden"),
        {"tiny": dict(batch=64, io=32, hidden=64), "small": dict(batch=1024, io=1024, hidden=2048),
         "paper": dict(batch=4096, io=4096, hidden=4096)},
        {"data": "batch:all", "model": "io:all", "2d": "batch:rows;io:cols"},
        einsum_shapes, einsum_step, einsum_formula),
    "mlp": Workload(
        ("batch", "io", "hidden"),
        {"tiny": dict(batch=16, io=8, hidden=32), "small": dict(batch=256, io=512, hidden=2048),
         "paper": dict(batch=512, io=1024, hidden=4096)},
        {"data": "batch:all", "model": "hidden:all", "2d": "batch:rows;hidden:cols"},
        mlp_shapes, mlp_step, mlp_formula),
    "transformer": Workload(
        TRANSFORMER_DIMS,
        {"tiny": dict(d_model=128, heads=8, d_kv=4, d_ff=256, layers=1, vocab=256, length=4, batch=8),
         "small": dict(d_model=256, heads=8, d_kv=32, d_ff=1024, layers=2, vocab=256, length=64, batch=16),
         "paper": dict(d_model=1024, heads=16, d_kv=64, d_ff=4096, layers=2, vocab=256, length=128, batch=8)},
        {"data": "batch:all", "model": "heads:all;d_ff:all;vocab:all", "2d": app.PAPER_LAYOUT},
        transformer_shapes, transformer_step, transformer_formula, carry=2),
}


# ------------------------------------------------------------------------------------ the plan

def parse_list(text: str, what: str, known: Optional[Sequence[str]] = None) -> List[str]:
    """'a,b' -> ['a', 'b'], each checked against `known`.

    >>> parse_list("strong, weak", "mode", ["strong", "weak"])
    ['strong', 'weak']
    """
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise UsageError(f"--{what}: empty list")
    for s in items:
        if known is not None and s not in known:
            raise UsageError(f"unknown {what} {s!r}: choose from {', '.join(known)}")
    return items


def parse_ranks(text: str, what: str = "ranks") -> List[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, positive, distinct); `what` names the option in errors."""
    try:
        ranks = sorted({int(s) for s in parse_list(text, what)})
    except ValueError as e:
        raise UsageError(f"--{what} {text!r}: expected comma-separated integers") from e
    if ranks[0] < 1:
        raise UsageError(f"--{what} {text!r}: rank counts must be >= 1")
    return ranks


def parse_layouts(specs: Sequence[str]) -> tuple:
    """(layout names in order, {(workload or None, name): rules}) from `NAME`, `NAME=RULES` and
    `WORKLOAD/NAME=RULES`.

    >>> parse_layouts(["data", "model=hidden:all", "transformer/model=heads:all"])
    (['data', 'model'], {(None, 'model'): 'hidden:all', ('transformer', 'model'): 'heads:all'})
    """
    names: List[str] = []
    rules: Dict[tuple, str] = {}
    for spec in specs:
        head, eq, body = spec.partition("=")
        workload, slash, name = head.strip().rpartition("/")
        name = name.strip()
        if not name or (slash and (workload not in WORKLOADS or not eq)):
            raise UsageError(f"--layouts {spec!r}: expected NAME, NAME=RULES or WORKLOAD/NAME=RULES "
                             f"(workloads: {', '.join(WORKLOADS)})")
        if eq:
            rules[(workload or None, name)] = "" if body.strip() == "[]" else body.strip()
        if name not in names:
            names.append(name)
    return names, rules


def rules_for(workload: str, name: str, given: Dict[tuple, str]) -> str:
    """The rules of layout `name` for `workload`: its own, else the generic ones, else the preset."""
    for key in ((workload, name), (None, name)):
        if key in given:
            return given[key]
    presets = WORKLOADS[workload].presets
    if name not in presets:
        raise UsageError(f"layout {name!r} has no rules for workload {workload!r}: give {name}=RULES or "
                         f"{workload}/{name}=RULES, or use a preset ({', '.join(presets)})")
    return presets[name]


def mesh_for(template: str, rules: str, n: int) -> str:
    """The mesh shape for `n` ranks: 'auto' -> apps/two_layer.py's choice for the layout; a
    template with {n} formatted; bare names -> the balanced factorisation of n.

    >>> mesh_for("auto", "batch:all", 4), mesh_for("rows;cols", "", 8), mesh_for("x:{n}", "", 2)
    ('all:4', 'rows:2;cols:4', 'x:2')
    """
    if template == "auto":
        return tl.mesh_shape_for(rules, n)
    if "{n}" in template:
        return template.replace("{n}", str(n))
    if ":" not in template:
        names = [s for s in template.replace(",", ";").replace(" ", ";").split(";") if s]
        return ";".join(f"{m}:{k}" for m, k in zip(names, tl.balanced(n, len(names))))
    return template


def sizes_for(workload: str, size: str, mode: str, n: int, overrides: Dict[str, Dict[str, int]]) -> Dict[str, int]:
    """The global sizes: the preset with `--set` overrides; the batch times n for weak scaling."""
    d = dict(WORKLOADS[workload].sizes[size], **overrides.get(workload, {}))
    if mode == "weak":
        d["batch"] *= n
    return d


def parse_overrides(specs: Sequence[str]) -> Dict[str, Dict[str, int]]:
    """['mlp.hidden=1024'] -> {'mlp': {'hidden': 1024}}."""
    out: Dict[str, Dict[str, int]] = {}
    for spec in specs:
        key, _, value = spec.partition("=")
        workload, _, name = key.strip().partition(".")
        if workload not in WORKLOADS:
            raise UsageError(f"--set {spec!r}: expected WORKLOAD.SIZE=INT, WORKLOAD one of {', '.join(WORKLOADS)}")
        known = WORKLOADS[workload].sizes["tiny"]
        if name not in known:
            raise UsageError(f"--set {spec!r}: {workload} has no size {name!r} (its sizes: {', '.join(known)})")
        if not value.strip().isdigit() or int(value) < 1:
            raise UsageError(f"--set {spec!r}: {value!r} is not a positive integer")
        out.setdefault(workload, {})[name] = int(value)
    return out


def check_case(case: Case) -> None:
    """UsageError if the case's layout names a dim its workload lacks, or does not fit its mesh
    (unknown mesh dim, two dims of one tensor on one mesh dim, a size not divisible: the step runs, but the
    communication formulas count equal blocks)."""
    wl = WORKLOADS[case.workload]
    where = f"{case.workload}, {case.mode} scaling, {case.ranks} ranks, layout {case.layout} ({case.rules or '[]'})"
    try:
        rules, mesh_shape = mm.LayoutRules(case.rules), mm.Shape(case.mesh)
    except mm.MpimeshError as e:
        raise UsageError(f"{where}: {e}") from e
    missing = [t for t, _ in rules.pairs if t not in wl.dims]
    if missing:
        raise UsageError(f"layout {case.layout} ({case.rules}) names dim {missing[0]!r}, which workload "
                         f"{case.workload!r} does not have (its dims: {', '.join(wl.dims)}); give it its own "
                         f"rules with '{case.workload}/{case.layout}=RULES'")
    if mesh_shape.size != case.ranks:
        raise UnfitError(f"{where}: mesh {case.mesh} has {mesh_shape.size} processors, not {case.ranks}")
    for shape in wl.shapes(case.sizes):
        try:
            layout = plan_layout(shape, mesh_shape, rules)
        except mm.LayoutError as e:
            raise UnfitError(f"{where}, mesh {case.mesh}: {e}") from e
        for d, m in zip(shape, layout):  # mpimesh runs uneven blocks, but the formulas here assume equal ones
            if m is not None and d.size % mesh_shape[m].size:
                raise UnfitError(f"{where}, mesh {case.mesh}: dim {d.name!r} (size {d.size}) is not divisible by "
                                 f"mesh dim {m!r} (size {mesh_shape[m].size}); the scaling formulas need equal blocks")


def plan_cases(args: argparse.Namespace, n: int, skipped: Optional[List[str]] = None) -> List[Case]:
    """Every case to run on `n` ranks, each checked (UsageError on bad input); with
    `args.skip_unfit`, the cases that do not fit n ranks are left out, their reasons appended to `skipped`."""
    names, given = parse_layouts(args.layouts)
    overrides = parse_overrides(args.set)
    cases = []
    for mode in parse_list(args.mode, "mode", ["strong", "weak"]):
        for workload in parse_list(args.workloads, "workload", list(WORKLOADS)):
            for name in names:
                rules = rules_for(workload, name, given)
                case = Case(workload, mode, name, rules, mesh_for(args.mesh, rules, n), n,
                            sizes_for(workload, args.size, mode, n, overrides))
                try:
                    check_case(case)
                except UnfitError as e:
                    if not args.skip_unfit:
                        raise
                    if skipped is not None:
                        skipped.append(str(e))
                    continue
                if args.buckets in ("on", "both"):
                    cases.append(case)
                if args.buckets in ("off", "both"):
                    cases.append(case._replace(layout=f"{name}-nobuckets", bucket_bytes=0))
    return cases


# ---------------------------------------------------------------------------------- the worker

def blas_kernel() -> str:
    """'openblas 0.3.27 SkylakeX' for the BLAS libraries in use (threadpoolctl)."""
    from threadpoolctl import threadpool_info
    return "; ".join(f"{i.get('internal_api')} {i.get('version')} {i.get('architecture', '?')}"
                     for i in threadpool_info() if i.get("user_api") == "blas") or "?"


@contextlib.contextmanager
def bucket_bytes(case: Case) -> Iterator[None]:
    """mm.gradients' bucket size of `case` in force (its default where the case gives none)."""
    saved = mm.buckets.bucket_bytes()
    mm.set_bucket_bytes(saved if case.bucket_bytes is None else case.bucket_bytes)
    try:
        yield
    finally:
        mm.set_bucket_bytes(saved)


def build(case: Case, mesh: mm.Mesh) -> Callable[[], None]:
    """The case's step on `mesh` under the rules in force, one step a call; a step that carries
    state (the Transformer's parameters and Adafactor state) feeds its new values to the next."""
    wl = WORKLOADS[case.workload]
    fn, args = wl.step(mesh, case.sizes)
    box = list(args)

    def step() -> None:
        out = fn(*box)
        if wl.carry:
            box[:wl.carry] = out
    return step


def run_case(case: Case, mesh: mm.Mesh, repeat: int, warmup: int) -> dict:
    """Build the case's step on `mesh` (every rank of the mesh calls this), run one step inside
    mm.profile(), then time `repeat` more after `warmup`: the result row (every rank).

    Example (one rank):

        mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
        run_case(Case("einsum", "strong", "data", "batch:all", "all:1", 1, dict(batch=8, io=4, hidden=8)), mesh, 1, 0)
        # {'workload': 'einsum', ..., 'step_ms_median': 0.02, 'comm_bytes_measured': 0, 'comm_bytes_formula': 0, ...}
    """
    wl = WORKLOADS[case.workload]
    timer = _TIMERS.setdefault(id(mesh), app.CommTimer(mesh))
    with bucket_bytes(case), mm.layout_scope(mesh, case.rules):
        step = build(case, mesh)
        c0 = timer.seconds
        with mm.profile() as prof:
            step()
        blocked = timer.seconds - c0
        t_min, t_med = timeit(step, repeat=repeat, warmup=warmup, comm=mesh.comm_for(mesh.shape.names))
    comm = prof.transfers
    measured = mesh.comm_for(mesh.shape.names).allreduce(sum(v["bytes"] for v in comm.values()), op=mm.MPI.MAX)
    formula = wl.formula(mesh, case.rules, case.sizes)
    return {"workload": case.workload, "mode": case.mode, "layout": case.layout, "rules": case.rules or "[]",
            "mesh": case.mesh, "ranks": case.ranks, "sizes": " ".join(f"{k}={v}" for k, v in case.sizes.items()),
            "step_ms_median": 1e3 * t_med, "step_ms_min": 1e3 * t_min, "comm_bytes_measured": measured,
            "comm_bytes_formula": formula.bytes(), "comm_match": formula.bytes() == measured,
            "comm_calls": sum(v["calls"] for v in comm.values()), "comm_keys": sorted(comm),
            "formula": formula.text, "gflop_per_rank": prof.counters.get("flops", {}).get("flops", 0) / 1e9,
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()), "blas_kernel": blas_kernel(),
            "bucket_bytes": mm.buckets.bucket_bytes() if case.bucket_bytes is None else case.bucket_bytes,
            "allreduce_calls": sum(v["calls"] for k, v in comm.items() if k.startswith("allreduce/")),
            "exposed_comm_ms": 1e3 * (blocked + prof.overlap["exposed"]),
            "hidden_comm_ms": 1e3 * prof.overlap["hidden"]}


def predict(case: Case, machine: "cost.Machine") -> dict:
    """The cost model's price of one step of `case` on `machine` (mm.cost.estimate's dict): the step
    recorded dry on a DryMesh of the case's mesh shape under its rules (mm.cost.record: shapes only,
    no ranks), with the case's gradient buckets."""
    dry = DryMesh(case.mesh, case.rules)
    with bucket_bytes(case), mm.layout_scope(dry, case.rules):
        fn, args = WORKLOADS[case.workload].step(dry, case.sizes)
        return cost.estimate(cost.record(fn, args, dry, case.rules), None, None, machine)


_TIMERS: Dict[int, "app.CommTimer"] = {}  # one per mesh: it wraps the mesh's collectives once


def worker(args: argparse.Namespace) -> None:
    """Run every case for this job's rank count; rank 0 prints progress and writes the JSON."""
    n = WORLD.Get_size()
    cases = plan_cases(args, n)
    rank0_print(f"--- {n} rank(s): {len(cases)} cases\n{kernel_report()}")
    meshes: Dict[str, mm.Mesh] = {}
    if args.calibrate:  # the machine the driver's predictions price on: this job's ranks, before its cases
        mesh = meshes[f"all:{n}"] = mm.Mesh(f"all:{n}")
        machine = cost.calibrate(mesh)
        if WORLD.Get_rank() == 0:
            write_machine(args.calibrate, machine, machine_key(mesh))
        rank0_print(f"calibrated ({args.calibrate}): {machine}")
    results = []
    for case in cases:
        if case.mesh not in meshes:
            meshes[case.mesh] = mm.Mesh(case.mesh)
        r = run_case(case, meshes[case.mesh], args.repeat, args.warmup)
        results.append(r)
        rank0_print(f"{case.workload:>11} {case.mode:>6} {case.layout:>6} {n:>3} ranks: {r['step_ms_median']:9.2f} ms "
                    f"(min {r['step_ms_min']:.2f}), comm {fmt_bytes(r['comm_bytes_measured'])}/rank "
                    f"(formula {_fmt_formula(r['comm_bytes_formula'])}), {r['allreduce_calls']} allreduces, exposed "
                    f"comm {r['exposed_comm_ms']:.1f} ms, load {r['loadavg']}")
    if WORLD.Get_rank() == 0:
        with open(args.worker, "w") as f:
            json.dump({"ranks": n, "results": results}, f)


def _fmt_formula(b: Optional[int]) -> str:
    return "n/a" if b is None else fmt_bytes(b)


# ---------------------------------------------------------------------------------- the driver

def child_env() -> Dict[str, str]:
    """This environment less any MPI launcher's variables (in case the driver itself was started
    under MPI), with the benchmark lock off: the driver holds it for its jobs."""
    return job_env(MPIMESH_BENCH_LOCK="")


def launch(args: argparse.Namespace, argv: Sequence[str], n: int, out: str, extra: Sequence[str] = ()) -> None:
    """Run this script's worker on `n` ranks with the launcher template (`extra`: more worker
    arguments); SystemExit if it fails."""
    cmd = shlex.split(args.launcher.replace("{n}", str(n))) + \
        [sys.executable, os.path.abspath(__file__), *argv, *extra, "--worker", out]
    env = child_env()
    if args.timeout:
        env["MPIEXEC_TIMEOUT"] = str(args.timeout)
    print(f"\n$ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    try:
        code = subprocess.call(cmd, env=env, timeout=args.timeout + 60 if args.timeout else None)
    except subprocess.TimeoutExpired:
        code = "timeout"
    if code != 0 or not os.path.exists(out):
        sys.exit(f"scaling.py: the {n}-rank job failed (exit {code}); its output is above")


def best_rounds(rows: List[dict]) -> List[dict]:
    """Of the rows of one case from several rounds, the one with the lowest median (in first-seen order).

    >>> [r["step_ms_median"] for r in best_rounds([{"workload": "w", "mode": "strong", "layout": "l", "ranks": 1,
    ...     "step_ms_median": t} for t in (3.0, 2.0, 4.0)])]
    [2.0]
    """
    best: Dict[tuple, dict] = {}
    for r in rows:
        key = (r["workload"], r["mode"], r["layout"], r["ranks"])
        if key not in best or r["step_ms_median"] < best[key]["step_ms_median"]:
            best[key] = r
    return list(best.values())


def add_scaling(rows: List[dict], time: str = "step_ms_median", names: tuple = ("speedup", "efficiency")) -> None:
    """Speedup and efficiency (`names`) of each row against the smallest rank count of its workload,
    mode and layout, from the times in column `time` (default the medians).

    >>> rows = [{"workload": "w", "mode": "strong", "layout": "l", "ranks": n, "step_ms_median": t}
    ...         for n, t in ((1, 10.0), (2, 5.0), (4, 4.0))]
    >>> add_scaling(rows); [(r["speedup"], r["efficiency"]) for r in rows]
    [(1.0, 1.0), (2.0, 1.0), (2.5, 0.625)]
    """
    base: Dict[tuple, dict] = {}
    for r in sorted(rows, key=lambda r: r["ranks"]):
        b = base.setdefault(series(r), r)
        r[names[0]], r[names[1]] = scaling_of(r["mode"], b["ranks"], b[time], r["ranks"], r[time])


def series(r: dict) -> tuple:
    """A row's curve: (workload, mode, layout)."""
    return r["workload"], r["mode"], r["layout"]


def scaling_of(mode: str, n0: int, t0: float, n: int, t: float) -> tuple:
    """(speedup, efficiency) of time `t` on `n` ranks against `t0` on `n0` (see the module docstring).

    >>> scaling_of("strong", 1, 10.0, 4, 4.0), scaling_of("weak", 1, 10.0, 4, 20.0)
    ((2.5, 0.625), (2.0, 0.5))
    """
    ratio, scale = t0 / t, n / n0
    return (ratio, ratio / scale) if mode == "strong" else (ratio * scale, ratio)


def calibration_ranks(ranks: Sequence[int], cores: int) -> List[int]:
    """The rank counts whose jobs calibrate the machine: those with a core per rank, else the smallest.

    >>> calibration_ranks([1, 2, 4], 2), calibration_ranks([4, 8], 2)
    ([1, 2], [4])
    """
    return [n for n in ranks if not cs.oversubscribed(n, cores)] or [min(ranks)]


def machine_for(machines: Dict[int, "cost.Machine"], n: int) -> "cost.Machine":
    """The machine that prices `n` ranks here: calibrated on `n` ranks, else on the most ranks below
    (an oversubscribed count: the model gives each rank a core), else on the fewest.

    >>> machine_for({1: "one", 2: "two"}, 4), machine_for({2: "two"}, 1)
    ('two', 'two')
    """
    below = [k for k in machines if k <= n]
    return machines[max(below) if below else min(machines)]


def _priced(e: dict) -> dict:
    """mm.cost.estimate's seconds as the rows' milliseconds."""
    return {"predicted_ms": 1e3 * e["seconds"], "predicted_compute_ms": 1e3 * e["compute_seconds"],
            "predicted_comm_ms": 1e3 * e["comm_seconds"]}


def add_predictions(rows: List[dict], cases: Dict[tuple, Case], machines: Dict[int, "cost.Machine"],
                    cores: int) -> None:
    """Beside each measured row: the cost model's price of its case on this machine (`machines`, by
    the rank count calibrated on: `machine_for`), its ratio to the measured median, the model's own
    speedup and efficiency, and whether the row's ranks outnumber the `cores` this process may use."""
    for r in rows:
        machine = machine_for(machines, r["ranks"])
        r.update(_priced(predict(cases[series(r) + (r["ranks"],)], machine)), cores=cores,
                 oversubscribed=cs.oversubscribed(r["ranks"], cores))
        r["predicted_over_measured"] = r["predicted_ms"] / r["step_ms_median"]
    add_scaling(rows, "predicted_ms", ("predicted_speedup", "predicted_efficiency"))


def extrapolate(rows: List[dict], cases: Dict[tuple, Case], args: argparse.Namespace, machine: "cost.Machine") -> tuple:
    """`(rows, left out)`: the cost model's price of every measured curve at `args.predict_ranks`
    on `args.cluster`, each rank computing as `machine`'s (sizes and mesh as the measured cases
    would have them there), with its speedup and efficiency against the model's own price of the
    curve's first measured point; and `(curve, ranks, why)` for each rank count left out (the
    layout does not divide the sizes)."""
    out, left_out = [], []
    first = {}
    for r in sorted(rows, key=lambda r: r["ranks"]):
        first.setdefault(series(r), r)
    for key, b in first.items():
        base = cases[key + (b["ranks"],)]
        for n in args.predict_ranks:
            case = base._replace(ranks=n, mesh=mesh_for(args.mesh, base.rules, n),
                                 sizes=sizes_for(base.workload, args.size, base.mode, n, parse_overrides(args.set)))
            try:
                check_case(case)
            except UnfitError as e:
                left_out.append((key, n, str(e)))
                continue
            e = predict(case, cs.on_cluster(machine, args.cluster, case.mesh))
            row = dict(zip(("workload", "mode", "layout"), key), rules=case.rules or "[]", mesh=case.mesh, ranks=n,
                       nodes=cs.nodes(args.cluster, n), sizes=" ".join(f"{k}={v}" for k, v in case.sizes.items()),
                       comm_bytes=e["comm_bytes"], cluster=args.cluster.describe(), **_priced(e))
            row["speedup"], row["efficiency"] = scaling_of(case.mode, b["ranks"], b["predicted_ms"], n,
                                                           row["predicted_ms"])
            out.append(row)
    return out, left_out


def write_csv(rows: List[dict], path: str, fields: Sequence[str] = CSV_FIELDS) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else "" if v is None else v) for k, v in r.items()})


def _ends(left_out: List[tuple], key: tuple) -> str:
    """Why a curve's predictions stop: the first rank count left out, from `extrapolate`'s reasons."""
    for k, n, reason in left_out:
        if k == key:
            m = re.search(r"dim '(\w+)' \(size (\d+)\)", reason)
            return f"none from {n} ranks: " + (f"{m.group(1)} {m.group(2)} does not split {n} ways" if m else reason)
    return ""


def plot(rows: List[dict], predicted: List[dict], left_out: List[tuple], out: str, size: str,
         cluster: "cs.Cluster", machine_note: str) -> List[str]:
    """One PNG per workload and mode: step time and efficiency against ranks, a colour per layout:
    measured (hollow where ranks outnumber the cores this process may use), the cost model on this
    machine at the measured rank counts and on the described cluster at `predicted`'s."""
    matplotlib = require("matplotlib", "bench", "benchmarks/scaling.py's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    paths = []
    for workload, mode in dict.fromkeys((r["workload"], r["mode"]) for r in rows):
        fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(12, 6.2))
        group = sorted((r for r in rows if (r["workload"], r["mode"]) == (workload, mode)), key=lambda r: r["ranks"])
        cores, measured = group[0]["cores"], sorted({r["ranks"] for r in group})
        handles, ends, ticks = [], [], set(measured)
        for i, layout in enumerate(dict.fromkeys(r["layout"] for r in group)):
            pts, colour = [r for r in group if r["layout"] == layout], f"C{i}"
            n, over = np.array([r["ranks"] for r in pts]), np.array([r["oversubscribed"] for r in pts], bool)
            model = sorted((r for r in predicted if series(r) == series(pts[0])), key=lambda r: r["ranks"])
            ticks.update(r["ranks"] for r in model)
            for ax, y, y_model, y_cluster in (
                    (ax_t, "step_ms_median", "predicted_ms", "predicted_ms"),
                    (ax_e, "efficiency", "predicted_efficiency", "efficiency")):
                v = np.array([r[y] for r in pts])
                ax.plot(n, v, "-", color=colour, lw=1.8)
                ax.plot(n[~over], v[~over], "o", color=colour, ms=7)
                ax.plot(n[over], v[over], "o", mfc="white", mec=colour, mew=1.8, ms=8)
                ax.plot(n, [r[y_model] for r in pts], "--s", color=colour, ms=4, lw=1.2)
                if model:
                    ax.plot([r["ranks"] for r in model], [r[y_cluster] for r in model], ":^", color=colour, ms=5,
                            lw=1.5)
            ax_t.fill_between(n, [r["step_ms_min"] for r in pts], [r["step_ms_median"] for r in pts], color=colour,
                              alpha=0.15, lw=0)
            last = pts[-1]
            handles.append(Line2D([], [], color=colour, lw=5, label=f"{layout} ({last['rules']}): comm "
                                  f"{fmt_bytes(last['comm_bytes_measured'])}/rank at {last['ranks']} ranks"))
            end = _ends(left_out, series(pts[0]))
            if end:
                ends.append(f"{layout}: {end}")
        over_any = [n for n in measured if cs.oversubscribed(n, cores)]
        for ax in (ax_t, ax_e):
            if over_any:
                ax.axvspan(cores * 2 ** 0.5, max(over_any) * 2 ** 0.5, color="red", alpha=0.07, lw=0)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(ticks), [str(n) for n in sorted(ticks)])
            ax.set_xlabel("MPI ranks")
            ax.grid(alpha=0.3)
        ax_e.axhline(1.0, color="grey", ls="-", lw=0.8)
        ax_t.set_ylabel("step time (ms)")
        ax_e.set_ylabel(f"parallel efficiency against {measured[0]} rank{'s' * (measured[0] > 1)}")
        ax_t.set_title("median step time (band: down to the fastest step)", fontsize=9)
        ax_e.set_title(f"{mode} scaling efficiency (model: against its own time at {measured[0]} "
                       f"rank{'s' * (measured[0] > 1)})", fontsize=9)
        ax_t.set_yscale("log")
        low, high = ax_t.get_ylim()
        ax_t.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5) if high / low > 40 else (1, 1.5, 2, 3, 5, 7)))
        ax_t.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax_t.yaxis.set_minor_formatter(NullFormatter())
        top = max([1.1] + [r["efficiency"] for r in group] + [r["predicted_efficiency"] for r in group] +
                  [r["efficiency"] for r in predicted if (r["workload"], r["mode"]) == (workload, mode)])
        ax_e.set_ylim(0, min(top, 3.0) * 1.05)
        handles += [
            Line2D([], [], color="k", marker="o", lw=1.8, label="measured here (median step)"),
            Line2D([], [], color="k", marker="o", mfc="white", mew=1.8, ls="none",
                   label=f"measured with more ranks than the {cores} cores this process may use "
                         f"(os.sched_getaffinity): oversubscribed, red band"),
            Line2D([], [], color="k", marker="s", ms=4, ls="--", lw=1.2,
                   label=f"cost model, this machine: {machine_note}"),
            Line2D([], [], color="k", marker="^", ls=":", lw=1.5, label=f"cost model, a cluster: {cluster.describe()}; "
                   f"each rank computes as here")]
        for h in handles:
            h.set_label(textwrap.fill(h.get_label(), 80, subsequent_indent="  "))
        fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
        sizes = group[0]["sizes"] if mode == "strong" else group[0]["sizes"] + " at the smallest rank count"
        load = [float(r["loadavg"].split()[0]) for r in group]
        fig.suptitle(f"{workload}: {mode} scaling, {size} sizes, 1-min load average {min(load):.1f}-{max(load):.1f}"
                     f"\n{sizes}" + (f"\ncluster predictions: {'; '.join(ends)}" if ends else ""), fontsize=10)
        lines = max(sum(h.get_label().count("\n") + 1 for h in handles[i::2]) for i in (0, 1))
        fig.tight_layout(rect=(0, 0.01 + 0.027 * lines, 1, 1))
        path = os.path.join(out, f"scaling_{workload}_{mode}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def report(rows: List[dict]) -> str:
    """The printed table: times, scaling, and communication measured beside the formula."""
    body = [(r["workload"], r["mode"], r["layout"], r["ranks"], f"{r['step_ms_median']:.2f}", f"{r['step_ms_min']:.2f}",
             f"{r['speedup']:.2f}", f"{r['efficiency']:.2f}", r["comm_bytes_measured"],
             "n/a" if r["comm_bytes_formula"] is None else r["comm_bytes_formula"],
             "yes" if r["comm_match"] else "NO", r["allreduce_calls"], f"{r['exposed_comm_ms']:.1f}",
             f"{r['hidden_comm_ms']:.1f}", r["loadavg"].split()[0]) for r in rows]
    out = table(("workload", "mode", "layout", "ranks", "median ms", "min ms", "speedup", "eff",
                 "comm B/rank", "formula B", "match", "allreduces", "exposed ms", "hidden ms", "load"), body)
    lines = [f"  {r['workload']} {r['mode']} {r['layout']} ({r['rules']}), {r['ranks']} ranks: {r['formula']} "
             f"-> {_fmt_formula(r['comm_bytes_formula'])}" for r in rows if r["ranks"] > 1]
    return out + "\n\ncommunication formulas (elements per rank per step; 4 bytes each):\n" + "\n".join(lines)


def model_report(rows: List[dict], predicted: List[dict]) -> str:
    """The printed tables: the cost model against each measured row (its terms beside the measured
    exposed communication), the verdict on the rows with a core per rank, and the cluster's predictions."""
    body = [(r["workload"], r["mode"], r["layout"], r["ranks"], "yes" if r["oversubscribed"] else "",
             f"{r['step_ms_median']:.2f}", f"{r['predicted_ms']:.2f}", f"{r['predicted_over_measured']:.2f}",
             f"{r['predicted_compute_ms']:.2f}", f"{r['predicted_comm_ms']:.2f}", f"{r['exposed_comm_ms']:.1f}")
            for r in rows]
    out = table(("workload", "mode", "layout", "ranks", "oversub.", "measured ms", "predicted ms", "pred/meas",
                 "model compute ms", "model comm ms", "measured exposed comm ms"), body)
    fit = [r for r in rows if not r["oversubscribed"]]
    within = [r for r in fit if abs(r["predicted_over_measured"] - 1) <= MODEL_TARGET]
    worst = max(fit, key=lambda r: abs(r["predicted_over_measured"] - 1), default=None)
    if worst is not None:
        ranks = sorted({r["ranks"] for r in fit})
        out += "\n" + verdict(f"cost model within {MODEL_TARGET:.0%} of the measured median on {ranks} ranks "
                              f"(a core per rank)", len(within) == len(fit),
                              f"{len(within)} of {len(fit)} rows; worst {worst['workload']} {worst['mode']} "
                              f"{worst['layout']} on {worst['ranks']}: {worst['predicted_over_measured']:.2f}x")
    if predicted:
        out += f"\n\ncost model on a cluster ({predicted[0]['cluster']}; each rank computes as here):\n" + table(
            ("workload", "mode", "layout", "ranks", "nodes", "mesh", "predicted ms", "compute ms", "comm ms",
             "speedup", "eff"),
            [(r["workload"], r["mode"], r["layout"], r["ranks"], r["nodes"], r["mesh"], f"{r['predicted_ms']:.3g}",
              f"{r['predicted_compute_ms']:.3g}", f"{r['predicted_comm_ms']:.3g}", f"{r['speedup']:.3g}",
              f"{r['efficiency']:.2f}") for r in predicted])
    return out


def machine_note(machines: Dict[int, "cost.Machine"], paths: Dict[int, str]) -> str:
    """The calibrated machines in a few words, for the plots' legends."""
    return "; ".join(f"{os.path.basename(paths[n])} {m.flops / 1e9:.0f} GFLOP/s, {cs.fmt_time(m.op_overhead)}/op"
                     + (f", link {cs.fmt_bandwidth(m.bandwidth)}, {cs.fmt_time(m.latency)}" if m.links else "")
                     for n, m in sorted(machines.items()))


def driver(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Run one job per rank count with cases (`args.plans`, checked), each with a core per rank also
    calibrating the machine every round unless `--machine` gave it (each rank count's fastest
    calibration is kept, as each case keeps its fastest round); write the CSVs and PNGs, print the tables."""
    print(kernel_report(), flush=True)
    cores = cs.usable_cores()
    ran = [n for n, cases in args.plans.items() if cases]
    calibrate_on = [] if args.machine else calibration_ranks(ran, cores)
    paths = {n: os.path.join(args.out, f"scaling_machine_n{n}.json") for n in calibrate_on} or \
        {min(ran): args.machine}
    rows, calibrations = [], {n: [] for n in calibrate_on}
    with tempfile.TemporaryDirectory(prefix="mpimesh-scaling-") as tmp:
        for k in range(args.rounds):
            for n in ran:
                out = os.path.join(tmp, f"round{k}-ranks{n}.json")
                if n in calibrations:
                    calibrations[n].append(os.path.join(tmp, f"round{k}-machine-n{n}.json"))
                launch(args, argv, n, out, ["--calibrate", calibrations[n][-1]] if n in calibrations else [])
                with open(out) as f:
                    rows += json.load(f)["results"]
        for n, found in calibrations.items():
            os.makedirs(args.out, exist_ok=True)
            shutil.copyfile(max(found, key=lambda p: read_machine(p).flops), paths[n])
    machines = {n: read_machine(p) for n, p in paths.items()}
    for n, p in paths.items():
        print(f"\nthe cost model prices on {p}: {machines[n]}", flush=True)
    rows = best_rounds(rows)
    add_scaling(rows)
    cases = {(c.workload, c.mode, c.layout, c.ranks): c for n in ran for c in args.plans[n]}
    add_predictions(rows, cases, machines, cores)
    predicted, left_out = extrapolate(rows, cases, args, machines[max(machines)])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "scaling.csv")
    write_csv(rows, path)
    write_csv(predicted, os.path.join(args.out, "scaling_cluster.csv"), CLUSTER_FIELDS)
    pngs = plot(rows, predicted, left_out, args.out, args.size, args.cluster, machine_note(machines, paths))
    print("\n" + report(rows) + "\n\ncost model against measurement (this machine):\n" + model_report(rows, predicted))
    print(f"\nwrote {path}, scaling_cluster.csv and {len(pngs)} plots: {', '.join(os.path.basename(p) for p in pngs)}")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4", help="rank counts, one MPI job each (default 1,2,4)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--layouts", nargs="+", default=["data", "model"], metavar="LAYOUT",
                    help="NAME, NAME=RULES or WORKLOAD/NAME=RULES (default: the presets data model)")
    ap.add_argument("--mode", default="strong,weak", help="strong, weak or both (default strong,weak)")
    ap.add_argument("--size", default="small", choices=["tiny", "small", "paper"], help="problem sizes (default small)")
    ap.add_argument("--set", nargs="+", default=[], metavar="WORKLOAD.SIZE=INT",
                    help="override sizes, e.g. mlp.hidden=1024")
    ap.add_argument("--buckets", default="on", choices=["on", "off", "both"],
                    help="gradient buckets: on (25 MiB, default), off (layout NAME-nobuckets) or both")
    ap.add_argument("--mesh", default="auto", help="mesh template: auto, 'all:{n}', 'rows:2;cols:{n}' or 'rows;cols'")
    ap.add_argument("--repeat", type=int, default=5, help="timed steps per case (median and min kept)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the profiled one")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the whole sweep this many times, keep each case's lowest median (load bursts)")
    ap.add_argument("--skip-unfit", action="store_true",
                    help="leave out the cases whose layout does not fit a rank count (e.g. batch 8 on 16 ranks)")
    ap.add_argument("--launcher", default=None, help='e.g. "srun --mpi=pmix -n {n}" (default: "<mpiexec> -n {n}")')
    ap.add_argument("--timeout", type=int, default=0, help="kill a job after this many seconds (0: never)")
    ap.add_argument("--out", default=RESULTS, help="folder for scaling.csv and the PNGs (default benchmarks/results)")
    ap.add_argument("--machine", default=None, metavar="FILE",
                    help="the calibrated machine the cost model prices on (JSON, as mpimesh.cost.cache writes it; "
                         "default: calibrate in this run, on each rank count with a core per rank, and keep them "
                         "as OUT/scaling_machine_n<ranks>.json)")
    ap.add_argument("--cluster", default=cs.DEFAULT, metavar="SPEC",
                    help=f"the cluster the predictions go on to (default {cs.DEFAULT!r}; fields: see "
                         f"benchmarks/cluster_spec.py)")
    ap.add_argument("--predict-ranks", default="8,16,32,64,128,256,512,1024",
                    help="rank counts priced on the cluster (default 8,16,...,1024)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--calibrate", default=None, help=argparse.SUPPRESS)  # (a worker: calibrate, keep it there)
    args = ap.parse_args(argv)
    try:
        args.ranks = parse_ranks(args.ranks)
        if args.repeat < 1 or args.warmup < 0 or args.rounds < 1:
            raise UsageError(f"--repeat {args.repeat} and --rounds {args.rounds} must be >= 1, "
                             f"--warmup {args.warmup} >= 0")
        if args.worker is None:
            require("matplotlib", "bench", "benchmarks/scaling.py's plots")  # before the sweep, not after
            args.launcher = args.launcher or f"{shlex.quote(find_mpiexec())} -n {{n}}"
            if "{n}" not in args.launcher:
                raise UsageError(f"--launcher {args.launcher!r} must contain {{n}} (the rank count)")
            skipped: List[str] = []
            args.cluster = cs.parse_cluster(args.cluster)
            args.predict_ranks = parse_ranks(args.predict_ranks, "predict-ranks")
            if args.machine:
                try:
                    read_machine(args.machine)  # before the sweep, not after
                except OSError as e:
                    raise UsageError(f"--machine {args.machine}: {e.strerror or e}") from e
            args.plans = {n: plan_cases(args, n, skipped) for n in args.ranks}
            if not any(args.plans.values()):
                raise UsageError("--skip-unfit left no case to run:\n  " + "\n  ".join(skipped))
            for reason in skipped:
                print(f"skipped: {reason}", flush=True)
    except (UsageError, cs.ClusterError, FileNotFoundError, mm.MpimeshError) as e:
        ap.error(str(e))
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        worker(args)
    else:
        driver(args, argv)


if __name__ == "__main__":
    main()
