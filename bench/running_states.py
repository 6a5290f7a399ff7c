"""Record running rows' hidden states with the default model's real answers: the data of the
re-prediction head (:mod:`treeserve.ops.remaining_head`), which reads a running row's state every
``--state-every`` tokens and predicts how many tokens the answer still needs.

Prompts are those of ``bench/predictor_data.py`` (pooled, shuffled with ``--seed``), split by
:func:`~treeserve.training.length_data.is_test_prompt`: the first ``--num-train`` training prompts
and the first ``--num-test`` held-out ones. Each is answered as the server answers it (one user
turn through the chat template, greedy, the served ``--format``, up to ``--max-tokens``), batched
by :func:`predictor_data.generate_batched`, which keeps the final hidden state of the forward that
wrote each multiple of ``--state-every`` tokens: the state a verifier step returns for a row's
last accepted node.

The ``.npz`` (under ``bench/out/``, not committed: it holds AlpacaEval-derived rows) has per
answer ``dataset``, ``id``, ``is_test``, ``prompt_len``, ``length``, ``is_capped``, ``loop_at``
(where :class:`~treeserve.actors.scheduler.preemption.RepeatWatch` first flags it; -1: never) and
its tokens (``tokens`` concatenated, ``token_offsets``); per state ``state_job`` (the answer's
index), ``state_written`` (tokens written) and ``states`` (float16 ``(n, D)``). Several shards'
files are read together by ``treeserve.training.remaining``.

Usage (two one-thread shards side by side, as ``bench/predictor_data.py`` runs)::

    python bench/running_states.py --shard 0/2 & python bench/running_states.py --shard 1/2; wait
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from predictor_data import DEFAULT_SETS, Job, generate_batched, load_jobs
from treeserve.actors.scheduler.preemption import RepeatWatch
from treeserve.models import DEFAULT_MODEL, load_model
from treeserve.training.length_data import is_test_prompt

OUT_DIR = Path(__file__).resolve().parent / "out"


def pick_jobs(jobs: Sequence[Job], num_train: int, num_test: int) -> list[Job]:
    """The first ``num_train`` training and ``num_test`` held-out jobs, in the pooled order."""
    train = [j for j in jobs if not is_test_prompt(j.dataset, j.id)][:num_train]
    test = [j for j in jobs if is_test_prompt(j.dataset, j.id)][:num_test]
    return train + test


def loop_onset(tokens: Sequence[int]) -> int:
    """Where :class:`RepeatWatch` flags the answer (-1: never); fed whole, it finds the first
    repeat as it would token by token."""
    watch = RepeatWatch()
    watch.feed(tokens, len(tokens))
    return -1 if watch.loop_at is None else watch.loop_at


def save(path: Path, jobs: Sequence[Job], meta: dict[str, object]) -> None:
    states = [(index, written, state) for index, job in enumerate(jobs) for written, state in job.states]
    np.savez_compressed(
        path,
        dataset=np.array([j.dataset for j in jobs]), id=np.array([j.id for j in jobs]),
        is_test=np.array([is_test_prompt(j.dataset, j.id) for j in jobs]),
        prompt_len=np.array([len(j.prompt_ids) for j in jobs]), length=np.array([len(j.output) for j in jobs]),
        is_capped=np.array([j.is_capped for j in jobs]), loop_at=np.array([loop_onset(j.output) for j in jobs]),
        tokens=np.array([t for j in jobs for t in j.output], dtype=np.int32),
        token_offsets=np.cumsum([0] + [len(j.output) for j in jobs]),
        state_job=np.array([s[0] for s in states], dtype=np.int32),
        state_written=np.array([s[1] for s in states], dtype=np.int32),
        states=np.stack([s[2].numpy() for s in states]).astype(np.float16) if states else np.zeros((0, 0), np.float16),
        meta=np.array(repr(meta)),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS))
    parser.add_argument("--num-train", type=int, default=1200)
    parser.add_argument("--num-test", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--state-every", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--format", default="q4_1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shard", default="0/1", metavar="I/N")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    shard, num_shards = (int(x) for x in args.shard.split("/"))
    torch.set_num_threads(args.threads)
    loaded = load_model(DEFAULT_MODEL, weight_format=args.format)
    jobs = pick_jobs(load_jobs(args.sets, loaded.tokenizer, args.max_prompt_tokens, args.seed),
                     args.num_train, args.num_test)[shard::num_shards]
    stop_ids = {int(t) for t in loaded.tokenizer.stop_ids}
    out = args.out or OUT_DIR / f"running_states_{args.max_tokens}_{args.format}_{shard}of{num_shards}.npz"
    t0 = time.monotonic()
    done: list[Job] = []
    generate_batched(loaded.model, jobs, stop_ids, args.max_tokens, args.batch, 1e9, done.append, args.state_every)
    elapsed = time.monotonic() - t0
    print(f"[running_states] {len(done)} answers, {sum(len(j.output) for j in done)} tokens in {elapsed:.0f} s",
          file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    save(out, done, {"model": DEFAULT_MODEL, "format": args.format, "max_tokens": args.max_tokens,
                     "state_every": args.state_every, "seed": args.seed, "sets": args.sets})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
