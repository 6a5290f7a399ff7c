"""``ServingMetrics``: one server's Prometheus metrics, in a registry of its own (several servers
in one process never share or collide), rendered by ``GET /metrics`` in the text format.

What feeds it:
- the scheduler, as its :class:`~treeserve.actors.scheduler.observer.SchedulerObserver`: every
  verify step (step time, tokens per row, tokens streamed) and every finished request (time
  to first token, time per output token, end-to-end latency, all measured by the scheduler
  from the request's arrival; so every front end's requests count);
- the HTTP front end: its requests by endpoint, outcome and error code, and those in flight;
- sources read at scrape time (:meth:`watch`): the scheduler's ``stats`` (queue length,
  running, free and parked rows, preemptions), the supervisors' restart counts, the ZeroMQ gateway's counters (``GatewayStats`` as a map), and
  the serving state.

``totals`` keeps the same counts as plain numbers for the one-line load log (``load_log.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from treeserve.actors.gateway.http_config import ServingState
from treeserve.actors.scheduler.observer import StepSample

__all__ = ["CONTENT_TYPE", "ServingMetrics", "ServingTotals"]

_log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text format's content type."""

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TOKENS_PER_STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64)

# The ZeroMQ gateway's counters (GatewayStats fields) as request outcomes.
_ZMQ_OUTCOMES = {"num_completed": "completed", "num_failed": "failed", "num_invalid": "invalid",
                 "num_overloaded": "overloaded", "num_cancels": "cancelled", "num_disconnects": "disconnected"}

SchedulerStatsSource = Callable[[], Awaitable[Mapping[str, Any]]]


@dataclass
class ServingTotals:
    """Monotonic totals since start (what the load log turns into rates): verify steps, their
    summed time, rows verified and the tokens they emitted, tokens streamed, finished requests."""

    num_steps: int = 0
    step_s: float = 0.0
    num_row_steps: int = 0
    num_row_tokens: int = 0
    num_emitted_tokens: int = 0
    num_finished: int = 0


