"""The fused attention kernels' CUDA source (`mpimesh.ops.attention_kernel`), run on the CPU: the
source compiled by the host's C++ compiler with each block's threads run as host threads (its
`__syncthreads` and `__syncwarp` real barriers, its `__shared__` arrays one per block, a warp of 3 or 4
lanes whose sums and maxima go through memory between barriers), launched by the module's own
launchers. Forward (the output and the logsumexp) and backward (dq, dk, dv) against numpy's float64
attention on the same inputs (bfloat16 inputs: their bfloat16 values), causal and not, float32 and
bfloat16, d_kv 16 and 64, lengths that are not multiples of the tiles (and of the warp), queries and
keys of different lengths. Each value's error is taken over the magnitude of its terms (the same sums
over absolute values, down to each dot's products: `reference`), and must be under: float32, 32
epsilons (sums of a few dozen float32 terms; seen: 8); bfloat16, the logsumexp 16 float32 epsilons (it
is float32), the output and dv 2^-8 (each value rounded once to bfloat16, half a unit in its last place)
and 16 epsilons (seen: 3.8e-3), dq and dk 2^-7 and 16 epsilons (rounded once, and their delta,
rowsum(do * o), is read from the output as stored, as FlashAttention does: another 2^-8 at most; seen:
1.7e-3). Never run on a GPU here. Skipped where no C++ compiler is installed."""
from __future__ import annotations

import ctypes
import os
import re
import sys

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
import cuda_source  # noqa: E402

from mpimesh.errors import DTypeError, ShapeError  # noqa: E402
from mpimesh.ops import attention_kernel as ak  # noqa: E402

pytestmark = [pytest.mark.skipif(MPI.COMM_WORLD.Get_size() != 1, reason="no MPI; the 1-rank session runs it"),
              pytest.mark.skipif(cuda_source.compiler() is None, reason="no C++ compiler to run the kernels' source")]

BF16 = np.dtype("bfloat16")
# A warp of 4 lanes, two warps of two rows (tiles of 8); a warp of 3, two warps of three rows (tiles of 7)
TILES = [ak.Tiles(warp=4, warps=2, rows=2, tile=8), ak.Tiles(warp=3, warps=2, rows=3, tile=7)]
CPU_PRELUDE = """#include <cmath>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>
using namespace std;
#define WARP %d
#define NEG_INF (-INFINITY)
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct Dim { unsigned int x; };
static thread_local Dim threadIdx, blockIdx;
static Dim blockDim;
struct Barrier {  /* n threads wait until all n have come */
  mutex m; condition_variable cv; int n = 0, count = 0; unsigned long long generation = 0;
  void wait() {
    unique_lock<mutex> lock(m);
    unsigned long long g = generation;
    if (++count == n) { count = 0; ++generation; cv.notify_all(); }
    else cv.wait(lock, [&] { return generation != g; });
  }
};
static Barrier block_barrier, warp_barriers[1024 / WARP];
static double lanes[1024];
static inline void __syncthreads() { block_barrier.wait(); }
static inline void __syncwarp() { warp_barriers[threadIdx.x / WARP].wait(); }
template <typename V> inline V warp_sum(V v) {
  lanes[threadIdx.x] = v; __syncwarp();
  V s = 0;
  for (unsigned int l = threadIdx.x / WARP * WARP; l < threadIdx.x / WARP * WARP + WARP; ++l) s += (V)lanes[l];
  __syncwarp();
  return s;
}
template <typename V> inline V warp_max(V v) {
  lanes[threadIdx.x] = v; __syncwarp();
  V s = NEG_INF;
  for (unsigned int l = threadIdx.x / WARP * WARP; l < threadIdx.x / WARP * WARP + WARP; ++l)
    s = (V)lanes[l] > s ? (V)lanes[l] : s;
  __syncwarp();
  return s;
}
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
"""
_ARGS = {np.dtype(np.int32): ctypes.c_int, np.dtype(np.int64): ctypes.c_longlong, np.dtype(np.float32): ctypes.c_float}


