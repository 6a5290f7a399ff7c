"""The checks of the row-invariant forward, shared by its tests (``test_row_invariance.py``) and
the subprocess that runs them under a lesser ISA path: each compares the float32 logits of one
request's tokens, bit for bit, between a reference (a prefill, then one-token steps) and the
same tokens computed inside other forwards (chains, trees, batches of other rows, prefills).

:func:`failures` returns the names of the comparisons that differ; an empty list is the claim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treeserve.ops.model import Transformer
from treeserve.ops.tree_attention import tree_mask_from_parents

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
"""The README's quick-start question in the default model's chat template."""

ROW_COUNTS = (1, 3, 16, 64)
"""Rows of the batched steps (the request's row among others at other lengths)."""


def other_prompts(vocab_size: int, count: int = 63) -> list[list[int]]:
    """Other requests' tokens, 20-120 each (other lengths than the request's)."""
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(20, 120, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def reference(model: Transformer, prompt: list[int], steps: int) -> tuple[Tensor, list[int], Tensor]:
    """The prompt's last logits ``(V,)`` from one prefill, the greedy continuation of ``steps``
    tokens, and each continuation token's logits ``(steps, V)`` from one-token steps."""
    cache = model.new_cache(1, len(prompt) + steps + 8)
    last = model(torch.tensor([prompt]), cache, logits_to_keep=1)[0, -1]
    cache.commit(0, list(range(len(prompt))))
    tokens, logits = [int(last.argmax())], []
    for _ in range(steps):
        out = model(torch.tensor([[tokens[-1]]]), cache)[0, 0]
        cache.commit(0, [0])
        logits.append(out)
        tokens.append(int(out.argmax()))
    return last, tokens[:steps], torch.stack(logits)


def _prefilled(model: Transformer, prompt: list[int], capacity: int) -> object:
    cache = model.new_cache(1, capacity)
    model(torch.tensor([prompt]), cache, logits_to_keep=1)
    cache.commit(0, list(range(len(prompt))))
    return cache


def failures(model: Transformer, prompt: list[int], others: list[list[int]], steps: int = 64) -> list[str]:
    """Every comparison whose logits differ in any bit: chains of 3, 16 and 64 tokens, trees of
    16 and 40 nodes, prefills of the prompt with part of the continuation (whole and in two
    pieces), a batched prefill beside other prompts, and one-token steps among
    :data:`ROW_COUNTS` rows (``others``: at least 63 other prompts, of other lengths). A prompt
    of more than 128 tokens takes the attention across its segments of 128 keys."""
    last, cont, want = reference(model, prompt, steps)
    capacity = len(prompt) + steps + 80
    failed: list[str] = []

    def check(name: str, got: Tensor, expected: Tensor) -> None:
        if not torch.equal(got, expected):
            failed.append(name)

    # Chains: token i of the chain is continuation token i (its logits predict token i + 1).
    for length in (3, 16, 64):
        cache = _prefilled(model, prompt, capacity)
        check(f"chain of {length}", model(torch.tensor([cont[:length]]), cache)[0], want[:length])

    # Trees: the continuation's first tokens as one path, distractors on branches: 16 nodes
    # (one chunk of the attention's tokens) and 40 (three chunks).
    generator = torch.Generator().manual_seed(len(prompt))
    for num_nodes, path in ((16, 6), (40, 10)):
        parents = [-1] + list(range(path - 1)) + [
            int(torch.randint(0, i, (1,), generator=generator)) for i in range(path, num_nodes)]
        distractors = torch.randint(3, model.config.vocab_size, (num_nodes,), generator=generator).tolist()
        nodes = cont[:path] + distractors[path:]
        mask = tree_mask_from_parents(torch.tensor(parents))[None]
        depth = mask.sum(-1) - 1  # (1, T)
        cache = _prefilled(model, prompt, capacity)
        tree = model(torch.tensor([nodes]), cache, tree_mask=mask, positions=len(prompt) + depth)[0]
        check(f"{num_nodes}-node tree", tree[:path], want[:path])

    # Prefills: the prompt with the first k continuation tokens, in one forward and split in two.
    for k in (1, 17, steps - 1):
        full = model(torch.tensor([prompt + cont[:k]]), model.new_cache(1, capacity))[0]
        check(f"prefill of prompt + {k}", full[len(prompt) - 1:], torch.cat([last[None], want[:k]]))
    split = len(prompt) // 3
    cache = model.new_cache(1, capacity)
    model(torch.tensor([prompt[:split]]), cache)
    cache.commit(0, list(range(split)))
    rest = model(torch.tensor([prompt[split:] + cont[:8]]), cache)[0]
    check("prefill in two pieces", rest[len(prompt) - split - 1:], torch.cat([last[None], want[:8]]))

    # A batched prefill, right-padded: the prompt beside two others of other lengths.
    batch = [prompt, *others[:2]]
    width = max(len(p) for p in batch)
    padded = torch.tensor([p + [p[-1]] * (width - len(p)) for p in batch])
    batched = model(padded, model.new_cache(len(batch), width + 8))
    check("batched prefill (3 rows)", batched[0, len(prompt) - 1], last)

    # One-token steps: the request's row (its continuation's token 8) among others.
    for rows in ROW_COUNTS:
        cache = model.new_cache(rows, capacity)
        lengths = [len(prompt) + 8] + [len(p) for p in others[:rows - 1]]
        width = max(lengths)
        sequences = [prompt + cont[:8]] + others[:rows - 1]
        padded = torch.tensor([s + [s[-1]] * (width - len(s)) for s in sequences])
        model.hidden_states(padded, cache)
        for row, length in enumerate(lengths):
            cache.commit(row, list(range(length)))
        step = torch.tensor([[cont[8]]] + [[s[-1]] for s in sequences[1:]])
        check(f"step among {rows} rows", model(step, cache)[0, 0], want[8])
    return failed
