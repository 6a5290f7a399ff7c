"""The q4_1 format's many-row AMX kernel (``treeserve.ops.kernels.q4_amx``): it computes with
the same weight values as torch's one-row int4 kernel, at every row count, tails included."""

from __future__ import annotations

import pytest
import torch

from treeserve.ops.formats import Int4Linear, q4_blocks_from_float
from treeserve.ops.kernels import q4_amx

pytestmark = pytest.mark.skipif(not q4_amx.available(), reason="needs a CPU with AMX-BF16 and a C++ compiler")


def _layer(out_features: int, in_features: int, seed: int) -> tuple[Int4Linear, torch.Tensor]:
    """A q4_1 linear from random weights, and the exact float32 weights its kernels stand for."""
    gen = torch.Generator().manual_seed(seed)
    blocks = q4_blocks_from_float(torch.randn(out_features, in_features, generator=gen) * 0.05)
    linear = Int4Linear(blocks, None)
    codes = blocks.codes.float()
    scale = linear.scales_and_zeros[..., 0].t().float().repeat_interleave(32, dim=1)
    zero = linear.scales_and_zeros[..., 1].t().float().repeat_interleave(32, dim=1)
    return linear, (codes - 8) * scale + zero


def _run(linear: Int4Linear, x: torch.Tensor, min_rows: int) -> torch.Tensor:
    assert linear.amx_codes is not None and linear.amx_scales_zeros is not None
    return q4_amx.mm(x, linear.amx_codes, linear.amx_scales_zeros, linear.packed, linear.scales_and_zeros,
                     linear.out_features, min_rows)


@pytest.mark.parametrize("shape", [(96, 64), (64, 160)])
def test_both_kernels_compute_with_the_unrounded_weight_values(shape: tuple[int, int]) -> None:
    """Rows that add two weights of one group: the fp32 sum of the exact values is exact, so each
    kernel must give exactly its bf16 rounding. A kernel that rounds the weights to bf16 first
    (a dequantized bf16 GEMM) misses on many outputs, which the last assertion shows."""
    linear, weight = _layer(*shape, seed=1)
    n, k = shape
    picks = torch.randint(0, 32, (40, 2), generator=torch.Generator().manual_seed(2))
    group = torch.arange(40) % (k // 32) * 32
    x = torch.zeros(40, k, dtype=torch.bfloat16)
    x[torch.arange(40), group + picks[:, 0]] = 1
    x[torch.arange(40), group + picks[:, 1]] += 1
    expected = (x.float() @ weight.t()).bfloat16()
    for rows in (1, 3, 16, 17, 40):  # one-row kernel, AMX, a whole tile, a tail, several tiles
        torch.testing.assert_close(_run(linear, x[:rows], min_rows=4), expected[:rows], rtol=0, atol=0)
    assert torch.equal(_run(linear, x, min_rows=10**9), expected)  # the one-row kernel on all 40 rows
    rounded = (x.float() @ weight.bfloat16().float().t()).bfloat16()
    assert (rounded != expected).float().mean() > 0.05


@pytest.mark.parametrize("rows", [4, 16, 33, 64])
def test_amx_and_one_row_kernels_agree_on_random_rows(rows: int) -> None:
    """Random activations: the two kernels differ only by fp32 summation order, which the bf16
    output rounds away almost everywhere (at most one bf16 step)."""
    linear, weight = _layer(128, 192, seed=rows)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).bfloat16()
    amx = _run(linear, x, min_rows=1).float()
    one_row = _run(linear, x, min_rows=10**9).float()
    step = one_row.abs().clamp(min=1e-3) * 2**-7  # one bf16 ulp and a little
    assert ((amx - one_row).abs() <= step).all()
    reference = x.float() @ weight.t()
    assert ((amx - reference).abs() <= reference.abs() * 2**-7 + 1e-3).all()


def test_the_format_runs_the_amx_kernel_from_min_rows_on() -> None:
    linear, _ = _layer(64, 64, seed=5)
    assert linear.amx_codes is not None and q4_amx.MIN_ROWS > 1
    x = torch.randn(2, 5, 64).bfloat16()  # leading dims fold into rows
    torch.testing.assert_close(linear(x), _run(linear, x.reshape(10, 64), min_rows=1).reshape(2, 5, 64), rtol=0, atol=0)


def test_pack_refuses_shapes_off_the_tile_grid() -> None:
    with pytest.raises(ValueError, match="multiples of 32"):
        q4_amx.pack(torch.zeros(48, 64, dtype=torch.uint8), torch.zeros(48, 2), torch.zeros(48, 2))
    assert not q4_amx.supports(48, 64) and q4_amx.supports(64, 96)
