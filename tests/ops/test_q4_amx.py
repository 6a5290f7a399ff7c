"""The q4_1 format's kernels (``treeserve.ops.kernels.q4_amx``, and its AVX2 twin ``q_avx2.cpp``):
the vector and tile paths compute with the same weight values as torch's int4 kernel, at every
row count, tails included; the int8-row paths of both compute their stated formula."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from treeserve.ops.linears import INT4_INNER_K_TILES, Int4Linear, q4_blocks_from_float
from treeserve.ops.kernels import avx2, q4_amx
from treeserve.ops.kernels.cpp_build import cpu_flags

pytestmark = pytest.mark.skipif(not q4_amx.available(), reason="needs a CPU with AVX512-BF16 or AVX2, and a C++ compiler")
AVX512 = q4_amx.available() and not q4_amx.avx2()
needs_avx512 = pytest.mark.skipif(not AVX512, reason="the bf16-row paths need AVX512-BF16")


def _layer(out_features: int, in_features: int, seed: int) -> tuple[Int4Linear, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """A q4_1 linear from random weights, the exact float32 weights it stands for (the codes with
    bf16 scale and zero), and torch's int4 kernel on the same values, as a function of x."""
    gen = torch.Generator().manual_seed(seed)
    blocks = q4_blocks_from_float(torch.randn(out_features, in_features, generator=gen) * 0.05)
    linear = Int4Linear(blocks, None)
    scale = blocks.scale.float().bfloat16()
    zero = (blocks.minimum.float() + 8 * blocks.scale.float()).bfloat16()
    weight = (blocks.codes.float() - 8) * scale.float().repeat_interleave(32, dim=1) + zero.float().repeat_interleave(32, dim=1)
    packed = torch._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), INT4_INNER_K_TILES)
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
    def torch_int4(x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)
    return linear, weight, torch_int4


def _run(linear: Int4Linear, x: torch.Tensor, min_rows: int, int8_rows: bool = False, on_avx2: bool = False) -> torch.Tensor:
    assert linear.amx_codes is not None and linear.amx_scales_zeros is not None
    return q4_amx.mm(x, linear.amx_codes, linear.amx_scales_zeros, linear.out_features, min_rows, int8_rows, on_avx2)


# The int8-row paths: AVX512-VNNI's (q4_amx.cpp) and AVX2's (q_avx2.cpp, which also runs on a CPU
# with AVX-512, so both are checked wherever the CPU has both).
INT8_KERNELS = [
    pytest.param(False, id="vnni", marks=pytest.mark.skipif(not (AVX512 and "avx512_vnni" in cpu_flags()),
                                                             reason="needs AVX512-VNNI")),
    pytest.param(True, id="avx2", marks=pytest.mark.skipif(not avx2.loaded(), reason="needs AVX2")),
]


def _int8(linear: Int4Linear, x: torch.Tensor, on_avx2: bool) -> torch.Tensor:
    return _run(linear, x, 1, int8_rows=True, on_avx2=on_avx2)


def _int8_reference(linear: Int4Linear, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What the int8-row path computes, in float64: each row's groups of 32 quantized as the
    kernel does in fp32 (``round(x * (127 / max |x|))``, ties to even, times ``d = max |x| / 127``)
    for the codes' term; the exact rows for the zero's."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))  # one division, as
    # the kernel's: 127 / amax with a Python scalar multiplies by a reciprocal, one more rounding
    quantized = (torch.round(blocks * inverse).double() * (amax / 127).double()).reshape(x.shape)
    zero = linear.amx_scales_zeros[:, :, 1].double()  # (N/32, G, 32): the zeros per group and column
    zero = zero.permute(0, 2, 1).reshape(linear.out_features, -1).repeat_interleave(32, dim=1)  # (N, K)
    return quantized @ (weight.double() - zero).t() + x.double() @ zero.t()


@needs_avx512
@pytest.mark.parametrize("shape", [(96, 64), (64, 160)])
def test_both_paths_compute_with_the_unrounded_weight_values(shape: tuple[int, int]) -> None:
    """Rows that add two weights of one group: the fp32 sum of the exact values is exact, so each
    path (and torch's int4 kernel) must give exactly its bf16 rounding. A kernel that rounds the
    weights to bf16 first (a dequantized bf16 GEMM) misses on many outputs, which the last
    assertion shows."""
    linear, weight, torch_int4 = _layer(*shape, seed=1)
    n, k = shape
    picks = torch.randint(0, 32, (40, 2), generator=torch.Generator().manual_seed(2))
    group = torch.arange(40) % (k // 32) * 32
    x = torch.zeros(40, k, dtype=torch.bfloat16)
    x[torch.arange(40), group + picks[:, 0]] = 1
    x[torch.arange(40), group + picks[:, 1]] += 1
    expected = (x.float() @ weight.t()).bfloat16()
    for rows in (1, 2, 3, 4, 16, 17, 40):  # vector rows (one chunk, two), tiles: whole, a tail, several
        for min_rows in (1, 10**9):
            assert torch.equal(_run(linear, x[:rows], min_rows), expected[:rows]), (rows, min_rows)
    assert torch.equal(torch_int4(x), expected)
    rounded = (x.float() @ weight.bfloat16().float().t()).bfloat16()
    assert (rounded != expected).float().mean() > 0.05


@needs_avx512
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 33, 64])
def test_paths_and_torchs_kernel_agree_on_random_rows(rows: int) -> None:
    """Random activations: the paths and torch's int4 kernel differ only by fp32 summation
    order, which the bf16 output rounds away almost everywhere (at most one bf16 step)."""
    linear, weight, torch_int4 = _layer(128, 192, seed=rows)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).bfloat16()
    tiles = _run(linear, x, min_rows=1).float()
    vector = _run(linear, x, min_rows=10**9).float()
    reference = torch_int4(x).float()
    step = reference.abs().clamp(min=1e-3) * 2**-7  # one bf16 ulp and a little
    assert ((tiles - reference).abs() <= step).all()
    assert ((vector - reference).abs() <= step).all()
    exact = x.float() @ weight.t()
    assert ((tiles - exact).abs() <= exact.abs() * 2**-7 + 1e-3).all()


