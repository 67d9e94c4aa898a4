"""Spatially partitioned segmentation: a small fully convolutional network trained end to end on
large synthetic images whose height and width are split over a 2-D mesh.

The images are random discs and rectangles; the target is the mask blurred by a box filter and
thresholded, a local operation to learn. The network is `depth` 3x3 SAME convolutions with relu,
then a 3x3 convolution to one logit per pixel, trained with Adam on a sigmoid cross-entropy. Only
the input's layout is chosen (`--layout`): every activation stays split like it, any rank count and
image size work, and each convolution brings halos from its neighbours. More: docs/apps.md.

Run::

    mpiexec -n 4 python apps/segment.py                       # 2x2 mesh, 256x256 images, ~1 min
    mpiexec -n 3 python apps/segment.py --size 64 --steps 20  # 1x3 mesh, width in blocks 22, 21, 21
    python apps/segment.py --mesh "all:1" --layout ""          # one process, unsplit
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Dict, Tuple, Union

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import mpimesh as mm  # noqa: E402  (first: it sets BLAS threads per rank before numpy loads BLAS)
import numpy as np  # noqa: E402
from apps.cli import UsageError, check_at_least, check_layout, main_guard, parser  # noqa: E402
from mpimesh.layers.conv import conv2d, init_conv2d  # noqa: E402
from mpimesh.layers.core import flatten, unflatten  # noqa: E402

Params = Dict[str, "mm.DistTensor"]
IN_DIM, OUT_DIM = mm.Dimension("channels", 1), mm.Dimension("logit", 1)


# ------------------------------------------------------------------------------------ data

def _box_blur(a: np.ndarray, k: int) -> np.ndarray:
    """Mean over the k x k window centred on each pixel of the last two axes, zeros beyond edges."""
    r = k // 2
    p = np.pad(a.astype(np.float64), [(0, 0)] * (a.ndim - 2) + [(r + 1, r), (r + 1, r)])
    c = p.cumsum(-2).cumsum(-1)
    s = c[..., k:, k:] - c[..., :-k, k:] - c[..., k:, :-k] + c[..., :-k, :-k]
    return s / (k * k)


def draw_shapes(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A height x width boolean mask of random discs and axis-aligned rectangles (about one
    shape per 400 pixels, so the statistics are the same at every image size)."""
    mask = np.zeros((height, width), bool)
    for _ in range(max(1, height * width // 400)):
        cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
        if rng.random() < 0.5:
            r = int(rng.integers(1, 11))
            y0, y1, x0, x1 = max(cy - r, 0), min(cy + r + 1, height), max(cx - r, 0), min(cx + r + 1, width)
            yy, xx = np.ogrid[y0:y1, x0:x1]
            mask[y0:y1, x0:x1] |= (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
        else:
            h, w = rng.integers(1, 17, 2)
            mask[cy:cy + h, cx:cx + w] = True
    return mask


def make_batch(seed: int, batch: int, size: Union[int, Tuple[int, int]], blur: int = 5, noise: float = 0.0
               ) -> Tuple[np.ndarray, np.ndarray]:
    """Global `(images [batch, height, width, 1], targets [batch, height, width, 1])`, float32,
    from `seed` only (`size`: an int for square images, or (height, width)): the target is the
    box-blurred shape mask thresholded at 0.5."""
    height, width = (size, size) if isinstance(size, int) else size
    rng = np.random.default_rng(seed)
    masks = np.stack([draw_shapes(rng, height, width) for _ in range(batch)])
    target = _box_blur(masks, blur) > 0.5
    x = masks.astype(np.float32)
    if noise:
        x = x + noise * rng.standard_normal(x.shape).astype(np.float32)
    return x[..., None], target.astype(np.float32)[..., None]


def image_shape(batch: int, size: Union[int, Tuple[int, int]]) -> Tuple[mm.Shape, mm.Shape]:
    """The input's and the target's shapes: [batch, height, width, channels|logit]."""
    height, width = (size, size) if isinstance(size, int) else size
    sp = [mm.Dimension("batch", batch), mm.Dimension("height", height), mm.Dimension("width", width)]
    return mm.Shape(sp + [IN_DIM]), mm.Shape(sp + [OUT_DIM])


# ----------------------------------------------------------------------------------- model

def channel_dims(depth: int, width: int) -> list:
    """The channel dims between layers: the input's, `depth` hidden ones, the logit's."""
    return [IN_DIM] + [mm.Dimension(f"hidden{i}", width) for i in range(depth)] + [OUT_DIM]


def init_params(mesh: mm.Mesh, seed: int, depth: int = 3, width: int = 8) -> Params:
    """Flat `{"conv<i>/kernel", "conv<i>/bias"}` for depth+1 3x3 convolutions (He-scaled
    normal kernels from `seed`, zero biases): the same values on any mesh and layout."""
    dims = channel_dims(depth, width)
    tree = {}
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        std = math.sqrt((2.0 if i < depth else 1.0) / (9 * a.size))
        tree[f"conv{i}"] = init_conv2d(mesh, seed * 1000 + i, 3, 3, a, b, stddev=std)
    return flatten(tree)


def network(params: Params, x: "mm.DistTensor") -> "mm.DistTensor":
    """Per-pixel logits [batch, height, width, logit] of x [batch, height, width, channels]."""
    tree = unflatten(params)
    n = len(tree)
    for i in range(n):
        x = conv2d(tree[f"conv{i}"], x, activation="relu" if i < n - 1 else None)
    return x


def sigmoid_cross_entropy(logits: "mm.DistTensor", targets: "mm.DistTensor") -> "mm.DistTensor":
    """Mean over all elements of `relu(z) - z·t + log(1 + exp(-|z|))` (stable for any z)."""
    z = logits
    return mm.reduce_mean(mm.relu(z) - z * targets + mm.log(1.0 + mm.exp(-mm.abs(z))))


def pixel_accuracy(logits: "mm.DistTensor", targets: "mm.DistTensor") -> "mm.DistTensor":
    """Fraction of pixels where (logit > 0) equals the binary target (a 0-d tensor)."""
    pred = mm.cast(mm.greater(logits, 0.0), logits.dtype)
    return mm.reduce_mean(1.0 - mm.abs(pred - targets))


def loss_and_grads(params: Params, x: "mm.DistTensor", t: "mm.DistTensor"):
    """`(loss, accuracy, grads)`: the forward pass and `mm.gradients` in one trace."""
    with mm.trace():
        logits = network(params, x)
        loss = sigmoid_cross_entropy(logits, t)
        names = list(params)
        grads = dict(zip(names, mm.gradients([loss], [params[k] for k in names])))
    return loss, pixel_accuracy(logits, t), grads


def train_step(params: Params, opt, state, x, t):
    """One Adam step: `(params, state, loss, accuracy)` (loss and accuracy before the update)."""
    loss, acc, grads = loss_and_grads(params, x, t)
    params, state = opt.update(params, grads, state)
    return params, state, loss, acc


# ------------------------------------------------------------------------------------ main

def balanced_2d(n: int) -> str:
    """'rows:r;cols:c' with r*c = n, r <= c, as square as possible (rows:1 for a prime n).

    >>> balanced_2d(6), balanced_2d(7)
    ('rows:2;cols:3', 'rows:1;cols:7')
    """
    r = max(d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0)
    return f"rows:{r};cols:{n // r}"


DIMS = {"batch": "images per step (--batch)", "height": "image rows (--size)", "width": "image columns (--size)",
        "channels": "input channels (1)", "hidden0, hidden1, ...": "channels of each hidden layer (--width)",
        "logit": "output channels (1)", "fh, fw": "the 3x3 filters' taps"}


def model_dims(depth: int) -> dict:
    """The tensor dims of a network with `depth` hidden layers (what --layout may name)."""
    names = ["batch", "height", "width", "channels", "logit", "fh", "fw"] + [f"hidden{i}" for i in range(depth)]
    return dict.fromkeys(names, "")


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__.split("\n\n")[0], DIMS, "height:rows;width:cols")
    ap.add_argument("--mesh", default=None,
                    help="mesh shape (default: the squarest rows:r;cols:c with r*c = ranks, any rank count)")
    ap.add_argument("--layout", default="height:rows;width:cols", help="layout rules (the input's layout)")
    ap.add_argument("--size", type=int, default=256, help="image height and width (2048: benchmark size)")
    ap.add_argument("--batch", type=int, default=2, help="images per step")
    ap.add_argument("--depth", type=int, default=3, help="hidden conv layers (plus the logit layer)")
    ap.add_argument("--width", type=int, default=8, help="channels per hidden layer")
    ap.add_argument("--blur", type=int, default=5, help="box-blur window of the target (odd)")
    ap.add_argument("--noise", type=float, default=0.0, help="stddev of Gaussian noise on the input")
    ap.add_argument("--steps", type=int, default=100, help="training steps")
    ap.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    ap.add_argument("--print-every", type=int, default=10, help="steps between progress lines")
    ap.add_argument("--seed", type=int, default=0, help="seed of the data and the initial weights")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.blur < 1 or args.blur % 2 == 0:
        raise UsageError(f"--blur must be odd and positive, got {args.blur}")
    check_at_least(args, 1, "size", "batch", "depth", "width", "steps", "print_every")
    check_at_least(args, 0, "noise", "seed")
    check_layout(args.layout, model_dims(args.depth))
    world = mm.MPI.COMM_WORLD
    mesh = mm.Mesh(args.mesh or balanced_2d(world.Get_size()), layout=args.layout)
    say = print if mesh.rank == 0 else (lambda *a, **k: None)
    x_shape, t_shape = image_shape(args.batch, args.size)

    def batch(seed):
        x, t = make_batch(seed, args.batch, args.size, args.blur, args.noise)
        return mesh.from_numpy(x, x_shape), mesh.from_numpy(t, t_shape)

    params = init_params(mesh, args.seed, args.depth, args.width)
    opt = mm.optim.Adam(args.lr)
    state = opt.init(params)
    x, _ = batch(1)
    say(mm.threads.describe())
    say(f"mesh {mesh.shape} rules '{mesh.layout}' -> input {x.shape} layout {x.layout or 'replicated'}, "
        f"local slice {x.local.shape}; {sum(p.shape.size for p in params.values())} parameters")
    times = []
    for step in range(args.steps):
        x, t = batch(args.seed * 100003 + step + 1)
        world.Barrier()
        t0 = time.perf_counter()
        params, state, loss, acc = train_step(params, opt, state, x, t)
        times.append(time.perf_counter() - t0)
        if step % args.print_every == 0 or step == args.steps - 1:
            loss_v, acc_v = float(loss), float(acc)  # collective: every rank
            say(f"step {step:4d}  loss {loss_v:.4f}  pixel accuracy {acc_v:.4f}  ({times[-1] * 1e3:.0f} ms)",
                flush=True)

    # held-out images: the trained net against copying the input mask
    xv, tv = make_batch(10**9 + args.seed, args.batch, args.size, args.blur, args.noise)
    x, t = mesh.from_numpy(xv, x_shape), mesh.from_numpy(tv, t_shape)
    acc = float(pixel_accuracy(network(params, x), t))
    copy = float(np.mean((xv > 0.5) == (tv > 0.5)))
    say(f"held-out pixel accuracy {acc:.4f} (copying the input: {copy:.4f}, all background: "
        f"{1 - tv.mean():.4f})")
    with mm.profile() as prof:
        train_step(params, opt, state, x, t)
    comm = prof.transfers
    say(f"step time median {np.median(times[1:] or times) * 1e3:.1f} ms; one step on rank 0: "
        f"{prof.counters.get('flops', {}).get('flops', 0) / 1e9:.2f} GFLOP"
        + "".join(f", {k} {v['calls']} calls {v['bytes']} B" for k, v in sorted(comm.items())))


if __name__ == "__main__":
    main_guard(main)()  # errors in bad input: one line per job
