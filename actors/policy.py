"""Admission-order policies for the continuous-batching scheduler.

A policy is a pure, deterministic object: it never reads a clock (``now`` is passed
in), never touches torch or sockets, and orders the *waiting* queue only. Each step
the scheduler calls :meth:`SchedulingPolicy.select` with a ``fits`` callback that
tries to reserve KV-cache room for a candidate; the policy walks its queue in
priority order and returns the requests it admitted.

Skipping rule (head-of-line blocking vs. starvation). A candidate for which ``fits``
returns ``False`` is *skipped* (it stays queued with its priority unchanged) so that
smaller requests behind it may use the free room, unless the candidate is
*bypass-protected*: then the walk stops and nothing behind it is admitted this step,
so the memory freed by finishing requests accumulates for it. FCFS protects every
request (strict head-of-line, textbook FCFS). SSJF, the SJF oracle and HRRN protect a
request once it has waited ``max_wait_s`` (it is then "promoted"). Skipping also stops
after ``max_skips`` unfit candidates, which keeps a step O(max_skips log n) when
memory is full. Without protection a large request could be bypassed forever by a
stream of small ones that always fit; ``tests/actors/test_policy_aging.py`` keeps a
deliberately unprotected policy that starves to show the rule matters.

Costs: FCFS, SSJF and the oracle are binary heaps with lazy deletion, O(log n)
amortised per add/remove/selected request. HRRN's order changes with time (two
ratios' order flips as both wait), so no static-key heap exists; it keeps one FCFS
heap per distinct predicted service time and compares the group heads, O(G + log n)
per selection with G distinct predicted lengths (G <= n).
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

POLICY_NAMES: tuple[str, ...] = ("fcfs", "ssjf", "sjf-oracle", "hrrn")
DEFAULT_MAX_SKIPS = 16

Fits = Callable[["QueuedRequest"], bool]
_HeapItem = TypeVar("_HeapItem", bound=tuple[object, ...])


@dataclass(frozen=True)
class QueuedRequest:
    """A request waiting for admission: what the scheduler knows when it arrives.

    ``predicted_len`` is the proxy model's predicted output length in tokens (``None``
    when no prediction exists; length-aware policies then assume ``max_tokens``, the
    longest it can be). ``true_len`` is the real output length and is read only by
    :class:`SJFOraclePolicy`, the offline comparison bound. A preempted request that is
    re-queued should keep its original ``arrival_s`` so it keeps its aging credit.
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
        """Predicted output tokens, falling back to ``max_tokens`` without a prediction."""
        if self.predicted_len is None:
            return float(self.max_tokens)
        return self.predicted_len


class SchedulingPolicy(Protocol):
    """Orders the waiting queue; pure and deterministic, with the clock injected as ``now``.

    ``add`` queues a request (a duplicate id is a ``ValueError``); ``remove`` drops a
    queued request (cancelled while waiting) and says whether it was queued;
    ``select`` admits up to ``max_count`` requests in priority order, calling ``fits``
    once per candidate (``fits`` must itself reserve the room when it returns ``True``,
    so later calls see less free memory) and applying the module's skipping rule;
    ``pop_next`` is ``select`` of one request with unlimited room.
    """

    def add(self, request: QueuedRequest, now: float) -> None: ...

    def remove(self, request_id: str) -> bool: ...

    def pop_next(self, now: float) -> QueuedRequest | None: ...

    def select(
        self, now: float, max_count: int, fits: Fits | None = None, *, max_skips: int = ...
    ) -> list[QueuedRequest]: ...

    def __len__(self) -> int: ...

    def __contains__(self, request_id: object) -> bool: ...


@dataclass(frozen=True, slots=True)
class _Slot:
    request: QueuedRequest
    order: int  # add order: the final, stable tie-break; kept when a skipped slot is re-placed
    token: int  # unique per placement; heap items carrying another token are stale


def _check_max_wait(max_wait_s: float) -> float:
    if math.isnan(max_wait_s) or max_wait_s < 0:
        raise ValueError(f"max_wait_s must be >= 0 (math.inf disables aging), got {max_wait_s!r}")
    return float(max_wait_s)


