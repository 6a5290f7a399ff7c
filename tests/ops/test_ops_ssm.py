"""Distilled SSMs (treeserve.ops.ssm): reduced-vocabulary head, greedy-spine drafting, weights file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests.ops.conftest import TINY, make_tiny_model
from treeserve.ops.drafting import ModelSpeculator
from treeserve.ops.model import Transformer
from treeserve.ops.model_config import ModelConfig
from treeserve.ops.sampling import SamplingParams, logits_to_probs
from treeserve.ops.speculative import generate_incremental, generate_speculative
from treeserve.ops.ssm import (
    DistilledSpeculator,
    DistilledSSM,
    init_ssm_from_verifier,
    load_distilled_speculators,
    load_ssms,
    save_ssms,
    ssm_config_for,
)



def tiny_verifier(seed: int = 0) -> Transformer:
    """A tiny random tied-embedding model (the SSM shares its embedding)."""
    return make_tiny_model(seed, weight_scale=0.3)


def tiny_ssm(verifier: Transformer, *, num_layers: int = 1, draft_vocab: int = 40, ffn_dim: int = 64, seed: int = 1) -> DistilledSSM:
    """An SSM over a random draft vocabulary, with its bias randomised so it is not all zero."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(verifier.config.vocab_size, generator=gen)[:draft_vocab].sort().values
    ssm = init_ssm_from_verifier(verifier, ssm_config_for(verifier, num_layers=num_layers, ffn_dim=ffn_dim,
                                                          draft_vocab_size=draft_vocab), ids)
    with torch.no_grad():
        ssm.head_bias.copy_(0.5 * torch.randn(draft_vocab, generator=gen))
    return ssm


def causal_draft_logits(ssm: DistilledSSM, tokens: Sequence[int]) -> Tensor:
    """Reference: the SSM's draft logits after ``tokens`` from a fresh causal pass."""
    with torch.no_grad():
        return ssm.draft_logits(torch.tensor([list(tokens)]), ssm.new_cache(1, len(tokens)))[0, -1]


def test_full_vocab_logits_are_minus_inf_outside_the_draft_vocabulary() -> None:
    verifier = tiny_verifier()
    ssm = tiny_ssm(verifier)
    tokens = torch.tensor([[3, 17, 5, 99, 42]])
    with torch.no_grad():
        full = ssm(tokens, ssm.new_cache(1, 8))
        draft = ssm.draft_logits(tokens, ssm.new_cache(1, 8))
    assert full.shape == (1, 5, 101)
    outside = torch.ones(101, dtype=torch.bool)
    outside[ssm.draft_ids] = False
    assert bool(torch.isneginf(full[..., outside]).all())
    torch.testing.assert_close(full[..., ssm.draft_ids], draft)
    # The SSM reads the verifier's embedding (shared, not copied).
    assert ssm.embed_tokens.weight.data_ptr() == verifier.embed_tokens.weight.data_ptr()


