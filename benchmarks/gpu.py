"""mpimesh against PyTorch eager on one GPU: the Transformer training step, and collectives staged
through the host between ranks that share the GPU.

    python benchmarks/gpu.py                                  # fp32, tf32 and bf16 on GPU 0
    python benchmarks/gpu.py --device cpu                     # smoke run: numpy and PyTorch on CPU, tiny model
    mpiexec -n 2 python benchmarks/gpu.py --collectives       # both ranks on GPU 0

Needs PyTorch, a benchmark-only dependency that no extra installs (`pip install torch`: a CUDA
build; for `--device cpu`, the CPU build: `pip install torch --index-url
https://download.pytorch.org/whl/cpu`), and on a GPU CuPy (`python3 install.py gpu`).

The step: apps/transformer.py's train step (d_model 1024, d_ff 4096, 16 heads of 64, 4 layers,
batch 32 x 512, Adam with linear warmup) on one rank, against benchmarks/torch_twin.py: the same
model in PyTorch, started from a copy of mpimesh's parameters, trained by `torch.optim.Adam` with
the same hyper-parameters. Before timing, the two losses on the same weights and batch, and again
after one step of each, must agree (fp32: to 1e-5 relative, else the run stops). Each precision
runs in a fresh process (CuPy reads `CUPY_TF32` once): fp32; tf32; bf16 (mpimesh's bfloat16
activations over float32 parameters, PyTorch's `torch.autocast`; TF32 on, which holds bfloat16
values exactly wherever mpimesh contracts them as float32). Step times: medians of `--steps`,
the two sides interleaved, the GPU synchronised after each. MFU: benchmarks/transformer.py's
`model_flops` / step time / the best n^3 matmul rate of CuPy and PyTorch (PyTorch's alone in bf16)
in the same precision and process. Peak memory of one step: the most bytes CuPy's pool handed out
(`mm.profile().peak_bytes["gpu"]`, parameters and optimiser state included, cached blocks not)
against `torch.cuda.max_memory_allocated()`; the pools' totals, cached blocks included
(`peak_bytes["gpu_cached"]`, `torch.cuda.max_memory_reserved()`), are printed beside. Bars on one H100: step time at most 1.0x
PyTorch's in fp32, 1.3x in tf32 and bf16; peak memory at most 1.2x in fp32 and tf32. The step also
runs compiled (`mm.compile`: recorded once, replayed without per-op Python), timed interleaved with
the others: bars 0.95x PyTorch eager in fp32, 0.8x in tf32 and bf16 on a GPU, 1.0x for the CPU's tiny
model in fp32 (the one bar judged on the CPU).
`--attention sdpa` gives PyTorch its fused attention instead of mpimesh's written-out one.
`--device cpu` (`--size tiny`; the default without a GPU) runs the same checks, steps and table on
numpy and PyTorch's CPU build, one thread each, and judges only the compiled fp32 bar.

`--profile`: where one mpimesh step's time goes, per precision, after the timings: wall time per step
against the summed time of its GPU kernels (torch.profiler's CUDA activity, which CUPTI gives for
CuPy's kernels too), the ops (`mm.trace()`) and kernels per step, the host's time to issue the
step per op, and the ten longest kernels (name, calls and ms per step). With `--device cpu` only
CPU activity is recorded and the kernel columns read n/a.

`--collectives`: allreduce and allgather of float32 buffers (`--mib`, default 1, 16, 64 per rank)
through `mm.Mesh("all:N", backend="cupy", transport="staged")`, against the same by hand: a copy
into a preallocated pinned host buffer, mpi4py's `Allreduce`/`Allgather`, a copy into a
preallocated GPU array. Results are checked equal first; times are the slowest rank's medians.
"""
from __future__ import annotations

import common  # noqa: F401  (first: fixes the BLAS environment)

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Callable, Dict, List, Optional  # noqa: E402

