"""Peers: the paper's MLP step in Mesh-TensorFlow, JAX and mpimesh (eager, compiled), in one run.

Run (plainly, not under mpiexec: it starts each part as a job or process of its own):

    python benchmarks/peers.py [--repeat N] [--ranks 2] [--peers-python /tmp/peers-venv/bin/python]

Mesh-TensorFlow needs a virtual environment of its own (mesh-tensorflow 0.1.21 imports
`tf.estimator`, which TensorFlow dropped after 2.15; that TensorFlow wants numpy < 2):

    python3 -m venv /tmp/peers-venv
    /tmp/peers-venv/bin/pip install "tensorflow-cpu==2.15.1" mesh-tensorflow threadpoolctl

Without it (no python at `--peers-python`), the others run and Mesh-TensorFlow is reported as not run.

The step is benchmarks/mlp_step.py's: b=512, d_io=1024, d_h=4096 by default, float32; forward
y = relu(x·w + bias)·v, the gradients of w, bias and v of 0.5·sum((y - t)²)/b, SGD at 1e-4; the
same global step on the same number of cores, data-parallel (batch split over N), model-parallel
(hidden split over N) and on 1 core:
  * mpimesh: `mpiexec -n N`, one process per rank, one BLAS thread each, apps/two_layer.py's
    `train_step` (`input_grad=False`) eager, and compiled (`mm.compile`, parameters donated);
    the 1-core case is a job of 1 rank.
  * JAX: one process with N host devices (`--xla_force_host_platform_device_count=N`, each op on
    one thread: `--xla_cpu_multi_thread_eigen=false`), the step `jax.jit`ted with `NamedSharding`s
    (batch or hidden over the mesh axis), parameters donated.
  * Mesh-TensorFlow: one process, TF1 graph mode (`tf.compat.v1`), its placement mesh
    implementation on N CPU devices of that process (`device_count={"CPU": N}`, one thread per op,
    N ops at once), the parameters, x and t variables sliced onto the devices. On CPU Mesh-TF can
    only simulate N processors inside one TensorFlow runtime (its other implementation, SIMD, is
    for TPUs): its collectives are tensors handed between devices of one process (add_n, concat),
    not messages between processes. TensorFlow 2.15 lacks `ops.register_tensor_conversion_function`,
    which mesh-tensorflow calls at import: this script puts the same function back under that name.
JAX and Mesh-TF processes are pinned to N cores (1 for the 1-core case).

Each part times, interleaved with its steps, the same reference: the step's five local matmuls
(numpy into preallocated arrays, per-rank shapes), on each of the N cores at once (mpimesh: on
every rank; JAX and Mesh-TF: N threads of that process, numpy releasing the GIL). Each step's
ratio is over its own part's reference, measured in the same process in the same run; medians of
--repeat runs (a run's time is the slowest rank's). No verdicts: published peer figures come from
other machines, and only ratios carry over.
"""
from __future__ import annotations

import sys

_PART = sys.argv[sys.argv.index("--part") + 1] if "--part" in sys.argv[:-1] else None
if _PART in (None, "mpimesh"):  # the Mesh-TF part runs in another venv, without mpi4py or mpimesh
    import common  # noqa: F401  (first: clean BLAS environment, may re-exec; the driver takes the lock)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from typing import Callable, Dict, List, Tuple  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LR = 1e-4  # mlp_step.py's: repeated steps on one batch must not drift into huge or denormal values
MARK = "PEERS_JSON "  # a part's result line
SETUP = 'python3 -m venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install "tensorflow-cpu==2.15.1" mesh-tensorflow'


def modes(n: int) -> List[Tuple[str, str]]:
    """(mode, the split tensor dim or "") on n cores."""
    return [("data-parallel", "batch"), ("model-parallel", "hidden")] if n > 1 else [("1 core", "")]


