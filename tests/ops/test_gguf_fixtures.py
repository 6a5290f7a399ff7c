"""treeserve against llama.cpp on GGUFs of every block type: a small random-weight llama model
written by the gguf package and requantized by llama.cpp into eight file types
(``bench/gguf_fixtures.py``), and models of the other architectures (llama3, qwen2, qwen3, phi3,
gemma3), with llama.cpp's own logits on 160 tokens saved beside each file.

Served as stored (``auto``: the gguf format, each tensor on its own kernel), each file's logits
stay within a tolerance of llama.cpp's (stated per file type below) and its top-1 agrees at 99%
or more of the positions; a decoder with one slip in a block type fails the same check.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from treeserve.ops import block_types
from treeserve.ops.kernels import codes8

DATA = Path(__file__).parent / "data" / "gguf"
META = json.loads((DATA / "fixtures.json").read_text(encoding="utf-8"))

# Largest |logit - llama.cpp's| over the positions, relative to llama.cpp's spread (max - min)
# at that position. Both sides multiply by int8 rows (llama.cpp's Q8_0 activations); the rest is
# treeserve's bf16 activations and K/V cache (llama.cpp keeps float32 activations and an f16
# cache). Measured: 0.013-0.030 (Q5_K_M the largest), and 99.4-100% top-1.
TOLERANCE = {name: 0.05 for name in META["files"]}


def logits_on_tokens(model: torch.nn.Module) -> torch.Tensor:
    """``model``'s float32 logits ``(T, V)`` for the fixtures' tokens from the start."""
    tokens = torch.tensor([META["tokens"]])
    return model(tokens, model.new_cache(1, tokens.shape[1]))[0].float()  # type: ignore[operator]


def served_logits(path: Path, cache: Path, weight_format: str = "auto") -> tuple[torch.Tensor, str]:
    from treeserve.ops.loaders.load import load_model

    model = load_model(path, weight_format=weight_format, cache_dir=cache, compile_decode=False).model
    return logits_on_tokens(model), model.weight_format


def compare(got: torch.Tensor, file: str) -> tuple[float, float]:
    """(largest relative error, top-1 agreement) against llama.cpp's logits for the fixture
    ``file`` (saved beside it)."""
    reference = torch.from_numpy(np.load(DATA / file.replace(".gguf", ".logits.npy")).astype(np.float32))
    spread = (reference.amax(-1) - reference.amin(-1))[:, None]
    error = ((got - reference).abs() / spread).max().item()
    agree = (got.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return error, agree


@pytest.mark.parametrize("name", sorted(META["files"]))
def test_each_file_type_gives_llama_cpps_logits(name: str, tmp_path: Path) -> None:
    if not codes8.available():
        pytest.skip("the gguf format's kernels need AVX2 and a C++ compiler")
    got, served = served_logits(DATA / f"tiny-llama-{name}.gguf", tmp_path)
    assert served in ("gguf", "q4_1")  # auto: as stored
    error, agree = compare(got, f"tiny-llama-{name}.gguf")
    assert error <= TOLERANCE[name], f"{name}: relative logit error {error:.4f}"
    assert agree >= 0.99, f"{name}: top-1 agreement {agree:.3f}"


def test_a_wrong_dequantizer_fails_against_llama_cpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K's codes read with their two nibble halves swapped (a plausible slip): the served
    model strays from llama.cpp's logits far beyond the tolerance."""
    if not codes8.available():
        pytest.skip("the gguf format's kernels need AVX2 and a C++ compiler")
    kind = block_types.BLOCK_TYPES["Q4_K"]

    def swapped(raw: np.ndarray) -> block_types.Decoded:
        codes, scales, zeros = kind.decode(raw)
        n = codes.shape[0]
        return codes.reshape(n, -1, 2, 16)[:, :, ::-1].reshape(n, -1), scales, zeros

    monkeypatch.setitem(block_types.BLOCK_TYPES, "Q4_K", dataclasses.replace(kind, decode=swapped))
    got, _ = served_logits(DATA / "tiny-llama-Q4_K_M.gguf", tmp_path)
    error, _ = compare(got, "tiny-llama-Q4_K_M.gguf")
    assert error > 2 * TOLERANCE["Q4_K_M"], error


def test_the_fixtures_hold_every_block_type() -> None:
    held = {t for f in META["files"].values() for t in f["block_types"]}
    assert set(block_types.BLOCK_TYPES) <= held


