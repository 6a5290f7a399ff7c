"""``PingJudge``: decides from ping outcomes whether a peer (node or head) is lost."""

from __future__ import annotations

import enum

__all__ = ["PingJudge", "Verdict"]


class Verdict(enum.Enum):
    """What one ping round says about the peer."""

    ALIVE = "alive"
    SUSPECT = "suspect"  # missed, but not yet enough misses in a row
    LOST = "lost"


class PingJudge:
    """Counts failed pings in a row; ``num_misses`` of them mean the peer is lost.

    A round is one sleep of ``interval_s`` plus one ping bounded by ``interval_s``, so
    it should take about ``2 * interval_s``. A failed round that took more than
    ``stall_factor * interval_s`` (by the caller's clock, passed as ``started``/``now``)
    means *our* event loop was blocked: the answer may be sitting unread, so the round
    is not held against the peer. Plain object: no clock, no I/O.
    """

    def __init__(self, interval_s: float, num_misses: int, stall_factor: float = 3.0) -> None:
        if not interval_s > 0 or num_misses < 1 or not stall_factor > 2:
            raise ValueError("PingJudge needs interval_s > 0, num_misses >= 1 and stall_factor > 2")
        self.interval_s = interval_s
        self.num_misses = num_misses
        self.stall_factor = stall_factor
        self.misses_in_a_row = 0

    def observe(self, is_answered: bool, started: float, now: float) -> Verdict:
        """Judge the round that began at ``started`` and ended at ``now`` (seconds)."""
        if is_answered:
            self.misses_in_a_row = 0
            return Verdict.ALIVE
        if now - started > self.stall_factor * self.interval_s:
            return Verdict.SUSPECT  # not counted
        self.misses_in_a_row += 1
        if self.misses_in_a_row >= self.num_misses:
            return Verdict.LOST
        return Verdict.SUSPECT
