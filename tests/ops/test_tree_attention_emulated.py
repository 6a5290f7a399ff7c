"""The CUDA tree-attention kernels run on the CPU: their source compiled by g++ under a shim
that emulates blocks, threads, shared memory and barriers (:mod:`treeserve.testing.tree_attention_shim`),
driven by the kernel's own host code (:func:`run_tree_attention`: plan, strides, workspace,
combine). Results must match a float64 reference on random trees (chains, wide, deep, 64
nodes), GQA, batches with different prefixes, several splits and block sizes, and float32,
bfloat16 and float16 inputs. The CPU twin (:func:`tree_attention_from_bits` on CPU) runs the
same cases, and so does the real kernel on CUDA (marked ``gpu``). Broken variants of the
source (mask ignored, no online-softmax rescale, a combine without the splits' weights) must
fail the same comparison. Skips without g++ (C++20).
"""

from __future__ import annotations

import importlib.util
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from treeserve.ops.kernels.tree_attention_cuda import KERNEL_SOURCE, THREADS_PER_BLOCK, plan_launch, run_tree_attention
from treeserve.ops.tree_attention import (
    ancestor_bits_from_mask,
    ancestor_bits_from_parents,
    is_cuda_kernel_available,
    tree_attention_from_bits,
    tree_mask_from_ancestor_bits,
    tree_mask_from_parents,
)
from treeserve.testing import tree_attention_shim

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
"""Against float64 on the same (rounded) inputs: float32 sums, then one rounding of the output
to the input dtype (bf16 keeps 8 bits of mantissa, fp16 11)."""


def _build(folder: Path, source: str) -> Any:
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to emulate the kernel")
    try:
        return tree_attention_shim.build(folder, source)
    except RuntimeError as exc:
        if "barrier" in str(exc):
            pytest.skip("g++ lacks C++20 <barrier>")
        raise


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _build(tmp_path_factory.mktemp("kernel"), KERNEL_SOURCE)


def random_tree(num_nodes: int, gen: torch.Generator, shape: str) -> list[int]:
    """Parents of a ``chain``, a ``wide`` tree (one root and its children), a ``deep`` one
    (each node's parent among the last four) or a ``random`` one (any earlier node)."""
    if shape == "chain":
        return list(range(-1, num_nodes - 1))
    if shape == "wide":
        return [-1] + [0] * (num_nodes - 1)
    parents = [-1]
    for i in range(1, num_nodes):
        low = max(0, i - 4) if shape == "deep" else 0
        parents.append(int(torch.randint(low, i, (1,), generator=gen)))
    return parents


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefixes: list[int],
              trees: list[list[int]]) -> torch.Tensor:
    """float64 attention of each new token over its prefix and its ancestors (and itself),
    GQA by index; vectorised over heads and tokens per row through an explicit mask."""
    batch, heads, num_new, head_dim = q.shape
    group = heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, (length, parents) in enumerate(zip(prefixes, trees)):
        visible = torch.zeros(num_new, length + num_new, dtype=torch.bool)
        visible[:, :length] = True
        for t in range(num_new):
            node = t
            while node >= 0:
                visible[t, length + node] = True
                node = parents[node]
        keys = k[b, :, : length + num_new].double().repeat_interleave(group, 0)  # (H, S, hd)
        values = v[b, :, : length + num_new].double().repeat_interleave(group, 0)
        scores = q[b].double() @ keys.transpose(1, 2) / math.sqrt(head_dim)  # (H, T, S)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[b] = torch.softmax(scores, -1) @ values
    return out


