"""Block accounting for the paged KV cache: admission checks, growth, freeing, preemption.

Pure bookkeeping (no torch): the cache holds ``num_blocks`` blocks of ``block_size``
token slots, and a running request holding ``t`` tokens of KV (prompt, generated
tokens and, during a verify step, the speculative token-tree slots) owns
``ceil(t / block_size)`` blocks. Admission reserves the prompt only; the scheduler
grows a reservation each step and, when growth fails, preempts a victim chosen by
:meth:`KVBudget.choose_preemption_victim` and re-queues it.

A request whose ``prompt_len + max_tokens`` needs more blocks than the whole cache can
never finish; :meth:`KVBudget.check_can_ever_fit` raises :class:`KVBudgetExceeded` for
it so the server rejects it at submission instead of letting it block the queue.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, replace


class KVBudgetError(Exception):
    """Base class of KV-budget errors."""


class KVBudgetExceeded(KVBudgetError, ValueError):
    """A request needs more KV blocks than the whole cache has, so it can never run."""

    def __init__(self, num_tokens: int, num_blocks_needed: int, num_blocks: int, block_size: int):
        self.num_tokens = num_tokens
        self.num_blocks_needed = num_blocks_needed
        self.num_blocks = num_blocks
        self.block_size = block_size
        super().__init__(
            f"request needs {num_tokens} KV tokens = {num_blocks_needed} blocks of "
            f"{block_size}, but the KV cache has only {num_blocks} blocks "
            f"({num_blocks * block_size} tokens); lower max_tokens or shorten the prompt"
        )


class KVBudgetUnavailable(KVBudgetError):
    """Not enough free blocks right now (``reserve`` called without a passing ``can_admit``).

    ``num_free_blocks`` is what admission may use: free blocks minus the watermark.
    """

    def __init__(self, request_id: str, num_blocks_needed: int, num_free_blocks: int):
        self.request_id = request_id
        self.num_blocks_needed = num_blocks_needed
        self.num_free_blocks = num_free_blocks
        super().__init__(
            f"cannot reserve {num_blocks_needed} KV blocks for {request_id!r}: "
            f"only {num_free_blocks} free"
        )


class PreemptionRule(enum.Enum):
    """Which running request to evict when a reservation cannot grow.

    ``MOST_REMAINING_WORK`` (default, SSJF-consistent): the request with the most
    predicted output still to generate (``max_tokens`` when unpredicted); shortest-first
    would run it last, and it would hold its blocks longest. ``LATEST_ARRIVAL`` (vLLM's
    FCFS rule): the most recently arrived request. Each rule breaks ties by the other
    criterion, then by the larger ``request_id``.
    """

    MOST_REMAINING_WORK = "most-remaining-work"
    LATEST_ARRIVAL = "latest-arrival"


@dataclass(frozen=True)
class KVReservation:
    """A running request's reservation: ``num_tokens`` of KV held in ``num_blocks`` blocks."""

    request_id: str
    prompt_len: int
    max_tokens: int
    arrival_s: float
    predicted_len: float | None
    num_tokens: int
    num_blocks: int

    @property
    def remaining_work(self) -> float:
        """Predicted output tokens still to generate (``max_tokens`` if unpredicted), >= 0."""
        generated = max(0, self.num_tokens - self.prompt_len)
        total = float(self.max_tokens) if self.predicted_len is None else self.predicted_len
        return max(0.0, total - generated)


