"""Verification where the logits are (``verify.accept_on_device``, with argmax targets or
``verify.keyed_targets``): for packed batches of random trees (duplicate siblings, pad nodes,
pad rows) it picks what :func:`verify_greedy` and :func:`verify_keyed` pick, row by row; and
the batched verifier takes it for greedy and seeded rows where its rule says so."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from treeserve.ops.token_tree import TokenTree, pack_trees
from treeserve.ops.sampling import SampleKey, SamplingParams
from treeserve.ops.verify import accept_on_device, keyed_targets, verify_greedy, verify_keyed


def _random_tree(gen: torch.Generator, vocab: int) -> TokenTree:
    num_nodes = 1 + int(torch.randint(0, 12, (1,), generator=gen))
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]
    return TokenTree.from_parents(parents, torch.randint(0, vocab, (num_nodes,), generator=gen).tolist())


def _on_device(trees: list[TokenTree], logits: list[torch.Tensor]) -> list[tuple[list[int], int]]:
    packed = pack_trees(trees, [5] * len(trees))
    width = packed.tokens.shape[1]
    padded = torch.full((len(trees), width, logits[0].shape[-1]), -1e9)
    for row, rows_logits in enumerate(logits):
        padded[row, : rows_logits.shape[0]] = rows_logits
        padded[row, rows_logits.shape[0]:, 0] = 1e9  # pad nodes' argmax: token 0, a pad token
    decided = accept_on_device(packed.tokens, packed.tree_mask, torch.tensor(packed.num_nodes), padded.argmax(-1)).tolist()
    return [(tree.path_to(last), bonus) for tree, (last, bonus) in zip(trees, decided)]


@pytest.mark.parametrize("seed", range(40))
def test_it_accepts_what_greedy_verification_accepts(seed: int) -> None:
    """Tiny vocabularies, so drafts often match the argmax and siblings often share a token."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 2 + seed % 4
    trees = [_random_tree(gen, vocab) for _ in range(1 + seed % 5)]
    logits = [torch.randn(tree.num_nodes, vocab, generator=gen) for tree in trees]
    expected = [(r.accepted, r.bonus_token) for r in (verify_greedy(t, lg) for t, lg in zip(trees, logits))]
    assert _on_device(trees, logits) == expected


def test_of_two_siblings_with_one_token_only_the_first_counts() -> None:
    """Nodes 1 and 2 both carry the root's argmax; node 2's child matches node 2's argmax.
    Greedy verification follows node 1 (the first) and stops there; a rule that let any
    matching sibling through would reach node 3."""
    tree = TokenTree.from_parents([-1, 0, 0, 2], [9, 1, 1, 0])
    logits = torch.full((4, 3), -5.0)
    logits[0, 1] = logits[1, 2] = logits[2, 0] = logits[3, 2] = 5.0
    assert verify_greedy(tree, logits).accepted == [0, 1]
    assert _on_device([tree], [logits]) == [([0, 1], 2)]


