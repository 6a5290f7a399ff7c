"""The teacher's side of distillation: the prompts (:func:`read_prompts`,
:func:`select_prompts`, or prompts the verifier writes itself, :func:`self_written_prompts`) and
the teacher data (:func:`generate_teacher_data`: chat prompts continued by the verifier's own
greedy output, with its top-``k`` next-token probabilities at every position, in resumable
shard files). :mod:`~treeserve.training.distill` and
:mod:`~treeserve.training.feature_distill` train on it.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from treeserve.ops.batch_step import prefill_rows
from treeserve.ops.model import Transformer
from treeserve.ops.tokenizer import Tokenizer

DistillProgress = Callable[[str, int, int], None]
"""``(stage, done, total)``: called after each unit of work (a batch, a training step)."""


def no_progress(stage: str, done: int, total: int) -> None:
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
    progress: DistillProgress = no_progress,
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


def save_atomic(obj: object, path: Path) -> None:
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
    progress: DistillProgress = no_progress,
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
            save_atomic({"records": [r.__dict__ for r in records]}, path)
        data.extend(records)
        progress("teacher", index + 1, num_batches)
    return data


def check_settings(path: Path, settings: dict[str, object]) -> None:
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