def test_init_copies_verifier_blocks_so_a_full_copy_predicts_like_the_verifier() -> None:
    verifier = tiny_verifier()
    ids = torch.arange(101)
    ssm = init_ssm_from_verifier(verifier, ssm_config_for(verifier, num_layers=3, ffn_dim=96, draft_vocab_size=101), ids)
    tokens = torch.tensor([[3, 17, 5, 99, 42, 7]])
    with torch.no_grad():
        expected = verifier(tokens, verifier.new_cache(1, 8))
        got = ssm(tokens, ssm.new_cache(1, 8))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def run_spine_check(speculator: DistilledSpeculator, params: SamplingParams, *, num_steps: int = 6) -> list[str]:
    """Drive ``speculator`` through random accept patterns; return every draft that differs
    from a fresh causal pass of its SSM over the same prefix (empty: all drafts right)."""
    ssm = speculator.ssm
    history = [5, 9, 13, 9]
    speculator.prefill(history)
    gen = torch.Generator().manual_seed(3)
    allowed = set(ssm.draft_ids.tolist())
    outside = torch.ones(ssm.ssm_config.vocab_size, dtype=torch.bool)
    outside[ssm.draft_ids] = False
    errors: list[str] = []
    for step in range(num_steps):
        tree = speculator.propose(params, gen)
        assert tree.root_token == history[-1] and int(tree.depths().max()) == len(speculator.widths)
        assert set(tree.tokens[1:].tolist()) <= allowed
        tokens = tree.tokens.tolist()
        for node, props in enumerate(tree.proposals()):
            if not props:
                continue
            path = tree.path_to(node)[1:]  # drafts from the root's child down to node
            reference = causal_draft_logits(ssm, history + [tokens[n] for n in path])
            if params.is_greedy:
                top = ssm.draft_ids[torch.topk(reference, len(props)).indices].tolist()
                if [tokens[p.child] for p in props] != top:
                    errors.append(f"step {step} node {node}: top tokens differ")
            else:
                assert tree.draft_probs is not None and props[0].q_row is not None
                q = tree.draft_probs[props[0].q_row]
                assert float(q[outside].sum()) == 0.0  # q never proposes a token outside the subset
                if not torch.allclose(q, logits_to_probs(ssm.to_full_vocab(reference), params), atol=1e-5, rtol=1e-4):
                    errors.append(f"step {step} node {node}: q differs")
        # Emit the path to a random node (on the spine: its KV is kept; a side branch: it is not)
        # plus an off-tree bonus token, or just a bonus token.
        node = int(torch.randint(0, tree.num_nodes, (1,), generator=gen)) if step % 3 else 0
        emitted = [tokens[n] for n in tree.path_to(node)[1:]] + [int(torch.randint(0, 101, (1,), generator=gen))]
        speculator.accept(emitted)
        history += emitted
    return errors


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=0)])
def test_spine_drafts_match_a_causal_pass_and_stay_in_the_draft_vocabulary(params: SamplingParams) -> None:
    ssm = tiny_ssm(tiny_verifier())
    assert run_spine_check(DistilledSpeculator(ssm, (3, 2, 1, 1), min_confidence=0.0), params) == []


class _StaleKVSpeculator(DistilledSpeculator):
    """Deliberately wrong: keeps the whole drafted spine's KV, whatever was emitted."""

    def accept(self, new_tokens: Sequence[int]) -> None:
        self._history.extend(int(t) for t in new_tokens)
        self._spine = []


def test_keeping_stale_spine_kv_is_caught_by_the_causal_check() -> None:
    ssm = tiny_ssm(tiny_verifier())
    errors = run_spine_check(_StaleKVSpeculator(ssm, (3, 2, 1, 1), min_confidence=0.0), SamplingParams(temperature=1.0, seed=0))
    assert errors


def test_limits_are_respected_before_drafting() -> None:
    verifier = tiny_verifier()
    speculator = DistilledSpeculator(tiny_ssm(verifier), (2, 2, 1, 1, 1))
    speculator.prefill([4, 5, 6])
    tree = speculator.propose(SamplingParams(), None, max_depth=3, max_nodes=6)
    assert int(tree.depths().max()) <= 3 and tree.num_nodes <= 6
    tree = speculator.propose(SamplingParams(), None, max_depth=0)
    assert tree.num_nodes == 1


@pytest.mark.parametrize("use_model_speculator", [False, True])
def test_generate_speculative_with_distilled_speculators_is_lossless(use_model_speculator: bool) -> None:
    verifier = tiny_verifier()
    # A 3-layer full-vocabulary copy drafts like the verifier (many accepted drafts); a random
    # 1-layer SSM over a subset drafts badly (many rejections): both paths get exercised.
    good = init_ssm_from_verifier(verifier, ssm_config_for(verifier, num_layers=3, ffn_dim=96, draft_vocab_size=101),
                                  torch.arange(101))
    bad = tiny_ssm(verifier)
    if use_model_speculator:
        speculators = [ModelSpeculator(good, (1, 1, 2, 1)), ModelSpeculator(bad, (2, 1, 1))]
    else:
        speculators = [DistilledSpeculator(good, (2, 1, 1, 1)), DistilledSpeculator(bad, (2, 2, 1))]
    params = SamplingParams(max_new_tokens=40)
    for prompt in ([1, 2, 3], [7, 7, 8, 50, 3, 2, 9]):
        reference = generate_incremental(verifier, prompt, params)
        result = generate_speculative(verifier, speculators, prompt, params)
        assert result.token_ids == reference.token_ids
        assert result.mean_accepted_per_step > 1.0  # the good SSM's drafts were accepted