def test_the_format_runs_the_tiles_from_min_rows_on_or_int8_rows_throughout() -> None:
    linear, _, _ = _layer(64, 64, seed=5)
    assert linear.amx_codes is not None and linear.packed is None and q4_amx.MIN_ROWS > 1
    assert linear.avx2 == (not AVX512)
    # int8 rows wherever the CPU has AVX512-VNNI (AMX hosts too: the format's one answer), or AVX2 only.
    assert linear.int8_rows == (not AVX512 or "avx512_vnni" in cpu_flags())
    x = torch.randn(2, 5, 64).bfloat16()  # leading dims fold into rows
    one = torch.randn(1, 64).bfloat16()
    if linear.int8_rows:
        assert torch.equal(linear(x), _int8(linear, x.reshape(10, 64), linear.avx2).reshape(2, 5, 64))
        assert torch.equal(linear(one), _int8(linear, one, linear.avx2))
    else:
        assert torch.equal(linear(x), _run(linear, x.reshape(10, 64), min_rows=1).reshape(2, 5, 64))
        assert torch.equal(linear(one), _run(linear, one, min_rows=10**9))


@pytest.mark.parametrize("on_avx2", INT8_KERNELS)
@pytest.mark.parametrize("shape", [(96, 64), (64, 160)])
def test_int8_rows_compute_their_stated_formula(shape: tuple[int, int], on_avx2: bool) -> None:
    """Random rows: the int8-row path is the float64 product of the quantized rows with the
    codes' part of the weights plus the exact rows with the zeros, up to fp32 sums and the bf16
    output rounding; the unrounded rows are not (torch's int4 kernel multiplies by the same
    weight values without rounding the rows), which the last assertion shows."""
    linear, weight, torch_int4 = _layer(*shape, seed=11)
    x = torch.randn(40, shape[1], generator=torch.Generator().manual_seed(12)).bfloat16()
    reference = _int8_reference(linear, weight, x)
    bound = reference.abs() * 2**-8 + 1e-3  # bf16 output rounding, and fp32 sums
    for rows in (1, 3, 4, 5, 16, 17, 40):
        assert ((_int8(linear, x[:rows], on_avx2).double() - reference[:rows]).abs() <= bound[:rows]).all(), rows
    unrounded = torch_int4(x).double()
    assert ((unrounded - reference).abs() > bound).float().mean() > 0.05


@pytest.mark.parametrize("on_avx2", INT8_KERNELS)
def test_int8_rows_give_each_row_the_same_bits_at_every_row_count(on_avx2: bool) -> None:
    """A row's result does not depend on the rows beside it (blocks of four rows and tails run
    the same sums in the same order): one forward of a tree equals its rows one by one."""
    linear, _, _ = _layer(128, 192, seed=13)
    x = torch.randn(23, 192, generator=torch.Generator().manual_seed(14)).bfloat16()
    together = _int8(linear, x, on_avx2)
    for rows in (1, 2, 3, 5, 9):
        assert torch.equal(_int8(linear, x[:rows], on_avx2), together[:rows]), rows
    for row in range(23):
        assert torch.equal(_int8(linear, x[row:row + 1], on_avx2)[0], together[row])


def test_pack_refuses_shapes_off_the_tile_grid() -> None:
    with pytest.raises(ValueError, match="multiples of 32"):
        q4_amx.pack(torch.zeros(48, 64, dtype=torch.uint8), torch.zeros(48, 2), torch.zeros(48, 2))
    assert not q4_amx.supports(48, 64) and q4_amx.supports(64, 96)


@pytest.mark.parametrize("on_avx2", INT8_KERNELS)
def test_int8_rows_keep_a_non_finite_row_non_finite(on_avx2: bool) -> None:
    """A NaN or inf activation makes its row's outputs non-finite (the verifier's row check
    relies on it; max_ps may drop a NaN from the group's max, the exact row sum keeps it) and
    leaves the other rows alone."""
    linear, _, _ = _layer(64, 96, seed=15)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(16)).bfloat16()
    x[1, 40] = float("nan")
    x[2, 7] = float("inf")
    x[3, 3] = float("-inf")
    out = _int8(linear, x, on_avx2).float()
    assert not torch.isfinite(out[1:]).any()
    assert torch.equal(out[0], _int8(linear, x[:1], on_avx2)[0].float())
