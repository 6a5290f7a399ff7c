"""Weight formats: how a loaded model's linear layers store and multiply their weights.

A format is chosen at load time and applied to a float32 :class:`~treeserve.ops.model.Transformer`
by :func:`apply_format`, a transform in the manner of gpt-fast's ``quantize`` and this
project's ``apply_tp``: it fuses each block's Q/K/V projections into one ``qkv_proj`` and its
gate/up projections into one ``gate_up_proj`` (the state dict on disk keeps the Hugging Face
names), and swaps every linear, the LM head included, for the format's kernel.

=========== ============ ==================================================================
format      activations  weights and kernel (CPU)
=========== ============ ==================================================================
float32     float32      float32: ``kernels/dense_cpu`` (AVX-512 or AVX2; one summation
                         order at every row count), else ``F.linear``
bfloat16    bfloat16     bfloat16 prepacked for oneDNN (AMX/AVX512-BF16 on this CPU;
                         ``F.linear`` where oneDNN has no bf16, :func:`onednn_bf16`)
int8        bfloat16     int8 per output row (symmetric, bf16 scale), ``_weight_int8pack_mm``
q4_1        bfloat16     4-bit codes, group 32, bf16 scale and zero: ``kernels/q4_amx``
                         (int8 rows on AVX512-VNNI at every shape; without
                         AVX-512, int8 rows on AVX2, ``kernels/q_avx2.cpp``; the
                         whole forward in one op, ``kernels/decode_layers``), else
                         ``_weight_int4pack_mm_for_cpu``
gguf        bfloat16     each linear in its GGUF block type (``block_types``): Q4_0, Q4_1,
                         Q4_K on q4_1's kernels; Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 as int8
                         codes with float32 scales and zeros, ``kernels/codes8`` (int8
                         rows, the same one-op forward); Q/K/V of mixed types fused on
                         ``codes8``; from float weights, q4_1
=========== ============ ==================================================================

The int formats' LM head is Q8_0 (int8 codes, a float16 scale per 32, fp32 logits) on
``kernels/q8_amx``'s packing where its kernels run, else bfloat16: on every CPU with AVX2 the
int16-row kernel (``kernels/q_avx2.cpp``, faster than the AVX-512 fp32 path at every row count
measured), else that AVX-512 path.

**One set of weight values.** Every kernel of a format computes with the same weight values
at every shape (one token, a tree, a batch): a format never switches to another
representation by shape, so a server's speculative output equals its own incremental
decoding up to float summation order.

**One answer in q4_1.** Where its kernels run (x86 with AVX2 or AVX512-VNNI), q4_1 rounds
each group of 32 activations to int8 at every row count, so a row's products are the same bits
at every row count (AMX hosts too: the bf16 tile path, whose sums depend on the shape, is not
used), the Q8_0 head runs one kernel at every row count for the same reason, and every
forward runs the one op of ``kernels/decode_layers``, whose norms and attention do not depend
on the other rows either: greedy speculation, batching, prefill chunking and ``--compile`` give
the same tokens as incremental decoding, bit for bit (``tests/ops/test_row_invariance.py``).
The gguf format makes the same promise on the same kernels (``tests/ops/test_gguf_format.py``).
float32's products on ``kernels/dense_cpu`` sum in one order at every row count too (its
attention does not promise it yet); bfloat16 and int8 do not promise it: oneDNN's and torch's
GEMMs change their summation order with the row count. The unformatted float32 model
(``nn.Linear``, ``F.linear``) stays the reference of the tests.

**q4_1 and the GGUF.** A Q4_1 block of 32 weights is ``w = d * q + m`` with ``q`` in 0..15 and
``d, m`` float16. The int4 kernel computes ``(q - 8) * scale + zero`` with ``scale = d`` and
``zero = m + 8 d``, both held in bfloat16 (the kernel's scale dtype): the codes are the GGUF's
own, and each weight differs from the dequantized Q4_1 value only by the bf16 rounding of
``d`` and ``m + 8 d`` (relative 2^-9 of each). Weights that do not come from Q4_1 blocks
(float checkpoints) are quantized group-wise from float32.

**The head and the GGUF.** The default model's embedding is tied and Q8_0 in its GGUF:
``w = d * q``, ``q`` in -127..127, ``d`` float16 per 32. :func:`q8_0_from_float` quantizes as
llama.cpp does (``d = amax / 127``), which recovers those codes and scales exactly from the
dequantized weights (the largest code of a block is always 127), and the kernel multiplies by
``d * q`` unrounded: the head serves the GGUF's own values, where a bf16 head rounded them.
A tied embedding then reads its rows out of the head's packed codes, and an untied one out of
its own stored blocks packed once (:mod:`~treeserve.ops.embedding`, wherever they are the bf16
table's rows bit for bit, checked on every row): no bf16 table is held.

On CUDA, float32 and bfloat16 run ``F.linear`` on plain weights (cuBLAS); int8 and q4_1
refuse with :class:`FormatUnsupportedError`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import cast

import torch
from torch import Tensor, nn

from treeserve.ops.format_names import AUTO_FORMAT as AUTO_FORMAT  # re-exported: formats' names live there
from treeserve.ops.format_names import DEFAULT_FORMAT as DEFAULT_FORMAT
from treeserve.ops.format_names import FORMAT_NAMES as FORMAT_NAMES
from treeserve.ops.format_names import WeightFormat as WeightFormat
from treeserve.ops.block_types import BLOCK_TYPES, Codes8Blocks, Q4Blocks, StoredBlocks, concat_rows
from treeserve.ops.embedding import embedding_codes, packed_embedding
from treeserve.ops.kernels import codes8, dense_cpu
from treeserve.ops.linears import (
    PREPARED_KERNELS,
    Q4_GROUP,
    FormatUnsupportedError,
    Codes8Linear,
    DenseLinear,
    Float32Linear,
    Int4Linear,
    Int8Linear,
    OneDnnLinear,
    Q8Linear,
    int4_buffers,
    int8_buffers,
    onednn_bf16,
    q4_blocks_from_float,
    q8_buffers,
    q8_head_fits,
)
from treeserve.ops.model import Block, Transformer
from treeserve.ops.model_config import ModelConfig

logger = logging.getLogger(__name__)


def resolve_format(name: str | WeightFormat, config: ModelConfig, device: torch.device | None = None,
                   stored_types: Mapping[str, str] | None = None) -> WeightFormat:
    """The format ``name`` stands for on a model of ``config`` on ``device``: ``auto`` is, on
    CPU when every linear's input size is a multiple of 32, the format the weights are stored in
    (``stored_types``: a GGUF's linear weights' block types by parameter name): ``q4_1`` where
    they are all Q4_1 or the weights are floats, else ``gguf`` (each in its own block type), or
    bfloat16 with a warning, once, where a stored type's kernel (codes8) does not run here;
    elsewhere bfloat16 (the int formats have CPU kernels only). Any other name is that format."""
    if name != AUTO_FORMAT:
        return WeightFormat.parse(name)
    if device is not None and device.type != "cpu":
        return WeightFormat.BFLOAT16
    inputs = (config.dim, config.num_heads * config.head_dim, config.ffn_dim)
    if not all(size % Q4_GROUP == 0 for size in inputs):
        return WeightFormat.BFLOAT16
    linears = {kind for name, kind in (stored_types or {}).items() if _is_linear(name)}
    if linears <= {"Q4_1", "F32", "F16", "BF16"}:
        return DEFAULT_FORMAT
    unserved = sorted(k for k in linears if k in BLOCK_TYPES and BLOCK_TYPES[k].kernel == "codes8")
    if unserved and not codes8.available():
        _warn_once(f"the block types {', '.join(unserved)} have no kernel on this machine (the 8-bit-code kernel needs "
                   "AVX2 and a C++ compiler): serving this model in bfloat16, dequantized")
        return WeightFormat.BFLOAT16
    return WeightFormat.GGUF


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process meets it."""
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


