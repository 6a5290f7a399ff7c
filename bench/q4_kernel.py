"""The q4_1 format's kernel against torch's int4 kernel: the vector path (AVX512-BF16), the
tile path (AMX) and the int8-row path (AVX512-VNNI, where the CPU has it) of
``ops/kernels/q4_amx``, and ``torch._weight_int4pack_mm_for_cpu`` on its own packing of the same
weights, per row count. Without AMX tiles the "tiles" column runs the vector path; on a CPU
without AVX-512 the AVX2 kernel (``q_avx2.cpp``, int8 rows) is the one column of ours.

    python bench/q4_kernel.py [--threads 2] [--rounds 5] [--rows 1 2 4 ...] [--json]

Each measurement is one pass over 30 layers of the default model's four weight shapes (120
distinct weights, 66 MB: what a decode step reads, so the weights come from memory, not from
cache), median of a few passes; the three kernels alternate within each round and the table
gives the median over rounds. ``MIN_ROWS`` in ``q4_amx.py`` (where the op switches paths) and
the one-row ratio in its docstring come from this table.

On a CPU where the AVX2 kernel runs, the bench first probes the cores' ceiling
(``bench/isa_peak.cpp``): the clock, and how many ``vpmaddubsw`` (32 int8 multiply-adds each) the
cores retire a cycle alone, beside ``vpaddsw`` and beside ``vpaddw`` (the add that accumulates
their products), ``vpmaddwd`` and fp32 FMAs. Each row count then also reports the kernel's
multiply-adds a second and their fraction of the ``vpmaddubsw`` + ``vpaddw`` ceiling of
``--threads`` cores, each at one core's measured rate (``of_int8_peak``): what a tree or a batch
can cost at best here.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from forward import median_seconds  # bench/ is on sys.path when this file runs as a script

from treeserve.ops.linears import INT4_INNER_K_TILES, Int4Linear, q4_blocks_from_float
from treeserve.ops.kernels import cpp_build, q4_amx
from treeserve.ops.kernels.cpp_build import cpu_flags

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
ROWS = (1, 2, 3, 4, 6, 8, 16, 64)


PEAK_KINDS = {"vpmaddubsw": 0, "vpmaddubsw+vpaddsw": 1, "vpmaddubsw+vpaddw": 2, "vpmaddwd": 3, "fma": 4}


def isa_peak(threads: int) -> dict[str, Any] | None:
    """This CPU's clock and multiply throughput (``isa_peak.cpp``): per core a cycle, and the
    int8 ceiling of ``threads`` cores in multiply-adds a second; None without a compiler."""
    library = cpp_build.build(Path(__file__).with_name("isa_peak.cpp"), ("-mavx2", "-mfma"))
    if library is None:
        return None
    lib = ctypes.CDLL(str(library))
    lib.ts_clock_ghz.restype = ctypes.c_double
    lib.ts_clock_ghz.argtypes = [ctypes.c_long]
    lib.ts_multiply_rate.restype = ctypes.c_double
    lib.ts_multiply_rate.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int]
    ghz = statistics.median(lib.ts_clock_ghz(50_000_000) for _ in range(3))
    per_cycle = {name: round(statistics.median(lib.ts_multiply_rate(kind, 20_000_000, 1) for _ in range(3)) / ghz / 1e9, 2)
                 for name, kind in PEAK_KINDS.items()}
    # The ceiling is every thread at one core's rate: timed together, the two vCPUs of the
    # development VM gave anywhere from 1.2x to 2x one (another guest's load), alone a steady rate.
    ceiling = threads * per_cycle["vpmaddubsw+vpaddw"] * ghz * 32
    return {"clock_ghz": round(ghz, 2), "per_core_per_cycle": per_cycle, "int8_peak_gmac_s": round(ceiling, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not q4_amx.available():
        raise SystemExit("the q4_1 kernels do not run on this machine (no AVX-512 or AVX2, or no C++ compiler)")
    avx2 = q4_amx.avx2()
    layers = []
    for _ in range(LAYERS):
        for n, k in SHAPES.values():
            blocks = q4_blocks_from_float(torch.randn(n, k) * 0.05)
            linear = Int4Linear(blocks, None)
            packed = torch._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), INT4_INNER_K_TILES)
            scale = blocks.scale.float()
            zero = blocks.minimum.float() + 8 * scale
            scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
            layers.append((linear, packed, scales_and_zeros))
    has_vnni = "avx512_vnni" in cpu_flags()
    megabytes = sum(linear.num_weight_bytes for linear, _, _ in layers) / 1e6
    result: dict[str, Any] = {"threads": args.threads, "weights_mb": round(megabytes, 1), "tiles": q4_amx.tiles(), "avx2": avx2,
                              "rows": {}}
    macs = LAYERS * sum(n * k for n, k in SHAPES.values())  # multiply-adds of one row through the 120 weights
    peak = isa_peak(args.threads) if avx2 else None
    if peak is not None:
        result["peak"] = peak
        if not args.json:
            print(f"clock {peak['clock_ghz']} GHz; a core retires a cycle: "
                  + ", ".join(f"{name} {value}" for name, value in peak["per_core_per_cycle"].items())
                  + f"; int8 ceiling on {args.threads} threads {peak['int8_peak_gmac_s']} G multiply-adds/s", flush=True)
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES.values()}

            def ours(min_rows: int, int8_rows: bool = False, avx2: bool = False) -> Callable[[], None]:
                def run() -> None:
                    for linear, _, _ in layers:
                        q4_amx.mm(inputs[linear.in_features], linear.amx_codes, linear.amx_scales_zeros,
                                  linear.out_features, min_rows, int8_rows, avx2)
                return run

            def torch_int4() -> None:
                for linear, packed, scales_and_zeros in layers:
                    torch._weight_int4pack_mm_for_cpu(inputs[linear.in_features], packed, 32, scales_and_zeros)

            kernels: list[tuple[str, Callable[[], None]]] = [("torch_int4", torch_int4)]
            if avx2:
                kernels.append(("avx2_int8_rows", ours(1, avx2=True)))
            else:
                kernels += [("vector", ours(10**9)), ("tiles", ours(1))]
                if has_vnni:
                    kernels.append(("int8_rows", ours(1, int8_rows=True)))
            times: dict[str, list[float]] = {name: [] for name, _ in kernels}
            for _ in range(args.rounds):
                for name, fn in kernels:
                    times[name].append(median_seconds(fn, 7) * 1e3)
            ms = {name: statistics.median(values) for name, values in times.items()}
            entry = {f"{name}_ms": round(value, 2) for name, value in ms.items()}
            entry.update({f"torch_over_{name}": round(ms["torch_int4"] / value, 2)
                          for name, value in ms.items() if name != "torch_int4"})
            if peak is not None:
                gmac_s = rows * macs / (ms["avx2_int8_rows"] / 1e3) / 1e9
                entry["avx2_gmac_s"] = round(gmac_s, 1)
                entry["of_int8_peak"] = round(gmac_s / peak["int8_peak_gmac_s"], 3)
            result["rows"][str(rows)] = entry
            if not args.json:
                print(f"rows {rows:>3}: " + "  ".join(f"{name} {value:6.2f} ms" for name, value in ms.items()) + "  ("
                      + ", ".join(f"torch/{name} x{ms['torch_int4'] / value:.2f}" for name, value in ms.items()
                                  if name != "torch_int4") + ")"
                      + (f"  {entry['avx2_gmac_s']} G multiply-adds/s, {entry['of_int8_peak']:.2f} of the int8 ceiling"
                         if peak is not None else ""), flush=True)
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
