"""One generation as the gateway relays it: tokenize a validated request, build the
scheduler's ``generate`` body, and turn the scheduler's token stream into client items
(incremental text + token ids) and the final ``stream_end`` body. No sockets here: items
go out through the ``send_item`` callback the gateway passes in."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, cast

from treeserve.actors.gateway.config import TokenizerLike
from treeserve.actors.gateway.request import CHAT_ROLES, GenerateRequest, InvalidRequest
from treeserve.actors.messages.gateway import GenerateBody
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.tokenizer import IncrementalDetokenizer, Tokenizer
from treeserve.runtime.errors import ActorError
from treeserve.runtime.ref import ActorRef
from treeserve.transport.messages import Error
from treeserve.transport.wire import ErrorCode

__all__ = [
    "STAT_KEYS",
    "StopMatcher",
    "chat_roles_for",
    "check_fits",
    "error_reply",
    "prompt_ids_for",
    "relay_generation",
    "scheduler_body",
]

_log = logging.getLogger(__name__)

STAT_KEYS = (
    "finish_reason",
    "num_prompt_tokens",
    "num_generated_tokens",
    "num_steps",
    "mean_accepted_per_step",
    "queue_s",
    "ttft_s",
    "total_s",
    "predicted_len",
)
"""Scheduler stats copied into ``stream_end`` (a whitelist: the scheduler may add
internal fields that are no business of the client)."""


def chat_roles_for(tokenizer: TokenizerLike) -> frozenset[str]:
    """The roles ``messages`` may use with ``tokenizer``: system, user and assistant, plus the
    roles its chat template names (``Tokenizer.chat_roles``); pass it as ``parse_generate``'s
    ``roles``."""
    if isinstance(tokenizer, Tokenizer):
        return CHAT_ROLES | tokenizer.chat_roles
    return CHAT_ROLES


def prompt_ids_for(tokenizer: TokenizerLike, req: GenerateRequest, context_length: int) -> list[int]:
    """The prompt's token ids: given ids, the encoded ``prompt``, or the ``messages``
    rendered with the chat template (``encode_chat`` when the tokenizer has it, so BOS
    is handled as the model wants). User text (``prompt``, message contents) never becomes a
    control token unless ``req.parse_special_tokens``: a ``Tokenizer`` is asked to split
    special-token strings in it (the template's own markup stays special); another
    ``TokenizerLike``'s ``encode`` must parse none. Raises ``InvalidRequest`` for a template
    error, an empty result, or a prompt leaving no room in the context for a generated token."""
    split = not req.parse_special_tokens
    if req.prompt_ids is not None:
        ids = list(req.prompt_ids)
    elif req.prompt is not None:
        if isinstance(tokenizer, Tokenizer):
            ids = tokenizer.encode(req.prompt, split_special_tokens=split)
        else:
            ids = [int(t) for t in tokenizer.encode(req.prompt)]
    else:
        assert req.messages is not None
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            encode_chat = getattr(tokenizer, "encode_chat", None)
            if isinstance(tokenizer, Tokenizer):
                ids = tokenizer.encode_chat(messages, split_special_tokens=split)
            elif callable(encode_chat):
                ids = [int(t) for t in encode_chat(messages)]
            else:
                ids = [int(t) for t in tokenizer.encode(tokenizer.apply_chat_template(messages))]
        except Exception as exc:  # template errors are about the client's messages
            raise InvalidRequest(f"cannot apply the chat template: {exc}") from exc
    field = "messages" if req.messages is not None else "prompt"  # the API's name for token ids too
    if not ids:
        raise InvalidRequest("the prompt tokenizes to no tokens", field)
    if len(ids) >= context_length:
        raise InvalidRequest(
            f"the prompt is {len(ids)} tokens; the context holds {context_length} tokens "
            "including at least one generated token", field
        )
    return ids


def check_fits(num_prompt_tokens: int, max_tokens: int, context_length: int) -> None:
    """Refuse a request whose prompt and ``max_tokens`` together overrun the context."""
    if num_prompt_tokens + max_tokens > context_length:
        raise InvalidRequest(
            f"'max_tokens' ({max_tokens}) and the prompt ({num_prompt_tokens} tokens) do not fit the context of "
            f"{context_length} tokens: send max_tokens of at most {context_length - num_prompt_tokens}", "max_tokens"
        )


def scheduler_body(req: GenerateRequest, prompt_ids: list[int], stop_ids: Sequence[int]) -> GenerateBody:
    """The scheduler's ``generate`` body, fresh ``request_id``; the tokenizer's ``stop_ids`` plus
    the request's own stop ids; the client's ``length_hint``, if any. It goes to the scheduler
    as the object (encoded only if the scheduler lives in another process)."""
    params = SamplingParams(
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        seed=req.seed,
        stop_token_ids=tuple(sorted(set(stop_ids) | set(req.stop_token_ids))),
        max_new_tokens=req.max_tokens,
    )
    return GenerateBody(uuid.uuid4().hex, tuple(prompt_ids), params, req.speculate, req.length_hint)


class StopMatcher:
    """Finds the first of ``stops`` in text that arrives in pieces.

    :meth:`push` returns the part of the text so far that is safe to release: it never
    contains a stop string nor a tail that could still become the start of one (that tail is
    held back until the next piece decides). Once a stop string has appeared, ``matched``
    is it and the released text ends right before it.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError("StopMatcher needs non-empty stop strings")
        self.stops = tuple(stops)
        self.matched: str | None = None
        self._held = ""

    def push(self, text: str) -> str:
        if self.matched is not None:
            return ""
        buffer = self._held + text
        found = [(index, stop) for stop in self.stops if (index := buffer.find(stop)) >= 0]
        if found:
            index, self.matched = min(found)
            self._held = ""
            return buffer[:index]
        keep = max((k for stop in self.stops for k in range(min(len(stop) - 1, len(buffer)), 0, -1)
                    if buffer.endswith(stop[:k])), default=0)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """The held-back tail, at the end of a generation that met no stop string."""
        held, self._held = self._held, ""
        return held


_ENDED = object()
"""What :func:`_next_item` returns once the stream has ended."""


async def _next_item(items: AsyncGenerator[Any, None], item_timeout_s: float | None) -> Any:
    """The scheduler's next item, or :data:`_ENDED`; silence past ``item_timeout_s`` is an
    ``internal`` error (the scheduler sends a keepalive well within it)."""
    wait = asyncio.timeout(item_timeout_s)
    try:
        async with wait:
            return await anext(items)
    except StopAsyncIteration:
        return _ENDED
    except TimeoutError:
        if not wait.expired():
            raise  # the scheduler's own deadline error
        raise ActorError(f"the scheduler sent nothing for {item_timeout_s}s (it sends a keepalive "
                         "well within that): it is stuck", code=ErrorCode.INTERNAL) from None


async def relay_generation(
    scheduler: ActorRef,
    body: GenerateBody,
    tokenizer: TokenizerLike,
    send_item: Callable[[dict[str, Any]], Awaitable[None]],
    stop: Sequence[str] = (),
    *,
    timeout_s: float | None = None,
    item_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run ``scheduler.generate(body)``, passing ``{"text", "token_ids"}`` items to
    ``send_item`` (text never splits a UTF-8 character; special tokens give no text),
    and return the ``stream_end`` body: full text, all ids and the scheduler's stats.
    Cancelling the caller, or ``send_item`` raising, cancels the scheduler's stream.

    With ``stop`` strings, text that could be the start of one is held back, and the first
    one to appear ends the generation: the text stops right before it, ``token_ids`` end with
    the token that completed it, ``finish_reason`` is ``"stop"`` and ``matched_stop`` names
    it. The scheduler is asked to ``finish`` the request (freeing its row at once); tokens it
    accepted meanwhile are dropped.

    Waits are bounded: ``timeout_s`` (the request's deadline, None: none) travels with the
    scheduler call, and each wait for the scheduler's next item is bounded by
    ``item_timeout_s`` (the scheduler yields an empty keepalive item well within its step
    timeout, so silence past it means the scheduler is stuck): then the generation fails
    with a non-retryable ``internal`` ``ActorError``."""
    detok = IncrementalDetokenizer(cast(Tokenizer, tokenizer), skip_special_tokens=True)
    matcher = StopMatcher(stop) if stop else None
    pieces: list[str] = []
    token_ids: list[int] = []
    final: dict[str, Any] | None = None
    # ask_stream is an async generator: closing it cancels the scheduler's stream.
    items = cast(AsyncGenerator[Any, None], scheduler.ask_stream("generate", body, timeout=timeout_s))
    async with contextlib.aclosing(items):
        while (item := await _next_item(items, item_timeout_s)) is not _ENDED:
            if not isinstance(item, dict):
                raise TypeError(f"scheduler yielded a {type(item).__name__}, expected a map")
            if item.get("done") is True:
                final = item  # may still carry tokens: handled like any item
            ids = [int(t) for t in item.get("token_ids", ())]
            if not ids or (matcher is not None and matcher.matched is not None):
                continue
            if matcher is None:
                text = detok.push(ids)
            else:  # token by token, so that the tokens after a stop string are left out
                taken: list[int] = []
                text = ""
                for token in ids:
                    taken.append(token)
                    text += matcher.push(detok.push([token]))
                    if matcher.matched is not None:
                        await scheduler.ask("finish", {"request_id": body.request_id,
                                                       "num_tokens": len(token_ids) + len(taken)})
                        break
                ids = taken
            pieces.append(text)
            token_ids.extend(ids)
            await send_item({"text": text, "token_ids": ids})
    if matcher is None or matcher.matched is None:
        tail = detok.finish()
        if matcher is not None:
            tail = matcher.push(tail)
            tail += "" if matcher.matched is not None else matcher.flush()
        if tail:
            pieces.append(tail)
            await send_item({"text": tail, "token_ids": []})
    if final is None:
        raise RuntimeError("the scheduler ended the stream without its final stats item")
    end_body: dict[str, Any] = {"text": "".join(pieces), "token_ids": token_ids}
    end_body.update({k: final[k] for k in STAT_KEYS if k in final})
    if matcher is not None and matcher.matched is not None:
        # The scheduler may have ended the request on its own (length, a stop id) before it
        # heard of the stop string; the client's answer ends at the string either way.
        end_body.update(finish_reason="stop", num_generated_tokens=len(token_ids), matched_stop=matcher.matched)
    return end_body


def error_reply(msg_id: int, exc: Exception, timeout_s: float | None) -> Error:
    """The ``error`` a client gets for a generation that failed with ``exc``.

    A scheduler's ``ActorError`` keeps its code (``overloaded``, ...), except that a missing
    scheduler actor or method is internal wiring, not the client's business: it becomes a
    retryable ``unavailable`` (a restart may fix it). A ``TimeoutError`` is the request's own
    deadline; anything else is a bug, logged with its traceback and sent as ``internal``."""
    if isinstance(exc, InvalidRequest):
        return Error(msg_id, ErrorCode.INVALID_REQUEST, str(exc))
    if isinstance(exc, ActorError):
        if exc.code in (ErrorCode.NO_SUCH_ACTOR, ErrorCode.NO_SUCH_METHOD):
            return Error(msg_id, ErrorCode.UNAVAILABLE, f"the model is not available ({exc.message})", True)
        return Error(msg_id, exc.code, exc.message, exc.retryable)
    if isinstance(exc, TimeoutError):
        return Error(msg_id, ErrorCode.DEADLINE_EXCEEDED, f"no result within {timeout_s}s")
    _log.error("gateway: generate failed", exc_info=exc)
    return Error(msg_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
