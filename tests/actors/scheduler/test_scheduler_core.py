"""``SchedulerCore`` alone: no sockets, no actors, and a fake clock (every ``now`` is passed in).

A fake verifier answers each plan row with tokens the test picks; the core's decisions are
checked directly: admission order (FCFS, SSJF), aging, cancellation, stop strings, prefill
chunks, the stopping rule (max tokens, EOS), faults, and speculator fan-out and recovery.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from treeserve.actors.scheduler.core import SchedulerCore
from treeserve.actors.scheduler.types import LengthReport, Release, RequestFailed, RequestFinished, RequestState, SchedulerConfig, SchedulerFault, ServiceUnavailable, StepEvents, StepPlan, StepReplies, TokensOut
from treeserve.actors.gateway.request import InvalidRequest
from treeserve.actors.messages.checks import MalformedReply
from treeserve.actors.messages.gateway import GenerateBody
from treeserve.actors.messages.verifier import RowVerdict
from treeserve.actors.messages.tree_wire import tree_to_wire
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculation_modes import SpeculationMode
from treeserve.ops.token_tree import TokenTree
from treeserve.runtime import ActorDeadError, ActorError, RemoteError
from treeserve.transport.wire import ErrorCode
from treeserve_testing.core_steps import admitted, verify

EOS = 2


def make_core(num_speculators: int = 0, **overrides: Any) -> SchedulerCore:
    base: dict[str, Any] = {"num_rows": 2, "row_capacity": 64, "vocab_size": 100, "max_tree_nodes": 4,
                            "adaptive_speculation": False, "max_decode_steps": 1}  # decode-ahead: its own tests
    return SchedulerCore(SchedulerConfig(**{**base, **overrides}), num_speculators=num_speculators)


def submit(core: SchedulerCore, rid: str, now: float, *, prompt: Sequence[int] = (1, 2, 3), max_tokens: int = 8,
           predicted: float | None = None, speculate: str = "none") -> RequestState:
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(EOS,))
    req = core.submit(rid, GenerateBody(rid, tuple(prompt), params, SpeculationMode(speculate)), now)
    core.enqueue(req, predicted)
    return req


def step(
    core: SchedulerCore, now: float, tokens: Mapping[str, Sequence[int]] | None = None
) -> tuple[StepPlan, StepEvents]:
    plan = core.plan(now)
    return plan, verify(core, plan, now, tokens)


def streamed(events: StepEvents) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for event in events.events:
        if isinstance(event, TokensOut):
            out.setdefault(event.request_id, []).extend(event.token_ids)
    return out


def finished(events: StepEvents | StepPlan) -> dict[str, dict[str, Any]]:
    items = events.events if isinstance(events, StepEvents) else events.finished
    return {e.request_id: e.summary for e in items if isinstance(e, RequestFinished)}


def failures(events: StepEvents) -> dict[str, ActorError]:
    return {e.request_id: e.error for e in events.events if isinstance(e, RequestFailed)}


def run_one_at_a_time(core: SchedulerCore, now: float, count: int) -> list[str]:
    """Admission order on one row: every admitted request emits EOS in its first step."""
    order: list[str] = []
    while len(order) < count:
        plan = core.plan(now)
        verify(core, plan, now, {row.request_id: [EOS] for row in plan.rows})
        order += admitted(plan)
        now += 1.0
    return order


# ---------------------------------------------------------------------- admission
@pytest.mark.parametrize(("policy", "expected"),
                         [("fcfs", ["long", "short", "mid"]), ("ssjf", ["short", "mid", "long"])])
def test_admission_order_follows_the_policy(policy: str, expected: list[str]) -> None:
    core = make_core(num_rows=1, policy=policy, max_wait_s=1000.0)
    for t, (rid, predicted) in enumerate([("long", 40.0), ("short", 5.0), ("mid", 20.0)]):
        submit(core, rid, float(t), max_tokens=50, predicted=predicted)
    assert run_one_at_a_time(core, 10.0, 3) == expected


def test_a_prediction_that_lands_later_rekeys_a_queued_request() -> None:
    core = make_core(num_rows=1, policy="ssjf", max_wait_s=1000.0)
    submit(core, "blocker", 0.0, max_tokens=50)
    step(core, 0.0)  # holds the only row
    early = submit(core, "early", 0.1, max_tokens=50)  # queued at once, keyed by max_tokens
    late = submit(core, "late", 0.2, max_tokens=50)
    assert core.is_queued(early) and core.is_queued(late)
    assert core.set_prediction(late, 4.0) and core.set_prediction(early, 30.0)
    assert late.predicted_len == 4.0 and core.snapshot()["num_rekeyed"] == 2
    core.cancel(core._running["blocker"])
    assert admitted(core.plan(1.0)) == ["late"]  # overtook the earlier arrival once its prediction landed


def test_a_request_is_admitted_before_its_prediction_and_the_prediction_is_still_recorded() -> None:
    core = make_core(num_rows=1, policy="ssjf", max_wait_s=1000.0)
    req = submit(core, "a", 0.0, max_tokens=10)
    assert admitted(core.plan(0.0)) == ["a"]  # a free row: no prediction needed to admit
    assert not core.set_prediction(req, 900.0)  # not queued any more: nothing to re-key
    assert req.predicted_len == 10.0  # clipped to max_tokens; kept for the summary and the learner
    _, events = step(core, 1.0, {"a": [EOS]})
    assert finished(events)["a"]["predicted_len"] == 10.0
    assert events.events[-1].report == LengthReport("a", 1, False)  # type: ignore[union-attr]


def test_a_client_length_hint_keys_the_request_and_caps_a_prediction() -> None:
    core = make_core(num_rows=1, policy="ssjf", max_wait_s=1000.0)
    submit(core, "blocker", 0.0, max_tokens=50)
    step(core, 0.0)
    params = SamplingParams(max_new_tokens=50, stop_token_ids=(EOS,))
    unhinted = core.submit("unhinted", GenerateBody("unhinted", (1, 2), params, SpeculationMode.NONE), 0.1)
    core.enqueue(unhinted)  # keyed by max_tokens (50)
    hinted = core.submit("hinted", GenerateBody("hinted", (1, 2), params, SpeculationMode.NONE, length_hint=6), 0.2)
    core.enqueue(hinted)  # keyed by its hint at once
    huge = core.submit("huge-hint", GenerateBody("huge-hint", (1, 2), params, SpeculationMode.NONE, length_hint=10_000),
                       0.3)
    core.enqueue(huge)  # a hint above max_tokens counts as max_tokens
    assert hinted.expected_len == 6.0 and core.snapshot()["num_hinted"] == 2
    core.set_prediction(hinted, 20.0)  # the smaller of hint and prediction keys it
    assert hinted.expected_len == 6.0
    core.cancel(core._running["blocker"])
    assert run_one_at_a_time(core, 1.0, 3) == ["hinted", "unhinted", "huge-hint"]


def test_aging_promotes_a_request_that_waited_max_wait_over_shorter_ones() -> None:
    def order(max_wait_s: float) -> list[str]:
        core = make_core(num_rows=1, policy="ssjf", max_wait_s=max_wait_s)
        submit(core, "long", 0.0, max_tokens=50, predicted=40.0)
        seen: list[str] = []
        for t in range(0, 16, 2):  # a shorter request arrives every 2 s; each runs for one step
            submit(core, f"short{t}", float(t), max_tokens=50, predicted=2.0)
            plan = core.plan(t + 0.5)
            verify(core, plan, t + 0.5, {row.request_id: [EOS] for row in plan.rows})
            seen += admitted(plan)
        return seen

    # Deadlines scale with the predicted service (``actors/scheduler/policy_aging.py``): "long" (40 tokens)
    # is promoted at 0 + 10 * 40/256 = 1.56 s, before short2's 2 + 10 * 2/256 = 2.08 s, so the
    # step of t = 2.5 admits it ahead of the shorter short2, and the shorts follow in deadline order.
    assert order(10.0) == ["short0", "long", "short2", "short4", "short6", "short8", "short10", "short12"]
    assert "long" not in order(1000.0)  # without aging it starves behind the stream of shorter ones


def test_admission_takes_the_lowest_free_rows_and_refuses_a_taken_id_or_a_full_queue() -> None:
    core = make_core(num_rows=3, row_capacity=20, max_queue=3)
    for rid in "abc":
        submit(core, rid, 0.0)
    with pytest.raises(ActorError) as full:
        submit(core, "d", 0.0)
    assert full.value.code is ErrorCode.OVERLOADED
    plan = core.plan(1.0)
    assert [(a.request_id, a.row) for chunk in plan.prefill_chunks for a in chunk] == [("a", 0), ("b", 1), ("c", 2)]
    with pytest.raises(InvalidRequest, match="already in use"):
        submit(core, "a", 1.0)


def test_admissions_share_prefill_chunks_up_to_max_prefill_tokens() -> None:
    core = make_core(num_rows=4, max_prefill_tokens=10)
    for rid, n in [("a", 4), ("b", 6), ("c", 3), ("d", 12)]:
        submit(core, rid, 0.0, prompt=[1] * n)
    plan = core.plan(1.0)
    assert [[a.request_id for a in chunk] for chunk in plan.prefill_chunks] == [["a", "b"], ["c"], ["d"]]
    assert [r.request_id for r in plan.rows] == ["a", "b", "c", "d"]  # the admitted rows run this step


# ---------------------------------------------------------------------- cancellation and stop strings
def test_cancelled_requests_leave_the_queue_and_free_their_rows() -> None:
    core = make_core(num_rows=1)
    a, b, _ = (submit(core, rid, 0.0, predicted=6.0) for rid in "abc")
    plan, events = step(core, 1.0)
    assert admitted(plan) == ["a"] and streamed(events) == {"a": [7]}
    assert core.cancel(b) == LengthReport("b", 0, is_censored=True)  # queued: dropped at once
    assert core.snapshot()["num_queued"] == 1
    plan = core.plan(2.0)
    assert core.cancel(a) == LengthReport("a", 1, is_censored=True)  # running: cancelled mid-step
    events = verify(core, plan, 2.0)
    assert "a" not in streamed(events)
    plan = core.plan(3.0)  # a's row is released, then given to c; b never runs
    assert plan.releases == (Release("a", 0, speculates=False),)
    assert admitted(plan) == ["c"] and plan.rows[0].row == 0
    assert core.cancel(a) is None  # ended: nothing more to do
    assert core.snapshot()["num_cancelled"] == 2


def test_a_stop_string_ends_the_request_at_its_token_before_the_next_step() -> None:
    core = make_core()
    submit(core, "a", 0.0, max_tokens=20, predicted=10.0)
    submit(core, "b", 0.0, max_tokens=20)
    step(core, 1.0, {"a": [5, 6, 7, 8]})
    assert core.stop("a", 3) and core.stop("a", 2)  # the earliest match wins
    assert not core.stop("nobody", 1)
    plan = core.plan(2.0)
    assert finished(plan)["a"]["finish_reason"] == "stop" and finished(plan)["a"]["num_generated_tokens"] == 2
    assert plan.finished[0].report == LengthReport("a", 2, is_censored=False)
    assert plan.releases == (Release("a", 0, speculates=False),)
    assert [r.request_id for r in plan.rows] == ["b"]
    assert not core.stop("a", 1)  # no longer running


# ---------------------------------------------------------------------- the stopping rule
def test_max_tokens_cuts_the_verified_tokens_and_finishes() -> None:
    core = make_core()
    submit(core, "a", 0.0, max_tokens=5)
    plan, events = step(core, 1.0, {"a": [5, 6, 7]})
    assert plan.rows[0].max_depth == 4 and streamed(events) == {"a": [5, 6, 7]} and not finished(events)
    plan, events = step(core, 3.0, {"a": [8, 9, 10]})
    assert plan.rows[0].max_depth == 1  # two tokens left: a tree of depth 1 plus the bonus token
    assert streamed(events) == {"a": [8, 9]}
    summary = finished(events)["a"]
    assert summary["finish_reason"] == "length" and summary["num_generated_tokens"] == 5 and summary["num_steps"] == 2
    assert (summary["queue_s"], summary["ttft_s"], summary["total_s"]) == (1.0, 1.0, 3.0)  # the fake clock
    assert events.releases == (Release("a", 0, speculates=False),)
    assert core.plan(4.0).is_idle


def test_eos_finishes_and_drops_the_tokens_after_it() -> None:
    core = make_core()
    submit(core, "a", 0.0)
    submit(core, "b", 0.0)
    _, events = step(core, 1.0, {"a": [5, EOS, 7], "b": [5, 6, 7]})
    assert streamed(events) == {"a": [5, EOS], "b": [5, 6, 7]}
    assert finished(events)["a"]["finish_reason"] == "stop" and "b" not in finished(events)
    assert [r.request_id for r in core.plan(2.0).rows] == ["b"]


# ---------------------------------------------------------------------- faults
def test_a_failed_row_ends_that_request_alone_non_retryably() -> None:
    core = make_core()
    submit(core, "a", 0.0)
    submit(core, "b", 0.0)
    plan = core.plan(1.0)
    events = verify(core, plan, 1.0, errors={"a": "numerical failure: nan"})
    error = failures(events)["a"]
    assert isinstance(error, SchedulerFault) and not error.retryable and "numerical failure" in error.message
    assert streamed(events) == {"b": [7]} and events.releases == (Release("a", 0, speculates=False),)
    assert core.snapshot()["num_row_failures"] == 1


@pytest.mark.parametrize(("cause", "is_retryable"),
                         [(ActorDeadError("rank 1 died"), True), (RemoteError("bug"), False)])
def test_a_verifier_failure_fails_the_running_requests_and_keeps_the_queue(
    cause: ActorError, is_retryable: bool
) -> None:
    core = make_core(num_rows=1)
    submit(core, "a", 0.0)
    submit(core, "b", 0.0)
    step(core, 1.0)
    error = failures(core.verifier_failed(cause))["a"]
    assert isinstance(error, ServiceUnavailable if is_retryable else SchedulerFault) and error.retryable is is_retryable
    plan = core.plan(2.0)  # the rows died with the shard: nothing to release, b takes row 0
    assert plan.releases == () and admitted(plan) == ["b"] and plan.rows[0].row == 0


def test_fail_all_ends_every_open_request_and_releases_the_held_rows() -> None:
    core = make_core(num_rows=1)
    a = submit(core, "a", 0.0)
    submit(core, "b", 0.0)
    waiting = core.submit("c", GenerateBody("c", (1, 2), SamplingParams(max_new_tokens=8), SpeculationMode.NONE),
                          0.0)  # submitted, not yet queued
    step(core, 1.0)
    ended = core.fail_all(SchedulerFault("boom"))
    assert set(failures(ended)) == {"a", "b", "c"} and ended.releases == (Release("a", 0, speculates=False),)
    core.enqueue(waiting, None)  # queued after the failure: it stays ended
    assert not core.set_prediction(waiting, 3.0)  # and so does a prediction that lands late
    assert core.snapshot()["num_queued"] == 0 and core.plan(2.0).is_idle
    submit(core, "a", 3.0)  # ids are free again and the next request runs
    assert admitted(core.plan(3.0)) == ["a"] and core.cancel(a) is None


# ---------------------------------------------------------------------- speculator fan-out
def test_proposals_merge_per_row_and_a_speculator_that_lost_state_gets_the_history() -> None:
    core = make_core(num_speculators=2, max_tree_nodes=5)
    submit(core, "a", 0.0, prompt=[1, 2, 3], max_tokens=8, speculate="tree")
    plan = core.plan(1.0)
    core.prefilled(plan.prefill_chunks[0], [None])
    asks = core.proposal_asks(plan)
    assert [(ask.speculator, ask.body["requests"][0]["max_nodes"]) for ask in asks] == [(0, 3), (1, 3)]
    assert all("history" not in ask.body["requests"][0] for ask in asks)
    chain = tree_to_wire(TokenTree.from_parents([-1, 0, 1], [3, 10, 11]))
    fork = tree_to_wire(TokenTree.from_parents([-1, 0, 0], [3, 10, 12]))
    (tree,) = core.merge_proposals(plan, asks, [{"trees": [chain]}, {"trees": [fork], "missing": ["a"]}])
    assert tree.tokens.tolist() == [3, 10, 11, 12] and tree.parents.tolist() == [-1, 0, 1, 0]
    core.apply(plan, StepReplies((tree,), (RowVerdict(0, (0, 1), (10, 20)),), 0.0, 0.0), 2.0)

    plan = core.plan(3.0)
    core.speculator_failed(0)  # speculator 0's start of a later request failed: rebuild it too
    asks = core.proposal_asks(plan)
    entries = [ask.body["requests"][0] for ask in asks]
    assert [e.get("history") for e in entries] == [[1, 2, 3, 10, 20], [1, 2, 3, 10, 20]]
    assert [e["new_tokens"] for e in entries] == [[10, 20], [10, 20]] and entries[0]["max_depth"] == 5
    with pytest.raises(MalformedReply, match="without a list"):
        core.merge_proposals(plan, asks, [{"tree": []}, None])


def test_a_tree_is_cut_to_the_tokens_still_allowed_and_chain_rows_keep_one_chain() -> None:
    core = make_core(num_speculators=1, max_tree_nodes=5)
    submit(core, "tree", 0.0, max_tokens=2, speculate="tree")
    submit(core, "chain", 0.0, max_tokens=8, speculate="chain")
    plan = core.plan(1.0)
    assert [(r.max_nodes, r.max_depth) for r in plan.rows] == [(5, 1), (5, 7)]
    deep = tree_to_wire(TokenTree.from_parents([-1, 0, 1, 0], [3, 10, 11, 12]))
    trees = core.merge_proposals(plan, core.proposal_asks(plan), [{"trees": [deep, deep]}])
    assert [t.tokens.tolist() for t in trees] == [[3, 10, 12], [3, 10, 11]]


# ---------------------------------------------------------------------- decode-ahead
def decode(core: SchedulerCore, now: float, verify_s: float, tokens: Mapping[str, Sequence[int]]) -> StepPlan:
    """One step whose verifier call took ``verify_s``; row ``r`` emits ``tokens[r]``."""
    plan = core.plan(now)
    for chunk in plan.prefill_chunks:
        core.prefilled(chunk, [None] * len(chunk))
    trees = core.merge_proposals(plan, core.proposal_asks(plan), [])
    verdicts = tuple(RowVerdict(r.row, (0,), tuple(tokens[r.request_id])) for r in plan.rows)
    core.apply(plan, StepReplies(trees, verdicts, propose_s=0.0, verify_s=verify_s), now)
    return plan


def test_decode_ahead_runs_as_many_plain_steps_as_fit_once_every_row_streams_and_nothing_waits() -> None:
    core = make_core(max_decode_steps=8, decode_ahead_s=0.1, num_rows=2)
    submit(core, "a", 0.0, max_tokens=40)
    assert decode(core, 1.0, 0.02, {"a": [5]}).decode_steps == 1  # the first token as soon as it can
    assert decode(core, 1.1, 0.05, {"a": [5] * 5}).decode_steps == 5  # 0.1 s of the 20 ms steps measured
    assert decode(core, 1.2, 0.08, {"a": [5] * 8}).decode_steps == 8  # 10 ms a step: 10 fit, at most 8
    submit(core, "b", 1.25, max_tokens=40)  # admitted next: its first token comes alone, so does a's
    assert decode(core, 1.3, 0.01, {"a": [5], "b": [6]}).decode_steps == 1
    assert decode(core, 1.4, 0.08, {"a": [5] * 8, "b": [6] * 8}).decode_steps == 8
    submit(core, "c", 1.45, max_tokens=40)  # waits for a row: no decode-ahead while it does
    assert decode(core, 1.5, 0.01, {"a": [5], "b": [6]}).decode_steps == 1
    assert core.snapshot()["num_queued"] == 1


def test_decode_ahead_stops_at_max_tokens_counts_each_forward_and_never_speculates() -> None:
    core = make_core(max_decode_steps=8, num_speculators=1)
    submit(core, "a", 0.0, max_tokens=6)
    decode(core, 1.0, 0.001, {"a": [5]})
    plan = core.plan(2.0)
    assert plan.decode_steps == 5  # what max_tokens leaves
    too_many = (RowVerdict(0, (0,), (5,) * 6),)
    with pytest.raises(ValueError, match="6 tokens from a step of 5 decode steps"):
        core.apply(plan, StepReplies((TokenTree.from_parents([-1], [5]),), too_many, 0.0, 0.001), 2.0)
    core = make_core(max_decode_steps=8, num_speculators=1)
    submit(core, "a", 0.0, max_tokens=6)
    decode(core, 1.0, 0.001, {"a": [5]})
    plan = core.plan(2.0)
    trees = core.merge_proposals(plan, core.proposal_asks(plan), [])
    events = core.apply(plan, StepReplies(trees, (RowVerdict(0, (0,), (5, 6, 7, 8, 9)),), 0.0, 0.005), 2.0)
    summary = finished(events)["a"]
    assert streamed(events) == {"a": [5, 6, 7, 8, 9]} and summary["finish_reason"] == "length"
    assert summary["num_steps"] == 6 and summary["mean_accepted_per_step"] == 1.0  # one forward per token
    assert core.stats.num_steps == 2 and core.stats.num_decode_steps == 6
    submit(core, "s", 3.0, max_tokens=20, speculate="tree")
    submit(core, "p", 3.0, max_tokens=20)
    for now in (4.0, 5.0, 6.0):  # a speculating row keeps every step to one
        plan = core.plan(now)
        assert plan.decode_steps == 1
        verify(core, plan, now)


class FixedBudget:
    """An adaptive policy stand-in: the tree budget the test sets (``budget``), and every
    observed step's arguments (``observed``)."""

    def __init__(self) -> None:
        self.budget = 1
        self.observed: list[dict[str, Any]] = []

    def tree_budget(self, num_rows: int) -> int:
        return self.budget

    def observe(self, **kwargs: Any) -> None:
        self.observed.append(kwargs)


