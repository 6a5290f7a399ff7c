"""The int formats' kernels for CPUs with AVX2 but without AVX-512 (``q_avx2.cpp``).

``q4_amx.cpp`` and ``q8_amx.cpp`` need AVX-512; on a CPU without it (AMD's Zen 3, say) the q4_1
format fell back to torch's int4 kernel and the int formats' head to a bf16 matrix (57 MB a
token instead of 30). This kernel takes their packings as they are: :mod:`q4_amx` and
:mod:`q8_amx` call it where their own does not run (their ``avx2()``), so the formats, the
saved buffers and the compiled step are the same on both kinds of CPU.

* ``q4_mm``: int8 rows (as the AVX512-VNNI path of ``q4_amx.cpp``), ``vpmaddubsw`` on the 4-bit
  codes, at every row count.
* ``q8_mm``: the Q8_0 head, int16 rows (a power-of-two scale per group of 32) against the
  codes widened to int16, exact int32 dots scaled in fp32: the int formats' head on every CPU
  with AVX2, those with AVX-512 too (``q8_amx.int16_rows``).

Compiled once per machine (:mod:`cpp_build`); :func:`loaded` says whether it runs here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from treeserve.ops.kernels import cpp_build

SOURCE = Path(__file__).with_name("q_avx2.cpp")
FLAGS = ("-mavx2", "-mfma", "-mf16c")
CPU_NEEDS = frozenset({"avx2", "fma", "f16c"})


def _q4_shape(x: Tensor, codes: Tensor, scales_zeros: Tensor, out_features: int) -> Tensor:
    return x.new_empty((x.shape[0], out_features))


def _q8_shape(x: Tensor, codes: Tensor, scales: Tensor, out_features: int) -> Tensor:
    return x.new_empty((x.shape[0], out_features), dtype=torch.float32)


def _q8g_shape(x: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor, out_features: int, float_out: bool) -> Tensor:
    return x.new_empty((x.shape[0], out_features), dtype=torch.float32 if float_out else x.dtype)


def loaded() -> bool:
    """True when the kernel is built and loaded and this CPU has AVX2, FMA and F16C."""
    mask = cpp_build.load_amx_ops(SOURCE, FLAGS, "ts_avx2_init",
                                  {"treeserve_avx2::q4_mm": _q4_shape, "treeserve_avx2::q8_mm": _q8_shape,
                                   "treeserve_avx2::q8g_mm": _q8g_shape},
                                  CPU_NEEDS, "the int formats fall back to torch's kernels", tiles=False)
    return bool(mask & cpp_build.VECTORS)
