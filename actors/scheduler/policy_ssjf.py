"""SSJF: speculative shortest job first, the order by *predicted* output length, with aging.

Order at time ``now``: first the promoted requests (past their service-scaled aging deadline),
earliest deadline first (:mod:`treeserve.actors.scheduler.policy_aging`, which states the wait bound), then
the rest by ``predicted_service`` (ties by arrival, then add order). A request without a
prediction counts as ``max_tokens`` long, the longest it can be; a prediction above
``max_tokens`` counts as ``max_tokens`` (a hard cap).
"""

from __future__ import annotations

import heapq

from treeserve.actors.scheduler.policy_aging import DEFAULT_AGING_TOKENS, AgingPolicy
from treeserve.actors.scheduler.policy_queue import Slot


class SSJFPolicy(AgingPolicy):
    """Shortest predicted output first, with aging by service-scaled deadlines (at most
    ``max_wait_s`` after arrival, reached from ``aging_tokens`` predicted tokens).

    ``_job_size`` is the length the order (and the deadline) reads; an offline bound (the SJF
    oracle of ``bench/scheduling.py``) overrides it to read the true length instead.
    """

    def __init__(self, max_wait_s: float, aging_tokens: float = DEFAULT_AGING_TOKENS) -> None:
        super().__init__(max_wait_s, aging_tokens)
        self._by_size: list[tuple[float, float, int, int, str]] = []

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
