"""Serving benchmark: the whole actor system (gateway, scheduler, speculator and verifier
child processes) on the default model, measured side by side in one run.

Measures, with greedy decoding:

* batch 1: tokens/s, mean tokens per verify step and time to first token for
  ``--speculate none``, ``chain`` and ``tree`` (the modes rotate per prompt, so a noisy
  machine hurts them alike; medians over prompts);
* total tokens/s and median TTFT with 1, 4 and 16 concurrent clients (``--clients``) for
  fixed-size tree speculation (a server with adaptive sizing off: every step drafts
  ``max_tree_nodes`` per row; key ``tree@N``), then, on a second server with adaptive sizing
  on, no speculation (``none@N``: requests with ``speculate="none"``, which the adaptive
  policy neither sizes nor learns from) and adaptive tree speculation (``tree-adaptive@N``),
  alternating. The adaptive server is warmed up with one pass before it is timed, since its
  policy learns the step costs and acceptance as it serves. Each mode runs ``--rounds``
  passes (order rotated per round); the median pass is reported.

Every pass replays the same prompts, and the suffix drafter learns from every request a server
serves: it would draft the earlier passes' greedy answers word for word. So the servers' suffix
indexes are emptied (``Server.forget_traffic``) before every batch-1 request and every pass,
and each figure is one of fresh traffic (within a pass the index learns from that pass's other
requests, as in service). ``--repetitive`` keeps what they learned: repeated traffic, the case
the suffix drafter is for. With fewer prompts than clients, prompts repeat within a pass: give
``--limit`` at least the largest ``--clients``.

``--peer llama-server`` measures instead the same streamed OpenAI-API chat traffic against
treeserve's HTTP server and llama.cpp's ``llama-server`` on the same GGUF (``--gguf``, default
the default model's file), a fresh server per client count with a slot (a KV row) per client:
total tokens/s, TTFT p50/p99 and time per output token (``bench/http_load.py``). treeserve then
serves the file as it is stored (``--format auto``; ``--format`` is not used) with its default
(adaptive) speculation, as ``treeserve serve --http --model FILE`` does.

Usage::

    python bench/serving.py --json                       # built-in prompts
    python bench/serving.py --dataset mtbench --limit 8  # after python bench/data/fetch.py mtbench
    LLAMA_SERVER=/path/to/llama-server python bench/serving.py --peer llama-server --dataset mtbench \
        --clients 1 4 16 64 --json

Progress goes to stderr; ``--json`` prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvloop

from treeserve.actors.scheduler.types import SchedulerSettings
from treeserve.ops.speculation_modes import SpeculationMode
from treeserve.actors.scheduler.policy import PolicyName
from treeserve.client import Client
from treeserve.ops.formats import FORMAT_NAMES
from treeserve.server import Server, ServerConfig

BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three tips for staying productive when working from home.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "What are the main differences between a list and a tuple in Python?",
    "Give me a short recipe for pancakes.",
]


def _log(message: str) -> None:
    print(f"[bench/serving] {message}", file=sys.stderr, flush=True)


def load_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts:
        prompts = [line for line in Path(args.prompts).read_text(encoding="utf-8").split("\n") if line.strip()]
    elif args.dataset:
        path = Path(__file__).parent / "data" / f"{args.dataset}.jsonl"
        if not path.exists():
            raise SystemExit(f"{path} is missing: run python bench/data/fetch.py {args.dataset}")
        prompts = [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    else:
        prompts = list(BUILTIN_PROMPTS)
    return prompts[: args.limit] if args.limit else prompts


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


async def run_one(client: Client, prompt: str, speculate: str, max_tokens: int) -> dict[str, float]:
    started = time.perf_counter()
    completion = await client.generate([{"role": "user", "content": prompt}], speculate=speculate, max_tokens=max_tokens)
    elapsed = time.perf_counter() - started
    return {
        "num_tokens": len(completion.token_ids),
        "seconds": elapsed,
        "tokens_per_s": len(completion.token_ids) / elapsed,
        "mean_accepted_per_step": completion.mean_accepted_per_step,
        "ttft_s": completion.client_ttft_s,
    }


async def concurrency(endpoint: str, prompts: list[str], speculate: str, num_clients: int,
                      max_tokens: int) -> dict[str, float]:
    """Total tokens/s of ``num_clients`` clients working through ``prompts`` (each at least once)."""
    jobs = [prompts[i % len(prompts)] for i in range(max(num_clients, len(prompts)))]
    started = time.perf_counter()
    queue: asyncio.Queue[str] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    runs: list[dict[str, float]] = []

    async def worker() -> None:
        async with Client(endpoint) as own:
            while not queue.empty():
                runs.append(await run_one(own, queue.get_nowait(), speculate, max_tokens))

    await asyncio.gather(*(worker() for _ in range(num_clients)))
    wall = time.perf_counter() - started
    return {
        "total_tokens_per_s": sum(r["num_tokens"] for r in runs) / wall,
        "median_ttft_s": _median([r["ttft_s"] for r in runs]),
        "mean_accepted_per_step": _median([r["mean_accepted_per_step"] for r in runs]),
        "num_requests": len(runs),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    prompts = load_prompts(args)
    modes = [SpeculationMode.NONE.value, SpeculationMode.CHAIN.value, SpeculationMode.TREE.value]
    with tempfile.TemporaryDirectory(prefix="treeserve-bench-") as tmp:
        config = ServerConfig(
            model=args.model, dtype=args.dtype, bind=f"ipc://{tmp}/gw.sock", num_rows=16,
            row_capacity=args.row_capacity, scheduling=SchedulerSettings(policy=PolicyName.FCFS.value, adaptive_speculation=False),
            max_tree_nodes=args.max_tree_nodes,
        )
        async with Server(config, progress=_log) as server, Client(server.endpoint) as client:
            _log("warm-up")
            for mode in modes:
                await run_one(client, "Hello!", mode, 8)
            forget = _forgetter(server, args)
            batch1: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            for i, prompt in enumerate(prompts if not args.skip_batch1 else []):
                order = modes[i % 3:] + modes[: i % 3]
                for mode in order:
                    await forget()
                    batch1[mode].append(await run_one(client, prompt, mode, args.max_tokens))
                _log(f"batch-1 prompt {i + 1}/{len(prompts)}: " + ", ".join(
                    f"{m} {batch1[m][-1]['tokens_per_s']:.1f} tok/s" for m in modes))
            result: dict[str, Any] = {"config": {
                "model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens, "num_prompts": len(prompts),
                "speculators": [dict(s) for s in config.resolved_speculators()], "max_tree_nodes": args.max_tree_nodes,
                "repetitive": args.repetitive,
            }, "batch1": {}, "concurrency": {}}
            base = _median([r["tokens_per_s"] for r in batch1[SpeculationMode.NONE.value]])
            for mode in modes if not args.skip_batch1 else []:
                tps = _median([r["tokens_per_s"] for r in batch1[mode]])
                result["batch1"][mode] = {
                    "tokens_per_s": tps,
                    "mean_accepted_per_step": _median([r["mean_accepted_per_step"] for r in batch1[mode]]),
                    "ttft_s": _median([r["ttft_s"] for r in batch1[mode]]),
                    "ratio_to_none": tps / base if base else 0.0,
                }
            for num_clients in args.clients:
                await _rounds(result, server.endpoint, prompts, {"tree": SpeculationMode.TREE.value}, num_clients,
                              args, forget)
        adaptive = replace(config, scheduling=replace(config.scheduling, adaptive_speculation=True))
        async with Server(adaptive, progress=_log) as server:
            forget = _forgetter(server, args)
            for num_clients in args.clients:
                await forget()
                await concurrency(server.endpoint, prompts, SpeculationMode.TREE.value, num_clients, args.max_tokens)  # learn
                await _rounds(result, server.endpoint, prompts,
                              {"none": SpeculationMode.NONE.value, "tree-adaptive": SpeculationMode.TREE.value},
                              num_clients, args, forget)
            assert server.scheduler is not None
            result["adaptive_state"] = (await server.scheduler.ask("stats")).get("adaptive")
    return result


def _forgetter(server: Server, args: argparse.Namespace) -> Callable[[], Awaitable[None]]:
    """What runs before every measured request or pass: empty the suffix indexes (fresh
    traffic), or nothing with ``--repetitive``."""
    async def keep() -> None:
        return None

    return keep if args.repetitive else server.forget_traffic


async def _rounds(result: dict[str, Any], endpoint: str, prompts: list[str], modes: dict[str, str],
                  num_clients: int, args: argparse.Namespace, forget: Callable[[], Awaitable[None]]) -> None:
    """``args.rounds`` passes of every mode (key -> speculate) at ``num_clients``, the order
    rotated each round; each key gets the pass with the median total tokens/s plus every
    round's figure (``rounds_tokens_per_s``)."""
    names = list(modes)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for index in range(args.rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            await forget()
            runs[name].append(await concurrency(endpoint, prompts, modes[name], num_clients, args.max_tokens))
            _log(f"{name}@{num_clients} round {index + 1}: {runs[name][-1]['total_tokens_per_s']:.1f} tok/s total")
    for name, passes in runs.items():
        ordered = sorted(passes, key=lambda r: r["total_tokens_per_s"])
        median = dict(ordered[(len(ordered) - 1) // 2])
        median["rounds_tokens_per_s"] = [round(r["total_tokens_per_s"], 2) for r in passes]
        result["concurrency"][f"{name}@{num_clients}"] = median


def peer_main(args: argparse.Namespace) -> None:
    """``--peer``: treeserve's HTTP server beside the peer's, a fresh pair per client count."""
    import http_load  # bench/ is on sys.path when this file runs as a script

    from treeserve.ops.loaders.registry import DEFAULT_MODEL, pull

    gguf = args.gguf or str(pull(DEFAULT_MODEL))
    with tempfile.TemporaryDirectory(prefix="treeserve-peer-") as tmp:
        result = http_load.compare(gguf, load_prompts(args), args.clients, args.max_tokens, args.row_capacity,
                                   args.threads, Path(tmp), progress=_log)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for clients, row in result["clients"].items():
        print(f"{clients:>3} clients: treeserve {row['treeserve_tok_s']:7.1f} tok/s, llama-server {row['peer_tok_s']:7.1f}"
              f" (x{row['tok_s_ratio']:.2f}); TTFT p99 {row['treeserve_ttft_p99_s']:.2f} / {row['peer_ttft_p99_s']:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--format", "--dtype", dest="dtype", choices=FORMAT_NAMES, default="float32",
                        help="weight format of the served model (float32: the exact reference)")
    parser.add_argument("--dataset", default=None, help="a set fetched by bench/data/fetch.py (e.g. mtbench)")
    parser.add_argument("--prompts", default=None, help="a file with one prompt per line")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--row-capacity", type=int, default=1024)
    parser.add_argument("--max-tree-nodes", type=int, default=64, help="tree cap per row (fixed trees use all of it)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="concurrency levels")
    parser.add_argument("--skip-batch1", action="store_true", help="only the concurrency runs")
    parser.add_argument("--rounds", type=int, default=3, help="passes per mode and concurrency (median reported)")
    parser.add_argument("--repetitive", action="store_true",
                        help="keep the suffix indexes across passes over the same prompts (repeated traffic); "
                             "default: empty them before every measured request and pass (fresh traffic)")
    parser.add_argument("--peer", choices=["llama-server"], default=None,
                        help="compare treeserve's HTTP server with this peer on the same traffic (bench/http_load.py)")
    parser.add_argument("--gguf", default=None, help="with --peer: the GGUF both serve (default: the default model's)")
    parser.add_argument("--threads", type=int, default=2, help="with --peer: the peer's threads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.peer:
        peer_main(args)
        return
    result = uvloop.run(bench(args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for mode, row in result["batch1"].items():
            print(f"batch1 {mode:6s} {row['tokens_per_s']:7.1f} tok/s  x{row['ratio_to_none']:.2f}  "
                  f"{row['mean_accepted_per_step']:.2f} tok/step  ttft {row['ttft_s']:.2f} s")
        for key, row in result["concurrency"].items():
            print(f"{key:9s} {row['total_tokens_per_s']:7.1f} tok/s total  ttft {row['median_ttft_s']:.2f} s")


if __name__ == "__main__":
    main()
