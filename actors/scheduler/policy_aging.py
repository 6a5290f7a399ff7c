"""Aging by service-scaled deadlines: every queued request gets an aging deadline, and a request
whose deadline has passed (a *promoted* request) goes first, earliest deadline first, ahead of
whatever order the policy keeps for the rest.

A request ``r`` arriving at ``a_r`` whose job size (predicted output tokens, at most its
``max_tokens``; at least 1) is ``S_r`` gets the deadline::

    d_r = a_r + max_wait_s * min(1, S_r / aging_tokens)

so ``max_wait_s`` is the latest any deadline falls after its request's arrival (it is reached by
jobs of ``aging_tokens`` tokens or more), and a short job's deadline comes proportionally sooner.
``aging_tokens = 1`` gives every request ``a_r + max_wait_s``: plain promotion after a fixed wait
in arrival order, the rule this replaces. Why scale: with one fixed wait, a server whose queue
takes longer than ``max_wait_s`` to drain promotes every waiting request, and the order becomes
FCFS again (measured: a 40-request burst that takes 120 s to drain, with a 30 s bound, gained 1%
over FCFS instead of 19%). With scaled deadlines the promoted requests are ordered by
``a + (max_wait_s / aging_tokens) * S``, which is still shortest-first within any window of
``max_wait_s`` of arrivals, however busy the server is. Deadlines read only what is known at
run time (unlike the SSJF paper's published code, whose aging reads the true job duration).

The aging guarantee. Assume the scheduler calls ``select`` at least every ``dt`` seconds, with at
least one free row whenever a promoted request is at the head within ``D`` seconds (running
requests finish and free their rows).

* ``r`` is promoted at the first call with ``now >= d_r``, so by ``d_r + dt <= a_r + max_wait_s + dt``.
* After that only promoted requests with an earlier (deadline, arrival, add order) key can be
  selected before ``r``. A request arriving after ``d_r`` has a later deadline, so it never
  can: **no request arriving more than max_wait_s after r is ever admitted before r.**
* Let ``A_r`` be the number of requests with an earlier key still queued at r's promotion; they
  all arrived before ``d_r``, so ``A_r`` is at most the requests queued when ``r`` arrived plus
  those that arrived in ``(a_r, a_r + max_wait_s]``. When a row is free at every call
  (``D = 0``) each call admits at least one of them, so r's queueing wait is at most
  ``(d_r - a_r) + dt * (1 + A_r)``; in general it is at most
  ``(d_r - a_r) + dt + (1 + A_r) * (D + dt)``, with ``d_r - a_r <= max_wait_s``.

The bound involves neither r's predicted nor its true length beyond the deadline's scale, and
``max_tokens`` caps the predicted length, so no prediction can push a deadline past
``max_wait_s``.

Predictions that land after queueing. The scheduler queues a request at once on its longest
possible size (``max_tokens``, or its client's length hint) and re-keys it (``update``) when
the predictor answers, ``L`` seconds later. ``update`` only lets the size shrink, so r's
deadline moves from ``a_r + max_wait_s * min(1, S_prior / aging_tokens)`` to the earlier
``d_r``, never later: a promoted request stays promoted, every deadline in force stays at most
``a_r + max_wait_s``, and r is promoted by ``min(a_r + max_wait_s, max(d_r, a_r + L)) + dt``.
The argument above holds with that promotion time in place of ``d_r + dt``; in particular r still
waits at most ``max_wait_s + dt * (1 + A_r)`` with a row free at every call, and still no request
arriving more than ``max_wait_s`` after r is admitted before it (its deadline in force is past
its arrival, which is past every deadline r ever had). ``tests/actors/scheduler/test_policy_aging.py`` checks the bound under an endless stream
of short requests, and that orders which let a promoted request be passed over (no promotion,
or unpromoted requests consulted first) starve the long one.
"""

from __future__ import annotations

import heapq
import math
from abc import abstractmethod

from treeserve.actors.scheduler.policy_queue import QueuedRequest, QueuePolicy, Slot

