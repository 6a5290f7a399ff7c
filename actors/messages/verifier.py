"""The bodies between the scheduler and the verifier shards: ``prefill``, ``step`` and ``release``
requests, and the ``prefill`` and ``step`` replies, checked row by row against the rows asked
for (see :mod:`~treeserve.actors.messages.checks` for the contract every body keeps, and for how the
rows' states and dense draft probabilities are stacked into one frame per kind)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treeserve.actors.messages.checks import MalformedReply, check_entries, check_flag, check_request_id, check_token_ids
from treeserve.actors.model_host import check_body, check_int
from treeserve.actors.messages.tree_wire import (
    ParamsCache,
    pack_trees,
    params_to_wire,
    split_row_states,
    stack_states,
    unpack_trees,
)
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree


# ---------------------------------------------------------------------- scheduler -> verifier
@dataclass(frozen=True)
class PrefillRow:
    """Reset cache row ``row`` and commit ``prompt_ids[:-1]`` (the last token is the row's
    first tree root); ``return_states``: answer the prompt's hidden states too."""

    row: int
    prompt_ids: Sequence[int]
    return_states: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"row": self.row, "prompt_ids": list(self.prompt_ids), "return_states": self.return_states}

    @classmethod
    def from_wire(cls, entry: Any) -> PrefillRow:
        entry = check_body(entry, ("row", "prompt_ids"), ("return_states",))
        return cls(check_int(entry["row"], "row"), check_token_ids(entry["prompt_ids"], "prompt_ids", non_empty=True),
                   check_flag(entry, "return_states"))


@dataclass(frozen=True)
class PrefillBody:
    """``prefill {"rows": [PrefillRow...], "rank0_answers"?}``; ``rank0_answers``: ranks >= 1
    run the call but answer None (see :class:`~treeserve.actors.verifier_group.VerifierGroup`)."""

    rows: tuple[PrefillRow, ...]
    rank0_answers: bool = False

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"rows": [r.to_wire() for r in self.rows]}
        return {**wire, "rank0_answers": True} if self.rank0_answers else wire

    @classmethod
    def from_wire(cls, body: Any) -> PrefillBody:
        body = check_body(body, ("rows",), ("rank0_answers",))
        rows = tuple(PrefillRow.from_wire(e) for e in check_entries(body, "rows", "prefill"))
        return cls(rows, check_flag(body, "rank0_answers"))


@dataclass(frozen=True, slots=True)
class StepRow:
    """Verify ``tree`` (rooted at the row's last token) in cache row ``row`` under ``params``;
    ``request_id`` names the request's random generator on rank 0."""

    row: int
    tree: TokenTree
    params: SamplingParams
    request_id: str


MAX_DECODE_STEPS = 64
"""The most plain decode steps one ``step`` call may ask for (``decode_steps``)."""


