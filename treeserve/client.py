"""Python client of the treeserve gateway (wire protocol: ``transport/PROTOCOL.md``).

``async with Client("tcp://127.0.0.1:5555") as c:`` then ``async for chunk in
c.stream("Hello")`` or ``await c.generate(...)``. One DEALER socket carries every
request, multiplexed by request id; works in any running asyncio or uvloop loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import zmq
import zmq.asyncio

from treeserve.actors.gateway_config import GATEWAY_LIMITS
from treeserve.transport.codec import DecodeError, EncodeError, decode, encode
from treeserve.transport.messages import (
    Cancel,
    Error,
    Heartbeat,
    Message,
    Reply,
    Request,
    StreamEnd,
    StreamItem,
)
from treeserve.transport.sockets import CurveClientConfig, make_dealer

if TYPE_CHECKING:
    from treeserve.ops.sampling import SamplingParams

__all__ = [
    "Chunk",
    "Client",
    "ClientClosedError",
    "ClientError",
    "Completion",
    "ConnectionLostError",
    "DeadlineExceededError",
    "InvalidRequestError",
    "OverloadedError",
    "RequestCancelledError",
    "ServerError",
    "UnavailableError",
]

_log = logging.getLogger(__name__)
_TARGET = "gateway"
_INFO_TIMEOUT_S = 30.0
# A request the gateway (with its default receive limits) would refuse is not sent.
_REQUEST_LIMITS = GATEWAY_LIMITS


# --------------------------------------------------------------------------- errors


class ClientError(Exception):
    """Base class of every error raised by ``Client``."""


class ClientClosedError(ClientError):
    """The client was closed (before or during the call)."""


class ServerError(ClientError):
    """The gateway answered with an ``error``: ``code`` (wire error code), ``message``
    (its text) and ``retryable`` (resending may succeed, e.g. ``overloaded``)."""

    def __init__(self, code: str, message: str, retryable: bool = False,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable
        self.details = details


class InvalidRequestError(ServerError, ValueError):
    """The request was rejected (``invalid_request``, or ``too_large`` before sending)."""


class OverloadedError(ServerError):
    """The gateway has too many streams open (``overloaded``); back off and retry."""


class UnavailableError(ServerError):
    """The gateway or the model behind it is unavailable (shutting down, actor died)."""


class ConnectionLostError(UnavailableError):
    """Client-side: the gateway stopped answering (no message, not even a heartbeat,
    within ``server_timeout_s`` while a call was open)."""


class DeadlineExceededError(ServerError, TimeoutError):
    """The call's ``timeout`` ran out (detected by the gateway or by the client)."""


class RequestCancelledError(ServerError):
    """The gateway cancelled the call."""


_BY_CODE: dict[str, type[ServerError]] = {
    "invalid_request": InvalidRequestError,
    "too_large": InvalidRequestError,
    "overloaded": OverloadedError,
    "unavailable": UnavailableError,
    "actor_dead": UnavailableError,
    "deadline_exceeded": DeadlineExceededError,
    "cancelled": RequestCancelledError,
}


def _server_error(err: Error) -> ServerError:
    code = str(err.code)
    return _BY_CODE.get(code, ServerError)(code, err.message, err.retryable, err.details)


# --------------------------------------------------------------------------- results


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


class _Failed:
    """A local failure delivered to a call's queue (connection lost, client closed)."""

    __slots__ = ("exc",)

    def __init__(self, exc: ClientError) -> None:
        self.exc = exc


_Event: TypeAlias = Reply | StreamItem | StreamEnd | Error | _Failed


class _Call:
    """One open request: its inbox and the deadline (loop time) if any."""

    __slots__ = ("deadline", "inbox")

    def __init__(self, deadline: float | None) -> None:
        self.inbox: asyncio.Queue[_Event] = asyncio.Queue()
        self.deadline = deadline


def _request_body(
    prompt: str | Sequence[Mapping[str, Any]] | Sequence[int],
    params: SamplingParams | None,
    speculate: str,
    overrides: Mapping[str, Any],
) -> dict[str, Any]:
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
    for key, value in overrides.items():
        body["max_tokens" if key == "max_new_tokens" else key] = value
    return body


# --------------------------------------------------------------------------- client


