"""Training a :class:`~treeserve.ops.feature_drafter.FeatureDrafter` on the LLM's own states.

Data: the LLM's own greedy answers to prompts, with its final hidden state ``f_t`` at every
position, recorded while it answers (:func:`generate_state_data`, which can continue the
answers of :func:`treeserve.training.teacher.generate_teacher_data`); :func:`collect_states` records
the states of given sequences in one more pass. Each training pair
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

from treeserve.ops.batch_step import prefill_rows, row_block
from treeserve.ops.feature_drafter import FeatureDrafter
from treeserve.ops.model import Transformer

Progress = Callable[[str, int, int, dict[str, float]], None]
"""``(stage, done, total, figures)``: called after each unit of work (a sequence, a step, an epoch)."""


def _no_progress(stage: str, done: int, total: int, figures: dict[str, float]) -> None:
    del stage, done, total, figures


@dataclass(frozen=True)
class StateSequence:
    """One sequence with the LLM's final hidden states ``(L, D)`` (float16) and top-1 next tokens
    ``(L,)``; its first ``prompt_len`` tokens are the prompt (0: unknown, all count as generated)."""

    token_ids: Tensor
    states: Tensor
    top1: Tensor
    prompt_len: int = 0


def collect_states(model: Transformer, sequences: Sequence[Tensor], *, prompt_lens: Sequence[int] | None = None,
                   progress: Progress = _no_progress) -> list[StateSequence]:
    """Run every token sequence through ``model`` once and keep its final hidden states."""
    out = []
    lens = list(prompt_lens) if prompt_lens is not None else [0] * len(sequences)
    for index, tokens in enumerate(sequences):
        ids = tokens.to(torch.long).reshape(-1)
        with torch.no_grad():
            logits, hidden = model(ids[None].to(model.device), model.new_cache(1, ids.numel()), return_hidden=True)
        out.append(StateSequence(ids.cpu(), hidden[0].to(torch.float16).cpu(), logits[0].argmax(-1).cpu(), lens[index]))
        progress("states", index + 1, len(sequences), {})
    return out


def generate_state_data(
    model: Transformer,
    starts: Sequence[tuple[Sequence[int], int]],
    work_dir: str | Path,
    *,
    max_new_tokens: int,
    stop_ids: frozenset[int] | set[int],
    batch_size: int = 16,
    save_every: int = 64,
    progress: Progress = _no_progress,
) -> list[StateSequence]:
    """The LLM's greedy continuations of ``starts`` with its states, in one pass (no second run).

    ``starts[i]`` is ``(token ids, prompt_len)``: a chat prompt (``prompt_len`` = its length) or
    a prompt plus the start of the LLM's own greedy answer (from ``treeserve distill``'s teacher
    data), which is continued until ``max_new_tokens`` tokens follow the prompt or a stop token
    ends it. Decoding is continuously batched over ``batch_size`` cache rows: a freed row takes
    the next start at once (its prefill gives the states and top-1 of every start token), and
    every busy row advances one token per forward (``model``'s compiled batched step where it
    has one). Finished sequences are saved ``save_every`` at a time under
    ``work_dir/states``; a rerun loads them and generates only the rest (a kill loses at most
    the unsaved ones). Saved answers are found by their prompt's tokens, so a rerun over more
    prompts, in any order, generates only the new ones. ``progress("states", done, total,
    {"elapsed_s", "eta_s", "tokens_per_s"})`` after each finished sequence. Returns the
    sequences in the order of ``starts``.
    """
    if batch_size < 1 or save_every < 1:
        raise ValueError(f"need batch_size >= 1 and save_every >= 1, got {batch_size}, {save_every}")
    seqs = [[int(t) for t in ids] for ids, _ in starts]
    prompt_lens = [int(n) for _, n in starts]
    if any(not seq or not 0 < n <= len(seq) for seq, n in zip(seqs, prompt_lens)):
        raise ValueError("every start needs tokens and a prompt_len in [1, its length]")
    folder = Path(work_dir) / "states"
    folder.mkdir(parents=True, exist_ok=True)
    saved: dict[tuple[int, ...], dict] = {}  # by prompt tokens, so a reshuffled or larger prompt set reuses them
    for path in sorted(folder.glob("part_*.pt")):
        for _, record in torch.load(path, weights_only=True)["records"]:
            saved[tuple(record["token_ids"][:record["prompt_len"]].tolist())] = record
    keys = [tuple(seq[:n]) for seq, n in zip(seqs, prompt_lens)]
    done = {i: StateSequence(**saved[key]) for i, key in enumerate(keys) if key in saved}
    del saved
    todo = [i for i in range(len(starts)) if i not in done]
    unsaved: list[tuple[int, StateSequence]] = []
    begun, new_tokens = time.monotonic(), 0

    def finish(index: int, record: StateSequence) -> None:
        nonlocal new_tokens
        done[index] = record
        unsaved.append((index, record))
        new_tokens += record.token_ids.numel() - len(starts[index][0])
        if len(unsaved) >= save_every:
            _save_part(folder, unsaved)
            unsaved.clear()
        elapsed = time.monotonic() - begun
        finished_here = len(done) - (len(starts) - len(todo))
        eta = elapsed / finished_here * (len(starts) - len(done))
        progress("states", len(done), len(starts), {"elapsed_s": elapsed, "eta_s": eta, "tokens_per_s": new_tokens / elapsed})

    if todo:
        _continue_batched(model, [(i, seqs[i], prompt_lens[i]) for i in todo], finish,
                          max_new_tokens=max_new_tokens, stop_ids=stop_ids, batch_size=batch_size)
    if unsaved:
        _save_part(folder, unsaved)
    return [done[i] for i in range(len(starts))]


def _save_part(folder: Path, records: list[tuple[int, StateSequence]]) -> None:
    path = folder / f"part_{len(list(folder.glob('part_*.pt'))):05d}_{min(i for i, _ in records):06d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"records": [(i, r.__dict__) for i, r in records]}, tmp)
    tmp.replace(path)


def _continue_batched(model: Transformer, jobs: Sequence[tuple[int, list[int], int]],
                      finish: Callable[[int, StateSequence], None], *, max_new_tokens: int,
                      stop_ids: frozenset[int] | set[int], batch_size: int) -> None:
    """Greedy-continue ``(index, tokens, prompt_len)`` jobs over ``batch_size`` rows, calling
    ``finish(index, record)`` as each ends (see :func:`generate_state_data`)."""
    cache = model.new_cache(batch_size, max(max(len(t), n + max_new_tokens) for _, t, n in jobs) + 1)
    rows: list[_Row | None] = [None] * batch_size
    queue = iter(jobs)

    def close(row: int) -> None:
        job = rows[row]
        assert job is not None
        finish(job.index, job.record())
        rows[row] = None

    def advance(row: int) -> None:
        """Append the row's latest top-1; close it on a stop token or its last new token (the
        last token's state is never computed: it is cut off)."""
        job = rows[row]
        assert job is not None
        token = int(job.top1[-1][-1])
        job.tokens.append(token)
        if token in stop_ids or len(job.tokens) - job.prompt_len >= max_new_tokens:
            close(row)

    with torch.no_grad():
        while True:
            refill = [row for row in range(batch_size) if rows[row] is None]
            while refill:  # rows freed by starts that are already complete are refilled at once
                taken = []
                for row in refill:
                    job = next(queue, None)
                    if job is None:
                        break
                    rows[row] = _Row(*job)
                    taken.append(row)
                if not taken:
                    break
                prefilled = prefill_rows(model, cache, [(row, rows[row].tokens) for row in taken],  # type: ignore[union-attr]
                                         want_states=True)
                refill = []
                for row, (_, hidden) in zip(taken, prefilled):
                    job = rows[row]
                    assert job is not None
                    job.add(hidden, model.logits(hidden).argmax(-1))
                    tokens, prompt_len = job.tokens, job.prompt_len
                    if tokens[-1] in stop_ids and len(tokens) > prompt_len or len(tokens) - prompt_len >= max_new_tokens:
                        close(row)  # a start that is already complete
                        refill.append(row)
                    else:
                        advance(row)
            busy = [row for row in range(batch_size) if rows[row] is not None]
            if not busy:
                return
            # Only rows [0, hi) run; an idle row inside is fed a dummy token and never committed.
            hi = max(busy) + 1
            view = row_block(cache, 0, hi)
            feed = torch.tensor([[0 if job is None else job.tokens[-1]] for job in rows[:hi]], device=model.device)
            logits, hidden = model(feed, view, return_hidden=True)  # (hi, 1, V), (hi, 1, D)
            top1 = logits[:, 0].argmax(-1)
            for row in range(hi):
                job = rows[row]
                view.commit(row, [0] if job is not None else [])
                if job is not None:
                    job.add(hidden[row], top1[row : row + 1])
                    advance(row)