def test_decode_ahead_runs_when_the_adaptive_policy_chooses_no_speculation() -> None:
    """Speculating requests at an adaptive budget of 1 draft nothing, so a call decodes ahead
    as for plain requests (before, every such step paid the scheduler's and the hop's cost:
    adaptive serving was 0.73x plain decoding at one client on fresh traffic); the policy
    learns one plain step of the call's mean forward time. A budget above 1 keeps one step a
    call. A feature drafter's rows decode ahead too: the call brings a state per token, and
    the next proposal carries every token and state since the last one."""
    core = make_core(max_decode_steps=8, decode_ahead_s=0.1, num_speculators=1, adaptive_speculation=True)
    policy = FixedBudget()
    observed = policy.observed
    core._adaptive = policy  # type: ignore[assignment]
    submit(core, "a", 0.0, max_tokens=40, speculate="tree")
    assert decode(core, 1.0, 0.02, {"a": [5]}).decode_steps == 1  # the first token alone
    plan = decode(core, 1.1, 0.05, {"a": [5] * 5})
    assert plan.decode_steps == 5 and plan.rows[0].max_nodes == 1
    assert observed[-1]["budget"] == 1 and observed[-1]["verify_s"] == pytest.approx(0.01)
    policy.budget = 4
    assert core.plan(1.2).decode_steps == 1
    states = make_core(max_decode_steps=8, num_speculators=1, adaptive_speculation=True, use_states=True)
    states._adaptive = FixedBudget()  # type: ignore[assignment]
    submit(states, "a", 0.0, max_tokens=40, speculate="tree")
    dim = 3
    for now, emitted in ((1.0, [5]), (1.1, [6, 7, 8, 9, 10])):
        plan = states.plan(now)
        for chunk in plan.prefill_chunks:
            states.prefilled(chunk, [np.zeros((2, dim), np.float32)] * len(chunk))
        assert plan.wants_states and plan.decode_steps == len(emitted)  # 1 (the first token), then 0.1 s of 20 ms
        assert states.proposal_asks(plan) == ()  # budget 1: no speculator is asked
        trees = states.merge_proposals(plan, (), [])
        verdict = RowVerdict(plan.rows[0].row, (0,), tuple(emitted),
                             np.arange(len(emitted) * dim, dtype=np.float32).reshape(-1, dim) + emitted[0])
        states.apply(plan, StepReplies(trees, (verdict,), propose_s=0.0, verify_s=0.02 * len(emitted)), now)
    states._adaptive.budget = 4  # type: ignore[attr-defined]
    (ask,) = states.proposal_asks(states.plan(1.2))
    (entry,) = ask.request.requests
    assert entry.new_tokens == (5, 6, 7, 8, 9, 10)
    assert entry.states is not None and entry.states.shape == (2 + 6, dim)  # the prompt's, then one per token
    assert entry.states[-1, 0] == 6 + 12  # the decode-ahead call's last root's state, in order


