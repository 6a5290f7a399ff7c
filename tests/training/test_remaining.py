"""Fitting the re-prediction head: it finds a signal planted in the states, and finds none when
the labels are shuffled (so its held-out scores are not an artefact of the split)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from treeserve.ops.remaining_head import load_remaining_head
from treeserve.training.remaining import RunningStates, fit, score

DIM = 16
CAP = 256
EVERY = 16


def planted(seed: int = 0, shuffle_labels: bool = False, num: int = 240) -> RunningStates:
    """Answers whose states carry, along axis 0, whether they run to the cap and, along axis 1,
    the log of what remains of one that ends (plus noise everywhere)."""
    rng = np.random.default_rng(seed)
    capped = rng.random(num) < 0.5
    length = np.where(capped, CAP, rng.integers(20, CAP - 10, size=num))
    is_test = np.arange(num) % 4 == 0
    jobs, written, states = [], [], []
    for j in range(num):
        for w in range(EVERY, int(length[j]) + 1, EVERY):
            state = rng.normal(size=DIM)
            state[0] += 2.0 if capped[j] else -2.0
            state[1] += 0.0 if capped[j] else np.log1p(length[j] - w)
            jobs.append(j), written.append(w), states.append(state)
    labels = capped.copy()
    if shuffle_labels:
        train = ~is_test
        labels[train] = rng.permutation(labels[train])
        length = np.where(labels, CAP, np.minimum(length, CAP - 1))
    return RunningStates(is_test=is_test, prompt_len=rng.integers(5, 50, size=num), length=length,
                         is_capped=labels, loop_at=np.full(num, -1), state_job=np.array(jobs),
                         state_written=np.array(written), states=np.array(states, dtype=np.float16),
                         cap=CAP, every=EVERY, model="tiny")


def test_the_head_finds_a_planted_signal_and_saves(tmp_path: Path) -> None:
    data = planted()
    head = fit(data)
    report = score(head, data)
    assert report, "no checkpoint had enough held-out answers"
    for point in report.values():
        assert point["auc_cap"] > 0.9
        assert point["tau_remaining"] > 0.4
    head.save(tmp_path / "head.npz")
    assert load_remaining_head(tmp_path / "head.npz").dim == DIM


def test_with_shuffled_training_labels_it_finds_nothing() -> None:
    data = planted(shuffle_labels=True)
    report = score(fit(data), planted())  # scored against the true held-out labels
    aucs = [point["auc_cap"] for point in report.values()]
    assert max(aucs) < 0.75
