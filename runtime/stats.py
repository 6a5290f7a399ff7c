"""``NodeStats``: the counters a node keeps for tests and monitoring."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NodeStats"]


@dataclass
class NodeStats:
    """Counters of one node (monotonic, never reset).

    ``num_bad_messages``: received messages the codec rejected; ``num_dropped``: ones
    dropped without any reply (unexpected kind, or the error reply could not be sent);
    ``num_late_replies``: answers that found no waiting call (late after a deadline or
    cancel, duplicates, and the answers to ``tell``); ``num_late_dropped``: requests
    refused or dropped because their deadline had passed before they ran;
    ``num_disconnects``: outgoing connections lost (their waiting calls failed).
    """

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
    num_disconnects: int = 0
