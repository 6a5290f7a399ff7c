"""Shared fixtures for the ops tests: tiny random models, random token trees, the default model."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from treeserve.ops.loaders.gguf import permute_for_llama_rope
from treeserve.ops.model import Transformer
from treeserve.ops.model_config import ModelConfig

TINY = dict(vocab_size=101, dim=48, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8, ffn_dim=96, max_seq_len=256)


def make_tiny_model(seed: int = 0, *, weight_scale: float = 0.2, **overrides: Any) -> Transformer:
    """A tiny float32 LLaMA-style model with random weights (biases and norms randomised too):
    norm scales ``1 + 0.5 N(0, 1)``, every other weight ``weight_scale * N(0, 1)``."""
    config = ModelConfig(**{**TINY, **overrides})
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.5 if "norm" in name else weight_scale
            base = 1.0 if "norm" in name else 0.0
            param.copy_(base + scale * torch.randn(param.shape, generator=gen))
    return model.eval()


def random_parents(num_nodes: int, gen: torch.Generator, *, num_roots: int = 1) -> torch.Tensor:
    """Random topologically ordered parent array with ``num_roots`` roots (-1) first."""
    parents = [-1] * num_roots
    for i in range(num_roots, num_nodes):
        parents.append(int(torch.randint(0, i, (1,), generator=gen)))
    return torch.tensor(parents, dtype=torch.long)


@pytest.fixture
def tiny_model_factory() -> Callable[..., Transformer]:
    """Factory ``(seed=0, **config_overrides) -> Transformer`` for tiny random float32 models."""
    return make_tiny_model


@pytest.fixture(scope="session")
def default_model_cache_dir() -> Path:
    """Cache dir for the real default model (``TREESERVE_CACHE`` or ``~/.cache/treeserve``)."""
    return Path(os.environ.get("TREESERVE_CACHE", Path.home() / ".cache" / "treeserve"))


@pytest.fixture(scope="session")
def default_model(default_model_cache_dir: Path) -> Any:
    """The default model loaded once per session in float32 (pulled into the cache dir if missing)."""
    from treeserve.models import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL, dtype=torch.float32, cache_dir=default_model_cache_dir)


@pytest.fixture
def parents_factory() -> Callable[..., torch.Tensor]:
    """Factory ``(num_nodes, gen, *, num_roots=1) -> parents`` for random token trees."""
    return random_parents


CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOKENIZER_CORPUS = (
    "The quick brown fox jumps over the lazy dog. In 2024 there were 365 days and 12 months. "
    "Tokenizers split text into pieces; merges join frequent pairs of bytes. Café naïve résumé 日本 🙂. "
) * 4


@pytest.fixture(scope="session")
def tiny_bpe_backend() -> Any:
    """:func:`train_tiny_bpe`'s tokenizer, once a session."""
    return train_tiny_bpe()


def train_tiny_bpe() -> Any:
    """A small trained byte-level BPE (``tokenizers.Tokenizer``) with the smollm pre-tokenizer.

    Ids 0..2 are the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([TOKENIZER_CORPUS], trainer)
    return backend


def bpe_vocab_and_merges(backend: Any) -> tuple[list[str], list[str]]:
    """(tokens by id, merges as "a b" strings) of a trained ``tokenizers`` BPE."""
    import json

    data = json.loads(backend.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges


@pytest.fixture
def vocab_and_merges() -> Callable[[Any], tuple[list[str], list[str]]]:
    """The helper :func:`bpe_vocab_and_merges` as a fixture."""
    return bpe_vocab_and_merges


@pytest.fixture
def chatml_template() -> str:
    """A ChatML Jinja chat template like SmolLM2's."""
    return CHATML_TEMPLATE


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "attn_out_norm.weight": "post_attention_norm.weight",
    "mlp_out_norm.weight": "post_ffw_norm.weight",
}

