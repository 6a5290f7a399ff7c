"""The decode step's blocks in one C++ op against the compiled step, side by side.

Where q4_1 runs on its int8-row kernels (AVX2 or AVX512-VNNI), ``load_model`` attaches the
fused step (``ops/kernels/decode_layers.cpp``); this bench also builds the ``torch.compile`` step the
format used before (compiled once into the usual cache, 1-3 min, then loaded) and times both on
the same caches in one process, rounds interleaved: one row, trees of 4 and 16 nodes over one
row, and 16 and 64 rows of one token, each over 256 cached tokens. The hidden states only (the
LM head is the same op on both). It also reports how far the two steps' logits lie apart,
relative to the logits' spread, and how often their top tokens agree (random tokens over a
random cache: near ties are common, so a few disagreements are expected).

    python bench/fused_step.py [--rounds 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from forward import CACHE_LENGTH, binary_tree, filled_cache  # noqa: E402

from treeserve.models import DEFAULT_MODEL, load_model  # noqa: E402
from treeserve.ops.decode_step import DecodeStep, artifact_name  # noqa: E402
from treeserve.ops.loaders.registry import resolve_cache_dir  # noqa: E402

SHAPES = (("1 row", 1, False), ("tree of 4", 4, True), ("tree of 16", 16, True), ("16 rows", 16, False),
          ("64 rows", 64, False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = load_model(DEFAULT_MODEL, weight_format="q4_1").model
    fused = model.decode_step
    if not isinstance(fused, DecodeStep) or not fused.is_fused:
        raise SystemExit("the fused step does not run here (it needs q4_1 on a CPU with AVX2 and a C++ compiler)")
    compiled = DecodeStep(model, artifact=resolve_cache_dir(None) / "compiled" / artifact_name(model))
    started = time.perf_counter()
    compiled.prepare()
    ready_s = time.perf_counter() - started
    results = []
    with torch.inference_mode():
        for label, size, is_tree in SHAPES:
            if is_tree:
                cache = filled_cache(model, 1, CACHE_LENGTH, size)
                mask, depth = binary_tree(size)
                tokens = torch.randint(0, 1000, (1, size), generator=torch.Generator().manual_seed(size))
                positions = (CACHE_LENGTH + depth)[None]

                def call(step: DecodeStep, tokens=tokens, cache=cache, mask=mask, positions=positions) -> torch.Tensor:
                    return step(tokens, cache, mask, positions)
            else:
                cache = filled_cache(model, size, CACHE_LENGTH, 4)
                tokens = torch.randint(0, 1000, (size, 1), generator=torch.Generator().manual_seed(size))

                def call(step: DecodeStep, tokens=tokens, cache=cache, mask=None, positions=None) -> torch.Tensor:
                    return step(tokens, cache)

            def once(step: DecodeStep, call: Callable[[DecodeStep], torch.Tensor] = call, cache=cache) -> torch.Tensor:
                out = call(step)
                for row in range(cache.batch_size):
                    cache.truncate(row, CACHE_LENGTH)
                return out

            a, b = model.logits(once(compiled)), model.logits(once(fused))
            spread = (a.amax(-1) - a.amin(-1))[..., None]
            repeats = 30 if size <= 16 else 8
            times: dict[str, list[float]] = {"compiled": [], "fused": []}
            for _ in range(3):
                once(compiled), once(fused)
            for _ in range(args.rounds):
                for name, step in (("compiled", compiled), ("fused", fused)):
                    t = time.perf_counter()
                    for _ in range(repeats):
                        once(step)
                    times[name].append((time.perf_counter() - t) / repeats)
            c, f = statistics.median(times["compiled"]), statistics.median(times["fused"])
            results.append({"shape": label, "compiled_ms": round(c * 1e3, 2), "fused_ms": round(f * 1e3, 2),
                            "speedup": round(c / f, 2),
                            "max_logit_gap_over_spread": round(((a - b).abs() / spread).max().item(), 4),
                            "top1_agreement": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 3)})
            if not args.json:
                r = results[-1]
                print(f"{label:>10}: compiled {r['compiled_ms']:.2f} ms, fused {r['fused_ms']:.2f} ms ({r['speedup']:.2f}x); "
                      f"logits {r['max_logit_gap_over_spread']:.3f} of the spread apart, top-1 agree {r['top1_agreement']:.3f}",
                      flush=True)
    if args.json:
        print(json.dumps({"compiled_step_ready_s": round(ready_s, 1), "rounds": args.rounds, "shapes": results}))


if __name__ == "__main__":
    main()