class Client:
    """A connection to a treeserve gateway at ``endpoint`` (tcp:// or ipc://).

    ``curve``: CURVE keys when the gateway requires them. ``timeout``: seconds allowed
    for each whole call (None: no limit; the gateway is told too). While calls are open
    the client sends a heartbeat every ``heartbeat_interval_s`` (so the gateway can tell
    a vanished client), and fails them with ``ConnectionLostError`` when the gateway
    says nothing for ``server_timeout_s``. Use as ``async with Client(...) as c``;
    ``aclose()`` is idempotent.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        curve: CurveClientConfig | None = None,
        timeout: float | None = None,
        heartbeat_interval_s: float = 0.5,
        server_timeout_s: float = 5.0,
    ) -> None:
        for name, value in (("heartbeat_interval_s", heartbeat_interval_s),
                            ("server_timeout_s", server_timeout_s), ("timeout", timeout)):
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"Client {name} must be a positive number of seconds, got {value!r}")
        self.endpoint = endpoint
        self._curve = curve
        self._timeout = timeout
        self._heartbeat_interval_s = heartbeat_interval_s
        self._server_timeout_s = server_timeout_s
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._last_heard = 0.0
        self._is_closed = False

    async def __aenter__(self) -> Client:
        self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def connect(self) -> None:
        """Create the socket and the reader/heartbeat tasks (needs a running loop);
        called by ``async with``. ZeroMQ connects in the background."""
        if self._is_closed:
            raise ClientClosedError("client is closed")
        if self._sock is not None:
            return
        loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        self._sock = make_dealer(self._ctx, self.endpoint, curve=self._curve)
        self._last_heard = loop.time()
        self._tasks = [
            loop.create_task(self._read(), name="treeserve-client:read"),
            loop.create_task(self._beat(), name="treeserve-client:heartbeat"),
        ]

    async def aclose(self) -> None:
        """Fail open calls with ``ClientClosedError``, stop the tasks, close the socket."""
        if self._is_closed:
            return
        self._is_closed = True
        self._fail_all(ClientClosedError("client closed"))
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # ------------------------------------------------------------------ public calls

    async def info(self) -> dict[str, Any]:
        """The served model: ``model``, ``vocab_size``, ``context_length``, ``eos_ids``...,
        and the server's ``status`` (``"ok"`` or ``"failed"``) with its ``failures``."""
        return await self._unary("info")

    async def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "failed", "failures": [...]}``: ``failed`` once a supervisor of
        the server gave up (the server will not serve again; restart it)."""
        return await self._unary("health")

    async def _unary(self, method: str) -> dict[str, Any]:
        timeout = self._timeout if self._timeout is not None else _INFO_TIMEOUT_S
        msg_id, call = await self._open(method, None, stream=False, timeout=timeout)
        try:
            event = await self._next(call)
        finally:
            self._calls.pop(msg_id, None)
        if isinstance(event, Reply) and isinstance(event.body, dict):
            return event.body
        raise self._unexpected(event)

    def stream(
        self,
        prompt: str | Sequence[Mapping[str, Any]] | Sequence[int],
        params: SamplingParams | None = None,
        *,
        speculate: str = "tree",
        **overrides: Any,
    ) -> AsyncIterator[Chunk]:
        """Generate from ``prompt`` (text, chat ``messages``, or token ids), yielding
        ``Chunk``s as tokens are accepted. ``params`` (``SamplingParams``) and
        ``overrides`` (wire field names: ``max_tokens``, ``temperature``, ``top_p``,
        ``top_k``, ``seed``, ``stop_token_ids``, ``stop``) set sampling. Breaking out of the loop
        or cancelling the consuming task sends ``cancel`` to the gateway. Raises
        ``ServerError`` subclasses (``InvalidRequestError``, ``OverloadedError``...)."""
        body = _request_body(prompt, params, speculate, overrides)
        return self._chunks(body, None)

    async def generate(
        self,
        prompt: str | Sequence[Mapping[str, Any]] | Sequence[int],
        params: SamplingParams | None = None,
        *,
        speculate: str = "tree",
        **overrides: Any,
    ) -> Completion:
        """Like ``stream`` but waits for the whole ``Completion``."""
        body = _request_body(prompt, params, speculate, overrides)
        result: list[Completion] = []
        chunks = self._chunks(body, result)
        try:
            async for _ in chunks:
                pass
        finally:
            await chunks.aclose()
        return result[0]

    # ------------------------------------------------------------------ internals

    async def _chunks(self, body: dict[str, Any], result: list[Completion] | None) -> AsyncGenerator[Chunk, None]:
        start = time.perf_counter()
        msg_id, call = await self._open("generate", body, stream=True, timeout=self._timeout)
        is_finished = False
        first_chunk_s: float | None = None
        try:
            expected_seq = 0
            while True:
                event = await self._next(call)
                if isinstance(event, StreamItem) and event.seq == expected_seq:
                    expected_seq += 1
                    if first_chunk_s is None:
                        first_chunk_s = time.perf_counter() - start
                    item = event.body if isinstance(event.body, dict) else {}
                    yield Chunk(str(item.get("text", "")), tuple(int(t) for t in item.get("token_ids", ())))
                elif isinstance(event, StreamEnd) and event.seq == expected_seq:
                    is_finished = True
                    if result is not None:
                        end = event.body if isinstance(event.body, dict) else {}
                        result.append(_completion(end, first_chunk_s, time.perf_counter() - start))
                    return
                else:
                    is_finished = isinstance(event, Error | _Failed)
                    raise self._unexpected(event)
        finally:
            self._calls.pop(msg_id, None)
            if not is_finished:
                self._send_nowait(Cancel(msg_id))

    async def _open(self, method: str, body: Any, *, stream: bool,
                    timeout: float | None) -> tuple[int, _Call]:
        if self._is_closed:
            raise ClientClosedError("client is closed")
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        msg_id = next(self._ids)
        timeout_ms = None if timeout is None else max(1, int(timeout * 1000))
        try:
            frames = encode(Request(msg_id, _TARGET, method, body, timeout_ms, stream), _REQUEST_LIMITS)
        except EncodeError as exc:
            raise InvalidRequestError("too_large", f"request not sent: {exc}") from exc
        call = _Call(None if timeout is None else loop.time() + timeout)
        if not self._calls:
            self._last_heard = loop.time()  # the server's silence counts from now
        self._calls[msg_id] = call
        try:
            await self._sock.send_multipart(frames, copy=False)
        except BaseException:
            self._calls.pop(msg_id, None)
            raise
        return msg_id, call

    async def _next(self, call: _Call) -> _Event:
        if call.deadline is None:
            return await call.inbox.get()
        try:
            async with asyncio.timeout_at(call.deadline):
                return await call.inbox.get()
        except TimeoutError:
            raise DeadlineExceededError("deadline_exceeded", "no answer within the client timeout") from None

    def _unexpected(self, event: _Event) -> ClientError:
        if isinstance(event, Error):
            return _server_error(event)
        if isinstance(event, _Failed):
            return event.exc
        return ServerError("bad_message", f"unexpected {type(event).__name__} (lost or reordered message?)")

    def _send_nowait(self, msg: Message) -> None:
        sock = self._sock
        if sock is None:
            return
        fut = cast("asyncio.Future[Any]", sock.send_multipart(encode(msg), flags=zmq.DONTWAIT, copy=False))
        fut.add_done_callback(_ignore_send_result)

    def _fail_all(self, exc: ClientError) -> None:
        for call in self._calls.values():
            call.inbox.put_nowait(_Failed(exc))
        self._calls.clear()

    async def _read(self) -> None:
        sock = self._sock
        assert sock is not None
        loop = asyncio.get_running_loop()
        while True:
            frames = await sock.recv_multipart(copy=False)
            self._last_heard = loop.time()
            try:
                msg = decode(frames)
            except DecodeError as exc:
                _log.warning("treeserve client: undecodable message from the gateway: %s", exc)
                call = self._calls.pop(exc.msg_id, None) if exc.msg_id is not None else None
                if call is not None:
                    call.inbox.put_nowait(_Failed(ServerError(str(exc.code), exc.message)))
                continue
            if isinstance(msg, Heartbeat | Request | Cancel):
                continue
            if msg.id is None:
                _log.warning("treeserve client: gateway error without request id: %s", msg)
                continue
            call = self._calls.get(msg.id)
            if call is not None:
                call.inbox.put_nowait(msg)

    async def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        seq = 0
        while True:
            await asyncio.sleep(self._heartbeat_interval_s)
            if not self._calls:
                continue
            silent_s = loop.time() - self._last_heard
            if silent_s > self._server_timeout_s:
                self._fail_all(ConnectionLostError(
                    "unavailable", f"the gateway at {self.endpoint} said nothing for {silent_s:.1f}s", True))
                continue
            self._send_nowait(Heartbeat(seq, time.time(), "client"))
            seq += 1


def _completion(end: dict[str, Any], ttft_s: float | None, total_s: float) -> Completion:
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


def _ignore_send_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # a failed cancel/heartbeat is not the caller's concern
