"""The length predictor's trained heads beyond ridge regression, fit offline only: ``rank``
(:func:`fit_rank_predictor`: the ridge solution refined by a pairwise ranking loss),
``listmle`` (:func:`fit_listmle_predictor`: the listwise ranking loss of vllm-ltr) and
``ordinal`` (:func:`fit_ordinal_predictor`: cumulative-link scores over length buckets). The
server loads any of them as a :class:`~treeserve.ops.length_predictor.Predictor`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from treeserve.ops.length_predictor import BUCKET_EDGES, FeatureSpec, Predictor, bucket_of, fit_predictor, kendall_tau

def pairwise_rank_loss(scores: np.ndarray, log_lengths: np.ndarray) -> tuple[float, np.ndarray]:
    """Weighted pairwise logistic loss of ``scores`` ``(N,)`` against the true order, and its gradient.

    Every pair with ``log_lengths[j] > log_lengths[i]`` adds
    ``|Δ log length| * log(1 + exp(-(s_j - s_i)))``, normalised by the total weight: pairs far
    apart in length matter most, tied pairs (two capped answers) not at all.
    """
    diff_y = log_lengths[None, :] - log_lengths[:, None]  # (N, N): > 0 where j is longer than i
    weight = np.where(diff_y > 0, diff_y, 0.0)
    total = float(weight.sum())
    if total == 0.0:
        return 0.0, np.zeros_like(scores)
    margin = scores[None, :] - scores[:, None]  # (N, N): s_j - s_i
    loss = float((weight * np.logaddexp(0.0, -margin)).sum()) / total
    g = weight * (0.5 * (1.0 - np.tanh(0.5 * margin))) / total  # weight * sigmoid(-margin) / total
    grad = g.sum(axis=1) - g.sum(axis=0)  # d/ds_i: +g_ij (s_i raises the loss), d/ds_j: -g_ij
    return loss, grad


def _tuned_head(ridge: Predictor, z: np.ndarray, lengths: np.ndarray, l2: Sequence[float],
                fit: Callable[[np.ndarray, float], np.ndarray], order: np.ndarray, spec: FeatureSpec,
                max_tokens: int, meta: dict[str, Any], head: str) -> Predictor:
    """What the ``rank`` and ``ordinal`` heads share once ``fit(indices, l2) -> weights`` is
    given: the L2 strength chosen by Kendall's tau on an inner 80/20 split (``order``, a
    permutation), the weights fit on every example, and the score rescaled by least squares to
    estimate ``log1p(length)`` (a positive scale keeps the order). A score that anti-correlates
    with length keeps ``ridge``."""
    y = np.log1p(lengths)
    inner_val, inner_train = order[: y.size // 5], order[y.size // 5:]
    best_strength, best_tau = l2[0], -math.inf
    if len(l2) > 1 and inner_val.size >= 10:
        for strength in l2:
            tau = kendall_tau(z[inner_val] @ fit(inner_train, strength), lengths[inner_val])
            if tau > best_tau:
                best_strength, best_tau = strength, tau
    w = fit(np.arange(y.size), best_strength)
    score = z @ w
    centred = score - score.mean()
    slope = float(centred @ (y - y.mean()) / max(float(centred @ centred), 1e-12))
    if not slope > 0:
        return ridge
    intercept = float(y.mean() - slope * score.mean())
    full_meta = {**ridge.meta, "l2": best_strength, "inner_tau": best_tau, **meta}
    return Predictor(spec, ridge.mean, ridge.scale, slope * w, intercept, max_tokens, full_meta, head=head)


def _adam_toward(w0: np.ndarray, loss_grad: Callable[[np.ndarray], np.ndarray], strength: float,
                 num_steps: int, lr: float) -> np.ndarray:
    """``num_steps`` of Adam from ``w0`` on a loss whose gradient at ``w`` is ``loss_grad(w)``, plus
    ``strength * |w - w0|^2`` (what the ``rank`` and ``listmle`` heads refine the ridge weights by)."""
    w, m, v = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    for step in range(1, num_steps + 1):
        grad = loss_grad(w) + 2.0 * strength * (w - w0)
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad**2
        w -= lr * (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.999**step)) + 1e-8)
    return w


def fit_rank_predictor(x: np.ndarray, lengths: np.ndarray, spec: FeatureSpec, max_tokens: int, *,
                       l2: Sequence[float] = (0.1, 1.0, 10.0), num_steps: int = 150, lr: float = 0.05,
                       max_pairs_n: int = 3000, seed: int = 0) -> Predictor:
    """A ``rank`` head: the ridge head of :func:`fit_predictor`, refined by Adam on
    :func:`pairwise_rank_loss` (plus ``l2 * |w - w_ridge|^2``), then rescaled by least squares so
    that the score estimates ``log1p(length)`` again (the order is unchanged by a positive scale).

    The L2 strength is chosen on an inner 80/20 split by Kendall's tau. At most ``max_pairs_n``
    examples (a seeded subsample) enter the O(N^2) pair loss per step; all enter the rescale.
    """
    x, lengths = np.asarray(x, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
    ridge = fit_predictor(x, lengths, spec, max_tokens, seed=seed)
    z = (x - ridge.mean) / ridge.scale
    y = np.log1p(lengths)
    rng = np.random.default_rng(seed)

    def refine(idx: np.ndarray, strength: float) -> np.ndarray:
        sub = idx if idx.size <= max_pairs_n else rng.choice(idx, max_pairs_n, replace=False)
        zs, ys = z[sub], y[sub]
        return _adam_toward(ridge.weights.copy(), lambda w: zs.T @ pairwise_rank_loss(zs @ w, ys)[1],
                            strength, num_steps, lr)

    order = rng.permutation(y.size)
    return _tuned_head(ridge, z, lengths, l2, refine, order, spec, max_tokens, {"num_steps": num_steps}, "rank")


def ordinal_loss(scores: np.ndarray, thresholds: np.ndarray, buckets: np.ndarray
                 ) -> tuple[float, np.ndarray, np.ndarray]:
    """Mean negative log-likelihood of bucket labels under a proportional-odds model, and its
    gradients with respect to ``scores`` ``(N,)`` and ``thresholds`` ``(K-1,)`` (increasing).

    ``P(bucket > k) = sigmoid(score - thresholds[k])``, so bucket ``k`` of ``K`` has probability
    ``sigmoid(t_k - s) - sigmoid(t_{k-1} - s)`` (``t_{-1} = -inf``, ``t_{K-1} = +inf``). The top
    bucket holds the capped answers: a censored length is only "at least the cap", which is
    exactly what the top bucket's likelihood says, and ties inside a bucket cost nothing.
    """
    num, num_cuts = scores.size, thresholds.size
    rows = np.arange(num)
    upper_cut, lower_cut = np.minimum(buckets, num_cuts - 1), np.maximum(buckets - 1, 0)
    has_upper, has_lower = buckets < num_cuts, buckets > 0
    cdf = 0.5 * (1.0 + np.tanh(0.5 * (thresholds[None, :] - scores[:, None])))  # (N, K-1): P(bucket <= k)
    density = cdf * (1.0 - cdf)
    upper = np.where(has_upper, cdf[rows, upper_cut], 1.0)
    lower = np.where(has_lower, cdf[rows, lower_cut], 0.0)
    prob = np.maximum(upper - lower, 1e-12)
    d_upper = np.where(has_upper, density[rows, upper_cut], 0.0)
    d_lower = np.where(has_lower, density[rows, lower_cut], 0.0)
    loss = float(-np.log(prob).mean())
    grad_scores = (d_upper - d_lower) / prob / num
    grad_thresholds = np.zeros(num_cuts)
    np.add.at(grad_thresholds, upper_cut[has_upper], -(d_upper / prob)[has_upper] / num)
    np.add.at(grad_thresholds, lower_cut[has_lower], (d_lower / prob)[has_lower] / num)
    return loss, grad_scores, grad_thresholds


def fit_ordinal_predictor(x: np.ndarray, lengths: np.ndarray, spec: FeatureSpec, max_tokens: int, *,
                          edges: Sequence[int] = BUCKET_EDGES, l2: Sequence[float] = (1.0, 10.0, 100.0, 1000.0),
                          num_steps: int = 300, lr: float = 0.05, seed: int = 0) -> Predictor:
    """An ``ordinal`` head: a proportional-odds model of the length bucket (:func:`ordinal_loss`
    over ``edges``, the capped answers in the top bucket), started from the ridge head and fit by
    Adam with ``l2 * |w|^2 / N``, then rescaled by least squares so that the score estimates
    ``log1p(length)`` (a positive scale keeps the order; the thresholds are dropped).

    The L2 strength is chosen on an inner 80/20 split by Kendall's tau. Each step is O(N * K),
    so unlike the pairwise ``rank`` head it uses every example.
    """
    x, lengths = np.asarray(x, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
    ridge = fit_predictor(x, lengths, spec, max_tokens, seed=seed)
    z = (x - ridge.mean) / ridge.scale
    y = np.log1p(lengths)
    buckets = bucket_of(lengths, edges)
    num_cuts = len(edges)

    def fit(idx: np.ndarray, strength: float) -> np.ndarray:
        zs, bs = z[idx], buckets[idx]
        w = ridge.weights.copy()
        start = zs @ w
        cuts = np.array([np.quantile(start, min(max((bs <= k).mean(), 0.01), 0.99)) for k in range(num_cuts)])
        # Increasing thresholds: the first one free, then softplus steps (log(expm1(step)) inverts softplus).
        first, steps = cuts[:1], np.log(np.expm1(np.maximum(np.diff(cuts), 1e-3)))
        params = [w, first, steps]
        moments = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
        for step in range(1, num_steps + 1):
            w, first, steps = params
            thresholds = np.concatenate([first, first + np.cumsum(np.logaddexp(0.0, steps))])
            _, grad_s, grad_t = ordinal_loss(zs @ w, thresholds, bs)
            grad_w = zs.T @ grad_s + 2.0 * strength * w / idx.size
            # t_j = first + sum_{i < j} softplus(steps_i): dt_j/dsteps_i = sigmoid(steps_i) for i < j.
            grad_steps = np.cumsum(grad_t[::-1])[::-1][1:] * 0.5 * (1.0 + np.tanh(0.5 * steps))
            grads = [grad_w, np.array([grad_t.sum()]), grad_steps]
            for i, grad in enumerate(grads):
                m, v = moments[i]
                m = 0.9 * m + 0.1 * grad
                v = 0.999 * v + 0.001 * grad**2
                moments[i] = (m, v)
                params[i] = params[i] - lr * (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.999**step)) + 1e-8)
        return params[0]

    order = np.random.default_rng(seed).permutation(y.size)
    return _tuned_head(ridge, z, lengths, l2, fit, order, spec, max_tokens,
                       {"num_steps": num_steps, "bucket_edges": list(edges)}, "ordinal")


def listmle_loss(scores: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean listMLE loss of lists of ``scores`` ``(B, K)``, each row already in the true order
    (longest first), and its gradient.

    The Plackett-Luce likelihood of that order: the longest job is drawn first with probability
    ``softmax(s)`` over the whole list, the next from the rest, and so on; the loss is
    ``sum_i logsumexp(s[i:]) - s[i]`` per list, averaged over lists.
    """
    shifted = scores - scores.max(axis=1, keepdims=True)
    tail = np.logaddexp.accumulate(shifted[:, ::-1], axis=1)[:, ::-1]  # (B, K): logsumexp(s[i:])
    loss = float((tail - shifted).sum(axis=1).mean())
    # d/ds_p: sum over draws i <= p of softmax_i(p), less 1 for its own draw.
    grad = np.exp(shifted) * np.cumsum(np.exp(-tail), axis=1) - 1.0
    return loss, grad / scores.shape[0]


