"""The layout search: `auto_layout` prices candidate rules with the cost model, `LayoutPlan` holds the result.

A candidate assigns some tensor dims of the recorded step to mesh dims of size > 1 (a tensor dim
at most once; a mesh dim at most once per tensor of the step, as a layout needs; a tensor dim
only to a mesh dim no larger than it, so no block is empty; sizes need not divide). Each is priced
by running the step again dry under it (`mpimesh.cost.record`: kernels repeated across candidates
are traced once). Where the candidates number at most `exact_limit`, all are priced (exact);
otherwise a beam search starts from the replicated layout and moves one tensor dim at a time,
keeping the `beam` best (not two that differ only by swapping mesh dims of equal size), until no
move helps. Plans over `memory_per_rank` are left out; among equal times the plan with fewer
uneven splits wins (then fewer rules). Where none fits, the search runs again with the weights sharded
over each mesh dim of size > 1 and over all (`record`'s `weights`), the fastest that fits winning; then
with one more `mm.remat` block rematerialised at a time. More: docs/weight_sharding.md.
"""
from __future__ import annotations

import itertools
import math
import numbers
import weakref
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from ..backend import as_dtype, is_float
from ..errors import MpimeshError
from ..layout import LayoutRules
from ..mesh import AbstractMesh
from ..remat import remat_policy
from .cache import calibrated
from .machine import Machine, number
from ..tree import flatten, is_tensor
from .model import ArgSpec, Recording, check_step, estimate, record, weight_positions
from .pipeline import bubble, pipeline_estimate, stage_step

_calibrated: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # mesh -> {dtype: Machine}


def compute_dtype(args) -> str:
    """The float dtype a step on `args` computes in, for its calibration: that of the most float
    elements among the tensors (DistTensors or ArgSpecs) in `args`; float32 where there are none.

    >>> from mpimesh.cost import ArgSpec
    >>> compute_dtype((ArgSpec("a:1000", "bfloat16"), ArgSpec("b:10", "float32"), ArgSpec("c:5000", "int32")))
    'bfloat16'
    """
    count: dict = {}
    for t in flatten(args)[0]:
        if not (is_tensor(t) or isinstance(t, ArgSpec)):
            continue
        dt = as_dtype(t.dtype)
        if is_float(dt):
            count[str(dt)] = count.get(str(dt), 0) + t.shape.size
    return max(count, key=count.get) if count else "float32"


