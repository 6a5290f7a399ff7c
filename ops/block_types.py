"""GGUF block types as data: what each stored type is, how its bytes decode into the values one
of our kernels multiplies by, and which kernel that is.

A GGUF stores each tensor in a block type of its own (a Q4_K_M file mixes Q4_K, Q6_K, Q5_0, Q8_0
and F32). :data:`BLOCK_TYPES` describes every integer type we serve without dequantizing: its
block size and bytes, the kernel that takes it and a decoder from raw blocks to that kernel's
input. The decoders give the file's own codes and scales, so :meth:`Q4Blocks.dequantize` and
:meth:`Codes8Blocks.dequantize` equal llama.cpp's dequantization (``gguf.quants.dequantize``) bit
for bit in float32 (``tests/ops/test_block_types.py`` checks every type, and that a decoder
with one slip fails the check). Adding a block type means an entry here and, if no kernel takes
its values yet, that kernel.

The two kernels' inputs:

* ``q4`` (:class:`Q4Blocks`, ``kernels/q4_amx`` and ``q_avx2.cpp``): codes 0..15 and per 32
  weights a scale and a minimum, ``w = scale * q + minimum``. Q4_0 (``d (q - 8)``), Q4_1
  (``d q + m``) and Q4_K (``d sc q - dmin m``, 6-bit ``sc`` and ``m`` per 32) take it exactly:
  ``d sc`` and ``dmin m`` are exact in float32 (an 11-bit significand times a 6-bit integer).
  The kernel holds the scale and ``minimum + 8 scale`` in bfloat16 (see ``formats``).
* ``codes8`` (:class:`Codes8Blocks`, ``kernels/codes8``): int8 codes, a float32 scale per 16 or
  32 weights and optionally a float32 zero per 32, ``w = scale * q + zero``. Q8_0 (``d q``),
  Q5_0 (``d (q - 16)``), Q5_1 (``d q + m``), Q5_K (``d sc q - dmin m``) and Q6_K
  (``d sc (q - 32)``, an int8 ``sc`` per 16) take it exactly, scales and zeros included.

Float tensors (F32, F16, BF16) are read as floats. Other types (Q2_K, Q3_K, the IQ and TQ
types, MXFP4) are refused before anything is converted: :func:`check_supported`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

GROUP = 32
"""Weights per group of the kernels' zeros (and of their activations' int8 quantization)."""

SUPER = 256
"""Weights per K-quant super-block."""


@dataclass(frozen=True)
class Q4Blocks:
    """4-bit values of one ``(N, K)`` weight: codes ``(N, K)`` uint8 in 0..15 and per block of 32
    columns a ``scale`` and a ``minimum`` (float16 or float32), each ``(N, K // 32)``, so
    ``w[n, k] = scale[n, k // 32] * codes[n, k] + minimum[n, k // 32]``."""

    codes: Tensor
    scale: Tensor
    minimum: Tensor

    kernel = "q4"

    def dequantize(self) -> Tensor:
        """The float32 weights ``(N, K)`` the blocks stand for (exactly what gguf computes)."""
        scale = self.scale.float().repeat_interleave(GROUP, dim=1)
        minimum = self.minimum.float().repeat_interleave(GROUP, dim=1)
        return scale * self.codes.float() + minimum

    def rows(self, index: Tensor | slice) -> Q4Blocks:
        """The blocks of the selected output rows."""
        return Q4Blocks(self.codes[index], self.scale[index], self.minimum[index])

    def as_codes8(self) -> Codes8Blocks:
        """The same values on the 8-bit-code kernel's input (exact: codes fit int8, and float16
        scales and minimums are exact in float32)."""
        return Codes8Blocks(self.codes.to(torch.int8), self.scale.float(), self.minimum.float())


@dataclass(frozen=True)
class Codes8Blocks:
    """Integer codes of one ``(N, K)`` weight: ``codes`` ``(N, K)`` int8, ``scales`` float32
    ``(N, K // S)`` with ``S`` 16 or 32, and ``zeros`` float32 ``(N, K // 32)`` or None, so
    ``w[n, k] = scales[n, k // S] * codes[n, k] + zeros[n, k // 32]``."""

    codes: Tensor
    scales: Tensor
    zeros: Tensor | None

    kernel = "codes8"

    @property
    def scale_group(self) -> int:
        """``S``: weights per scale."""
        return self.codes.shape[1] // self.scales.shape[1]

    def dequantize(self) -> Tensor:
        """The float32 weights ``(N, K)`` (exactly what gguf computes)."""
        out = self.scales.repeat_interleave(self.scale_group, dim=1) * self.codes.float()
        return out if self.zeros is None else out + self.zeros.repeat_interleave(GROUP, dim=1)

    def rows(self, index: Tensor | slice) -> Codes8Blocks:
        """The codes of the selected output rows."""
        return Codes8Blocks(self.codes[index], self.scales[index], None if self.zeros is None else self.zeros[index])

    def with_scale_group(self, group: int) -> Codes8Blocks:
        """The same values with a scale every ``group`` weights (16 from 32: each scale twice)."""
        if group == self.scale_group:
            return self
        if (group, self.scale_group) != (16, 32):
            raise ValueError(f"cannot regroup scales from {self.scale_group} to {group}")
        return Codes8Blocks(self.codes, self.scales.repeat_interleave(2, dim=1), self.zeros)

    def with_zeros(self) -> Codes8Blocks:
        """The same values with explicit zeros (of 0.0 where there were none)."""
        if self.zeros is not None:
            return self
        n, k = self.codes.shape
        return Codes8Blocks(self.codes, self.scales, torch.zeros(n, k // GROUP))


StoredBlocks = Q4Blocks | Codes8Blocks
"""A weight's stored values, in the form of the kernel that serves them."""


def concat_rows(parts: Sequence[StoredBlocks]) -> StoredBlocks:
    """``parts`` stacked along the output rows (Q/K/V into one QKV weight): on the 4-bit kernel
    when every part is on it, else all on the 8-bit-code kernel, with the finest scale group and
    zeros where any part has them. Every part keeps its values exactly."""
    if all(isinstance(p, Q4Blocks) for p in parts):
        q4 = [p for p in parts if isinstance(p, Q4Blocks)]
        scale_dtype = torch.float16 if all(p.scale.dtype == torch.float16 for p in q4) else torch.float32
        return Q4Blocks(torch.cat([p.codes for p in q4]), torch.cat([p.scale.to(scale_dtype) for p in q4]),
                        torch.cat([p.minimum.to(scale_dtype) for p in q4]))
    wide = [p.as_codes8() if isinstance(p, Q4Blocks) else p for p in parts]
    group = min(p.scale_group for p in wide)
    wide = [p.with_scale_group(group) for p in wide]
    if any(p.zeros is not None for p in wide):
        wide = [p.with_zeros() for p in wide]
    zeros = None if wide[0].zeros is None else torch.cat([p.zeros for p in wide if p.zeros is not None])
    return Codes8Blocks(torch.cat([p.codes for p in wide]), torch.cat([p.scales for p in wide]), zeros)


# -- decoders: raw blocks (n, type_size) uint8 -> arrays per block -----------------------------

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]
"""codes ``(n, block)``, scales ``(n, block // S)`` float32 and zeros ``(n, block // 32)`` float32
or None (for ``q4``: codes, scale and minimum)."""


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 from two bytes a row, as float32 ``(n, 1)``."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """ggml's 4-bit packing: of each ``width``-byte run, the low nibbles are elements 0..width-1
    and the high nibbles width..2*width-1."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, width)
    return ((runs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of a little-endian 32-bit mask, for the 32 elements of a Q5_0 / Q5_1 block."""
    bits = qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(count, dtype=np.uint32).reshape(1, count)
    return (bits & 1).astype(np.uint8)


def _decode_q4_0(b: np.ndarray) -> Decoded:
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:], 16), d, -8.0 * d


def _decode_q4_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 4:], 16), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minimums of a Q4_K / Q5_K super-block from its 12 bytes:
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same
    for the minimums, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and minimums 4-7."""
    n = raw.shape[0]
    s = raw.reshape(n, 3, 4)
    lo_sc, lo_m, packed = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo_sc & 0x3F, (packed & 0x0F) | ((lo_sc >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([lo_m & 0x3F, (packed >> 4) | ((lo_m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _decode_q4_k(b: np.ndarray) -> Decoded:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return _nibbles(b[:, 16:], 32), d * sc, -(dmin * mn)


def _decode_q8_0(b: np.ndarray) -> Decoded:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, 0:2]), None


def _decode_q5_0(b: np.ndarray) -> Decoded:
    q = _nibbles(b[:, 6:], 16) | (_high_bits(b[:, 2:6], 32) << 4)
    return (q.astype(np.int16) - 16).astype(np.int8), _f16(b[:, 0:2]), None


def _decode_q5_1(b: np.ndarray) -> Decoded:
    q = _nibbles(b[:, 8:], 16) | (_high_bits(b[:, 4:8], 32) << 4)
    return q.astype(np.int8), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _decode_q5_k(b: np.ndarray) -> Decoded:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh, ql = b[:, 16:48], b[:, 48:]
    # Sub-block j (32 weights): low nibbles of ql's run j // 2 (low for even j, high for odd), and
    # bit j of each of qh's 32 bytes.
    high = ((qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(n, -1)
    q = _nibbles(ql, 32) | (high << 4)
    return q.astype(np.int8), d * sc, -(dmin * mn)


def _decode_q6_k(b: np.ndarray) -> Decoded:
    n = b.shape[0]
    ql, qh, sc, d = b[:, 0:128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    # Each half of 128 weights: ql's 64 bytes give the low nibbles of weights 0-63 (low) and
    # 64-127 (high); qh's 32 bytes give bits 4-5 of weights 0-31, 32-63, 64-95, 96-127 in their
    # bit pairs 0, 2, 4, 6.
    low = ((ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 2, 128)
    high = ((qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, 2, 128)
    q = (low | (high << 4)).reshape(n, SUPER).astype(np.int16) - 32
    return q.astype(np.int8), d * np.ascontiguousarray(sc).view(np.int8).astype(np.float32), None


@dataclass(frozen=True)
class BlockType:
    """One GGUF integer block type: ``block_size`` weights in ``type_size`` bytes, served by
    ``kernel`` (``q4`` or ``codes8``) on the values ``decode`` gives (a scale every
    ``scale_group`` weights)."""

    name: str
    block_size: int
    type_size: int
    kernel: str
    scale_group: int
    decode: Callable[[np.ndarray], Decoded]

    def stored(self, raw: np.ndarray, rows: int) -> StoredBlocks:
        """A tensor's values from its raw bytes (``rows`` output rows, in file order)."""
        blocks = np.ascontiguousarray(raw).reshape(-1, self.type_size)
        codes, scales, zeros = self.decode(blocks)
        def shaped(a: np.ndarray, dtype: torch.dtype) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1))).to(dtype)
        if self.kernel == "q4":
            return Q4Blocks(shaped(codes, torch.uint8), shaped(scales, torch.float32), shaped(zeros, torch.float32))
        return Codes8Blocks(shaped(codes, torch.int8), shaped(scales, torch.float32),
                            None if zeros is None else shaped(zeros, torch.float32))


BLOCK_TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("Q4_0", 32, 18, "q4", 32, _decode_q4_0),
    BlockType("Q4_1", 32, 20, "q4", 32, _decode_q4_1),
    BlockType("Q4_K", SUPER, 144, "q4", 32, _decode_q4_k),
    BlockType("Q5_0", 32, 22, "codes8", 32, _decode_q5_0),
    BlockType("Q5_1", 32, 24, "codes8", 32, _decode_q5_1),
    BlockType("Q5_K", SUPER, 176, "codes8", 32, _decode_q5_k),
    BlockType("Q6_K", SUPER, 210, "codes8", 16, _decode_q6_k),
    BlockType("Q8_0", 32, 34, "codes8", 32, _decode_q8_0),
)}
"""The integer block types served natively, by GGUF type name."""

FLOAT_TYPES = ("F32", "F16", "BF16")
"""Stored float types (read as floats)."""


class UnsupportedBlockType(ValueError):
    """A tensor is stored in a block type that treeserve does not read."""


def supported_names() -> str:
    """The readable types, for messages."""
    return ", ".join((*FLOAT_TYPES, *BLOCK_TYPES))


def check_supported(types: dict[str, str]) -> None:
    """Raise :class:`UnsupportedBlockType` naming the first tensor (by GGUF name) whose type
    (GGUF type name) is not served, with the supported types."""
    for name, kind in types.items():
        if kind not in BLOCK_TYPES and kind not in FLOAT_TYPES:
            raise UnsupportedBlockType(f"tensor {name} is stored as {kind}, which treeserve does not read; "
                                       f"supported block types: {supported_names()}")


__all__ = ["BLOCK_TYPES", "FLOAT_TYPES", "BlockType", "Codes8Blocks", "Q4Blocks", "StoredBlocks",
           "UnsupportedBlockType", "check_supported", "concat_rows", "supported_names"]
