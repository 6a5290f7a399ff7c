"""The verify step's attention on CUDA: a CuPy ``RawModule`` over the committed prefix and a
token tree given as ancestor bitmasks (FlexFlow Serve's layout).

Contract (the CPU twin is :func:`treeserve.ops.tree_attention.tree_attention_from_bits`):

* ``q`` ``(B, H, T, hd)``, any strides with ``hd`` contiguous (the model passes its
  ``(B, T, H, hd)`` projection transposed, read in place);
* ``k``, ``v`` ``(B, n_kv, C, hd)``, the cache's own storage (``hd`` contiguous, one set of
  strides for both): row ``b``'s committed prefix is slots ``[0, prefix_lengths[b])`` and its
  ``T`` new tokens follow it; ``H`` a multiple of ``n_kv`` (GQA: each KV head is read once per
  tile for all its query heads, never expanded);
* ``ancestor_bits`` ``(B, T)`` int64 read as uint64: bit ``j`` of word ``t`` is set iff new
  token ``t`` sees new token ``j`` (itself and its ancestors; at most 64 nodes). Bit ``t`` of
  word ``t`` must be set, so that every row has a visible key;
* float32, bfloat16 or float16, one dtype for all three; scores, the softmax and the sums in
  float32; returns ``(B, H, T, hd)`` in that dtype (a transposed view of ``(B, T, H, hd)``).

Design (flash-decoding for trees):

* A block owns one KV head of one row, ``ROWS`` query rows (a query row is one new token under
  one of the KV head's ``H / n_kv`` query heads) and one *split*, a run of the row's keys.
  It walks its keys in tiles of ``KEYS``: loads the tile's K and V into shared memory as
  float32, scores every (query row, key) pair, hides a key ``L + j`` from token ``t`` unless
  bit ``j`` of ``ancestor_bits[t]`` is set, and folds the tile into running (max, sum,
  accumulator) state with the online softmax's rescale. Nothing of size ``S`` is ever written.
* With one split the block writes the normalised output. With several (a long prefix and
  few blocks: the host picks enough splits to fill the GPU) each writes its unnormalised
  state, and ``tree_attention_combine`` merges the splits' states per output element.
* Any ``blockDim.x`` works (every loop strides by it, and barriers are the only
  synchronisation: no warp shuffles), so a CPU shim can run this source with emulated
  threads (``tests/ops/test_tree_attention_emulated.py``).

:func:`run_tree_attention` is the host side with the launcher left open (CuPy here, the CPU
shim in the tests), so the plan, strides, workspace and combine are the same code in both.
``cupy`` is imported only when a kernel runs on CUDA.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ROWS = 16
"""Query rows per block (the kernel source's ``ROWS``)."""
KEYS = 32
"""Keys per shared-memory tile (the kernel source's ``KEYS``)."""
THREADS_PER_BLOCK = 128
MAX_TREE_NODES = 64
"""New tokens per row: one 64-bit ancestor word each."""
MAX_HEAD_DIM = 256
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
MIN_TILES_PER_SPLIT = 4
"""A split walks at least this many key tiles, so its state write and the combine stay small
against its work."""

KERNEL_SOURCE = r"""
#define ROWS 16
#define KEYS 32
#ifndef INFINITY  // NVRTC includes no math.h
#define INFINITY __int_as_float(0x7f800000)
#endif

// Raw 16-bit float bits to float32, without cuda_bf16.h / cuda_fp16.h (NVRTC and the CPU shim
// compile the same lines).
__device__ __forceinline__ float bf16_bits_to_float(unsigned short x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

__device__ __forceinline__ float half_bits_to_float(unsigned short x) {
    const unsigned int sign = ((unsigned int)x & 0x8000u) << 16;
    const unsigned int exponent = ((unsigned int)x >> 10) & 0x1fu;
    const unsigned int mantissa = (unsigned int)x & 0x3ffu;
    if (exponent == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));  // inf, nan
    if (exponent == 0u) {  // zero or subnormal: mantissa * 2^-24
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

struct LoadF32 {
    typedef float T;
    static __device__ __forceinline__ float at(const float* p, long long i) { return p[i]; }
};
struct LoadBF16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float at(const unsigned short* p, long long i) { return bf16_bits_to_float(p[i]); }
};
struct LoadF16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float at(const unsigned short* p, long long i) { return half_bits_to_float(p[i]); }
};

// grid (num_splits, row_tiles * KVH, B); any blockDim.x. Dynamic shared memory: see tile_smem_bytes.
template <class Load>
__device__ __forceinline__ void tree_attention_tiles(
    const typename Load::T* __restrict__ q,          // (B, H, T, D) by the strides below
    const typename Load::T* __restrict__ k,          // (B, KVH, C, D) by the strides below
    const typename Load::T* __restrict__ v,          // same strides as k
    const int* __restrict__ prefix_lengths,          // (B,)
    const unsigned long long* __restrict__ ancestor_bits,  // (B, T)
    float* __restrict__ out,                         // (B, T, H, D), written when num_splits == 1
    float* __restrict__ partial_acc,                 // (B, H, T, num_splits, D), when num_splits > 1
    float* __restrict__ partial_ml,                  // (B, H, T, num_splits, 2): running max, sum
    const long long q_sb, const long long q_sh, const long long q_st,
    const long long kv_sb, const long long kv_sh, const long long kv_ss,
    const int H, const int KVH, const int T, const int D,
    const int tiles_per_split, const int num_splits, const float scale_log2)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned long long* bits_s = (unsigned long long*)smem_raw;  // ROWS: the row's ancestor word
    int* t_s = (int*)(bits_s + ROWS);                            // ROWS: its new token, -1 = padding
    float* q_s = (float*)(t_s + ROWS);                           // ROWS x D, scaled by scale * log2(e)
    float* k_s = q_s + ROWS * D;                                 // KEYS x (D + 1), padded: no bank conflicts
    float* v_s = k_s + KEYS * (D + 1);                           // KEYS x D
    float* p_s = v_s + KEYS * D;                                 // ROWS x KEYS: scores, then weights
    float* acc_s = p_s + ROWS * KEYS;                            // ROWS x D: unnormalised output
    float* m_s = acc_s + ROWS * D;                               // ROWS: running max (log2 units)
    float* l_s = m_s + ROWS;                                     // ROWS: running sum of weights
    float* alpha_s = l_s + ROWS;                                 // ROWS: this tile's rescale

    const int split = blockIdx.x;
    const int kvh = blockIdx.y % KVH;
    const int row0 = (blockIdx.y / KVH) * ROWS;
    const int b = blockIdx.z;
    const int tid = threadIdx.x;
    const int nthreads = blockDim.x;
    const int G = H / KVH;
    const int num_rows = G * T;  // query rows of this KV head: row = t * G + g
    const int L = prefix_lengths[b];
    const int num_keys = L + T;
    const int key_begin = split * tiles_per_split * KEYS;
    const int key_end = min(num_keys, key_begin + tiles_per_split * KEYS);

    for (int r = tid; r < ROWS; r += nthreads) {
        const int row = row0 + r;
        t_s[r] = row < num_rows ? row / G : -1;
        bits_s[r] = row < num_rows ? ancestor_bits[(long long)b * T + row / G] : 0ull;
        m_s[r] = -INFINITY;
        l_s[r] = 0.0f;
    }
    for (int i = tid; i < ROWS * D; i += nthreads) {
        const int r = i / D, d = i % D, row = row0 + r;
        float x = 0.0f;
        if (row < num_rows) {
            const int t = row / G, h = kvh * G + row % G;
            x = Load::at(q, (long long)b * q_sb + (long long)h * q_sh + (long long)t * q_st + d) * scale_log2;
        }
        q_s[i] = x;
        acc_s[i] = 0.0f;
    }
    const typename Load::T* k_base = k + (long long)b * kv_sb + (long long)kvh * kv_sh;
    const typename Load::T* v_base = v + (long long)b * kv_sb + (long long)kvh * kv_sh;

    for (int tile = key_begin; tile < key_end; tile += KEYS) {
        __syncthreads();  // the last tile's readers are done (and the setup above is published)
        const int n = min(KEYS, key_end - tile);
        for (int i = tid; i < KEYS * D; i += nthreads) {
            const int j = i / D, d = i % D;
            float kx = 0.0f, vx = 0.0f;
            if (j < n) {
                const long long at = (long long)(tile + j) * kv_ss + d;
                kx = Load::at(k_base, at);
                vx = Load::at(v_base, at);
            }
            k_s[j * (D + 1) + d] = kx;
            v_s[j * D + d] = vx;
        }
        __syncthreads();
        // Scores: committed keys are visible to every row, key L + j to token t iff bit j of its word.
        for (int i = tid; i < ROWS * KEYS; i += nthreads) {
            const int r = i / KEYS, j = i % KEYS, key = tile + j;
            const bool visible = j < n && t_s[r] >= 0 && (key < L || ((bits_s[r] >> (key - L)) & 1ull));
            float score = -INFINITY;
            if (visible) {
                const float* qr = q_s + r * D;
                const float* kr = k_s + j * (D + 1);
                float dot = 0.0f;
                for (int d = 0; d < D; ++d) dot += qr[d] * kr[d];
                score = dot;
            }
            p_s[i] = score;
        }
        __syncthreads();
        // Online softmax: fold the tile into each row's running max and sum.
        for (int r = tid; r < ROWS; r += nthreads) {
            float* pr = p_s + r * KEYS;
            float tile_max = -INFINITY;
            for (int j = 0; j < KEYS; ++j) tile_max = fmaxf(tile_max, pr[j]);
            const float m_old = m_s[r];
            const float m_new = fmaxf(m_old, tile_max);
            float alpha = 1.0f, sum = 0.0f;
            if (m_new == -INFINITY) {  // nothing visible yet: keep the state, add nothing
                for (int j = 0; j < KEYS; ++j) pr[j] = 0.0f;
            } else {
                alpha = exp2f(m_old - m_new);  // 0 while m_old is -inf
                for (int j = 0; j < KEYS; ++j) {
                    const float p = exp2f(pr[j] - m_new);  // hidden keys: exp2(-inf) = 0
                    pr[j] = p;
                    sum += p;
                }
            }
            m_s[r] = m_new;
            l_s[r] = l_s[r] * alpha + sum;
            alpha_s[r] = alpha;
        }
        __syncthreads();
        for (int i = tid; i < ROWS * D; i += nthreads) {  // each thread owns its acc_s elements
            const int r = i / D, d = i % D;
            const float* pr = p_s + r * KEYS;
            float acc = acc_s[i] * alpha_s[r];
            for (int j = 0; j < n; ++j) acc += pr[j] * v_s[j * D + d];
            acc_s[i] = acc;
        }
    }
    __syncthreads();
    for (int i = tid; i < ROWS * D; i += nthreads) {
        const int r = i / D, d = i % D, row = row0 + r;
        if (row >= num_rows) continue;
        const int t = row / G, h = kvh * G + row % G;
        if (num_splits == 1) {
            out[(((long long)b * T + t) * H + h) * D + d] = acc_s[i] / l_s[r];
        } else {
            const long long state = (((long long)b * H + h) * T + t) * num_splits + split;
            partial_acc[state * D + d] = acc_s[i];
            if (d == 0) {
                partial_ml[state * 2] = m_s[r];
                partial_ml[state * 2 + 1] = l_s[r];
            }
        }
    }
}

#define TREE_ATTENTION_ENTRY(NAME, LOAD)                                                          \
extern "C" __global__ void NAME(                                                                  \
    const LOAD::T* q, const LOAD::T* k, const LOAD::T* v, const int* prefix_lengths,              \
    const unsigned long long* ancestor_bits, float* out, float* partial_acc, float* partial_ml,   \
    long long q_sb, long long q_sh, long long q_st, long long kv_sb, long long kv_sh, long long kv_ss, \
    int H, int KVH, int T, int D, int tiles_per_split, int num_splits, float scale_log2) {        \
    tree_attention_tiles<LOAD>(q, k, v, prefix_lengths, ancestor_bits, out, partial_acc, partial_ml, \
        q_sb, q_sh, q_st, kv_sb, kv_sh, kv_ss, H, KVH, T, D, tiles_per_split, num_splits, scale_log2); \
}

TREE_ATTENTION_ENTRY(tree_attention_f32, LoadF32)
TREE_ATTENTION_ENTRY(tree_attention_bf16, LoadBF16)
TREE_ATTENTION_ENTRY(tree_attention_f16, LoadF16)

// Merge the splits' states: one thread per output element (b, t, h, d), any grid.
extern "C" __global__ void tree_attention_combine(
    const float* __restrict__ partial_acc,  // (B, H, T, num_splits, D)
    const float* __restrict__ partial_ml,   // (B, H, T, num_splits, 2)
    float* __restrict__ out,                // (B, T, H, D)
    const int H, const int T, const int D, const int num_splits, const long long total)
{
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int d = (int)(i % D);
        const long long state0 = (i / D) * num_splits;  // (b, h, t) row of the states
        const int t = (int)((i / D) % T);
        const long long bh = i / D / T;
        const int h = (int)(bh % H);
        const long long b = bh / H;
        float m = -INFINITY;
        for (int s = 0; s < num_splits; ++s) m = fmaxf(m, partial_ml[(state0 + s) * 2]);
        float numerator = 0.0f, denominator = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            const float w = exp2f(partial_ml[(state0 + s) * 2] - m);  // an empty split: exp2(-inf) = 0
            numerator += w * partial_acc[(state0 + s) * D + d];
            denominator += w * partial_ml[(state0 + s) * 2 + 1];
        }
        out[((b * T + t) * H + h) * D + d] = numerator / denominator;
    }
}
"""

KERNEL_NAMES = ("tree_attention_f32", "tree_attention_bf16", "tree_attention_f16", "tree_attention_combine")

PTR, I32, I64, F32 = "ptr", "i32", "i64", "f32"
TILE_SIGNATURE = (PTR,) * 8 + (I64,) * 6 + (I32,) * 6 + (F32,)
COMBINE_SIGNATURE = (PTR,) * 3 + (I32,) * 4 + (I64,)
COMBINE_THREADS = 256

Launch = Callable[[str, tuple[int, int, int], int, int, Sequence[tuple[str, Any]]], None]
"""``launch(kernel_name, grid, threads_per_block, shared_bytes, args)``, args as ``(kind, value)``
pairs: a kind of :data:`PTR` takes a tensor (its ``data_ptr``), the others a number."""


@dataclass(frozen=True)
class LaunchPlan:
    """How one call is cut into blocks: ``row_tiles`` blocks of :data:`ROWS` query rows per KV
    head and row, each of ``num_splits`` splits walking ``tiles_per_split`` key tiles."""

    row_tiles: int
    num_splits: int
    tiles_per_split: int

    def grid(self, batch: int, kv_heads: int) -> tuple[int, int, int]:
        return (self.num_splits, self.row_tiles * kv_heads, batch)


def plan_launch(batch: int, heads: int, kv_heads: int, num_new: int, max_keys: int, *, num_sms: int,
                num_splits: int | None = None) -> LaunchPlan:
    """The launch for rows of up to ``max_keys`` keys (longest prefix + ``num_new``): splits keys
    until the grid holds about two blocks per multiprocessor (``num_sms``), each split walking
    at least :data:`MIN_TILES_PER_SPLIT` tiles; ``num_splits`` forces a count (tests)."""
    row_tiles = -(-(heads // kv_heads) * num_new // ROWS)
    num_tiles = -(-max_keys // KEYS)
    if num_splits is None:
        blocks = row_tiles * kv_heads * batch
        wanted = -(-2 * num_sms // blocks)
        num_splits = max(1, min(wanted, num_tiles // MIN_TILES_PER_SPLIT))
    num_splits = max(1, min(num_splits, num_tiles))
    tiles_per_split = -(-num_tiles // num_splits)
    num_splits = -(-num_tiles // tiles_per_split)  # no split left without a tile
    return LaunchPlan(row_tiles, num_splits, tiles_per_split)


def tile_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one tile kernel block (the kernel's layout)."""
    floats = ROWS * head_dim + KEYS * (head_dim + 1) + KEYS * head_dim + ROWS * KEYS + ROWS * head_dim + 3 * ROWS
    return ROWS * 8 + ROWS * 4 + floats * 4


def check_inputs(q: Tensor, k: Tensor, v: Tensor, prefix_lengths: Tensor, ancestor_bits: Tensor) -> None:
    """``ValueError`` for shapes, dtypes or layouts the kernel does not take."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q must be (B, H, T, hd) and k, v (B, n_kv, C, hd) alike, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    batch, heads, num_new, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit q {tuple(q.shape)}")
    if heads % k.shape[1]:
        raise ValueError(f"num_heads {heads} must be a multiple of num_kv_heads {k.shape[1]}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype of {sorted(map(str, DTYPES))}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 1 <= num_new <= MAX_TREE_NODES:
        raise ValueError(f"the kernel takes 1 to {MAX_TREE_NODES} new tokens per row, got {num_new}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM}, got {head_dim}")
    if q.stride(3) != 1 or k.stride(3) != 1 or k.stride() != v.stride():
        raise ValueError("q, k and v need a contiguous head dim, and k and v one set of strides")
    if ancestor_bits.shape != (batch, num_new) or ancestor_bits.dtype != torch.int64:
        raise ValueError(f"ancestor_bits must be int64 (B, T) = {(batch, num_new)}, got "
                         f"{ancestor_bits.dtype} {tuple(ancestor_bits.shape)}")
    if prefix_lengths.shape != (batch,):
        raise ValueError(f"prefix_lengths must be (B,) = ({batch},), got {tuple(prefix_lengths.shape)}")


def run_tree_attention(
    q: Tensor, k: Tensor, v: Tensor, prefix_lengths: Tensor, ancestor_bits: Tensor, *, launch: Launch,
    num_sms: int, max_prefix_length: int | None = None, num_splits: int | None = None,
    threads_per_block: int = THREADS_PER_BLOCK,
) -> Tensor:
    """The host side of the kernel on ``launch`` (CuPy, or the tests' CPU shim): checks, plan,
    workspace, the tile kernel and, with several splits, the combine. See the module docstring
    for the contract. ``max_prefix_length`` (the longest ``prefix_lengths``, when the caller
    knows it) spares a device-to-host read."""
    check_inputs(q, k, v, prefix_lengths, ancestor_bits)
    batch, heads, num_new, head_dim = q.shape
    kv_heads, capacity = k.shape[1], k.shape[2]
    if max_prefix_length is None:
        max_prefix_length = int(prefix_lengths.max())
    if max_prefix_length + num_new > capacity:
        raise ValueError(f"k/v hold {capacity} slots but a prefix of {max_prefix_length} and {num_new} new tokens need more")
    plan = plan_launch(batch, heads, kv_heads, num_new, max_prefix_length + num_new, num_sms=num_sms,
                       num_splits=num_splits)
    lengths = prefix_lengths.to(device=q.device, dtype=torch.int32).contiguous()
    bits = ancestor_bits.to(q.device).contiguous()
    out = torch.empty((batch, num_new, heads, head_dim), dtype=torch.float32, device=q.device)  # (B, T, H, hd)
    states = batch * heads * num_new * plan.num_splits
    many = plan.num_splits > 1
    partial_acc = torch.empty((states * head_dim,) if many else (1,), dtype=torch.float32, device=q.device)
    partial_ml = torch.empty((states * 2,) if many else (1,), dtype=torch.float32, device=q.device)
    values = (q, k, v, lengths, bits, out, partial_acc, partial_ml,
              q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
              heads, kv_heads, num_new, head_dim, plan.tiles_per_split, plan.num_splits,
              head_dim ** -0.5 * math.log2(math.e))
    launch(f"tree_attention_{DTYPES[q.dtype]}", plan.grid(batch, kv_heads), threads_per_block,
           tile_smem_bytes(head_dim), tuple(zip(TILE_SIGNATURE, values)))
    if many:
        total = batch * num_new * heads * head_dim
        blocks = min(-(-total // COMBINE_THREADS), 4 * num_sms)
        launch("tree_attention_combine", (blocks, 1, 1), COMBINE_THREADS, 0, tuple(zip(
            COMBINE_SIGNATURE, (partial_acc, partial_ml, out, heads, num_new, head_dim, plan.num_splits, total))))
    return out.to(q.dtype).transpose(1, 2)  # (B, H, T, hd)


@functools.lru_cache(maxsize=None)
def _cupy_kernels(device_index: int) -> dict[str, Any]:
    """The compiled kernels on one device (CuPy also caches the binary on disk)."""
    import cupy

    with cupy.cuda.Device(device_index):  # compiled by NVRTC on first use, per device
        module = cupy.RawModule(code=KERNEL_SOURCE)
        return {name: module.get_function(name) for name in KERNEL_NAMES}


@functools.lru_cache(maxsize=None)
def _cupy_launch(device: torch.device) -> Launch:
    """The CuPy launcher of one device (kept: the model calls it once per layer)."""
    import cupy
    import numpy

    index = device.index if device.index is not None else torch.cuda.current_device()
    kernels = _cupy_kernels(index)
    # A pointer parameter is 8 bytes passed by value: CuPy packs a uint64 scalar as exactly
    # that, with none of the per-call cost of wrapping torch's memory in a cupy array.
    converters = {PTR: lambda tensor: numpy.uint64(tensor.data_ptr()), I32: numpy.int32, I64: numpy.int64,
                  F32: numpy.float32}

    def launch(name: str, grid: tuple[int, int, int], threads: int, shared_bytes: int,
               args: Sequence[tuple[str, Any]]) -> None:
        kernel = kernels[name]
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with cupy.cuda.Device(index), stream:
            if shared_bytes > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_bytes:
                kernel.max_dynamic_shared_size_bytes = shared_bytes  # opt in above the default 48 KiB
            kernel(grid, (threads,), tuple(converters[kind](value) for kind, value in args), shared_mem=shared_bytes)

    return launch


def tree_attention_cuda(q: Tensor, k: Tensor, v: Tensor, prefix_lengths: Tensor, ancestor_bits: Tensor, *,
                        max_prefix_length: int | None = None, num_splits: int | None = None) -> Tensor:
    """Tree attention on CUDA tensors with the CuPy kernels; see the module docstring."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        raise ValueError("tree_attention_cuda needs CUDA tensors")
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return run_tree_attention(q, k, v, prefix_lengths, ancestor_bits, launch=_cupy_launch(q.device), num_sms=num_sms,
                              max_prefix_length=max_prefix_length, num_splits=num_splits)
