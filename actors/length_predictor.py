"""``LengthPredictorActor``: the SSJF proxy model as an actor that predicts output lengths.

The scheduler asks it for every request without a client length hint (``ssjf`` and ``hrrn`` order by predicted
service) and tells it how each request ended, so the head can learn online.

Config dict::

    {"model": str, "cache_dir": str|None, "device": "cpu"|"cuda:N",
     "predictor": str|None, "num_threads": int|None,
     "online": bool, "max_pending": int}

``model`` is the served LM; a ``hidden`` predictor runs its first blocks (float32, as trained)
and the rest of the model is dropped after loading. ``predictor`` is an ``.npz`` written by
``treeserve train-predictor`` (None: the shipped one), or a ``lookup`` table of true lengths
(the benchmark's SJF oracle, never refined online). With ``online`` the head is refined from
completed requests by :class:`treeserve.ops.length_predictor.OnlineHead` (bounded buffer, a
ridge re-solve every few requests). Handlers:

* ``predict {"request_id", "prompt_ids", "max_tokens"?}`` -> ``{"predicted_len": float}``: predicted output
  tokens (clipped to ``[1, predictor cap]``; a predictor trained with the cap as a feature reads
  ``max_tokens``). The features are kept (at most ``max_pending``
  requests, oldest dropped first) until ``observe`` for that request.
* ``predict_batch {"requests": [{"request_id", "prompt_ids", "max_tokens"?}, ...]}`` ->
  ``{"predicted_lens": [float, ...]}``: ``predict`` of several requests in one call, their
  ``hidden`` features in padded batched prefills (the scheduler sends the requests that arrived
  while its previous call ran).
* ``observe {"request_id", "num_generated_tokens", "is_censored"}`` -> None: the request
  ended. ``is_censored`` means the length is only a lower bound (stopped by ``max_tokens``
  below the predictor's own cap, or cancelled); such requests teach nothing and are dropped.
* ``stats`` -> counters.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treeserve.actors.messages.length import LengthReport, PredictBatchBody, PredictBatchReply, PredictBody, PredictReply
from treeserve.actors.model_host import (
    SerialOffload,
    check_device,
    check_int,
    check_model_name,
    check_str_or_none,
)
from treeserve.ops.length_predictor import OnlineHead, Predictor, load_predictor
from treeserve.ops.loaders.load import load_model
from treeserve.runtime import Actor, handler


@dataclass(frozen=True)
class LengthPredictorConfig:
    """Validated config of a :class:`LengthPredictorActor` (see the module docstring)."""

    model: str
    cache_dir: str | None = None
    device: str = "cpu"
    predictor: str | None = None
    num_threads: int | None = None
    online: bool = True
    max_pending: int = 4096

    @classmethod
    def from_wire(cls, config: Any) -> LengthPredictorConfig:
        """Build from the constructor dict; ``ValueError`` names the bad key."""
        if not isinstance(config, Mapping):
            raise ValueError(f"LengthPredictorActor config must be a dict, got {type(config).__name__}")
        known = {"model", "cache_dir", "device", "predictor", "num_threads", "online", "max_pending"}
        unknown = sorted(str(k) for k in config if k not in known)
        if unknown:
            raise ValueError(f"unknown LengthPredictorActor config keys {unknown}; known keys: {sorted(known)}")
        model = check_model_name(config.get("model"))
        cache_dir = check_str_or_none(config.get("cache_dir"), "cache_dir")
        predictor = check_str_or_none(config.get("predictor"), "predictor")
        device = check_device(config.get("device", "cpu"))
        num_threads = config.get("num_threads")
        if num_threads is not None:
            check_int(num_threads, "num_threads", minimum=1)
        online = config.get("online", True)
        if not isinstance(online, bool):
            raise ValueError(f"online must be true or false, got {online!r}")
        max_pending = check_int(config.get("max_pending", 4096), "max_pending", minimum=1)
        return cls(model, cache_dir, device, predictor, num_threads, online, max_pending)


class LengthPredictorActor(Actor):
    """Serves ``predict`` / ``observe`` / ``stats`` over a trained length predictor."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = LengthPredictorConfig.from_wire(config)
        self._offload = SerialOffload()
        self._predictor: Predictor | None = None
        self._online: OnlineHead | None = None
        self._vocab_size = 0
        self._pending: OrderedDict[str, np.ndarray] = OrderedDict()  # request_id -> features
        self._counters = {"num_predicted": 0, "num_observed": 0, "num_censored": 0, "num_unknown": 0}

    async def on_start(self) -> None:
        """Load the predictor (and the model's first blocks when it needs them)."""
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        await self._offload.run(self._load)

    def _load(self) -> None:
        cfg = self.config
        predictor = load_predictor(cfg.predictor)
        model = load_model(cfg.model, dtype=torch.float32, cache_dir=cfg.cache_dir).model
        self._vocab_size = model.config.vocab_size
        if predictor.spec.needs_model:
            expected = 2 * model.config.dim + 1  # see treeserve.ops.length_predictor.pooled_hidden_features
            if predictor.mean.shape[0] != expected or predictor.spec.num_layers > model.config.num_layers:
                raise ValueError(
                    f"predictor {cfg.predictor or 'shipped'} reads {predictor.mean.shape[0]} features of "
                    f"{predictor.spec.num_layers} blocks; model {cfg.model!r} gives {expected} features of "
                    f"{model.config.num_layers} blocks: train one for this model (treeserve train-predictor)"
                )
            # Keep only the blocks the features read; the rest of the model is freed.
            predictor.bind(model.to(cfg.device))
        self._predictor = predictor
        # A lookup oracle (bench/scheduling.py's SJF oracle) knows the true lengths: nothing to learn.
        self._online = OnlineHead(predictor) if cfg.online and not predictor.spec.is_lookup else None

    # ------------------------------------------------------------------ handlers
    @handler
    async def predict(self, body: Any) -> dict[str, float]:
        """Predicted output tokens of one chat-templated prompt (see the module docstring)."""
        call = PredictBody.from_wire(body, self._vocab_size)
        value = await self._offload.run(self._predict, call.request_id, list(call.prompt_ids), call.max_tokens)
        return PredictReply(value).to_wire()

    @handler
    async def predict_batch(self, body: Any) -> dict[str, list[float]]:
        """Predicted output tokens of several chat-templated prompts, in order."""
        call = PredictBatchBody.from_wire(body, self._vocab_size)
        values = await self._offload.run(self._predict_many, [r.request_id for r in call.requests],
                                         [list(r.prompt_ids) for r in call.requests],
                                         [r.max_tokens for r in call.requests])
        return PredictBatchReply(tuple(values)).to_wire()

    @handler
    async def observe(self, body: Any) -> None:
        """Learn from one ended request (``is_censored`` ones are only forgotten)."""
        report = LengthReport.from_wire(body)
        await self._offload.run(self._observe, report.request_id, report.num_generated_tokens, report.is_censored)

    @handler
    async def stats(self) -> dict[str, Any]:
        """Counters: predictions made, observations learnt from / dropped as censored / unknown."""
        return {**self._counters, "num_pending": len(self._pending), "is_online": self._online is not None}

    # ------------------------------------------------------------------ compute (worker thread)
    def _loaded_predictor(self) -> Predictor:
        if self._predictor is None:  # handlers run only after on_start loaded it
            raise RuntimeError("LengthPredictorActor is not started")
        return self._predictor

    def _predict(self, request_id: str, prompt: list[int], max_tokens: int | None) -> float:
        return self._predict_many([request_id], [prompt], [max_tokens])[0]

    def _predict_many(self, request_ids: list[str], prompts: list[list[int]],
                      caps: list[int | None]) -> list[float]:
        predictor = self._loaded_predictor()
        x = predictor.prompt_features_batch(prompts, caps)  # (N, F)
        for request_id, row in zip(request_ids, x):
            self._pending[request_id] = row
            self._pending.move_to_end(request_id)
        while len(self._pending) > self.config.max_pending:
            self._pending.popitem(last=False)
        self._counters["num_predicted"] += len(request_ids)
        return [float(v) for v in np.atleast_1d(predictor.predict_features(x))]

    def _observe(self, request_id: str, num_tokens: int, censored: bool) -> None:
        x = self._pending.pop(request_id, None)
        if x is None:
            self._counters["num_unknown"] += 1
            return
        max_tokens = self._loaded_predictor().max_tokens
        # A request stopped by max_tokens below the training cap only shows a lower bound.
        if censored and num_tokens < max_tokens:
            self._counters["num_censored"] += 1
            return
        self._counters["num_observed"] += 1
        if self._online is not None:
            self._online.observe(x, min(num_tokens, max_tokens))


__all__ = ["LengthPredictorActor", "LengthPredictorConfig"]
