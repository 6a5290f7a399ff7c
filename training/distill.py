"""Distilling small speculative models (SSMs) from a verifier, with SpecInfer's boost-tuning.

Three stages, all pure torch, resumable through files in a work dir, reporting through a
``progress(stage, done, total)`` callback (no printing):

1. **Teacher data** (:func:`generate_teacher_data`): chat prompts run through the verifier,
   continued by its own greedy output (on-policy), in batches over a multi-row KV cache. At
   every position the verifier's top-``k`` next-token probabilities are kept, so no second
   teacher pass is needed. Each finished batch is one shard file; a restart skips them.
2. **Draft vocabulary** (:func:`draft_vocabulary`): the most frequent teacher top-1 tokens.
3. **Collective boost-tuning** (:func:`boost_tune`): SSM 1 is distilled on all positions; SSM
   ``j`` starts from SSM ``j-1`` and is fine-tuned with the loss weight of the positions that
   SSMs ``1..j-1`` already predict (top-1 equal to the teacher's) scaled down, so it focuses
   on what the others miss (SpecInfer section 3). Training checkpoints every epoch.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from treeserve.ops.batch_step import prefill_rows
from treeserve.ops.model import Transformer
from treeserve.ops.tokenizer import Tokenizer
from treeserve.ops.ssm import DistilledSSM, init_ssm_from_verifier, save_ssms, ssm_config_for

DistillProgress = Callable[[str, int, int], None]
"""``(stage, done, total)``: called after each unit of work (a batch, a training step)."""


def _no_progress(stage: str, done: int, total: int) -> None:
    del stage, done, total


@dataclass(frozen=True)
class TeacherSequence:
    """One prompt plus the teacher's greedy continuation, with the teacher's top-k per position.

    ``token_ids`` (L,) int64; ``prompt_len`` tokens of it are the prompt. ``top_ids``/``top_probs``
    ``(L - 1, k)``: the teacher's k most likely next tokens (and their probabilities) after
    each prefix ``token_ids[: t + 1]``, most likely first.
    """

    token_ids: Tensor
    prompt_len: int
    top_ids: Tensor
    top_probs: Tensor


# --------------------------------------------------------------------------- prompts


def read_prompts(paths: Sequence[str | Path]) -> list[str]:
    """The ``prompt`` field of every line of the given JSONL files (split on ``\\n`` only)."""
    prompts: list[str] = []
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").split("\n"):
            if line.strip():
                prompt = json.loads(line).get("prompt")
                if isinstance(prompt, str) and prompt.strip():
                    prompts.append(prompt)
    return prompts


def select_prompts(
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    max_prompts: int,
    max_prompt_tokens: int = 320,
    seed: int = 0,
) -> list[list[int]]:
    """Chat-template token ids of up to ``max_prompts`` prompts, shuffled by ``seed``.

    Prompts longer than ``max_prompt_tokens`` tokens are skipped. The order depends only on
    ``prompts`` and ``seed``, so a smaller ``max_prompts`` selects a prefix of a larger one (and
    the teacher shards of the prefix stay valid).
    """
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    out: list[list[int]] = []
    for index in order:
        if len(out) >= max_prompts:
            break
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompts[index]}], add_generation_prompt=True)
        ids = tokenizer.encode(text)
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
    return out


def user_turn_prefix(tokenizer: Tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's first message begins (the default
    system prompt included, where the template adds one)."""
    sentinel = "\u0001USER\u0001"
    text = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], add_generation_prompt=False)
    return tokenizer.encode(text[: text.index(sentinel)])


