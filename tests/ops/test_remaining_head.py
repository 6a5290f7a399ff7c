"""The re-prediction head: its arithmetic, its file, and the shipped one."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from treeserve.models import DEFAULT_MODEL
from treeserve.ops.length_metrics import PredictorError
from treeserve.ops.remaining_head import RemainingHead, load_remaining_head, remaining_features

DIM = 6


def make_head(b_cap: float, b_len: float, w_cap: np.ndarray | None = None) -> RemainingHead:
    width = DIM + 2
    return RemainingHead("tiny", DIM, 16, 512, np.zeros(width), np.ones(width),
                         np.zeros(width) if w_cap is None else w_cap, b_cap, np.zeros(width), b_len)


def test_a_head_sure_of_the_cap_predicts_the_rest_of_it() -> None:
    head = make_head(b_cap=40.0, b_len=math.log1p(10))
    assert head.remaining(np.zeros(DIM), 100, 20, 300) == pytest.approx(200.0)


def test_a_head_sure_of_an_end_predicts_its_length_within_the_cap() -> None:
    head = make_head(b_cap=-40.0, b_len=math.log1p(10))
    assert head.remaining(np.zeros(DIM), 100, 20, 300) == pytest.approx(10.0)
    assert head.remaining(np.zeros(DIM), 295, 20, 300) == pytest.approx(5.0)  # never past the cap
    assert head.remaining(np.zeros(DIM), 300, 20, 300) == 1.0


def test_the_expectation_mixes_both_heads() -> None:
    head = make_head(b_cap=0.0, b_len=math.log1p(10))  # P(cap) = 1/2
    assert head.remaining(np.zeros(DIM), 100, 20, 300) == pytest.approx(0.5 * 200 + 0.5 * 10)


def test_the_state_moves_the_prediction() -> None:
    w_cap = np.zeros(DIM + 2)
    w_cap[0] = 10.0
    head = make_head(b_cap=0.0, b_len=math.log1p(10), w_cap=w_cap)
    looping, ending = np.eye(DIM)[0], -np.eye(DIM)[0]
    assert head.remaining(looping, 100, 20, 300) > 190 > 11 > head.remaining(ending, 100, 20, 300)


def test_features_are_the_state_and_two_logs() -> None:
    x = remaining_features(np.ones((2, DIM)), np.array([16, 32]), np.array([5, 5]))
    assert x.shape == (2, DIM + 2)
    np.testing.assert_allclose(x[:, -2:], np.log1p([[16, 5], [32, 5]]))


def test_it_refuses_a_state_of_another_model() -> None:
    with pytest.raises(PredictorError):
        make_head(0.0, 0.0).remaining(np.zeros(DIM + 1), 10, 10, 100)


def test_a_saved_head_loads_equal(tmp_path: Path) -> None:
    w_cap = np.arange(DIM + 2, dtype=np.float64) / 10
    head = make_head(b_cap=0.25, b_len=2.0, w_cap=w_cap)
    head.save(tmp_path / "head.npz")
    loaded = load_remaining_head(tmp_path / "head.npz")
    state = np.linspace(-1, 1, DIM)
    assert loaded.remaining(state, 40, 12, 512) == pytest.approx(head.remaining(state, 40, 12, 512), rel=1e-6)
    assert (loaded.model, loaded.dim, loaded.every, loaded.cap) == ("tiny", DIM, 16, 512)


def test_a_damaged_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(PredictorError):
        load_remaining_head(tmp_path / "bad.npz")


def test_the_shipped_head_is_the_default_models() -> None:
    head = load_remaining_head()
    assert head.model == DEFAULT_MODEL and head.dim == 576 and head.every >= 1
    assert head.meta["num_answers"] >= 500
