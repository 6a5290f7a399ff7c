"""What the scheduler tells a monitor (``SchedulerObserver``): each verify step as a
``StepSample`` and each finished request's summary. The scheduler calls the observer inline in
its step loop, so an observer only records (no I/O, no awaits); an observer that raises is
logged and ignored, never a step fault."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["SchedulerObserver", "StepSample"]


@dataclass(frozen=True, slots=True)
class StepSample:
    """One verify step: ``step_s`` its wall time (proposing the trees plus verifying them, in
    seconds), ``tokens_per_row`` the tokens each verified row emitted (its accepted draft tokens
    plus the LLM's own: 1 without speculation), ``num_emitted_tokens`` the tokens streamed to
    consumers (after the stopping rule; cancelled requests get none)."""

    step_s: float
    tokens_per_row: tuple[int, ...]
    num_emitted_tokens: int


class SchedulerObserver(Protocol):
    """Receives the scheduler's measurements (see the module docstring for the rules)."""

    def on_step(self, sample: StepSample) -> None:
        """After every verify step."""

    def on_finished(self, summary: Mapping[str, Any]) -> None:
        """When a request finishes normally, with the summary its stream's last item carries
        (``finish_reason``, ``num_prompt_tokens``, ``num_generated_tokens``, ``queue_s``,
        ``ttft_s``, ``total_s``, ...; times in seconds from its arrival at the scheduler)."""
