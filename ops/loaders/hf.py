"""Read a Hugging Face model folder (``config.json`` + ``*.safetensors``) of a LLaMA, Mistral,
Qwen2/3, Phi-3 or Gemma 3 model.

HF checkpoints already use rotate-half RoPE, so no Q/K permutation is undone. Parameter names
lose their ``model.`` prefix to match :class:`treeserve.ops.model.Transformer`. Phi-3's fused
``qkv_proj`` and ``gate_up_proj`` are split by rows. Gemma 3's norms scale by ``1 + weight``
(stored as ``1 +`` here, as llama.cpp's converter does), and its norms are renamed: HF's
``post_attention_layernorm`` is the attention's output norm, ``pre_feedforward_layernorm`` the
MLP's input norm. Sliding windows are read as HF applies them (Mistral's, Phi-3's and Gemma 3's
``sliding_window``, on the layers ``layer_types`` or Gemma's pattern say). The tokenizer is read
separately by :meth:`treeserve.ops.tokenizer.Tokenizer.from_folder`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from treeserve.ops.model_config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text", "gemma3")
GEMMA3 = ("gemma3_text", "gemma3")
_GEMMA_NORMS = {"post_attention_layernorm": "attn_out_norm", "pre_feedforward_layernorm": "post_attention_layernorm",
                "post_feedforward_layernorm": "mlp_out_norm"}
"""Gemma 3's norm names (HF) -> ours."""


class HFFormatError(ValueError):
    """The folder is not a supported Hugging Face LLaMA-family checkpoint."""


@dataclass(frozen=True)
class HFModel:
    """What :func:`read_hf_folder` returns: config, float32 state dict (our names), model type."""

    config: ModelConfig
    state_dict: dict[str, Tensor]
    model_type: str


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Translate an HF ``config.json`` dict (:data:`SUPPORTED_MODEL_TYPES`) into a :class:`ModelConfig`."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFFormatError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "gemma3":  # the multimodal checkpoint: its language model's config
        hf = {**hf["text_config"], "model_type": "gemma3_text",
              "tie_word_embeddings": hf.get("tie_word_embeddings", hf["text_config"].get("tie_word_embeddings", True))}
        model_type = "gemma3_text"
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    if float(hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))) != 1.0:
        raise HFFormatError("partial rotary embeddings (partial_rotary_factor) are not supported")
    num_heads = int(hf["num_attention_heads"])
    dim = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or dim // num_heads)
    rope_base, scaling, local_base = _rope_settings(hf)
    extra = _gemma3_fields(hf, dim, head_dim, local_base) if model_type == "gemma3_text" else _window_fields(hf, model_type)
    mscale, context = 1.0, int(hf.get("max_position_embeddings", 2048))
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        # Phi-3's long rope within its original context: the short factors, and cos and sin times
        # sqrt(1 + ln(max / original) / ln(original)) (HF's Phi3 and llama.cpp alike).
        original = int(hf.get("original_max_position_embeddings") or scaling["original_max_position_embeddings"])
        ratio = context / original
        mscale = math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1 else 1.0
        context, scaling = original, {"rope_type": "factors", "factors": scaling["short_factor"]}
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        dim=dim,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        ffn_dim=int(hf["intermediate_size"]),
        rope_base=rope_base,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=context,
        qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", model_type == "gemma3_text")),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        rope_factors=hf_rope_factors(scaling, rope_base, head_dim),
        rope_mscale=mscale,
        **extra,
    )


def _rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None]:
    """The rope base, scaling (None: plain) and windowed layers' base (None: the same) of an HF
    config, in the older form (``rope_theta``, ``rope_scaling``, Gemma 3's
    ``rope_local_base_freq``) or transformers 5's ``rope_parameters`` (one dict, or one per layer
    type: ``full_attention`` and ``sliding_attention``)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise HFFormatError(f"rope scaling on sliding-window layers ({local!r}) is not supported")
        full = params["full_attention"]
        local_base = local.get("rope_theta")
        return float(full.get("rope_theta", 10000.0)), _scaling_of(full), None if local_base is None else float(local_base)
    if isinstance(params, dict):
        base = hf.get("rope_theta", params.get("rope_theta"))
        return float(base or 10000.0), _scaling_of(params), _local_base(hf)
    return float(hf.get("rope_theta") or 10000.0), hf.get("rope_scaling"), _local_base(hf)


def _scaling_of(params: dict[str, Any]) -> dict[str, Any] | None:
    kind = params.get("rope_type", params.get("type", "default"))
    return None if kind in (None, "default") else params


def _local_base(hf: dict[str, Any]) -> float | None:
    base = hf.get("rope_local_base_freq")
    return None if base is None else float(base)


def _window_layers(hf: dict[str, Any], num_layers: int) -> tuple[bool, ...] | None:
    """The windowed layers of ``layer_types`` (``sliding_attention``), or None (all)."""
    types = hf.get("layer_types")
    return None if types is None else tuple(t == "sliding_attention" for t in types[:num_layers])


def _window_fields(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Mistral's and Phi-3's sliding window, on every layer (or those of ``layer_types``)."""
    window = hf.get("sliding_window") if model_type in ("mistral", "phi3") else None
    if not window or int(window) >= int(hf.get("max_position_embeddings", 2048)):
        return {}
    return {"sliding_window": int(window), "window_layers": _window_layers(hf, int(hf["num_hidden_layers"]))}


