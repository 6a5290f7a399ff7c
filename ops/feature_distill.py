"""Training a :class:`~treeserve.ops.feature_drafter.FeatureDrafter` on the LLM's own states.

Data: sequences the LLM itself produced (prompts + its greedy continuations, see
:func:`treeserve.ops.distill.generate_teacher_data`), run once more through the LLM to record
its final hidden state ``f_t`` at every position (:func:`collect_states`). Each training pair
``(f_t, x_{t+1})`` has the target ``f_{t+1}`` and the LLM's next-token distribution at
``t + 1`` over the draft vocabulary (``softmax(f_{t+1} W_K^T)``), so the drafter learns the
LLM's state dynamics (smooth L1 on the state) and what its head makes of them (cross entropy
to the LLM's distribution), as EAGLE does. Training runs over causal windows with the
drafter's own attention, the way it drafts; progress goes to a callback; checkpoints make it
resumable (:func:`train_feature_drafter`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from treeserve.ops.feature_drafter import FeatureDrafter
from treeserve.ops.model import Transformer

Progress = Callable[[str, int, int, dict[str, float]], None]
"""``(stage, done, total, figures)``: called after each unit of work (a sequence, a step, an epoch)."""


def _no_progress(stage: str, done: int, total: int, figures: dict[str, float]) -> None:
    del stage, done, total, figures


@dataclass(frozen=True)
class StateSequence:
    """One sequence with the LLM's final hidden states ``(L, D)`` (float16) and top-1 next tokens ``(L,)``."""

    token_ids: Tensor
    states: Tensor
    top1: Tensor


def collect_states(model: Transformer, sequences: Sequence[Tensor], *, progress: Progress = _no_progress) -> list[StateSequence]:
    """Run every token sequence through ``model`` once and keep its final hidden states."""
    out = []
    for index, tokens in enumerate(sequences):
        ids = tokens.to(torch.long).reshape(-1)
        with torch.no_grad():
            logits, hidden = model(ids[None].to(model.device), model.new_cache(1, ids.numel()), return_hidden=True)
        out.append(StateSequence(ids.cpu(), hidden[0].to(torch.float16).cpu(), logits[0].argmax(-1).cpu()))
        progress("states", index + 1, len(sequences), {})
    return out


def draft_vocabulary(data: Sequence[StateSequence], size: int) -> Tensor:
    """The ``size`` tokens the LLM most often predicts (its top-1) in ``data``, ascending ids."""
    if not data:
        raise ValueError("no sequences to choose a draft vocabulary from")
    vocab = int(max(int(d.token_ids.max()) for d in data)) + 1
    vocab = max(vocab, int(max(int(d.top1.max()) for d in data)) + 1)
    counts = torch.zeros(max(vocab, size))
    for d in data:
        counts.index_add_(0, d.top1, torch.ones(d.top1.numel()))
    return torch.topk(counts, size).indices.sort().values


def _windows(data: Sequence[StateSequence], length: int) -> list[tuple[int, int]]:
    """(sequence, start) windows of ``length + 1`` positions covering every sequence."""
    out = []
    for index, seq in enumerate(data):
        n = seq.token_ids.numel()
        if n < 3:
            continue
        span = min(length, n - 1)
        out.extend((index, start) for start in range(0, max(n - 1 - span, 0) + 1, span))
    return out


