"""``AdaptiveConfig``: the knobs of the adaptive speculation policy
(:class:`~treeserve.actors.scheduler.adaptive.AdaptiveSpeculation`), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (the config's and the policy's counts)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class AdaptiveConfig:
    """Knobs of :class:`~treeserve.actors.scheduler.adaptive.AdaptiveSpeculation`; validated on construction
    with ``ValueError``.

    ``candidates``: tree budgets in nodes per row, root included, strictly increasing and
    starting at 1 (no speculation is always allowed); keep the largest <= the scheduler's
    ``max_tree_nodes``. ``acceptance_decay``: fraction of the acceptance evidence forgotten per
    step (every budget). ``cost_alpha``: EMA weight of one step's cost in its cell.
    ``explore_every``: at most one probe of another budget per this many steps of a bucket (4x
    as often while a neighbour has fewer than 3 steps measured or looks better).
    ``explore_cost``: the fraction of a bucket's time that the probes of each measured, worse
    neighbour may cost (up to a 64 * ``explore_every`` step interval). ``switch_margin``:
    relative gain needed to leave the current budget, with rates taken ``switch_confidence``
    standard errors against the switch.
    ``outlier_clip``: a cost residual is clipped at this many running mean absolute residuals.
    ``prior_accepted_per_doubling``: the prior of ``A(n)`` is this times ``log2(n)``, capped at
    ``n - 1`` and worth ``prior_weight`` rows; forgetting never takes an estimate below that
    weight. ``prior_verify_s``/``prior_propose_s``: ``(base, per_row, per_node)`` seconds of a
    step, used only for the very first choice (``per_node`` of propose counts drafted nodes).
    """

    candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    acceptance_decay: float = 0.02
    cost_alpha: float = 0.1
    explore_every: int = 16
    explore_cost: float = 0.005
    switch_margin: float = 0.02
    switch_confidence: float = 1.0
    outlier_clip: float = 4.0
    prior_weight: float = 4.0
    prior_accepted_per_doubling: float = 0.8
    prior_verify_s: tuple[float, float, float] = (0.05, 0.002, 0.002)
    prior_propose_s: tuple[float, float, float] = (0.005, 0.0005, 0.001)

    def __post_init__(self) -> None:
        cands = self.candidates
        if not isinstance(cands, tuple) or not cands or not all(is_int(c) for c in cands):
            raise ValueError(f"AdaptiveConfig.candidates must be a non-empty tuple of ints, got {cands!r}")
        if cands[0] != 1:
            raise ValueError(f"AdaptiveConfig.candidates must start at 1 (no speculation), got {cands!r}")
        if any(b <= a for a, b in zip(cands, cands[1:])):
            raise ValueError(f"AdaptiveConfig.candidates must be strictly increasing, got {cands!r}")
        if not (isinstance(self.acceptance_decay, (int, float)) and 0 <= self.acceptance_decay < 1):
            raise ValueError(f"AdaptiveConfig.acceptance_decay must be in [0, 1), got {self.acceptance_decay!r}")
        if not (isinstance(self.cost_alpha, (int, float)) and 0 < self.cost_alpha <= 1):
            raise ValueError(f"AdaptiveConfig.cost_alpha must be in (0, 1], got {self.cost_alpha!r}")
        if not (isinstance(self.switch_margin, (int, float)) and 0 <= self.switch_margin < 1):
            raise ValueError(f"AdaptiveConfig.switch_margin must be in [0, 1), got {self.switch_margin!r}")
        if not (isinstance(self.switch_confidence, (int, float)) and 0 <= self.switch_confidence <= 10):
            raise ValueError(f"AdaptiveConfig.switch_confidence must be in [0, 10], got {self.switch_confidence!r}")
        if not (isinstance(self.explore_cost, (int, float)) and 0 < self.explore_cost <= 1):
            raise ValueError(f"AdaptiveConfig.explore_cost must be in (0, 1], got {self.explore_cost!r}")
        if not is_int(self.explore_every) or self.explore_every < 2:
            raise ValueError(f"AdaptiveConfig.explore_every must be an int >= 2, got {self.explore_every!r}")
        for name in ("outlier_clip", "prior_weight"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 1):
                raise ValueError(f"AdaptiveConfig.{name} must be finite and >= 1, got {value!r}")
        per_doubling = self.prior_accepted_per_doubling
        if not (isinstance(per_doubling, (int, float)) and math.isfinite(per_doubling) and per_doubling >= 0):
            raise ValueError(
                f"AdaptiveConfig.prior_accepted_per_doubling must be finite and >= 0, got {per_doubling!r}")
        for name in ("prior_verify_s", "prior_propose_s"):
            value = getattr(self, name)
            if (not isinstance(value, tuple) or len(value) != 3
                    or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in value)):
                raise ValueError(f"AdaptiveConfig.{name} must be 3 finite seconds >= 0 "
                                 f"(base, per_row, per_node), got {value!r}")
        if self.prior_verify_s[0] <= 0:
            raise ValueError(f"AdaptiveConfig.prior_verify_s base must be > 0, got {self.prior_verify_s!r}")


__all__ = ["AdaptiveConfig", "is_int"]
