"""Fused attention on CuPy: softmax(scale * q k^T, causal or not) v by FlashAttention's tiling, each
way, where the heads and the length are whole on a rank (no op calls it). The forward pass never
stores the logits (online softmax over tiles, keeping each row's logsumexp); the backward pass
recomputes each tile's probabilities, with no atomics. Inputs: [batch, heads, length, d_kv]
float32 or bfloat16, d_kv <= 128, computed in float32. The CUDA source also compiles for the CPU,
where the tests check it. The kernels and tile sizes: docs/gpu_kernels.md.

>>> gpu_tiles(64), gpu_tiles(128).rows
(Tiles(warp=32, warps=4, rows=4, tile=32), 2)
>>> import numpy as np
>>> attention_forward(np, np.zeros((1, 2, 3, 200), np.float32), *[np.zeros((1, 2, 3, 200), np.float32)] * 2)
Traceback (most recent call last):
mpimesh.errors.ShapeError: attention: d_kv 200 is over 128 (q [1, 2, 3, 200])
"""
from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np

from ..backend import cached_kernel
from ..errors import DTypeError, ShapeError
from .rowwise import GPU_PRELUDE, PRELUDE_TYPES

MAX_D_KV = 128
DTYPES = ("float32", "bfloat16")


class Tiles(NamedTuple):
    """A block of `warps` warps of `warp` lanes (32 on a GPU, fewer in the CPU build); each warp takes
    `rows` query (or key) rows, the block streams the other side `tile` rows at a time."""

    warp: int = 32
    warps: int = 4
    rows: int = 4
    tile: int = 32

    def defines(self, d_kv: int) -> str:
        """The source's compile-time sizes for `d_kv`."""
        return (f"#define D_KV {d_kv}\n#define WARPS {self.warps}\n#define ROWS {self.rows}\n"
                f"#define TILE {self.tile}\n")


def gpu_tiles(d_kv: int) -> Tiles:
    """An H100/H200's blocks: 128 threads; 16 rows per block (8 past d_kv 64, for shared memory)."""
    return Tiles(rows=4 if d_kv <= 64 else 2)


def shared_bytes(d_kv: int, tiles: Tiles) -> Dict[str, int]:
    """Each kernel's static shared memory, in bytes (as `ATTENTION_SOURCE` declares it).

    >>> max(shared_bytes(64, gpu_tiles(64)).values()) <= 48 * 1024   # no opt-in needed
    True
    """
    block, t, padded = tiles.warps * tiles.rows, tiles.tile, d_kv + 1
    floats = {"mpimesh_attention_fwd": block * d_kv + t * padded + t * d_kv + block * t,
              "mpimesh_attention_bwd_delta": 0,
              "mpimesh_attention_bwd_dkdv": 2 * block * d_kv + 2 * t * padded + 2 * t + 2 * block * t,
              "mpimesh_attention_bwd_dq": 2 * block * d_kv + 2 * t * padded + block * t}
    return {k: 4 * n for k, n in floats.items()}


