"""`apps/transformer.py --pipeline MESH_DIM`: the Transformer's blocks as pipeline stages over a mesh dim.

    mpiexec -n 4 python apps/transformer.py --pipeline rows --microbatches 4      # mesh rows:2;cols:2
    mpiexec -n 2 python apps/transformer.py --mesh stages:2 --pipeline stages --layers 4 --schedule interleaved \
        --virtual-stages 2

The blocks are stacked into S*V stage entries (S: MESH_DIM's size, V: --virtual-stages; `mm.stack_layers`)
and run by `mm.pipeline_value_and_grad`. The embedding runs before it data-parallel over MESH_DIM (the batch
split over it, as in GSPMD's example), its gradient taken from the pipeline's dx by `mm.gradients`; the
head (final norm, logits, softmax cross-entropy) runs on the last stage, one microbatch at a time (1F1B
needs each microbatch's loss as it leaves the pipeline). The optimizer updates each block's tensors as the
unpipelined app does, so the losses are the unpipelined run's; checkpoints hold the blocks per layer
(`mm.unstack_stages`), so --resume goes either way. Steps run op by op (not `mm.compile`d).
"""
from __future__ import annotations

import argparse
import re
from typing import Callable, NamedTuple, Optional

import numpy as np

import mpimesh as mm
from apps.cli import UsageError
from mpimesh import layers
from mpimesh.pipeline import last_run, microbatch, stage_mesh
from mpimesh.pipeline_schedules import SCHEDULES
from mpimesh.stages import from_entries, stage_entries

LAYER = re.compile(r"layer(\d+)/(.+)")  # a block's tensor, per layer
STACKED = re.compile(r"stages/(\d+)/(.+)")  # a block's tensor, stacked: stages/<place in its entry>/<its name>
STAGES = "stages/"


class Pipe(NamedTuple):
    """--pipeline's settings."""
    mesh_dim: str
    microbatches: int
    schedule: str
    virtual: int

    def stages(self, mesh: mm.Mesh) -> int:
        return mesh.shape[self.mesh_dim].size

    def per_entry(self, mesh: mm.Mesh, cfg) -> int:
        """P: the blocks in each of the S*V stage entries."""
        return cfg.layers // (self.stages(mesh) * self.virtual)

    def theory(self, mesh: mm.Mesh) -> float:
        """The bubble (S-1)/(M+S-1), divided by V when interleaved."""
        S = self.stages(mesh)
        return (S - 1) / (self.microbatches + S - 1) / self.virtual


class Model(NamedTuple):
    """The Transformer's parts (apps/transformer.py's): `embed(p, inputs, cfg)` the residual stream,
    `block(b, x, cfg, i, train, seed, capacity)` block i `(x, aux or None)`, `head(p, x)` the logits."""
    embed: Callable
    block: Callable
    head: Callable


def add_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pipeline", default=None, metavar="MESH_DIM", help="run the blocks as pipeline stages over "
                    "MESH_DIM (mm.pipeline_value_and_grad; the embedding data-parallel over it, the head on the last "
                    "stage); checkpoints stay per layer, so --resume works with and without it")
    ap.add_argument("--microbatches", type=int, default=4, help="--pipeline: microbatches per step")
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="--pipeline: the schedule")
    ap.add_argument("--virtual-stages", dest="virtual_stages", type=int, default=1,
                    help="--pipeline with --schedule interleaved: stages per rank (V)")


