"""Admission-order policies for the continuous-batching scheduler: their names and the factory.

The names are defined here once; the CLI, the server's config, the scheduler and the benches
use them. The pieces:

* :mod:`treeserve.actors.scheduler.policy_queue`: a queued request, the policy interface, the shared
  queue mechanics, and FCFS;
* :mod:`treeserve.actors.scheduler.policy_aging`: service-scaled aging deadlines (at most ``max_wait_s``
  after arrival) and the wait bound they give;
* :mod:`treeserve.actors.scheduler.policy_ssjf`: SSJF, shortest predicted output first;
* :mod:`treeserve.actors.scheduler.policy_hrrn`: HRRN, highest response ratio next.

The SJF oracle (shortest *true* length first) is an offline comparison bound, not a serving
policy: it lives with the scheduling benchmark, ``bench/scheduling.py``.
"""

from __future__ import annotations

import enum
import math

from treeserve.actors.scheduler.policy_aging import DEFAULT_AGING_TOKENS
from treeserve.actors.scheduler.policy_hrrn import HRRNPolicy, response_ratio
from treeserve.actors.scheduler.policy_queue import FCFSPolicy, QueuedRequest, SchedulingPolicy
from treeserve.actors.scheduler.policy_ssjf import SSJFPolicy


class PolicyName(enum.StrEnum):
    """The admission policies a server runs."""

    FCFS = "fcfs"
    SSJF = "ssjf"
    HRRN = "hrrn"

    @property
    def uses_predictions(self) -> bool:
        """Whether the policy orders by predicted output length (so a server runs the predictor)."""
        return self is not PolicyName.FCFS


POLICY_NAMES: tuple[str, ...] = tuple(p.value for p in PolicyName)
"""Every policy name, in the order ``--scheduler`` lists them."""
PREDICTION_POLICIES: tuple[str, ...] = tuple(p.value for p in PolicyName if p.uses_predictions)
"""The policies that order by the output-length predictor's predictions."""


def make_policy(name: str, **config: float) -> SchedulingPolicy:
    """Build a policy by name (``fcfs``, ``ssjf``, ``hrrn``).

    Options: ``max_wait_s``, the latest aging deadline after arrival (required for ``ssjf``,
    optional for ``hrrn``), and ``aging_tokens``, the job size that gets the full ``max_wait_s``
    (default :data:`~treeserve.actors.scheduler.policy_aging.DEFAULT_AGING_TOKENS`; ``1``: the same fixed
    wait for every request); ``fcfs`` takes none. Unknown names, unknown options and missing
    required options raise ``ValueError`` naming the valid ones.
    """
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown scheduling policy {name!r}; valid names: {', '.join(POLICY_NAMES)}")
    policy = PolicyName(name)
    allowed = () if policy is PolicyName.FCFS else ("max_wait_s", "aging_tokens")
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for policy {name!r}; "
            f"valid options: {', '.join(allowed) or 'none'}"
        )
    if policy is PolicyName.FCFS:
        return FCFSPolicy()
    if policy is PolicyName.SSJF:
        if "max_wait_s" not in config:
            raise ValueError("policy 'ssjf' needs max_wait_s (the aging bound, in seconds)")
        return SSJFPolicy(config["max_wait_s"], config.get("aging_tokens", DEFAULT_AGING_TOKENS))
    return HRRNPolicy(config.get("max_wait_s", math.inf), config.get("aging_tokens", DEFAULT_AGING_TOKENS))


__all__ = [
    "DEFAULT_AGING_TOKENS", "POLICY_NAMES", "PREDICTION_POLICIES", "FCFSPolicy", "HRRNPolicy", "PolicyName", "QueuedRequest",
    "SSJFPolicy", "SchedulingPolicy", "make_policy", "response_ratio",
]
