"""``InboundStats`` and ``NodeStats``: the counters a ROUTER endpoint and a node keep for
tests and monitoring."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["InboundStats", "NodeStats"]


@dataclass
class InboundStats:
    """Counters of one ROUTER endpoint (``Inbound``: a node's, or the gateway's), monotonic,
    never reset.

    ``num_bad_messages``: received messages the codec rejected; ``num_dropped``: ones
    dropped without any reply (unexpected kind, or the error reply could not be sent);
    ``num_error_replies``: requests refused with an ``error``; ``num_late_dropped``:
    requests refused or dropped because their deadline had passed before they ran;
    ``num_send_failures``: sends zmq refused (peer queue full or peer gone).
    """

    num_requests: int = 0
    num_bad_messages: int = 0
    num_dropped: int = 0
    num_error_replies: int = 0
    num_late_dropped: int = 0
    num_cancels_received: int = 0
    num_heartbeats: int = 0
    num_send_failures: int = 0


@dataclass
class NodeStats(InboundStats):
    """Counters of one node: its ROUTER's (``InboundStats``) and its outgoing calls'.

    ``num_late_replies``: answers that found no waiting call (late after a deadline or
    cancel, duplicates, and the answers to ``tell``); ``num_disconnects``: outgoing
    connections lost (their waiting calls failed). ``num_bad_messages``, ``num_dropped``,
    ``num_heartbeats`` and ``num_send_failures`` count both directions.
    """

    num_overloaded: int = 0
    num_late_replies: int = 0
    num_disconnects: int = 0
