"""Re-prediction while running: how many tokens a running answer still needs, read from the
served model's own final hidden state (the state a verifier step returns for a row's last
accepted node), every few tokens.

A prompt says little about how long its answer runs; the answer, once started, says more. On the
default model about half of the chat answers run to the cap, most in a repetition loop, and the
hidden state shows where an answer is going well before a loop repeats a whole run of tokens.

:class:`RemainingHead` is two linear heads over the same standardized features (the state,
``log1p(tokens written)`` and ``log1p(prompt tokens)``):

* ``P(cap)``: a logistic head, the probability that the answer runs to the cap it was trained at;
* ``log1p(remaining)``: a ridge head, the tokens still to come of an answer that ends by itself.

:meth:`RemainingHead.remaining` combines them for a request capped at ``max_tokens``:
``p * (max_tokens - written) + (1 - p) * min(expm1(r), max_tokens - written)``, an expectation,
since shortest-remaining-first ranks by expected work. The heads are fitted by
:mod:`treeserve.training.remaining` on ``bench/running_states.py``'s answers; the shipped one
(:data:`DEFAULT_REMAINING_FILE`) is the default model's in its served format. Weights save to a
small ``.npz`` (arrays plus one JSON metadata string; no pickle). Numpy only: it runs in the
scheduler, on one state a request every :attr:`RemainingHead.every` tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from treeserve.ops.length_metrics import PredictorError
from treeserve.ops.length_predictor import read_weights_npz

DEFAULT_REMAINING_FILE = "data/remaining_smollm2-135m-instruct.npz"
_FORMAT_VERSION = 1


def remaining_features(states: np.ndarray, written: np.ndarray, prompt_len: np.ndarray) -> np.ndarray:
    """Unstandardized features ``(n, D + 2)`` of states ``(n, D)`` after ``written`` tokens of
    answers to prompts of ``prompt_len`` tokens."""
    states = np.asarray(states, dtype=np.float64).reshape(len(written), -1)
    extra = np.log1p(np.stack([np.asarray(written, np.float64), np.asarray(prompt_len, np.float64)], axis=1))
    return np.concatenate([states, extra], axis=1)


def expected_remaining(p_cap: np.ndarray, log_len: np.ndarray, left: np.ndarray | float) -> np.ndarray:
    """The heads' expectation of the tokens left, ``left`` of them at most:
    ``p * left + (1 - p) * min(expm1(log_len), left)`` (a negative ``log_len`` counts as 0)."""
    return p_cap * left + (1.0 - p_cap) * np.minimum(np.expm1(np.maximum(log_len, 0.0)), left)


@dataclass(frozen=True, eq=False)
class RemainingHead:
    """See the module docstring. ``model``: the served model it was fitted for, ``dim`` its
    hidden size; ``every``: tokens between the states it was fitted on (re-predict that often);
    ``cap``: the cap of its training answers."""

    model: str
    dim: int
    every: int
    cap: int
    mean: np.ndarray
    scale: np.ndarray
    w_cap: np.ndarray
    b_cap: float
    w_len: np.ndarray
    b_len: float
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        width = self.dim + 2
        for name in ("mean", "scale", "w_cap", "w_len"):
            if getattr(self, name).shape != (width,):
                raise PredictorError(f"RemainingHead.{name} must have shape ({width},), got {getattr(self, name).shape}")
        if self.every < 1 or self.cap < 1:
            raise PredictorError("RemainingHead.every and cap must be >= 1")

    def heads(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(P(cap), predicted log1p(remaining) if it ends by itself)`` per feature row."""
        z = (np.atleast_2d(features) - self.mean) / self.scale
        logit = np.clip(z @ self.w_cap + self.b_cap, -40.0, 40.0)
        return 1.0 / (1.0 + np.exp(-logit)), z @ self.w_len + self.b_len

    def remaining(self, state: np.ndarray, written: int, prompt_len: int, max_tokens: int) -> float:
        """Expected tokens still to write (>= 1) of an answer at ``written`` of ``max_tokens``
        tokens, its last state ``state`` ``(D,)``."""
        if np.shape(state) != (self.dim,):
            raise PredictorError(f"a state of shape {np.shape(state)} for a head of dim {self.dim}")
        features = remaining_features(np.asarray(state)[None], np.array([written]), np.array([prompt_len]))
        p_cap, log_len = self.heads(features)
        return max(1.0, float(expected_remaining(p_cap, log_len, max(1.0, float(max_tokens - written)))[0]))

    def save(self, path: str | Path) -> None:
        meta = {"format_version": _FORMAT_VERSION, "model": self.model, "dim": self.dim, "every": self.every,
                "cap": self.cap, "b_cap": self.b_cap, "b_len": self.b_len, "meta": self.meta}
        with Path(path).open("wb") as handle:
            np.savez_compressed(handle, mean=self.mean.astype(np.float32), scale=self.scale.astype(np.float32),
                                w_cap=self.w_cap.astype(np.float32), w_len=self.w_len.astype(np.float32),
                                meta=np.array(json.dumps(meta)))


def load_remaining_head(path: str | Path | None = None) -> RemainingHead:
    """Load a head saved by :meth:`RemainingHead.save`; ``None``: the shipped one."""
    names = ("mean", "scale", "w_cap", "w_len")
    meta, arrays = read_weights_npz(path, DEFAULT_REMAINING_FILE, names, "remaining head")
    if set(arrays) != set(names):
        raise PredictorError(f"remaining head {path or DEFAULT_REMAINING_FILE} lacks {sorted(set(names) - set(arrays))}")
    if meta.get("format_version") != _FORMAT_VERSION:
        raise PredictorError(f"unsupported remaining-head format {meta.get('format_version')!r}")
    return RemainingHead(str(meta["model"]), int(meta["dim"]), int(meta["every"]), int(meta["cap"]), arrays["mean"],
                         arrays["scale"], arrays["w_cap"], float(meta["b_cap"]), arrays["w_len"], float(meta["b_len"]),
                         dict(meta.get("meta", {})))


__all__ = ["DEFAULT_REMAINING_FILE", "RemainingHead", "expected_remaining", "load_remaining_head", "remaining_features"]
