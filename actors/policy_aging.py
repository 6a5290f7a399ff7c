"""Aging: a request that has waited ``max_wait_s`` is promoted, and promoted requests go first,
oldest first, ahead of whatever order the policy keeps for the rest.

Length-aware orders (SSJF, HRRN) can pass over a long request for as long as shorter ones keep
arriving; promotion bounds that wait by the waiting time alone, known at run time (unlike the
SSJF paper's published code, whose aging reads the true job duration).

Aging guarantee. Assume the scheduler calls ``select`` at least every ``dt`` seconds, with at
least one free row whenever a promoted request is at the head within ``D`` seconds (running
requests finish and free their rows). A request r arriving at ``a`` is promoted at the first
call with ``now - a >= max_wait_s``, so by ``a + max_wait_s + dt``. After that only promoted
requests with an earlier (``arrival_s``, add order) can be selected before r; requests added
later with a later ``arrival_s`` never can. Let ``A`` be the number of such requests still
queued at r's promotion. When a row is free at every call (``D = 0``), each call admits at
least one of them, so r's queueing wait is at most ``max_wait_s + dt * (1 + A)``; in general
it is at most ``max_wait_s + dt + (1 + A) * (D + dt)``. ``A`` is at most the number of requests
queued when r arrived, plus requests added later with an older ``arrival_s``. The bound
involves neither r's predicted nor its true length. ``tests/actors/test_policy_aging.py``
checks it under an endless stream of short requests, and that an order without promotion
starves the long one.
"""

from __future__ import annotations

import heapq
import math
from abc import abstractmethod

from treeserve.actors.policy_queue import QueuedRequest, QueuePolicy, Slot


def check_max_wait(max_wait_s: float) -> float:
    """``max_wait_s`` as a float; ``ValueError`` unless it is >= 0 (``math.inf``: no aging)."""
    if math.isnan(max_wait_s) or max_wait_s < 0:
        raise ValueError(f"max_wait_s must be >= 0 (math.inf disables aging), got {max_wait_s!r}")
    return float(max_wait_s)


class AgingPolicy(QueuePolicy):
    """A queue whose promoted requests (waited >= ``max_wait_s``) come first in arrival order.

    Subclasses keep the order of the rest: ``_index_waiting``, ``_clear_waiting`` and
    ``_pop_waiting`` mirror :class:`~treeserve.actors.policy_queue.QueuePolicy`'s hooks.
    """

    def __init__(self, max_wait_s: float) -> None:
        super().__init__()
        self._max_wait_s = check_max_wait(max_wait_s)
        self._by_arrival: list[tuple[float, int, int, str]] = []  # empty without aging

    @property
    def max_wait_s(self) -> float:
        """Waiting time after which a request is promoted (``math.inf``: never)."""
        return self._max_wait_s

    def is_promoted(self, request: QueuedRequest, now: float) -> bool:
        """Whether ``request`` has waited at least ``max_wait_s`` at ``now``."""
        return now - request.arrival_s >= self._max_wait_s

    def _index(self, slot: Slot) -> int:
        pushed = self._index_waiting(slot)
        if math.isinf(self._max_wait_s):
            return pushed
        request = slot.request
        heapq.heappush(self._by_arrival, (request.arrival_s, slot.order, slot.token, request.request_id))
        return pushed + 1

    def _clear_index(self) -> None:
        self._by_arrival.clear()
        self._clear_waiting()

    def _pop_best(self, now: float) -> Slot | None:
        # The earliest live arrival decides whether any request is promoted at all, so the
        # subclass's order is consulted only when none is.
        arrivals = self._by_arrival
        while arrivals:
            _, _, token, request_id = arrivals[0]
            if not self._is_live(request_id, token):
                self._heappop(arrivals)
                continue
            if self.is_promoted(self._slots[request_id].request, now):
                self._heappop(arrivals)
                return self._take(request_id)
            break
        return self._pop_waiting(now)

    @abstractmethod
    def _index_waiting(self, slot: Slot) -> int:
        """Push ``slot`` into the subclass's heaps; return how many heap items were pushed."""

    @abstractmethod
    def _clear_waiting(self) -> None:
        """Empty the subclass's heaps."""

    @abstractmethod
    def _pop_waiting(self, now: float) -> Slot | None:
        """Remove and return the best live slot by the subclass's order (via ``_take``)."""


__all__ = ["AgingPolicy", "check_max_wait"]
