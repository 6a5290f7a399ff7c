"""Output-length proxy model for SSJF: predicts how many tokens the served model will generate.

A :class:`Predictor` is a linear head whose score estimates ``log1p(output tokens)``, over one of
these feature sets (:class:`FeatureSpec`):

* ``hidden``: the prompt's hidden states after the served model's first ``num_layers`` blocks
  (run through ``Transformer.truncated``, final norm applied), mean-pooled over the prompt and
  at its last token, plus ``log1p(prompt length)``. Costs ``num_layers / num_layers_total`` of
  a prefill, and needs the model (it lives in the verifier/speculator processes).
* ``tokens``: a hashed set (0/1 presence) of prompt token ids (``num_buckets`` buckets) plus
  ``log1p(prompt length)``. No model; microseconds, so it can run in the scheduler itself.
* ``prompt_len``: ``log1p(prompt length)`` alone, the baseline the issue compares against.
* ``lookup``: not a model but an offline oracle: the recorded true length of known prompts
  (by a hash of their ids), ``max_tokens`` for any other. ``bench/scheduling.py`` writes one
  from a first pass so a real server can run the SJF oracle through the same predictor actor.

Two heads (``Predictor.head``): ``ridge`` (:func:`fit_predictor`, ridge regression on
``log1p(length)``, its strength chosen by k-fold cross-validation) and ``rank``
(:func:`~treeserve.training.length_heads.fit_rank_predictor`: the ridge solution refined by a pairwise ranking loss, because
SSJF needs the order of jobs, not their lengths, then rescaled by least squares so the score
still estimates ``log1p(length)``) and ``ordinal`` (:func:`~treeserve.training.length_heads.fit_ordinal_predictor`: a
proportional-odds model over the length buckets, the buckets' own likelihood rather than pairs,
rescaled the same way). :func:`evaluate` gives held-out metrics (MAE in tokens,
bucket accuracy, Kendall's tau-b). Weights save to a small ``.npz`` (arrays plus one JSON metadata string; no
pickle). :class:`OnlineHead` refines a trained head from completed requests at bounded cost.
Training on recorded lengths and the ``treeserve train-predictor`` command are in
:mod:`treeserve.training.predictor`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from treeserve.ops.length_metrics import BUCKET_EDGES, PredictorError, bucket_of, evaluate, kendall_tau

if TYPE_CHECKING:
    from treeserve.ops.model import Transformer

FEATURE_KINDS = ("hidden", "tokens", "prompt_len", "lookup")
HEADS = ("ridge", "rank", "ordinal", "listmle")
DEFAULT_PREDICTOR_FILE = "data/predictor_smollm2-135m-instruct.npz"
DEFAULT_ALPHAS = (0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0)
_FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 1: ridge heads without "head" or lookup tables


@dataclass(frozen=True)
class FeatureSpec:
    """Which features a predictor reads: ``kind`` in :data:`FEATURE_KINDS`; ``num_layers``
    (blocks of the served model, ``hidden`` only); ``num_buckets`` (hash buckets, ``tokens`` only);
    ``with_cap``: the request's ``max_tokens`` is a feature too (:func:`cap_features`, appended)."""

    kind: str = "hidden"
    num_layers: int = 4
    num_buckets: int = 1024
    with_cap: bool = False

    def __post_init__(self) -> None:
        if self.kind not in FEATURE_KINDS:
            raise PredictorError(f"feature kind must be one of {FEATURE_KINDS}, got {self.kind!r}")
        if self.num_layers < 1 or self.num_buckets < 1:
            raise PredictorError("num_layers and num_buckets must be >= 1")

    @property
    def needs_model(self) -> bool:
        """Whether computing the features runs the served model's first layers."""
        return self.kind == "hidden"

    @property
    def is_lookup(self) -> bool:
        """Whether this is the ``lookup`` oracle (a table of known lengths, nothing learnt)."""
        return self.kind == "lookup"


def prompt_key(prompt_ids: Sequence[int]) -> float:
    """A 52-bit hash of the prompt's ids as a float (exact in float64): the ``lookup`` key."""
    digest = hashlib.sha256(np.asarray(prompt_ids, dtype=np.int64).tobytes()).digest()
    return float(int.from_bytes(digest[:8], "big") >> 12)


# ---------------------------------------------------------------------------------- features
CAP_KNOTS = (16, 64, 256, 1024)
"""Knots of :func:`cap_features`: the cap's log enters piecewise, so a linear head can say that an
8-token cap fixes the answer's length while a 1,024-token one barely bounds it."""


