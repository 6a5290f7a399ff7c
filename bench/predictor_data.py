"""Record the default model's real output lengths on benchmark prompts (output-length predictor data).

Every prompt is sent as one user turn through the model's chat template and answered with
greedy decoding up to ``--max-tokens`` tokens (stopping at the tokenizer's stop ids), exactly
as the server answers ``messages=[{"role": "user", "content": prompt}]`` at temperature 0.
Decoding is batched: a continuous-batching greedy loop keeps ``--batch`` KV-cache rows busy
(a finished row is refilled with the next prompt at once), one forward per step for all rows.

Prompts come from the fetched sets (``python bench/data/fetch.py``), pooled and shuffled with
``--seed``; they are answered in that order, so stopping at ``--time-budget-s`` (no new prompt
is started after it, the running ones finish) keeps a uniform random subset, not a
short-output-biased one.

Output: a CSV (default ``bench/data/predictor_lengths.csv``) whose ``#`` header lines record
the provenance (script, model and its GGUF sha256, parameters, date, git commit) and whose
rows are ``dataset,id,prompt_sha256,num_prompt_tokens,num_output_tokens,is_capped``. No prompt
text is stored (AlpacaEval is CC BY-NC); :func:`treeserve.predictor.load_length_data` joins
the rows back to the fetched prompt files by ``(dataset, id)`` and checks ``prompt_sha256``.

Usage::

    nice -n 19 python bench/predictor_data.py --time-budget-s 1500 --threads 1
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import hashlib
import json
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from treeserve.models import DEFAULT_MODEL, REGISTRY, load_model
from treeserve.ops.batch_step import prefill_row
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.model import Transformer

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_SETS = ("mtbench", "humaneval", "gsm8k", "arenahard", "alpacaeval")
CSV_FIELDS = ("dataset", "id", "prompt_sha256", "num_prompt_tokens", "num_output_tokens", "is_capped")


def _log(message: str) -> None:
    print(f"[predictor_data] {message}", file=sys.stderr, flush=True)


def prompt_sha256(prompt: str) -> str:
    """Hex sha256 of a prompt's UTF-8 text (how the CSV rows are tied to the fetched prompts)."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


@dataclass
class Job:
    """One prompt to answer and, once done, its output length."""

    dataset: str
    id: str
    prompt: str
    prompt_ids: list[int]
    output: list[int]
    is_capped: bool = False


def load_jobs(sets: Sequence[str], tokenizer: object, max_prompt_tokens: int, seed: int) -> list[Job]:
    """All prompts of ``sets`` that tokenize to at most ``max_prompt_tokens`` (chat-templated), shuffled."""
    jobs: list[Job] = []
    for name in sets:
        path = DATA_DIR / f"{name}.jsonl"
        if not path.exists():
            raise SystemExit(f"{path} is missing: run python bench/data/fetch.py {name}")
        for line in path.read_text(encoding="utf-8").split("\n"):
            if not line.strip():
                continue
            record = json.loads(line)
            ids = tokenizer.encode_chat([{"role": "user", "content": record["prompt"]}])  # type: ignore[attr-defined]
            if len(ids) <= max_prompt_tokens:
                jobs.append(Job(name, str(record["id"]), record["prompt"], [int(t) for t in ids], []))
    random.Random(seed).shuffle(jobs)
    return jobs


def generate_batched(
    model: Transformer,
    jobs: Sequence[Job],
    stop_ids: set[int],
    max_tokens: int,
    batch_size: int,
    time_budget_s: float,
    on_done: object,
) -> int:
    """Greedy-decode ``jobs`` in order with continuous batching; return how many were started.

    Each row is prefilled alone (:func:`prefill_row`), then every busy row advances one token
    per batched forward. A row finishes on a stop id (kept, counted) or at ``max_tokens``.
    No job is started once ``time_budget_s`` has passed; the running ones finish.
    """
    capacity = max(len(j.prompt_ids) for j in jobs) + max_tokens + 1
    cache: KVCache = model.new_cache(batch_size, capacity)
    rows: list[Job | None] = [None] * batch_size
    next_token = [0] * batch_size
    started_at = time.monotonic()
    num_started = 0
    num_steps = 0
    while True:
        for row in range(batch_size):
            if rows[row] is None and num_started < len(jobs) and time.monotonic() - started_at < time_budget_s:
                job = jobs[num_started]
                num_started += 1
                # The prompt's last token is fed by the first decode step (keeps every step 1 token/row).
                prefill_row(model, cache, row, job.prompt_ids[:-1])
                next_token[row] = job.prompt_ids[-1]
                rows[row] = job
        busy = [r for r in range(batch_size) if rows[r] is not None]
        if not busy:
            return num_started
        # Only the rows [0, hi) run; idle rows inside it are padded and never committed.
        hi = max(busy) + 1
        view = _row_view(cache, hi)
        tokens = torch.tensor([[next_token[r]] for r in range(hi)], dtype=torch.long)
        logits = model(tokens, view)  # (hi, 1, V)
        picks = logits[:, -1].argmax(dim=-1).tolist()
        num_steps += 1
        for r in range(hi):
            job = rows[r]
            view.commit(r, [0] if job is not None else [])
            if job is None:
                continue
            token = int(picks[r])
            job.output.append(token)
            next_token[r] = token
            if token in stop_ids or len(job.output) >= max_tokens:
                job.is_capped = token not in stop_ids
                rows[r] = None
                on_done(job)  # type: ignore[operator]


