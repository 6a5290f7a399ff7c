"""The float32 format's linear (``torch.ops.treeserve_dense.mm``, ``kernels/dense_cpu.cpp``):
against float64, and one summation order at every row count and on both builds.

:func:`rows_agree` is the row-invariance check; ``F.linear``-like sums that change order with
the row count fail it (a test), so the kernel passing it means something.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from treeserve.ops import formats, linears
from treeserve.ops.kernels import cpp_build, dense_cpu

from .conftest import make_tiny_model

pytestmark = pytest.mark.skipif(not dense_cpu.available(), reason="the kernel needs AVX2 or AVX-512 and a C++ compiler")

SHAPES = [(1536, 576), (576, 1536), (37, 100), (1, 17), (65, 48), (33, 16)]
"""(N, K): the default model's products, and edges (N not a multiple of the tiles, K not of 16)."""
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 16, 17, 63, 64, 65, 130)


def operands(n: int, k: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(max(ROW_COUNTS), k, generator=gen), torch.randn(n, k, generator=gen),
            torch.randn(n, generator=gen))


def rows_agree(mm: Callable[[Tensor, Tensor, Tensor | None], Tensor], x: Tensor, w: Tensor, b: Tensor | None) -> bool:
    """True when every row of ``x`` gets the same bits from ``mm`` alone and among every row count
    of :data:`ROW_COUNTS` (first, last and middle rows)."""
    for rows in ROW_COUNTS:
        batch = mm(x[:rows], w, b)
        for row in {0, rows // 2, rows - 1}:
            if not torch.equal(batch[row], mm(x[row:row + 1], w, b)[0]):
                return False
    return True


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_products_match_float64(n: int, k: int) -> None:
    x, w, b = operands(n, k, seed=n + k)
    exact = x.double() @ w.double().t() + b.double()
    for bias in (b, None):
        out = dense_cpu.mm(x, w, bias)
        expected = exact if bias is not None else exact - b.double()
        assert out.dtype == torch.float32 and out.shape == (x.shape[0], n)
        # float32 sums of K products: well inside 1e-5 of the largest magnitude.
        assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_leading_dimensions_are_kept() -> None:
    x, w, b = operands(48, 32, seed=1)
    batched = x[:12].reshape(3, 4, 32)
    assert torch.equal(dense_cpu.mm(batched, w, b), dense_cpu.mm(x[:12], w, b).reshape(3, 4, 48))


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_a_row_gets_the_same_bits_at_every_row_count(n: int, k: int) -> None:
    x, w, b = operands(n, k, seed=7 * n + k)
    assert rows_agree(dense_cpu.mm, x, w, b)
    assert rows_agree(dense_cpu.mm, x, w, None)


def test_sums_whose_order_follows_the_row_count_fail_the_check() -> None:
    x, w, b = operands(576, 1536, seed=3)

    def shifting(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        # One summation order for a lone row, another (two halves of K) for a batch.
        if rows.shape[0] == 1:
            return dense_cpu.mm(rows, weight, bias)
        half = weight.shape[1] // 2
        left, right = weight[:, :half].contiguous(), weight[:, half:].contiguous()
        return dense_cpu.mm(rows[:, :half], left, bias) + dense_cpu.mm(rows[:, half:], right, None)

    assert not rows_agree(shifting, x, w, b)


def test_the_float32_format_runs_the_kernel() -> None:
    """Every linear and the head of a float32-formatted model (its logits against the unformatted
    model's: ``test_formats.py``)."""
    model = formats.apply_format(make_tiny_model(0), "float32")
    kernels = [m for m in model.modules() if isinstance(m, linears.DenseLinear)]
    assert model.head_kernel in kernels and len(kernels) == 1 + 4 * len(model.layers)
    assert all(isinstance(m, linears.Float32Linear) for m in kernels)


BUILD_SCRIPT = """
import sys, torch
from treeserve.ops.kernels import dense_cpu
assert dense_cpu.available()
gen = torch.Generator().manual_seed(11)
outs = [dense_cpu.mm(torch.randn(70, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen))
        for n, k in {shapes!r}]
torch.save(outs, sys.argv[1])
"""


def test_the_avx512_and_avx2_builds_compute_the_same_bits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpp_build.cpu_flags():
        pytest.skip("one build only on a CPU without AVX-512")
    results = []
    for level in ("avx512", "avx2"):
        target = tmp_path / f"{level}.pt"
        env = {**os.environ, cpp_build.ISA_ENV: level}
        done = subprocess.run([sys.executable, "-c", BUILD_SCRIPT.format(shapes=SHAPES), str(target)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        results.append(torch.load(target))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
