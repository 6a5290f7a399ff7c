"""What the one C++ op of :mod:`~treeserve.ops.kernels.decode_layers` needs to know of a model:
whether its blocks can run on it (:func:`fits`), which product kernel its linears take
(:func:`kernel_of`), the op's weight list (:func:`weights`) and the call itself (:func:`run`).
The kernels know no model; this module joins them to :mod:`~treeserve.ops.model` and
:mod:`~treeserve.ops.formats` for :mod:`~treeserve.ops.decode_step`.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from treeserve.ops.linears import Codes8Linear, Int4Linear
from treeserve.ops.kernels import decode_layers
from treeserve.ops.model import Block, Transformer
from treeserve.ops.model_config import ACTIVATIONS


def kernel_of(model: torch.nn.Module) -> int | None:
    """The op's ``kernel`` argument for ``model``'s linears: 0 where they run the AVX2 kernels,
    1 where they run ``q4_amx.cpp``'s int8 rows (AVX512-VNNI); None where they run neither
    (torch's int4 kernel, or bf16 rows on AMX tiles), or are not all alike."""
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
    model = cast(Transformer, model)
    config = model.config
    if model.dtype != torch.bfloat16 or model.device.type != "cpu" or kernel_of(model) is None:
        return False
    if (config.head_dim % 16 or config.head_dim > decode_layers.MAX_HEAD_DIM
            or config.num_heads // config.num_kv_heads > decode_layers.MAX_GROUP):
        return False
    for module in model.layers:
        # A hook (tensor parallelism's all-reduce after o_proj and down_proj) would not run.
        if any(m._forward_hooks or m._forward_pre_hooks for m in cast(Block, module).modules()):
            return False
    # Built only now, for a model that can take it.
    return decode_layers.available()


def weights(model: torch.nn.Module) -> list[Tensor]:
    """The op's ``weights`` list for ``model`` (19 a block, then the final norm's): the linears'
    own buffers, three each, Q/K/V's bias (bf16, or empty), the Q and K head norms' weights (or
    empty), the attention's and the MLP's output norms' (Gemma's, or empty) and the norms' weights
    in float32 (exact copies of their bf16 values)."""
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
    config = model.config  # type: ignore[attr-defined]
    mask = _NO_MASK if tree_mask is None else tree_mask
    local = (model.rope_cos_local, model.rope_sin_local) if config.local_rope else (_NO_ROPE, _NO_ROPE)  # type: ignore[attr-defined]
    windows = [config.window(i) or 0 for i in range(config.num_layers)]
    out: Tensor = torch.ops.treeserve_layers.run(
        h, positions, mask, lengths, keys, values, model.rope_cos, model.rope_sin, *local, weight_list,  # type: ignore[attr-defined]
        windows, config.num_heads, config.num_kv_heads, config.ffn_dim, float(config.norm_eps), kernel,
        ACTIVATIONS.index(config.activation), float(config.attn_scale or 0.0))  # the activation: an index
    return out


_NO_MASK = torch.empty(0, dtype=torch.bool)
_NO_ROPE = torch.empty(0, dtype=torch.float32)
