"""Fitting and scoring the re-prediction head (:class:`~treeserve.ops.remaining_head.RemainingHead`)
on running rows' states recorded by ``bench/running_states.py``.

Every state of an answer that has not yet ended (``written < length``) is one example: its
features (:func:`~treeserve.ops.remaining_head.remaining_features`), whether the answer ran to the
cap, and, for one that ended by itself, ``log1p(length - written)``. The logistic head is fitted by
Newton's method with an L2 penalty, the ridge head in closed form; each penalty is chosen by
5-fold cross-validation over answers (an answer's states never sit on both sides of a fold).

:func:`score` gives, at fixed points of an answer (16, 32, 64, 128 and 256 tokens written), over
the held-out answers still running there: the AUC of ``P(cap)`` for the capped ones, the Kendall
tau of the predicted remaining tokens against the true ones, and the share of capped answers the
repetition watch has flagged by then (the re-prediction the scheduler had before this head).

Usage::

    python -m treeserve.training.remaining --data bench/out/running_states_512_q4_1_*.npz \\
        --out ops/data/remaining_smollm2-135m-instruct.npz --json
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from treeserve.ops.length_metrics import kendall_tau
from treeserve.ops.remaining_head import RemainingHead, expected_remaining, remaining_features

ALPHAS = (1.0, 10.0, 100.0, 1000.0, 10000.0)
CHECKPOINTS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class RunningStates:
    """``bench/running_states.py`` files, read together: per answer and per state (see there)."""

    is_test: np.ndarray
    prompt_len: np.ndarray
    length: np.ndarray
    is_capped: np.ndarray
    loop_at: np.ndarray
    state_job: np.ndarray
    state_written: np.ndarray
    states: np.ndarray
    cap: int
    every: int
    model: str

    @classmethod
    def load(cls, paths: Sequence[str | Path]) -> RunningStates:
        parts: dict[str, list[np.ndarray]] = {}
        num_jobs = 0
        meta: dict[str, object] = {}
        for path in paths:
            with np.load(path, allow_pickle=False) as data:
                meta = ast.literal_eval(str(data["meta"]))  # a dict literal written by repr()
                for name in ("is_test", "prompt_len", "length", "is_capped", "loop_at", "state_written", "states"):
                    parts.setdefault(name, []).append(data[name])
                parts.setdefault("state_job", []).append(data["state_job"] + num_jobs)
                num_jobs += len(data["length"])
        if not parts:
            raise ValueError("no running-state files given")
        joined = {name: np.concatenate(arrays) for name, arrays in parts.items()}
        return cls(**joined, cap=int(meta["max_tokens"]), every=int(meta["state_every"]),  # type: ignore[arg-type]
                   model=str(meta["model"]))

    def examples(self, test: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Features, capped flags, true remaining tokens, answer index and tokens written of the
        states of unfinished answers in the held-out (``test``) or training split."""
        job = self.state_job
        keep = (self.state_written < self.length[job]) & (self.is_test[job] == test)
        job, written = job[keep], self.state_written[keep]
        x = remaining_features(self.states[keep].astype(np.float64), written, self.prompt_len[job])
        return x, self.is_capped[job].astype(np.float64), (self.length[job] - written).astype(np.float64), job, written


def _standardize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    return mean, np.where(scale > 1e-8, scale, 1.0)


def _logistic(z: np.ndarray, y: np.ndarray, alpha: float, steps: int = 25) -> tuple[np.ndarray, float]:
    """L2-penalized logistic regression by Newton's method (the intercept unpenalized)."""
    a = np.concatenate([z, np.ones((len(z), 1))], axis=1)
    w = np.zeros(a.shape[1])
    penalty = alpha * np.eye(a.shape[1])
    penalty[-1, -1] = 0.0
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-np.clip(a @ w, -40, 40)))
        grad = a.T @ (p - y) + penalty @ w
        hess = (a * (p * (1 - p))[:, None]).T @ a + penalty + 1e-9 * np.eye(a.shape[1])
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-7:
            break
    return w[:-1], float(w[-1])


