"""The ranking head, the lookup oracle and the held-out test split of the length predictor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from treeserve.ops.length_predictor import prompt_key
from treeserve.training.length_heads import pairwise_rank_loss
from treeserve.training.predictor import train_predictor
from treeserve.ops.length_predictor import HEADS, FeatureSpec, PredictorError, evaluate, load_predictor, lookup_predictor, token_features
from treeserve.training.length_heads import fit_rank_predictor
from treeserve.training.length_data import TEST_FRACTION, LengthExample, is_test_prompt


def _graded_examples(n: int, seed: int, prefix: str = "") -> list[LengthExample]:
    """A marker token per length class (tokens 3..6: short to long) amid random tokens; the prompt
    length says nothing. Lengths within a class are noisy and the longest class hits the cap."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(10, 400, int(rng.integers(5, 60))).tolist()
        level = int(rng.integers(0, 4))
        ids[int(rng.integers(0, len(ids)))] = 3 + level
        length = int(min(256, rng.integers(1, 40) + 70 * level))
        out.append(LengthExample("synthetic", f"{prefix}{i}", tuple(ids), length, length == 256))
    return out


def test_pairwise_rank_loss_gradient_matches_finite_differences() -> None:
    rng = np.random.default_rng(3)
    scores, log_len = rng.normal(size=12), np.log1p(rng.integers(1, 300, 12).astype(float))
    log_len[3] = log_len[5]  # a tie adds nothing
    loss, grad = pairwise_rank_loss(scores, log_len)
    eps = 1e-6
    for i in range(12):
        bumped = scores.copy()
        bumped[i] += eps
        assert (pairwise_rank_loss(bumped, log_len)[0] - loss) / eps == pytest.approx(grad[i], abs=1e-5)
    # Scoring in the true order costs less than scoring in the reverse order.
    assert pairwise_rank_loss(log_len, log_len)[0] < pairwise_rank_loss(-log_len, log_len)[0]
    assert pairwise_rank_loss(scores, np.zeros(12)) == (0.0, pytest.approx(np.zeros(12)))


def test_rank_head_ranks_held_out_prompts_and_a_constant_does_not() -> None:
    train, test = _graded_examples(300, 0), _graded_examples(200, 1, prefix="t")
    report = train_predictor(train, FeatureSpec("tokens", num_buckets=1024), head="rank", test=test,
                             compare=[FeatureSpec("prompt_len")], max_tokens=256)
    assert report.predictor.head == "rank" and report.held_out["tokens@1024"]["num"] == 200
    assert report.held_out["tokens@1024"]["kendall_tau"] > 0.5
    assert abs(report.held_out["prompt_len"]["kendall_tau"]) < 0.2  # the length alone says nothing
    true = np.array([e.num_output_tokens for e in test], dtype=float)
    assert evaluate(np.full(true.size, 100.0), true)["kendall_tau"] == 0.0  # the same check fails for a constant
    # The score still estimates the length in tokens (rescaled after ranking), within the cap.
    predicted = report.held_out_predictions["tokens@1024"]
    assert 1.0 <= predicted.min() and predicted.max() <= 256.0
    assert evaluate(predicted, true)["mae_tokens"] < 60


def test_rank_head_saves_and_loads(tmp_path: Path) -> None:
    examples = _graded_examples(120, 2)
    x = np.stack([token_features(e.prompt_ids, 64) for e in examples])
    head = fit_rank_predictor(x, np.array([e.num_output_tokens for e in examples]), FeatureSpec("tokens", num_buckets=64),
                              256, num_steps=30)
    head.save(tmp_path / "rank.npz")
    back = load_predictor(tmp_path / "rank.npz")
    assert back.head == "rank" and np.allclose(back.predict_features(x), head.predict_features(x), rtol=1e-4)