# `T` the stored dtype, `A` float (`rowwise.PRELUDE_TYPES`: `load`/`store` convert); `WARP`, `warp_max`,
# `warp_sum` and `NEG_INF` from the prelude; `D_KV`, `WARPS`, `ROWS`, `TILE` from `Tiles.defines`. Arrays
# are [bh, length, D_KV] (bh = batch * heads); `lse` and `delta` [bh, length]. A warp's lanes split the
# other side's rows of a tile (scores) or the D_KV columns (sums over the tile); a warp's rows of scores go
# through shared memory (`__syncwarp` between the writes and the reads).
ATTENTION_PARAMS = {
    "mpimesh_attention_fwd": "const T* q, const T* k, const T* v, T* o, float* lse, long long lq, long long lk, "
                             "float scale, int causal",
    "mpimesh_attention_bwd_delta": "const T* o, const T* dout, float* delta, long long rows",
    "mpimesh_attention_bwd_dkdv": "const T* q, const T* k, const T* v, const T* dout, const float* lse, "
                                  "const float* delta, T* dk, T* dv, long long lq, long long lk, float scale, "
                                  "int causal",
    "mpimesh_attention_bwd_dq": "const T* q, const T* k, const T* v, const T* dout, const float* lse, "
                                "const float* delta, T* dq, long long lq, long long lk, float scale, int causal",
}
ATTENTION_SOURCE = """
#define BLOCK_ROWS (WARPS * ROWS)
#define PER_LANE(n) (((n) + WARP - 1) / WARP)
#define WARP_LANE int warp = threadIdx.x / WARP, lane = threadIdx.x %% WARP;
#define SEES(i, j) ((j) < lk && (!causal || (j) <= (i)))

/* rows [r0, r0 + n) of a [length, D_KV] array into s[n][stride] as float (past the end: 0) */
__device__ __forceinline__ void tile_in(float* s, int stride, const T* x, long long r0, int n, long long length) {
  for (int e = threadIdx.x; e < n * D_KV; e += blockDim.x) {
    int r = e / D_KV, d = e %% D_KV;
    s[r * stride + d] = r0 + r < length ? load(x[(r0 + r) * D_KV + d]) : 0;
  }
}

__device__ __forceinline__ float dot(const float* a, const float* b) {
  float s = 0;
  for (int d = 0; d < D_KV; ++d) s += a[d] * b[d];
  return s;
}

extern "C" __global__ void mpimesh_attention_fwd(%(mpimesh_attention_fwd)s) {
  __shared__ float qs[BLOCK_ROWS][D_KV];
  __shared__ float ks[TILE][D_KV + 1];
  __shared__ float vs[TILE][D_KV];
  __shared__ float ps[BLOCK_ROWS][TILE];
  WARP_LANE
  long long blocks = (lq + BLOCK_ROWS - 1) / BLOCK_ROWS;
  long long bh = blockIdx.x / blocks, q0 = (blockIdx.x %% blocks) * BLOCK_ROWS;
  tile_in(&qs[0][0], D_KV, q + bh * lq * D_KV, q0, BLOCK_ROWS, lq);
  float m[ROWS], l[ROWS], acc[ROWS][PER_LANE(D_KV)];
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    m[r] = NEG_INF; l[r] = 0;
    #pragma unroll
    for (int c = 0; c < PER_LANE(D_KV); ++c) acc[r][c] = 0;
  }
  long long kend = causal && q0 + BLOCK_ROWS < lk ? q0 + BLOCK_ROWS : lk;
  for (long long k0 = 0; k0 < kend; k0 += TILE) {
    __syncthreads();  /* (the last tile read by every warp) */
    tile_in(&ks[0][0], D_KV + 1, k + bh * lk * D_KV, k0, TILE, lk);
    tile_in(&vs[0][0], D_KV, v + bh * lk * D_KV, k0, TILE, lk);
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      int row = warp * ROWS + r;
      long long i = q0 + row;
      float s[PER_LANE(TILE)], top = NEG_INF;
      #pragma unroll
      for (int t = 0; t < PER_LANE(TILE); ++t) {
        int j = lane + t * WARP;
        s[t] = j < TILE && SEES(i, k0 + j) ? scale * dot(qs[row], ks[j]) : NEG_INF;
        top = s[t] > top ? s[t] : top;
      }
      top = warp_max(top);
      float mnew = top > m[r] ? top : m[r];
      float shift = mnew == NEG_INF ? 0 : mnew;  /* (no key seen yet: every p is 0) */
      float alpha = exp(m[r] - shift), sum = 0;
      #pragma unroll
      for (int t = 0; t < PER_LANE(TILE); ++t) {
        int j = lane + t * WARP;
        float p = exp(s[t] - shift);
        if (j < TILE) ps[row][j] = p;
        sum += p;
      }
      l[r] = l[r] * alpha + warp_sum(sum);
      m[r] = mnew;
      __syncwarp();
      #pragma unroll
      for (int c = 0; c < PER_LANE(D_KV); ++c) {
        int d = lane + c * WARP;
        float a = acc[r][c] * alpha;
        if (d < D_KV)
          for (int j = 0; j < TILE; ++j) a += ps[row][j] * vs[j][d];
        acc[r][c] = a;
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    long long i = q0 + warp * ROWS + r;
    if (i >= lq) continue;
    T* orow = o + (bh * lq + i) * D_KV;
    #pragma unroll
    for (int c = 0; c < PER_LANE(D_KV); ++c) {
      int d = lane + c * WARP;
      if (d < D_KV) orow[d] = store(acc[r][c] / l[r]);
    }
    if (lane == 0) lse[bh * lq + i] = m[r] + log(l[r]);
  }
}

extern "C" __global__ void mpimesh_attention_bwd_delta(%(mpimesh_attention_bwd_delta)s) {
  WARP_LANE
  long long row = (long long)blockIdx.x * WARPS + warp;
  float s = 0;
  if (row < rows)
    for (int d = lane; d < D_KV; d += WARP) s += load(o[row * D_KV + d]) * load(dout[row * D_KV + d]);
  s = warp_sum(s);
  if (row < rows && lane == 0) delta[row] = s;
}

/* the block's BLOCK_ROWS keys; the queries stream through, TILE at a time */
extern "C" __global__ void mpimesh_attention_bwd_dkdv(%(mpimesh_attention_bwd_dkdv)s) {
  __shared__ float ks[BLOCK_ROWS][D_KV];
  __shared__ float vs[BLOCK_ROWS][D_KV];
  __shared__ float qs[TILE][D_KV + 1];
  __shared__ float dos[TILE][D_KV + 1];
  __shared__ float ls[TILE], ds[TILE];
  __shared__ float ps[BLOCK_ROWS][TILE];
  __shared__ float dss[BLOCK_ROWS][TILE];
  WARP_LANE
  long long blocks = (lk + BLOCK_ROWS - 1) / BLOCK_ROWS;
  long long bh = blockIdx.x / blocks, k0 = (blockIdx.x %% blocks) * BLOCK_ROWS;
  tile_in(&ks[0][0], D_KV, k + bh * lk * D_KV, k0, BLOCK_ROWS, lk);
  tile_in(&vs[0][0], D_KV, v + bh * lk * D_KV, k0, BLOCK_ROWS, lk);
  float dk_acc[ROWS][PER_LANE(D_KV)], dv_acc[ROWS][PER_LANE(D_KV)];
  #pragma unroll
  for (int r = 0; r < ROWS; ++r)
    #pragma unroll
    for (int c = 0; c < PER_LANE(D_KV); ++c) dk_acc[r][c] = dv_acc[r][c] = 0;
  for (long long i0 = causal ? k0 / TILE * TILE : 0; i0 < lq; i0 += TILE) {
    __syncthreads();
    tile_in(&qs[0][0], D_KV + 1, q + bh * lq * D_KV, i0, TILE, lq);
    tile_in(&dos[0][0], D_KV + 1, dout + bh * lq * D_KV, i0, TILE, lq);
    for (int e = threadIdx.x; e < TILE; e += blockDim.x) {
      ls[e] = i0 + e < lq ? lse[bh * lq + i0 + e] : 0;
      ds[e] = i0 + e < lq ? delta[bh * lq + i0 + e] : 0;
    }
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      int row = warp * ROWS + r;
      long long j = k0 + row;
      #pragma unroll
      for (int t = 0; t < PER_LANE(TILE); ++t) {
        int i = lane + t * WARP;
        if (i >= TILE) continue;
        float p = i0 + i < lq && SEES(i0 + i, j) ? exp(scale * dot(qs[i], ks[row]) - ls[i]) : 0;
        ps[row][i] = p;
        dss[row][i] = p * (dot(dos[i], vs[row]) - ds[i]);
      }
      __syncwarp();
      #pragma unroll
      for (int c = 0; c < PER_LANE(D_KV); ++c) {
        int d = lane + c * WARP;
        if (d >= D_KV) continue;
        float a = dv_acc[r][c], b = dk_acc[r][c];
        for (int i = 0; i < TILE; ++i) {
          a += ps[row][i] * dos[i][d];
          b += dss[row][i] * qs[i][d];
        }
        dv_acc[r][c] = a;
        dk_acc[r][c] = b;
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    long long j = k0 + warp * ROWS + r;
    if (j >= lk) continue;
    #pragma unroll
    for (int c = 0; c < PER_LANE(D_KV); ++c) {
      int d = lane + c * WARP;
      if (d >= D_KV) continue;
      dk[(bh * lk + j) * D_KV + d] = store(scale * dk_acc[r][c]);
      dv[(bh * lk + j) * D_KV + d] = store(dv_acc[r][c]);
    }
  }
}

/* the block's BLOCK_ROWS queries; the keys stream through, TILE at a time */
extern "C" __global__ void mpimesh_attention_bwd_dq(%(mpimesh_attention_bwd_dq)s) {
  __shared__ float qs[BLOCK_ROWS][D_KV];
  __shared__ float dos[BLOCK_ROWS][D_KV];
  __shared__ float ks[TILE][D_KV + 1];
  __shared__ float vs[TILE][D_KV + 1];
  __shared__ float dss[BLOCK_ROWS][TILE];
  WARP_LANE
  long long blocks = (lq + BLOCK_ROWS - 1) / BLOCK_ROWS;
  long long bh = blockIdx.x / blocks, q0 = (blockIdx.x %% blocks) * BLOCK_ROWS;
  tile_in(&qs[0][0], D_KV, q + bh * lq * D_KV, q0, BLOCK_ROWS, lq);
  tile_in(&dos[0][0], D_KV, dout + bh * lq * D_KV, q0, BLOCK_ROWS, lq);
  float acc[ROWS][PER_LANE(D_KV)], lr[ROWS], dr[ROWS];
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    long long i = q0 + warp * ROWS + r;
    lr[r] = i < lq ? lse[bh * lq + i] : 0;
    dr[r] = i < lq ? delta[bh * lq + i] : 0;
    #pragma unroll
    for (int c = 0; c < PER_LANE(D_KV); ++c) acc[r][c] = 0;
  }
  long long kend = causal && q0 + BLOCK_ROWS < lk ? q0 + BLOCK_ROWS : lk;
  for (long long k0 = 0; k0 < kend; k0 += TILE) {
    __syncthreads();
    tile_in(&ks[0][0], D_KV + 1, k + bh * lk * D_KV, k0, TILE, lk);
    tile_in(&vs[0][0], D_KV + 1, v + bh * lk * D_KV, k0, TILE, lk);
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      int row = warp * ROWS + r;
      long long i = q0 + row;
      #pragma unroll
      for (int t = 0; t < PER_LANE(TILE); ++t) {
        int j = lane + t * WARP;
        if (j >= TILE) continue;
        float p = i < lq && SEES(i, k0 + j) ? exp(scale * dot(qs[row], ks[j]) - lr[r]) : 0;
        dss[row][j] = p * (dot(dos[row], vs[j]) - dr[r]);
      }
      __syncwarp();
      #pragma unroll
      for (int c = 0; c < PER_LANE(D_KV); ++c) {
        int d = lane + c * WARP;
        if (d >= D_KV) continue;
        float a = acc[r][c];
        for (int j = 0; j < TILE; ++j) a += dss[row][j] * ks[j][d];
        acc[r][c] = a;
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    long long i = q0 + warp * ROWS + r;
    if (i >= lq) continue;
    #pragma unroll
    for (int c = 0; c < PER_LANE(D_KV); ++c) {
      int d = lane + c * WARP;
      if (d < D_KV) dq[(bh * lq + i) * D_KV + d] = store(scale * acc[r][c]);
    }
  }
}
""" % ATTENTION_PARAMS