@torch.no_grad()
def self_written_prompts(
    model: Transformer,
    tokenizer: Tokenizer,
    num: int,
    *,
    temperature: float = 0.9,
    max_tokens: int = 96,
    batch_size: int = 64,
    seed: int = 0,
    min_chars: int = 16,
    exclude: Sequence[str] = (),
    max_rounds: int | None = None,
    progress: DistillProgress = _no_progress,
) -> list[str]:
    """Up to ``num`` distinct user questions written by ``model`` itself: ``batch_size`` rows
    sampled at ``temperature`` from the user-turn prefix of its chat template, each until its
    end-of-turn token. A question is kept when its turn ended (not cut at ``max_tokens``), it
    has at least ``min_chars`` characters and a letter, no chat-template marker, and its
    normalized text (lower case, single spaces) is new and not in ``exclude`` (the evaluation
    sets). Deterministic for a ``seed``. Stops after ``max_rounds`` batches (default: enough
    for ``num`` if a fifth of the draws were kept).
    """
    if num < 1 or batch_size < 1 or temperature <= 0:
        raise ValueError(f"need num >= 1, batch_size >= 1 and temperature > 0, got {num}, {batch_size}, {temperature}")
    prefix = user_turn_prefix(tokenizer)
    stops = set(tokenizer.stop_ids)
    gen = torch.Generator().manual_seed(seed)

    def norm(text: str) -> str:
        return " ".join(text.lower().split())

    seen = {norm(t) for t in exclude}
    kept: list[str] = []
    rounds = max_rounds if max_rounds is not None else 5 * math.ceil(num / batch_size) + 5
    device = model.device
    for _ in range(rounds):
        cache = model.new_cache(batch_size, len(prefix) + max_tokens)
        prefill_rows(model, cache, [(row, prefix[:-1]) for row in range(batch_size)])
        feed = [prefix[-1]] * batch_size
        written: list[list[int]] = [[] for _ in range(batch_size)]
        ended = [False] * batch_size
        for _ in range(max_tokens):
            logits = model(torch.tensor(feed, device=device)[:, None], cache)[:, -1].float()  # (B, V)
            draws = torch.multinomial(torch.softmax(logits.cpu() / temperature, dim=-1), 1, generator=gen)[:, 0]
            for row in range(batch_size):
                cache.commit(row, [] if ended[row] else [0])
                if not ended[row]:
                    token = int(draws[row])
                    ended[row] = token in stops
                    if not ended[row]:
                        written[row].append(token)
                    feed[row] = token
            if all(ended):
                break
        for row in range(batch_size):
            text = tokenizer.decode(written[row]).strip()
            if not ended[row] or len(text) < min_chars or "<|" in text or not any(c.isalpha() for c in text):
                continue
            if norm(text) not in seen and len(kept) < num:
                seen.add(norm(text))
                kept.append(text)
        progress("questions", len(kept), num)
        if len(kept) >= num:
            break
    return kept


# --------------------------------------------------------------------------- teacher data


def _top_k_probs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)  # (..., V)
    top = torch.topk(probs, k, dim=-1)
    return top.indices.to(torch.int32), top.values.to(torch.float16)


