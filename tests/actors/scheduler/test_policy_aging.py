"""SSJF's aging bound under an adversarial stream, and why aging matters.

The stream: one long job arrives, then short jobs keep arriving faster than the server
can serve them. Shortest-first without aging serves the shorts forever; SSJF with
aging must select the long job within the documented bound
(:mod:`treeserve.actors.scheduler.policy_aging`): its deadline, the step gap and the requests with an
earlier deadline queued when it is promoted, which all arrived within ``max_wait_s`` after it.
The same checks run against deliberately broken policies that let a promoted request be passed
over, and must fail for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from treeserve.actors.scheduler.policy import HRRNPolicy, QueuedRequest, SchedulingPolicy, SSJFPolicy
from treeserve.actors.scheduler.policy_aging import AgingPolicy
from treeserve.actors.scheduler.policy_queue import Slot

DT = 1.0  # seconds between scheduler steps (the fake clock's tick)
MAX_WAIT_S = 20.0
MAX_TOKENS = 8192  # large enough that the "long" job's prediction is not capped


def adversarial_stream(num_steps: int) -> list[QueuedRequest]:
    """A long job at t=0.1 amid short jobs every 0.4 s (2.5 arrivals per 1-request step)."""
    shorts = [
        QueuedRequest(f"s{i}", round(0.4 * i, 6), 3, MAX_TOKENS, predicted_len=10.0, true_len=10)
        for i in range(int(num_steps / 0.4) + 1)
    ]
    long_job = QueuedRequest("long", 0.1, 8, MAX_TOKENS, predicted_len=5000.0, true_len=5000)
    return sorted([*shorts, long_job], key=lambda r: r.arrival_s)


@dataclass
class Outcome:
    waits: dict[str, float]  # request_id -> queueing wait of the selected requests
    num_ahead: dict[str, int]  # request_id -> requests queued when it was added
    arrivals: list[float]  # every arrival time of the stream
    num_left: int
    rekeyed_at: dict[str, float] = field(default_factory=dict)  # request_id -> when its prediction re-keyed it

    def bound_count(self, request: QueuedRequest) -> int:
        """Upper bound on A_r: queued at r's arrival plus arrivals in (a_r, a_r + max_wait_s]."""
        a = request.arrival_s
        return self.num_ahead[request.request_id] + sum(a < t <= a + MAX_WAIT_S for t in self.arrivals)


def run_one_per_step(policy: SchedulingPolicy, stream: list[QueuedRequest], num_steps: int,
                     prediction_lag_s: float | None = None) -> Outcome:
    """Fake-clock server: each step adds the arrivals so far, then serves one request.

    With ``prediction_lag_s``, every request is queued on its prior (no prediction: counts as
    ``max_tokens``) and re-keyed by its prediction at the first step ``prediction_lag_s`` after
    it arrived, as the scheduler does (``Outcome.rekeyed_at``)."""
    waits: dict[str, float] = {}
    num_ahead: dict[str, int] = {}
    rekeyed_at: dict[str, float] = {}
    lagging: list[QueuedRequest] = []
    pending = iter(stream)
    nxt = next(pending, None)
    for k in range(num_steps):
        now = k * DT
        while nxt is not None and nxt.arrival_s <= now:
            num_ahead[nxt.request_id] = len(policy)
            if prediction_lag_s is None:
                policy.add(nxt, now)
            else:
                policy.add(QueuedRequest(nxt.request_id, nxt.arrival_s, nxt.prompt_len, nxt.max_tokens,
                                         true_len=nxt.true_len), now)
                lagging.append(nxt)
            nxt = next(pending, None)
        if prediction_lag_s is not None:
            for r in [r for r in lagging if now >= r.arrival_s + prediction_lag_s]:
                lagging.remove(r)
                rekeyed_at[r.request_id] = now
                policy.update(r)
        chosen = policy.pop_next(now)
        if chosen is not None:
            waits[chosen.request_id] = now - chosen.arrival_s
    return Outcome(waits, num_ahead, [r.arrival_s for r in stream], len(policy), rekeyed_at)


class _UnprotectedSSJF(SSJFPolicy):
    """Deliberately wrong: never promotes, so a waiting request is passed over by shorter ones."""

    def _pop_best(self, now: float) -> Slot | None:
        return self._pop_waiting(now)


class _BypassedPromotionSSJF(SSJFPolicy):
    """Deliberately wrong: promotes, but serves unpromoted shorter requests ahead of promoted ones."""

    def _pop_best(self, now: float) -> Slot | None:
        return self._pop_waiting(now) or super()._pop_best(now)


