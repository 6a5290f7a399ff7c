"""Held-out figures of an output-length predictor: Kendall's tau-b, length buckets, and the
summary :func:`evaluate` gives (``treeserve.ops.length_predictor`` re-exports them)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

BUCKET_EDGES = (64, 128, 256, 512)
"""Bucket ``i`` holds lengths in ``[edges[i-1], edges[i])``; the last bucket is ``>= 512`` (capped)."""


class PredictorError(ValueError):
    """A predictor file, dataset or argument is unusable; the message says why."""


def kendall_tau(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Kendall's tau-b of two equal-length samples (ties in either handled); 0.0 when undefined.

    O(n^2) memory-chunked pair counting: fine for the few thousand points evaluated here.
    """
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise PredictorError(f"kendall_tau needs two 1-D samples of one length, got {a.shape} and {b.shape}")
    n = a.size
    concordant_minus_discordant = 0.0
    num_untied_a = num_untied_b = 0.0
    for start in range(0, n, 512):
        da = np.sign(a[start:start + 512, None] - a[None, :])  # (chunk, n)
        db = np.sign(b[start:start + 512, None] - b[None, :])
        concordant_minus_discordant += float((da * db).sum())
        num_untied_a += float((da != 0).sum())
        num_untied_b += float((db != 0).sum())
    if num_untied_a == 0 or num_untied_b == 0:
        return 0.0
    return concordant_minus_discordant / math.sqrt(num_untied_a * num_untied_b)


def bucket_of(lengths: np.ndarray, edges: Sequence[int] = BUCKET_EDGES) -> np.ndarray:
    """Bucket index of each length (see :data:`BUCKET_EDGES`)."""
    return np.searchsorted(np.asarray(edges), np.asarray(lengths, dtype=np.float64), side="right")


def evaluate(predicted: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """Held-out figures: ``mae_tokens``, ``bucket_accuracy``, ``kendall_tau``, ``num``."""
    predicted, true = np.asarray(predicted, dtype=np.float64), np.asarray(true, dtype=np.float64)
    return {
        "num": float(true.size),
        "mae_tokens": float(np.abs(predicted - true).mean()) if true.size else 0.0,
        "bucket_accuracy": float((bucket_of(predicted) == bucket_of(true)).mean()) if true.size else 0.0,
        "kendall_tau": kendall_tau(predicted, true),
    }


__all__ = ["BUCKET_EDGES", "PredictorError", "bucket_of", "evaluate", "kendall_tau"]
