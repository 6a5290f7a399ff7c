"""Ordering, removal, selection and factory behaviour of the scheduling policies (the SJF oracle's
are in tests/test_bench_scheduling.py, with the oracle)."""

from __future__ import annotations

import math
import random

import pytest

from treeserve.actors.scheduler.policy import (
    POLICY_NAMES,
    FCFSPolicy,
    HRRNPolicy,
    QueuedRequest,
    SchedulingPolicy,
    SSJFPolicy,
    make_policy,
    response_ratio,
)


def req(
    rid: str,
    arrival: float,
    predicted: float | None = None,
    true_len: int | None = None,
    max_tokens: int = 512,
    prompt_len: int = 8,
) -> QueuedRequest:
    return QueuedRequest(rid, arrival, prompt_len, max_tokens, predicted, true_len)


def drain(policy: SchedulingPolicy, now: float) -> list[str]:
    out: list[str] = []
    while (r := policy.pop_next(now)) is not None:
        out.append(r.request_id)
    return out


def test_fcfs_orders_by_arrival_not_add_order() -> None:
    p = FCFSPolicy()
    p.add(req("c", 3.0, predicted=1), now=3.0)
    p.add(req("a", 1.0, predicted=900), now=3.0)
    p.add(req("b", 2.0, predicted=5), now=3.0)
    p.add(req("a2", 1.0, predicted=1), now=3.0)  # same arrival as "a": add order breaks the tie
    assert len(p) == 4
    assert drain(p, now=10.0) == ["a", "a2", "b", "c"]
    assert len(p) == 0 and p.pop_next(11.0) is None


def test_ssjf_orders_by_predicted_length_with_stable_ties() -> None:
    p = SSJFPolicy(max_wait_s=math.inf)
    p.add(req("long", 0.0, predicted=300), 0.0)
    p.add(req("short-late", 2.0, predicted=10), 2.0)
    p.add(req("short-early", 1.0, predicted=10), 2.0)
    p.add(req("mid", 0.5, predicted=50), 2.0)
    p.add(req("short-late-b", 2.0, predicted=10), 2.0)
    p.add(req("unpredicted", 0.1, predicted=None, max_tokens=100), 2.0)  # counts as 100
    assert drain(p, now=3.0) == [
        "short-early", "short-late", "short-late-b", "mid", "unpredicted", "long",
    ]


def test_ssjf_promotes_at_service_scaled_deadlines_earliest_first() -> None:
    p = SSJFPolicy(max_wait_s=10.0, aging_tokens=256)  # deadline = arrival + 10 * min(1, size / 256)
    p.add(req("old-long", 0.0, predicted=1000), 0.0)  # deadline 10.0
    p.add(req("older-long", -1.0, predicted=2000), 0.0)  # deadline 9.0
    p.add(req("new-short", 9.0, predicted=1), 9.0)  # deadline 9.0390625
    assert p.is_promoted(req("x", 0.0, predicted=300), now=10.0)
    assert not p.is_promoted(req("x", 0.0, predicted=300), now=9.99)
    assert p.is_promoted(req("y", 0.0, predicted=128), now=5.0) and not p.is_promoted(req("y", 0.0, predicted=128), 4.9)
    # At 9.5 only "older-long" and "new-short" are promoted: earliest deadline first.
    assert p.pop_next(9.5) is not None and "older-long" not in p
    assert drain(p, now=9.5) == ["new-short", "old-long"]
    # At 20 all three are promoted: by deadline (l2: 1 + 10 * 99/256 = 4.87; l1: 10; s: 15.04),
    # not by arrival: a fixed wait (aging_tokens=1) would give l1, l2, s.
    q = SSJFPolicy(max_wait_s=10.0, aging_tokens=256)
    fixed = SSJFPolicy(max_wait_s=10.0, aging_tokens=1)
    for r in (req("s", 15.0, predicted=1), req("l2", 1.0, predicted=99), req("l1", 0.0, predicted=500)):
        q.add(r, 15.0)
        fixed.add(r, 15.0)
    assert drain(q, now=20.0) == ["l2", "l1", "s"]
    assert drain(fixed, now=20.0) == ["l1", "l2", "s"]


def test_max_tokens_caps_the_prediction() -> None:
    assert req("a", 0.0, predicted=900, max_tokens=16).predicted_service == 16.0
    assert req("b", 0.0, predicted=9, max_tokens=16).predicted_service == 9.0
    p = SSJFPolicy(max_wait_s=math.inf)
    p.add(req("capped", 0.0, predicted=900, max_tokens=16), 0.0)  # can generate at most 16
    p.add(req("mid", 0.0, predicted=100, max_tokens=512), 0.0)
    assert drain(p, now=1.0) == ["capped", "mid"]


