"""KV block accounting: admission, growth, freeing, never-fits rejection and preemption choice."""

from __future__ import annotations

import random

import pytest

from treeserve.actors.kv_budget import (
    KVBudget,
    KVBudgetExceeded,
    KVBudgetUnavailable,
    PreemptionRule,
)


def test_blocks_round_up() -> None:
    b = KVBudget(num_blocks=8, block_size=16)
    assert [b.blocks_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_reserve_grow_shrink_free_accounting() -> None:
    b = KVBudget(num_blocks=10, block_size=4)
    r = b.reserve("a", prompt_len=5, max_tokens=35, arrival_s=0.0)
    assert r.num_blocks == 2 and b.num_free_blocks == 8 and b.num_used_blocks == 2
    assert b.grow("a", 8) is True and b.reservation("a").num_blocks == 2  # same blocks
    assert b.grow("a", 9) is True and b.num_free_blocks == 7  # 3 blocks
    b.reserve("b", prompt_len=4, max_tokens=1, arrival_s=0.0)  # 1 block
    assert b.grow("a", 36) is True and b.num_free_blocks == 0  # 9 + 1 blocks: full
    assert b.grow("a", 37) is False  # would need a free block: unchanged
    assert b.reservation("a").num_tokens == 36 and b.num_free_blocks == 0
    assert b.shrink("a", 12) == 6 and b.num_free_blocks == 6
    with pytest.raises(ValueError, match="use shrink"):
        b.grow("a", 3)
    assert b.free("a") == 3 and b.free("b") == 1
    assert b.num_free_blocks == 10 and len(b) == 0
    with pytest.raises(KeyError, match="holds no KV reservation"):
        b.free("a")


def test_can_admit_respects_free_blocks_and_watermark() -> None:
    b = KVBudget(num_blocks=10, block_size=1, watermark_blocks=2)
    assert b.can_admit(8, 1) is True
    assert b.can_admit(9, 1) is False  # would eat into the watermark
    assert b.try_reserve("a", 6, 1, arrival_s=0.0) is True
    assert b.try_reserve("b", 3, 1, arrival_s=0.0) is False and "b" not in b
    with pytest.raises(KVBudgetUnavailable, match="only 2 free"):
        b.reserve("b", 3, 1, arrival_s=0.0)
    assert b.grow("a", 10) is True  # growth may use the watermark
    with pytest.raises(ValueError, match="already holds"):
        b.reserve("a", 0, 1, arrival_s=0.0)


def test_request_that_can_never_fit_is_rejected_with_numbers() -> None:
    b = KVBudget(num_blocks=4, block_size=16)  # 64 tokens
    b.check_can_ever_fit(prompt_len=40, max_tokens=24)  # exactly 64: fine
    with pytest.raises(KVBudgetExceeded) as info:
        b.check_can_ever_fit(prompt_len=40, max_tokens=25)
    err = info.value
    assert (err.num_tokens, err.num_blocks_needed, err.num_blocks, err.block_size) == (65, 5, 4, 16)
    assert "65 KV tokens = 5 blocks of 16" in str(err) and "only 4 blocks (64 tokens)" in str(err)
    assert isinstance(err, ValueError)
    with pytest.raises(KVBudgetExceeded):  # can_admit refuses to answer False for it
        b.can_admit(10, 100)
    b.reserve("a", 10, 54, arrival_s=0.0)
    with pytest.raises(KVBudgetExceeded):
        b.grow("a", 65)


def test_preemption_picks_most_remaining_predicted_work() -> None:
    b = KVBudget(num_blocks=1000, block_size=1)
    b.reserve("near-done", 5, 500, arrival_s=3.0, predicted_len=20)
    b.reserve("long", 5, 500, arrival_s=1.0, predicted_len=300)
    b.reserve("unpredicted", 5, 100, arrival_s=2.0)  # counts max_tokens = 100
    assert b.grow("near-done", 5 + 18)  # 2 predicted tokens left
    assert b.grow("long", 5 + 100)  # 200 left
    assert b.reservation("long").remaining_work == 200
    assert b.choose_preemption_victim() == "long"
    assert b.choose_preemption_victim(exclude={"long"}) == "unpredicted"
    assert b.choose_preemption_victim(exclude={"long", "unpredicted", "near-done"}) is None
    assert b.grow("near-done", 5 + 40)  # past its prediction: remaining clamps to 0
    assert b.reservation("near-done").remaining_work == 0


def test_preemption_ties_go_to_latest_arrival_and_rule_can_switch() -> None:
    b = KVBudget(num_blocks=100, block_size=1)
    b.reserve("early", 5, 50, arrival_s=1.0, predicted_len=30)
    b.reserve("late", 5, 50, arrival_s=9.0, predicted_len=30)
    b.reserve("mid-big", 5, 50, arrival_s=5.0, predicted_len=31)
    assert b.choose_preemption_victim() == "mid-big"
    assert b.choose_preemption_victim(exclude={"mid-big"}) == "late"
    fcfs_style = KVBudget(100, 1, preemption_rule=PreemptionRule.LATEST_ARRIVAL)
    fcfs_style.reserve("early", 5, 50, arrival_s=1.0, predicted_len=300)
    fcfs_style.reserve("late", 5, 50, arrival_s=9.0, predicted_len=3)
    assert fcfs_style.choose_preemption_victim() == "late"


def test_random_operations_match_a_reference_count() -> None:
    rng = random.Random(11)
    b = KVBudget(num_blocks=64, block_size=8)
    tokens: dict[str, int] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.3:
            rid = f"r{step}"
            prompt = rng.randint(0, 60)
            admitted = b.try_reserve(rid, prompt, 100, arrival_s=float(step))
            expected = -(-prompt // 8) <= 64 - sum(-(-t // 8) for t in tokens.values())
            assert admitted == expected
            if admitted:
                tokens[rid] = prompt
        elif tokens and op < 0.7:
            rid = rng.choice(sorted(tokens))
            new = tokens[rid] + rng.randint(0, 20)
            room = 64 - sum(-(-t // 8) for r, t in tokens.items() if r != rid)
            assert b.grow(rid, new) == (-(-new // 8) <= room)
            if -(-new // 8) <= room:
                tokens[rid] = new
        elif tokens and op < 0.8:
            rid = rng.choice(sorted(tokens))
            new = rng.randint(0, tokens[rid])
            b.shrink(rid, new)
            tokens[rid] = new
        elif tokens:
            rid = rng.choice(sorted(tokens))
            assert b.free(rid) == -(-tokens.pop(rid) // 8)
        used = sum(-(-t // 8) for t in tokens.values())
        assert b.num_used_blocks == used and b.num_free_blocks == 64 - used
        assert len(b) == len(tokens)


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVBudget(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        KVBudget(4, 0)
    with pytest.raises(ValueError, match="watermark_blocks"):
        KVBudget(4, 16, watermark_blocks=4)