def test_save_load_round_trip(tmp_path: Path) -> None:
    verifier = tiny_verifier()
    ssms = [tiny_ssm(verifier, seed=1), tiny_ssm(verifier, seed=1)]
    with torch.no_grad():
        for p in ssms[1].layers.parameters():
            p.add_(0.1)
        for ssm in ssms:  # the file is float16: round first so the comparison is exact
            for p in ssm.parameters():
                if p is not ssm.embed_tokens.weight:
                    p.copy_(p.half().float())
    path = tmp_path / "ssm.safetensors"
    save_ssms(ssms, path)
    loaded = load_ssms(verifier, path)
    tokens = torch.tensor([[3, 17, 5, 99]])
    assert len(loaded) == 2
    for original, copy in zip(ssms, loaded):
        assert torch.equal(copy.draft_ids, original.draft_ids)
        with torch.no_grad():
            torch.testing.assert_close(copy.draft_logits(tokens, copy.new_cache(1, 4)),
                                       original.draft_logits(tokens, original.new_cache(1, 4)))
    speculators = load_distilled_speculators(verifier, path, expansion=(2, 1))
    assert [type(s) for s in speculators] == [DistilledSpeculator, DistilledSpeculator]
    with pytest.raises(FileNotFoundError):
        load_distilled_speculators(verifier, tmp_path / "missing.safetensors")
    other = Transformer(ModelConfig(**{**TINY, "dim": 32, "head_dim": 8, "num_heads": 4}))
    with pytest.raises(ValueError):
        load_ssms(other, path)


def test_greedy_early_stop_shortens_the_spine_only_for_greedy_params() -> None:
    verifier = tiny_verifier()
    ssm = tiny_ssm(verifier)
    speculator = DistilledSpeculator(ssm, (2, 1, 1, 1), min_confidence=1.0)  # every spine child is doubted
    speculator.prefill([4, 5, 6])
    assert int(speculator.propose(SamplingParams(), None).depths().max()) == 1
    speculator.accept([7])
    stochastic = speculator.propose(SamplingParams(temperature=1.0, seed=0), torch.Generator().manual_seed(0))
    assert int(stochastic.depths().max()) == 4
    never = DistilledSpeculator(ssm, (2, 1, 1, 1), min_confidence=0.0)
    never.prefill([4, 5, 6])
    assert int(never.propose(SamplingParams(), None).depths().max()) == 4
    params = SamplingParams(max_new_tokens=30)
    mid = DistilledSpeculator(ssm, (2, 1, 1, 1), min_confidence=0.3)
    assert (generate_speculative(verifier, [mid], [9, 8, 7], params).token_ids
            == generate_incremental(verifier, [9, 8, 7], params).token_ids)
    with pytest.raises(ValueError):
        DistilledSpeculator(ssm, (2,), min_confidence=1.5)


