"""Signed 8-bit codes by group times bf16 rows: GGUF's Q8_0, Q5_0, Q5_1, Q5_K and Q6_K as they are.

Each of those block types is, once its bits are unpacked, a signed code per weight with a
float scale per group of ``S`` weights along K (32, or 16 for Q6_K) and, for Q5_1 and Q5_K, a
float offset per group of 32 (and a fused Q/K/V whose parts mix them, scales per 16 and zeros
together):

    w[n, k] = scales[n, k // S] * codes[n, k] + zeros[n, k // 32]

so one kernel serves them all, on the codes (1 byte a weight, about twice q4_1's reads) rather
than a dequantized bf16 or fp32 matrix (2 or 4). It multiplies by **int8 rows**, as the q4_1
format's int8-row path does and with the same quantization (``quantize_row``):
each row's groups of 32 go to int8 (``d = max |x| / 127``, ``xq = round(x * (127 / max |x|))``,
ties to even; a group under 1e-30 counts as zero), the integer dots ``codes . xq`` over each
scale group are exact in int32 (``vpdpbusd`` on AVX512-VNNI, ``q4_amx.cpp``; ``vpmaddubsw`` with
llama.cpp's sign trick on AVX2, ``q_avx2.cpp``), and then, per group in K order,

    acc = fma(float(dot_h) * d, scales_h, acc)   for each scale group h of the 32
    acc = fma(d * sum(xq over the 32), zeros, acc)   (the zero term)

The zero term takes the quantized row's sum, as llama.cpp's Q8_1 rows do, not the exact sum of
x: the product is then exactly the rounded row times the weights, ``sum(w * xq * d)``, whose
error is the rounding of x weighted by the small, centred w. With the exact sum, a code's and
its offset's parts of one weight would meet two different rows, and the error would be weighted
by ``w - zero`` (up to 31 times the scale in Q5_1 and Q5_K): 2-3x llama.cpp's logit error on the
test fixtures (``tests/ops/test_gguf_fixtures.py``).

Every fp32 step is lane-wise in that order, so a row's result is the **same bits at every row
count** and in **both builds** (AVX-512 and AVX2); a NaN or inf in a group makes its row's
outputs NaN. The weights are the codes' exact values; only the rows are rounded (8 bits a
group, the precision llama.cpp multiplies these blocks in).

Layout (:func:`pack`): codes ``[N/16][K/32][8 quads][16 columns][4]`` int8, a quad being 4
consecutive k of a column (one 64-byte row of a quad is one 512-bit ``vpdpbusd`` operand, or two
256-bit halves); scales ``[N/16][K/S][16]`` and zeros ``[N/16][K/32][16]`` float32, or an empty
zeros tensor. ``N % 16 == 0`` and ``K % 32 == 0``.

**Codes of five bits** (Q5_0's, -16..15; Q5_1's and Q5_K's, 0..31) are packed at 5/8 of a byte
each (0.625 bytes a weight, against 1): each group's 512 codes, in the order above, as 5-bit
fields ``f = code + 16`` (int8 buffer) or ``f = code`` (uint8 buffer), 256 bytes of low nibbles
(byte ``t`` holds ``f[t]`` and ``f[t + 256]``) and a 64-byte bitmap of their fifth bits (bit ``t``
is ``f[t]``'s). The kernels widen one 16-column block's groups back to int8 codes before its
products, so a packed weight gives exactly the bits of its 8-bit layout; only the bytes read
differ. They are packed so where it pays (:data:`FIVE_BITS_PAY`), and read on either kernel.

The ops are ``torch.ops.treeserve_q4.q8g_mm`` (AVX512-VNNI) and ``torch.ops.treeserve_avx2.q8g_mm``
(AVX2), built and loaded with their files' other ops (:mod:`q4_amx`, :mod:`avx2`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from treeserve.ops.kernels import avx2 as avx2_kernel
from treeserve.ops.kernels import q4_amx

GROUP = 32
"""Weights per row-quantization group along K (and per zero); K must be a multiple of it."""

COLUMNS = 16
"""Output columns a block of the packing holds (one 512-bit register of fp32 sums); N must be a multiple of it."""


def supports(out_features: int, in_features: int) -> bool:
    """True when a weight of this shape fits the kernel (N a multiple of 16, K of 32)."""
    return out_features % COLUMNS == 0 and in_features % GROUP == 0


def available() -> bool:
    """True when the op runs here: q4_amx's kernel with AVX512-VNNI, or on a CPU without
    AVX-512 the AVX2 kernel (:func:`avx2`)."""
    return (q4_amx.int8_rows() and not q4_amx.avx2()) or avx2_kernel.loaded()


def avx2() -> bool:
    """True when :func:`mm` must take the AVX2 kernel (``avx2=True``): the AVX512-VNNI one does
    not run here, that one does. A constant of the machine."""
    return not (q4_amx.int8_rows() and not q4_amx.avx2()) and avx2_kernel.loaded()


def _scale_group(n: int, k: int, scales: Tensor) -> int:
    """S, from the scales' shape ``(N, K // S)``."""
    for size in (GROUP, GROUP // 2):
        if scales.shape == (n, k // size):
            return size
    raise ValueError(f"scales must be {(n, k // GROUP)} or {(n, k // (GROUP // 2))}, got {tuple(scales.shape)}")


CODES5_BYTES = 320
"""The bytes of one group's 512 codes (16 columns x 32 k) packed at five bits each."""
FIVE_BITS_PAY = "the AVX512-VNNI kernel"
"""Where :func:`pack` packs five-bit codes unasked. The default model requantized to Q4_K_M
(Zen 4, 2 threads, 2026-12-05): on the AVX512-VNNI kernel the step read 117 MB a token instead of
144 and took 5.6-5.8 ms against 6.1-7.1, trees and batches no slower; on the AVX2 kernel, whose
widening spreads each fifth bit with three instructions a 32 codes, the step took 7.6 ms against
6.5 and a 16-row batch 455 tokens/s against 595."""


def pack(codes: Tensor, scales: Tensor, zeros: Tensor | None, *,
         five_bits: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's layouts (see the module's docstring) of codes ``(N, K)`` int8, ``scales``
    ``(N, K // S)`` (S = 32 or 16) and ``zeros`` ``(N, K // 32)`` or None.

    Returns (codes: ``(N * K,)`` int8, or ``(N * K * 5 // 8,)`` int8 or uint8 where every code
    fits five bits and ``five_bits`` allows it; scales ``(N * K // S,)`` float32; zeros
    ``(N * K // 32,)`` float32, or an empty float32 tensor for none). ``five_bits`` None: where
    it pays, on the AVX512-VNNI kernel (:data:`FIVE_BITS_PAY`).
    """
    n, k = codes.shape
    if not supports(n, k):
        raise ValueError(f"codes8 needs N a multiple of {COLUMNS} and K of {GROUP}, got ({n}, {k})")
    if codes.dtype != torch.int8:
        raise ValueError(f"codes must be int8, got {codes.dtype}")
    size = _scale_group(n, k, scales)
    if zeros is not None and zeros.shape != (n, k // GROUP):
        raise ValueError(f"zeros must be {(n, k // GROUP)}, got {tuple(zeros.shape)}")
    # n = nb*16 + c: block nb, column c; k = g*32 + p*4 + j: group g, quad p, byte j.
    packed = codes.reshape(n // COLUMNS, COLUMNS, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4)  # (nb, g, p, c, j)

    def blocked(t: Tensor) -> Tensor:  # (N, groups) -> (nb, groups, 16), flat
        return t.float().reshape(n // COLUMNS, COLUMNS, -1).permute(0, 2, 1).contiguous().reshape(-1)

    empty = torch.empty(0, dtype=torch.float32)
    flat = packed.contiguous().reshape(-1)
    if five_bits is None:
        five_bits = not avx2()
    low, high = int(codes.min()), int(codes.max())
    if five_bits and -16 <= low and high <= 15:
        flat = _five_bits((flat.to(torch.int16) + 16).to(torch.uint8)).view(torch.int8)
    elif five_bits and 0 <= low and high <= 31:
        flat = _five_bits(flat.view(torch.uint8))
    return flat, blocked(scales), empty if zeros is None else blocked(zeros)


def _five_bits(fields: Tensor) -> Tensor:
    """5-bit ``fields`` (uint8, 0..31, groups of 512 in the kernel's order) packed as the module
    docstring says: per group, 256 bytes of nibble pairs, then a 64-byte bitmap of fifth bits."""
    groups = fields.reshape(-1, 512)
    nibbles = (groups[:, :256] & 15) | ((groups[:, 256:] & 15) << 4)
    bits = ((groups >> 4) & 1).reshape(-1, 64, 8)  # bit t of the bitmap: byte t // 8, bit t % 8
    bitmap = (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    return torch.cat([nibbles, bitmap], dim=1).reshape(-1)


def mm(x: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor, out_features: int, *, float_out: bool = False,
       avx2: bool = False) -> Tensor:
    """``x @ w.T`` for bf16 rows ``x`` ``(M, K)`` on :func:`pack`'s buffers: ``(M, N)`` bf16
    (nearest even), or float32 with ``float_out``. ``avx2``: the AVX2 kernel (pass
    :func:`avx2`'s answer). Call only once :func:`available` has returned True (it loads the op)."""
    if avx2:
        out: Tensor = torch.ops.treeserve_avx2.q8g_mm(x, codes, scales, zeros, out_features, float_out)
        return out
    result: Tensor = torch.ops.treeserve_q4.q8g_mm(x, codes, scales, zeros, out_features, float_out)
    return result


def dequantize(codes: Tensor, scales: Tensor, zeros: Tensor | None) -> Tensor:
    """The weights ``(N, K)`` float32 from the unpacked codes ``(N, K)``, scales ``(N, K // S)``
    and zeros ``(N, K // 32)`` or None: each ``scale * code + zero`` rounded once (from float64)."""
    n, k = codes.shape
    size = _scale_group(n, k, scales)
    w = codes.double() * scales.double().repeat_interleave(size, dim=1)
    if zeros is not None:
        w = w + zeros.double().repeat_interleave(GROUP, dim=1)
    return w.float()
