"""Strict validation of the gateway's public ``generate`` request body.

The body is untrusted client input: every field is named, typed and range-checked, and
unknown fields are refused, so a typo never silently changes what gets generated. The
result is a small frozen value; tokenization happens later (it needs the tokenizer).

The rules every front end shares live here (the ZeroMQ gateway and the HTTP one): nil for
an optional field is its default; chat roles are validated; "characters" are Unicode code
points of content (role names do not count); error texts name wire types (``got nil``,
``got bin``), never Python's (``transport/PROTOCOL.md`` 11.3).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from treeserve.ops.speculation_modes import SpeculationMode
from treeserve.runtime import ActorError
from treeserve.transport.wire import ErrorCode
from treeserve.transport.wire_types import wire_repr, wire_type

__all__ = [
    "CHAT_ROLES",
    "DEFAULT_MAX_TOKENS",
    "GENERATE_FIELDS",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MIN_SAMPLING_TEMPERATURE",
    "ChatMessage",
    "GenerateRequest",
    "InvalidRequest",
    "SpeculationMode",
    "parse_generate",
    "sampling_temperature",
]

DEFAULT_MAX_TOKENS = 128
_MAX_SEED = 2**63 - 1
_MAX_LENGTH_HINT = 2**31  # exclusive; a hint above max_tokens is allowed (it caps nothing)
_MAX_MESSAGES = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
_MESSAGE_KEYS = frozenset({"role", "content"})

CHAT_ROLES: frozenset[str] = frozenset({"system", "user", "assistant"})
"""The roles every model accepts in ``messages``; a model's template may name more
(``stream.chat_roles_for``)."""

MIN_SAMPLING_TEMPERATURE = 1e-5
"""The smallest temperature that is sampled; any temperature below it is greedy decoding.

Sampling divides the float32 logits by the temperature: a tiny one (``1e-300`` is 0 in
float32) makes them infinite and the probabilities NaN. At 1e-5 a logit gap of 0.001
already weighs the runner-up by ``exp(-100)``, so greedy is that limit, not a change of
meaning (``transport/PROTOCOL.md`` 11.3)."""


def sampling_temperature(temperature: float) -> float:
    """``temperature``, or 0.0 (greedy) when it is below :data:`MIN_SAMPLING_TEMPERATURE`."""
    return 0.0 if temperature < MIN_SAMPLING_TEMPERATURE else temperature

GENERATE_FIELDS: frozenset[str] = frozenset(
    {
        "prompt",
        "messages",
        "prompt_ids",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop_token_ids",
        "stop",
        "speculate",
        "parse_special_tokens",
        "length_hint",
    }
)
"""Every field a ``generate`` body may carry; any other key is refused."""


class InvalidRequest(ActorError, ValueError):
    """A client request was rejected where it entered (the gateway's parsing, or a scheduler
    body that crossed a process);
    the message says which field and why, and is sent back verbatim as an ``invalid_request``
    error. ``param``: the field at fault, given, or else the one the message starts with
    (``'max_tokens' must be ...``); None for the body as a whole."""

    default_code = ErrorCode.INVALID_REQUEST

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        named = re.match(r"'([a-z_]+)'", message)
        self.param = param if param is not None else named.group(1) if named else None


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat turn: a non-empty ``role`` and its ``content`` text."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A client's request as it entered (a ZeroMQ ``generate`` body or an OpenAI HTTP body),
    checked once by :func:`parse_generate`. It exists because only the front ends read text:
    the prompt or chat messages before the chat template, and stop strings; the scheduler gets
    the tokens (:class:`~treeserve.actors.messages.gateway.GenerateBody`). Exactly one of ``prompt``, ``messages`` and
    ``prompt_ids`` is set. ``temperature == 0`` is greedy; ``top_k`` None is no limit;
    ``stop_token_ids`` are extra stops added to the tokenizer's own; ``stop`` are strings that
    end the generation where they first appear in its text (the text stops before them).
    ``parse_special_tokens``: special-token strings in ``prompt`` and message contents become
    control tokens; False (the default): they are tokenized as the plain text they are.
    ``length_hint``: the client's expected output tokens (None: it gave none); a server that
    orders by output length reads ``min(length_hint, max_tokens)`` instead of predicting."""

    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    prompt_ids: tuple[int, ...] | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    seed: int | None
    stop_token_ids: tuple[int, ...]
    speculate: SpeculationMode
    stop: tuple[str, ...] = ()
    parse_special_tokens: bool = False
    length_hint: int | None = None


def _is_int(value: object) -> bool:
    return type(value) is int


