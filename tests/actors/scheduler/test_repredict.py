"""Re-prediction of running requests from their hidden states (``Repredictor`` in
``SchedulerCore``, fake verifier, fake clock): when the core asks for states, that it reads them,
and that a request its prompt predicted short but its states show long yields its row. The same
scene without the head keeps the row (the control: a core that ignored the head would pass the
first half and fail here)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from treeserve.actors.scheduler.core import SchedulerCore
from treeserve.actors.scheduler.preemption import predicted_remaining
from treeserve.actors.scheduler.types import Move, SchedulerConfig
from treeserve.actors.messages.gateway import GenerateBody
from treeserve.ops.remaining_head import RemainingHead
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculation_modes import SpeculationMode

from treeserve_testing.core_steps import verify

DIM = 4
EVERY = 16
EOS = 2
LONG = np.array([[1.0, 0.0, 0.0, 0.0]], np.float32)  # a state the head below reads as "runs to the cap"


def head() -> RemainingHead:
    w_cap = np.zeros(DIM + 2)
    w_cap[0] = 20.0
    return RemainingHead("tiny", DIM, EVERY, 512, np.zeros(DIM + 2), np.ones(DIM + 2), w_cap, -10.0,
                         np.zeros(DIM + 2), math.log1p(4))


def make_core(with_head: bool, **overrides: Any) -> SchedulerCore:
    base: dict[str, Any] = {"num_rows": 1, "preempt_rows": 1, "row_capacity": 1024, "vocab_size": 100,
                            "max_tree_nodes": 4, "adaptive_speculation": False, "max_decode_steps": 1,
                            "policy": "ssjf", "max_wait_s": 1000.0, "remaining_head": head() if with_head else None}
    return SchedulerCore(SchedulerConfig(**{**base, **overrides}))


def submit(core: SchedulerCore, rid: str, now: float, *, max_tokens: int, predicted: float) -> None:
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(EOS,))
    core.enqueue(core.submit(rid, GenerateBody(rid, (1, 2, 3), params, SpeculationMode.NONE), now), predicted)


def run(core: SchedulerCore, rid: str, num_tokens: int, state: np.ndarray) -> list[bool]:
    """Step the only running request ``rid`` through ``num_tokens`` distinct tokens, each state
    ``state``; whether each plan asked for states."""
    asked = []
    for n in range(num_tokens):
        plan = core.plan(0.01 * n)
        asked.append(plan.wants_states)
        verify(core, plan, 0.01 * n, {rid: [3 + n % 90]}, states={rid: state})
    return asked


def test_predicted_remaining_follows_the_latest_reprediction() -> None:
    assert predicted_remaining(100, 512, 150.0, None, (300.0, 96)) == 296.0
    assert predicted_remaining(100, 512, 150.0, None, (600.0, 96)) == 412.0  # never past the cap
    assert predicted_remaining(100, 512, 150.0, 90, (10.0, 96)) == 412.0  # a loop still runs to the cap


def test_states_are_asked_for_every_head_every_forwards_and_read() -> None:
    core = make_core(with_head=True)
    submit(core, "a", 0.0, max_tokens=400, predicted=30.0)
    asked = run(core, "a", 3 * EVERY + 1, LONG)
    assert [n for n, yes in enumerate(asked) if yes] == [0, EVERY, 2 * EVERY, 3 * EVERY]
    assert core.stats.num_repredicted == 4
    req = core._running["a"]
    assert req.repredicted is not None and req.repredicted[1] == 3 * EVERY + 1
    assert req.predicted_remaining > 300  # the state says "to the cap", the prompt said 30


def test_without_preemption_no_states_are_asked() -> None:
    core = make_core(with_head=True, preempt_rows=0)
    submit(core, "a", 0.0, max_tokens=400, predicted=30.0)
    assert not any(run(core, "a", EVERY + 1, LONG))


def test_a_row_its_states_show_long_yields_to_a_far_shorter_job() -> None:
    for with_head in (True, False):
        core = make_core(with_head)
        submit(core, "long", 0.0, max_tokens=400, predicted=30.0)
        run(core, "long", 2 * EVERY, LONG)
        submit(core, "short", 1.0, max_tokens=16, predicted=5.0)
        plan = core.plan(1.0)
        if with_head:
            assert plan.moves == (Move("long", 0, 1),)
        else:  # predicted 30 and past it: about to end, so it keeps its row
            assert plan.moves == () and core.stats.num_preempted == 0