import numpy as np  # noqa: E402
from common import WORLD, compare, fmt_bytes, kernel_report, rank0_print, table, verdict  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "apps"))
import transformer as app  # noqa: E402

import mpimesh as mm  # noqa: E402
from mpimesh.backend import device_count  # noqa: E402
from mpimesh.launch import job_env  # noqa: E402

SIZES = {"full": {"d_model": 1024, "heads": 16, "d_kv": 64, "d_ff": 4096, "layers": 4, "batch": 32, "length": 512},
         "tiny": {"d_model": 64, "heads": 4, "d_kv": 16, "d_ff": 256, "layers": 2, "batch": 8, "length": 64}}
DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16"}  # mpimesh's activations per precision
TF32 = ("tf32", "bf16")  # bf16 too: TF32 holds bfloat16 values exactly where mpimesh contracts them as float32
TIME_BARS = {"fp32": 1.0, "tf32": 1.3, "bf16": 1.3}  # mpimesh step / PyTorch step, at most
COMPILED_BARS = {"fp32": 0.95, "tf32": 0.8, "bf16": 0.8}  # mpimesh compiled step / PyTorch eager step, at most
CPU_COMPILED_BAR = 1.0  # --device cpu, tiny: the compiled step / PyTorch CPU eager, at most
MEMORY_BARS = {"fp32": 1.2, "tf32": 1.2}  # mpimesh peak / PyTorch peak, at most
SAME_MODEL = {"fp32": 1e-5, "tf32": 1e-2, "bf16": 3e-2}  # |relative loss difference| on the same weights and batch
GEMM_N = {"gpu": 8192, "cpu": 1024}
PROFILE_STEPS = 3  # --profile: steps timed, traced and profiled
DEFAULTS = {"gpu": {"size": "full", "precisions": "fp32,tf32,bf16", "steps": 10, "warmup": 3, "mib": "1,16,64"},
            "cpu": {"size": "tiny", "precisions": "fp32,bf16", "steps": 3, "warmup": 1, "mib": "0.25,1"}}