def _field(body: Mapping[str, Any], key: str, default: Any) -> Any:
    """``body[key]``, or ``default`` when the key is absent or nil (nil is the default everywhere)."""
    value = body.get(key)
    return default if value is None else value


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = _field(body, key, default)
    if type(value) not in (int, float):
        raise InvalidRequest(f"'{key}' must be a number, got {wire_type(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidRequest(f"'{key}' must be finite, got {wire_repr(value)}")
    return number


def _token_ids(value: object, key: str, vocab_size: int, max_len: int) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise InvalidRequest(f"'{key}' must be an array of token ids, got {wire_type(value)}")
    if len(value) > max_len:
        raise InvalidRequest(f"'{key}' has {len(value)} ids; at most {max_len} are allowed")
    for index, token in enumerate(value):
        if not _is_int(token):
            raise InvalidRequest(f"'{key}'[{index}] must be an int, got {wire_type(token)}")
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"'{key}'[{index}] = {token} is outside the vocabulary [0, {vocab_size})"
            )
    return tuple(value)


def _unicode(text: str, key: str) -> str:
    """``text``, refused where it holds a lone surrogate (JSON's ``"\\ud800"`` decodes to one):
    no UTF-8 encodes it, and the tokenizer would fail on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"'{key}' is not valid Unicode: a lone surrogate at character {exc.start}", key) from None
    return text


def _stop_strings(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise InvalidRequest(f"'stop' must be a str or an array of str, got {wire_type(value)}")
    if len(value) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"'stop' has {len(value)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for index, stop in enumerate(value):
        if not isinstance(stop, str) or not stop:
            raise InvalidRequest(f"'stop'[{index}] must be a non-empty str, got {_shown(stop, str)}")
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidRequest(f"'stop'[{index}] has {len(stop)} characters; at most {MAX_STOP_CHARS} are allowed")
        _unicode(stop, "stop")
    return tuple(value)


def _keys(body: Mapping[Any, Any], where: str) -> None:
    """Map keys may be str or bin on the wire (section 4); field names are str."""
    if any(not isinstance(key, str) for key in body):
        bad = next(key for key in body if not isinstance(key, str))
        raise InvalidRequest(f"{where} keys must be str, got a {wire_type(bad)} key")


def _messages(value: object, max_prompt_chars: int, roles: Collection[str]) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        got = wire_type(value) if not isinstance(value, list) else "an empty array"
        raise InvalidRequest(f"'messages' must be a non-empty array of {{role, content}} maps, got {got}")
    if len(value) > _MAX_MESSAGES:
        raise InvalidRequest(f"'messages' has {len(value)} entries; at most {_MAX_MESSAGES}")
    out: list[ChatMessage] = []
    num_chars = 0
    for index, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise InvalidRequest(f"'messages'[{index}] must be a map with 'role' and 'content', got {wire_type(entry)}")
        _keys(entry, f"'messages'[{index}]")
        unknown = sorted(set(entry) - _MESSAGE_KEYS)
        if unknown:
            raise InvalidRequest(f"'messages'[{index}] has unknown field(s) {unknown}")
        role, content = entry.get("role"), entry.get("content")
        if not isinstance(role, str):
            raise InvalidRequest(f"'messages'[{index}].role must be a str, got {wire_type(role)}")
        if role not in roles:
            raise InvalidRequest(f"'messages'[{index}].role must be one of {sorted(roles)}, got {wire_repr(role)}")
        if not isinstance(content, str):
            raise InvalidRequest(f"'messages'[{index}].content must be a str, got {wire_type(content)}")
        _unicode(content, "messages")
        num_chars += len(content)  # code points of content; role names do not count
        out.append(ChatMessage(role, content))
    if num_chars > max_prompt_chars:
        raise InvalidRequest(
            f"'messages' hold {num_chars} characters; at most {max_prompt_chars} are allowed"
        )
    if not any(m.content for m in out):
        raise InvalidRequest("'messages' are all empty")
    return tuple(out)


def _prompt(body: Mapping[str, Any], vocab_size: int, context_length: int, max_prompt_chars: int,
            roles: Collection[str]) -> tuple[str | None, tuple[ChatMessage, ...] | None, tuple[int, ...] | None]:
    """The body's one prompt: ``prompt``, ``messages`` or ``prompt_ids`` (the others None)."""
    given = [k for k in ("prompt", "messages", "prompt_ids") if body.get(k) is not None]
    if len(given) != 1:
        raise InvalidRequest(
            "exactly one of 'prompt', 'messages' or 'prompt_ids' is required"
            + (f" (got {given})" if given else "")
        )
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_ids: tuple[int, ...] | None = None
    if given == ["prompt"]:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequest(f"'prompt' must be a str, got {wire_type(prompt)}")
        if not prompt:
            raise InvalidRequest("'prompt' is empty")
        if len(prompt) > max_prompt_chars:  # a Python str's length counts code points
            raise InvalidRequest(
                f"'prompt' has {len(prompt)} characters; at most {max_prompt_chars} are allowed"
            )
        _unicode(prompt, "prompt")
    elif given == ["messages"]:
        messages = _messages(body["messages"], max_prompt_chars, roles)
    else:
        prompt_ids = _token_ids(body["prompt_ids"], "prompt_ids", vocab_size, context_length - 1)
        if not prompt_ids:
            raise InvalidRequest("'prompt_ids' is empty")
    return prompt, messages, prompt_ids