class _QueuePolicy(ABC):
    """Shared mechanics: lazy-deletion bookkeeping and the select/skip walk.

    Subclasses index a slot into their heaps (``_index``), pop the best live slot
    (``_pop_best``), and say which requests may not be bypassed.
    """

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}
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
        self._place(request, self._num_added)
        self._num_added += 1

    def remove(self, request_id: str) -> bool:
        """Drop a queued request; ``False`` when it was not queued (already admitted)."""
        if self._slots.pop(request_id, None) is None:
            return False
        self._maybe_compact()
        return True

    def pop_next(self, now: float) -> QueuedRequest | None:
        """The highest-priority request at ``now``, removed from the queue; ``None`` if empty."""
        chosen = self.select(now, 1)
        return chosen[0] if chosen else None

    def select(
        self,
        now: float,
        max_count: int,
        fits: Fits | None = None,
        *,
        max_skips: int = DEFAULT_MAX_SKIPS,
    ) -> list[QueuedRequest]:
        """Admit up to ``max_count`` requests in priority order (see the module's skipping rule).

        If ``fits`` raises, every request taken or skipped in this call is put back
        before the exception propagates (room that ``fits`` already reserved for them
        is the caller's to release).
        """
        if max_count < 0:
            raise ValueError(f"max_count must be >= 0, got {max_count}")
        if max_skips < 0:
            raise ValueError(f"max_skips must be >= 0, got {max_skips}")
        taken: list[_Slot] = []
        skipped: list[_Slot] = []
        try:
            while len(taken) < max_count:
                slot = self._pop_best(now)
                if slot is None:
                    break
                # Held in `skipped` while `fits` runs so that an exception puts it back too.
                skipped.append(slot)
                if fits is None or fits(slot.request):
                    taken.append(skipped.pop())
                    continue
                if self._is_bypass_protected(slot.request, now) or len(skipped) > max_skips:
                    # Stop: protected head-of-line, or (max_skips + 1) unfit candidates seen.
                    break
        except BaseException:
            for slot in taken:
                self._place(slot.request, slot.order)
            raise
        finally:
            for slot in skipped:
                self._place(slot.request, slot.order)
        self._maybe_compact()
        return [slot.request for slot in taken]

    # -- hooks -------------------------------------------------------------------------
    def _check_request(self, request: QueuedRequest) -> None:
        """Reject requests this policy cannot order (raise ``ValueError``)."""

    @abstractmethod
    def _index(self, slot: _Slot) -> int:
        """Push ``slot`` into the policy's heaps; return how many heap items were pushed."""

    @abstractmethod
    def _clear_index(self) -> None:
        """Empty the policy's heaps (followed by re-indexing every live slot)."""

    @abstractmethod
    def _pop_best(self, now: float) -> _Slot | None:
        """Remove and return the best live slot at ``now`` (via ``_take``), or ``None``."""

    @abstractmethod
    def _is_bypass_protected(self, request: QueuedRequest, now: float) -> bool:
        """Whether a non-fitting ``request`` must stop the walk instead of being skipped."""

    # -- helpers for subclasses --------------------------------------------------------
    def _place(self, request: QueuedRequest, order: int) -> None:
        slot = _Slot(request, order, self._num_placements)
        self._num_placements += 1
        self._slots[request.request_id] = slot
        self._num_heap_items += self._index(slot)

    def _is_live(self, request_id: str, token: int) -> bool:
        slot = self._slots.get(request_id)
        return slot is not None and slot.token == token

    def _take(self, request_id: str) -> _Slot:
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


class FCFSPolicy(_QueuePolicy):
    """First come, first served by ``arrival_s`` (ties by add order), strict head-of-line."""

    def __init__(self) -> None:
        super().__init__()
        self._by_arrival: list[tuple[float, int, int, str]] = []

    def _index(self, slot: _Slot) -> int:
        item = (slot.request.arrival_s, slot.order, slot.token, slot.request.request_id)
        heapq.heappush(self._by_arrival, item)
        return 1

    def _clear_index(self) -> None:
        self._by_arrival.clear()

    def _pop_best(self, now: float) -> _Slot | None:
        while self._by_arrival:
            _, _, token, request_id = self._heappop(self._by_arrival)
            if self._is_live(request_id, token):
                return self._take(request_id)
        return None

    def _is_bypass_protected(self, request: QueuedRequest, now: float) -> bool:
        return True


