"""Every transformer block of the decode step in one C++ op (``decode_layers.cpp``), for the
q4_1 format on the AVX2 kernels.

The compiled step (:class:`~treeserve.ops.decode_step.DecodeStep`) spends a third of a
one-row step outside its kernels on a CPU of two cores: its Python wrapper calls ~330 fused
kernels and extern ops a step. ``torch.ops.treeserve_layers.run`` calls the same matrix and
attention ops from C++ and does the elementwise work between them itself, so the step needs
neither Python per op nor compiling. :func:`fits` says whether a model can take it: every block's
linears on the AVX2 ``q4_mm`` packing without biases or hooks (a tensor-parallel shard's
all-reduce keeps the compiled step), the tree-attention kernel loaded for its heads, bf16
activations. :func:`run` takes :func:`~treeserve.ops.decode_step.blocks_hidden`'s
arguments and returns its result.

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
FLAGS = avx2.FLAGS

_lock = threading.Lock()
_loaded: bool | None = None


def available() -> bool:
    """True when the op is built and loaded here (which needs the AVX2 matrix kernel and the
    CPU tree-attention kernel loaded first)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = False
            if avx2.loaded() and tree_attention_cpu.available():
                path = cpp_build.build(SOURCE, FLAGS)
                if path is not None:
                    torch.ops.load_library(str(path))  # registers treeserve_layers::run
                    _loaded = True
        return _loaded


def fits(model: torch.nn.Module) -> bool:
    """Whether ``model``'s blocks can run on the op (see the module docstring)."""
    from treeserve.ops.formats import Int4Linear
    from treeserve.ops.model import Block, Transformer

    model = cast(Transformer, model)
    config = model.config
    if model.dtype != torch.bfloat16 or model.device.type != "cpu":
        return False
    for module in model.layers:
        block = cast(Block, module)
        linears = (block.self_attn.qkv_proj, block.self_attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj)
        if not all(isinstance(m, Int4Linear) and m.avx2 and m.bias is None and m.amx_codes is not None
                   for m in linears):
            return False
        # A hook (tensor parallelism's all-reduce after o_proj and down_proj) would not run.
        if any(m._forward_hooks or m._forward_pre_hooks for m in block.modules()):
            return False
    # Built only now, for a model that can take it: an AVX-512 CPU (its linears on the AMX
    # kernel's paths) never compiles it.
    return available() and tree_attention_cpu.fits(model.device, model.dtype, config.num_heads, config.num_kv_heads,
                                                    config.head_dim)


def weights(model: torch.nn.Module) -> list[Tensor]:
    """The op's ``weights`` list for ``model`` (10 a block, then the final norm's): the linears'
    own buffers and the norms' weights in float32 (exact copies of their bf16 values)."""
    from treeserve.ops.formats import Int4Linear
    from treeserve.ops.model import Block, Transformer

    model = cast(Transformer, model)
    out: list[Tensor] = []
    for module in model.layers:
        block = cast(Block, module)
        out.append(block.input_layernorm.weight.detach().float().contiguous())
        for linear in (block.self_attn.qkv_proj, block.self_attn.o_proj):
            linear = cast(Int4Linear, linear)
            out += [cast(Tensor, linear.amx_codes), cast(Tensor, linear.amx_scales_zeros)]
        out.append(block.post_attention_layernorm.weight.detach().float().contiguous())
        for linear in (block.mlp.gate_up_proj, block.mlp.down_proj):
            linear = cast(Int4Linear, linear)
            out += [cast(Tensor, linear.amx_codes), cast(Tensor, linear.amx_scales_zeros)]
    out.append(model.norm.weight.detach().float().contiguous())
    return out


def run(model: torch.nn.Module, weight_list: list[Tensor], h: Tensor, positions: Tensor, tree_mask: Tensor,
        lengths: Tensor, keys: list[Tensor], values: list[Tensor]) -> Tensor:
    """The final-normed hidden states ``(B, T, D)`` of every block over ``h``, writing the new
    K/V at slots ``lengths[b] + t`` (the arguments of
    :func:`~treeserve.ops.decode_step.blocks_hidden`; ``weight_list`` from :func:`weights`)."""
    config = model.config  # type: ignore[attr-defined]
    out: Tensor = torch.ops.treeserve_layers.run(
        h, positions, tree_mask, lengths, keys, values, model.rope_cos, model.rope_sin, weight_list,  # type: ignore[attr-defined]
        config.num_heads, config.num_kv_heads, float(config.norm_eps))
    return out