def test_lookup_predictor_returns_recorded_lengths_and_max_tokens_otherwise(tmp_path: Path) -> None:
    oracle = lookup_predictor([(1, 2, 3), (4, 5), (9,)], [17, 240, 3], max_tokens=256)
    oracle.save(tmp_path / "oracle.npz")
    back = load_predictor(tmp_path / "oracle.npz")
    assert back.spec.is_lookup and not back.spec.needs_model
    assert back.predict_from_prompt_ids([4, 5]) == 240.0
    assert back.predict_from_prompt_ids([1, 2, 3]) == 17.0
    assert back.predict_from_prompt_ids([1, 2]) == 256.0  # unknown prompt: the longest it can be
    batch = np.stack([back.prompt_features(p) for p in ([9], [4, 5], [7])])
    assert back.predict_features(batch).tolist() == [3.0, 240.0, 256.0]
    assert prompt_key([1, 2, 3]) != prompt_key([1, 2, 4]) and prompt_key([1]) == prompt_key([1])
    with pytest.raises(PredictorError):
        lookup_predictor([(1,)], [1, 2], 8)


def test_test_split_is_a_fixed_fifth_of_each_set_and_never_trained_on() -> None:
    ids = [str(i) for i in range(4000)]
    share = sum(is_test_prompt("mtbench", i) for i in ids) / len(ids)
    assert abs(share - TEST_FRACTION) < 0.03
    assert [is_test_prompt("gsm8k", i) for i in ids[:50]] == [is_test_prompt("gsm8k", i) for i in ids[:50]]
    examples = _graded_examples(40, 4)
    with pytest.raises(PredictorError, match="also a training prompt"):
        train_predictor(examples, FeatureSpec("prompt_len"), test=examples[:5])


def test_ordinal_loss_gradients_match_finite_differences() -> None:
    from treeserve.training.length_heads import ordinal_loss

    rng = np.random.default_rng(5)
    scores, thresholds = rng.normal(size=15), np.array([-1.0, -0.2, 0.5, 1.4])
    buckets = np.array([0, 1, 2, 3, 4] * 3)
    loss, grad_s, grad_t = ordinal_loss(scores, thresholds, buckets)
    eps = 1e-6
    for i in range(15):
        bumped = scores.copy()
        bumped[i] += eps
        assert (ordinal_loss(bumped, thresholds, buckets)[0] - loss) / eps == pytest.approx(grad_s[i], abs=1e-5)
    for k in range(4):
        bumped = thresholds.copy()
        bumped[k] += eps
        assert (ordinal_loss(scores, bumped, buckets)[0] - loss) / eps == pytest.approx(grad_t[k], abs=1e-5)
    # Scores in the buckets' order cost less than the reverse order.
    ordered = buckets.astype(float) - 2.0
    assert ordinal_loss(ordered, thresholds, buckets)[0] < ordinal_loss(-ordered, thresholds, buckets)[0]


def test_ordinal_head_ranks_held_out_prompts_saves_and_loads(tmp_path: Path) -> None:
    train, test = _graded_examples(300, 0), _graded_examples(200, 1, prefix="t")
    report = train_predictor(train, FeatureSpec("tokens", num_buckets=1024), head="ordinal", test=test, max_tokens=256)
    predictor = report.predictor
    assert predictor.head == "ordinal" and report.held_out["tokens@1024"]["kendall_tau"] > 0.5
    assert predictor.meta["bucket_edges"] == [64, 128, 256, 512] and predictor.meta["l2"] in (1.0, 10.0, 100.0, 1000.0)
    predictor.save(tmp_path / "ordinal.npz")
    loaded = load_predictor(tmp_path / "ordinal.npz")
    assert loaded.head == "ordinal"
    x = token_features(test[0].prompt_ids, 1024)
    assert loaded.predict_features(x) == pytest.approx(predictor.predict_features(x))
    assert 1.0 <= loaded.predict_features(x) <= 256.0


@pytest.mark.parametrize("head", HEADS)
def test_every_head_trains_through_train_predictor(head: str) -> None:
    # train-predictor's run() fits every head of HEADS on the same features: each must be dispatched.
    train, test = _graded_examples(200, 0), _graded_examples(100, 1, prefix="t")
    report = train_predictor(train, FeatureSpec("tokens", num_buckets=1024), head=head, test=test, max_tokens=256)
    assert report.predictor.head == head
    assert report.held_out["tokens@1024"]["kendall_tau"] > 0.4
