"""Read a Hugging Face model folder (``config.json`` + ``*.safetensors``) of a LLaMA or Qwen2 model.

HF checkpoints already use rotate-half RoPE, so no Q/K permutation is undone. Parameter names
lose their ``model.`` prefix to match :class:`treeserve.ops.model.Transformer`. The tokenizer
is read separately by :meth:`treeserve.ops.tokenizer.Tokenizer.from_folder`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from treeserve.ops.model import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class HFFormatError(ValueError):
    """The folder is not a supported Hugging Face LLaMA-family checkpoint."""


@dataclass(frozen=True)
class HFModel:
    """What :func:`read_hf_folder` returns: config, float32 state dict (our names), model type."""

    config: ModelConfig
    state_dict: dict[str, Tensor]
    model_type: str


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Translate an HF ``config.json`` dict (llama/qwen2 family) into a :class:`ModelConfig`."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFFormatError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    num_heads = int(hf["num_attention_heads"])
    dim = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or dim // num_heads)
    rope_base = hf.get("rope_theta")
    if rope_base is None and isinstance(hf.get("rope_parameters"), dict):
        rope_base = hf["rope_parameters"].get("rope_theta")
    rope_base = float(rope_base or 10000.0)
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
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        rope_factors=hf_rope_factors(hf.get("rope_scaling"), rope_base, head_dim),
    )


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
    state: dict[str, Tensor] = {}
    for shard in shards:
        for name, tensor in load_file(str(shard)).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            key = name.removeprefix("model.")
            state[key] = tensor.to(torch.float32)
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise HFFormatError("config says tie_word_embeddings=false but there is no lm_head.weight")
    return HFModel(config=config, state_dict=state, model_type=str(hf["model_type"]))