def _gemma3_fields(hf: dict[str, Any], dim: int, head_dim: int, local_base: float | None) -> dict[str, Any]:
    """Gemma 3's fields beyond llama's: sliding-window layers (``layer_types``, else every
    ``sliding_window_pattern``-th layer global) with their rope base, tanh GELU, output norms,
    embeddings times ``sqrt(dim)`` and scores times ``query_pre_attn_scalar ** -0.5``."""
    if hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
        raise HFFormatError("Gemma 3 with logit softcapping is not supported")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise HFFormatError(f"Gemma 3 with hidden_activation {hf['hidden_activation']!r} is not supported")
    layers = int(hf["num_hidden_layers"])
    scalar = float(hf.get("query_pre_attn_scalar") or head_dim)
    fields: dict[str, Any] = {"activation": "gelu_tanh", "post_norms": True, "embed_scale": math.sqrt(dim),
                              "attn_scale": None if scalar == head_dim else scalar ** -0.5}
    if hf.get("sliding_window"):
        windows = _window_layers(hf, layers)
        if windows is None:
            pattern = int(hf.get("sliding_window_pattern", 6))
            windows = tuple(pattern == 0 or (i + 1) % pattern != 0 for i in range(layers))
        fields.update(sliding_window=int(hf["sliding_window"]), window_layers=windows,
                      rope_base_local=10000.0 if local_base is None else local_base)
    return fields


def hf_rope_factors(scaling: dict[str, Any] | None, rope_base: float, head_dim: int) -> tuple[float, ...] | None:
    """Each rotary frequency's divisor for an HF ``rope_scaling`` (None: plain rope): ``linear``
    divides every frequency by ``factor``; ``llama3`` (Llama 3.1 and later) leaves the high
    frequencies, divides the low ones by ``factor`` and blends those between, as llama.cpp's
    converter writes them into a GGUF's ``rope_freqs``. Others (YaRN, dynamic) raise
    :class:`HFFormatError`."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    half = head_dim // 2
    if kind == "linear":
        return (factor,) * half
    if kind == "factors":  # already one per frequency (Phi-3's short factors)
        factors = tuple(float(f) for f in scaling["factors"])
        if len(factors) != half:
            raise HFFormatError(f"rope_scaling has {len(factors)} factors; the head size {head_dim} needs {half}")
        return factors
    if kind != "llama3":
        raise HFFormatError(f"rope_scaling {scaling!r} is not supported; supported: linear, llama3")
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    context = float(scaling.get("original_max_position_embeddings", 8192))
    factors = []
    for i in range(half):
        wavelength = 2 * math.pi * rope_base ** (2 * i / head_dim)
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def read_hf_folder(folder: str | Path) -> HFModel:
    """Load ``config.json`` and every ``*.safetensors`` shard of ``folder`` as float32."""
    from safetensors.torch import load_file

    folder = Path(folder)
    hf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config = config_from_hf(hf)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise HFFormatError(f"no *.safetensors files in {folder}")
    gemma = hf["model_type"] in GEMMA3
    state: dict[str, Tensor] = {}
    for shard in shards:
        for name, tensor in load_file(str(shard)).items():
            key = name.removeprefix("language_model.").removeprefix("model.").removeprefix("language_model.")
            if key.endswith("rotary_emb.inv_freq") or key.startswith(("vision_tower.", "multi_modal_projector.")):
                continue
            for key, part in _split(key, tensor.to(torch.float32), config):
                if gemma:
                    key, part = _gemma_name(key, part)
                state[key] = part
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise HFFormatError("config says tie_word_embeddings=false but there is no lm_head.weight")
    return HFModel(config=config, state_dict=state, model_type=str(hf["model_type"]))


def _split(key: str, tensor: Tensor, config: ModelConfig) -> list[tuple[str, Tensor]]:
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` as our separate parameters; any other
    parameter as it is."""
    if key.endswith("self_attn.qkv_proj.weight"):
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        prefix = key.removesuffix("qkv_proj.weight")
        return list(zip((f"{prefix}q_proj.weight", f"{prefix}k_proj.weight", f"{prefix}v_proj.weight"),
                        tensor.split([q, kv, kv])))
    if key.endswith("mlp.gate_up_proj.weight"):
        prefix = key.removesuffix("gate_up_proj.weight")
        return list(zip((f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"), tensor.chunk(2)))
    return [(key, tensor)]


def _gemma_name(key: str, tensor: Tensor) -> tuple[str, Tensor]:
    """A Gemma 3 parameter under our name, its norms' weights as ``1 + weight``."""
    parts = key.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[2] in _GEMMA_NORMS:
        key = ".".join([parts[0], parts[1], _GEMMA_NORMS[parts[2]], parts[3]])
    return key, tensor + 1.0 if key.endswith("norm.weight") else tensor