@torch.no_grad()
def teacher_generate_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: frozenset[int] | set[int],
    top_k: int = 8,
) -> list[TeacherSequence]:
    """Greedy-continue every prompt with ``model`` in one batch and record its top-``k`` per position.

    Each prompt is prefilled on its own (batch-1, exactly as incremental decoding does) and
    its KV copied into a row of a shared cache; then all unfinished rows decode one token per
    batched forward. A row ends after a stop token or ``max_new_tokens`` tokens.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("teacher_generate_batch needs non-empty prompts")
    batch = len(prompts)
    cache = model.new_cache(batch, max(len(p) for p in prompts) + max_new_tokens)
    device = model.device
    seqs = [[int(t) for t in p] for p in prompts]
    top_ids: list[list[Tensor]] = [[] for _ in range(batch)]
    top_probs: list[list[Tensor]] = [[] for _ in range(batch)]
    next_tokens: list[int] = []
    for row, prompt in enumerate(seqs):
        scratch = model.new_cache(1, len(prompt))
        logits = model(torch.tensor([prompt], device=device), scratch)  # (1, P, V)
        for layer in range(cache.num_layers):
            cache.keys[layer][row, :, : len(prompt)] = scratch.keys[layer][0]  # (n_kv, P, hd)
            cache.values[layer][row, :, : len(prompt)] = scratch.values[layer][0]
        cache.lengths[row] = len(prompt)
        ids, probs = _top_k_probs(logits[0], top_k)  # (P, k)
        top_ids[row].append(ids)
        top_probs[row].append(probs)
        next_tokens.append(int(ids[-1, 0]))
    is_done = [False] * batch
    num_new = [0] * batch
    while True:
        for row in range(batch):
            if not is_done[row]:
                seqs[row].append(next_tokens[row])
                num_new[row] += 1
                if next_tokens[row] in stop_ids or num_new[row] >= max_new_tokens:
                    is_done[row] = True
        if all(is_done):
            break
        # Finished rows still take part (batched forward) but never commit, so they stay put.
        feed = torch.tensor([[seqs[row][-1]] for row in range(batch)], device=device)  # (B, 1)
        logits = model(feed, cache)  # (B, 1, V)
        ids, probs = _top_k_probs(logits[:, 0], top_k)  # (B, k)
        for row in range(batch):
            if is_done[row]:
                cache.commit(row, [])
                continue
            cache.commit(row, [0])
            top_ids[row].append(ids[row : row + 1])
            top_probs[row].append(probs[row : row + 1])
            next_tokens[row] = int(ids[row, 0])
    out: list[TeacherSequence] = []
    for row, prompt_ids in enumerate(prompts):
        length = len(seqs[row])
        out.append(
            TeacherSequence(
                token_ids=torch.tensor(seqs[row], dtype=torch.long),
                prompt_len=len(prompt_ids),
                top_ids=torch.cat(top_ids[row])[: length - 1],
                top_probs=torch.cat(top_probs[row])[: length - 1],
            )
        )
    return out


def _save_atomic(obj: object, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def generate_teacher_data(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    work_dir: str | Path,
    *,
    batch_size: int = 16,
    max_new_tokens: int = 160,
    stop_ids: frozenset[int] | set[int],
    top_k: int = 8,
    progress: DistillProgress = _no_progress,
) -> list[TeacherSequence]:
    """Teacher data for ``prompts``, one shard file per batch under ``work_dir/teacher``.

    Shards already on disk are loaded instead of recomputed, so an interrupted run resumes at
    the first missing batch. Batches are formed in the given prompt order (sort by length
    beforehand to waste less padding).
    """
    folder = Path(work_dir) / "teacher"
    folder.mkdir(parents=True, exist_ok=True)
    num_batches = math.ceil(len(prompts) / batch_size)
    data: list[TeacherSequence] = []
    for index in range(num_batches):
        path = folder / f"shard_{index:05d}.pt"
        chunk = prompts[index * batch_size : (index + 1) * batch_size]
        if path.exists():
            saved = torch.load(path, weights_only=True)
            records = [TeacherSequence(**r) for r in saved["records"]]
        else:
            records = teacher_generate_batch(model, chunk, max_new_tokens=max_new_tokens, stop_ids=stop_ids, top_k=top_k)
            _save_atomic({"records": [r.__dict__ for r in records]}, path)
        data.extend(records)
        progress("teacher", index + 1, num_batches)
    return data


def _check_settings(path: Path, settings: dict[str, object]) -> None:
    """Record ``settings`` in ``path``, or check that the checkpoints there were made with them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved != json.loads(json.dumps(settings)):
            raise ValueError(
                f"{path.parent} holds checkpoints made with other settings ({saved}, now {settings}); "
                "use another work dir or delete it"
            )
    else:
        path.write_text(json.dumps(settings, sort_keys=True), encoding="utf-8")


