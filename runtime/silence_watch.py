"""``SilenceWatch``: heartbeats to one peer, and a silence deadline, while calls to it are open.

A DEALER cannot see a ROUTER that hangs, or that vanished without closing its
connection: its replies simply stop. The caller therefore heartbeats while it waits (so
the peer can tell a vanished caller, as the gateway does) and gives up once the peer has
said nothing at all, not even a heartbeat, for a timeout. The Python client watches the
gateway this way (``transport/PROTOCOL.md`` 11.5).
"""

from __future__ import annotations

import asyncio
import time

from treeserve.runtime.errors import ConnectionLost
from treeserve.runtime.outbound import Outbound
from treeserve.runtime.stall import StallGuard
from treeserve.transport.messages import Heartbeat

__all__ = ["SilenceWatch"]


class SilenceWatch:
    """Watches the calls ``outbound`` has open to ``endpoint``, one :meth:`tick` every
    ``interval_s`` (:meth:`run` loops them).

    While calls are open, a tick sends a ``heartbeat`` named ``sender``, or, once nothing
    was heard from the endpoint for more than ``timeout_s``, fails those calls with
    ``ConnectionLost`` instead. Silence counts from the later of the last message heard
    and the first tick that saw calls open (so it is at most one interval lenient), never
    from before the calls began. A tick right after this loop itself was blocked judges
    nobody: the peer's messages may be sitting unread in the socket (``StallGuard``).
    """

    def __init__(
        self,
        outbound: Outbound,
        endpoint: str,
        *,
        interval_s: float,
        timeout_s: float,
        sender: str,
        now: float,
    ) -> None:
        if not (interval_s > 0 and timeout_s > 0):
            raise ValueError("SilenceWatch needs interval_s > 0 and timeout_s > 0")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.num_lost = 0
        self._outbound = outbound
        self._endpoint = endpoint
        self._sender = sender
        self._guard = StallGuard(interval_s, now)
        self._calls_since: float | None = None  # first tick that saw the current calls
        self._seq = 0

    def tick(self, now: float) -> bool:
        """One round at loop time ``now``; True when it declared the peer lost."""
        is_stalled = self._guard.tick(now)
        if not self._outbound.has_calls_to(self._endpoint):
            self._calls_since = None
            return False
        if self._calls_since is None:
            self._calls_since = now
        heard = self._outbound.last_heard(self._endpoint)
        silent_s = now - max(self._calls_since, heard if heard is not None else self._calls_since)
        if silent_s > self.timeout_s and not is_stalled:
            self.num_lost += 1
            self._calls_since = None
            self._outbound.fail_calls_to(self._endpoint, ConnectionLost(
                f"{self._endpoint} said nothing for {silent_s:.1f}s", retryable=True))
            return True
        self._outbound.send_heartbeat(self._endpoint, Heartbeat(self._seq, time.time(), self._sender))
        self._seq += 1
        return False

    async def run(self) -> None:
        """Tick every ``interval_s`` until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval_s)
            self.tick(loop.time())
