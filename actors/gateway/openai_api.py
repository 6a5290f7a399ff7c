"""The OpenAI API's shapes, mapped onto treeserve's own: a ``/v1/chat/completions`` or
``/v1/completions`` body becomes a wire ``generate`` body (``transport/PROTOCOL.md`` 11), which
then takes the ZeroMQ gateway's own path (``parse_generate``, ``prompt_ids_for``,
``scheduler_body``, ``relay_generation``); the ``stream_end`` body it yields becomes the
response objects, chunks and ``usage``. Errors are :class:`ApiError` (OpenAI's
``{"error": {...}}`` shape and an HTTP status). No I/O here.

OpenAI's defaults hold where they differ from the wire's: ``temperature`` 1.0, ``max_tokens``
16 for completions and the rest of the context for chat. ``null`` for any optional field
means its default. Fields that ask for what treeserve does not do (``n`` > 1, penalties,
logprobs, tools...) are refused with 400 unless they carry their neutral value; unknown fields
are refused too, so that a typo never silently changes what gets generated.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from treeserve.actors.gateway.stream import error_reply
from treeserve.transport.wire import ErrorCode

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "ApiError",
    "Endpoint",
    "OpenAIRequest",
    "ResponseHead",
    "api_error_from",
    "chunk_body",
    "completion_body",
    "default_max_tokens",
    "finish_reason_of",
    "parse_openai",
    "usage_of",
]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions`` (chat defaults to the rest of the context)."""

_DEFAULT_TEMPERATURE = 1.0  # OpenAI's; the wire's default is greedy
_EXTENSION_KEYS = frozenset({"speculate", "top_k", "stop_token_ids", "parse_special_tokens", "length_hint"})
_COMMON_KEYS = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
                          "stream_options", "user", "treeserve"})
# Fields treeserve does not implement, accepted only with the value that asks for nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},),
    "logprobs": (False, 0), "top_logprobs": (0,), "response_format": ({"type": "text"},),
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False), "metadata": ({},),
    "store": (False,), "echo": (False,), "best_of": (1,), "suffix": ("",),
}
_CHAT_KEYS = _COMMON_KEYS | {"messages", "max_completion_tokens", "frequency_penalty", "presence_penalty",
                             "logit_bias", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
                             "parallel_tool_calls", "metadata", "store"}
_COMPLETION_KEYS = _COMMON_KEYS | {"prompt", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
                                   "echo", "best_of", "suffix"}
_FINISH_REASONS = {"stop": "stop", "length": "length"}  # scheduler / wire -> OpenAI


class Endpoint(enum.Enum):
    """The two generating endpoints, with the ``object`` names of their responses."""

    CHAT = ("chat.completion", "chat.completion.chunk", "chatcmpl")
    COMPLETIONS = ("text_completion", "text_completion", "cmpl")

    @property
    def object_name(self) -> str:
        return self.value[0]

    @property
    def chunk_object_name(self) -> str:
        return self.value[1]

    @property
    def id_prefix(self) -> str:
        return self.value[2]


