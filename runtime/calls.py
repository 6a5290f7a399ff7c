"""Caller-side state of calls in flight (``PendingAsk``, ``StreamCall``) and the
callee-side ``Envelope`` a mailbox holds."""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from typing import TYPE_CHECKING, Any, TypeAlias

from treeserve.runtime.errors import ActorError, error_from_wire
from treeserve.transport.messages import Error, Reply, StreamEnd, StreamItem

if TYPE_CHECKING:
    from treeserve.runtime.actor import HandlerSpec

__all__ = ["Envelope", "EnvelopeState", "PendingAsk", "StreamCall", "StreamEvent"]

StreamEvent: TypeAlias = StreamItem | StreamEnd | ActorError


class PendingAsk:
    """One unary call awaiting its reply. ``endpoint`` is the callee's node, so every
    call to a node that died can be failed at once; the future holds the raw reply body
    or the typed error."""

    __slots__ = ("endpoint", "future")

    def __init__(self, endpoint: str, future: asyncio.Future[Any]) -> None:
        self.endpoint = endpoint
        self.future = future

    def deliver(self, msg: Reply | StreamItem | StreamEnd | Error) -> bool:
        """Complete the call with ``msg``; returns False when the call already ended
        (the message is late). A stream message for a unary call is a protocol error."""
        fut = self.future
        if fut.done():
            return False
        if type(msg) is Reply:
            fut.set_result(msg.body)
        elif type(msg) is Error:
            fut.set_exception(error_from_wire(msg))
        else:
            fut.set_exception(ActorError(f"callee answered a unary call with {type(msg).__name__}"))
        return True

    def fail(self, exc: ActorError) -> None:
        """End the call with ``exc`` unless it already ended."""
        if not self.future.done():
            self.future.set_exception(exc)

    @property
    def is_done(self) -> bool:
        """True once a result or an error was delivered."""
        return self.future.done()


class StreamCall:
    """One streaming call: a buffer of received items in ``seq`` order ending with a
    ``StreamEnd`` or an ``ActorError``. At most ``capacity`` items are buffered: the
    in-process producer waits for space (``wait_space``); a remote stream that overflows
    is failed with ``OverloadedError`` by the node, so memory stays bounded."""

    __slots__ = ("_events", "_reader", "_writer", "capacity", "endpoint", "expected_seq", "is_done")

    def __init__(self, endpoint: str, capacity: int) -> None:
        self.endpoint = endpoint
        self.capacity = capacity
        self.expected_seq = 0
        self.is_done = False
        self._events: deque[StreamEvent] = deque()
        self._reader: asyncio.Future[None] | None = None
        self._writer: asyncio.Future[None] | None = None

    @property
    def is_full(self) -> bool:
        """True when ``capacity`` items wait to be read."""
        return len(self._events) >= self.capacity

    def push(self, event: StreamEvent) -> None:
        """Append an event (the node checks ``is_full`` and ``seq`` first); an end or an
        error finishes the stream, and later events are ignored."""
        if self.is_done:
            return
        if not isinstance(event, StreamItem):
            self.is_done = True
        self._events.append(event)
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    def fail(self, exc: ActorError) -> None:
        """Finish the stream with ``exc``, after the items already buffered."""
        if self.is_done:
            return
        self.push(exc)
        writer = self._writer
        if writer is not None and not writer.done():
            writer.set_result(None)

    async def next_event(self) -> StreamEvent:
        """Wait for and pop the next event."""
        while not self._events:
            self._reader = asyncio.get_running_loop().create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        event = self._events.popleft()
        writer = self._writer
        if writer is not None and not writer.done():
            writer.set_result(None)
        return event

    async def wait_space(self) -> None:
        """In-process producers wait here while the buffer is full."""
        while self.is_full and not self.is_done:
            self._writer = asyncio.get_running_loop().create_future()
            try:
                await self._writer
            finally:
                self._writer = None


class EnvelopeState(enum.Enum):
    """Lifecycle of a request inside a callee: queued, running, or finished."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


class Envelope:
    """A request accepted into an actor's mailbox. Exactly one of ``peer`` (remote
    caller's routing id: reply over the ROUTER), ``future`` (in-process unary caller) or
    ``stream`` (in-process stream caller) is the reply target. ``deadline`` is in
    ``loop.time()`` seconds, None for none. ``is_cancelled`` is set when the caller
    cancels or the deadline passes while queued, so the worker skips it."""

    __slots__ = (
        "body", "deadline", "future", "id", "is_cancelled", "method", "peer", "spec",
        "state", "stream",
    )

    def __init__(
        self,
        msg_id: int,
        method: str,
        spec: HandlerSpec,
        body: Any,
        deadline: float | None,
        peer: bytes | None,
        future: asyncio.Future[Any] | None,
        stream: StreamCall | None,
    ) -> None:
        self.id = msg_id
        self.method = method
        self.spec = spec
        self.body = body
        self.deadline = deadline
        self.peer = peer
        self.future = future
        self.stream = stream
        self.state = EnvelopeState.QUEUED
        self.is_cancelled = False
