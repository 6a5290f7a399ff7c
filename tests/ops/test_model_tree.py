"""Tree forward == separate causal passes; commit == incremental decoding (tiny float32 models)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from treeserve.ops.kv_cache import CacheCapacityError, KVCache
from treeserve.ops.model import Transformer
from treeserve.ops.model_config import ModelConfig
from treeserve.ops.tree_attention import tree_mask_from_parents

TOL = 1e-4

CHAIN = [-1, 0, 1, 2, 3, 4]
WIDE = [-1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2]  # many branches at depth 1
MIXED = [-1, 0, 0, 1, 1, 2, 3, 3, 6, -1, 9]  # two roots, uneven depths


def path_of(parents: list[int], node: int) -> list[int]:
    """Root-to-node index path (ascending because parents precede children)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def causal_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Plain causal pass over a 1-D token sequence from an empty cache: (T, V)."""
    cache = model.new_cache(1, capacity=tokens.numel() + 1)
    return model(tokens[None], cache)[0]


def tree_inputs(parents_rows: list[list[int]], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tree_mask (B, T, T), positions (B, T)) for per-row parent arrays and committed lengths."""
    parents = torch.tensor(parents_rows)
    mask = tree_mask_from_parents(parents)
    depth = mask.sum(-1) - 1
    return mask, torch.tensor(lengths)[:, None] + depth


def prefill(model: Transformer, cache: KVCache, prefixes: list[torch.Tensor]) -> None:
    """Commit each row's own prefix; rows end with different lengths.

    Each run writes the prefix into every row's pending slots but only ``row`` keeps it, which
    also exercises "uncommitted pending slots leave no trace".
    """
    for row, prefix in enumerate(prefixes):
        model(prefix[None].expand(cache.batch_size, -1), cache)
        cache.commit(row, range(prefix.numel()))


GEMMA3 = {"qk_norm": True, "sliding_window": 4, "window_layers": (True, False, True), "rope_base_local": 500.0,
          "post_norms": True, "activation": "gelu_tanh", "embed_scale": 2.0, "attn_scale": 0.3}
"""Gemma 3's parts on the tiny model: a window of 4 keys (shorter than the prefixes and trees)."""


@pytest.mark.parametrize("shape", [CHAIN, WIDE, MIXED], ids=["chain", "wide", "mixed"])
@pytest.mark.parametrize("variant", [{}, {"qkv_bias": True, "tie_embeddings": False}, GEMMA3], ids=["llama", "qwen2", "gemma3"])
def test_tree_pass_equals_separate_path_passes(tiny_model_factory: Callable[..., Transformer], shape: list[int], variant: dict) -> None:
    model = tiny_model_factory(seed=1, **variant)
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    prefixes = [torch.randint(0, vocab, (5,), generator=gen), torch.randint(0, vocab, (9,), generator=gen)]
    # Row 1 gets a different random tree of the same size.
    other = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, len(shape))]
    rows = [shape, other]
    tree_tokens = torch.randint(0, vocab, (2, len(shape)), generator=gen)
    with torch.inference_mode():
        cache = model.new_cache(2, capacity=64)
        prefill(model, cache, prefixes)
        assert cache.lengths.tolist() == [5, 9]
        mask, positions = tree_inputs(rows, [5, 9])
        logits = model(tree_tokens, cache, tree_mask=mask, positions=positions)
        assert cache.lengths.tolist() == [5, 9], "forward must not advance lengths"
        worst = 0.0
        for row in range(2):
            for node in range(len(shape)):
                seq = torch.cat([prefixes[row], tree_tokens[row, path_of(rows[row], node)]])
                ref = causal_logits(model, seq)[-1]
                worst = max(worst, (ref - logits[row, node]).abs().max().item())
    assert worst <= TOL


def test_causal_mask_on_a_branching_tree_is_detected(tiny_model_factory: Callable[..., Transformer]) -> None:
    """The equality check must fail for a wrong implementation (siblings seeing each other)."""
    model = tiny_model_factory(seed=2)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 101, (4,), generator=gen)
    tokens = torch.randint(0, 101, (1, len(WIDE)), generator=gen)
    with torch.inference_mode():
        cache = model.new_cache(1, capacity=32)
        model(prefix[None], cache)
        cache.commit(0, range(4))
        _, positions = tree_inputs([WIDE], [4])
        wrong = model(tokens, cache, tree_mask=None, positions=positions)  # causal instead of tree
        node = 5
        ref = causal_logits(model, torch.cat([prefix, tokens[0, path_of(WIDE, node)]]))[-1]
    assert (ref - wrong[0, node]).abs().max().item() > 1e-2