def test_llama3_rope_scaling_gives_llama_cpps_logits(tmp_path: Path) -> None:
    """Llama 3.1's per-frequency rope factors (``rope_freqs``, from 1 to 8 here): read from the
    file and applied, llama.cpp's logits; the same model on plain rope strays far from them."""
    if not codes8.available():
        pytest.skip("the gguf format's kernels need AVX2 and a C++ compiler")
    from treeserve.ops.loaders.load import load_model
    from treeserve.ops.model_config import rope_tables

    info = META["llama3"]
    model = load_model(DATA / info["file"], weight_format="auto", cache_dir=tmp_path, compile_decode=False).model
    assert model.config.rope_factors == pytest.approx(info["rope_factors"], rel=1e-6)
    error, agree = compare(logits_on_tokens(model), info["file"])
    assert error <= TOLERANCE["Q8_0"] and agree >= 0.99, (error, agree)
    model.rope_cos, model.rope_sin = rope_tables(dataclasses.replace(model.config, rope_factors=None))
    plain_error, plain_agree = compare(logits_on_tokens(model), info["file"])
    assert plain_error > 2 * TOLERANCE["Q8_0"] and plain_agree < agree, (plain_error, plain_agree)


def _stray(model: torch.nn.Module, arch: str) -> None:
    """Change, in ``model``, what ``arch`` adds to llama (a wrong implementation of it)."""
    attn = model.layers[0].self_attn
    with torch.no_grad():
        if arch == "qwen2":
            attn.qkv_proj.bias.zero_()
        elif arch == "qwen3":
            attn.q_norm.weight.fill_(1.0)
        elif arch == "phi3":  # gate and up read the other way round from the fused ffn_up
            blocks = model.layers[0].mlp.gate_up_proj
            for name in ("c8_codes", "c8_scales", "c8_zeros", "amx_codes", "amx_scales_zeros"):
                buffer = getattr(blocks, name, None)
                if isinstance(buffer, torch.Tensor) and buffer.dim() > 0 and buffer.shape[0] % 2 == 0:
                    buffer.copy_(torch.cat(buffer.chunk(2)[::-1]))
        else:  # gemma3 with no sliding window: every layer global
            model.config = dataclasses.replace(model.config, sliding_window=None, window_layers=None)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3", "gemma3"])
def test_other_architectures_run_the_one_op_forward_with_llama_cpps_logits(arch: str, tmp_path: Path) -> None:
    """qwen2 (Q/K/V biases, an untied head), qwen3 (per-head Q/K norms), phi3 (Q/K/V and gate/up
    each one tensor in the file) and gemma3 (a sliding window of 24 keys on one layer, each
    layer kind with its rope, output norms, GELU, scaled embeddings), Q4_K_M: served on the
    one-op forward, which does each of these as the eager forward does, with llama.cpp's logits
    and one answer per row (a window crossed many times); the op with that part changed strays."""
    if not codes8.available():
        pytest.skip("the gguf format's kernels need AVX2 and a C++ compiler")
    from treeserve.ops.decode_step import DecodeStep
    from treeserve.ops.loaders.load import load_model

    from . import row_invariance
    from .row_invariance import other_prompts

    info = META[arch]
    model = load_model(DATA / info["file"], weight_format="auto", cache_dir=tmp_path, compile_decode=False).model
    step = model.decode_step
    if not isinstance(step, DecodeStep) or not step.is_fused:
        pytest.skip("the one-op forward needs AVX2, FMA and F16C and a C++ compiler")
    config = model.config
    assert (config.qkv_bias, config.qk_norm) == {"qwen2": (True, False), "phi3": (False, False)}.get(arch, (False, True))
    if arch == "gemma3":
        assert (config.sliding_window, config.window_layers, config.activation) == (24, (True, False), "gelu_tanh")
    error, agree = compare(logits_on_tokens(model), info["file"])
    assert error <= TOLERANCE["Q4_K_M"] and agree >= 0.99, (error, agree)
    assert row_invariance.failures(model, META["tokens"][:150], other_prompts(META["vocab_size"])) == []
    _stray(model, arch)
    changed = DecodeStep(model)
    assert changed.fuse()
    model.decode_step = changed
    strayed, _ = compare(logits_on_tokens(model), info["file"])
    assert strayed > 2 * error, (strayed, error)


ARCH_FILES = {"llama": "tiny-llama-Q4_K_M.gguf", "llama3": META["llama3"]["file"], "qwen2": META["qwen2"]["file"],
              "qwen3": META["qwen3"]["file"], "phi3": META["phi3"]["file"], "gemma3": META["gemma3"]["file"]}


@pytest.mark.parametrize("arch", ["phi3", "gemma3"])
def test_phi3_and_gemma3_in_float32_give_llama_cpps_logits(arch: str, tmp_path: Path) -> None:
    """The eager forward (float32, the file's weights dequantized) of phi3 and gemma3 within the
    tolerance of llama.cpp; gemma3 without its window, or with the global layers' rope on every
    layer, strays far from it."""
    from treeserve.ops.loaders.load import load_model

    info = META[arch]
    model = load_model(DATA / info["file"], weight_format="float32", cache_dir=tmp_path, compile_decode=False).model
    error, agree = compare(logits_on_tokens(model), info["file"])
    assert error <= TOLERANCE["Q4_K_M"] and agree >= 0.99, (error, agree)
    if arch == "gemma3":
        config = model.config
        for wrong in (dataclasses.replace(config, sliding_window=None, window_layers=None),
                      dataclasses.replace(config, rope_base_local=None),
                      dataclasses.replace(config, sliding_window=25)):
            model.config = wrong
            model.set_rope_tables()
            strayed, _ = compare(logits_on_tokens(model), info["file"])
            assert strayed > 2 * error, (wrong, strayed, error)