def local_sizes(split: str, n: int, b: int, dh: int) -> Tuple[int, int]:
    """This rank's batch and hidden sizes (the sizes divide n here)."""
    return (b // n if split == "batch" else b), (dh // n if split == "hidden" else dh)


def local_matmuls(b: int, dio: int, dh: int) -> Callable[[], None]:
    """The step's five local matmuls (forward x·w, h·v; backward hᵀ·dy, dy·vᵀ, xᵀ·dh) into
    preallocated arrays: one rank's local compute alone (mlp_step.py's reference)."""
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((b, dio), np.float32), rng.standard_normal((b, dio), np.float32)
    w, v = rng.standard_normal((dio, dh), np.float32), rng.standard_normal((dh, dio), np.float32)
    h, y, dv, dw, dhb = (np.empty(s, np.float32) for s in ((b, dh), (b, dio), (dh, dio), (dio, dh), (b, dh)))

    def run() -> None:
        np.matmul(x, w, out=h)
        np.matmul(h, v, out=y)
        np.matmul(h.T, dy, out=dv)
        np.matmul(dy, v.T, out=dhb)
        np.matmul(x.T, dhb, out=dw)
    return run


def on_cores(n: int, b: int, dio: int, dh: int) -> Callable[[], None]:
    """`local_matmuls` on n threads at once (numpy releases the GIL in matmul)."""
    runs = [local_matmuls(b, dio, dh) for _ in range(n)]
    if n == 1:
        return runs[0]
    pool = ThreadPoolExecutor(n)
    return lambda: list(pool.map(lambda f: f(), runs))


def interleaved(fns: Dict[str, Callable[[], None]], repeat: int, warmup: int = 2) -> Dict[str, Tuple[float, float]]:
    """(min, median) seconds of each function, run by run in alternating order (one process)."""
    names = list(fns)
    for _ in range(warmup):
        for k in names:
            fns[k]()
    times: Dict[str, list] = {k: [] for k in names}
    for r in range(repeat):
        for k in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: (min(v), statistics.median(v)) for k, v in times.items()}


def pin(n: int) -> None:
    """Run this process on n cores only."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:n])


# ---------------------------------------------------------------------------------------- parts

def part_mpimesh(args) -> dict:
    """Every mode on this job's ranks: the reference, the eager step and the compiled one."""
    from mpi4py import MPI  # (the Mesh-TF part's venv has neither mpi4py nor mpimesh)
    import mpimesh as mm
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "apps"))
    import two_layer as tl

    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    s = tl.Sizes.of(args.batch, args.d_io, args.d_hidden)
    out = {}
    for mode, split in modes(n):
        mesh = mm.Mesh(f"all:{n}")
        with mm.layout_scope(mesh, f"{split}:all" if split else ""):
            params = tl.init_params(mesh, s, seed=0)
            x, target = tl.make_data(mesh, s)
            step = mm.compile(lambda p, x, t: tl.train_step(p, x, t, LR, input_grad=False), donate_argnums=0)
            state = {k: v * 1.0 for k, v in params.items()}  # (its own: the eager step keeps `params`)

            def compiled() -> None:
                state.update(step(dict(state), x, target).params)
            lb, lh = local_sizes(split, n, args.batch, args.d_hidden)
            fns = {"reference": local_matmuls(lb, args.d_io, lh),
                   "mpimesh eager": lambda: tl.train_step(params, x, target, LR, input_grad=False),
                   "mpimesh compiled": compiled}
            out[mode] = common.compare(fns, repeat=args.repeat, warmup=2, comm=comm)
    return {"report": common.kernel_report(), "times": out}


