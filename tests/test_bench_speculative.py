"""bench/speculative.py on a tiny random model: prompt loading, the interleaved run, the summary
(JSON shape, greedy tokens equal incremental's, a lossy verifier caught), optional speculators
and peers skipped or wired without failing. No timing is asserted."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from treeserve.ops.ngram import NGramSpeculator
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_speculative
from treeserve.ops.speculation_modes import SpeculationMode
from treeserve.ops.verify import VerifyResult
from treeserve_testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
EOS = 2
# Prompts with repeats, so the n-gram speculator finds matches and drafts get accepted.
PROMPTS = [("a", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]), ("b", [10, 11, 12, 13, 14, 10, 11, 12]), ("c", [3, 40, 50, 60])]


bench = load_script("treeserve_bench_speculative", ROOT / "bench" / "speculative.py")
tiny = load_script("tiny_model_files", ROOT / "tests" / "actors" / "tiny_model_files.py")


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return tiny.make_tiny_model(0)


def test_load_prompts_from_dataset_and_file(tmp_path: Path) -> None:
    records = [{"id": 7, "prompt": "first\u2028line"}, {"id": "x", "prompt": "second"}, {"id": 9, "prompt": "third"}]
    (tmp_path / "toy.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n")
    prompts = bench.load_prompts("toy", None, 2, data_dir=tmp_path)
    assert prompts == [bench.Prompt("7", "first\u2028line"), bench.Prompt("x", "second")]
    lines = tmp_path / "lines.txt"
    lines.write_text("one\n\ntwo\n")
    assert [p.text for p in bench.load_prompts(None, lines)] == ["one", "two"]
    with pytest.raises(ValueError):
        bench.load_prompts("toy", lines, data_dir=tmp_path)
    with pytest.raises(FileNotFoundError):
        bench.load_prompts("missing", None, data_dir=tmp_path)


def test_greedy_and_sampled_runs_give_the_json_shape_and_lossless_tokens(model: Any) -> None:
    available = bench.load_speculators(model, with_distilled=False)
    modes = bench.treeserve_modes(model, ["incremental", "chain", "tree:ngram"], available)
    assert [m.name for m in modes] == ["incremental", "chain", "tree:ngram"]
    measurements = bench.run_benchmark(modes, PROMPTS, [0.0, 0.8], max_tokens=40, stop_ids=[EOS], seed=3,
                                       warmup_tokens=8)
    # Interleaved: each prompt runs every mode (rotated order) before the next prompt starts.
    assert [m.prompt_id for m in measurements] == [pid for pid, _ in PROMPTS for _ in range(6)]
    assert [m.mode for m in measurements[6:9]] == ["chain", "tree:ngram", "incremental"]
    report = json.loads(json.dumps({"dataset": "toy", "results": bench.summarize(measurements, modes), "config": {}}))
    results = {(r["mode"], r["temperature"]): r for r in report["results"]}
    assert set(results) == {(m, t) for m in ("incremental", "chain", "tree:ngram") for t in (0.0, 0.8)}
    for r in report["results"]:
        assert {"mode", "temperature", "tokens_per_s", "mean_accepted_per_step", "ratio_to_incremental"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["num_prompts"] == len(PROMPTS)
        assert r["mean_accepted_per_step"] >= 1.0
        assert r["ratio_to_incremental"] == pytest.approx(
            r["tokens_per_s"] / results[("incremental", r["temperature"])]["tokens_per_s"])
        if r["temperature"] == 0.0:
            assert r["greedy_matches_incremental"] == 1.0, r["mode"]
        else:
            assert r["greedy_matches_incremental"] is None
    assert results[("incremental", 0.0)]["mean_accepted_per_step"] == 1.0
    # The tree mode really speculated (some drafts accepted), so the match above is not vacuous.
    assert results[("tree:ngram", 0.0)]["mean_accepted_per_step"] > 1.0
    for m in measurements:
        if m.mode == "tree:ngram":
            assert results[("tree:ngram", m.temperature)]["mean_tokens_per_step"] >= 1.0
            assert m.generated.num_steps == len(m.generated.accepted_per_step)


def _accept_first_chain(tree: Any, logits: torch.Tensor, params: SamplingParams, generator: Any) -> VerifyResult:
    """A lossy verifier: accepts every first proposal whatever the LLM says."""
    props = tree.proposals()
    accepted, node = [0], 0
    while props[node]:
        node = props[node][0].child
        accepted.append(node)
    return VerifyResult(accepted, int(logits[node].argmax()))


def test_greedy_check_catches_a_lossy_verifier(model: Any) -> None:
    available = bench.load_speculators(model, with_distilled=False)
    modes = bench.treeserve_modes(model, ["incremental"], available)
    ngram = available.speculators["ngram"]
    modes.append(bench.Mode("tree:lossy", lambda ids, p: bench._from_result(
        generate_speculative(model, ngram, ids, p, SpeculationMode.TREE, verifier=_accept_first_chain)), True))
    measurements = bench.run_benchmark(modes, PROMPTS, [0.0], max_tokens=40, stop_ids=[EOS], warmup_tokens=4)
    results = {r["mode"]: r for r in bench.summarize(measurements, modes)}
    assert results["tree:lossy"]["greedy_matches_incremental"] < 1.0


def test_distilled_failures_skip_and_several_ssms_merge(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "treeserve.ops.ssm", None)  # import fails
    available = bench.load_speculators(model, ssm_path="ssm.safetensors")
    assert "tree:distilled" in available.skipped and set(available.speculators) == {"ngram", "suffix"}
    assert [m.name for m in bench.treeserve_modes(model, ["tree:distilled", "tree:ngram"], available)] == ["tree:ngram"]

    def no_weights(_model: Any, _path: Any) -> list[Any]:
        raise FileNotFoundError("no trained weights")

    monkeypatch.setitem(sys.modules, "treeserve.ops.ssm", types.SimpleNamespace(load_distilled_speculators=no_weights))
    assert "no trained weights" in bench.load_speculators(model, ssm_path="ssm.safetensors").skipped["tree:distilled"]

    # Stand-ins for two SSMs: tree:distilled merges both, tree:merged adds the n-gram one, chain uses the first SSM.
    ssms = [NGramSpeculator(97, num_draft_tokens=4), NGramSpeculator(97, max_ngram=2, num_draft_tokens=3)]
    monkeypatch.setitem(sys.modules, "treeserve.ops.ssm",
                        types.SimpleNamespace(load_distilled_speculators=lambda _model, _path: ssms))
    available = bench.load_speculators(model, ssm_path="ssm.safetensors")
    # (The shipped feature drafter is for the default model, so it is skipped on this tiny one.)
    assert "tree:distilled" not in available.skipped and available.speculators["distilled"] == ssms
    available.speculators.pop("feature", None)
    calls: list[tuple[int, SpeculationMode]] = []
    real = bench.generate_speculative

    def spy(model_: Any, speculators: Any, ids: Any, params: Any, mode: Any, **kwargs: Any) -> Any:
        calls.append((len(speculators), mode))
        return real(model_, speculators, ids, params, mode, **kwargs)

    monkeypatch.setattr(bench, "generate_speculative", spy)
    modes = bench.treeserve_modes(model, ["incremental", "chain", "tree:distilled", "tree:merged"], available)
    measurements = bench.run_benchmark(modes, PROMPTS[:1], [0.0], max_tokens=16, stop_ids=[EOS], warmup_tokens=2)
    # tree:merged: n-gram, suffix and both SSMs.
    assert calls[-3:] == [(1, SpeculationMode.CHAIN), (2, SpeculationMode.TREE), (4, SpeculationMode.TREE)]
    assert all(r["greedy_matches_incremental"] == 1.0 for r in bench.summarize(measurements, modes))


def test_the_suffix_drafter_has_seen_only_earlier_prompts_at_the_same_temperature(model: Any) -> None:
    """Its index is what a server holds after the run's earlier prompts: never the warm-up's or
    another temperature's answer to the same prompt; with --repeat, the earlier rounds."""
    available = bench.load_speculators(model, with_distilled=False)
    suffix = available.speculators["suffix"][0]
    mode = bench.treeserve_modes(model, ["tree:suffix"], available)[0]
    seen: list[int] = []

    def run(ids: list[int], params: Any) -> Any:
        seen.append(suffix.index.num_sequences)
        return mode.run(ids, params)

    spied = dataclasses.replace(mode, run=run)
    bench.run_benchmark([spied], PROMPTS[:2], [0.0, 0.8], max_tokens=8, stop_ids=[EOS], warmup_tokens=2)
    assert seen == [0, 0, 0, 1, 1]  # warm-up; prompt 1 at T=0 and 0.8; prompt 2 at T=0 and 0.8