def _sibling(name: str):
    """benchmarks/<name>.py as a module (benchmarks/transformer.py has apps/transformer.py's name)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


model_flops = _sibling("transformer").model_flops


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_torch(device: str) -> None:
    """SystemExit naming what to install where PyTorch (built with CUDA, on the GPU) is missing."""
    if importlib.util.find_spec("torch") is None:
        raise SystemExit("benchmarks/gpu.py needs PyTorch, a benchmark-only dependency: pip install torch")
    if device == "gpu":
        import torch
        if not torch.cuda.is_available():
            raise SystemExit(f"benchmarks/gpu.py --device gpu needs PyTorch built with CUDA; this one is "
                             f"{torch.__version__}: pip install torch (the CUDA build for this driver)")


def resolve_device(asked: Optional[str]) -> str:
    """`asked`, or gpu where CuPy sees one and cpu otherwise; SystemExit if a GPU is asked for in vain."""
    if asked == "cpu":
        return "cpu"
    if device_count() > 0:
        return "gpu"
    if asked is None:
        return "cpu"
    if importlib.util.find_spec("cupy") is None:
        raise SystemExit("benchmarks/gpu.py --device gpu needs CuPy: python3 install.py gpu")
    raise SystemExit("benchmarks/gpu.py --device gpu: CuPy sees no GPU (check the driver and CUDA_VISIBLE_DEVICES)")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("gpu", "cpu"), help="default: gpu where CuPy sees one, else cpu")
    ap.add_argument("--size", choices=sorted(SIZES), help="full: the issue's step (default on a GPU); tiny (on CPU)")
    ap.add_argument("--precisions", help="comma-separated, of fp32,tf32,bf16 (default: all on a GPU, fp32,bf16 on CPU)")
    ap.add_argument("--steps", type=int, help="timed steps per side (default 10 on a GPU, 3 on CPU)")
    ap.add_argument("--warmup", type=int, help="untimed steps per side first (default 3 on a GPU, 1 on CPU)")
    ap.add_argument("--attention", choices=("explicit", "sdpa"), default="explicit",
                    help="PyTorch's attention: written out as mpimesh computes it, or its fused kernel (sdpa)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one mpimesh step per precision: kernel vs wall time, top kernels, ops per step")
    ap.add_argument("--collectives", action="store_true", help="time staged allreduce and allgather (under mpiexec)")
    ap.add_argument("--mib", help="--collectives: MiB per rank, comma-separated (default 1,16,64; CPU 0.25,1)")
    ap.add_argument("--repeat", type=int, default=10, help="--collectives: timed runs per case")
    ap.add_argument("--worker", choices=sorted(DTYPES), help=argparse.SUPPRESS)  # one precision, in this process
    ap.add_argument("--out", help=argparse.SUPPRESS)  # the worker's JSON result
    args = ap.parse_args(argv)
    args.device = resolve_device(args.device)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.precisions = args.precisions.split(",")
    unknown = [p for p in args.precisions if p not in DTYPES or (p == "tf32" and args.device == "cpu")]
    if unknown:
        ap.error(f"--precisions: {', '.join(unknown)} not available on {args.device}; choose from "
                 f"{', '.join(p for p in DTYPES if args.device == 'gpu' or p != 'tf32')}")
    try:
        args.mib = [float(m) for m in args.mib.split(",")]
    except ValueError:
        ap.error(f"--mib {args.mib!r}: expected comma-separated numbers")
    if args.steps < 1 or args.warmup < 0 or args.repeat < 1 or min(args.mib) <= 0:
        ap.error("--steps, --repeat and --mib must be positive, --warmup at least 0")
    return args


# --------------------------------------------------------------------------- the training step

def gemm_rates(torch, xp, precision: str, device: str, syncs: Dict[str, Callable]) -> Dict[str, Optional[float]]:
    """FLOP/s of an n^3 matmul in `precision`, best of 5: the array library's (None in bf16) and PyTorch's."""
    n = GEMM_N[device]
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    lib = xp.__name__
    fns = {}
    if precision != "bf16":
        xa = xp.asarray(a)
        fns[lib] = lambda: (xa @ xa, syncs["mpimesh"]())
    ta = torch.from_numpy(a).to("cuda" if device == "gpu" else "cpu",
                                torch.bfloat16 if precision == "bf16" else torch.float32)
    fns["torch"] = lambda: (ta @ ta, syncs["torch"]())
    best = {k: t[0] for k, t in compare(fns, repeat=5, warmup=2, comm=mm.MPI.COMM_SELF).items()}
    return {k: 2 * n ** 3 / best[k] if k in best else None for k in (lib, "torch")}


def measure(precision: str, args: argparse.Namespace) -> dict:
    """One precision in this process: the same-model check, GEMM rates, step times, peak memory."""
    import torch
    from torch_twin import TorchTwin, make_adam
    gpu = args.device == "gpu"
    where = "cuda" if gpu else "cpu"
    mm.set_matmul_precision("tf32" if precision in TF32 else "highest")
    if gpu:
        import cupy
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision in TF32
        syncs = {"mpimesh": cupy.cuda.Device().synchronize, "torch": torch.cuda.synchronize}
    else:
        torch.set_num_threads(1)  # numpy's BLAS runs one thread too (common.py)
        syncs = {"mpimesh": lambda: None, "torch": lambda: None}
    say = (lambda *a: print(f"[{precision}]", *a, flush=True))

    cfg = app.Config(optimizer="adam", lr=3e-3, warmup=20, dtype=DTYPES[precision], **SIZES[args.size])
    mesh = mm.Mesh("all:1", backend="cupy" if gpu else "numpy", comm=mm.MPI.COMM_SELF)
    data = np.random.default_rng(1).integers(0, 256, size=1 << 16).astype(np.uint8)
    offsets = app.train_offsets(data, cfg, 0, 0)
    batch = app.make_batch(mesh, data, cfg, offsets)
    ids, targets = (torch.from_numpy(a).long().to(where) for a in app.batch_windows(data, cfg, offsets))
    opt = app.make_optimizer(cfg)
    params = app.init_params(mesh, cfg)
    start = {k: t.to_numpy() for k, t in params.items()}
    model = TorchTwin(start, args.attention, where)
    torch_opt, schedule = make_adam(model, cfg.lr, cfg.warmup, (opt.beta1, opt.beta2), opt.epsilon)
    train_step = app.make_train_step(cfg, opt)
    state = [params, opt.init(params)]

    def autocast():
        return torch.autocast(where, dtype=torch.bfloat16, enabled=precision == "bf16")

    def mm_issue() -> None:
        state[0], state[1], _ = train_step(state[0], state[1], batch)

    def mm_step() -> None:
        mm_issue()
        syncs["mpimesh"]()

    compiled_step = mm.compile(train_step)

    def compiled_issue() -> None:
        state[0], state[1], _ = compiled_step(state[0], state[1], batch)

    def compiled() -> None:
        compiled_issue()
        syncs["mpimesh"]()

    def torch_step() -> None:
        torch_opt.zero_grad()
        with autocast():
            loss = model(ids, targets)
        loss.backward()
        torch_opt.step()
        schedule.step()
        syncs["torch"]()

    def losses() -> tuple:
        with torch.no_grad(), autocast():
            theirs = float(model(ids, targets))
        return float(app.loss_fn(state[0], batch, cfg, train=False)), theirs

    before = losses()
    mm_step()
    torch_step()
    after = losses()
    rel = [abs(a - b) / abs(b) for a, b in (before, after)]
    moved = {k: t.to_numpy() - start[k] for k, t in state[0].items()}  # each parameter's first update
    gap = sum(np.sum((moved[k] - (p.detach().cpu().numpy() - start[k])) ** 2) for k, p in model.p.items())
    update = np.sqrt(gap / sum(np.sum(u ** 2) for u in moved.values()))
    same = max(rel) <= SAME_MODEL[precision]
    say(f"same model: loss {before[0]:.6f} (mpimesh) vs {before[1]:.6f} (torch), relative difference {rel[0]:.1e}; "
        f"after one Adam step {rel[1]:.1e}, the updates differ by {update:.1e} of their norm "
        f"(tolerance {SAME_MODEL[precision]:g} on the loss: {'ok' if same else 'EXCEEDED'})")
    if precision == "fp32" and not same:
        raise SystemExit(f"[fp32] mpimesh and the PyTorch twin disagree beyond {SAME_MODEL['fp32']:g}: "
                         f"not timing two different models")

    rates = gemm_rates(torch, mesh.xp, precision, args.device, syncs)
    say(f"{GEMM_N[args.device]}^3 matmul on {torch.cuda.get_device_name() if gpu else 'cpu'}: "
        + ", ".join(f"{k} {r / 1e12:.2f} TFLOP/s" if r else f"{k} n/a" for k, r in rates.items()))
    times = compare({"mpimesh": mm_step, "compiled": compiled, "torch": torch_step}, repeat=args.steps,
                    warmup=args.warmup, comm=mm.MPI.COMM_SELF)

    say(graph_plan(compiled_step))
    with mm.profile(memory=not gpu) as prof:  # CPU: tracemalloc's peak of the step's own allocations
        mm_step()
    torch_peak = reserved = None
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch_step()
        torch_peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    mm_peak = prof.peak_bytes["gpu" if gpu else "arrays"]
    say(f"step (median of {args.steps}): mpimesh {times['mpimesh'][1] * 1e3:.1f} ms eager, "
        f"{times['compiled'][1] * 1e3:.1f} ms compiled, torch "
        f"{times['torch'][1] * 1e3:.1f} ms; peak memory mpimesh {mib(mm_peak)}"
        + (f" allocated, {mib(prof.peak_bytes['gpu_cached'])} in its pool; torch {mib(torch_peak)} "
           f"allocated, {mib(reserved)} reserved" if gpu else ", torch n/a"))
    return {"flops": model_flops(cfg), "peak_rate": max(r for r in rates.values() if r), "mm_s": times["mpimesh"][1],
            "compiled_s": times["compiled"][1], "torch_s": times["torch"][1], "mm_bytes": mm_peak, "torch_bytes": torch_peak, "loss_rel": rel[0],
            "profile": {"eager": dict(profile_step(mm_issue, syncs["mpimesh"], gpu),
                                      op_times=op_times(mm_issue, syncs["mpimesh"], gpu)),
                        "compiled": profile_step(compiled_issue, syncs["mpimesh"], gpu,
                                                 ops=len(compiled_step.programs()[-1].ops))}
            if args.profile else None}


def op_times(issue: Callable, sync: Callable, gpu: bool, top: int = 15) -> list:
    """Where one eager step's device time goes, op by op: each op's kernels between two CUDA events
    (on the CPU, wall time), summed per (op, output shape); the `top` longest as (ms, calls, op, shape)."""
    from mpimesh.mesh import Mesh
    real, marks = Mesh.run, []
    if gpu:
        import cupy

        def stamp():
            event = cupy.cuda.Event()
            event.record()
            return event
        elapsed = cupy.cuda.get_elapsed_time
    else:
        stamp, elapsed = time.perf_counter, (lambda a, b: (b - a) * 1e3)

    def timed(self, name, lower, arrays, n_out, ctx=None, **out):
        start = stamp()
        result = real(self, name, lower, arrays, n_out, ctx, **out)
        marks.append((name, tuple(getattr(result[0], "shape", ())), start, stamp()))
        return result
    sync()
    Mesh.run = timed
    try:
        issue()
    finally:
        Mesh.run = real
    sync()
    totals: Dict[tuple, List[float]] = {}
    for name, shape, start, end in marks:
        t = totals.setdefault((name, shape), [0, 0.0])
        t[0] += 1
        t[1] += elapsed(start, end)
    return sorted(((ms, calls, name, "x".join(map(str, shape))) for (name, shape), (calls, ms) in totals.items()),
                  reverse=True)[:top]


def graph_plan(step) -> str:
    """How the compiled step replays: its engine, and under CUDA graphs the segments and host steps (why)."""
    engines = [e.engine for e in step.cache.values() if e.engine is not None]
    if not engines:
        return "compiled: not replayed yet"
    engine = engines[-1]
    if not hasattr(engine, "plan"):
        return f"compiled: {type(engine).__name__}, {len(engine.steps)} steps (no CUDA graphs)"
    why: Dict[str, int] = {}
    for entry in engine.plan:
        if entry[0] == "host":
            key = entry[2] if entry[1][0] != "op" else f"{entry[1][1]}: {entry[2]}"
            why[key[:120]] = why.get(key[:120], 0) + 1
    return (f"compiled: {engine.segments} CUDA graph(s), {engine.host_steps} host step(s) of {len(engine.engine.steps)}"
            + "".join(f"; {n}x {k}" for k, n in sorted(why.items(), key=lambda kv: -kv[1])[:8]))


def profile_step(issue: Callable, sync: Callable, gpu: bool, ops: Optional[int] = None) -> dict:
    """Where one mpimesh step's time goes: wall time and the host's time to issue it (before waiting
    for the GPU), medians of PROFILE_STEPS; the ops of one step (`ops`, else its `mm.trace()`); on a GPU
    the kernels torch.profiler sees through CUPTI (CuPy's too: any CUDA activity of the process, kernels
    in CUDA graphs included), their time and count per step and the ten longest (name, calls, ms per
    step). On the CPU only CPU activity is recorded and the kernel fields are None."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    walls, hosts = [], []
    for _ in range(PROFILE_STEPS):
        sync()
        t0 = time.perf_counter()
        issue()
        hosts.append(time.perf_counter() - t0)
        sync()
        walls.append(time.perf_counter() - t0)
    if ops is None:
        with mm.trace() as tr:
            issue()
        ops = len(tr.ops)
        del tr  # it holds the step's tensors
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
        for _ in range(PROFILE_STEPS):
            issue()
        sync()
    kernels: Dict[str, List[float]] = {}
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA:
            k = kernels.setdefault(ev.name, [0, 0.0])
            k[0] += 1
            k[1] += ev.time_range.elapsed_us() / 1e3
    per_step = {name: (calls / PROFILE_STEPS, ms / PROFILE_STEPS) for name, (calls, ms) in kernels.items()}
    return {"wall_ms": float(np.median(walls)) * 1e3, "host_ms": float(np.median(hosts)) * 1e3, "ops": ops,
            "host_us_per_op": float(np.median(hosts)) * 1e6 / max(ops, 1),
            "kernel_ms": sum(ms for _, ms in per_step.values()) if gpu else None,
            "kernels": sum(calls for calls, _ in per_step.values()) if gpu else None,
            "top": sorted(((n, c, ms) for n, (c, ms) in per_step.items()), key=lambda k: -k[2])[:10]}