def check_single_row_bound(policy: SchedulingPolicy, steps: int = 200) -> list[str]:
    """Run the adversarial stream one request per step; return every violation of the bound."""
    stream = adversarial_stream(steps)
    by_id = {r.request_id: r for r in stream}
    out = run_one_per_step(policy, stream, steps)
    problems = [] if out.num_left > 100 else ["the stream is not an overload"]
    if "long" not in out.waits:
        return [*problems, "the long job was never selected"]
    assert isinstance(policy, AgingPolicy)
    for rid, wait in out.waits.items():
        req = by_id[rid]
        # Documented bound with a row free at every call: (d_r - a_r) + dt * (1 + A_r).
        if wait > (policy.deadline(req) - req.arrival_s) + DT * (1 + out.bound_count(req)):
            problems.append(f"{rid} waited {wait} s")
    return problems


def test_ssjf_aging_bounds_the_long_jobs_wait_under_an_endless_short_stream() -> None:
    policy = SSJFPolicy(max_wait_s=MAX_WAIT_S)
    assert check_single_row_bound(policy) == []
    out = run_one_per_step(SSJFPolicy(max_wait_s=MAX_WAIT_S), adversarial_stream(200), 200)
    assert out.waits["long"] >= MAX_WAIT_S - DT  # and it was not served early by accident
    # Nothing that arrived more than max_wait_s after the long job went before it.
    long_admitted = 0.1 + out.waits["long"]
    for rid, wait in out.waits.items():
        arrival = round(0.4 * int(rid[1:]), 6) if rid != "long" else 0.1
        if arrival > 0.1 + MAX_WAIT_S:
            assert arrival + wait > long_admitted, rid


@pytest.mark.parametrize("broken", [_UnprotectedSSJF, _BypassedPromotionSSJF],
                         ids=["never-promotes", "promoted-bypassed"])
def test_the_bound_check_fails_for_a_policy_that_lets_promoted_requests_be_bypassed(
        broken: Callable[[float], SchedulingPolicy]) -> None:
    problems = check_single_row_bound(broken(MAX_WAIT_S))
    assert "the long job was never selected" in problems


@pytest.mark.parametrize("policy", [SSJFPolicy(max_wait_s=math.inf)], ids=["ssjf-without-aging"])
def test_shortest_first_without_aging_starves_the_long_job(policy: SchedulingPolicy) -> None:
    steps = 200
    out = run_one_per_step(policy, adversarial_stream(steps), steps)
    assert "long" not in out.waits and "long" in policy
    assert steps * DT > 5 * (MAX_WAIT_S + DT)  # horizon far past the aging bound


NUM_ROWS = 2  # KV-cache rows: admission takes free rows, a request holds one until it ends
SHORT_STEPS = 2  # steps a short job runs once admitted
LONG_STEPS = 3


def run_with_rows(policy: SchedulingPolicy, stream: list[QueuedRequest], num_steps: int) -> Outcome:
    """Fake-clock server with NUM_ROWS rows: each step frees the rows of finished requests,
    adds the arrivals so far, then admits into the free rows."""
    running: dict[str, float] = {}  # request_id -> finish time
    waits: dict[str, float] = {}
    num_ahead: dict[str, int] = {}
    pending = iter(stream)
    nxt = next(pending, None)
    for k in range(num_steps):
        now = k * DT
        for rid in [rid for rid, end in running.items() if end <= now]:
            del running[rid]
        while nxt is not None and nxt.arrival_s <= now:
            num_ahead[nxt.request_id] = len(policy)
            policy.add(nxt, now)
            nxt = next(pending, None)
        for r in policy.select(now, max_count=NUM_ROWS - len(running)):
            waits[r.request_id] = now - r.arrival_s
            running[r.request_id] = now + DT * (LONG_STEPS if r.request_id == "long" else SHORT_STEPS)
        assert len(running) <= NUM_ROWS
    return Outcome(waits, num_ahead, [r.arrival_s for r in stream], len(policy))


@pytest.mark.parametrize("make", [lambda: SSJFPolicy(MAX_WAIT_S), lambda: HRRNPolicy(MAX_WAIT_S)], ids=["ssjf", "hrrn"])
def test_a_promoted_request_gets_a_row_within_the_bound_while_rows_are_contended(
        make: Callable[[], AgingPolicy]) -> None:
    steps = 200
    stream = adversarial_stream(steps)
    policy = make()
    out = run_with_rows(policy, stream, steps)
    assert out.num_left > 50  # overload: the rows are always contended
    assert "long" in out.waits
    # General bound: (d_r - a_r) + dt + (1 + A_r) * (D + dt), D = longest running time.
    d = DT * LONG_STEPS
    for r in stream:
        if r.request_id in out.waits:
            bound = (policy.deadline(r) - r.arrival_s) + DT + (1 + out.bound_count(r)) * (d + DT)
            assert out.waits[r.request_id] <= bound, r.request_id


def test_without_promotion_short_requests_starve_a_long_one_of_rows() -> None:
    steps = 200
    stream = adversarial_stream(steps)
    out = run_with_rows(_UnprotectedSSJF(max_wait_s=MAX_WAIT_S), stream, steps)
    assert "long" not in out.waits  # small requests always take the rows it waits for


