"""What a verify forward over n rows costs against the one-row step, and what speculation must
then accept to pay.

A speculative step verifies the last accepted token and n - 1 drafted ones in one forward of n
rows, and yields between 1 and n tokens. So at a cost of c(n) one-row steps it is s times as
fast as plain decoding when it yields s * c(n) tokens a step (drafting not counted). This
prints, per n, the forward's time beside the one-row step (the sizes interleaved in every
round, medians), the tokens a step that break even and that reach ``--target``, and the
per-draft acceptance a chain of n - 1 drafts needs for them (a chain whose drafts each hold
with probability a yields 1 + a + ... + a^(n-1) tokens a step; a tree spreads its nodes over
alternatives instead, but still has to yield the same tokens).

    python bench/verify_cost.py --format q4_1 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from forward import CACHE_LENGTH, filled_cache  # noqa: E402

from treeserve.models import load_model  # noqa: E402


def chain_tokens(rows: int, acceptance: float) -> float:
    """Expected tokens of a verify step over a chain of rows - 1 drafts, each accepted with
    probability ``acceptance`` given its parent was."""
    return sum(acceptance ** i for i in range(rows))


def acceptance_for(rows: int, tokens: float) -> float | None:
    """The per-draft acceptance at which a chain over ``rows`` yields ``tokens`` a step (None:
    more than ``rows`` tokens, out of reach)."""
    if tokens > rows:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if chain_tokens(rows, mid) < tokens else (low, mid)
    return high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--format", default="q4_1")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--target", type=float, default=1.6, help="speedup over plain decoding to solve for")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = sorted(set([1, *args.sizes]))
    torch.set_grad_enabled(False)
    model = load_model(args.model, weight_format=args.format).model
    forwards = {}
    for n in sizes:
        cache = filled_cache(model, 1, CACHE_LENGTH, n)
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None]
        tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        positions = (CACHE_LENGTH + torch.arange(n))[None]
        forwards[n] = (lambda t=tokens, c=cache, m=mask, p=positions: model(t, c, tree_mask=m, positions=p))
        for _ in range(3):
            forwards[n]()  # each call rewrites the same slots: the cache's length never moves
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(args.rounds):
        for n in sizes:
            start = time.perf_counter()
            forwards[n]()
            times[n].append(time.perf_counter() - start)
    step = statistics.median(times[1])
    rows = []
    for n in sizes:
        cost = statistics.median(times[n]) / step
        even, target = cost, args.target * cost
        rows.append({"rows": n, "ms": statistics.median(times[n]) * 1e3, "cost": cost,
                     "tokens_break_even": even, "tokens_target": target,
                     "chain_acceptance_break_even": acceptance_for(n, even),
                     "chain_acceptance_target": acceptance_for(n, target)})

    def cell(a: float | None) -> str:
        return "out of reach" if a is None else f"{a:.2f}"

    print(f"{args.model} {args.format}, {CACHE_LENGTH} cached tokens, {args.threads} threads, "
          f"medians of {args.rounds} interleaved rounds; target {args.target}x plain decoding")
    print("| rows | forward | vs the step | tokens a step: even / target | chain acceptance: even / target |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['ms']:.2f} ms | {r['cost']:.2f}x | {r['tokens_break_even']:.2f} / "
              f"{r['tokens_target']:.2f} | {cell(r['chain_acceptance_break_even'])} / "
              f"{cell(r['chain_acceptance_target'])} |")
    if args.json:
        print(json.dumps({"model": args.model, "format": args.format, "target": args.target, "rows": rows}))


if __name__ == "__main__":
    main()