def test_a_speculating_request_releases_the_tokens_its_speculators_have_not_seen() -> None:
    """The suffix index outlives a request, and at an adaptive budget of 1 no proposal carries
    the request's tokens to it: its release does, from the last proposal on (a speculator to be
    rebuilt from the history gets none, they would be out of step)."""
    core = make_core(max_decode_steps=8, decode_ahead_s=0.1, num_speculators=1, adaptive_speculation=True)
    core._adaptive = policy = FixedBudget()  # type: ignore[assignment]
    for rid in ("a", "c"):
        submit(core, rid, 0.0, max_tokens=6, speculate="tree")
    decode(core, 1.0, 0.02, {"a": [5], "c": [5]})
    policy.budget = 4  # one proposal, which speculator 0 fails: both rows are to be rebuilt
    plan = core.plan(1.1)
    asks = core.proposal_asks(plan)
    assert [len(a.request.requests) for a in asks] == [2]
    trees = core.merge_proposals(plan, asks, [None])
    core.speculator_failed(0)
    verdicts = tuple(RowVerdict(r.row, (0,), (6,)) for r in plan.rows)
    core.apply(plan, StepReplies(trees, verdicts, propose_s=0.0, verify_s=0.02), 1.1)
    core._running["a"].needs_history.clear()  # as if a later proposal had rebuilt "a"
    policy.budget = 1
    plan = core.plan(1.2)
    assert plan.decode_steps == 4  # what max_tokens leaves
    verdicts = tuple(RowVerdict(r.row, (0,), (7, 8, 9, 10)) for r in plan.rows)
    ended = core.apply(plan, StepReplies(core.merge_proposals(plan, (), []), verdicts, propose_s=0.0, verify_s=0.08), 1.2)
    assert {r.request_id: (r.speculates, r.new_tokens) for r in ended.releases} == {
        "a": (True, (6, 7, 8, 9, 10)), "c": (True, ())}  # 6 came from the proposal's own step
