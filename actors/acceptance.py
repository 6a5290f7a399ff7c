"""How a generation's speculation is reported: tokens per verify step, in SpecInfer's convention.

One rule for every path that reports it (the scheduler's ``stream_end`` summary and
``treeserve generate --in-process``), so their figures compare.
"""

from __future__ import annotations

from collections.abc import Sequence


def mean_tokens_per_step(accepted_per_step: Sequence[int]) -> float:
    """SpecInfer's "tokens verified per step": the accepted draft tokens of each verify step plus
    the LLM's own token, averaged over the steps; 1.0 without speculation, 0.0 before any step."""
    steps = len(accepted_per_step)
    return (sum(accepted_per_step) + steps) / steps if steps else 0.0


__all__ = ["mean_tokens_per_step"]