def parse_generate(
    body: object, *, vocab_size: int, context_length: int, max_prompt_chars: int,
    roles: Collection[str] = CHAT_ROLES,
) -> GenerateRequest:
    """Validate an untrusted ``generate`` body; raises ``InvalidRequest`` naming the first
    bad field. Checks: a map with str keys; no unknown field; a nil field is the same as an
    absent one; exactly one of ``prompt`` (non-empty str of at most ``max_prompt_chars``
    characters, i.e. Unicode code points) / ``messages`` (``roles`` only, at most
    ``max_prompt_chars`` characters of content in all) / ``prompt_ids`` (ids in
    ``[0, vocab_size)``, fewer than ``context_length``); ``max_tokens`` an int in
    ``[1, context_length)`` (default ``min(128, context_length - 1)``); ``temperature`` finite and ``>= 0``
    (below :data:`MIN_SAMPLING_TEMPERATURE` it becomes 0, greedy); ``top_p`` in ``(0, 1]``;
    ``top_k`` nil or an int ``>= 1``; ``seed`` nil or an int in ``[0, 2**63)``;
    ``stop_token_ids`` ids in the vocabulary; ``stop`` a str or an array of at most 16
    non-empty strings of at most 256 characters; ``speculate`` one of tree/chain/none;
    ``parse_special_tokens`` a bool (default false); ``length_hint`` nil or an int in
    ``[1, 2**31)``."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the generate body must be a map, got {wire_type(body)}")
    _keys(body, "the generate body's")
    unknown = sorted(k for k in body if k not in GENERATE_FIELDS)
    if unknown:
        raise InvalidRequest(
            f"unknown field(s) {unknown}; allowed: {sorted(GENERATE_FIELDS)}"
        )
    prompt, messages, prompt_ids = _prompt(body, vocab_size, context_length, max_prompt_chars, roles)
    max_tokens = _field(body, "max_tokens", min(DEFAULT_MAX_TOKENS, context_length - 1))
    if not _is_int(max_tokens):
        raise InvalidRequest(f"'max_tokens' must be an int, got {wire_type(max_tokens)}")
    if not 1 <= max_tokens < context_length:
        raise InvalidRequest(
            f"'max_tokens' must be in [1, {context_length - 1}] (the context length is "
            f"{context_length}), got {max_tokens}"
        )
    temperature = _number(body, "temperature", 0.0)
    if temperature < 0:
        raise InvalidRequest(f"'temperature' must be >= 0 (0 = greedy), got {temperature}")
    temperature = sampling_temperature(temperature)
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"'top_p' must be in (0, 1], got {top_p}")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise InvalidRequest(f"'top_k' must be nil (no limit) or an int >= 1, got {_shown(top_k, int)}")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= _MAX_SEED):
        raise InvalidRequest(f"'seed' must be nil or an int in [0, 2^63), got {_shown(seed, int)}")
    stop_token_ids = _token_ids(_field(body, "stop_token_ids", []), "stop_token_ids", vocab_size, 64)
    stop = _stop_strings(_field(body, "stop", []))
    speculate_value = _field(body, "speculate", SpeculationMode.TREE.value)
    if not isinstance(speculate_value, str) or speculate_value not in {s.value for s in SpeculationMode}:
        raise InvalidRequest(
            f"'speculate' must be one of {[s.value for s in SpeculationMode]}, got {_shown(speculate_value, str)}"
        )
    parse_special_tokens = _field(body, "parse_special_tokens", False)
    if type(parse_special_tokens) is not bool:
        raise InvalidRequest(f"'parse_special_tokens' must be a bool, got {wire_type(parse_special_tokens)}")
    length_hint = body.get("length_hint")
    if length_hint is not None and (not _is_int(length_hint) or not 1 <= length_hint < _MAX_LENGTH_HINT):
        raise InvalidRequest(f"'length_hint' must be nil or an int in [1, 2^31), got {_shown(length_hint, int)}")
    return GenerateRequest(
        prompt=prompt,
        messages=messages,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop_token_ids=stop_token_ids,
        speculate=SpeculationMode(speculate_value),
        stop=stop,
        parse_special_tokens=parse_special_tokens,
        length_hint=length_hint,
    )


def _shown(value: object, expected: type) -> str:
    """``value`` as written when it has the ``expected`` type (only its range was wrong), else its
    wire type (``got bool``, ``got nil``)."""
    return wire_repr(value) if type(value) is expected else wire_type(value)