DEFAULT_AGING_TOKENS = 512.0
"""Job size (tokens) from which a request's aging deadline is the full ``max_wait_s``. Chat answers
of this model run to 512 tokens and beyond (``bench/RESULTS.md``): below this scale every
predicted length keeps a deadline of its own, so promoted requests stay in predicted order; 256
tied every job predicted at 256 tokens or more once promoted (then arrival order)."""


def check_max_wait(max_wait_s: float) -> float:
    """``max_wait_s`` as a float; ``ValueError`` unless it is >= 0 (``math.inf``: no aging)."""
    if math.isnan(max_wait_s) or max_wait_s < 0:
        raise ValueError(f"max_wait_s must be >= 0 (math.inf disables aging), got {max_wait_s!r}")
    return float(max_wait_s)


def check_aging_tokens(aging_tokens: float) -> float:
    """``aging_tokens`` as a float; ``ValueError`` unless it is finite and >= 1."""
    if not (math.isfinite(aging_tokens) and aging_tokens >= 1):
        raise ValueError(f"aging_tokens must be finite and >= 1 (1: a fixed wait for every request), "
                         f"got {aging_tokens!r}")
    return float(aging_tokens)


class AgingPolicy(QueuePolicy):
    """A queue whose promoted requests (past their aging deadline) come first, earliest
    deadline first; see the module docstring for the deadline and the wait bound.

    Subclasses keep the order of the rest: ``_index_waiting``, ``_clear_waiting`` and
    ``_pop_waiting`` mirror :class:`~treeserve.actors.scheduler.policy_queue.QueuePolicy`'s hooks;
    ``_job_size`` is the length both the order and the deadline read.
    """

    def __init__(self, max_wait_s: float, aging_tokens: float = DEFAULT_AGING_TOKENS) -> None:
        super().__init__()
        self._max_wait_s = check_max_wait(max_wait_s)
        self._aging_tokens = check_aging_tokens(aging_tokens)
        self._by_deadline: list[tuple[float, float, int, int, str]] = []  # empty without aging

    @property
    def max_wait_s(self) -> float:
        """The latest an aging deadline falls after its request's arrival (``math.inf``: no aging)."""
        return self._max_wait_s

    @property
    def aging_tokens(self) -> float:
        """Job size from which the deadline is the full ``max_wait_s`` (smaller jobs: proportionally sooner)."""
        return self._aging_tokens

    def _job_size(self, request: QueuedRequest) -> float:
        """The length the order and the deadline read: the predicted service (capped by ``max_tokens``)."""
        return request.predicted_service

    def deadline(self, request: QueuedRequest) -> float:
        """When ``request`` is promoted: ``arrival + max_wait_s * min(1, size / aging_tokens)``."""
        size = max(1.0, self._job_size(request))
        return request.arrival_s + self._max_wait_s * min(1.0, size / self._aging_tokens)

    def is_promoted(self, request: QueuedRequest, now: float) -> bool:
        """Whether ``request``'s aging deadline has passed at ``now``."""
        return now >= self.deadline(request)

    def _index(self, slot: Slot) -> int:
        pushed = self._index_waiting(slot)
        if math.isinf(self._max_wait_s):
            return pushed
        request = slot.request
        item = (self.deadline(request), request.arrival_s, slot.order, slot.token, request.request_id)
        heapq.heappush(self._by_deadline, item)
        return pushed + 1

    def _clear_index(self) -> None:
        self._by_deadline.clear()
        self._clear_waiting()

    def _pop_best(self, now: float) -> Slot | None:
        # The earliest live deadline decides whether any request is promoted at all, so the
        # subclass's order is consulted only when none is.
        deadlines = self._by_deadline
        while deadlines:
            deadline, _, _, token, request_id = deadlines[0]
            if not self._is_live(request_id, token):
                self._heappop(deadlines)
                continue
            if now >= deadline:
                self._heappop(deadlines)
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


__all__ = ["DEFAULT_AGING_TOKENS", "AgingPolicy", "check_aging_tokens", "check_max_wait"]
