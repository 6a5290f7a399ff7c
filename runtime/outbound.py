"""``Outbound``: the calls one node makes to actors on other nodes."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from functools import partial
from typing import Any, TypeAlias

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from treeserve.runtime.bodies import body_to_wire
from treeserve.runtime.calls import PendingAsk, StreamCall
from treeserve.runtime.errors import (
    ActorDeadError,
    ActorError,
    DeadlineExceeded,
    OverloadedError,
    RemoteError,
    RuntimeClosedError,
    error_from_wire,
)
from treeserve.runtime.pump import SocketPump
from treeserve.runtime.stats import NodeStats
from treeserve.transport.codec import DecodeError, decode, encode
from treeserve.transport.messages import (
    ActorAddress,
    Cancel,
    Error,
    Heartbeat,
    Message,
    Request,
    StreamEnd,
    StreamItem,
)
from treeserve.transport.sockets import make_dealer
from treeserve.transport.wire import ErrorCode, WireLimits

__all__ = ["Outbound"]

_Pending: TypeAlias = PendingAsk | StreamCall


class _Connection:
    """Our DEALER to one node plus a monitor of its disconnections."""

    __slots__ = ("monitor", "pump", "socket")

    def __init__(self, socket: zmq.asyncio.Socket, pump: SocketPump, monitor: SocketPump) -> None:
        self.socket = socket
        self.pump = pump
        self.monitor = monitor

    def close(self) -> None:
        self.monitor.close()
        self.socket.disable_monitor()
        self.pump.close()


class Outbound:
    """Remote calls of one node: one DEALER per remote node (created on first use),
    all calls multiplexed on it by request id. Ids come from one counter and are never
    reused, so a late or duplicate answer finds no waiter and is discarded (counted in
    ``stats.num_late_replies``), never delivered to another call.

    At most ``max_in_flight`` calls wait at once (more raise ``OverloadedError``).
    ``mark_down`` fails every call to a dead node at once and drops the connection,
    so requests queued for the dead process never reach its restarted successor. A
    lost connection (the peer process died, or dropped us) fails the calls waiting on
    it with ``ActorDeadError`` too, even for nodes nobody supervises: their answers
    can no longer arrive, since a ROUTER drops replies to a vanished connection.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        stats: NodeStats,
        *,
        limits: WireLimits,
        max_in_flight: int,
        stream_buffer: int,
    ) -> None:
        self._ctx = ctx
        self._stats = stats
        self._limits = limits
        self._max_in_flight = max_in_flight
        self._stream_buffer = stream_buffer
        self._connections: dict[str, _Connection] = {}
        self._pending: dict[int, _Pending] = {}
        self._down: dict[str, ActorError] = {}
        self._ids = itertools.count(1)
        self._is_closed = False

    @property
    def num_in_flight(self) -> int:
        """Calls awaiting an answer."""
        return len(self._pending)

    def close(self) -> None:
        """Fail every waiting call with ``RuntimeClosedError`` and close all sockets."""
        self._is_closed = True
        pending, self._pending = self._pending, {}
        for call in pending.values():
            call.fail(RuntimeClosedError("runtime closed"))
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()

    # ------------------------------------------------------------------ liveness

    def mark_down(self, endpoint: str, exc: ActorError) -> None:
        """Declare node ``endpoint`` dead: fail its calls with (copies of) ``exc`` now,
        drop the connection, and refuse new calls to it until ``mark_up``."""
        self._down[endpoint] = exc
        self._fail_calls_to(endpoint, exc)
        conn = self._connections.pop(endpoint, None)
        if conn is not None:
            conn.close()

    def _fail_calls_to(self, endpoint: str, exc: ActorError) -> None:
        for msg_id, call in list(self._pending.items()):
            if call.endpoint == endpoint:
                del self._pending[msg_id]
                call.fail(type(exc)(exc.message, code=exc.code, retryable=exc.retryable))

    def mark_up(self, endpoint: str) -> None:
        """Allow calls to ``endpoint`` again (after a restart)."""
        self._down.pop(endpoint, None)

    def send_heartbeat(self, endpoint: str, beat: Heartbeat) -> None:
        """Send a heartbeat to node ``endpoint`` (no answer expected)."""
        self._send(endpoint, encode(beat, self._limits))

    # ------------------------------------------------------------------ calls

    async def ask(self, address: ActorAddress, method: str, body: Any, timeout_s: float | None) -> Any:
        """Send a request and wait for its reply body (refs not yet bound)."""
        self._check_can_call(address.endpoint)
        loop = asyncio.get_running_loop()
        msg_id = next(self._ids)
        frames = self._request(msg_id, address, method, body, timeout_s, is_stream=False)
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending[msg_id] = PendingAsk(address.endpoint, fut)
        timer = None if timeout_s is None else loop.call_later(
            timeout_s, self._expire, msg_id, address, method)
        try:
            if not self._send(address.endpoint, frames):
                raise OverloadedError(f"cannot send to {address.endpoint}: queue full")
            return await fut
        except asyncio.CancelledError:
            if self._pending.pop(msg_id, None) is not None:
                self._send_cancel(address.endpoint, msg_id)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(msg_id, None)

    def tell(self, address: ActorAddress, method: str, body: Any) -> None:
        """Send a request whose answer nobody awaits."""
        self._check_can_call(address.endpoint)
        # The protocol has no one-way request: the callee answers and, as the id was
        # never registered, the answer is discarded on arrival (counted as late).
        frames = self._request(next(self._ids), address, method, body, None, is_stream=False)
        if not self._send(address.endpoint, frames):
            raise OverloadedError(f"cannot send to {address.endpoint}: queue full")

    def open_stream(
        self, address: ActorAddress, method: str, body: Any, timeout_s: float | None
    ) -> tuple[StreamCall, Callable[[], None]]:
        """Start a streaming call; returns its buffer and its cancel function."""
        self._check_can_call(address.endpoint)
        loop = asyncio.get_running_loop()
        msg_id = next(self._ids)
        frames = self._request(msg_id, address, method, body, timeout_s, is_stream=True)
        call = StreamCall(address.endpoint, self._stream_buffer)
        self._pending[msg_id] = call
        if not self._send(address.endpoint, frames):
            del self._pending[msg_id]
            raise OverloadedError(f"cannot send to {address.endpoint}: queue full")
        timer = None if timeout_s is None else loop.call_later(
            timeout_s, self._expire, msg_id, address, method)

        def cancel() -> None:
            if timer is not None:
                timer.cancel()
            if self._pending.pop(msg_id, None) is not None:
                self._send_cancel(address.endpoint, msg_id)

        return call, cancel

    def _check_can_call(self, endpoint: str) -> None:
        if self._is_closed:
            raise RuntimeClosedError("runtime closed")
        down = self._down.get(endpoint)
        if down is not None:
            raise type(down)(down.message, code=down.code, retryable=down.retryable)
        if len(self._pending) >= self._max_in_flight:
            self._stats.num_overloaded += 1
            raise OverloadedError(f"{len(self._pending)} calls in flight (max {self._max_in_flight})")

    def _request(
        self,
        msg_id: int,
        address: ActorAddress,
        method: str,
        body: Any,
        timeout_s: float | None,
        *,
        is_stream: bool,
    ) -> list[bytes | memoryview]:
        # The callee gets the remaining budget, not an absolute time: clocks may differ.
        timeout_ms = None if timeout_s is None else max(1, int(timeout_s * 1000))
        request = Request(msg_id, address.name, method, body_to_wire(body), timeout_ms, is_stream)
        return encode(request, self._limits)

    def _expire(self, msg_id: int, address: ActorAddress, method: str) -> None:
        call = self._pending.pop(msg_id, None)
        if call is not None:
            call.fail(DeadlineExceeded(f"{address.name}.{method}: no answer before the deadline"))
            self._send_cancel(address.endpoint, msg_id)

    def _send_cancel(self, endpoint: str, msg_id: int) -> None:
        if endpoint in self._connections:
            self._send(endpoint, encode(Cancel(msg_id), self._limits))

    def _send(self, endpoint: str, frames: list[Any]) -> bool:
        conn = self._connections.get(endpoint)
        if conn is None:
            conn = self._connect(endpoint)
        if not conn.pump.send_nowait(frames):
            self._stats.num_send_failures += 1
            return False
        return True

    def _connect(self, endpoint: str) -> _Connection:
        sock = make_dealer(self._ctx, endpoint, limits=self._limits)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        conn = _Connection(
            sock,
            SocketPump(sock, self._on_frames, f"dealer {endpoint}"),
            SocketPump(monitor, partial(self._on_monitor_event, endpoint), f"monitor {endpoint}"),
        )
        self._connections[endpoint] = conn
        return conn

    def _on_monitor_event(self, endpoint: str, frames: list[zmq.Frame]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self._stats.num_disconnects += 1
            self._fail_calls_to(endpoint, ActorDeadError(f"connection to {endpoint} lost"))

    # ------------------------------------------------------------------ answers

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = decode(frames, self._limits)
        except DecodeError as exc:
            self._stats.num_bad_messages += 1
            bad = None if exc.msg_id is None else self._pending.pop(exc.msg_id, None)
            if bad is not None:
                bad.fail(RemoteError(f"undecodable answer: {exc.message}", code=exc.code))
            return
        self._on_answer(msg)

    def _on_answer(self, msg: Message) -> None:
        if isinstance(msg, Request | Cancel | Heartbeat):
            self._stats.num_dropped += 1
            return
        msg_id = msg.id
        call = self._pending.get(msg_id) if msg_id is not None else None
        if call is None or msg_id is None:
            self._stats.num_late_replies += 1
            return
        if isinstance(call, PendingAsk):
            del self._pending[msg_id]
            call.deliver(msg)
            return
        if isinstance(msg, StreamItem):
            if msg.seq != call.expected_seq:
                self._abort_stream(msg_id, call, RemoteError(
                    f"stream item seq {msg.seq}, expected {call.expected_seq}", code=ErrorCode.BAD_MESSAGE))
            elif call.is_full:
                self._abort_stream(msg_id, call, OverloadedError(
                    f"stream consumer is {call.capacity} items behind"))
            else:
                call.expected_seq += 1
                call.push(msg)
            return
        del self._pending[msg_id]
        if isinstance(msg, StreamEnd):
            call.push(msg)
        elif isinstance(msg, Error):
            call.fail(error_from_wire(msg))
        else:
            call.fail(RemoteError("a unary reply answered a stream call", code=ErrorCode.BAD_MESSAGE))

    def _abort_stream(self, msg_id: int, call: StreamCall, exc: ActorError) -> None:
        del self._pending[msg_id]
        call.fail(exc)
        self._send_cancel(call.endpoint, msg_id)
