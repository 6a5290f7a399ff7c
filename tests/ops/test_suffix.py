"""The suffix drafter (``treeserve.ops.suffix``): proposals from every request's tokens, most
frequent first, within its depth, node budget, probability floor and memory capacity."""

from __future__ import annotations

import pytest
import torch

from treeserve.ops.sampling import SamplingParams
from treeserve.ops.suffix import SuffixIndex, SuffixSpeculator
from treeserve.ops.token_tree import TokenTree

VOCAB = 50
GREEDY = SamplingParams()


def seen(index: SuffixIndex, *sequences: list[int]) -> None:
    """Earlier requests of the same process: each sequence is one request's prompt + output."""
    for tokens in sequences:
        SuffixSpeculator(index, VOCAB).prefill(tokens)


def paths(tree: TokenTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path of ``tree`` (root excluded)."""
    tokens = tree.tokens.tolist()
    return {tuple(tokens[i] for i in tree.path_to(node)[1:]) for node in range(1, tree.num_nodes)}


def test_proposes_what_followed_the_same_suffix_in_another_request() -> None:
    index = SuffixIndex()
    seen(index, [1, 2, 3, 4, 5, 6, 7, 8])
    speculator = SuffixSpeculator(index, VOCAB)
    speculator.prefill([40, 41, 3, 4])  # ends like the earlier request's tokens 3, 4
    tree = speculator.propose(GREEDY, None)
    assert tree.root_token == 4
    assert paths(tree) == {(5,), (5, 6), (5, 6, 7), (5, 6, 7, 8)}
    speculator.accept([5, 6])
    assert paths(speculator.propose(GREEDY, None)) == {(7,), (7, 8)}


def test_nothing_is_proposed_without_a_match_or_from_the_requests_own_end() -> None:
    index = SuffixIndex()
    speculator = SuffixSpeculator(index, VOCAB)
    speculator.prefill([1, 2, 3])
    assert speculator.propose(GREEDY, None).num_nodes == 1  # its own suffix has nothing after it yet
    speculator.accept([1, 2])  # ... 1, 2, 3, 1, 2: the suffix 1, 2 occurred at the start
    assert paths(speculator.propose(GREEDY, None)) == {(3,), (3, 1), (3, 1, 2)}


def test_the_most_frequent_continuation_comes_first_and_rare_ones_are_floored() -> None:
    index = SuffixIndex()
    seen(index, [9, 1, 2, 3, 4], [8, 1, 2, 3, 4], [7, 1, 2, 3, 5])
    speculator = SuffixSpeculator(index, VOCAB, min_probability=0.0)
    speculator.prefill([30, 2, 3])
    assert paths(speculator.propose(GREEDY, None, max_nodes=2)) == {(4,)}  # 2 of 3 before 1 of 3
    assert paths(speculator.propose(GREEDY, None)) == {(4,), (5,)}
    floored = SuffixSpeculator(index, VOCAB, min_probability=0.5)
    floored.prefill([30, 2, 3])
    assert paths(floored.propose(GREEDY, None)) == {(4,)}


def test_depth_and_node_budget_are_respected() -> None:
    index = SuffixIndex()
    seen(index, list(range(1, 30)))
    speculator = SuffixSpeculator(index, VOCAB, num_draft_tokens=6)
    speculator.prefill([45, 3, 4])
    assert max(map(len, paths(speculator.propose(GREEDY, None)))) == 6
    assert max(map(len, paths(speculator.propose(GREEDY, None, max_depth=3)))) == 3
    assert speculator.propose(GREEDY, None, max_nodes=4).num_nodes == 4
    assert speculator.propose(GREEDY, None, max_nodes=1).num_nodes == 1


def test_stochastic_proposals_carry_point_masses() -> None:
    index = SuffixIndex()
    seen(index, [1, 2, 3, 4, 5])
    speculator = SuffixSpeculator(index, VOCAB)
    speculator.prefill([2, 3])
    tree = speculator.propose(SamplingParams(temperature=0.8), torch.Generator().manual_seed(0))
    proposals = tree.proposals()
    assert tree.num_nodes == 3
    assert tree.draft_probs is not None
    for children in proposals:
        for proposal in children:
            q = tree.draft_probs[proposal.q_row]
            assert float(q.sum()) == 1.0 and float(q[int(tree.tokens[proposal.child])]) == 1.0


def test_memory_is_bounded_and_the_oldest_requests_go_first() -> None:
    index = SuffixIndex(capacity=40)
    seen(index, [1, 2, 3, 4] + [20] * 16)  # 20 tokens, oldest
    seen(index, [5, 6, 7, 8] + [21] * 16)
    assert index.num_tokens == 40 and index.num_sequences == 2
    speculator = SuffixSpeculator(index, VOCAB)
    speculator.prefill([9, 5, 6])  # a third request: 3 tokens over, the oldest is evicted
    assert index.num_tokens == 23 and index.num_sequences == 2
    assert paths(speculator.propose(GREEDY, None, max_depth=2)) == {(7,), (7, 8)}
    other = SuffixSpeculator(index, VOCAB)
    other.prefill([9, 2, 3])  # the evicted request's tokens are no longer proposed
    assert other.propose(GREEDY, None).num_nodes == 1


def test_the_index_stays_bounded_over_many_requests() -> None:
    """Evicted requests take their index entries with them: a long-running server's index
    holds no more n-grams than its capacity's tokens carry."""
    index = SuffixIndex(capacity=200, min_ngram=2, max_ngram=4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        seen(index, torch.randint(0, VOCAB, (30,), generator=gen).tolist())
    assert index.num_tokens <= 200
    assert index.num_index_keys <= 3 * 200
    speculator = SuffixSpeculator(index, VOCAB)
    speculator.prefill([1, 2])
    speculator.propose(GREEDY, None)  # lookups still work after the evictions


def test_a_request_longer_than_the_capacity_keeps_its_own_tokens() -> None:
    index = SuffixIndex(capacity=8)
    speculator = SuffixSpeculator(index, VOCAB)
    speculator.prefill([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2])
    assert index.num_sequences == 1 and index.num_tokens == 12
    assert (3,) in paths(speculator.propose(GREEDY, None))


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError):
        SuffixIndex(min_ngram=4, max_ngram=2)
    with pytest.raises(ValueError):
        SuffixSpeculator(SuffixIndex(), VOCAB, min_probability=1.5)
    with pytest.raises(RuntimeError):
        SuffixSpeculator(SuffixIndex(), VOCAB).propose(GREEDY, None)