def cpu_kernels(dtype: str, d_kv: int, tiles: ak.Tiles) -> dict:
    """The kernels of `ak.source(dtype, d_kv, tiles)` as CuPy calls them, `f(grid, block, args)`: the
    block's threads run side by side (host threads), the blocks one after another."""
    launchers = []
    for name, spec in ak.ATTENTION_PARAMS.items():
        names = ", ".join(p.split()[-1].lstrip("*") for p in spec.split(","))
        launchers.append(f'extern "C" void launch_{name}(unsigned int grid, unsigned int block, {spec}) {{\n'
                         f"  blockDim.x = block; block_barrier.n = block;\n"
                         f"  for (unsigned int w = 0; w < block / WARP; ++w) warp_barriers[w].n = WARP;\n"
                         f"  vector<thread> threads;\n  for (unsigned int t = 0; t < block; ++t)\n"
                         f"    threads.emplace_back([=] {{\n      threadIdx.x = t;\n"
                         f"      for (unsigned int b = 0; b < grid; ++b) {{ blockIdx.x = b; {name}({names}); "
                         f"__syncthreads(); }}\n    }});\n  for (auto& t : threads) t.join();\n}}\n")
    lib = cuda_source._build(CPU_PRELUDE % tiles.warp + ak.source(dtype, d_kv, tiles) + "\n".join(launchers))

    def kernel(name):
        def call(grid, block, args):
            assert block[0] % tiles.warp == 0 and block[0] <= 1024
            values = [a.ctypes.data_as(ctypes.c_void_p) if isinstance(a, np.ndarray) else _ARGS[a.dtype](a)
                      for a in args]
            getattr(lib, f"launch_{name}")(ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]), *values)
        return call
    return {name: kernel(name) for name in ak.ATTENTION_PARAMS}


def reference(q, k, v, do, causal: bool, scale: float) -> tuple:
    """numpy's float64 attention and its gradients, `{name: array}`, and the magnitude of each value's
    terms (the same sums of absolute values, down to the products in each dot: a float32 sum errs by some
    epsilons of that; delta = rowsum(do * o) has the terms |do| |o|, the gradients' delta from an output
    rounded to bfloat16 errs by 2^-9 of those)."""
    q, k, v, do = (a.astype(np.float64) for a in (q, k, v, do))
    s = scale * np.einsum("bhid,bhjd->bhij", q, k)
    if causal:
        s = np.where(np.arange(k.shape[2])[None, :] > np.arange(q.shape[2])[:, None], -np.inf, s)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    p = e / e.sum(-1, keepdims=True)
    dp = np.einsum("bhid,bhjd->bhij", do, v)
    delta = (dp * p).sum(-1, keepdims=True)
    o = p @ v
    ds = p * (dp - delta)
    dp_terms = np.einsum("bhid,bhjd->bhij", np.abs(do), np.abs(v))
    ds_terms = p * (dp_terms + (np.abs(do) * np.abs(o)).sum(-1, keepdims=True))
    want = {"o": o, "lse": m[..., 0] + np.log(e.sum(-1)), "dq": scale * ds @ k,
            "dk": scale * np.einsum("bhij,bhid->bhjd", ds, q), "dv": np.einsum("bhij,bhid->bhjd", p, do)}
    terms = {"o": p @ np.abs(v), "lse": np.abs(want["lse"]) + 1, "dq": scale * ds_terms @ np.abs(k),
             "dk": scale * np.einsum("bhij,bhid->bhjd", ds_terms, np.abs(q)),
             "dv": np.einsum("bhij,bhid->bhjd", p, np.abs(do))}
    return want, terms


def inputs(shape_q, shape_k, dtype, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal(shape_q).astype(np.float32).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal(shape_k).astype(np.float32).astype(dtype) for _ in range(2))
    return q, k, v, do


def errors(got: dict, want: dict, terms: dict) -> dict:
    """Each array's largest error, each value's over the magnitude of its terms (0 over 0: none)."""
    out = {}
    for n in want:
        err = np.abs(got[n].astype(np.float64) - want[n])
        assert not err[terms[n] == 0].any(), n
        out[n] = float((err / np.where(terms[n] == 0, 1, terms[n])).max(initial=0))
    return out


