"""The n-gram (suffix-match) speculator against a slow brute-force search."""

from __future__ import annotations

import pytest
import torch

from treeserve.ops.ngram import NGramSpeculator
from treeserve.ops.sampling import SamplingParams


def brute_force_continuations(history: list[int], max_ngram: int, length: int, num_branches: int) -> list[list[int]]:
    end = len(history)
    for n in range(min(max_ngram, end), 0, -1):
        suffix = history[end - n :]
        found: list[list[int]] = []
        for start in range(end - 1, n - 1, -1):  # start = position right after an occurrence
            if history[start - n : start] == suffix:
                cont = history[start : start + length]
                if cont not in found:
                    found.append(cont)
                if len(found) == num_branches:
                    break
        if found:
            return found
    return []


def test_continuations_match_brute_force_as_tokens_arrive() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        history = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        spec = NGramSpeculator(4, max_ngram=3, num_draft_tokens=3, num_branches=2)
        spec.prefill(history[:1])
        spec.accept(history[1:])
        assert spec.continuations(3) == brute_force_continuations(history, 3, 3, 2), (trial, history)


def test_proposes_a_trie_of_continuations_rooted_at_the_last_token() -> None:
    spec = NGramSpeculator(10, max_ngram=2, num_draft_tokens=3, num_branches=3)
    spec.prefill([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 7, 1, 2])
    greedy = spec.propose(SamplingParams(), None)
    assert greedy.root_token == 2 and greedy.draft_probs is None
    paths = {tuple(greedy.tokens[greedy.path_to(n)].tolist()) for n in range(greedy.num_nodes)}
    # "1 2" was followed by "7 1 2", "3 5 1" and "3 4 1" (most recent first); "3" is shared.
    assert paths == {(2,), (2, 7), (2, 7, 1), (2, 7, 1, 2), (2, 3), (2, 3, 5), (2, 3, 5, 1), (2, 3, 4), (2, 3, 4, 1)}
    assert int(spec.propose(SamplingParams(), None, max_depth=1).depths().max()) == 1
    capped = spec.propose(SamplingParams(), None, max_nodes=5)
    assert capped.num_nodes == 5 and capped.tokens.tolist() == [2, 7, 1, 2, 3]
    # Stochastic: one point-mass q per proposal.
    tree = spec.propose(SamplingParams(temperature=1.0), None)
    assert tree.draft_probs is not None
    for props in tree.proposals():
        for p in props:
            assert p.q_row is not None
            q = tree.draft_probs[p.q_row]
            assert float(q[int(tree.tokens[p.child])]) == 1.0 and float(q.sum()) == 1.0


def test_no_match_gives_a_root_only_tree_and_bad_config_raises() -> None:
    spec = NGramSpeculator(10)
    spec.prefill([1, 2, 3])
    assert spec.propose(SamplingParams(), None).num_nodes == 1
    with pytest.raises(ValueError, match="min_ngram"):
        NGramSpeculator(10, max_ngram=0)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        NGramSpeculator(10, num_draft_tokens=0)
    with pytest.raises(ValueError, match="non-empty"):
        spec.prefill([])
