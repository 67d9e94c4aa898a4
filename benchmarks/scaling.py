"""Strong and weak scaling of a split einsum, the paper's two-layer MLP step and the Transformer step.

    python benchmarks/scaling.py                          # ranks 1,2,4, small sizes, a few minutes
    python benchmarks/scaling.py --ranks 1,2,4 --workloads einsum,mlp,transformer \\
        --layouts "data=batch:all" "model=hidden:all" "transformer/model=heads:all;d_ff:all;vocab:all" \\
        --mode strong,weak --out benchmarks/results
    python benchmarks/scaling.py --launcher "srun --mpi=pmix -n {n}" --ranks 8,16,32 --size paper

This driver (plain `python`, not under mpiexec) launches one MPI job per rank count with the
`--launcher` template (default: mpimesh.launch's `find_mpiexec()`, i.e. `<mpiexec> -n {n}`); each job
runs this file with the hidden `--worker FILE` flag, times every case and writes its results as JSON
from rank 0. The driver holds the benchmark lock of common.py while its jobs run (they skip it),
then writes `scaling.csv`, one PNG per workload and mode (`scaling_<workload>_<mode>.png`: step time
and efficiency against ranks, one line per layout) and prints a table.

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
import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections import Counter  # noqa: E402
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence  # noqa: E402

import numpy as np  # noqa: E402
from common import WORLD, fmt_bytes, kernel_report, rank0_print, table, timeit  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as app  # noqa: E402
import two_layer as tl  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.launch import find_mpiexec, job_env  # noqa: E402
from mpimesh.layout import plan_layout  # noqa: E402  (pure layout maths: the library's own checks)
from mpimesh.extras import require  # noqa: E402

BYTES_PER_ELEMENT = 4  # every workload is float32
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CSV_FIELDS = ["workload", "mode", "layout", "rules", "mesh", "ranks", "sizes", "step_ms_median", "step_ms_min",
              "speedup", "efficiency", "comm_bytes_measured", "comm_bytes_formula", "comm_match", "comm_calls",
              "formula", "gflop_per_rank", "loadavg", "blas_kernel", "bucket_bytes", "allreduce_calls",
              "exposed_comm_ms", "hidden_comm_ms"]


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
    checking layouts before launching), a builder of its step and its communication formula."""
    dims: Sequence[str]
    sizes: Dict[str, Dict[str, int]]
    presets: Dict[str, str]
    shapes: Callable[[Dict[str, int]], List[mm.Shape]]
    build: Callable[[mm.Mesh, Dict[str, int]], Callable[[], object]]
    formula: Callable[[mm.Mesh, str, Dict[str, int]], Formula]


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


def einsum_build(mesh: mm.Mesh, d: Dict[str, int]) -> Callable[[], object]:
    """y = x·w on `mesh` under the layout rules in force.

    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> einsum_build(mesh, {"batch": 4, "io": 2, "hidden": 3})().shape
    Shape('[batch:4, hidden:3]')
    """
    x_shape, w_shape, _ = einsum_shapes(d)
    x, w = mesh.random_normal(x_shape, seed=0), mesh.random_normal(w_shape, seed=1)
    return lambda: mm.einsum([x, w])


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


def mlp_build(mesh: mm.Mesh, d: Dict[str, int]) -> Callable[[], object]:
    """apps/two_layer.py's step (with the input gradient, as in Table 1) on fixed parameters."""
    s = _mlp_sizes(d)
    params, (x, target) = tl.init_params(mesh, s, seed=0), tl.make_data(mesh, s)
    lr = 4.0 / s.hidden.size  # two_layer.py's default
    return lambda: tl.train_step(params, x, target, lr, input_grad=True)


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