def fit_listmle_predictor(x: np.ndarray, lengths: np.ndarray, spec: FeatureSpec, max_tokens: int, *,
                          l2: Sequence[float] = (0.1, 1.0, 10.0), num_steps: int = 300, lr: float = 0.02,
                          list_size: int = 32, lists_per_step: int = 64, seed: int = 0) -> Predictor:
    """A ``listmle`` head: the ridge head of :func:`fit_predictor`, refined by Adam on
    :func:`listmle_loss` over random lists of ``list_size`` examples (``lists_per_step`` lists a
    step, ties in length broken at random, plus ``l2 * |w - w_ridge|^2``), then rescaled by least
    squares so that the score estimates ``log1p(length)`` (the order is unchanged). The L2
    strength is chosen on an inner 80/20 split by Kendall's tau. Each step costs
    ``O(lists_per_step * list_size * F)``, whatever the number of examples.
    """
    x, lengths = np.asarray(x, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
    ridge = fit_predictor(x, lengths, spec, max_tokens, seed=seed)
    z = (x - ridge.mean) / ridge.scale
    y = np.log1p(lengths)
    rng = np.random.default_rng(seed)

    def refine(idx: np.ndarray, strength: float) -> np.ndarray:
        size = min(list_size, idx.size)

        def loss_grad(w: np.ndarray) -> np.ndarray:
            picks = np.stack([rng.choice(idx, size, replace=False) for _ in range(lists_per_step)])  # (B, K)
            jitter = rng.random(picks.shape)  # random order among equal lengths
            order = np.lexsort((jitter, -y[picks]), axis=1)  # longest first
            zs = z[np.take_along_axis(picks, order, axis=1)]  # (B, K, F)
            _, grad_s = listmle_loss(zs @ w)
            return np.einsum("bk,bkf->f", grad_s, zs)

        return _adam_toward(ridge.weights.copy(), loss_grad, strength, num_steps, lr)

    order = rng.permutation(y.size)
    return _tuned_head(ridge, z, lengths, l2, refine, order, spec, max_tokens,
                       {"num_steps": num_steps, "list_size": list_size}, "listmle")