def draft_vocabulary(data: Sequence[TeacherSequence], size: int, *, always: Sequence[int] = ()) -> Tensor:
    """The ``size`` token ids most often the teacher's top-1, sorted ascending (int64 ``(size,)``).

    Ids in ``always`` (e.g. stop tokens) come first; ties are broken by how often a token is
    in the teacher's lower top-k ranks, then by the lower id (so ``size`` may exceed the
    number of distinct top-1 tokens).
    """
    vocab = max(int(s.top_ids.max()) for s in data) + 1
    vocab = max([vocab, *[int(t) + 1 for t in always]])
    if size > vocab:
        raise ValueError(f"a draft vocabulary of {size} ids needs token ids up to {size - 1}; the data has {vocab}")
    top1 = torch.zeros(vocab, dtype=torch.long)
    lower = torch.zeros(vocab, dtype=torch.long)
    for seq in data:
        top1 += torch.bincount(seq.top_ids[:, 0].long(), minlength=vocab)
        lower += torch.bincount(seq.top_ids[:, 1:].reshape(-1).long(), minlength=vocab)
    score = top1 * (1 << 32) + lower  # (V,) lexicographic: top-1 count, then lower-rank count
    forced = sorted({int(t) for t in always})
    score[forced] = -1
    order = torch.argsort(-score, stable=True).tolist()
    chosen = forced + [t for t in order if t not in set(forced)][: max(size - len(forced), 0)]
    return torch.tensor(sorted(chosen[:size]), dtype=torch.long)


# --------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainingSet:
    """Teacher data flattened for training: padded sequences and per-position targets.

    ``tokens`` (N, T) int64 right-padded with 0; ``target_idx`` (N, T, k) int64 draft-vocabulary
    indices of the teacher's top-k after each position (-1: not in the draft vocabulary or no
    target); ``target_probs`` (N, T, k) float32; ``base_weights`` (N, T) float32 (0 on padding
    and on the last token of each sequence); ``teacher_top1`` (N, T) int64 teacher top-1 draft
    index (-1 when outside the vocabulary or no target); ``lengths`` (N,) real tokens per row;
    ``is_response`` (N, T) bool: the position predicts a response token.
    """

    tokens: Tensor
    target_idx: Tensor
    target_probs: Tensor
    base_weights: Tensor
    teacher_top1: Tensor
    lengths: Tensor
    is_response: Tensor

    @property
    def num_sequences(self) -> int:
        """Number of sequences (rows)."""
        return int(self.tokens.shape[0])


def build_training_set(data: Sequence[TeacherSequence], draft_ids: Tensor, *, prompt_weight: float = 0.25) -> TrainingSet:
    """Pad ``data`` into a :class:`TrainingSet` over the draft vocabulary ``draft_ids``.

    Positions inside the prompt weigh ``prompt_weight``, those predicting response tokens 1.
    """
    if not data:
        raise ValueError("build_training_set needs at least one teacher sequence")
    vocab = max(int(draft_ids.max()), max(int(s.top_ids.max()) for s in data)) + 1
    lookup = torch.full((vocab,), -1, dtype=torch.long)
    lookup[draft_ids] = torch.arange(draft_ids.numel())
    num, length = len(data), max(len(s.token_ids) for s in data)
    k = data[0].top_ids.shape[1]
    tokens = torch.zeros(num, length, dtype=torch.long)
    target_idx = torch.full((num, length, k), -1, dtype=torch.long)
    target_probs = torch.zeros(num, length, k)
    weights = torch.zeros(num, length)
    for row, seq in enumerate(data):
        n = len(seq.token_ids)
        tokens[row, :n] = seq.token_ids
        target_idx[row, : n - 1] = lookup[seq.top_ids.long()]
        target_probs[row, : n - 1] = seq.top_probs.float()
        weights[row, : n - 1] = 1.0
        weights[row, : max(seq.prompt_len - 1, 0)] = prompt_weight
    target_probs = torch.where(target_idx >= 0, target_probs, torch.zeros(()))
    lengths = torch.tensor([len(s.token_ids) for s in data], dtype=torch.long)
    starts = torch.tensor([max(s.prompt_len - 1, 0) for s in data], dtype=torch.long)
    columns = torch.arange(length)[None]  # (1, T)
    is_response = (columns >= starts[:, None]) & (columns < lengths[:, None] - 1)  # (N, T)
    return TrainingSet(tokens, target_idx, target_probs, weights, target_idx[..., 0].clone(), lengths, is_response)


