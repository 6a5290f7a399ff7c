"""``SocketPump``: event-loop-driven, callback-based I/O on one zmq socket.

Each received message is handed to a callback straight from the loop's reader
callback: no task, no future and no pyzmq asyncio bookkeeping per message, which keeps
the runtime's per-message cost close to the bare socket's. Sends never block: they
succeed at once or report failure (peer queue full, peer gone).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

__all__ = ["SendOutcome", "SocketPump", "close_monitor"]

_log = logging.getLogger(__name__)
_MAX_BATCH = 256  # messages handled per reader callback before yielding to the loop
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_SEND_RETRY_S = 0.001


class SendOutcome(enum.Enum):
    """What became of one non-blocking send: a ROUTER must tell a peer whose queue is full
    (retry later) from one that is gone (stop sending to it)."""

    SENT = "sent"
    FULL = "full"  # the peer's queue is at its high-water mark
    GONE = "gone"  # the peer is not connected (ROUTER_MANDATORY), or the socket closed


class SocketPump:
    """Reads every message of ``sock`` into ``on_message(frames)`` from the event loop
    and sends without blocking.

    The zmq file descriptor is edge-triggered: it only signals that events *may* have
    changed, and any send or receive can consume that signal. So the reader drains until
    ``ZMQ_EVENTS`` says nothing is left, and every send re-checks for pending input.
    ``on_message`` must not raise (exceptions are logged and the message dropped).
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        on_message: Callable[[list[zmq.Frame]], None],
        name: str,
    ) -> None:
        self._owner = sock  # owns the libzmq socket; closed by ``close``
        self._sock: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._on_message = on_message
        self._name = name
        self._loop = asyncio.get_running_loop()
        self._is_drain_scheduled = False
        self._is_closed = False
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()  # messages may already be waiting

    def _is_readable(self) -> bool:
        return bool(int(self._sock.getsockopt(_EVENTS)) & _POLLIN)

    def _schedule_drain(self) -> None:
        if not self._is_drain_scheduled and not self._is_closed:
            self._is_drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._is_drain_scheduled = False
        if self._is_closed:
            return
        sock = self._sock
        on_message = self._on_message
        for _ in range(_MAX_BATCH):
            if not self._is_readable():
                return
            try:
                frames = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:
                _log.exception("%s: receive failed", self._name)
                return
            try:
                on_message(frames)
            except Exception:
                _log.exception("%s: failed to handle a message", self._name)
        self._schedule_drain()  # more may be waiting: let other callbacks run first

    def try_send(self, frames: list[Any]) -> SendOutcome:
        """Send one message now, or say why zmq refused it."""
        if self._is_closed:
            return SendOutcome.GONE
        try:
            self._sock.send_multipart(frames, _NOBLOCK, copy=False)
        except zmq.Again:  # high-water mark reached
            outcome = SendOutcome.FULL
        except zmq.ZMQError:  # EHOSTUNREACH under ROUTER_MANDATORY
            outcome = SendOutcome.GONE
        else:
            outcome = SendOutcome.SENT
        # Sending may have consumed the edge announcing new input.
        if self._is_readable():
            self._schedule_drain()
        return outcome

    def send_nowait(self, frames: list[Any]) -> bool:
        """Send one message now; False when zmq refuses (queue full, peer gone)."""
        return self.try_send(frames) is SendOutcome.SENT

    async def send(
        self, frames: list[Any], *, give_up_s: float | None = None, retry_s: float = _SEND_RETRY_S
    ) -> bool:
        """Send, waiting (polling every ``retry_s``) while the peer's queue is full; False
        when the socket closed, the peer is unreachable, or its queue stayed full for
        ``give_up_s`` (None: wait as long as it takes)."""
        loop = self._loop
        give_up_at = None if give_up_s is None else loop.time() + give_up_s
        while True:
            outcome = self.try_send(frames)
            if outcome is SendOutcome.SENT:
                return True
            if outcome is SendOutcome.GONE or (give_up_at is not None and loop.time() >= give_up_at):
                return False
            await asyncio.sleep(retry_s)

    def close(self) -> None:
        """Stop reading and close the socket (no linger). Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        self._loop.remove_reader(self._fd)
        self._owner.close(linger=0)


def close_monitor(sock: zmq.asyncio.Socket, monitor: SocketPump) -> None:
    """Stop ``sock``'s socket monitor and close ``monitor``, the pump reading it (pyzmq's order).

    libzmq's end first, so its I/O thread sends no more events, then ours. Closed the other way
    round, an event the I/O thread sends after our end is gone blocks it on the PAIR while it holds
    the monitor's lock, and ``disable_monitor`` then waits for that lock for ever (it hung CI runs).
    """
    sock.disable_monitor()
    monitor.close()
