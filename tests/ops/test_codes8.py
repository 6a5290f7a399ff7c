"""The codes8 kernel (``treeserve.ops.kernels.codes8``: signed 8-bit codes by group, GGUF's Q8_0,
Q5_0, Q5_1, Q5_K and Q6_K): both builds (AVX512-VNNI in ``q4_amx.cpp``, AVX2 in ``q_avx2.cpp``)
compute the stated formula on int8 rows, close to the float64 product, give a row the same bits
at every row count and give each other the same bits; zero, tiny and non-finite rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from treeserve.ops.kernels import avx2, codes8, cpp_build

pytestmark = pytest.mark.skipif(not codes8.available(), reason="needs a CPU with AVX512-VNNI or AVX2, and a C++ compiler")
VNNI = codes8.available() and not codes8.avx2()
BOTH = VNNI and avx2.loaded()  # this CPU runs both builds (the AVX2 one runs on AVX-512 CPUs too)

KERNELS = [
    pytest.param(False, id="vnni", marks=pytest.mark.skipif(not VNNI, reason="needs AVX512-VNNI")),
    pytest.param(True, id="avx2", marks=pytest.mark.skipif(not avx2.loaded(), reason="needs AVX2")),
]
# (S, zeros): Q8_0 / Q5_0 (scales per 32), Q5_1 / Q5_K (and zeros per 32), Q6_K (scales per 16).
FORMATS = [pytest.param((32, False), id="s32"), pytest.param((32, True), id="s32-zeros"), pytest.param((16, False), id="s16"),
           pytest.param((16, True), id="s16-zeros")]  # the last: a fused Q/K/V of Q4_K parts and a Q6_K part

Weights = tuple[Tensor, Tensor, Tensor | None]


def _weights(n: int, k: int, fmt: tuple[int, bool], seed: int) -> Weights:
    """Random codes over all of int8 (-128 and 127 in every row), scales of either sign per S,
    zeros per 32 or None."""
    size, with_zeros = fmt
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    codes[:, 3] = -128
    codes[:, k - 5] = 127
    scales = torch.randn(n, k // size, generator=gen) * 1e-3
    zeros = torch.randn(n, k // 32, generator=gen) * 0.05 if with_zeros else None
    return codes, scales, zeros


def _mm(weights: Weights, x: Tensor, on_avx2: bool, float_out: bool = False) -> Tensor:
    codes, scales, zeros = weights
    return codes8.mm(x, *codes8.pack(codes, scales, zeros), codes.shape[0], float_out=float_out, avx2=on_avx2)


def _quantized_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's int8 rows in float64: ``xq * d`` per element ``(M, K)``, and per group of 32
    their sum ``d * sum(xq)`` ``(M, K // 32)`` (the zero term's factor). Quantized in float32 as the kernel is: ``127 / max |x|``
    one division, ``x`` times it rounded to nearest even, ``d = max |x| / 127``."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    tiny = amax < 1e-30
    inverse = torch.where(tiny, torch.zeros_like(amax), torch.full_like(amax, 127) / amax)
    d = torch.where(tiny, torch.zeros_like(amax), amax / 127)
    quantized = torch.round(blocks * inverse).double() * d.double()
    return quantized.reshape(x.shape), quantized.sum(-1)


def _stated(weights: Weights, x: Tensor) -> tuple[Tensor, Tensor]:
    """What the kernel computes, in float64 (the quantized rows times the codes and scales, their
    groups' sums times the zeros: the quantized rows times the weights), and a bound on its fp32 steps: 2^-18 of the terms' magnitudes."""
    codes, scales, zeros = weights
    quantized, sums = _quantized_rows(x)
    scaled = codes.double() * scales.double().repeat_interleave(codes.shape[1] // scales.shape[1], dim=1)
    result, magnitude = quantized @ scaled.t(), quantized.abs() @ scaled.abs().t()
    if zeros is not None:
        result, magnitude = result + sums @ zeros.double().t(), magnitude + sums.abs() @ zeros.double().abs().t()
    return result, magnitude * 2**-18


def _bits(t: Tensor) -> Tensor:
    """t's bit patterns (NaN outputs compare too)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _relative_errors(out: Tensor, reference: Tensor) -> Tensor:
    """Each row's error norm over its reference's norm."""
    return (out.double() - reference).norm(dim=1) / reference.norm(dim=1)


@pytest.mark.parametrize("on_avx2", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(48, 256), (32, 192)])
def test_the_kernel_computes_its_stated_formula_close_to_the_float64_product(
        shape: tuple[int, int], fmt: tuple[int, bool], on_avx2: bool) -> None:
    """Random rows: the fp32 output is the float64 formula on the quantized rows up to fp32 sums,
    and within int8 row quantization (8 bits a group: 0.5-0.8% of a row's norm here, 1.5% allowed) of
    the float64 product with the dequantized weight; the bf16 output is the fp32 one rounded to
    nearest even. A weight read with the scales (or zeros) of neighbouring groups swapped, as a
    packing that mixes up Q6_K's halves would, misses the bound on every row: the check can fail."""
    n, k = shape
    weights = _weights(n, k, fmt, seed=k + fmt[0])
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = _mm(weights, x, on_avx2, float_out=True)
    assert out.dtype == torch.float32 and out.shape == (16, n)
    stated, bound = _stated(weights, x)
    assert ((out.double() - stated).abs() <= bound).all()
    assert torch.equal(_mm(weights, x, on_avx2), out.bfloat16())

    codes, scales, zeros = weights
    reference = x.double() @ codes8.dequantize(codes, scales, zeros).double().t()
    assert (_relative_errors(out, reference) < 1.5e-2).all()
    swapped = [(codes, scales.reshape(n, -1, 2).flip(-1).reshape(n, -1), zeros)]
    if zeros is not None:
        swapped.append((codes, scales, zeros.reshape(n, -1, 2).flip(-1).reshape(n, -1)))
    for wrong in swapped:
        assert (_relative_errors(out, x.double() @ codes8.dequantize(*wrong).double().t()) > 1.5e-2).all()