def transformer_build(mesh: mm.Mesh, d: Dict[str, int]) -> Callable[[], object]:
    """apps/transformer.py's training step on one fixed batch of random bytes; each call updates
    the parameters and the Adafactor state."""
    cfg = transformer_config(d)
    opt = app.make_optimizer(cfg)
    params = app.init_params(mesh, cfg)
    box = {"params": params, "state": opt.init(params)}
    train_step = app.make_train_step(cfg, opt)
    data = np.random.default_rng(1).integers(0, 256, size=1 << 16).astype(np.uint8)
    batch = app.make_batch(mesh, data, cfg, app.train_offsets(data, cfg, 0, 0))

    def step() -> None:
        box["params"], box["state"], _ = train_step(box["params"], box["state"], batch)
    return step


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
        einsum_shapes, einsum_build, einsum_formula),
    "mlp": Workload(
        ("batch", "io", "hidden"),
        {"tiny": dict(batch=16, io=8, hidden=32), "small": dict(batch=256, io=512, hidden=2048),
         "paper": dict(batch=512, io=1024, hidden=4096)},
        {"data": "batch:all", "model": "hidden:all", "2d": "batch:rows;hidden:cols"},
        mlp_shapes, mlp_build, mlp_formula),
    "transformer": Workload(
        TRANSFORMER_DIMS,
        {"tiny": dict(d_model=128, heads=8, d_kv=4, d_ff=256, layers=1, vocab=256, length=4, batch=8),
         "small": dict(d_model=256, heads=8, d_kv=32, d_ff=1024, layers=2, vocab=256, length=64, batch=16),
         "paper": dict(d_model=1024, heads=16, d_kv=64, d_ff=4096, layers=2, vocab=256, length=128, batch=8)},
        {"data": "batch:all", "model": "heads:all;d_ff:all;vocab:all", "2d": app.PAPER_LAYOUT},
        transformer_shapes, transformer_build, transformer_formula),
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


def parse_ranks(text: str) -> List[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, positive, distinct)."""
    try:
        ranks = sorted({int(s) for s in parse_list(text, "ranks")})
    except ValueError as e:
        raise UsageError(f"--ranks {text!r}: expected comma-separated integers") from e
    if ranks[0] < 1:
        raise UsageError(f"--ranks {text!r}: rank counts must be >= 1")
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
    saved = mm.buckets.bucket_bytes()
    mm.set_bucket_bytes(saved if case.bucket_bytes is None else case.bucket_bytes)
    try:
        with mm.layout_scope(mesh, case.rules):
            step = wl.build(mesh, case.sizes)
            c0 = timer.seconds
            with mm.profile() as prof:
                step()
            blocked = timer.seconds - c0
            t_min, t_med = timeit(step, repeat=repeat, warmup=warmup, comm=mesh.comm_for(mesh.shape.names))
    finally:
        mm.set_bucket_bytes(saved)
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


_TIMERS: Dict[int, "app.CommTimer"] = {}  # one per mesh: it wraps the mesh's collectives once


def worker(args: argparse.Namespace) -> None:
    """Run every case for this job's rank count; rank 0 prints progress and writes the JSON."""
    n = WORLD.Get_size()
    cases = plan_cases(args, n)
    rank0_print(f"--- {n} rank(s): {len(cases)} cases\n{kernel_report()}")
    meshes: Dict[str, mm.Mesh] = {}
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


def launch(args: argparse.Namespace, argv: Sequence[str], n: int, out: str) -> None:
    """Run this script's worker on `n` ranks with the launcher template; SystemExit if it fails."""
    cmd = shlex.split(args.launcher.replace("{n}", str(n))) + \
        [sys.executable, os.path.abspath(__file__), *argv, "--worker", out]
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


def add_scaling(rows: List[dict]) -> None:
    """Speedup and efficiency of each row against the smallest rank count of its workload, mode
    and layout (medians).

    >>> rows = [{"workload": "w", "mode": "strong", "layout": "l", "ranks": n, "step_ms_median": t}
    ...         for n, t in ((1, 10.0), (2, 5.0), (4, 4.0))]
    >>> add_scaling(rows); [(r["speedup"], r["efficiency"]) for r in rows]
    [(1.0, 1.0), (2.0, 1.0), (2.5, 0.625)]
    """
    base: Dict[tuple, dict] = {}
    for r in sorted(rows, key=lambda r: r["ranks"]):
        b = base.setdefault((r["workload"], r["mode"], r["layout"]), r)
        ratio, scale = b["step_ms_median"] / r["step_ms_median"], r["ranks"] / b["ranks"]
        r["speedup"], r["efficiency"] = (ratio, ratio / scale) if r["mode"] == "strong" else (ratio * scale, ratio)