class _ShortestFirstPolicy(_QueuePolicy):
    """Shortest job first by ``_job_size`` with aging by promotion after ``max_wait_s``."""

    def __init__(self, max_wait_s: float) -> None:
        super().__init__()
        self._max_wait_s = _check_max_wait(max_wait_s)
        self._by_arrival: list[tuple[float, int, int, str]] = []
        self._by_size: list[tuple[float, float, int, int, str]] = []

    @property
    def max_wait_s(self) -> float:
        """Waiting time after which a request is promoted (``math.inf``: never)."""
        return self._max_wait_s

    @abstractmethod
    def _job_size(self, request: QueuedRequest) -> float:
        """The length the shortest-first order sorts by."""

    def is_promoted(self, request: QueuedRequest, now: float) -> bool:
        """Whether ``request`` has waited at least ``max_wait_s`` at ``now``."""
        return now - request.arrival_s >= self._max_wait_s

    def _index(self, slot: _Slot) -> int:
        request = slot.request
        heapq.heappush(
            self._by_arrival, (request.arrival_s, slot.order, slot.token, request.request_id)
        )
        size = self._job_size(request)
        heapq.heappush(
            self._by_size,
            (size, request.arrival_s, slot.order, slot.token, request.request_id),
        )
        return 2

    def _clear_index(self) -> None:
        self._by_arrival.clear()
        self._by_size.clear()

    def _pop_best(self, now: float) -> _Slot | None:
        # Promoted requests first, oldest first. The earliest live arrival decides whether
        # any request is promoted at all, so the size heap is only consulted when none is.
        arrivals = self._by_arrival
        while arrivals:
            arrival_s, _, token, request_id = arrivals[0]
            if not self._is_live(request_id, token):
                self._heappop(arrivals)
                continue
            if now - arrival_s >= self._max_wait_s:
                self._heappop(arrivals)
                return self._take(request_id)
            break
        while self._by_size:
            _, _, _, token, request_id = self._heappop(self._by_size)
            if self._is_live(request_id, token):
                return self._take(request_id)
        return None

    def _is_bypass_protected(self, request: QueuedRequest, now: float) -> bool:
        return self.is_promoted(request, now)


class SSJFPolicy(_ShortestFirstPolicy):
    """Speculative shortest job first: shortest *predicted* output first, with aging.

    Order at time ``now``: first the promoted requests (waited >= ``max_wait_s``) in
    arrival order, then the rest by ``predicted_service`` (ties by arrival, then add
    order). Unlike the SSJF paper's published code, whose aging reads the true job
    duration, aging here uses only the waiting time, known at run time.

    Aging guarantee. Assume the scheduler calls ``select`` at least every ``dt``
    seconds, admits at least one request per call whenever the best candidate fits,
    and that room for a promoted request at the head frees within ``D`` seconds
    (running requests finish; admission behind a non-fitting promoted request stops).
    A request r arriving at ``a`` is promoted at the first call with ``now - a >=
    max_wait_s``, so by ``a + max_wait_s + dt``. After that only promoted requests with
    an earlier (``arrival_s``, add order) can be selected before r; requests added
    later with a later ``arrival_s`` never can. Let ``A`` be the number of such requests
    still queued at r's promotion. When every candidate fits (``D = 0``), each call
    admits at least one of them, so r's queueing wait is at most
    ``max_wait_s + dt * (1 + A)``; in general it is at most
    ``max_wait_s + dt + (1 + A) * (D + dt)``. ``A`` is at most the number of requests
    queued when r arrived, plus requests added later with an older ``arrival_s`` (e.g.
    re-queued preempted requests). The bound involves neither r's predicted nor its true length.
    """

    def __init__(self, max_wait_s: float) -> None:
        super().__init__(max_wait_s)

    def _job_size(self, request: QueuedRequest) -> float:
        return request.predicted_service


