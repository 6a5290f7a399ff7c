"""Admission micro-benchmark: prefilling a burst of prompts into a multi-row KV cache.

When many requests arrive at once the verifier prefills them all before their first tree
step, so admission time is most of their time to first token. This measures, side by side in
one run (modes interleaved per repeat, medians reported), for the default model on this CPU:

* ``serial``: one :func:`~treeserve.ops.batch_step.prefill_row` per prompt (one batch-1
  forward each, as the verifier did before batched admission);
* ``batched``: one :func:`~treeserve.ops.batch_step.prefill_rows` call for the whole burst;
* for a single prompt, the forward with the LM head over every prompt position (what a
  prefill computed before) against :meth:`~treeserve.ops.model.Transformer.hidden_states`.

Prompts are the first N of a bench data set (chat template applied), as ``bench/serving.py``
sends them. ``--json`` prints one JSON object.

    python bench/prefill.py [--dataset mtbench] [--burst 16] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from treeserve.models import DEFAULT_MODEL, load_model
from treeserve.ops.batch_step import prefill_row, prefill_rows
from treeserve.ops.model import Transformer


def measure(model: Transformer, prompts: list[list[int]], repeats: int) -> dict[str, Any]:
    """Median seconds of serial vs batched admission of ``prompts``, and of one prefill with and
    without the LM head (the longest prompt), modes interleaved within each repeat."""
    cache = model.new_cache(len(prompts), max(len(p) for p in prompts) + 1)
    longest = max(prompts, key=len)
    feed = torch.tensor([longest])
    modes = {
        "serial": lambda: [prefill_row(model, cache, row, p) for row, p in enumerate(prompts)],
        "batched": lambda: prefill_rows(model, cache, list(enumerate(prompts))),
        "one_prompt_with_head": lambda: model(feed, model.new_cache(1, len(longest))),
        "one_prompt_no_head": lambda: model.hidden_states(feed, model.new_cache(1, len(longest))),
    }
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    for fn in modes.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in modes.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    med = {name: statistics.median(times) for name, times in seconds.items()}
    return {
        "burst": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "longest_prompt": len(longest),
        "median_ms": {name: round(s * 1e3, 1) for name, s in med.items()},
        "batched_over_serial": round(med["batched"] / med["serial"], 3),
        "no_head_over_with_head": round(med["one_prompt_no_head"] / med["one_prompt_with_head"], 3),
    }


def load_texts(dataset: str, limit: int) -> list[str]:
    path = Path(__file__).parent / "data" / f"{dataset}.jsonl"
    if not path.exists():
        raise SystemExit(f"{path} is missing: run python bench/data/fetch.py {dataset}")
    lines = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    return [json.loads(line)["prompt"] for line in lines[:limit]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="mtbench")
    parser.add_argument("--burst", type=int, default=16, help="prompts admitted at once")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = []
    for dtype in args.dtypes:
        loaded = load_model(DEFAULT_MODEL, dtype=getattr(torch, dtype))
        # The verifier prefills all but the last prompt token (the first tree's root).
        prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": text}])[:-1]
                   for text in load_texts(args.dataset, args.burst)]
        results.append({"dtype": dtype, **measure(loaded.model, prompts, args.repeats)})
    if args.json:
        print(json.dumps({"dataset": args.dataset, "threads": torch.get_num_threads(), "results": results}))
    else:
        for r in results:
            ms = r["median_ms"]
            print(f"{r['dtype']}: {r['burst']} prompts ({r['prompt_tokens']} tokens): serial {ms['serial']} ms, "
                  f"batched {ms['batched']} ms ({r['batched_over_serial']}x); one {r['longest_prompt']}-token "
                  f"prefill {ms['one_prompt_with_head']} ms with the LM head, {ms['one_prompt_no_head']} ms without "
                  f"({r['no_head_over_with_head']}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