@pytest.mark.parametrize("tiles", TILES, ids=["warp4", "warp3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d_kv", [16, 64])
@pytest.mark.parametrize("lq, lk", [(1, 1), (6, 6), (37, 37), (9, 23), (23, 9)])
def test_forward_and_gradients_equal_float64_attention(tiles, dtype, causal, d_kv, lq, lk):
    q, k, v, do = inputs((2, 3, lq, d_kv), (2, 3, lk, d_kv), dtype, seed=lq * 100 + lk + d_kv)
    scale = 0.7 / np.sqrt(d_kv) * (3 if d_kv == 16 else 1)  # (some rows peaked: exp's range, not only its middle)
    kernels = cpu_kernels(dtype, d_kv, tiles)
    o, lse = ak.attention_forward(np, q, k, v, causal, scale, tiles, kernels)
    dq, dk, dv = ak.attention_backward(np, q, k, v, o, lse, do, causal, scale, tiles, kernels)
    assert o.dtype == dq.dtype == dk.dtype == dv.dtype == np.dtype(dtype) and lse.dtype == np.float32
    want, terms = reference(q, k, v, do, causal, scale)
    if causal and lk > lq:  # (keys past the last query: no query sees them, their gradients are 0)
        assert not dk[:, :, lq:].any() and not dv[:, :, lq:].any()
    err = errors({"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, want, terms)
    eps = 16 * np.finfo(np.float32).eps  # (float32 sums of a few dozen terms)
    tol = dict.fromkeys(err, 2 * eps) if dtype == "float32" else \
        {"o": 2.0 ** -8 + eps, "lse": eps, "dv": 2.0 ** -8 + eps, "dq": 2.0 ** -7 + eps, "dk": 2.0 ** -7 + eps}
    assert all(err[n] <= tol[n] for n in tol), {n: f"{e:.2e} (tolerance {tol[n]:.1e})" for n, e in err.items()}


def test_the_shared_memory_fits_an_h100_without_opting_in():
    """`shared_bytes` is what the source declares (its `__shared__` arrays, sized by the macros), and
    each kernel stays under 48 KiB for every d_kv up to 128 on `gpu_tiles`."""
    source = ak.ATTENTION_SOURCE
    for d_kv in (16, 64, 100, 128):
        tiles = ak.gpu_tiles(d_kv)
        macros = {"BLOCK_ROWS": tiles.warps * tiles.rows, "TILE": tiles.tile, "D_KV": d_kv}
        for name, size in ak.shared_bytes(d_kv, tiles).items():
            body = source[source.index(f"void {name}("):]
            body = body[:body.find("extern \"C\"", 1) if "extern \"C\"" in body[1:] else len(body)]
            floats = 0
            for dims in re.findall(r"__shared__ float [^;]+;", body):
                for array in re.findall(r"\w+((?:\[[^\]]+\])+)", dims):
                    n = 1
                    for dim in re.findall(r"\[([^\]]+)\]", array):
                        n *= eval(dim, {}, macros)  # noqa: S307  (the macros' arithmetic)
                    floats += n
            assert 4 * floats == size, (name, d_kv)
            assert size <= 48 * 1024, (name, d_kv, size)


def test_bad_inputs_are_refused_naming_them():
    z = np.zeros((1, 2, 3, 16), np.float32)
    with pytest.raises(ShapeError, match=r"q \[1, 2, 3, 16\], k \[1, 2, 3, 8\], v \[1, 2, 3, 16\]"):
        ak.attention_forward(np, z, np.zeros((1, 2, 3, 8), np.float32), z)
    with pytest.raises(ShapeError, match=r"must be \[batch, heads, length, d_kv\].*q \[2, 3, 16\]"):
        ak.attention_forward(np, z[0], z, z)
    with pytest.raises(ShapeError, match="no keys for 3 queries"):
        ak.attention_forward(np, z, z[:, :, :0], z[:, :, :0])
    with pytest.raises(DTypeError, match="q float32, k bfloat16, v float32"):
        ak.attention_forward(np, z, z.astype(BF16), z)
    with pytest.raises(DTypeError, match="all float32 or all bfloat16: got q float64"):
        ak.attention_forward(np, *[z.astype(np.float64)] * 3)
    with pytest.raises(ShapeError, match="C-contiguous"):
        ak.attention_forward(np, z, z, np.zeros((1, 2, 16, 3), np.float32).swapaxes(2, 3))
    o, lse = np.zeros_like(z), np.zeros((1, 2, 3), np.float32)
    with pytest.raises(ShapeError, match=r"attention backward: .* lse \[1, 2\]"):
        ak.attention_backward(np, z, z, z, o, lse[:, :, 0], z)


def test_empty_inputs_launch_nothing():
    def refuse(*args):
        raise AssertionError("launched")
    kernels = dict.fromkeys(ak.ATTENTION_PARAMS, refuse)
    z = np.zeros((2, 0, 5, 16), np.float32)
    o, lse = ak.attention_forward(np, z, z, z, kernels=kernels)
    assert o.shape == z.shape and lse.shape == (2, 0, 5)
    q, kv = np.zeros((1, 2, 0, 16), np.float32), np.ones((1, 2, 4, 16), np.float32)
    dq, dk, dv = ak.attention_backward(np, q, kv, kv, q, np.zeros((1, 2, 0), np.float32), q, kernels=kernels)
    assert dq.shape == q.shape and dk.shape == kv.shape and not dk.any() and not dv.any()
