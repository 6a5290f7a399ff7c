"""GGUF block types (``treeserve.ops.block_types``): every type's decoder gives exactly the values
llama.cpp's dequantization gives (``gguf.quants.dequantize``), on random blocks whose every bit
pattern is exercised; a decoder with one slip fails the same check; the fused parts of mixed
types keep their values."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from .conftest import random_raw
from treeserve.ops.block_types import (
    BLOCK_TYPES,
    BlockType,
    Codes8Blocks,
    Q4Blocks,
    UnsupportedBlockType,
    check_supported,
    concat_rows,
)

def reference(kind: BlockType, raw: np.ndarray) -> np.ndarray:
    """llama.cpp's values (gguf-py's port of its dequantizers), float32 ``(rows, K)``."""
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind.name]).astype(np.float32)


@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
def test_decoded_values_are_llama_cpps_bit_for_bit(name: str) -> None:
    kind = BLOCK_TYPES[name]
    raw = random_raw(kind, rows=6, blocks_per_row=2 if kind.block_size == 256 else 5)
    stored = kind.stored(raw, rows=6)
    assert stored.kernel == kind.kernel
    expected = reference(kind, raw)
    got = stored.dequantize().numpy()
    assert got.shape == expected.shape
    assert np.array_equal(got, expected), f"{name}: max diff {np.abs(got - expected).max()}"
    if isinstance(stored, Codes8Blocks):
        assert stored.scale_group == kind.scale_group


def _wrong_high_bits(decode):  # type: ignore[no-untyped-def]
    """A decoder whose codes lose their top bit (the fifth or sixth), a plausible slip."""
    def decoded(b):  # type: ignore[no-untyped-def]
        codes, scales, zeros = decode(b)
        return codes & np.array(0x0F, dtype=codes.dtype), scales, zeros
    return decoded


def _wrong_nibble_order(decode):  # type: ignore[no-untyped-def]
    """A decoder that reads each block's two nibble halves swapped."""
    def decoded(b):  # type: ignore[no-untyped-def]
        codes, scales, zeros = decode(b)
        n = codes.shape[0]
        halves = codes.reshape(n, -1, 2, 16)
        return halves[:, :, ::-1].reshape(n, -1), scales, zeros
    return decoded


@pytest.mark.parametrize("name, slip", [("Q4_K", _wrong_nibble_order), ("Q5_K", _wrong_high_bits),
                                        ("Q6_K", _wrong_high_bits), ("Q5_0", _wrong_high_bits),
                                        ("Q4_0", _wrong_nibble_order)])
def test_a_wrong_decoder_fails_the_check(name: str, slip) -> None:  # type: ignore[no-untyped-def]
    kind = BLOCK_TYPES[name]
    wrong = dataclasses.replace(kind, decode=slip(kind.decode))
    raw = random_raw(kind, rows=4, blocks_per_row=1 if kind.block_size == 256 else 8, seed=1)
    assert not np.array_equal(wrong.stored(raw, rows=4).dequantize().numpy(), reference(kind, raw))


def test_mixed_parts_concatenate_with_their_values() -> None:
    """Q/K/V of three types (Q5_0, Q4_K, Q6_K, as a Q4_K_M file mixes them) join on the 8-bit-code
    kernel's input with every part's values unchanged; all-4-bit parts stay 4-bit."""
    parts = [BLOCK_TYPES[n].stored(random_raw(BLOCK_TYPES[n], 3, 1 if BLOCK_TYPES[n].block_size == 256 else 8, i), 3)
             for i, n in enumerate(("Q5_0", "Q4_K", "Q6_K"))]
    joined = concat_rows(parts)
    assert isinstance(joined, Codes8Blocks) and joined.scale_group == 16 and joined.zeros is not None
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))
    q4 = [BLOCK_TYPES[n].stored(random_raw(BLOCK_TYPES[n], 2, 8 if n != "Q4_K" else 1, 3), 2) for n in ("Q4_0", "Q4_K")]
    joined4 = concat_rows(q4)
    assert isinstance(joined4, Q4Blocks)
    assert torch.equal(joined4.dequantize(), torch.cat([p.dequantize() for p in q4]))


def test_unsupported_types_are_named() -> None:
    check_supported({"blk.0.attn_q.weight": "Q4_K", "output_norm.weight": "F32"})
    with pytest.raises(UnsupportedBlockType, match=r"blk\.0\.ffn_down\.weight is stored as Q2_K.*supported block types: .*Q6_K"):
        check_supported({"blk.0.attn_q.weight": "Q4_K", "blk.0.ffn_down.weight": "Q2_K"})
