"""Read a LLaMA-family GGUF file (``llama``, ``qwen2``, ``qwen3``, ``phi3`` or ``gemma3``
architecture) into a state dict + config.

Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` and its GGUF shape is
reversed to get the torch ``(out, in)`` layout. llama-architecture files store ``attn_q`` and
``attn_k`` permuted for llama.cpp's interleaved rope (``convert_hf_to_gguf.py``'s ``permute``);
we undo that so the usual rotate-half rope applies. The other architectures are not permuted.
qwen3's and gemma3's per-head Q/K norms (``attn_q_norm``, ``attn_k_norm``) set ``qk_norm``.
phi3 stores Q/K/V as one ``attn_qkv`` and gate/up as one ``ffn_up``: they are split by rows.
gemma3 adds norms on the attention's and the MLP's outputs (its norm weights are stored with
Gemma's ``1 +`` already added), sliding-window layers with their own rope base, scaled
embeddings and a GELU MLP, as llama.cpp reads them. Embeddings are tied when there is no
``output.weight``.
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
from treeserve.ops.model_config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
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
    "post_attention_norm.weight": "attn_out_norm.weight",
    "post_ffw_norm.weight": "mlp_out_norm.weight",
}
GEMMA3_SWA_PATTERN = 6
"""llama.cpp's default for gemma3: of every six layers, the first five are windowed."""
GEMMA3_ROPE_BASE_SWA = 10000.0
"""llama.cpp's default rope base of gemma3's windowed layers."""
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
    head_dim = field_value(reader, f"{arch}.attention.key_length")  # llama.cpp's n_embd_head_k
    vocab = field_value(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab = len(tokens.data) if tokens is not None else int(embd.shape[-1])
    names = {t.name for t in reader.tensors}
    head_size = int(head_dim) if head_dim else dim // num_heads
    rotary = field_value(reader, f"{arch}.rope.dimension_count")
    if rotary and int(rotary) != head_size:
        raise GGUFFormatError(f"GGUF rope over {rotary} of each head's {head_size} dimensions (partial rotary) is not supported")
    num_layers = int(need("block_count"))
    extra = _gemma3_fields(reader, dim, num_heads, num_layers) if arch == "gemma3" else {}
    factors, mscale, context = rope_factors(reader, arch, head_size)
    config = ModelConfig(
        vocab_size=int(vocab),
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_size,
        ffn_dim=int(need("feed_forward_length")),
        rope_base=_from_float32(field_value(reader, f"{arch}.rope.freq_base") or 10000.0),
        norm_eps=_from_float32(need("attention.layer_norm_rms_epsilon")),
        max_seq_len=context or int(field_value(reader, f"{arch}.context_length") or 2048),
        qkv_bias="blk.0.attn_q.bias" in names,
        tie_embeddings="output.weight" not in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_factors=factors,
        rope_mscale=mscale,
        **extra,
    )
    return config, arch


def _gemma3_fields(reader: Any, dim: int, num_heads: int, num_layers: int) -> dict[str, Any]:
    """gemma3's :class:`ModelConfig` fields beyond the llama ones, as llama.cpp reads them
    (``llama_model_gemma3::load_arch_hparams``): the sliding window and its layers (an array of
    flags, or every ``pattern``-th layer global), the windowed layers' rope base, and the
    attention scale (``1/sqrt(dim / heads)`` for the 62-layer 27B, else ``1/sqrt(head size)``)."""
    if field_value(reader, "gemma3.final_logit_softcapping"):
        raise GGUFFormatError("GGUF gemma3 with final logit softcapping is not supported")
    window = field_value(reader, "gemma3.attention.sliding_window")
    fields: dict[str, Any] = {"activation": "gelu_tanh", "post_norms": True, "embed_scale": float(np.sqrt(np.float32(dim)))}
    if num_layers == 62:
        fields["attn_scale"] = float(1.0 / np.sqrt(np.float32(dim // num_heads)))
    if window:
        pattern = field_value(reader, "gemma3.attention.sliding_window_pattern")
        if isinstance(pattern, list):
            layers = tuple(bool(p) for p in pattern)
        else:
            n = int(pattern) if pattern is not None else GEMMA3_SWA_PATTERN
            layers = tuple(n == 0 or i % n < n - 1 for i in range(num_layers))
        base = field_value(reader, "gemma3.rope.freq_base_swa")
        fields.update(sliding_window=int(window), window_layers=layers,
                      rope_base_local=_from_float32(base) if base else GEMMA3_ROPE_BASE_SWA)
    return fields


def rope_factors(reader: Any, arch: str, head_size: int) -> tuple[tuple[float, ...] | None, float, int | None]:
    """The divisor of each rotary frequency, a factor on cos and sin, and a context limit (None:
    the file's): Llama 3.1+'s ``rope_freqs`` tensor (which llama.cpp's converter computes from the
    model's ``rope_scaling``), a linear scaling's factor, Phi-3's long-rope short factors
    (``rope_factors_short``, with its ``attn_factor``: what llama.cpp runs within the original
    context, to which the context is then limited), or None for plain rope. Other scalings
    (YaRN) raise :class:`GGUFFormatError`: served without them the model would answer, wrongly."""
    def factors_of(name: str) -> tuple[float, ...] | None:
        tensor = next((t for t in reader.tensors if t.name == name), None)
        if tensor is None:
            return None
        values = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
        if values.shape[0] != head_size // 2:
            raise GGUFFormatError(f"{name} has {values.shape[0]} factors; the head size {head_size} needs {head_size // 2}")
        return tuple(float(v) for v in values)

    freqs = factors_of("rope_freqs.weight")
    if freqs is not None:
        return freqs, 1.0, None
    short = factors_of("rope_factors_short.weight")
    if short is not None:
        original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
        if not original:
            raise GGUFFormatError("GGUF long-rope factors without rope.scaling.original_context_length")
        mscale = field_value(reader, f"{arch}.rope.scaling.attn_factor")
        return short, float(mscale) if mscale else 1.0, int(original)
    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return None, 1.0, None
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    if scaling == "linear" and factor:
        return (float(factor),) * (head_size // 2), 1.0, None
    raise GGUFFormatError(f"GGUF rope scaling {scaling!r} is not supported; supported: plain rope, linear, "
                          "Llama 3's per-frequency factors (rope_freqs) and Phi-3's short long-rope factors")


def _from_float32(value: float) -> float:
    """The shortest decimal that a float32 metadata value stands for (1e-5, not 9.99999975e-06)."""
    return float(f"{float(value):.7g}")


def torch_name(gguf_name: str) -> str | None:
    """Our parameter name for a GGUF tensor name, or None for tensors we do not use (or split:
    :func:`torch_parts`)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    return None


def torch_parts(gguf_name: str, config: ModelConfig, arch: str) -> list[tuple[str, int, int]]:
    """Our parameters held in GGUF tensor ``gguf_name``, each with its rows ``[start, stop)``:
    one whole tensor, phi3's ``attn_qkv`` (Q, K, V rows) and ``ffn_up`` (gate, up rows), or none."""
    parts = gguf_name.split(".", 2)
    if arch == "phi3" and len(parts) == 3 and parts[0] == "blk" and parts[2] in ("attn_qkv.weight", "ffn_up.weight"):
        prefix = f"layers.{parts[1]}"
        if parts[2] == "attn_qkv.weight":
            q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            return [(f"{prefix}.self_attn.q_proj.weight", 0, q), (f"{prefix}.self_attn.k_proj.weight", q, q + kv),
                    (f"{prefix}.self_attn.v_proj.weight", q + kv, q + 2 * kv)]
        f = config.ffn_dim
        return [(f"{prefix}.mlp.gate_proj.weight", 0, f), (f"{prefix}.mlp.up_proj.weight", f, 2 * f)]
    name = torch_name(gguf_name)
    return [] if name is None else [(name, 0, -1)]


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
        parts = torch_parts(tensor.name, config, arch)
        if not parts:
            continue
        whole = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        whole = np.ascontiguousarray(whole.reshape(tuple(int(d) for d in reversed(tensor.shape))), dtype=np.float32)
        for name, start, stop in parts:
            array = whole if stop < 0 else np.ascontiguousarray(whole[start:stop])
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


def tensor_types(reader: Any, config: ModelConfig, arch: str) -> dict[str, str]:
    """The GGUF type name (``Q4_K``, ``F32``...) of every tensor we use, by GGUF tensor name
    (``config`` and ``arch``: :func:`config_from_gguf`'s)."""
    return {t.name: t.tensor_type.name for t in reader.tensors if torch_parts(t.name, config, arch)}


def parameter_types(reader: Any, config: ModelConfig, arch: str) -> dict[str, str]:
    """The GGUF type name of every parameter we read, by our parameter name (a split tensor's
    parts each have its type; ``config`` and ``arch``: :func:`config_from_gguf`'s)."""
    return {name: t.tensor_type.name for t in reader.tensors for name, _, _ in torch_parts(t.name, config, arch)}


def check_reader(reader: Any) -> tuple[ModelConfig, str]:
    """The model's config and architecture, once its architecture, metadata and every used
    tensor's block type are known to be supported (:class:`GGUFFormatError` otherwise): the check
    that runs before anything is converted or cached."""
    config, arch = config_from_gguf(reader)
    try:
        check_supported(tensor_types(reader, config, arch))
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
        kind = BLOCK_TYPES.get(tensor.tensor_type.name)
        parts = torch_parts(tensor.name, config, arch)
        if kind is None or not parts or not parts[0][0].endswith(".weight"):
            continue
        whole = kind.stored(np.asarray(tensor.data), int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1)
        for name, start, stop in parts:
            if name in ("lm_head.weight", "embed_tokens.weight") and kind.name == "Q8_0":
                continue  # the int formats' Q8_0 head recovers these codes from the float values
            blocks = whole if stop < 0 else whole.rows(torch.arange(start, stop))
            if arch in PERMUTED_ARCHITECTURES and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
                heads = config.num_heads if name.endswith("q_proj.weight") else config.num_kv_heads
                order = torch.from_numpy(unpermute_llama_rope(np.arange(blocks.codes.shape[0]), heads))
                blocks = blocks.rows(order)
            found[name] = blocks
    return found
