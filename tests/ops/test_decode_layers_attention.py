"""The fused op's attention alone (``torch.ops.treeserve_layers.attend``, the code every layer of
``decode_layers.cpp`` runs): each new token's output against float64 attention over the keys it
may see, for decode batches of rows of different lengths (inside one key block, at block and
128-key segment edges, across several segments), token trees, causal chains, sliding windows
and a query scale; and each row of a batch bit for bit what it gets alone.

The tolerance is the bf16 output's rounding (the op sums in float32): a window one key off,
which the reference case shows, moves outputs by several times it.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from treeserve.ops.kernels import decode_layers

pytestmark = pytest.mark.skipif(not decode_layers.available(), reason="the fused op needs AVX2 and a C++ compiler")

TOLERANCE = 2e-2
"""Largest |op - float64| allowed, on outputs of magnitude up to about 1 (bf16 keeps 8 bits)."""


def reference(q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, mask: Tensor | None, window: int,
              scale: float) -> Tensor:
    """float64 attention of the new tokens (B, T, H, hd) over slots [0, L) and their visible new
    slots, the last ``window`` of each token's keys when ``window`` > 0: (B, T, H * hd)."""
    B, T, H, hd = q.shape
    n_kv = keys.shape[1]
    out = torch.zeros(B, T, H, hd, dtype=torch.float64)
    for b in range(B):
        L = int(lengths[b])
        for t in range(T):
            new = [s for s in range(T) if (mask[b, t, s] if mask is not None else s <= t)]
            slots = list(range(L)) + [L + s for s in new]
            if window > 0:
                slots = slots[-window:]
            for h in range(H):
                g = h // (H // n_kv)
                k = keys[b, g, slots].double()
                v = values[b, g, slots].double()
                weights = torch.softmax(k @ q[b, t, h].double() * scale, dim=0)
                out[b, t, h] = weights @ v
    return out.reshape(B, T, H * hd)


def binary_tree(nodes: int) -> Tensor:
    mask = torch.zeros(nodes, nodes, dtype=torch.bool)
    for i in range(nodes):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = (j - 1) // 2 if j > 0 else -1
    return mask


def inputs(lengths: list[int], new: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    B, capacity = len(lengths), max(lengths) + new + 3
    q = torch.randn(B, new, heads, head_dim, generator=gen).bfloat16()
    keys = torch.randn(B, kv_heads, capacity, head_dim, generator=gen).bfloat16()
    values = torch.randn(B, kv_heads, capacity, head_dim, generator=gen).bfloat16()
    return q, keys, values, torch.tensor(lengths)


def attend(q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, mask: Tensor | None, window: int,
           scale: float) -> Tensor:
    empty = torch.empty(0, dtype=torch.bool)
    result: Tensor = torch.ops.treeserve_layers.attend(q, keys, values, lengths, empty if mask is None else mask, window,
                                                       scale)
    return result


CASES = [
    # (name, row lengths, new tokens, tree?, heads, KV heads, head size, window, scale)
    ("decode batch", [1, 63, 64, 65, 127, 128, 129, 300], 1, False, 9, 3, 64, 0, None),
    ("16-node tree", [200], 16, True, 9, 3, 64, 0, None),
    ("tree on two rows", [5, 190], 7, True, 4, 1, 128, 0, None),
    ("chain (prefill)", [0], 70, False, 9, 3, 64, 0, None),
    ("chain after a prefix", [130], 20, False, 8, 2, 32, 0, None),
    ("window, decode batch", [3, 40, 64, 200], 1, False, 4, 1, 64, 24, None),
    ("window, chain", [100], 30, False, 4, 2, 48, 33, None),
    ("window, tree, query scale", [150], 9, True, 4, 1, 64, 70, 0.07),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_matches_float64(case) -> None:  # type: ignore[no-untyped-def]
    name, lengths, new, tree, heads, kv_heads, head_dim, window, scale = case
    q, keys, values, lengths_t = inputs(lengths, new, heads, kv_heads, head_dim, seed=len(name))
    mask = binary_tree(new).expand(len(lengths), new, new).contiguous() if tree else None
    scale = head_dim**-0.5 if scale is None else scale
    got = attend(q, keys, values, lengths_t, mask, window, scale).double()
    want = reference(q, keys, values, lengths_t, mask, window, scale)
    assert (got - want).abs().max().item() < TOLERANCE
    if window > 0:  # the tolerance tells a window one key wider apart
        wider = reference(q, keys, values, lengths_t, mask, window + 1, scale)
        assert (got - wider).abs().max().item() > 2 * TOLERANCE


def test_a_row_gets_the_same_bits_alone_and_in_a_batch() -> None:
    lengths = [1, 64, 65, 129, 257, 300, 7, 128]
    q, keys, values, lengths_t = inputs(lengths, 1, 9, 3, 64, seed=5)
    together = attend(q, keys, values, lengths_t, None, 0, 0.125)
    for b in range(len(lengths)):
        alone = attend(q[b : b + 1], keys[b : b + 1].contiguous(), values[b : b + 1].contiguous(), lengths_t[b : b + 1],
                       None, 0, 0.125)
        assert torch.equal(alone[0], together[b])
