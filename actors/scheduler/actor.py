"""The scheduler actor: continuous batching of speculative verify steps under a pluggable policy.

A request joins the running batch at any step and leaves when it finishes. The decisions
(admission order, rows, prefill chunks, tree budgets and merges, the stopping rule) are
:class:`~treeserve.actors.scheduler.core.SchedulerCore`'s; this actor does the I/O around each
step: it releases the rows of ended requests, moves a preempted request's cache to its park row
and a resumed one's back (:mod:`~treeserve.actors.scheduler.preemption`), prefills the admitted ones and starts their
speculators, asks every speculator concurrently for token trees, sends ONE batched verify step
to the :class:`~treeserve.actors.verifier_group.VerifierGroup`, and streams the results.

Faults: a speculator that fails is skipped for that step and gets the full token history on
its next proposal (a restarted one rebuilds its state). A verifier shard that dies ends every
running request with a retryable ``unavailable`` error (their KV rows are gone with it); one
that answers an error of its own (a bug) ends them with a non-retryable ``internal`` error. A
row the verifier could not verify (non-finite logits) ends that request alone, non-retryably.
Anything else that goes wrong in a step (a malformed reply, a tree that does not decode, a bug)
is logged with its traceback and fails every open request with a non-retryable ``internal``
error at once; the scheduler then resets its rows and queue and goes on serving. If even that
recovery fails, the step loop (a task owned by the actor) dies and the actor's
``LocalSupervisor`` restarts the scheduler.

Liveness: a ``generate`` stream that has nothing to send for ``keepalive_s`` (queued, or a long
step) yields an empty ``{"token_ids": []}`` item while the step loop runs, so a consumer can
bound its wait for the next item by ``step_timeout_s`` (the gateway does).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from treeserve.actors.messages.gateway import FinishBody, GenerateBody
from treeserve.actors.messages.length import LengthReport, PredictBatchBody, PredictBatchReply, PredictBody
from treeserve.actors.messages.speculator import RequestRelease, StartBody
from treeserve.actors.messages.verifier import PrefillRow, StepRow
from treeserve.actors.scheduler.core import RequestState, SchedulerCore, prefill_chunks
from treeserve.actors.scheduler.observer import SchedulerObserver, StepSample
from treeserve.actors.scheduler.types import Admission, Event, Release, RequestFinished, SchedulerConfig, SchedulerFault, ServiceUnavailable, StepPlan, StepReplies, TokensOut
from treeserve.actors.gateway.request import InvalidRequest
from treeserve.actors.verifier_group import VerifierGroup
from treeserve.ops.token_tree import TokenTree
from treeserve.runtime import Actor, ActorError, ActorRef, handler, stream_handler

log = logging.getLogger(__name__)

# Earlier names of the core's request state and prefill grouping (tests use them).
_Request = RequestState
_prefill_chunks = prefill_chunks

Outbox = asyncio.Queue[dict[str, Any] | ActorError]


class SchedulerActor(Actor):
    """Runs the step loop (an owned task) and serves ``generate`` streams and ``stats``.

    Constructed in the head process with the config, the verifier shards' refs (rank order)
    and the speculator actors' refs, and optionally a
    :class:`~treeserve.actors.length_predictor.LengthPredictorActor`: with a policy that orders
    by predicted length, each request is queued the moment it arrives, keyed by ``max_tokens``
    (or ``min(length_hint, max_tokens)`` when its client sent a hint; such a request is not
    predicted), and re-keyed by ``min(prediction, max_tokens)`` when its prediction lands
    (batched, off the admission path: a request that finds a free row never waits for it);
    every ended request that was predicted is reported to it so it can learn online.
    ``generate`` streams ``{"token_ids": [...]}`` items and a last item with ``"done": true``
    and the request's statistics; cancelling the stream removes the request and frees its KV
    row. ``clock`` is injectable for tests. ``observer`` (optional) is told every step and every
    finished request (``scheduler_observer.py``: metrics).
    """

    max_concurrency = 65536
    mailbox_size = 65536

    def __init__(
        self,
        config: SchedulerConfig,
        verifiers: Sequence[ActorRef],
        speculators: Sequence[ActorRef] = (),
        predictor: ActorRef | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        observer: SchedulerObserver | None = None,
    ) -> None:
        if not verifiers:
            raise ValueError("the scheduler needs at least one verifier shard")
        self.config = config
        self.verifiers = VerifierGroup(verifiers, timeout_s=config.step_timeout_s)
        self.speculators = list(speculators)
        self.predictor = predictor if config.uses_predictions else None
        self.clock = clock
        self.observer = observer
        self.core = SchedulerCore(config, num_speculators=len(self.speculators))
        self._outboxes: dict[str, Outbox] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[Any] | None = None
        self._ids = itertools.count()
        self._to_predict: list[RequestState] = []  # arrival order; may hold requests that ended since
        self._predict_wake = asyncio.Event()

    async def on_start(self) -> None:
        self._loop_task = self.tasks.start(self._run(), "step-loop")
        if self.predictor is not None:
            self.tasks.start(self._predict_loop(), "predict-loop")

    async def on_stop(self) -> None:
        await self.tasks.aclose(timeout_s=5.0)  # the step loop first: nothing may run after the failures below
        await self._deliver(self.core.fail_all(ServiceUnavailable("the scheduler is shutting down")).events)

    # ------------------------------------------------------------------ public handlers
    @stream_handler
    async def generate(self, body: Any) -> AsyncIterator[dict[str, Any]]:
        call = GenerateBody.received(body, vocab_size=self.config.vocab_size,
                                     context_length=self.config.row_capacity - self.config.max_tree_nodes)
        req = self.core.submit(call.request_id or f"req-{next(self._ids)}", call, now=self.clock())
        outbox: Outbox = asyncio.Queue()
        self._outboxes[req.request_id] = outbox
        try:
            # Queued at once (a free row admits it at the next plan); its prediction re-keys it later.
            self.core.enqueue(req)
            if self.predictor is not None and req.length_hint is None:
                self._to_predict.append(req)
                self._predict_wake.set()
            self._wake.set()
            while True:
                try:
                    async with asyncio.timeout(self.config.keepalive_s):
                        item = await outbox.get()
                except TimeoutError:
                    if self._loop_task is None or self._loop_task.done():
                        raise SchedulerFault("the scheduler's step loop is not running") from None
                    yield {"token_ids": []}  # keepalive: queued, or in a long step
                    continue
                if isinstance(item, ActorError):
                    raise item
                yield item
                if item.get("done"):
                    return
        finally:
            if self._outboxes.get(req.request_id) is outbox:
                del self._outboxes[req.request_id]
            report = self.core.cancel(req)  # does nothing for a request that ended
            self._wake.set()
            await self._report_length(report)

    @handler
    async def finish(self, body: Any) -> bool:
        """``{"request_id", "num_tokens"}``: end a running request as if its ``num_tokens``-th
        token had been a stop token (the gateway calls this when a stop string appears in the
        text). The request's stream ends with its final item as usual, before the next step;
        tokens streamed after that point are the caller's to drop. False if the request is
        not running (already finished, cancelled, or never admitted)."""
        try:
            call = FinishBody.from_wire(body)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if not self.core.stop(call.request_id, call.num_tokens):
            return False
        self._wake.set()
        return True

    @handler
    async def stats(self) -> dict[str, Any]:
        return {**self.core.snapshot(), "has_predictor": self.predictor is not None,
                "num_prefix_tokens_reused": self.verifiers.num_prefix_tokens_reused}

    # ------------------------------------------------------------------ length prediction
    async def _predict_loop(self) -> None:
        """Predict the lengths of new requests, one batch at a time, off the admission path.

        Requests that arrive while a batch runs make up the next one, so under a burst the
        predictor sees few large calls, not one call per request. Queued requests go first
        (their prediction decides their order); running ones only feed the summary and the
        predictor's online learning, and ended ones are dropped."""
        while True:
            await self._predict_wake.wait()
            self._predict_wake.clear()
            while batch := self._next_prediction_batch():
                await self._predict_batch(batch)

    def _next_prediction_batch(self) -> list[RequestState]:
        self._to_predict = [r for r in self._to_predict if self.core.is_open(r)]
        ordered = sorted(self._to_predict, key=lambda r: not self.core.is_queued(r))  # stable: arrival order
        batch = ordered[: self.config.max_predict_batch]
        taken = {id(r) for r in batch}
        self._to_predict = [r for r in self._to_predict if id(r) not in taken]
        return batch

    async def _predict_batch(self, batch: Sequence[RequestState]) -> None:
        """Ask the predictor for ``batch`` and re-key those still queued; on a failure they keep
        their keys (``max_tokens``) and serving goes on."""
        assert self.predictor is not None
        body = PredictBatchBody(tuple(PredictBody(r.request_id, tuple(r.prompt_ids), r.params.max_new_tokens)
                                      for r in batch))
        try:
            reply = await self.predictor.ask("predict_batch", body.to_wire(), timeout=self.config.predict_timeout_s)
            values = PredictBatchReply.from_wire(reply, len(batch)).predicted_lens
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any predictor fault degrades to "no prediction"
            self.core.stats.num_predictor_failures += len(batch)
            log.warning("length prediction of %d requests failed (%s); they stay keyed by max_tokens", len(batch), exc)
            return
        self.core.stats.num_predicted += len(batch)
        rekeyed = [self.core.set_prediction(req, value) for req, value in zip(batch, values)]
        if any(rekeyed):
            self._wake.set()

    async def _report_length(self, report: LengthReport | None) -> None:
        """Tell the predictor how long a request really ran (it drops censored lengths)."""
        if self.predictor is None or report is None:
            return
        try:
            await self.predictor.tell("observe", report.to_wire())
        except ActorError as exc:  # learning is best effort; serving goes on
            log.debug("could not report the length of %s: %s", report.request_id, exc)

    # ------------------------------------------------------------------ the step loop
    async def _run(self) -> None:
        while True:
            try:
                await self._run_once()
            except Exception as exc:  # noqa: BLE001 - nobody may wait on a step that failed
                await self._recover(exc)

    async def _run_once(self) -> None:
        plan = self.core.plan(self.clock())
        if plan.is_idle:  # nothing runs and nothing waits (plan() and clear() share no await)
            self._wake.clear()
            await self._wake.wait()
            return
        await self._deliver(plan.finished)
        if not await self._release(plan.releases):
            return
        for move in plan.moves:
            try:
                await self.verifiers.move(move.src, move.dst)
            except ActorError as exc:
                await self._deliver(self.core.verifier_failed(exc).events)  # this whole plan included
                return
        for chunk in plan.prefill_chunks:
            if not await self._prefill(chunk):
                return
        if plan.rows:
            await self._step(plan)

    async def _recover(self, exc: Exception) -> None:
        """After an unexpected step failure: fail every open request at once (non-retryable
        ``internal``), then release their rows and reset the queue, so the next request starts
        from a clean state. An exception out of here ends the loop: the supervisor restarts us."""
        self.core.stats.num_step_faults += 1
        log.error("scheduler step failed; failing %d open requests", self.core.num_open, exc_info=exc)
        error = SchedulerFault(f"internal error in the scheduler, the request was ended: {type(exc).__name__}: {exc}")
        ended = self.core.fail_all(error)
        await self._deliver(ended.events)
        await self._release(ended.releases)  # stops at a failure: the shards are gone, every row is free

    async def _prefill(self, chunk: Sequence[Admission]) -> bool:
        """Prefill one chunk of admissions and start their speculators; False if the shards failed."""
        self.core.stats.num_prefill_calls += 1
        try:
            states = await self.verifiers.prefill([PrefillRow(a.row, a.prompt_ids, a.wants_states) for a in chunk])
        except ActorError as exc:
            await self._deliver(self.core.verifier_failed(exc).events)  # this whole plan included
            return False
        self.core.prefilled(chunk, states)
        await asyncio.gather(*(self._start_speculators(a.request_id, a.prompt_ids) for a in chunk if a.speculates))
        return True

    async def _start_speculators(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        body = StartBody(request_id, tuple(prompt_ids)).to_wire()
        results = await asyncio.gather(
            *(s.ask("start", body, timeout=self.config.step_timeout_s) for s in self.speculators),
            return_exceptions=True,
        )
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                self._on_speculator_failure(index, result)

    async def _step(self, plan: StepPlan) -> None:
        started = time.perf_counter()
        trees = await self._propose(plan)
        proposed = time.perf_counter()
        rows = [StepRow(r.row, tree, r.params, r.request_id) for r, tree in zip(plan.rows, trees)]
        try:
            verdicts = await self.verifiers.step(rows, return_states=plan.wants_states, decode_steps=plan.decode_steps)
        except ActorError as exc:
            await self._deliver(self.core.verifier_failed(exc).events)
            return
        verified = time.perf_counter()
        replies = StepReplies(trees, tuple(verdicts), propose_s=proposed - started, verify_s=verified - proposed)
        ended = self.core.apply(plan, replies, self.clock())
        if self.observer is not None:
            emitted = sum(len(e.token_ids) for e in ended.events if isinstance(e, TokensOut))
            for sample in _step_samples(plan, replies, emitted):
                self._observe(self.observer.on_step, sample)
        await self._deliver(ended.events)
        await self._release(ended.releases)

    def _observe(self, call: Callable[[Any], None], what: Any) -> None:
        """Tell the observer; its faults are its own (logged), never a step's."""
        try:
            call(what)
        except Exception:  # noqa: BLE001 - monitoring must not end requests
            log.exception("the scheduler's observer failed")

    async def _propose(self, plan: StepPlan) -> tuple[TokenTree, ...]:
        """One token tree per plan row: ask the speculators concurrently, let the core merge."""
        asks = self.core.proposal_asks(plan)
        results = await asyncio.gather(
            *(self.speculators[a.speculator].ask("propose", a.body, timeout=self.config.step_timeout_s) for a in asks),
            return_exceptions=True,
        )
        replies = []
        for ask, result in zip(asks, results):
            if isinstance(result, BaseException):
                self._on_speculator_failure(ask.speculator, result)
                result = None
            replies.append(result)
        return self.core.merge_proposals(plan, asks, replies)

    # ------------------------------------------------------------------ delivery and faults
    async def _deliver(self, events: Sequence[Event]) -> None:
        """Put each event on its request's stream (a consumer that left has none); report the
        length of each finished request to the predictor."""
        for event in events:
            item: dict[str, Any] | ActorError
            if isinstance(event, TokensOut):
                item = {"token_ids": list(event.token_ids)}
            elif isinstance(event, RequestFinished):
                item = {"token_ids": [], "done": True, **event.summary}
                if self.observer is not None:
                    self._observe(self.observer.on_finished, event.summary)
            else:
                item = event.error
            outbox = self._outboxes.get(event.request_id)
            if outbox is not None:
                outbox.put_nowait(item)
        for event in events:
            if isinstance(event, RequestFinished):
                await self._report_length(event.report)

    async def _release(self, releases: Sequence[Release]) -> bool:
        """Free each row on every shard and the request on its speculators; False (and every
        running request failed) as soon as the shards fail."""
        for release in releases:
            try:
                await self.verifiers.release(release.row, release.request_id)
            except ActorError as exc:
                await self._deliver(self.core.verifier_failed(exc).events)
                return False
            if release.speculates:
                body = RequestRelease(release.request_id, release.new_tokens).to_wire()
                await asyncio.gather(
                    *(s.ask("release", body, timeout=self.config.step_timeout_s) for s in self.speculators),
                    return_exceptions=True,
                )
        return True

    def _on_speculator_failure(self, index: int, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        log.warning("speculator %d failed (%s); its requests go on without it this step", index, exc)
        self.core.speculator_failed(index)


def _step_samples(plan: StepPlan, replies: StepReplies, emitted: int) -> list[StepSample]:
    """What the observer is told of a step: one sample per forward, so a decode-ahead call of
    k steps counts as k steps of a k-th of its time, each row emitting one token in each."""
    done = [v for v in replies.verdicts if v.error is None]
    step_s = replies.propose_s + replies.verify_s
    if plan.decode_steps == 1:
        return [StepSample(step_s, tuple(len(v.accepted) for v in done), emitted)]
    forwards = replies.num_forwards(plan.decode_steps)
    return [StepSample(step_s / forwards, tuple(1 for v in done if len(v.new_tokens) > index),
                       emitted if index == 0 else 0) for index in range(forwards)]


__all__ = ["SchedulerActor", "SchedulerConfig", "SchedulerFault", "ServiceUnavailable"]