def distill_loss(draft_logits: Tensor, target_idx: Tensor, target_probs: Tensor, weights: Tensor) -> Tensor:
    """Weighted cross-entropy of the SSM against the teacher's truncated top-k distribution.

    ``draft_logits`` (B, T, K); ``target_idx``/``target_probs`` (B, T, k) (-1 / 0 where absent);
    ``weights`` (B, T). Returns ``sum(w * sum_k -p_k log q_k) / sum(w)``.
    """
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)  # (B, T, K)
    picked = log_q.gather(-1, target_idx.clamp(min=0))  # (B, T, k)
    per_position = -(target_probs * picked).sum(-1)  # (B, T)
    return (weights * per_position).sum() / weights.sum().clamp(min=1e-6)


def boost_weights(base_weights: Tensor, predictions: Sequence[Tensor], teacher_top1: Tensor, *, matched_weight: float) -> Tensor:
    """Boost-tuning weights for the next SSM: positions some earlier SSM already gets right
    (top-1 equal to the teacher's ``teacher_top1``) are scaled by ``matched_weight`` (< 1).

    ``predictions``: each earlier SSM's top-1 draft index ``(N, T)``. Positions without a
    teacher target in the draft vocabulary (``teacher_top1 == -1``) count as missed.
    """
    if not 0.0 <= matched_weight <= 1.0:
        raise ValueError(f"matched_weight must be in [0, 1], got {matched_weight}")
    covered = torch.zeros_like(teacher_top1, dtype=torch.bool)
    for top1 in predictions:
        covered |= (top1 == teacher_top1) & (teacher_top1 >= 0)
    return base_weights * torch.where(covered, matched_weight, 1.0)


def _batches(train: TrainingSet, rows: Sequence[int], tokens_per_batch: int, generator: random.Random | None) -> list[list[int]]:
    lengths = train.lengths
    ordered = sorted(rows, key=lambda r: int(lengths[r]))
    batches: list[list[int]] = []
    current: list[int] = []
    for row in ordered:
        longest = max([int(lengths[r]) for r in current] + [int(lengths[row])])
        if current and longest * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(row)
    if current:
        batches.append(current)
    if generator is not None:
        generator.shuffle(batches)
    return batches


