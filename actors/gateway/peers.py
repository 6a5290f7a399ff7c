"""``ClientPeers``: which gateway clients have streams open, and when each was last heard.

The gateway must notice a client that vanished without a word (its process was killed,
its network cut): nothing else would ever cancel that client's streams and free their
KV rows. So every client with a stream open is watched (``transport/PROTOCOL.md`` 11.5):
any message from it is a sign of life, the gateway heartbeats it every interval, and a
client silent for ``disconnect_timeout_s`` is cut off. This table makes those decisions;
the gateway does the sending and cancelling. A stream cut off still ends with a final error,
``cut_off_error`` (``transport/PROTOCOL.md`` 11.5). A client's open stream is a ``Stream``; why
the gateway cancelled it, a ``CancelReason``.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from treeserve.transport.messages import Error
from treeserve.transport.wire import ErrorCode

__all__ = ["CancelReason", "ClientPeers", "PeerGone", "Stream", "cut_off_error"]


def cut_off_error(msg_id: int, *, is_silent: bool, disconnect_timeout_s: float,
                  heartbeat_interval_s: float) -> Error:
    """The final error of stream ``msg_id``, cut off because its client was silent for
    ``disconnect_timeout_s`` (``is_silent``) or could not be reached: ``cancelled``, retryable
    (the request was fine), ``details.reason`` ``"client_silent"`` or ``"client_unreachable"``."""
    if is_silent:
        text = (f"cancelled: nothing heard from this client for over {disconnect_timeout_s}s "
                f"(disconnect_timeout_s); while streams are open, send a heartbeat at least every "
                f"{heartbeat_interval_s}s")
    else:
        text = ("cancelled: a message of this stream could not be delivered (the connection to this client "
                f"dropped, or its receive queue stayed full for {disconnect_timeout_s}s); items may be missing")
    reason = "client_silent" if is_silent else "client_unreachable"
    return Error(msg_id, ErrorCode.CANCELLED, text, True,
                 {"reason": reason, "disconnect_timeout_s": disconnect_timeout_s})


@dataclass(slots=True)
class _Peer:
    last_seen: float
    beat_seq: int = 0
    msg_ids: set[int] = field(default_factory=set)


class ClientPeers:
    """Clients (ROUTER routing ids) with open streams. A client enters with its first
    stream (``opened``) and leaves with its last (``closed``) or when cut off (``pop``).
    Plain object: the caller's clock, no I/O."""

    def __init__(self) -> None:
        self._peers: dict[bytes, _Peer] = {}

    def __contains__(self, peer: bytes) -> bool:
        return peer in self._peers

    def heard_from(self, peer: bytes, now: float) -> None:
        """Any message of ``peer`` arrived at ``now`` (ignored for clients not watched)."""
        state = self._peers.get(peer)
        if state is not None:
            state.last_seen = now

    def opened(self, peer: bytes, msg_id: int, now: float) -> None:
        """``peer`` opened stream ``msg_id`` at ``now`` (a request is a sign of life)."""
        state = self._peers.setdefault(peer, _Peer(now))
        state.last_seen = now
        state.msg_ids.add(msg_id)

    def closed(self, peer: bytes, msg_id: int) -> None:
        """Stream ``msg_id`` of ``peer`` ended; a client with none left is no longer watched."""
        state = self._peers.get(peer)
        if state is not None:
            state.msg_ids.discard(msg_id)
            if not state.msg_ids:
                del self._peers[peer]

    def pop(self, peer: bytes) -> set[int] | None:
        """Stop watching ``peer``; returns the ids of its open streams (None: not watched)."""
        state = self._peers.pop(peer, None)
        return None if state is None else state.msg_ids

    def silent(self, now: float, timeout_s: float) -> list[bytes]:
        """Watched clients not heard from for more than ``timeout_s`` at ``now``."""
        return [peer for peer, state in self._peers.items() if now - state.last_seen > timeout_s]

    def next_beats(self) -> list[tuple[bytes, int]]:
        """``(peer, seq)`` of the heartbeat each watched client gets now (seq advances)."""
        beats = []
        for peer, state in self._peers.items():
            beats.append((peer, state.beat_seq))
            state.beat_seq += 1
        return beats


class CancelReason(enum.Enum):
    """Why a stream task was cancelled (decides what the client is told: nothing after its
    own cancel, ``unavailable`` at shutdown, a final ``cancelled`` error when it was cut off)."""

    CLIENT_CANCEL = "client_cancel"
    SILENT = "client_silent"  # nothing heard from the client for disconnect_timeout_s
    UNREACHABLE = "client_unreachable"  # a message to it could not be delivered
    SHUTDOWN = "shutdown"


class PeerGone(Exception):
    """The client stopped accepting messages mid-stream (the gateway ends its stream)."""


class Stream:
    """One open generate stream: its client, request id, task and items sent so far."""

    __slots__ = ("cancel_reason", "msg_id", "peer", "seq", "task")

    def __init__(self, peer: bytes, msg_id: int) -> None:
        self.peer = peer
        self.msg_id = msg_id
        self.seq = 0
        self.task: asyncio.Task[None] | None = None
        self.cancel_reason: CancelReason | None = None
