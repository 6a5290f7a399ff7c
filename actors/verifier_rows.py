"""A verifier shard's cache rows: what each holds (:class:`RowTokens`), zeroing one
(:func:`zero_row`) and the shard's warm-up (:func:`warm_up`).

What each row holds, token by token: so that a prompt admitted to a row reuses the K/V of the
longest prefix it shares with what the row held before (the chat template's system prompt, a
repeated prompt, the earlier turns of a conversation).

A released row keeps its committed K/V and its length (the ``release`` of
:class:`~treeserve.actors.verifier.VerifierShard`): a pad tree that a batched step runs in that
row writes after them and is never committed, so the kept slots stay as they were until the
row's next prefill. The shard records every row's
committed tokens as it commits them (the prefill's, and each step's accepted path) and forgets
a row whose cache it zeroes or moves. The record is the shard's own: a restarted shard starts
with none, so it never trusts K/V it did not write.
"""

from __future__ import annotations

from collections.abc import Sequence

from treeserve.actors.scheduler.rows import shared_prefix
from treeserve.ops.batch_step import RowStep, prefill_rows, verify_rows
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.model import Transformer
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree


class RowTokens:
    """The committed token ids of each cache row that has a record (none: nothing reusable)."""

    def __init__(self) -> None:
        self._rows: dict[int, list[int]] = {}

    def reusable(self, row: int, prompt: Sequence[int], committed: int) -> int:
        """How many of ``prompt``'s first tokens ``row`` holds: the longest common prefix of the
        row's record and ``prompt``. 0 where the record does not match the row's ``committed``
        length (the record is then dropped: a row's record must account for every slot)."""
        held = self._rows.get(row)
        if held is None:
            return 0
        if len(held) != committed:
            del self._rows[row]
            return 0
        return shared_prefix(held, prompt)

    def set(self, row: int, tokens: Sequence[int]) -> None:
        """``row`` now holds exactly ``tokens`` (a prefill's committed prompt)."""
        self._rows[row] = [int(t) for t in tokens]

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        """``row`` committed ``tokens`` after what it held (a step's accepted path); a row without
        a record stays without one."""
        held = self._rows.get(row)
        if held is not None:
            held.extend(int(t) for t in tokens)

    def forget(self, row: int) -> None:
        """``row``'s slots are no longer what was recorded (zeroed, moved, reset)."""
        self._rows.pop(row, None)

    def move(self, src: int, dst: int) -> None:
        """``src``'s committed slots moved to ``dst``; ``src`` is empty."""
        held = self._rows.pop(src, None)
        if held is None:
            self._rows.pop(dst, None)
        else:
            self._rows[dst] = held


def zero_row(cache: KVCache, row: int) -> None:
    cache.reset_row(row)
    for tensor in (*cache.keys, *cache.values):  # (B, n_kv, capacity, hd) each
        tensor[row].zero_()


WARM_UP_TOKENS = 8
"""The prompt length :func:`warm_up` prefills (ids 1..8 of the vocabulary, modulo its size)."""


def warm_up(model: Transformer, cache: KVCache) -> None:
    """A short prefill and two decode steps on row 0 through the serving path, then the row
    zeroed, before the shard reports ready: the first request's prefill and steps would
    otherwise pay one-time costs (oneDNN's primitives, the allocator's first growth, lazy kernel
    loads; 0.3-0.4 s of the first token with the tokenizer's, measured). Zeroing leaves no trace
    of the warm-up tokens, whatever the weights make of them (a non-finite K/V would reach the
    next request through masked slots). Every tensor-parallel rank runs the same forwards, so
    their collectives pair up. Skipped for rows too short to hold it."""
    if cache.capacity < WARM_UP_TOKENS + 2:
        return
    prompt = [i % model.config.vocab_size for i in range(1, WARM_UP_TOKENS + 1)]
    try:
        prefill_rows(model, cache, [(0, prompt[:-1])])
        root = prompt[-1]
        for _ in range(2):
            (result,) = verify_rows(model, cache, [RowStep(0, TokenTree.root_only(root), SamplingParams())])
            root = result.bonus_token
        if cache.device.type == "cuda":  # a tree step: CuPy compiles the tree kernel (or loads it) now
            siblings = [root, root, (root + 1) % model.config.vocab_size]
            verify_rows(model, cache, [RowStep(0, TokenTree.from_parents([-1, 0, 0], siblings), SamplingParams())])
    finally:
        zero_row(cache, 0)


__all__ = ["WARM_UP_TOKENS", "RowTokens", "warm_up", "zero_row"]