def cap_features(max_tokens: int) -> np.ndarray:
    """The request's ``max_tokens`` as features: ``log1p(min(max_tokens, knot))`` for each of
    :data:`CAP_KNOTS` (``(len(CAP_KNOTS),)``)."""
    if max_tokens < 1:
        raise PredictorError(f"max_tokens must be >= 1, got {max_tokens}")
    return np.array([math.log1p(min(max_tokens, knot)) for knot in CAP_KNOTS])


def token_features(prompt_ids: Sequence[int], num_buckets: int) -> np.ndarray:
    """Hashed set of token ids (1.0 where some prompt id hashes, ``(num_buckets,)``) then ``log1p(len)``.

    Presence rather than counts: "the prompt contains *essay*" is the signal, and a 0/1
    indicator keeps it independent of the prompt's length (which has its own feature).
    """
    present = np.zeros(num_buckets, dtype=np.float64)
    if prompt_ids:
        # Multiplicative hashing spreads neighbouring ids (similar BPE pieces) over buckets.
        ids = (np.asarray(prompt_ids, dtype=np.uint64) * np.uint64(2654435761)) % np.uint64(num_buckets)
        present[ids.astype(np.int64)] = 1.0
    return np.concatenate([present, [math.log1p(len(prompt_ids))]])


def pooled_hidden_features(hidden: np.ndarray) -> np.ndarray:
    """``hidden`` ``(T, D)`` of one prompt -> ``[mean over T, last row, log1p(T)]`` ``(2D + 1,)``."""
    if hidden.ndim != 2 or hidden.shape[0] == 0:
        raise PredictorError(f"hidden must be (T, D) with T >= 1, got shape {hidden.shape}")
    hidden = hidden.astype(np.float64)
    return np.concatenate([hidden.mean(axis=0), hidden[-1], [math.log1p(hidden.shape[0])]])


def prompt_hidden(model: Transformer, prompt_ids: Sequence[int]) -> np.ndarray:
    """Final-normed hidden states ``(T, D)`` of ``model`` over the prompt (one causal prefill).

    Runs ``Transformer.forward``'s blocks without the LM head: for a truncated model the
    ``(T, vocab)`` logits would cost more than the few blocks themselves. The test suite checks
    the result against ``model(..., return_hidden=True)``.
    """
    import torch

    cache = model.new_cache(1, len(prompt_ids))
    with torch.inference_mode():
        h = model.embed(torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device))  # (1, T, D)
        h = model.norm(model.run_blocks(h, cache, None, None))
    out: np.ndarray = h[0].float().cpu().numpy()
    return out


def prompt_hidden_batch(model: Transformer, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """:func:`prompt_hidden` of several prompts in one padded causal prefill: ``[(T_i, D)]``.

    Prompts are right-padded to the longest: a causal chain never lets a prompt's tokens attend
    to the padding after them, so each prompt's states are its own prefill's up to float
    rounding (the batch changes the kernels' summation order; the tests bound the difference).
    """
    import torch

    if not prompts or any(not p for p in prompts):
        raise PredictorError("prompt_hidden_batch needs at least one prompt, none of them empty")
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)  # (B, T): pad id 0, never attended
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
    cache = model.new_cache(len(prompts), longest)
    with torch.inference_mode():
        h = model.embed(ids.to(model.device))  # (B, T, D)
        h = model.norm(model.run_blocks(h, cache, None, None))
    out = h.float().cpu().numpy()
    return [out[row, : len(prompt)] for row, prompt in enumerate(prompts)]


