"""treeserve's Hugging Face loader and forward against HF transformers on tiny random models of
the architectures whose HF checkpoints carry what a GGUF fixture cannot show: Gemma 3 (sliding
windows on a pattern of layers, each kind with its rope, 1 + weight norms renamed, a query scale
other than the head size's), Phi-3 (fused Q/K/V and gate/up, long-rope short factors and their
cos/sin factor, a sliding window) and Mistral (a sliding window on every layer).

Each model is saved by transformers (``save_pretrained``), read by treeserve's HF loader, and
both score 40 random tokens (every window crossed) in float32; the largest logit difference is
printed. ``--legacy`` rewrites each saved config into transformers 4's keys (``rope_theta``,
``rope_scaling``, ``rope_local_base_freq``, no ``layer_types``), as most hub checkpoints have
them. Bench-only (needs the ``bench`` extra's transformers):

    python bench/hf_architectures.py [--legacy]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

import torch

from treeserve.ops.loaders.hf import read_hf_folder
from treeserve.ops.model import Transformer

VOCAB = 300
TOKENS = 40


def cases() -> dict[str, tuple[Any, Any]]:
    """Each architecture's tiny config and model class."""
    import transformers as tf

    return {
        "gemma3_text": (tf.Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, sliding_window=8, sliding_window_pattern=2,
            rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=24, max_position_embeddings=256),
            tf.Gemma3ForCausalLM),
        "phi3": (tf.Phi3Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=9, max_position_embeddings=256, original_max_position_embeddings=128,
            pad_token_id=0, rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                          "long_factor": [2.0] * 8}), tf.Phi3ForCausalLM),
        "mistral": (tf.MistralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=7, max_position_embeddings=256), tf.MistralForCausalLM),
    }


def to_legacy(path: str) -> None:
    """Rewrite a saved ``config.json`` in transformers 4's rope keys, without ``layer_types``."""
    config = json.loads(open(path, encoding="utf-8").read())
    params = config.pop("rope_parameters")
    if "full_attention" in params:
        config["rope_theta"] = params["full_attention"]["rope_theta"]
        config["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        config["rope_scaling"] = {k: v for k, v in params["full_attention"].items() if k != "rope_theta"}
    else:
        config["rope_theta"] = params.pop("rope_theta")
        config["rope_scaling"] = params if params.get("rope_type") != "default" else None
    config.pop("layer_types", None)
    open(path, "w", encoding="utf-8").write(json.dumps(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--legacy", action="store_true", help="transformers 4's config keys")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name, (config, model_class) in cases().items():
        config._attn_implementation = "eager"
        reference = model_class(config).eval()
        with torch.no_grad():  # norms away from their initial values
            for param_name, param in reference.named_parameters():
                if "norm" in param_name:
                    param.add_(0.3 * torch.randn_like(param))
        with tempfile.TemporaryDirectory() as folder:
            reference.save_pretrained(folder)
            if args.legacy:
                to_legacy(f"{folder}/config.json")
            loaded = read_hf_folder(folder)
        ours = Transformer.from_state_dict(loaded.config, loaded.state_dict)
        tokens = torch.randint(0, VOCAB, (1, TOKENS))
        with torch.no_grad():
            expected = reference(tokens).logits
        got = ours(tokens, ours.new_cache(1, TOKENS))
        print(json.dumps({"model_type": name, "sliding_window": loaded.config.sliding_window,
                          "window_layers": loaded.config.window_layers, "rope_mscale": loaded.config.rope_mscale,
                          "max_abs_diff": (got - expected).abs().max().item(),
                          "max_abs_logit": expected.abs().max().item()}))


if __name__ == "__main__":
    main()