def make_case(seed: int, *, heads: int, kv_heads: int, head_dim: int, prefixes: list[int], trees: list[list[int]],
              dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Inputs laid out as the model holds them: q a transposed ``(B, T, H, hd)`` view, k/v a
    cache ``(B, n_kv, C, hd)`` with junk beyond each row's keys."""
    gen = torch.Generator().manual_seed(seed)
    batch, num_new = len(prefixes), len(trees[0])
    capacity = max(prefixes) + num_new + 5
    q = torch.randn(batch, num_new, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)  # (B, H, T, hd)
    k = (torch.randn(batch, kv_heads, capacity, head_dim, generator=gen) * 1.5).to(dtype)
    v = torch.randn(batch, kv_heads, capacity, head_dim, generator=gen).to(dtype)
    bits = ancestor_bits_from_parents(torch.tensor(trees))
    return q, k, v, torch.tensor(prefixes), bits


CASES = {
    # name: (heads, kv_heads, head_dim, prefixes, tree shapes, nodes)
    "chain": (6, 2, 16, [0, 45], ["chain", "chain"], 8),
    "wide": (9, 3, 64, [70, 3], ["wide", "wide"], 16),
    "deep64": (9, 3, 64, [0, 100, 33], ["deep", "random", "chain"], 64),
    "mha128": (4, 4, 128, [300], ["random"], 20),
    "gqa4": (8, 2, 32, [129, 64, 1, 0], ["random", "deep", "wide", "chain"], 33),
}


def case_inputs(name: str, seed: int, dtype: torch.dtype) -> tuple[Any, ...]:
    heads, kv_heads, head_dim, prefixes, shapes, nodes = CASES[name]
    gen = torch.Generator().manual_seed(100 + seed)
    trees = [random_tree(nodes, gen, shape) for shape in shapes]
    q, k, v, lengths, bits = make_case(seed, heads=heads, kv_heads=kv_heads, head_dim=head_dim, prefixes=prefixes,
                                       trees=trees, dtype=dtype)
    return q, k, v, lengths, bits, reference(q, k, v, prefixes, trees)


def emulated(shim: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, bits: torch.Tensor,
             *, threads: int = THREADS_PER_BLOCK, num_splits: int | None = None, num_sms: int = 132,
             calls: list[str] | None = None) -> torch.Tensor:
    return run_tree_attention(q, k, v, lengths, bits, launch=tree_attention_shim.launcher(shim, calls),
                              num_sms=num_sms, num_splits=num_splits, threads_per_block=threads)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernel_matches_reference(shim: Any, name: str, dtype: torch.dtype) -> None:
    q, k, v, lengths, bits, expected = case_inputs(name, 0, dtype)
    got = emulated(shim, q, k, v, lengths, bits, num_splits=1)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.double() - expected).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not is_cuda_kernel_available(), reason="needs CUDA and cupy")
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_cuda_kernel_matches_reference(name: str, dtype: torch.dtype, num_splits: int | None) -> None:
    """GPU twin of the emulated tests: the same inputs and tolerances through CuPy."""
    from treeserve.ops.kernels.tree_attention_cuda import tree_attention_cuda

    q, k, v, lengths, bits, expected = case_inputs(name, 0, dtype)
    got = tree_attention_cuda(q.cuda(), k.cuda(), v.cuda(), lengths.cuda(), bits.cuda(), num_splits=num_splits)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.cpu().double() - expected).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize(("name", "threads", "num_splits"), [
    ("deep64", 128, 3), ("deep64", 7, None), ("mha128", 1, 4), ("gqa4", 32, 2), ("chain", 64, 2), ("wide", 33, None),
])
def test_kernel_splits_and_block_sizes(shim: Any, name: str, threads: int, num_splits: int | None) -> None:
    """Several splits merged by the combine kernel (some splits empty for short rows), block
    sizes that are not a multiple of a warp, one thread a block."""
    q, k, v, lengths, bits, expected = case_inputs(name, 1, torch.float32)
    calls: list[str] = []
    got = emulated(shim, q, k, v, lengths, bits, threads=threads, num_splits=num_splits, num_sms=8, calls=calls)
    assert (got.double() - expected).abs().max().item() < 1e-5
    assert calls[0] == "tree_attention_f32"
    assert ("tree_attention_combine" in calls) == (len(calls) == 2)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_twin_matches_reference(name: str, dtype: torch.dtype) -> None:
    """The CPU twin takes the same inputs (ancestor words) and meets the same reference."""
    q, k, v, lengths, bits, expected = case_inputs(name, 0, dtype)
    got = tree_attention_from_bits(q, k, v, lengths, bits)
    assert got.dtype == dtype
    assert (got.double() - expected).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_16_bit_conversions_are_exact(shim: Any) -> None:
    """The kernel's bf16 and fp16 bit conversions, every one of the 65,536 patterns (fp16
    subnormals, infinities and NaNs included), against torch's."""
    import ctypes

    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    for kind, dtype in ((0, torch.bfloat16), (1, torch.float16)):
        out = torch.empty(65536, dtype=torch.float32)
        shim.convert_16_bits(ctypes.c_void_p(patterns.data_ptr()), ctypes.c_void_p(out.data_ptr()), 65536, kind)
        expected = patterns.view(dtype).float()
        assert torch.equal(out.isnan(), expected.isnan())
        assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])


