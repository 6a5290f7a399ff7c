"""``Node``: one process's ROUTER endpoint, its hosted actors, and its outgoing calls."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from treeserve.runtime.actor import Actor, HandlerKind
from treeserve.runtime.bodies import body_from_wire, body_to_wire
from treeserve.runtime.calls import Envelope, StreamCall
from treeserve.runtime.cell import ActorCell
from treeserve.runtime.curve import LinkCurve
from treeserve.runtime.errors import (
    ActorError,
    CallCancelled,
    DeadlineExceeded,
    RemoteError,
    RuntimeClosedError,
    error_from_local,
    error_to_wire,
)
from treeserve.runtime.inbound import Inbound, Refusal, bind_router
from treeserve.runtime.local_calls import LocalCalls
from treeserve.runtime.outbound import Outbound
from treeserve.runtime.pump import SendOutcome
from treeserve.runtime.ref import ActorRef
from treeserve.runtime.stats import NodeStats
from treeserve.runtime.tasks import TaskOwner
from treeserve.transport.codec import encode
from treeserve.transport.messages import (
    ActorAddress,
    Heartbeat,
    Reply,
    Request,
    StreamEnd,
    StreamItem,
)
from treeserve.transport.sockets import CurveAuthenticator, bound_endpoint
from treeserve.transport.wire import ErrorCode, WireLimits

__all__ = ["Node", "NodeStats"]

_log = logging.getLogger(__name__)

_InboundCall = tuple[ActorCell, Envelope]  # a remote request in an actor's mailbox


class Node:
    """Hosts actors behind one ROUTER socket and routes this process's calls: to a
    local actor directly, to other nodes through ``Outbound`` (one DEALER per node,
    multiplexed by never-reused request ids).

    Calls to an actor on this node skip serialization: the body object itself is handed
    over (callers must not mutate it afterwards). Remote requests arrive through
    ``Inbound`` (``runtime/inbound.py``): a message the codec rejects gets an ``Error``
    reply to its sender (id None when unreadable) or is dropped when even that cannot be
    sent; both are counted in ``stats`` and other peers keep being served. With ``curve``
    the ROUTER admits only allow-listed CURVE clients and every outgoing DEALER is a
    CURVE client (``runtime/curve.py``).
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
        curve: LinkCurve | None = None,
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
        self._curve = curve
        self._auth: CurveAuthenticator | None = None
        self._inbound: Inbound[_InboundCall] | None = None
        self._endpoint = ""
        self._cells: dict[str, ActorCell] = {}
        self._local = LocalCalls(self._cells, self.stats, stream_buffer=stream_buffer)
        self._outbound = Outbound(
            ctx, self.stats, limits=limits, max_in_flight=max_in_flight, stream_buffer=stream_buffer,
            curve=None if curve is None else curve.client_config(),
        )
        self._is_closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind the ROUTER (with its ZAP handler under CURVE) and start serving it."""
        sock, self._auth = await bind_router(
            self._ctx, self._bind, limits=self._limits, allow_public_bind=self._allow_public_bind,
            curve=None if self._curve is None else self._curve.server_config(),
        )
        self._endpoint = bound_endpoint(sock)
        self._inbound = Inbound(
            sock, f"router {self._endpoint}", limits=self._limits, stats=self.stats,
            admit=self._admit, cancel=_cancel_inbound, on_heartbeat=self._on_inbound_heartbeat,
        )

    @property
    def endpoint(self) -> str:
        """The endpoint other processes connect to (real port after a ``:0`` bind)."""
        return self._endpoint

    @property
    def num_in_flight(self) -> int:
        """Outgoing remote calls awaiting an answer."""
        return self._outbound.num_in_flight

    async def stop_actors(self, timeout_s: float) -> None:
        """Stop the hosted actors (each one's ``on_stop``), leaving the sockets open so that
        their last calls to other processes still complete. Idempotent."""
        for cell in list(self._cells.values()):
            await cell.stop(timeout_s)
        self._cells.clear()

    async def aclose(self, timeout_s: float) -> None:
        """Stop hosted actors, fail outgoing calls, close sockets. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        self._local.close()
        await self.stop_actors(timeout_s)
        self._outbound.close()
        await self.tasks.aclose(timeout_s)
        if self._inbound is not None:
            self._inbound.close()
        if self._auth is not None:
            await self._auth.aclose()

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

    def from_wire(self, body: Any) -> Any:
        """A received body with its actor addresses made refs bound to this node."""
        return body_from_wire(body, self)

    # ------------------------------------------------------------------ outgoing links

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

    async def ask(self, address: ActorAddress, method: str, body: Any, timeout_s: float | None) -> Any:
        """Call ``method`` on the actor at ``address``; see ``ActorRef.ask``."""
        if timeout_s is not None and timeout_s <= 0:
            raise DeadlineExceeded(f"{address.name}.{method}: no time left to send")
        if address.endpoint == self._endpoint:
            return await self._local.ask(address, method, body, timeout_s)
        reply_body = await self._outbound.ask(address, method, body, timeout_s)
        return body_from_wire(reply_body, self)

    async def tell(self, address: ActorAddress, method: str, body: Any) -> None:
        """Send without waiting for the result; see ``ActorRef.tell``."""
        if address.endpoint == self._endpoint:
            self._local.tell(address, method, body)
        else:
            self._outbound.tell(address, method, body)

    def open_stream(
        self, address: ActorAddress, method: str, body: Any, timeout_s: float | None
    ) -> tuple[StreamCall, Callable[[], None]]:
        """Start a streaming call; returns its buffer and a function that cancels it
        (a no-op once the stream ended). Used by ``ActorRef.ask_stream``."""
        if address.endpoint == self._endpoint:
            return self._local.open_stream(address, method, body, timeout_s)
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
        if self._inbound is None or not await self._inbound.send_when_ready(env.peer, frames):
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
        if self._inbound is not None:
            self._inbound.release(env.peer, env.id)

    def _reply(self, peer: bytes, frames: list[bytes | memoryview]) -> bool:
        return self._inbound is not None and self._inbound.send_frames(peer, frames) is SendOutcome.SENT

    # ------------------------------------------------------------------ receiving

    def _admit(self, peer: bytes, req: Request, deadline: float | None) -> _InboundCall | Refusal:
        """Put a remote request into its actor's mailbox (``Inbound`` checked the rest)."""
        cell = self._cells.get(req.target)
        if cell is None or not cell.is_alive:
            return Refusal(ErrorCode.NO_SUCH_ACTOR, f"no actor {req.target!r} on {self._endpoint}")
        spec = cell.handlers.get(req.method)
        kind = HandlerKind.STREAM if req.stream else HandlerKind.UNARY
        if spec is None or spec.kind is not kind:
            return Refusal(ErrorCode.NO_SUCH_METHOD, f"actor {req.target!r} has no {kind.value} handler {req.method!r}")
        env = Envelope(req.id, req.method, spec, body_from_wire(req.body, self), deadline, peer, None, None)
        if not cell.offer(env):
            self.stats.num_overloaded += 1
            return Refusal(ErrorCode.OVERLOADED, f"mailbox of {req.target!r} is full")
        return cell, env

    def _on_inbound_heartbeat(self, peer: bytes, beat: Heartbeat) -> None:
        if self.on_heartbeat is not None:
            self.on_heartbeat(beat)


def _cancel_inbound(call: _InboundCall) -> None:
    cell, env = call
    cell.cancel(env, CallCancelled("cancelled by the caller"))