class ServingMetrics:
    """The metrics of one server (see the module docstring). Recording is synchronous and
    cheap; :meth:`render` refreshes the scrape-time sources, then renders the registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.totals = ServingTotals()
        self.latest_scheduler_stats: Mapping[str, Any] = {}
        self._scheduler_stats: SchedulerStatsSource | None = None
        self._restarts: Callable[[], Mapping[str, int]] = dict
        self._zmq_stats: Callable[[], Mapping[str, Any] | None] = lambda: None
        self._state: Callable[[], ServingState] = lambda: ServingState.STARTING
        r = self.registry
        self.http_requests = Counter(
            "treeserve_http_requests", "HTTP API requests by endpoint, outcome (completed, error, cancelled) and "
            "error code (none when completed)", ["endpoint", "outcome", "code"], registry=r)
        self.http_in_flight = Gauge("treeserve_http_requests_in_flight", "HTTP generations running now", registry=r)
        self.generated_tokens = Counter("treeserve_generated_tokens", "Tokens streamed to clients", registry=r)
        self.prompt_tokens = Counter("treeserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.finished = Counter("treeserve_requests_finished", "Requests that ran to their end, by finish_reason",
                                ["finish_reason"], registry=r)
        self.tokens_per_step = Histogram(
            "treeserve_accepted_tokens_per_step", "Tokens one verify step emits for one row (accepted draft "
            "tokens plus the model's own; 1 without speculation)", buckets=_TOKENS_PER_STEP_BUCKETS, registry=r)
        self.step_seconds = Histogram("treeserve_scheduler_step_seconds", "Wall time of one scheduler step "
                                      "(proposing the token trees and verifying them)", buckets=_STEP_BUCKETS,
                                      registry=r)
        self.ttft = Histogram("treeserve_time_to_first_token_seconds", "From a request's arrival at the "
                              "scheduler to its first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("treeserve_time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", buckets=_TOKEN_TIME_BUCKETS, registry=r)
        self.e2e = Histogram("treeserve_request_latency_seconds", "From a request's arrival at the scheduler "
                             "to its last token", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("treeserve_request_queue_seconds", "Time a request waited for a row",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_LiveCollector(self))

    def watch(self, *, scheduler_stats: SchedulerStatsSource | None = None,
              restarts: Callable[[], Mapping[str, int]] | None = None,
              zmq_stats: Callable[[], Mapping[str, Any] | None] | None = None,
              state: Callable[[], ServingState] | None = None) -> None:
        """Set the sources read at scrape time (each optional; later calls replace them)."""
        if scheduler_stats is not None:
            self._scheduler_stats = scheduler_stats
        if restarts is not None:
            self._restarts = restarts
        if zmq_stats is not None:
            self._zmq_stats = zmq_stats
        if state is not None:
            self._state = state

    # ------------------------------------------------------------------ recording
    def on_step(self, sample: StepSample) -> None:
        """:class:`SchedulerObserver`: one verify step."""
        t = self.totals
        t.num_steps += 1
        t.step_s += sample.step_s
        t.num_row_steps += len(sample.tokens_per_row)
        t.num_row_tokens += sum(sample.tokens_per_row)
        t.num_emitted_tokens += sample.num_emitted_tokens
        self.step_seconds.observe(sample.step_s)
        for tokens in sample.tokens_per_row:
            self.tokens_per_step.observe(tokens)
        self.generated_tokens.inc(sample.num_emitted_tokens)

    def on_finished(self, summary: Mapping[str, Any]) -> None:
        """:class:`SchedulerObserver`: one request finished (its scheduler summary)."""
        self.totals.num_finished += 1
        self.finished.labels(finish_reason=str(summary.get("finish_reason"))).inc()
        self.prompt_tokens.inc(int(summary.get("num_prompt_tokens", 0)))
        ttft, total = float(summary.get("ttft_s", 0.0)), float(summary.get("total_s", 0.0))
        self.ttft.observe(ttft)
        self.e2e.observe(total)
        self.queue_time.observe(float(summary.get("queue_s", 0.0)))
        num_tokens = int(summary.get("num_generated_tokens", 0))
        if num_tokens > 1:
            self.tpot.observe(max(0.0, total - ttft) / (num_tokens - 1))

    def on_http_request(self, endpoint: str, outcome: str, code: str | None) -> None:
        """One HTTP request ended: ``outcome`` completed / error / cancelled, ``code`` its error code."""
        self.http_requests.labels(endpoint=endpoint, outcome=outcome, code=code or "none").inc()

    # ------------------------------------------------------------------ reading
    async def refresh(self) -> Mapping[str, Any]:
        """Ask the scheduler for its stats (kept as ``latest_scheduler_stats``); an unreachable
        scheduler (starting, restarting) leaves the last ones in place."""
        if self._scheduler_stats is not None:
            try:
                self.latest_scheduler_stats = dict(await self._scheduler_stats())
            except Exception as exc:  # noqa: BLE001 - a scrape must not fail because the scheduler restarts
                _log.debug("metrics: no scheduler stats (%s)", exc)
        return self.latest_scheduler_stats

    async def render(self) -> bytes:
        """The Prometheus text of every metric, the scrape-time sources refreshed first."""
        await self.refresh()
        return generate_latest(self.registry)

    def restarts(self) -> Mapping[str, int]:
        return dict(self._restarts())

    def state(self) -> ServingState:
        return self._state()

    def zmq_stats(self) -> Mapping[str, Any] | None:
        return self._zmq_stats()


class _LiveCollector(Collector):
    """The metrics read from their sources at scrape time."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        stats = m.latest_scheduler_stats
        for name, key, doc in (("treeserve_queue_length", "num_queued", "Requests waiting for a row"),
                               ("treeserve_running_rows", "num_running", "Requests holding a KV-cache row"),
                               ("treeserve_free_rows", "num_free_rows", "KV-cache rows free"),
                               ("treeserve_parked_requests", "num_parked", "Preempted requests waiting in a park row")):
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        for name, key, doc in (("treeserve_preemptions", "num_preempted", "Running requests preempted (moved to a "
                                "park row for a far shorter queued one)"),
                               ("treeserve_resumptions", "num_resumed", "Preempted requests moved back to run"),
                               ("treeserve_repredictions", "num_repredicted", "Running requests re-predicted from "
                                "their hidden states"),
                               ("treeserve_prefix_reused_tokens", "num_prefix_tokens_reused", "Prompt tokens whose K/V "
                                "their row held already, not prefilled again")):
            if key in stats:
                yield CounterMetricFamily(name, doc, value=float(stats[key]))
        restarts = CounterMetricFamily("treeserve_child_restarts", "Restarts of child actors, by supervisor",
                                       labels=["supervisor"])
        for supervisor, count in sorted(m.restarts().items()):
            restarts.add_metric([supervisor], float(count))
        yield restarts
        zmq = m.zmq_stats()
        if zmq is not None:
            requests = CounterMetricFamily("treeserve_zmq_requests", "ZeroMQ gateway generate streams by outcome",
                                           labels=["outcome"])
            for key, outcome in _ZMQ_OUTCOMES.items():
                if key in zmq:
                    requests.add_metric([outcome], float(zmq[key]))
            yield requests
        current = m.state()
        state = GaugeMetricFamily("treeserve_state", "1 for the serving state the server is in",
                                  labels=["state"])
        for each in ServingState:
            state.add_metric([each.value], 1.0 if each is current else 0.0)
        yield state
