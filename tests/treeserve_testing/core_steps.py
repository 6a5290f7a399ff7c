"""Drive a :class:`~treeserve.actors.scheduler.core.SchedulerCore` through steps with a fake
verifier (no sockets, no model): the scheduler core's tests and the preemption tests share it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from treeserve.actors.messages.verifier import RowVerdict
from treeserve.actors.scheduler.core import SchedulerCore
from treeserve.actors.scheduler.types import StepEvents, StepPlan, StepReplies

__all__ = ["admitted", "verify"]


def admitted(plan: StepPlan) -> list[str]:
    return [a.request_id for chunk in plan.prefill_chunks for a in chunk]


def verify(core: SchedulerCore, plan: StepPlan, now: float, tokens: Mapping[str, Sequence[int]] | None = None,
           errors: Mapping[str, str] | None = None, states: Mapping[str, np.ndarray] | None = None) -> StepEvents:
    """The rest of ``plan``'s step with a fake verifier: row ``r`` emits ``tokens[r]`` (default
    one token 7), or fails with ``errors[r]``; no speculator is asked. When the plan asks for
    hidden states, row ``r`` returns ``states[r]`` (one row per token; default zeros of width 4)."""
    for chunk in plan.prefill_chunks:
        core.prefilled(chunk, [None] * len(chunk))
    asks = core.proposal_asks(plan)
    trees = core.merge_proposals(plan, asks, [None] * len(asks))
    verdicts = []
    for row in plan.rows:
        if errors and row.request_id in errors:
            verdicts.append(RowVerdict(row.row, error=errors[row.request_id]))
        else:
            new = tuple((tokens or {}).get(row.request_id, (7,)))
            returned = None
            if plan.wants_states:
                returned = (states or {}).get(row.request_id, np.zeros((len(new), 4), np.float32))
            verdicts.append(RowVerdict(row.row, tuple(range(len(new))), new, returned))
    return core.apply(plan, StepReplies(trees, tuple(verdicts), propose_s=0.0, verify_s=0.0), now)
