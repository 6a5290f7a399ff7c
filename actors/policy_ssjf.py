"""SSJF: speculative shortest job first, the order by *predicted* output length, with aging.

Order at time ``now``: first the promoted requests (waited >= ``max_wait_s``) in arrival order
(:mod:`treeserve.actors.policy_aging`, which states the wait bound), then the rest by
``predicted_service`` (ties by arrival, then add order). A request without a prediction counts
as ``max_tokens`` long, the longest it can be.
"""

from __future__ import annotations

import heapq

from treeserve.actors.policy_aging import AgingPolicy
from treeserve.actors.policy_queue import QueuedRequest, Slot


class SSJFPolicy(AgingPolicy):
    """Shortest predicted output first, with aging by promotion after ``max_wait_s``.

    ``_job_size`` is the length the order sorts by; an offline bound (the SJF oracle of
    ``bench/scheduling.py``) overrides it to read the true length instead.
    """

    def __init__(self, max_wait_s: float) -> None:
        super().__init__(max_wait_s)
        self._by_size: list[tuple[float, float, int, int, str]] = []

    def _job_size(self, request: QueuedRequest) -> float:
        """The length the shortest-first order sorts by: the predicted service."""
        return request.predicted_service

    def _index_waiting(self, slot: Slot) -> int:
        request = slot.request
        item = (self._job_size(request), request.arrival_s, slot.order, slot.token, request.request_id)
        heapq.heappush(self._by_size, item)
        return 1

    def _clear_waiting(self) -> None:
        self._by_size.clear()

    def _pop_waiting(self, now: float) -> Slot | None:
        while self._by_size:
            _, _, _, token, request_id = self._heappop(self._by_size)
            if self._is_live(request_id, token):
                return self._take(request_id)
        return None


__all__ = ["SSJFPolicy"]
