"""``Outbound``: the calls one process makes to actors on other nodes (a node's remote
calls, and the Python client's calls to the gateway)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from functools import partial
from typing import Any, TypeAlias

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from treeserve.runtime.bodies import body_to_wire
from treeserve.runtime.calls import PendingAsk, StreamCall
from treeserve.runtime.errors import (
    ActorError,
    ConnectionLost,
    DeadlineExceeded,
    OverloadedError,
    RemoteError,
    RuntimeClosedError,
    error_from_wire,
)
from treeserve.runtime.pump import SocketPump, close_monitor
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
from treeserve.transport.sockets import CurveClientConfig, make_dealer
from treeserve.transport.wire import ErrorCode, WireLimits

__all__ = ["Outbound"]

_log = logging.getLogger(__name__)

_Pending: TypeAlias = PendingAsk | StreamCall

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_HANDSHAKE_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
_CONNECT_RECHECK_S = 0.25  # a wait for a connection looks again this often (it may be replaced)


class _Connection:
    """Our DEALER to one node plus a monitor of its handshakes and disconnections.
    ``is_refused`` is True from a failed handshake to the next successful one: the
    disconnect that follows a refusal is no lost connection (nothing was ever delivered).
    ``is_up`` is set from a successful handshake to the next disconnection."""

    __slots__ = ("is_refused", "is_up", "monitor", "pump", "socket")

    def __init__(self, socket: zmq.asyncio.Socket, pump: SocketPump, monitor: SocketPump) -> None:
        self.socket = socket
        self.pump = pump
        self.monitor = monitor
        self.is_refused = False
        self.is_up = asyncio.Event()

    def close(self) -> None:
        close_monitor(self.socket, self.monitor)
        self.pump.close()


class Outbound:
    """Remote calls of one process: one DEALER per remote node (created on first use),
    all calls multiplexed on it by request id. Ids come from one counter and are never
    reused, so a late or duplicate answer finds no waiter and is discarded (counted in
    ``stats.num_late_replies``), never delivered to another call.

    At most ``max_in_flight`` calls wait at once (more raise ``OverloadedError``).
    ``mark_down`` fails every call to a dead node at once and drops the connection,
    so requests queued for the dead process never reach its restarted successor. A
    lost connection (the peer process died, or dropped us) fails the calls waiting on
    it with ``ConnectionLost`` too, even for nodes nobody supervises: their answers can
    no longer arrive, since a ROUTER drops replies to a vanished connection. A refused
    handshake (a CURVE peer that does not admit our key, a wrong server key, or a
    plaintext/CURVE mismatch) is no lost connection: nothing gets through, as the
    protocol says, so its calls run to their deadline (whose error says why), and a
    connection libzmq gave up on is made afresh by the next call.

    Answers are decoded under ``limits``; requests are encoded under ``send_limits``
    (default ``limits``; the client checks the gateway's smaller limits before sending).
    ``curve`` makes every DEALER a CURVE client. ``last_heard`` (any message, heartbeats
    included) lets a liveness watch judge a silent peer (``runtime/silence_watch.py``).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        stats: NodeStats,
        *,
        limits: WireLimits,
        max_in_flight: int,
        stream_buffer: int,
        send_limits: WireLimits | None = None,
        curve: CurveClientConfig | None = None,
    ) -> None:
        self._ctx = ctx
        self._stats = stats
        self._limits = limits
        self._send_limits = limits if send_limits is None else send_limits
        self._curve = curve
        self._max_in_flight = max_in_flight
        self._stream_buffer = stream_buffer
        self._connections: dict[str, _Connection] = {}
        self._pending: dict[int, _Pending] = {}
        self._down: dict[str, ActorError] = {}
        self._refused: dict[str, str] = {}  # endpoint -> why its last handshake failed
        self._heard: dict[str, float] = {}  # endpoint -> loop time of its last message
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
        self.fail_calls_to(endpoint, exc)
        conn = self._connections.pop(endpoint, None)
        if conn is not None:
            conn.close()

    def fail_calls_to(self, endpoint: str, exc: ActorError) -> None:
        """Fail every call waiting on ``endpoint`` with (a copy of) ``exc``; the
        connection stays, so later calls may still succeed."""
        for msg_id, call in list(self._pending.items()):
            if call.endpoint == endpoint:
                del self._pending[msg_id]
                call.fail(type(exc)(exc.message, code=exc.code, retryable=exc.retryable))

    def has_calls_to(self, endpoint: str) -> bool:
        """True while some call waits on ``endpoint``."""
        return any(call.endpoint == endpoint for call in self._pending.values())

    def last_heard(self, endpoint: str) -> float | None:
        """``loop.time()`` of the last message received from ``endpoint`` (None: never)."""
        return self._heard.get(endpoint)

    def connect(self, endpoint: str) -> None:
        """Open the connection to ``endpoint`` now (ZeroMQ connects in the background)
        instead of on the first call."""
        self._check_open()
        if endpoint not in self._connections:
            self._connect(endpoint)

    async def wait_connected(self, endpoint: str, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until a handshake with ``endpoint`` has succeeded and the
        connection has not dropped since; True at once when it is up. Connects if needed (and
        again after libzmq gave up on a refused handshake). Raises ``RuntimeClosedError`` once
        closed."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + timeout_s
        while True:
            self._check_open()
            conn = self._connections.get(endpoint) or self._connect(endpoint)
            if conn.is_up.is_set():
                return True
            left = give_up_at - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):  # look again: the connection may be replaced
                await asyncio.wait_for(conn.is_up.wait(), min(left, _CONNECT_RECHECK_S))

    def refusal(self, endpoint: str) -> str | None:
        """Why the last handshake with ``endpoint`` failed (None: none failed since it succeeded)."""
        return self._refused.get(endpoint)

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
                raise self._queue_full(address.endpoint)
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
            raise self._queue_full(address.endpoint)

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
            raise self._queue_full(address.endpoint)
        timer = None if timeout_s is None else loop.call_later(
            timeout_s, self._expire, msg_id, address, method)

        def cancel() -> None:
            if timer is not None:
                timer.cancel()
            if self._pending.pop(msg_id, None) is not None:
                self._send_cancel(address.endpoint, msg_id)

        return call, cancel

    def _check_open(self) -> None:
        if self._is_closed:
            raise RuntimeClosedError("runtime closed")

    def _check_can_call(self, endpoint: str) -> None:
        self._check_open()
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
        return encode(request, self._send_limits)

    def _queue_full(self, endpoint: str) -> OverloadedError:
        # A link whose handshake was refused takes no message (nothing completes the connection
        # to queue behind): say why, as a deadline does.
        refused = self._refused.get(endpoint)
        why = "" if refused is None else f" ({refused})"
        return OverloadedError(f"cannot send to {endpoint}: queue full{why}")

    def _expire(self, msg_id: int, address: ActorAddress, method: str) -> None:
        call = self._pending.pop(msg_id, None)
        if call is not None:
            refused = self._refused.get(address.endpoint)
            why = "" if refused is None else f" ({refused})"
            call.fail(DeadlineExceeded(f"{address.name}.{method}: no answer before the deadline{why}"))
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
        monitors: list[zmq.asyncio.Socket] = []
        # The monitor must exist before the socket connects, or it can miss the first handshake.
        sock = make_dealer(self._ctx, endpoint, limits=self._limits, curve=self._curve,
                           before_connect=lambda s: monitors.append(s.get_monitor_socket(_MONITORED)))
        [monitor] = monitors
        conn = _Connection(
            sock,
            SocketPump(sock, partial(self._on_frames, endpoint), f"dealer {endpoint}"),
            SocketPump(monitor, partial(self._on_monitor_event, endpoint), f"monitor {endpoint}"),
        )
        self._connections[endpoint] = conn
        return conn

    def _on_monitor_event(self, endpoint: str, frames: list[zmq.Frame]) -> None:
        conn = self._connections.get(endpoint)
        event = int(parse_monitor_message([f.bytes for f in frames])["event"])
        if conn is None:
            return
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            conn.is_refused = False
            conn.is_up.set()
            self._refused.pop(endpoint, None)
        elif event & _HANDSHAKE_FAILED:
            conn.is_refused = True
            why = (f"{endpoint} refused the handshake: a CURVE key not on its allow-list, a wrong "
                   "server key, or CURVE on one side only")
            if endpoint not in self._refused:
                _log.warning("%s", why)
            self._refused[endpoint] = why
            if event & _HANDSHAKE_REFUSED:
                # libzmq never reconnects after these: start afresh on the next call (after
                # this callback: the monitor's own pump closes with the connection).
                asyncio.get_running_loop().call_soon(self._drop_connection, endpoint, conn)
        elif event == zmq.EVENT_DISCONNECTED:
            conn.is_up.clear()
            if not conn.is_refused:
                self._stats.num_disconnects += 1
                self.fail_calls_to(endpoint, ConnectionLost(f"connection to {endpoint} lost"))

    def _drop_connection(self, endpoint: str, conn: _Connection) -> None:
        if self._connections.get(endpoint) is conn:
            del self._connections[endpoint]
            conn.close()

    # ------------------------------------------------------------------ answers

    def _on_frames(self, endpoint: str, frames: list[zmq.Frame]) -> None:
        self._heard[endpoint] = asyncio.get_running_loop().time()
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
        if isinstance(msg, Heartbeat):  # heartbeats may go either way; a sign of life
            self._stats.num_heartbeats += 1
            return
        if isinstance(msg, Request | Cancel):
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
        if isinstance(msg, StreamEnd) and msg.seq != call.expected_seq:
            call.fail(RemoteError(
                f"stream ended after {msg.seq} items, {call.expected_seq} received", code=ErrorCode.BAD_MESSAGE))
        elif isinstance(msg, StreamEnd):
            call.push(msg)
        elif isinstance(msg, Error):
            call.fail(error_from_wire(msg))
        else:
            call.fail(RemoteError("a unary reply answered a stream call", code=ErrorCode.BAD_MESSAGE))

    def _abort_stream(self, msg_id: int, call: StreamCall, exc: ActorError) -> None:
        del self._pending[msg_id]
        call.fail(exc)
        self._send_cancel(call.endpoint, msg_id)
