"""The real default model (marked ``model``): perplexity, Q/K un-permutation, tokenizer, chat template.

The session fixture pulls the model into ``$TREESERVE_CACHE`` or ``~/.cache/treeserve`` once
(``treeserve pull`` does the same) and converts it once.
"""

from __future__ import annotations

import math
from importlib import resources

import pytest
import torch

from treeserve.models import DEFAULT_MODEL, pull
from treeserve.ops.loaders.gguf import read_gguf
from treeserve.ops.model import Transformer
from treeserve.ops.tokenizer import IncrementalDetokenizer
from treeserve.ops.tree_attention import tree_mask_from_parents

pytestmark = pytest.mark.model

# Measured: about 12.7 with the correct loader, about 159 with Q/K left permuted.
PERPLEXITY_BOUND = 25.0


def english_text() -> str:
    return resources.files("treeserve.ops").joinpath("data/english.txt").read_text(encoding="utf-8")


def perplexity(model: Transformer, ids: list[int]) -> float:
    tokens = torch.tensor([ids])
    logits = model(tokens, model.new_cache(1, len(ids)))
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:])
    return math.exp(nll.item())


def test_default_model_facts(default_model) -> None:
    cfg = default_model.config
    assert (cfg.num_layers, cfg.dim, cfg.ffn_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 1536, 9, 3, 64)
    assert (cfg.vocab_size, cfg.rope_base, cfg.max_seq_len, cfg.tie_embeddings) == (49152, 1e5, 8192, True)
    tok = default_model.tokenizer
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.decode([1, 2]) == "<|im_start|><|im_end|>"


def test_perplexity_on_english_is_low(default_model) -> None:
    ids = default_model.tokenizer.encode(english_text())
    assert 400 <= len(ids) <= 600
    assert perplexity(default_model.model, ids) < PERPLEXITY_BOUND


def test_skipping_the_qk_unpermute_breaks_perplexity(default_model, default_model_cache_dir) -> None:
    """The same check fails for a loader that forgets llama.cpp's Q/K permutation."""
    raw = read_gguf(pull(DEFAULT_MODEL, default_model_cache_dir), unpermute_qk=False)
    wrong = Transformer.from_state_dict(raw.config, raw.state_dict)
    ids = default_model.tokenizer.encode(english_text())
    assert perplexity(wrong, ids) > 4 * PERPLEXITY_BOUND


def test_tokenizer_round_trip_and_chat_template(default_model) -> None:
    tok = default_model.tokenizer
    text = english_text() + "\nDigits 2024, unicode café – 日本語 🙂 and <|im_end|>."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("123") == [tok.backend.token_to_id(d) for d in "123"]  # smollm splits digits
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([i]) for i in ids) + detok.finish() == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[0] == tok.bos_id


def test_tree_pass_matches_path_passes_on_the_real_model(default_model) -> None:
    model = default_model.model
    prefix = default_model.tokenizer.encode("The capital of France is")
    parents = [-1, 0, 0, 1, 2]
    tree_tokens = torch.tensor([[12, 345, 678, 90, 1000]])
    mask = tree_mask_from_parents(torch.tensor(parents))
    depth = mask.sum(-1) - 1
    cache = model.new_cache(1, 64)
    model(torch.tensor([prefix]), cache)
    cache.commit(0, range(len(prefix)))
    logits = model(tree_tokens, cache, tree_mask=mask[None], positions=(len(prefix) + depth)[None])
    for node in range(len(parents)):
        path = mask[node].nonzero().flatten()
        seq = torch.tensor([prefix + tree_tokens[0, path].tolist()])
        ref = model(seq, model.new_cache(1, seq.shape[1]))[0, -1]
        assert (ref - logits[0, node]).abs().max().item() <= 1e-4  # measured about 5e-5
