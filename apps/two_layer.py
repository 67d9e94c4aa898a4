"""The Mesh-TensorFlow paper's two-layer example (section 8), one SGD step under five layouts

y = relu(x·w + bias)·v, trained by plain SGD towards a random "teacher" net of the same shape,
written with mpimesh's public API (its backward pass `mm.gradients`). For each layout of the paper
(`[]`, `batch:all`, `hidden:all`, `batch:rows;hidden:cols`, `batch:rows;hidden:cols;io:planes`) it
profiles one step and prints the elements each processor fed to allreduces beside the paper's
Table 1 formula, then the median time of a few more steps and the loss. Meshes use all ranks (the
most balanced factorisations). More: docs/apps.md.

Run::

    mpiexec -n 4 python apps/two_layer.py
    python -m mpimesh.launch -n 4 apps/two_layer.py --layouts "hidden:all" "batch:rows;hidden:cols"
"""
from __future__ import annotations

import itertools
import math
import os
import statistics
import sys
import time
from typing import Dict, NamedTuple, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import mpimesh as mm  # noqa: E402
from apps.cli import UsageError, check_at_least, check_layout, main_guard, parser  # noqa: E402

MESH_DIMS = ("all", "rows", "cols", "planes")  # the dims of mesh_shape_for's meshes
LAYOUTS = ["", "batch:all", "hidden:all", "batch:rows;hidden:cols", "batch:rows;hidden:cols;io:planes"]
Params = Dict[str, "mm.DistTensor"]


class Sizes(NamedTuple):
    """The model's dims."""
    batch: mm.Dimension
    io: mm.Dimension
    hidden: mm.Dimension

    @classmethod
    def of(cls, batch: int, d_io: int, d_hidden: int) -> "Sizes":
        return cls(mm.Dimension("batch", batch), mm.Dimension("io", d_io), mm.Dimension("hidden", d_hidden))


class Step(NamedTuple):
    """What one training step returns: the updated parameters, the gradients (keys w, bias, v,
    and x when the input gradient is computed) and the output y (before the update)."""
    params: Params
    grads: Params
    y: "mm.DistTensor"


# ---------------------------------------------------------------- the model and its step

def init_params(mesh: mm.Mesh, s: Sizes, seed: int) -> Params:
    """w, bias, v from `seed`, N(0, 1/fan_in) (bias N(0, 0.1²)); the values depend on the seed only."""
    return {"w": mesh.random_normal([s.io, s.hidden], seed, stddev=1 / math.sqrt(s.io.size)),
            "bias": mesh.random_normal([s.hidden], seed + 1, stddev=0.1),
            "v": mesh.random_normal([s.hidden, s.io], seed + 2, stddev=1 / math.sqrt(s.hidden.size))}


def make_data(mesh: mm.Mesh, s: Sizes, seed: int = 100):
    """A fixed input batch x and its regression target: the output of a random teacher net."""
    x = mesh.random_normal([s.batch, s.io], seed)
    y, _ = forward(init_params(mesh, s, seed + 1), x)
    return x, y


def forward(params: Params, x):
    """y = relu(x·w + bias)·v; also returns what the backward pass needs: (h_pre, h)."""
    h_pre = mm.einsum([x, params["w"]]) + params["bias"]   # [batch, hidden]
    h = mm.relu(h_pre)
    y = mm.einsum([h, params["v"]])                         # [batch, io]
    return y, (h_pre, h)


def loss_grad(y, target):
    """d loss / dy for loss = 0.5·sum((y - target)²)/batch."""
    return (y - target) * (1.0 / y.shape["batch"].size)


def backward(params: Params, x, y, dy, input_grad: bool = True) -> Params:
    """Gradients of w, bias, v (and x) by `mm.gradients` over the step's open trace.

    The loss gradient `dy` enters as y's cotangent (`grad_ys`): dy pulled back through the forward
    pass, with no scalar reduction (so the counted allreduces are Table 1's).
    """
    names = ["w", "bias", "v"] + (["x"] if input_grad else [])
    xs = [params[n] for n in names[:3]] + ([x] if input_grad else [])
    return dict(zip(names, mm.gradients([y], xs, grad_ys=[dy])))


