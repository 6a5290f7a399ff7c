"""Read a LLaMA-family GGUF file (``llama``, ``qwen2`` or ``qwen3`` architecture) into a state dict + config.

Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` and its GGUF shape is
reversed to get the torch ``(out, in)`` layout. llama-architecture files store ``attn_q`` and
``attn_k`` permuted for llama.cpp's interleaved rope (``convert_hf_to_gguf.py``'s ``permute``);
we undo that so the usual rotate-half rope applies. qwen2 and qwen3 files are not permuted;
qwen3's per-head Q/K norms (``attn_q_norm``, ``attn_k_norm``) set ``qk_norm``. Embeddings
are tied when there is no ``output.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from treeserve.ops.block_types import BLOCK_TYPES, StoredBlocks, UnsupportedBlockType, check_supported
from treeserve.ops.loaders.registry import ModelLoadError
from treeserve.ops.model import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
PERMUTED_ARCHITECTURES = ("llama",)

_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFFormatError(ModelLoadError, ValueError):
    """The GGUF file is not a supported model (architecture, block type) or lacks a required
    field: the command line reports it in one line (a :class:`ModelLoadError`)."""


@dataclass(frozen=True)
class GGUFModel:
    """What :func:`read_gguf` returns: config, float32 state dict and the architecture name."""

    config: ModelConfig
    state_dict: dict[str, Tensor]
    architecture: str


def permute_for_llama_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The permutation llama.cpp's converter applies to Q/K rows (rotate-half -> interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_llama_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of :func:`permute_for_llama_rope` (interleaved -> rotate-half rows)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def field_value(reader: Any, key: str) -> Any:
    """The decoded value of metadata ``key`` (str, number, bool or list), or None if absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def config_from_gguf(reader: Any) -> tuple[ModelConfig, str]:
    """Build the :class:`ModelConfig` (and return the architecture) from GGUF metadata."""
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFFormatError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def need(key: str) -> Any:
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFFormatError(f"GGUF file lacks the metadata field {arch}.{key}")
        return value

    dim = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = int(field_value(reader, f"{arch}.attention.head_count_kv") or num_heads)
    head_dim = field_value(reader, f"{arch}.attention.key_length") or field_value(reader, f"{arch}.rope.dimension_count")
    vocab = field_value(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab = len(tokens.data) if tokens is not None else int(embd.shape[-1])
    names = {t.name for t in reader.tensors}
    head_size = int(head_dim) if head_dim else dim // num_heads
    config = ModelConfig(
        vocab_size=int(vocab),
        dim=dim,
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_size,
        ffn_dim=int(need("feed_forward_length")),
        rope_base=_from_float32(field_value(reader, f"{arch}.rope.freq_base") or 10000.0),
        norm_eps=_from_float32(need("attention.layer_norm_rms_epsilon")),
        max_seq_len=int(field_value(reader, f"{arch}.context_length") or 2048),
        qkv_bias="blk.0.attn_q.bias" in names,
        tie_embeddings="output.weight" not in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_factors=rope_factors(reader, arch, head_size),
    )
    return config, arch


def rope_factors(reader: Any, arch: str, head_size: int) -> tuple[float, ...] | None:
    """The divisor of each rotary frequency: Llama 3.1+'s ``rope_freqs`` tensor (which llama.cpp's
    converter computes from the model's ``rope_scaling``), a linear scaling's factor, or None for
    plain rope. Other scalings (YaRN) raise :class:`GGUFFormatError`: served without them the
    model would answer, wrongly."""
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        values = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if values.shape[0] != head_size // 2:
            raise GGUFFormatError(f"rope_freqs has {values.shape[0]} factors; the head size {head_size} needs {head_size // 2}")
        return tuple(float(v) for v in values)
    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return None
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    if scaling == "linear" and factor:
        return (float(factor),) * (head_size // 2)
    raise GGUFFormatError(f"GGUF rope scaling {scaling!r} is not supported; supported: plain rope, linear, "
                          "and Llama 3's per-frequency factors (rope_freqs)")


def _from_float32(value: float) -> float:
    """The shortest decimal that a float32 metadata value stands for (1e-5, not 9.99999975e-06)."""
    return float(f"{float(value):.7g}")


def torch_name(gguf_name: str) -> str | None:
    """Our parameter name for a GGUF tensor name, or None for tensors we do not use."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    return None


def read_gguf(path: str | Path, *, unpermute_qk: bool = True) -> GGUFModel:
    """Dequantize a GGUF model file into a float32 state dict and its config.

    ``unpermute_qk=False`` skips undoing llama.cpp's Q/K permutation; it exists only so tests
    can show that the step matters (the model then scores English far worse).
    """
    import gguf

    return read_gguf_reader(gguf.GGUFReader(str(path)), unpermute_qk=unpermute_qk)


def read_gguf_reader(reader: Any, *, unpermute_qk: bool = True) -> GGUFModel:
    """:func:`read_gguf` for an already open ``gguf.GGUFReader`` (opening one costs seconds)."""
    import gguf

    config, arch = check_reader(reader)
    state: dict[str, Tensor] = {}
    for tensor in reader.tensors:
        name = torch_name(tensor.name)
        if name is None:
            continue
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.ascontiguousarray(array.reshape(tuple(int(d) for d in reversed(tensor.shape))), dtype=np.float32)
        if unpermute_qk and arch in PERMUTED_ARCHITECTURES:
            if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
                array = unpermute_llama_rope(array, config.num_heads)
            elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
                array = unpermute_llama_rope(array, config.num_kv_heads)
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only memmap
            array = array.copy()
        state[name] = torch.from_numpy(array)
    missing = [n for n in ("embed_tokens.weight", "norm.weight") if n not in state]
    if missing:
        raise GGUFFormatError(f"GGUF file lacks tensors for {missing}")
    return GGUFModel(config=config, state_dict=state, architecture=arch)


def tensor_types(reader: Any) -> dict[str, str]:
    """The GGUF type name (``Q4_K``, ``F32``...) of every tensor we use, by GGUF tensor name."""
    return {t.name: t.tensor_type.name for t in reader.tensors if torch_name(t.name) is not None}


def check_reader(reader: Any) -> tuple[ModelConfig, str]:
    """The model's config and architecture, once its architecture, metadata and every used
    tensor's block type are known to be supported (:class:`GGUFFormatError` otherwise): the check
    that runs before anything is converted or cached."""
    config, arch = config_from_gguf(reader)
    try:
        check_supported(tensor_types(reader))
    except UnsupportedBlockType as exc:
        raise GGUFFormatError(str(exc)) from None
    return config, arch


def read_stored_blocks(path: str | Path) -> dict[str, StoredBlocks]:
    """The stored values of every linear weight held in an integer block type
    (:data:`~treeserve.ops.block_types.BLOCK_TYPES`), and of the embedding and output matrices
    (the LM head) where they are not Q8_0, by our parameter name, in the form of the kernel that
    serves them.

    Q/K rows are unpermuted exactly as :func:`read_gguf` unpermutes the dequantized weights
    (a row permutation: blocks run along the input dimension), so
    ``blocks[name].dequantize()`` equals ``read_gguf(path).state_dict[name]`` bit for bit.
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    config, arch = check_reader(reader)
    found: dict[str, StoredBlocks] = {}
    for tensor in reader.tensors:
        name = torch_name(tensor.name)
        kind = BLOCK_TYPES.get(tensor.tensor_type.name)
        if name is None or kind is None or not name.endswith(".weight"):
            continue
        if name in ("lm_head.weight", "embed_tokens.weight") and kind.name == "Q8_0":
            continue  # the int formats' Q8_0 head recovers these codes from the float values
        blocks = kind.stored(np.asarray(tensor.data), int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1)
        if arch in PERMUTED_ARCHITECTURES and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            heads = config.num_heads if name.endswith("q_proj.weight") else config.num_kv_heads
            order = torch.from_numpy(unpermute_llama_rope(np.arange(blocks.codes.shape[0]), heads))
            blocks = blocks.rows(order)
        found[name] = blocks
    return found
