"""``StallGuard``: tells a periodic liveness tick whether its own event loop was blocked.

A watcher that judges peers by how long ago it last heard from them must not judge right
after its own loop was blocked (a GC pause, a blocking call): the peers' heartbeats may be
sitting unread in a socket. The supervisor and the gateway both skip such a tick.
"""

from __future__ import annotations

__all__ = ["StallGuard"]


class StallGuard:
    """Pass :meth:`tick` the time of each tick, right after its sleep of ``period_s``: it is
    True when more than two periods passed since the previous tick (or :meth:`reset`), i.e.
    the loop was blocked, and counts those ticks in ``num_stalled``. :meth:`reset` after
    awaited work of the tick itself (a restart), which is not a blocked loop. Plain object:
    the caller's clock, no I/O."""

    def __init__(self, period_s: float, now: float) -> None:
        self.period_s = period_s
        self.num_stalled = 0
        self._last = now

    def tick(self, now: float) -> bool:
        stalled = now - self._last > 2 * self.period_s
        self._last = now
        self.num_stalled += int(stalled)
        return stalled

    def reset(self, now: float) -> None:
        self._last = now