def source(dtype: str, d_kv: int, tiles: Tiles) -> str:
    """`ATTENTION_SOURCE` for `dtype` and `d_kv`, less the prelude of warp reductions (the GPU's in
    `_compiled`; a CPU build brings its own)."""
    return tiles.defines(d_kv) + PRELUDE_TYPES[dtype] + ATTENTION_SOURCE


def _compiled(xp, dtype: str, d_kv: int, tiles: Tiles) -> dict:
    """`{name: kernel}` of the source for `dtype`, `d_kv` and `tiles`, compiled by NVRTC on first use."""
    key = (dtype, d_kv, tiles)
    return cached_kernel(("attention",) + key, lambda: _compile(xp, *key))


def _compile(xp, dtype: str, d_kv: int, tiles: Tiles) -> dict:
    module = xp.RawModule(code=GPU_PRELUDE + source(dtype, d_kv, tiles))
    return {name: module.get_function(name) for name in ATTENTION_PARAMS}


def _check(q, k, v) -> Tuple[int, int, int, int, int]:
    """(batch, heads, query length, key length, d_kv) of q, k, v, or a ShapeError or DTypeError."""
    named = [f"{n} {list(a.shape)}" for n, a in zip("qkv", (q, k, v))]
    shapes = ", ".join(named)
    if any(a.ndim != 4 for a in (q, k, v)) or k.shape != v.shape or q.shape[:2] != k.shape[:2] \
            or q.shape[3] != k.shape[3]:
        raise ShapeError(f"attention: q, k and v must be [batch, heads, length, d_kv], k and v alike, the "
                         f"batch, heads and d_kv of all three alike: got {shapes}")
    b, h, lq, d = q.shape
    if d > MAX_D_KV:
        raise ShapeError(f"attention: d_kv {d} is over {MAX_D_KV} ({named[0]})")
    if lq > 0 and k.shape[2] == 0:
        raise ShapeError(f"attention: no keys for {lq} queries ({shapes})")
    dtypes = {a.dtype.name for a in (q, k, v)}
    if len(dtypes) != 1 or dtypes.pop() not in DTYPES:
        raise DTypeError(f"attention: q, k and v must be all float32 or all bfloat16: got "
                         f"{', '.join(f'{n} {a.dtype}' for n, a in zip('qkv', (q, k, v)))}")
    if not all(a.flags.c_contiguous for a in (q, k, v)):
        raise ShapeError(f"attention: q, k and v must be C-contiguous ({shapes})")
    return b, h, lq, k.shape[2], d


