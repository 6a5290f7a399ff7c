"""Python client of the treeserve gateway (wire protocol: ``transport/PROTOCOL.md``).

``async with Client("tcp://127.0.0.1:5555") as c:`` then ``async for chunk in
c.stream("Hello")`` or ``await c.generate(...)``. Works in any running asyncio or uvloop
loop. The calls travel through the runtime's own outgoing-call machinery
(``runtime/outbound.py``: one DEALER multiplexed by request ids, deadlines, cancel on
abandon, lost connections) and its liveness watch (``runtime/silence_watch.py``), so the
client and the actor runtime speak the protocol through the same code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import zmq.asyncio

from treeserve.client_errors import (
    ClientClosedError,
    ClientError,
    ConnectionLostError,
    ConnectTimeoutError,
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    RequestCancelledError,
    ServerError,
    UnavailableError,
    client_error,
)
from treeserve.client_messages import Chunk, Completion, chunk_from, completion_from, request_body
from treeserve.runtime.errors import ActorError
from treeserve.runtime.outbound import Outbound
from treeserve.runtime.silence_watch import SilenceWatch
from treeserve.runtime.stats import NodeStats
from treeserve.runtime.tasks import TaskOwner
from treeserve.transport.codec import EncodeError
from treeserve.transport.messages import ActorAddress, StreamEnd, StreamItem
from treeserve.transport.sockets import CurveClientConfig
from treeserve.transport.wire import DEFAULT_LIMITS, GATEWAY_LIMITS, GATEWAY_TARGET

if TYPE_CHECKING:
    from treeserve.ops.sampling import SamplingParams

__all__ = [
    "Chunk",
    "Client",
    "ClientClosedError",
    "ClientError",
    "Completion",
    "ConnectTimeoutError",
    "ConnectionLostError",
    "DeadlineExceededError",
    "InvalidRequestError",
    "OverloadedError",
    "RequestCancelledError",
    "ServerError",
    "UnavailableError",
]

_request_body = request_body  # the name the unit tests know

_INFO_TIMEOUT_S = 30.0  # an info/health answer, once connected (without a client timeout)
DEFAULT_CONNECT_TIMEOUT_S = 60.0  # a server's start-up (loading a model) takes 15-25 s on 2 cores
_CLOSE_TIMEOUT_S = 1.0
# Calls and buffered chunks per client: far beyond any real use, so never the limit that
# bites (a stream has at most max_tokens + 1 chunks); they only bound a runaway.
_MAX_IN_FLIGHT = 65_536
_STREAM_BUFFER = 1 << 20


class Client:
    """A connection to a treeserve gateway at ``endpoint`` (tcp:// or ipc://).

    ``curve``: CURVE keys when the gateway requires them. ``timeout``: seconds allowed
    for each whole call, the wait for a connection included (None: no limit; the gateway is
    told what is left). A call made while the gateway is not reachable yet (the client was
    started first, or the server is restarting) waits for it, at most ``connect_timeout_s``,
    then fails with ``ConnectTimeoutError`` naming the endpoint and the wait (or, when
    ``timeout`` is shorter and runs out first, ``DeadlineExceededError``). While calls are open
    the client sends a heartbeat every ``heartbeat_interval_s`` (so the gateway can tell
    a vanished client), and fails them with ``ConnectionLostError`` when the gateway
    says nothing for ``server_timeout_s`` or its connection drops. A request bigger than
    the gateway accepts is refused before sending (``InvalidRequestError``,
    ``too_large``). Use as ``async with Client(...) as c``; ``aclose()`` is idempotent.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        curve: CurveClientConfig | None = None,
        timeout: float | None = None,
        heartbeat_interval_s: float = 0.5,
        server_timeout_s: float = 5.0,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        for name, value in (("heartbeat_interval_s", heartbeat_interval_s),
                            ("server_timeout_s", server_timeout_s), ("timeout", timeout),
                            ("connect_timeout_s", connect_timeout_s)):
            if value is not None and not (isinstance(value, int | float) and not isinstance(value, bool)
                                          and value > 0):
                raise ValueError(f"Client {name} must be a positive number of seconds, got {value!r}")
        self.endpoint = endpoint
        self.connect_timeout_s = float(connect_timeout_s)
        self.stats = NodeStats()
        self._address = ActorAddress(endpoint, GATEWAY_TARGET)
        self._curve = curve
        self._timeout = timeout
        self._heartbeat_interval_s = heartbeat_interval_s
        self._server_timeout_s = server_timeout_s
        self._ctx: zmq.asyncio.Context | None = None
        self._outbound: Outbound | None = None
        self._tasks = TaskOwner("treeserve-client")
        self._is_closed = False

    async def __aenter__(self) -> Client:
        self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def connect(self) -> None:
        """Open the connection and start the liveness watch (needs a running loop);
        called by ``async with``. ZeroMQ connects in the background."""
        if self._is_closed:
            raise ClientClosedError("client is closed")
        if self._outbound is not None:
            return
        loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        # Answers are read under the protocol's default limits; requests are checked
        # against the gateway's receive limits before they are sent.
        outbound = Outbound(self._ctx, self.stats, limits=DEFAULT_LIMITS, send_limits=GATEWAY_LIMITS,
                            max_in_flight=_MAX_IN_FLIGHT, stream_buffer=_STREAM_BUFFER, curve=self._curve)
        self._outbound = outbound
        outbound.connect(self.endpoint)
        watch = SilenceWatch(outbound, self.endpoint, interval_s=self._heartbeat_interval_s,
                             timeout_s=self._server_timeout_s, sender="client", now=loop.time())
        self._tasks.start(watch.run(), "liveness")

    async def aclose(self) -> None:
        """Fail open calls with ``ClientClosedError``, stop the watch, close the socket."""
        if self._is_closed:
            return
        self._is_closed = True
        if self._outbound is not None:
            self._outbound.close()
        await self._tasks.aclose(_CLOSE_TIMEOUT_S)
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

    def stream(
        self,
        prompt: str | Sequence[Mapping[str, Any]] | Sequence[int],
        params: SamplingParams | None = None,
        *,
        speculate: str = "tree",
        length_hint: int | None = None,
        **overrides: Any,
    ) -> AsyncIterator[Chunk]:
        """Generate from ``prompt`` (text, chat ``messages``, or token ids), yielding
        ``Chunk``s as tokens are accepted. ``params`` (``SamplingParams``) and
        ``overrides`` (wire field names, ``transport/PROTOCOL.md`` 11.3: ``max_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop_token_ids``, ``stop``,
        ``parse_special_tokens``; None is the server's default; ``max_new_tokens`` is a deprecated
        alias of ``max_tokens``) set sampling. ``length_hint``: the output tokens you expect; a
        server that schedules by output length queues the request by it (capped at
        ``max_tokens``) instead of predicting; None sends no hint (the key is left out, so
        servers that predate it accept the request). Breaking out of the loop or cancelling the
        consuming task sends ``cancel`` to the gateway. Raises ``ServerError`` subclasses
        (``InvalidRequestError``, ``OverloadedError``...)."""
        return self._chunks(request_body(prompt, params, speculate, overrides, length_hint), None)

    async def generate(
        self,
        prompt: str | Sequence[Mapping[str, Any]] | Sequence[int],
        params: SamplingParams | None = None,
        *,
        speculate: str = "tree",
        length_hint: int | None = None,
        **overrides: Any,
    ) -> Completion:
        """Like ``stream`` but waits for the whole ``Completion``."""
        result: list[Completion] = []
        chunks = self._chunks(request_body(prompt, params, speculate, overrides, length_hint), result)
        try:
            async for _ in chunks:
                pass
        finally:
            await chunks.aclose()
        return result[0]

    # ------------------------------------------------------------------ internals

    def _connected(self) -> Outbound:
        if self._is_closed:
            raise ClientClosedError("client is closed")
        if self._outbound is None:
            self.connect()
        assert self._outbound is not None
        return self._outbound

    async def _reachable(self) -> tuple[Outbound, float | None]:
        """The connection, once the gateway is reachable, and what is left of the call's timeout."""
        outbound = self._connected()
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = self._timeout
        wait_s = self.connect_timeout_s if timeout is None else min(timeout, self.connect_timeout_s)
        try:
            is_up = await outbound.wait_connected(self.endpoint, wait_s)
        except ActorError as exc:  # closed meanwhile
            raise client_error(exc) from None
        if is_up:
            return outbound, None if timeout is None else max(timeout - (loop.time() - started), 1e-3)
        refusal = outbound.refusal(self.endpoint)
        why = f": {refusal}" if refusal else " (is a treeserve server running there?)"
        if timeout is not None and timeout < self.connect_timeout_s:
            raise DeadlineExceededError(
                "deadline_exceeded", f"no connection to {self.endpoint} within the call's timeout of {timeout} s{why}")
        raise ConnectTimeoutError(
            "unavailable", f"could not connect to {self.endpoint} within {self.connect_timeout_s} s "
            f"(connect_timeout_s){why}", True)

    async def _unary(self, method: str) -> dict[str, Any]:
        outbound, left_s = await self._reachable()
        timeout = left_s if left_s is not None else _INFO_TIMEOUT_S
        try:
            body = await outbound.ask(self._address, method, None, timeout)
        except ActorError as exc:
            raise client_error(exc) from None
        if not isinstance(body, dict):
            raise ServerError("bad_message", f"{method} answered {type(body).__name__}, not a map")
        return body

    async def _chunks(self, body: dict[str, Any], result: list[Completion] | None) -> AsyncGenerator[Chunk, None]:
        start = time.perf_counter()
        outbound, left_s = await self._reachable()
        try:
            call, cancel = outbound.open_stream(self._address, "generate", body, left_s)
        except EncodeError as exc:
            raise InvalidRequestError("too_large", f"request not sent: {exc}") from exc
        except ActorError as exc:
            raise client_error(exc) from None
        first_chunk_s: float | None = None
        try:
            while True:
                event = await call.next_event()
                if isinstance(event, StreamItem):
                    if first_chunk_s is None:
                        first_chunk_s = time.perf_counter() - start
                    yield chunk_from(event.body)
                elif isinstance(event, StreamEnd):
                    if result is not None:
                        result.append(completion_from(event.body, first_chunk_s, time.perf_counter() - start))
                    return
                else:
                    raise client_error(event)
        finally:
            cancel()  # tells the gateway unless the stream already ended