@pytest.mark.parametrize("on_avx2", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_row_gets_the_same_bits_at_every_row_count(fmt: tuple[int, bool], on_avx2: bool) -> None:
    """Rows of very different sizes: each row of 64 equals the same row in every prefix of the
    batch, in a batch of its own of 3, and alone, bit for bit (bf16 and fp32 outputs)."""
    weights = _weights(64, 160, fmt, seed=7)
    x = (torch.randn(64, 160, generator=torch.Generator().manual_seed(8)) * torch.logspace(-3, 2, 64)[:, None]).bfloat16()
    for float_out in (False, True):
        together = _mm(weights, x, on_avx2, float_out)
        for rows in (1, 3, 16, 64):
            assert torch.equal(_mm(weights, x[:rows], on_avx2, float_out), together[:rows]), rows
        assert torch.equal(_mm(weights, x[37:40], on_avx2, float_out), together[37:40])
        for row in range(64):
            assert torch.equal(_mm(weights, x[row:row + 1], on_avx2, float_out)[0], together[row]), row


def _odd_rows(k: int) -> Tensor:
    """Random rows and the edge cases: a group whose fp32 sum rounds (2^30, -2^30 and 1: 1 summed
    one way, 0 another), a row of zeros, one under the tiny threshold, tiny rows whose outputs are
    subnormal floats, a single NaN, an inf, a row all NaN."""
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(9))
    x[1] = 0
    x[1, 0], x[1, 16], x[1, 8] = 2.0**30, -(2.0**30), 1.0
    x[2] = 0
    x[3] *= 1e-32
    x[4] *= 1e-27
    x[5, 7] = float("nan")
    x[6, k - 1] = float("inf")
    x[7] = float("nan")
    return x.bfloat16()


