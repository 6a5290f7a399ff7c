"""A tied model's embedding read out of its LM head's packed codes (``treeserve.ops.embedding``):
the same rows as the bf16 table, bit for bit, on both packings (q8_amx's Q8_0 head, codes8's
head of another block type), only where they are the same, and shared by the drafters."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from treeserve.ops.embedding import PackedEmbedding, embedding_rows, packed_embedding
from treeserve.ops.formats import apply_format
from treeserve.ops.kernels import dense_cpu, q8_amx

from .conftest import make_tiny_model
from .test_formats import FORMAT_DIMS, q4_model
from .test_gguf_fixtures import DATA, META

pytestmark = pytest.mark.skipif(not (dense_cpu.available() and q8_amx.available()),
                                reason="the packed heads and embed_rows need AVX2 and a C++ compiler")


def _table(model: torch.nn.Module) -> torch.Tensor:
    """The bf16 table an unshared format holds: the float32 embedding rounded."""
    return model.embed_tokens.weight.detach().to(torch.bfloat16).clone()


def test_the_q8_head_serves_the_embedding_bit_for_bit() -> None:
    model, blocks = q4_model(seed=5)
    table = _table(model)
    apply_format(model, "q4_1")
    embedding = model.embed_tokens
    assert isinstance(embedding, PackedEmbedding) and embedding.kind == 0
    assert embedding.codes.data_ptr() == model.head_kernel.codes.data_ptr()  # the head's own storage
    ids = torch.arange(table.shape[0])
    assert torch.equal(embedding.rows(ids).view(torch.int16), table.view(torch.int16))
    tokens = torch.tensor([[5, 0, 127, 64], [3, 3, 90, 31]])
    assert torch.equal(embedding(tokens), table[tokens])
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"


def test_a_head_of_other_values_keeps_the_table() -> None:
    """Random float weights: the Q8_0 head is quantized from them, so it is not the table."""
    model = make_tiny_model(7, **FORMAT_DIMS)
    apply_format(model, "q4_1")
    assert isinstance(model.embed_tokens, torch.nn.Embedding)


def test_one_changed_code_fails_the_check() -> None:
    """The check reads every row: a head whose codes differ in one weight is not shared."""
    model, _ = q4_model(seed=6)
    table = _table(model)
    apply_format(model, "q4_1")
    head = copy.deepcopy(model.head_kernel)
    assert packed_embedding(head, table) is not None
    head.codes[5000] = head.codes[5000] ^ 1
    assert packed_embedding(head, table) is None


def _stored_embedding(kind: str, seed: int, blocks_seed: int, *, tied: bool) -> tuple[torch.nn.Module, dict[str, object]]:
    """A tiny float32 model (K-quant sizes) whose embedding holds exactly the values of random
    ``kind`` blocks, and those blocks as ``apply_format``'s ``stored``."""
    from treeserve.ops.block_types import BLOCK_TYPES

    from .conftest import random_raw
    from .test_gguf_format import DIMS, SCALE

    model = make_tiny_model(seed, **{**DIMS, "tie_embeddings": tied})
    block = BLOCK_TYPES[kind]
    rows, cols = model.embed_tokens.weight.shape
    stored = block.stored(random_raw(block, rows, cols // block.block_size, seed=blocks_seed, scale=SCALE[kind] * 20), rows)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(stored.dequantize())
    return model, {"embed_tokens.weight": stored}


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_1", "Q6_K", "Q8_0"])
def test_a_codes8_head_serves_the_embedding_bit_for_bit(kind: str) -> None:
    """A tied embedding stored in another block type (the gguf format puts its head on codes8,
    scales per 16 or 32, zeros where the type has them) gives the file's dequantized rows, and
    the model the same logits as with the table, whether the head holds its codes at a byte or
    at five bits (:mod:`~treeserve.ops.kernels.codes8`'s packing where it pays)."""
    from .test_gguf_format import logits

    model, stored = _stored_embedding(kind, 9, 3, tied=True)
    table = _table(model)
    rows, cols = table.shape
    apply_format(model, "gguf", stored=stored)
    embedding = model.embed_tokens
    assert isinstance(embedding, PackedEmbedding) and embedding.kind == 1, type(embedding)
    assert (embedding.zeros is not None) == (kind in ("Q4_0", "Q4_K", "Q5_1"))
    assert torch.equal(embedding.rows(torch.arange(rows)).view(torch.int16), table.view(torch.int16))
    tokens = torch.randint(0, rows, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    got = logits(model, tokens)
    model.embed_tokens = torch.nn.Embedding(rows, cols, _weight=table)
    assert torch.equal(got, logits(model, tokens))


def test_an_untied_embedding_of_a_shape_codes8_does_not_take_keeps_its_table(tmp_path: Path) -> None:
    from treeserve.ops.loaders.load import load_model

    model = load_model(DATA / META["mixed"]["qwen2"]["file"], weight_format="auto", cache_dir=tmp_path,
                       compile_decode=False).model
    assert model.lm_head is not None and model.config.vocab_size % 16 != 0
    assert isinstance(model.embed_tokens, torch.nn.Embedding)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_an_untied_embedding_reads_its_own_blocks_and_saves_them_with_the_format(kind: str) -> None:
    """An untied embedding stored in a block type: packed once, its rows the table's bit for bit,
    the same logits, left out of the bytes a token reads, and back from the saved buffers."""
    from treeserve.ops.formats import prepared_buffers, weight_bytes_per_token

    from .test_gguf_format import logits

    model, stored = _stored_embedding(kind, 10, 5, tied=False)
    table = _table(model)
    rows, cols = table.shape
    apply_format(model, "gguf", stored=stored)
    assert isinstance(model.embed_tokens, PackedEmbedding) and model.lm_head is not None
    assert torch.equal(model.embed_tokens.rows(torch.arange(rows)).view(torch.int16), table.view(torch.int16))
    tokens = torch.randint(0, rows, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    got = logits(model, tokens)
    read = weight_bytes_per_token(model)
    saved = prepared_buffers(model)
    assert any(name.startswith("embed_codes.") for name in saved)
    model.embed_tokens = torch.nn.Embedding(rows, cols, _weight=table)
    assert torch.equal(got, logits(model, tokens))
    del model.embed_codes
    assert weight_bytes_per_token(model) == read  # the embedding's codes are not read a token
    again, _ = _stored_embedding(kind, 10, 5, tied=False)
    apply_format(again, "gguf", prepared=saved)  # a later start: the saved buffers, no blocks
    assert isinstance(again.embed_tokens, PackedEmbedding)
    assert torch.equal(logits(again, tokens), got)


def test_the_drafters_read_their_head_rows_from_the_packed_embedding() -> None:
    from treeserve.ops.feature_drafter import FeatureDrafter
    from treeserve.ops.ssm import DistilledSSM, SSMConfig

    model, _ = q4_model(seed=8)
    table = _table(model)
    apply_format(model, "q4_1")
    c = model.config
    config = SSMConfig(vocab_size=c.vocab_size, dim=c.dim, num_layers=1, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                       head_dim=c.head_dim, ffn_dim=c.ffn_dim, draft_vocab_size=32)
    ids = torch.arange(0, 128, 4)
    for drafter in (DistilledSSM(config, model.embed_tokens).to(model.dtype),
                    FeatureDrafter(config, model.embed_tokens, None).to(model.dtype)):
        assert torch.equal(drafter.head_weight.view(torch.int16), table[:32].view(torch.int16))
        drafter.set_draft_ids(ids)
        assert drafter.embed_tokens is model.embed_tokens
        assert torch.equal(drafter.head_weight.view(torch.int16), table[ids].view(torch.int16))
        assert torch.equal(embedding_rows(drafter.embed_tokens, ids), table[ids])
    # The drafters' .to(dtype) left the head's own codes and float16 scales as they were.
    assert model.head_kernel.codes.dtype == torch.int8 and model.head_kernel.scales.dtype == torch.float16
    assert model.embed_tokens.scales.data_ptr() == model.head_kernel.scales.data_ptr()


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("five_bits", [False, True])
def test_both_codes8_packings_give_the_rows(kind: str, five_bits: bool) -> None:
    """codes8's head at a byte a code and at five bits (signed Q5_0 fields, unsigned Q5_1 ones;
    Q8_0's codes never fit five bits), whichever this host packs by default."""
    from treeserve.ops.block_types import BLOCK_TYPES
    from treeserve.ops.kernels import codes8
    from treeserve.ops.linears import Codes8Linear

    from .conftest import random_raw

    block = BLOCK_TYPES[kind]
    rows, cols = 64, 96
    stored = block.stored(random_raw(block, rows, cols // block.block_size, seed=4, scale=0.05), rows)
    table = stored.dequantize().to(torch.bfloat16)
    codes, scales, zeros = codes8.pack(stored.codes, stored.scales, stored.zeros, five_bits=five_bits)
    assert (codes.numel() < rows * cols) == (five_bits and kind != "Q8_0")
    head = Codes8Linear({"c8_codes": codes, "c8_scales": scales, "c8_zeros": zeros,
                         "c8_shape": torch.tensor([rows, cols])}, None, float_out=True)
    shared = packed_embedding(head, table)
    assert shared is not None
    assert torch.equal(shared.rows(torch.arange(rows)).view(torch.int16), table.view(torch.int16))