@dataclass(frozen=True)
class StepBody:
    """``step {"rows": [{"row", "tree", "params", "request_id"}], "return_states"?, "draft_probs"?,
    "rank0_answers"?, "decode_steps"?}``: one token tree per row, verified in batched forwards;
    the trees' dense draft probabilities stacked in ``draft_probs`` (see the module docstring).

    ``decode_steps`` k > 1 (at most :data:`MAX_DECODE_STEPS`) asks for k plain decode steps in
    one call: every tree must be its root alone. Each step decodes one token per row and the
    next step's root is that token; a row stops early after a stop token of its params. A row's
    verdict then has ``accepted == (0,)`` and up to k ``new_tokens``, exactly what k one-step
    calls would have emitted, and with ``return_states`` the states of those calls' roots, one
    per new token (what a feature drafter needs, so it does not hold its requests to one token
    a call when the adaptive policy chose plain decoding)."""

    rows: tuple[StepRow, ...]
    return_states: bool = False
    rank0_answers: bool = False
    decode_steps: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.decode_steps, bool) or not isinstance(self.decode_steps, int) or \
                not 1 <= self.decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(f"decode_steps must be an int in [1, {MAX_DECODE_STEPS}], got {self.decode_steps!r}")
        if self.decode_steps > 1:
            wide = [r.row for r in self.rows if r.tree.num_nodes != 1]
            if wide:
                raise ValueError(f"a step of several decode steps takes one-node trees; rows {wide} have more")

    def to_wire(self) -> dict[str, Any]:
        trees, stacked = pack_trees([r.tree for r in self.rows])
        wire: dict[str, Any] = {
            "rows": [{"row": r.row, "tree": tree, "params": params_to_wire(r.params), "request_id": r.request_id}
                     for r, tree in zip(self.rows, trees)],
            "return_states": self.return_states,
        }
        if stacked is not None:
            wire["draft_probs"] = stacked
        if self.decode_steps > 1:
            wire["decode_steps"] = self.decode_steps
        return {**wire, "rank0_answers": True} if self.rank0_answers else wire

    @classmethod
    def from_wire(cls, body: Any, params: ParamsCache) -> StepBody:
        """Validate and decode; each request's params come from (and go to) ``params``."""
        body = check_body(body, ("rows",), ("return_states", "rank0_answers", "draft_probs", "decode_steps"))
        entries = [check_body(e, ("row", "tree", "params", "request_id")) for e in check_entries(body, "rows", "step")]
        trees = unpack_trees([e["tree"] for e in entries], body.get("draft_probs"))
        rows = []
        for entry, tree in zip(entries, trees):
            request_id = check_request_id(entry["request_id"])
            if tree is None:
                raise ValueError(f"step row {entry['row']!r} has no token tree")
            rows.append(StepRow(check_int(entry["row"], "row"), tree, params.parse(request_id, entry["params"]),
                                request_id))
        decode_steps = check_int(body.get("decode_steps", 1), "decode_steps")
        return cls(tuple(rows), check_flag(body, "return_states"), check_flag(body, "rank0_answers"), decode_steps)


@dataclass(frozen=True)
class RowRelease:
    """``release {"row", "request_id"}`` to a verifier shard: forget the row's cache and the request."""

    row: int
    request_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"row": self.row, "request_id": self.request_id}

    @classmethod
    def from_wire(cls, body: Any) -> RowRelease:
        body = check_body(body, ("row", "request_id"))
        return cls(check_int(body["row"], "row"), check_request_id(body["request_id"]))


@dataclass(frozen=True)
class RowMove:
    """``move {"src", "dst"}`` to a verifier shard: move row ``src``'s cache to the empty row
    ``dst`` (a preempted request parks there, and comes back the same way when it resumes)."""

    src: int
    dst: int

    def to_wire(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst}

    @classmethod
    def from_wire(cls, body: Any) -> RowMove:
        body = check_body(body, ("src", "dst"))
        return cls(check_int(body["src"], "src"), check_int(body["dst"], "dst"))


# ---------------------------------------------------------------------- verifier -> scheduler
@dataclass(frozen=True)
class PrefilledRow:
    """A verifier's answer for one prefill row: the committed ``length``, how many of those
    tokens' K/V the row held already (``reused``; not computed again) and, when asked for, the
    hidden states of ``prompt_ids[:-1]``, float32 ``(length, D)``."""

    row: int
    length: int
    states: np.ndarray | None = None
    reused: int = 0


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True)
class PrefillReply:
    """A verifier's ``prefill`` answer: ``{"rows": [{"row", "length", "reused"?, "num_states"?}],
    "states"?}``, the rows' states stacked."""

    rows: tuple[PrefilledRow, ...]

    def to_wire(self, dim: int) -> dict[str, Any]:
        wire: dict[str, Any] = {"rows": [{"row": r.row, "length": r.length,
                                          **({"reused": r.reused} if r.reused else {}),
                                          **({} if r.states is None else {"num_states": int(r.states.shape[0])})}
                                         for r in self.rows]}
        wanted = [r.states for r in self.rows if r.states is not None]
        return {**wire, "states": stack_states(wanted, dim)} if wanted else wire

    @classmethod
    def from_wire(cls, reply: Any, rows: Sequence[int]) -> PrefillReply:
        """Rank 0's answer for ``rows`` (in order); :class:`MalformedReply` if it is not that."""
        entries = _reply_rows(reply, rows, "prefill")
        for entry in entries:
            _require(entry, ("length",), "prefill")
        states = _reply_states(reply, entries, "prefill")
        reused = [_reply_int(e, "reused") if "reused" in e else 0 for e in entries]
        if any(not 0 <= n <= _reply_int(e, "length") for n, e in zip(reused, entries)):
            raise MalformedReply(f"prefill reply reuses more tokens than a row holds: {reused}")
        return cls(tuple(PrefilledRow(e["row"], _reply_int(e, "length"), s, n)
                         for e, s, n in zip(entries, states, reused)))


