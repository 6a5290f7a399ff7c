"""The bodies the gateway sends the scheduler: ``generate`` and ``finish`` (see
:mod:`~treeserve.actors.messages.checks` for the contract every body keeps)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from treeserve.actors.gateway.request import InvalidRequest, sampling_temperature
from treeserve.ops.speculation_modes import SpeculationMode
from treeserve.actors.messages.checks import check_request_id
from treeserve.actors.messages.tree_wire import params_from_wire, params_to_wire
from treeserve.ops.sampling import SamplingParams


@dataclass(frozen=True)
class GenerateBody:
    """The scheduler's ``generate {"request_id"?, "prompt_ids", "params"?, "speculate"?,
    "length_hint"?}`` body: a request as tokens and sampling params, which is all the scheduler
    reads. The gateway builds it from a checked :class:`~treeserve.actors.gateway.request.GenerateRequest`
    and, in its own process, hands the object over as it is (:meth:`received`); a body from
    another process is checked once, by :meth:`from_wire`.

    ``params`` are the request's sampling params, with the one temperature rule applied
    (``transport/PROTOCOL.md`` 11.3: below the smallest sampling temperature is greedy, so no
    row's scaled logits overflow); ``request_id`` None: the scheduler names the request;
    ``length_hint`` (an int >= 1, or None/absent) is the client's expected output tokens, which a
    length-ordered scheduler reads instead of predicting (``PROTOCOL.md`` 11.3)."""

    request_id: str | None
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    speculate: SpeculationMode = SpeculationMode.TREE
    length_hint: int | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"prompt_ids": list(self.prompt_ids), "params": params_to_wire(self.params),
                                "speculate": self.speculate.value}
        if self.length_hint is not None:
            wire["length_hint"] = self.length_hint
        return wire if self.request_id is None else {"request_id": self.request_id, **wire}

    @classmethod
    def received(cls, body: Any, *, vocab_size: int, context_length: int) -> GenerateBody:
        """The body a ``generate`` handler got: the object itself when it came from this process
        (checked where it entered: the gateway's ``parse_generate``), else :meth:`from_wire`'s."""
        if isinstance(body, GenerateBody):
            return body
        return cls.from_wire(body, vocab_size=vocab_size, context_length=context_length)

    @classmethod
    def from_wire(cls, body: Any, *, vocab_size: int, context_length: int) -> GenerateBody:
        """The one check of a body that crossed a process: ``InvalidRequest`` naming the bad
        field. The prompt's ids must lie in ``[0, vocab_size)``, and the prompt and ``max_new_tokens``
        must fit ``context_length`` (a row less one token tree)."""
        if not isinstance(body, Mapping):
            raise InvalidRequest("generate body must be a map")
        unknown = set(body) - {"request_id", "prompt_ids", "params", "speculate", "length_hint"}
        if unknown:
            raise InvalidRequest(f"unknown generate fields: {sorted(map(str, unknown))}")
        prompt = body.get("prompt_ids")
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequest("prompt_ids must be a list of integers", "prompt_ids")
        if not prompt:
            raise InvalidRequest("prompt_ids must not be empty", "prompt_ids")
        if any(not 0 <= t < vocab_size for t in prompt):
            raise InvalidRequest(f"prompt_ids contains a token id outside [0, {vocab_size})", "prompt_ids")
        try:
            params = params_from_wire(body.get("params") or {})
        except ValueError as exc:
            raise InvalidRequest(str(exc), "params") from None
        params = replace(params, temperature=sampling_temperature(params.temperature))
        if len(prompt) + params.max_new_tokens > context_length:
            raise InvalidRequest(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_new_tokens}) does not fit "
                                 f"the context of {context_length} tokens", "max_tokens")
        speculate = body.get("speculate", SpeculationMode.TREE.value)
        if speculate not in tuple(SpeculationMode):
            raise InvalidRequest(f"speculate must be one of {tuple(m.value for m in SpeculationMode)}, got {speculate!r}",
                                 "speculate")
        length_hint = body.get("length_hint")
        if length_hint is not None and (isinstance(length_hint, bool) or not isinstance(length_hint, int)
                                        or length_hint < 1):
            raise InvalidRequest(f"length_hint must be an int >= 1, got {length_hint!r}", "length_hint")
        request_id = body.get("request_id")
        return cls(request_id if isinstance(request_id, str) and request_id else None, tuple(prompt), params,
                   SpeculationMode(speculate), length_hint)


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
        return cls(check_request_id(body["request_id"]), num_tokens)


__all__ = ["FinishBody", "GenerateBody"]