def test_llama_cpp_mode_resets_before_each_run_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    class FakeLlama:
        def __init__(self, **kwargs: Any) -> None:
            events.append(f"init threads={kwargs['n_threads']}")

        def reset(self) -> None:
            events.append("reset")

        def generate(self, tokens: list[int], **kwargs: Any) -> Any:
            events.append(f"generate temp={kwargs['temp']} top_k={kwargs['top_k']}")
            yield from [9, 8, EOS, 7, 7]

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    mode = bench.llama_cpp_mode(Path("model.gguf"), threads=2, n_ctx=64, seed=0)
    stop = SamplingParams(stop_token_ids=(EOS,), max_new_tokens=10)
    assert mode.run([1, 2], stop).token_ids == [9, 8, EOS]
    assert mode.run([1, 2], SamplingParams(temperature=0.8, max_new_tokens=4, seed=1)).token_ids == [9, 8, EOS, 7]
    assert events == ["init threads=2", "reset", "generate temp=0.0 top_k=0", "reset", "generate temp=0.8 top_k=0"]


def test_llama_cpp_lookup_mode_hands_llama_its_prompt_lookup_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    drafts: list[Any] = []

    class FakeDraft:
        def __init__(self, num_pred_tokens: int) -> None:
            self.num_pred_tokens = num_pred_tokens

    class FakeLlama:
        def __init__(self, **kwargs: Any) -> None:
            drafts.append(kwargs["draft_model"])

        def reset(self) -> None:
            pass

        def generate(self, tokens: list[int], **kwargs: Any) -> Any:
            yield from [9, EOS]

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", types.SimpleNamespace(LlamaPromptLookupDecoding=FakeDraft))
    plain = bench.llama_cpp_mode(Path("model.gguf"), threads=2, n_ctx=64, seed=0)
    lookup = bench.llama_cpp_mode(Path("model.gguf"), threads=2, n_ctx=64, seed=0, lookup=True)
    assert (plain.name, lookup.name) == ("llama-cpp", "llama-cpp-lookup")
    assert drafts[0] is None and drafts[1].num_pred_tokens == bench.LLAMA_CPP_LOOKUP_TOKENS
    assert lookup.run([1, 2], SamplingParams(stop_token_ids=(EOS,), max_new_tokens=10)).token_ids == [9, EOS]