@pytest.mark.skipif(not BOTH, reason="one build here: needs AVX512-VNNI and AVX2")
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_avx512_and_avx2_builds_give_the_same_bits(fmt: tuple[int, bool]) -> None:
    """The integer dots are exact in both and every fp32 step is the same lane-wise operation in
    the same order, group sums and bf16 rounding included: the same bits, edge rows too. The
    group that sums to 1 or 0 by order is a real difference (the sums below), which q4_amx.cpp's
    16-lane group_sums made before it took q_avx2.cpp's order."""
    codes, scales, zeros = _weights(48, 128, fmt, seed=10)
    scales[:8] *= 1e-12  # row 4's outputs there are subnormal floats
    if zeros is not None:
        codes[:, 16] = codes[:, 0]  # the codes' term of row 1 cancels
        zeros[:8] *= 1e-12
    weights = (codes, scales, zeros)
    x = _odd_rows(128)
    row = x[1, :32].float()
    avx2_order = ((row[:8] + row[8:16]) + (row[16:24] + row[24:])).sum()
    zmm_order = ((row[:16] + row[16:]).reshape(2, 8).flip(0).sum(0)).sum()
    assert avx2_order != zmm_order
    for float_out in (False, True):
        wide = _mm(weights, x, False, float_out)
        assert torch.equal(_bits(wide), _bits(_mm(weights, x, True, float_out)))
        assert torch.equal(_bits(_mm(weights, x[:1], False, float_out)), _bits(_mm(weights, x[:1], True, float_out)))
        smallest = torch.finfo(wide.dtype).tiny
        assert ((wide[4, :8] != 0) & (wide[4, :8].abs() < smallest)).any()  # subnormal outputs rounded alike


_CAPPED = """
import sys, torch
from treeserve.ops.kernels import codes8
assert codes8.available() and codes8.avx2()
inputs = torch.load({path!r})
out = [codes8.mm(inputs["x"], *packed, inputs["n"], float_out=float_out, avx2=True)
       for packed in inputs["packed"] for float_out in (False, True)]
torch.save(out, {out!r})
"""


