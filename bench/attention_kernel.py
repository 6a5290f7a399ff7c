"""The decode step's attention side by side: the CPU tree-mask kernel of
``ops/kernels/tree_attention_cpu`` against torch's fused attention under the dense mask the
step would otherwise build, on the default model's heads (9 query heads over 3 KV heads of 64)
and a 256-token committed cache, in bf16.

    python bench/attention_kernel.py [--threads 2] [--repeats 30] [--json]

Cases: one decode token, a 16- and a 64-node binary tree at one row, one token on 16 and 64
rows. Prints the median microseconds of each and the ratio (torch / kernel).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from forward import median_seconds  # bench/ is on sys.path when this file runs as a script

from treeserve.ops.kernels import tree_attention_cpu
from treeserve.ops.tree_attention import attention_under_mask, build_attention_mask, tree_mask_from_parents

HEADS, KV_HEADS, HEAD_DIM, COMMITTED = 9, 3, 64, 256
CASES = ((1, 1), (1, 16), (1, 64), (16, 1), (64, 1))  # (rows, new tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not tree_attention_cpu.available():
        raise SystemExit("the CPU tree-attention kernel is not available here (no AVX-512, or no C++ compiler)")
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"threads": args.threads, "cases": {}}
    for rows, new in CASES:
        capacity = COMMITTED + new + 4
        q = torch.randn(rows, new, HEADS, HEAD_DIM, generator=gen).bfloat16()
        k = torch.randn(rows, KV_HEADS, capacity, HEAD_DIM, generator=gen).bfloat16()
        v = torch.randn(rows, KV_HEADS, capacity, HEAD_DIM, generator=gen).bfloat16()
        lengths = torch.full((rows,), COMMITTED)
        parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, new)])
        tree = tree_mask_from_parents(parents).expand(rows, new, new).contiguous()
        slots = COMMITTED + new

        def theirs() -> torch.Tensor:
            mask = build_attention_mask(lengths, tree, new, slots)
            return attention_under_mask(q.transpose(1, 2), k[:, :, :slots], v[:, :, :slots], mask)

        torch_us = median_seconds(theirs, args.repeats, warmup=3) * 1e6
        ours_us = median_seconds(lambda: tree_attention_cpu.tree_decode(q, k, v, lengths, tree), args.repeats,
                                 warmup=3) * 1e6
        name = f"{rows} rows x {new} new"
        result["cases"][name] = {"torch_us": round(torch_us, 1), "kernel_us": round(ours_us, 1),
                                 "speedup": round(torch_us / ours_us, 2)}
        if not args.json:
            print(f"{name:>18}: torch {torch_us:8.1f} us  kernel {ours_us:8.1f} us  x{torch_us / ours_us:.2f}", flush=True)
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
