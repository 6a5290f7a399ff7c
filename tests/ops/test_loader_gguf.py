"""GGUF round trips: tiny llama (Q/K permuted like llama.cpp) and qwen2 (bias, untied) models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from treeserve.ops.loaders.gguf import permute_for_llama_rope, read_gguf, unpermute_llama_rope
from treeserve.ops.model import Transformer
from treeserve.ops.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Tokenizers split 2024 days; café 🙂 <|im_start|>user"


def logits_of(model: Transformer, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens]), model.new_cache(1, len(tokens)))[0]


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("qwen2", {"qkv_bias": True, "tie_embeddings": False})],
)
def test_gguf_round_trip_gives_same_logits(
    tmp_path: Path, tiny_model_factory, tiny_bpe_backend, write_tiny_gguf, arch, overrides
) -> None:
    vocab = tiny_bpe_backend.get_vocab_size()
    source = tiny_model_factory(seed=3, vocab_size=vocab, **overrides)
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(path, source, arch, tiny_bpe_backend)
    loaded = read_gguf(path)
    assert loaded.architecture == arch
    assert loaded.config == source.config
    model = Transformer.from_state_dict(loaded.config, loaded.state_dict)
    tokens = [5, 77, 200, 3, 150, 9, 11]
    got = logits_of(model, tokens)
    assert (got - logits_of(expected, tokens)).abs().max().item() <= 1e-5
    # Q8_0 only touched ffn_down, so the source model is close but not identical.
    assert (got - logits_of(source, tokens)).abs().max().item() < 0.5

    if arch == "llama":
        # The permutation matters: skipping the undo step changes the logits.
        wrong = read_gguf(path, unpermute_qk=False)
        bad = Transformer.from_state_dict(wrong.config, wrong.state_dict)
        assert (logits_of(bad, tokens) - got).abs().max().item() > 1e-2

    tokenizer = Tokenizer.from_gguf(path)
    assert tokenizer.encode(TEXT) == tiny_bpe_backend.encode(TEXT).ids
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    assert {0, 2} <= tokenizer.stop_ids
    assert tokenizer.encode("<|im_start|>")[0] == 1  # specials are matched as one token
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    weight = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    permuted = permute_for_llama_rope(weight, 4)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(unpermute_llama_rope(permuted, 4), weight)


def test_incremental_detokenizer_never_splits_characters(tiny_bpe_backend) -> None:
    tokenizer = Tokenizer(tiny_bpe_backend, bos_id=1, eos_id=2, chat_template=None)
    text = "naïve 日本 🙂 ok"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.finish())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    # Byte-level tokens of the emoji alone do not decode to a complete character.
    naive = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in naive)