def gguf_name(name: str) -> str:
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, index, rest = name.split(".", 2)
    return f"blk.{index}.{GGUF_NAMES[rest]}"


def write_gguf(path: Path, model: Transformer, arch: str, backend: Any, template: str = CHATML_TEMPLATE,
               tokenizer: Callable[[Any], None] | None = None) -> Transformer:
    """Write ``model`` as a GGUF the way llama.cpp's converter would; return the expected model.

    Q/K are permuted for llama; ``ffn_down`` is stored as Q8_0, so the expected model holds the
    dequantized value of that tensor. A model with ``rope_factors`` gets them as the
    ``rope_freqs`` tensor (as Llama 3.1's converter writes them), or for gemma3 as a linear
    scaling (the same factor everywhere). phi3 stores Q/K/V as one ``attn_qkv`` and gate/up as one
    ``ffn_up``; gemma3 writes its sliding window, its windowed layers and their rope base.
    ``tokenizer(writer)`` writes the tokenizer's fields instead of ``backend``'s byte-level BPE
    (with the bos/eos ids 1 and 2).
    """
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.dim)
    writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    if cfg.head_dim != cfg.dim // cfg.num_heads:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if cfg.sliding_window is not None:
        writer.add_sliding_window(cfg.sliding_window)
        if cfg.window_layers is not None:
            writer.add_sliding_window_pattern(list(cfg.window_layers))
    if cfg.rope_base_local is not None:
        writer.add_rope_freq_base_swa(cfg.rope_base_local)
    if arch == "gemma3" and cfg.rope_factors is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_factors[0])
    if tokenizer is not None:
        tokenizer(writer)
    else:
        tokens, merges = bpe_vocab_and_merges(backend)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(template)
    expected = {}
    state = dict(model.state_dict())
    if arch == "phi3":  # one attn_qkv and one ffn_up a layer, split again when read
        for i in range(cfg.num_layers):
            for fused, parts in (("self_attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                 ("mlp.gate_up", ("mlp.gate_proj", "mlp.up_proj"))):
                weights = [state.pop(f"layers.{i}.{part}.weight") for part in parts]
                stored = torch.cat(weights).numpy().astype(np.float32)
                writer.add_tensor(f"blk.{i}.{'attn_qkv' if fused == 'self_attn.qkv' else 'ffn_up'}.weight", stored)
                for part, weight in zip(parts, weights):
                    expected[f"layers.{i}.{part}.weight"] = weight.clone()
    for name, tensor in state.items():
        array = tensor.numpy().astype(np.float32)
        stored = array
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            stored = permute_for_llama_rope(array, heads)
        if name.endswith("down_proj.weight"):  # inner dim 96: a whole number of Q8_0 blocks
            quantized = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name(name), quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            array = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0).reshape(array.shape)
        else:
            writer.add_tensor(gguf_name(name), stored)
        expected[name] = torch.from_numpy(np.ascontiguousarray(array))
    if cfg.rope_factors is not None and arch != "gemma3":
        writer.add_tensor("rope_freqs.weight", np.asarray(cfg.rope_factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Transformer.from_state_dict(cfg, expected)


@pytest.fixture
def write_tiny_gguf() -> Callable[..., Transformer]:
    """Fixture form of :func:`write_gguf` ``(path, model, arch, backend, template=ChatML)``."""
    return write_gguf


# Where each GGUF block type keeps its float16 scales (byte offsets in a block): random bytes
# there would make NaN and inf scales, so they get finite values instead.
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,), "Q8_0": (0,)}


def random_raw(kind: Any, rows: int, blocks_per_row: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """``rows`` rows of random blocks of the block type ``kind`` (a
    :class:`~treeserve.ops.block_types.BlockType`): raw bytes ``(rows, blocks * type_size)``,
    every bit random but the float16 scales (normal, times ``scale``)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, kind.type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[kind.name]:
        scales = (rng.standard_normal(rows * blocks_per_row) * scale).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)
