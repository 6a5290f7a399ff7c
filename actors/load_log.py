"""The one-line load summary ``treeserve serve`` prints every few seconds, so that a person sees
the load without a scraper. ``LoadLog.line`` is pure (counters in, text out); ``log_load_every``
is the loop around it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from treeserve.actors.metrics import ServingMetrics, ServingTotals

__all__ = ["LoadLog", "log_load_every"]


@dataclass(frozen=True, slots=True)
class _Seen:
    at_s: float
    totals: ServingTotals
    num_completed: int
    num_failed: int
    num_cancelled: int
    num_restarts: int


class LoadLog:
    """Turns the metrics' totals and the scheduler's stats into one line per period, e.g.
    ``load: 2 running, 1 queued, 6/8 rows free | 41.3 tok/s, 1.84 tok/step, 22.4 steps/s,
    step 44.6 ms | last 10s: 3 done, 0 failed, 1 cancelled | restarts 0``. Rates are over the
    period since the previous line (since start for the first one). An idle server says so
    once: a period in which nothing ran, waited, ended or restarted, after another such
    period, gives no line (None)."""

    def __init__(self, start_s: float) -> None:
        self._seen = _Seen(start_s, ServingTotals(), 0, 0, 0, 0)
        self._was_idle = False

    def line(self, now_s: float, totals: ServingTotals, scheduler: Mapping[str, Any],
             num_restarts: int) -> str | None:
        before, self._seen = self._seen, _Seen(
            now_s, replace(totals), int(scheduler.get("num_completed", 0)), int(scheduler.get("num_failed", 0)),
            int(scheduler.get("num_cancelled", 0)), num_restarts)
        now = self._seen
        is_idle = (totals == before.totals and not scheduler.get("num_running") and not scheduler.get("num_queued")
                   and (now.num_completed, now.num_failed, now.num_cancelled, now.num_restarts)
                   == (before.num_completed, before.num_failed, before.num_cancelled, before.num_restarts))
        was_idle, self._was_idle = self._was_idle, is_idle
        if is_idle and was_idle:
            return None
        period_s = max(now_s - before.at_s, 1e-9)
        steps = totals.num_steps - before.totals.num_steps
        row_steps = totals.num_row_steps - before.totals.num_row_steps
        tokens_per_step = (totals.num_row_tokens - before.totals.num_row_tokens) / row_steps if row_steps else 0.0
        step_ms = 1000 * (totals.step_s - before.totals.step_s) / steps if steps else 0.0
        rows = "rows unknown"  # no scheduler stats yet (starting)
        if {"num_running", "num_queued", "num_free_rows"} <= scheduler.keys():
            running, free = int(scheduler["num_running"]), int(scheduler["num_free_rows"])
            rows = f"{running} running, {int(scheduler['num_queued'])} queued, {free}/{running + free} rows free"
        return (f"load: {rows} | "
                f"{(totals.num_emitted_tokens - before.totals.num_emitted_tokens) / period_s:.1f} tok/s, "
                f"{tokens_per_step:.2f} tok/step, {steps / period_s:.1f} steps/s, step {step_ms:.1f} ms | "
                f"last {period_s:.0f}s: {now.num_completed - before.num_completed} done, "
                f"{now.num_failed - before.num_failed} failed, {now.num_cancelled - before.num_cancelled} cancelled"
                f" | restarts {num_restarts}")


async def log_load_every(interval_s: float, metrics: ServingMetrics, emit: Callable[[str], None],
                         clock: Callable[[], float]) -> None:
    """Every ``interval_s`` seconds, ``emit`` one :class:`LoadLog` line (none while idle after
    the first idle one); runs until cancelled."""
    if not interval_s > 0:
        raise ValueError(f"the load log interval must be > 0 seconds, got {interval_s}")
    log = LoadLog(clock())
    while True:
        await asyncio.sleep(interval_s)
        scheduler = await metrics.refresh()
        line = log.line(clock(), metrics.totals, scheduler, sum(metrics.restarts().values()))
        if line is not None:
            emit(line)
