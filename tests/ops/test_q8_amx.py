"""The int formats' Q8_0 LM head (``treeserve.ops.kernels.q8_amx``): both of its paths, and its
AVX2 twin (``q_avx2.cpp``, int16 rows), multiply by the blocks' exact values ``q * d``, give a row
the same bits at every row count, and llama.cpp's quantization recovers a Q8_0 weight's own codes
and scales."""

from __future__ import annotations

import pytest
import torch

from treeserve.ops.linears import Q8Linear, q8_0_from_float, q8_buffers
from treeserve.ops.kernels import avx2, q8_amx

pytestmark = pytest.mark.skipif(not q8_amx.available(), reason="needs a CPU with AVX-512 or AVX2, and a C++ compiler")
AVX512 = q8_amx.available() and not q8_amx.avx2()
_needs_avx512 = pytest.mark.skipif(not AVX512, reason="needs AVX-512")
# (min_rows, on AVX2): the tiles (the AVX-512 path without them), the AVX-512 path, the AVX2 kernel
# (which also runs on a CPU with AVX-512, so all three are checked there).
PATHS = [
    pytest.param((1, False), id="tiles", marks=_needs_avx512),
    pytest.param((10**9, False), id="avx512", marks=_needs_avx512),
    pytest.param((1, True), id="avx2", marks=pytest.mark.skipif(not avx2.loaded(), reason="needs AVX2")),
]

ROW_COUNTS = (1, 2, 5, 6, 16, 17, 40)  # the AVX-512 path, up to MIN_ROWS, whole tiles, tails


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    return (codes.float().reshape(n, k // 32, 32) * scale.float()[..., None]).reshape(n, k)


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, Q8Linear]:
    """Exact Q8_0 float32 weights ``(N, K)`` and the head kernel built from them."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    exact = _dequantize(*q8_0_from_float(w))
    return exact, Q8Linear(q8_buffers(exact), n)


def _run(head: Q8Linear, x: torch.Tensor, path: tuple[int, bool]) -> torch.Tensor:
    min_rows, on_avx2 = path
    return q8_amx.mm(x, head.codes, head.scales, head.out_features, min_rows, on_avx2)


def test_q8_0_from_float_recovers_q8_0_weights_exactly() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    codes, scale = q8_0_from_float(w)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float16 and int(codes.abs().max()) == 127
    exact = _dequantize(codes, scale)
    again, again_scale = q8_0_from_float(exact)
    assert torch.equal(again, codes) and torch.equal(again_scale, scale)
    assert (exact - w).abs().max() <= scale.float().max() / 2 + 1e-6  # round to nearest code


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(64, 64), (96, 160)])
def test_both_paths_multiply_by_the_unrounded_weight_values(shape: tuple[int, int], path: tuple[int, bool]) -> None:
    """Rows that add two weights of one group: ``(q1 + q2) * d`` rounded once equals the fp32 sum
    of the two exact values, so each path must give the reference bit for bit. A kernel that
    rounds the weights to bf16 first misses on many outputs, which the last assertion shows."""
    n, k = shape
    exact, head = _weight(n, k, seed=1)
    picks = torch.randint(0, 32, (40, 2), generator=torch.Generator().manual_seed(2))
    group = torch.arange(40) % (k // 32) * 32
    x = torch.zeros(40, k, dtype=torch.bfloat16)
    x[torch.arange(40), group + picks[:, 0]] = 1
    x[torch.arange(40), group + picks[:, 1]] += 1
    expected = x.float() @ exact.t()
    for rows in ROW_COUNTS:
        out = _run(head, x[:rows], path)
        assert out.dtype == torch.float32
        assert torch.equal(out, expected[:rows]), rows
    rounded = x.float() @ exact.bfloat16().float().t()
    assert (rounded != expected).float().mean() > 0.05


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_paths_agree_on_random_rows(rows: int, path: tuple[int, bool]) -> None:
    """Random activations: every path is the fp64 product up to fp32 summation, and the head
    runs the int16-row kernel on every host with AVX2 (``q8_amx.int16_rows``)."""
    exact, head = _weight(128, 192, seed=rows)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).bfloat16()
    reference = x.double() @ exact.double().t()
    bound = (x.double().abs() @ exact.double().abs().t()) * 2**-14 + 1e-7
    assert ((_run(head, x, path).double() - reference).abs() <= bound).all()
    folded = head(x.reshape(1, rows, 192))  # leading dims fold into rows
    assert folded.shape == (1, rows, 128)
    assert torch.equal(folded[0], _run(head, x, (q8_amx.VECTORS_ONLY, q8_amx.int16_rows())))  # the int16 rows wherever AVX2 is


@pytest.mark.parametrize("path", PATHS)
def test_each_row_gets_the_same_bits_at_every_row_count(path: tuple[int, bool]) -> None:
    """A verify step's rows must get the logits the one-row decode step gets (speculation in the
    int formats returns the server's own incremental output): each row of a batch equals the
    same row run alone and in every prefix of the batch, bit for bit."""
    exact, head = _weight(96, 160, seed=3)
    x = (torch.randn(40, 160, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 1, 40)[:, None]).bfloat16()
    together = _run(head, x, path)
    for rows in ROW_COUNTS:
        assert torch.equal(_run(head, x[:rows], path), together[:rows]), rows
    for row in (0, 7, 39):
        assert torch.equal(_run(head, x[row:row + 1], path)[0], together[row]), row


@pytest.mark.parametrize("path", PATHS)
def test_zero_and_non_finite_rows(path: tuple[int, bool]) -> None:
    """A row of zeros gives zeros; a NaN or an inf anywhere in a row makes its outputs non-finite
    (a broken hidden state must not pass for logits), and leaves the other rows alone."""
    exact, head = _weight(64, 96, seed=5)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(6)).bfloat16()
    x[1] = 0
    x[2, 40] = float("nan")
    x[3, 70] = float("inf")
    out = _run(head, x, path)
    assert torch.equal(out[1], torch.zeros(64))
    assert not out[2].isfinite().any() and not out[3].isfinite().any()
    assert torch.equal(out[0], _run(head, x[:1], path)[0]) and out[0].isfinite().all()


def test_pack_refuses_shapes_off_the_block_grid() -> None:
    with pytest.raises(ValueError, match="multiples of 32"):
        q8_amx.pack(torch.zeros(48, 64, dtype=torch.int8), torch.zeros(48, 2, dtype=torch.float16))
    assert not q8_amx.supports(101, 64) and q8_amx.supports(128, 64)


@pytest.mark.model
def test_the_served_head_applies_the_ggufs_q8_0_embedding(default_model) -> None:  # type: ignore[no-untyped-def]
    """On the real GGUF: the tied embedding (Q8_0 there, dequantized to float32 by the loader) is
    recovered code for code, and the q4_1 head's kernel multiplies by exactly those values."""
    weight = default_model.model.lm_head_weight  # (V, D) float32
    codes, scale = q8_0_from_float(weight)
    assert torch.equal(_dequantize(codes, scale), weight)
    head = Q8Linear(q8_buffers(weight), weight.shape[0])
    eye = torch.eye(weight.shape[1], dtype=torch.bfloat16)
    if AVX512:
        assert torch.equal(_run(head, eye, (1, False)).t(), weight)  # the tiles
        assert torch.equal(_run(head, eye[:8], (10**9, False)).t(), weight[:, :8])  # the AVX-512 path
    if avx2.loaded():
        assert torch.equal(_run(head, eye[:8], (1, True)).t(), weight[:, :8])
