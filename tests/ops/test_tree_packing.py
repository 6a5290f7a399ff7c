"""pack_trees: one batched forward over several rows' token trees equals per-row forwards."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from treeserve.ops.model import Transformer
from treeserve.ops.model_config import ModelConfig
from treeserve.ops.token_tree import TokenTree, pack_trees


def tiny_model() -> Transformer:
    config = ModelConfig(
        vocab_size=50, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64, max_seq_len=64
    )
    gen = torch.Generator().manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(param.shape, generator=gen))
    return model.eval()


def logits_of(model: Transformer, tokens: Tensor, cache, **kwargs: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
    out = model(tokens, cache, **kwargs)
    assert isinstance(out, Tensor)
    return out


def test_batched_tree_forward_matches_each_row_alone() -> None:
    model = tiny_model()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 50, (3, 9), generator=gen)
    lengths = [9, 4, 6]
    trees = [
        TokenTree.from_parents([-1, 0, 0, 1, 3], [7, 8, 9, 10, 11]),
        TokenTree.chain(3, [4]),
        TokenTree.from_parents([-1, 0, 1, 0, 3, 3, 2], [1, 2, 3, 4, 5, 6, 7]),
    ]
    packed = pack_trees(trees, lengths, pad_token_id=49)
    assert packed.tokens.shape == (3, 7) and packed.num_nodes == (5, 2, 7)
    assert packed.positions[1].tolist() == [4, 5] + [4] * 5
    with torch.no_grad():
        cache = model.new_cache(3, 32)
        logits_of(model, prompts, cache)
        for row, length in enumerate(lengths):
            cache.commit(row, range(length))
        batched = logits_of(model, packed.tokens, cache, tree_mask=packed.tree_mask, positions=packed.positions)
        for row, (tree, length) in enumerate(zip(trees, lengths)):
            alone_cache = model.new_cache(1, 32)
            logits_of(model, prompts[row : row + 1, :length], alone_cache)
            alone_cache.commit(0, range(length))
            alone = logits_of(
                model,
                tree.tokens[None],
                alone_cache,
                tree_mask=tree.tree_mask()[None],
                positions=(length + tree.depths())[None],
            )
            torch.testing.assert_close(batched[row, : tree.num_nodes], alone[0], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="one committed length per tree"):
        pack_trees(trees, [1, 2])