class _Row:
    """One sequence being continued: its tokens, and the states and top-1 computed so far."""

    def __init__(self, index: int, tokens: list[int], prompt_len: int) -> None:
        self.index, self.tokens, self.prompt_len = index, list(tokens), prompt_len
        self.states: list[Tensor] = []
        self.top1: list[Tensor] = []

    def add(self, hidden: Tensor, top1: Tensor) -> None:
        self.states.append(hidden.to(torch.float16).cpu())
        self.top1.append(top1.cpu())

    def record(self) -> StateSequence:
        state = torch.cat(self.states)
        return StateSequence(torch.tensor(self.tokens[:state.shape[0]]), state, torch.cat(self.top1), self.prompt_len)


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


def training_windows(data: Sequence[StateSequence], length: int) -> list[tuple[int, int]]:
    """(sequence, start) windows of ``length + 1`` positions covering every sequence."""
    out = []
    for index, seq in enumerate(data):
        n = seq.token_ids.numel()
        if n < 3:
            continue
        span = min(length, n - 1)
        out.extend((index, start) for start in range(0, max(n - 1 - span, 0) + 1, span))
    return out


def training_batch(data: Sequence[StateSequence], picks: Sequence[tuple[int, int]], length: int,
           prompt_weight: float = 1.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Inputs ``(f_t, x_{t+1})``, target states ``f_{t+1}`` and per-position loss weights, cut to
    the shortest window. A pair whose token ``x_{t+1}`` is a prompt token other than the last
    one never roots a draft (drafting starts at the prompt's last token): its weight is
    ``prompt_weight``."""
    span = min(min(data[i].token_ids.numel() - 1 - s, length) for i, s in picks)
    states = torch.stack([data[i].states[s: s + span] for i, s in picks]).float()  # (B, T, D)
    tokens = torch.stack([data[i].token_ids[s + 1: s + 1 + span] for i, s in picks])  # (B, T)
    targets = torch.stack([data[i].states[s + 1: s + 1 + span] for i, s in picks]).float()  # (B, T, D)
    index = torch.arange(span)
    weights = torch.stack([
        torch.where(s + 1 + index >= data[i].prompt_len - 1, 1.0, prompt_weight) for i, s in picks])  # (B, T)
    return states, tokens, targets, weights


def _second_step_mask(batch: int, span: int) -> Tensor:
    """``(B, 1, T, 2T)``: second-step token ``j`` sees the first pass's pairs before ``j`` (the
    true states a draft's context holds) and itself, as a depth-2 draft node does."""
    index = torch.arange(span)
    first = index[None, :] < index[:, None]  # (T, T): slot s < j
    own = torch.eye(span, dtype=torch.bool)
    return torch.cat([first, own], dim=1)[None, None].expand(batch, 1, span, 2 * span)


def unrolled_features(drafter: FeatureDrafter, states: Tensor, tokens: Tensor, *,
                      steps: int = 1) -> list[Tensor]:
    """The drafter's predicted states ``(B, T, D)`` per draft step, over a causal window.

    Step 1 reads the LLM's true states (the first draft after a verified token). Step 2 at
    ``j`` reads step 1's *prediction* of ``f_j`` with the true token ``x_{j+1}``, over the true
    pairs before ``j``: what a second draft step sees when the first draft was right (EAGLE-3's
    "training-time test"); its position 0 has no predicted input and is left out of losses.
    """
    if steps not in (1, 2):
        raise ValueError(f"steps must be 1 or 2, got {steps}")
    batch, span = tokens.shape
    first_cache = drafter.new_cache(batch, span)
    first = drafter.features(states, tokens, first_cache)
    if steps == 1:
        return [first]
    # A second cache holding the first pass's pairs as committed slots; built out of place, since
    # writing into the first cache would change tensors its attention saved for backward.
    cache = drafter.new_cache(batch, 2 * span)
    for layer in range(cache.num_layers):
        for slots, written in ((cache.keys, first_cache.keys), (cache.values, first_cache.values)):
            slots[layer] = torch.cat([written[layer][:, :, :span], slots[layer][:, :, span:]], dim=2)
    cache.lengths.fill_(span)
    shifted = torch.cat([states[:, :1].to(first.dtype), first[:, :-1]], dim=1)
    positions = torch.arange(span, device=tokens.device)[None].expand(batch, span)
    mask = _second_step_mask(batch, span).to(tokens.device)
    second = drafter.features(shifted, tokens, cache, positions=positions, slot_mask=mask)
    return [first, second]


def feature_loss(drafter: FeatureDrafter, states: Tensor, tokens: Tensor, targets: Tensor,
                 weights: Tensor | None = None, *, state_weight: float = 1.0, steps: int = 1) -> tuple[Tensor, Tensor]:
    """(loss, first-step draft logits): per draft step (:func:`unrolled_features`), cross
    entropy to the LLM's draft-vocabulary distribution at the next position plus
    ``state_weight`` times smooth L1 to its next state, averaged under ``weights`` ``(B, T)``."""
    predicted = unrolled_features(drafter, states, tokens, steps=steps)
    with torch.no_grad():
        teacher = F.softmax(drafter.head(targets.to(drafter.dtype)), dim=-1)
    w = torch.ones(tokens.shape, device=tokens.device) if weights is None else weights.to(tokens.device)
    loss = torch.zeros((), device=tokens.device)
    first_logits = drafter.head(predicted[0])
    for step, states_k in enumerate(predicted):
        logits = first_logits if step == 0 else drafter.head(states_k)  # (B, T, K)
        wk = w if step == 0 else w * (torch.arange(w.shape[1], device=w.device) > 0)
        cross_entropy = -(teacher * F.log_softmax(logits, dim=-1)).sum(-1)  # (B, T)
        smooth = F.smooth_l1_loss(states_k.float(), targets, reduction="none").mean(-1)  # (B, T)
        loss = loss + ((cross_entropy + state_weight * smooth) * wk).sum() / wk.sum().clamp(min=1e-6)
    return loss, first_logits


def evaluate_top1(drafter: FeatureDrafter, data: Sequence[StateSequence], *, length: int = 256,
                  batch_size: int = 8, generated_only: bool = False, step: int = 1) -> float:
    """Fraction of positions where the drafter's top-1 at draft ``step`` (1 or 2, see
    :func:`unrolled_features`) equals the LLM's top-1; ``generated_only``: only the positions
    that root drafts in serving (from the prompt's last token on), which is what acceptance
    depends on (prompt positions are easier)."""
    windows = training_windows(data, length)
    hits = total = 0
    drafter.eval()
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            picks = windows[start: start + batch_size]
            states, tokens, _, weights = training_batch(data, picks, length, prompt_weight=0.0 if generated_only else 1.0)
            predicted = unrolled_features(drafter, states, tokens, steps=step)[-1]
            guess = drafter.draft_ids[drafter.head(predicted).argmax(-1)]  # (B, T)
            span = tokens.shape[1]
            truth = torch.stack([data[i].top1[s + 1: s + 1 + span] for i, s in picks])
            counted = weights > 0
            if step == 2:
                counted[:, 0] = False
            hits += int(((guess == truth) & counted).sum())
            total += int(counted.sum())
    return hits / max(total, 1)


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser and schedule: AdamW at ``lr`` with cosine decay over ``epochs``, gradient norm
    clipped at ``clip``; windows of ``length`` positions, ``batch_size`` per step. ``steps``: draft
    steps unrolled in the loss (2 also trains on the drafter's own predicted states);
    ``prompt_weight``: loss weight of positions that never root a draft (inside the prompt)."""

    epochs: int = 20
    lr: float = 1e-3
    batch_size: int = 8
    length: int = 192
    clip: float = 1.0
    state_weight: float = 1.0
    seed: int = 0
    steps: int = 2
    prompt_weight: float = 0.2

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.length < 2 or not self.lr > 0 or not self.clip > 0:
            raise ValueError(f"bad TrainConfig {self}")
        if self.steps not in (1, 2) or not 0 <= self.prompt_weight <= 1:
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
    windows = training_windows(data, config.length)
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
            loss, _ = feature_loss(drafter, *training_batch(data, picks, config.length, config.prompt_weight),
                                   state_weight=config.state_weight, steps=config.steps)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(trainable, config.clip)
            optimizer.step()
            done = step + 1 - first_epoch * steps_per_epoch
            rate = (time.monotonic() - started) / done
            progress("train", step + 1, total_steps, {"loss": loss.item(), "eta_s": rate * (total_steps - step - 1)})
        history.append(evaluate_top1(drafter, held_out, length=config.length, generated_only=True)
                       if held_out else math.nan)
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
    "generate_state_data",
    "train_feature_drafter",
    "unrolled_features",
]
