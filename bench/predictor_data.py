"""Record the default model's real output lengths on chat prompts (the output-length predictor's data).

Every prompt is sent as one user turn through the model's chat template and answered with
greedy decoding up to ``--max-tokens`` tokens (stopping at the tokenizer's stop ids), exactly
as the server answers ``messages=[{"role": "user", "content": prompt}]`` at its default
temperature 0. Decoding is batched: a continuous-batching greedy loop keeps ``--batch``
KV-cache rows busy (rows freed in one step are refilled together by one batched prefill,
:func:`~treeserve.ops.batch_step.prefill_rows`), one forward per step for all rows.

Prompts come from the fetched public sets (``python bench/data/fetch.py``) and the synthetic
set (``python bench/data/synthetic.py``, written here when missing), pooled and shuffled with
``--seed``; they are answered in that order, so stopping early (``--time-budget-s``, or a
kill) keeps a uniform random subset, not a short-output-biased one.

The model is served as the CLI serves it: ``--format q4_1`` (the default) puts the weights in
the 4-bit format and runs every decode step through the compiled batched step
(``ops/decode_step.py``), about 4x float32's speed here at 64 rows; ``--dtype`` keeps the
first runs' plain eager float32 / bfloat16 weights.

Output is written as each answer ends, so a run is resumable: a rerun with the same flags
skips every ``(dataset, id)`` already in the output files. Two CSVs: ``--out`` (default
``bench/data/predictor_lengths_<max_tokens>_<format>.csv``, committed) for every set but
AlpacaEval, and ``--out-noncommercial`` (default
``bench/out/predictor_lengths_<max_tokens>_<format>_alpacaeval.csv``, ignored by git) for
AlpacaEval's rows, whose data is CC BY-NC. Their ``#`` header lines record the
provenance (script, model and its GGUF sha256, parameters, date, git commit); the rows are
``dataset,id,prompt_sha256,num_prompt_tokens,num_output_tokens,is_capped``. No prompt text is
stored: :func:`treeserve.training.length_data.load_length_data` joins the rows back to the prompt files by
``(dataset, id)`` and checks ``prompt_sha256``.

Usage (the shipped 512-token data; ``bench/data/README.md`` gives the times)::

    python bench/data/fetch.py mtbench humaneval gsm8k arenahard alpacaeval
    nice -n 19 python bench/predictor_data.py --sets mtbench humaneval gsm8k arenahard alpacaeval --shard 0/2 &
    sleep 20; nice -n 19 python bench/predictor_data.py --sets mtbench humaneval gsm8k arenahard alpacaeval --shard 1/2
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from treeserve.models import DEFAULT_MODEL, REGISTRY, load_model
from treeserve.ops.batch_step import prefill_rows, row_block
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.model import Transformer

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_SETS = ("mtbench", "humaneval", "gsm8k", "arenahard", "alpacaeval", "synthetic")
NONCOMMERCIAL_SETS = ("alpacaeval",)
"""Sets whose rows never go into a committed file (AlpacaEval is CC BY-NC)."""
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
    states: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (tokens written, final hidden state)


def _ensure_synthetic() -> None:
    path = DATA_DIR / "synthetic.jsonl"
    if not path.exists():
        sys.path.insert(0, str(DATA_DIR))
        from synthetic import main as write_synthetic  # bench/data/synthetic.py

        write_synthetic([])


def load_jobs(sets: Sequence[str], tokenizer: object, max_prompt_tokens: int, seed: int) -> list[Job]:
    """All prompts of ``sets`` that tokenize to at most ``max_prompt_tokens`` (chat-templated), shuffled."""
    jobs: list[Job] = []
    for name in sets:
        if name == "synthetic":
            _ensure_synthetic()
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
    on_done: Callable[[Job], None],
    state_every: int = 0,
) -> int:
    """Greedy-decode ``jobs`` in order with continuous batching; return how many were started.

    Rows free at the top of a step are refilled together (one :func:`prefill_rows` call), then
    every busy row advances one token per batched forward. A row finishes on a stop id (kept,
    counted) or at ``max_tokens``. No job is started once ``time_budget_s`` has passed; the
    running ones finish. With ``state_every`` > 0 a job keeps, each time its answer reaches a
    multiple of that many tokens, the final hidden state of the forward that wrote the last of
    them (``Job.states``): what a running row's re-prediction reads in serving.
    """
    if not jobs:
        return 0
    capacity = max(len(j.prompt_ids) for j in jobs) + max_tokens + 1
    cache: KVCache = model.new_cache(batch_size, capacity)
    rows: list[Job | None] = [None] * batch_size
    next_token = [0] * batch_size
    started_at = time.monotonic()
    num_started = 0
    while True:
        refill: list[tuple[int, list[int]]] = []
        for row in range(batch_size):
            if rows[row] is None and num_started < len(jobs) and time.monotonic() - started_at < time_budget_s:
                job = jobs[num_started]
                num_started += 1
                # The prompt's last token is fed by the first decode step (keeps every step 1 token/row).
                refill.append((row, job.prompt_ids[:-1]))
                next_token[row] = job.prompt_ids[-1]
                rows[row] = job
        if refill:
            prefill_rows(model, cache, refill)
        busy = [r for r in range(batch_size) if rows[r] is not None]
        if not busy:
            return num_started
        # Only the rows [0, hi) run; idle rows inside it are padded and never committed.
        hi = max(busy) + 1
        view = row_block(cache, 0, hi)
        tokens = torch.tensor([[next_token[r]] for r in range(hi)], dtype=torch.long)
        with torch.inference_mode():
            if state_every:
                logits, hidden = model(tokens, view, return_hidden=True)  # (hi, 1, V), (hi, 1, D)
            else:
                logits = model(tokens, view)  # (hi, 1, V)
        picks = logits[:, -1].argmax(dim=-1).tolist()
        for r in range(hi):
            job = rows[r]
            view.commit(r, [0] if job is not None else [])
            if job is None:
                continue
            token = int(picks[r])
            job.output.append(token)
            next_token[r] = token
            if state_every and len(job.output) % state_every == 0:
                job.states.append((len(job.output), hidden[r, -1].float().clone()))
            if token in stop_ids or len(job.output) >= max_tokens:
                job.is_capped = token not in stop_ids
                rows[r] = None
                on_done(job)


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def recorded_keys(path: Path) -> set[tuple[str, str]]:
    """``(dataset, id)`` of every row already in ``path`` (empty when it does not exist)."""
    if not path.exists():
        return set()
    with path.open(encoding="utf-8") as handle:
        return {(r["dataset"], r["id"]) for r in csv.DictReader(line for line in handle if not line.startswith("#"))}


class RowWriter:
    """Appends one CSV row per finished job, flushed at once (a killed run loses nothing written)."""

    def __init__(self, path: Path, header: dict[str, object]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        is_new = not path.exists() or path.stat().st_size == 0
        self._handle = path.open("a", encoding="utf-8", newline="")
        if is_new:
            for key, value in header.items():
                self._handle.write(f"# {key}: {json.dumps(value)}\n")
        self._writer = csv.writer(self._handle)
        if is_new:
            self._writer.writerow(CSV_FIELDS)
        self._handle.flush()

    def write(self, job: Job) -> None:
        self._writer.writerow([job.dataset, job.id, prompt_sha256(job.prompt), len(job.prompt_ids),
                               len(job.output), int(job.is_capped)])
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS), help="prompt sets (bench/data/<name>.jsonl)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/data/predictor_lengths_<max-tokens>_<format>.csv")
    parser.add_argument("--out-noncommercial", type=Path, default=None,
                        help=f"where rows of {'/'.join(NONCOMMERCIAL_SETS)} go (never a committed file; default: "
                             "bench/out/predictor_lengths_<max-tokens>_<format>_alpacaeval.csv)")
    parser.add_argument("--max-tokens", type=int, default=512, help="output cap (capped rows are flagged)")
    parser.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer (chat-templated) prompts")
    parser.add_argument("--batch", type=int, default=64, help="KV-cache rows decoded together")
    parser.add_argument("--limit", type=int, default=0, help="answer at most this many prompts (0: all)")
    parser.add_argument("--time-budget-s", type=float, default=1e9, help="start no prompt after this")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed of the pooled prompts")
    parser.add_argument("--format", default="q4_1", choices=["q4_1", "int8", "bfloat16", "float32"],
                        help="weight format (ops/formats.py; q4_1, the CLI's default serving format, runs batches "
                             "through the compiled decode step; float32 is the exact reference)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="deprecated: plain eager weights in this dtype instead of --format (the first runs)")
    parser.add_argument("--skip-recorded", type=Path, nargs="*", default=[],
                        help="also skip prompts recorded in these CSVs (e.g. a run in another dtype)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: on a shared machine two threads ran a step 10x slower)")
    parser.add_argument("--shard", default="0/1", metavar="I/N",
                        help="answer only every N-th queued prompt from the I-th (run N processes of one thread "
                             "each, started one after another: they append to the same files)")
    args = parser.parse_args(argv)
    shard, _, num_shards = args.shard.partition("/")
    if not (shard.isdigit() and num_shards.isdigit() and int(shard) < int(num_shards)):
        parser.error(f"--shard must be I/N with 0 <= I < N, got {args.shard!r}")
    torch.set_num_threads(args.threads)
    weights = args.dtype if args.dtype is not None else args.format
    if args.out is None:
        args.out = DATA_DIR / f"predictor_lengths_{args.max_tokens}_{weights}.csv"
    if args.out_noncommercial is None:
        args.out_noncommercial = DATA_DIR.parent / "out" / f"predictor_lengths_{args.max_tokens}_{weights}_alpacaeval.csv"

    if args.dtype is not None:
        loaded = load_model(DEFAULT_MODEL, dtype=getattr(torch, args.dtype))
    else:
        loaded = load_model(DEFAULT_MODEL, weight_format=args.format)
    tokenizer = loaded.tokenizer
    jobs = load_jobs(args.sets, tokenizer, args.max_prompt_tokens, args.seed)
    if args.limit:
        jobs = jobs[: args.limit]
    done_keys = recorded_keys(args.out) | recorded_keys(args.out_noncommercial)
    for path in args.skip_recorded:
        done_keys |= recorded_keys(path)
    # Shard before skipping recorded rows, so shards started at different times never overlap.
    todo = [j for j in jobs[int(shard)::int(num_shards)] if (j.dataset, j.id) not in done_keys]
    stop_ids = set(int(t) for t in tokenizer.stop_ids)
    _log(f"{len(jobs)} prompts from {args.sets}; shard {args.shard}: {len(todo)} to answer; "
         f"batch {args.batch}, max_tokens {args.max_tokens}")

    header = {
        "script": "bench/predictor_data.py",
        "git_commit": _git_commit(),
        "model": DEFAULT_MODEL,
        "model_gguf_sha256": REGISTRY[DEFAULT_MODEL].gguf_sha256,
        "model_wheel": REGISTRY[DEFAULT_MODEL].wheel_requirement,
        "decoding": f"greedy (temperature 0), {weights}, chat template with one user turn, stop at tokenizer stop ids",
        "max_tokens": args.max_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "sets": list(args.sets),
        "shuffle_seed": args.seed,
        "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "prompt_text": "not stored; join (dataset, id) with bench/data/<dataset>.jsonl "
                       "(bench/data/fetch.py, bench/data/synthetic.py)",
        "resumable": "rows are appended as answers end; a rerun skips recorded (dataset, id)",
    }
    writers = {"main": RowWriter(args.out, {**header, "sets": [s for s in args.sets if s not in NONCOMMERCIAL_SETS]})}
    if any(s in NONCOMMERCIAL_SETS for s in args.sets):
        writers["nc"] = RowWriter(args.out_noncommercial,
                                  {**header, "sets": [s for s in args.sets if s in NONCOMMERCIAL_SETS],
                                   "licence": "AlpacaEval data is CC BY-NC 4.0: do not commit this file"})
    num_done = 0
    num_tokens = 0
    t0 = time.monotonic()

    def on_done(job: Job) -> None:
        nonlocal num_done, num_tokens
        writers["nc" if job.dataset in NONCOMMERCIAL_SETS else "main"].write(job)
        num_done += 1
        num_tokens += len(job.output)
        if num_done % 25 == 0:
            elapsed = time.monotonic() - t0
            _log(f"{num_done}/{len(todo)} done, {num_tokens / elapsed:.1f} tok/s, {elapsed:.0f} s")

    try:
        generate_batched(loaded.model, todo, stop_ids, args.max_tokens, args.batch, args.time_budget_s, on_done)
    finally:
        for writer in writers.values():
            writer.close()
    _log(f"recorded {num_done} answers ({num_tokens} tokens) in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
