"""The message bodies the serving actors send each other, as typed frozen dataclasses.

One class per body; ``to_wire()`` gives the msgpack-able dict a sender passes to ``ask``, and
``from_wire(...)`` is the receiver's one validation of it, at its handler's entry (a request
body) or where the answer comes back (a reply). After that, the actors pass the typed objects
and never re-check a field. The wire shapes are the handlers' docstrings' (``actors/verifier.py``,
``actors/speculator.py``, ``actors/length_predictor.py``, ``actors/scheduler.py``); token trees
and sampling params keep the field codecs of :mod:`~treeserve.actors.tree_wire`.

Errors: a malformed *request* body raises ``ValueError`` naming the field, which the runtime
answers as ``invalid_request`` (the receiver's range checks against its own config, such as a
row number or a token id, come with the body's parse); a malformed *reply* raises
:class:`MalformedReply`, a bug on one side.

Frames: a message's tensors travel as one frame per kind, whatever the row count. The rows'
hidden states are stacked into one ``(sum n_i, D)`` float32 array (each row says its
``num_states``), and so are the trees' dense ``draft_probs``: ``(sum R_i, V)`` in the body's
``"draft_probs"``, each such tree's field then being ``{"stacked": R_i}``
(:func:`~treeserve.actors.tree_wire.pack_trees`). Sparse and absent ``draft_probs`` stay in
the tree, costing no frame.

Params: a request's sampling params are the same at every step, so a receiver parses each
request's params once (:class:`~treeserve.actors.tree_wire.ParamsCache`), not once per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from treeserve.actors.gateway_request import Speculate, sampling_temperature
from treeserve.actors.model_host import check_body, check_int
from treeserve.actors.tree_wire import (
    ParamsCache,
    pack_trees,
    params_from_wire,
    params_to_wire,
    split_row_states,
    stack_states,
    unpack_trees,
)
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree


class MalformedReply(RuntimeError):
    """A speculator or verifier answered something the scheduler cannot use (wrong rows,
    missing fields): a bug on one side, handled like any unexpected step failure."""


# ---------------------------------------------------------------------- field checks
def _request_id(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"request_id must be a non-empty string, got {value!r}")
    return value


def _token_ids(value: Any, name: str, vocab_size: int | None = None, *, non_empty: bool = False) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or (non_empty and not value):
        raise ValueError(f"{name} must be a {'non-empty ' if non_empty else ''}list of token ids")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in value):
        raise ValueError(f"{name} must hold non-negative integers")
    if vocab_size is not None and any(t >= vocab_size for t in value):
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size})")
    return tuple(value)


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _entries(body: Mapping[str, Any], name: str, what: str) -> list[Any] | tuple[Any, ...]:
    value = body[name]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{what} needs a non-empty list {name!r}")
    return value


# ---------------------------------------------------------------------- gateway -> scheduler
@dataclass(frozen=True)
class GenerateBody:
    """The scheduler's ``generate {"request_id"?, "prompt_ids", "params"?, "speculate"?}`` body.

    ``params`` are the request's sampling params, with the one temperature rule applied
    (``transport/PROTOCOL.md`` 11.3: below the smallest sampling temperature is greedy, so no
    row's scaled logits overflow); ``request_id`` None: the scheduler names the request."""

    request_id: str | None
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    speculate: Speculate = Speculate.TREE

    def to_wire(self) -> dict[str, Any]:
        wire = {"prompt_ids": list(self.prompt_ids), "params": params_to_wire(self.params),
                "speculate": self.speculate.value}
        return wire if self.request_id is None else {"request_id": self.request_id, **wire}

    @classmethod
    def from_wire(cls, body: Any, vocab_size: int) -> GenerateBody:
        if not isinstance(body, Mapping):
            raise ValueError("generate body must be a map")
        unknown = set(body) - {"request_id", "prompt_ids", "params", "speculate"}
        if unknown:
            raise ValueError(f"unknown generate fields: {sorted(map(str, unknown))}")
        prompt = body.get("prompt_ids")
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt_ids must be a list of integers")
        if not prompt:
            raise ValueError("prompt_ids must not be empty")
        if any(not 0 <= t < vocab_size for t in prompt):
            raise ValueError(f"prompt_ids contains a token id outside [0, {vocab_size})")
        params = params_from_wire(body.get("params") or {})
        params = replace(params, temperature=sampling_temperature(params.temperature))
        speculate = body.get("speculate", Speculate.TREE.value)
        if speculate not in tuple(Speculate):
            raise ValueError(f"speculate must be one of {tuple(m.value for m in Speculate)}, got {speculate!r}")
        request_id = body.get("request_id")
        return cls(request_id if isinstance(request_id, str) and request_id else None, tuple(prompt), params,
                   Speculate(speculate))


@dataclass(frozen=True)
class FinishBody:
    """``finish {"request_id", "num_tokens"}``: end a running request after its ``num_tokens``-th token."""

    request_id: str
    num_tokens: int

    def to_wire(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "num_tokens": self.num_tokens}

    @classmethod
    def from_wire(cls, body: Any) -> FinishBody:
        if not isinstance(body, Mapping) or set(body) != {"request_id", "num_tokens"}:
            raise ValueError("finish takes {request_id, num_tokens}")
        num_tokens = body["num_tokens"]
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
        return cls(_request_id(body["request_id"]), num_tokens)


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
        return cls(check_int(entry["row"], "row"), _token_ids(entry["prompt_ids"], "prompt_ids", non_empty=True),
                   _flag(entry, "return_states"))


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
        rows = tuple(PrefillRow.from_wire(e) for e in _entries(body, "rows", "prefill"))
        return cls(rows, _flag(body, "rank0_answers"))


@dataclass(frozen=True, slots=True)
class StepRow:
    """Verify ``tree`` (rooted at the row's last token) in cache row ``row`` under ``params``;
    ``request_id`` names the request's random generator on rank 0."""

    row: int
    tree: TokenTree
    params: SamplingParams
    request_id: str


@dataclass(frozen=True)
class StepBody:
    """``step {"rows": [{"row", "tree", "params", "request_id"}], "return_states"?, "draft_probs"?,
    "rank0_answers"?}``: one token tree per row, verified in batched forwards; the trees'
    dense draft probabilities stacked in ``draft_probs`` (see the module docstring)."""

    rows: tuple[StepRow, ...]
    return_states: bool = False
    rank0_answers: bool = False

    def to_wire(self) -> dict[str, Any]:
        trees, stacked = pack_trees([r.tree for r in self.rows])
        wire: dict[str, Any] = {
            "rows": [{"row": r.row, "tree": tree, "params": params_to_wire(r.params), "request_id": r.request_id}
                     for r, tree in zip(self.rows, trees)],
            "return_states": self.return_states,
        }
        if stacked is not None:
            wire["draft_probs"] = stacked
        return {**wire, "rank0_answers": True} if self.rank0_answers else wire

    @classmethod
    def from_wire(cls, body: Any, params: ParamsCache) -> StepBody:
        """Validate and decode; each request's params come from (and go to) ``params``."""
        body = check_body(body, ("rows",), ("return_states", "rank0_answers", "draft_probs"))
        entries = [check_body(e, ("row", "tree", "params", "request_id")) for e in _entries(body, "rows", "step")]
        trees = unpack_trees([e["tree"] for e in entries], body.get("draft_probs"))
        rows = []
        for entry, tree in zip(entries, trees):
            request_id = _request_id(entry["request_id"])
            if tree is None:
                raise ValueError(f"step row {entry['row']!r} has no token tree")
            rows.append(StepRow(check_int(entry["row"], "row"), tree, params.parse(request_id, entry["params"]),
                                request_id))
        return cls(tuple(rows), _flag(body, "return_states"), _flag(body, "rank0_answers"))


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
        return cls(check_int(body["row"], "row"), _request_id(body["request_id"]))


# ---------------------------------------------------------------------- verifier -> scheduler
@dataclass(frozen=True)
class PrefilledRow:
    """A verifier's answer for one prefill row: the committed ``length`` and, when asked for,
    the hidden states of ``prompt_ids[:-1]``, float32 ``(length, D)``."""

    row: int
    length: int
    states: np.ndarray | None = None


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
    """A verifier's ``prefill`` answer: ``{"rows": [{"row", "length", "num_states"?}], "states"?}``,
    the rows' states stacked."""

    rows: tuple[PrefilledRow, ...]

    def to_wire(self, dim: int) -> dict[str, Any]:
        wire: dict[str, Any] = {"rows": [{"row": r.row, "length": r.length} if r.states is None else
                                         {"row": r.row, "length": r.length, "num_states": int(r.states.shape[0])}
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
        return cls(tuple(PrefilledRow(e["row"], _reply_int(e, "length"), s) for e, s in zip(entries, states)))


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


# ---------------------------------------------------------------------- scheduler <-> speculator
@dataclass(frozen=True)
class StartBody:
    """``start {"request_id", "prompt_ids"}``: fresh speculator state over the prompt."""

    request_id: str
    prompt_ids: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_ids": list(self.prompt_ids)}

    @classmethod
    def from_wire(cls, body: Any, vocab_size: int) -> StartBody:
        body = check_body(body, ("request_id", "prompt_ids"))
        return cls(_request_id(body["request_id"]), _token_ids(body["prompt_ids"], "prompt_ids", vocab_size, non_empty=True))


@dataclass(frozen=True, slots=True)
class ProposalRequest:
    """One request of a ``propose`` call: advance by ``new_tokens``, then draft a tree at most
    ``max_depth`` deep and (with ``max_nodes``) that many nodes; ``history`` (the full sequence,
    ending with the root) rebuilds a speculator that lost the request; ``states`` are the LLM's
    hidden states ``(n, D)`` of the tokens since the last ones sent."""

    request_id: str
    new_tokens: tuple[int, ...]
    max_depth: int
    params: SamplingParams
    max_nodes: int | None = None
    history: tuple[int, ...] | None = None
    states: np.ndarray | None = None


@dataclass(frozen=True)
class ProposeBody:
    """``propose {"requests": [{"request_id", "new_tokens", "max_depth", "params", "max_nodes"?,
    "history"?, "num_states"?}], "states"?}``, the requests' states stacked in ``states``."""

    requests: tuple[ProposalRequest, ...]

    def to_wire(self) -> dict[str, Any]:
        entries = []
        for r in self.requests:
            entry: dict[str, Any] = {"request_id": r.request_id, "new_tokens": list(r.new_tokens),
                                     "max_depth": r.max_depth, "params": params_to_wire(r.params)}
            if r.max_nodes is not None:
                entry["max_nodes"] = r.max_nodes
            if r.history is not None:
                entry["history"] = list(r.history)
            if r.states is not None:
                entry["num_states"] = int(r.states.shape[0])
            entries.append(entry)
        states = [r.states for r in self.requests if r.states is not None]
        wire: dict[str, Any] = {"requests": entries}
        return {**wire, "states": np.concatenate(states)} if states else wire

    @classmethod
    def from_wire(cls, body: Any, *, vocab_size: int, dim: int, params: ParamsCache) -> ProposeBody:
        """Validate and decode (token ids below ``vocab_size``, states ``dim`` wide)."""
        body = check_body(body, ("requests",), ("states",))
        entries = body["requests"]
        if not isinstance(entries, (list, tuple)):
            raise ValueError("propose needs a list 'requests'")
        checked = [check_body(e, ("request_id", "new_tokens", "max_depth", "params"),
                              ("history", "max_nodes", "num_states")) for e in entries]
        states = split_row_states(body.get("states"), [e.get("num_states") for e in checked], dim)
        requests = []
        for entry, part in zip(checked, states):
            request_id = _request_id(entry["request_id"])
            history, max_nodes = entry.get("history"), entry.get("max_nodes")
            requests.append(ProposalRequest(
                request_id,
                _token_ids(entry["new_tokens"], "new_tokens", vocab_size),
                check_int(entry["max_depth"], "max_depth"),
                params.parse(request_id, entry["params"]),
                None if max_nodes is None else check_int(max_nodes, "max_nodes", minimum=1),
                None if history is None else _token_ids(history, "history", vocab_size),
                part,
            ))
        return cls(tuple(requests))


@dataclass(frozen=True)
class ProposeReply:
    """A speculator's ``propose`` answer: one tree per request (None: no proposal), in request
    order, and the requests it had no state for (``missing``: send their history next time)."""

    trees: tuple[TokenTree | None, ...]
    missing: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        trees, stacked = pack_trees(self.trees)
        wire: dict[str, Any] = {"trees": trees, "missing": list(self.missing)}
        return wire if stacked is None else {**wire, "draft_probs": stacked}

    @classmethod
    def from_wire(cls, reply: Any, num_requests: int, speculator: int) -> ProposeReply:
        """Speculator ``speculator``'s answer for ``num_requests`` requests; :class:`MalformedReply`
        if it is not that (a tree that does not decode included)."""
        if not isinstance(reply, Mapping) or not isinstance(reply.get("trees"), list):
            raise MalformedReply(f"speculator {speculator} answered propose without a list 'trees'")
        wires = reply["trees"]
        if len(wires) != num_requests:
            raise MalformedReply(f"speculator {speculator} answered {len(wires)} trees for {num_requests} requests")
        missing = reply.get("missing", [])
        if not isinstance(missing, list) or not all(isinstance(m, str) for m in missing):
            raise MalformedReply(f"speculator {speculator} answered a 'missing' that is not a list of request ids")
        try:
            trees = unpack_trees(wires, reply.get("draft_probs"))
        except ValueError as exc:
            raise MalformedReply(f"speculator {speculator} answered a malformed tree: {exc}") from None
        return cls(tuple(trees), tuple(missing))


@dataclass(frozen=True)
class RequestRelease:
    """``release {"request_id"}`` to a speculator: forget the request (idempotent)."""

    request_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"request_id": self.request_id}

    @classmethod
    def from_wire(cls, body: Any) -> RequestRelease:
        return cls(_request_id(check_body(body, ("request_id",))["request_id"]))


# ---------------------------------------------------------------------- scheduler <-> length predictor
@dataclass(frozen=True)
class PredictBody:
    """``predict {"request_id", "prompt_ids"}``: the predicted output length of one prompt."""

    request_id: str
    prompt_ids: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_ids": list(self.prompt_ids)}

    @classmethod
    def from_wire(cls, body: Any, vocab_size: int) -> PredictBody:
        body = check_body(body, ("request_id", "prompt_ids"))
        return cls(_request_id(body["request_id"]), _token_ids(body["prompt_ids"], "prompt_ids", vocab_size, non_empty=True))


@dataclass(frozen=True)
class PredictReply:
    """``{"predicted_len": float}``: predicted output tokens."""

    predicted_len: float

    def to_wire(self) -> dict[str, float]:
        return {"predicted_len": self.predicted_len}

    @classmethod
    def from_wire(cls, reply: Any) -> PredictReply:
        value = reply.get("predicted_len") if isinstance(reply, Mapping) else None
        if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
            raise MalformedReply(f"the length predictor answered {reply!r}, not a finite 'predicted_len'")
        return cls(float(value))


@dataclass(frozen=True)
class LengthReport:
    """``observe {"request_id", "num_generated_tokens", "is_censored"}``: how long a request
    really ran, for a length predictor that learns online (``is_censored``: the request ended
    before its natural end, so the length is a lower bound)."""

    request_id: str
    num_generated_tokens: int
    is_censored: bool

    def to_wire(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "num_generated_tokens": self.num_generated_tokens,
                "is_censored": self.is_censored}

    @classmethod
    def from_wire(cls, body: Any) -> LengthReport:
        body = check_body(body, ("request_id", "num_generated_tokens", "is_censored"))
        censored = body["is_censored"]
        if not isinstance(censored, bool):
            raise ValueError("is_censored must be true or false")
        return cls(_request_id(body["request_id"]), check_int(body["num_generated_tokens"], "num_generated_tokens"),
                   censored)


__all__ = [
    "FinishBody", "GenerateBody", "LengthReport", "MalformedReply", "PredictBody", "PredictReply",
    "PrefillBody", "PrefillReply", "PrefillRow", "PrefilledRow", "ProposalRequest", "ProposeBody", "ProposeReply",
    "RequestRelease", "RowRelease", "RowVerdict", "StartBody", "StepBody", "StepReply", "StepRow",
]