def run_workers(args: argparse.Namespace) -> Dict[str, dict]:
    """Each precision in a fresh process of this script (CuPy reads CUPY_TF32 once); {precision: result}."""
    passed = [f"--device={args.device}", f"--size={args.size}", f"--steps={args.steps}", f"--warmup={args.warmup}",
              f"--attention={args.attention}"] + (["--profile"] if args.profile else [])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions:
            out = os.path.join(tmp, f"{precision}.json")
            env = job_env(MPIMESH_BENCH_LOCK="", CUPY_TF32="1" if precision in TF32 else "0")
            sys.stdout.flush()
            code = subprocess.call([sys.executable, os.path.abspath(__file__), *passed, "--worker", precision,
                                    "--out", out], env=env)
            if code == 0:
                with open(out) as f:
                    results[precision] = json.load(f)
            else:
                print(f"[{precision}] failed with exit status {code} (its output is above)", flush=True)
    return results


def report(results: Dict[str, dict], args: argparse.Namespace) -> None:
    """The verdicts (GPU only: the bars are for one H100) and the table."""
    gpu = args.device == "gpu"
    judged = (lambda met: "-" if met is None or not gpu else "MET" if met else "MISSED")
    rows = []
    for p, r in results.items():
        ratio, compiled_ratio = r["mm_s"] / r["torch_s"], r["compiled_s"] / r["torch_s"]
        compiled_bar = COMPILED_BARS[p] if gpu else CPU_COMPILED_BAR
        compiled_met = compiled_ratio <= compiled_bar if gpu or (args.size == "tiny" and p == "fp32") else None
        if compiled_met is not None:
            print(verdict(f"{p} compiled step <= {compiled_bar}x PyTorch eager{'' if gpu else ' (CPU, tiny)'}",
                          compiled_met, f"{r['compiled_s'] * 1e3:.1f} ms vs {r['torch_s'] * 1e3:.1f} ms, "
                          f"{compiled_ratio:.2f}x"))
        mem_ratio = r["mm_bytes"] / r["torch_bytes"] if r["torch_bytes"] else None
        time_met = ratio <= TIME_BARS[p]
        mem_met = mem_ratio <= MEMORY_BARS[p] if mem_ratio is not None and p in MEMORY_BARS else None
        if gpu:
            print(verdict(f"{p} step <= {TIME_BARS[p]}x PyTorch eager", time_met,
                          f"{r['mm_s'] * 1e3:.1f} ms vs {r['torch_s'] * 1e3:.1f} ms, {ratio:.2f}x"))
            if mem_met is not None:
                print(verdict(f"{p} peak GPU memory <= {MEMORY_BARS[p]}x PyTorch's", mem_met,
                              f"{mib(r['mm_bytes'])} vs {mib(r['torch_bytes'])}, {mem_ratio:.2f}x"))
        rows.append((p, f"{r['mm_s'] * 1e3:.1f}", f"{r['torch_s'] * 1e3:.1f}", f"{ratio:.2f}", f"<= {TIME_BARS[p]}",
                     judged(time_met), f"{r['compiled_s'] * 1e3:.1f}", f"{compiled_ratio:.2f}", f"<= {compiled_bar}",
                     "-" if compiled_met is None else "MET" if compiled_met else "MISSED", f"{100 * r['flops'] / r['mm_s'] / r['peak_rate']:.1f}%",
                     f"{100 * r['flops'] / r['torch_s'] / r['peak_rate']:.1f}%", f"{r['mm_bytes'] / 2**20:.0f}",
                     f"{r['torch_bytes'] / 2**20:.0f}" if r["torch_bytes"] else "n/a",
                     f"{mem_ratio:.2f}" if mem_ratio else "-", f"<= {MEMORY_BARS[p]}" if p in MEMORY_BARS else "-",
                     judged(mem_met), f"{r['loss_rel']:.1e}"))
    cfg = SIZES[args.size]
    print(f"\nmodel ({args.size}): d_model {cfg['d_model']}, d_ff {cfg['d_ff']}, {cfg['heads']}x{cfg['d_kv']} heads, "
          f"{cfg['layers']} layers, batch {cfg['batch']} x length {cfg['length']}; Adam; PyTorch attention "
          f"{args.attention}; MFU against the best matmul rate of each precision; memory in MiB"
          + ("" if gpu else "\ncpu smoke run: the bars are for one H100 GPU and are not judged here, but the compiled "
             "fp32 step's (numpy has no bfloat16 GEMM: mpimesh widens, PyTorch does not)"))
    print(table(("precision", "eager ms", "torch ms", "ratio", "bar", "time", "compiled ms", "ratio", "bar", "time",
                 "MFU eager", "MFU torch",
                 "mpimesh MiB", "torch MiB", "mem ratio", "mem bar", "memory", "loss diff"), rows), flush=True)
    if args.profile:
        report_profile({(p, how): r["profile"][how] for p, r in results.items() for how in ("eager", "compiled")}, gpu)