def _batch_tensors(train: TrainingSet, rows: list[int], weights: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    index = torch.tensor(rows)
    width = int(train.lengths[index].max())
    return (
        train.tokens[index, :width],
        train.target_idx[index, :width],
        train.target_probs[index, :width],
        weights[index, :width],
    )


@torch.no_grad()
def predict_top1(ssm: DistilledSSM, train: TrainingSet, *, tokens_per_batch: int = 8192) -> Tensor:
    """The SSM's top-1 draft index at every position ``(N, T)`` (padding positions: -1)."""
    out = torch.full_like(train.teacher_top1, -1)
    for rows in _batches(train, range(train.num_sequences), tokens_per_batch, None):
        tokens, _, _, _ = _batch_tensors(train, rows, train.base_weights)
        cache = ssm.new_cache(len(rows), tokens.shape[1])
        top1 = ssm.draft_logits(tokens, cache).argmax(dim=-1)  # (B, T)
        out[torch.tensor(rows), : tokens.shape[1]] = top1
    has_target = torch.arange(out.shape[1])[None] < (train.lengths[:, None] - 1)  # (N, T)
    return torch.where(has_target, out, torch.full_like(out, -1))


def top1_agreement(predictions: Sequence[Tensor], train: TrainingSet, *, response_only: bool = True) -> float:
    """Fraction of positions where any of ``predictions`` equals the teacher's top-1.

    With ``response_only`` only positions predicting response tokens count.
    """
    has_target = torch.arange(train.tokens.shape[1])[None] < (train.lengths[:, None] - 1)  # (N, T)
    valid = train.is_response if response_only else has_target
    covered = torch.zeros_like(valid)
    for top1 in predictions:
        covered |= (top1 == train.teacher_top1) & (train.teacher_top1 >= 0)
    return float((covered & valid).sum()) / max(int(valid.sum()), 1)


def train_ssm(
    ssm: DistilledSSM,
    train: TrainingSet,
    weights: Tensor,
    *,
    num_epochs: int,
    lr: float,
    tokens_per_batch: int = 4096,
    seed: int = 0,
    checkpoint: Path | None = None,
    progress: DistillProgress = _no_progress,
    stage: str = "train",
) -> None:
    """Distil ``ssm`` in place on ``train`` with per-position ``weights`` (AdamW, cosine LR).

    The shared embedding and the head rows stay frozen. With ``checkpoint`` the model and
    optimizer state are saved after every epoch and a run finds and resumes from it.
    """
    params = [p for name, p in ssm.named_parameters() if not name.startswith("embed_tokens.")]
    ssm.embed_tokens.weight.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(seed)
    epoch_batches = [_batches(train, range(train.num_sequences), tokens_per_batch, rng) for _ in range(num_epochs)]
    total = sum(len(b) for b in epoch_batches)
    start_epoch = 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        ssm.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = int(state["epoch"])
    step = sum(len(b) for b in epoch_batches[:start_epoch])
    ssm.train()
    for epoch in range(start_epoch, num_epochs):
        for rows in epoch_batches[epoch]:
            for group in optimizer.param_groups:
                group["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * step / max(total, 1)))
            tokens, target_idx, target_probs, batch_weights = _batch_tensors(train, rows, weights)
            cache = ssm.new_cache(len(rows), tokens.shape[1])
            loss = distill_loss(ssm.draft_logits(tokens, cache), target_idx, target_probs, batch_weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            progress(stage, step, total)
        if checkpoint is not None:
            _save_atomic({"model": ssm.stored_state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}, checkpoint)
    ssm.eval()
    for p in params:
        p.requires_grad_(False)


# --------------------------------------------------------------------------- boost-tuning


@dataclass(frozen=True)
class BoostConfig:
    """Hyper-parameters of collective boost-tuning (see :func:`boost_tune`)."""

    num_ssms: int = 2
    num_layers: int = 1
    ffn_dim: int = 1024
    draft_vocab_size: int = 4096
    num_epochs: int = 3
    num_boost_epochs: int = 2
    lr: float = 1e-3
    boost_lr: float = 5e-4
    matched_weight: float = 0.1
    tokens_per_batch: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_ssms", "num_layers", "ffn_dim", "draft_vocab_size", "num_epochs", "tokens_per_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"BoostConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_boost_epochs < 0 or not self.lr > 0 or not self.boost_lr > 0:
            raise ValueError("BoostConfig needs num_boost_epochs >= 0 and positive learning rates")
        if not 0.0 <= self.matched_weight <= 1.0:
            raise ValueError(f"BoostConfig.matched_weight must be in [0, 1], got {self.matched_weight}")


def boost_tune(
    verifier: Transformer,
    train: TrainingSet,
    draft_ids: Tensor,
    config: BoostConfig,
    *,
    work_dir: Path | None = None,
    progress: DistillProgress = _no_progress,
) -> list[DistilledSSM]:
    """Collective boost-tuning of ``config.num_ssms`` SSMs (SpecInfer section 3).

    SSM 1 starts from the verifier's first blocks and is distilled on all positions. SSM ``j``
    starts from SSM ``j-1`` and is fine-tuned with :func:`boost_weights` (positions any earlier
    SSM predicts right weigh ``matched_weight``). With ``work_dir``, finished SSMs and epoch
    checkpoints are kept in ``work_dir/train`` and a rerun resumes from them.
    """
    folder = None if work_dir is None else Path(work_dir) / "train"
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    ssm_cfg = ssm_config_for(verifier, num_layers=config.num_layers, ffn_dim=config.ffn_dim,
                             draft_vocab_size=config.draft_vocab_size)
    ssms: list[DistilledSSM] = []
    predictions: list[Tensor] = []
    for j in range(config.num_ssms):
        ssm = init_ssm_from_verifier(verifier, ssm_cfg, draft_ids)
        if ssms:
            ssm.load_state_dict(ssms[-1].stored_state_dict(), strict=False)
        final = None if folder is None else folder / f"ssm{j}_final.pt"
        if final is not None and final.exists():
            ssm.load_state_dict(torch.load(final, weights_only=True), strict=False)
        else:
            if j == 0:
                weights, epochs, lr = train.base_weights, config.num_epochs, config.lr
            else:
                weights = boost_weights(train.base_weights, predictions, train.teacher_top1,
                                        matched_weight=config.matched_weight)
                epochs, lr = config.num_boost_epochs, config.boost_lr
            if epochs > 0:
                train_ssm(
                    ssm, train, weights, num_epochs=epochs, lr=lr, tokens_per_batch=config.tokens_per_batch,
                    seed=config.seed + j, checkpoint=None if folder is None else folder / f"ssm{j}_epoch.pt",
                    progress=progress, stage=f"train ssm{j + 1}",
                )
            if final is not None:
                _save_atomic(ssm.stored_state_dict(), final)
        ssm.requires_grad_(False)
        ssms.append(ssm.eval())
        if j + 1 < config.num_ssms:
            predictions.append(predict_top1(ssm, train))
    return ssms


@dataclass(frozen=True)
class DistillResult:
    """What :func:`run_distillation` produced: the SSMs, their file, and held-out agreement.

    ``heldout_agreement[j]``: top-1 agreement with the teacher on held-out response positions of
    SSMs ``1..j+1`` together (any of them right); ``draft_vocab_coverage``: share of held-out
    teacher top-1 tokens inside the draft vocabulary.
    """

    ssms: list[DistilledSSM]
    path: Path
    num_train_sequences: int
    num_heldout_sequences: int
    num_train_tokens: int
    heldout_agreement: list[float]
    draft_vocab_coverage: float


def run_distillation(
    verifier: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    stop_ids: frozenset[int] | set[int],
    work_dir: str | Path,
    out_path: str | Path,
    config: BoostConfig,
    batch_size: int = 16,
    max_new_tokens: int = 128,
    top_k: int = 8,
    num_heldout: int = 16,
    prompt_weight: float = 0.25,
    progress: DistillProgress = _no_progress,
) -> DistillResult:
    """Teacher data, draft vocabulary, boost-tuning and the weights file, all resumable in ``work_dir``.

    The last ``num_heldout`` sequences are kept out of training and measure top-1 agreement.
    """
    if len(prompts) <= num_heldout:
        raise ValueError(f"need more than num_heldout={num_heldout} prompts, got {len(prompts)}")
    work = Path(work_dir)
    _check_settings(work / "teacher_settings.json", {"batch_size": batch_size, "max_new_tokens": max_new_tokens,
                                                      "top_k": top_k})
    _check_settings(work / "train_settings.json", {"num_prompts": len(prompts), "num_heldout": num_heldout,
                                                    "prompt_weight": prompt_weight, **config.__dict__})
    data = generate_teacher_data(verifier, prompts, work, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                 stop_ids=stop_ids, top_k=top_k, progress=progress)
    train_data, heldout_data = data[:-num_heldout], data[-num_heldout:]
    vocab_path = work / f"draft_vocab_{config.draft_vocab_size}.pt"
    if vocab_path.exists():
        draft_ids = torch.load(vocab_path, weights_only=True)
    else:
        draft_ids = draft_vocabulary(train_data, config.draft_vocab_size, always=sorted(stop_ids))
        _save_atomic(draft_ids, vocab_path)
    train = build_training_set(train_data, draft_ids, prompt_weight=prompt_weight)
    ssms = boost_tune(verifier, train, draft_ids, config, work_dir=work, progress=progress)
    heldout = build_training_set(heldout_data, draft_ids, prompt_weight=prompt_weight)
    predictions = [predict_top1(ssm, heldout) for ssm in ssms]
    agreement = [top1_agreement(predictions[: j + 1], heldout) for j in range(len(ssms))]
    valid = heldout.is_response
    coverage = float(((heldout.teacher_top1 >= 0) & valid).sum()) / max(int(valid.sum()), 1)
    save_ssms(ssms, out_path, metadata={"boost": config.__dict__, "heldout_agreement": agreement})
    return DistillResult(ssms, Path(out_path), len(train_data), len(heldout_data),
                         int((train.lengths - 1).sum()), agreement, coverage)