class KVBudget:
    """Counts KV-cache blocks per running request.

    Invariant: ``num_free_blocks + sum(reservation blocks) == num_blocks``.
    ``watermark_blocks`` are kept free at admission (not at growth) so that admitting a
    request does not immediately force running requests into preemption.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        watermark_blocks: int = 0,
        preemption_rule: PreemptionRule = PreemptionRule.MOST_REMAINING_WORK,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0 <= watermark_blocks < num_blocks:
            raise ValueError(
                f"watermark_blocks must be in [0, num_blocks={num_blocks}), got {watermark_blocks}"
            )
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._watermark_blocks = watermark_blocks
        self._preemption_rule = preemption_rule
        self._num_free_blocks = num_blocks
        self._reservations: dict[str, KVReservation] = {}

    @property
    def num_blocks(self) -> int:
        """Total blocks in the cache."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any reservation."""
        return self._num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by reservations."""
        return self._num_blocks - self._num_free_blocks

    def __len__(self) -> int:
        return len(self._reservations)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reservations

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of KV."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self._block_size)

    def check_can_ever_fit(self, prompt_len: int, max_tokens: int) -> None:
        """Raise :class:`KVBudgetExceeded` if the request cannot fit even in an empty cache."""
        num_tokens = prompt_len + max_tokens
        needed = self.blocks_for(num_tokens)
        if needed > self._num_blocks:
            raise KVBudgetExceeded(num_tokens, needed, self._num_blocks, self._block_size)

    def can_admit(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether the prompt's blocks fit now, keeping ``watermark_blocks`` free.

        Raises :class:`KVBudgetExceeded` for a request that can never fit: it should have
        been rejected at submission, and answering ``False`` would let it wait (and, once
        promoted by aging, block admission) forever.
        """
        self.check_can_ever_fit(prompt_len, max_tokens)
        return self.blocks_for(prompt_len) <= self._num_free_blocks - self._watermark_blocks

    def reserve(
        self,
        request_id: str,
        prompt_len: int,
        max_tokens: int,
        *,
        arrival_s: float,
        predicted_len: float | None = None,
    ) -> KVReservation:
        """Reserve blocks for the prompt of a newly admitted request.

        Raises :class:`KVBudgetUnavailable` when :meth:`can_admit` would say ``False``
        and ``ValueError`` for a request id that already holds a reservation.
        """
        if request_id in self._reservations:
            raise ValueError(f"request {request_id!r} already holds a KV reservation")
        if not self.can_admit(prompt_len, max_tokens):
            raise KVBudgetUnavailable(
                request_id,
                self.blocks_for(prompt_len),
                self._num_free_blocks - self._watermark_blocks,
            )
        reservation = KVReservation(
            request_id=request_id,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            arrival_s=arrival_s,
            predicted_len=predicted_len,
            num_tokens=prompt_len,
            num_blocks=self.blocks_for(prompt_len),
        )
        self._reservations[request_id] = reservation
        self._num_free_blocks -= reservation.num_blocks
        return reservation

    def try_reserve(
        self,
        request_id: str,
        prompt_len: int,
        max_tokens: int,
        *,
        arrival_s: float,
        predicted_len: float | None = None,
    ) -> bool:
        """Reserve if :meth:`can_admit`; a ready-made ``fits`` callback for ``policy.select``."""
        if not self.can_admit(prompt_len, max_tokens):
            return False
        self.reserve(
            request_id, prompt_len, max_tokens, arrival_s=arrival_s, predicted_len=predicted_len
        )
        return True

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Grow a reservation to hold ``num_tokens`` tokens; ``False`` (unchanged) if no room.

        Raises :class:`KVBudgetExceeded` if ``num_tokens`` exceeds the whole cache and
        ``ValueError`` if it is below the current size (use :meth:`shrink`).
        """
        current = self.reservation(request_id)
        if num_tokens < current.num_tokens:
            raise ValueError(
                f"grow({request_id!r}, {num_tokens}) is below its current "
                f"{current.num_tokens} tokens; use shrink()"
            )
        needed = self.blocks_for(num_tokens)
        if needed > self._num_blocks:
            raise KVBudgetExceeded(num_tokens, needed, self._num_blocks, self._block_size)
        extra = needed - current.num_blocks
        if extra > self._num_free_blocks:
            return False
        self._replace(current, num_tokens, needed)
        return True

    def shrink(self, request_id: str, num_tokens: int) -> int:
        """Shrink a reservation (e.g. drop rejected token-tree slots); return blocks freed."""
        current = self.reservation(request_id)
        if not 0 <= num_tokens <= current.num_tokens:
            raise ValueError(
                f"shrink({request_id!r}, {num_tokens}) must be in [0, {current.num_tokens}]"
            )
        needed = self.blocks_for(num_tokens)
        freed = current.num_blocks - needed
        self._replace(current, num_tokens, needed)
        return freed

    def free(self, request_id: str) -> int:
        """Release a finished, cancelled or preempted request's blocks; return how many."""
        reservation = self.reservation(request_id)
        del self._reservations[request_id]
        self._num_free_blocks += reservation.num_blocks
        return reservation.num_blocks

    def reservation(self, request_id: str) -> KVReservation:
        """The current reservation of ``request_id`` (``KeyError`` if it holds none)."""
        try:
            return self._reservations[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no KV reservation") from None

    def choose_preemption_victim(self, exclude: Collection[str] = ()) -> str | None:
        """The running request to preempt under the configured :class:`PreemptionRule`.

        ``exclude`` lists requests that must not be chosen (e.g. the one that is trying
        to grow, or requests already preempted once, so no request is evicted over and
        over). ``None`` when every running request is excluded. The caller frees the
        victim and re-queues it with its original ``arrival_s`` so it keeps its aging
        credit; its KV is recomputed on re-admission.
        """
        candidates = [r for r in self._reservations.values() if r.request_id not in exclude]
        if not candidates:
            return None
        if self._preemption_rule is PreemptionRule.MOST_REMAINING_WORK:
            victim = max(candidates, key=lambda r: (r.remaining_work, r.arrival_s, r.request_id))
        else:
            victim = max(candidates, key=lambda r: (r.arrival_s, r.remaining_work, r.request_id))
        return victim.request_id

    def _replace(self, current: KVReservation, num_tokens: int, num_blocks: int) -> None:
        self._num_free_blocks -= num_blocks - current.num_blocks
        self._reservations[current.request_id] = replace(
            current, num_tokens=num_tokens, num_blocks=num_blocks
        )
        assert 0 <= self._num_free_blocks <= self._num_blocks
