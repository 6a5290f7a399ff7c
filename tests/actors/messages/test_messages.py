"""The typed message bodies between actors (``actors/messages*.py``).

Every body survives ``to_wire`` -> the transport codec -> ``from_wire`` exactly; a body's
tensors take one frame per kind whatever the row count (states and dense draft probabilities
stacked), so a 128-row step fits the transport's frame limit; a malformed request body is a
``ValueError`` naming the field, raised at the handler's entry before any compute, and a
malformed reply a ``MalformedReply``; a request's params are parsed once per receiver.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from treeserve.ops.speculation_modes import SpeculationMode
from treeserve.actors.messages.checks import MalformedReply
from treeserve.actors.gateway.request import InvalidRequest
from treeserve.actors.messages.gateway import FinishBody, GenerateBody
from treeserve.actors.messages.length import LengthReport, PredictBatchBody, PredictBatchReply, PredictBody, PredictReply
from treeserve.actors.messages.speculator import ProposalRequest, ProposeBody, ProposeReply, RequestRelease, StartBody
from treeserve.actors.messages.verifier import (
    PrefillBody,
    PrefilledRow,
    PrefillReply,
    PrefillRow,
    RowRelease,
    RowVerdict,
    StepBody,
    StepReply,
    StepRow,
)
from treeserve.actors.speculator import SpeculatorActor
from treeserve.actors.messages.tree_wire import SPARSE_MAX_NONZEROS, ParamsCache, params_to_wire
from treeserve.actors.verifier import VerifierShard
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree, TokenTreeBuilder
from treeserve.transport import Request, decode, encode

import tiny_model_files as tiny  # registered by conftest.py

VOCAB = SPARSE_MAX_NONZEROS + 100  # a dense draft row has more non-zeros than the sparse form allows
DIM = 6
CONTEXT = 400
SAMPLED = SamplingParams(temperature=0.7, top_k=40, seed=3, stop_token_ids=(2,), max_new_tokens=20)


def frames_of(body: Any) -> list[Any]:
    return list(encode(Request(id=1, target="a", method="m", body=body)))


def through_codec(body: Any) -> Any:
    msg = decode(frames_of(body))
    assert isinstance(msg, Request)
    return msg.body


def dense_tree(root: int, seed: int) -> TokenTree:
    """A stochastic tree whose two draft rows are full softmax rows (sent dense)."""
    gen = torch.Generator().manual_seed(seed)
    builder = TokenTreeBuilder(root, with_probs=True)
    first = builder.add_proposal(0, 5, speculator=0, q_row=builder.add_probs(torch.softmax(torch.randn(VOCAB, generator=gen), -1)))
    builder.add_proposal(first, 9, speculator=0, q_row=builder.add_probs(torch.softmax(torch.randn(VOCAB, generator=gen), -1)))
    return builder.build()


def sparse_tree(root: int) -> TokenTree:
    builder = TokenTreeBuilder(root, with_probs=True)
    builder.add_proposal(0, 7, speculator=0, q_row=builder.add_probs(torch.nn.functional.one_hot(torch.tensor(7), VOCAB).float()))
    return builder.build()


def assert_same_tree(a: TokenTree | None, b: TokenTree | None) -> None:
    assert (a is None) == (b is None)
    if a is None or b is None:
        return
    for name in ("parents", "tokens", "proposal_children", "proposal_speculators", "proposal_q_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.draft_probs is None) == (b.draft_probs is None)
    if a.draft_probs is not None and b.draft_probs is not None:
        assert torch.equal(a.draft_probs, b.draft_probs)


def mixed_trees(count: int) -> list[TokenTree]:
    """Greedy, sparse and dense trees in turn."""
    kinds = [lambda i: TokenTree.from_parents([-1, 0, 0], [i % 50 + 3, 4, 5]), sparse_tree,
             lambda i: dense_tree(i % 50 + 3, i)]
    return [kinds[i % 3](i) for i in range(count)]


# ---------------------------------------------------------------------- round trips
def test_step_body_round_trip_with_greedy_sparse_and_dense_trees() -> None:
    trees = mixed_trees(6)
    rows = tuple(StepRow(i, tree, SAMPLED if i % 2 else SamplingParams(), f"r{i}") for i, tree in enumerate(trees))
    for rank0_answers in (False, True):
        body = StepBody(rows, return_states=True, rank0_answers=rank0_answers)
        back = StepBody.from_wire(through_codec(body.to_wire()), ParamsCache())
        assert (back.return_states, back.rank0_answers) == (True, rank0_answers)
        assert [(r.row, r.params, r.request_id) for r in back.rows] == [(r.row, r.params, r.request_id) for r in rows]
        for want, got in zip(rows, back.rows):
            assert_same_tree(want.tree, got.tree)
    assert "rank0_answers" not in StepBody(rows).to_wire()  # one shard: nothing to mark


def test_propose_body_and_reply_round_trip() -> None:
    states = np.arange(5 * DIM, dtype=np.float32).reshape(5, DIM)
    requests = (
        ProposalRequest("a", (4, 5), 3, SAMPLED, max_nodes=8, states=states[:2]),
        ProposalRequest("b", (), 6, SamplingParams(), history=(1, 2, 3), states=states[2:]),
        ProposalRequest("c", (9,), 0, SamplingParams()),
    )
    back = ProposeBody.from_wire(through_codec(ProposeBody(requests).to_wire()), vocab_size=VOCAB, dim=DIM,
                                 params=ParamsCache())
    for want, got in zip(requests, back.requests, strict=True):
        assert (got.request_id, got.new_tokens, got.max_depth, got.params, got.max_nodes, got.history) == \
            (want.request_id, want.new_tokens, want.max_depth, want.params, want.max_nodes, want.history)
        assert (got.states is None) == (want.states is None)
        if want.states is not None:
            assert got.states is not None and np.array_equal(got.states, want.states)

    trees = (*mixed_trees(3), None)
    reply = ProposeReply.from_wire(through_codec(ProposeReply(trees, ("c",)).to_wire()), 4, speculator=0)
    assert reply.missing == ("c",)
    for want_tree, got_tree in zip(trees, reply.trees, strict=True):
        assert_same_tree(want_tree, got_tree)


def test_verifier_replies_round_trip_with_states_and_a_failed_row() -> None:
    states = np.arange(4 * DIM, dtype=np.float32).reshape(4, DIM)
    prefill = PrefillReply((PrefilledRow(0, 3, states[:3]), PrefilledRow(2, 5), PrefilledRow(3, 1, states[3:])))
    back = PrefillReply.from_wire(through_codec(prefill.to_wire(DIM)), [0, 2, 3])
    assert [(r.row, r.length, None if r.states is None else r.states.tolist()) for r in back.rows] == \
        [(0, 3, states[:3].tolist()), (2, 5, None), (3, 1, states[3:].tolist())]

    verdicts = (RowVerdict(0, (0, 1), (4, 8), states[:2]), RowVerdict(1, error="numerical failure"),
                RowVerdict(2, (0,), (6,), states[2:3]))
    wire = through_codec(StepReply(verdicts, return_states=True).to_wire(DIM))
    assert wire["rows"][0]["bonus_token"] == 8  # the wire keeps every field it had
    got = StepReply.from_wire(wire, [0, 1, 2], return_states=True).verdicts
    assert got[1] == verdicts[1]
    for want, have in zip(verdicts[::2], got[::2]):
        assert (have.row, have.accepted, have.new_tokens) == (want.row, want.accepted, want.new_tokens)
        assert have.states is not None and want.states is not None and np.array_equal(have.states, want.states)


def test_the_small_bodies_round_trip() -> None:
    generate = GenerateBody("g", (5, 6), SAMPLED, SpeculationMode.CHAIN)
    assert generate_from_wire(through_codec(generate.to_wire())) == generate
    assert generate_from_wire({"prompt_ids": [1]}) == GenerateBody(None, (1,), SamplingParams())
    tiny_t = generate_from_wire({"prompt_ids": [1], "params": {"temperature": 1e-300}})
    assert tiny_t.params.is_greedy  # the one temperature rule: below the smallest sampled one is greedy
    prefill = PrefillBody((PrefillRow(1, (5, 6, 7), True), PrefillRow(0, (4,))), rank0_answers=True)
    assert PrefillBody.from_wire(through_codec(prefill.to_wire())) == prefill
    for body, parse in [
        (FinishBody("g", 3), FinishBody.from_wire),
        (RowRelease(2, "g"), RowRelease.from_wire),
        (LengthReport("g", 17, True), LengthReport.from_wire),
        (PredictReply(12.5), PredictReply.from_wire),
    ]:
        assert parse(through_codec(body.to_wire())) == body
    assert StartBody.from_wire(through_codec(StartBody("g", (1, 2)).to_wire()), VOCAB) == StartBody("g", (1, 2))
    for release in (RequestRelease("g"), RequestRelease("g", (4, 5))):
        assert RequestRelease.from_wire(through_codec(release.to_wire()), VOCAB) == release
    with pytest.raises(ValueError):
        RequestRelease.from_wire({"request_id": "g", "new_tokens": [VOCAB]}, VOCAB)
    assert PredictBody.from_wire(through_codec(PredictBody("g", (1, 2)).to_wire()), VOCAB) == PredictBody("g", (1, 2))
    capped = PredictBody("g", (1, 2), max_tokens=16)  # a predictor that reads the cap gets it
    assert PredictBody.from_wire(through_codec(capped.to_wire()), VOCAB) == capped
    with pytest.raises(ValueError, match="max_tokens"):
        PredictBody.from_wire({"request_id": "g", "prompt_ids": [1], "max_tokens": 0}, VOCAB)
    batch = PredictBatchBody((PredictBody("g", (1, 2)), PredictBody("h", (3,), max_tokens=8)))
    assert PredictBatchBody.from_wire(through_codec(batch.to_wire()), VOCAB) == batch
    assert PredictBatchReply.from_wire(through_codec({"predicted_lens": [3, 4.5]}), 2) == PredictBatchReply((3.0, 4.5))


def generate_from_wire(body: Any) -> GenerateBody:
    return GenerateBody.from_wire(body, vocab_size=VOCAB, context_length=CONTEXT)


def test_a_generate_body_is_checked_where_it_crosses_a_process_and_passed_as_is_within_one() -> None:
    body = GenerateBody("g", (5, 6), SAMPLED, SpeculationMode.CHAIN, length_hint=3)
    assert GenerateBody.received(body, vocab_size=VOCAB, context_length=CONTEXT) is body
    assert GenerateBody.received(through_codec(body.to_wire()), vocab_size=VOCAB, context_length=CONTEXT) == body
    fits = {"prompt_ids": [1] * 4, "params": {"max_new_tokens": CONTEXT - 4}}
    assert generate_from_wire(fits).params.max_new_tokens == CONTEXT - 4
    for param, bad in [("max_tokens", {"prompt_ids": [1] * 5, "params": {"max_new_tokens": CONTEXT - 4}}),
                       ("prompt_ids", {"prompt_ids": [VOCAB]}),
                       ("params", {"prompt_ids": [1], "params": {"temperature": -1}}),
                       ("speculate", {"prompt_ids": [1], "speculate": "forest"}),
                       ("length_hint", {"prompt_ids": [1], "length_hint": 0})]:
        with pytest.raises(InvalidRequest) as refused:
            generate_from_wire(bad)
        assert refused.value.param == param


def test_the_generate_body_carries_an_optional_length_hint() -> None:
    hinted = GenerateBody("g", (5, 6), SAMPLED, SpeculationMode.NONE, length_hint=40)
    assert hinted.to_wire()["length_hint"] == 40
    assert generate_from_wire(through_codec(hinted.to_wire())) == hinted
    assert "length_hint" not in GenerateBody("g", (5,), SAMPLED).to_wire()  # what an old gateway sends
    assert generate_from_wire({"prompt_ids": [1], "length_hint": None}).length_hint is None
    for bad in (0, -1, True, 2.5, "40"):
        with pytest.raises(ValueError, match="length_hint must be an int >= 1"):
            generate_from_wire({"prompt_ids": [1], "length_hint": bad})


# ---------------------------------------------------------------------- frames
@pytest.mark.parametrize("num_rows", [1, 64, 128])
def test_a_steps_tensors_take_one_frame_per_kind_whatever_the_row_count(num_rows: int) -> None:
    trees = [dense_tree(i % 50 + 3, i) for i in range(num_rows)]  # every tree has dense draft probs
    step = StepBody(tuple(StepRow(i, t, SAMPLED, f"r{i}") for i, t in enumerate(trees)), return_states=True)
    assert len(frames_of(step.to_wire())) == 2  # header + the stacked draft probs
    assert len(frames_of(ProposeReply(tuple(trees)).to_wire())) == 2
    verdicts = tuple(RowVerdict(i, (0, 1), (5, 9), np.ones((2, DIM), np.float32)) for i in range(num_rows))
    assert len(frames_of(StepReply(verdicts, return_states=True).to_wire(DIM))) == 2  # header + stacked states
    requests = tuple(ProposalRequest(f"r{i}", (5,), 3, SAMPLED, states=np.ones((1, DIM), np.float32))
                     for i in range(num_rows))
    assert len(frames_of(ProposeBody(requests).to_wire())) == 2
    prefill = PrefillReply(tuple(PrefilledRow(i, 3, np.ones((3, DIM), np.float32)) for i in range(num_rows)))
    assert len(frames_of(prefill.to_wire(DIM))) == 2


# ---------------------------------------------------------------------- rejection
def step_wire() -> dict[str, Any]:
    return StepBody((StepRow(0, dense_tree(3, 0), SAMPLED, "r0"), StepRow(1, sparse_tree(4), SAMPLED, "r1"))).to_wire()


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda b: b.pop("rows"), "missing fields"),
    (lambda b: b.update(extra=1), "unknown fields"),
    (lambda b: b.update(rows=[]), "non-empty list 'rows'"),
    (lambda b: b["rows"].__setitem__(0, ["not", "a", "map"]), "must be a map"),
    (lambda b: b["rows"][0].update(row="0"), "row must be an integer"),
    (lambda b: b["rows"][1].pop("params"), "missing fields \\['params'\\]"),
    (lambda b: b["rows"][0].update(request_id=7), "request_id"),
    (lambda b: b["rows"][0]["params"].update(top_p=2.0), "top_p"),
    (lambda b: b["rows"][1]["tree"].pop("tokens"), "missing"),
    (lambda b: b.update(return_states="yes"), "return_states must be true or false"),
    (lambda b: b.pop("draft_probs"), "the body has none"),
    (lambda b: b.update(draft_probs=b["draft_probs"][:1]), "do not hold the trees' 2 rows"),
    (lambda b: b["rows"][0]["tree"].update(draft_probs={"stacked": -1}), "stacked draft_probs rows"),
])
def test_a_malformed_step_body_is_rejected_naming_the_field(mutate: Any, message: str) -> None:
    body = step_wire()
    mutate(body)
    with pytest.raises(ValueError, match=message):
        StepBody.from_wire(body, ParamsCache())


@pytest.mark.parametrize(("body", "message"), [
    ({"rows": [{"row": 0}]}, "missing fields \\['prompt_ids'\\]"),
    ({"rows": [{"row": True, "prompt_ids": [1]}]}, "row must be an integer"),
    ({"rows": [{"row": 0, "prompt_ids": []}]}, "non-empty list"),
    ({"rows": [{"row": 0, "prompt_ids": [1, "2"]}]}, "non-negative integers"),
])
def test_a_malformed_prefill_body_is_rejected(body: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrefillBody.from_wire(body)


def test_malformed_speculator_and_predictor_bodies_are_rejected() -> None:
    good = ProposeBody((ProposalRequest("a", (4,), 3, SAMPLED, states=np.ones((1, DIM), np.float32)),)).to_wire()
    for mutate, message in [
        (lambda b: b["requests"][0].pop("max_depth"), "missing fields \\['max_depth'\\]"),
        (lambda b: b["requests"][0].update(new_tokens=[VOCAB]), "token ids in"),
        (lambda b: b["requests"][0].update(max_nodes=0), "max_nodes"),
        (lambda b: b.update(states=np.ones((1, DIM + 1), np.float32)), "shape"),
        (lambda b: b.pop("states"), "no stacked 'states'"),
    ]:
        body = {**good, "requests": [dict(good["requests"][0])]}
        mutate(body)
        with pytest.raises(ValueError, match=message):
            ProposeBody.from_wire(body, vocab_size=VOCAB, dim=DIM, params=ParamsCache())
    with pytest.raises(ValueError, match="unknown generate fields"):
        generate_from_wire({"prompt_ids": [1], "prompt": "x"})
    with pytest.raises(ValueError, match="speculate must be one of"):
        generate_from_wire({"prompt_ids": [1], "speculate": "forest"})
    with pytest.raises(ValueError, match="is_censored"):
        LengthReport.from_wire({"request_id": "a", "num_generated_tokens": 3, "is_censored": 1})
    with pytest.raises(ValueError, match="token ids in"):
        StartBody.from_wire({"request_id": "a", "prompt_ids": [VOCAB]}, VOCAB)


@pytest.mark.parametrize(("reply", "message"), [
    ({"tree": []}, "without a list"),
    ({"trees": []}, "0 trees for 1 requests"),
    ({"trees": [{"tokens": "not a tree"}]}, "malformed tree"),
    ({"trees": [None], "missing": "a"}, "missing"),
])
def test_a_malformed_propose_reply_is_a_malformed_reply(reply: Any, message: str) -> None:
    with pytest.raises(MalformedReply, match=message):
        ProposeReply.from_wire(reply, 1, speculator=0)


def test_a_malformed_verifier_reply_is_a_malformed_reply() -> None:
    with pytest.raises(MalformedReply, match="lacks \\['length'\\]"):
        PrefillReply.from_wire({"rows": [{"row": 0}]}, [0])
    with pytest.raises(MalformedReply, match="asked for rows"):
        PrefillReply.from_wire({"rows": [{"row": 1, "length": 2}]}, [0])
    with pytest.raises(MalformedReply, match="predicted_len"):
        PredictReply.from_wire({"predicted_len": float("nan")})
    for reply in ({"predicted_lens": [1.0]}, {"predicted_lens": [1.0, float("inf")]}, {"predicted_lens": [1.0, True]}, []):
        with pytest.raises(MalformedReply, match="2 finite 'predicted_lens'"):
            PredictBatchReply.from_wire(reply, 2)
    with pytest.raises(ValueError, match="non-empty list"):
        PredictBatchBody.from_wire({"requests": []}, VOCAB)


async def test_the_verifier_rejects_a_malformed_body_at_its_entry_before_any_compute() -> None:
    # An unstarted shard: a body that passes validation meets "not started"; a malformed one
    # never gets that far.
    shard = VerifierShard({"model": "unused"})
    good = step_wire()
    with pytest.raises(RuntimeError, match="not started"):
        await shard.step(good)
    wrong_row = {**good, "rows": [{**good["rows"][0], "row": "0"}, good["rows"][1]]}
    with pytest.raises(ValueError, match="row must be an integer"):
        await shard.step(wrong_row)
    with pytest.raises(ValueError, match="missing fields \\['prompt_ids'\\]"):
        await shard.prefill({"rows": [{"row": 0}]})
    with pytest.raises(ValueError, match="missing fields \\['row'\\]"):
        await shard.release({"request_id": "r0"})


async def test_the_speculator_rejects_a_malformed_body_at_its_entry() -> None:
    speculator = SpeculatorActor({"model": "unused", "speculators": [{"kind": "ngram"}]})
    speculator._model = tiny.make_tiny_model()  # what on_start loads: the vocabulary the checks use
    speculator._drafters = [None]  # an n-gram speculator drafts with no model
    vocab = speculator._model.config.vocab_size
    entry = {"request_id": "a", "new_tokens": [], "max_depth": 2, "params": params_to_wire(SamplingParams())}
    with pytest.raises(ValueError, match="missing fields \\['max_depth'\\]"):
        await speculator.propose({"requests": [{k: v for k, v in entry.items() if k != "max_depth"}]})
    with pytest.raises(ValueError, match="token ids in"):
        await speculator.propose({"requests": [{**entry, "new_tokens": [vocab]}]})
    with pytest.raises(ValueError, match="prompt_ids"):
        await speculator.start({"request_id": "a", "prompt_ids": "1 2 3"})
    await speculator.start({"request_id": "a", "prompt_ids": [5, 6, 7, 5, 6]})
    reply = ProposeReply.from_wire(await speculator.propose({"requests": [entry]}), 1, speculator=0)
    assert reply.missing == () and reply.trees[0] is not None and reply.trees[0].root_token == 6


# ---------------------------------------------------------------------- params once per request
def test_a_requests_params_are_parsed_once_per_receiver() -> None:
    cache = ParamsCache(max_entries=2)
    wire = params_to_wire(SAMPLED)
    first = cache.parse("a", wire)
    assert first == SAMPLED
    assert cache.parse("a", dict(wire)) is first  # an equal wire dict (the next step's): no parse
    changed = cache.parse("a", {**wire, "top_k": 5})
    assert changed.top_k == 5 and changed is not first  # a different dict is parsed again
    with pytest.raises(ValueError, match="temperature"):
        cache.parse("b", {**wire, "temperature": -1.0})  # malformed params are still refused
    cache.parse("b", wire)
    cache.parse("c", wire)
    assert len(cache) == 2  # bounded: the oldest request went first
    cache.forget("c")
    assert len(cache) == 1

    rows = tuple(StepRow(i, TokenTree.from_parents([-1], [3]), SAMPLED, "same") for i in range(3))
    parsed = StepBody.from_wire(through_codec(StepBody(rows).to_wire()), ParamsCache())
    assert parsed.rows[0].params is parsed.rows[1].params is parsed.rows[2].params


def test_dense_draft_probs_of_different_widths_are_refused() -> None:
    narrow = TokenTreeBuilder(3, with_probs=True)
    narrow.add_proposal(0, 5, q_row=narrow.add_probs(torch.softmax(torch.randn(VOCAB - 1), -1)))
    with pytest.raises(ValueError, match="different vocab sizes"):
        StepBody((StepRow(0, dense_tree(3, 0), SAMPLED, "a"), StepRow(1, narrow.build(), SAMPLED, "b"))).to_wire()