@pytest.mark.slow
def test_hf_generate_on_the_same_weights_matches_incremental(model: Any, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    folder = tiny.write_tiny_hf_model(tmp_path / "tiny", seed=0)
    hf_model = bench.load_hf_model(folder, torch.float32)
    available = bench.load_speculators(model, with_distilled=False)
    modes = bench.treeserve_modes(model, ["incremental"], available)
    modes += [bench.hf_mode(hf_model, "hf-generate"), bench.hf_mode(hf_model, "hf-prompt-lookup", prompt_lookup_num_tokens=10)]
    measurements = bench.run_benchmark(modes, PROMPTS, [0.0, 0.8], max_tokens=24, stop_ids=[EOS], warmup_tokens=4)
    results = {(r["mode"], r["temperature"]): r for r in bench.summarize(measurements, modes)}
    for name in ("hf-generate", "hf-prompt-lookup"):
        assert results[(name, 0.0)]["greedy_matches_incremental"] == 1.0
        assert results[(name, 0.0)]["mean_accepted_per_step"] is None
        assert results[(name, 0.8)]["num_tokens"] > 0


def test_distilled_modes_need_an_ssm_file(model: Any) -> None:
    # None is shipped, so without --ssm the distilled modes are skipped with the reason.
    assert "--ssm" in bench.load_speculators(model).skipped["tree:distilled"]
