"""SSJF's aging bound under an adversarial stream, and why aging matters.

The stream: one long job arrives, then short jobs keep arriving faster than the server
can serve them. Shortest-first without aging serves the shorts forever; SSJF with
aging must select the long job within the documented bound, which depends on
``max_wait_s``, the step gap and the queue ahead of it, never on its length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from treeserve.actors.policy import QueuedRequest, SchedulingPolicy, SSJFPolicy

DT = 1.0  # seconds between scheduler steps (the fake clock's tick)
MAX_WAIT_S = 20.0


def adversarial_stream(num_steps: int) -> list[QueuedRequest]:
    """A long job at t=0.1 amid short jobs every 0.4 s (2.5 arrivals per 1-request step)."""
    shorts = [
        QueuedRequest(f"s{i}", round(0.4 * i, 6), 3, 2, predicted_len=10.0, true_len=10)
        for i in range(int(num_steps / 0.4) + 1)
    ]
    long_job = QueuedRequest(
        "long", 0.1, 8, 2, predicted_len=5000.0, true_len=5000
    )
    return sorted([*shorts, long_job], key=lambda r: r.arrival_s)


@dataclass
class Outcome:
    waits: dict[str, float]  # request_id -> queueing wait of the selected requests
    num_ahead: dict[str, int]  # request_id -> requests queued when it was added
    num_left: int


def run_one_per_step(policy: SchedulingPolicy, stream: list[QueuedRequest], num_steps: int) -> Outcome:
    """Fake-clock server: each step adds the arrivals so far, then serves one request."""
    waits: dict[str, float] = {}
    num_ahead: dict[str, int] = {}
    pending = iter(stream)
    nxt = next(pending, None)
    for k in range(num_steps):
        now = k * DT
        while nxt is not None and nxt.arrival_s <= now:
            num_ahead[nxt.request_id] = len(policy)
            policy.add(nxt, now)
            nxt = next(pending, None)
        chosen = policy.pop_next(now)
        if chosen is not None:
            waits[chosen.request_id] = now - chosen.arrival_s
    return Outcome(waits, num_ahead, len(policy))


def test_ssjf_aging_bounds_the_long_jobs_wait_under_an_endless_short_stream() -> None:
    steps = 200
    out = run_one_per_step(SSJFPolicy(max_wait_s=MAX_WAIT_S), adversarial_stream(steps), steps)
    assert out.num_left > 100  # the stream really is faster than service (overload)
    assert "long" in out.waits, "aging failed: the long job was never selected"
    # Documented bound with unlimited room: max_wait_s + dt * (1 + A).
    assert out.num_ahead["long"] == 0
    assert out.waits["long"] <= MAX_WAIT_S + DT * (1 + out.num_ahead["long"])
    assert out.waits["long"] >= MAX_WAIT_S - DT  # and it was not served early by accident
    # The same bound holds for every request, whatever its predicted length.
    for rid, wait in out.waits.items():
        assert wait <= MAX_WAIT_S + DT * (1 + out.num_ahead[rid]), rid


@pytest.mark.parametrize("policy", [SSJFPolicy(max_wait_s=math.inf)], ids=["ssjf-without-aging"])
def test_shortest_first_without_aging_starves_the_long_job(policy: SchedulingPolicy) -> None:
    steps = 200
    out = run_one_per_step(policy, adversarial_stream(steps), steps)
    assert "long" not in out.waits and "long" in policy
    assert steps * DT > 5 * (MAX_WAIT_S + DT)  # horizon far past the aging bound


class _UnprotectedSSJF(SSJFPolicy):
    """Deliberately wrong: never promotes, so a waiting request is passed over by shorter ones."""

    def is_promoted(self, request: QueuedRequest, now: float) -> bool:
        return False


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
    return Outcome(waits, num_ahead, len(policy))


def test_a_promoted_request_gets_a_row_within_the_bound_while_rows_are_contended() -> None:
    steps = 200
    stream = adversarial_stream(steps)
    out = run_with_rows(SSJFPolicy(max_wait_s=MAX_WAIT_S), stream, steps)
    assert out.num_left > 50  # overload: the rows are always contended
    assert "long" in out.waits
    # General bound: max_wait_s + dt + (1 + A) * (D + dt), D = longest running time.
    d = DT * LONG_STEPS
    for rid, wait in out.waits.items():
        assert wait <= MAX_WAIT_S + DT + (1 + out.num_ahead[rid]) * (d + DT), rid


def test_without_promotion_short_requests_starve_a_long_one_of_rows() -> None:
    steps = 200
    stream = adversarial_stream(steps)
    out = run_with_rows(_UnprotectedSSJF(max_wait_s=MAX_WAIT_S), stream, steps)
    assert "long" not in out.waits  # small requests always take the rows it waits for
