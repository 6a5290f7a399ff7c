"""The scheduler's free KV-cache rows, and what each held last.

A request is given the lowest free row (compact rows batch without padding), unless another
free row last held a prefix of its prompt at least :data:`AFFINITY_TOKENS` longer than the
lowest one did: the verifier keeps a released row's K/V and prefills only what a prompt does
not share with them (:mod:`~treeserve.actors.verifier_rows`), so a conversation's next turn,
or a repeated prompt, that finds its old row free skips most of its prefill. What a row held is
the scheduler's guess (the request's prompt and all its tokens but the last, which no step
committed); the verifier reuses only what its own record of the row confirms.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

AFFINITY_TOKENS = 32
"""How many more prompt tokens a row other than the lowest free one must hold to be chosen:
about a 64-row step's prefill time on the default model (0.8 ms a token on 2 cores), against a
row that may leave a gap in the batched steps."""


def shared_prefix(held: Sequence[int], prompt: Sequence[int]) -> int:
    """The length of the longest common prefix of ``held`` and ``prompt``."""
    n = min(len(held), len(prompt))
    same = 0
    while same < n and held[same] == prompt[same]:
        same += 1
    return same


class FreeRows:
    """Free running rows in ascending order, with what each held when it was freed."""

    def __init__(self, rows: Iterable[int]) -> None:
        self._free = sorted(rows)
        self._held: dict[int, Sequence[int]] = {}

    def __len__(self) -> int:
        return len(self._free)

    def put(self, row: int, held: Sequence[int] = ()) -> None:
        """``row`` is free; its cache holds the K/V of ``held`` (nothing known: empty)."""
        index = bisect.bisect_left(self._free, row)
        if index < len(self._free) and self._free[index] == row:
            raise ValueError(f"row {row} is already free")
        self._free.insert(index, row)
        if held:
            self._held[row] = held
        else:
            self._held.pop(row, None)

    def take(self, prompt: Sequence[int] = ()) -> int:
        """A free row for a request with ``prompt`` (see the module docstring)."""
        lowest = self._free[0]
        best, most = lowest, shared_prefix(self._held.get(lowest, ()), prompt) if prompt else 0
        if prompt:
            floor = most + AFFINITY_TOKENS
            for row in self._free[1:]:
                held = self._held.get(row, ())
                if len(held) >= floor and (n := shared_prefix(held, prompt)) >= max(floor, most + 1):
                    best, most = row, n
        self._free.remove(best)
        self._held.pop(best, None)
        return best


__all__ = ["AFFINITY_TOKENS", "FreeRows", "shared_prefix"]
