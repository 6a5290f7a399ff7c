"""The bodies between the scheduler and the speculators: ``start``, ``propose`` (and its reply)
and ``release`` (see :mod:`~treeserve.actors.messages.checks` for the contract every body keeps)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from treeserve.actors.messages.checks import MalformedReply, check_request_id, check_token_ids
from treeserve.actors.model_host import check_body, check_int
from treeserve.actors.messages.tree_wire import ParamsCache, pack_trees, params_to_wire, split_row_states, unpack_trees
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree


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
        return cls(check_request_id(body["request_id"]),
                   check_token_ids(body["prompt_ids"], "prompt_ids", vocab_size, non_empty=True))


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
            request_id = check_request_id(entry["request_id"])
            history, max_nodes = entry.get("history"), entry.get("max_nodes")
            requests.append(ProposalRequest(
                request_id,
                check_token_ids(entry["new_tokens"], "new_tokens", vocab_size),
                check_int(entry["max_depth"], "max_depth"),
                params.parse(request_id, entry["params"]),
                None if max_nodes is None else check_int(max_nodes, "max_nodes", minimum=1),
                None if history is None else check_token_ids(history, "history", vocab_size),
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
    """``release {"request_id", "new_tokens"?}`` to a speculator: forget the request
    (idempotent), after the speculators whose index outlives it (suffix) took ``new_tokens``,
    what it emitted since its last propose (all of its answer when plain decoding was chosen)."""

    request_id: str
    new_tokens: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"request_id": self.request_id}
        return {**wire, "new_tokens": list(self.new_tokens)} if self.new_tokens else wire

    @classmethod
    def from_wire(cls, body: Any, vocab_size: int) -> RequestRelease:
        body = check_body(body, ("request_id",), ("new_tokens",))
        return cls(check_request_id(body["request_id"]), check_token_ids(body.get("new_tokens", []), "new_tokens",
                                                                          vocab_size))


__all__ = ["ProposalRequest", "ProposeBody", "ProposeReply", "RequestRelease", "StartBody"]