def _row_view(cache: KVCache, stop: int) -> KVCache:
    """Rows ``[0, stop)`` of ``cache`` as a smaller cache sharing its storage."""
    import copy

    view = copy.copy(cache)
    view.keys = [k[:stop] for k in cache.keys]  # (b, n_kv, capacity, hd) views
    view.values = [v[:stop] for v in cache.values]
    view.lengths = cache.lengths[:stop]
    view.batch_size = stop
    view.num_pending = [0] * stop
    return view


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS), help="prompt sets (bench/data/<name>.jsonl)")
    parser.add_argument("--out", type=Path, default=DATA_DIR / "predictor_lengths.csv")
    parser.add_argument("--max-tokens", type=int, default=512, help="output cap (capped rows are flagged)")
    parser.add_argument("--max-prompt-tokens", type=int, default=768, help="skip longer (chat-templated) prompts")
    parser.add_argument("--batch", type=int, default=16, help="KV-cache rows decoded together")
    parser.add_argument("--limit", type=int, default=0, help="answer at most this many prompts (0: all)")
    parser.add_argument("--time-budget-s", type=float, default=1500.0, help="start no prompt after this")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed of the pooled prompts")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    loaded = load_model(DEFAULT_MODEL)
    tokenizer = loaded.tokenizer
    jobs = load_jobs(args.sets, tokenizer, args.max_prompt_tokens, args.seed)
    if args.limit:
        jobs = jobs[: args.limit]
    stop_ids = set(int(t) for t in tokenizer.stop_ids)
    _log(f"{len(jobs)} prompts queued from {args.sets}; batch {args.batch}, max_tokens {args.max_tokens}")

    started = dt.datetime.now(dt.timezone.utc)
    header = {
        "script": "bench/predictor_data.py",
        "git_commit": _git_commit(),
        "model": DEFAULT_MODEL,
        "model_gguf_sha256": REGISTRY[DEFAULT_MODEL].gguf_sha256,
        "model_wheel": REGISTRY[DEFAULT_MODEL].wheel_requirement,
        "decoding": "greedy (temperature 0), chat template with one user turn, stop at tokenizer stop ids",
        "max_tokens": args.max_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "sets": list(args.sets),
        "shuffle_seed": args.seed,
        "batch": args.batch,
        "started_utc": started.isoformat(timespec="seconds"),
        "prompt_text": "not stored; join (dataset, id) with bench/data/<dataset>.jsonl from bench/data/fetch.py",
    }
    done: list[Job] = []
    t0 = time.monotonic()

    def on_done(job: Job) -> None:
        done.append(job)
        if len(done) % 10 == 0:
            rate = sum(len(j.output) for j in done) / (time.monotonic() - t0)
            _log(f"{len(done)} done, {rate:.1f} tok/s, {time.monotonic() - t0:.0f} s")

    num_started = generate_batched(loaded.model, jobs, stop_ids, args.max_tokens, args.batch, args.time_budget_s, on_done)
    wall = time.monotonic() - t0
    header["wall_s"] = round(wall, 1)
    header["num_prompts"] = len(done)
    header["num_prompts_available"] = len(jobs)
    order = {id(j): i for i, j in enumerate(jobs)}
    done.sort(key=lambda j: order[id(j)])
    assert len(done) == num_started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8", newline="") as handle:
        for key, value in header.items():
            handle.write(f"# {key}: {json.dumps(value)}\n")
        writer = csv.writer(handle)
        writer.writerow(CSV_FIELDS)
        for job in done:
            writer.writerow([job.dataset, job.id, prompt_sha256(job.prompt), len(job.prompt_ids),
                             len(job.output), int(job.is_capped)])
    _log(f"wrote {len(done)} rows to {args.out} in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
