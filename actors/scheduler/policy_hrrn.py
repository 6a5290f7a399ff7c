"""HRRN: highest response ratio next (as in SGLang), on the predicted service time.

A request's response ratio ``(wait + service) / service`` grows without bound while it waits,
so it is never passed over forever; with a finite ``max_wait_s`` it also gets a service-scaled
aging deadline as :mod:`treeserve.actors.scheduler.policy_aging` states, which bounds its wait in seconds.

HRRN's order changes with time (two ratios' order flips as both wait), so no static-key heap
exists: it keeps one FCFS heap per distinct predicted service time and compares the group
heads, O(G + log n) per selection with G distinct predicted lengths (G <= n).
"""

from __future__ import annotations

import heapq
import math

from treeserve.actors.scheduler.policy_aging import DEFAULT_AGING_TOKENS, AgingPolicy
from treeserve.actors.scheduler.policy_queue import QueuedRequest, Slot


def response_ratio(request: QueuedRequest, now: float) -> float:
    """HRRN's response ratio ``(wait + service) / service`` at ``now``.

    ``wait = max(0, now - arrival_s)`` and ``service = max(1, predicted_service)`` tokens: at
    least one token is always generated, which also keeps the ratio finite.
    """
    service = max(1.0, request.predicted_service)
    wait = max(0.0, now - request.arrival_s)
    return (wait + service) / service


class HRRNPolicy(AgingPolicy):
    """Highest response ratio first; ties in ratio go to the earlier arrival, then add order.
    ``max_wait_s`` (default ``math.inf``: no promotion) and ``aging_tokens`` set the aging deadline."""

    def __init__(self, max_wait_s: float = math.inf, aging_tokens: float = DEFAULT_AGING_TOKENS) -> None:
        super().__init__(max_wait_s, aging_tokens)
        # Within one service-time group the oldest request has the highest ratio, so a
        # group is an FCFS heap and only its head competes.
        self._groups: dict[float, list[tuple[float, int, int, str]]] = {}

    def _index_waiting(self, slot: Slot) -> int:
        request = slot.request
        heap = self._groups.setdefault(max(1.0, request.predicted_service), [])
        heapq.heappush(heap, (request.arrival_s, slot.order, slot.token, request.request_id))
        return 1

    def _clear_waiting(self) -> None:
        self._groups.clear()

    def _pop_waiting(self, now: float) -> Slot | None:
        best_key: tuple[float, float, int] | None = None
        best_heap: list[tuple[float, int, int, str]] | None = None
        empty: list[float] = []
        for service, heap in self._groups.items():
            while heap and not self._is_live(heap[0][3], heap[0][2]):
                self._heappop(heap)
            if not heap:
                empty.append(service)
                continue
            arrival_s, order, _, _ = heap[0]
            ratio = (max(0.0, now - arrival_s) + service) / service
            key = (-ratio, arrival_s, order)
            if best_key is None or key < best_key:
                best_key, best_heap = key, heap
        for service in empty:
            del self._groups[service]
        if best_heap is None:
            return None
        _, _, _, request_id = self._heappop(best_heap)
        return self._take(request_id)


__all__ = ["HRRNPolicy", "response_ratio"]