def test_deadlines_scale_with_the_predicted_service_and_cap_at_max_wait() -> None:
    p = SSJFPolicy(max_wait_s=30.0, aging_tokens=256)
    assert p.deadline(QueuedRequest("a", 5.0, 1, 256, predicted_len=64.0)) == pytest.approx(5.0 + 7.5)
    assert p.deadline(QueuedRequest("b", 5.0, 1, 4096, predicted_len=4000.0)) == pytest.approx(35.0)
    # max_tokens caps the prediction, so a cap of 16 tokens cannot earn a late deadline.
    assert p.deadline(QueuedRequest("c", 0.0, 1, 16, predicted_len=900.0)) == pytest.approx(30.0 * 16 / 256)
    # No prediction: counts as max_tokens long.
    assert p.deadline(QueuedRequest("d", 0.0, 1, 128)) == pytest.approx(15.0)
    fixed = SSJFPolicy(max_wait_s=30.0, aging_tokens=1)  # the fixed-wait rule
    assert fixed.deadline(QueuedRequest("e", 2.0, 1, 256, predicted_len=3.0)) == pytest.approx(32.0)


def test_a_busy_queue_stays_shortest_first_after_everything_is_promoted() -> None:
    """The issue's burst: everything arrives within 2 s and waits longer than max_wait_s. A fixed
    wait turns the order into FCFS; the scaled deadlines keep it shortest first."""
    burst = [QueuedRequest(f"r{i}", 0.05 * i, 10, 256, predicted_len=float(256 - 6 * i)) for i in range(40)]
    scaled, fixed = SSJFPolicy(max_wait_s=30.0), SSJFPolicy(max_wait_s=30.0, aging_tokens=1)
    for r in burst:
        scaled.add(r, 2.0)
        fixed.add(r, 2.0)
    now = 60.0  # all 40 promoted under both rules
    assert [r.request_id for r in fixed.select(now, 40)] == [f"r{i}" for i in range(40)]
    assert [r.request_id for r in scaled.select(now, 40)] == [f"r{i}" for i in reversed(range(40))]


def test_the_default_aging_scale_keeps_a_512_token_burst_shortest_first() -> None:
    """Chat answers run to 512 tokens (the benchmark's cap): with the default scale every
    predicted length up to 512 keeps its own deadline, so a drained-late burst stays shortest
    first across the whole range; a 256-token scale ties everything from 256 up (arrival order)."""
    burst = [QueuedRequest(f"r{i}", 0.05 * i, 10, 512, predicted_len=float(500 - 12 * i)) for i in range(40)]
    default, half = SSJFPolicy(max_wait_s=30.0), SSJFPolicy(max_wait_s=30.0, aging_tokens=256)
    for r in burst:
        default.add(r, 2.0)
        half.add(r, 2.0)
    now = 60.0  # every request promoted
    assert [r.request_id for r in default.select(now, 40)] == [f"r{i}" for i in reversed(range(40))]
    tied = [r.request_id for r in half.select(now, 40)]
    long_ones = [i for i in tied if int(i[1:]) <= 20]  # predicted 500..260: deadline arrival + 30 s each
    assert long_ones == [f"r{i}" for i in range(21)]  # so in arrival order, the longest first


PREDICTION_LAG_S = 3.0  # the predictor answers this long after a request arrives


@pytest.mark.parametrize("make", [lambda: SSJFPolicy(MAX_WAIT_S), lambda: HRRNPolicy(MAX_WAIT_S)], ids=["ssjf", "hrrn"])
def test_the_bound_holds_when_predictions_land_after_queueing(make: Callable[[], AgingPolicy]) -> None:
    """The documented bound with late predictions: r is promoted by
    ``min(a_r + max_wait_s, max(d_r, rekey_r))``, then waits for at most A_r others."""
    steps = 200
    stream = adversarial_stream(steps)
    policy = make()
    out = run_one_per_step(policy, stream, steps, prediction_lag_s=PREDICTION_LAG_S)
    assert out.num_left > 100 and "long" in out.waits
    for r in stream:
        if r.request_id not in out.waits:
            continue
        wait = out.waits[r.request_id]
        promoted = min(r.arrival_s + MAX_WAIT_S, max(policy.deadline(r), out.rekeyed_at.get(r.request_id, math.inf)))
        assert wait <= (promoted - r.arrival_s) + DT * (1 + out.bound_count(r)), r.request_id
        assert wait <= MAX_WAIT_S + DT * (1 + out.bound_count(r)), r.request_id
    # The long job still goes ahead of every request that arrived more than max_wait_s after it.
    long_admitted = 0.1 + out.waits["long"]
    for r in stream:
        if r.arrival_s > 0.1 + MAX_WAIT_S and r.request_id in out.waits:
            assert r.arrival_s + out.waits[r.request_id] > long_admitted, r.request_id