def padded_batches(lengths: Sequence[int], max_padding: float = 0.25) -> list[list[int]]:
    """Indices of ``lengths`` grouped for padded prefills: sorted by length, and a group grows
    while its padded size ``count * longest`` stays within ``(1 + max_padding)`` of its tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] <= (1 + max_padding) * (total + lengths[i]):
            groups[-1].append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


def features_batch(spec: FeatureSpec, prompts: Sequence[Sequence[int]], model: Transformer | None = None,
                   caps: Sequence[int] | None = None) -> np.ndarray:
    """:func:`features` of several prompts ``(N, F)`` (``caps``: each request's ``max_tokens``,
    read by a ``with_cap`` spec); ``hidden`` ones run in padded prefills of similar lengths
    (:func:`padded_batches`), not one prefill per prompt."""
    if not prompts:
        raise PredictorError("features_batch needs at least one prompt")
    if caps is not None and len(caps) != len(prompts):
        raise PredictorError(f"{len(caps)} caps for {len(prompts)} prompts")
    if spec.kind != "hidden" or len(prompts) == 1:
        return np.stack([features(spec, p, model, None if caps is None else caps[i]) for i, p in enumerate(prompts)])
    if any(not p for p in prompts):
        raise PredictorError("prompt_ids must not be empty")
    _check_hidden_model(spec, model)
    assert model is not None
    rows: dict[int, np.ndarray] = {}
    for group in padded_batches([len(p) for p in prompts]):
        for i, hidden in zip(group, prompt_hidden_batch(model, [prompts[i] for i in group])):
            rows[i] = with_cap_features(spec, pooled_hidden_features(hidden), None if caps is None else caps[i])
    return np.stack([rows[i] for i in range(len(prompts))])


def with_cap_features(spec: FeatureSpec, x: np.ndarray, max_tokens: int | None) -> np.ndarray:
    """``x`` with :func:`cap_features` appended when ``spec.with_cap`` (``max_tokens`` is then required)."""
    if not spec.with_cap:
        return x
    if max_tokens is None:
        raise PredictorError("this predictor reads the request's max_tokens: pass it")
    return np.concatenate([x, cap_features(max_tokens)])


def _check_hidden_model(spec: FeatureSpec, model: Transformer | None) -> None:
    if model is None:
        raise PredictorError("hidden features need the served model (pass model=...)")
    if model.config.num_layers != spec.num_layers:
        raise PredictorError(f"hidden features need a {spec.num_layers}-layer truncated model, "
                             f"got {model.config.num_layers} layers (use model.truncated({spec.num_layers}))")


def features(spec: FeatureSpec, prompt_ids: Sequence[int], model: Transformer | None = None,
             max_tokens: int | None = None) -> np.ndarray:
    """The feature vector of one prompt under ``spec`` (``model``: the truncated model for
    ``hidden``; ``max_tokens``: the request's cap, read by a ``with_cap`` spec)."""
    if not prompt_ids:
        raise PredictorError("prompt_ids must not be empty")
    if spec.kind == "prompt_len":
        x = np.array([math.log1p(len(prompt_ids))])
    elif spec.kind == "tokens":
        x = token_features(prompt_ids, spec.num_buckets)
    elif spec.kind == "lookup":
        return np.array([prompt_key(prompt_ids)])
    else:
        _check_hidden_model(spec, model)
        assert model is not None
        x = pooled_hidden_features(prompt_hidden(model, prompt_ids))
    return with_cap_features(spec, x, max_tokens)


# ---------------------------------------------------------------------------------- the head
def _ridge(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[np.ndarray, float]:
    """Ridge on centred data: weights ``(F,)`` and intercept (the intercept is not penalised)."""
    x_mean, y_mean = x.mean(axis=0), float(y.mean())
    xc, yc = x - x_mean, y - y_mean
    num, dim = xc.shape
    if dim <= num:
        w = np.linalg.solve(xc.T @ xc + alpha * np.eye(dim), xc.T @ yc)
    else:  # dual form: an (n, n) system when features outnumber examples
        w = xc.T @ np.linalg.solve(xc @ xc.T + alpha * np.eye(num), yc)
    return w, y_mean - float(x_mean @ w)


@dataclass
class Predictor:
    """A trained length predictor: standardisation, linear weights and metadata.

    ``predict_features(x)`` returns predicted output tokens clipped to ``[1, max_tokens]``
    (``max_tokens``: the generation cap of the training data). ``head`` says how the weights
    were fit (:data:`HEADS`); either way ``z @ weights + intercept`` estimates ``log1p(length)``.
    A ``lookup`` predictor instead maps :func:`prompt_key` values (``table_keys``) to recorded
    lengths (``table_lengths``). ``meta`` records provenance.
    """

    spec: FeatureSpec
    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    intercept: float
    max_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)
    head: str = "ridge"
    table_keys: np.ndarray = field(default_factory=lambda: np.zeros(0))
    table_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0))
    _truncated: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.head not in HEADS:
            raise PredictorError(f"head must be one of {HEADS}, got {self.head!r}")

    def predict_features(self, x: np.ndarray) -> np.ndarray | float:
        """Predicted output tokens for one feature vector ``(F,)`` (a float) or a batch ``(N, F)``."""
        x = np.asarray(x, dtype=np.float64)
        if self.spec.is_lookup:
            keys = x[..., 0].reshape(-1)  # (N,)
            found = np.full(keys.shape, float(self.max_tokens))
            if self.table_keys.size:
                where = np.searchsorted(self.table_keys, keys).clip(0, self.table_keys.size - 1)
                known = self.table_keys[where] == keys
                found[known] = self.table_lengths[where[known]]
            out = np.clip(found, 1.0, float(self.max_tokens))
            return float(out[0]) if x.ndim == 1 else out
        z = (x - self.mean) / self.scale
        log_len = z @ self.weights + self.intercept
        out = np.clip(np.expm1(log_len), 1.0, float(self.max_tokens))
        return float(out) if np.ndim(out) == 0 else out

    def bind(self, model: Transformer) -> Predictor:
        """Attach the served model (``hidden`` features run its first ``num_layers`` blocks)."""
        if self.spec.needs_model:
            self._truncated = model.truncated(self.spec.num_layers)
        return self

    def predict_from_prompt_ids(self, prompt_ids: Sequence[int], model: Transformer | None = None,
                                max_tokens: int | None = None) -> float:
        """Predicted output tokens of one prompt (chat-templated ids, as the scheduler sees them)
        asked for at most ``max_tokens`` (a ``with_cap`` predictor reads it; None: its own cap).

        ``hidden`` predictors need the served model: pass it here or :meth:`bind` it once.
        """
        truncated = self._truncated
        if self.spec.needs_model and model is not None:
            truncated = model.truncated(self.spec.num_layers)
        value = self.predict_features(features(self.spec, prompt_ids, truncated, self._cap(max_tokens)))
        assert isinstance(value, float)
        return value

    predict = predict_from_prompt_ids

    def prompt_features(self, prompt_ids: Sequence[int], max_tokens: int | None = None) -> np.ndarray:
        """The feature vector of one prompt (``hidden`` predictors need :meth:`bind` first)."""
        return features(self.spec, prompt_ids, self._truncated, self._cap(max_tokens))

    def prompt_features_batch(self, prompts: Sequence[Sequence[int]],
                              caps: Sequence[int | None] | None = None) -> np.ndarray:
        """:meth:`prompt_features` of several prompts ``(N, F)``, in padded batched prefills."""
        filled = [self._cap(c) for c in caps] if caps is not None else [self.max_tokens] * len(prompts)
        return features_batch(self.spec, prompts, self._truncated, filled)

    def _cap(self, max_tokens: int | None) -> int:
        return self.max_tokens if max_tokens is None else int(max_tokens)

    def save(self, path: str | Path) -> None:
        """Write a ``.npz`` (float32 arrays + a JSON metadata string; loadable without pickle)."""
        meta = {"format_version": _FORMAT_VERSION, "spec": self.spec.__dict__, "max_tokens": self.max_tokens,
                "intercept": self.intercept, "head": self.head, **{"meta": self.meta}}
        with Path(path).open("wb") as handle:
            # Lookup keys are 52-bit integers: float64 keeps them exact.
            np.savez_compressed(handle, mean=self.mean.astype(np.float32), scale=self.scale.astype(np.float32),
                                weights=self.weights.astype(np.float32), table_keys=self.table_keys.astype(np.float64),
                                table_lengths=self.table_lengths.astype(np.float32), meta=np.array(json.dumps(meta)))


