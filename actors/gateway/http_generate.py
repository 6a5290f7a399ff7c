"""One OpenAI generation as the HTTP front end runs it: the mapped request takes the ZeroMQ
gateway's own path (``parse_generate`` -> ``prompt_ids_for`` -> ``scheduler_body`` ->
``relay_generation``), and its items become one JSON answer or a server-sent event stream.

The stream's headers go out with its first text, so that anything refused before then (a
prompt that does not fit, a full queue) is still an ordinary HTTP error with its status.
Framing: every event is ``data: <one-line JSON>\\n\\n``; a stream that completes ends with
``data: [DONE]\\n\\n``; one that fails after its headers went out ends with a single
``data: {"error": {...}}\\n\\n`` event and no ``[DONE]``. A client that goes away cancels the
handler (or fails its next write), which closes the scheduler stream and frees the row.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from treeserve.actors.gateway.config import TokenizerLike
from treeserve.actors.gateway.openai_api import (
    ApiError,
    OpenAIRequest,
    ResponseHead,
    chunk_body,
    completion_body,
    default_max_tokens,
    finish_reason_of,
    treeserve_stats,
    usage_of,
)
from treeserve.actors.gateway.request import InvalidRequest, parse_generate
from treeserve.actors.messages.gateway import GenerateBody
from treeserve.actors.gateway.stream import check_fits, prompt_ids_for, relay_generation, scheduler_body
from treeserve.runtime.ref import ActorRef

__all__ = ["Generation", "HttpBackend", "SseStream", "dumps", "new_head", "prepare_generation", "run_generation"]

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
DONE_EVENT = b"data: [DONE]\n\n"


def dumps(value: Any) -> str:
    """Compact JSON on one line (string newlines are escaped, so it fits one SSE ``data:`` line)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True, slots=True)
class HttpBackend:
    """What the HTTP front end generates with once the server is up: the tokenizer, the
    scheduler, and the limits the ZeroMQ gateway applies (its ``GatewayConfig``'s values:
    ``context_length`` in tokens, ``max_prompt_chars``, ``scheduler_timeout_s`` bounding each
    wait for the scheduler's next item; ``roles``: the chat roles ``messages`` may use,
    ``chat_roles_for(tokenizer)``)."""

    tokenizer: TokenizerLike
    scheduler: ActorRef
    vocab_size: int
    context_length: int
    max_prompt_chars: int
    scheduler_timeout_s: float
    roles: frozenset[str]

    @property
    def stop_ids(self) -> list[int]:
        return sorted({int(t) for t in self.tokenizer.stop_ids})


@dataclass(frozen=True, slots=True)
class Generation:
    """A request ready for the scheduler: its ``generate`` body, stop strings and speculation mode."""

    request: OpenAIRequest
    body: GenerateBody
    stop: tuple[str, ...]
    speculate: str


def prepare_generation(backend: HttpBackend, request: OpenAIRequest) -> Generation:
    """Validate and tokenize exactly as the ZeroMQ gateway does; an ``InvalidRequest`` is a 400.
    Without ``max_tokens`` the endpoint's default (:func:`default_max_tokens`) applies."""
    try:
        req = parse_generate(request.wire, vocab_size=backend.vocab_size, context_length=backend.context_length,
                             max_prompt_chars=backend.max_prompt_chars, roles=backend.roles)
        prompt_ids = prompt_ids_for(backend.tokenizer, req, backend.context_length)
        if not request.has_max_tokens:
            req = replace(req, max_tokens=default_max_tokens(request.endpoint, len(prompt_ids), backend.context_length))
        check_fits(len(prompt_ids), req.max_tokens, backend.context_length)
    except InvalidRequest as exc:  # the wire's prompt_ids are the API's token-id prompt
        raise ApiError.bad_request(str(exc), "prompt" if exc.param == "prompt_ids" else exc.param) from None
    return Generation(request, scheduler_body(req, prompt_ids, backend.stop_ids), req.stop, req.speculate.value)


class SseStream:
    """The event stream of one response, opened lazily (see the module docstring)."""

    def __init__(self, http_request: web.Request, head: ResponseHead, include_usage: bool) -> None:
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        self.head = head
        self.include_usage = include_usage
        self._http_request = http_request

    @property
    def is_open(self) -> bool:
        return self.response.prepared

    async def open(self) -> None:
        if not self.is_open:
            await self.response.prepare(self._http_request)
            # Chat's first chunk names the role (OpenAI's framing); completions have no role.
            await self.send(chunk_body(self.head, text="", is_first=True, include_usage=self.include_usage))

    async def send(self, event: Mapping[str, Any]) -> None:
        await self.response.write(f"data: {dumps(event)}\n\n".encode())

    async def text(self, text: str) -> None:
        await self.open()
        if text:
            await self.send(chunk_body(self.head, text=text, include_usage=self.include_usage))

    async def finish(self, end: Mapping[str, Any], speculate: str) -> None:
        """The last chunk (``finish_reason`` and the ``treeserve`` stats), the usage chunk when
        asked for, then ``[DONE]``."""
        await self.open()
        await self.send(chunk_body(self.head, finish_reason=finish_reason_of(end), include_usage=self.include_usage,
                                   extra={"treeserve": treeserve_stats(end, speculate)}))
        if self.include_usage:
            await self.send({**self.head.object(chunk=True), "choices": [], "usage": usage_of(end)})
        await self.response.write(DONE_EVENT)
        await self.response.write_eof()

    async def fail(self, error: ApiError) -> None:
        await self.send(error.body())
        await self.response.write_eof()


def new_head(request: OpenAIRequest, model_name: str) -> ResponseHead:
    return ResponseHead(request.endpoint, f"{request.endpoint.id_prefix}-{uuid.uuid4().hex}", int(time.time()),
                        model_name)


async def run_generation(backend: HttpBackend, generation: Generation, head: ResponseHead,
                         stream: SseStream | None) -> web.StreamResponse:
    """Relay one generation: into ``stream`` (events as tokens arrive), or, without one, as
    one JSON answer. Errors before a stream opened raise (the caller answers with their
    status); errors after it are sent as the stream's last event."""
    async def send_item(item: dict[str, Any]) -> None:
        if stream is not None:
            await stream.text(str(item.get("text", "")))

    end = await relay_generation(backend.scheduler, generation.body, backend.tokenizer, send_item, generation.stop,
                                 item_timeout_s=backend.scheduler_timeout_s)
    if stream is None:
        return web.Response(text=dumps(completion_body(head, end, generation.speculate)),
                            content_type="application/json")
    await stream.finish(end, generation.speculate)
    return stream.response
