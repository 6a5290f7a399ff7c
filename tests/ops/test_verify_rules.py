"""Greedy, keyed and stochastic (MSS) verification rules on hand-made and random token trees."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor

from treeserve.ops.sampling import SampleKey, SamplingParams, logits_to_probs, sample_keyed
from treeserve.ops.token_tree import TokenTree, TokenTreeBuilder
from treeserve.ops.verify import VerificationError, verify, verify_greedy, verify_keyed, verify_stochastic

V = 6


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def reference_greedy(parents: list[int], tokens: list[int], logits: Tensor) -> tuple[list[int], int]:
    path = [0]
    while True:
        target = int(logits[path[-1]].argmax())
        matches = [j for j in range(len(parents)) if parents[j] == path[-1] and tokens[j] == target]
        if not matches:
            return path, target
        path.append(matches[0])


def test_verify_greedy_matches_reference_on_random_trees() -> None:
    gen = torch.Generator().manual_seed(0)
    num_long = 0
    for _ in range(300):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tokens = torch.randint(0, 3, (n,), generator=gen).tolist()  # vocab 3: many matches
        logits = torch.randn(n, 3, generator=gen)
        result = verify_greedy(TokenTree.from_parents(parents, tokens), logits)
        assert (result.accepted, result.bonus_token) == reference_greedy(parents, tokens, logits)
        num_long += len(result.accepted) >= 3
    assert num_long > 10  # the walk really goes deep


def test_greedy_accepts_whole_matching_chain_and_reports_new_tokens() -> None:
    tree = TokenTree.chain(5, [1, 2, 3])
    logits = torch.full((4, V), -1.0)
    for node, nxt in enumerate([1, 2, 3, 4]):
        logits[node, nxt] = 1.0
    result = verify_greedy(tree, logits)
    assert result.accepted == [0, 1, 2, 3] and result.bonus_token == 4
    assert result.num_accepted_drafts == 3 and result.new_tokens(tree) == [1, 2, 3, 4]
    logits[1, 2], logits[1, 0] = -1.0, 2.0  # mismatch after the first draft
    result = verify(tree, logits, SamplingParams(), None)
    assert result.accepted == [0, 1] and result.new_tokens(tree) == [1, 0]


def one_level_tree(gen: torch.Generator, qs: list[Tensor], draws_per_q: list[int]) -> TokenTree:
    """Root with proposals drawn i.i.d. from each q (fresh draws each call, duplicates kept)."""
    builder = TokenTreeBuilder(0, with_probs=True)
    for q, num in zip(qs, draws_per_q):
        row = builder.add_probs(q)
        for token in torch.multinomial(q, num, replacement=True, generator=gen).tolist():
            builder.add_proposal(0, token, speculator=row, q_row=row)
    return builder.build()


def first_token_counts(make_tree: Callable[[torch.Generator], TokenTree], root_logits: Tensor, params: SamplingParams, n: int) -> Tensor:
    gen = torch.Generator().manual_seed(5)
    counts = torch.zeros(V)
    for _ in range(n):
        tree = make_tree(gen)
        logits = root_logits.expand(tree.num_nodes, V)
        counts[verify_stochastic(tree, logits, params, gen).new_tokens(tree)[0]] += 1
    return counts


def test_one_step_mss_reproduces_p_for_mixed_proposals() -> None:
    # q1 puts no mass where p is large, q2 is close to p, plus a point mass: duplicates,
    # residual updates and "all rejected" all occur.
    root_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    params = SamplingParams(temperature=1.0)
    p = logits_to_probs(root_logits, params).double()
    q1 = torch.tensor([0.0, 0.05, 0.05, 0.6, 0.3, 0.0])
    q2 = torch.softmax(torch.tensor([1.5, 1.2, 0.2, 0.0, -0.5, 0.9]), -1)
    q3 = torch.nn.functional.one_hot(torch.tensor(4), V).float()
    n = 6000
    counts = first_token_counts(lambda g: one_level_tree(g, [q1, q2, q3], [2, 1, 1]), root_logits, params, n)
    expected = p * n
    chi2 = float(((counts.double() - expected) ** 2 / expected).sum())
    assert chi2 < 25.7, (counts, expected)  # 99.99th percentile of chi-square with 5 dof
    # The same draws without the ratio test (accept the first proposal) are far off.
    wrong = torch.zeros(V)
    gen = torch.Generator().manual_seed(5)
    for _ in range(n):
        tree = one_level_tree(gen, [q1, q2, q3], [2, 1, 1])
        wrong[int(tree.tokens[tree.proposals()[0][0].child])] += 1
    assert float(((wrong.double() - expected) ** 2 / expected).sum()) > 25.7


def test_identical_p_and_q_accepts_every_first_proposal() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(V, generator=gen)
    params = SamplingParams(temperature=0.8, top_k=4)
    q = logits_to_probs(logits, params)
    for _ in range(50):
        builder = TokenTreeBuilder(0, with_probs=True)
        node = 0
        for _depth in range(3):
            row = builder.add_probs(q)
            token = int(torch.multinomial(q, 1, generator=gen))
            node = builder.add_proposal(node, token, q_row=row)
        tree = builder.build()
        result = verify_stochastic(tree, logits.expand(tree.num_nodes, V), params, gen)
        assert result.accepted == tree.path_to(node)


def test_stochastic_verification_input_errors() -> None:
    builder = TokenTreeBuilder(0, with_probs=True)
    row = builder.add_probs(torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))
    builder.add_proposal(0, 3, q_row=row)  # 3 cannot come from that q
    tree = builder.build()
    params = SamplingParams(temperature=1.0)
    with pytest.raises(VerificationError, match="proposed"):
        verify_stochastic(tree, torch.zeros(2, V), params, torch.Generator())
    with pytest.raises(VerificationError, match="draft_probs"):
        verify_stochastic(TokenTree.chain(0, [1]), torch.zeros(2, V), params, torch.Generator())
    with pytest.raises(ValueError, match="rows"):
        verify_greedy(TokenTree.chain(0, [1]), torch.zeros(3, V))
    # Greedy params: greedy rule, no draft_probs needed; a root-only tree samples from p.
    assert verify_stochastic(TokenTree.chain(0, [2]), torch.eye(V)[[2, 4]], SamplingParams(), None).accepted == [0, 1]
    only_root = verify_stochastic(TokenTree.from_parents([-1], [0]), torch.eye(V)[[5]] * 50, params, torch.Generator())
    assert only_root.accepted == [0] and only_root.bonus_token == 5


def test_cutting_a_drawn_tree_by_size_is_biased_but_worst_case_limits_are_not() -> None:
    """Why speculators get ``max_nodes`` before drafting: keeping the second of two i.i.d. draws
    only when it adds no node (it repeats the first) is a value-dependent cut and breaks MSS."""
    p_logits = torch.log(torch.tensor([0.1, 0.45, 0.45]))
    p = torch.softmax(p_logits, -1).double()
    q = torch.tensor([0.5, 0.4, 0.1])
    params = SamplingParams(temperature=1.0)
    n = 12000

    def counts(cut: bool) -> Tensor:
        gen = torch.Generator().manual_seed(9)
        result = torch.zeros(3)
        for _ in range(n):
            builder = TokenTreeBuilder(0, with_probs=True)
            row = builder.add_probs(q)
            first, second = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
            builder.add_proposal(0, first, q_row=row)
            if not cut or second == first:
                builder.add_proposal(0, second, q_row=row)
            tree = builder.build()
            result[verify_stochastic(tree, p_logits.expand(tree.num_nodes, 3), params, gen).new_tokens(tree)[0]] += 1
        return result

    def chi2(c: Tensor) -> float:
        return float(((c.double() - p * n) ** 2 / (p * n)).sum())

    assert chi2(counts(cut=False)) < 18.4  # 99.99th percentile, 2 dof
    assert chi2(counts(cut=True)) > 18.4


def test_keyed_verification_follows_the_keyed_samples_of_each_depth() -> None:
    # Root -> {1 (twice, one a duplicate draw), 2}; 1 -> 3 -> 4: every path node's target is the
    # keyed sample of its own logits at position + depth, the first matching child is taken.
    builder = TokenTreeBuilder(0, with_probs=True)
    q = builder.add_probs(torch.full((V,), 1 / V))
    one = builder.add_proposal(0, 1, q_row=q)
    builder.add_proposal(0, 1, q_row=q)
    builder.add_proposal(0, 2, q_row=q)
    three = builder.add_proposal(one, 3, q_row=q)
    builder.add_proposal(three, 4, q_row=q)
    tree = builder.build()
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(3)
    seen_accepted = set()
    for seed in range(200):
        logits = torch.randn(tree.num_nodes, V, generator=gen) * 2
        key = SampleKey(seed, 17)
        result = verify_keyed(tree, logits, params, key)
        assert verify(tree, logits, params, key) == result  # the dispatch of a key
        path, node = [0], 0
        while True:  # the reference walk, one keyed sample per depth
            target = sample_keyed(logits_to_probs(logits[node][None], params), seed, [17 + len(path) - 1])[0]
            child = next((c for c in range(1, tree.num_nodes)
                          if int(tree.parents[c]) == node and int(tree.tokens[c]) == target), None)
            if child is None:
                break
            path.append(child)
            node = child
        assert result.accepted == path and result.bonus_token == target
        seen_accepted.add(len(path))
    assert seen_accepted == {1, 2, 3, 4}  # every depth was reached by some seed


def test_keyed_verification_needs_no_draft_probs_but_checks_them() -> None:
    params = SamplingParams(temperature=1.0)
    # A greedy-drafted chain (no draft_probs) is fine: drafts are only compared to targets.
    result = verify_keyed(TokenTree.chain(0, [5]), torch.eye(V)[[5, 2]] * 50, params, SampleKey(1, 0))
    assert result.accepted == [0, 1] and result.bonus_token == 2
    builder = TokenTreeBuilder(0, with_probs=True)
    row = builder.add_probs(torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))
    builder.add_proposal(0, 3, q_row=row)  # 3 cannot come from that q: a speculator's bug
    with pytest.raises(VerificationError, match="proposed"):
        verify_keyed(builder.build(), torch.zeros(2, V), params, SampleKey(1, 0))
    assert verify_keyed(TokenTree.chain(0, [2]), torch.eye(V)[[2, 4]], SamplingParams(), SampleKey(1, 0)).accepted == [0, 1]
