"""The decode step's CPU tree-attention kernel (``kernels.tree_attention_cpu``) against the slow
float64 reference: random trees and chains, ragged committed lengths across its key blocks,
GQA groups, head sizes that are and are not multiples of 16, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from treeserve.ops.kernels import tree_attention_cpu
from treeserve.ops.tree_attention import tree_mask_from_parents

from .test_tree_attention import reference_attention

pytestmark = pytest.mark.skipif(not tree_attention_cpu.available(), reason="needs AVX-512 or AVX2, and a C++ compiler")

# (heads, kv_heads, head_dim, new tokens, committed lengths per row)
CASES = [
    (6, 2, 16, 9, [0, 13]),
    (9, 3, 64, 1, [63, 64, 65, 200]),  # the default model's heads: one decode token per row
    (9, 3, 64, 16, [130, 1]),
    (9, 3, 64, 64, [70]),
    (4, 1, 8, 7, [5, 0, 31]),
    (4, 2, 72, 5, [40, 17]),  # a head size with a 16-lane tail
    (8, 8, 128, 3, [33, 2]),  # no grouping, the widest head
    (2, 1, 4, 12, [3]),
    (9, 3, 64, 40, [300, 17]),  # bf16 on AMX: 120 query rows per KV group, a partial row tile
]


def random_parents(num_new: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, num_new)]


def inputs(case: tuple, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    heads, kv_heads, head_dim, num_new, lengths = case
    gen = torch.Generator().manual_seed(seed)
    batch, capacity = len(lengths), max(lengths) + num_new + 3
    q = torch.randn(batch, num_new, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, capacity, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, capacity, head_dim, generator=gen).to(dtype)
    parents = [random_parents(num_new, gen) for _ in lengths]
    if batch > 1:
        parents[-1] = list(range(-1, num_new - 1))  # one row a chain
    return q, k, v, torch.tensor(lengths), parents


def reference(q, k, v, lengths, parents):  # type: ignore[no-untyped-def]
    expected = reference_attention(q.transpose(1, 2).double(), k.double(), v.double(), lengths, parents)
    return expected.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"h{case[0]}kv{case[1]}d{case[2]}t{case[3]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_float64_reference(case: tuple, dtype: torch.dtype) -> None:
    q, k, v, lengths, parents = inputs(case, dtype)
    mask = tree_mask_from_parents(torch.tensor(parents))
    got = tree_attention_cpu.tree_decode(q, k, v, lengths, mask)
    assert got.shape == (q.shape[0], q.shape[1], q.shape[2] * q.shape[3]) and got.dtype == dtype
    # The reference sees the same (bf16-rounded) inputs; bf16 output adds half a bf16 step.
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2
    assert (got.double() - reference(q, k, v, lengths, parents)).abs().max().item() < tolerance


# Few items for the threads (one row, or two): each item's slots are split into segments,
# attended apart and merged; ragged rows leave the short row's later segments empty.
SPLIT_CASES = [
    (9, 3, 64, 1, [300]),
    (9, 3, 64, 5, [400]),  # a tree in the last segment
    (9, 3, 64, 1, [500, 3]),
    (6, 2, 16, 2, [1000]),
    (9, 3, 64, 16, [700]),  # bf16 on AMX: the tile path's segments
    (9, 3, 64, 20, [500, 3]),  # and a short row's empty ones
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda case: f"h{case[0]}kv{case[1]}t{case[3]}len{case[4]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_split_over_threads_merge_to_the_reference(case: tuple, dtype: torch.dtype) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split needs more than one thread
    try:
        q, k, v, lengths, parents = inputs(case, dtype, seed=3)
        got = tree_attention_cpu.tree_decode(q, k, v, lengths, tree_mask_from_parents(torch.tensor(parents)))
    finally:
        torch.set_num_threads(threads)
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2
    assert (got.double() - reference(q, k, v, lengths, parents)).abs().max().item() < tolerance


def test_a_mask_that_leaks_siblings_is_caught() -> None:
    """The check has power: the same tree attended as a chain misses the reference."""
    q, k, v, lengths, parents = inputs((6, 2, 16, 9, [0, 13]), torch.float32, seed=3)
    parents = [[-1, 0, 0, 1, 1, 2, 5, 5, -1]] * 2
    chain = torch.ones(9, 9, dtype=torch.bool).tril().expand(2, -1, -1)
    wrong = tree_attention_cpu.tree_decode(q, k, v, lengths, chain)
    assert (wrong.double() - reference(q, k, v, lengths, parents)).abs().max().item() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mask_that_leaks_siblings_is_caught_on_every_path(dtype: torch.dtype) -> None:
    """As above, for a 16-node tree of the default model's heads (bf16 runs on AMX tiles where
    the CPU has them)."""
    q, k, v, lengths, parents = inputs((9, 3, 64, 16, [90]), dtype, seed=5)
    chain = torch.ones(16, 16, dtype=torch.bool).tril()[None]
    wrong = tree_attention_cpu.tree_decode(q, k, v, lengths, chain)
    assert (wrong.double() - reference(q, k, v, lengths, parents)).abs().max().item() > 5e-2


@pytest.mark.parametrize("threads", [1, 2])  # one segment per KV group, or several merged
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_query_in_a_tree_spoils_its_own_row_only(dtype: torch.dtype, threads: int) -> None:
    q, k, v, lengths, parents = inputs((9, 3, 64, 16, [90]), dtype, seed=6)
    q[0, 3, 4, 7] = float("nan")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = tree_attention_cpu.tree_decode(q, k, v, lengths, tree_mask_from_parents(torch.tensor(parents)))
    finally:
        torch.set_num_threads(before)
    spoiled = got.view(1, 16, 9, 64)[0, 3, 4]
    assert spoiled.isnan().all()
    rest = got.view(1, 16, 9, 64).clone()
    rest[0, 3, 4] = 0.0
    assert rest.isfinite().all()


def test_a_non_finite_query_spoils_its_own_row_only() -> None:
    q, k, v, lengths, parents = inputs((9, 3, 64, 1, [63, 64, 65, 200]), torch.float32)
    q[1, 0, 4, 7] = float("nan")
    got = tree_attention_cpu.tree_decode(q, k, v, lengths, torch.ones(4, 1, 1, dtype=torch.bool))
    assert got[1].isnan().any()
    assert got[[0, 2, 3]].isfinite().all()


def test_new_tokens_past_the_capacity_are_refused() -> None:
    q, k, v, lengths, parents = inputs((4, 1, 8, 7, [5, 0, 31]), torch.float32)
    mask = tree_mask_from_parents(torch.tensor(parents))
    capacity, num_new = k.shape[2], q.shape[1]
    tree_attention_cpu.tree_decode(q, k, v, torch.tensor([5, 0, capacity - num_new]), mask)  # fills the row
    with pytest.raises(RuntimeError, match="do not fit"):
        tree_attention_cpu.tree_decode(q, k, v, torch.tensor([5, 0, capacity - num_new + 1]), mask)


def test_groups_wider_than_one_item_are_refused_not_overrun() -> None:
    q = torch.randn(1, 1, 32, 16)
    k = v = torch.randn(1, 1, 8, 16)
    assert not tree_attention_cpu.supports(q, kv_heads=1) and tree_attention_cpu.supports(q, kv_heads=2)
    with pytest.raises(RuntimeError, match="query heads per KV head"):
        tree_attention_cpu.tree_decode(q, k, v, torch.tensor([3]), torch.ones(1, 1, 1, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_strided_new_rows_after_each_rows_length(dtype: torch.dtype) -> None:
    """The decode step passes its values as a slice of the fused QKV output (not contiguous)."""
    gen = torch.Generator().manual_seed(7)
    batch, kv_heads, capacity, head_dim, num_new = 2, 3, 20, 64, 5
    keys = torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype)
    values = torch.zeros_like(keys)
    fused = torch.randn(batch, num_new, 3 * kv_heads * head_dim, generator=gen).to(dtype)
    new_k, new_v, _ = fused.split(kv_heads * head_dim, dim=-1)
    new_k = new_k.view(batch, num_new, kv_heads, head_dim)
    new_v = new_v.view(batch, num_new, kv_heads, head_dim)
    assert not new_k.is_contiguous()
    lengths = torch.tensor([0, 9])
    tree_attention_cpu.write_kv(keys, values, new_k, new_v, lengths)
    for b, start in enumerate(lengths.tolist()):
        assert torch.equal(keys[b, :, start:start + num_new], new_k[b].transpose(0, 1))
        assert torch.equal(values[b, :, start:start + num_new], new_v[b].transpose(0, 1))
        assert not keys[b, :, :start].any() and not keys[b, :, start + num_new:].any()