def check_flags(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What --pipeline needs and refuses, from the flags alone (one line from rank 0, exit status 2)."""
    named = [f for f, default in (("--microbatches", 4), ("--schedule", "1f1b"), ("--virtual-stages", 1))
             if getattr(args, f[2:].replace("-", "_")) != default]
    if not args.pipeline:
        if named:
            ap.error(f"{', '.join(named)} need --pipeline MESH_DIM")
        return
    if args.microbatches < 1 or args.virtual_stages < 1:
        ap.error(f"--microbatches {args.microbatches}, --virtual-stages {args.virtual_stages}: each must be at least 1")
    if args.virtual_stages > 1 and args.schedule != "interleaved":
        ap.error(f"--virtual-stages {args.virtual_stages} needs --schedule interleaved (got {args.schedule})")
    refused = {"--backend jax": args.backend == "jax", "--layout auto": args.layout == "auto",
               "--shard-weights": bool(args.shard_weights), "--dtype float16": args.dtype == "float16"}
    for flag, given in refused.items():
        if given:
            ap.error(f"--pipeline does not run with {flag} (yet)")


def from_args(args: argparse.Namespace) -> Optional[Pipe]:
    return Pipe(args.pipeline, args.microbatches, args.schedule, args.virtual_stages) if args.pipeline else None


def check(pipe: Pipe, mesh: mm.Mesh, cfg) -> None:
    """The pipeline against the mesh and the model: a UsageError naming the sizes (every rank alike)."""
    if pipe.mesh_dim not in mesh.shape.names:
        raise UsageError(f"--pipeline {pipe.mesh_dim!r}: mesh {mesh.shape} has no such dim")
    S, V = pipe.stages(mesh), pipe.virtual
    if cfg.layers % (S * V):
        raise UsageError(f"--pipeline {pipe.mesh_dim}: --layers {cfg.layers} do not fill {S * V} stages evenly "
                         f"({pipe.mesh_dim}:{S} x --virtual-stages {V}): give a multiple of {S * V}")
    if pipe.microbatches > cfg.batch:
        raise UsageError(f"--microbatches {pipe.microbatches} exceeds --batch {cfg.batch}")
    P = pipe.per_entry(mesh, cfg)
    odd = [i for i in range(cfg.layers) if cfg.is_moe(i) != cfg.is_moe(i % P)]
    if odd:
        raise UsageError(f"--moe-every {cfg.moe_every} with {P} block(s) a stage ({cfg.layers} layers over {S * V} "
                         f"stages) puts mixtures of experts at other places in different stages (layer {odd[0]}); "
                         f"every stage must hold the same kinds of blocks: --moe-every must divide {P}")


def outside_rules(mesh: mm.Mesh, mesh_dim: str) -> mm.LayoutRules:
    """The rules outside the pipeline: the mesh's, with the batch over `mesh_dim` (data parallelism)."""
    pairs = [(d, m) for d, m in mesh.rules.pairs if d != "batch" and m != mesh_dim]
    return mm.LayoutRules([("batch", mesh_dim)] + pairs)


# ------------------------------------------------------------------ per-layer names <-> stage-stacked

def _grouped(flat: dict, count: int, pattern: re.Pattern) -> tuple:
    """`(groups, rest)`: `count` dicts of the tensors whose name `pattern` matches, by its (group, name
    within it), and a dict of the others."""
    groups, rest = [{} for _ in range(count)], {}
    for name, t in flat.items():
        m = pattern.fullmatch(name)
        if m:
            groups[int(m[1])][m[2]] = t
        else:
            rest[name] = t
    return groups, rest


def to_stages(flat: dict, pipe: Pipe, mesh: mm.Mesh, cfg) -> dict:
    """A flat dict of the app's names (`layer3/att/q/kernel`, ...) with its blocks' tensors stacked
    into stage entries, named `stages/<j>/att/q/kernel` (j: the block's place in its entry)."""
    per, out = _grouped(flat, cfg.layers, LAYER)
    if any(per):
        for j, tree in enumerate(mm.stack_layers(per, pipe.mesh_dim, pipe.virtual)):
            out.update({f"{STAGES}{j}/{k}": t for k, t in tree.items()})
    return out


def from_stages(flat: dict, pipe: Pipe, mesh: mm.Mesh, cfg) -> dict:
    """`to_stages` undone: every block's tensors per layer again (each broadcast from its stage)."""
    stacked, out = _grouped(flat, pipe.per_entry(mesh, cfg), STACKED)
    if any(stacked):
        for i, tree in enumerate(mm.unstack_stages(stacked, pipe.mesh_dim, pipe.virtual)):
            out.update({f"layer{i}/{k}": t for k, t in tree.items()})
    return out


def state_to_stages(state: dict, pipe: Pipe, mesh: mm.Mesh, cfg, back: bool = False) -> dict:
    """An optimizer state's slots through `to_stages` (`back`: `from_stages`); the step as it is."""
    convert = from_stages if back else to_stages
    return {k: convert(v, pipe, mesh, cfg) if isinstance(v, dict) else v for k, v in state.items()}


# ------------------------------------------------------------------------------------- the step

def _seed_entries(seed, pipe: Pipe, mesh: mm.Mesh):
    """A seed tensor as an int64 tensor with a stage dim (it rides in the stage parameters to the stage
    meshes); an int seed as it is."""
    if not hasattr(seed, "tensor_layout"):
        return seed
    K = pipe.stages(mesh) * pipe.virtual
    return mesh.from_numpy(np.full(K, int(seed.to_numpy()), np.int64), f"stage:{K}", f"stage:{pipe.mesh_dim}")


def value_and_grad(params: dict, batch: dict, cfg, pipe: Pipe, model: Model, seed=0) -> tuple:
    """`(loss, grads)` of the training loss (as the app's `loss_fn` with `train=True`) for the stage-stacked
    `params` (`to_stages`), grads named as params."""
    mesh = batch["inputs"].mesh
    p = layers.unflatten(params)
    P = pipe.per_entry(mesh, cfg)
    seeds = _seed_entries(seed, pipe, mesh)
    stage_params = {"blocks": p["stages"]} if isinstance(seeds, int) else {"blocks": p["stages"], "seed": seeds}

    def stage_fn(q, h):
        mb = microbatch()
        aux = None
        for j in range(P):
            i = mb.position * P + j
            h, a = model.block(q["blocks"][str(j)], h, cfg, i, True, q.get("seed", seeds),
                               {"draws": (mb.start, mb.total)}, remat=i < cfg.remat)
            if a is not None:
                a = a * (mb.size / mb.total)  # the block's aux is a mean over the microbatch's sequences
                aux = a if aux is None else aux + a
        return h, aux

    def head_loss(h, t, head):
        ce = layers.softmax_cross_entropy_with_logits(model.head(head, h), t, "vocab")
        return mm.reduce_sum(ce) * (1.0 / (cfg.batch * cfg.length))

    with mm.trace():
        with mm.layout_scope(mesh, outside_rules(mesh, pipe.mesh_dim)):
            x = model.embed(p, batch["inputs"], cfg)
        inside = {d: m for d, m in mesh.tensor_layout(x.shape).items() if m != pipe.mesh_dim}
        x_in = mm.relayout(x, inside)
        head = {"ln_f": p["ln_f"], "logits": p["logits"]}
        loss, sgrads, dx, hgrads = mm.pipeline_value_and_grad(
            stage_fn, head_loss, stage_params, x_in, batch["targets"], pipe.mesh_dim, pipe.microbatches,
            schedule=pipe.schedule, virtual_stages=pipe.virtual, loss_params=head)
        outer = [n for n in params if n.split("/")[0] in ("embed", "pos")]
        got = mm.gradients([x_in], [params[n] for n in outer], [dx])
    grads = dict(zip(outer, got))
    grads.update(layers.flatten(hgrads))
    grads.update({f"{STAGES}{k}": g for k, g in layers.flatten(sgrads["blocks"]).items()})
    return loss, {n: grads[n] for n in params}


def update(optimizer, params: dict, grads: dict, state: dict, pipe: Pipe) -> tuple:
    """`optimizer.update` as the unpipelined app applies it: the stage-stacked tensors updated entry by
    entry, each a tensor of its stage mesh (`stage_entries`), so that per-tensor statistics (Adafactor's
    RMS and factored moments) are each layer's own."""
    whole = [n for n in params if not n.startswith(STAGES)]
    stacked = [n for n in params if n.startswith(STAGES)]
    pick = (lambda names, d: {n: d[n] for n in names if n in d})
    new_p, new_s = optimizer.update(pick(whole, params), pick(whole, grads),
                                    {k: pick(whole, v) if isinstance(v, dict) else v for k, v in state.items()})
    if stacked:
        mesh = params[stacked[0]].mesh
        sub = stage_mesh(mesh, pipe.mesh_dim)

        def views(d: dict) -> dict:
            return {f"{n}#{v}": e for n in stacked if n in d for v, e in enumerate(stage_entries(d[n], pipe.mesh_dim))}
        step = mm.from_local(state["step"].local, (), sub)
        with mm.layout_scope(sub, mesh.layout):
            vp, vs = optimizer.update(views(params), views(grads),
                                      {k: views(v) if isinstance(v, dict) else step for k, v in state.items()})
        V = params[stacked[0]].local.shape[0]
        for n in stacked:
            new_p[n] = from_entries([vp[f"{n}#{v}"] for v in range(V)], params[n])
            for k, slot in state.items():
                if isinstance(slot, dict) and n in slot:
                    new_s[k][n] = from_entries([vs[k][f"{n}#{v}"] for v in range(V)], slot[n])
    return {n: new_p[n] for n in params}, new_s


def make_train_step(cfg, optimizer, pipe: Pipe, model: Model) -> Callable:
    """`train_step(params, opt_state, batch, seed=0) -> (params, opt_state, loss)` on stage-stacked params
    and state (`to_stages`, `state_to_stages`), as the app's `make_train_step` on per-layer ones."""
    def train_step(params: dict, opt_state: dict, batch: dict, seed=0):
        loss, grads = value_and_grad(params, batch, cfg, pipe, model, seed)
        params, opt_state = update(optimizer, params, grads, opt_state, pipe)
        return params, opt_state, loss
    return train_step


# --------------------------------------------------------------------------------------- the bubble

def banner(pipe: Pipe, mesh: mm.Mesh, cfg) -> str:
    """The banner's line for --pipeline."""
    S, V, P = pipe.stages(mesh), pipe.virtual, pipe.per_entry(mesh, cfg)
    return (f"pipeline over {pipe.mesh_dim}: {S} stages{f' x {V} virtual' if V > 1 else ''}, {P} block(s) each, "
            f"{pipe.microbatches} microbatches, schedule {pipe.schedule}; embedding data-parallel over "
            f"{pipe.mesh_dim}, the head on the last stage; steps run op by op")


def measured_share() -> float:
    """This rank's share of its last pipeline op spent in the transfers between stages (its bubble)."""
    return last_run["in_transfers"] / last_run["seconds"] if last_run.get("seconds") else 0.0


def bubble_line(pipe: Pipe, mesh: mm.Mesh, shares: list) -> str:
    """The measured bubble (the mean over ranks and steps, the first left out where there are more)
    beside the theory; a collective over the mesh's ranks."""
    kept = shares[1:] if len(shares) > 1 else shares
    mine = float(np.mean(kept)) if kept else 0.0
    mean = mesh.comm_for(mesh.shape.names).allreduce(mine) / mesh.size if mesh.size > 1 else mine
    S, V, M = pipe.stages(mesh), pipe.virtual, pipe.microbatches
    formula = f"(S-1)/(M+S-1){'/V' if V > 1 else ''}"
    return (f"pipeline over {pipe.mesh_dim}: {S} stages{f' x {V} virtual' if V > 1 else ''}, {M} microbatches, "
            f"{pipe.schedule}: bubble measured {100 * mean:.1f}% (time in the transfers between stages, mean of "
            f"the ranks over steps {len(shares) - len(kept) + 1}-{len(shares)}), theory {formula} = "
            f"{100 * pipe.theory(mesh):.1f}%")
