"""Distilling small speculative models (SSMs) from a verifier, with SpecInfer's boost-tuning.

Three stages, all pure torch, resumable through files in a work dir, reporting through a
``progress(stage, done, total)`` callback (no printing):

1. **Teacher data** (:func:`~treeserve.training.teacher.generate_teacher_data`): chat prompts run through the verifier,
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

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from treeserve.ops.model import Transformer
from treeserve.ops.ssm import DistilledSSM, init_ssm_from_verifier, save_ssms, ssm_config_for
from treeserve.training.teacher import (
    DistillProgress,
    TeacherSequence,
    check_settings,
    generate_teacher_data,
    no_progress,
    save_atomic,
)

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
    progress: DistillProgress = no_progress,
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
            save_atomic({"model": ssm.stored_state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}, checkpoint)
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
    progress: DistillProgress = no_progress,
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
                save_atomic(ssm.stored_state_dict(), final)
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
    progress: DistillProgress = no_progress,
) -> DistillResult:
    """Teacher data, draft vocabulary, boost-tuning and the weights file, all resumable in ``work_dir``.

    The last ``num_heldout`` sequences are kept out of training and measure top-1 agreement.
    """
    if len(prompts) <= num_heldout:
        raise ValueError(f"need more than num_heldout={num_heldout} prompts, got {len(prompts)}")
    work = Path(work_dir)
    check_settings(work / "teacher_settings.json", {"batch_size": batch_size, "max_new_tokens": max_new_tokens,
                                                      "top_k": top_k})
    check_settings(work / "train_settings.json", {"num_prompts": len(prompts), "num_heldout": num_heldout,
                                                    "prompt_weight": prompt_weight, **config.__dict__})
    data = generate_teacher_data(verifier, prompts, work, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                 stop_ids=stop_ids, top_k=top_k, progress=progress)
    train_data, heldout_data = data[:-num_heldout], data[-num_heldout:]
    vocab_path = work / f"draft_vocab_{config.draft_vocab_size}.pt"
    if vocab_path.exists():
        draft_ids = torch.load(vocab_path, weights_only=True)
    else:
        draft_ids = draft_vocabulary(train_data, config.draft_vocab_size, always=sorted(stop_ids))
        save_atomic(draft_ids, vocab_path)
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
