"""``VerifierGroup``: the tensor-parallel verifier shards behind one object.

Every shard gets every call, in the same order: tensor parallelism needs each rank to run the
same forwards and collectives (see :mod:`treeserve.actors.verifier`). The group builds each
call's body once (a :mod:`~treeserve.actors.messages.checks` body's ``to_wire``) and hands that one
body to every shard. With more than one shard the body says ``"rank0_answers": true``: ranks >= 1
then answer ``None`` once they have committed, since their rows and hidden states would be
thrown away; rank 0's reply is checked here (the message's ``from_wire``) and returned as
typed results. (The runtime still packs the message once per remote shard: sharing that work
too needs a multicast ``ask``.)

Failures: when shards fail, a retryable error (a dead rank) wins over the errors it caused in
the others (a broken collective), so the caller judges the failure by its cause; every error
is an ``ActorError``. A reply that does not answer the rows asked (wrong rows, missing fields,
states that do not add up) raises :class:`~treeserve.actors.messages.MalformedReply`: a bug
on one side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from treeserve.actors.messages.verifier import (
    PrefillBody,
    PrefillReply,
    PrefillRow,
    RowMove,
    RowRelease,
    RowVerdict,
    StepBody,
    StepReply,
    StepRow,
)
from treeserve.runtime import ActorError, ActorRef
from treeserve.transport.wire import ErrorCode


class VerifierGroup:
    """The verifier shards ``shards`` (rank order) as one verifier; ``timeout_s`` bounds each call."""

    def __init__(self, shards: Sequence[ActorRef], *, timeout_s: float) -> None:
        if not shards:
            raise ValueError("a verifier group needs at least one shard")
        self.shards = tuple(shards)
        self.timeout_s = timeout_s
        self.num_prefix_tokens_reused = 0  # prompt tokens whose K/V a row held already (not prefilled again)

    @property
    def tp_size(self) -> int:
        return len(self.shards)

    async def prefill(self, rows: Sequence[PrefillRow]) -> list[np.ndarray | None]:
        """Prefill ``rows`` (batched forwards); each row's hidden states ``(n, D)``, or None for
        a row that asked for none. Tokens a row held already count in ``num_prefix_tokens_reused``."""
        reply = await self._fan_out("prefill", PrefillBody(tuple(rows), rank0_answers=self.tp_size > 1).to_wire())
        prefilled = PrefillReply.from_wire(reply, [r.row for r in rows]).rows
        self.num_prefix_tokens_reused += sum(r.reused for r in prefilled)
        return [r.states for r in prefilled]

    async def step(self, rows: Sequence[StepRow], *, return_states: bool, decode_steps: int = 1) -> list[RowVerdict]:
        """Verify one token tree per row in batched forwards and commit the accepted paths
        (``decode_steps`` > 1: that many plain decode steps of one-node trees, see
        :class:`~treeserve.actors.messages.verifier.StepBody`)."""
        body = StepBody(tuple(rows), return_states, rank0_answers=self.tp_size > 1, decode_steps=decode_steps).to_wire()
        reply = await self._fan_out("step", body)
        return list(StepReply.from_wire(reply, [r.row for r in rows], return_states=return_states).verdicts)

    async def release(self, row: int, request_id: str) -> None:
        """Forget ``row``'s cache and ``request_id``'s generator on every shard."""
        await self._fan_out("release", RowRelease(row, request_id).to_wire())

    async def move(self, src: int, dst: int) -> None:
        """Move row ``src``'s cache to the empty row ``dst`` on every shard (a preempted request
        parks, or resumes)."""
        await self._fan_out("move", RowMove(src, dst).to_wire())

    async def _fan_out(self, method: str, body: dict[str, Any]) -> Any:
        """Send ``body`` (one object for all shards) to every shard; return rank 0's reply."""
        results = await asyncio.gather(
            *(shard.ask(method, body, timeout=self.timeout_s) for shard in self.shards),
            return_exceptions=True,
        )
        errors: list[ActorError] = []
        for result in results:
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, ActorError):
                errors.append(result)
            elif isinstance(result, BaseException):
                errors.append(ActorError(f"{type(result).__name__}: {result}", code=ErrorCode.INTERNAL))
        if errors:
            raise next((e for e in errors if e.retryable), errors[0])
        return results[0]


__all__ = ["VerifierGroup"]
