"""The training subcommands: ``train-predictor`` (the SSJF output-length predictor), ``distill``
(token-only SSMs by boost-tuning) and ``distill-features`` (the feature-level drafter)."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from treeserve.cli_common import UserError, add_model_flags, model_name, progress
from treeserve.ops.format_names import FORMAT_NAMES

EVALUATION_SETS = ("mtbench", "humaneval")
"""Prompt sets the benchmarks measure on: never trained on."""
TRAINING_SETS = ("alpacaeval", "arenahard", "gsm8k")
"""The prompt sets the shipped drafters were trained on (``python bench/data/fetch.py`` fetches them)."""


def _add_teacher_flags(p: argparse.ArgumentParser) -> None:
    """Model, prompts and teacher-data flags shared by `distill` and `distill-features`."""
    add_model_flags(p)
    p.add_argument("--prompts", type=Path, nargs="+", required=True, metavar="JSONL",
                   help="JSONL prompt files, e.g. " + " ".join(f"bench/data/{n}.jsonl" for n in TRAINING_SETS)
                        + " after `python bench/data/fetch.py " + " ".join(TRAINING_SETS) + "` (never the "
                        "evaluation sets " + "/".join(EVALUATION_SETS) + ")")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="teacher data and checkpoints, shared by distill and distill-features; a rerun resumes "
                        "from them (default: <cache>/distill/<model>)")
    p.add_argument("--max-prompts", type=int, default=800)
    p.add_argument("--max-new-tokens", type=int, default=128, help="teacher continuation length cap")
    p.add_argument("--batch-size", type=int, default=16, help="teacher generation batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")


def add_train_parsers(sub: Any) -> None:
    """The ``train-predictor``, ``distill`` and ``distill-features`` subcommands' flags."""
    train = sub.add_parser("train-predictor", help="train the SSJF output-length predictor (see treeserve.training.predictor)")
    from treeserve.training.predictor import add_arguments as add_predictor_arguments

    add_predictor_arguments(train)

    distill = sub.add_parser(
        "distill", help="distil small speculative models (SSMs) from the model by boost-tuning (see treeserve.training.distill)"
    )
    _add_teacher_flags(distill)
    distill.add_argument("--out", type=Path, default=None, help="weights file (default: <work-dir>/ssm.safetensors)")
    distill.add_argument("--num-ssms", type=int, default=2)
    distill.add_argument("--layers", type=int, default=1, help="decoder layers per SSM")
    distill.add_argument("--ffn-dim", type=int, default=1024)
    distill.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary size")
    distill.add_argument("--epochs", type=int, default=3, help="epochs of the first SSM")
    distill.add_argument("--boost-epochs", type=int, default=2, help="epochs of each boost-tuned SSM")
    distill.add_argument("--lr", type=float, default=2e-3)
    distill.add_argument("--tokens-per-batch", type=int, default=1024)
    distill.add_argument("--heldout", type=int, default=16, help="sequences kept out of training to measure agreement")

    synth = sub.add_parser(
        "synth-prompts", help="have the model write user questions (sampled user turns), de-duplicated and filtered, "
                              "as a JSONL prompt set for distill-features")
    add_model_flags(synth)
    synth.add_argument("--out", type=Path, required=True, help="JSONL file to write ({\"id\", \"prompt\"} per line)")
    synth.add_argument("--num", type=int, default=3000, help="questions to write")
    synth.add_argument("--format", dest="dtype", choices=FORMAT_NAMES, default="q4_1", help="weight format of the writer")
    synth.add_argument("--temperature", type=float, default=0.9)
    synth.add_argument("--max-tokens", type=int, default=96, help="a question cut at this length is dropped")
    synth.add_argument("--batch-size", type=int, default=64)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--threads", type=int, default=2, help="torch CPU threads")

    features = sub.add_parser(
        "distill-features", help="train the feature-level drafter (EAGLE-style) on the model's own states")
    _add_teacher_flags(features)
    features.add_argument("--out", type=Path, default=None, help="weights file (default: <work-dir>/feature_drafter.safetensors)")
    features.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size")
    features.add_argument("--epochs", type=int, default=20)
    features.add_argument("--lr", type=float, default=1e-3)
    features.add_argument("--heldout", type=int, default=32, help="sequences kept out of training to measure agreement")
    features.add_argument("--init", type=Path, default=None,
                          help="continue training this drafter file (its draft vocabulary is kept) instead of a new one")
    features.add_argument("--steps", type=int, default=2, choices=(1, 2),
                          help="draft steps unrolled in training (2: also on the drafter's own predicted states)")
    features.add_argument("--teacher-format", choices=FORMAT_NAMES, default="float32",
                          help="weight format of the model that answers the prompts and gives the states (q4_1: the "
                               "default serving format's own states, on its compiled batched step, several times "
                               "faster; the drafter still trains in float32)")
    features.add_argument("--prompt-weight", type=float, default=0.2,
                          help="loss weight of prompt positions, which never root a draft")


