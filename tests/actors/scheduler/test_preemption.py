"""Limited preemption in ``SchedulerCore`` (fake verifier, fake clock): who is preempted, when,
how a parked request resumes, and that the aging bound still holds.

The bound test runs a long, looping request against an endless stream of short ones; the same
check fails for a rule that preempts without limit and ignores promotion (tried below), so it is
not a check that any scheduler passes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from treeserve.actors.scheduler import preemption as preemption_module
from treeserve.actors.scheduler.core import SchedulerCore
from treeserve.actors.scheduler.preemption import LOOP_NGRAM, RepeatWatch, predicted_remaining
from treeserve.actors.scheduler.types import Move, RequestFinished, SchedulerConfig
from treeserve.actors.messages.gateway import GenerateBody
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculation_modes import SpeculationMode

from treeserve_testing.core_steps import admitted, verify

EOS = 2
CYCLE = [10 + i for i in range(LOOP_NGRAM)]  # an answer that repeats this loops at 2 * LOOP_NGRAM tokens


def make_core(**overrides: Any) -> SchedulerCore:
    base: dict[str, Any] = {"num_rows": 1, "preempt_rows": 1, "row_capacity": 1024, "vocab_size": 100,
                            "max_tree_nodes": 4, "adaptive_speculation": False, "max_decode_steps": 1,
                            "policy": "ssjf", "max_wait_s": 1000.0}
    return SchedulerCore(SchedulerConfig(**{**base, **overrides}))


def submit(core: SchedulerCore, rid: str, now: float, *, max_tokens: int, predicted: float | None) -> Any:
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(EOS,))
    req = core.submit(rid, GenerateBody(rid, (1, 2, 3), params, SpeculationMode.NONE), now)
    core.enqueue(req, predicted)
    return req


def loop_tokens(start: int, count: int) -> list[int]:
    return [CYCLE[(start + i) % len(CYCLE)] for i in range(count)]


def run_looping(core: SchedulerCore, rid: str, now: float, num_tokens: int) -> float:
    """Step until ``rid`` (the only running request) has written ``num_tokens`` looping tokens."""
    while rid not in core._running or len(core._running[rid].emitted) < num_tokens:
        plan = core.plan(now)
        done = len(core._running[rid].emitted)
        verify(core, plan, now, {rid: loop_tokens(done, 1)})
        now += 0.01
    return now


# ---------------------------------------------------------------------------------- the watch
def test_the_repeat_watch_flags_the_first_repeated_run() -> None:
    watch = RepeatWatch(4)
    answer: list[int] = []
    for token in [1, 2, 3, 4, 5, 6, 1, 2, 3]:
        answer.append(token)
        watch.feed(answer, 1)
    assert watch.loop_at is None  # 1 2 3 repeats, but no run of 4 does
    answer.append(4)
    watch.feed(answer, 1)
    assert watch.loop_at == 10
    fed_at_once = RepeatWatch(4)
    fed_at_once.feed(answer, len(answer))
    assert fed_at_once.loop_at == 10


def test_predicted_remaining_runs_to_the_cap_once_looping() -> None:
    assert predicted_remaining(100, 512, 150.0, None) == 50.0
    assert predicted_remaining(100, 512, 150.0, 90) == 412.0
    assert predicted_remaining(200, 512, 150.0, None) == 1.0  # past its prediction: about to end
    assert predicted_remaining(0, 64, None, None) == 64.0  # no prediction: its cap


# ---------------------------------------------------------------------------------- the core
def test_a_looping_row_parks_for_a_far_shorter_job_and_resumes_after_it() -> None:
    core = make_core()
    submit(core, "long", 0.0, max_tokens=400, predicted=300.0)
    now = run_looping(core, "long", 0.0, 2 * LOOP_NGRAM)
    assert core._running["long"].repeats.loop_at == 2 * LOOP_NGRAM
    submit(core, "short", now, max_tokens=16, predicted=5.0)
    plan = core.plan(now)
    assert plan.moves == (Move("long", 0, 1),)
    assert admitted(plan) == ["short"] and [r.request_id for r in plan.rows] == ["short"]
    verify(core, plan, now, {"short": [7, 7, EOS]})
    resumed = core.plan(now + 0.01)
    assert resumed.moves == (Move("long", 1, 0),) and not resumed.prefill_chunks
    assert [r.request_id for r in resumed.rows] == ["long"]
    stats = core.snapshot()
    assert (stats["num_preempted"], stats["num_resumed"], stats["num_parked"]) == (1, 1, 0)


def test_a_row_is_preempted_at_most_max_preemptions_times() -> None:
    core = make_core(max_preemptions=1)
    submit(core, "long", 0.0, max_tokens=400, predicted=300.0)
    now = run_looping(core, "long", 0.0, 2 * LOOP_NGRAM)
    for n in range(3):
        submit(core, f"short{n}", now, max_tokens=16, predicted=5.0)
        plan = core.plan(now)
        verify(core, plan, now, {r.request_id: [EOS] if r.request_id != "long" else loop_tokens(0, 1)
                                 for r in plan.rows})
        now += 0.01
    assert core.stats.num_preempted == 1


@pytest.mark.parametrize("case", ["near_its_end", "not_much_longer", "promoted", "no_park_row", "stopped"])
def test_no_preemption(case: str) -> None:
    core = make_core(**({"max_wait_s": 0.5} if case == "promoted" else {}),
                     **({"preempt_rows": 0, "policy": "ssjf"} if case == "no_park_row" else {}))
    cap = 2 * LOOP_NGRAM + 40 if case == "near_its_end" else 400
    submit(core, "long", 0.0, max_tokens=cap, predicted=300.0)
    now = run_looping(core, "long", 0.0, 2 * LOOP_NGRAM)
    if case == "promoted":
        now = 10.0  # past the long request's deadline (arrival + max_wait_s)
    if case == "stopped":
        assert core.stop("long", 2 * LOOP_NGRAM)
    submit(core, "short", now, max_tokens=200, predicted=200.0 if case == "not_much_longer" else 5.0)
    plan = core.plan(now)
    assert plan.moves == ()
    assert core.stats.num_preempted == 0


def test_a_cancelled_parked_request_frees_its_park_row() -> None:
    core = make_core()
    long = submit(core, "long", 0.0, max_tokens=400, predicted=300.0)
    now = run_looping(core, "long", 0.0, 2 * LOOP_NGRAM)
    submit(core, "short", now, max_tokens=16, predicted=5.0)
    plan = core.plan(now)
    assert plan.moves == (Move("long", 0, 1),)
    verify(core, plan, now, {"short": [7]})
    core.cancel(long)
    plan = core.plan(now + 0.01)
    assert [(r.request_id, r.row) for r in plan.releases] == [("long", 1)]
    assert core.snapshot()["num_parked"] == 0 and core._free_park_rows == [1]


def test_a_verifier_failure_ends_parked_requests_too() -> None:
    from treeserve.runtime import ActorDeadError

    core = make_core()
    submit(core, "long", 0.0, max_tokens=400, predicted=300.0)
    now = run_looping(core, "long", 0.0, 2 * LOOP_NGRAM)
    submit(core, "short", now, max_tokens=16, predicted=5.0)
    verify(core, core.plan(now), now, {"short": [7]})
    ended = core.verifier_failed(ActorDeadError("gone"))
    assert sorted(e.request_id for e in ended.events) == ["long", "short"]
    assert core.num_open == 0 and core.plan(now).is_idle
    submit(core, "next", now, max_tokens=8, predicted=4.0)
    assert admitted(core.plan(now)) == ["next"]


# ---------------------------------------------------------------------------------- the aging bound
MAX_WAIT_S = 2.0
STEP_S = 0.01


def long_request_end(core: SchedulerCore, num_steps: int = 3000) -> tuple[float | None, int]:
    """A looping request of 400 tokens, then a short request arriving every step (each predicted
    at 5 tokens, ending at its first step, so the stream alone keeps the row busy without a backlog): when the long one finishes (None: not within ``num_steps``) and
    how often it was preempted."""
    submit(core, "long", 0.0, max_tokens=400, predicted=300.0)
    now, arrivals = run_looping(core, "long", 0.0, 2 * LOOP_NGRAM), 0  # it loops; then the stream starts
    for _ in range(num_steps):
        submit(core, f"s{arrivals}", now, max_tokens=16, predicted=5.0)
        arrivals += 1
        plan = core.plan(now)
        tokens = {}
        for row in plan.rows:
            req = core._running[row.request_id]
            tokens[row.request_id] = (loop_tokens(len(req.emitted), 1) if row.request_id == "long"
                                      else [EOS])
        events = verify(core, plan, now, tokens)
        now += STEP_S
        if any(isinstance(e, RequestFinished) and e.request_id == "long" for e in events.events):
            return now, core.stats.num_preempted
    return None, core.stats.num_preempted


def bound_s() -> float:
    # Promoted by arrival + max_wait_s + one step, it resumes at once (its deadline is the
    # earliest of all: it arrived first) and is never preempted again, so at most its 400 tokens
    # follow, one a step (a few steps of slack).
    return MAX_WAIT_S + STEP_S + 400 * STEP_S + 25 * STEP_S


def test_a_preempted_request_still_meets_the_aging_bound() -> None:
    finished, preempted = long_request_end(make_core(max_wait_s=MAX_WAIT_S, max_preemptions=3))
    assert preempted >= 1  # the stream did preempt it
    assert finished is not None and finished <= bound_s()


def test_the_bound_check_fails_for_preemption_that_restarts_the_aging_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug the rules exclude: a preempted request queued as a new arrival, preempted without
    limit and whatever its deadline. It then starves behind the stream, and the same check catches it."""
    monkeypatch.setattr(preemption_module, "may_preempt", lambda remaining, head_len, count, limit: remaining >= 2 * head_len)
    core = make_core(max_wait_s=MAX_WAIT_S)
    add = core._policy.add

    def add_as_new_arrival(request: Any, now: float) -> None:
        if core._requests[request.request_id].is_parked:
            request = dataclasses.replace(request, arrival_s=now)
        add(request, now)

    monkeypatch.setattr(core._policy, "add", add_as_new_arrival)
    monkeypatch.setattr(core._policy, "is_promoted", lambda request, now: False)
    finished, preempted = long_request_end(core)
    assert preempted > 3
    assert finished is None or finished > bound_s()
