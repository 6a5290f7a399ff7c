"""The waiting queue every admission policy shares: a queued request, the policy interface,
lazy-deletion heaps, and FCFS.

A policy is a pure, deterministic object: it never reads a clock (``now`` is passed in), never
touches torch or sockets, and orders the *waiting* queue only. Each step the scheduler calls
:meth:`SchedulingPolicy.select` with the number of free KV-cache rows; every request fits a
row (the scheduler refuses one that never fits at submission), so the policy hands out the
rows in its priority order and nothing is skipped.

Costs: heaps with lazy deletion, O(log n) amortised per add, update, remove and selected request.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, TypeVar

_HeapItem = TypeVar("_HeapItem", bound=tuple[object, ...])


@dataclass(frozen=True)
class QueuedRequest:
    """A request waiting for admission: what the scheduler knows when it arrives. It is the
    policies' own view, apart from :class:`~treeserve.actors.scheduler.types.RequestState`, so
    that an ordering reads only what ordering may read, and ``bench/scheduling.py``'s simulator
    runs the same policies on requests that never reach a scheduler core.

    ``predicted_len`` is the proxy model's predicted output length in tokens (``None`` when no
    prediction exists; length-aware policies then assume ``max_tokens``, the longest it can
    be; ``max_tokens`` also caps any prediction: :attr:`predicted_service`). ``true_len`` is the real output length, known only offline: the SJF oracle of
    ``bench/scheduling.py`` reads it, no serving policy does.
    """

    request_id: str
    arrival_s: float
    prompt_len: int
    max_tokens: int
    predicted_len: float | None = None
    true_len: int | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if not math.isfinite(self.arrival_s):
            raise ValueError(f"arrival_s must be finite, got {self.arrival_s!r}")
        if self.prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.predicted_len is not None and not (
            math.isfinite(self.predicted_len) and self.predicted_len >= 0
        ):
            raise ValueError(f"predicted_len must be finite and >= 0, got {self.predicted_len!r}")
        if self.true_len is not None and self.true_len < 0:
            raise ValueError(f"true_len must be >= 0, got {self.true_len}")

    @property
    def predicted_service(self) -> float:
        """Predicted output tokens, at most ``max_tokens`` (a request never generates more), and
        ``max_tokens`` without a prediction."""
        if self.predicted_len is None:
            return float(self.max_tokens)
        return min(self.predicted_len, float(self.max_tokens))


class SchedulingPolicy(Protocol):
    """Orders the waiting queue; pure and deterministic, with the clock injected as ``now``.

    ``add`` queues a request (a duplicate id is a ``ValueError``); ``remove`` drops a queued
    request (cancelled while waiting) and says whether it was queued; ``update`` re-keys a
    queued request whose prediction arrived after it was queued (:meth:`QueuePolicy.update`
    states what may change) and says whether it was queued; ``select`` takes up to
    ``max_count`` requests (the free rows) off the queue in priority order at ``now``;
    ``pop_next`` is ``select`` of one; ``peek`` is the request ``pop_next`` would take, left queued.
    """

    def add(self, request: QueuedRequest, now: float) -> None: ...

    def remove(self, request_id: str) -> bool: ...

    def update(self, request: QueuedRequest) -> bool: ...

    def pop_next(self, now: float) -> QueuedRequest | None: ...
    def peek(self, now: float) -> QueuedRequest | None: ...

    def select(self, now: float, max_count: int) -> list[QueuedRequest]: ...

    def __len__(self) -> int: ...

    def __contains__(self, request_id: object) -> bool: ...


@dataclass(frozen=True, slots=True)
class Slot:
    """A queued request in a policy's heaps. ``order``: add order, the final and stable
    tie-break; ``token``: unique per placement, so heap items that carry another one are stale."""

    request: QueuedRequest
    order: int
    token: int


class QueuePolicy(ABC):
    """Shared mechanics: the live slots, lazy-deletion bookkeeping and ``select``.

    Subclasses index a slot into their heaps (``_index``) and pop the best live slot at
    ``now`` (``_pop_best``, through ``_take``).
    """

    def __init__(self) -> None:
        self._slots: dict[str, Slot] = {}
        self._num_added = 0
        self._num_placements = 0
        self._num_heap_items = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slots

    def add(self, request: QueuedRequest, now: float) -> None:
        """Queue ``request``; ``now`` is accepted for interface symmetry and ignored."""
        if request.request_id in self._slots:
            raise ValueError(f"request {request.request_id!r} is already queued")
        self._check_request(request)
        slot = Slot(request, self._num_added, self._num_placements)
        self._num_added += 1
        self._num_placements += 1
        self._slots[request.request_id] = slot
        self._num_heap_items += self._index(slot)

    def remove(self, request_id: str) -> bool:
        """Drop a queued request; ``False`` when it was not queued (already admitted)."""
        if self._slots.pop(request_id, None) is None:
            return False
        self._maybe_compact()
        return True

    def update(self, request: QueuedRequest) -> bool:
        """Re-key a queued request (its length prediction arrived after it was queued); ``False``
        when it is no longer queued (admitted or removed meanwhile: nothing to do).

        Only the prediction may change, and only downwards: ``request.predicted_service`` must
        not exceed the queued one's (a request is queued on the longest it can be, its
        ``max_tokens`` or its client's hint, until the prediction lands). So an aging deadline
        (:mod:`treeserve.actors.scheduler.policy_aging`) only ever moves earlier, and a promoted request
        stays promoted. The arrival, and with it the aging clock, and the add order (the final
        tie-break) are kept. Anything else is a ``ValueError`` naming the difference.
        """
        slot = self._slots.get(request.request_id)
        if slot is None:
            return False
        old = slot.request
        if (request.arrival_s, request.prompt_len, request.max_tokens, request.true_len) != (
                old.arrival_s, old.prompt_len, old.max_tokens, old.true_len):
            raise ValueError(f"update may change only the prediction of {request.request_id!r}: "
                             f"queued {old}, got {request}")
        if request.predicted_service > old.predicted_service:
            raise ValueError(f"update may only shorten {request.request_id!r}'s predicted service "
                             f"({old.predicted_service} -> {request.predicted_service}): deadlines never move later")
        self._check_request(request)
        # A new placement token: heap items of the old key are stale and dropped when they surface.
        slot = Slot(request, slot.order, self._num_placements)
        self._num_placements += 1
        self._slots[request.request_id] = slot
        self._num_heap_items += self._index(slot)
        self._maybe_compact()
        return True

    def pop_next(self, now: float) -> QueuedRequest | None:
        """The highest-priority request at ``now``, removed from the queue; ``None`` if empty."""
        chosen = self.select(now, 1)
        return chosen[0] if chosen else None

    def peek(self, now: float) -> QueuedRequest | None:
        """The request :meth:`pop_next` would take at ``now``, left in the queue (same slot, so
        the same place in every order); ``None`` if empty."""
        slot = self._pop_best(now)
        if slot is None:
            return None
        self._slots[slot.request.request_id] = slot
        self._num_heap_items += self._index(slot)
        return slot.request

    def select(self, now: float, max_count: int) -> list[QueuedRequest]:
        """Take up to ``max_count`` requests off the queue, best first at ``now``."""
        if max_count < 0:
            raise ValueError(f"max_count must be >= 0, got {max_count}")
        taken: list[QueuedRequest] = []
        while len(taken) < max_count and (slot := self._pop_best(now)) is not None:
            taken.append(slot.request)
        self._maybe_compact()
        return taken

    # -- hooks -------------------------------------------------------------------------
    def _check_request(self, request: QueuedRequest) -> None:
        """Reject requests this policy cannot order (raise ``ValueError``)."""

    @abstractmethod
    def _index(self, slot: Slot) -> int:
        """Push ``slot`` into the policy's heaps; return how many heap items were pushed."""

    @abstractmethod
    def _clear_index(self) -> None:
        """Empty the policy's heaps (followed by re-indexing every live slot)."""

    @abstractmethod
    def _pop_best(self, now: float) -> Slot | None:
        """Remove and return the best live slot at ``now`` (via ``_take``), or ``None``."""

    # -- helpers for subclasses --------------------------------------------------------
    def _is_live(self, request_id: str, token: int) -> bool:
        slot = self._slots.get(request_id)
        return slot is not None and slot.token == token

    def _take(self, request_id: str) -> Slot:
        return self._slots.pop(request_id)

    def _heappop(self, heap: list[_HeapItem]) -> _HeapItem:
        self._num_heap_items -= 1
        return heapq.heappop(heap)

    def _maybe_compact(self) -> None:
        # Stale heap items (removed or already-selected requests) are dropped lazily when
        # they surface; rebuild when they dominate so memory stays O(live requests).
        if self._num_heap_items > 4 * len(self._slots) + 64:
            self._clear_index()
            self._num_heap_items = sum(self._index(slot) for slot in self._slots.values())


class FCFSPolicy(QueuePolicy):
    """First come, first served by ``arrival_s`` (ties by add order)."""

    def __init__(self) -> None:
        super().__init__()
        self._by_arrival: list[tuple[float, int, int, str]] = []

    def _index(self, slot: Slot) -> int:
        item = (slot.request.arrival_s, slot.order, slot.token, slot.request.request_id)
        heapq.heappush(self._by_arrival, item)
        return 1

    def _clear_index(self) -> None:
        self._by_arrival.clear()

    def _pop_best(self, now: float) -> Slot | None:
        while self._by_arrival:
            _, _, token, request_id = self._heappop(self._by_arrival)
            if self._is_live(request_id, token):
                return self._take(request_id)
        return None


__all__ = ["FCFSPolicy", "QueuePolicy", "QueuedRequest", "SchedulingPolicy", "Slot"]
