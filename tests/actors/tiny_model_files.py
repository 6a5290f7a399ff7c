"""Tiny random LLaMA-style models written to disk, so child-process actors can load them by path.

:func:`write_tiny_hf_model` writes a Hugging Face folder (``config.json``, ``model.safetensors``
with the ``model.`` prefix, a word-level ``tokenizer.json`` and ``tokenizer_config.json``) that
``treeserve.models.load_model(path)`` reads back into exactly the same float32 weights as
:func:`make_tiny_model`. Token ids: 0 ``<unk>``, 1 ``<bos>``, 2 ``<eos>``, then ``w3``, ``w4``...
Not a test module (no ``test_`` prefix): import it by path from tests.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from treeserve.ops.linears import Int4Linear
from treeserve.ops.model import Transformer
from treeserve.ops.model_config import ModelConfig

TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=97, dim=48, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8, ffn_dim=96, max_seq_len=256
)
EOS_ID = 2


def make_tiny_model(seed: int = 0, **overrides: Any) -> Transformer:
    """A tiny float32 model with random weights (norm scales near 1, untied LM head)."""
    config = ModelConfig(**{**TINY_CONFIG, "tie_embeddings": False, **overrides})
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            base, scale = (1.0, 0.5) if "norm" in name else (0.0, 0.2)
            param.copy_(base + scale * torch.randn(param.shape, generator=gen))
    return model.eval()


def write_tiny_hf_model(folder: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random model (see :func:`make_tiny_model`) as an HF folder; return the folder."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(seed, **overrides)
    cfg = model.config
    hf_config = {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "rope_theta": cfg.rope_base,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "attention_bias": cfg.qkv_bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": 1,
        "eos_token_id": EOS_ID,
    }
    (folder / "config.json").write_text(json.dumps(hf_config, indent=1), encoding="utf-8")
    state = {
        (name if name.startswith("lm_head") else f"model.{name}"): tensor.contiguous()
        for name, tensor in model.state_dict().items()
    }
    save_file(state, str(folder / "model.safetensors"))
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": EOS_ID, **{f"w{i}": i for i in range(3, cfg.vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


def write_prompt_len_predictor(path: Path, prompt_lens: Sequence[int], lengths: Sequence[float], cap: int) -> Path:
    """Fit a ``prompt_len`` length predictor on (prompt length, answer length) pairs, so a test
    knows which prompts it predicts long; save it to ``path`` and return that."""
    import numpy as np

    from treeserve.ops.length_predictor import FeatureSpec, fit_predictor

    x = np.log1p(np.asarray(prompt_lens, dtype=np.float64))[:, None]
    predictor = fit_predictor(x, np.asarray(lengths, dtype=np.float64), FeatureSpec("prompt_len"), cap,
                              alphas=(1e-3,), num_folds=2)
    predictor.save(path)
    return path


# Sizes the fused op and the Q8_0 head take: every linear's sizes multiples of 32, a head of
# 16 (a multiple of 8), the vocabulary a multiple of 32.
FUSED_DIMS: dict[str, Any] = dict(vocab_size=128, dim=64, ffn_dim=128, num_heads=4, num_kv_heads=2, head_dim=16)
SKIP_REASON = ("q4_1 runs no int8-row kernel of this project here (it needs a C++ compiler and AVX2 or AVX512-VNNI; "
               "torch's int4 kernel and the bf16 rows promise no same bits at every row count)")


def q4_1_or_skip(model: torch.nn.Module) -> None:
    """Skip unless ``model``'s q4_1 linears run this project's int8-row kernels (AVX2, or
    AVX512-VNNI): the kernels whose rows are the same bits at every row count."""
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    if not linears or not all(m.amx_codes is not None and m.int8_rows for m in linears):
        pytest.skip(SKIP_REASON)
