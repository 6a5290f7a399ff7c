"""The decode step's attention side by side, on the default model's heads (9 query heads over 3
KV heads of 64) and a 256-token committed cache, in bf16: the fused op's attention
(``decode_layers.cpp``, the one q4_1 and the GGUF formats serve with; ``fused``), the CPU
tree-mask kernel of ``ops/kernels/tree_attention_cpu`` (the float formats'; ``kernel``) and
torch's fused attention under the dense mask the step would otherwise build (``torch``).

    python bench/attention_kernel.py [--threads 2] [--repeats 30] [--layers 30] [--json]

Cases: one decode token, a 16- and a 64-node binary tree at one row, one token on 16 and 64
rows. ``--layers N`` gives each case N caches, one a layer, attended in turn as a step does, so
that a batch's caches stream from memory rather than sit in L3. Prints the median microseconds
a layer of each and the ratios torch / kernel and kernel / fused. ``TREESERVE_ISA=avx2`` times
the AVX2 builds on an AVX-512 host.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from forward import median_seconds  # bench/ is on sys.path when this file runs as a script

from treeserve.ops.kernels import decode_layers, tree_attention_cpu
from treeserve.ops.tree_attention import attention_under_mask, build_attention_mask, tree_mask_from_parents

HEADS, KV_HEADS, HEAD_DIM, COMMITTED = 9, 3, 64, 256
CASES = ((1, 1), (1, 16), (1, 64), (16, 1), (64, 1))  # (rows, new tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", type=int, default=1, help="caches per case, attended in turn (30: a step's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not tree_attention_cpu.available() or not decode_layers.available():
        raise SystemExit("the CPU attention kernels are not available here (no AVX2, or no C++ compiler)")
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"threads": args.threads, "layers": args.layers, "cases": {}}
    for rows, new in CASES:
        capacity = COMMITTED + new + 4
        q = torch.randn(rows, new, HEADS, HEAD_DIM, generator=gen).bfloat16()
        caches = [(torch.randn(rows, KV_HEADS, capacity, HEAD_DIM, generator=gen).bfloat16(),
                   torch.randn(rows, KV_HEADS, capacity, HEAD_DIM, generator=gen).bfloat16()) for _ in range(args.layers)]
        lengths = torch.full((rows,), COMMITTED)
        parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, new)])
        tree = tree_mask_from_parents(parents).expand(rows, new, new).contiguous()
        slots = COMMITTED + new

        def theirs() -> None:
            mask = build_attention_mask(lengths, tree, new, slots)
            for k, v in caches:
                attention_under_mask(q.transpose(1, 2), k[:, :, :slots], v[:, :, :slots], mask)

        def kernel() -> None:
            for k, v in caches:
                tree_attention_cpu.tree_decode(q, k, v, lengths, tree)

        def fused() -> None:
            for k, v in caches:
                torch.ops.treeserve_layers.attend(q, k, v, lengths, tree, 0, HEAD_DIM**-0.5)

        torch_us, kernel_us, fused_us = (median_seconds(f, args.repeats, warmup=3) * 1e6 / args.layers
                                         for f in (theirs, kernel, fused))
        name = f"{rows} rows x {new} new"
        result["cases"][name] = {"torch_us": round(torch_us, 1), "kernel_us": round(kernel_us, 1),
                                 "fused_us": round(fused_us, 1), "torch_over_kernel": round(torch_us / kernel_us, 2),
                                 "kernel_over_fused": round(kernel_us / fused_us, 2)}
        if not args.json:
            print(f"{name:>18}: torch {torch_us:8.1f} us  kernel {kernel_us:8.1f} us  fused {fused_us:8.1f} us"
                  f"  torch/kernel x{torch_us / kernel_us:.2f}  kernel/fused x{kernel_us / fused_us:.2f}", flush=True)
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
