"""Every architecture in every block type, against llama.cpp: for each of llama, llama3, qwen2,
qwen3, phi3 and gemma3, one small trained model whose weight matrices are spread over all eight
integer block types treeserve reads (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, each as
llama.cpp's own requantization wrote it; ``bench/gguf_fixtures.py``'s ``mixed_fixture``), with
llama.cpp's logits on 160 tokens saved beside it.

Served as stored (each tensor on its own kernel, Q/K/V of different types fused), each file
stays within the tolerance of llama.cpp's logits with top-1 agreeing at 99% or more, and gives one
answer per row; a decoder with a slip in any one block type strays far from llama.cpp's logits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from treeserve.ops import block_types
from treeserve.ops.kernels import codes8

from .test_gguf_fixtures import DATA, META, compare, logits_on_tokens, served_logits

MIXED = META["mixed"]

TOLERANCE = 0.05
"""Largest |logit - llama.cpp's| relative to llama.cpp's spread at the position, as for the
single-type files (``test_gguf_fixtures.py``)."""

pytestmark = pytest.mark.skipif(not codes8.available(), reason="the gguf format's kernels need AVX2 and a C++ compiler")


def test_each_mixed_file_holds_every_block_type() -> None:
    for name, info in MIXED.items():
        assert set(info["block_types"]) == set(block_types.BLOCK_TYPES), name


@pytest.mark.parametrize("arch", sorted(MIXED))
def test_every_block_type_of_each_architecture_gives_llama_cpps_logits(arch: str, tmp_path: Path) -> None:
    """Within the tolerance of llama.cpp's logits, top-1 agreeing at 99% or more, on the one-op
    forward where it runs, with one answer per row (chains, trees, batches, prefills)."""
    from treeserve.ops.loaders.load import load_model

    from . import row_invariance

    info = MIXED[arch]
    model = load_model(DATA / info["file"], weight_format="auto", cache_dir=tmp_path, compile_decode=False).model
    assert model.weight_format == "gguf"
    error, agree = compare(logits_on_tokens(model), info["file"])
    assert error <= TOLERANCE and agree >= 0.99, (error, agree)
    if getattr(model.decode_step, "is_fused", False):
        others = row_invariance.other_prompts(META["vocab_size"])
        assert row_invariance.failures(model, META["tokens"][:150], others) == []


def _reversed_blocks(kind: block_types.BlockType) -> block_types.BlockType:
    """``kind`` with the codes of each block read back to front (a slip in the order of its bytes)."""
    def decode(raw: np.ndarray) -> block_types.Decoded:
        codes, scales, zeros = kind.decode(raw)
        n = codes.shape[0]
        return codes.reshape(n, -1, kind.block_size)[:, :, ::-1].reshape(n, -1), scales, zeros

    return dataclasses.replace(kind, decode=decode)


@pytest.mark.parametrize("kind", sorted(block_types.BLOCK_TYPES))
def test_a_wrong_dequantizer_of_any_block_type_strays(kind: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """One block type decoded wrongly (its codes reversed in each block) moves the logits of a
    mixed file (each type on another architecture's file) far beyond the tolerance."""
    arch = sorted(MIXED)[sorted(block_types.BLOCK_TYPES).index(kind) % len(MIXED)]
    info = MIXED[arch]
    assert kind in info["tensor_types"].values()
    good, _ = served_logits(DATA / info["file"], tmp_path / "good")
    monkeypatch.setitem(block_types.BLOCK_TYPES, kind, _reversed_blocks(block_types.BLOCK_TYPES[kind]))
    bad, _ = served_logits(DATA / info["file"], tmp_path / "bad")
    error, _ = compare(good, info["file"])
    strayed, _ = compare(bad, info["file"])
    assert strayed > 2 * TOLERANCE and strayed > 4 * error, (arch, kind, strayed, error)


@pytest.mark.parametrize("arch", sorted(MIXED))
def test_greedy_tree_speculation_equals_incremental_decoding_in_every_block_type(arch: str, tmp_path: Path) -> None:
    """Greedy tree speculation gives incremental decoding's tokens on each mixed file as stored,
    with a self-drafting tree (the model's first layer) so that steps accept several tokens."""
    from treeserve.ops.drafting import ModelSpeculator
    from treeserve.ops.loaders.load import load_model
    from treeserve.ops.ngram import NGramSpeculator
    from treeserve.ops.sampling import SamplingParams
    from treeserve.ops.speculative import generate_incremental, generate_speculative

    path = DATA / MIXED[arch]["file"]
    model = load_model(path, weight_format="auto", cache_dir=tmp_path, compile_decode=False).model
    prompt = META["tokens"][:40]
    params = SamplingParams(max_new_tokens=40)
    reference = generate_incremental(model, prompt, params)
    drafter = load_model(path, cache_dir=tmp_path).model.truncated(1)
    speculators = [ModelSpeculator(drafter, (2, 2, 1, 1)), NGramSpeculator(META["vocab_size"])]
    result = generate_speculative(model, speculators, prompt, params)
    assert result.token_ids == reference.token_ids
    assert result.mean_accepted_per_step > 0.0
