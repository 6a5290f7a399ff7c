"""Every transformer block in one C++ op (``decode_layers.cpp``): the forward of the formats of
GGUF blocks (q4_1, and gguf's mix of 4-bit and 8-bit codes) on CPUs with AVX2, for every shape serving runs (a decode step, a token tree, a batch of rows, a
prefill of any length), with one answer per row.

``torch.ops.treeserve_layers.run`` computes each row of its input the same way whatever else
shares the call: the products (4-bit or 8-bit codes, each linear on its own kernel) quantize
each row on its own and sum exact int32 dots per group (the AVX2 kernels, or those of
``q4_amx.cpp`` on AVX512-VNNI: :func:`kernel_of`); the norms,
RoPE, SiLU and residual adds work row by row in a fixed order; and the attention sums over each
token's visible keys in an order fixed by their place in its own sequence (see the .cpp). So a
token's logits are the same bits in a one-token step, a chain, a tree, a batch of 64 rows or a
prefill, and speculation, batching and prefill chunking never change a greedy answer
(``tests/ops/test_row_invariance.py``). The op has two builds, AVX-512 (on hosts with it) and
AVX2 (:func:`flags`), which compute the same bits (a test compares them); its products are
those of the host's kernel (each path's invariance is tested, not their agreement with each
other).

``torch.ops.treeserve_layers.attend`` runs one layer's attention alone, as ``run`` does (for
``tests/ops/test_decode_layers_attention.py`` and ``bench/attention_kernel.py``).

It also spares the compiled step's Python wrapper (~330 calls a step), so q4_1 needs neither
Python per op nor compiling. :func:`fits` says whether a model can take it: every block's
linears on the ``q4_amx`` packing with one of the two int8-row kernels or on ``codes8``'s (on the
same CPU's kernels), without biases but Q/K/V's (Qwen2's), without hooks
(a tensor-parallel shard's all-reduce keeps the compiled step), bf16 activations, a head size
that is a multiple of 16 (at most 256) and at most 16 query heads per KV head; Gemma 3's sliding
windows, local rope, output norms, GELU and attention scale are the op's too. :func:`run` takes
:func:`~treeserve.ops.decode_step.blocks_hidden`'s arguments and returns its result.

Built once per machine (:mod:`cpp_build`) after the ops it calls are loaded.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import cast

import torch
from torch import Tensor

from treeserve.ops.kernels import avx2, cpp_build, tree_attention_cpu

SOURCE = Path(__file__).with_name("decode_layers.cpp")
AVX2_FLAGS = (*avx2.FLAGS, "-ffp-contract=off")
AVX512_FLAGS = (*cpp_build.AVX512, "-mfma", "-mf16c", "-ffp-contract=off")
"""The op's two builds: its attention's 16-lane vectors are two ymm halves or one zmm register,
added in the same order either way, so both compute the same bits; no contraction of scalar
multiply-adds into FMAs at the compiler's choice (its vector FMAs are written out)."""
MAX_HEAD_DIM = 256
MAX_GROUP = 16
"""The op's limits: the head size (a multiple of 16) and the query heads per KV head."""


def flags() -> tuple[str, ...]:
    """The build this CPU runs (as :func:`cpp_build.cpu_flags` shows it: ``TREESERVE_ISA=avx2``
    picks the AVX2 build on an AVX-512 host)."""
    return AVX512_FLAGS if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpp_build.cpu_flags() else AVX2_FLAGS

_lock = threading.Lock()
_loaded: bool | None = None


