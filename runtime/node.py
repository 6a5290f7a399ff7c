"""``Node``: one process's ROUTER endpoint, its hosted actors, and its outgoing calls."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from treeserve.runtime.actor import Actor, HandlerKind
from treeserve.runtime.bodies import body_from_wire, body_to_wire
from treeserve.runtime.calls import Envelope, StreamCall
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
    error_to_wire,
)
from treeserve.runtime.outbound import Outbound
from treeserve.runtime.pump import SocketPump
from treeserve.runtime.ref import ActorRef
from treeserve.runtime.stats import NodeStats
from treeserve.runtime.tasks import TaskOwner
from treeserve.transport.codec import DecodeError, decode, encode
from treeserve.transport.messages import (
    ActorAddress,
    Cancel,
    Error,
    Heartbeat,
    Reply,
    Request,
    StreamEnd,
    StreamItem,
)
from treeserve.transport.sockets import bound_endpoint, make_router
from treeserve.transport.wire import RETRYABLE_CODES, ErrorCode, WireLimits

__all__ = ["Node", "NodeStats"]

_log = logging.getLogger(__name__)


class Node:
    """Hosts actors behind one ROUTER socket and routes this process's calls: to a
    local actor directly, to other nodes through ``Outbound`` (one DEALER per node,
    multiplexed by never-reused request ids).

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
        self._mailbox_size = mailbox_size
        self._stream_buffer = stream_buffer
        self._allow_public_bind = allow_public_bind
        self._router: SocketPump | None = None
        self._endpoint = ""
        self._cells: dict[str, ActorCell] = {}
        self._inbound: dict[tuple[bytes, int], tuple[ActorCell, Envelope]] = {}
        self._outbound = Outbound(
            ctx, self.stats, limits=limits, max_in_flight=max_in_flight, stream_buffer=stream_buffer
        )
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
        return self._outbound.num_in_flight

    async def aclose(self, timeout_s: float) -> None:
        """Stop hosted actors, fail outgoing calls, close sockets. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        for cell in list(self._cells.values()):
            await cell.stop(timeout_s)
        self._cells.clear()
        self._outbound.close()
        await self.tasks.aclose(timeout_s)
        if self._router is not None:
            self._router.close()

    # ------------------------------------------------------------------ hosting

    async def host(
        self,
        name: str,
        actor: Actor,
        mailbox_size: int | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> ActorRef:
        """Register ``actor`` as ``name``, run its ``on_start`` and start serving it.
        ``on_failure`` hears of every task owned by the actor that dies of an exception
        (its supervisor's restart hook)."""
        if self._is_closed:
            raise RuntimeClosedError("runtime closed")
        if name in self._cells:
            raise ValueError(f"an actor named {name!r} already runs on this node")
        size = mailbox_size or type(actor).mailbox_size or self._mailbox_size
        ref = self.ref(ActorAddress(self._endpoint, name))
        actor.attach(self, ref, on_failure)
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
        """Declare node ``endpoint`` dead; see ``Outbound.mark_down``."""
        self._outbound.mark_down(endpoint, exc)

    def mark_up(self, endpoint: str) -> None:
        """Allow calls to ``endpoint`` again (after a restart)."""
        self._outbound.mark_up(endpoint)

    def send_heartbeat(self, endpoint: str, beat: Heartbeat) -> None:
        """Send a heartbeat to node ``endpoint`` (no answer expected)."""
        self._outbound.send_heartbeat(endpoint, beat)

    # ------------------------------------------------------------------ calling

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
        reply_body = await self._outbound.ask(address, method, body, timeout_s)
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
        self._outbound.tell(address, method, body)

    def open_stream(
        self, address: ActorAddress, method: str, body: Any, timeout_s: float | None
    ) -> tuple[StreamCall, Callable[[], None]]:
        """Start a streaming call; returns its buffer and a function that cancels it
        (a no-op once the stream ended). Used by ``ActorRef.ask_stream``."""
        if address.endpoint == self._endpoint:
            loop = asyncio.get_running_loop()
            call = StreamCall(address.endpoint, self._stream_buffer)
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
        return self._outbound.open_stream(address, method, body, timeout_s)

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

    # ------------------------------------------------------------------ receiving

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


def _ignore_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: a tell's failure is not the sender's concern

