"""Greedy losslessness: speculative generation == plain incremental greedy decoding, token for token."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from treeserve.ops.decode_step import DecodeStep
from treeserve.ops.drafting import ModelSpeculator, Speculator
from treeserve.ops.formats import apply_format
from treeserve.ops.model import Transformer
from treeserve.ops.model_config import ModelConfig
from treeserve.ops.ngram import NGramSpeculator
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.suffix import SuffixIndex, SuffixSpeculator
from treeserve.ops.speculative import FinishReason, generate_incremental, generate_speculative
from treeserve.ops.speculation_modes import SpeculationMode
from treeserve.ops.token_tree import TokenTree
from treeserve.ops.verify import VerifyResult

VOCAB = 96
PROMPT = [3, 17, 42, 5, 17, 42, 9, 3, 17]


def tiny_model(seed: int, num_layers: int = 3, vocab_size: int = VOCAB) -> Transformer:
    """A tiny float32 random model (independent weights per seed)."""
    config = ModelConfig(
        vocab_size=vocab_size, dim=32, num_layers=num_layers, num_heads=4, num_kv_heads=2,
        head_dim=8, ffn_dim=64, max_seq_len=192,
    )
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            base, scale = (1.0, 0.3) if "norm" in name else (0.0, 0.3)
            param.copy_(base + scale * torch.randn(param.shape, generator=gen))
    return model.eval()


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    # Tiny tensors: intra-op thread start-up costs more than the work on a busy machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def llm() -> Transformer:
    return tiny_model(0)


def speculator_sets(llm: Transformer) -> dict[str, list[Speculator]]:
    """Fresh speculators of every kind: random, well aligned, several merged, n-gram."""
    return {
        "self_tree": [ModelSpeculator(llm, (1, 1, 3, 1, 1, 1, 1, 1))],
        "self_chain": [ModelSpeculator(llm, (1,) * 6)],
        "truncated_tree": [ModelSpeculator(llm.truncated(2), (2, 2, 1, 1))],
        "random_tree": [ModelSpeculator(tiny_model(11, num_layers=1), (1, 1, 3, 1, 1, 1, 1, 1))],
        "random_chain": [ModelSpeculator(tiny_model(12, num_layers=2), (1, 1, 1, 1))],
        "three_merged": [
            ModelSpeculator(tiny_model(13, num_layers=1), (2, 2, 1)),
            ModelSpeculator(llm.truncated(1), (1, 3, 1, 1)),
            ModelSpeculator(llm.truncated(2), (1, 1, 1, 1, 1)),
        ],
        "ngram": [NGramSpeculator(VOCAB, max_ngram=3, num_draft_tokens=5, num_branches=2)],
        "ngram_and_ssm": [NGramSpeculator(VOCAB), ModelSpeculator(tiny_model(14, num_layers=1), (3, 1))],
    }


def test_greedy_speculative_equals_incremental_for_every_speculator_kind(llm: Transformer) -> None:
    params = SamplingParams(max_new_tokens=48)
    reference = generate_incremental(llm, PROMPT, params)
    assert reference.finish_reason is FinishReason.LENGTH and len(reference.token_ids) == 48
    accepted: dict[str, float] = {}
    for name, speculators in speculator_sets(llm).items():
        result = generate_speculative(llm, speculators, PROMPT, params)
        assert result.token_ids == reference.token_ids, name
        assert result.finish_reason is FinishReason.LENGTH, name
        accepted[name] = result.mean_accepted_per_step
    # Not vacuous: the aligned speculators are accepted (almost) fully, and whole trees of
    # several tokens pass verification in one step.
    assert accepted["self_tree"] >= 6.5
    assert accepted["self_chain"] >= 5.5
    assert accepted["truncated_tree"] > 0.0


def test_chain_mode_and_no_speculators_are_lossless(llm: Transformer) -> None:
    params = SamplingParams(max_new_tokens=20)
    reference = generate_incremental(llm, PROMPT, params).token_ids
    chain = generate_speculative(llm, speculator_sets(llm)["three_merged"], PROMPT, params, SpeculationMode.CHAIN)
    assert chain.token_ids == reference
    small = generate_speculative(llm, speculator_sets(llm)["three_merged"], PROMPT, params, max_tree_nodes=4)
    assert small.token_ids == reference
    bare = generate_speculative(llm, [], PROMPT, params)
    assert bare.token_ids == reference and bare.num_steps == 20 and bare.mean_accepted_per_step == 0.0


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7, 13])
def test_max_new_tokens_truncates_inside_an_accepted_path(llm: Transformer, max_new_tokens: int) -> None:
    params = SamplingParams(max_new_tokens=max_new_tokens)
    reference = generate_incremental(llm, PROMPT, params)
    assert len(reference.token_ids) == max_new_tokens
    for name in ("self_tree", "random_tree", "ngram"):
        result = generate_speculative(llm, speculator_sets(llm)[name], PROMPT, params)
        assert result.token_ids == reference.token_ids, name
        assert result.finish_reason is FinishReason.LENGTH


def test_stop_tokens_end_generation_identically(llm: Transformer) -> None:
    free_run = generate_incremental(llm, PROMPT, SamplingParams(max_new_tokens=40)).token_ids
    # Stop at a token first emitted mid-run (the aligned speculator accepts it mid-path), at
    # the very first token, and at a token never emitted.
    never = next(t for t in range(VOCAB) if t not in free_run)
    for stops in [(free_run[9],), (free_run[0],), (never,), (free_run[4], free_run[2])]:
        params = SamplingParams(max_new_tokens=40, stop_token_ids=stops)
        reference = generate_incremental(llm, PROMPT, params)
        if never in stops:
            assert reference.finish_reason is FinishReason.LENGTH
        else:
            assert reference.finish_reason is FinishReason.STOP and reference.token_ids[-1] in stops
            assert not any(t in stops for t in reference.token_ids[:-1])
        for name in ("self_tree", "three_merged", "ngram", "random_chain"):
            result = generate_speculative(llm, speculator_sets(llm)[name], PROMPT, params)
            assert result.token_ids == reference.token_ids, (name, stops)
            assert result.finish_reason is reference.finish_reason


def test_the_suffix_drafter_learns_from_earlier_requests_and_stays_lossless(llm: Transformer) -> None:
    """An earlier request of the same process saw a corrupted copy of this answer (every fifth
    token wrong) and an unrelated one; the suffix drafter proposes from both, merged with the
    n-gram drafter, and the output is still the LLM's own, token for token. Then the same
    request again: its whole answer is proposed from the index and accepted in a few steps."""
    params = SamplingParams(max_new_tokens=40)
    reference = generate_incremental(llm, PROMPT, params).token_ids
    corrupted = [(t + 1) % VOCAB if i % 5 == 4 else t for i, t in enumerate(reference)]
    index = SuffixIndex()
    for earlier in (PROMPT + corrupted, [int(t) for t in torch.randint(0, VOCAB, (60,))]):
        SuffixSpeculator(index, VOCAB).prefill(earlier)
    first = generate_speculative(llm, [SuffixSpeculator(index, VOCAB), NGramSpeculator(VOCAB)], PROMPT, params)
    assert first.token_ids == reference
    again = generate_speculative(llm, [SuffixSpeculator(index, VOCAB), NGramSpeculator(VOCAB)], PROMPT, params)
    assert again.token_ids == reference
    assert first.mean_accepted_per_step >= 0.9  # not vacuous: drafts pass (incremental: 0)
    assert again.mean_accepted_per_step >= 8.0
    index_fed_wrong = SuffixIndex()
    SuffixSpeculator(index_fed_wrong, VOCAB).prefill(PROMPT + corrupted)
    wrong = generate_speculative(llm, [SuffixSpeculator(index_fed_wrong, VOCAB)], PROMPT, params,
                                 verifier=accept_first_child_regardless)
    assert wrong.token_ids != reference  # the equality check has power here too


def test_single_token_prompt(llm: Transformer) -> None:
    params = SamplingParams(max_new_tokens=12)
    reference = generate_incremental(llm, [7], params).token_ids
    for name in ("self_tree", "ngram_and_ssm"):
        assert generate_speculative(llm, speculator_sets(llm)[name], [7], params).token_ids == reference


def accept_first_child_regardless(
    tree: TokenTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> VerifyResult:
    """A deliberately WRONG verifier: follows the first child whatever the LLM predicts."""
    accepted = [0]
    while children := tree.children_of(accepted[-1]):
        accepted.append(children[0])
    return VerifyResult(accepted, int(logits[accepted[-1]].argmax()))


def test_the_equality_check_catches_a_wrong_verifier(llm: Transformer) -> None:
    params = SamplingParams(max_new_tokens=24)
    reference = generate_incremental(llm, PROMPT, params).token_ids
    for name in ("random_tree", "three_merged"):
        wrong = generate_speculative(
            llm, speculator_sets(llm)[name], PROMPT, params, verifier=accept_first_child_regardless
        )
        assert wrong.token_ids != reference, name


def test_generation_rejects_bad_requests(llm: Transformer) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        generate_speculative(llm, [], [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        generate_incremental(llm, [VOCAB], SamplingParams())
    with pytest.raises(ValueError, match="max_seq_len"):
        generate_speculative(llm, [], PROMPT, SamplingParams(max_new_tokens=190))


def test_greedy_speculation_through_the_serving_decode_step_equals_incremental() -> None:
    """The path a served model runs: fused float32 weights and the decode step, whose attention
    is the tree-mask kernel of ``kernels.tree_attention_cpu`` where this CPU has one."""
    llm = apply_format(tiny_model(0), "float32")
    llm.decode_step = DecodeStep(llm)
    params = SamplingParams(max_new_tokens=40)
    reference = generate_incremental(llm, PROMPT, params)
    assert reference.token_ids == generate_incremental(tiny_model(0), PROMPT, params).token_ids
    sets = speculator_sets(llm)
    for name in ("self_tree", "random_tree", "ngram_and_ssm"):
        result = generate_speculative(llm, sets[name], PROMPT, params)
        assert result.token_ids == reference.token_ids, name
    assert generate_speculative(llm, sets["self_tree"], PROMPT, params).mean_accepted_per_step >= 6.5