def write_csv(rows: List[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else "" if v is None else v) for k, v in r.items()})


def plot(rows: List[dict], out: str, size: str) -> List[str]:
    """One PNG per workload and mode: step time and efficiency against ranks, a line per layout."""
    matplotlib = require("matplotlib", "bench", "benchmarks/scaling.py's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter

    paths = []
    for workload, mode in dict.fromkeys((r["workload"], r["mode"]) for r in rows):
        fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(11, 4.2))
        group = sorted((r for r in rows if (r["workload"], r["mode"]) == (workload, mode)), key=lambda r: r["ranks"])
        ranks = sorted({r["ranks"] for r in group})
        for i, layout in enumerate(dict.fromkeys(r["layout"] for r in group)):
            pts = sorted((r["ranks"], r["step_ms_median"], r["efficiency"], r["step_ms_min"], r) for r in group
                         if r["layout"] == layout)
            n, t, e, t_min = (np.array([p[k] for p in pts]) for k in range(4))
            last, colour = pts[-1][4], f"C{i}"
            ax_t.plot(n, t, "o-", color=colour, label=f"{layout} ({last['rules']}): comm "
                      f"{fmt_bytes(last['comm_bytes_measured'])}/rank at {last['ranks']} ranks")
            ax_t.fill_between(n, t_min, t, color=colour, alpha=0.15, lw=0)
            ideal = t[0] * n[0] / n if mode == "strong" else np.full(len(n), t[0])
            ax_t.plot(n, ideal, ":", color=colour, alpha=0.6)
            ax_e.plot(n, e, "o-", color=colour, label=layout)
        ax_e.axhline(1.0, color="grey", ls=":", lw=1)
        ax_t.set_title("median step time (band: down to the min; dotted: ideal)", fontsize=9)
        ax_e.set_title(f"{mode} scaling efficiency against {ranks[0]} rank{'s' * (ranks[0] > 1)}", fontsize=9)
        for ax, label in ((ax_t, "step time (ms)"), (ax_e, "parallel efficiency")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ranks, [str(n) for n in ranks])
            ax.set_xlabel("MPI ranks")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.yaxis.set_major_formatter(LogFormatter())
        ax_t.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        ax_e.set_ylim(bottom=0)
        ax_t.legend(fontsize=8)
        sizes = group[0]["sizes"] if mode == "strong" else group[0]["sizes"] + " at the smallest rank count"
        load = [float(r["loadavg"].split()[0]) for r in group]
        fig.suptitle(f"{workload}: {mode} scaling, {size} sizes, 1-min load average {min(load):.1f}-{max(load):.1f}"
                     f"\n{sizes}", fontsize=10)
        fig.tight_layout()
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


def driver(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Run one job per rank count with cases (`args.plans`, checked), write the CSV and PNGs."""
    print(kernel_report(), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpimesh-scaling-") as tmp:
        for k in range(args.rounds):
            for n in (n for n, cases in args.plans.items() if cases):
                out = os.path.join(tmp, f"round{k}-ranks{n}.json")
                launch(args, argv, n, out)
                with open(out) as f:
                    rows += json.load(f)["results"]
    rows = best_rounds(rows)
    add_scaling(rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "scaling.csv")
    write_csv(rows, path)
    pngs = plot(rows, args.out, args.size)
    print("\n" + report(rows))
    print(f"\nwrote {path} and {len(pngs)} plots: {', '.join(os.path.basename(p) for p in pngs)}")


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
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
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
            args.plans = {n: plan_cases(args, n, skipped) for n in args.ranks}
            if not any(args.plans.values()):
                raise UsageError("--skip-unfit left no case to run:\n  " + "\n  ".join(skipped))
            for reason in skipped:
                print(f"skipped: {reason}", flush=True)
    except (UsageError, FileNotFoundError, mm.MpimeshError) as e:
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