@pytest.mark.parametrize("weight_format", ["float32", "auto"])
@pytest.mark.parametrize("arch", sorted(ARCH_FILES))
def test_greedy_tree_speculation_equals_incremental_decoding(arch: str, weight_format: str, tmp_path: Path) -> None:
    """For each architecture, greedy tree speculation gives incremental decoding's tokens: in
    float32 (whose logits agree across shapes to rounding), and as stored (the one-op forward,
    the same bits at every shape). A self-drafting tree (the model's first layer) keeps it from
    being vacuous: some steps accept several tokens."""
    from treeserve.ops.drafting import ModelSpeculator
    from treeserve.ops.loaders.load import load_model
    from treeserve.ops.ngram import NGramSpeculator
    from treeserve.ops.sampling import SamplingParams
    from treeserve.ops.speculative import generate_incremental, generate_speculative

    if weight_format == "auto" and not codes8.available():
        pytest.skip("the gguf format's kernels need AVX2 and a C++ compiler")
    model = load_model(DATA / ARCH_FILES[arch], weight_format=weight_format, cache_dir=tmp_path,
                       compile_decode=False).model
    prompt = META["tokens"][:40]
    params = SamplingParams(max_new_tokens=40)
    reference = generate_incremental(model, prompt, params)
    drafter = load_model(DATA / ARCH_FILES[arch], cache_dir=tmp_path).model.truncated(1)
    speculators = [ModelSpeculator(drafter, (2, 2, 1, 1)), NGramSpeculator(META["vocab_size"])]
    result = generate_speculative(model, speculators, prompt, params)
    assert result.token_ids == reference.token_ids
    assert result.mean_accepted_per_step > 0.0


BPE_PRE_KINDS = ("bpe_smollm", "bpe_llama-bpe", "bpe_qwen2")
"""One vocabulary whose merges cross every split, under three pre-tokenizers (``bench/gguf_fixtures.py``)."""


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece", "sentencepiece_no_prefix", *BPE_PRE_KINDS])
def test_tokenizers_give_llama_cpps_ids(kind: str, tmp_path: Path) -> None:
    """Each GGUF tokenizer kind (byte-level BPE with the smollm, llama-bpe and qwen2
    pre-tokenizers; SentencePiece with scores and byte fallback, with a space prefix as Llama 2's
    or without as Gemma's) gives llama.cpp's own ids on texts with Unicode, digits, code, runs
    of whitespace, characters outside the vocabulary and special-token text, decodes back, and
    does the same once saved with a converted model and read back."""
    from treeserve.ops.tokenizer import Tokenizer

    info = META[kind]
    tokenizer = Tokenizer.from_gguf(DATA / info["file"])
    tokenizer.save(tmp_path)
    for reread in (tokenizer, Tokenizer.from_folder(tmp_path)):
        for text, ids in zip(info["texts"], info["ids"], strict=True):
            assert reread.encode(text, add_bos=False) == ids, text
            if "<" not in text:  # special-token text decodes with the spaces SentencePiece puts around it
                assert reread.decode(ids) == text


def test_a_sentencepiece_tokenizer_with_its_scores_reversed_differs() -> None:
    """The check can fail: the same vocabulary with the scores reversed (merges in the other
    order) gives other ids on the texts."""
    import gguf

    from treeserve.ops.tokenizer import Tokenizer

    info = META["sentencepiece"]
    reader = gguf.GGUFReader(str(DATA / info["file"]))

    class Reversed:  # the reader, with each score negated
        fields = dict(reader.fields)

    scores = reader.fields["tokenizer.ggml.scores"]
    Reversed.fields["tokenizer.ggml.scores"] = type("F", (), {"contents": lambda self: [-v for v in scores.contents()]})()
    tokenizer = Tokenizer.from_gguf_reader(Reversed())
    assert any(tokenizer.encode(t, add_bos=False) != ids for t, ids in zip(info["texts"], info["ids"]))


def test_the_pre_tokenizer_fixtures_tell_the_pre_tokenizers_apart() -> None:
    """The pre-tokenizer check can fail: on the same vocabulary llama.cpp's ids differ between
    each two of smollm, llama-bpe and qwen2 on some text (digits, contractions, whitespace), so
    a tokenizer that read one pre-tokenizer as another would miss the other's ids."""
    for i, first in enumerate(BPE_PRE_KINDS):
        for second in BPE_PRE_KINDS[i + 1:]:
            assert META[first]["ids"] != META[second]["ids"], (first, second)