def test_verify_rows_takes_it_for_greedy_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched verifier's greedy rows are decided on the device where its rule says so
    (on CUDA; forced here): a broken device rule (always stop at the root) shows in its results."""
    from treeserve.ops import batch_step
    from treeserve.ops.formats import apply_format

    from .conftest import make_tiny_model

    model = apply_format(make_tiny_model(2, dim=64, ffn_dim=128, num_heads=8, num_kv_heads=2, head_dim=8), "float32")
    cache = model.new_cache(2, 32)
    batch_step.prefill_rows(model, cache, [(0, [1, 2, 3]), (1, [4, 5])])
    probe = model.new_cache(2, 32)
    batch_step.prefill_rows(model, probe, [(0, [1, 2, 3]), (1, [4, 5])])
    roots = [TokenTree.root_only(7), TokenTree.root_only(8)]
    first = batch_step.verify_rows(model, probe, [batch_step.RowStep(r, roots[r], SamplingParams()) for r in (0, 1)])
    chains = [TokenTree.chain(7, [first[0].bonus_token]), TokenTree.chain(8, [first[1].bonus_token])]
    steps = [batch_step.RowStep(r, chains[r], SamplingParams()) for r in (0, 1)]
    monkeypatch.setattr(batch_step, "decides_on_device", lambda logits: True)
    monkeypatch.setattr(batch_step, "accept_on_device",
                        lambda tokens, mask, n, targets: torch.stack([torch.zeros(2, dtype=torch.long), targets[:, 0]], 1))
    broken = batch_step.verify_rows(model, cache, steps)
    assert [r.accepted for r in broken] == [[0], [0]]
    monkeypatch.undo()
    monkeypatch.setattr(batch_step, "decides_on_device", lambda logits: True)
    cache = model.new_cache(2, 32)
    batch_step.prefill_rows(model, cache, [(0, [1, 2, 3]), (1, [4, 5])])
    assert [r.accepted for r in batch_step.verify_rows(model, cache, steps)] == [[0, 1], [0, 1]]


KEYED_PARAMS = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.3, top_k=3, seed=2),
                SamplingParams(temperature=0.7, top_p=0.6, seed=3)]


@pytest.mark.parametrize("seed", range(30))
def test_keyed_targets_accept_what_keyed_verification_accepts(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    vocab = 3 + seed % 3
    trees = [_random_tree(gen, vocab) for _ in range(1 + seed % 4)]
    logits = [2 * torch.randn(tree.num_nodes, vocab, generator=gen) for tree in trees]
    params = KEYED_PARAMS[seed % len(KEYED_PARAMS)]
    keys = [SampleKey(int(params.seed or 0) + row, 7 + 3 * row) for row in range(len(trees))]
    expected = [(r.accepted, r.bonus_token) for r in
                (verify_keyed(t, lg, params, k) for t, lg, k in zip(trees, logits, keys))]
    packed = pack_trees(trees, [5] * len(trees))
    targets = torch.zeros(packed.tokens.shape, dtype=torch.long)
    for row, (tree, rows_logits, key) in enumerate(zip(trees, logits, keys)):
        row_targets, fine = keyed_targets(rows_logits, params, key, tree.depths().tolist())
        assert bool(fine)
        targets[row, : tree.num_nodes] = row_targets
    decided = accept_on_device(packed.tokens, packed.tree_mask, torch.tensor(packed.num_nodes), targets).tolist()
    assert [(tree.path_to(last), bonus) for tree, (last, bonus) in zip(trees, decided)] == expected


def test_keyed_targets_draw_at_each_nodes_own_position() -> None:
    """A rule that keyed every node at the root's position would draw the same token at
    every depth of a flat distribution; the keys differ by depth."""
    logits = torch.zeros(8, 50)
    targets, _ = keyed_targets(logits, SamplingParams(temperature=1.0, seed=4), SampleKey(4, 10), list(range(8)))
    assert len(set(targets.tolist())) > 1
    same, _ = keyed_targets(logits, SamplingParams(temperature=1.0, seed=4), SampleKey(4, 10), [0] * 8)
    assert len(set(same.tolist())) == 1


def test_a_row_that_is_not_a_distribution_is_flagged() -> None:
    logits = torch.zeros(2, 5)
    logits[1, 2] = float("nan")
    _, fine = keyed_targets(logits, SamplingParams(temperature=1.0, seed=1), SampleKey(1, 3), [0, 1])
    assert not bool(fine)


def test_verify_rows_decides_seeded_rows_on_the_device_as_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded and greedy rows through the batched verifier, decided on the device (forced) and
    on the host: the same accepted paths, bonus tokens and committed lengths, step after step."""
    from treeserve.ops import batch_step
    from treeserve.ops.formats import apply_format

    from .conftest import make_tiny_model

    model = apply_format(make_tiny_model(2, dim=64, ffn_dim=128, num_heads=8, num_kv_heads=2, head_dim=8), "float32")
    params = [SamplingParams(temperature=0.9, seed=5), SamplingParams(), SamplingParams(temperature=1.2, top_p=0.9, seed=6)]
    caches = [model.new_cache(3, 64) for _ in range(2)]
    for cache in caches:
        batch_step.prefill_rows(model, cache, [(0, [1, 2, 3]), (1, [4, 5]), (2, [9])])
    gen = torch.Generator().manual_seed(3)
    roots = [7, 8, 9]
    for _ in range(4):
        trees = []
        for root in roots:
            num_nodes = int(torch.randint(1, 7, (1,), generator=gen))
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]
            trees.append(TokenTree.from_parents(parents, [root] + torch.randint(0, 6, (num_nodes - 1,), generator=gen).tolist()))
        steps = [batch_step.RowStep(row, trees[row], params[row]) for row in range(3)]
        on_host = batch_step.verify_rows(model, caches[0], steps)
        with monkeypatch.context() as patch:
            patch.setattr(batch_step, "decides_on_device", lambda logits: True)
            on_device = batch_step.verify_rows(model, caches[1], steps)
        assert [(r.accepted, r.bonus_token) for r in on_device] == [(r.accepted, r.bonus_token) for r in on_host]
        assert caches[0].lengths.tolist() == caches[1].lengths.tolist()
        roots = [r.bonus_token for r in on_host]


