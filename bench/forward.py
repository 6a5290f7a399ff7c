"""Forward-pass micro-benchmark of the default model on this machine.

Measures (median of repeats) one forward over a token tree of 1, 4, 8, 16, 32 and 64 nodes on
a 256-token committed cache, as a ratio to a 1-token decode step, and greedy decode tokens/s,
in float32 and bfloat16. ``--json`` prints one JSON object; otherwise a table.

    python bench/forward.py [--json] [--model NAME_OR_PATH] [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from treeserve.models import DEFAULT_MODEL, load_model
from treeserve.ops.model import Transformer
from treeserve.ops.tree_attention import tree_mask_from_parents

TREE_SIZES = (1, 4, 8, 16, 32, 64)
CACHE_LENGTH = 256


def binary_tree(num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tree_mask (1, n, n), depth (n,)) of a complete binary token tree with ``num_nodes`` nodes."""
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, num_nodes)])
    mask = tree_mask_from_parents(parents)
    return mask[None], mask.sum(-1) - 1


def timings(fn: Any, repeats: int) -> tuple[float, float]:
    """(median, min) wall seconds of ``fn()`` over ``repeats`` runs after one warm-up.

    The minimum is reported too because on a shared machine it is the least disturbed run.
    """
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def tree_ratios(model: Transformer, repeats: int) -> dict[str, Any]:
    """Median forward time per tree size and its ratio to the 1-token decode step."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    cache = model.new_cache(1, CACHE_LENGTH + max(TREE_SIZES) + 1)
    model(torch.randint(0, vocab, (1, CACHE_LENGTH), generator=gen), cache)
    cache.commit(0, range(CACHE_LENGTH))
    seconds: dict[int, float] = {}
    fastest: dict[int, float] = {}
    for n in TREE_SIZES:
        tokens = torch.randint(0, vocab, (1, n), generator=gen)
        mask, depth = binary_tree(n)
        positions = (CACHE_LENGTH + depth)[None]
        if n == 1:
            seconds[n], fastest[n] = timings(lambda: model(tokens, cache), repeats)  # plain decode step
        else:
            seconds[n], fastest[n] = timings(lambda: model(tokens, cache, tree_mask=mask, positions=positions), repeats)
    base = seconds[1]
    return {
        "decode_step_ms": round(base * 1e3, 2),
        "tree_forward_ms": {str(n): round(s * 1e3, 2) for n, s in seconds.items()},
        "ratio_to_decode_step": {str(n): round(s / base, 3) for n, s in seconds.items()},
        "ratio_to_decode_step_of_minimums": {str(n): round(s / fastest[1], 3) for n, s in fastest.items()},
    }


def decode_tokens_per_second(model: Transformer, prompt_len: int, num_tokens: int, repeats: int) -> float:
    """Greedy decode speed (tokens/s, median over repeats) after a ``prompt_len``-token prefill."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=gen)
    rates = []
    for _ in range(repeats):
        cache = model.new_cache(1, prompt_len + num_tokens + 1)
        logits = model(prompt, cache)
        cache.commit(0, range(prompt_len))
        token = logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(num_tokens):
            logits = model(token, cache)
            cache.commit(0, [0])
            token = logits[:, -1:].argmax(-1)
        rates.append(num_tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name, .gguf path or model folder")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "model": args.model,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cache_length": CACHE_LENGTH,
        "tree_shape": "complete binary tree",
    }
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        loaded = load_model(args.model, dtype=dtype)
        entry = tree_ratios(loaded.model, args.repeats)
        entry["decode_tokens_per_s"] = round(
            decode_tokens_per_second(loaded.model, 32, args.decode_tokens, max(3, args.repeats // 2)), 2
        )
        entry["load_seconds"] = round(loaded.load_seconds, 2)
        result[name] = entry
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for name in ("float32", "bfloat16"):
        entry = result[name]
        print(f"{name}: decode {entry['decode_tokens_per_s']} tok/s, step {entry['decode_step_ms']} ms")
        for n, ratio in entry["ratio_to_decode_step"].items():
            print(f"  tree {n:>2} nodes: {entry['tree_forward_ms'][n]:8.2f} ms  {ratio:5.2f}x")


if __name__ == "__main__":
    main()