def part_jax(args) -> dict:
    """Every mode on this process's host devices (XLA_FLAGS set by the driver)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    n = args.cores
    pin(n)
    mesh = Mesh(np.array(jax.devices()[:n]), ("all",))
    b, dio, dh = args.batch, args.d_io, args.d_hidden

    def step(p, x, t):
        def loss(p):
            y = jax.nn.relu(x @ p["w"] + p["bias"]) @ p["v"]
            return 0.5 * jnp.sum(jnp.square(y - t)) / b
        g = jax.grad(loss)(p)
        return {k: p[k] - LR * g[k] for k in p}

    rng = np.random.default_rng(0)
    init = {"w": rng.standard_normal((dio, dh), np.float32) / np.float32(np.sqrt(dio)),
            "bias": np.zeros(dh, np.float32),
            "v": rng.standard_normal((dh, dio), np.float32) / np.float32(np.sqrt(dh))}
    xs, ts = rng.standard_normal((b, dio), np.float32), rng.standard_normal((b, dio), np.float32)
    out = {}
    for mode, split in modes(n):
        ax = "all" if split else None
        specs = {"w": P(None, ax if split == "hidden" else None), "bias": P(ax if split == "hidden" else None),
                 "v": P(ax if split == "hidden" else None, None)}
        p_sh = {k: NamedSharding(mesh, v) for k, v in specs.items()}
        d_sh = NamedSharding(mesh, P(ax if split == "batch" else None, None))
        fn = jax.jit(step, in_shardings=(p_sh, d_sh, d_sh), out_shardings=p_sh, donate_argnums=0)
        state = {"p": {k: jax.device_put(v, p_sh[k]) for k, v in init.items()}}
        x, t = jax.device_put(xs, d_sh), jax.device_put(ts, d_sh)

        def run() -> None:
            state["p"] = jax.block_until_ready(fn(state["p"], x, t))
        lb, lh = local_sizes(split, n, b, dh)
        out[mode] = interleaved({"reference": on_cores(n, lb, dio, lh), "JAX jit": run}, args.repeat)
    return {"report": f"jax {jax.__version__}, {n} {jax.devices()[0].platform} devices, pinned to {n} cores",
            "times": out}


def part_mtf(args) -> dict:
    """Every mode on this process's TF CPU devices: Mesh-TF's placement mesh implementation."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow.compat.v1 as tf
    from tensorflow.python.framework import ops, tensor_conversion_registry
    if not hasattr(ops, "register_tensor_conversion_function"):  # (TF 2.15 moved it; mesh-tensorflow calls it)
        ops.register_tensor_conversion_function = tensor_conversion_registry.register_tensor_conversion_function
    import mesh_tensorflow as mtf
    from threadpoolctl import threadpool_info

    tf.disable_v2_behavior()
    tf.logging.set_verbosity(tf.logging.ERROR)
    n = args.cores
    pin(n)
    b, dio, dh = args.batch, args.d_io, args.d_hidden
    rng = np.random.default_rng(0)
    xs, ts = rng.standard_normal((b, dio), np.float32), rng.standard_normal((b, dio), np.float32)
    out = {}
    for mode, split in modes(n):
        with tf.Graph().as_default():
            graph = mtf.Graph()
            mesh = mtf.Mesh(graph, "mesh")
            B, IO, H = mtf.Dimension("batch", b), mtf.Dimension("io", dio), mtf.Dimension("hidden", dh)
            x = mtf.get_variable(mesh, "x", [B, IO], initializer=tf.constant_initializer(xs), trainable=False)
            t = mtf.get_variable(mesh, "t", [B, IO], initializer=tf.constant_initializer(ts), trainable=False)
            w = mtf.get_variable(mesh, "w", [IO, H], initializer=tf.random_normal_initializer(stddev=dio ** -0.5))
            bias = mtf.get_variable(mesh, "bias", [H], initializer=tf.zeros_initializer())
            v = mtf.get_variable(mesh, "v", [H, IO], initializer=tf.random_normal_initializer(stddev=dh ** -0.5))
            y = mtf.einsum([mtf.relu(mtf.einsum([x, w], [B, H]) + bias), v], [B, IO])
            loss = mtf.reduce_sum(mtf.square(y - t)) * (0.5 / b)
            variables = graph.trainable_variables
            grads = mtf.gradients([loss], [var.outputs[0] for var in variables])
            updates = mtf.optimize.SgdOptimizer(LR).apply_grads(grads, variables)
            impl = mtf.placement_mesh_impl.PlacementMeshImpl(
                mtf.convert_to_shape(f"all:{n}"), mtf.convert_to_layout_rules(f"{split}:all" if split else ""),
                [f"/cpu:{i}" for i in range(n)])
            lowering = mtf.Lowering(graph, {mesh: impl})
            step_ops = [lowering.lowered_operation(op) for op in updates]
            config = tf.ConfigProto(device_count={"CPU": n}, intra_op_parallelism_threads=1,
                                    inter_op_parallelism_threads=n, use_per_session_threads=True)
            with tf.Session(config=config) as sess:
                sess.run(tf.global_variables_initializer())
                sess.run(lowering.copy_masters_to_slices())
                lb, lh = local_sizes(split, n, b, dh)
                out[mode] = interleaved({"reference": on_cores(n, lb, dio, lh),
                                         "Mesh-TF placement": lambda: sess.run(step_ops)}, args.repeat)
    blas = "; ".join(f"{i.get('internal_api')} {i.get('version')} kernel={i.get('architecture')} "
                     f"threads={i.get('num_threads')}" for i in threadpool_info())
    return {"report": f"tensorflow {tf.__version__} (oneDNN {os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'default')}), "
                      f"mesh-tensorflow {getattr(mtf, '__version__', '0.1.21')}, numpy {np.__version__}: {blas}; "
                      f"{n} CPU devices, pinned to {n} cores", "times": out}


