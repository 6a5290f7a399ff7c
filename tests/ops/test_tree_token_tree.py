"""TokenTree, TokenTreeBuilder and merge_trees against slow, obvious references."""

from __future__ import annotations

import pytest
import torch

from treeserve.ops.token_tree import TokenTree, TokenTreeBuilder, merge_trees

VOCAB = 5  # small, so random trees from different speculators collide often


def random_parents(num_nodes: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]


def random_stochastic_tree(gen: torch.Generator, root: int, num_proposals: int, with_probs: bool = True) -> TokenTree:
    """Random trie grown by proposals at random existing nodes (duplicate draws included)."""
    builder = TokenTreeBuilder(root, with_probs=with_probs)
    rows: dict[int, int] = {}
    for _ in range(num_proposals):
        parent = int(torch.randint(0, builder.num_nodes, (1,), generator=gen))
        token = int(torch.randint(0, VOCAB, (1,), generator=gen))
        q_row = None
        if with_probs:
            if parent not in rows:
                rows[parent] = builder.add_probs(torch.rand(VOCAB, generator=gen).softmax(-1))
            q_row = rows[parent]
        builder.add_proposal(parent, token, q_row=q_row)
    return builder.build()


def ref_path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_depths_mask_and_paths_match_slow_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    for num_nodes in (1, 2, 7, 20):
        parents = random_parents(num_nodes, gen)
        tokens = torch.randint(0, 50, (num_nodes,), generator=gen)
        tree = TokenTree.from_parents(parents, tokens)
        assert tree.num_nodes == num_nodes and tree.parents_tensor().tolist() == parents
        mask = tree.tree_mask()
        assert mask.shape == (num_nodes, num_nodes) and mask.dtype == torch.bool
        for i in range(num_nodes):
            path = ref_path(parents, i)
            assert tree.path_to(i) == path
            assert int(tree.depths()[i]) == len(path) - 1
            assert mask[i].nonzero().flatten().tolist() == sorted(path)
            assert tree.children_of(i) == [j for j in range(num_nodes) if parents[j] == i]
        # from_parents: exactly one proposal per non-root node, grouped by parent.
        props = tree.proposals()
        assert sorted(p.child for ps in props for p in ps) == list(range(1, num_nodes))
        assert all(parents[p.child] == node for node, ps in enumerate(props) for p in ps)


def test_chain_and_invalid_trees() -> None:
    chain = TokenTree.chain(7, [1, 2, 3])
    assert chain.parents.tolist() == [-1, 0, 1, 2] and chain.tokens.tolist() == [7, 1, 2, 3]
    assert chain.depths().tolist() == [0, 1, 2, 3] and chain.root_token == 7
    with pytest.raises(ValueError, match="precede"):
        TokenTree.from_parents([-1, 2, 0], [1, 2, 3])
    with pytest.raises(ValueError, match="only root"):
        TokenTree.from_parents([-1, -1], [1, 2])
    with pytest.raises(ValueError, match="equal non-zero length"):
        TokenTree.from_parents([-1, 0], [1])
    with pytest.raises(IndexError):
        chain.path_to(4)


def test_builder_is_a_trie_that_keeps_every_proposal() -> None:
    builder = TokenTreeBuilder(9, with_probs=True)
    q = builder.add_probs(torch.full((VOCAB,), 1 / VOCAB))
    a = builder.add_proposal(0, 3, speculator=0, q_row=q)
    b = builder.add_proposal(0, 3, speculator=0, q_row=q)  # duplicate i.i.d. draw
    c = builder.add_proposal(0, 1, speculator=1, q_row=q)
    d = builder.add_proposal(a, 3, speculator=0, q_row=q)
    assert a == b == 1 and c == 2 and d == 3 and builder.find_child(0, 1) == 2 and builder.find_child(0, 4) is None
    tree = builder.build()
    assert tree.parents.tolist() == [-1, 0, 0, 1] and tree.tokens.tolist() == [9, 3, 1, 3]
    assert [(p.child, p.speculator) for p in tree.proposals()[0]] == [(1, 0), (1, 0), (2, 1)]
    assert tree.num_speculators == 2
    with pytest.raises(ValueError, match="q row"):
        builder.add_proposal(0, 2)
    with pytest.raises(ValueError, match="greedy"):
        TokenTreeBuilder(0, with_probs=False).add_probs(torch.ones(3))


