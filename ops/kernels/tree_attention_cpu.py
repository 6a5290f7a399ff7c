"""The verify step's attention on CPU: new tokens over their row's KV cache under a token tree.

``tree_attention_cpu.cpp`` (AVX-512, or AVX2 where the CPU has no AVX-512; see its header) computes, for each new token, attention
over its row's committed slots plus the tree-visible new slots, reading each key and value
once per KV head (GQA) under an online softmax. It replaces, in the decode step, torch's
fused attention over a dense ``(B, 1, T, S)`` mask: that kernel read every row up to the
longest row's length and, at 64 rows on a 256-token cache, read the cache at about 6 GB/s.

Its ops: ``torch.ops.treeserve_attn.write_kv`` stores the new tokens' K/V in the cache in
place, and ``torch.ops.treeserve_attn.tree_decode(q, keys, values, lengths, tree_mask)``, whose
shapes are those of :mod:`treeserve.ops.tree_attention` with ``q`` laid out ``(B, T, H, hd)``
(before the head transpose) and the result ``(B, T, H * hd)`` (after it). It is built once per
machine (:mod:`cpp_build`). :func:`available` says whether this CPU and machine can run it;
where they cannot, the decode step keeps torch's attention.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from treeserve.ops.kernels import cpp_build

SOURCE = Path(__file__).with_name("tree_attention_cpu.cpp")
FLAGS = cpp_build.AVX512
BF16_FLAGS = ("-mavx512bf16",)
"""Added where the CPU has AVX512-BF16: bfloat16 attention with a head size that is a multiple of
32 then multiplies queries by keys in bf16 pairs (``attend_item_bf16``), without widening them."""
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")
"""Added where the CPU also has AMX-BF16 (used only where Linux grants this process the tiles):
bfloat16 trees of more query rows per KV group than one vector item takes run on tiles
(``attend_tiles``: a 16-node tree of the default model and larger)."""
MAX_HEAD_DIM = 128
MAX_GROUP = 16
"""The most query heads per KV head (one item's rows; more would need the group split)."""
DTYPES = (torch.float32, torch.bfloat16)

_loaded: bool | None = None


def _shape(q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, tree_mask: Tensor) -> Tensor:
    batch, num_new, heads, head_dim = q.shape
    return q.new_empty((batch, num_new, heads * head_dim))


def _write_kv_shape(keys: Tensor, values: Tensor, new_keys: Tensor, new_values: Tensor, lengths: Tensor) -> None:
    return None


def _flags() -> tuple[str, ...] | None:
    flags = cpp_build.cpu_flags()
    chosen = cpp_build.simd16_flags()
    if chosen == FLAGS and "avx512_bf16" in flags:
        chosen = (*FLAGS, *BF16_FLAGS)
        if {"amx_tile", "amx_bf16"} <= flags:  # many new tokens on tiles, where the OS grants them
            chosen = (*chosen, *AMX_FLAGS)
    return chosen


def available() -> bool:
    """True when the kernel is built and loaded (a CPU with AVX-512, or AVX2 and FMA, and a C++
    compiler)."""
    global _loaded
    if _loaded is None:
        _loaded = cpp_build.load_ops(SOURCE, _flags, {"treeserve_attn::tree_decode": _shape,
                                                      "treeserve_attn::write_kv": _write_kv_shape})
    return _loaded


def loaded() -> bool:
    """True once :func:`available` has loaded the kernel (a plain read, for traced code)."""
    return _loaded is True


def fits(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """True when attention of these shapes can run on the loaded kernel: CPU, float32 or
    bfloat16, ``head_dim <= 128``, at most 16 query heads per KV head (plain reads only, so
    traced code calls it too; :func:`available` must have run)."""
    return (loaded() and device.type == "cpu" and dtype in DTYPES and head_dim <= MAX_HEAD_DIM
            and heads // kv_heads <= MAX_GROUP)


def supports(q: Tensor, kv_heads: int) -> bool:
    """True when queries like ``q`` ``(B, T, H, hd)`` over ``kv_heads`` KV heads can run here
    (:func:`fits`, after loading the kernel if it can be)."""
    return available() and fits(q.device, q.dtype, q.shape[2], kv_heads, q.shape[3])


def tree_decode(q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, tree_mask: Tensor) -> Tensor:
    """Attention ``(B, T, H * hd)`` of new-token queries ``q`` ``(B, T, H, hd)`` over the cache
    ``keys``/``values`` ``(B, n_kv, C, hd)``: token ``t`` of row ``b`` sees slots
    ``[0, lengths[b])`` and slot ``lengths[b] + s`` iff ``tree_mask[b, t, s]``. The new tokens'
    K/V must already be written. Call only where :func:`supports` is True."""
    result: Tensor = torch.ops.treeserve_attn.tree_decode(q, keys, values, lengths, tree_mask)
    return result


def write_kv(keys: Tensor, values: Tensor, new_keys: Tensor, new_values: Tensor, lengths: Tensor) -> None:
    """Store new tokens' ``new_keys``/``new_values`` ``(B, T, n_kv, hd)`` at cache slots
    ``lengths[b] + t`` of ``keys``/``values`` ``(B, n_kv, C, hd)``, in place (a compiled graph
    keeps it in place; an indexed store there copies the whole cache)."""
    torch.ops.treeserve_attn.write_kv(keys, values, new_keys, new_values, lengths)
