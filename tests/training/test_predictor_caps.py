"""The listMLE head and the cap-aware predictor: the loss and its gradient, a head that ranks
held-out prompts, a cap feature it reads, and the save/load round trip of a ``with_cap`` spec."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from treeserve.ops.length_predictor import (CAP_KNOTS, FeatureSpec, PredictorError, cap_features, evaluate, features,
                                            load_predictor, token_features)
from treeserve.training.length_heads import fit_listmle_predictor, listmle_loss


def test_listmle_gradient_matches_finite_differences_and_prefers_the_true_order() -> None:
    scores = np.random.default_rng(0).normal(size=(3, 6))
    loss, grad = listmle_loss(scores)
    eps = 1e-6
    for b in range(3):
        for k in range(6):
            bumped = scores.copy()
            bumped[b, k] += eps
            assert (listmle_loss(bumped)[0] - loss) / eps == pytest.approx(grad[b, k], abs=1e-5)
    in_order = np.array([[5.0, 4.0, 3.0, 2.0, 1.0]])  # lists are given longest first
    assert listmle_loss(in_order)[0] < listmle_loss(in_order[:, ::-1].copy())[0]


def _examples(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompts whose marker token (3..6) says short to long; each asked at a random cap; the job
    length is the answer's length up to the cap."""
    rng = np.random.default_rng(seed)
    x, lengths, caps = [], [], []
    for _ in range(n):
        ids = rng.integers(10, 400, 30).tolist()
        level = int(rng.integers(0, 4))
        ids[int(rng.integers(0, 30))] = 3 + level
        cap = int(rng.choice([8, 64, 512]))
        x.append(np.concatenate([token_features(ids, 64), cap_features(cap)]))
        lengths.append(min(cap, int(rng.integers(1, 40) + 100 * level)))
        caps.append(cap)
    return np.stack(x), np.array(lengths, dtype=np.float64), np.array(caps)


def test_a_listmle_head_with_the_cap_ranks_held_out_jobs() -> None:
    spec = FeatureSpec("tokens", num_buckets=64, with_cap=True)
    x, lengths, _ = _examples(400, 0)
    head = fit_listmle_predictor(x, lengths, spec, 512, num_steps=150)
    x_test, true, caps = _examples(200, 1)
    predicted = np.minimum(head.predict_features(x_test), caps)
    assert head.head == "listmle" and evaluate(predicted, true)["kendall_tau"] > 0.6
    # Without the cap's features the same head loses most of the order (the check can fail).
    blind = x_test.copy()
    blind[:, -len(CAP_KNOTS):] = cap_features(512)
    assert evaluate(head.predict_features(blind), true)["kendall_tau"] < evaluate(predicted, true)["kendall_tau"] - 0.1


def test_a_with_cap_spec_reads_max_tokens_and_survives_save_and_load(tmp_path: Path) -> None:
    spec = FeatureSpec("prompt_len", with_cap=True)
    assert features(spec, [1, 2, 3], max_tokens=8).tolist() == pytest.approx(
        [np.log1p(3), *[np.log1p(min(8, k)) for k in CAP_KNOTS]])
    with pytest.raises(PredictorError, match="max_tokens"):
        features(spec, [1, 2, 3])
    x, lengths, _ = _examples(50, 2)
    prompt_len = np.full((len(x), 1), np.log1p(30.0))  # what a prompt_len spec reads, then the cap
    head = fit_listmle_predictor(np.concatenate([prompt_len, x[:, -len(CAP_KNOTS):]], axis=1), lengths,
                                 FeatureSpec("prompt_len", with_cap=True), 512, num_steps=20)
    head.save(tmp_path / "h.npz")
    loaded = load_predictor(tmp_path / "h.npz")
    assert loaded.spec.with_cap and loaded.head == "listmle"
    assert loaded.predict_from_prompt_ids([1, 2, 3], max_tokens=8) == pytest.approx(
        head.predict_from_prompt_ids([1, 2, 3], max_tokens=8))
    assert loaded.predict_from_prompt_ids([1, 2, 3], max_tokens=8) != loaded.predict_from_prompt_ids([1, 2, 3], max_tokens=512)
