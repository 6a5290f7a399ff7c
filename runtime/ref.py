"""``ActorRef``: a callable, serializable handle on an actor anywhere."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from treeserve.runtime.errors import ActorError
from treeserve.transport.messages import ActorAddress, StreamEnd, StreamItem

__all__ = ["ActorRef", "RefNode"]


class StreamEvents(Protocol):
    """A streaming call's buffer, as a ref reads it (``calls.StreamCall``)."""

    async def next_event(self) -> StreamItem | StreamEnd | ActorError: ...


class RefNode(Protocol):
    """What a ref calls through: its process's node (``node.Node``), seen from here so that
    this module needs nothing of the node's own."""

    default_timeout_s: float | None

    def is_local(self, address: ActorAddress) -> bool: ...

    async def ask(self, address: ActorAddress, method: str, body: Any, timeout_s: float | None) -> Any: ...

    async def tell(self, address: ActorAddress, method: str, body: Any) -> None: ...

    def open_stream(self, address: ActorAddress, method: str, body: Any,
                    timeout_s: float | None) -> tuple[StreamEvents, Callable[[], None]]: ...

    def from_wire(self, body: Any) -> Any: ...

    def ref(self, address: ActorAddress) -> ActorRef: ...


class ActorRef:
    """Names actor ``address.name`` on the node at ``address.endpoint`` and calls it
    through the local ``node``.

    A ref put inside any message body travels as its ``ActorAddress`` and arrives as a
    ref bound to the receiving process's node, so it can be called there. Refs compare
    and hash by address. A ref names a *slot*, not an incarnation: after a supervisor
    restarts the actor (same name, same endpoint), the same ref reaches the new one.
    """

    __slots__ = ("_node", "address")

    def __init__(self, address: ActorAddress, node: RefNode) -> None:
        self.address = address
        self._node = node

    @property
    def name(self) -> str:
        """The actor's name on its node."""
        return self.address.name

    @property
    def endpoint(self) -> str:
        """The endpoint of the node hosting the actor."""
        return self.address.endpoint

    @property
    def is_local(self) -> bool:
        """True when the actor lives in this process (calls skip serialization)."""
        return self._node.is_local(self.address)

    async def ask(self, method: str, body: Any = None, *, timeout: float | None = None) -> Any:
        """Run handler ``method`` with ``body`` and return its result.

        ``timeout`` (seconds; None: the runtime's ``default_timeout_s``) is a deadline
        that travels with the request: the callee drops the request if it is still
        queued when the deadline passes and cancels its handler if still running. The
        caller then gets ``DeadlineExceeded``; a reply arriving later is discarded.
        Cancelling the calling task sends ``Cancel`` and the callee's handler observes
        ``CancelledError``. Failures raise ``ActorError`` subclasses: ``ActorDeadError``,
        ``OverloadedError``, ``NoSuchActor``, ``NoSuchMethod``, ``RemoteError`` (the
        handler raised; code ``INTERNAL``)...
        """
        return await self._node.ask(self.address, method, body, self._timeout(timeout))

    async def tell(self, method: str, body: Any = None) -> None:
        """Send ``method(body)`` without waiting for it to run. Returns once the message
        is queued (raises ``OverloadedError`` when it cannot be); the handler's result
        or failure is discarded."""
        await self._node.tell(self.address, method, body)

    async def ask_stream(
        self, method: str, body: Any = None, *, timeout: float | None = None
    ) -> AsyncIterator[Any]:
        """Iterate over the items yielded by stream handler ``method``.

        The iteration ends when the callee's generator returns, or raises the typed
        error that ended it. ``timeout`` bounds the whole stream (None: no deadline).
        Breaking out of the loop, closing the iterator or cancelling the consuming task
        cancels the callee's generator (use ``contextlib.aclosing`` for prompt cleanup
        when breaking out of ``async for``). At most ``RuntimeConfig.stream_buffer``
        items are buffered for a slow consumer; a remote producer further ahead makes
        the stream fail with ``OverloadedError``.
        """
        node = self._node
        call, cancel = node.open_stream(self.address, method, body, timeout)
        try:
            while True:
                event = await call.next_event()
                if isinstance(event, StreamItem):
                    yield event.body if self.is_local else node.from_wire(event.body)
                elif isinstance(event, StreamEnd):
                    return
                else:
                    assert isinstance(event, ActorError)
                    raise event
        finally:
            cancel()

    def _timeout(self, timeout: float | None) -> float | None:
        return self._node.default_timeout_s if timeout is None else timeout

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and other.address == self.address

    def __hash__(self) -> int:
        return hash(self.address)

    def __repr__(self) -> str:
        return f"ActorRef({self.address.name!r} @ {self.address.endpoint})"
