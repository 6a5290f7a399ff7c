"""Limited preemption: a running request whose predicted remainder is long yields its row to a
queued request predicted far shorter, and waits with its K/V kept until it is the policy's
choice again.

Where a preempted request waits. The verifier's cache has ``num_rows`` rows that steps run and,
after them, ``preempt_rows`` *park rows* (``SchedulerSettings.preempt_rows``; 0: no
preemption). Preempting moves the request's committed K/V into a free park row
(:meth:`~treeserve.ops.kv_cache.KVCache.move_row`, a copy of its committed slots: on the CPU a
row's cache is ordinary memory), and resuming moves it back into a free running row, so
nothing is recomputed and the resumed forward reads exactly the keys and values it would have
read unpreempted (``tests/actors/scheduler/test_preemption_exact.py``). Running rows stay the
low ``num_rows`` rows, so a step's batch stays one compact block.

Re-prediction while running (:func:`predicted_remaining`). The prompt-time prediction says
little once a request runs; what it has written says more. On the default model about half of
the chat answers that reach the 512-token cap do so in a repetition loop (``bench/RESULTS.md``),
and a loop shows in the tokens: :class:`RepeatWatch` flags a request once a run of
:data:`LOOP_NGRAM` tokens repeats within its answer (on the 40 chat prompts of
``bench/data/trace_chat512.jsonl``, q4_1: 22 of the 24 capped answers flagged, after 32-331
tokens, median 109; 3 of the 16 others, all longer than 150 tokens). A flagged request is
expected to run to its cap. The answer's hidden state says more, and sooner: with a
:class:`~treeserve.ops.remaining_head.RemainingHead` (the shipped one is the default model's),
:class:`Repredictor` asks the verifier for the rows' final hidden states every ``head.every``
decode forwards and re-predicts each running request's remainder from its last one. An
unflagged request is expected to run to that re-prediction, else to its prediction (or hint, or cap).

The rules (:func:`pick_victim`, :func:`may_preempt`). At most one request is preempted per plan, and only when every
running row is taken and a park row is free. The victim is the running request with the longest
predicted remainder among those that:

* have streamed a token and were preempted fewer than ``max_preemptions`` times;
* are predicted to need at least :data:`MIN_REMAINING_TOKENS` more tokens and at least
  :data:`PREEMPT_RATIO` times the queue head's predicted length (the head in the policy's own
  order at ``now``, never a parked request): never near its end, and only for a much shorter job;
* are not promoted: the aging deadline they would have as parked requests (from their arrival,
  so at most ``max_wait_s`` after it) has not passed.

A parked request queues in the same policy as the waiting ones, keyed by its predicted remainder
(its ``max_tokens`` there: the tokens it still may write), with its original arrival. So it
resumes in the policy's order, promoted requests first, earliest deadline first; and since a
promoted request is never preempted, the aging bound of
:mod:`~treeserve.actors.scheduler.policy_aging` still holds with parking counted as waiting:
by its deadline plus the bound's slack a request holds a running row for good (a request is
preempted at most ``max_preemptions`` times, never after its deadline).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from treeserve.ops.remaining_head import RemainingHead
from treeserve.ops.sampling import SamplingParams

LOOP_NGRAM = 24
"""Tokens in a run whose repetition flags a looping answer (see the module docstring)."""
MIN_REMAINING_TOKENS = 64
"""A running request predicted to finish within this many tokens is never preempted."""
PREEMPT_RATIO = 2.0
"""A running request yields only to a queued one predicted at most 1/this of its remainder."""


class RepeatWatch:
    """Whether an answer has repeated a run of ``ngram`` tokens, fed as it grows: one set lookup a
    token (the runs seen so far are kept until the first repeat).

    ``loop_at`` is the answer length at which the first repeated run ended (None: no repeat yet).
    """

    __slots__ = ("_ngram", "_seen", "loop_at")

    def __init__(self, ngram: int = LOOP_NGRAM) -> None:
        if ngram < 2:
            raise ValueError(f"ngram must be >= 2, got {ngram}")
        self._ngram = ngram
        self._seen: set[tuple[int, ...]] = set()
        self.loop_at: int | None = None

    def feed(self, emitted: Sequence[int], num_new: int) -> None:
        """``emitted`` is the whole answer so far, its last ``num_new`` tokens new since the last call."""
        if self.loop_at is not None:
            return
        n = self._ngram
        for end in range(max(n, len(emitted) - num_new + 1), len(emitted) + 1):
            run = tuple(emitted[end - n:end])
            if run in self._seen:
                self.loop_at = end
                self._seen.clear()  # no longer needed
                return
            self._seen.add(run)


def predicted_remaining(num_emitted: int, max_tokens: int, expected_len: float | None, loop_at: int | None,
                        repredicted: tuple[float, int] | None = None) -> float:
    """Tokens a running request is predicted still to write (>= 1): up to its cap once it loops;
    else what the hidden-state head last predicted (``(remaining, at num_emitted)``), less what
    it has written since; else up to its expected length (prediction or hint; the cap without either)."""
    if loop_at is not None:
        return float(max(1, max_tokens - num_emitted))
    if repredicted is not None:
        remaining, at = repredicted
        return max(1.0, min(remaining - (num_emitted - at), float(max_tokens - num_emitted)))
    expected = float(max_tokens) if expected_len is None else min(float(expected_len), float(max_tokens))
    return max(1.0, expected - num_emitted)


def may_preempt(remaining: float, head_len: float, num_preempted: int, max_preemptions: int) -> bool:
    """Whether a running request predicted to need ``remaining`` more tokens, preempted
    ``num_preempted`` times so far, may yield to a queued one predicted at ``head_len`` tokens
    (the caller checks the aging deadline and that the request has streamed a token)."""
    return (num_preempted < max_preemptions and remaining >= MIN_REMAINING_TOKENS
            and remaining >= PREEMPT_RATIO * head_len)


class Repredictor:
    """Re-predicts running requests' remainders from their final hidden states with ``head``
    (:class:`~treeserve.ops.remaining_head.RemainingHead`): a step's call asks the verifier for
    the states (:attr:`is_due`) every ``head.every`` decode forwards, and each running request is
    then re-predicted from its last state (the forward that wrote its last token, as the head was
    fitted)."""

    __slots__ = ("head", "_forwards")

    def __init__(self, head: RemainingHead) -> None:
        self.head = head
        self._forwards = head.every  # the first step asks

    @property
    def is_due(self) -> bool:
        """Whether the next call asks: its own forward makes ``head.every`` since the last state."""
        return self._forwards + 1 >= self.head.every

    def stepped(self, num_forwards: int, had_states: bool) -> None:
        """A step of ``num_forwards`` decode forwards ran (its call asked for states or not)."""
        self._forwards = 0 if had_states else self._forwards + num_forwards

    def update(self, req: Repredictable, states: Any) -> bool:
        """Re-predict ``req`` from the last of its new states ``(n, D)``; False (unchanged) when
        there is none."""
        array = np.asarray(states)
        if array.ndim != 2 or not len(array) or not req.emitted:
            return False
        written = len(req.emitted)
        req.repredicted = (self.head.remaining(array[-1], written, len(req.prompt_ids), req.params.max_new_tokens),
                           written)
        return True


class Repredictable(Protocol):
    """What :meth:`Repredictor.update` reads and writes of a request (a scheduler ``RequestState``)."""

    prompt_ids: list[int]
    emitted: list[int]
    params: SamplingParams
    repredicted: tuple[float, int] | None


class Preemptible(Protocol):
    """What :func:`pick_victim` reads of a running request (a scheduler ``RequestState``)."""

    is_parked: bool
    is_cancelled: bool
    stop_after: int | None
    emitted: list[int]
    num_preempted: int

    @property
    def predicted_remaining(self) -> float: ...


_R = TypeVar("_R", bound=Preemptible)


def pick_victim(running: Iterable[_R], head_len: float, max_preemptions: int,
                is_promoted: Callable[[_R], bool]) -> _R | None:
    """The running request to park for a queued one predicted at ``head_len`` tokens (None: no
    request may yield): of those that run (not parked, cancelled or stopped), have streamed a
    token, pass :func:`may_preempt` and are not promoted, the one predicted to need the most."""
    candidates = [r for r in running
                  if not (r.is_parked or r.is_cancelled or r.stop_after is not None or not r.emitted)
                  and may_preempt(r.predicted_remaining, head_len, r.num_preempted, max_preemptions)
                  and not is_promoted(r)]
    return max(candidates, key=lambda r: r.predicted_remaining, default=None)


__all__ = ["LOOP_NGRAM", "MIN_REMAINING_TOKENS", "PREEMPT_RATIO", "Preemptible", "RepeatWatch", "Repredictable",
           "Repredictor", "may_preempt", "pick_victim", "predicted_remaining"]