def report_profile(profiles: Dict[tuple, dict], gpu: bool) -> None:
    """`--profile`'s table (one row per precision and step: eager, compiled) and each one's longest kernels."""
    def n_a(value, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)
    rows = [(p, how, f"{r['wall_ms']:.2f}", f"{r['host_ms']:.2f}", n_a(r["kernel_ms"], ".2f"),
             n_a(None if r["kernel_ms"] is None else 100 * r["kernel_ms"] / r["wall_ms"], ".0f"), r["ops"],
             n_a(r["kernels"], ".0f"), f"{r['host_us_per_op']:.1f}") for (p, how), r in profiles.items()]
    print(f"\nprofile of one mpimesh step (medians of {PROFILE_STEPS}; host: the time to issue it; kernels: "
          + ("CUDA activity through CUPTI, CuPy's included)" if gpu else "n/a, cpu run: CPU activity only)"))
    print(table(("precision", "step", "wall ms", "host ms", "kernel ms", "kernel %", "ops/step", "kernels/step",
                 "host us/op"), rows))
    for (p, how), r in profiles.items():
        if r.get("op_times"):
            print(f"\n{p} {how}: longest ops of one step ({'device time between CUDA events' if gpu else 'wall time'})")
            print(table(("ms", "calls", "op", "output block"), [(f"{ms:.3f}", c, n, sh) for ms, c, n, sh in r["op_times"]]))
        if r["top"]:
            print(f"\n{p} {how}: longest kernels per step")
            print(table(("ms", "calls", "kernel"), [(f"{ms:.3f}", f"{c:g}", name[:100]) for name, c, ms in r["top"]]))
    sys.stdout.flush()