def _is_linear(name: str) -> bool:
    """Whether a parameter name is a block's linear weight (the formats' kernels' weights)."""
    return name.startswith("layers.") and name.endswith("_proj.weight")


def make_linear(
    fmt: WeightFormat, weight: Tensor | None, bias: Tensor | None, *, blocks: StoredBlocks | None = None,
    prepared: Mapping[str, Tensor] | None = None, device: torch.device | None = None,
) -> nn.Module:
    """The format's kernel for a float ``(N, K)`` weight (``blocks``: its stored values, if any;
    ``prepared``: the int kernels' buffers, computed before, which replace both).

    The q4_1 format takes 4-bit blocks (Q4_0, Q4_1, Q4_K); the gguf format takes every stored
    block type, each on its kernel. ``weight`` may be None only when ``blocks`` or ``prepared``
    stand in for it. The int formats' LM head is not made here (see ``_head``).
    """
    device = device if device is not None else weight.device if weight is not None else torch.device("cpu")
    if device.type == "cuda" and fmt.is_int:
        raise FormatUnsupportedError(f"the {fmt.value} format has CPU kernels only; on CUDA use float32 or bfloat16")
    if prepared and fmt is WeightFormat.INT8:
        return Int8Linear(prepared, bias)
    if prepared and fmt in (WeightFormat.Q4_1, WeightFormat.GGUF):
        return Codes8Linear(prepared, bias) if "c8_codes" in prepared else Int4Linear(prepared, bias)
    if fmt is WeightFormat.GGUF and isinstance(blocks, Codes8Blocks):
        return Codes8Linear(blocks, bias)
    if fmt in (WeightFormat.Q4_1, WeightFormat.GGUF) and isinstance(blocks, Q4Blocks):
        return Int4Linear(blocks, bias)
    if weight is None:
        raise ValueError(f"make_linear: the {fmt.value} format needs the float weight here")
    if device.type == "cuda":
        dtype = fmt.activation_dtype
        return DenseLinear(weight.to(device, dtype), None if bias is None else bias.to(device, dtype))
    if fmt is WeightFormat.FLOAT32:
        kind = Float32Linear if dense_cpu.available() else DenseLinear
        return kind(weight.float(), None if bias is None else bias.float())
    if fmt is WeightFormat.BFLOAT16:
        if not onednn_bf16():
            return DenseLinear(weight.to(torch.bfloat16), None if bias is None else bias.to(torch.bfloat16))
        return OneDnnLinear(weight, bias)
    if fmt is WeightFormat.INT8:
        return Int8Linear(int8_buffers(weight), bias)
    return Int4Linear(int4_buffers(q4_blocks_from_float(weight)), bias)


