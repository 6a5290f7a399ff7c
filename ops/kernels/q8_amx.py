"""The int formats' LM head: 8-bit group-32 weights (the GGUF's Q8_0 blocks) times bf16 rows.

The default model's embedding is tied and stored in its GGUF as Q8_0 (an int8 code per weight
and a float16 scale per 32): 30 MB, against 57 MB for the same matrix in bf16, which until this
kernel was the int formats' head and a quarter of their decode step. ``q8_amx.cpp`` multiplies by
those codes and scales as they are (see its header): exact products, fp32 sums per group,
scaled in fp32, fp32 logits out. Under :data:`MIN_ROWS` rows it streams the codes through
AVX-512 FMAs; from there on it widens them to bf16 (exact) for AMX tiles, as ``q4_amx`` does
with 4-bit codes. Both paths read one packing and compute with the same weight values.

The source is compiled once per machine (:mod:`cpp_build`) and registers
``torch.ops.treeserve_q8.mm``. :func:`available` says whether it runs here (a CPU with AVX-512,
a compiler, a successful build; :func:`tiles` whether AMX tiles do too); where it does not, the
int formats keep a bf16 head.
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
"""Weights per Q8_0 block along K; N and K must be multiples of it."""

SOURCE = Path(__file__).with_name("q8_amx.cpp")
FLAGS = (*cpp_build.AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mf16c")
CPU_NEEDS = frozenset({"avx512bw", "f16c"})
"""What the AVX-512 path needs of the CPU (``/proc/cpuinfo``'s names); the tiles need AMX too."""

MIN_ROWS = 6
"""From this many rows on, the AMX tiles run (fewer: the AVX-512 path). Measured on the default
model's head (49152 x 576), 2 threads, codes from DRAM: at 1-4 rows the AVX-512 path takes
0.88-0.9x the tiles' time, at 6-7 rows the tiles take 0.87-0.95x its time."""

def _mm_shape(x: Tensor, codes: Tensor, scales: Tensor, out_features: int, min_rows: int) -> Tensor:
    return x.new_empty((x.shape[0], out_features), dtype=torch.float32)


def _loaded() -> int:
    return cpp_build.load_amx_ops(SOURCE, FLAGS, "ts_q8_amx_init", {"treeserve_q8::mm": _mm_shape},
                                  CPU_NEEDS, "the int formats' head runs the AVX2 kernel (q_avx2.cpp) where the CPU has AVX2, else bf16")


def available() -> bool:
    """True when this packing's kernel runs here: this one (AVX-512, whether or not it may use
    AMX tiles, :func:`tiles`), or on a CPU without AVX-512 its AVX2 twin (:func:`avx2`)."""
    return bool(_loaded() & cpp_build.VECTORS) or avx2_kernel.loaded()


def avx2() -> bool:
    """True when :func:`mm` runs the AVX2 kernel (``q_avx2.cpp``, int16 rows at every row count):
    this one cannot run here, that one can."""
    return not _loaded() & cpp_build.VECTORS and avx2_kernel.loaded()


def int16_rows() -> bool:
    """True where the AVX2 kernel (``q_avx2.cpp``: each group of 32 x as int16 codes, exact int32
    dots) runs: every CPU with AVX2, those with AVX-512 and AMX included. :class:`Q8Linear` runs
    it at every row count on every host, so a row's logits are the same bits at every row count
    and on every ISA path; on Zen 4 with AVX-512 it took 0.35 / 3.35 / 12.4 ms at 1 / 16 / 64
    rows of the default model's head where this file's AVX-512 path took 0.56 / 5.03 / 19.7."""
    return avx2_kernel.loaded()


def tiles() -> bool:
    """True when the kernel runs and this process may use AMX tiles (from ``min_rows`` rows on);
    where False the AVX-512 path runs at every row count."""
    return bool(_loaded() & cpp_build.TILES)


def supports(out_features: int, in_features: int) -> bool:
    """True when a weight of this shape fits the kernel (both sizes multiples of 32)."""
    return out_features % GROUP == 0 and in_features % GROUP == 0


def pack(codes: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's layouts (see ``q8_amx.cpp``) of Q8_0 codes ``(N, K)`` int8 and their float16
    scales ``(N, K // 32)`` (``w = codes * scale``).

    Returns (codes ``(N * K,)`` int8, scales ``(N // 32, K // 32, 32)`` float16).
    """
    n, k = codes.shape
    if not supports(n, k):
        raise ValueError(f"q8_amx needs both sizes multiples of {GROUP}, got ({n}, {k})")
    if scale.shape != (n, k // GROUP):
        raise ValueError(f"scale must be {(n, k // GROUP)}, got {tuple(scale.shape)}")
    # k = g*32 + r*2 + j: group g, tile row r, VNNI slot j; n = nb*32 + h*16 + c: block nb, tile h, column c.
    q = codes.to(torch.int8).reshape(n // GROUP, 2, 16, k // GROUP, 16, 2)  # (nb, h, c, g, r, j)
    packed = q.permute(0, 3, 1, 4, 2, 5).contiguous().reshape(-1)  # (nb, g, h, r, c, j)
    scales = scale.to(torch.float16).reshape(n // GROUP, GROUP, k // GROUP).permute(0, 2, 1).contiguous()  # (nb, g, 32)
    return packed, scales


VECTORS_ONLY = 1 << 62
"""A ``min_rows`` no batch reaches: the AVX-512 path at every row count, whose sums are the same
bits for a row whatever the row count (the tiles sum a group's even and odd products in another
order). The int formats' head passes it, so that a row's logits do not depend on the rows beside
it (the format's one answer, ``formats.py``)."""


def mm(x: Tensor, codes: Tensor, scales: Tensor, out_features: int, min_rows: int = MIN_ROWS,
       avx2: bool = False) -> Tensor:
    """``x @ w.T`` for bf16 rows ``x`` ``(M, K)``: float32 ``(M, N)``, on :func:`pack`'s buffers
    (``avx2``: on the AVX2 kernel; pass :func:`avx2`'s answer, a constant of the machine).

    Call only once :func:`available` has returned True (it loads the op).
    """
    if avx2:
        out: Tensor = torch.ops.treeserve_avx2.q8_mm(x, codes, scales, out_features)
        return out
    result: Tensor = torch.ops.treeserve_q8.mm(x, codes, scales, out_features, min_rows)
    return result
