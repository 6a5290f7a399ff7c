"""Batched verification over a multi-row KV cache must reproduce single-request generation exactly.

Several requests (different prompt lengths, speculators giving trees of different sizes,
greedy and seeded stochastic) are stepped together with ``prefill_row`` + ``verify_rows``; each
must emit exactly the tokens ``generate_speculative`` gives it alone (float32, tiny model),
which also equal ``generate_incremental`` in greedy mode. A packer whose pads are visible to
real nodes must break that equality.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch

from treeserve.ops.batch_step import RowStep, _prefill_groups, prefill_row, prefill_rows, verify_rows
from treeserve.ops.drafting import ModelSpeculator, Speculator
from treeserve.ops.model import Transformer
from treeserve.ops.ngram import NGramSpeculator
from treeserve.ops.sampling import SamplingParams, make_generator
from treeserve.ops.speculative import emit_until_done, generate_incremental, generate_speculative
from treeserve.ops.token_tree import PackedTrees, TokenTree, merge_trees, pack_trees

MAX_TREE_NODES = 64


@pytest.fixture(autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    # Tiny models gain nothing from intra-op threads, which only contend on a shared machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _fit(tree: TokenTree, max_depth: int, max_nodes: int) -> TokenTree:
    # Same trimming as the single-request loop, so stochastic runs consume the same randomness.
    keep = (tree.depths() <= max_depth) & (torch.arange(tree.num_nodes) < max_nodes)
    return tree if bool(keep.all()) else tree.restricted(keep)


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    make_speculators: Callable[[], list[Speculator]]
    row: int = 0
    speculators: list[Speculator] = field(default_factory=list)
    generator: torch.Generator | None = None
    emitted: list[int] = field(default_factory=list)
    root: int = 0
    is_done: bool = False


def run_batched(
    model: Transformer, requests: Sequence[Request], *, num_rows: int, packer=pack_trees, prefill: str = "rows",
) -> list[list[int]]:
    """Step all requests together, like a scheduler would, and return each one's tokens.
    ``prefill="rows"`` prefills one request at a time, ``"batched"`` all of them in one call."""
    cache = model.new_cache(num_rows, 200)
    if prefill == "batched":
        lengths = prefill_rows(model, cache, [(req.row, req.prompt[:-1]) for req in requests])
        assert [n for n, _ in lengths] == [len(req.prompt) - 1 for req in requests]
    for req in requests:
        if prefill == "rows":
            assert prefill_row(model, cache, req.row, req.prompt[:-1]) == len(req.prompt) - 1
        req.speculators = req.make_speculators()
        for s in req.speculators:
            s.prefill(req.prompt)
        req.generator = None if req.params.is_greedy else make_generator(req.params)
        req.root = req.prompt[-1]
    while active := [r for r in requests if not r.is_done]:
        steps = []
        for req in active:
            remaining = req.params.max_new_tokens - len(req.emitted)
            trees = [s.propose(req.params, req.generator, max_depth=remaining - 1) for s in req.speculators]
            tree = merge_trees(trees) if trees else TokenTree.from_parents([-1], [req.root])
            assert tree.root_token == req.root
            ref_capacity = min(model.config.max_seq_len, len(req.prompt) + req.params.max_new_tokens + MAX_TREE_NODES)
            tree = _fit(tree, remaining - 1, ref_capacity - int(cache.lengths[req.row]))
            steps.append(RowStep(req.row, tree, req.params, req.generator))
        results = verify_rows(model, cache, steps, packer=packer)
        for req, step, result in zip(active, steps, results):
            new_tokens = result.new_tokens(step.tree)
            _, finish = emit_until_done(req.emitted, new_tokens, req.params)
            if finish is not None:
                req.is_done = True
                continue
            for s in req.speculators:
                s.accept(new_tokens)
            req.root = result.bonus_token
    return [r.emitted for r in requests]


def make_requests(model: Transformer, *, stochastic: bool) -> list[Request]:
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(7)

    def prompt(n: int) -> list[int]:
        base = torch.randint(0, vocab, (max(n // 2, 1),), generator=gen).tolist()
        return (base * 3)[:n]  # repeats give the n-gram speculator matches

    def params(seed: int, max_new: int) -> SamplingParams:
        if stochastic:
            return SamplingParams(temperature=0.9, top_k=20, seed=seed, max_new_tokens=max_new)
        return SamplingParams(max_new_tokens=max_new)

    full = model.truncated(model.config.num_layers)  # a perfect drafter: long accepted paths
    first = model.truncated(1)
    return [
        Request(prompt(5), params(1, 14), lambda: [ModelSpeculator(full, (1, 2, 1, 1), capacity=200)], row=0),
        Request(prompt(17), params(2, 11), lambda: [NGramSpeculator(vocab, num_draft_tokens=3),
                                                    ModelSpeculator(first, (2, 1), capacity=200)], row=1),
        Request(prompt(2), params(3, 9), lambda: [], row=3),  # root-only trees; row 2 is an idle gap
        Request(prompt(9), params(4, 12), lambda: [NGramSpeculator(vocab, num_branches=2)], row=4),
    ]


def reference(model: Transformer, req: Request) -> list[int]:
    return generate_speculative(model, req.make_speculators(), req.prompt, req.params,
                                max_tree_nodes=MAX_TREE_NODES).token_ids


_GREEDY_CASE: dict[str, tuple[Transformer, list[list[int]]]] = {}


@pytest.fixture
def greedy_case(tiny_model_factory) -> tuple[Transformer, list[list[int]]]:  # type: ignore[no-untyped-def]
    """The tiny model and its single-request greedy outputs (computed once, shared by two tests)."""
    if "case" not in _GREEDY_CASE:
        model = tiny_model_factory(seed=3)
        _GREEDY_CASE["case"] = model, [reference(model, r) for r in make_requests(model, stochastic=False)]
    return _GREEDY_CASE["case"]


@pytest.mark.parametrize("prefill", ["rows", "batched"])
def test_batched_greedy_steps_match_single_request_generation(greedy_case, prefill: str) -> None:  # type: ignore[no-untyped-def]
    model, expected = greedy_case
    requests = make_requests(model, stochastic=False)
    assert expected == [generate_incremental(model, r.prompt, r.params).token_ids for r in requests]
    got = run_batched(model, requests, num_rows=6, prefill=prefill)
    assert got == expected
    assert all(len(tokens) == r.params.max_new_tokens for tokens, r in zip(got, requests))


@pytest.mark.parametrize("prefill", ["rows", "batched"])
def test_batched_stochastic_steps_match_single_request_generation(tiny_model_factory, prefill: str) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model_factory(seed=3)
    requests = make_requests(model, stochastic=True)
    expected = [reference(model, r) for r in requests]
    got = run_batched(model, make_requests(model, stochastic=True), num_rows=6, prefill=prefill)
    assert got == expected
    assert all(len(tokens) == r.params.max_new_tokens for tokens, r in zip(got, requests))


def _leaky_packer(trees, lengths, pad_token_id):  # type: ignore[no-untyped-def]
    # Deliberately wrong: every real node also attends to its row's pad slots.
    packed = pack_trees(trees, lengths, pad_token_id)
    mask = packed.tree_mask.clone()
    for b, n in enumerate(packed.num_nodes):
        mask[b, :n, n:] = True
    return PackedTrees(packed.tokens, mask, packed.positions, packed.num_nodes)


def test_pads_visible_to_real_nodes_break_the_equality(greedy_case) -> None:  # type: ignore[no-untyped-def]
    model, expected = greedy_case
    got = run_batched(model, make_requests(model, stochastic=False), num_rows=6, packer=_leaky_packer)
    assert got != expected


def test_prefill_row_leaves_other_rows_alone(tiny_model_factory) -> None:
    model = tiny_model_factory(seed=1)
    cache = model.new_cache(3, 32)
    prefill_row(model, cache, 0, [1, 2, 3, 4])
    keys0 = [k[0].clone() for k in cache.keys]
    prefill_row(model, cache, 2, [5, 6])
    assert cache.lengths.tolist() == [4, 0, 2]
    assert all(torch.equal(k[0], before) for k, before in zip(cache.keys, keys0))
    single = model.new_cache(1, 32)
    model(torch.tensor([[5, 6]]), single)
    assert all(torch.equal(k[2, :, :2], s[0, :, :2]) for k, s in zip(cache.keys, single.keys))
    prefill_row(model, cache, 0, [])
    assert cache.lengths.tolist() == [0, 0, 2]


def test_prefill_rows_fills_each_row_as_its_own_prefill_would(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model_factory(seed=4)
    gen = torch.Generator().manual_seed(11)
    prompts = {0: [], 1: torch.randint(0, 50, (9,), generator=gen).tolist(), 2: [7],
               4: torch.randint(0, 50, (6,), generator=gen).tolist(), 5: torch.randint(0, 50, (8,), generator=gen).tolist()}
    cache = model.new_cache(6, 16)
    prefill_row(model, cache, 3, [1, 2, 3])  # a running row the call must not touch
    keys3 = [k[3].clone() for k in cache.keys]
    out = prefill_rows(model, cache, list(prompts.items()), want_states=True)
    assert [n for n, _ in out] == [len(p) for p in prompts.values()]
    assert cache.lengths.tolist() == [0, 9, 1, 3, 6, 8]
    assert all(torch.equal(k[3], before) for k, before in zip(cache.keys, keys3))
    for (row, prompt), (_, states) in zip(prompts.items(), out):
        assert states.shape == (len(prompt), model.config.dim)
        if not prompt:
            continue
        alone = model.new_cache(1, 16)
        _, hidden = model(torch.tensor([prompt]), alone, return_hidden=True)
        assert torch.allclose(states, hidden[0], atol=1e-5)
        for layer in range(model.config.num_layers):  # right padding never reached a real token
            n = len(prompt)
            assert torch.allclose(cache.keys[layer][row, :, :n], alone.keys[layer][0, :, :n], atol=1e-5)
            assert torch.allclose(cache.values[layer][row, :, :n], alone.values[layer][0, :, :n], atol=1e-5)


def test_prefill_rows_keeps_a_rows_first_slots_and_prefills_the_rest(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    """``keep``: a row keeps that many committed slots and the forward runs only the rest of its
    prompt, attending to them: the K/V a whole prefill of the prompt gives (float32 here; the
    fused op's bits are test_verifier_prefix_reuse.py's), beside a row prefilled whole."""
    model = tiny_model_factory(seed=4)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 50, (n,), generator=gen).tolist() for n in (11, 9, 7)]
    cache = model.new_cache(3, 16)
    prefill_rows(model, cache, [(0, prompts[0][:6] + [1, 1]), (1, prompts[1]), (2, prompts[2])])  # what the rows held
    out = prefill_rows(model, cache, [(0, prompts[0][6:]), (1, []), (2, prompts[2])], keep=[6, 9, 0])
    assert [n for n, _ in out] == [11, 9, 7] and cache.lengths.tolist() == [11, 9, 7]
    for row, prompt in enumerate(prompts):
        whole = model.new_cache(1, 16)
        model(torch.tensor([prompt]), whole)
        for layer in range(model.config.num_layers):
            n = len(prompt)
            assert torch.allclose(cache.keys[layer][row, :, :n], whole.keys[layer][0, :, :n], atol=1e-5), row
            assert torch.allclose(cache.values[layer][row, :, :n], whole.values[layer][0, :, :n], atol=1e-5), row
    for keep, error in [([12, 0, 0], "cannot keep"), ([1], "one count per prompt")]:
        with pytest.raises(ValueError, match=error):
            prefill_rows(model, cache, [(0, [4]), (1, [4]), (2, [4])][:3 if len(keep) == 3 else 2], keep=keep)
    with pytest.raises(ValueError, match="no states"):
        prefill_rows(model, cache, [(0, [4])], keep=[2], want_states=True)
    assert cache.lengths.tolist() == [11, 9, 7]


def test_prefill_groups_trade_padding_against_forwards() -> None:
    assert _prefill_groups([], 64, 8) == []
    assert _prefill_groups([3, 4, 4, 5], 64, 8) == [[0, 1, 2, 3]]  # 20 padded + 8 beats any split
    assert _prefill_groups([3, 4, 4, 5], 64, 0) == [[0], [1], [2], [3]]  # free forwards: each prompt alone
    assert _prefill_groups([3, 4, 4, 5], 12, 8) == [[0, 1, 2], [3]]  # 4 x 5 padded would exceed 12
    assert _prefill_groups([2, 2, 2, 30], 1000, 8) == [[0, 1, 2], [3]]  # 4 x 30 padded costs more than a forward
    assert _prefill_groups([100, 100], 64, 8) == [[0], [1]]  # each longer than the budget: alone


def test_prefill_rows_rejects_bad_input_without_resetting_any_row(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model_factory(seed=4)
    cache = model.new_cache(2, 8)
    prefill_row(model, cache, 0, [1, 2, 3])
    for bad, error in [([(1, [4]), (1, [5])], "once"), ([(1, [4]), (0, [10_000])], "token ids"),
                       ([(1, list(range(9)))], "does not fit"), ([(0, [4]), (2, [4])], "out of range")]:
        with pytest.raises((ValueError, IndexError), match=error):
            prefill_rows(model, cache, bad)
        assert cache.lengths.tolist() == [3, 0]


def test_verify_rows_rejects_bad_input_without_moving_any_row(tiny_model_factory) -> None:
    model = tiny_model_factory(seed=1)
    cache = model.new_cache(2, 8)
    prefill_row(model, cache, 0, [1, 2, 3])
    prefill_row(model, cache, 1, [1, 2, 3, 4, 5, 6])
    greedy = SamplingParams()
    small = TokenTree.chain(7, [8])
    big = TokenTree.chain(7, [8, 9, 10])
    with pytest.raises(ValueError, match="room"):
        verify_rows(model, cache, [RowStep(0, small, greedy), RowStep(1, big, greedy)])
    with pytest.raises(ValueError, match="once"):
        verify_rows(model, cache, [RowStep(0, small, greedy), RowStep(0, small, greedy)])
    with pytest.raises(ValueError, match="token ids"):
        verify_rows(model, cache, [RowStep(0, TokenTree.chain(7, [10_000]), greedy)])
    with pytest.raises(IndexError):
        verify_rows(model, cache, [RowStep(5, small, greedy)])

    def failing(tree, logits, params, generator):  # type: ignore[no-untyped-def]
        raise ValueError("verifier failed")

    with pytest.raises(ValueError, match="verifier failed"):
        verify_rows(model, cache, [RowStep(0, small, greedy), RowStep(1, small, greedy)], verifier=failing)
    assert cache.lengths.tolist() == [3, 6]
    results = verify_rows(model, cache, [RowStep(1, small, greedy)])
    assert cache.lengths.tolist() == [3, 6 + len(results[0].accepted)]


def test_idle_row_without_room_splits_the_batch_instead_of_failing(tiny_model_factory) -> None:
    model = tiny_model_factory(seed=2)
    cache = model.new_cache(3, 8)
    for row, prompt in enumerate([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13]]):
        prefill_row(model, cache, row, prompt)
    trees = {0: TokenTree.from_parents([-1, 0, 0], [4, 5, 6]), 2: TokenTree.chain(14, [15, 16])}
    greedy = SamplingParams()
    # Idle row 1 (7 of 8 slots used) cannot take the 3 padded tokens of a shared forward.
    results = verify_rows(model, cache, [RowStep(r, t, greedy) for r, t in trees.items()])
    assert cache.lengths[1] == 7
    for (row, tree), result in zip(trees.items(), results):
        alone = model.new_cache(1, 8)
        prefill_row(model, alone, 0, [[1, 2, 3], None, [11, 12, 13]][row])
        [expected] = verify_rows(model, alone, [RowStep(0, tree, greedy)])
        assert (result.accepted, result.bonus_token) == (expected.accepted, expected.bonus_token)
        assert int(cache.lengths[row]) == 3 + len(result.accepted)
        for layer in range(model.config.num_layers):
            n = int(alone.lengths[0])
            assert torch.allclose(cache.keys[layer][row, :, :n], alone.keys[layer][0, :, :n], atol=1e-6)
