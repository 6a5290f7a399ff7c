"""The scheduler actor: continuous batching of speculative verify steps under a pluggable policy.

A request joins the running batch at any step and leaves when it finishes. Each step the
scheduler:

1. admits queued requests in the policy's order (``fcfs``, ``ssjf`` with aging, ...) into free
   KV-cache rows of the verifier shards, prefilling their prompts;
2. asks every speculator actor, concurrently, for one token tree per running request;
3. merges the trees per request (``merge_trees``) and trims them to the tokens still allowed;
4. sends ONE batched verify step to every verifier shard (all ranks get the same call, in the
   same order, as tensor parallelism requires) and takes rank 0's reply;
5. applies the accepted tokens and streams them to the request's consumer.

KV budget: every request owns one cache row of ``row_capacity`` slots for its whole life, and
is admitted only when ``prompt + max_tokens + max_tree_nodes`` fits a row. A request that can
never fit is rejected with ``invalid_request`` at submission; others wait for a free row.
Memory therefore never runs out mid-generation, so nothing is preempted.

Faults: a speculator that fails is skipped for that step (its requests go on with the other
speculators, or without speculation) and gets the full token history on its next proposal so
a restarted speculator can rebuild its state. A verifier shard that dies ends every running
request with a retryable ``unavailable`` error (their KV rows are gone with the shard) — no
consumer ever hangs; the supervisor restarts the shards and new requests are served again. A
shard that answers with an error of its own (a bug, not a death) ends them with a
non-retryable ``internal`` error: the same step would fail again. A row the verifier could not
verify (non-finite logits: a numerical failure of that request alone) ends that request with a
non-retryable ``internal`` error; the other rows of the step go on.

Anything else that goes wrong in a step (a malformed or mismatched reply from a speculator or
a verifier, a tree that does not decode, a bug) is logged with its traceback and fails every
open request with a non-retryable ``internal`` error at once; the scheduler then resets its
rows and queue and goes on serving new requests. If even that recovery fails, the step loop
(a task owned by the actor) dies and the actor's ``LocalSupervisor`` restarts the scheduler.

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
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from treeserve.actors.adaptive import AdaptiveConfig, AdaptiveSpeculation
from treeserve.actors.gateway_request import sampling_temperature
from treeserve.actors.policy import QueuedRequest, SchedulingPolicy, make_policy
from treeserve.actors.tree_wire import params_from_wire, params_to_wire, split_states, tree_from_wire, tree_to_wire
from treeserve.ops.drafting import split_node_budget
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import FinishReason, emit_until_done
from treeserve.ops.token_tree import TokenTree, merge_trees
from treeserve.runtime import Actor, ActorError, ActorRef, handler, stream_handler
from treeserve.transport.wire import ErrorCode

log = logging.getLogger(__name__)

SPECULATE_MODES = ("tree", "chain", "none")
PREDICTION_POLICIES = ("ssjf", "hrrn")


class InvalidRequest(ActorError):
    """A generate request the scheduler refuses (bad field, never fits the KV cache)."""

    default_code = ErrorCode.INVALID_REQUEST


class ServiceUnavailable(ActorError):
    """The verifier failed while the request ran; retrying the request may succeed."""

    default_code = ErrorCode.UNAVAILABLE


class SchedulerFault(ActorError):
    """A request ended by a fault that retrying would meet again: a bug or a malformed reply
    in the scheduler's step, or a numerical failure in the request's own row."""

    default_code = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class MalformedReply(RuntimeError):
    """A speculator or verifier answered something the scheduler cannot use (wrong rows,
    missing fields): a bug on one side, handled like any unexpected step failure."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler knobs. ``num_rows``/``row_capacity`` must match the verifier shards' cache;
    ``max_tree_nodes`` caps a merged token tree (root included); ``max_wait_s`` is the aging
    bound of ``ssjf``/``hrrn``/``sjf-oracle``; ``step_timeout_s`` bounds each call to a shard;
    ``predict_timeout_s`` bounds the length prediction of one request (on timeout the request
    is queued without one, as if it would run to ``max_tokens``). ``adaptive_speculation``
    sizes each step's trees (nodes per row, at most ``max_tree_nodes``) from measured acceptance
    and step cost at the current batch size (:mod:`treeserve.actors.adaptive`); without it every
    step drafts ``max_tree_nodes``. ``use_states``: a speculator drafts from the LLM's hidden
    states (a ``feature`` drafter): the verifier returns them and they travel with proposals.
    ``max_prefill_tokens`` bounds the prompt tokens of one prefill call: requests admitted
    together share calls (and batched forwards) up to it, a longer prompt goes alone."""

    num_rows: int = 8
    row_capacity: int = 2048
    vocab_size: int = 49152
    policy: str = "fcfs"
    max_wait_s: float = 30.0
    max_tree_nodes: int = 64
    max_queue: int = 4096
    step_timeout_s: float = 300.0
    predict_timeout_s: float = 10.0
    adaptive_speculation: bool = True
    use_states: bool = False
    max_prefill_tokens: int = 8192

    def __post_init__(self) -> None:
        for name in ("num_rows", "row_capacity", "vocab_size", "max_tree_nodes", "max_queue", "max_prefill_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 1, got {value!r}")
        if not self.max_wait_s > 0:
            raise ValueError(f"SchedulerConfig.max_wait_s must be > 0, got {self.max_wait_s}")
        for name in ("step_timeout_s", "predict_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SchedulerConfig.{name} must be > 0, got {getattr(self, name)}")
        make_policy(self.policy, **self._policy_options())  # validates the name early

    def _policy_options(self) -> dict[str, Any]:
        return {} if self.policy == "fcfs" else {"max_wait_s": self.max_wait_s}

    def make_policy(self) -> SchedulingPolicy:
        """A fresh policy object of the configured kind."""
        return make_policy(self.policy, **self._policy_options())

    @property
    def keepalive_s(self) -> float:
        """How long a ``generate`` stream stays silent before it yields an empty keepalive item
        (a quarter of ``step_timeout_s``, the bound a consumer may put on its wait)."""
        return self.step_timeout_s / 4

    @property
    def uses_predictions(self) -> bool:
        """Whether the policy orders by predicted output length (``ssjf``, ``hrrn``)."""
        return self.policy in PREDICTION_POLICIES


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculate: str
    arrival_s: float
    outbox: asyncio.Queue[dict[str, Any] | ActorError] = field(default_factory=asyncio.Queue)
    row: int | None = None
    emitted: list[int] = field(default_factory=list)
    since_propose: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    needs_history: set[int] = field(default_factory=set)
    states_pending: list[Any] = field(default_factory=list)  # LLM states not yet sent to speculators
    states_all: list[Any] = field(default_factory=list)  # every state so far (to rebuild a speculator)
    predicted_len: float | None = None
    admitted_s: float | None = None
    first_token_s: float | None = None
    is_cancelled: bool = False
    is_done: bool = False
    stop_after: int | None = None  # a consumer's stop string ended the output after this many tokens

    @property
    def root(self) -> int:
        """The last token so far: the root of the next token tree."""
        return self.emitted[-1] if self.emitted else self.prompt_ids[-1]


def _prefill_chunks(requests: list[_Request], max_tokens: int) -> list[list[_Request]]:
    """Consecutive runs of ``requests`` whose prompts total at most ``max_tokens`` (a longer
    prompt runs alone)."""
    chunks: list[list[_Request]] = []
    total = 0
    for req in requests:
        if chunks and total + len(req.prompt_ids) <= max_tokens:
            chunks[-1].append(req)
            total += len(req.prompt_ids)
        else:
            chunks.append([req])
            total = len(req.prompt_ids)
    return chunks


def _require(entry: Any, keys: Sequence[str], method: str) -> None:
    missing = [k for k in keys if k not in entry]
    if missing:
        raise MalformedReply(f"verifier {method} reply row {entry.get('row')!r} lacks {missing}")


def _reply_rows(reply: Any, rows: Sequence[int | None], method: str) -> list[dict[str, Any]]:
    """The verifier's per-row answers to ``method``, checked to name exactly ``rows`` in order."""
    entries = reply.get("rows") if isinstance(reply, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise MalformedReply(f"verifier {method} reply has no list of row maps 'rows'")
    answered = [e.get("row") for e in entries]
    if answered != list(rows):
        raise MalformedReply(f"verifier answered {method} for rows {answered}, asked for rows {list(rows)}")
    return entries


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequest(f"{what} must be a list of integers")
    return list(value)


class SchedulerActor(Actor):
    """Runs the step loop (an owned task) and serves ``generate`` streams and ``stats``.

    Constructed in the head process with the config, the verifier shards' refs (rank order)
    and the speculator actors' refs, and optionally a
    :class:`~treeserve.actors.length_predictor.LengthPredictorActor`: with a policy that orders
    by predicted length, each request is queued with ``min(prediction, max_tokens)`` (without a
    predictor, or when it fails, the policy assumes ``max_tokens``), and every ended request is
    reported to it so it can learn online. ``generate`` streams ``{"token_ids": [...]}`` items
    and a last item with ``"done": true`` and the request's statistics; cancelling the stream
    removes the request and frees its KV row. ``clock`` is injectable for tests.
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
    ) -> None:
        if not verifiers:
            raise ValueError("the scheduler needs at least one verifier shard")
        self.config = config
        self.verifiers = list(verifiers)
        self.speculators = list(speculators)
        self.predictor = predictor if config.uses_predictions else None
        self.clock = clock
        self._policy = config.make_policy()
        self._requests: dict[str, _Request] = {}
        self._running: dict[str, _Request] = {}
        self._free_rows = list(range(config.num_rows))
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[Any] | None = None
        self._ids = itertools.count()
        self._counters = {"num_steps": 0, "num_completed": 0, "num_cancelled": 0, "num_failed": 0,
                          "num_speculator_failures": 0, "num_verifier_failures": 0,
                          "num_predicted": 0, "num_predictor_failures": 0, "num_prefill_calls": 0,
                          "num_step_faults": 0, "num_row_failures": 0}
        self._timers = {"propose_s": 0.0, "verify_s": 0.0}  # wall time spent in each phase of the steps
        self._adaptive: AdaptiveSpeculation | None = None
        if config.adaptive_speculation and self.speculators:
            candidates = tuple(n for n in AdaptiveConfig().candidates if n <= config.max_tree_nodes)
            self._adaptive = AdaptiveSpeculation(AdaptiveConfig(candidates=candidates))

    async def on_start(self) -> None:
        self._loop_task = self.tasks.start(self._run(), "step-loop")

    async def on_stop(self) -> None:
        await self.tasks.aclose(timeout_s=5.0)  # the step loop first: nothing may run after the failures below
        for req in list(self._requests.values()):
            self._fail(req, ServiceUnavailable("the scheduler is shutting down"))

    # ------------------------------------------------------------------ public handlers
    @stream_handler
    async def generate(self, body: Any) -> AsyncIterator[dict[str, Any]]:
        req = self._parse(body)
        if len(self._policy) >= self.config.max_queue:
            raise ActorError(f"scheduler queue is full ({self.config.max_queue} waiting)", code=ErrorCode.OVERLOADED)
        self._requests[req.request_id] = req
        try:
            # Aging counts from arrival, so the time spent predicting counts as waiting.
            req.predicted_len = await self._predict(req)
        except BaseException:
            self._requests.pop(req.request_id, None)
            raise
        self._policy.add(
            QueuedRequest(req.request_id, req.arrival_s, len(req.prompt_ids), req.params.max_new_tokens,
                          predicted_len=req.predicted_len),
            req.arrival_s,
        )
        self._wake.set()
        try:
            while True:
                try:
                    async with asyncio.timeout(self.config.keepalive_s):
                        item = await req.outbox.get()
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
            if not req.is_done:
                req.is_cancelled = True
                if self._policy.remove(req.request_id):
                    self._requests.pop(req.request_id, None)
                self._counters["num_cancelled"] += 1
                self._wake.set()
                await self._report_length(req, is_censored=True)

    @handler
    async def finish(self, body: Any) -> bool:
        """``{"request_id", "num_tokens"}``: end a running request as if its ``num_tokens``-th
        token had been a stop token (the gateway calls this when a stop string appears in the
        text). The request's stream ends with its final item as usual, before the next step;
        tokens streamed after that point are the caller's to drop. False if the request is
        not running (already finished, cancelled, or never admitted)."""
        if not isinstance(body, dict) or set(body) != {"request_id", "num_tokens"}:
            raise InvalidRequest("finish takes {request_id, num_tokens}")
        num_tokens = body["num_tokens"]
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise InvalidRequest(f"num_tokens must be an int >= 1, got {num_tokens!r}")
        req = self._running.get(body["request_id"])
        if req is None or req.is_done or req.is_cancelled:
            return False
        req.stop_after = num_tokens if req.stop_after is None else min(req.stop_after, num_tokens)
        self._wake.set()
        return True

    @handler
    async def stats(self) -> dict[str, Any]:
        return {
            **self._counters,
            **self._timers,
            "num_queued": len(self._policy),
            "num_running": len(self._running),
            "num_free_rows": len(self._free_rows),
            "policy": self.config.policy,
            "has_predictor": self.predictor is not None,
            **({} if self._adaptive is None else {"adaptive": self._adaptive.snapshot()}),
        }

    # ------------------------------------------------------------------ length prediction
    async def _predict(self, req: _Request) -> float | None:
        """``min(predicted length, max_tokens)``, or None without a (working) predictor."""
        if self.predictor is None:
            return None
        try:
            reply = await self.predictor.ask(
                "predict", {"request_id": req.request_id, "prompt_ids": req.prompt_ids},
                timeout=self.config.predict_timeout_s,
            )
            value = float(reply["predicted_len"])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any predictor fault degrades to "no prediction"
            self._counters["num_predictor_failures"] += 1
            log.warning("length prediction failed for %s (%s); queued as max_tokens", req.request_id, exc)
            return None
        self._counters["num_predicted"] += 1
        return min(max(value, 1.0), float(req.params.max_new_tokens))

    async def _report_length(self, req: _Request, *, is_censored: bool) -> None:
        """Tell the predictor how long the request really ran (it drops censored lengths)."""
        if self.predictor is None or req.predicted_len is None:
            return
        body = {"request_id": req.request_id, "num_generated_tokens": len(req.emitted), "is_censored": is_censored}
        try:
            await self.predictor.tell("observe", body)
        except ActorError as exc:  # learning is best effort; serving goes on
            log.debug("could not report the length of %s: %s", req.request_id, exc)

    # ------------------------------------------------------------------ request parsing
    def _parse(self, body: Any) -> _Request:
        if not isinstance(body, dict):
            raise InvalidRequest("generate body must be a map")
        unknown = set(body) - {"request_id", "prompt_ids", "params", "speculate"}
        if unknown:
            raise InvalidRequest(f"unknown generate fields: {sorted(unknown)}")
        prompt = _int_list(body.get("prompt_ids"), "prompt_ids")
        if not prompt:
            raise InvalidRequest("prompt_ids must not be empty")
        if any(not 0 <= t < self.config.vocab_size for t in prompt):
            raise InvalidRequest(f"prompt_ids contains a token id outside [0, {self.config.vocab_size})")
        try:
            params = params_from_wire(body.get("params") or {})
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        # The one temperature rule (transport/PROTOCOL.md 11.3): below the smallest sampling
        # temperature is greedy, so no row's scaled logits can overflow.
        params = replace(params, temperature=sampling_temperature(params.temperature))
        speculate = body.get("speculate", "tree")
        if speculate not in SPECULATE_MODES:
            raise InvalidRequest(f"speculate must be one of {SPECULATE_MODES}, got {speculate!r}")
        needed = len(prompt) + params.max_new_tokens + self.config.max_tree_nodes
        if needed > self.config.row_capacity:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_new_tokens}) does not fit the "
                f"context of {self.config.row_capacity - self.config.max_tree_nodes} tokens"
            )
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        return _Request(request_id, prompt, params, speculate, self.clock())

    # ------------------------------------------------------------------ the step loop
    async def _run(self) -> None:
        while True:
            try:
                await self._run_once()
            except Exception as exc:  # noqa: BLE001 - nobody may wait on a step that failed
                await self._recover(exc)

    async def _run_once(self) -> None:
        await self._reap_cancelled()
        await self._reap_stopped()
        await self._admit()
        if not self._running:
            self._wake.clear()
            if len(self._policy) == 0 or not self._free_rows:
                await self._wake.wait()
            return
        await self._step()

    async def _recover(self, exc: Exception) -> None:
        """After an unexpected step failure: fail every open request at once (non-retryable
        ``internal``), then release their rows and reset the queue, so the next request starts
        from a clean state. An exception out of here ends the loop: the supervisor restarts us."""
        self._counters["num_step_faults"] += 1
        log.error("scheduler step failed; failing %d open requests", len(self._requests), exc_info=exc)
        error = SchedulerFault(f"internal error in the scheduler, the request was ended: {type(exc).__name__}: {exc}")
        running = list(self._running.values())
        for req in list(self._requests.values()):
            self._counters["num_failed"] += 1
            self._fail(req, error)
        self._policy = self.config.make_policy()
        for req in running:
            if not await self._release_resources(req):
                break  # the shards are gone: every row is free again anyway
        self._free_rows = list(range(self.config.num_rows))

    async def _reap_cancelled(self) -> None:
        for req in [r for r in self._running.values() if r.is_cancelled]:
            await self._release(req)

    async def _reap_stopped(self) -> None:
        for req in [r for r in self._running.values() if r.stop_after is not None and not r.is_cancelled]:
            del req.emitted[req.stop_after:]  # what the consumer kept: the length the predictor learns
            await self._finish(req, FinishReason.STOP)

    async def _admit(self) -> None:
        while self._free_rows and len(self._policy):
            picked = self._policy.select(self.clock(), len(self._free_rows))
            if not picked:
                return
            admitted: list[_Request] = []
            for queued in picked:
                req = self._requests.get(queued.request_id)
                if req is None or req.is_cancelled:
                    self._requests.pop(queued.request_id, None)
                    continue
                self._free_rows.sort(reverse=True)
                req.row = self._free_rows.pop()  # the lowest free row: compact rows batch without padding
                req.admitted_s = self.clock()
                self._running[req.request_id] = req
                admitted.append(req)
            # A burst of arrivals shares prefill calls (batched forwards), up to max_prefill_tokens each.
            for chunk in _prefill_chunks(admitted, self.config.max_prefill_tokens):
                rows = [{"row": req.row, "prompt_ids": req.prompt_ids,
                         "return_states": self.config.use_states and req.speculate != "none"} for req in chunk]
                self._counters["num_prefill_calls"] += 1
                try:
                    reply = await self._all_shards("prefill", {"rows": rows})
                except ActorError as exc:
                    self._on_verifier_failure(exc)  # fails every running request, this whole pick included
                    return
                entries = _reply_rows(reply, [r.row for r in chunk], "prefill")
                for req, states in zip(chunk, self._row_states(reply, entries, "prefill")):
                    if states is not None:
                        self._add_states(req, states)
                await asyncio.gather(*(self._start_speculators(req) for req in chunk))

    async def _start_speculators(self, req: _Request) -> None:
        if req.speculate == "none":
            return
        body = {"request_id": req.request_id, "prompt_ids": req.prompt_ids}
        results = await asyncio.gather(
            *(s.ask("start", body, timeout=self.config.step_timeout_s) for s in self.speculators),
            return_exceptions=True,
        )
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                self._on_speculator_failure(index, result)

    async def _step(self) -> None:
        batch = [r for r in self._running.values() if not r.is_cancelled]
        if not batch:
            return
        # A step where no row speculates says nothing about tree budgets: the policy neither
        # chooses for it nor learns from it (else a plain step would be costed as a tree step).
        adaptive = self._adaptive if any(r.speculate != "none" for r in batch) else None
        budget = self.config.max_tree_nodes if adaptive is None else adaptive.tree_budget(len(batch))
        started = time.perf_counter()
        trees = await self._propose(batch, budget)
        proposed = time.perf_counter()
        rows = [
            {"row": req.row, "tree": tree_to_wire(tree), "params": params_to_wire(req.params), "request_id": req.request_id}
            for req, tree in zip(batch, trees)
        ]
        wants_states = self.config.use_states and any(r.speculate != "none" for r in batch)
        try:
            reply = await self._all_shards("step", {"rows": rows, "return_states": wants_states})
        except ActorError as exc:
            self._on_verifier_failure(exc)
            return
        verified = time.perf_counter()
        results = _reply_rows(reply, [r.row for r in batch], "step")
        for result in results:
            if "error" not in result:
                _require(result, ("accepted", "new_tokens", *(("num_states",) if wants_states else ())), "step")
        row_states = self._row_states(reply, results, "step") if wants_states else [None] * len(results)
        self._counters["num_steps"] += 1
        self._timers["propose_s"] += proposed - started
        self._timers["verify_s"] += verified - proposed
        if adaptive is not None:
            try:
                adaptive.observe(
                    num_rows=len(batch), budget=budget, nodes_per_row=[t.num_nodes for t in trees],
                    accepted_per_row=[len(r["accepted"]) - 1 if "accepted" in r else 0 for r in results],
                    verify_s=verified - proposed, propose_s=proposed - started,
                )
            except ValueError as exc:  # a speculator overran its share: keep serving, do not learn
                log.warning("adaptive speculation ignored a step: %s", exc)
        now = self.clock()
        for req, result, states in zip(batch, results, row_states):
            if "error" in result:  # a numerical failure in this row alone: end this request only
                self._counters["num_row_failures"] += 1
                self._counters["num_failed"] += 1
                log.warning("request %s failed in its verifier row: %s", req.request_id, result["error"])
                req.is_done = True
                req.outbox.put_nowait(SchedulerFault(f"the verifier could not verify this request: {result['error']}"))
                await self._release(req)
                continue
            new_tokens = [int(t) for t in result["new_tokens"]]
            taken, finish = emit_until_done(req.emitted, new_tokens, req.params)
            req.accepted_per_step.append(len(result["accepted"]) - 1)
            req.since_propose.extend(taken)
            if states is not None and req.speculate != "none":
                self._add_states(req, states)
            if req.first_token_s is None:
                req.first_token_s = now
            if not req.is_cancelled:
                req.outbox.put_nowait({"token_ids": taken})
            if finish is not None:
                await self._finish(req, finish)

    async def _propose(self, batch: list[_Request], budget: int) -> list[TokenTree]:
        """One token tree per request of ``batch``, each of at most ``budget`` nodes (root included)."""
        speculating = [r for r in batch if r.speculate != "none" and r.params.max_new_tokens - len(r.emitted) > 1]
        per_request: dict[str, list[TokenTree]] = {r.request_id: [] for r in batch}
        # A fixed per-speculator share of the budget, so the merged tree never needs a size cut
        # that would depend on the draws; what does not divide evenly goes to the first ones.
        shares = split_node_budget(budget, len(self.speculators))
        asked = [index for index, share in enumerate(shares) if share > 1]
        if speculating and asked:
            calls = []
            for index in asked:
                spec = self.speculators[index]
                entries = []
                states_sent: list[np.ndarray] = []
                for req in speculating:
                    entry: dict[str, Any] = {
                        "request_id": req.request_id,
                        "new_tokens": list(req.since_propose),
                        "max_depth": req.params.max_new_tokens - len(req.emitted) - 1,
                        "params": params_to_wire(req.params),
                        "max_nodes": shares[index],
                    }
                    parts = req.states_pending
                    if index in req.needs_history:
                        entry["history"] = req.prompt_ids + req.emitted
                        parts = req.states_all
                    if parts:
                        entry["num_states"] = sum(len(part) for part in parts)
                        states_sent.extend(parts)
                    entries.append(entry)
                body: dict[str, Any] = {"requests": entries}
                if states_sent:  # stacked: one frame, whatever the number of requests
                    body["states"] = np.concatenate(states_sent)
                calls.append(spec.ask("propose", body, timeout=self.config.step_timeout_s))
            results = await asyncio.gather(*calls, return_exceptions=True)
            for index, result in zip(asked, results):
                if isinstance(result, BaseException):
                    self._on_speculator_failure(index, result)
                    continue
                if not isinstance(result, dict) or not isinstance(result.get("trees"), list):
                    raise MalformedReply(f"speculator {index} answered propose without a list 'trees'")
                if len(result["trees"]) != len(speculating):
                    raise MalformedReply(f"speculator {index} answered {len(result['trees'])} trees "
                                         f"for {len(speculating)} requests")
                missing = set(result.get("missing", ()))
                for req, wire in zip(speculating, result["trees"]):
                    if req.request_id in missing:
                        req.needs_history.add(index)  # the speculator lost its state: resend history
                    else:
                        req.needs_history.discard(index)
                    if wire is not None:
                        per_request[req.request_id].append(tree_from_wire(wire))
            for req in speculating:
                req.since_propose.clear()
                req.states_pending.clear()
                # A speculator left out this step missed these tokens: rebuild it from the history.
                req.needs_history.update(i for i in range(len(self.speculators)) if i not in asked)
        trees = []
        for req in batch:
            proposed = [t for t in per_request[req.request_id] if t.root_token == req.root]
            tree = merge_trees(proposed) if proposed else TokenTree.from_parents([-1], [req.root])
            if req.speculate == "chain":
                tree = tree.first_chain()
            trees.append(self._fit(tree, req))
        return trees

    @staticmethod
    def _row_states(reply: Any, entries: list[dict[str, Any]], method: str) -> list[np.ndarray | None]:
        """Each reply row's slice of the reply's stacked ``states`` (None: the row has none)."""
        counts = [entry.get("num_states") for entry in entries]
        if all(count is None for count in counts):
            return [None] * len(entries)
        if "states" not in reply:
            raise MalformedReply(f"verifier {method} reply gives num_states but no 'states'")
        try:
            parts = split_states(reply["states"], [count or 0 for count in counts])
        except ValueError as exc:
            raise MalformedReply(f"verifier {method} reply: {exc}") from None
        return [None if count is None else part for count, part in zip(counts, parts)]

    @staticmethod
    def _add_states(req: _Request, states: Any) -> None:
        array = np.asarray(states)
        req.states_pending.append(array)
        req.states_all.append(array)

    def _fit(self, tree: TokenTree, req: _Request) -> TokenTree:
        """Trim to the tokens still allowed (depth only: a depth cut does not depend on the draws)."""
        max_depth = req.params.max_new_tokens - len(req.emitted) - 1
        keep = tree.depths() <= max_depth
        if not bool(keep.all()):
            tree = tree.restricted(keep)
        if tree.num_nodes > self.config.max_tree_nodes:  # the per-speculator shares prevent this
            raise RuntimeError(f"merged token tree of {tree.num_nodes} nodes exceeds max_tree_nodes")
        return tree

    # ------------------------------------------------------------------ completion and faults
    async def _finish(self, req: _Request, finish: FinishReason) -> None:
        now = self.clock()
        steps = len(req.accepted_per_step)
        req.is_done = True
        req.outbox.put_nowait({
            "token_ids": [],
            "done": True,
            "finish_reason": finish.value,
            "num_prompt_tokens": len(req.prompt_ids),
            "num_generated_tokens": len(req.emitted),
            "num_steps": steps,
            # SpecInfer's "tokens verified per step": accepted drafts plus the LLM's own token.
            "mean_accepted_per_step": (sum(req.accepted_per_step) + steps) / steps if steps else 0.0,
            "mean_accepted_drafts_per_step": sum(req.accepted_per_step) / steps if steps else 0.0,
            "queue_s": (req.admitted_s or now) - req.arrival_s,
            "ttft_s": (req.first_token_s or now) - req.arrival_s,
            "total_s": now - req.arrival_s,
            **({} if req.predicted_len is None else {"predicted_len": req.predicted_len}),
        })
        self._counters["num_completed"] += 1
        await self._report_length(req, is_censored=finish is FinishReason.LENGTH)
        await self._release(req)

    async def _release(self, req: _Request) -> None:
        self._running.pop(req.request_id, None)
        self._requests.pop(req.request_id, None)
        row = req.row
        if await self._release_resources(req) and row is not None:
            self._free_rows.append(row)

    async def _release_resources(self, req: _Request) -> bool:
        """Free ``req``'s verifier row and speculator state; False if the shards failed."""
        if req.row is None:
            return True
        row, req.row = req.row, None
        try:
            await self._all_shards("release", {"row": row, "request_id": req.request_id})
        except ActorError as exc:
            self._on_verifier_failure(exc)
            return False
        if req.speculate != "none":
            await asyncio.gather(
                *(s.ask("release", {"request_id": req.request_id}, timeout=self.config.step_timeout_s)
                  for s in self.speculators),
                return_exceptions=True,
            )
        return True

    def _fail(self, req: _Request, error: ActorError) -> None:
        req.is_done = True
        req.outbox.put_nowait(error)
        self._running.pop(req.request_id, None)
        self._requests.pop(req.request_id, None)

    def _on_speculator_failure(self, index: int, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        self._counters["num_speculator_failures"] += 1
        log.warning("speculator %d failed (%s); its requests go on without it this step", index, exc)
        for req in self._running.values():
            req.needs_history.add(index)

    def _on_verifier_failure(self, exc: ActorError) -> None:
        """Every running request loses its KV rows with the shard: fail them. Retryably when
        the shard died, timed out or was unreachable (a restarted one may serve the retry);
        not when it answered an error of its own (the same step would fail again)."""
        self._counters["num_verifier_failures"] += 1
        log.warning("verifier step failed (%s); failing %d running requests", exc, len(self._running))
        message = f"the verifier failed during the request: {exc.message}"
        error: ActorError
        if exc.retryable or exc.code is ErrorCode.DEADLINE_EXCEEDED:
            error = ServiceUnavailable(message, retryable=True)
        else:
            error = SchedulerFault(message)
        for req in list(self._running.values()):
            self._counters["num_failed"] += 1
            self._fail(req, error)
        self._free_rows = list(range(self.config.num_rows))

    async def _all_shards(self, method: str, body: dict[str, Any]) -> Any:
        """Send one call to every verifier shard (rank order) and return rank 0's reply. When
        shards fail, a retryable error (a dead rank) wins over the errors it caused in the
        others (a broken collective), so the failure is judged by its cause."""
        results = await asyncio.gather(
            *(v.ask(method, body, timeout=self.config.step_timeout_s) for v in self.verifiers),
            return_exceptions=True,
        )
        errors: list[ActorError] = []
        for result in results:
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, ActorError):
                errors.append(result)
            elif isinstance(result, BaseException):
                errors.append(ActorError(f"{type(result).__name__}: {result}", code=ErrorCode.INTERNAL))
        if errors:
            raise next((e for e in errors if e.retryable), errors[0])
        return results[0]

