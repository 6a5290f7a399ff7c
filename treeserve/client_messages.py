"""The client's side of the gateway's message bodies (``transport/PROTOCOL.md`` section 11):
the ``generate`` request body it sends, and the ``Chunk`` / ``Completion`` values it makes of
the ``stream_item`` / ``stream_end`` bodies it receives."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treeserve.ops.sampling import SamplingParams

__all__ = ["Chunk", "Completion", "chunk_from", "completion_from", "request_body"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Newly generated text (never half a UTF-8 character) and the token ids behind it;
    a chunk may carry ids but no text yet, or (at the end) text but no ids."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished generation: full ``text`` and ``token_ids``, why it stopped
    (``"stop"`` or ``"length"``), the gateway's stats (``ttft_s``/``total_s``/``queue_s``
    measured by the scheduler; ``mean_accepted_per_step`` is tokens emitted per verifier
    step, the speculation gain), ``client_ttft_s``/``client_total_s`` as seen here,
    ``predicted_len`` (the server's output-length prediction, when it orders by one) and
    ``matched_stop`` (the ``stop`` string that ended the text, if one did)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    num_prompt_tokens: int
    num_generated_tokens: int
    num_steps: int
    mean_accepted_per_step: float
    queue_s: float
    ttft_s: float
    total_s: float
    client_ttft_s: float
    client_total_s: float
    predicted_len: float | None = None
    matched_stop: str | None = None


def chunk_from(item: Any) -> Chunk:
    """The ``Chunk`` of a ``stream_item`` body (``{text, token_ids}``)."""
    body = item if isinstance(item, dict) else {}
    return Chunk(str(body.get("text", "")), tuple(int(t) for t in body.get("token_ids", ())))


def request_body(
    prompt: str | Sequence[Mapping[str, Any]] | Sequence[int],
    params: SamplingParams | None,
    speculate: str,
    overrides: Mapping[str, Any],
    length_hint: int | None = None,
) -> dict[str, Any]:
    """The ``generate`` body for ``prompt`` (text, chat messages or token ids), sampling
    ``params``, wire-named ``overrides`` (a None override is sent as nil: the server's
    default) and the client's ``length_hint`` (None: the key is left out, so a server that
    predates the field accepts the body). ``max_new_tokens`` is a deprecated alias of
    ``max_tokens`` (a ``DeprecationWarning``; it goes in the next release); giving both is a
    ``TypeError``."""
    body: dict[str, Any] = {}
    if isinstance(prompt, str):
        body["prompt"] = prompt
    elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt) and prompt:
        body["messages"] = [dict(m) for m in prompt]  # type: ignore[arg-type]
    elif isinstance(prompt, Sequence):
        body["prompt_ids"] = [int(t) for t in prompt]  # type: ignore[arg-type]
    else:
        raise TypeError("prompt must be a str, a list of {role, content} maps, or a list of token ids")
    if params is not None:  # duck-typed: importing SamplingParams would import torch
        body["temperature"] = float(params.temperature)
        body["top_p"] = float(params.top_p)
        body["max_tokens"] = int(params.max_new_tokens)
        if params.top_k is not None:
            body["top_k"] = int(params.top_k)
        if params.seed is not None:
            body["seed"] = int(params.seed)
        if params.stop_token_ids:
            body["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    body["speculate"] = speculate
    if "max_new_tokens" in overrides:
        if "max_tokens" in overrides:
            raise TypeError("give max_tokens only (max_new_tokens is its deprecated alias)")
        warnings.warn("max_new_tokens is deprecated; use max_tokens (the wire's name)", DeprecationWarning,
                      stacklevel=4)
    for key, value in overrides.items():
        body["max_tokens" if key == "max_new_tokens" else key] = value
    if length_hint is not None:  # checked by the server, where the request enters
        body["length_hint"] = length_hint
    return body


def completion_from(end_body: Any, ttft_s: float | None, total_s: float) -> Completion:
    """The ``Completion`` of a ``stream_end`` body, with the client's own timings (``ttft_s``
    None: no chunk came before the end)."""
    end: dict[str, Any] = end_body if isinstance(end_body, dict) else {}
    return Completion(
        text=str(end.get("text", "")),
        token_ids=tuple(int(t) for t in end.get("token_ids", ())),
        finish_reason=str(end.get("finish_reason", "")),
        num_prompt_tokens=int(end.get("num_prompt_tokens", 0)),
        num_generated_tokens=int(end.get("num_generated_tokens", len(end.get("token_ids", ())))),
        num_steps=int(end.get("num_steps", 0)),
        mean_accepted_per_step=float(end.get("mean_accepted_per_step", 0.0)),
        queue_s=float(end.get("queue_s", 0.0)),
        ttft_s=float(end.get("ttft_s", 0.0)),
        total_s=float(end.get("total_s", 0.0)),
        client_ttft_s=total_s if ttft_s is None else ttft_s,
        client_total_s=total_s,
        predicted_len=None if end.get("predicted_len") is None else float(end["predicted_len"]),
        matched_stop=None if end.get("matched_stop") is None else str(end["matched_stop"]),
    )