def _grid(rows: int, bh: int, tiles: Tiles) -> tuple:
    return (bh * -(-rows // (tiles.warps * tiles.rows)),), (tiles.warps * tiles.warp,)


def attention_forward(xp, q, k, v, causal: bool = False, scale: Optional[float] = None,
                      tiles: Optional[Tiles] = None, kernels: Optional[dict] = None) -> tuple:
    """`(o, lse)`: softmax(scale * q k^T) v, masked where `causal` (query i sees keys 0..i), and the
    logsumexp of each row of scaled logits (float32, [batch, heads, query length]) for the backward.
    `scale` defaults to 1/sqrt(d_kv); `tiles` to `gpu_tiles(d_kv)`; `kernels` to the compiled source."""
    b, h, lq, lk, d = _check(q, k, v)
    scale = 1 / math.sqrt(d) if scale is None else scale
    tiles = tiles or gpu_tiles(d)
    o, lse = xp.empty(q.shape, q.dtype), xp.empty((b, h, lq), np.float32)
    if o.size:
        kernels = kernels or _compiled(xp, q.dtype.name, d, tiles)
        kernels["mpimesh_attention_fwd"](*_grid(lq, b * h, tiles), (q, k, v, o, lse, np.int64(lq), np.int64(lk),
                                                                     np.float32(scale), np.int32(causal)))
    return o, lse


def attention_backward(xp, q, k, v, o, lse, do, causal: bool = False, scale: Optional[float] = None,
                       tiles: Optional[Tiles] = None, kernels: Optional[dict] = None) -> tuple:
    """`(dq, dk, dv)` of `attention_forward`'s `(o, lse)` for the output's gradient `do` (o's shape
    and dtype, C-contiguous), the same `causal` and `scale`."""
    b, h, lq, lk, d = _check(q, k, v)
    if do.shape != q.shape or o.shape != q.shape or do.dtype != q.dtype or lse.shape != (b, h, lq) \
            or not (do.flags.c_contiguous and o.flags.c_contiguous and lse.flags.c_contiguous):
        raise ShapeError(f"attention backward: o and do must be C-contiguous like q {list(q.shape)} {q.dtype}, lse "
                         f"[{b}, {h}, {lq}]: got o {list(o.shape)} {o.dtype}, do {list(do.shape)} {do.dtype}, "
                         f"lse {list(lse.shape)}")
    scale = 1 / math.sqrt(d) if scale is None else scale
    tiles = tiles or gpu_tiles(d)
    dq, dk, dv = xp.empty(q.shape, q.dtype), xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)
    if dq.size == 0:
        return dq, dk, dv
    kernels = kernels or _compiled(xp, q.dtype.name, d, tiles)
    delta = xp.empty((b, h, lq), np.float32)
    kernels["mpimesh_attention_bwd_delta"]((-(-b * h * lq // tiles.warps),), (tiles.warps * tiles.warp,),
                                           (o, do, delta, np.int64(b * h * lq)))
    common = (lse, delta)
    kernels["mpimesh_attention_bwd_dkdv"](*_grid(lk, b * h, tiles), (q, k, v, do, *common, dk, dv, np.int64(lq),
                                                                     np.int64(lk), np.float32(scale), np.int32(causal)))
    kernels["mpimesh_attention_bwd_dq"](*_grid(lq, b * h, tiles), (q, k, v, do, *common, dq, np.int64(lq),
                                                                   np.int64(lk), np.float32(scale), np.int32(causal)))
    return dq, dk, dv
