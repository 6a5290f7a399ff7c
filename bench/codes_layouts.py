"""Five-bit codes against the byte-a-code layout on one GGUF, side by side: the 8-bit-code kernel
reads Q5_0, Q5_1 and Q5_K weights packed at five bits where :data:`codes8.FIVE_BITS_PAY` says it
pays (``kernels/codes8.py``); this times the same model both ways, in alternating worker
processes (A B A B ...), each with its own cache folder:

* the one-row decode step, 16- and 64-row batched steps (ms), on a 256-token cache;
* forwards over complete binary trees of 16 and 64 nodes (ms).

Reported per figure: the median of each layout, and the per-round ratios five / eight. The two
layouts compute the same bits (``tests/ops/test_codes8.py``), so only the time can differ.

    python bench/codes_layouts.py --model FILE.gguf [--rounds 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def worker(model_path: str, layout: str, cache_dir: str) -> dict[str, float]:
    """One round of one layout: load the model as served (``auto``) and time it."""
    import functools

    import torch

    sys.path.insert(0, str(HERE))
    from forward import step_seconds, tree_seconds  # noqa: E402 (bench/ on the path first)

    from treeserve.ops.kernels import codes8
    from treeserve.ops.loaders.load import load_model

    codes8.pack = functools.partial(codes8.pack, five_bits=layout == "five")  # type: ignore[assignment]
    model = load_model(model_path, weight_format="auto", cache_dir=cache_dir, compile_decode=False).model
    torch.set_num_threads(2)
    out = {f"step_{rows}": step_seconds(model, rows, 5) * 1000 for rows in (1, 16, 64)}
    out.update({f"tree_{nodes}": tree_seconds(model, nodes, 5) * 1000 for nodes in (16, 64)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a .gguf whose linears hold Q5 blocks (a Q4_K_M, say)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=2, metavar=("LAYOUT", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, *args.worker)))
        return
    runs: dict[str, list[dict[str, float]]] = {"five": [], "eight": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for layout in runs:
                done = subprocess.run([sys.executable, __file__, "--model", args.model, "--worker", layout,
                                       str(Path(tmp) / layout)], capture_output=True, text=True, check=True)
                runs[layout].append(json.loads(done.stdout.strip().splitlines()[-1]))
    result = {key: {"five_ms": round(statistics.median(r[key] for r in runs["five"]), 2),
                    "eight_ms": round(statistics.median(r[key] for r in runs["eight"]), 2),
                    "per_round_five_over_eight": [round(a[key] / b[key], 3) for a, b in zip(runs["five"], runs["eight"])]}
              for key in runs["five"][0]}
    for entry in result.values():
        entry["median_ratio"] = round(statistics.median(entry["per_round_five_over_eight"]), 3)
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