@dataclass(frozen=True)
class LayoutPlan:
    """The result of `mm.auto_layout`."""

    rules: str
    """The fastest rules that fit the memory limit, as a rules string: `"batch:rows;hidden:cols"`
    (`""`: everything replicated)."""
    seconds: float
    """The predicted step time of `rules`, in seconds."""
    bytes_per_rank: int
    """The predicted memory per rank of `rules`, in bytes."""
    candidates: list
    """`[(rules, seconds, bytes_per_rank)]` of the priced rules that fit, fastest first (the first is `rules`,
    with its `plan_label`). A plan with weights sharded is named by `plan_label`: its rules and
    `" | shard_weights <mesh dims>"`, `"batch:x | shard_weights x"`."""
    too_big: list
    """`[(rules, seconds, bytes_per_rank)]` of the priced rules over the memory limit, smallest first
    (named like `candidates`)."""
    machine: Machine
    """The `Machine` the rules were priced on."""
    recording: Recording
    """The step recorded replicated (no rules; with the plan's weights sharded, `Recording.weights`),
    for `estimate` under other rules."""
    exact: bool
    """Whether every candidate was priced (else a beam search)."""
    remat: int = 0
    """How many of the step's `mm.remat` blocks the plan rematerialises: the first `remat` calls
    (run the step inside `mpimesh.remat.remat_policy(lambda k: k < plan.remat)`). 0, unless no
    layout fits the memory without: then the fewest that let one fit."""
    shard_weights: Optional[str] = None
    """The mesh dims (`"x"`, `"rows+cols"`) over which the plan shards the weights: run the step on
    `mm.shard_weights(a, plan.shard_weights)` for each weight argument `a` (`auto_layout`'s
    `weight_args`; the optimizer state made from sharded parameters is sharded alike). None, unless
    no rules fit the memory without: see the module."""
    pipeline: Optional[dict] = None
    """How the plan pipelines (`auto_layout`'s `pipeline`), or None: `{"mesh_dim", "schedule", "microbatches",
    "virtual_stages", "remat", "bubble", "why"}`, `why` "the fastest plan" or "the only plan that fits".
    Run the stages as `mm.pipeline_value_and_grad` (or `mm.pipeline`) does over `mesh_dim` under `rules`,
    which split the stage dim over it; `recording` is then one stage's run on a microbatch."""

    def report(self, top: int = 5) -> str:
        """The chosen rules and the next `top` alternatives (not those that only swap mesh dims
        of equal size with one shown), with predicted times and memory."""
        lines = [f"layout search ({'exact' if self.exact else 'beam'}, {len(self.candidates) + len(self.too_big)} "
                 f"candidates priced on {self.machine.name or 'the given machine'}):"]
        if self.shard_weights:
            lines.append(f"  memory is short: weights sharded over {self.shard_weights} "
                         f"(mm.shard_weights; gathered before use, gradients reduce-scattered)")
        if self.remat:
            lines.append(f"  memory is short: the first {self.remat} mm.remat block(s) rematerialised "
                         f"(their activations recomputed in the backward pass)")
        if self.pipeline:
            p = self.pipeline
            v = f", {p['virtual_stages']} virtual stages" if p["virtual_stages"] > 1 else ""
            lines.append(f"  {p['why']}: a pipeline over {p['mesh_dim']} ({p['schedule']}, {p['microbatches']} "
                         f"microbatches{v}" + (", remat" if p["remat"] else "") + f"; bubble {p['bubble']:.1%})")
        shown: set = set()
        for label, s, b in self.candidates:
            rules, weights = split_label(label)
            sig = (_signature(dict(LayoutRules(rules).pairs), self.recording.mesh_shape, weights),
                   label.partition(_PIPELINED)[2])
            if sig in shown:
                continue
            mark = "chosen" if not shown else f"  #{len(shown) + 1} "
            shown.add(sig)
            lines.append(f"  {mark} {s * 1e3:9.2f} ms  {b / 2**20:9.2f} MiB/rank  {label or '(replicated)'!s}")
            if len(shown) > top:
                break
        return "\n".join(lines)


def plan_label(rules: str, weights: Optional[str]) -> str:
    """A priced plan's name in `LayoutPlan.candidates`: its rules, then `" | shard_weights <mesh dims>"`
    where it shards the weights (`split_label` reads it back).

    >>> plan_label("batch:x", "x"), plan_label("", "x"), plan_label("batch:x", None)
    ('batch:x | shard_weights x', '| shard_weights x', 'batch:x')
    """
    return f"{rules} {_SHARDED}{weights}".lstrip() if weights else rules


def split_label(label: str) -> tuple:
    """`(rules, weights or None)` of a `plan_label` (or of a `pipeline_label`: its rules, None).

    >>> split_label('batch:x | shard_weights x'), split_label('hidden:x'), split_label('stage:x | pipeline x (1f1b)')
    (('batch:x', 'x'), ('hidden:x', None), ('stage:x', None))
    """
    rules, _, weights = label.partition(_PIPELINED)[0].partition(_SHARDED)
    return rules.strip(), weights.strip() or None


def pipeline_label(rules: str, pipeline: dict) -> str:
    """A priced pipeline's name in `LayoutPlan.candidates`: its rules, then `" | pipeline <mesh dim> (...)"`.

    >>> pipeline_label("stage:x", {"mesh_dim": "x", "schedule": "1f1b", "microbatches": 8, "virtual_stages": 1})
    'stage:x | pipeline x (1f1b, 8 microbatches)'
    """
    v = pipeline["virtual_stages"]
    return (f"{rules} {_PIPELINED}{pipeline['mesh_dim']} ({pipeline['schedule']}, {pipeline['microbatches']} "
            f"microbatches{f', {v} virtual stages' if v > 1 else ''})")


_SHARDED = "| shard_weights "
_PIPELINED = "| pipeline "


def _rules_string(assign: dict, order: list) -> str:
    return ";".join(f"{d}:{assign[d]}" for d in order if assign.get(d))