def cmd_train_predictor(args: argparse.Namespace) -> int:
    from treeserve.ops.length_predictor import PredictorError
    from treeserve.training.predictor import run

    try:
        return int(run(args) or 0)
    except PredictorError as exc:  # a missing dataset or an unusable file: the message says what to run
        raise UserError(str(exc)) from None


class _StageProgress:
    """Prints ``stage done/total`` with elapsed time and an estimate of the stage's rest, at most every few seconds.

    The estimate uses the rate over the last ``window`` units, so work resumed from
    checkpoints (fast at first) does not skew it.
    """

    def __init__(self, every_s: float = 5.0, window: int = 20) -> None:
        self.every_s = every_s
        self.window = window
        self.stage = ""
        self.stage_started = 0.0
        self.last_print = 0.0
        self.recent: list[tuple[float, int]] = []

    def __call__(self, stage: str, done: int, total: int, figures: dict[str, float] | None = None) -> None:
        now = time.perf_counter()
        if stage != self.stage:
            self.stage, self.stage_started, self.last_print, self.recent = stage, now, 0.0, []
        self.recent = [*self.recent[-self.window :], (now, done)]
        if now - self.last_print < self.every_s and done < total:
            return
        self.last_print = now
        (t0, d0), (t1, d1) = self.recent[0], self.recent[-1]
        rate = (d1 - d0) / (t1 - t0) if t1 > t0 else 0.0
        eta = f", about {(total - done) / rate:.0f} s left" if rate > 0 and done < total else ""
        rate_text = f", {figures['tokens_per_s']:.0f} new tokens/s" if figures and "tokens_per_s" in figures else ""
        progress(f"{stage}: {done}/{total} ({now - self.stage_started:.0f} s{eta}{rate_text})")


def _distill_inputs(args: argparse.Namespace) -> tuple[str, Path]:
    """The model name and the work dir of `distill`/`distill-features`, after refusing missing
    prompt files and the evaluation sets."""
    from treeserve.models import resolve_cache_dir

    for path in args.prompts:
        if not path.is_file():
            raise UserError(f"no prompt file {path}")
        if path.stem in EVALUATION_SETS:
            raise UserError(f"{path} is an evaluation set: training on it would inflate the benchmark")
    name = model_name(args)
    return name, args.work_dir or resolve_cache_dir(args.cache_dir) / "distill" / Path(name).stem.lower()


