"""Adaptive speculation: how many token-tree nodes to draft per row, given the batch and what it costs.

A pure, deterministic policy object (no clock, no I/O, no globals): the scheduler asks
:meth:`AdaptiveSpeculation.tree_budget` before each step and reports the step with
:meth:`AdaptiveSpeculation.observe` afterwards. Among ``candidates`` (nodes per row, root
included; ``1`` means no speculation) it picks the one with the best expected decode rate::

    tokens/s(n) = rows * (1 + A(n)) / (rows * C(bucket(rows), n))

- ``A(n)``: accepted drafts per row (bonus token excluded) under budget ``n``; one weighted
  mean per candidate, since a bigger tree accepts more, whose evidence fades by
  ``acceptance_decay`` per step (so a budget it stopped using is judged on its recent probes).
  The means are kept non-decreasing in ``n`` (a weighted isotonic fit after each step): a
  bigger tree holds what a smaller one drafts, and without the fit a bigger budget's evidence
  from before the traffic changed (repeated requests that the suffix drafter now knows) would
  hold the policy at the size it had.
  Acceptance belongs to the requests, not to the batch, so every batch size shares it.
- ``C(b, n)``: measured seconds per row of a whole step (propose + verify) under budget ``n``
  in batch-size bucket ``b`` (rows 1, 2, 3-4, 5-8, 9-16, ...). A forward over one row is
  memory-bound and over many rows compute-bound, so what an extra node costs differs a lot
  between buckets; one cell per (bucket, budget) measures it directly instead of trusting a
  model to extrapolate. Cells keep their values when the batch moves away, which is what lets
  the tree grow back at once when the batch shrinks again. A residual is clipped at
  ``outlier_clip`` times the cell's running mean absolute residual, so one slow step (a GC
  pause) cannot swing it. Rows cancel in the rate, so one bucket makes one decision.

The choice in a bucket is the best *measured* cell (a cell is measured once it was used); a
bucket with none starts from the nearest bucket's choice scaled to the same nodes per step
(``rows * budget``) but never above that choice (a tree that did not pay at more rows is not
assumed to pay at fewer: the climb finds out), or, on the first step ever, from the
configured prior cost model.
Unmeasured sizes are reached only by exploration, a deterministic schedule of single steps at
a neighbouring candidate of the current choice or at 1 (no speculation: the cheapest step and
the baseline, reachable from anywhere), kept per bucket on the bucket's own step count (a
bucket visited only at the tail of a burst still explores). An unmeasured neighbour (fewer
than 3 steps: a cell is the median of its first 3, since one step may have shared the CPU
with a request's admission) or one whose estimated rate beats the current one's, but not by
enough to switch, is probed every ``explore_every // 4`` steps (unmeasured ones first, the
smaller first; then the best-looking). Otherwise at most one probe per ``explore_every``
steps, of the neighbour most overdue, where a neighbour is due when its probes cost
``explore_cost`` of the bucket's time: ``(1 / ratio - 1) / explore_cost`` steps after its
last use, where ``ratio`` is its measured rate over the current one's, but at least
``explore_every`` and at most 64x that (so a neighbour more than about 6x worse, whose
estimate must not go stale either, costs more than ``explore_cost``). So a clearly worse
neighbour (a 4x costlier step at high load) is probed rarely, the estimates of sizes it
stopped using still recover, and a size that became better is found by climbing; far sizes
are never jumped to on a guess, since one step with a huge tree at a large batch costs as
much as dozens of plain decode steps. A switch needs a gain above ``switch_margin`` even
when the challenger's rate is taken ``switch_confidence`` standard errors low (hysteresis
against timing and acceptance noise: at batch 1 a probe adds a single row's acceptance).
Budget 1 is always a candidate, and the scheduler skips the speculators when it is chosen,
so at high load the policy settles on plain decoding: never slower than no speculation, less
the cost of the rare probes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treeserve.actors.scheduler.adaptive_config import AdaptiveConfig, is_int

_MAX_EXPLORE_STRETCH = 64  # a measured neighbour is probed at least every 64 * explore_every bucket steps
_MIN_CELL_STEPS = 3  # a cell is the median of its first 3 steps, probed at the climbing pace until then
_FRESH_CELL_SPREAD = 0.15  # assumed relative mean absolute deviation of a cell measured once


def rows_bucket(num_rows: int) -> int:
    """The batch-size bucket of ``num_rows``: 0 for 1 row, 1 for 2, 2 for 3-4, 3 for 5-8, ..."""
    return (num_rows - 1).bit_length()


def _bucket_label(bucket: int) -> str:
    low, high = (1, 1) if bucket == 0 else ((1 << (bucket - 1)) + 1, 1 << bucket)
    return str(low) if low == high else f"{low}-{high}"


@dataclass
class _CostCell:
    """Seconds per row of a step at one (bucket, budget); ``last_step`` is on the bucket's own
    step count. The first ``_MIN_CELL_STEPS`` steps set it to their median (a step that shared
    the CPU with another process is slow, never fast, so one such step must not become the
    cell's value for dozens of steps); after that it is an EMA with clipped residuals."""

    seconds_per_row: float
    mean_abs_residual: float
    last_step: int
    first: list[float]  # the first _MIN_CELL_STEPS values
    num_steps: int = 1

    @classmethod
    def fresh(cls, value: float, step: int) -> _CostCell:
        return cls(value, _FRESH_CELL_SPREAD * value, step, [value])

    def update(self, value: float, alpha: float, outlier_clip: float, step: int) -> None:
        self.last_step = step
        self.num_steps += 1
        if len(self.first) < _MIN_CELL_STEPS:
            self.first.append(value)
            self.seconds_per_row = statistics.median(self.first)
            # The median absolute deviation, which the slow step does not inflate either.
            spread = statistics.median(abs(v - self.seconds_per_row) for v in self.first)
            self.mean_abs_residual = max(spread, 0.05 * self.seconds_per_row)
            return
        bound = outlier_clip * self.mean_abs_residual
        error = max(-bound, min(bound, value - self.seconds_per_row))
        self.seconds_per_row += alpha * error
        # Floor the residual scale so a run of identical timings cannot make it clip everything.
        self.mean_abs_residual += alpha * (abs(error) - self.mean_abs_residual)
        self.mean_abs_residual = max(self.mean_abs_residual, 0.02 * self.seconds_per_row)


@dataclass
class _Acceptance:
    """Accepted drafts per row under one budget: weighted sums whose weights decay every step.

    Decay is per scheduler step, not per observed row, so a budget probed once in a while at
    batch 1 is judged on its recent probes rather than on rows from long ago; uniform decay
    leaves the mean alone and only lowers the confidence (``weight`` is the effective rows).
    """

    weight: float
    total: float
    total_sq: float

    @property
    def mean(self) -> float:
        return self.total / self.weight

    @property
    def standard_error(self) -> float:
        variance = max(0.0, self.total_sq / self.weight - self.mean ** 2)
        return math.sqrt(variance / max(self.weight, 1.0))

    def decay(self, factor: float, min_weight: float) -> None:
        # Never below min_weight rows: an old estimate then still counts as a prior, so the
        # first new row after a long pause (the batch was large for a while) cannot alone
        # replace it. This also keeps the sums far from underflow.
        if self.weight * factor >= min_weight:
            self.weight *= factor
            self.total *= factor
            self.total_sq *= factor

    def set_mean(self, mean: float) -> None:
        """Move the mean to ``mean``, keeping the weight and the variance."""
        old = self.mean
        self.total = self.weight * mean
        self.total_sq += self.weight * (mean * mean - old * old)

    def add(self, accepted: int) -> None:
        self.weight += 1.0
        self.total += accepted
        self.total_sq += accepted * accepted


def _make_monotone(estimates: Sequence[_Acceptance]) -> None:
    """Weighted isotonic regression of the means, in place (pool adjacent violators): where a
    bigger budget's mean is below a smaller one's, both get their weighted mean."""
    blocks: list[tuple[float, float, int]] = []  # (weight, weighted sum, members)
    for estimate in estimates:
        weight, total, members = estimate.weight, estimate.total, 1
        while blocks and blocks[-1][1] / blocks[-1][0] > total / weight:
            w, t, m = blocks.pop()
            weight, total, members = weight + w, total + t, members + m
        blocks.append((weight, total, members))
    index = 0
    for weight, total, members in blocks:
        for estimate in estimates[index: index + members]:
            if estimate.mean != total / weight:
                estimate.set_mean(total / weight)
        index += members


@dataclass(frozen=True)
class BudgetEstimate:
    """What the policy expects of one candidate budget in a batch-size bucket; ``seconds_per_row``
    and ``tokens_per_row_s`` are ``None`` until that (bucket, budget) was measured."""

    nodes_per_row: int
    accepted_per_row: float
    seconds_per_row: float | None
    tokens_per_row_s: float | None


class AdaptiveSpeculation:
    """Chooses the token-tree budget per row each step from measured acceptance and cost.

    Contract: call ``tree_budget(num_rows)`` before a step (it has no side effects), draft at
    most that many nodes per row (root included; when it is 1 do not call the speculators),
    then call ``observe`` once with what happened, passing the same budget back. The object is
    deterministic: the same sequence of calls gives the same budgets. Not thread-safe.
    """

    def __init__(self, config: AdaptiveConfig | None = None) -> None:
        self.config = config if config is not None else AdaptiveConfig()
        cfg = self.config
        self._num_steps = 0
        self._acceptance: dict[int, _Acceptance] = {}
        for n in cfg.candidates:
            prior = min(n - 1.0, cfg.prior_accepted_per_doubling * math.log2(n))
            # prior_weight pseudo-rows at the prior mean, with a Poisson-like variance.
            self._acceptance[n] = _Acceptance(cfg.prior_weight, cfg.prior_weight * prior,
                                              cfg.prior_weight * (prior * prior + max(prior, 0.25)))
        self._cells: dict[int, dict[int, _CostCell]] = {}  # bucket -> budget -> measured cost
        self._choice: dict[int, int] = {}  # bucket -> budget chosen after the last step there
        self._bucket_rows: dict[int, int] = {}  # bucket -> rows of the last step there
        self._bucket_steps: dict[int, int] = {}  # bucket -> steps observed there (its exploration clock)

    # ------------------------------------------------------------------ decisions
    def tree_budget(self, num_rows: int) -> int:
        """Nodes per row (root included, one of ``config.candidates``) to draft for a step of
        ``num_rows`` rows. Pure: depends only on ``num_rows`` and what was observed so far."""
        self._check_rows(num_rows)
        bucket = rows_bucket(num_rows)
        current = self._current(bucket, num_rows)
        cfg = self.config
        index = cfg.candidates.index(current)
        # No speculation (1) is always probed too: it is the cheapest step, the baseline the
        # policy must never fall below, and reachable from a plateau where neighbours tie.
        neighbours = sorted({cfg.candidates[i] for i in (index - 1, index + 1) if 0 <= i < len(cfg.candidates)}
                            | {1} - {current})
        cells = self._cells.get(bucket, {})
        clock = self._bucket_steps.get(bucket, 0)
        # A cell of fewer than _MIN_CELL_STEPS steps is not yet a measurement: one step taken
        # while another process held the CPU (a request being admitted) would otherwise keep a
        # rarely visited bucket on a wrong choice for a long time.
        unmeasured = [n for n in neighbours if n not in cells or cells[n].num_steps < _MIN_CELL_STEPS]
        rate = {e.nodes_per_row: e.tokens_per_row_s for e in self.estimates(num_rows)}
        current_rate = rate[current]
        # A measured neighbour that looks better but is not yet confidently better (the switch
        # rule) needs evidence as much as an unmeasured one: without it, acceptance evidence
        # fades as fast as rare probes add it and the policy never leaves a worse size.
        promising = sorted((n for n in neighbours if n not in unmeasured and current_rate
                            and (rate[n] or 0.0) > current_rate), key=lambda n: -(rate[n] or 0.0))
        if unmeasured or promising:
            # The climb is still under way: look at such a neighbour 4x as often, an unmeasured
            # one first and the smaller first (its step costs less if it turns out worse).
            period = max(2, cfg.explore_every // 4)
            return (unmeasured + promising)[0] if clock % period == period - 1 else current
        if clock % cfg.explore_every != cfg.explore_every - 1:
            return current
        # At most one probe per explore_every steps, of a neighbour whose last use is older than
        # the interval at which its probes cost explore_cost of the time: a probe of a step
        # that earns `ratio` of the current rate costs (1 / ratio - 1) steps of the current one.
        overdue: list[tuple[float, int]] = []
        for n in neighbours:
            ratio = min((rate[n] or 0.0) / current_rate, 1.0) if current_rate else 1.0
            loss = 1.0 / max(ratio, 1.0 / _MAX_EXPLORE_STRETCH) - 1.0
            interval = min(max(cfg.explore_every, loss / cfg.explore_cost), _MAX_EXPLORE_STRETCH * cfg.explore_every)
            age = clock - cells[n].last_step
            if age >= interval:
                overdue.append((age / interval, -n))
        return -max(overdue)[1] if overdue else current

    def estimates(self, num_rows: int) -> list[BudgetEstimate]:
        """The expected acceptance, cost and rate of every candidate in ``num_rows``'s bucket."""
        self._check_rows(num_rows)
        cells = self._cells.get(rows_bucket(num_rows), {})
        out = []
        for n in self.config.candidates:
            cell = cells.get(n)
            cost = cell.seconds_per_row if cell is not None else None
            accepted = self._acceptance[n].mean
            rate = (1.0 + accepted) / max(cost, 1e-12) if cost is not None else None
            out.append(BudgetEstimate(n, accepted, cost, rate))
        return out

    def _accepted_low(self, z: float) -> dict[int, float]:
        """Per candidate, the most that it or any smaller budget accepts, each estimate taken
        ``z`` standard errors low (monotone, as :meth:`observe` keeps the means)."""
        floor: dict[int, float] = {}
        best = 0.0
        for n in self.config.candidates:
            acceptance = self._acceptance[n]
            best = max(best, acceptance.mean - z * acceptance.standard_error)
            floor[n] = best
        return floor

    def _current(self, bucket: int, num_rows: int) -> int:
        choice = self._choice.get(bucket)
        if choice is not None:
            return choice
        if self._choice:
            # The batch moved to a new bucket: start from the nearest bucket's choice, scaled to
            # keep the verifier's nodes per step (rows * budget), the resource a bigger batch
            # competes for; rounded down, to the cheaper step.
            nearest = min(self._choice, key=lambda b: (abs(b - bucket), b))
            nodes_per_step = self._choice[nearest] * self._bucket_rows[nearest]
            return max(n for n in self.config.candidates
                       if n <= self._choice[nearest] and n * num_rows <= max(nodes_per_step, num_rows))
        return self._prior_choice(num_rows)

    def _prior_choice(self, num_rows: int) -> int:
        """The first budget ever: the best under the configured prior costs and acceptance."""
        cfg = self.config

        def rate(n: int) -> float:
            nodes = num_rows * n
            verify = cfg.prior_verify_s[0] + cfg.prior_verify_s[1] * num_rows + cfg.prior_verify_s[2] * nodes
            propose = 0.0 if n == 1 else (cfg.prior_propose_s[0] + cfg.prior_propose_s[1] * num_rows
                                          + cfg.prior_propose_s[2] * (nodes - num_rows))
            return (1.0 + self._acceptance[n].mean) / (verify + propose)

        return max(cfg.candidates, key=lambda n: (rate(n), -n))

    def _best_measured(self, bucket: int, current: int) -> int:
        """The current budget, unless another measured one beats it by more than
        ``switch_margin`` with both judged ``switch_confidence`` standard errors against the
        switch (the challenger low, the current high). At batch 1 a step adds one row's
        acceptance, so a few lucky or unlucky draws must not move the choice either way."""
        cfg = self.config
        z = cfg.switch_confidence
        low: dict[int, float] = {}
        high: dict[int, float] = {}
        mean: dict[int, float] = {}
        accepted_low = self._accepted_low(z)
        for n, cell in self._cells.get(bucket, {}).items():
            acceptance = self._acceptance[n]
            # 1.25 * mean absolute deviation estimates a standard deviation.
            cost_se = 1.25 * cell.mean_abs_residual / math.sqrt(min(cell.num_steps, 2.0 / cfg.cost_alpha - 1.0))
            mean[n] = (1.0 + acceptance.mean) / cell.seconds_per_row
            low[n] = (1.0 + max(0.0, accepted_low[n])) / (cell.seconds_per_row + z * cost_se)
            high[n] = (1.0 + acceptance.mean + z * acceptance.standard_error) / max(cell.seconds_per_row - z * cost_se,
                                                                                   0.5 * cell.seconds_per_row)
        if current not in mean:
            return max(mean, key=lambda n: (mean[n], -n))
        challengers = [n for n in mean if n != current]
        if not challengers:
            return current
        best = max(challengers, key=lambda n: (low[n], -n))
        return best if low[best] > (1.0 + cfg.switch_margin) * high[current] else current

    # ------------------------------------------------------------------ measurements
    def observe(self, *, num_rows: int, budget: int, nodes_per_row: Sequence[int],
                accepted_per_row: Sequence[int], verify_s: float, propose_s: float) -> None:
        """Record one finished step: ``budget`` is what ``tree_budget`` returned for it,
        ``nodes_per_row[i]`` the nodes row ``i`` verified (root included, ``<= budget``; merged or
        trimmed trees may be smaller), ``accepted_per_row[i]`` its accepted drafts (bonus token
        excluded, ``< nodes``), and the wall seconds of the propose and verify phases. Raises
        ``ValueError`` on inconsistent input, and then changes nothing."""
        self._check_rows(num_rows)
        if budget not in self.config.candidates:
            raise ValueError(f"budget {budget!r} is not one of the candidates {self.config.candidates}")
        if len(nodes_per_row) != num_rows or len(accepted_per_row) != num_rows:
            raise ValueError(f"expected {num_rows} nodes and accepted counts, got "
                             f"{len(nodes_per_row)} and {len(accepted_per_row)}")
        for nodes, accepted in zip(nodes_per_row, accepted_per_row):
            if not (is_int(nodes) and 1 <= nodes <= budget):
                raise ValueError(f"nodes per row must be ints in [1, budget={budget}], got {nodes!r}")
            if not (is_int(accepted) and 0 <= accepted < nodes):
                raise ValueError(f"accepted drafts must be ints in [0, nodes), got {accepted!r} of {nodes}")
        for name, seconds in (("verify_s", verify_s), ("propose_s", propose_s)):
            if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"{name} must be finite seconds >= 0, got {seconds!r}")

        cfg = self.config
        # Acceptance is credited to the budget, not to the tree's actual size: the rate of a
        # budget is what matters, including its rows whose trees came out smaller.
        for acceptance in self._acceptance.values():
            acceptance.decay(1.0 - cfg.acceptance_decay, cfg.prior_weight)
        for accepted in accepted_per_row:
            self._acceptance[budget].add(accepted)
        # The estimates stay monotone in the budget. A bigger budget drafts a tree that holds
        # what a smaller one drafts (the speculators keep their best paths first when a budget
        # cuts them), so it accepts at least as much; but its own evidence may predate a change
        # in the traffic (a suffix index that now holds the answers makes every budget accept
        # more), and judged on it the policy would keep the size it has. So where a bigger
        # budget's mean falls below a smaller one's, the two are pooled (weighted by their
        # evidence): the stale one rises towards the fresh one, and its next probes start there.
        _make_monotone([self._acceptance[n] for n in cfg.candidates])
        bucket = rows_bucket(num_rows)
        cells = self._cells.setdefault(bucket, {})
        per_row = (verify_s + propose_s) / num_rows
        clock = self._bucket_steps.get(bucket, 0)
        cell = cells.get(budget)
        if cell is None:
            cells[budget] = _CostCell.fresh(per_row, clock)
        else:
            cell.update(per_row, cfg.cost_alpha, cfg.outlier_clip, clock)
        current = self._current(bucket, num_rows)
        self._choice[bucket] = self._best_measured(bucket, current)
        self._bucket_rows[bucket] = num_rows
        self._bucket_steps[bucket] = clock + 1
        self._num_steps += 1

    # ------------------------------------------------------------------ introspection
    def snapshot(self) -> dict[str, Any]:
        """Current estimates, for the scheduler's ``stats`` (string keys, plain numbers)."""
        return {
            "num_steps": self._num_steps,
            "accepted_per_row": {str(n): round(a.mean, 4) for n, a in self._acceptance.items()},
            "budget_by_rows": {_bucket_label(b): self._choice[b] for b in sorted(self._choice)},
            "seconds_per_row": {
                _bucket_label(b): {str(n): round(c.seconds_per_row, 6) for n, c in sorted(cells.items())}
                for b, cells in sorted(self._cells.items())},
        }

    @staticmethod
    def _check_rows(num_rows: int) -> None:
        if not is_int(num_rows) or num_rows < 1:
            raise ValueError(f"num_rows must be an int >= 1, got {num_rows!r}")
