"""``Inbound``: the request path of one ROUTER socket, shared by a runtime node and the
public gateway.

Both serve the same wire protocol (``transport/PROTOCOL.md``) on a ROUTER: they decode
each message under receive limits, answer what the codec rejects with an ``error``,
refuse a request id that is still open or a request whose deadline already passed,
route ``cancel`` to the request it names and hand ``heartbeat``s on. That is written
here once; what a request *means* (an actor's handler, a ``generate`` stream) stays
with the service, which only decides whether to take each request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeAlias, TypeVar

import zmq
import zmq.asyncio

from treeserve.runtime.pump import SendOutcome, SocketPump, close_monitor
from treeserve.runtime.stats import InboundStats
from treeserve.transport.codec import DecodeError, decode, encode
from treeserve.transport.messages import Cancel, Error, Heartbeat, Message, Request
from treeserve.transport.sockets import CurveAuthenticator, CurveServerConfig, make_router
from treeserve.transport.wire import RETRYABLE_CODES, ErrorCode, Kind, WireLimits

__all__ = ["Inbound", "Refusal", "bind_router"]

CallT = TypeVar("CallT")

_Key: TypeAlias = tuple[bytes, int]  # (the peer's routing id, its request id)

_ANSWER_KINDS = frozenset({Kind.REPLY.value, Kind.STREAM_ITEM.value, Kind.STREAM_END.value, Kind.ERROR.value})
"""Kinds that answer a request: a ROUTER never answers them, whatever is wrong with them."""

_NO_ANSWER_ID_KINDS = frozenset({Kind.CANCEL.value, Kind.HEARTBEAT.value})
"""Kinds that start no request: an error about one never carries an id (it ends nothing)."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """A service's answer that it will not take a request: the ``error`` the peer gets
    (``retryable`` None: the code's default, ``transport/wire.RETRYABLE_CODES``)."""

    code: ErrorCode
    message: str
    retryable: bool | None = None


async def bind_router(
    ctx: zmq.asyncio.Context,
    bind: str,
    *,
    limits: WireLimits,
    curve: CurveServerConfig | None,
    allow_public_bind: bool,
    handover: bool = False,
) -> tuple[zmq.asyncio.Socket, CurveAuthenticator | None]:
    """A ROUTER bound to ``bind`` and, under ``curve``, the running ZAP handler that
    enforces its allow-list (libzmq would admit every client without one). The caller
    owns both and closes the handler after the socket. ``handover``: see ``make_router``."""
    auth = None
    if curve is not None:
        auth = CurveAuthenticator(ctx)
        auth.start()
    try:
        sock = make_router(ctx, bind, limits=limits, curve=curve, authenticator=auth,
                           allow_public_bind=allow_public_bind, handover=handover)
    except BaseException:
        if auth is not None:
            await auth.aclose()
        raise
    return sock, auth


class Inbound(Generic[CallT]):
    """Receives every message of a bound ROUTER ``sock`` (owned from now on: ``close``
    closes it) and answers on it.

    Checks made here, before the service sees a request, in this order: the frames decode
    under ``limits`` (else an ``error`` with the codec's code, counted in
    ``stats.num_bad_messages``); the peer has no open request with the same id (else
    ``invalid_request``); the deadline has not passed on arrival, ``timeout_ms`` 0 included,
    whatever the method (else ``deadline_exceeded``, counted in ``num_late_dropped``).

    An ``error`` carries a request id only when it ends that request (``PROTOCOL.md`` 2,
    "error"): one about a ``cancel`` or ``heartbeat``, about a request reusing an id that is
    still open, or about a message whose id is unreadable carries id nil, so that it can never
    be taken for the end of the open request. A message that is itself an answer (``reply``,
    ``stream_item``, ``stream_end``, ``error``) is never answered, decodable or not.

    Then ``admit(peer, request, deadline)`` decides (``deadline`` in ``loop.time()``
    seconds, None: none). It either starts serving the request and returns its call,
    which is tracked until ``release`` (so the call must not finish inside ``admit``), or
    answers at once and returns None, or returns a ``Refusal``, sent as an ``error``.

    A ``cancel`` for an open request calls ``cancel(call)`` (unknown ids are ignored, as
    the protocol says); a ``heartbeat`` calls ``on_heartbeat``; ``heard_from(peer)`` runs
    for every decodable message (any message is a sign of life). Answers (``reply``,
    ``stream_*``, ``error``) never flow to a ROUTER and are dropped unanswered, so two
    peers can never loop on each other's errors. ``on_disconnect()`` (optional) runs when
    ZeroMQ drops a connection of the socket (which peer it was, ZeroMQ does not say): messages
    queued to that peer are lost, so a service with open streams checks who it can still reach.

    Replies are encoded under ``send_limits`` (default: ``limits``) and sent without
    blocking; ``send_when_ready`` waits while the peer's queue is full (backpressure on a
    stream's producer), polling every ``send_retry_s``. Nothing here blocks the loop.
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        name: str,
        *,
        limits: WireLimits,
        stats: InboundStats,
        admit: Callable[[bytes, Request, float | None], CallT | Refusal | None],
        cancel: Callable[[CallT], None],
        on_heartbeat: Callable[[bytes, Heartbeat], None] | None = None,
        heard_from: Callable[[bytes], None] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        send_limits: WireLimits | None = None,
        send_retry_s: float = 0.001,
    ) -> None:
        self.stats = stats
        self._limits = limits
        self._send_limits = limits if send_limits is None else send_limits
        self._send_retry_s = send_retry_s
        self._admit = admit
        self._cancel = cancel
        self._on_heartbeat = on_heartbeat
        self._heard_from = heard_from
        self._calls: dict[_Key, CallT] = {}
        self._loop = asyncio.get_running_loop()
        self._monitor: SocketPump | None = None
        self._sock = sock
        if on_disconnect is not None:
            self._monitor = SocketPump(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED),
                                       lambda _frames: on_disconnect(), f"{name} monitor")
        self._pump = SocketPump(sock, self._on_frames, name)

    # ------------------------------------------------------------------ open requests

    @property
    def num_open(self) -> int:
        """Requests taken by the service and not yet released."""
        return len(self._calls)

    def open_calls(self) -> list[CallT]:
        """The calls of every open request (a copy: safe to release while iterating)."""
        return list(self._calls.values())

    def get(self, peer: bytes, msg_id: int) -> CallT | None:
        """The open call of ``peer``'s request ``msg_id``, if any."""
        return self._calls.get((peer, msg_id))

    def release(self, peer: bytes, msg_id: int) -> None:
        """Forget a finished request; its id may be used again. Idempotent."""
        self._calls.pop((peer, msg_id), None)

    def close(self) -> None:
        """Stop receiving and close the socket. Idempotent."""
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            close_monitor(self._sock, monitor)
        self._pump.close()

    # ------------------------------------------------------------------ sending

    def send_frames(self, peer: bytes, frames: list[bytes | memoryview]) -> SendOutcome:
        """Send encoded ``frames`` to ``peer`` now (failures counted)."""
        outcome = self._pump.try_send([peer, *frames])
        if outcome is not SendOutcome.SENT:
            self.stats.num_send_failures += 1
        return outcome

    def send(self, peer: bytes, msg: Message) -> SendOutcome:
        """Encode ``msg`` under the send limits and send it now; raises ``EncodeError``
        when it cannot be encoded."""
        return self.send_frames(peer, encode(msg, self._send_limits))

    def encode(self, msg: Message) -> list[bytes | memoryview]:
        """``msg`` encoded under the send limits (raises ``EncodeError``)."""
        return encode(msg, self._send_limits)

    async def send_when_ready(
        self, peer: bytes, frames: list[bytes | memoryview], *, give_up_s: float | None = None
    ) -> bool:
        """Send, waiting while ``peer``'s queue is full; False when the peer is gone, the
        socket closed, or the queue stayed full for ``give_up_s`` (None: no limit)."""
        ok = await self._pump.send([peer, *frames], give_up_s=give_up_s, retry_s=self._send_retry_s)
        if not ok:
            self.stats.num_send_failures += 1
        return ok

    def refuse(self, peer: bytes, msg_id: int | None, code: ErrorCode, text: str,
               retryable: bool | None = None) -> SendOutcome:
        """Answer a request with an ``error`` (``retryable`` None: the code's default)."""
        self.stats.num_error_replies += 1
        is_retryable = code in RETRYABLE_CODES if retryable is None else retryable
        return self.send(peer, Error(msg_id, code, text, is_retryable))

    # ------------------------------------------------------------------ receiving

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        stats = self.stats
        if len(frames) < 2:  # a ROUTER always prepends the routing id
            stats.num_dropped += 1
            return
        peer = frames[0].bytes
        try:
            msg = decode(frames[1:], self._limits)
        except DecodeError as exc:
            stats.num_bad_messages += 1
            if exc.kind in _ANSWER_KINDS:  # never answer an answer: no error loops
                stats.num_dropped += 1
                return
            ending_id = self._ending_id(peer, exc)
            text = exc.message
            if ending_id is None and exc.msg_id is not None:
                text += f" (about the {exc.kind or 'message'} with id {exc.msg_id}; this error ends no request)"
            err = Error(ending_id, exc.code, text, exc.code in RETRYABLE_CODES)
            if self.send(peer, err) is not SendOutcome.SENT:
                stats.num_dropped += 1
            return
        if self._heard_from is not None:
            self._heard_from(peer)
        if isinstance(msg, Request):
            self._on_request(peer, msg)
        elif isinstance(msg, Cancel):
            stats.num_cancels_received += 1
            call = self._calls.get((peer, msg.id))
            if call is not None:
                self._cancel(call)
        elif isinstance(msg, Heartbeat):
            stats.num_heartbeats += 1
            if self._on_heartbeat is not None:
                self._on_heartbeat(peer, msg)
        else:  # answers belong on DEALER sockets; never answer them (no error loops)
            stats.num_dropped += 1

    def _ending_id(self, peer: bytes, exc: DecodeError) -> int | None:
        """The id an ``error`` about undecodable message ``exc`` may carry: the message's own,
        when that error ends a request (a new one, refused); else nil, never a live id."""
        if exc.msg_id is None or exc.kind in _NO_ANSWER_ID_KINDS or (peer, exc.msg_id) in self._calls:
            return None
        return exc.msg_id

    def _on_request(self, peer: bytes, req: Request) -> None:
        self.stats.num_requests += 1
        key = (peer, req.id)
        if key in self._calls:
            # Id nil: this error ends nothing; the open request with this id goes on.
            self.refuse(peer, None, ErrorCode.INVALID_REQUEST,
                        f"request id {req.id} is already in use by an open request of yours; this request "
                        "was not run (the open one goes on)")
            return
        deadline = None
        if req.timeout_ms is not None:
            if req.timeout_ms <= 0:
                self.stats.num_late_dropped += 1
                self.refuse(peer, req.id, ErrorCode.DEADLINE_EXCEEDED, "request arrived with no time left")
                return
            deadline = self._loop.time() + req.timeout_ms / 1000
        outcome = self._admit(peer, req, deadline)
        if isinstance(outcome, Refusal):
            self.refuse(peer, req.id, outcome.code, outcome.message, outcome.retryable)
        elif outcome is not None:
            self._calls[key] = outcome
