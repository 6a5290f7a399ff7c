"""``VerifierGroup``: the tensor-parallel verifier shards behind one object.

Every shard gets every call, in the same order: tensor parallelism needs each rank to run the
same forwards and collectives (see :mod:`treeserve.actors.verifier`). The group builds each
call's body once (token trees and sampling params to their wire form) and hands that one body
to every shard. With more than one shard the body says ``"rank0_answers": true``: ranks >= 1
then answer ``None`` once they have committed, since their rows and hidden states would be
thrown away; rank 0's reply is checked here and returned as typed results. (The runtime still
packs the message once per remote shard: sharing that work too needs a multicast ``ask``.)

Failures: when shards fail, a retryable error (a dead rank) wins over the errors it caused in
the others (a broken collective), so the caller judges the failure by its cause; every error
is an ``ActorError``. A reply that does not answer the rows asked (wrong rows, missing fields,
states that do not add up) raises :class:`MalformedReply`: a bug on one side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treeserve.actors.tree_wire import params_to_wire, split_states, tree_to_wire
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree
from treeserve.runtime import ActorError, ActorRef
from treeserve.transport.wire import ErrorCode


class MalformedReply(RuntimeError):
    """A speculator or verifier answered something the scheduler cannot use (wrong rows,
    missing fields): a bug on one side, handled like any unexpected step failure."""


@dataclass(frozen=True)
class PrefillRow:
    """Reset cache row ``row`` and commit ``prompt_ids[:-1]`` (the last token is the row's
    first tree root); ``return_states``: answer the prompt's hidden states too."""

    row: int
    prompt_ids: Sequence[int]
    return_states: bool = False


@dataclass(frozen=True)
class StepRow:
    """Verify ``tree`` (rooted at the row's last token) in cache row ``row`` under ``params``;
    ``request_id`` names the request's random generator on rank 0."""

    row: int
    tree: TokenTree
    params: SamplingParams
    request_id: str


@dataclass(frozen=True)
class RowVerdict:
    """Rank 0's answer for one step row: the accepted path (node indices, root first), the
    tokens it emits (the accepted drafts, then the bonus token) and, when asked for, the final
    hidden states of the accepted nodes, float32 ``(len(accepted), D)``. A row that failed
    numerically on its own has ``error`` instead (and nothing else)."""

    row: int
    accepted: tuple[int, ...] = ()
    new_tokens: tuple[int, ...] = ()
    states: np.ndarray | None = None
    error: str | None = None


class VerifierGroup:
    """The verifier shards ``shards`` (rank order) as one verifier; ``timeout_s`` bounds each call."""

    def __init__(self, shards: Sequence[ActorRef], *, timeout_s: float) -> None:
        if not shards:
            raise ValueError("a verifier group needs at least one shard")
        self.shards = tuple(shards)
        self.timeout_s = timeout_s

    @property
    def tp_size(self) -> int:
        return len(self.shards)

    async def prefill(self, rows: Sequence[PrefillRow]) -> list[np.ndarray | None]:
        """Prefill ``rows`` (batched forwards); each row's hidden states ``(n, D)``, or None for
        a row that asked for none."""
        body = {"rows": [{"row": r.row, "prompt_ids": list(r.prompt_ids), "return_states": r.return_states}
                         for r in rows]}
        reply = await self._fan_out("prefill", body)
        entries = _reply_rows(reply, [r.row for r in rows], "prefill")
        return _row_states(reply, entries, "prefill")

    async def step(self, rows: Sequence[StepRow], *, return_states: bool) -> list[RowVerdict]:
        """Verify one token tree per row in batched forwards and commit the accepted paths."""
        body = {
            "rows": [{"row": r.row, "tree": tree_to_wire(r.tree), "params": params_to_wire(r.params),
                      "request_id": r.request_id} for r in rows],
            "return_states": return_states,
        }
        reply = await self._fan_out("step", body)
        entries = _reply_rows(reply, [r.row for r in rows], "step")
        for entry in entries:
            if "error" not in entry:
                _require(entry, ("accepted", "new_tokens", *(("num_states",) if return_states else ())), "step")
        states = _row_states(reply, entries, "step") if return_states else [None] * len(entries)
        return [_verdict(entry, part) for entry, part in zip(entries, states)]

    async def release(self, row: int, request_id: str) -> None:
        """Forget ``row``'s cache and ``request_id``'s generator on every shard."""
        await self._fan_out("release", {"row": row, "request_id": request_id})

    async def _fan_out(self, method: str, body: dict[str, Any]) -> Any:
        """Send ``body`` (one object for all shards) to every shard; return rank 0's reply."""
        if len(self.shards) > 1 and method != "release":
            body = {**body, "rank0_answers": True}
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


def _require(entry: dict[str, Any], keys: Sequence[str], method: str) -> None:
    missing = [k for k in keys if k not in entry]
    if missing:
        raise MalformedReply(f"verifier {method} reply row {entry.get('row')!r} lacks {missing}")


def _reply_rows(reply: Any, rows: Sequence[int], method: str) -> list[dict[str, Any]]:
    """The verifier's per-row answers to ``method``, checked to name exactly ``rows`` in order."""
    entries = reply.get("rows") if isinstance(reply, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise MalformedReply(f"verifier {method} reply has no list of row maps 'rows'")
    answered = [e.get("row") for e in entries]
    if answered != list(rows):
        raise MalformedReply(f"verifier answered {method} for rows {answered}, asked for rows {list(rows)}")
    return entries


def _row_states(reply: dict[str, Any], entries: list[dict[str, Any]], method: str) -> list[np.ndarray | None]:
    """Each reply row's slice of the reply's stacked ``states`` (None: the row has none)."""
    counts = [entry.get("num_states") for entry in entries]
    if all(count is None for count in counts):
        return [None] * len(entries)
    if "states" not in reply:
        raise MalformedReply(f"verifier {method} reply gives num_states but no 'states'")
    try:
        parts = split_states(reply["states"], [count or 0 for count in counts])
    except ValueError as exc:
        raise MalformedReply(f"verifier {method} reply: {exc}") from None
    return [None if count is None else part for count, part in zip(counts, parts)]


def _verdict(entry: dict[str, Any], states: np.ndarray | None) -> RowVerdict:
    if "error" in entry:
        return RowVerdict(entry["row"], error=str(entry["error"]))
    return RowVerdict(entry["row"], _ints(entry, "accepted"), _ints(entry, "new_tokens"), states)


def _ints(entry: dict[str, Any], name: str) -> tuple[int, ...]:
    value = entry[name]
    if not isinstance(value, list) or not value or \
            not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in value):
        raise MalformedReply(f"verifier step reply row {entry['row']}: {name} is not a non-empty list of ints")
    return tuple(int(v) for v in value)


__all__ = ["MalformedReply", "PrefillRow", "RowVerdict", "StepRow", "VerifierGroup"]