def prepared_buffers(model: nn.Module) -> dict[str, Tensor]:
    """The buffers of ``model``'s int kernels by ``<module path>.<buffer>``: what
    :func:`apply_format`'s ``prepared`` takes back (a saved format, so a second start skips
    packing and quantizing)."""
    return {
        f"{name}.{buffer}": tensor
        for name, module in model.named_modules() if isinstance(module, PREPARED_KERNELS)
        for buffer, tensor in module.named_buffers(recurse=False) if tensor is not None
    }


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights (codes, scales and zeros included) one decode step reads: every
    format kernel of ``model``, the LM head included; embeddings and norms are left out (a
    step reads one embedding row and a few KB of norms)."""
    total = 0
    lookups = getattr(model, "embed_codes", None)  # an untied embedding's codes: one row a token
    for module in model.modules():
        if module is lookups:
            continue
        if isinstance(module, (DenseLinear, OneDnnLinear, *PREPARED_KERNELS)):
            total += module.num_weight_bytes
    return total


def _head(fmt: WeightFormat, weight: Tensor, prepared: Mapping[str, Tensor], stored: StoredBlocks | None) -> nn.Module:
    """The LM head's kernel: for the int formats Q8_0 where it fits (else bfloat16), or in the
    gguf format the file's own values of a head stored in another block type (``stored``, float32
    logits); the format's own kernel for the float ones."""
    if fmt.is_int:
        if prepared:
            if "c8_codes" in prepared:
                return Codes8Linear(prepared, None, float_out=True)
            return Q8Linear(prepared, weight.shape[0])
        if fmt is WeightFormat.GGUF and stored is not None and codes8.available() and codes8.supports(*weight.shape):
            values = stored.as_codes8() if isinstance(stored, Q4Blocks) else stored
            return Codes8Linear(values, None, float_out=True)
        if q8_head_fits(weight):
            return Q8Linear(q8_buffers(weight), weight.shape[0])
        return make_linear(WeightFormat.BFLOAT16, weight, None)
    return make_linear(fmt, weight, None, device=weight.device)


