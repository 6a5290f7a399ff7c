"""The speculator factory: spec strings, the default set and its order, and building a request's
speculators in spec order (the server's actors and the in-process path both build them here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from treeserve.actors.speculator_factory import (
    NGRAM_OPTIONS,
    SpeculatorKind,
    SpeculatorSpec,
    default_speculators,
    load_drafter,
    make_speculators,
    parse_speculator,
)
from treeserve.ops.drafting import ModelSpeculator
from treeserve.ops.feature_drafter import DEFAULT_FEATURE_DRAFTER_FILE
from treeserve.ops.feature_speculator import DEFAULT_FEATURE_WIDTHS
from treeserve.ops.loaders.registry import DEFAULT_MODEL
from treeserve.ops.ngram import NGramSpeculator

import tiny_model_files as tiny  # registered by conftest.py


def test_spec_strings_parse_to_validated_specs_that_round_trip() -> None:
    expansion = (1, 2, 1)
    assert parse_speculator("ngram", expansion).to_wire() == {"kind": "ngram", **NGRAM_OPTIONS, "num_draft_tokens": 3}
    assert parse_speculator("self:2", expansion).to_wire() == {"kind": "self", "layers": 2, "expansion": [1, 2, 1]}
    assert parse_speculator("self", expansion).options["layers"] == 4
    assert parse_speculator("feature", expansion).options == {"path": None, "expansion": DEFAULT_FEATURE_WIDTHS}
    assert parse_speculator("distilled:ssm.safetensors", expansion).options["path"] == "ssm.safetensors"
    assert parse_speculator("model:other", expansion).options["model"] == "other"
    for text in ("ngram", "self:2", "feature:f.safetensors", "distilled:s.safetensors", "model:m"):
        spec = parse_speculator(text, expansion)
        assert SpeculatorSpec.from_wire(spec.to_wire()) == spec
    with pytest.raises(ValueError, match="distilled:PATH"):
        parse_speculator("distilled", expansion)  # no SSM file is shipped: the spec must name one
    with pytest.raises(ValueError, match="needs 'path'"):
        SpeculatorSpec.from_wire({"kind": "distilled", "expansion": [2]})
    with pytest.raises(ValueError, match="integer"):
        parse_speculator("self:x", expansion)
    with pytest.raises(ValueError, match="unknown speculator"):
        parse_speculator("magic", expansion)


def test_int_formats_default_to_the_model_free_drafters() -> None:
    expected = [SpeculatorKind.SUFFIX, SpeculatorKind.NGRAM]
    for fmt in ("q4_1", "int8", "auto"):
        assert [s.kind for s in default_speculators(DEFAULT_MODEL, fmt)] == expected
    assert [s.kind for s in default_speculators(DEFAULT_MODEL, "auto", "cuda:0")] != expected  # auto is bf16 there
    assert [s.kind for s in default_speculators("some/other/model", "bfloat16")] == [SpeculatorKind.NGRAM]


def test_default_speculators_put_the_feature_drafter_first() -> None:
    assert [s.kind for s in default_speculators("some/other/model")] == [SpeculatorKind.NGRAM]
    kinds = [s.kind for s in default_speculators(DEFAULT_MODEL)]
    if DEFAULT_FEATURE_DRAFTER_FILE.is_file():
        assert kinds == [SpeculatorKind.FEATURE, SpeculatorKind.NGRAM]
    else:
        assert kinds == [SpeculatorKind.NGRAM]


def test_a_requests_speculators_come_in_spec_order(tmp_path: Path) -> None:
    from treeserve.ops.loaders.load import load_model

    model = load_model(tiny.write_tiny_hf_model(tmp_path / "tiny")).model
    specs = (parse_speculator("self:1", (1, 2)), parse_speculator("ngram", (1, 2)))
    drafters = [load_drafter(spec, model) for spec in specs]
    assert drafters[1] is None and drafters[0] is not None and drafters[0].config.num_layers == 1
    first, second = make_speculators(specs, drafters, model.config.vocab_size)
    assert isinstance(first, ModelSpeculator) and isinstance(second, NGramSpeculator)
    assert make_speculators(specs, drafters, model.config.vocab_size)[0] is not first  # fresh per request
    with pytest.raises(ValueError, match="drafters"):
        make_speculators(specs, drafters[:1], model.config.vocab_size)
    with pytest.raises(ValueError):
        load_drafter(parse_speculator(f"self:{model.config.num_layers + 1}", (1,)), model)


def test_suffix_specs_share_one_index_per_process(tmp_path: Path) -> None:
    from treeserve.ops.loaders.load import load_model
    from treeserve.ops.sampling import SamplingParams
    from treeserve.ops.suffix import SuffixIndex, SuffixSpeculator

    spec = SpeculatorSpec.from_wire({"kind": "suffix", "capacity": 100, "num_draft_tokens": 3, "min_probability": 0.2})
    assert parse_speculator("suffix", (1, 2)) == SpeculatorSpec(SpeculatorKind.SUFFIX, {})
    assert SpeculatorSpec.from_wire(spec.to_wire()) == spec
    model = load_model(tiny.write_tiny_hf_model(tmp_path / "tiny")).model
    index = load_drafter(spec, model)
    assert isinstance(index, SuffixIndex) and index.capacity == 100
    first, second = (make_speculators((spec,), (index,), model.config.vocab_size)[0] for _ in range(2))
    assert isinstance(first, SuffixSpeculator) and first is not second and first.index is second.index
    assert first.num_draft_tokens == 3 and first.min_probability == 0.2
    first.prefill([5, 6, 7, 8, 9])
    second.prefill([1, 6, 7])  # another request: drafts from the first one's tokens
    assert second.propose(SamplingParams(), None).tokens.tolist() == [7, 8, 9]
    for bad in ({"kind": "suffix", "capacity": 0}, {"kind": "suffix", "min_probability": 2},
                {"kind": "suffix", "min_ngram": 5, "max_ngram": 3}, {"kind": "suffix", "expansion": [1]}):
        with pytest.raises(ValueError):
            SpeculatorSpec.from_wire(bad)
