"""The bodies between the scheduler and the length predictor: ``predict`` and ``predict_batch``
(and their replies) and ``observe`` (see :mod:`~treeserve.actors.messages.checks` for the contract every body keeps)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from treeserve.actors.messages.checks import MalformedReply, check_request_id, check_token_ids
from treeserve.actors.model_host import check_body, check_int


@dataclass(frozen=True)
class PredictBody:
    """``predict {"request_id", "prompt_ids", "max_tokens"?}``: the predicted output length of one
    prompt asked for at most ``max_tokens`` tokens (a predictor that reads the cap needs it;
    absent: the predictor's own cap)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int | None = None

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"request_id": self.request_id, "prompt_ids": list(self.prompt_ids)}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body

    @classmethod
    def from_wire(cls, body: Any, vocab_size: int) -> PredictBody:
        body = check_body(body, ("request_id", "prompt_ids"), optional=("max_tokens",))
        max_tokens = body.get("max_tokens")
        return cls(check_request_id(body["request_id"]),
                   check_token_ids(body["prompt_ids"], "prompt_ids", vocab_size, non_empty=True),
                   None if max_tokens is None else check_int(max_tokens, "max_tokens", minimum=1))


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
class PredictBatchBody:
    """``predict_batch {"requests": [{"request_id", "prompt_ids"}, ...]}``: the predicted output
    lengths of several prompts in one call (the scheduler batches the requests that arrived
    while the previous call ran). At least one request; ids need not be unique."""

    requests: tuple[PredictBody, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"requests": [r.to_wire() for r in self.requests]}

    @classmethod
    def from_wire(cls, body: Any, vocab_size: int) -> PredictBatchBody:
        body = check_body(body, ("requests",))
        requests = body["requests"]
        if not isinstance(requests, list) or not requests:
            raise ValueError("requests must be a non-empty list of {request_id, prompt_ids}")
        return cls(tuple(PredictBody.from_wire(r, vocab_size) for r in requests))


@dataclass(frozen=True)
class PredictBatchReply:
    """``{"predicted_lens": [float, ...]}``: predicted output tokens, one per request, in order."""

    predicted_lens: tuple[float, ...]

    def to_wire(self) -> dict[str, list[float]]:
        return {"predicted_lens": list(self.predicted_lens)}

    @classmethod
    def from_wire(cls, reply: Any, num_requests: int) -> PredictBatchReply:
        values = reply.get("predicted_lens") if isinstance(reply, Mapping) else None
        if (not isinstance(values, list) or len(values) != num_requests
                or any(isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v) for v in values)):
            raise MalformedReply(f"the length predictor answered {reply!r}, not {num_requests} finite 'predicted_lens'")
        return cls(tuple(float(v) for v in values))


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
        return cls(check_request_id(body["request_id"]),
                   check_int(body["num_generated_tokens"], "num_generated_tokens"), censored)


__all__ = ["LengthReport", "PredictBatchBody", "PredictBatchReply", "PredictBody", "PredictReply"]
