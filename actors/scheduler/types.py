"""The scheduler's vocabulary: its config and errors, a request's state, a step's plan, and the
events it returns.

:class:`~treeserve.actors.scheduler.core.SchedulerCore` makes the decisions and
:class:`~treeserve.actors.scheduler.SchedulerActor` carries them out; these frozen dataclasses
are what passes between the two. ``StepPlan`` says what one step does, in field order
(finish, release, prefill, propose and verify); ``StepReplies`` is what came back;
``StepEvents`` is what that ended: tokens to stream, requests that finished or failed, and the
rows to release.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treeserve.ops.speculation_modes import SpeculationMode
from treeserve.actors.messages.length import LengthReport
from treeserve.actors.messages.speculator import ProposeBody
from treeserve.actors.messages.verifier import MAX_DECODE_STEPS, RowVerdict
from treeserve.actors.scheduler.policy import PREDICTION_POLICIES, SchedulingPolicy, make_policy
from treeserve.actors.scheduler.preemption import RepeatWatch, predicted_remaining
from treeserve.ops.remaining_head import RemainingHead
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree
from treeserve.runtime import ActorError
from treeserve.transport.wire import ErrorCode


class ServiceUnavailable(ActorError):
    """The verifier failed while the request ran; retrying the request may succeed."""

    default_code = ErrorCode.UNAVAILABLE


class SchedulerFault(ActorError):
    """A request ended by a fault that retrying would meet again: a bug or a malformed reply
    in the scheduler's step, or a numerical failure in the request's own row."""

    default_code = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


@dataclass(frozen=True)
class SchedulerSettings:
    """The scheduler's own settings: the ones a user chooses (``treeserve serve``'s flags of the
    same ``dest``, or :class:`~treeserve.server_config.ServerConfig`'s ``scheduling``), apart
    from the shapes it shares with the verifier and gateway (:class:`SchedulerConfig`). A new
    setting is a field here, its flag, and the code that reads it.

    ``policy``: the admission order; ``max_wait_s`` is the aging bound of ``ssjf``/``hrrn``.
    Length predictions never delay admission: a request is queued the moment it arrives, keyed by
    the longest it can be (``max_tokens``, or its client's ``length_hint``), and re-keyed when its
    prediction lands; one that finds a free row is admitted at once. Predictions run in batches
    of at most ``max_predict_batch`` requests (the ones still queued first), one batch at a time,
    each bounded by ``predict_timeout_s`` (on a timeout its requests keep their keys). ``adaptive_speculation``
    sizes each step's trees (nodes per row, at most ``max_tree_nodes``) from measured acceptance
    and step cost at the current batch size (:mod:`treeserve.actors.scheduler.adaptive`); without it every
    step drafts ``max_tree_nodes``. ``max_prefill_tokens`` bounds the prompt tokens of one
    prefill call: requests admitted together share calls (and batched forwards) up to it, a
    longer prompt goes alone. ``max_queue``: requests waiting before new ones are refused as
    ``overloaded``.

    Decode-ahead: when no running request drafts (none speculates, or the adaptive policy chose
    no speculation for the step; a feature drafter's states come back one per token), every one
    has streamed its first
    token and nothing waits for admission, one verifier call runs up to ``max_decode_steps`` plain decode
    steps, as many as fit in ``decode_ahead_s`` at the last measured step time (the tokens are
    the same; the scheduler's and the hop's cost is paid once per call, not per token, and the
    stream gets them in chunks of that many). A request arriving meanwhile waits for the call
    to end: at most about ``decode_ahead_s``. ``max_decode_steps=1`` turns it off. At 32, a
    one-row step of 4.5-5 ms (q4_1, fused blocks, the 2-core AVX2 host) runs 20 a call; the cap
    of 8 it had left batch-1 serving at 0.81-0.83x the in-process rate against 0.88-0.91x
    (``bench/actors_vs_inprocess.py``, two runs each).

    Limited preemption (:mod:`treeserve.actors.scheduler.preemption`): with ``preempt_rows`` > 0
    the verifier's cache has that many more rows, where preempted requests wait with their K/V
    kept; a running request with a long predicted remainder yields its row to a queued one
    predicted far shorter, at most ``max_preemptions`` times and never after its aging deadline.
    Needs ``ssjf`` or ``hrrn``."""

    policy: str = "fcfs"
    max_wait_s: float = 30.0
    max_queue: int = 4096
    predict_timeout_s: float = 10.0
    max_predict_batch: int = 16
    adaptive_speculation: bool = True
    max_prefill_tokens: int = 8192
    max_decode_steps: int = 32
    decode_ahead_s: float = 0.1
    preempt_rows: int = 0
    max_preemptions: int = 1

    def __post_init__(self) -> None:
        _check_counts(self, ("max_queue", "max_prefill_tokens", "max_decode_steps", "max_predict_batch",
                             "max_preemptions"))
        if isinstance(self.preempt_rows, bool) or not isinstance(self.preempt_rows, int) or self.preempt_rows < 0:
            raise ValueError(f"{type(self).__name__}.preempt_rows must be an int >= 0, got {self.preempt_rows!r}")
        if self.preempt_rows and not self.uses_predictions:
            raise ValueError(f"preemption (preempt_rows {self.preempt_rows}) needs a policy that orders by predicted "
                             f"length ({', '.join(PREDICTION_POLICIES)}), not {self.policy!r}")
        if self.max_decode_steps > MAX_DECODE_STEPS:
            raise ValueError(f"{type(self).__name__}.max_decode_steps must be <= {MAX_DECODE_STEPS}, "
                             f"got {self.max_decode_steps}")
        if not self.decode_ahead_s >= 0:
            raise ValueError(f"{type(self).__name__}.decode_ahead_s must be >= 0, got {self.decode_ahead_s}")
        for name in ("max_wait_s", "predict_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{type(self).__name__}.{name} must be > 0, got {getattr(self, name)}")
        self.make_policy()  # validates the name early

    def make_policy(self) -> SchedulingPolicy:
        """A fresh policy object of the configured kind."""
        return make_policy(self.policy, **({} if self.policy == "fcfs" else {"max_wait_s": self.max_wait_s}))

    @property
    def uses_predictions(self) -> bool:
        """Whether the policy orders by predicted output length (``ssjf``, ``hrrn``)."""
        return self.policy in PREDICTION_POLICIES


def _check_counts(config: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(config).__name__}.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig(SchedulerSettings):
    """The scheduler's settings and the shapes the server's composition root gives it:
    ``num_rows``/``row_capacity`` must match the verifier shards' cache; ``max_tree_nodes``
    caps a merged token tree (root included); ``step_timeout_s`` bounds each call to a shard;
    ``vocab_size`` is the model's; ``use_states``: a speculator drafts from the LLM's hidden
    states (a ``feature`` drafter): the verifier returns them and they travel with proposals;
    ``remaining_head``: with preemption, running requests are re-predicted from their hidden
    states by this head (:class:`~treeserve.actors.scheduler.preemption.Repredictor`; None: from
    their tokens alone)."""

    num_rows: int = 8
    row_capacity: int = 2048
    vocab_size: int = 49152
    max_tree_nodes: int = 64
    step_timeout_s: float = 300.0
    use_states: bool = False
    remaining_head: RemainingHead | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_counts(self, ("num_rows", "row_capacity", "vocab_size", "max_tree_nodes"))
        if not self.step_timeout_s > 0:
            raise ValueError(f"SchedulerConfig.step_timeout_s must be > 0, got {self.step_timeout_s}")
        super().__post_init__()

    @property
    def keepalive_s(self) -> float:
        """How long a ``generate`` stream stays silent before it yields an empty keepalive item
        (a quarter of ``step_timeout_s``, the bound a consumer may put on its wait)."""
        return self.step_timeout_s / 4


@dataclass
class RequestState:
    """What the scheduler core knows of one open request (queued or running); mutable, and the
    core's alone. It exists beside the immutable body the request came in
    (:class:`~treeserve.actors.messages.gateway.GenerateBody`) because its row, emitted tokens,
    prediction and timings change at every step. ``length_hint``: the client's expected output tokens (None: it sent none);
    ``predicted_len``: the length predictor's guess, at most ``max_tokens``, once it has landed
    (it may land after admission, or never)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculate: str  # a SpeculationMode value
    arrival_s: float
    row: int | None = None
    emitted: list[int] = field(default_factory=list)
    since_propose: list[int] = field(default_factory=list)  # emitted, not yet sent to the speculators
    accepted_per_step: list[int] = field(default_factory=list)
    needs_history: set[int] = field(default_factory=set)  # speculators to rebuild from the full history
    states_pending: list[np.ndarray] = field(default_factory=list)  # LLM states not yet sent to speculators
    states_all: list[np.ndarray] = field(default_factory=list)  # every state so far (to rebuild a speculator)
    length_hint: int | None = None
    predicted_len: float | None = None
    admitted_s: float | None = None
    first_token_s: float | None = None
    is_cancelled: bool = False
    stop_after: int | None = None  # a consumer's stop string ended the output after this many tokens
    is_parked: bool = False  # preempted: its row is a park row, and it queues to resume
    num_preempted: int = 0
    repeats: RepeatWatch | None = None  # set while preemption is on: whether the answer loops
    repredicted: tuple[float, int] | None = None  # the hidden-state head's remainder, and at how many tokens

    @property
    def root(self) -> int:
        """The last token so far: the root of the next token tree."""
        return self.emitted[-1] if self.emitted else self.prompt_ids[-1]

    @property
    def speculates(self) -> bool:
        return self.speculate != SpeculationMode.NONE

    @property
    def predicted_remaining(self) -> float:
        """Tokens it is predicted still to write (:func:`~treeserve.actors.scheduler.preemption.predicted_remaining`)."""
        loop_at = None if self.repeats is None else self.repeats.loop_at
        return predicted_remaining(len(self.emitted), self.params.max_new_tokens, self.expected_len, loop_at,
                                   self.repredicted)

    @property
    def expected_len(self) -> float | None:
        """The output length the admission order reads: the smaller of the client's hint and
        the prediction (None: neither yet; the policy then assumes ``max_tokens``)."""
        known = [float(v) for v in (self.length_hint, self.predicted_len) if v is not None]
        return min(known) if known else None

    def add_states(self, states: Any) -> None:
        """Keep LLM hidden states ``(n, D)`` of new tokens for the speculators."""
        array = np.asarray(states)
        self.states_pending.append(array)
        self.states_all.append(array)


# ---------------------------------------------------------------------- plans and events
@dataclass(frozen=True)
class Admission:
    """A request given KV row ``row`` this step: prefill its prompt there, then start its
    speculators (if it ``speculates``); ``wants_states``: the prefill returns hidden states.
    An instruction of one step's plan (frozen, so the plan can be carried out while the core
    moves on), not a second record of the request."""

    request_id: str
    row: int
    prompt_ids: tuple[int, ...]
    wants_states: bool
    speculates: bool


@dataclass(frozen=True)
class Release:
    """Free ``row`` on every verifier shard, and the request's state on the speculators, which
    first index ``new_tokens`` (emitted since the request's last proposal) for later requests."""

    request_id: str
    row: int
    speculates: bool
    new_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class Move:
    """Move ``request_id``'s cache from row ``src`` to the empty row ``dst`` on every shard: a
    preempted request parks, or a parked one resumes."""

    request_id: str
    src: int
    dst: int


@dataclass(frozen=True)
class RowPlan:
    """One row of the verify batch and its token-tree budget: at most ``max_nodes`` nodes (root
    included), none deeper than ``max_depth`` (the tokens still allowed, less the bonus token).
    An instruction of one step's plan, like :class:`Admission`."""

    request_id: str
    row: int
    params: SamplingParams
    mode: str  # a SpeculationMode value
    max_nodes: int
    max_depth: int

    @property
    def is_speculating(self) -> bool:
        return self.mode != SpeculationMode.NONE and self.max_depth >= 1


@dataclass(frozen=True)
class TokensOut:
    """Tokens to stream to the request's consumer."""

    request_id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RequestFinished:
    """The request ended normally; ``summary`` holds its final statistics (``finish_reason``...);
    ``report`` is for the length predictor (None: the request had no prediction)."""

    request_id: str
    summary: dict[str, Any]
    report: LengthReport | None


@dataclass(frozen=True)
class RequestFailed:
    """The request ended with ``error``."""

    request_id: str
    error: ActorError


Event = TokensOut | RequestFinished | RequestFailed


@dataclass(frozen=True)
class StepEvents:
    """What a decision ended: events in order, then the rows to release."""

    events: tuple[Event, ...] = ()
    releases: tuple[Release, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """One step, decided at ``plan(now)``; the caller carries it out in field order."""

    finished: tuple[RequestFinished, ...]  # ended by a stop string since the last step
    releases: tuple[Release, ...]  # those and cancelled requests: release before any prefill
    moves: tuple[Move, ...]  # a preemption and resumptions, in order: after the releases, before any prefill
    prefill_chunks: tuple[tuple[Admission, ...], ...]
    rows: tuple[RowPlan, ...]  # the verify batch, this step's admissions included
    tree_budget: int  # nodes per row (root included) shared among the speculators
    is_budget_adaptive: bool  # the adaptive policy chose tree_budget and learns from this step
    wants_states: bool  # the verify step returns the accepted nodes' hidden states
    decode_steps: int = 1  # > 1: plain decode steps in one verifier call (decode-ahead, one-node trees)

    @property
    def is_idle(self) -> bool:
        return not (self.finished or self.releases or self.moves or self.prefill_chunks or self.rows)


@dataclass(frozen=True)
class ProposalAsk:
    """The ``propose`` call for speculator ``speculator``: one request per speculating plan row;
    ``body`` is its wire form, built once."""

    speculator: int
    request: ProposeBody

    @functools.cached_property
    def body(self) -> dict[str, Any]:
        return self.request.to_wire()


@dataclass(frozen=True)
class StepReplies:
    """What came back for a plan's rows: the verified trees, rank 0's verdicts, and the wall
    time of the proposal and verification phases (seconds)."""

    trees: tuple[TokenTree, ...]
    verdicts: tuple[RowVerdict, ...]
    propose_s: float
    verify_s: float

    def num_forwards(self, decode_steps: int) -> int:
        """The forwards the verifier ran for a step of ``decode_steps`` (a decode-ahead call
        runs as many as its longest row's tokens)."""
        if decode_steps == 1:
            return 1
        return max((len(v.new_tokens) for v in self.verdicts if v.error is None), default=1)


@dataclass
class SchedulerStats:
    """Counters since start, and the wall time spent in each phase of the steps. ``num_steps``
    counts verifier calls, ``num_decode_steps`` the forwards they ran (more than the calls
    where a call decoded ahead several steps)."""

    num_steps: int = 0
    num_decode_steps: int = 0
    num_completed: int = 0
    num_cancelled: int = 0
    num_failed: int = 0
    num_speculator_failures: int = 0
    num_verifier_failures: int = 0
    num_predicted: int = 0
    num_predictor_failures: int = 0
    num_rekeyed: int = 0  # queued requests whose prediction landed while they waited
    num_hinted: int = 0  # requests ordered by their client's length hint (not predicted)
    num_prefill_calls: int = 0
    num_step_faults: int = 0
    num_row_failures: int = 0
    num_preempted: int = 0  # running requests moved to a park row
    num_resumed: int = 0  # parked requests moved back
    num_repredicted: int = 0  # re-predictions of running requests from their hidden states
    propose_s: float = 0.0
    verify_s: float = 0.0


__all__ = [
    "Admission", "Event", "LengthReport", "Move", "ProposalAsk",
    "Release", "RequestFailed", "RequestFinished", "RequestState", "RowPlan", "SchedulerConfig", "SchedulerFault",
    "SchedulerStats", "ServiceUnavailable", "StepEvents", "StepPlan", "StepReplies", "TokensOut",
]