@dataclass(frozen=True)
class StepReply:
    """A verifier's ``step`` answer: ``{"rows": [{"row", "accepted", "bonus_token", "new_tokens",
    "num_states"?} | {"row", "error"}], "states"?}``, the rows' states stacked (``"states"``
    present iff the step asked for them)."""

    verdicts: tuple[RowVerdict, ...]
    return_states: bool = False

    def to_wire(self, dim: int) -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        kept: list[np.ndarray] = []
        for v in self.verdicts:
            if v.error is not None:
                rows.append({"row": v.row, "error": v.error})
                continue
            row = {"row": v.row, "accepted": list(v.accepted), "bonus_token": v.new_tokens[-1],
                   "new_tokens": list(v.new_tokens)}
            if v.states is not None:
                row["num_states"] = int(v.states.shape[0])
                kept.append(v.states)
            rows.append(row)
        return {"rows": rows, "states": stack_states(kept, dim)} if self.return_states else {"rows": rows}

    @classmethod
    def from_wire(cls, reply: Any, rows: Sequence[int], *, return_states: bool) -> StepReply:
        """Rank 0's answer for ``rows`` (in order); :class:`MalformedReply` if it is not that."""
        entries = _reply_rows(reply, rows, "step")
        for entry in entries:
            if "error" not in entry:
                _require(entry, ("accepted", "new_tokens", *(("num_states",) if return_states else ())), "step")
        states = _reply_states(reply, entries, "step") if return_states else [None] * len(entries)
        return cls(tuple(RowVerdict(e["row"], error=str(e["error"])) if "error" in e else
                         RowVerdict(e["row"], _reply_ints(e, "accepted"), _reply_ints(e, "new_tokens"), s)
                         for e, s in zip(entries, states)), return_states)


def _require(entry: Mapping[str, Any], keys: Sequence[str], method: str) -> None:
    missing = [k for k in keys if k not in entry]
    if missing:
        raise MalformedReply(f"verifier {method} reply row {entry.get('row')!r} lacks {missing}")


def _reply_rows(reply: Any, rows: Sequence[int], method: str) -> list[Mapping[str, Any]]:
    """The verifier's per-row answers to ``method``, checked to name exactly ``rows`` in order."""
    entries = reply.get("rows") if isinstance(reply, Mapping) else None
    if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
        raise MalformedReply(f"verifier {method} reply has no list of row maps 'rows'")
    answered = [e.get("row") for e in entries]
    if answered != list(rows):
        raise MalformedReply(f"verifier answered {method} for rows {answered}, asked for rows {list(rows)}")
    return entries


def _reply_states(reply: Mapping[str, Any], entries: Sequence[Mapping[str, Any]], method: str) -> list[np.ndarray | None]:
    try:
        return split_row_states(reply.get("states"), [e.get("num_states") for e in entries])
    except ValueError as exc:
        raise MalformedReply(f"verifier {method} reply: {exc}") from None


def _reply_int(entry: Mapping[str, Any], name: str) -> int:
    value = entry[name]
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise MalformedReply(f"verifier reply row {entry['row']}: {name} is not an int")
    return int(value)


def _reply_ints(entry: Mapping[str, Any], name: str) -> tuple[int, ...]:
    value = entry[name]
    if not isinstance(value, list) or not value or \
            not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in value):
        raise MalformedReply(f"verifier step reply row {entry['row']}: {name} is not a non-empty list of ints")
    return tuple(int(v) for v in value)


__all__ = [
    "MAX_DECODE_STEPS", "PrefillBody", "PrefillReply", "PrefillRow", "PrefilledRow", "RowMove", "RowRelease", "RowVerdict", "StepBody", "StepReply",
    "StepRow",
]
