"""The q4_1 format's two kernels side by side: torch's one-row int4 kernel and the AMX kernel
of ``ops/kernels/q4_amx``, on the default model's four weight shapes, per row count.

    python bench/q4_kernel.py [--threads 2] [--repeats 50] [--json]

Prints the median microseconds of each kernel and their ratio; ``MIN_ROWS`` in
``q4_amx.py`` (where the format switches kernels) comes from this table.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from forward import median_seconds  # bench/ is on sys.path when this file runs as a script

from treeserve.ops.formats import Int4Linear, q4_blocks_from_float
from treeserve.ops.kernels import q4_amx

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def median_us(fn: Any, repeats: int) -> float:
    return median_seconds(fn, repeats, warmup=5) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not q4_amx.available():
        raise SystemExit("the AMX kernel is not available on this machine (no AMX-BF16, or no C++ compiler)")
    result: dict[str, Any] = {"threads": args.threads, "shapes": {}}
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            linear = Int4Linear(q4_blocks_from_float(torch.randn(n, k) * 0.05), None)
            assert linear.amx_codes is not None and linear.amx_scales_zeros is not None
            rows_out = {}
            for rows in ROWS:
                x = torch.randn(rows, k).bfloat16()
                amx = median_us(lambda: q4_amx.mm(x, linear.amx_codes, linear.amx_scales_zeros, linear.packed,
                                                  linear.scales_and_zeros, n, 1), args.repeats)
                one_row = median_us(lambda: torch._weight_int4pack_mm_for_cpu(x, linear.packed, 32, linear.scales_and_zeros),
                                    args.repeats)
                rows_out[str(rows)] = {"amx_us": round(amx, 1), "one_row_us": round(one_row, 1),
                                       "speedup": round(one_row / amx, 2)}
                if not args.json:
                    print(f"{name:>8} ({n}x{k}) rows {rows:>3}: one-row {one_row:7.1f} us  amx {amx:7.1f} us  "
                          f"x{one_row / amx:.2f}", flush=True)
            result["shapes"][name] = rows_out
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
