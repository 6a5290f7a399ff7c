"""Tree attention against a slow float64 reference, on CPU and (marked ``gpu``) on CUDA.

The CPU and CUDA cases share inputs through one parametrized test; the CUDA case runs the
CuPy kernel through the dispatcher and skips cleanly without CUDA or cupy.
"""

from __future__ import annotations

import math

import pytest
import torch

from treeserve.ops.tree_attention import (
    ancestor_bits_from_parents,
    is_cuda_kernel_available,
    tree_attention,
    tree_attention_from_bits,
    tree_attention_from_parents,
    tree_mask_from_parents,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not is_cuda_kernel_available(), reason="needs CUDA and cupy")],
    ),
]


def brute_force_mask(parents: list[int]) -> torch.Tensor:
    """Ancestor-or-self mask by walking up from every node."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        node = i
        while node >= 0:
            mask[i, node] = True
            node = parents[node]
    return mask


def reference_attention(q, k, v, prefix_lengths, parents_rows):  # type: ignore[no-untyped-def]
    """Loop-over-everything float64 attention of each new token over its visible slots."""
    batch, num_heads, num_new, head_dim = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        length = int(prefix_lengths[b])
        mask = brute_force_mask(parents_rows[b])
        for h in range(num_heads):
            for t in range(num_new):
                slots = list(range(length)) + [length + s for s in range(num_new) if mask[t, s]]
                keys = k[b, h // group, slots].double()
                scores = keys @ q[b, h, t].double() / math.sqrt(head_dim)
                out[b, h, t] = torch.softmax(scores, 0) @ v[b, h // group, slots].double()
    return out


def make_inputs(seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, head_dim, num_new, capacity = 2, 6, 2, 16, 9, 40
    prefix_lengths = torch.tensor([0, 13])  # an empty prefix exercises root-only attention
    parents_rows = [[-1, 0, 0, 1, 1, 2, 5, 5, -1], [-1, 0, 1, 2, 3, 4, 5, 6, 7]]  # tree and chain
    q = torch.randn(batch, heads, num_new, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, capacity, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, capacity, head_dim, generator=gen)
    return q, k, v, prefix_lengths, parents_rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_attention_matches_reference(device: str, seed: int) -> None:
    q, k, v, prefix_lengths, parents_rows = make_inputs(seed)
    expected = reference_attention(q, k, v, prefix_lengths, parents_rows)
    parents = torch.tensor(parents_rows)
    got = tree_attention_from_parents(
        q.to(device), k.to(device), v.to(device), prefix_lengths.to(device), parents.to(device)
    ).cpu()
    assert got.shape == q.shape
    assert (got.double() - expected).abs().max().item() < 1e-5
    if device == "cpu":
        via_mask = tree_attention(q, k, v, prefix_lengths, brute_force_mask(parents_rows[0]).repeat(2, 1, 1))
        # Row 0 uses its own tree; row 1 the same tree here (not its chain), so compare row 0 only.
        assert (via_mask[0].double() - expected[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_tree_attention_from_bits_matches_reference(device: str, dtype: torch.dtype) -> None:
    """The ancestor-word entry point (the CUDA kernel's; on CPU its twin) on the same inputs, in
    each dtype against float64 of the rounded inputs: 1e-5 in float32, 2e-2 in 16 bits."""
    q, k, v, prefix_lengths, parents_rows = make_inputs(4)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    expected = reference_attention(q, k, v, prefix_lengths, parents_rows)
    bits = ancestor_bits_from_parents(torch.tensor(parents_rows))
    got = tree_attention_from_bits(q.to(device), k.to(device), v.to(device), prefix_lengths.to(device), bits.to(device))
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.cpu().double() - expected).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_sibling_leak_is_detected(device: str) -> None:
    """A causal (sibling-leaking) mask must differ from the reference: the check can fail."""
    q, k, v, prefix_lengths, parents_rows = make_inputs(3)
    expected = reference_attention(q, k, v, prefix_lengths, parents_rows)
    chain = torch.arange(-1, q.shape[2] - 1).expand(2, -1)  # treats every node as the previous one's child
    wrong = tree_attention_from_parents(
        q.to(device), k.to(device), v.to(device), prefix_lengths.to(device), chain.to(device)
    ).cpu()
    assert (wrong.double() - expected).abs().max().item() > 1e-2


def test_tree_mask_from_parents_matches_brute_force() -> None:
    gen = torch.Generator().manual_seed(11)
    for n in (1, 2, 7, 33):
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, n)]
        assert torch.equal(tree_mask_from_parents(torch.tensor(parents)), brute_force_mask(parents))
    batched = torch.tensor([[-1, 0, 0], [-1, -1, 1]])
    assert torch.equal(tree_mask_from_parents(batched)[1], brute_force_mask([-1, -1, 1]))


@pytest.mark.parametrize("bad", [[0], [-1, 1], [-1, 0, 5], [-2]])
def test_tree_mask_rejects_non_topological_parents(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="parents"):
        tree_mask_from_parents(torch.tensor(bad))


def test_cuda_module_imports_without_cupy() -> None:
    """Importing the kernel module must not import cupy (it is loaded lazily)."""
    import sys

    import treeserve.ops.kernels.tree_attention_cuda as mod

    assert all(name in mod.KERNEL_SOURCE for name in mod.KERNEL_NAMES)
    if importlib_find("cupy") is None:
        assert "cupy" not in sys.modules


def importlib_find(name: str):  # type: ignore[no-untyped-def]
    import importlib.util

    return importlib.util.find_spec(name)


def test_window_mask_keeps_the_last_window_keys_of_each_token() -> None:
    """A key at position ``k`` is within the window of a token at position ``p`` iff
    ``p - w < k <= p``... for committed slots (slot = position) and tree slots (their
    depth-based positions), against a loop over every (token, slot)."""
    from treeserve.ops.tree_attention import build_attention_mask, tree_mask_from_parents, window_mask

    parents = torch.tensor([[-1, 0, 0, 1, 3], [-1, -1, 1, 2, 0]])
    tree = tree_mask_from_parents(parents)
    lengths = torch.tensor([6, 2])
    positions = lengths[:, None] + tree.sum(-1) - 1
    slots = int(lengths.max()) + 5
    for window in (1, 3, 5):
        got = (build_attention_mask(lengths, tree, 5, slots) & window_mask(lengths, positions, slots, window))[:, 0]
        for b in range(2):
            for t in range(5):
                for slot in range(slots):
                    s_new = slot - int(lengths[b])
                    if slot < lengths[b]:
                        visible, key = True, slot
                    elif s_new < 5:
                        visible, key = bool(tree[b, t, s_new]), int(positions[b, s_new])
                    else:
                        visible, key = False, 0
                    expected = visible and int(positions[b, t]) - key < window
                    assert bool(got[b, t, slot]) == expected, (window, b, t, slot)