def test_response_ratio_matches_hand_computation() -> None:
    a = req("A", 0.0, predicted=10)  # (10 + 10) / 10 = 2.0 at t=10
    b = req("B", 5.0, predicted=2)  # (5 + 2) / 2 = 3.5
    c = req("C", 8.0, predicted=1)  # (2 + 1) / 1 = 3.0
    d = req("D", 12.0, predicted=0)  # arrives "later": wait clamps to 0, service clamps to 1
    assert response_ratio(a, 10.0) == pytest.approx(2.0)
    assert response_ratio(b, 10.0) == pytest.approx(3.5)
    assert response_ratio(c, 10.0) == pytest.approx(3.0)
    assert response_ratio(d, 10.0) == pytest.approx(1.0)
    p = HRRNPolicy()
    for r in (a, b, c, d):
        p.add(r, 10.0)
    assert drain(p, now=10.0) == ["B", "C", "A", "D"]
    # At t=40: A = 5.0, B = 18.5, C = 33.0, D = 29.0 (now arrived and waiting 28).
    p2 = HRRNPolicy()
    for r in (a, b, c, d):
        p2.add(r, 40.0)
    assert [response_ratio(r, 40.0) for r in (a, b, c, d)] == pytest.approx([5.0, 18.5, 33.0, 29.0])
    assert drain(p2, now=40.0) == ["C", "D", "B", "A"]


def test_hrrn_matches_bruteforce_argmax_on_random_queues() -> None:
    rng = random.Random(7)
    p = HRRNPolicy()
    queued: dict[str, QueuedRequest] = {}
    for i in range(300):
        r = req(f"r{i}", rng.uniform(0, 100), predicted=float(rng.choice([1, 5, 20, 64, 200])))
        p.add(r, 100.0)
        queued[r.request_id] = r
    now = 100.0
    while queued:
        now += rng.uniform(0, 3)
        if rng.random() < 0.2:
            victim = rng.choice(sorted(queued))
            assert p.remove(victim)
            del queued[victim]
            continue
        expected = min(
            queued.values(),
            key=lambda r: (-response_ratio(r, now), r.arrival_s, int(r.request_id[1:])),
        )
        got = p.pop_next(now)
        assert got is not None and got.request_id == expected.request_id
        del queued[got.request_id]
    assert len(p) == 0


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_remove_drops_a_queued_request(name: str) -> None:
    p = make_policy(name, **({} if name == "fcfs" else {"max_wait_s": 5.0}))
    for i in range(6):
        p.add(req(f"r{i}", float(i), predicted=float(10 - i), true_len=10 - i), float(i))
    assert "r3" in p
    assert p.remove("r3") is True
    assert p.remove("r3") is False and p.remove("never") is False
    assert "r3" not in p and len(p) == 5
    got = drain(p, now=6.0)
    assert sorted(got) == ["r0", "r1", "r2", "r4", "r5"]
    # The same id may be queued again after removal; the stale heap entries stay dead.
    p.add(req("r3", 7.0, predicted=1.0, true_len=1), 7.0)
    assert drain(p, now=7.0) == ["r3"]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_duplicate_add_is_rejected(name: str) -> None:
    p = make_policy(name, max_wait_s=1.0) if name != "fcfs" else make_policy(name)
    p.add(req("x", 0.0, 1.0, 1), 0.0)
    with pytest.raises(ValueError, match="already queued"):
        p.add(req("x", 1.0, 1.0, 1), 1.0)


def test_many_removals_keep_heaps_compact_and_order_correct() -> None:
    p = SSJFPolicy(max_wait_s=math.inf)
    for i in range(5000):
        p.add(req(f"r{i}", float(i), predicted=float(i % 97)), float(i))
    for i in range(5000):
        if i % 5:
            p.remove(f"r{i}")
    assert len(p) == 1000
    assert p._num_heap_items <= 4 * len(p) + 64  # lazy garbage bounded by compaction
    got = drain(p, now=6000.0)
    kept = [f"r{i}" for i in range(0, 5000, 5)]
    expected = sorted(kept, key=lambda s: (int(s[1:]) % 97, int(s[1:])))
    assert got == expected


def test_select_respects_max_count_and_keeps_the_rest_in_order() -> None:
    p = SSJFPolicy(max_wait_s=math.inf)
    for i in range(5):
        p.add(req(f"r{i}", 0.0, predicted=float(5 - i)), 0.0)
    assert p.select(0.0, 0) == [] and len(p) == 5
    assert [r.request_id for r in p.select(0.0, 2)] == ["r4", "r3"]
    assert [r.request_id for r in p.select(0.0, 8)] == ["r2", "r1", "r0"]
    assert p.select(0.0, 8) == [] and len(p) == 0
    with pytest.raises(ValueError, match="max_count"):
        p.select(0.0, -1)


def test_make_policy_validates_names_and_options() -> None:
    assert isinstance(make_policy("fcfs"), FCFSPolicy)
    ssjf = make_policy("ssjf", max_wait_s=12.5)
    assert isinstance(ssjf, SSJFPolicy) and ssjf.max_wait_s == 12.5
    assert isinstance(make_policy("hrrn", max_wait_s=3.0), HRRNPolicy)
    with pytest.raises(ValueError, match="valid names: fcfs, ssjf, hrrn"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="needs max_wait_s"):
        make_policy("ssjf")
    with pytest.raises(ValueError, match="unknown option"):
        make_policy("fcfs", max_wait_s=1.0)
    with pytest.raises(ValueError, match="unknown option"):
        make_policy("ssjf", max_wait_s=1.0, rate=2.0)
    with pytest.raises(ValueError, match="max_wait_s must be >= 0"):
        make_policy("ssjf", max_wait_s=-1.0)