def _moved_hooks(old: nn.Module, new: nn.Module) -> nn.Module:
    """Carry forward hooks (tensor parallelism's all-reduce) from a replaced linear to its kernel."""
    for hook in old._forward_hooks.values():
        new.register_forward_hook(hook)
    return new


def _pack_embedding(model: Transformer, stored: StoredBlocks | None, saved: Mapping[str, Tensor]) -> None:
    """An int format's embedding: its rows out of packed codes where they are the bf16 table's,
    the head's when tied, else its own ``stored`` blocks packed once (``saved``: those buffers
    from an earlier start; a submodule ``embed_codes``, so :func:`prepared_buffers` saves them)."""
    table = model.embed_tokens.weight.detach()
    codes: nn.Module | None = model.head_kernel
    if model.lm_head is not None:
        codes = (Codes8Linear(saved, None, float_out=True) if saved and codes8.available()
                 else embedding_codes(stored, table))
    packed = packed_embedding(codes, table)
    if packed is not None:
        model.embed_tokens = cast(nn.Embedding, packed)
        if codes is not model.head_kernel:
            model.embed_codes = codes


def _format_blocks(model: Transformer, fmt: WeightFormat, stored: Mapping[str, StoredBlocks] | None) -> dict[str, StoredBlocks]:
    """The stored blocks ``fmt`` serves: the q4_1 format takes the 4-bit ones, the gguf format
    every stored type; :class:`FormatUnsupportedError` where they do not fit a tensor-parallel
    shard's sliced weights."""
    blocks = {name: b for name, b in (stored or {}).items()
              if fmt is WeightFormat.GGUF or (fmt is WeightFormat.Q4_1 and isinstance(b, Q4Blocks))}
    params = dict(model.named_parameters()) if blocks else {}
    if any(name in params and b.codes.shape != params[name].shape for name, b in blocks.items()):
        raise FormatUnsupportedError(f"a GGUF's stored blocks do not fit a tensor-parallel shard (run {fmt.value} with --tp 1)")
    return blocks