def sgd(params: Params, grads: Params, lr: float) -> Params:
    """p - lr·g for each parameter (`mm.axpy`: one array and one pass over memory less than `p - g * lr`)."""
    return {k: mm.axpy(-lr, grads[k], p) for k, p in params.items()}


def train_step(params: Params, x, target, lr: float, input_grad: bool = True) -> Step:
    """Forward, loss gradient, backward, SGD update."""
    with mm.trace():
        y, _ = forward(params, x)
        grads = backward(params, x, y, loss_grad(y, target), input_grad)
        return Step(sgd(params, grads, lr), grads, y)


def loss_value(y, target) -> float:
    """0.5·sum((y - target)²)/batch, on every rank (for printing; outside the step)."""
    return float(mm.reduce_sum(mm.square(y - target))) * 0.5 / y.shape["batch"].size


# ---------------------------------------------------------------- meshes and Table 1

def balanced(n: int, k: int) -> list[int]:
    """The most balanced factorisation of n into k factors, ascending (4, 3 -> [1, 2, 2])."""
    best = None
    for f in itertools.product([d for d in range(1, n + 1) if n % d == 0], repeat=k):
        if math.prod(f) == n:
            key = (max(f), sorted(f, reverse=True))
            if best is None or key < best[0]:
                best = (key, sorted(f))
    return best[1]


def mesh_shape_for(rules: str, n: int) -> str:
    """The mesh a layout runs on: 3-D if it names `planes`, 2-D if `rows`/`cols`, else `all:n`."""
    used = {m for _, m in mm.LayoutRules(rules).pairs}
    if "planes" in used:
        return "rows:{};cols:{};planes:{}".format(*balanced(n, 3))
    if used & {"rows", "cols"}:
        return "rows:{};cols:{}".format(*balanced(n, 2))
    return f"all:{n}"


def check_mesh_dims(rules: str) -> None:
    """Refuse rules naming a mesh dim that `mesh_shape_for` does not make, or `all` beside the others."""
    used = {m for _, m in mm.LayoutRules(rules).pairs}
    unknown = sorted(used - set(MESH_DIMS))
    if unknown:
        raise UsageError(f"--layouts {rules!r} names mesh dim {', '.join(map(repr, unknown))}, which this app's "
                         f"meshes do not have; their dims are all (1-D), rows, cols (2-D) and planes (3-D)")
    if "all" in used and len(used) > 1:
        raise UsageError(f"--layouts {rules!r} names 'all' (the 1-D mesh all:N) beside "
                         f"{', '.join(sorted(used - {'all'}))} (2-D and 3-D meshes): use rows, cols and planes")


def _split(mesh: mm.Mesh, rules: mm.LayoutRules, dim: str) -> tuple[Optional[str], int]:
    m = rules.mesh_dim(dim)
    return m, (mesh.shape[m].size if m else 1)


def expected_allreduces(mesh: mm.Mesh, rules, s: Sizes, input_grad: bool = True) -> Dict[str, int]:
    """Elements each processor allreduces in one step, per collective key, derived from the step.

    Each einsum allreduces its local output over the mesh dim of its split reduced dim: with batch
    split r ways (mesh dim R), hidden c ways (C) and io p ways (P), x·w and dy·v over P (b·d_h/(r·c)
    each), h·v and dx over C (b·d_io/(r·p)), dv, dbias and dw over R (d_h·d_io/(c·p), d_h/c,
    d_io·d_h/(p·c)); elementwise ops need none and a mesh dim of size 1 counts nothing. This gives the
    paper's Table 1 rows. Where a split is uneven, each quotient is rank 0's block size, rounded up
    (`_first`). The derivation written out: docs/apps.md."""
    rules = mm.LayoutRules(rules)
    b, dio, dh = s.batch.size, s.io.size, s.hidden.size
    (rm, r), (cm, c), (pm, p) = (_split(mesh, rules, d) for d in ("batch", "hidden", "io"))
    out: Dict[str, int] = {}
    if p > 1:
        out[f"allreduce/{pm}"] = 2 * _first(b, r) * _first(dh, c)
    if c > 1:
        out[f"allreduce/{cm}"] = (2 if input_grad else 1) * _first(b, r) * _first(dio, p)
    if r > 1:
        out[f"allreduce/{rm}"] = 2 * _first(dio, p) * _first(dh, c) + _first(dh, c)
    return out


