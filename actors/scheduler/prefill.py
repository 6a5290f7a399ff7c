"""Prefill chunks: the requests admitted in one step, grouped so that one prefill call's prompts
stay within a token budget."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class _HasPrompt(Protocol):
    @property
    def prompt_ids(self) -> Sequence[int]: ...


_P = TypeVar("_P", bound=_HasPrompt)


def prefill_chunks(requests: Sequence[_P], max_tokens: int) -> list[list[_P]]:
    """Consecutive runs of ``requests`` whose prompts total at most ``max_tokens`` (a longer
    prompt runs alone)."""
    chunks: list[list[_P]] = []
    total = 0
    for req in requests:
        if chunks and total + len(req.prompt_ids) <= max_tokens:
            chunks[-1].append(req)
            total += len(req.prompt_ids)
        else:
            chunks.append([req])
            total = len(req.prompt_ids)
    return chunks


__all__ = ["prefill_chunks"]
