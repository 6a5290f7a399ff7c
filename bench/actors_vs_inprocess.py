"""Batch 1 without speculation, served through the actors against the same decoding in-process,
alternating in one run.

    python bench/actors_vs_inprocess.py [--reps 10] [--tokens 128] [--json]

One process loads the default model in the default format with the compiled decode step and
starts an embedded ``Server`` (its verifier is a child process, as ``treeserve serve`` runs it).
Each round times one chat request through ``Client.generate`` (gateway, scheduler, verifier; the
client's wall time, prefill included) and then ``generate_incremental`` on the same prompt ids
in this process, and checks that both produced the same number of tokens (the same work; each
round's answers run to ``--tokens`` unless a stop token comes first). The tokens themselves
need not match in the fast formats: the server prefills all but the prompt's last token and
runs that one as a decode step, the in-process loop prefills the whole prompt, and the two
round differently (a prefill's products run on AMX tiles and, from 6 tokens on, its attention
too, with bf16 softmax weights; a one-token step runs on vectors in fp32), so a near-tie can
turn; the report gives how many tokens
the two answers share before they part (float32 serves the same tokens). One untimed request
of each warms both paths first. While one path runs the other is idle, so they do not share the CPU.
Reports each path's median tokens/s and the median of the per-round ratios served / in-process
(issue 12's bar: at least 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

from treeserve.cli_serve import server_config
from treeserve.client import Client
from treeserve.models import DEFAULT_MODEL, load_model
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental
from treeserve.server import Server

MESSAGES = [{"role": "user", "content": "Write a long story about a dragon who learns to paint."}]


async def run(reps: int, tokens: int) -> dict[str, object]:
    loaded = load_model(DEFAULT_MODEL, weight_format="auto", compile_decode=True)
    prompt_ids = loaded.tokenizer.encode_chat(MESSAGES)
    params = SamplingParams(max_new_tokens=tokens, stop_token_ids=tuple(loaded.tokenizer.stop_ids))
    generate_incremental(loaded.model, prompt_ids, params)
    served: list[float] = []
    local: list[float] = []
    shared: list[int] = []
    with tempfile.TemporaryDirectory(prefix="treeserve-bench-") as tmp:
        config = server_config(model=DEFAULT_MODEL, bind=f"ipc://{tmp}/gateway.sock", dtype="auto", num_rows=1,
                               row_capacity=max(512, tokens + 2048), compile_decode=True)
        async with Server(config) as server, Client(server.endpoint) as client:
            await client.generate(MESSAGES, speculate="none", max_tokens=tokens)
            for _ in range(reps):
                started = time.perf_counter()
                completion = await client.generate(MESSAGES, speculate="none", max_tokens=tokens)
                served.append(len(completion.token_ids) / (time.perf_counter() - started))
                started = time.perf_counter()
                result = generate_incremental(loaded.model, prompt_ids, params)
                local.append(len(result.token_ids) / (time.perf_counter() - started))
                a, b = list(completion.token_ids), list(result.token_ids)
                if len(a) != len(b):
                    raise SystemExit(f"the served answer has {len(a)} tokens, the in-process one {len(b)}")
                shared.append(next((k for k in range(len(a)) if a[k] != b[k]), len(a)))
    ratios = [s / l for s, l in zip(served, local)]
    return {
        "tokens": tokens, "reps": reps,
        "served_tok_s": round(statistics.median(served), 1), "in_process_tok_s": round(statistics.median(local), 1),
        "ratio_median": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3), "shared_prefix_tokens": min(shared),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import uvloop

    result = uvloop.run(run(args.reps, args.tokens))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"served {result['served_tok_s']} tok/s, in-process {result['in_process_tok_s']} tok/s, served / in-process "
              f"{result['ratio_median']} (min {result['ratio_min']}, max {result['ratio_max']}) over {args.reps} rounds; "
              f"the answers share their first {result['shared_prefix_tokens']} of {args.tokens} tokens")


if __name__ == "__main__":
    main()