def available() -> bool:
    """True when the op is built and loaded here (a CPU with AVX2, FMA and F16C, where the AVX2
    matrix kernel and the CPU tree-attention kernel, whose ``write_kv`` it calls, load, and a
    C++ compiler)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = False
            if avx2.loaded() and tree_attention_cpu.available():
                path = cpp_build.build(SOURCE, flags())
                if path is not None:
                    torch.ops.load_library(str(path))  # registers treeserve_layers::run
                    _loaded = True
        return _loaded


def kernel_of(model: torch.nn.Module) -> int | None:
    """The op's ``kernel`` argument for ``model``'s linears: 0 where they run the AVX2 kernels,
    1 where they run ``q4_amx.cpp``'s int8 rows (AVX512-VNNI); None where they run neither
    (torch's int4 kernel, or bf16 rows on AMX tiles), or are not all alike."""
    from treeserve.ops.formats import Codes8Linear, Int4Linear
    from treeserve.ops.model import Block, Transformer

    model = cast(Transformer, model)
    kinds = set()
    for module in model.layers:
        block = cast(Block, module)
        qkv = block.self_attn.qkv_proj
        for m in (qkv, block.self_attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj):
            unbiased = m is qkv or m.bias is None  # the op adds Q/K/V's bias only
            if isinstance(m, Codes8Linear) and unbiased:
                kinds.add(0 if m.avx2 else 1)
            elif isinstance(m, Int4Linear) and m.amx_codes is not None and unbiased:
                kinds.add(0 if m.avx2 else 1 if m.int8_rows else None)
            else:
                return None
    return kinds.pop() if len(kinds) == 1 else None


def fits(model: torch.nn.Module) -> bool:
    """Whether ``model``'s blocks can run on the op (see the module docstring)."""
    from treeserve.ops.model import Block, Transformer

    model = cast(Transformer, model)
    config = model.config
    if model.dtype != torch.bfloat16 or model.device.type != "cpu" or kernel_of(model) is None:
        return False
    if config.head_dim % 16 or config.head_dim > MAX_HEAD_DIM or config.num_heads // config.num_kv_heads > MAX_GROUP:
        return False
    for module in model.layers:
        # A hook (tensor parallelism's all-reduce after o_proj and down_proj) would not run.
        if any(m._forward_hooks or m._forward_pre_hooks for m in cast(Block, module).modules()):
            return False
    # Built only now, for a model that can take it.
    return available()


def weights(model: torch.nn.Module) -> list[Tensor]:
    """The op's ``weights`` list for ``model`` (19 a block, then the final norm's): the linears'
    own buffers, three each, Q/K/V's bias (bf16, or empty), the Q and K head norms' weights (or
    empty), the attention's and the MLP's output norms' (Gemma's, or empty) and the norms' weights
    in float32 (exact copies of their bf16 values)."""
    from treeserve.ops.formats import Codes8Linear, Int4Linear
    from treeserve.ops.model import Block, Transformer

    def three(linear: torch.nn.Module) -> list[Tensor]:
        if isinstance(linear, Codes8Linear):
            return [linear.c8_codes, linear.c8_scales, linear.c8_zeros]
        linear = cast(Int4Linear, linear)
        return [cast(Tensor, linear.amx_codes), cast(Tensor, linear.amx_scales_zeros), _NO_MASK]

    model = cast(Transformer, model)
    out: list[Tensor] = []
    for module in model.layers:
        block = cast(Block, module)
        out.append(block.input_layernorm.weight.detach().float().contiguous())
        qkv_bias = block.self_attn.qkv_proj.bias
        out += three(block.self_attn.qkv_proj)
        out.append(_NO_MASK if qkv_bias is None else qkv_bias.detach().to(torch.bfloat16).contiguous())
        for norm in (block.self_attn.q_norm, block.self_attn.k_norm):  # Qwen3's per-head norms
            out.append(_NO_MASK if norm is None else norm.weight.detach().float().contiguous())
        out += three(block.self_attn.o_proj)
        out.append(block.post_attention_layernorm.weight.detach().float().contiguous())
        out += three(block.mlp.gate_up_proj) + three(block.mlp.down_proj)
        for norm in (block.attn_out_norm, block.mlp_out_norm):
            out.append(_NO_MASK if norm is None else norm.weight.detach().float().contiguous())
    out.append(model.norm.weight.detach().float().contiguous())
    return out


def run(model: torch.nn.Module, weight_list: list[Tensor], h: Tensor, positions: Tensor, tree_mask: Tensor | None,
        lengths: Tensor, keys: list[Tensor], values: list[Tensor], kernel: int) -> Tensor:
    """The final-normed hidden states ``(B, T, D)`` of every block over ``h``, writing the new
    K/V at slots ``lengths[b] + t`` (the arguments of
    :func:`~treeserve.ops.decode_step.blocks_hidden`, but ``tree_mask`` None for a causal chain
    of any length; ``weight_list`` from :func:`weights`, ``kernel`` from :func:`kernel_of`)."""
    from treeserve.ops.model import ACTIVATIONS  # the op's activation argument: an index in it

    config = model.config  # type: ignore[attr-defined]
    mask = _NO_MASK if tree_mask is None else tree_mask
    local = (model.rope_cos_local, model.rope_sin_local) if config.local_rope else (_NO_ROPE, _NO_ROPE)  # type: ignore[attr-defined]
    windows = [config.window(i) or 0 for i in range(config.num_layers)]
    out: Tensor = torch.ops.treeserve_layers.run(
        h, positions, mask, lengths, keys, values, model.rope_cos, model.rope_sin, *local, weight_list,  # type: ignore[attr-defined]
        windows, config.num_heads, config.num_kv_heads, config.ffn_dim, float(config.norm_eps), kernel,
        ACTIVATIONS.index(config.activation), float(config.attn_scale or 0.0))
    return out


_NO_MASK = torch.empty(0, dtype=torch.bool)
_NO_ROPE = torch.empty(0, dtype=torch.float32)