def test_ancestor_words_round_trip() -> None:
    gen = torch.Generator().manual_seed(5)
    trees = [random_tree(64, gen, shape) for shape in ("random", "deep", "chain")]
    mask = tree_mask_from_parents(torch.tensor(trees))
    bits = ancestor_bits_from_mask(mask)
    assert int(bits[2, 63]) == -1  # the chain's last node sees all 64: every bit, the sign bit too
    assert torch.equal(tree_mask_from_ancestor_bits(bits), mask)
    assert torch.equal(ancestor_bits_from_parents(torch.tensor(trees[0])), bits[0])


def test_plan_fills_the_gpu_without_empty_splits() -> None:
    # One row of a 64-node tree, GQA 9/3: 12 row tiles per KV head, 36 blocks before splitting.
    plan = plan_launch(1, 9, 3, 64, 2048 + 64, num_sms=132)
    assert plan.row_tiles == 12 and plan.num_splits == 8
    assert (plan.num_splits - 1) * plan.tiles_per_split < -(-(2048 + 64) // 32) <= plan.num_splits * plan.tiles_per_split
    assert plan_launch(1, 9, 3, 64, 100, num_sms=132).num_splits == 1  # 4 tiles: too short to split
    assert plan_launch(64, 9, 3, 64, 8192, num_sms=132).num_splits == 1  # 2,304 blocks already


MUTANTS = {
    "mask ignored": ("(key < L || ((bits_s[r] >> (key - L)) & 1ull))", "true"),
    "no rescale": ("alpha = exp2f(m_old - m_new);", "alpha = 1.0f;"),
    "combine unweighted": ("const float w = exp2f(partial_ml[(state0 + s) * 2] - m);",
                           "const float w = partial_ml[(state0 + s) * 2] == -INFINITY ? 0.0f : 1.0f;"),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_broken_kernels_fail_the_comparison(tmp_path: Path, mutant: str) -> None:
    """The comparison can fail: each broken source misses the reference by far."""
    old, new = MUTANTS[mutant]
    assert KERNEL_SOURCE.count(old) == 1
    broken = _build(tmp_path, KERNEL_SOURCE.replace(old, new))
    q, k, v, lengths, bits, expected = case_inputs("deep64", 2, torch.float32)
    got = emulated(broken, q, k, v, lengths, bits, num_splits=3, num_sms=8)
    assert (got.double() - expected).abs().max().item() > 1e-2


def twin_module() -> Any:
    """The CPU twin's test module, for its small fixed inputs."""
    spec = importlib.util.spec_from_file_location("tree_attention_twin", Path(__file__).with_name("test_tree_attention.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_on_the_twin_inputs(shim: Any) -> None:
    """The twin test's own inputs and float64 reference (a tree and a chain, an empty prefix)."""
    twin = twin_module()
    q, k, v, prefix_lengths, parents_rows = twin.make_inputs(0)
    expected = twin.reference_attention(q, k, v, prefix_lengths, parents_rows)
    got = emulated(shim, q, k, v, prefix_lengths, ancestor_bits_from_parents(torch.tensor(parents_rows)), threads=16)
    assert (got.double() - expected).abs().max().item() < 1e-5
