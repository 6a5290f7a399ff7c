"""Fused CUDA tree attention (CuPy ``RawKernel``): ancestor mask from parents + softmax attention.

Same contract as :func:`treeserve.ops.tree_attention.tree_attention_from_parents`:
q ``(B, H, T, hd)``, k/v ``(B, n_kv, S, hd)`` with row ``b``'s committed prefix in
``[0, prefix_lengths[b])`` and its new tokens at ``[prefix_lengths[b], prefix_lengths[b] + T)``,
``parents`` ``(B, T)`` with ``-1`` for roots and ``parents[b, i] < i``. Returns ``(B, H, T, hd)``
in q's dtype. ``cupy`` is imported only when the function is called.

Design (simple on purpose, one thread block per (query token, head, row)):
1. Each thread takes key slots ``s`` in a stride. A slot is visible if it is committed
   (``s < L``) or it is new token ``j = s - L`` and ``j`` is the query ``t`` itself or one of its
   ancestors; since parents precede children, walking ``t -> parent -> ...`` while the node is
   ``>= j`` finds ``j`` iff it is an ancestor-or-self. Visible scores go to a float32 scratch
   row, hidden ones are ``-inf``.
2. Block reductions give the row max and the sum of ``exp(score - max)``.
3. Threads take output dims ``d`` and sum ``p[s] * v[s, d]`` over visible slots.
Everything is computed in float32; the self slot is always visible, so the max is finite.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

THREADS_PER_BLOCK = 128  # power of two: the tree reductions below halve it

KERNEL_SOURCE = r"""
extern "C" __global__
void tree_attention_fwd(const float* __restrict__ q,              // (B, H, T, D)
                        const float* __restrict__ k,              // (B, KVH, S, D)
                        const float* __restrict__ v,              // (B, KVH, S, D)
                        const int* __restrict__ prefix_lengths,   // (B,)
                        const int* __restrict__ parents,          // (B, T), -1 = root
                        float* __restrict__ scratch,              // (B, H, T, S) scores then probs
                        float* __restrict__ out,                  // (B, H, T, D)
                        const int H, const int KVH, const int T, const int S, const int D,
                        const float scale)
{
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int tid = threadIdx.x;
    const int nthreads = blockDim.x;
    const int kvh = h / (H / KVH);
    const int L = prefix_lengths[b];
    const int num_keys = L + T;  // host checks num_keys <= S

    extern __shared__ float smem[];
    float* q_s = smem;        // D floats
    float* red = smem + D;    // nthreads floats

    const long long row = ((long long)b * H + h) * T + t;
    const float* q_ptr = q + row * D;
    for (int d = tid; d < D; d += nthreads) q_s[d] = q_ptr[d];
    __syncthreads();

    const float* k_base = k + ((long long)b * KVH + kvh) * (long long)S * D;
    const float* v_base = v + ((long long)b * KVH + kvh) * (long long)S * D;
    const int* par = parents + (long long)b * T;
    float* p_row = scratch + row * (long long)S;

    // Pass 1: masked scores and the running max.
    float local_max = -INFINITY;
    for (int s = tid; s < num_keys; s += nthreads) {
        bool visible = s < L;
        if (!visible) {
            const int target = s - L;
            int node = t;
            while (node >= target) {
                if (node == target) { visible = true; break; }
                node = par[node];
            }
        }
        float score = -INFINITY;
        if (visible) {
            const float* k_ptr = k_base + (long long)s * D;
            float acc = 0.0f;
            for (int d = 0; d < D; ++d) acc += q_s[d] * k_ptr[d];
            score = acc * scale;
        }
        p_row[s] = score;
        local_max = fmaxf(local_max, score);
    }
    red[tid] = local_max;
    __syncthreads();
    for (int stride = nthreads / 2; stride > 0; stride >>= 1) {
        if (tid < stride) red[tid] = fmaxf(red[tid], red[tid + stride]);
        __syncthreads();
    }
    const float row_max = red[0];
    __syncthreads();  // everyone has read red[0] before it is reused

    // Pass 2: probabilities (unnormalised) and their sum.
    float local_sum = 0.0f;
    for (int s = tid; s < num_keys; s += nthreads) {
        const float score = p_row[s];
        const float p = (score == -INFINITY) ? 0.0f : expf(score - row_max);
        p_row[s] = p;
        local_sum += p;
    }
    red[tid] = local_sum;
    __syncthreads();  // also publishes the p_row writes to the whole block
    for (int stride = nthreads / 2; stride > 0; stride >>= 1) {
        if (tid < stride) red[tid] += red[tid + stride];
        __syncthreads();
    }
    const float inv_total = 1.0f / red[0];

    // Pass 3: weighted sum of values, one output dim per thread.
    float* out_ptr = out + row * D;
    for (int d = tid; d < D; d += nthreads) {
        float acc = 0.0f;
        for (int s = 0; s < num_keys; ++s) {
            const float p = p_row[s];
            if (p != 0.0f) acc += p * v_base[(long long)s * D + d];
        }
        out_ptr[d] = acc * inv_total;
    }
}
"""


def _load_kernel() -> Any:
    """Compile (CuPy caches compiled kernels on disk and per process) and return the RawKernel."""
    import cupy

    return cupy.RawKernel(KERNEL_SOURCE, "tree_attention_fwd")


def tree_attention_cuda(q: Tensor, k: Tensor, v: Tensor, prefix_lengths: Tensor, parents: Tensor) -> Tensor:
    """Fused tree attention on CUDA tensors; see the module docstring for the contract."""
    import cupy

    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        raise ValueError("tree_attention_cuda needs CUDA tensors")
    batch, num_heads, num_new, head_dim = q.shape
    _, num_kv_heads, num_slots, _ = k.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if parents.shape != (batch, num_new):
        raise ValueError(f"parents must be (B, T) = {(batch, num_new)}, got {tuple(parents.shape)}")
    index = torch.arange(num_new, device=parents.device)
    if bool(((parents >= index) | (parents < -1)).any()):
        raise ValueError("parents[i] must be -1 or an earlier node index (< i)")
    if int(prefix_lengths.max()) + num_new > num_slots:
        raise ValueError(f"k/v hold {num_slots} slots but prefix+new tokens need more")

    qf = q.float().contiguous()
    kf = k.float().contiguous()
    vf = v.float().contiguous()
    lengths32 = prefix_lengths.to(device=q.device, dtype=torch.int32).contiguous()
    parents32 = parents.to(device=q.device, dtype=torch.int32).contiguous()
    scratch = torch.empty((batch, num_heads, num_new, num_slots), dtype=torch.float32, device=q.device)
    out = torch.empty_like(qf)

    kernel = _load_kernel()
    shared_bytes = (head_dim + THREADS_PER_BLOCK) * 4
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(q.device).cuda_stream)
    with cupy.cuda.Device(q.device.index or 0), stream:
        kernel(
            (num_new, num_heads, batch),
            (THREADS_PER_BLOCK,),
            (
                cupy.asarray(qf), cupy.asarray(kf), cupy.asarray(vf),
                cupy.asarray(lengths32), cupy.asarray(parents32),
                cupy.asarray(scratch), cupy.asarray(out),
                cupy.int32(num_heads), cupy.int32(num_kv_heads), cupy.int32(num_new),
                cupy.int32(num_slots), cupy.int32(head_dim), cupy.float32(head_dim ** -0.5),
            ),
            shared_mem=shared_bytes,
        )
    return out.to(q.dtype)
