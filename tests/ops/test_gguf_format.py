"""The gguf format: a model whose linears are stored in mixed GGUF block types (as a Q4_K_M
file mixes Q4_K, Q6_K, Q5_0 and Q8_0) serves each on its kernel with its own values, fused Q/K/V
of mixed types included, agrees with float32 on the same values, and runs the one-op forward
with one answer per row."""

from __future__ import annotations

import zlib

import pytest
import torch

from treeserve.ops.block_types import BLOCK_TYPES, StoredBlocks
from treeserve.ops.decode_step import DecodeStep
from treeserve.ops.formats import apply_format
from treeserve.ops.linears import Codes8Linear, Int4Linear
from treeserve.ops.kernels import codes8
from treeserve.ops.model import Transformer

from . import row_invariance
from .conftest import make_tiny_model, random_raw
from .row_invariance import other_prompts

# K-quants need rows of 256 weights: every input size here is 256.
DIMS = dict(vocab_size=256, dim=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, ffn_dim=256,
            max_seq_len=512)

# Each type's scale, so that its weights come out about 0.01-0.05 in size.
SCALE = {"Q4_0": 0.005, "Q4_1": 0.004, "Q4_K": 0.0002, "Q5_0": 0.0025, "Q5_1": 0.002, "Q5_K": 0.0001,
         "Q6_K": 0.00004, "Q8_0": 0.0003}

# Layer 0: Q/K/V of three types without zeros (one QKV on 8-bit codes, scales per 16), a 4-bit
# o_proj, gate/up with zeros, Q6_K down. Layer 1: Q4_K Q/K with Q6_K V (zeros and scales per
# 16), the 4-bit types elsewhere.
TYPES = {
    0: {"q_proj": "Q5_0", "k_proj": "Q8_0", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q5_K", "up_proj": "Q5_1",
        "down_proj": "Q6_K"},
    1: {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q8_0", "gate_proj": "Q4_0", "up_proj": "Q4_1",
        "down_proj": "Q4_K"},
}


def stored_model(seed: int = 0) -> tuple[Transformer, dict[str, StoredBlocks]]:
    """A tiny float32 model whose linears hold exactly the values of random blocks of
    :data:`TYPES`, and those blocks."""
    model = make_tiny_model(seed, **DIMS)
    stored: dict[str, StoredBlocks] = {}
    with torch.no_grad():
        for index, types in TYPES.items():
            for name, param in model.layers[index].named_parameters():
                part = name.split(".")[-2]
                if part not in types:
                    continue
                kind = BLOCK_TYPES[types[part]]
                rows, cols = param.shape
                # A seed of the tensor's name that every process agrees on (hash() of a str is
                # salted per process: the blocks, and the agreement below, changed from run to run).
                seed = zlib.crc32(f"{index}.{part}".encode()) % 1000
                raw = random_raw(kind, rows, cols // kind.block_size, seed=seed, scale=SCALE[kind.name])
                blocks = kind.stored(raw, rows)
                param.copy_(blocks.dequantize())
                stored[f"layers.{index}.{name}"] = blocks
    return model, stored


def logits(model: Transformer, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(tokens))
    return model(torch.tensor([tokens]), cache)[0].float()


@pytest.fixture(scope="module")
def served() -> tuple[Transformer, torch.Tensor]:
    if not codes8.available():
        pytest.skip("the 8-bit-code kernel needs AVX2 and a C++ compiler")
    tokens = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = logits(stored_model()[0], tokens)
    model, stored = stored_model()
    return apply_format(model, "gguf", stored=stored), reference


def test_each_linear_runs_its_stored_type_and_agrees_with_float32(served) -> None:  # type: ignore[no-untyped-def]
    model, reference = served
    first, second = model.layers
    assert isinstance(first.self_attn.qkv_proj, Codes8Linear) and isinstance(first.self_attn.o_proj, Int4Linear)
    assert isinstance(first.mlp.gate_up_proj, Codes8Linear) and isinstance(first.mlp.down_proj, Codes8Linear)
    assert isinstance(second.self_attn.qkv_proj, Codes8Linear) and isinstance(second.mlp.gate_up_proj, Int4Linear)
    tokens = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    got = logits(model, tokens)
    spread = (reference.amax(-1) - reference.amin(-1))[:, None]
    error = ((got - reference).abs() / spread).max().item()
    # bf16 activations and int8 rows, as q4_1 (tests/ops/test_formats.py): 0.12 of the spread.
    assert 0 < error <= 0.12, error
    agree = (got.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_a_wrong_value_in_one_part_is_seen(served) -> None:  # type: ignore[no-untyped-def]
    """The agreement check can fail: the same model with V's scales doubled strays from float32."""
    _, reference = served
    model, stored = stored_model()
    v = stored["layers.0.self_attn.v_proj.weight"]
    stored["layers.0.self_attn.v_proj.weight"] = type(v)(v.codes, v.scales * 2, v.zeros)  # type: ignore[call-arg]
    tokens = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    got = logits(apply_format(model, "gguf", stored=stored), tokens)
    spread = (reference.amax(-1) - reference.amin(-1))[:, None]
    assert ((got - reference).abs() / spread).max().item() > 0.12


def test_the_mixed_forward_is_row_invariant(served) -> None:  # type: ignore[no-untyped-def]
    model, _ = served
    step = DecodeStep(model)
    if not step.fuse():
        pytest.skip("the one-op forward needs AVX2, FMA and F16C and a C++ compiler")
    model.decode_step = step
    try:
        prompt = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(2)).tolist()
        assert row_invariance.failures(model, prompt, other_prompts(256)) == []
    finally:
        model.decode_step = None
