"""The CUDA tree-attention kernels run on the CPU: their source compiled by g++ under a shim
that emulates blocks, threads, shared memory and barriers (:mod:`treeserve_testing.tree_attention_shim`),
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

from treeserve.ops.kernels.tree_attention_cuda import (
    KERNEL_SOURCE,
    ROW_VARIANTS,
    ROWS,
    WIDE_ROWS_FROM,
    plan_launch,
    rows_per_block,
    run_tree_attention,
)
from treeserve.ops.tree_attention import (
    ancestor_bits_from_mask,
    ancestor_bits_from_parents,
    is_cuda_kernel_available,
    tree_attention_from_bits,
    tree_mask_from_ancestor_bits,
    tree_mask_from_parents,
)
from treeserve_testing import tree_attention_shim

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
             *, threads: int | None = None, num_splits: int | None = None, num_sms: int = 132,
             calls: list[str] | None = None, rows: int = ROWS) -> torch.Tensor:
    return run_tree_attention(q, k, v, lengths, bits, launch=tree_attention_shim.launcher(shim, calls),
                              num_sms=num_sms, num_splits=num_splits, threads_per_block=threads, rows=rows)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", ROW_VARIANTS)
def test_kernel_matches_reference(shim: Any, name: str, dtype: torch.dtype, rows: int) -> None:
    """Every build (dtype, query rows a block) against the float64 reference, one split."""
    q, k, v, lengths, bits, expected = case_inputs(name, 0, dtype)
    got = emulated(shim, q, k, v, lengths, bits, num_splits=1, rows=rows)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.double() - expected).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not is_cuda_kernel_available(), reason="needs CUDA and cupy")
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "odd-offset"])
@pytest.mark.parametrize("rows", ROW_VARIANTS)
def test_cuda_kernel_matches_reference(name: str, dtype: torch.dtype, num_splits: int | None, aligned: bool,
                                       rows: int) -> None:
    """GPU twin of the emulated tests: the same inputs and tolerances through the CUDA launcher,
    with K/V on 16-byte boundaries (vector loads) and one element past one (element loads),
    every build."""
    from treeserve.ops.kernels.tree_attention_cuda import cupy_launch, num_sms_of, run_tree_attention

    q, k, v, lengths, bits, expected = case_inputs(name, 0, dtype)
    k, v = k.cuda(), v.cuda()
    if not aligned:
        k, v = unaligned(k, v)
    index = k.device.index or 0
    got = run_tree_attention(q.cuda(), k, v, lengths.cuda(), bits.cuda(), launch=cupy_launch(index),
                             num_sms=num_sms_of(index), num_splits=num_splits, rows=rows)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.cpu().double() - expected).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize(("name", "threads", "num_splits", "rows"), [
    ("deep64", 128, 3, 16), ("deep64", 7, None, 16), ("mha128", 1, 4, 16), ("gqa4", 32, 2, 16), ("chain", 64, 2, 16),
    ("wide", 33, None, 16), ("deep64", 45, 3, 32), ("gqa4", 256, None, 32),
])
def test_kernel_splits_and_block_sizes(shim: Any, name: str, threads: int, num_splits: int | None, rows: int) -> None:
    """Several splits merged by the combine kernel (some splits empty for short rows), block
    sizes that are not a multiple of a warp, one thread a block, both row builds."""
    q, k, v, lengths, bits, expected = case_inputs(name, 1, torch.float32)
    calls: list[str] = []
    got = emulated(shim, q, k, v, lengths, bits, threads=threads, num_splits=num_splits, num_sms=8, calls=calls,
                   rows=rows)
    assert (got.double() - expected).abs().max().item() < 1e-5
    assert calls[0] == f"tree_attention_f32_r{rows}"
    assert ("tree_attention_combine_f32" in calls) == (len(calls) == 2)


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


def test_16_bit_stores_round_as_torch_does(shim: Any) -> None:
    """The kernel writes its output in the inputs' dtype: its float32 -> bf16 / fp16 rounding
    gives torch's bits (nearest even) on every tie and near-tie around each format's steps, fp16
    subnormals and overflow, infinities, and a million random patterns; NaN stays NaN."""
    import ctypes

    gen = torch.Generator().manual_seed(11)
    random = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    bases = torch.arange(0, 1 << 16, dtype=torch.int64)
    near = [(bases << 16) + offset for offset in (0x7fff, 0x8000, 0x8001)]  # bf16's ties and their neighbours
    # float32 bits in steps of 2^12 from 2^-25 to past 65504: every fp16 normal and every tie between two
    halfs = torch.arange(0x33000000, 0x47800000 + (1 << 13), 1 << 12, dtype=torch.int64)
    near += [halfs - 1, halfs, halfs + 1, halfs | (1 << 31)]
    patterns = torch.cat([random, *(x.to(torch.int64).to(torch.int32) for x in near)])
    floats = patterns.view(torch.float32).contiguous()
    for kind, dtype in ((0, torch.bfloat16), (1, torch.float16)):
        out = torch.empty(floats.numel(), dtype=torch.int16)
        shim.store_16_bits(ctypes.c_void_p(floats.data_ptr()), ctypes.c_void_p(out.data_ptr()), floats.numel(), kind)
        expected = floats.to(dtype)
        got = out.view(dtype)
        assert torch.equal(got.isnan(), expected.isnan())
        numbers = ~expected.isnan()
        assert torch.equal(got[numbers].view(torch.int16), expected[numbers].view(torch.int16))


def test_ancestor_words_round_trip() -> None:
    gen = torch.Generator().manual_seed(5)
    trees = [random_tree(64, gen, shape) for shape in ("random", "deep", "chain")]
    mask = tree_mask_from_parents(torch.tensor(trees))
    bits = ancestor_bits_from_mask(mask)
    assert int(bits[2, 63]) == -1  # the chain's last node sees all 64: every bit, the sign bit too
    assert torch.equal(tree_mask_from_ancestor_bits(bits), mask)
    assert torch.equal(ancestor_bits_from_parents(torch.tensor(trees[0])), bits[0])


def test_plan_fills_the_gpu_without_empty_splits() -> None:
    # One row of a 64-node tree, GQA 9/3: 12 row tiles of 16 per KV head, 36 blocks before
    # splitting; 4 blocks per multiprocessor of 132 wants 15 splits of 66 tiles: 14 of 5 tiles.
    plan = plan_launch(1, 9, 3, 64, 2048 + 64, num_sms=132)
    assert plan.rows == ROWS == 16 and plan.row_tiles == 12 and plan.num_splits == 14 and plan.tiles_per_split == 5
    assert (plan.num_splits - 1) * plan.tiles_per_split < -(-(2048 + 64) // 32) <= plan.num_splits * plan.tiles_per_split
    assert plan_launch(1, 9, 3, 64, 100, num_sms=132).num_splits == 1  # 4 tiles: too short to split
    assert plan_launch(64, 9, 3, 64, 8192, num_sms=132).num_splits == 1  # 2,304 blocks already
    halved = plan_launch(1, 9, 3, 64, 2048 + 64, num_sms=132, blocks_per_sm=2)
    assert halved.num_splits == 8  # 264 blocks wanted: 8 splits of 9 tiles
    wider = plan_launch(1, 9, 3, 64, 2048 + 64, num_sms=132, rows=32)
    assert wider.row_tiles == 6 and wider.num_splits == 14  # 18 blocks, 30 splits wanted, at most 16: 5 tiles each
    with pytest.raises(ValueError, match="not built"):
        plan_launch(1, 9, 3, 64, 100, num_sms=132, rows=8)


def test_wide_trees_take_blocks_of_32_rows(shim: Any) -> None:
    """The launch picks 32 query rows a block from WIDE_ROWS_FROM rows per KV head on (a 64-node
    tree at GQA 3), 16 below (a 16-node one)."""
    assert rows_per_block(WIDE_ROWS_FROM - 1) == ROWS == 16 and rows_per_block(WIDE_ROWS_FROM) == 32
    for name, expected in (("deep64", "tree_attention_f32_r32"), ("wide", "tree_attention_f32_r16")):
        q, k, v, lengths, bits, reference_out = case_inputs(name, 4, torch.float32)
        calls: list[str] = []
        got = run_tree_attention(q, k, v, lengths, bits, launch=tree_attention_shim.launcher(shim, calls), num_sms=8)
        assert calls[0] == expected
        assert (got.double() - reference_out).abs().max().item() < 1e-5


MUTANTS = {
    "mask ignored": ("(key < L || ((bits_s[r] >> (key - L)) & 1ull))", "true"),
    "no rescale": ("alpha_s[r] = m_new == -INFINITY ? 1.0f : exp2f(m_old - m_new);", "alpha_s[r] = 1.0f;"),
    "row sums skip the second row": ("sum1 += p1;", ""),
    "vector loads swap K and V": ("k_s[j * KD + d0 + e] = kx[e];", "k_s[j * KD + d0 + e] = vx[e];"),
    "scalar loads swap K and V": ("v_s[j * D + d] = vx;", "v_s[j * D + d] = kx;"),
    "combine unweighted": ("const float w = exp2f(partial_ml[(state0 + s) * 2] - m);",
                           "const float w = partial_ml[(state0 + s) * 2] == -INFINITY ? 0.0f : 1.0f;"),
}


def unaligned(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` and ``v`` copied into storage one element past a 16-byte boundary, with the same
    strides: the kernel must take its element-by-element loads."""
    def shifted(x: torch.Tensor) -> torch.Tensor:
        storage = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        view = storage[1:].view(x.shape)
        view.copy_(x)
        return view

    return shifted(k), shifted(v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unaligned_kv_takes_the_element_loads(shim: Any, dtype: torch.dtype) -> None:
    """K/V that do not start on a 16-byte boundary (a cache view at an odd offset) give the same
    answer through the element-by-element loads; aligned ones take the 16-byte loads."""
    q, k, v, lengths, bits, expected = case_inputs("deep64", 3, dtype)
    flags = []

    def recording(name: str, grid: Any, threads: int, shared: int, args: Any) -> None:
        if not name.startswith("tree_attention_combine"):
            flags.append(args[-1][1])
        tree_attention_shim.launcher(shim)(name, grid, threads, shared, args)

    k_odd, v_odd = unaligned(k, v)
    got = run_tree_attention(q, k_odd, v_odd, lengths, bits, launch=recording, num_sms=8, num_splits=2)
    aligned = run_tree_attention(q, k, v, lengths, bits, launch=recording, num_sms=8, num_splits=2)
    assert flags == [0, 1]
    for result in (got, aligned):
        assert (result.double() - expected).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_broken_kernels_fail_the_comparison(tmp_path: Path, mutant: str) -> None:
    """The comparison can fail: each broken source misses the reference by far (through the
    16-byte loads, and through the element loads for K/V at an odd offset)."""
    old, new = MUTANTS[mutant]
    assert KERNEL_SOURCE.count(old) == 1
    broken = _build(tmp_path, KERNEL_SOURCE.replace(old, new))
    q, k, v, lengths, bits, expected = case_inputs("deep64", 2, torch.float32)
    worst = 0.0
    for keys, values in ((k, v), unaligned(k, v)):
        got = emulated(broken, q, keys, values, lengths, bits, num_splits=3, num_sms=8)
        worst = max(worst, (got.double() - expected).abs().max().item())
    assert worst > 1e-2


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


def test_packed_parameters_lay_out_as_the_kernels_declare_them() -> None:
    """The driver launch packs each kernel's parameters into one buffer; a C struct of the
    kernel's parameter types (the layout CUDA gives them) reads back every value."""
    import ctypes
    import struct

    from treeserve.ops.kernels.tree_attention_cuda import COMBINE_SIGNATURE, PACKING, TILE_SIGNATURE

    c_types = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int, "i64": ctypes.c_longlong, "f32": ctypes.c_float}
    for signature in (TILE_SIGNATURE, COMBINE_SIGNATURE):
        packer = struct.Struct("@" + "".join(PACKING[kind] for kind in signature))
        fields = [(f"p{i}", c_types[kind]) for i, kind in enumerate(signature)]
        layout = type("Params", (ctypes.Structure,), {"_fields_": fields})
        values = [(1 << 40) + 16 * i if kind == "ptr" else -(i + 3) if kind in ("i32", "i64") else 0.5 + i
                  for i, kind in enumerate(signature)]
        packed = packer.pack(*values)
        assert len(packed) <= ctypes.sizeof(layout)  # CUDA reads the parameters, not the struct's tail padding
        read = layout.from_buffer_copy(packed + bytes(ctypes.sizeof(layout) - len(packed)))
        assert [getattr(read, name) for name, _ in fields] == values