# -------------------------------------------------------------------------------- collectives

def by_hand(kind: str, x, xp, gpu: bool) -> Callable:
    """The reference: `x` into a preallocated (pinned) host buffer, mpi4py's `kind` between host
    buffers, the result into a preallocated device array; returns that array."""
    count = x.size * (WORLD.Get_size() if kind == "allgather" else 1)
    if gpu:
        import cupyx
        send, recv = cupyx.empty_pinned(x.shape, np.float32), cupyx.empty_pinned((count,), np.float32)
    else:
        send, recv = np.empty(x.shape, np.float32), np.empty(count, np.float32)
    out = xp.empty(count, np.float32)
    transfer = WORLD.Allreduce if kind == "allreduce" else WORLD.Allgather

    def run():
        if gpu:
            x.get(out=send)
            transfer(send, recv)
            out.set(recv)
            xp.cuda.Device().synchronize()
        else:
            np.copyto(send, x)
            transfer(send, recv)
            np.copyto(out, recv)
        return out
    return run


def collectives(args: argparse.Namespace) -> None:
    """mpimesh's staged allreduce and allgather against `by_hand`, per buffer size."""
    n = WORLD.Get_size()
    if n < 2:
        raise SystemExit("benchmarks/gpu.py --collectives times transfers between ranks: mpiexec -n 2 python "
                         "benchmarks/gpu.py --collectives")
    gpu = args.device == "gpu"
    mesh = mm.Mesh(f"all:{n}", backend="cupy" if gpu else "numpy", transport="staged", **({"device": 0} if gpu else {}))
    xp, coll = mesh.xp, mesh.collectives
    sync = xp.cuda.Device().synchronize if gpu else (lambda: None)
    rank0_print(kernel_report())
    rows = []
    for size in args.mib:
        count = int(size * 2 ** 20) // 4
        x = xp.asarray(np.random.default_rng(WORLD.Get_rank()).standard_normal(count, dtype=np.float32))
        for kind, ours in (("allreduce", lambda: coll.allreduce(x, ("all",))),
                           ("allgather", lambda: coll.allgather(x, "all", 0))):
            theirs = by_hand(kind, x, xp, gpu)
            if not bool(xp.array_equal(ours(), theirs())):
                raise AssertionError(f"staged {kind} of {fmt_bytes(4 * count)} differs from the reference")
            t = compare({"staged": lambda: (ours(), sync()), "by hand": theirs}, repeat=args.repeat, warmup=2)
            staged, hand = t["staged"][1], t["by hand"][1]
            rows.append((fmt_bytes(4 * count), kind, f"{staged * 1e3:.3f}", f"{hand * 1e3:.3f}", f"{staged / hand:.2f}",
                         f"{4 * count / staged / 1e9:.2f}", f"{4 * count / hand / 1e9:.2f}"))
    where = "GPU 0, shared" if gpu else "host (cpu smoke run)"
    rank0_print(f"\nstaged collectives on {n} ranks, {where}: mpimesh (transport 'staged') vs host MPI plus the "
                f"copies by hand; float32, medians of {args.repeat}, the slowest rank's; GB/s of this rank's input")
    rank0_print(table(("per rank", "collective", "mpimesh ms", "by hand ms", "ratio", "mpimesh GB/s", "by hand GB/s"),
                      rows))


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        with open(args.out, "w") as f:
            json.dump(measure(args.worker, args), f)
        return 0
    if args.collectives:
        collectives(args)
        return 0
    if WORLD.Get_size() != 1:
        raise SystemExit("benchmarks/gpu.py times the step on one rank: python benchmarks/gpu.py (mpiexec -n 2 "
                         "only with --collectives)")
    check_torch(args.device)
    print(kernel_report())
    print(f"device {args.device}; torch {importlib.metadata.version('torch')}"
          + (f", cupy {mm.backend.array_module('cupy').__version__}" if args.device == "gpu" else ""), flush=True)
    results = run_workers(args)
    if results:
        report(results, args)
    return 0 if len(results) == len(args.precisions) else 1


if __name__ == "__main__":
    sys.exit(main())
