"""``KVCache.move_row``: a row's committed keys, values and length move to an empty row; the
source ends empty and other rows are untouched."""

from __future__ import annotations

import pytest
import torch

from treeserve.ops.kv_cache import KVCache


def filled_cache() -> KVCache:
    cache = KVCache(num_layers=2, batch_size=3, num_kv_heads=2, head_dim=4, capacity=8)
    generator = torch.Generator().manual_seed(0)
    for layer in range(2):
        cache.keys[layer].copy_(torch.randn(cache.keys[layer].shape, generator=generator))
        cache.values[layer].copy_(torch.randn(cache.values[layer].shape, generator=generator))
    cache.lengths[0], cache.lengths[1] = 5, 3
    return cache


def test_move_row_carries_the_committed_slots_and_empties_the_source() -> None:
    cache = filled_cache()
    cache.reset_row(2)
    before = [(k[0, :, :5].clone(), v[0, :, :5].clone()) for k, v in zip(cache.keys, cache.values)]
    other = [(k[1].clone(), v[1].clone()) for k, v in zip(cache.keys, cache.values)]
    cache.move_row(0, 2)
    assert cache.lengths.tolist() == [0, 3, 5]
    for layer, (k, v) in enumerate(before):
        assert torch.equal(cache.keys[layer][2, :, :5], k) and torch.equal(cache.values[layer][2, :, :5], v)
        assert torch.equal(cache.keys[layer][1], other[layer][0]) and torch.equal(cache.values[layer][1], other[layer][1])


def test_move_row_refuses_a_destination_that_holds_tokens() -> None:
    cache = filled_cache()
    with pytest.raises(ValueError, match="reset it first"):
        cache.move_row(0, 1)
    with pytest.raises(ValueError, match="two different rows"):
        cache.move_row(1, 1)
    with pytest.raises(IndexError):
        cache.move_row(0, 3)