PARTS = {"mpimesh": part_mpimesh, "jax": part_jax, "mtf": part_mtf}


# --------------------------------------------------------------------------------------- driver

def launch(cmd: List[str], env: dict, what: str) -> dict:
    """Run one part; its result (or {"error": ...})."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    found = [line[len(MARK):] for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode or not found:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
        return {"error": f"{what} failed (exit {proc.returncode}): " + " | ".join(tail)}
    return json.loads(found[-1])


def driver(args) -> None:
    from mpimesh.launch import find_mpiexec, job_env  # (here, not at the top: see part_mpimesh)

    common.rank0_print(common.kernel_report())
    flags = ["--repeat", str(args.repeat), "--batch", str(args.batch), "--d-io", str(args.d_io),
             "--d-hidden", str(args.d_hidden)]
    me = os.path.abspath(__file__)
    env = job_env(MPIMESH_BENCH_LOCK="")  # (this process holds the lock; the parts must not wait for it)
    runs: Dict[str, dict] = {}
    for cores in (args.ranks, 1):
        part = flags + ["--cores", str(cores)]
        runs[f"mpimesh/{cores}"] = launch([find_mpiexec(), "-n", str(cores), sys.executable, me, "--part", "mpimesh",
                                          *part], env, f"mpimesh on {cores} ranks")
        xla = f"--xla_force_host_platform_device_count={cores} --xla_cpu_multi_thread_eigen=false"
        runs[f"jax/{cores}"] = launch([sys.executable, me, "--part", "jax", *part], {**env, "XLA_FLAGS": xla},
                                      f"JAX on {cores} devices")
        if args.peers_python and os.path.exists(args.peers_python):
            runs[f"mtf/{cores}"] = launch([args.peers_python, me, "--part", "mtf", *part], env,
                                          f"Mesh-TF on {cores} devices")
        else:
            runs[f"mtf/{cores}"] = {"error": f"Mesh-TF not run: no python at {args.peers_python!r} (set up: {SETUP})"}
    print(f"\nthe paper's MLP step, b={args.batch} d_io={args.d_io} d_h={args.d_hidden}, float32, forward + grads of "
          f"w, bias, v + SGD; median of {args.repeat} interleaved runs; ratio: over the reference (the step's "
          f"local matmuls on each core at once) measured in the same process")
    rows, notes = [], []
    for key, r in runs.items():
        if "error" in r:
            notes.append(r["error"])
            continue
        notes.append(f"{key}: {r['report']}".replace("\n", "; "))
        cores = int(key.split("/")[1])
        for mode, times in r["times"].items():
            ref = times["reference"][1]
            for name, (low, med) in times.items():
                if name != "reference":
                    rows.append((mode, name, cores, f"{1e3 * med:.1f}", f"{1e3 * low:.1f}", f"{1e3 * ref:.1f}",
                                 f"{med / ref:.2f}"))
    order = {m: i for i, m in enumerate(("data-parallel", "model-parallel", "1 core"))}
    rows.sort(key=lambda row: order[row[0]])
    print(common.table(("mode", "step", "cores", "ms", "(min)", "reference ms", "ratio"), rows))
    print("\n" + "\n".join(notes))
    print(f"load average at the end: {common.load_average()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10, help="timed runs per case (the median is kept)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks (mpimesh) or devices (JAX, Mesh-TF) besides 1")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--d-io", type=int, default=1024)
    ap.add_argument("--d-hidden", type=int, default=4096)
    ap.add_argument("--peers-python", default="/tmp/peers-venv/bin/python",
                    help="the python of the venv with tensorflow-cpu and mesh-tensorflow")
    ap.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--cores", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.batch % args.ranks or args.d_hidden % args.ranks:
        ap.error(f"--batch {args.batch} and --d-hidden {args.d_hidden} must divide by --ranks {args.ranks} "
                 "(Mesh-TensorFlow splits only dims its mesh divides)")
    if args.part is None:
        driver(args)
        return
    result = PARTS[args.part](args)
    if args.part != "mpimesh" or common.WORLD.Get_rank() == 0:
        print(MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