def _first(n: int, k: int) -> int:
    """The size of the first block of a dim of size n split k ways: n/k where k divides n, else
    rounded up (rank 0's, whose counters the app prints)."""
    return -(-n // k)


def table1_formula(mesh: mm.Mesh, rules, input_grad: bool = True) -> str:
    """The formula of `expected_allreduces` in symbols, for the dims this layout splits."""
    rules = mm.LayoutRules(rules)
    sym = {"batch": "r", "hidden": "c", "io": "p"}
    split = {d: rules.mesh_dim(d) is not None for d in sym}

    def term(coef: str, num: str, dims: Sequence[str]) -> str:
        den = [sym[d] for d in dims if split[d]]
        return coef + num + ("" if not den else "/" + den[0] if len(den) == 1 else "/(" + "·".join(den) + ")")
    terms = []
    if split["io"]:
        terms.append(term("2·", "b·d_h", ["batch", "hidden"]))
    if split["hidden"]:
        terms.append(term("2·" if input_grad else "", "b·d_io", ["batch", "io"]))
    if split["batch"]:
        terms += [term("2·", "d_io·d_h", ["io", "hidden"]), term("", "d_h", ["hidden"])]
    return " + ".join(terms) or "0"


def measured_elements(prof) -> tuple[int, Dict[str, dict]]:
    """Allreduced (plus allgathered/alltoall'd) elements of a profile, and those counter entries."""
    comm = {k: v for k, v in prof.counters.items() if k.split("/")[0] in ("allreduce", "allgather", "alltoall")}
    return sum(v["elements"] for v in comm.values()), comm


# ---------------------------------------------------------------- the demo

def run_layout(rules: str, s: Sizes, args, comm_size: int, asked: bool = False) -> None:
    """One profiled step, then `args.steps` timed steps, under `rules`; rank 0 prints. Rules the
    mesh cannot take are skipped, or refused where the user `asked` for them (--layouts)."""
    shape = mesh_shape_for(rules, comm_size)
    mesh = mm.Mesh(shape)
    say = print if mesh.rank == 0 else (lambda *a, **k: None)
    name = rules or "[]"
    say(f"\n== layout {name}   mesh {shape}")
    try:
        with mm.layout_scope(mesh, rules):
            mesh.plan(mm.Shape(list(s)))  # mesh dims known, each used once
    except mm.LayoutError as e:
        if asked:
            raise UsageError(f"--layouts {rules!r}: {e}") from None
        say(f"   skipped: {e}")
        return
    with mm.layout_scope(mesh, rules):
        params = init_params(mesh, s, args.seed)
        x, target = make_data(mesh, s)
        with mm.profile() as prof:
            step = train_step(params, x, target, args.lr, args.input_grad)
        losses = [loss_value(step.y, target)]
        params = step.params
        times = []
        for _ in range(args.steps):
            mesh.barrier()
            t0 = time.perf_counter()
            step = train_step(params, x, target, args.lr, args.input_grad)
            mesh.barrier()
            times.append(time.perf_counter() - t0)
            losses.append(loss_value(step.y, target))
            params = step.params
        losses.append(loss_value(forward(params, x)[0], target))
    total, comm = measured_elements(prof)
    expected = sum(expected_allreduces(mesh, rules, s, args.input_grad).values())
    detail = "; ".join(f"{k} {v['elements']:,} in {v['calls']} calls" for k, v in sorted(comm.items()))
    split = [(sym, s_.size, mesh.shape[m].size) for sym, s_ in (("r", s.batch), ("c", s.hidden), ("p", s.io))
             for m in [mm.LayoutRules(rules).mesh_dim(s_.name)] if m]
    sizes = ", ".join(f"{sym}={k}" for sym, _, k in split) + (
        "; uneven: rank 0's blocks, rounded up" if any(n % k for _, n, k in split) else "")
    say(f"   allreduced elements per processor, one step: {total:,} measured"
        + (f"  [{detail}]" if detail else ""))
    say(f"   Table 1: {table1_formula(mesh, rules, args.input_grad)} = {expected:,}"
        + (f"  ({sizes})" if sizes else "") + ("   MATCH" if total == expected else "   MISMATCH"))
    idle = [f"{m}:1" for _, m in mm.LayoutRules(rules).pairs if mesh.shape[m].size == 1]
    if idle and mesh.size > 1:
        say(f"   (terms reduced over {', '.join(idle)} are 0: a mesh dim of size 1 sends nothing)")
    others = [k for k in comm if not k.startswith("allreduce/")]
    say(f"   allgather/alltoall: {', '.join(others) if others else 'none'}")
    if times:
        say(f"   step time: median {1e3 * statistics.median(times):.1f} ms over {len(times)} steps")
    say("   loss: " + " -> ".join(f"{v:.4g}" for v in losses))


DIMS = {"batch": "examples per step (--batch)", "io": "input and output features (--d-io)",
        "hidden": "the hidden layer's units (--d-hidden)"}


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = parser(__doc__.split("\n")[0] + ", each timed; rank 0 prints.", DIMS, "batch:rows;hidden:cols",
               mesh="all:N, or rows:r;cols:c and rows:r;cols:c;planes:p\n  for rules that name those dims")
    p.add_argument("--batch", type=int, default=256, help="examples per step")
    p.add_argument("--d-io", type=int, default=512, help="input and output features")
    p.add_argument("--d-hidden", type=int, default=2048, help="hidden units")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the profiled one")
    p.add_argument("--lr", type=float, default=None, help="SGD learning rate (default: 4/d_hidden)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initial weights")
    p.add_argument("--layouts", nargs="+", default=None, metavar="RULES",
                   help='a subset of the layouts, e.g. "[]" "batch:rows;hidden:cols" (default: the paper\'s five)')
    p.add_argument("--no-input-grad", dest="input_grad", action="store_false",
                   help="skip the input gradient dx (a first layer needs none)")
    args = p.parse_args(argv)
    layouts = LAYOUTS if args.layouts is None else ["" if r.strip() in ("[]", "") else r for r in args.layouts]
    for rules in layouts:
        check_layout(rules, DIMS, "--layouts")
        check_mesh_dims(rules)
    check_at_least(args, 1, "batch", "d_io", "d_hidden")
    check_at_least(args, 0, "steps")
    args.lr = 4.0 / args.d_hidden if args.lr is None else args.lr
    check_at_least(args, 0, "lr", above=True)
    s = Sizes.of(args.batch, args.d_io, args.d_hidden)
    n = mm.MPI.COMM_WORLD.Get_size()
    if mm.MPI.COMM_WORLD.Get_rank() == 0:
        print(f"two-layer net y = relu(x·w + bias)·v: b={s.batch.size} d_io={s.io.size} d_h={s.hidden.size}, "
              f"float32, {n} ranks, lr={args.lr:g}, input gradient {'on' if args.input_grad else 'off'}\n"
              f"{mm.threads.describe()}")
    for rules in layouts:
        run_layout(rules, s, args, n, asked=args.layouts is not None)


if __name__ == "__main__":
    main_guard(main)()  # errors in bad input: one line per job
