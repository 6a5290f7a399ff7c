"""How often a verify forward over a chain agrees with the one-token steps, in a fast format.

In float32 speculation returns exactly what incremental decoding returns (the tests prove it);
in the fast formats the two paths run different kernels for the same weight values (one row:
the vector paths; 16 rows: tiles), so near-ties can flip. This measures it directly: for the
forward bench's chat prompts, greedy-decode 16 + k tokens one step at a time (k = 0, 16, 32),
then run the last 16 as one chain forward on the same prefix, and compare the two sets of
logits position by position.

    python bench/chain_vs_step.py [--format q4_1] [--prompts 9] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from forward import chat_prompts  # bench/ is on sys.path when this file runs as a script

from treeserve.models import DEFAULT_MODEL, load_model

CHAIN = 16
OFFSETS = (0, 16, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="q4_1")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, weight_format=args.format)
    model = loaded.model
    agree = total = 0
    diffs: list[float] = []
    with torch.inference_mode():
        for ids in chat_prompts(loaded.tokenizer, args.prompts):
            for offset in OFFSETS:
                capacity = len(ids) + offset + CHAIN + 8
                cache = model.new_cache(1, capacity)
                logits = model(torch.tensor([ids]), cache)[:, -1]
                cache.commit(0, range(len(ids)))
                tokens: list[int] = []
                stepped: list[torch.Tensor] = []
                for _ in range(offset + CHAIN):
                    tokens.append(int(logits.argmax()))
                    logits = model(torch.tensor([[tokens[-1]]]), cache)[:, -1]
                    cache.commit(0, [0])
                    stepped.append(logits[0].float())
                prefix = ids + tokens[:offset]
                chain_cache = model.new_cache(1, capacity)
                model(torch.tensor([prefix]), chain_cache)
                chain_cache.commit(0, range(len(prefix)))
                chained = model(torch.tensor([tokens[offset:offset + CHAIN]]), chain_cache)[0].float()
                reference = torch.stack(stepped[offset:])
                agree += int((chained.argmax(-1) == reference.argmax(-1)).sum())
                total += CHAIN
                diffs.append((chained - reference).abs().max().item())
    result = {"format": args.format, "positions": total, "argmax_agreement": agree / total,
              "max_abs_logit_diff": {"median": statistics.median(diffs), "max": max(diffs)}}
    print(json.dumps(result) if args.json else
          f"{args.format}: chain argmax = steps' at {agree}/{total} positions ({agree / total:.2%}); "
          f"max |logit diff| per chain: median {result['max_abs_logit_diff']['median']:.3f}, max {max(diffs):.3f}")


if __name__ == "__main__":
    main()
