"""Expansion-based drafting and the batched small-model speculator vs slow causal references."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from treeserve.ops.drafting import (
    ModelSpeculator,
    expand_token_tree,
    split_node_budget,
    validate_expansion,
    worst_case_num_nodes,
)
from treeserve.ops.model import Transformer
from treeserve.ops.model_config import ModelConfig
from treeserve.ops.sampling import SamplingParams, logits_to_probs

VOCAB = 40


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_model(seed: int, max_seq_len: int = 64) -> Transformer:
    config = ModelConfig(
        vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64,
        max_seq_len=max_seq_len,
    )
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(param.shape, generator=gen))
    return model.eval()


def causal_next_logits(model: Transformer, sequence: list[int]) -> Tensor:
    """Slow reference: a fresh cache and a plain causal pass over the whole sequence."""
    with torch.no_grad():
        out = model(torch.tensor([sequence]), model.new_cache(1, len(sequence)))
    assert isinstance(out, Tensor)
    return out[0, -1]


def path_tokens(parents: list[int], tokens: list[int], node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def test_greedy_expansion_takes_top_k_per_frontier_node() -> None:
    calls: list[list[int]] = []

    def next_logits(parents: list[int], tokens: list[int], frontier: list[int]) -> Tensor:
        calls.append(list(frontier))
        # Deterministic fake drafter: prefers token (sum of path + j) % VOCAB in order j = 0, 1, ...
        rows = []
        for node in frontier:
            base = sum(path_tokens(parents, tokens, node)) + tokens[0]
            rows.append(torch.tensor([-float((t - base) % VOCAB) for t in range(VOCAB)]))
        return torch.stack(rows)

    tree = expand_token_tree(3, (1, 2, 1), next_logits, SamplingParams(), None)
    assert calls == [[0], [1], [2, 3]]  # one call per step, the whole frontier at once
    assert tree.parents.tolist() == [-1, 0, 1, 1, 2, 3]
    assert tree.tokens.tolist() == [3, 3, 6, 7, 12, 13]
    assert tree.draft_probs is None
    with pytest.raises(ValueError, match="expansion"):
        validate_expansion((1, 0))
    with pytest.raises(ValueError, match="expansion"):
        validate_expansion(())


def test_stochastic_expansion_records_each_draw_with_its_q() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=gen)
    params = SamplingParams(temperature=1.0, top_k=3)

    def next_logits(parents: list[int], tokens: list[int], frontier: list[int]) -> Tensor:
        return logits.expand(len(frontier), VOCAB)

    tree = expand_token_tree(0, (4, 2), next_logits, params, gen, speculator=2)
    props = tree.proposals()
    assert len(props[0]) == 4  # four draws, duplicates kept as separate proposals
    assert sum(len(ps) for ps in props) == 4 + 2 * len(tree.children_of(0))
    assert all(p.speculator == 2 for ps in props for p in ps)
    assert tree.draft_probs is not None
    q = logits_to_probs(logits, params)
    for ps in props:
        for p in ps:
            assert p.q_row is not None
            torch.testing.assert_close(tree.draft_probs[p.q_row], q)
            assert float(q[int(tree.tokens[p.child])]) > 0  # only top-3 tokens can be drawn


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=0)])
def test_model_speculator_drafts_what_a_causal_pass_predicts_across_steps(params: SamplingParams) -> None:
    ssm = tiny_model(1)
    speculator = ModelSpeculator(ssm, (2, 1, 3, 1))
    num_forwards = [0]
    ssm.register_forward_pre_hook(lambda *_: num_forwards.__setitem__(0, num_forwards[0] + 1))
    history = [5, 9, 13, 9]
    speculator.prefill(history)
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        before = num_forwards[0]
        tree = speculator.propose(params, gen)
        assert num_forwards[0] - before == 4  # one batched SSM forward per expansion step
        assert tree.root_token == history[-1] and int(tree.depths().max()) == 4
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        for node, props in enumerate(tree.proposals()):
            if not props:
                continue
            reference = causal_next_logits(ssm, history + path_tokens(parents, tokens, node))
            if params.is_greedy:
                width = len(props)
                top = torch.topk(reference, width).indices.tolist()
                assert [tokens[p.child] for p in props] == top, (step, node)
            else:
                assert tree.draft_probs is not None and props[0].q_row is not None
                torch.testing.assert_close(
                    tree.draft_probs[props[0].q_row], logits_to_probs(reference, params), atol=1e-5, rtol=1e-4
                )
        # Emit: part of a drafted path (its KV is kept) then a token off the tree, or no drafts.
        leaf = int(torch.randint(0, tree.num_nodes, (1,), generator=gen)) if step % 2 == 0 else 0
        emitted = path_tokens(parents, tokens, leaf) + [int(torch.randint(0, VOCAB, (1,), generator=gen))]
        speculator.accept(emitted)
        history += emitted


def test_model_speculator_respects_max_depth_and_cache_room() -> None:
    ssm = tiny_model(2, max_seq_len=16)
    speculator = ModelSpeculator(ssm, (2, 2, 2, 2))
    speculator.prefill(list(range(1, 11)))  # 10 tokens; 6 slots left of 16
    assert int(speculator.propose(SamplingParams(), None, max_depth=2).depths().max()) == 2
    assert speculator.propose(SamplingParams(), None, max_depth=0).num_nodes == 1
    # Full depth would need 2 + 4 + 8 = 14 draft slots; it drafts as deep as the room allows.
    tree = speculator.propose(SamplingParams(), None)
    assert int(tree.depths().max()) == 3  # feeding depth <= 2 takes 6 slots; depth 3 would take 14
    # max_nodes is met through the worst case (no equal draws), decided before drafting.
    params = SamplingParams(temperature=1.0)
    assert int(speculator.propose(params, torch.Generator(), max_nodes=7).depths().max()) == 2
    assert int(speculator.propose(params, torch.Generator(), max_nodes=6).depths().max()) == 1
    assert worst_case_num_nodes((2, 2, 2, 2)) == [1, 3, 7, 15, 31]
    with pytest.raises(RuntimeError, match="prefill"):
        ModelSpeculator(ssm, (1,)).propose(SamplingParams(), None)


def test_node_budget_split_fits_the_merge_and_never_wastes_a_small_budget() -> None:
    for budget in range(1, 40):
        for count in range(1, 5):
            shares = split_node_budget(budget, count)
            assert len(shares) == count and min(shares) >= 1
            # The trie merge of trees within these limits has at most this many nodes.
            assert 1 + sum(s - 1 for s in shares) == max(budget, 1)
            assert shares == sorted(shares, reverse=True) and max(shares) - min(shares) <= 1
    # Two nodes over two speculators: the first drafts one token (an even split gave none).
    assert split_node_budget(2, 2) == [2, 1]
    assert split_node_budget(64, 2) == [33, 32]
