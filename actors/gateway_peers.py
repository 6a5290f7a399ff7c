"""``ClientPeers``: which gateway clients have streams open, and when each was last heard.

The gateway must notice a client that vanished without a word (its process was killed,
its network cut): nothing else would ever cancel that client's streams and free their
KV rows. So every client with a stream open is watched (``transport/PROTOCOL.md`` 11.5):
any message from it is a sign of life, the gateway heartbeats it every interval, and a
client silent for ``disconnect_timeout_s`` is cut off. This table makes those decisions;
the gateway does the sending and cancelling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ClientPeers"]


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
