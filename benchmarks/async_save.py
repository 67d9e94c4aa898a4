"""Training during a background checkpoint save: the Transformer's step time while `mm.save(...,
blocking=False)` writes its state, against a step with no save, in the same run.

Run (common.py fixes the BLAS environment by itself: one BLAS thread per rank):

    mpiexec -n N python benchmarks/async_save.py [--repeat 9] [--d-model 256 --layers 4 ...] [--dir DIR]

The step is `apps/transformer.py`'s, compiled with the parameters and optimizer state donated (as the
app runs it), on the app's default mesh and layout. The state saved is the app's checkpoint (parameters,
Adafactor's state, the data position) with `checkpoint.save_step(..., blocking=False)`, in DIR (default: a
temporary directory; a real disk is what fsync measures). Trials alternate: a plain step; or a save, then
steps until the save is committed (each of them "during a save"). Times are the slowest rank's.
- ratio: median step during a save / median plain step. Bar: at most 1.2.
- Beside it, for scale: the save call itself (what it stops training for: agreeing, copying the blocks,
  making the temporary directory) and a blocking save of the same state.
Ratios only: no verdict against absolute times from another machine.
"""
import common  # noqa: F401  (first: clean BLAS environment, may re-exec)

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

import mpimesh as mm
from common import WORLD, kernel_report, rank0_print, table, verdict
from mpimesh import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))
import transformer as T  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=9, help="trials of each kind")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    return ap.parse_args()


def main() -> None:
    args = parse()
    cfg = T.Config(d_model=args.d_model, d_ff=args.d_ff, layers=args.layers, batch=args.batch, length=args.length)
    mesh = mm.Mesh(T.default_mesh(WORLD.Get_size()), layout=T.PAPER_LAYOUT)
    train = T.load_corpus(None, 1 << 20, 0.1)[0]
    opt = T.make_optimizer(cfg)
    params = T.init_params(mesh, cfg, 0)
    state = T.init_state(cfg, opt, params)
    step_fn = mm.compile(T.make_train_step(cfg, opt), donate_argnums=(0, 1))
    batches = T.Batches(train, cfg, 0)
    root = WORLD.bcast(args.dir or tempfile.mkdtemp(prefix="mpimesh-async-bench-") if WORLD.rank == 0 else None)

    def step():
        nonlocal params, state
        batch = T.make_batch(mesh, train, cfg, batches.next())
        params, state, loss = step_fn(params, state, batch)
        float(loss)  # (the step's end: its loss on the host, as the app reads it)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def save(blocking: bool):
        return checkpoint.save_step(root, batches.position, T.checkpoint_tree(params, state, batches.state()),
                                    keep=2, blocking=blocking)

    for _ in range(3):  # warm up: the step is recorded, then replayed
        step()
    timed(lambda: save(True))
    plain, during, calls, blocking, overlapped = [], [], [], [], []
    for r in range(args.repeat):
        WORLD.Barrier()
        plain.append(timed(step))
        WORLD.Barrier()
        t0 = time.perf_counter()
        handle = save(False)
        calls.append(time.perf_counter() - t0)
        n = 0
        while True:  # steps until every rank's save is done (every rank runs as many: they are collectives)
            during.append(timed(step))
            n += 1
            if WORLD.allreduce(int(handle.done()), op=mm.MPI.MIN):
                break
        handle.wait()
        overlapped.append(n)
        WORLD.Barrier()
        blocking.append(timed(lambda: save(True)))
    most = lambda xs: WORLD.allreduce(max(xs), op=mm.MPI.MAX)  # noqa: E731
    def med(xs: list) -> float:
        """The median over trials of the slowest rank's time."""
        slowest = np.empty(len(xs))
        WORLD.Allreduce(np.array(xs), slowest, op=mm.MPI.MAX)
        return float(np.median(slowest))

    plain_s, during_s, call_s, blocking_s = med(plain), med(during), med(calls), med(blocking)
    ratio = during_s / plain_s
    size = sum(e.stat().st_size for e in os.scandir(checkpoint.step_path(root, batches.position - 1))) \
        if WORLD.rank == 0 else 0
    rank0_print(kernel_report())
    rank0_print(f"transformer d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.layers} layers, batch {cfg.batch}, length "
                f"{cfg.length}; mesh {mesh.shape}, layout {T.PAPER_LAYOUT!r}; checkpoint {size / 2**20:.1f} MiB "
                f"in {root}; {args.repeat} trials, {len(during)} steps during saves "
                f"({most(overlapped)} at most per save)")
    rank0_print(table(["what", "median ms", "x plain step"], [
        ["plain step", f"{plain_s * 1e3:.1f}", "1.00"],
        ["step during a background save", f"{during_s * 1e3:.1f}", f"{ratio:.2f}"],
        ["the save call (blocking=False)", f"{call_s * 1e3:.1f}", f"{call_s / plain_s:.2f}"],
        ["a blocking save", f"{blocking_s * 1e3:.1f}", f"{blocking_s / plain_s:.2f}"]]))
    rank0_print(verdict("step during a background save <= 1.2x a plain step", ratio <= 1.2, f"{ratio:.2f}x"))
    WORLD.Barrier()
    if WORLD.rank == 0 and not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