def _ridge(z: np.ndarray, y: np.ndarray, alpha: float) -> tuple[np.ndarray, float]:
    mean = float(y.mean())
    w = np.linalg.solve(z.T @ z + alpha * np.eye(z.shape[1]), z.T @ (y - mean))
    return w, mean


def _log_loss(z: np.ndarray, y: np.ndarray, w: np.ndarray, b: float) -> float:
    p = np.clip(1.0 / (1.0 + np.exp(-np.clip(z @ w + b, -40, 40))), 1e-9, 1 - 1e-9)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def _choose_alpha(z: np.ndarray, y: np.ndarray, groups: np.ndarray, logistic: bool, seed: int) -> float:
    folds = np.random.default_rng(seed).integers(0, 5, size=int(groups.max()) + 1)[groups]
    best, best_err = ALPHAS[0], math.inf
    for alpha in ALPHAS:
        err = 0.0
        for k in range(5):
            train, held = folds != k, folds == k
            if logistic:
                w, b = _logistic(z[train], y[train], alpha)
                err += _log_loss(z[held], y[held], w, b)
            else:
                w, b = _ridge(z[train], y[train], alpha)
                err += float(np.mean((z[held] @ w + b - y[held]) ** 2))
        if err < best_err:
            best, best_err = alpha, err
    return best


def fit(data: RunningStates, seed: int = 0) -> RemainingHead:
    """Both heads on the training split's states (see the module docstring)."""
    x, capped, remaining, job, _ = data.examples(test=False)
    mean, scale = _standardize(x)
    z = (x - mean) / scale
    alpha_cap = _choose_alpha(z, capped, job, True, seed)
    w_cap, b_cap = _logistic(z, capped, alpha_cap)
    ends = capped == 0
    alpha_len = _choose_alpha(z[ends], np.log1p(remaining[ends]), job[ends], False, seed)
    w_len, b_len = _ridge(z[ends], np.log1p(remaining[ends]), alpha_len)
    meta = {"alpha_cap": alpha_cap, "alpha_len": alpha_len, "num_answers": int(len(np.unique(job))),
            "num_states": int(len(job))}
    return RemainingHead(data.model, x.shape[1] - 2, data.every, data.cap, mean, scale, w_cap, b_cap, w_len, b_len, meta)


def _auc(score: np.ndarray, label: np.ndarray) -> float:
    pos, neg = score[label == 1], score[label == 0]
    if not len(pos) or not len(neg):
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    ranks = np.empty(len(order))
    ranks[order] = np.arange(1, len(order) + 1)
    return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def score(head: RemainingHead, data: RunningStates) -> dict[str, dict[str, float]]:
    """Held-out figures per checkpoint (see the module docstring)."""
    x, capped, remaining, job, written = data.examples(test=True)
    out: dict[str, dict[str, float]] = {}
    for point in CHECKPOINTS:
        at = written == point
        if at.sum() < 10:
            continue
        p_cap, log_len = head.heads(x[at])
        predicted = expected_remaining(p_cap, log_len, data.cap - point)
        loops = data.loop_at[job[at]]
        flagged = (loops >= 0) & (loops <= point)
        out[str(point)] = {
            "answers": int(at.sum()), "capped": int(capped[at].sum()),
            "auc_cap": round(_auc(p_cap, capped[at]), 3),
            "tau_remaining": round(kendall_tau(predicted, remaining[at]), 3),
            "repeat_watch_flagged_capped": round(float(flagged[capped[at] == 1].mean()), 3)
            if capped[at].sum() else float("nan"),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--data", nargs="+", required=True, help="bench/running_states.py files")
    parser.add_argument("--out", type=Path, default=None, help="save the fitted head here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    data = RunningStates.load(args.data)
    head = fit(data)
    report = {"fit": head.meta, "held_out": score(head, data)}
    if args.out is not None:
        head.save(args.out)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
