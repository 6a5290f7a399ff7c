"""The q4_1 format's kernel: 4-bit group-32 weights times bf16 rows, at every row count.

``q4_amx.cpp`` multiplies by the GGUF's codes with the format's bf16 scales and zeros (see its
header): for a few rows (a decode step) by AVX512-BF16 dot products on the codes widened to
bf16 by table, which stream the codes at close to the machine's read bandwidth; for more rows
(trees, batches, prefills) on AMX tiles, where a bf16 tile is exactly one group of 32 along K.
The codes ``q - 8`` are exact in bf16 and each group's partial sum is scaled in fp32, so both
paths compute with the same weight values and differ only in float summation order. It
replaced torch's ``_weight_int4pack_mm_for_cpu``, which computes in fp32 FMAs (16 rows cost it
about six times one row) and took 1.01-1.24x the vector path's time for one row
(``bench/q4_kernel.py``, seven runs, median 1.09x); it stays the format's fallback where this
one cannot run.

The format now takes the int8 rows below on every CPU with AVX512-VNNI, AMX hosts included
(:func:`int8_rows`): their sums are the same bits at every row count, the bf16 paths' are not,
and the format promises one answer per row. The bf16 paths stay in the op (and its tests).

Without AMX tiles (a CPU without them, or a VM that hides them) the bf16 dot products bound
every row count: ``vdpbf16ps`` does 32 products in 1.05 ns a core here, so 16 rows cost 6.4x
one row and a 16-node tree 5.8x a decode step. There the format multiplies by **int8 rows**
instead (:func:`int8_rows`, ``mm``'s ``int8_rows``), at every row count: each row's groups of
32 are quantized to int8 (``d = max |x| / 127``, as llama.cpp's Q8_0 blocks) and AVX512-VNNI's
``vpdpbusd`` takes 64 exact integer products in 0.46 ns. On a decode step's 120 weights (one
process, alternating): one row 3.16 against 4.92 ms, 16 rows 13.6 against 40.0 ms, 64 rows
37.1 against 124.2 ms. The weights are the same values; the rows lose precision (the
default model's greedy agreement with float32 went from 98.6% to 97.2%, ``bench/forward.py``),
and a row's result is the same bits at every row count, so speculative and incremental
decoding still compute alike.

The source is compiled once per machine (about 10 s; see :mod:`cpp_build`). It registers the
dispatcher op ``torch.ops.treeserve_q4.mm``, which picks the path by row count (or takes the
int8 rows at every row count), so an eager forward, the compiled decode step and the fused op
of ``decode_layers`` call it alike. :func:`available` says whether it can run
here: a CPU with AVX512-BF16, a compiler, and a successful build; :func:`tiles` whether the
tile path does too (AMX-BF16, granted by the OS; a VM may hide it). On a CPU without AVX-512
the same packing runs on the AVX2 kernel (:mod:`~treeserve.ops.kernels.avx2`, int8 rows;
:func:`avx2` says so), and :func:`available` covers both.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from treeserve.ops.kernels import avx2 as avx2_kernel
from treeserve.ops.kernels import cpp_build

log = logging.getLogger(__name__)

GROUP = 32
"""Weights per group along K (one bf16 AMX tile deep); N and K must be multiples of it."""

SOURCE = Path(__file__).with_name("q4_amx.cpp")
FLAGS = (*cpp_build.AVX512, "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16")
CPU_NEEDS = frozenset({"avx512bw", "avx512_bf16"})
"""What the vector path needs of the CPU (``/proc/cpuinfo``'s names); the tiles need AMX too."""

MIN_ROWS = 2
"""From this many rows on, the AMX tiles run (one row: the AVX512-BF16 path). Measured by
``bench/q4_kernel.py`` (a decode step's 120 weights, 2 threads, two runs): at one row the tiles
take 1.28-1.30x the vector path's time; at two rows the vector path takes 0.82x and 1.12x the
tiles' (a tie within this machine's noise), at three 1.22-1.38x, at four 1.53-1.87x."""

def _mm_shape(x: Tensor, codes: Tensor, scales_zeros: Tensor, out_features: int, min_rows: int,
              int8_rows: bool) -> Tensor:
    return x.new_empty((x.shape[0], out_features))


def _q8g_shape(x: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor, out_features: int, float_out: bool) -> Tensor:
    return x.new_empty((x.shape[0], out_features), dtype=torch.float32 if float_out else x.dtype)


def _loaded() -> int:
    return cpp_build.load_amx_ops(SOURCE, FLAGS, "ts_q4_amx_init",
                                  {"treeserve_q4::mm": _mm_shape, "treeserve_q4::q8g_mm": _q8g_shape},
                                  CPU_NEEDS, "q4_1 runs the AVX2 kernel (q_avx2.cpp) where the CPU has AVX2, else torch's int4 kernel")


def available() -> bool:
    """True when this packing's kernel runs here: this one (AVX512-BF16, whether or not it may
    use AMX tiles, :func:`tiles`), or on a CPU without AVX-512 its AVX2 twin (:func:`avx2`)."""
    return bool(_loaded() & cpp_build.VECTORS) or avx2_kernel.loaded()


def avx2() -> bool:
    """True when :func:`mm` runs the AVX2 kernel (``q_avx2.cpp``, int8 rows at every row count):
    this one cannot run here, that one can."""
    return not _loaded() & cpp_build.VECTORS and avx2_kernel.loaded()


def tiles() -> bool:
    """True when the kernel runs and this process may use AMX tiles: the op's tile path runs from
    ``min_rows`` rows on. Where False (no AMX on the CPU, or hidden by a VM) it runs the vector
    path at every row count."""
    return bool(_loaded() & cpp_build.TILES)


def int8_rows() -> bool:
    """True when the q4_1 format multiplies by int8 rows here (:func:`mm`'s ``int8_rows``): the
    kernel runs and the CPU has AVX512-VNNI, with or without AMX tiles. The int8 rows give a row
    the same bits at every row count, which the bf16 paths (the vector path for one row, tiles
    from :data:`MIN_ROWS`) do not: the format's one answer needs them. The AVX2 kernel
    (:func:`avx2`) always multiplies by int8 rows."""
    mask = _loaded()
    return bool(mask & cpp_build.VECTORS and mask & cpp_build.VNNI) or avx2()


def supports(out_features: int, in_features: int) -> bool:
    """True when a weight of this shape fits the kernel (both sizes multiples of 32)."""
    return out_features % GROUP == 0 and in_features % GROUP == 0


def pack(codes: Tensor, scale: Tensor, zero: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's layouts (see ``q4_amx.cpp``) of codes ``(N, K)`` uint8 in 0..15 and the
    ``scale`` and ``zero`` ``(N, K // 32)`` of ``w = (q - 8) * scale + zero``, held in bf16.

    Returns (codes ``(N * K // 2,)`` uint8, scales and zeros ``(N // 32, K // 32, 2, 32)`` bf16).
    """
    n, k = codes.shape
    if not supports(n, k):
        raise ValueError(f"q4_amx needs both sizes multiples of {GROUP}, got ({n}, {k})")
    if scale.shape != (n, k // GROUP) or zero.shape != scale.shape:
        raise ValueError(f"scale and zero must be {(n, k // GROUP)}, got {tuple(scale.shape)} and {tuple(zero.shape)}")
    # k = g*32 + p*4 + r*2 + j: group g, tile row pair p, row r of the pair (nibble), VNNI slot j;
    # n = nb*32 + h*16 + c: block nb, tile h, column c.
    q = codes.to(torch.uint8).reshape(n // GROUP, 2, 16, k // GROUP, 8, 2, 2)  # (nb, h, c, g, p, r, j)
    q = q.permute(0, 3, 1, 4, 5, 2, 6)  # (nb, g, h, p, r, c, j)
    packed = (q[..., 0, :, :] | (q[..., 1, :, :] << 4)).contiguous().reshape(-1)
    def blocked(t: Tensor) -> Tensor:
        return t.to(torch.bfloat16).reshape(n // GROUP, GROUP, k // GROUP).permute(0, 2, 1)  # (nb, g, 32)
    scales_zeros = torch.stack([blocked(scale), blocked(zero)], dim=2).contiguous()  # (nb, g, 2, 32)
    return packed, scales_zeros


def mm(x: Tensor, codes: Tensor, scales_zeros: Tensor, out_features: int, min_rows: int = MIN_ROWS,
       int8_rows: bool = False, avx2: bool = False) -> Tensor:
    """``x @ w.T`` for bf16 rows ``x`` ``(M, K)``: bf16 ``(M, N)``, on :func:`pack`'s buffers
    (the vector path under ``min_rows`` rows, the tiles from there on; with ``int8_rows``, the
    rows quantized to int8 per group of 32 and AVX512-VNNI products at every row count, see
    ``q4_amx.cpp``, which only a CPU with AVX512-VNNI may ask for). ``avx2``: the AVX2 kernel
    instead (int8 rows; pass :func:`avx2`'s answer, a constant of the machine).

    Call only once :func:`available` has returned True (it loads the op).
    """
    if avx2:
        out: Tensor = torch.ops.treeserve_avx2.q4_mm(x, codes, scales_zeros, out_features)
        return out
    result: Tensor = torch.ops.treeserve_q4.mm(x, codes, scales_zeros, out_features, min_rows, int8_rows)
    return result