class ApiError(Exception):
    """An error answer in OpenAI's shape: ``status`` (HTTP), ``type`` (OpenAI's error type),
    ``code`` (treeserve's wire error code, or ``invalid_api_key`` / ``model_not_found`` /
    ``not_found``), ``param`` (the field at fault, when known) and, for 429/503,
    ``retry_after_s`` (sent as ``Retry-After``)."""

    def __init__(self, status: int, message: str, *, type_: str, code: str, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        # The message and param may quote the client's own text: a lone surrogate there is
        # written as its escape, since no UTF-8 body can carry it.
        message = _utf8_safe(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = None if param is None else _utf8_safe(param)
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> ApiError:
        return cls(400, message, type_="invalid_request_error", code=ErrorCode.INVALID_REQUEST.value, param=param)


def _utf8_safe(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def api_error_from(exc: Exception, *, overloaded_retry_after_s: int, unavailable_retry_after_s: int) -> ApiError:
    """The HTTP error for a generation that failed with ``exc``: classified exactly as the
    ZeroMQ gateway classifies it (``error_reply``: invalid request, the scheduler's codes,
    internal bugs logged with their traceback), then mapped to a status: invalid_request 400,
    overloaded 429, unavailable and actor_dead 503 (both with ``Retry-After``),
    deadline_exceeded 504, anything else 500."""
    if isinstance(exc, ApiError):
        return exc
    wire = error_reply(0, exc, None)
    code = wire.code
    if code is ErrorCode.INVALID_REQUEST:
        return ApiError.bad_request(wire.message)
    if code is ErrorCode.OVERLOADED:
        return ApiError(429, wire.message, type_="rate_limit_error", code=code.value,
                        retry_after_s=overloaded_retry_after_s)
    if code in (ErrorCode.UNAVAILABLE, ErrorCode.ACTOR_DEAD):
        return ApiError(503, wire.message, type_="server_error", code=code.value,
                        retry_after_s=unavailable_retry_after_s)
    if code is ErrorCode.DEADLINE_EXCEEDED:
        return ApiError(504, wire.message, type_="server_error", code=code.value)
    return ApiError(500, wire.message, type_="server_error", code=code.value)


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """An OpenAI request, mapped: ``wire`` is OpenAI's fields renamed to a ``generate`` body,
    which :func:`~treeserve.actors.gateway.request.parse_generate` then checks, the one check
    both front ends share; the rest is what only HTTP has: ``has_max_tokens`` False means the endpoint's default applies once the prompt's length
    is known (:func:`default_max_tokens`); ``stream`` and ``include_usage`` shape the answer."""

    endpoint: Endpoint
    wire: dict[str, Any]
    has_max_tokens: bool
    stream: bool
    include_usage: bool


def _type_name(value: object) -> str:
    """JSON's name for a value's type (what an HTTP client sent), not Python's."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _check_neutral(body: Mapping[str, Any]) -> None:
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
            raise ApiError.bad_request(f"'{key}' is not supported by this server (send null or leave it out)", key)


def _content_text(content: object, index: int) -> str:
    """A message's text: a string, or an array of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError.bad_request(f"messages[{index}].content: only text parts "
                                           '({"type": "text", "text": ...}) are supported', "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError.bad_request(f"messages[{index}].content must be a string or an array of text parts, "
                               f"got {_type_name(content)}", "messages")


def _messages(value: object) -> list[dict[str, Any]]:
    """The messages with their contents as text; roles are checked by ``parse_generate``."""
    if not isinstance(value, list):
        raise ApiError.bad_request(f"'messages' must be an array, got {_type_name(value)}", "messages")
    out: list[dict[str, Any]] = []
    for index, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise ApiError.bad_request(f"messages[{index}] must be an object", "messages")
        extra = sorted(set(entry) - {"role", "content"})
        if extra:
            raise ApiError.bad_request(f"messages[{index}] has field(s) this server does not support: {extra}",
                                       "messages")
        if "content" not in entry:
            raise ApiError.bad_request(f"messages[{index}] has no 'content'", "messages")
        out.append({"role": entry.get("role"), "content": _content_text(entry["content"], index)})
    return out


def _prompt(value: object) -> dict[str, Any]:
    """A completions ``prompt``: a string, one string in an array, or an array of token ids."""
    if isinstance(value, str):
        return {"prompt": value}
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return {"prompt_ids": value}
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return {"prompt": value[0]}
    if isinstance(value, list) and len(value) > 1:
        raise ApiError.bad_request("batched prompts are not supported: send one prompt per request", "prompt")
    raise ApiError.bad_request(f"'prompt' must be a string or an array of token ids, got {_type_name(value)}",
                               "prompt")


def parse_openai(endpoint: Endpoint, body: object, model_name: str) -> OpenAIRequest:
    """Validate an OpenAI request body and map it onto a wire ``generate`` body. Raises
    :class:`ApiError`: 404 for a model other than ``model_name``, 400 for anything else wrong
    (the wire body is validated further by ``parse_generate``, whose errors are 400s too)."""
    if not isinstance(body, dict):
        raise ApiError.bad_request(f"the request body must be a JSON object, got {_type_name(body)}")
    allowed = _CHAT_KEYS if endpoint is Endpoint.CHAT else _COMPLETION_KEYS
    unknown = sorted(str(k) for k in body if k not in allowed)
    if unknown:
        raise ApiError.bad_request(f"unknown field(s) {unknown}; treeserve's own options go in the "
                                   f"'treeserve' object ({sorted(_EXTENSION_KEYS)})", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError.bad_request("'model' is required: the id GET /v1/models lists", "model")
    if model != model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                       type_="not_found_error", code="model_not_found", param="model")
    _check_neutral(body)
    n = body.get("n")
    if n is not None and (type(n) is not int or n < 1):
        raise ApiError.bad_request(f"'n' must be a positive integer, got {n!r}", "n")
    if n is not None and n > 1:
        raise ApiError.bad_request("'n' > 1 is not supported: send n requests (with different seeds)", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError.bad_request(f"'stream' must be a boolean, got {_type_name(stream)}", "stream")
    include_usage = _include_usage(body.get("stream_options"), bool(stream))

    if endpoint is Endpoint.CHAT:
        if "messages" not in body:
            raise ApiError.bad_request("'messages' is required", "messages")
        wire: dict[str, Any] = {"messages": _messages(body["messages"])}
    else:
        if "prompt" not in body:
            raise ApiError.bad_request("'prompt' is required", "prompt")
        wire = _prompt(body["prompt"])
    max_tokens = body.get("max_tokens")
    if endpoint is Endpoint.CHAT and body.get("max_completion_tokens") is not None:
        if max_tokens is not None and max_tokens != body["max_completion_tokens"]:
            raise ApiError.bad_request("'max_tokens' and 'max_completion_tokens' differ: send one of them",
                                       "max_completion_tokens")
        max_tokens = body["max_completion_tokens"]
    if max_tokens is not None:
        wire["max_tokens"] = max_tokens
    temperature = body.get("temperature")
    wire["temperature"] = _DEFAULT_TEMPERATURE if temperature is None else temperature
    for key in ("top_p", "seed", "stop"):
        if body.get(key) is not None:
            wire[key] = body[key]
    extension = body.get("treeserve")
    if extension is not None:
        if not isinstance(extension, dict):
            raise ApiError.bad_request(f"'treeserve' must be an object, got {_type_name(extension)}", "treeserve")
        extra = sorted(str(k) for k in extension if k not in _EXTENSION_KEYS)
        if extra:
            raise ApiError.bad_request(f"unknown treeserve option(s) {extra}; known: {sorted(_EXTENSION_KEYS)}",
                                       "treeserve")
        wire.update({k: v for k, v in extension.items() if v is not None})
    return OpenAIRequest(endpoint, wire, max_tokens is not None, bool(stream), include_usage)


def _include_usage(options: object, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise ApiError.bad_request("'stream_options' is only allowed with \"stream\": true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError.bad_request("'stream_options' must be an object with at most 'include_usage'",
                                   "stream_options")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise ApiError.bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    return bool(value)


def default_max_tokens(endpoint: Endpoint, num_prompt_tokens: int, context_length: int) -> int:
    """``max_tokens`` when the request gave none: what is left of the context for chat, at most
    16 for completions (OpenAI's defaults); at least 1 (a longer prompt is refused anyway)."""
    room = max(1, context_length - num_prompt_tokens)
    return room if endpoint is Endpoint.CHAT else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every object of one response repeats: its ``id``, ``created`` (Unix seconds) and ``model``."""

    endpoint: Endpoint
    id: str
    created: int
    model: str

    def object(self, *, chunk: bool) -> dict[str, Any]:
        name = self.endpoint.chunk_object_name if chunk else self.endpoint.object_name
        return {"id": self.id, "object": name, "created": self.created, "model": self.model}


def finish_reason_of(end: Mapping[str, Any]) -> str:
    """OpenAI's ``finish_reason`` for a ``stream_end`` body: ``stop`` (a stop token or a stop
    string), ``length`` (``max_tokens`` reached)."""
    reason = end.get("finish_reason")
    if reason not in _FINISH_REASONS:
        raise ValueError(f"the generation ended with an unknown finish_reason {reason!r}")
    return _FINISH_REASONS[reason]


def usage_of(end: Mapping[str, Any]) -> dict[str, int]:
    prompt, completion = int(end.get("num_prompt_tokens", 0)), len(end.get("token_ids", ()))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def treeserve_stats(end: Mapping[str, Any], speculate: str) -> dict[str, Any]:
    """The ``treeserve`` extension object of a response: how it was drafted and the scheduler's
    statistics (``mean_accepted_per_step`` counts the tokens one verify step emits)."""
    keys = ("num_steps", "mean_accepted_per_step", "queue_s", "ttft_s", "total_s", "predicted_len", "matched_stop")
    return {"speculate": speculate, **{k: end[k] for k in keys if k in end}}


def completion_body(head: ResponseHead, end: Mapping[str, Any], speculate: str) -> dict[str, Any]:
    """The non-streamed answer: one choice with the whole text, ``usage`` and the stats."""
    reason = finish_reason_of(end)
    text = str(end.get("text", ""))
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if head.endpoint is Endpoint.CHAT:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {**head.object(chunk=False), "choices": [choice], "usage": usage_of(end),
            "treeserve": treeserve_stats(end, speculate)}


def chunk_body(head: ResponseHead, *, text: str | None = None, is_first: bool = False,
               finish_reason: str | None = None, include_usage: bool = False,
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk: new ``text`` (chat: the first chunk also names the role), or the last
    one with ``finish_reason``. With ``include_usage`` every such chunk has ``usage: null``
    (the usage chunk itself is built by the caller: no choices and the usage)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if head.endpoint is Endpoint.CHAT:
        delta: dict[str, Any] = {"role": "assistant"} if is_first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    chunk = {**head.object(chunk=True), "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    if extra:
        chunk.update(extra)
    return chunk

