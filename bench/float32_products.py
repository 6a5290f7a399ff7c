"""float32's products: our kernel (``ops/kernels/dense_cpu.cpp``) against ``F.linear``, side by side.

Times, on random float32 weights of the default model's shapes (its 113 MB head, 49152 x 576,
and a block's four products), one product at several row counts with each, alternating, and
prints medians (ms) and the ratio. ``--prefill`` also times a whole float32 prefill of the
default model (``logits_to_keep=1``) at 16, 128 and 512 tokens with each kernel in its float32
format.

    python bench/float32_products.py [--threads 2] [--repeats 15] [--prefill] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from treeserve.ops.kernels import dense_cpu

SHAPES = {"head": (49152, 576), "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
"""(N, K) of the default model's products (SmolLM2-135M: hidden 576, 9 heads, 3 KV heads, MLP 1536)."""
ROWS = (1, 4, 16, 64, 512)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def products(repeats: int) -> dict[str, dict[str, dict[str, float]]]:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, generator=gen)
        out[name] = {}
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            ours, theirs = [], []
            for _ in range(3):  # alternate, so drift on a shared host falls on both
                ours.append(median_ms(lambda: dense_cpu.mm(x, weight, None), repeats))
                theirs.append(median_ms(lambda: F.linear(x, weight), repeats))
            a, b = statistics.median(ours), statistics.median(theirs)
            out[name][str(rows)] = {"dense_cpu_ms": round(a, 3), "f_linear_ms": round(b, 3), "ratio": round(a / b, 2)}
    return out


def prefills(repeats: int) -> dict[str, dict[str, float]]:
    from treeserve.models import DEFAULT_MODEL, load_model
    from treeserve.ops import linears

    model = load_model(DEFAULT_MODEL, weight_format="float32").model
    kernels = [m for m in model.modules() if isinstance(m, linears.Float32Linear)]
    gen = torch.Generator().manual_seed(1)
    out: dict[str, dict[str, float]] = {}
    for length in (16, 128, 512):
        tokens = torch.randint(100, model.config.vocab_size, (1, length), generator=gen)

        def prefill() -> None:
            model(tokens, model.new_cache(1, length + 8), logits_to_keep=1)

        ours, theirs = [], []
        for _ in range(3):
            ours.append(median_ms(prefill, repeats))
            for m in kernels:  # the same weights through F.linear
                m.__class__ = linears.DenseLinear
            theirs.append(median_ms(prefill, repeats))
            for m in kernels:
                m.__class__ = linears.Float32Linear
        a, b = statistics.median(ours), statistics.median(theirs)
        out[str(length)] = {"dense_cpu_ms": round(a, 1), "f_linear_ms": round(b, 1), "ratio": round(a / b, 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prefill", action="store_true", help="also whole float32 prefills of the default model")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not dense_cpu.available():
        raise SystemExit("the float32 kernel does not run here (no AVX2 / AVX-512 or no compiler)")
    torch.set_num_threads(args.threads)
    found: dict[str, object] = {"threads": torch.get_num_threads(), "products": products(args.repeats)}
    if args.prefill:
        found["prefill"] = prefills(max(3, args.repeats // 5))
    if args.json:
        print(json.dumps(found, indent=1))
        return
    for name, by_rows in found["products"].items():  # type: ignore[union-attr]
        for rows, cell in by_rows.items():
            print(f"{name:8s} {rows:>4s} rows: dense_cpu {cell['dense_cpu_ms']:8.3f} ms  F.linear {cell['f_linear_ms']:8.3f} ms  {cell['ratio']}x")
    for length, cell in found.get("prefill", {}).items():  # type: ignore[union-attr]
        print(f"prefill {length:>4s} tokens: dense_cpu {cell['dense_cpu_ms']} ms  F.linear {cell['f_linear_ms']} ms  {cell['ratio']}x")


if __name__ == "__main__":
    main()