def test_queued_request_validation() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        QueuedRequest("a", 0.0, 1, 0)
    with pytest.raises(ValueError, match="arrival_s"):
        QueuedRequest("a", math.nan, 1, 1)
    with pytest.raises(ValueError, match="predicted_len"):
        QueuedRequest("a", 0.0, 1, 1, predicted_len=-2.0)
    with pytest.raises(ValueError, match="request_id"):
        QueuedRequest("", 0.0, 1, 1)


def test_hrrn_promotes_at_its_aging_deadline() -> None:
    def queue(policy: HRRNPolicy) -> HRRNPolicy:
        policy.add(req("long", 0.0, predicted=1000), 0.0)  # ratio at t=10: 1010 / 1000 = 1.01
        policy.add(req("short", 5.0, predicted=200), 5.0)  # ratio at t=10: 205 / 200 = 1.025
        return policy

    # Deadlines (max_wait_s 10, aging_tokens 256): long 10.0, short 5 + 10 * 200/256 = 12.8.
    assert drain(queue(HRRNPolicy(max_wait_s=10.0, aging_tokens=256)), now=10.0) == ["long", "short"]  # promoted
    assert drain(queue(HRRNPolicy(max_wait_s=10.0, aging_tokens=256)), now=9.5) == ["short", "long"]  # the ratio
    assert drain(queue(HRRNPolicy()), now=10.0) == ["short", "long"]  # no aging: the ratio alone


# ---------------------------------------------------------------------- re-keying (update)
@pytest.mark.parametrize("make", [lambda: SSJFPolicy(max_wait_s=math.inf), lambda: HRRNPolicy()], ids=["ssjf", "hrrn"])
def test_update_rekeys_a_queued_request_when_its_prediction_lands(make: object) -> None:
    p = make()  # type: ignore[operator]
    assert isinstance(p, (SSJFPolicy, HRRNPolicy))
    p.add(req("a", 0.0, predicted=None, max_tokens=100), 0.0)  # queued on its prior: max_tokens
    p.add(req("b", 0.1, predicted=None, max_tokens=100), 0.1)
    p.add(req("c", 0.2, predicted=5), 0.2)
    assert p.update(req("b", 0.1, predicted=3, max_tokens=100))  # b's prediction lands: now the shortest
    assert p.update(req("a", 0.0, predicted=100, max_tokens=100))  # the same size: a no-op re-key
    assert drain(p, now=0.3) == ["b", "c", "a"]
    assert not p.update(req("b", 0.1, predicted=2, max_tokens=100))  # no longer queued: nothing to do


def test_update_only_shrinks_the_key_and_keeps_the_arrival() -> None:
    p = SSJFPolicy(max_wait_s=10.0)
    p.add(req("a", 1.0, predicted=40), 1.0)
    with pytest.raises(ValueError, match="only shorten"):
        p.update(req("a", 1.0, predicted=41))  # a deadline would move later
    with pytest.raises(ValueError, match="only the prediction"):
        p.update(req("a", 0.5, predicted=10))  # the aging clock is the arrival's
    with pytest.raises(ValueError, match="only the prediction"):
        p.update(req("a", 1.0, predicted=10, max_tokens=64))
    assert len(p) == 1 and p.pop_next(2.0) == req("a", 1.0, predicted=40)  # untouched by the refusals


def test_update_moves_the_aging_deadline_earlier_and_keeps_the_add_order_tie_break() -> None:
    p = SSJFPolicy(max_wait_s=10.0, aging_tokens=100)
    p.add(req("x", 0.0, predicted=None, max_tokens=100), 0.0)  # deadline 10.0
    p.add(req("y", 0.0, predicted=30, max_tokens=100), 0.0)  # deadline 3.0
    assert p.update(req("x", 0.0, predicted=30, max_tokens=100))  # deadline 3.0 now too
    assert p.is_promoted(req("x", 0.0, predicted=30, max_tokens=100), 3.0)
    assert [r.request_id for r in p.select(3.0, 2)] == ["x", "y"]  # both promoted: tied, x was added first


def test_many_updates_keep_the_heaps_bounded_and_the_order_right() -> None:
    rng = random.Random(3)
    p = SSJFPolicy(max_wait_s=math.inf)
    sizes = {f"r{i}": 1000.0 for i in range(50)}
    for i in range(50):
        p.add(req(f"r{i}", float(i), predicted=None, max_tokens=1000), float(i))
    for _ in range(2000):
        rid = f"r{rng.randrange(50)}"
        sizes[rid] = max(1.0, sizes[rid] - rng.random() * 30)
        assert p.update(req(rid, float(rid[1:]), predicted=sizes[rid], max_tokens=1000))
    assert p._num_heap_items <= 4 * len(p) + 64 + 2  # stale items are compacted away
    expected = sorted(sizes, key=lambda r: (sizes[r], float(r[1:])))
    assert drain(p, now=100.0) == expected