@pytest.mark.skipif(not BOTH, reason="one build here: needs AVX512-VNNI and AVX2")
def test_a_process_capped_at_avx2_gives_the_avx512_bits(tmp_path: Path) -> None:
    """The same in a process whose kernels are capped at AVX2 (``TREESERVE_ISA=avx2``), where
    codes8 dispatches to the AVX2 build itself: every format's outputs, edge rows too."""
    x = _odd_rows(96)
    packed = [codes8.pack(*_weights(32, 96, fmt.values[0], seed=11)) for fmt in FORMATS]
    torch.save({"x": x, "n": 32, "packed": packed}, tmp_path / "inputs.pt")
    script = _CAPPED.format(path=str(tmp_path / "inputs.pt"), out=str(tmp_path / "out.pt"))
    env = {**{k: v for k, v in os.environ.items() if k != cpp_build.ISA_ENV}, cpp_build.ISA_ENV: "avx2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    capped = torch.load(tmp_path / "out.pt")
    here = [codes8.mm(x, *p, 32, float_out=float_out) for p in packed for float_out in (False, True)]
    assert len(capped) == len(here) == 2 * len(FORMATS)
    for a, b in zip(here, capped):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("on_avx2", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_tiny_and_non_finite_rows(fmt: tuple[int, bool], on_avx2: bool) -> None:
    """A row of zeros gives zeros, and so does a row under the tiny threshold (its int8 row is
    zeros, and so is its quantized sum, the zero term's factor); a NaN or an inf anywhere in a row makes all its outputs NaN (with or without zeros: a broken
    hidden state must not pass for numbers) and leaves the other rows alone."""
    weights = _weights(32, 96, fmt, seed=12)
    x = _odd_rows(96)
    out = _mm(weights, x, on_avx2, float_out=True)
    assert torch.equal(out[2], torch.zeros(32))
    assert torch.equal(out[3], torch.zeros(32))
    assert out[5:8].isnan().all()
    assert out[[0, 1, 4, 8, 9, 10, 11]].isfinite().all()
    assert torch.equal(out[0], _mm(weights, x[:1], on_avx2, float_out=True)[0])


@pytest.mark.parametrize("on_avx2", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("signed", [True, False], ids=["q5_0", "q5_k"])
def test_five_bit_codes_give_the_eight_bit_layouts_bits(fmt: tuple[int, bool], on_avx2: bool, signed: bool) -> None:
    """Codes of five bits (Q5_0's -16..15, or Q5_1's and Q5_K's 0..31) are packed at 5/8 of a
    byte and widened in the kernel: the same bits as their 8-bit layout at every row count, both
    extremes of the range present."""
    codes, scales, zeros = _weights(48, 128, fmt, seed=21)
    codes = (codes.to(torch.int16) % 32 - (16 if signed else 0)).to(torch.int8)
    codes[:, 7], codes[:, 100] = (-16, 15) if signed else (0, 31)
    five = codes8.pack(codes, scales, zeros, five_bits=True)
    eight = codes8.pack(codes, scales, zeros, five_bits=False)
    assert five[0].numel() * 8 == codes.numel() * 5 and eight[0].numel() == codes.numel()
    assert five[0].dtype == (torch.int8 if signed else torch.uint8)
    x = _odd_rows(128)
    for rows in (1, 3, 12, 64):
        xr = x.repeat(6, 1)[:rows]
        for float_out in (False, True):
            got = codes8.mm(xr, *five, 48, float_out=float_out, avx2=on_avx2)
            want = codes8.mm(xr, *eight, 48, float_out=float_out, avx2=on_avx2)
            assert torch.equal(_bits(got), _bits(want)), (rows, float_out)


def test_pack_and_the_op_refuse_what_does_not_fit() -> None:
    codes = torch.zeros(32, 64, dtype=torch.int8)
    codes[0, 0] = 100  # eight bits: the byte-a-code layout
    assert codes8.supports(32, 64) and not codes8.supports(40, 64) and not codes8.supports(32, 48)
    with pytest.raises(ValueError, match="multiple"):
        codes8.pack(torch.zeros(40, 64, dtype=torch.int8), torch.zeros(40, 2), None)
    with pytest.raises(ValueError, match="scales must be"):
        codes8.pack(codes, torch.zeros(32, 3), None)
    with pytest.raises(ValueError, match="zeros must be"):
        codes8.pack(codes, torch.zeros(32, 4), torch.zeros(32, 4))  # zeros per 16
    packed_codes, scales, zeros = codes8.pack(codes, torch.zeros(32, 4), None)
    assert packed_codes.shape == (32 * 64,) and scales.shape == (128,) and zeros.numel() == 0
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="zeros must be per 32"):
        codes8.mm(x, packed_codes, scales, torch.zeros(32), 32, avx2=codes8.avx2())
    with pytest.raises(RuntimeError, match="does not fit"):
        codes8.mm(torch.zeros(2, 96, dtype=torch.bfloat16), packed_codes, scales, zeros, 32, avx2=codes8.avx2())
    assert codes8.mm(x[:0], packed_codes, scales, zeros, 32, avx2=codes8.avx2()).shape == (0, 32)


def test_the_fake_op_gives_the_shapes() -> None:
    """The ops' meta functions (what torch.compile traces with): bf16 or fp32 (M, N)."""
    codes, scales, zeros = codes8.pack(*_weights(32, 64, (32, True), seed=13))
    x = torch.empty(5, 64, dtype=torch.bfloat16, device="meta")
    for float_out in (False, True):
        out = codes8.mm(x, codes.to("meta"), scales.to("meta"), zeros.to("meta"), 32, float_out=float_out,
                        avx2=codes8.avx2())
        assert out.shape == (5, 32) and out.dtype == (torch.float32 if float_out else torch.bfloat16)