def read_weights_npz(path: str | Path | None, shipped: str, names: Sequence[str],
                     what: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The JSON metadata and the float64 arrays ``names`` (those present) of a weights ``.npz``
    written with a ``meta`` string, no pickle; ``None``: the shipped file ``shipped`` (under
    ``treeserve.ops``). Any failure is a :class:`PredictorError` naming ``what`` it loaded."""
    try:
        if path is None:
            handle = resources.files("treeserve.ops").joinpath(shipped).open("rb")
        else:
            handle = Path(path).open("rb")
        with handle, np.load(handle, allow_pickle=False) as data:
            return json.loads(str(data["meta"])), {k: data[k].astype(np.float64) for k in names if k in data.files}
    except (OSError, KeyError, ValueError) as exc:
        raise PredictorError(f"cannot load {what} {path or shipped}: {exc}") from exc


def load_predictor(path: str | Path | None = None) -> Predictor:
    """Load a predictor saved by :meth:`Predictor.save`; ``None``: the shipped default one."""
    meta, arrays = read_weights_npz(path, DEFAULT_PREDICTOR_FILE,
                                    ("mean", "scale", "weights", "table_keys", "table_lengths"), "predictor")
    if meta.get("format_version") not in _READABLE_VERSIONS:
        raise PredictorError(f"unsupported predictor format {meta.get('format_version')!r}")
    empty = np.zeros(0)
    return Predictor(FeatureSpec(**meta["spec"]), arrays["mean"], arrays["scale"], arrays["weights"],
                     float(meta["intercept"]), int(meta["max_tokens"]), meta.get("meta", {}),
                     head=str(meta.get("head", "ridge")), table_keys=arrays.get("table_keys", empty),
                     table_lengths=arrays.get("table_lengths", empty))


def lookup_predictor(prompts: Sequence[Sequence[int]], lengths: Sequence[int], max_tokens: int) -> Predictor:
    """The ``lookup`` oracle: each prompt's recorded length (``max_tokens`` for unknown prompts)."""
    if len(prompts) != len(lengths):
        raise PredictorError(f"need one length per prompt, got {len(prompts)} prompts and {len(lengths)} lengths")
    table = {prompt_key(p): float(n) for p, n in zip(prompts, lengths)}
    keys = np.array(sorted(table), dtype=np.float64)
    one = np.ones(1)
    return Predictor(FeatureSpec("lookup"), np.zeros(1), one, np.zeros(1), 0.0, max_tokens,
                     {"num_prompts": len(table), "purpose": "offline SJF oracle (true lengths)"},
                     table_keys=keys, table_lengths=np.array([table[k] for k in keys]))


def fit_predictor(x: np.ndarray, lengths: np.ndarray, spec: FeatureSpec, max_tokens: int, *,
                  alphas: Sequence[float] = DEFAULT_ALPHAS, num_folds: int = 5, seed: int = 0) -> Predictor:
    """Fit a ridge head on ``log1p(lengths)``; the ridge strength is chosen by k-fold CV (MSE)."""
    x, y = np.asarray(x, dtype=np.float64), np.log1p(np.asarray(lengths, dtype=np.float64))
    if x.ndim != 2 or x.shape[0] != y.size or y.size < 2:
        raise PredictorError(f"need an (N, F) feature matrix and N >= 2 lengths, got {x.shape} and {y.size}")
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale = np.where(scale > 1e-12, scale, 1.0)
    z = (x - mean) / scale
    folds = np.random.default_rng(seed).permutation(y.size) % max(2, min(num_folds, y.size))
    best_alpha, best_err = alphas[0], math.inf
    for alpha in alphas:
        err = 0.0
        for k in np.unique(folds):
            w, b = _ridge(z[folds != k], y[folds != k], alpha)
            err += float(((z[folds == k] @ w + b - y[folds == k]) ** 2).sum())
        if err < best_err:
            best_alpha, best_err = alpha, err
    w, b = _ridge(z, y, best_alpha)
    return Predictor(spec, mean, scale, w, b, max_tokens, {"alpha": best_alpha, "num_train": int(y.size)})


class OnlineHead:
    """Refines a trained predictor from completed requests, at bounded cost.

    Keeps the last ``buffer_size`` (features, true length) pairs and, every ``refit_every``
    observations, re-solves ridge *towards the trained weights* on that buffer:
    ``w = argmin |Z w + b - y|^2 + alpha |w - w0|^2`` (dual form, O(N^2 F + N^3) with
    N = ``buffer_size``), so a few requests nudge the head and many override it.
    """

    def __init__(self, predictor: Predictor, *, buffer_size: int = 256, refit_every: int = 32,
                 alpha: float | None = None) -> None:
        if buffer_size < 1 or refit_every < 1:
            raise PredictorError("buffer_size and refit_every must be >= 1")
        self.predictor = predictor
        self._w0, self._b0 = predictor.weights.copy(), predictor.intercept
        self._alpha = float(alpha if alpha is not None else predictor.meta.get("alpha", 10.0))
        self._buffer: deque[tuple[np.ndarray, float]] = deque(maxlen=buffer_size)
        self._refit_every = refit_every
        self.num_observed = 0

    def observe(self, x: np.ndarray, true_len: int) -> None:
        """Record one completed request (its features and real output length)."""
        self._buffer.append((np.asarray(x, dtype=np.float64), math.log1p(max(0, true_len))))
        self.num_observed += 1
        if self.num_observed % self._refit_every == 0:
            self.refit()

    def refit(self) -> None:
        """Re-solve the head on the buffer (regularised towards the trained weights)."""
        if not self._buffer:
            return
        p = self.predictor
        z = (np.stack([x for x, _ in self._buffer]) - p.mean) / p.scale  # (N, F)
        y = np.array([t for _, t in self._buffer])
        residual = y - (z @ self._w0 + self._b0)
        # Intercept shift: mean residual, shrunk like one extra feature of value 1.
        zc, rc = z - z.mean(axis=0), residual - residual.mean()
        delta = zc.T @ np.linalg.solve(zc @ zc.T + self._alpha * np.eye(len(y)), rc)
        p.weights = self._w0 + delta
        p.intercept = self._b0 + float(residual.mean() - z.mean(axis=0) @ delta) * len(y) / (len(y) + self._alpha)

