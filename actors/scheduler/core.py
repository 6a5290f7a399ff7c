"""``SchedulerCore``: the scheduler's decisions as a plain object; no sockets, no clock reads.

The core owns the requests, the verifier's KV-cache rows, the admission policy, the adaptive
tree budget and the statistics. Its caller (:class:`~treeserve.actors.scheduler.SchedulerActor`)
does the I/O between its calls. One step:

1. ``plan(now) -> StepPlan``: the requests that a stop string ended, the rows to release
   (those, and cancelled requests), the admissions grouped into prefill chunks, and the verify
   batch with each row's token-tree budget. Rows are reused in the same plan, so the caller
   releases before it prefills;
2. the caller releases, prefills (``prefilled``), asks the speculators (``proposal_asks``),
   lets the core merge their trees (``merge_proposals``, :mod:`~treeserve.actors.scheduler.proposals`)
   and verifies the batch;
3. ``apply(plan, replies, now) -> StepEvents``: the tokens to stream, the requests that
   finished or failed, and the rows that frees.

``now`` is passed in (seconds of one monotonic clock), so a test drives the core with a fake
clock. A request ends only through an event the core returns; the core never streams.

KV budget: every request owns one cache row of ``row_capacity`` slots for its whole life, and
is admitted only when ``prompt + max_tokens + max_tree_nodes`` fits a row. A request that can
never fit is refused with ``invalid_request`` at submission; others wait for a free row, so
memory never runs out mid-generation. A preempted request (:mod:`~treeserve.actors.scheduler.preemption`)
moves its cache to a park row (``num_rows`` and up, never run by a step) and back when it resumes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from treeserve.actors.acceptance import mean_tokens_per_step
from treeserve.actors.scheduler.adaptive import AdaptiveSpeculation
from treeserve.actors.scheduler.adaptive_config import AdaptiveConfig
from treeserve.actors.messages.gateway import GenerateBody
from treeserve.actors.scheduler.policy import QueuedRequest
from treeserve.actors.scheduler.proposals import proposal_asks, take_proposals, verified_tree
from treeserve.actors.scheduler.preemption import RepeatWatch, Repredictor, pick_victim
from treeserve.actors.scheduler.prefill import prefill_chunks
from treeserve.actors.scheduler.rows import FreeRows
from treeserve.actors.scheduler.types import Admission, Event, LengthReport, Move, ProposalAsk, Release, RequestFailed, RequestFinished, RequestState, RowPlan, SchedulerConfig, SchedulerFault, SchedulerStats, ServiceUnavailable, StepEvents, StepPlan, StepReplies, TokensOut
from treeserve.actors.gateway.request import InvalidRequest
from treeserve.ops.speculative import FinishReason, emit_until_done
from treeserve.ops.token_tree import TokenTree
from treeserve.runtime import ActorError
from treeserve.transport.wire import ErrorCode

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- the core
class SchedulerCore:
    """The scheduler's state and decisions (see the module docstring for a step's calls).

    ``num_speculators`` is the number of speculator actors the caller asks, in index order.
    Replies that do not fit the plan raise (:class:`~treeserve.actors.messages.MalformedReply`,
    ``ValueError``); the caller treats that as a step fault and ends every open request with
    :meth:`fail_all`.
    """

    def __init__(self, config: SchedulerConfig, num_speculators: int = 0) -> None:
        self.config = config
        self.num_speculators = num_speculators
        self.stats = SchedulerStats()
        self._policy = config.make_policy()
        self._requests: dict[str, RequestState] = {}  # open: queued or running
        self._running: dict[str, RequestState] = {}  # holding a row (parked ones too), in admission order
        self._reset_rows()  # every running row and park row free
        self._plain_step_s: float | None = None  # one plain decode step's time, last measured
        self._adaptive: AdaptiveSpeculation | None = None
        if config.adaptive_speculation and num_speculators:
            # Powers of two up to the tree cap: repeated traffic (the suffix drafter's) pays up to it.
            candidates = tuple(1 << i for i in range(config.max_tree_nodes.bit_length()))
            self._adaptive = AdaptiveSpeculation(AdaptiveConfig(candidates=candidates))
        head = config.remaining_head if config.preempt_rows else None  # re-prediction serves preemption only
        self._repredictor = None if head is None else Repredictor(head)

    @property
    def num_open(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ requests
    def submit(self, request_id: str, call: GenerateBody, now: float) -> RequestState:
        """Register the request ``call`` arriving at ``now`` (its aging starts there);
        :meth:`enqueue` queues it. Its values were checked where it entered this process
        (:meth:`GenerateBody.received`); only the scheduler's own state is checked here."""
        if request_id in self._requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        if len(self._policy) >= self.config.max_queue:
            raise ActorError(f"scheduler queue is full ({self.config.max_queue} waiting)", code=ErrorCode.OVERLOADED)
        req = self._requests[request_id] = RequestState(request_id, list(call.prompt_ids), call.params,
                                                        call.speculate, now, length_hint=call.length_hint)
        req.repeats = RepeatWatch() if self.config.preempt_rows else None
        if call.length_hint is not None:
            self.stats.num_hinted += 1
        return req

    def enqueue(self, req: RequestState, predicted_len: float | None = None) -> None:
        """Queue ``req`` for admission (a no-op if it has ended), keyed by the smaller of
        ``predicted_len`` and its client's length hint; with neither, by ``max_tokens`` until
        :meth:`set_prediction` re-keys it."""
        if not self.is_open(req):
            return
        if predicted_len is not None:
            req.predicted_len = predicted_len
        self._policy.add(self._queued(req), req.arrival_s)

    def set_prediction(self, req: RequestState, predicted_len: float) -> bool:
        """The length predictor's guess for ``req`` landed: record it (clipped to
        ``[1, max_tokens]``, for the summary and the predictor's online learning) and, if ``req``
        still waits, re-key it by the smaller of it and the hint (a key only shrinks, so its
        aging deadline only moves earlier: :mod:`treeserve.actors.scheduler.policy_aging`). True when it
        was re-keyed; False when it was already admitted or has ended."""
        if not self.is_open(req):
            return False
        req.predicted_len = min(max(predicted_len, 1.0), float(req.params.max_new_tokens))
        if req.is_parked:  # queued on its remainder, which the running re-prediction keeps
            return False
        if not self._policy.update(self._queued(req)):
            return False
        self.stats.num_rekeyed += 1
        return True

    def is_open(self, req: RequestState) -> bool:
        """Whether ``req`` is still queued or running (not ended, failed or cancelled)."""
        return self._requests.get(req.request_id) is req and not req.is_cancelled

    def is_queued(self, req: RequestState) -> bool:
        """Whether ``req`` waits for admission."""
        return self.is_open(req) and req.request_id in self._policy

    @staticmethod
    def _queued(req: RequestState) -> QueuedRequest:
        """The policy's view of ``req``: a parked request queues on what it still may write."""
        if req.is_parked or req.emitted:
            return QueuedRequest(req.request_id, req.arrival_s, len(req.prompt_ids) + len(req.emitted),
                                 max(1, req.params.max_new_tokens - len(req.emitted)),
                                 predicted_len=req.predicted_remaining)
        return QueuedRequest(req.request_id, req.arrival_s, len(req.prompt_ids), req.params.max_new_tokens,
                             predicted_len=req.expected_len)

    def cancel(self, req: RequestState) -> LengthReport | None:
        """The consumer left. A queued request is dropped now; a running one keeps its row
        until the next plan releases it. Returns the length report of a request that was still
        open and had a prediction (None otherwise; cancelling an ended request does nothing)."""
        if self._requests.get(req.request_id) is not req or req.is_cancelled:
            return None
        req.is_cancelled = True
        if self._policy.remove(req.request_id):
            del self._requests[req.request_id]
        self.stats.num_cancelled += 1
        return self._report(req, is_censored=True)

    def stop(self, request_id: str, num_tokens: int) -> bool:
        """End a running request as if its ``num_tokens``-th token had been a stop token (a stop
        string matched); the next plan finishes it. False if it is not running."""
        req = self._running.get(request_id)
        if req is None or req.is_cancelled:
            return False
        req.stop_after = num_tokens if req.stop_after is None else min(req.stop_after, num_tokens)
        return True

    # ------------------------------------------------------------------ the step
    def plan(self, now: float) -> StepPlan:
        """Reap cancelled and stopped requests, admit queued ones into the free rows (in the
        policy's order at ``now``) and size the step's token trees."""
        finished: list[RequestFinished] = []
        releases: list[Release] = []
        for req in list(self._running.values()):
            if req.is_cancelled:
                releases.append(self._release(req))
            elif req.stop_after is not None:
                del req.emitted[req.stop_after:]  # what the consumer kept: the length the predictor learns
                finished.append(self._finish(req, FinishReason.STOP, now))
                releases.append(self._release(req))
        moves = self._preempt(now) if self._free_park_rows else []
        admitted = self._admit(now, moves)
        batch = [r for r in self._running.values() if not r.is_cancelled and not r.is_parked]
        # A step where no row speculates says nothing about tree budgets: the policy neither
        # chooses for it nor learns from it (else a plain step would be costed as a tree step).
        speculating = any(r.speculates for r in batch)
        adaptive = self._adaptive if speculating else None
        budget = self.config.max_tree_nodes if adaptive is None else adaptive.tree_budget(len(batch))
        wants_states = (self.config.use_states and speculating) or bool(self._repredictor and self._repredictor.is_due)
        rows = []
        for req in batch:
            assert req.row is not None
            max_depth = req.params.max_new_tokens - len(req.emitted) - 1
            max_nodes = budget if req.speculates and max_depth >= 1 else 1
            rows.append(RowPlan(req.request_id, req.row, req.params, req.speculate, max_nodes, max_depth))
        return StepPlan(
            finished=tuple(finished),
            releases=tuple(releases),
            moves=tuple(moves),
            prefill_chunks=tuple(tuple(chunk) for chunk in prefill_chunks(admitted, self.config.max_prefill_tokens)),
            rows=tuple(rows),
            tree_budget=budget,
            is_budget_adaptive=adaptive is not None,
            wants_states=wants_states,
            decode_steps=self._decode_steps(batch, speculating and budget > 1),
        )

    def _decode_steps(self, batch: Sequence[RequestState], drafting: bool) -> int:
        """How many plain decode steps the next verifier call runs (see ``SchedulerConfig``):
        1 unless no row drafts (none speculates, or the adaptive policy chose no speculation
        for the step), every row has streamed its first token and nothing waits. A feature
        drafter's states come back from such a call too, one per token."""
        if not batch or self._plain_step_s is None or len(self._requests) > len(batch):
            return 1
        if drafting or any(not r.emitted for r in batch):
            return 1
        fits = int(self.config.decode_ahead_s / max(self._plain_step_s, 1e-6))
        remaining = min(r.params.max_new_tokens - len(r.emitted) for r in batch)
        return max(1, min(self.config.max_decode_steps, fits, remaining))

    def prefilled(self, chunk: Sequence[Admission], states: Sequence[np.ndarray | None]) -> None:
        """Record a prefill chunk's hidden states (None for rows that asked for none)."""
        if len(states) != len(chunk):
            raise ValueError(f"{len(states)} prefill states for {len(chunk)} rows")
        for admission, part in zip(chunk, states):
            if part is not None:
                self._running[admission.request_id].add_states(part)

    def proposal_asks(self, plan: StepPlan) -> tuple[ProposalAsk, ...]:
        """The ``propose`` calls of this step (see :func:`~treeserve.actors.scheduler.proposals.proposal_asks`)."""
        return proposal_asks(self._speculating(plan), plan.tree_budget, self.num_speculators)

    def merge_proposals(
        self, plan: StepPlan, asks: Sequence[ProposalAsk], replies: Sequence[Any]
    ) -> tuple[TokenTree, ...]:
        """One token tree per plan row from the speculators' ``replies`` to ``asks``: their wire
        dicts, validated here, where they enter the core (None: that speculator failed, see
        :meth:`speculator_failed`)."""
        proposed = take_proposals(self._speculating(plan), asks, replies, self.num_speculators)
        return tuple(verified_tree(self._running[row.request_id].root, proposed.get(row.request_id, []), row,
                                   self.config.max_tree_nodes) for row in plan.rows)

    def apply(self, plan: StepPlan, replies: StepReplies, now: float) -> StepEvents:
        """Take each row's accepted tokens under the stopping rule; end the rows that finished
        or failed numerically (that request alone, non-retryably)."""
        if not len(plan.rows) == len(replies.trees) == len(replies.verdicts):
            raise ValueError(f"{len(replies.trees)} trees and {len(replies.verdicts)} verdicts "
                             f"for {len(plan.rows)} rows")
        self.stats.num_steps += 1
        self.stats.propose_s += replies.propose_s
        self.stats.verify_s += replies.verify_s
        forwards = replies.num_forwards(plan.decode_steps)
        if plan.is_budget_adaptive and self._adaptive is not None:
            try:
                # A decode-ahead call (the policy chose no speculation) is observed as one
                # plain step of its forwards' mean time: what plain decoding costs here.
                self._adaptive.observe(
                    num_rows=len(plan.rows), budget=plan.tree_budget,
                    nodes_per_row=[t.num_nodes for t in replies.trees],
                    accepted_per_row=[len(v.accepted) - 1 if v.error is None else 0 for v in replies.verdicts],
                    verify_s=replies.verify_s / forwards, propose_s=replies.propose_s / forwards,
                )
            except ValueError as exc:  # a speculator overran its share: keep serving, do not learn
                log.warning("adaptive speculation ignored a step: %s", exc)
        self.stats.num_decode_steps += forwards
        if not any(r.is_speculating and r.max_nodes > 1 for r in plan.rows):
            self._plain_step_s = replies.verify_s / forwards
        if self._repredictor is not None:
            self._repredictor.stepped(forwards, plan.wants_states)
        events: list[Event] = []
        releases: list[Release] = []
        for row, verdict in zip(plan.rows, replies.verdicts):
            req = self._running[row.request_id]
            if verdict.error is None and len(verdict.new_tokens) > max(plan.decode_steps, len(verdict.accepted)):
                raise ValueError(f"row {row.row}: {len(verdict.new_tokens)} tokens from a step of "
                                 f"{plan.decode_steps} decode steps and {len(verdict.accepted)} accepted nodes")
            if verdict.error is not None:
                self.stats.num_row_failures += 1
                self.stats.num_failed += 1
                log.warning("request %s failed in its verifier row: %s", req.request_id, verdict.error)
                error = SchedulerFault(f"the verifier could not verify this request: {verdict.error}")
                events.append(RequestFailed(req.request_id, error))
                releases.append(self._release(req))
                continue
            taken, finish = emit_until_done(req.emitted, list(verdict.new_tokens), req.params)
            if req.repeats is not None:
                req.repeats.feed(req.emitted, len(taken))
            # A decode-ahead call ran one forward per token, no drafts.
            req.accepted_per_step.extend([0] * len(verdict.new_tokens) if plan.decode_steps > 1 else [len(verdict.accepted) - 1])
            req.since_propose.extend(taken)
            if verdict.states is not None and req.speculates and self.config.use_states:
                req.add_states(verdict.states)
            if verdict.states is not None and self._repredictor is not None and finish is None:
                self.stats.num_repredicted += self._repredictor.update(req, verdict.states)
            if req.first_token_s is None:
                req.first_token_s = now
            if not req.is_cancelled:
                events.append(TokensOut(req.request_id, tuple(taken)))
            if finish is not None:
                events.append(self._finish(req, finish, now))
                releases.append(self._release(req))
        return StepEvents(tuple(events), tuple(releases))

    # ------------------------------------------------------------------ faults
    def speculator_failed(self, index: int) -> None:
        """Speculator ``index`` failed a call: the running requests go on without it and send
        it their full history next time (a restarted speculator rebuilds its state)."""
        self.stats.num_speculator_failures += 1
        for req in self._running.values():
            req.needs_history.add(index)

    def verifier_failed(self, error: ActorError) -> StepEvents:
        """Every running request lost its KV row with the shards: fail them. Retryably when a
        shard died, timed out or was unreachable (a restarted one may serve the retry); not when
        it answered an error of its own (the same step would fail again)."""
        self.stats.num_verifier_failures += 1
        log.warning("verifier step failed (%s); failing %d running requests", error, len(self._running))
        message = f"the verifier failed during the request: {error.message}"
        failure: ActorError
        if error.retryable or error.code is ErrorCode.DEADLINE_EXCEEDED:
            failure = ServiceUnavailable(message, retryable=True)
        else:
            failure = SchedulerFault(message)
        events = [self._end(req, failure) for req in list(self._running.values())]
        self.stats.num_failed += len(events)
        self._reset_rows()
        return StepEvents(tuple(events))

    def fail_all(self, error: ActorError) -> StepEvents:
        """End every open request with ``error`` and start from an empty queue; the rows the
        running ones held are to be released (then every row is free)."""
        releases = tuple(Release(r.request_id, r.row, r.speculates)
                         for r in self._running.values() if r.row is not None)
        events = [self._end(req, error) for req in list(self._requests.values())]
        self.stats.num_failed += len(events)
        self._policy = self.config.make_policy()
        self._reset_rows()
        return StepEvents(tuple(events), releases)

    def snapshot(self) -> dict[str, Any]:
        """The statistics as the ``stats`` handler reports them."""
        return {
            **asdict(self.stats),
            "num_queued": len(self._policy),
            "num_running": len(self._running),
            "num_free_rows": len(self._free_rows),
            "num_parked": sum(r.is_parked for r in self._running.values()),
            "policy": self.config.policy,
            **({} if self._adaptive is None else {"adaptive": self._adaptive.snapshot()}),
        }

    # ------------------------------------------------------------------ helpers
    def _reset_rows(self) -> None:
        self._free_rows = FreeRows(range(self.config.num_rows))
        self._free_park_rows = list(range(self.config.num_rows, self.config.num_rows + self.config.preempt_rows))

    def _preempt(self, now: float) -> list[Move]:
        """Park at most one running request for the queue's head (the rules:
        :mod:`~treeserve.actors.scheduler.preemption`); its running row is then free for admission."""
        if self._free_rows or not self._free_park_rows:
            return []
        head = self._policy.peek(now)
        if head is None or self._requests[head.request_id].is_parked:
            return []
        is_promoted = getattr(self._policy, "is_promoted", lambda _request, _now: False)
        victim = pick_victim(self._running.values(), head.predicted_service, self.config.max_preemptions,
                             lambda r: bool(is_promoted(self._queued(r), now)))
        if victim is None or victim.row is None:
            return []
        self._free_park_rows.sort(reverse=True)
        move = Move(victim.request_id, victim.row, self._free_park_rows.pop())
        self._free_rows.put(victim.row)  # its cache moves to the park row
        victim.row, victim.is_parked = move.dst, True
        victim.num_preempted += 1
        self.stats.num_preempted += 1
        self._policy.add(self._queued(victim), now)
        return [move]

    def _admit(self, now: float, moves: list[Move]) -> list[Admission]:
        """Give free running rows to queued requests in the policy's order: a parked one resumes
        (a move back, appended to ``moves``), any other is prefilled."""
        admitted: list[Admission] = []
        while self._free_rows and len(self._policy):
            picked = self._policy.select(now, len(self._free_rows))
            if not picked:
                break
            for queued in picked:
                req = self._requests[queued.request_id]
                row = self._free_rows.take(() if req.is_parked else req.prompt_ids)  # rows.py: which row
                if req.is_parked:
                    assert req.row is not None
                    moves.append(Move(req.request_id, req.row, row))
                    self._free_park_rows.append(req.row)
                    req.row, req.is_parked = row, False
                    self.stats.num_resumed += 1
                    continue
                req.row = row
                req.admitted_s = now
                self._running[req.request_id] = req
                wants_states = self.config.use_states and req.speculates
                admitted.append(Admission(req.request_id, req.row, tuple(req.prompt_ids), wants_states, req.speculates))
        return admitted

    def _finish(self, req: RequestState, finish: FinishReason, now: float) -> RequestFinished:
        steps = len(req.accepted_per_step)
        summary = {
            "finish_reason": finish.value,
            "num_prompt_tokens": len(req.prompt_ids),
            "num_generated_tokens": len(req.emitted),
            "num_steps": steps,
            "mean_accepted_per_step": mean_tokens_per_step(req.accepted_per_step),
            "mean_accepted_drafts_per_step": sum(req.accepted_per_step) / steps if steps else 0.0,
            "queue_s": (req.admitted_s or now) - req.arrival_s,
            "ttft_s": (req.first_token_s or now) - req.arrival_s,
            "total_s": now - req.arrival_s,
            **({} if req.predicted_len is None else {"predicted_len": req.predicted_len}),
        }
        self.stats.num_completed += 1
        return RequestFinished(req.request_id, summary, self._report(req, is_censored=finish is FinishReason.LENGTH))

    def _release(self, req: RequestState) -> Release:
        """End ``req`` and free its row at once: the caller releases it before any later prefill."""
        assert req.row is not None, f"request {req.request_id} holds no row"
        row, req.row = req.row, None
        self._running.pop(req.request_id, None)
        self._requests.pop(req.request_id, None)
        if req.is_parked:
            self._policy.remove(req.request_id)
            self._free_park_rows.append(row)
        else:
            self._free_rows.put(row, req.prompt_ids + req.emitted[:-1])  # what the row's K/V hold
        # A speculator that must be rebuilt from the history would take these out of step.
        tail = tuple(req.since_propose) if req.speculates and not req.needs_history else ()
        return Release(req.request_id, row, req.speculates, tail)

    def _end(self, req: RequestState, error: ActorError) -> RequestFailed:
        if req.is_parked:
            self._policy.remove(req.request_id)
        self._running.pop(req.request_id, None)
        self._requests.pop(req.request_id, None)
        return RequestFailed(req.request_id, error)

    @staticmethod
    def _report(req: RequestState, *, is_censored: bool) -> LengthReport | None:
        return None if req.predicted_len is None else LengthReport(req.request_id, len(req.emitted), is_censored)

    def _speculating(self, plan: StepPlan) -> list[RequestState]:
        return [self._running[row.request_id] for row in plan.rows if row.is_speculating]


__all__ = ["RequestState", "SchedulerCore", "prefill_chunks"]
