"""A stand-in for the verifier shard, for scheduler tests without a model: ``StepVerifier``
answers the scheduler's ``prefill``/``step``/``release`` calls, every step emitting one token
(7) for each row after ``step_s`` seconds."""

from __future__ import annotations

import asyncio
from typing import Any

from treeserve.runtime.actor import Actor, handler

__all__ = ["StepVerifier"]


class StepVerifier(Actor):
    """Every step emits one token (7) per row after ``step_s`` seconds."""

    max_concurrency = 8

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    @handler
    async def prefill(self, body: Any) -> Any:
        return {"rows": [{"row": r["row"], "length": len(r["prompt_ids"]) - 1} for r in body["rows"]]}

    @handler
    async def step(self, body: Any) -> Any:
        await asyncio.sleep(self.step_s)
        return {"rows": [{"row": r["row"], "accepted": [0], "bonus_token": 7, "new_tokens": [7]} for r in body["rows"]]}

    @handler
    async def release(self, body: Any) -> None:
        return None