def incremental_cache(model: Transformer, tokens: torch.Tensor, capacity: int) -> tuple[KVCache, torch.Tensor]:
    """Cache and per-step logits from decoding ``tokens`` one at a time."""
    cache = model.new_cache(1, capacity=capacity)
    outs = []
    for tok in tokens.tolist():
        outs.append(model(torch.tensor([[tok]]), cache)[0, 0])
        cache.commit(0, [0])
    return cache, torch.stack(outs)


@pytest.mark.parametrize("leaf", [8, 3, 10], ids=["deep-branch", "short", "second-root-chain"])
def test_commit_of_accepted_path_equals_incremental_cache(tiny_model_factory: Callable[..., Transformer], leaf: int) -> None:
    model = tiny_model_factory(seed=4)
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 101, (6,), generator=gen)
    tokens = torch.randint(0, 101, (1, len(MIXED)), generator=gen)
    follow = torch.randint(0, 101, (3,), generator=gen)
    keep = path_of(MIXED, leaf)
    with torch.inference_mode():
        cache = model.new_cache(1, capacity=40)
        model(prefix[None], cache)
        cache.commit(0, range(6))
        mask, positions = tree_inputs([MIXED], [6])
        model(tokens, cache, tree_mask=mask, positions=positions)
        cache.commit(0, keep)
        accepted = torch.cat([prefix, tokens[0, keep]])
        ref_cache, _ = incremental_cache(model, accepted, capacity=40)
        n = accepted.numel()
        assert cache.lengths.tolist() == [n] == ref_cache.lengths.tolist()
        for layer in range(model.config.num_layers):
            assert torch.allclose(cache.keys[layer][:, :, :n], ref_cache.keys[layer][:, :, :n], atol=1e-5)
            assert torch.allclose(cache.values[layer][:, :, :n], ref_cache.values[layer][:, :, :n], atol=1e-5)
        after = model(follow[None], cache)[0]
        after_ref = model(follow[None], ref_cache)[0]
        full_ref = causal_logits(model, torch.cat([accepted, follow]))[-3:]
    assert (after - after_ref).abs().max().item() <= TOL
    assert (after - full_ref).abs().max().item() <= TOL


def test_committing_a_non_path_is_detected(tiny_model_factory: Callable[..., Transformer]) -> None:
    """Keeping siblings (not a root-to-leaf path) must give a cache unlike incremental decoding."""
    model = tiny_model_factory(seed=4)
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 101, (6,), generator=gen)
    tokens = torch.randint(0, 101, (1, len(WIDE)), generator=gen)
    keep = [0, 1, 2]  # 1 and 2 are siblings
    with torch.inference_mode():
        cache = model.new_cache(1, capacity=40)
        model(prefix[None], cache)
        cache.commit(0, range(6))
        mask, positions = tree_inputs([WIDE], [6])
        model(tokens, cache, tree_mask=mask, positions=positions)
        cache.commit(0, keep)
        ref_cache, _ = incremental_cache(model, torch.cat([prefix, tokens[0, keep]]), capacity=40)
    diff = (cache.keys[1][:, :, :9] - ref_cache.keys[1][:, :, :9]).abs().max().item()
    assert diff > 1e-3


def test_padded_batch_rows_match_unpadded_runs(tiny_model_factory: Callable[..., Transformer]) -> None:
    """Row 0 has 3 real tokens padded to 5 (self-only pad tokens); real logits are unaffected."""
    model = tiny_model_factory(seed=6)
    gen = torch.Generator().manual_seed(8)
    prefixes = [torch.randint(0, 101, (4,), generator=gen), torch.randint(0, 101, (7,), generator=gen)]
    real = [torch.randint(0, 101, (3,), generator=gen), torch.randint(0, 101, (5,), generator=gen)]
    with torch.inference_mode():
        cache = model.new_cache(2, capacity=32)
        prefill(model, cache, prefixes)
        tokens = torch.stack([torch.cat([real[0], torch.zeros(2, dtype=torch.long)]), real[1]])
        mask = torch.tril(torch.ones(5, 5, dtype=torch.bool)).repeat(2, 1, 1)
        mask[0, 3:, :] = False
        mask[0, 3, 3] = mask[0, 4, 4] = True  # pads see only themselves (and the prefix)
        logits = model(tokens, cache, tree_mask=mask)
        cache.commit(0, range(3))
        cache.commit(1, range(5))
        for row in range(2):
            ref = causal_logits(model, torch.cat([prefixes[row], real[row]]))[-real[row].numel():]
            assert (logits[row, : real[row].numel()] - ref).abs().max().item() <= TOL
        assert cache.lengths.tolist() == [7, 12]
        nxt = model(torch.tensor([[5], [6]]), cache)
        for row, tok in enumerate([5, 6]):
            ref = causal_logits(model, torch.cat([prefixes[row], real[row], torch.tensor([tok])]))[-1]
            assert (nxt[row, 0] - ref).abs().max().item() <= TOL


