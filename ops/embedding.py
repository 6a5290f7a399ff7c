"""The token embedding read out of packed codes: the LM head's own where it is tied to the
embedding, or the embedding's own GGUF blocks packed once where it is not.

A tied model's embedding table and LM head hold the same matrix. Once a format has packed the
head (a GGUF's Q8_0 on ``kernels/q8_amx``, or a stored block type on ``kernels/codes8``), a
bf16 copy of the same values as the embedding table is a second copy of the largest matrix:
56.6 MB beside the default model's 32 MB head, 335 MB for Gemma 3 270M's 262k-token vocabulary.
An untied model's embedding (Llama 3 8B's 128k x 4096, 1 GB in bf16) is stored in a block type
of a byte or less a weight. :class:`PackedEmbedding` looks rows up in packed codes and scales,
and dequantizes only the rows asked for, in the order the file's dequantization takes
(``block_types``): the rows are the bf16 table's own, bit for bit. :func:`packed_embedding`
builds one only where that holds, checked on every row when the format is applied;
:func:`embedding_codes` packs an untied embedding's stored blocks for it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from treeserve.ops.block_types import Q4Blocks, StoredBlocks
from treeserve.ops.kernels import codes8, dense_cpu
from treeserve.ops.linears import Codes8Linear, Q8Linear

CHECK_ROWS = 4096
"""Rows compared at a time against the table (a bounded scratch)."""

_NONE = torch.empty(0)


class PackedEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over packed codes: a :class:`Q8Linear` or :class:`Codes8Linear`
    (at a byte or five bits a code), an LM head's or an untied embedding's own
    (:func:`embedding_codes`). ``forward(tokens)`` gives ``(..., D)`` bf16 rows.

    The kernel's tensors are held as buffers of this module too (the same storage, not saved
    with a state dict), and nothing converts or moves them: a drafter's ``.to(dtype)`` over the
    shared embedding leaves the head's codes and scales as they are (:meth:`_apply`; the int
    formats are CPU-only).
    """

    dtype = torch.bfloat16

    def __init__(self, head: Q8Linear | Codes8Linear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.kind = 0 if isinstance(head, Q8Linear) else 1  # embed_rows.h's packings
        if isinstance(head, Q8Linear):
            tensors = {"codes": head.codes, "scales": head.scales, "zeros": None}
        else:
            zeros = head.c8_zeros if head.c8_zeros.numel() else None
            tensors = {"codes": head.c8_codes, "scales": head.c8_scales, "zeros": zeros}
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """Leave the head's tensors as they are: they belong to the head kernel."""
        return self

    def rows(self, ids: Tensor) -> Tensor:
        """The rows ``ids`` ``(T,)`` of the table, ``(T, D)`` bf16: ``scale * code`` (``+ zero``)
        in float32, as the file's dequantization, then rounded (``embed_rows.h``)."""
        zeros = _NONE if self.zeros is None else self.zeros
        out: Tensor = torch.ops.treeserve_dense.embed_rows(ids.reshape(-1).to(torch.long).contiguous(), self.codes,
                                                           self.scales, zeros, self.kind, self.num_embeddings,
                                                           self.embedding_dim)
        return out

    def forward(self, tokens: Tensor) -> Tensor:
        return self.rows(tokens).reshape(*tokens.shape, self.embedding_dim)

    @property
    def weight(self) -> Tensor:
        """The whole ``(V, D)`` table, dequantized anew on each read (for code that needs the
        matrix itself; a lookup reads :meth:`rows`)."""
        return self.rows(torch.arange(self.num_embeddings, device=self.device))


def packed_embedding(head: nn.Module | None, table: Tensor) -> PackedEmbedding | None:
    """A :class:`PackedEmbedding` over ``head`` (a packed LM head, or :func:`embedding_codes`)
    that gives every row of ``table`` ``(V, D)`` bit for bit, or None (another kernel, another
    shape, or values that differ: a head quantized from float weights that were not Q8_0
    blocks)."""
    if not isinstance(head, (Q8Linear, Codes8Linear)) or (head.out_features, head.in_features) != tuple(table.shape):
        return None
    if isinstance(head, Q8Linear) and head.codes.numel() != table.numel():  # q8_amx's codes, a byte each
        return None
    if table.dtype != torch.bfloat16 or table.device.type != "cpu" or not dense_cpu.available():
        return None
    packed = PackedEmbedding(head)
    for start in range(0, table.shape[0], CHECK_ROWS):
        ids = torch.arange(start, min(start + CHECK_ROWS, table.shape[0]), device=table.device)
        if not torch.equal(packed.rows(ids).view(torch.int16), table[ids].view(torch.int16)):
            return None
    return packed


def embedding_codes(stored: StoredBlocks | None, table: Tensor) -> Codes8Linear | None:
    """The stored blocks of an untied embedding (``table`` ``(V, D)``), packed on codes8 for
    :func:`packed_embedding` to read (the kernel's container only: nothing multiplies by it), or
    None where there are none or codes8 does not take the shape here."""
    if stored is None or not codes8.available() or not codes8.supports(*table.shape):
        return None
    return Codes8Linear(stored.as_codes8() if isinstance(stored, Q4Blocks) else stored, None, float_out=True)


def embedding_rows(embedding: nn.Module, ids: Tensor) -> Tensor:
    """Rows ``ids`` of an ``nn.Embedding``'s or a :class:`PackedEmbedding`'s table."""
    if isinstance(embedding, PackedEmbedding):
        return embedding.rows(ids)
    weight: Tensor = embedding.weight
    return weight.detach()[ids]


__all__ = ["PackedEmbedding", "embedding_codes", "embedding_rows", "packed_embedding"]
