"""``LocalCalls``: calls from this process to actors hosted by this process's node.

They skip the wire entirely: the body object itself goes into the actor's mailbox (the
caller must not mutate it afterwards) and the result comes back through a future or a
``StreamCall`` buffer. Deadlines and cancellation behave as for a remote call, so a caller
cannot tell where its callee lives (``ActorRef``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from treeserve.runtime.actor import HandlerKind
from treeserve.runtime.calls import Envelope, StreamCall
from treeserve.runtime.cell import ActorCell
from treeserve.runtime.errors import (
    CallCancelled,
    DeadlineExceeded,
    NoSuchActor,
    NoSuchMethod,
    OverloadedError,
    RuntimeClosedError,
)
from treeserve.runtime.stats import NodeStats
from treeserve.transport.messages import ActorAddress

__all__ = ["LocalCalls"]


class LocalCalls:
    """In-process ``ask`` / ``tell`` / ``open_stream`` on the actors in ``cells`` (the
    node's live table, read at each call). A full mailbox raises ``OverloadedError``
    (counted in ``stats.num_overloaded``); after ``close`` every call raises
    ``RuntimeClosedError``."""

    def __init__(self, cells: Mapping[str, ActorCell], stats: NodeStats, *, stream_buffer: int) -> None:
        self._cells = cells
        self._stats = stats
        self._stream_buffer = stream_buffer
        self._is_closed = False

    def close(self) -> None:
        """Refuse every later call."""
        self._is_closed = True

    def _cell(self, address: ActorAddress, method: str, kind: HandlerKind) -> ActorCell:
        if self._is_closed:
            raise RuntimeClosedError("runtime closed")
        cell = self._cells.get(address.name)
        if cell is None or not cell.is_alive:
            raise NoSuchActor(f"no actor {address.name!r} on {address.endpoint}")
        spec = cell.handlers.get(method)
        if spec is None or spec.kind is not kind:
            raise NoSuchMethod(f"actor {address.name!r} has no {kind.value} handler {method!r}")
        return cell

    def _offer(self, cell: ActorCell, env: Envelope) -> None:
        if not cell.offer(env):
            self._stats.num_overloaded += 1
            raise OverloadedError(f"mailbox of {cell.name!r} is full")

    async def ask(self, address: ActorAddress, method: str, body: Any, timeout_s: float | None) -> Any:
        """Run unary ``method`` and return its result; see ``ActorRef.ask``."""
        loop = asyncio.get_running_loop()
        cell = self._cell(address, method, HandlerKind.UNARY)
        fut: asyncio.Future[Any] = loop.create_future()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        env = Envelope(0, method, cell.handlers[method], body, deadline, None, fut, None)
        self._offer(cell, env)
        timer = None if deadline is None else loop.call_at(deadline, _expire, fut, address, method)
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

    def tell(self, address: ActorAddress, method: str, body: Any) -> None:
        """Queue unary ``method``; its result or failure is discarded."""
        cell = self._cell(address, method, HandlerKind.UNARY)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_ignore_result)
        self._offer(cell, Envelope(0, method, cell.handlers[method], body, None, None, fut, None))

    def open_stream(
        self, address: ActorAddress, method: str, body: Any, timeout_s: float | None
    ) -> tuple[StreamCall, Callable[[], None]]:
        """Start stream ``method``; returns its buffer and a function that cancels it."""
        loop = asyncio.get_running_loop()
        call = StreamCall(address.endpoint, self._stream_buffer)
        cell = self._cell(address, method, HandlerKind.STREAM)
        deadline = None if timeout_s is None else loop.time() + timeout_s
        env = Envelope(0, method, cell.handlers[method], body, deadline, None, None, call)
        self._offer(cell, env)
        timer = None if deadline is None else loop.call_at(
            deadline, call.fail, DeadlineExceeded(f"{address.name}.{method}: stream deadline passed"))

        def cancel() -> None:
            if timer is not None:
                timer.cancel()
            if not call.is_done:
                call.fail(CallCancelled("cancelled by the caller"))
            cell.cancel(env, CallCancelled("cancelled by the caller"))

        return call, cancel


def _expire(fut: asyncio.Future[Any], address: ActorAddress, method: str) -> None:
    if not fut.done():
        fut.set_exception(DeadlineExceeded(f"{address.name}.{method}: no reply before the deadline"))


def _ignore_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: a tell's failure is not the sender's concern
