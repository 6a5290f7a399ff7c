"""The float32 format's linear on CPU (``dense_cpu.cpp``, AVX-512 or AVX2; see its header).

torch's float32 product reads a one-row decode's weights on a single thread (about 11 GB/s on the
default model's 113 MB head, with one thread or two) and sums in another order at every row
count. This kernel splits every product over torch's threads in units they claim as they come
free, and gives each output one summation order at every row count and on both builds, so a
row's outputs are the same bits alone, in a tree, in a batch or in a prefill.

Its op is ``torch.ops.treeserve_dense.mm(x, weight, bias)`` (and ``embed_rows``, an embedding's rows
read out of packed codes, ``embed_rows.h`` and :mod:`treeserve.ops.embedding`);
it is built once per machine
(:mod:`cpp_build`). :func:`available` says whether this CPU and machine can run it; where they
cannot, the float32 format keeps ``F.linear``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from treeserve.ops.kernels import cpp_build

SOURCE = Path(__file__).with_name("dense_cpu.cpp")
CONTRACT = ("-ffp-contract=off",)
"""Added to either build (:func:`cpp_build.simd16_flags`): no multiply and add fused but those
written as FMAs, so both builds sum alike."""

_NO_BIAS = torch.empty(0)


def _shape(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _rows_shape(ids: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor, kind: int, n: int, k: int) -> Tensor:
    return codes.new_empty((ids.shape[0], k), dtype=torch.bfloat16)


def _flags() -> tuple[str, ...] | None:
    chosen = cpp_build.simd16_flags()
    return (*chosen, *CONTRACT) if chosen is not None else None


def available() -> bool:
    """True when the kernel is built and loaded (a CPU with AVX-512, or AVX2 and FMA, and a C++
    compiler)."""
    return cpp_build.load_ops(SOURCE, _flags, {"treeserve_dense::mm": _shape, "treeserve_dense::embed_rows": _rows_shape})


def mm(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` for float32 ``x`` ``(..., K)`` and a contiguous ``(N, K)`` weight.
    Call only where :func:`available` is True."""
    flat = x.reshape(-1, x.shape[-1])
    out: Tensor = torch.ops.treeserve_dense.mm(flat, weight, _NO_BIAS if bias is None else bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])