class SJFOraclePolicy(_ShortestFirstPolicy):
    """Shortest *true* output length first: an offline comparison bound, not deployable.

    Reads ``true_len`` (required on every request). Aging is off by default
    (``max_wait_s=math.inf``, pure SJF); with a finite ``max_wait_s`` it has the same
    promotion rule and guarantee as :class:`SSJFPolicy`.
    """

    def __init__(self, max_wait_s: float = math.inf) -> None:
        super().__init__(max_wait_s)

    def _check_request(self, request: QueuedRequest) -> None:
        if request.true_len is None:
            raise ValueError(
                f"sjf-oracle needs true_len on every request; {request.request_id!r} has none"
            )

    def _job_size(self, request: QueuedRequest) -> float:
        assert request.true_len is not None  # enforced by _check_request on add
        return float(request.true_len)


def response_ratio(request: QueuedRequest, now: float) -> float:
    """HRRN's response ratio ``(wait + service) / service`` at ``now``.

    ``wait = max(0, now - arrival_s)`` and ``service = max(1, predicted_service)``
    tokens: at least one token is always generated, which also keeps the ratio finite.
    """
    service = max(1.0, request.predicted_service)
    wait = max(0.0, now - request.arrival_s)
    return (wait + service) / service


class HRRNPolicy(_QueuePolicy):
    """Highest response ratio next (as in SGLang), using the predicted service time.

    Ties in ratio go to the earlier arrival, then add order. The ratio grows without
    bound while a request waits, so ``pop_next`` never starves anyone; with ``fits``
    a request is bypass-protected once it waited ``max_wait_s`` (default ``math.inf``:
    never, so a request that does not fit can be skipped indefinitely).
    """

    def __init__(self, max_wait_s: float = math.inf) -> None:
        super().__init__()
        self._max_wait_s = _check_max_wait(max_wait_s)
        # Within one service-time group the oldest request has the highest ratio, so a
        # group is an FCFS heap and only its head competes.
        self._groups: dict[float, list[tuple[float, int, int, str]]] = {}

    def _index(self, slot: _Slot) -> int:
        request = slot.request
        service = max(1.0, request.predicted_service)
        heap = self._groups.setdefault(service, [])
        heapq.heappush(heap, (request.arrival_s, slot.order, slot.token, request.request_id))
        return 1

    def _clear_index(self) -> None:
        self._groups.clear()

    def _pop_best(self, now: float) -> _Slot | None:
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

    def _is_bypass_protected(self, request: QueuedRequest, now: float) -> bool:
        return now - request.arrival_s >= self._max_wait_s


def make_policy(name: str, **config: float) -> SchedulingPolicy:
    """Build a policy by name (``fcfs``, ``ssjf``, ``sjf-oracle``, ``hrrn``).

    The only option is ``max_wait_s`` (required for ``ssjf``, optional for
    ``sjf-oracle`` and ``hrrn``, not accepted by ``fcfs``). Unknown names, unknown
    options and missing required options raise ``ValueError`` naming the valid ones.
    """
    if name not in POLICY_NAMES:
        raise ValueError(
            f"unknown scheduling policy {name!r}; valid names: {', '.join(POLICY_NAMES)}"
        )
    allowed = () if name == "fcfs" else ("max_wait_s",)
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for policy {name!r}; "
            f"valid options: {', '.join(allowed) or 'none'}"
        )
    if name == "fcfs":
        return FCFSPolicy()
    if name == "ssjf":
        if "max_wait_s" not in config:
            raise ValueError("policy 'ssjf' needs max_wait_s (the aging bound, in seconds)")
        return SSJFPolicy(config["max_wait_s"])
    max_wait_s = config.get("max_wait_s", math.inf)
    if name == "sjf-oracle":
        return SJFOraclePolicy(max_wait_s)
    return HRRNPolicy(max_wait_s)
