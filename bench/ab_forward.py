"""The default format's forward in two checkouts side by side, in one run: this tree against a
baseline (another commit's checkout with its own virtual environment), on one ISA path.

Each round runs a worker process per side, in turn (A B A B ...), and each worker loads the
default model as serving does (``load_model(..., weight_format=FORMAT)``: the fused op, a
compiled step or the eager forward, whatever that checkout serves with) and measures, with
``bench/forward.py``'s timers on a 256-token cache:

* the one-row decode step (ms);
* forwards over complete binary trees of 4, 16 and 64 nodes, as ratios to that step;
* batched steps of 16 and 64 rows (tokens/s) and their ratio to one row;
* prefills of 128 and 512 tokens from an empty cache (ms).

Reported: each figure's median over the rounds per side, and the medians of the per-round
ratios this tree / baseline. ``--isa`` caps both sides' kernels (``TREESERVE_ISA``; a baseline
older than that variable needs its ``ops/kernels/cpp_build.py`` from this tree to honour it).

    git worktree add /tmp/base <commit> && python3 -m venv /tmp/base/.venv \\
        && /tmp/base/.venv/bin/pip install -q -e /tmp/base
    python bench/ab_forward.py --baseline-python /tmp/base/.venv/bin/python --isa avx2 --rounds 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
TREES = (4, 16, 64)
BATCHES = (16, 64)
PREFILLS = (128, 512)


def worker(fmt: str, repeats: int) -> dict[str, Any]:
    """One side's figures (run inside that side's interpreter)."""
    import torch

    sys.path.insert(0, str(HERE))
    import forward  # this tree's timers, on the side's own treeserve

    from treeserve.models import DEFAULT_MODEL, load_model

    torch.set_num_threads(2)
    started = time.perf_counter()
    model = load_model(DEFAULT_MODEL, weight_format=fmt).model
    load_s = time.perf_counter() - started
    step = model.decode_step
    one = forward.step_seconds(model, 1, repeats)
    out: dict[str, Any] = {
        "path": "fused" if getattr(step, "is_fused", False) else "compiled" if getattr(step, "is_compiled", False)
        else "eager",
        "load_s": round(load_s, 2),
        "step_ms": one * 1e3,
    }
    for nodes in TREES:
        out[f"tree_{nodes}_ratio"] = forward.tree_seconds(model, nodes, repeats) / one
    for rows in BATCHES:
        seconds = forward.step_seconds(model, rows, max(3, repeats // 2))
        out[f"batch_{rows}_tok_s"] = rows / seconds
        out[f"batch_{rows}_ratio"] = rows / seconds * one
    gen = torch.Generator().manual_seed(3)
    for length in PREFILLS:
        tokens = torch.randint(100, model.config.vocab_size, (1, length), generator=gen)
        cache = model.new_cache(1, length)

        def prefill() -> None:
            model(tokens, cache, logits_to_keep=1)

        out[f"prefill_{length}_ms"] = forward.median_seconds(prefill, max(3, repeats // 2), warmup=1) * 1e3
    return out


def run_side(python: str, fmt: str, repeats: int, isa: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if isa:
        env["TREESERVE_ISA"] = isa
    done = subprocess.run([python, __file__, "--worker", "--format", fmt, "--repeats", str(repeats)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{python}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-python", help="the baseline checkout's interpreter (its treeserve installed -e)")
    parser.add_argument("--format", default="q4_1")
    parser.add_argument("--isa", choices=("amx", "avx512", "avx2"), default=None, help="cap both sides' kernels")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.format, args.repeats)))
        return
    if not args.baseline_python:
        parser.error("--baseline-python is required")
    sides = {"this": sys.executable, "baseline": args.baseline_python}
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(args.rounds):
        rounds.append({name: run_side(python, args.format, args.repeats, args.isa) for name, python in sides.items()})
        print(f"[ab_forward] round {index + 1}: {json.dumps(rounds[-1])}", file=sys.stderr, flush=True)
    figures = [k for k, v in rounds[0]["this"].items() if isinstance(v, float)]
    result: dict[str, Any] = {
        "format": args.format, "isa": args.isa or "host", "rounds": args.rounds,
        "paths": {name: rounds[0][name]["path"] for name in sides},
        "median": {name: {k: round(statistics.median(r[name][k] for r in rounds), 3) for k in figures} for name in sides},
        "this_over_baseline": {k: round(statistics.median(r["this"][k] / r["baseline"][k] for r in rounds), 3)
                               for k in figures},
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for key in figures:
        print(f"{key:>18}: this {result['median']['this'][key]:9.3f}  baseline {result['median']['baseline'][key]:9.3f}"
              f"  ratio {result['this_over_baseline'][key]:.3f}")


if __name__ == "__main__":
    main()
