"""Which free row a request gets (``actors/scheduler/rows.py``): the lowest, unless another free
row last held at least ``AFFINITY_TOKENS`` more of its prompt; through the core, a conversation's
next turn goes back to its row while a lower row is free. A core that gave every request the
lowest row, or the row with the longest shared prefix however short, fails this."""

from __future__ import annotations

import pytest

from treeserve.actors.messages.gateway import GenerateBody
from treeserve.actors.scheduler.core import SchedulerCore
from treeserve.actors.scheduler.rows import AFFINITY_TOKENS, FreeRows, shared_prefix
from treeserve.actors.scheduler.types import SchedulerConfig
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculation_modes import SpeculationMode
from treeserve_testing.core_steps import verify

LONG = list(range(10, 10 + AFFINITY_TOKENS + 8))


def test_the_lowest_free_row_unless_another_holds_far_more_of_the_prompt() -> None:
    assert shared_prefix([1, 2, 3], [1, 2, 4]) == 2 and shared_prefix([], [1]) == 0
    rows = FreeRows([2, 0, 3, 1])
    assert [rows.take(LONG) for _ in range(4)] == [0, 1, 2, 3] and len(rows) == 0  # nothing held: lowest first
    rows.put(2, LONG)
    rows.put(0)
    assert rows.take(LONG + [5]) == 2  # all it held, against nothing
    rows.put(2, LONG[:AFFINITY_TOKENS - 1])
    assert rows.take(LONG) == 0  # short of the bar
    rows.put(0, LONG[:4])
    rows.put(3, LONG[:4 + AFFINITY_TOKENS])
    assert rows.take(LONG) == 3  # 36 tokens against the lowest row's 4
    rows.put(3, [99] + LONG)  # what it holds starts otherwise
    assert rows.take(LONG) == 0 and rows.take(LONG) == 2 and rows.take() == 3 and len(rows) == 0
    rows.put(1)
    with pytest.raises(ValueError, match="already free"):
        rows.put(1)


def test_a_conversations_next_turn_returns_to_its_row() -> None:
    core = SchedulerCore(SchedulerConfig(num_rows=3, row_capacity=256, vocab_size=500, max_tree_nodes=4,
                                         adaptive_speculation=False, max_decode_steps=1))
    params = SamplingParams(max_new_tokens=4)

    def submit(rid: str, prompt: list[int], now: float) -> None:
        core.enqueue(core.submit(rid, GenerateBody(rid, tuple(prompt), params, SpeculationMode.NONE), now))

    for rid in ("a", "b", "c"):
        submit(rid, LONG if rid == "b" else [1, 2], 0.0)
    plan = core.plan(0.0)
    rows = {a.request_id: a.row for chunk in plan.prefill_chunks for a in chunk}
    assert rows == {"a": 0, "b": 1, "c": 2}
    answer = [7, 8, 9, 11]
    now = 0.0
    for token in answer:  # every request runs its four tokens and ends
        now += 1.0
        verify(core, plan, now, {"a": [3], "b": [token], "c": [3]})
        plan = core.plan(now)
    assert core.snapshot()["num_free_rows"] == 3
    submit("b2", LONG + answer + [40, 41], now)  # b's next turn: b's row held LONG and its first 3 tokens
    submit("other", [1, 2, 5], now + 0.5)
    plan = core.plan(now)
    rows = {a.request_id: a.row for chunk in plan.prefill_chunks for a in chunk}
    assert rows == {"other": 0, "b2": 1}