def cmd_distill(args: argparse.Namespace) -> int:
    import torch

    from treeserve.models import load_model
    from treeserve.training.distill import BoostConfig, run_distillation
    from treeserve.training.teacher import read_prompts, select_prompts

    torch.set_num_threads(max(args.threads, 1))
    try:
        config = BoostConfig(num_ssms=args.num_ssms, num_layers=args.layers, ffn_dim=args.ffn_dim,
                             draft_vocab_size=args.draft_vocab, num_epochs=args.epochs,
                             num_boost_epochs=args.boost_epochs, lr=args.lr, boost_lr=args.lr / 2,
                             tokens_per_batch=args.tokens_per_batch, seed=args.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    name, work_dir = _distill_inputs(args)
    out = args.out or work_dir / "ssm.safetensors"
    if (work_dir / "teacher").exists():
        progress(f"resuming from the checkpoints in {work_dir}")
    loaded = load_model(name, dtype=torch.float32, cache_dir=args.cache_dir, progress=progress)
    model, tokenizer = loaded.model, loaded.tokenizer
    model.requires_grad_(False)
    prompts = select_prompts(tokenizer, read_prompts(args.prompts), max_prompts=args.max_prompts, seed=args.seed)
    progress(f"{len(prompts)} prompts, work dir {work_dir}")
    started = time.perf_counter()
    try:
        result = run_distillation(
            model, prompts, stop_ids=tokenizer.stop_ids, work_dir=work_dir, out_path=out, config=config,
            batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, num_heldout=args.heldout,
            progress=_StageProgress(),
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    agreement = ", ".join(f"{a:.3f}" for a in result.heldout_agreement)
    progress(
        f"wrote {result.path} ({result.path.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - started:.0f} s: "
        f"{result.num_train_sequences} training sequences ({result.num_train_tokens} positions), held-out top-1 "
        f"agreement of SSMs 1..k together: {agreement}; draft vocabulary covers {result.draft_vocab_coverage:.3f}"
    )
    print(result.path)
    return 0


def _teacher_starts(work_dir: Path, prompts: list[list[int]], batch_size: int) -> list[tuple[list[int], int]]:
    """Per prompt, the longest start on disk: `distill`'s teacher continuation when its shard
    exists (same prompt order and batch), else the prompt itself."""
    import torch

    starts: list[tuple[list[int], int]] = [(p, len(p)) for p in prompts]
    for index in range(math.ceil(len(prompts) / batch_size)):
        path = work_dir / "teacher" / f"shard_{index:05d}.pt"
        if not path.exists():
            break
        for offset, record in enumerate(torch.load(path, weights_only=True)["records"]):
            row = index * batch_size + offset
            ids = [int(t) for t in record["token_ids"]]
            if row < len(prompts) and ids[: len(prompts[row])] == prompts[row]:
                starts[row] = (ids, len(prompts[row]))
    return starts


def _drafter_metadata(path: Path) -> Any:
    """The training record stored in a feature-drafter file (what a fine-tune started from)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return json.loads((handle.metadata() or {}).get("metadata", "{}"))


def cmd_synth_prompts(args: argparse.Namespace) -> int:
    import torch

    from treeserve.models import load_model
    from treeserve.training.teacher import read_prompts, self_written_prompts

    torch.set_num_threads(max(args.threads, 1))
    name = model_name(args)
    loaded = load_model(name, weight_format=args.dtype, cache_dir=args.cache_dir, progress=progress)
    # The evaluation sets' questions are never written into a training set.
    data = Path(__file__).resolve().parent.parent / "bench" / "data"
    exclude = read_prompts([p for n in EVALUATION_SETS if (p := data / f"{n}.jsonl").is_file()])
    started = time.perf_counter()
    stage = _StageProgress()
    try:
        questions = self_written_prompts(loaded.model, loaded.tokenizer, args.num, temperature=args.temperature,
                                         max_tokens=args.max_tokens, batch_size=args.batch_size, seed=args.seed,
                                         exclude=exclude, progress=stage)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as file:
        for index, text in enumerate(questions):
            file.write(json.dumps({"id": f"selfwritten/{index}", "prompt": text}) + "\n")
    progress(f"wrote {len(questions)} questions to {args.out} in {time.perf_counter() - started:.0f} s")
    print(args.out)
    return 0


def cmd_distill_features(args: argparse.Namespace) -> int:
    import torch

    from treeserve.models import load_model
    from treeserve.training.teacher import read_prompts, select_prompts
    from treeserve.training.feature_distill import (
        TrainConfig,
        draft_vocabulary,
        evaluate_top1,
        generate_state_data,
        train_feature_drafter,
    )
    from treeserve.ops.feature_drafter import init_feature_drafter, load_feature_drafter, save_feature_drafter
    from treeserve.ops.ssm import ssm_config_for

    torch.set_num_threads(max(args.threads, 1))
    name, work_dir = _distill_inputs(args)
    try:
        config = TrainConfig(epochs=args.epochs, lr=args.lr, seed=args.seed, steps=args.steps,
                             prompt_weight=args.prompt_weight)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    out = args.out or work_dir / "feature_drafter.safetensors"
    loaded = load_model(name, dtype=torch.float32, cache_dir=args.cache_dir, progress=progress)
    model, tokenizer = loaded.model, loaded.tokenizer
    model.requires_grad_(False)
    prompts = select_prompts(tokenizer, read_prompts(args.prompts), max_prompts=args.max_prompts, seed=args.seed)
    if len(prompts) <= args.heldout:
        raise UserError(f"need more than --heldout {args.heldout} prompts, got {len(prompts)}")
    progress(f"{len(prompts)} prompts, work dir {work_dir}")
    started = time.perf_counter()
    stage = _StageProgress()
    starts = _teacher_starts(work_dir, prompts, args.batch_size)
    reused = sum(len(ids) > n for ids, n in starts)
    if reused:
        progress(f"continuing {reused} answers from `treeserve distill`'s teacher data")
    teacher, folder = model, work_dir / f"states_{args.max_new_tokens}"
    if args.teacher_format != "float32":
        teacher = load_model(name, weight_format=args.teacher_format, cache_dir=args.cache_dir, progress=progress).model
        folder = work_dir / f"states_{args.max_new_tokens}_{teacher.weight_format}"
    data = generate_state_data(teacher, starts, folder, batch_size=args.batch_size,
                               max_new_tokens=args.max_new_tokens, stop_ids=tokenizer.stop_ids,
                               progress=lambda s, d, t, f: stage(s, d, t, f))
    del teacher
    train, heldout = data[: -args.heldout], data[-args.heldout:]
    if args.init is not None:
        try:
            drafter = load_feature_drafter(model, args.init)  # keeps its draft vocabulary
        except (FileNotFoundError, ValueError) as exc:
            raise UserError(str(exc)) from None
    else:
        drafter = init_feature_drafter(
            model, ssm_config_for(model, num_layers=1, ffn_dim=model.config.ffn_dim, draft_vocab_size=args.draft_vocab),
            draft_vocabulary(train, args.draft_vocab))

    def report(stage_name: str, done: int, total: int, figures: dict[str, float]) -> None:
        stage(stage_name, done, total)
        if stage_name == "epoch":
            progress(f"epoch {done}/{total}: held-out top-1 agreement on generated positions "
                      f"{figures['held_out_top1']:.3f}")

    start = "" if args.init is None else f"_from_{args.init.stem}"
    checkpoint = work_dir / f"feature_ckpt_{args.draft_vocab}_{args.max_new_tokens}_{len(prompts)}{start}.pt"
    history = train_feature_drafter(drafter, train, config, held_out=heldout, checkpoint=checkpoint, progress=report)
    second = evaluate_top1(drafter, heldout, length=config.length, generated_only=True, step=2)
    save_feature_drafter(drafter, out, metadata={
        "train": config.__dict__, "num_train_sequences": len(train), "num_heldout_sequences": len(heldout),
        "num_train_positions": sum(d.token_ids.numel() for d in train),
        "num_train_generated_positions": sum(d.token_ids.numel() - d.prompt_len for d in train),
        "heldout_generated_top1": history, "heldout_generated_top1_step2": second,
        "prompts": [str(p) for p in args.prompts], "max_prompts": args.max_prompts,
        "max_new_tokens": args.max_new_tokens, "model": name,
        "init": None if args.init is None else {"path": str(args.init), "metadata": _drafter_metadata(args.init)},
    })
    progress(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - started:.0f} s; "
              f"held-out top-1 agreement on generated positions {history[-1]:.3f} (second draft step {second:.3f})")
    print(out)
    return 0


__all__ = ["add_train_parsers", "cmd_distill", "cmd_distill_features", "cmd_synth_prompts", "cmd_train_predictor"]