def apply_format(
    model: Transformer, fmt: WeightFormat | str, *, stored: Mapping[str, StoredBlocks] | None = None,
    prepared: Mapping[str, Tensor] | None = None,
) -> Transformer:
    """Put ``model``'s linears into ``fmt`` in place (fusing Q/K/V and gate/up) and return it.

    ``model`` must hold float32 weights and must not have been formatted already; tensor
    parallelism (``apply_tp``) goes first, so each rank formats its own slices. ``stored``
    (parameter name -> stored values, from :func:`~treeserve.ops.loaders.gguf.read_stored_blocks`)
    gives the q4_1 format the GGUF's own 4-bit codes and the gguf format every block type's;
    weights without them are quantized from float (to q4_1). With ``stored``, pass the format
    :func:`resolve_format` gives for their types (``auto`` here knows only float weights).
    ``prepared`` (from :func:`prepared_buffers` of the same model, format and code, saved
    earlier) gives the int kernels their buffers, so nothing is packed or quantized again.
    Embeddings and norms move to the format's activation dtype; in the int formats the embedding
    becomes a :class:`~treeserve.ops.embedding.PackedEmbedding` over the head's codes (tied) or its
    own stored blocks (untied) where those give its rows bit for bit
    (:func:`~treeserve.ops.embedding.packed_embedding`). The model then serves inference
    only (its fused kernels carry no gradients); :meth:`Transformer.logits` uses the format's head.
    """
    fmt = resolve_format(fmt, model.config, model.device)
    if model.head_kernel is not None:
        raise ValueError("apply_format: this model is already formatted")
    if model.dtype != torch.float32:
        raise ValueError(f"apply_format needs a float32 model (the source values), got {model.dtype}")
    device = model.device
    blocks = _format_blocks(model, fmt, stored)
    saved = dict(prepared or {})

    def buffers_of(path: str) -> dict[str, Tensor]:
        return {key[len(path) + 1:]: value for key, value in saved.items() if key.startswith(f"{path}.")}

    def fused(prefix: str, fused_name: str, parts: list[nn.Linear], names: list[str]) -> nn.Module:
        biases = [p.bias for p in parts]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
        own = buffers_of(f"{prefix}.{fused_name}")
        part_blocks = [blocks.get(f"{prefix}.{n}.weight") for n in names]
        joined = None
        if all(b is not None for b in part_blocks) and not own:
            joined = concat_rows([b for b in part_blocks if b is not None])
        # The fused float weight only where no blocks or saved buffers stand in for it.
        weight = None if own or joined is not None else torch.cat([p.weight.detach() for p in parts])
        return make_linear(fmt, weight, bias, blocks=joined, prepared=own, device=device)

    def single(prefix: str, linear: nn.Linear) -> nn.Module:
        bias = None if linear.bias is None else linear.bias.detach()
        kernel = make_linear(fmt, linear.weight.detach(), bias, blocks=blocks.get(f"{prefix}.weight"),
                             prepared=buffers_of(prefix), device=device)
        return _moved_hooks(linear, kernel)

    for index, module in enumerate(model.layers):
        block = cast(Block, module)
        attn, mlp = block.self_attn, block.mlp
        attn.qkv_proj = fused(f"layers.{index}.self_attn", "qkv_proj", [attn.q_proj, attn.k_proj, attn.v_proj],
                              ["q_proj", "k_proj", "v_proj"])
        mlp.gate_up_proj = fused(f"layers.{index}.mlp", "gate_up_proj", [mlp.gate_proj, mlp.up_proj], ["gate_proj", "up_proj"])
        attn.o_proj = cast(nn.Linear, single(f"layers.{index}.self_attn.o_proj", attn.o_proj))
        mlp.down_proj = cast(nn.Linear, single(f"layers.{index}.mlp.down_proj", mlp.down_proj))
        for name in ("q_proj", "k_proj", "v_proj"):
            delattr(attn, name)
        for name in ("gate_proj", "up_proj"):
            delattr(mlp, name)
        for norm in (block.input_layernorm, block.post_attention_layernorm, attn.q_norm, attn.k_norm,
                     block.attn_out_norm, block.mlp_out_norm):
            if norm is not None:
                norm.to(fmt.activation_dtype)
    head_name = "embed_tokens.weight" if model.lm_head is None else "lm_head.weight"  # tied or not
    model.head_kernel = _head(fmt, model.lm_head_weight.detach(), buffers_of("head_kernel"), blocks.get(head_name))
    model.embed_tokens.to(fmt.activation_dtype)
    if fmt.is_int:
        _pack_embedding(model, blocks.get("embed_tokens.weight"), buffers_of("embed_codes"))
    model.norm.to(fmt.activation_dtype)
    if model.lm_head is not None:
        model.lm_head.to(fmt.activation_dtype)
    model.weight_format = fmt.value
    return model