def _signature(assign: dict, mesh_shape, weights: Optional[str] = None) -> tuple:
    """What a plan is up to renaming mesh dims of equal size (its twins price alike, or nearly);
    `weights`: the mesh dims it shards the weights over."""
    groups: dict = {}
    for d, m in list(assign.items()) + [("| weights", m) for m in (weights.split("+") if weights else ())]:
        groups.setdefault(m, []).append(d)
    return tuple(sorted((mesh_shape[m].size, tuple(sorted(ds))) for m, ds in groups.items()))


def auto_layout(fn, args, mesh, memory_per_rank: Optional[float] = None, machine: Optional[Machine] = None,
                *, exact_limit: int = 256, beam: int = 2, weight_args: Optional[Sequence[int]] = None,
                pipeline: Optional[dict] = None) -> LayoutPlan:
    """Choose layout rules for `fn(*args)` on `mesh` with the cost model: a collective, every rank must call
    and gets the same plan (candidates priced dry, shared out over the ranks: `fn` must not read values).
    `machine`: default the mesh's calibration; `memory_per_rank`: bytes (default the machine's; `math.inf`:
    none); `exact_limit`, `beam`: see the module. If no rules fit, the weights at `weight_args` (default: the
    dicts) are sharded (`.shard_weights`), then `mm.remat` blocks rematerialised (`.remat`). `pipeline`: the
    model as stages, `pipeline_estimate`'s arguments in a dict (`.pipeline`). docs/cost_model.md.

    >>> import mpimesh as mm
    >>> from mpimesh.dryrun import DryMesh
    >>> m = mm.cost.Machine(flops=1e9, latency=1e-4, bandwidth=1e8, memory=2**30)
    >>> step = lambda x, w: mm.reduce_sum(mm.relu(mm.einsum([x, w])))
    >>> args = (mm.cost.ArgSpec("batch:64;io:32", "float32"), mm.cost.ArgSpec("io:32;hidden:1024", "float32"))
    >>> auto_layout(step, args, DryMesh("x:4"), machine=m).rules
    'hidden:x'
    """
    check_step("auto_layout", fn, args)
    if not isinstance(mesh, AbstractMesh):
        raise TypeError(f"auto_layout: mesh must be a Mesh or a DryMesh (mpimesh.dryrun.DryMesh('x:4') for a shape "
                        f"alone), got {mesh!r:.60} ({type(mesh).__name__})")
    if machine is not None and not isinstance(machine, Machine):
        raise TypeError(f"auto_layout: machine must be a mm.cost.Machine (mm.cost.TPUV2, TPUV3, "
                        f"H100_NVLINK, or calibrate(mesh)) or None (this mesh's calibration), got {machine!r:.60} "
                        f"({type(machine).__name__})")
    if memory_per_rank is not None:
        memory_per_rank = number("auto_layout: memory_per_rank (bytes, or None: the machine's memory)",
                                 memory_per_rank, True, infinite=True)
    for name, value, low in (("exact_limit", exact_limit, 0), ("beam", beam, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"auto_layout: {name} must be an int, got {value!r} ({type(value).__name__})")
        if value < low:
            raise MpimeshError(f"auto_layout: {name} must be >= {low}, got {value!r}")
    if machine is None:
        if getattr(mesh, "dry", False) or not hasattr(mesh, "comm_for"):
            raise MpimeshError(f"auto_layout on {mesh!r} (no processors) needs machine=... (mm.cost.TPUV2, ...)")
        dtype = compute_dtype(args)
        machine = _calibrated.setdefault(mesh, {}).get(dtype)
        if machine is None:
            machine = _calibrated[mesh][dtype] = calibrated(mesh, dtype=dtype)
    limit = machine.memory if memory_per_rank is None else memory_per_rank
    if pipeline is None:
        return _unpipelined(fn, args, mesh, machine, limit, exact_limit, beam, weight_args)
    plans, over = _pipelined(pipeline, mesh, machine, limit, exact_limit, beam)
    try:
        plans.append(_unpipelined(fn, args, mesh, machine, limit, exact_limit, beam, weight_args))
        why = "the fastest plan"
    except MpimeshError as e:
        if not plans:
            smallest = min(over, key=lambda c: c[2])
            raise MpimeshError(f"{e}; nor does a pipeline: the smallest needs {smallest[2]:.0f} "
                               f"({smallest[0]})") from None
        why = "the only plan that fits"
    best = _best(plans, over)
    return best if best.pipeline is None else replace(best, pipeline=dict(best.pipeline, why=why))


def _unpipelined(fn, args, mesh, machine: Machine, limit: float, exact_limit: int, beam: int,
                 weight_args) -> LayoutPlan:
    """`auto_layout` without pipelines: the rules, then weight sharding, then remat (see the module)."""
    positions = weight_positions(args, weight_args)
    calls: list = []
    with remat_policy(lambda k: calls.append(k) or False):
        record(fn, args, mesh.shape, "", weight_args=positions)
    big = [d.name for d in mesh.shape if d.size > 1]
    sharding = (big + ["+".join(big)] * (len(big) > 1)) if _has_weights(args, positions) else []
    for k in range(len(calls) + 1):  # the fewest remat blocks that let a layout fit
        run = _rematerialising(fn, k)
        try:
            return _search(run, args, mesh, machine, limit, exact_limit, beam, k, "", positions)
        except _TooBig as e:
            short = [e]
        plans = []
        for weights in sharding:  # weight sharding only where no rules fit without
            try:
                plans.append(_search(run, args, mesh, machine, limit, exact_limit, beam, k, weights, positions))
            except _TooBig as e:
                short.append(e)
        if plans:
            return _best(plans, [c for e in short for c in e.too_big])
        if k == len(calls):
            raise MpimeshError(str(short[0]) + "".join(f"; with weights sharded over {e.weights}, {e.smallest}"
                                                          for e in short[1:])) from None


class _TooBig(MpimeshError):
    def __init__(self, message: str, weights: str, smallest: str, too_big: list):
        super().__init__(message)
        self.weights, self.smallest, self.too_big = weights, smallest, too_big


def _has_weights(args, positions: tuple) -> bool:
    """Whether the arguments at `positions` hold a float tensor (DistTensor or ArgSpec)."""
    return any((is_tensor(t) or isinstance(t, ArgSpec)) and is_float(as_dtype(t.dtype))
               for i in positions for t in flatten(args[i])[0])


_PIPELINE_KEYS = {"stage_fn", "stage_params", "x", "microbatches", "loss_fn", "targets", "schedule", "virtual_stages",
                  "remat", "batch_dim", "stage_dim", "mesh_dims"}


def _pipelined(spec, mesh, machine: Machine, limit: float, exact_limit: int, beam: int) -> tuple:
    """`(plans, over)`: per mesh dim, schedule and microbatch count of `spec` (`auto_layout`'s `pipeline`),
    the fastest rules within the stage (`ranked` over the stage mesh) that fit `limit`, as a `LayoutPlan`;
    and the pipelines priced over `limit`."""
    if not isinstance(spec, dict) or not {"stage_fn", "stage_params", "x", "microbatches"} <= set(spec) \
            or set(spec) - _PIPELINE_KEYS:
        raise TypeError(f"auto_layout: pipeline must be a dict with stage_fn, stage_params, x and microbatches, and "
                        f"optionally {', '.join(sorted(_PIPELINE_KEYS - {'stage_fn', 'stage_params', 'x'}))}; got "
                        f"{spec!r:.100}")
    kw = {k: spec[k] for k in ("loss_fn", "targets", "remat", "batch_dim") if k in spec}
    stage_dim, virtual = spec.get("stage_dim", "stage"), spec.get("virtual_stages", 1)
    counts = [spec["microbatches"]] if isinstance(spec["microbatches"], int) else list(spec["microbatches"])
    schedules = [spec.get("schedule")] if not isinstance(spec.get("schedule"), (list, tuple)) else spec["schedule"]
    sizes = {t.shape[stage_dim].size for t in flatten(spec["stage_params"])[0]
             if (is_tensor(t) or isinstance(t, ArgSpec)) and stage_dim in t.shape.names}
    dims = spec.get("mesh_dims") or [d.name for d in mesh.shape if d.size > 1 and {d.size * virtual} == sizes]
    if not dims:
        raise MpimeshError(f"auto_layout: no mesh dim of {mesh.shape} has the stages' count: stage dim "
                           f"{stage_dim!r} of stage_params has size(s) {sorted(sizes)}, virtual_stages {virtual}")
    plans, over = [], []
    for mesh_dim in dims:
        for schedule in schedules:
            for m in counts:
                base, sub = stage_step(spec["stage_fn"], spec["stage_params"], spec["x"], mesh.shape, mesh_dim, m,
                                       schedule=schedule, virtual_stages=virtual, stage_dim=stage_dim, **kw)

                def staged(rules: str, mesh_dim=mesh_dim) -> str:
                    return ";".join(r for r in (rules, f"{stage_dim}:{mesh_dim}") if r)

                def price(rules: str, mesh_dim=mesh_dim, schedule=schedule, m=m) -> tuple:
                    e = pipeline_estimate(spec["stage_fn"], spec["stage_params"], spec["x"], mesh.shape, mesh_dim, m,
                                          machine, rules=staged(rules), schedule=schedule, virtual_stages=virtual,
                                          stage_dim=stage_dim, **kw)
                    return e["seconds"], e["bytes_per_rank"]
                fits, too_big, exact = ranked(base, sub, _comm(mesh), price, limit, exact_limit, beam)
                info = {"mesh_dim": mesh_dim, "schedule": schedule or ("1f1b" if "loss_fn" in kw else "gpipe"),
                        "microbatches": m, "virtual_stages": virtual, "remat": bool(kw.get("remat")),
                        "bubble": bubble(mesh.shape[mesh_dim].size, m, virtual)}
                over += [(pipeline_label(staged(r), info), s, b) for r, s, b in too_big]
                if fits:
                    plans.append(LayoutPlan(staged(fits[0][0]), fits[0][1], int(fits[0][2]),
                                            [(pipeline_label(staged(r), info), s, b) for r, s, b in fits], [], machine,
                                            base, exact, pipeline=info))
    return plans, over


def _best(plans: list, too_big: list) -> LayoutPlan:
    """The fastest of the plans of one `_search` each (with weights sharded over different mesh dims),
    fewer sharded mesh dims on a tie; their candidates merged, with `too_big` (the other searches')."""
    best = min(plans, key=lambda p: (p.seconds, (p.shard_weights or "").count("+")))
    fits = sorted((c for p in plans for c in p.candidates), key=lambda c: (c[1], c[0].count("+")))
    fits.remove(best.candidates[0])
    too_big = sorted(too_big + [c for p in plans for c in p.too_big], key=lambda c: c[2])
    return replace(best, candidates=[best.candidates[0]] + fits, too_big=too_big,
                   exact=all(p.exact for p in plans))


def _rematerialising(fn, k: int):
    """`fn` with its first `k` `mm.remat` calls rematerialised, the others plain calls."""
    def run(*args):
        with remat_policy(lambda j: j < k):
            return fn(*args)
    return run


def _search(fn, args, mesh, machine: Machine, limit: float, exact_limit: int, beam: int, remat: int,
            weights: str, positions: tuple) -> LayoutPlan:
    """`auto_layout`'s search for `fn` as it is, with `weights` sharded (see `record`); `_TooBig`
    where no layout fits `limit`."""
    base = record(fn, args, mesh.shape, "", weights=weights, weight_args=positions)

    def price(rules: str) -> tuple:
        e = estimate(base, rules, mesh.shape, machine)
        return e["seconds"], e["bytes_per_rank"]
    fits, over, exact = ranked(base, mesh.shape, _comm(mesh), price, limit, exact_limit, beam)
    fits = [(plan_label(r, weights), s, b) for r, s, b in fits]
    over = [(plan_label(r, weights), s, b) for r, s, b in over]
    if not fits:
        r, s, b = min(over, key=lambda p: p[2])
        smallest = f"the smallest needs {b:.0f} ({r or 'replicated'!s}); {len(over)} layouts priced"
        raise _TooBig(f"auto_layout: no layout priced fits {limit:.0f} bytes per rank on mesh {mesh.shape}: "
                      f"{smallest}" + (f", with {remat} mm.remat block(s) rematerialised" if remat else ""),
                      weights, smallest, over)
    label, seconds, nbytes = fits[0]
    return LayoutPlan(split_label(label)[0], seconds, int(nbytes), fits, over, machine, base, exact, remat,
                      weights or None)


def _comm(mesh):
    """The communicator over which `ranked` shares out its pricing: `mesh`'s, or None (one rank, or dry)."""
    return mesh.comm_for(mesh.shape.names) if hasattr(mesh, "comm_for") and mesh.size > 1 else None


def ranked(base: Recording, mesh_shape, comm, price, limit: float, exact_limit: int, beam: int) -> tuple:
    """`(fits, over, exact)`: the rules for the step of `base` (recorded replicated) on `mesh_shape`, each
    `(rules, seconds, bytes_per_rank)` by `price(rules)`, those within `limit` fastest first, the others
    smallest first; `exact`: all priced (else a beam search; see the module). `comm`: None, or the
    communicator whose ranks share out the pricing (every one calls, all get all prices)."""
    order = list(base.dims)
    mdims = [d for d in mesh_shape if d.size > 1]
    options = {d: [None] + [m.name for m in mdims if base.dims[d] >= m.size] for d in order}
    order = [d for d in order if len(options[d]) > 1]
    shapes = [[d for d in s if d in options] for s in base.shapes]

    def valid(assign: dict) -> bool:
        for s in shapes:
            used = [assign[d] for d in s if assign.get(d)]
            if len(used) != len(set(used)):
                return False
        return True

    priced: dict[str, tuple] = {}
    failed: dict[str, str] = {}

    def price_all(assigns: list) -> None:
        """Price the new ones among `assigns`, shared out over the ranks of `comm` (each prices every
        size-th; all get all prices)."""
        todo = {}
        for a in assigns:
            r = _rules_string(a, order)
            if r not in priced and r not in failed:
                todo[r] = a
        mine = list(todo.items())[comm.Get_rank()::comm.Get_size()] if comm is not None else list(todo.items())
        out = []
        for rules, assign in mine:
            try:
                seconds, nbytes = price(rules)
            except MpimeshError as err:  # a layout some op cannot run: not a candidate
                out.append((rules, None, str(err), 0))
                continue
            uneven = sum(base.dims[d] % mesh_shape[m].size != 0 for d, m in assign.items() if m)
            out.append((rules, seconds, nbytes, uneven))
        for p in (sum(comm.allgather(out), []) if comm is not None else out):
            if p[1] is None:
                failed[p[0]] = p[2]
            else:
                priced[p[0]] = p

    def score(p: tuple) -> tuple:
        rules, s, b, uneven = p
        return (0, s, uneven, rules.count(":")) if b <= limit else (1, b, s, rules)

    space = math.prod(len(options[d]) for d in order)
    exact = space <= exact_limit
    if exact:
        everything = [dict((d, m) for d, m in zip(order, choice) if m)
                      for choice in itertools.product(*[options[d] for d in order])]
        price_all([a for a in everything if valid(a)])
    else:
        frontier = [{}]
        price_all([{}])
        while True:
            pool = {_rules_string(a, order): a for a in frontier}
            for st in frontier:
                for d in order:
                    for m in options[d]:
                        if m == st.get(d):
                            continue
                        new = {k: v for k, v in st.items() if k != d}
                        if m:
                            new[d] = m
                        if valid(new):
                            pool[_rules_string(new, order)] = new
            price_all(list(pool.values()))
            pool = {r: a for r, a in pool.items() if r in priced}
            best, twins = [], set()
            for r in sorted(pool, key=lambda r: score(priced[r])):
                sig = _signature(pool[r], mesh_shape)
                if sig not in twins and len(best) < beam:
                    best.append(r)
                    twins.add(sig)
            if set(best) == {_rules_string(a, order) for a in frontier}:
                break
            frontier = [pool[r] for r in best]
    if not priced:
        raise MpimeshError(f"auto_layout: no layout of the step could be priced; the first error: "
                           f"{next(iter(failed.values()))}")
    ranked_ = sorted(priced.values(), key=score)
    return ([(r, s, b) for r, s, b, _ in ranked_ if b <= limit], [(r, s, b) for r, s, b, _ in ranked_ if b > limit],
            exact)
