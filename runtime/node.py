"""``Node``: one process's ROUTER endpoint, its hosted actors, and its outgoing calls."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import zmq
import zmq.asyncio

from treeserve.runtime.actor import Actor, HandlerKind
from treeserve.runtime.bodies import body_from_wire, body_to_wire
from treeserve.runtime.calls import Envelope, PendingAsk, StreamCall
from treeserve.runtime.cell import ActorCell
from treeserve.runtime.errors import (
    ActorError,
    CallCancelled,
    DeadlineExceeded,
    NoSuchActor,
    NoSuchMethod,
    OverloadedError,
    RemoteError,
    RuntimeClosedError,
    error_from_local,
    error_from_wire,
    error_to_wire,
)
from treeserve.runtime.ref import ActorRef
from treeserve.runtime.pump import SocketPump
from treeserve.runtime.tasks import TaskOwner
from treeserve.transport.codec import DecodeError, decode, encode
from treeserve.transport.messages import (
    ActorAddress,
    Cancel,
    Error,
    Heartbeat,
    Message,
    Reply,
    Request,
    StreamEnd,
    StreamItem,
)
from treeserve.transport.sockets import bound_endpoint, make_dealer, make_router
from treeserve.transport.wire import RETRYABLE_CODES, ErrorCode, WireLimits

__all__ = ["Node", "NodeStats"]

_log = logging.getLogger(__name__)


@dataclass
class NodeStats:
    """Counters of one node, for tests and monitoring (monotonic, never reset)."""

    num_requests: int = 0
    num_bad_messages: int = 0
    num_dropped: int = 0
    num_error_replies: int = 0
    num_overloaded: int = 0
    num_late_dropped: int = 0
    num_late_replies: int = 0
    num_cancels_received: int = 0
    num_heartbeats: int = 0
    num_send_failures: int = 0


class _Peer:
    """Our DEALER connection to another node; answers arrive on it."""

    __slots__ = ("endpoint", "pump")

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.pump: SocketPump | None = None


_Pending: TypeAlias = PendingAsk | StreamCall


class Node:
    """Hosts actors behind one ROUTER socket and makes calls to other nodes over one
    DEALER per remote node, multiplexed by request id (ids come from a counter and are
    never reused, so a late answer can only be discarded, never misdelivered).

    Calls to an actor on this node skip serialization: the body object itself is handed
    over (callers must not mutate it afterwards). A message the codec rejects gets an
    ``Error`` reply to its sender (id None when unreadable) or is dropped when even that
    cannot be sent; both are counted in ``stats`` and other peers keep being served.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        bind: str,
        *,
        limits: WireLimits,
        max_in_flight: int,
        mailbox_size: int,
        stream_buffer: int,
        default_timeout_s: float | None,
        allow_public_bind: bool = False,
    ) -> None:
        self.default_timeout_s = default_timeout_s
        self.tasks = TaskOwner("node")
        self.stats = NodeStats()
        self.on_heartbeat: Callable[[Heartbeat], None] | None = None
        self._ctx = ctx
        self._bind = bind
        self._limits = limits
        self._max_in_flight = max_in_flight
        self._mailbox_size = mailbox_size
        self._stream_buffer = stream_buffer
        self._allow_public_bind = allow_public_bind
        self._router: SocketPump | None = None
        self._endpoint = ""
        self._cells: dict[str, ActorCell] = {}
        self._peers: dict[str, _Peer] = {}
        self._pending: dict[int, _Pending] = {}
        self._inbound: dict[tuple[bytes, int], tuple[ActorCell, Envelope]] = {}
        self._down: dict[str, ActorError] = {}
        self._ids = itertools.count(1)
        self._is_closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind the ROUTER and start serving it."""
        sock = make_router(
            self._ctx, self._bind, limits=self._limits, allow_public_bind=self._allow_public_bind
        )
        self._endpoint = bound_endpoint(sock)
        self._router = SocketPump(sock, self._on_router_frames, f"router {self._endpoint}")

    @property
    def endpoint(self) -> str:
        """The endpoint other processes connect to (real port after a ``:0`` bind)."""
        return self._endpoint

    @property
    def num_in_flight(self) -> int:
        """Outgoing remote calls awaiting an answer."""
        return len(self._pending)

    async def aclose(self, timeout_s: float) -> None:
        """Stop hosted actors, fail outgoing calls, close sockets. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        for cell in list(self._cells.values()):
            await cell.stop(timeout_s)
        self._cells.clear()
        for call in list(self._pending.values()):
            call.fail(RuntimeClosedError("runtime closed"))
        self._pending.clear()
        await self.tasks.aclose(timeout_s)
        for peer in self._peers.values():
            if peer.pump is not None:
                peer.pump.close()
        self._peers.clear()
        if self._router is not None:
            self._router.close()

    # ------------------------------------------------------------------ hosting

    async def host(self, name: str, actor: Actor, mailbox_size: int | None = None) -> ActorRef:
        """Register ``actor`` as ``name``, run its ``on_start`` and start serving it."""
        if self._is_closed:
            raise RuntimeClosedError("runtime closed")
        if name in self._cells:
            raise ValueError(f"an actor named {name!r} already runs on this node")
        size = mailbox_size or type(actor).mailbox_size or self._mailbox_size
        ref = self.ref(ActorAddress(self._endpoint, name))
        actor.attach(self, ref)
        cell = ActorCell(self, name, actor, size)
        self._cells[name] = cell  # reserve the name while on_start runs
        try:
            await cell.start()
        except BaseException:
            del self._cells[name]
            raise
        return ref

    async def stop_actor(self, name: str, timeout_s: float) -> None:
        """Stop the local actor ``name`` (callers get ``ActorDeadError``)."""
        cell = self._cells.pop(name, None)
        if cell is not None:
            await cell.stop(timeout_s)

    def ref(self, address: ActorAddress) -> ActorRef:
        """A callable reference to the actor at ``address`` (any node)."""
        return ActorRef(address, self)

    def is_local(self, address: ActorAddress) -> bool:
        """True when ``address`` names this node."""
        return address.endpoint == self._endpoint

    # ------------------------------------------------------------------ liveness

    def mark_down(self, endpoint: str, exc: ActorError) -> None:
        """Declare node ``endpoint`` dead: fail its pending calls with ``exc``, drop our
        connection (so requests queued for the old process never reach a restarted
        one), and fail new calls to it until ``mark_up``."""
        self._down[endpoint] = exc
        for msg_id, call in list(self._pending.items()):
            if call.endpoint == endpoint:
                del self._pending[msg_id]
                call.fail(type(exc)(exc.message, code=exc.code, retryable=exc.retryable))
        peer = self._peers.pop(endpoint, None)
        if peer is not None and peer.pump is not None:
            peer.pump.close()

    def mark_up(self, endpoint: str) -> None:
        """Allow calls to ``endpoint`` again (after a restart)."""
        self._down.pop(endpoint, None)

    def send_heartbeat(self, endpoint: str, beat: Heartbeat) -> None:
        """Send a heartbeat to node ``endpoint`` (no answer expected)."""
        self._send_nowait(self._peer(endpoint), encode(beat, self._limits))

    # ------------------------------------------------------------------ calling

    def _check_can_call(self, endpoint: str) -> None:
        if self._is_closed:
            raise RuntimeClosedError("runtime closed")
        down = self._down.get(endpoint)
        if down is not None:
            raise type(down)(down.message, code=down.code, retryable=down.retryable)
        if len(self._pending) >= self._max_in_flight:
            self.stats.num_overloaded += 1
            raise OverloadedError(f"{len(self._pending)} calls in flight (max {self._max_in_flight})")

    def _local_cell(self, address: ActorAddress, method: str, kind: HandlerKind) -> ActorCell:
        if self._is_closed:
            raise RuntimeClosedError("runtime closed")
        cell = self._cells.get(address.name)
        if cell is None or not cell.is_alive:
            raise NoSuchActor(f"no actor {address.name!r} on {self._endpoint}")
        spec = cell.handlers.get(method)
        if spec is None or spec.kind is not kind:
            raise NoSuchMethod(f"actor {address.name!r} has no {kind.value} handler {method!r}")
        return cell

    async def ask(self, address: ActorAddress, method: str, body: Any, timeout_s: float | None) -> Any:
        """Call ``method`` on the actor at ``address``; see ``ActorRef.ask``."""
        loop = asyncio.get_running_loop()
        if timeout_s is not None and timeout_s <= 0:
            raise DeadlineExceeded(f"{address.name}.{method}: no time left to send")
        if address.endpoint == self._endpoint:
            return await self._ask_local(loop, address, method, body, timeout_s)
        self._check_can_call(address.endpoint)
        msg_id = next(self._ids)
        timeout_ms = None if timeout_s is None else max(1, int(timeout_s * 1000))
        frames = encode(
            Request(msg_id, address.name, method, body_to_wire(body), timeout_ms, False), self._limits
        )
        peer = self._peer(address.endpoint)
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending[msg_id] = PendingAsk(address.endpoint, fut)
        timer = None if timeout_s is None else loop.call_later(
            timeout_s, self._expire_call, msg_id, address, method)
        try:
            if not self._send_nowait(peer, frames):
                raise OverloadedError(f"cannot send to {address.endpoint}: queue full")
            reply_body = await fut
        except asyncio.CancelledError:
            if self._pending.pop(msg_id, None) is not None:
                self._send_cancel(address.endpoint, msg_id)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(msg_id, None)
        return body_from_wire(reply_body, self)

    async def _ask_local(
        self,
        loop: asyncio.AbstractEventLoop,
        address: ActorAddress,
        method: str,
        body: Any,
        timeout_s: float | None,
    ) -> Any:
        cell = self._local_cell(address, method, HandlerKind.UNARY)
        fut: asyncio.Future[Any] = loop.create_future()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        env = Envelope(0, method, cell.handlers[method], body, deadline, None, fut, None)
        if not cell.offer(env):
            self.stats.num_overloaded += 1
            raise OverloadedError(f"mailbox of {address.name!r} is full")
        timer = None if deadline is None else loop.call_at(deadline, self._expire_local, fut, address, method)
        try:
            return await fut
        except asyncio.CancelledError:
            cell.cancel(env, CallCancelled("cancelled by the caller"))
            raise
        except DeadlineExceeded:
            cell.cancel(env, DeadlineExceeded("deadline passed"))
            raise
        finally:
            if timer is not None:
                timer.cancel()

    @staticmethod
    def _expire_local(fut: asyncio.Future[Any], address: ActorAddress, method: str) -> None:
        if not fut.done():
            fut.set_exception(DeadlineExceeded(f"{address.name}.{method}: no reply before the deadline"))

    def _expire_call(self, msg_id: int, address: ActorAddress, method: str) -> None:
        call = self._pending.pop(msg_id, None)
        if call is not None:
            call.fail(DeadlineExceeded(f"{address.name}.{method}: no reply before the deadline"))
            self._send_cancel(address.endpoint, msg_id)

    def _send_cancel(self, endpoint: str, msg_id: int) -> None:
        peer = self._peers.get(endpoint)
        if peer is not None:
            self._send_nowait(peer, encode(Cancel(msg_id), self._limits))

    async def tell(self, address: ActorAddress, method: str, body: Any) -> None:
        """Send without waiting for the result; see ``ActorRef.tell``."""
        if address.endpoint == self._endpoint:
            cell = self._local_cell(address, method, HandlerKind.UNARY)
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            fut.add_done_callback(_ignore_result)
            env = Envelope(0, method, cell.handlers[method], body, None, None, fut, None)
            if not cell.offer(env):
                self.stats.num_overloaded += 1
                raise OverloadedError(f"mailbox of {address.name!r} is full")
            return
        self._check_can_call(address.endpoint)
        # The protocol has no one-way request: the callee answers and, as the id was
        # never registered, the answer is discarded on arrival (counted as late).
        frames = encode(Request(next(self._ids), address.name, method, body_to_wire(body)), self._limits)
        if not self._send_nowait(self._peer(address.endpoint), frames):
            raise OverloadedError(f"cannot send to {address.endpoint}: queue full")

    def open_stream(
        self, address: ActorAddress, method: str, body: Any, timeout_s: float | None
    ) -> tuple[StreamCall, Callable[[], None]]:
        """Start a streaming call; returns its buffer and a function that cancels it
        (a no-op once the stream ended). Used by ``ActorRef.ask_stream``."""
        loop = asyncio.get_running_loop()
        call = StreamCall(address.endpoint, self._stream_buffer)
        if address.endpoint == self._endpoint:
            cell = self._local_cell(address, method, HandlerKind.STREAM)
            deadline = None if timeout_s is None else loop.time() + timeout_s
            env = Envelope(0, method, cell.handlers[method], body, deadline, None, None, call)
            if not cell.offer(env):
                self.stats.num_overloaded += 1
                raise OverloadedError(f"mailbox of {address.name!r} is full")
            timer = None if deadline is None else loop.call_at(
                deadline, call.fail, DeadlineExceeded(f"{address.name}.{method}: stream deadline passed"))

            def cancel_local() -> None:
                if timer is not None:
                    timer.cancel()
                if not call.is_done:
                    call.fail(CallCancelled("cancelled by the caller"))
                cell.cancel(env, CallCancelled("cancelled by the caller"))

            return call, cancel_local
        self._check_can_call(address.endpoint)
        msg_id = next(self._ids)
        timeout_ms = None if timeout_s is None else max(1, int(timeout_s * 1000))
        frames = encode(
            Request(msg_id, address.name, method, body_to_wire(body), timeout_ms, True), self._limits
        )
        peer = self._peer(address.endpoint)
        self._pending[msg_id] = call
        if not self._send_nowait(peer, frames):
            del self._pending[msg_id]
            raise OverloadedError(f"cannot send to {address.endpoint}: queue full")
        remote_timer = None if timeout_s is None else loop.call_later(
            timeout_s, self._expire_call, msg_id, address, method)

        def cancel_remote() -> None:
            if remote_timer is not None:
                remote_timer.cancel()
            if self._pending.pop(msg_id, None) is not None:
                self._send_cancel(address.endpoint, msg_id)

        return call, cancel_remote

    # ------------------------------------------------------------------ answering

    def finish_reply(self, env: Envelope, result: Any) -> None:
        """Deliver a unary handler's result to its caller."""
        if env.future is not None:
            if not env.future.done():
                env.future.set_result(result)
            return
        assert env.peer is not None
        self._release(env)
        try:
            frames = encode(Reply(env.id, body_to_wire(result)), self._limits)
        except ValueError as exc:  # EncodeError: the handler returned something unsendable
            self.finish_error(env, RemoteError(f"cannot encode the reply: {exc}", code=ErrorCode.INTERNAL))
            return
        self._reply(env.peer, frames)

    def finish_error(self, env: Envelope, exc: BaseException) -> None:
        """Deliver a failure (handler exception or runtime error) to the caller."""
        if env.future is not None:
            if not env.future.done():
                env.future.set_exception(error_from_local(exc))
            return
        if env.stream is not None:
            env.stream.fail(error_from_local(exc))
            return
        assert env.peer is not None
        self._release(env)
        self.stats.num_error_replies += 1
        self._reply(env.peer, encode(error_to_wire(env.id, exc), self._limits))

    async def stream_item(self, env: Envelope, seq: int, item: Any) -> None:
        """Deliver one stream item, waiting while an in-process consumer's buffer is
        full; raises ``CallCancelled`` when the consumer is gone."""
        stream = env.stream
        if stream is not None:
            await stream.wait_space()
            if stream.is_done:
                raise CallCancelled("the stream consumer went away")
            stream.push(StreamItem(0, seq, item))
            return
        assert env.peer is not None
        frames = encode(StreamItem(env.id, seq, body_to_wire(item)), self._limits)
        # Waits while the caller's queue is full: a slow network pushes back on the
        # generator.
        if self._router is None or not await self._router.send([env.peer, *frames]):
            raise CallCancelled("the stream consumer is unreachable")

    def finish_stream(self, env: Envelope, seq: int) -> None:
        """End a stream successfully after ``seq`` items."""
        if env.stream is not None:
            env.stream.push(StreamEnd(0, seq))
            return
        assert env.peer is not None
        self._release(env)
        self._reply(env.peer, encode(StreamEnd(env.id, seq), self._limits))

    def _release(self, env: Envelope) -> None:
        assert env.peer is not None
        self._inbound.pop((env.peer, env.id), None)

    def _reply(self, peer: bytes, frames: list[bytes | memoryview]) -> bool:
        if self._router is None or not self._router.send_nowait([peer, *frames]):
            self.stats.num_send_failures += 1
            return False
        return True

    def _send_nowait(self, peer: _Peer, frames: list[Any]) -> bool:
        """Send without waiting; False (and counted) when zmq refuses at once (peer
        queue full), so nothing ever piles up in memory here."""
        if peer.pump is None or not peer.pump.send_nowait(frames):
            self.stats.num_send_failures += 1
            return False
        return True

    # ------------------------------------------------------------------ receiving

    def _peer(self, endpoint: str) -> _Peer:
        peer = self._peers.get(endpoint)
        if peer is None:
            peer = _Peer(endpoint)
            peer.pump = SocketPump(
                make_dealer(self._ctx, endpoint, limits=self._limits),
                self._on_dealer_frames,
                f"dealer {endpoint}",
            )
            self._peers[endpoint] = peer
        return peer

    def _on_router_frames(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            self.stats.num_dropped += 1
            return
        peer = frames[0].bytes
        try:
            msg = decode(frames[1:], self._limits)
        except DecodeError as exc:
            self.stats.num_bad_messages += 1
            err = Error(exc.msg_id, exc.code, exc.message, exc.code in RETRYABLE_CODES)
            if not self._reply(peer, encode(err, self._limits)):
                self.stats.num_dropped += 1
            return
        if isinstance(msg, Request):
            self._on_request(peer, msg)
        elif isinstance(msg, Cancel):
            self.stats.num_cancels_received += 1
            entry = self._inbound.get((peer, msg.id))
            if entry is not None:
                entry[0].cancel(entry[1], CallCancelled("cancelled by the caller"))
        elif isinstance(msg, Heartbeat):
            self.stats.num_heartbeats += 1
            if self.on_heartbeat is not None:
                self.on_heartbeat(msg)
        else:  # answers belong on DEALER sockets, not here
            self.stats.num_dropped += 1

    def _on_request(self, peer: bytes, req: Request) -> None:
        self.stats.num_requests += 1
        cell = self._cells.get(req.target)
        if cell is None or not cell.is_alive:
            self._refuse(peer, req.id, ErrorCode.NO_SUCH_ACTOR, f"no actor {req.target!r} on {self._endpoint}")
            return
        spec = cell.handlers.get(req.method)
        kind = HandlerKind.STREAM if req.stream else HandlerKind.UNARY
        if spec is None or spec.kind is not kind:
            self._refuse(peer, req.id, ErrorCode.NO_SUCH_METHOD,
                         f"actor {req.target!r} has no {kind.value} handler {req.method!r}")
            return
        key = (peer, req.id)
        if key in self._inbound:
            self._refuse(peer, req.id, ErrorCode.INVALID_REQUEST, f"request id {req.id} is already in use")
            return
        deadline = None
        if req.timeout_ms is not None:
            if req.timeout_ms <= 0:
                self.stats.num_late_dropped += 1
                self._refuse(peer, req.id, ErrorCode.DEADLINE_EXCEEDED, "request arrived with no time left")
                return
            deadline = asyncio.get_running_loop().time() + req.timeout_ms / 1000
        env = Envelope(req.id, req.method, spec, body_from_wire(req.body, self), deadline, peer, None, None)
        if not cell.offer(env):
            self.stats.num_overloaded += 1
            self._refuse(peer, req.id, ErrorCode.OVERLOADED, f"mailbox of {req.target!r} is full")
            return
        self._inbound[key] = (cell, env)

    def _refuse(self, peer: bytes, msg_id: int, code: ErrorCode, text: str) -> None:
        self.stats.num_error_replies += 1
        self._reply(peer, encode(Error(msg_id, code, text, code in RETRYABLE_CODES), self._limits))

    def _on_dealer_frames(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = decode(frames, self._limits)
        except DecodeError as exc:
            self.stats.num_bad_messages += 1
            bad = None if exc.msg_id is None else self._pending.pop(exc.msg_id, None)
            if bad is not None:
                bad.fail(RemoteError(f"undecodable answer: {exc.message}", code=exc.code))
            return
        self._on_answer(msg)

    def _on_answer(self, msg: Message) -> None:
        if isinstance(msg, Request | Cancel | Heartbeat):
            self.stats.num_dropped += 1
            return
        msg_id = msg.id
        call = self._pending.get(msg_id) if msg_id is not None else None
        if call is None or msg_id is None:
            self.stats.num_late_replies += 1
            return
        if isinstance(call, PendingAsk):
            del self._pending[msg_id]
            call.deliver(msg)
            return
        if isinstance(msg, StreamItem):
            if msg.seq != call.expected_seq:
                del self._pending[msg_id]
                call.fail(RemoteError(f"stream item seq {msg.seq}, expected {call.expected_seq}",
                                      code=ErrorCode.BAD_MESSAGE))
                self._send_cancel(call.endpoint, msg_id)
                return
            if call.is_full:
                del self._pending[msg_id]
                call.fail(OverloadedError(f"stream consumer is {call.capacity} items behind"))
                self._send_cancel(call.endpoint, msg_id)
                return
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


def _ignore_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: a tell's failure is not the sender's concern