def merged_reference(trees: list[TokenTree]) -> dict[tuple[int, ...], list[tuple[tuple[int, ...], int, list[float]]]]:
    """Per token path (from the root), the ordered proposals (child path, speculator, q)."""
    ref: dict[tuple[int, ...], list[tuple[tuple[int, ...], int, list[float]]]] = {}
    offset = 0
    for tree in trees:
        par, tok = tree.parents.tolist(), tree.tokens.tolist()

        def key(node: int) -> tuple[int, ...]:
            return tuple(tok[i] for i in ref_path(par, node))  # noqa: B023

        for node in range(tree.num_nodes):
            ref.setdefault(key(node), [])
        for node, props in enumerate(tree.proposals()):
            for p in props:
                assert tree.draft_probs is not None and p.q_row is not None
                ref[key(node)].append((key(p.child), p.speculator + offset, tree.draft_probs[p.q_row].tolist()))
        offset += tree.num_speculators
    return ref


def test_merge_three_speculators_matches_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    for trial in range(20):
        trees = [random_stochastic_tree(gen, root=4, num_proposals=int(n)) for n in torch.randint(0, 12, (3,), generator=gen)]
        merged = merge_trees(trees)
        assert merged.draft_probs is not None
        par, tok = merged.parents.tolist(), merged.tokens.tolist()
        keys = [tuple(tok[i] for i in ref_path(par, n)) for n in range(merged.num_nodes)]
        assert len(set(keys)) == len(keys), "merged tree must be a trie"
        ref = merged_reference(trees)
        assert set(keys) == set(ref), trial
        for node, props in enumerate(merged.proposals()):
            got = [(keys[p.child], p.speculator, merged.draft_probs[p.q_row].tolist()) for p in props]  # type: ignore[index]
            assert got == ref[keys[node]], (trial, node)
        assert merged.num_speculators <= 3


def test_merge_greedy_trees_and_root_only_trees() -> None:
    a = TokenTree.chain(2, [1, 3])
    b = TokenTree.from_parents([-1, 0, 0, 1], [2, 1, 4, 0])
    root_only = TokenTree.from_parents([-1], [2])
    merged = merge_trees([a, root_only, b])
    assert merged.draft_probs is None
    paths = {tuple(merged.tokens[merged.path_to(n)].tolist()) for n in range(merged.num_nodes)}
    assert paths == {(2,), (2, 1), (2, 1, 3), (2, 4), (2, 1, 0)}
    assert [p.speculator for p in merged.proposals()[0]] == [0, 2, 2]  # a is 0, root_only 1, b 2
    gen = torch.Generator().manual_seed(2)
    stochastic = random_stochastic_tree(gen, root=2, num_proposals=4)
    assert merge_trees([root_only, stochastic]).draft_probs is not None
    with pytest.raises(ValueError, match="greedy"):
        merge_trees([a, stochastic])
    with pytest.raises(ValueError, match="root"):
        merge_trees([a, TokenTree.chain(3, [1])])
    with pytest.raises(ValueError, match="at least one"):
        merge_trees([])


def test_restricted_and_first_chain() -> None:
    gen = torch.Generator().manual_seed(3)
    tree = random_stochastic_tree(gen, root=0, num_proposals=15)
    depths = tree.depths()
    sub = tree.restricted(depths <= 1)
    assert sub.num_nodes == int((depths <= 1).sum()) and bool((sub.depths() <= 1).all())
    kept_paths = {tuple(tree.tokens[tree.path_to(n)].tolist()) for n in range(tree.num_nodes) if depths[n] <= 1}
    assert {tuple(sub.tokens[sub.path_to(n)].tolist()) for n in range(sub.num_nodes)} == kept_paths
    assert len([p for ps in sub.proposals() for p in ps]) == int((depths[tree.proposal_children] <= 1).sum())
    with pytest.raises(ValueError, match="parent"):
        inner = next(n for n in range(1, tree.num_nodes) if tree.children_of(n))
        tree.restricted(torch.arange(tree.num_nodes) != inner)
    chain = tree.first_chain()
    node, expected = 0, [int(tree.tokens[0])]
    while props := tree.proposals()[node]:
        node = props[0].child
        expected.append(int(tree.tokens[node]))
    assert chain.tokens.tolist() == expected and chain.parents.tolist() == list(range(-1, len(expected) - 1))
    assert all(len(ps) == (1 if i < chain.num_nodes - 1 else 0) for i, ps in enumerate(chain.proposals()))