def _batch(data: Sequence[StateSequence], picks: Sequence[tuple[int, int]], length: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inputs ``(f_t, x_{t+1})`` and target states ``f_{t+1}``, cut to the shortest window."""
    span = min(min(data[i].token_ids.numel() - 1 - s, length) for i, s in picks)
    states = torch.stack([data[i].states[s: s + span] for i, s in picks]).float()  # (B, T, D)
    tokens = torch.stack([data[i].token_ids[s + 1: s + 1 + span] for i, s in picks])  # (B, T)
    targets = torch.stack([data[i].states[s + 1: s + 1 + span] for i, s in picks]).float()  # (B, T, D)
    return states, tokens, targets


def feature_loss(drafter: FeatureDrafter, states: Tensor, tokens: Tensor, targets: Tensor, *,
                 state_weight: float = 1.0) -> tuple[Tensor, Tensor]:
    """(loss, predicted draft logits): cross entropy to the LLM's draft-vocabulary distribution
    at the next position plus ``state_weight`` times smooth L1 to its next state."""
    predicted = drafter.features(states, tokens, drafter.new_cache(tokens.shape[0], tokens.shape[1]))
    logits = drafter.head(predicted)  # (B, T, K)
    with torch.no_grad():
        teacher = F.softmax(drafter.head(targets.to(drafter.dtype)), dim=-1)
    cross_entropy = -(teacher * F.log_softmax(logits, dim=-1)).sum(-1).mean()
    return cross_entropy + state_weight * F.smooth_l1_loss(predicted.float(), targets), logits


def evaluate_top1(drafter: FeatureDrafter, data: Sequence[StateSequence], *, length: int = 256,
                  batch_size: int = 8) -> float:
    """Fraction of positions where the drafter's first-step top-1 equals the LLM's top-1."""
    windows = _windows(data, length)
    hits = total = 0
    drafter.eval()
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            picks = windows[start: start + batch_size]
            states, tokens, _ = _batch(data, picks, length)
            predicted = drafter.features(states, tokens, drafter.new_cache(tokens.shape[0], tokens.shape[1]))
            guess = drafter.draft_ids[drafter.head(predicted).argmax(-1)]  # (B, T)
            span = tokens.shape[1]
            truth = torch.stack([data[i].top1[s + 1: s + 1 + span] for i, s in picks])
            hits += int((guess == truth).sum())
            total += truth.numel()
    return hits / max(total, 1)


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser and schedule: AdamW at ``lr`` with cosine decay over ``epochs``, gradient norm
    clipped at ``clip``; windows of ``length`` positions, ``batch_size`` per step."""

    epochs: int = 20
    lr: float = 1e-3
    batch_size: int = 8
    length: int = 192
    clip: float = 1.0
    state_weight: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.length < 2 or not self.lr > 0 or not self.clip > 0:
            raise ValueError(f"bad TrainConfig {self}")


def train_feature_drafter(
    drafter: FeatureDrafter,
    data: Sequence[StateSequence],
    config: TrainConfig = TrainConfig(),
    *,
    held_out: Sequence[StateSequence] = (),
    checkpoint: str | Path | None = None,
    progress: Progress = _no_progress,
) -> list[float]:
    """Train ``drafter`` in place; returns the held-out top-1 agreement after each epoch.

    With ``checkpoint``, the weights, optimiser state and epoch are saved after every epoch and
    a later call resumes after the last completed epoch (same data and config expected).
    """
    trainable = [p for n, p in drafter.named_parameters() if not n.startswith("embed_tokens.")]
    for parameter in drafter.embed_tokens.parameters():
        parameter.requires_grad_(False)
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=0.0)
    windows = _windows(data, config.length)
    steps_per_epoch = math.ceil(len(windows) / config.batch_size)
    total_steps = config.epochs * steps_per_epoch
    first_epoch, history = 0, []
    path = None if checkpoint is None else Path(checkpoint)
    if path is not None and path.exists():
        saved = torch.load(path, weights_only=True)
        drafter.load_state_dict(saved["drafter"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        first_epoch, history = int(saved["epoch"]), list(saved["history"])
    rng = random.Random(config.seed)
    for _ in range(first_epoch):
        rng.shuffle(windows)  # the order earlier epochs used, so a resumed run continues the same schedule
    started = time.monotonic()
    for epoch in range(first_epoch, config.epochs):
        rng.shuffle(windows)
        drafter.train()
        for index in range(steps_per_epoch):
            step = epoch * steps_per_epoch + index
            for group in optimizer.param_groups:
                group["lr"] = config.lr * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            picks = windows[index * config.batch_size: (index + 1) * config.batch_size]
            loss, _ = feature_loss(drafter, *_batch(data, picks, config.length), state_weight=config.state_weight)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(trainable, config.clip)
            optimizer.step()
            done = step + 1 - first_epoch * steps_per_epoch
            rate = (time.monotonic() - started) / done
            progress("train", step + 1, total_steps, {"loss": loss.item(), "eta_s": rate * (total_steps - step - 1)})
        history.append(evaluate_top1(drafter, held_out, length=config.length) if held_out else math.nan)
        progress("epoch", epoch + 1, config.epochs, {"held_out_top1": history[-1]})
        if path is not None:
            state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens.")}
            tmp = path.with_suffix(".tmp")
            torch.save({"drafter": state, "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                        "history": history}, tmp)
            tmp.replace(path)
    drafter.eval()
    return history


__all__ = [
    "StateSequence",
    "TrainConfig",
    "collect_states",
    "draft_vocabulary",
    "evaluate_top1",
    "feature_loss",
    "train_feature_drafter",
]