def test_speculator_actor_config_loads_a_distilled_ssm(tmp_path: Path) -> None:
    from treeserve.actors.speculator import SpeculatorActor, SpeculatorSpec
    from treeserve.models import load_model

    tiny_files = Path(__file__).parents[1] / "actors" / "tiny_model_files.py"
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_model_files_for_ssm", tiny_files)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = module.write_tiny_hf_model(tmp_path / "tiny")
    verifier = load_model(folder).model
    path = tmp_path / "ssm.safetensors"
    save_ssms([tiny_ssm(verifier, seed=1), tiny_ssm(verifier, seed=1)], path)

    parsed = SpeculatorSpec.from_wire({"kind": "distilled", "path": str(path), "index": 1, "expansion": [2, 1]})
    assert parsed.options == {"path": str(path), "index": 1, "expansion": (2, 1)}
    with pytest.raises(ValueError):
        SpeculatorSpec.from_wire({"kind": "distilled", "expansion": [2], "layers": 3})
    with pytest.raises(ValueError):
        SpeculatorSpec.from_wire({"kind": "distilled", "index": -1, "expansion": [2]})

    actor = SpeculatorActor({"model": str(folder), "speculators": [
        {"kind": "distilled", "path": str(path), "index": 1, "expansion": [2, 1, 1]}]})
    actor._load()
    drafter = actor._drafters[0]
    assert isinstance(drafter, DistilledSSM)
    expected = load_ssms(verifier, path)[1]
    tokens = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(drafter.draft_logits(tokens, drafter.new_cache(1, 3)),
                                   expected.draft_logits(tokens, expected.new_cache(1, 3)))
    missing_file = SpeculatorActor({"model": str(folder), "speculators": [
        {"kind": "distilled", "path": str(tmp_path / "none.safetensors"), "expansion": [2]}]})
    with pytest.raises(FileNotFoundError):
        missing_file._load()


def test_a_small_node_budget_keeps_the_chain_of_first_choices() -> None:
    from treeserve.ops.ssm import fit_spine_widths

    # Chain first, then alternatives from the shallowest depth (dropping whole depths instead
    # left nothing to draft under 8 nodes, which made small adaptive budgets useless).
    assert [fit_spine_widths((4, 2, 1), None, n, 100) for n in range(1, 10)] == [
        (), (1,), (1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 1, 1), (4, 2, 1), (4, 2, 1)]
    assert fit_spine_widths((4, 2, 1), 2, 6, 100) == (4, 1)  # depth cut first, then the node budget
    assert fit_spine_widths((4, 2, 1), None, 4, 2) == (2, 1)  # and the drafter cache's room (2 depths)


def test_sampled_spine_children_are_drawn_from_the_q_they_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Multi-step speculative sampling is lossless only if each proposal is a draw from the q
    recorded with it: the children's empirical distribution must fit that q (chi-square), and
    a drafter that draws from a flatter distribution than it records must fail the check."""
    from tests.ops.test_lossless_stochastic import chi_square_p_value
    from treeserve.ops import ssm
    from treeserve.ops.token_tree import TokenTreeBuilder

    vocab, draft_ids = 12, torch.tensor([1, 4, 5, 8, 10])
    draft_logits = torch.tensor([1.5, -0.5, 0.3, 2.0, 0.0])
    params = SamplingParams(temperature=0.8)

    def to_full_vocab(logits: Tensor) -> Tensor:
        full = torch.full((vocab,), float("-inf"))
        full[draft_ids] = logits
        return full

    def proposal_counts() -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(0)
        found = torch.zeros(vocab, dtype=torch.long)
        for _ in range(1000):
            builder = TokenTreeBuilder(0, with_probs=True)
            ssm.add_spine_children(builder, 0, draft_logits, draft_ids, to_full_vocab, params, gen, 3)
            tree = builder.build()
            assert tree.draft_probs is not None
            for proposal in tree.proposals()[0]:  # duplicates stay separate proposals
                found[int(tree.tokens[proposal.child])] += 1
        return found, tree.draft_probs[0]

    found, q = proposal_counts()
    assert torch.allclose(q, logits_to_probs(to_full_vocab(draft_logits), params))
    assert chi_square_p_value(found, q) > 1e-3
    sample = ssm.sample_from_probs
    monkeypatch.setattr(ssm, "sample_from_probs", lambda probs, gen, n: sample(probs.sqrt(), gen, n))  # wrong
    found, q = proposal_counts()
    assert chi_square_p_value(found, q) < 1e-6