def test_a_row_with_a_non_finite_logit_goes_to_the_host_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a wrapped verifier (``on_device=True``), a row whose logits hold a NaN is not
    decided on the device: the wrapper sees it (and fails it), the other row is decided there."""
    from treeserve.ops import batch_step
    from treeserve.ops.formats import apply_format

    from .conftest import make_tiny_model

    model = apply_format(make_tiny_model(2, dim=64, ffn_dim=128, num_heads=8, num_kv_heads=2, head_dim=8), "float32")
    cache = model.new_cache(2, 32)
    batch_step.prefill_rows(model, cache, [(0, [1, 2, 3]), (1, [4, 5])])
    real_forward = type(model).forward

    def poisoned(self: Any, tokens: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
        logits = real_forward(self, tokens, cache, **kwargs).clone()
        logits[1, 0, 3] = float("nan")
        return logits

    seen: list[int] = []

    def wrapper(tree: TokenTree, logits: torch.Tensor, params: SamplingParams, randomness: Any) -> Any:
        seen.append(tree.root_token)
        return verify_greedy(tree, logits)

    monkeypatch.setattr(type(model), "forward", poisoned)
    monkeypatch.setattr(batch_step, "decides_on_device", lambda logits: True)
    steps = [batch_step.RowStep(r, TokenTree.root_only(7 + r), SamplingParams()) for r in (0, 1)]
    batch_step.verify_rows(model, cache, steps, verifier=wrapper, on_device=True)
    assert seen == [8]
    seen.clear()
    batch_step.verify_rows(model, cache, steps, verifier=wrapper)  # a wrapper alone: every row goes to it
    assert seen == [7, 8]


def test_rows_decided_on_the_device_return_their_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """``verify_rows_with_states`` (a feature drafter's verifier) gives the accepted nodes'
    hidden states for rows decided on the device as for rows decided on the host."""
    from treeserve.ops import batch_step
    from treeserve.ops.formats import apply_format

    from .conftest import make_tiny_model

    model = apply_format(make_tiny_model(2, dim=64, ffn_dim=128, num_heads=8, num_kv_heads=2, head_dim=8), "float32")
    caches = [model.new_cache(2, 32) for _ in range(2)]
    for cache in caches:
        batch_step.prefill_rows(model, cache, [(0, [1, 2, 3]), (1, [4, 5])])
    trees = [TokenTree.from_parents([-1, 0, 0, 1], [7, 3, 4, 5]), TokenTree.chain(8, [2, 2])]
    steps = [batch_step.RowStep(0, trees[0], SamplingParams()), batch_step.RowStep(1, trees[1], KEYED_PARAMS[0])]
    on_host = batch_step.verify_rows_with_states(model, caches[0], steps)
    with monkeypatch.context() as patch:
        patch.setattr(batch_step, "decides_on_device", lambda logits: True)
        on_device = batch_step.verify_rows_with_states(model, caches[1], steps)
    assert [(r.accepted, r.bonus_token) for r in on_device[0]] == [(r.accepted, r.bonus_token) for r in on_host[0]]
    for mine, theirs, result in zip(on_device[1], on_host[1], on_host[0]):
        assert mine.shape[0] == len(result.accepted) and torch.equal(mine, theirs)