def test_return_hidden_and_truncated_model_share_weights(tiny_model_factory: Callable[..., Transformer]) -> None:
    model = tiny_model_factory(seed=9)
    small = model.truncated(1)
    assert small.config.num_layers == 1
    assert small.layers[0] is model.layers[0] and small.embed_tokens is model.embed_tokens
    tokens = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        logits, hidden = model(tokens, model.new_cache(1, 8), return_hidden=True)
        small_logits = small(tokens, small.new_cache(1, 8))
        projected = hidden @ model.embed_tokens.weight.T
    assert hidden.shape == (1, 3, model.config.dim)
    assert torch.allclose(logits, projected, atol=1e-5)
    assert small_logits.shape == logits.shape and not torch.allclose(small_logits, logits)
    with pytest.raises(ValueError):
        model.truncated(0)


def test_hidden_states_and_logits_to_keep_match_the_full_forward(tiny_model_factory: Callable[..., Transformer]) -> None:
    model = tiny_model_factory(seed=9, tie_embeddings=False)
    tokens = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    full_cache, head_cache, last_cache = (model.new_cache(2, 8) for _ in range(3))
    logits, hidden = model(tokens, full_cache, return_hidden=True)
    states = model.hidden_states(tokens, head_cache)
    last, last_hidden = model(tokens, last_cache, return_hidden=True, logits_to_keep=2)
    assert torch.equal(states, hidden) and torch.equal(last_hidden, hidden)
    assert last.shape == (2, 2, model.config.vocab_size) and torch.allclose(last, logits[:, -2:], atol=1e-6)
    for layer in range(model.config.num_layers):  # the same pending K/V, whatever is scored
        for cache in (head_cache, last_cache):
            assert torch.equal(cache.keys[layer][:, :, :5], full_cache.keys[layer][:, :, :5])
            assert torch.equal(cache.values[layer][:, :, :5], full_cache.values[layer][:, :, :5])
    for bad in (0, 6):
        with pytest.raises(ValueError, match="logits_to_keep"):
            model(tokens, model.new_cache(2, 8), logits_to_keep=bad)
    with pytest.raises(ValueError, match="positions"):
        model.hidden_states(tokens, model.new_cache(2, 8), positions=torch.tensor([[0]]))


def test_cache_errors_and_row_bookkeeping(tiny_model_factory: Callable[..., Transformer]) -> None:
    model = tiny_model_factory(seed=10)
    with torch.inference_mode():
        cache = model.new_cache(1, capacity=4)
        model(torch.tensor([[1, 2, 3]]), cache)
        with pytest.raises(ValueError, match="pending"):
            cache.commit(0, [3])
        with pytest.raises(ValueError, match="ascending"):
            cache.commit(0, [1, 0])
        cache.commit(0, [0, 1, 2])
        with pytest.raises(CacheCapacityError, match="capacity 4"):
            model(torch.tensor([[1, 2]]), cache)
        cache.truncate(0, 1)
        assert cache.lengths.tolist() == [1]
        with pytest.raises(ValueError):
            cache.truncate(0, 2)
        cache.reset_row(0)
        assert cache.lengths.tolist() == [0]
        with pytest.raises(IndexError):
            cache.reset_row(1)


def test_forward_input_validation(tiny_model_factory: Callable[..., Transformer]) -> None:
    model = tiny_model_factory(seed=10)
    cache = model.new_cache(1, capacity=8)
    with pytest.raises(ValueError, match="at least one"):
        model(torch.zeros(1, 0, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="bool"):
        model(torch.tensor([[1, 2]]), cache, tree_mask=torch.ones(1, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="positions"):
        model(torch.tensor([[1, 2]]), cache, positions=torch.tensor([[0]]))
    with pytest.raises(ValueError, match="does not fit"):
        model(torch.tensor([[1], [2]]), cache)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(vocab_size=10, dim=8, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4, ffn_dim=8)
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig(vocab_size=0, dim=8, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4, ffn_dim=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tree_pass_on_cuda_matches_cpu(tiny_model_factory: Callable[..., Transformer]) -> None:
    """GPU twin: the same tree forward on CUDA gives the CPU logits (same inputs as above)."""
    model = tiny_model_factory(seed=1)
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 101, (1, 5), generator=gen)
    tokens = torch.randint(0, 101, (1, len(MIXED)), generator=gen)
    mask, positions = tree_inputs([MIXED], [5])
    outs = []
    for device in ("cpu", "cuda"):
        m = model.to(device)
        cache = m.new_cache(1, capacity=32)
        m(prefix.to(device), cache)
        cache.commit(0, range(5))
        outs.append(m(tokens.to(device), cache, tree_mask=mask.to(device), positions=positions.to(device)).cpu())
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-3  # TF32/fused kernels differ in rounding
