"""``treeserve generate``: one completion of PROMPT, through an embedded server (every actor) or,
with ``--in-process``, on a model in this process (debugging, measuring the actors' cost).

The two are one path with the model run in two places. Both build the same ``generate`` body
(:func:`generate_body`) and the same speculators in the same order (:func:`generate_speculators`,
from :mod:`treeserve.actors.speculator_factory`). In-process, the body then goes through what
the server runs on it, in the server's order: the gateway's ``parse_generate`` (validation) and
``prompt_ids_for`` (the one chat-template path), ``scheduler_body`` (the tokens and sampling
params the scheduler and verifier get), then the factory's speculators; the figures come out
by the scheduler's rule (:func:`treeserve.actors.acceptance.mean_tokens_per_step`).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from treeserve.ops.speculation_modes import SpeculationMode
from treeserve.actors.speculator_factory import SpeculatorSpec, default_speculators, parse_speculator
from treeserve.cli_common import (
    UserError,
    add_expansion_flag,
    add_format_flag,
    add_model_flags,
    model_name,
    parse_expansion,
    progress,
)

GENERATE_ROWS = 1
"""The embedded server's KV-cache rows: one request."""

CONTEXT_ROOM = 2048
"""The prompt tokens the embedded server's context holds beside ``--max-tokens`` by default."""
MIN_CONTEXT, MAX_DEFAULT_SLOTS = 512, 8192
"""The default context's bounds: at least 512 tokens, and KV rows of at most 8192 slots (the
context and a speculation tree's slots; ``--context`` may go past it)."""


def served_context(args: argparse.Namespace, tree_slots: int) -> int:
    """The tokens the embedded server's one request may hold, prompt and answer: ``--context``, or
    ``--max-tokens`` + :data:`CONTEXT_ROOM`, at least :data:`MIN_CONTEXT`, in rows of at most
    :data:`MAX_DEFAULT_SLOTS` with ``tree_slots`` more for a tree."""
    if args.context is not None:
        return int(args.context)
    return min(MAX_DEFAULT_SLOTS - tree_slots, max(MIN_CONTEXT, args.max_tokens + CONTEXT_ROOM))

COMPILE_MIN_TOKENS = 512
"""``--compile auto`` uses the compiled decode step from this many ``--max-tokens`` on. Loading
a saved step takes 3-4 s (imports and unpickling) and saves about 11 ms a step on the default
model (q4_1: 13 ms compiled against 24 ms eager, 2 cores), so it pays after about 400 steps."""


def add_generate_parser(sub: Any) -> None:
    """The ``generate`` subcommand's flags."""
    gen = sub.add_parser("generate", help="print one completion of PROMPT")
    gen.add_argument("prompt", help="the user message (wrapped in the model's chat template unless --raw)")
    add_model_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--context", type=int, default=None, metavar="N",
                     help=f"tokens the request may hold, prompt and answer (default: --max-tokens + {CONTEXT_ROOM}, "
                          f"at least {MIN_CONTEXT}, in KV rows of at most {MAX_DEFAULT_SLOTS} slots with a tree's; "
                          "the model's own context bounds it; --in-process: the model's context)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, metavar="TEXT",
                     help="end the completion before the first appearance of TEXT (repeatable)")
    gen.add_argument("--speculate", choices=[m.value for m in SpeculationMode], default=SpeculationMode.TREE.value)
    add_format_flag(gen)
    add_expansion_flag(gen)
    gen.add_argument(
        "--draft-layers", type=int, default=0,
        help="add a self-drafting speculator = the model's first K layers (default 0: the server's default "
             "speculators only)",
    )
    gen.add_argument(
        "--compile", choices=("auto", "yes", "no"), default="auto",
        help=f"use the compiled decode step (its first compile takes minutes, later starts load it in seconds); "
             f"auto (default): only from --max-tokens {COMPILE_MIN_TOKENS} on, below that the eager step finishes first",
    )
    gen.add_argument("--device", default="cpu",
                     help="cpu or cuda[:N]: where the verifier and the speculator run (on CUDA: float32 or bfloat16, "
                          "auto is bfloat16)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    gen.add_argument(
        "--in-process", action="store_true",
        help="run the model in this process instead of through the actor system (debugging, benchmarks)",
    )


def generate_body(args: argparse.Namespace) -> dict[str, Any]:
    """The wire ``generate`` body of the flags (``transport/PROTOCOL.md``): what the server path
    sends and the in-process path parses."""
    body: dict[str, Any] = {"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}
    body.update(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, speculate=args.speculate)
    if args.top_k is not None:
        body["top_k"] = args.top_k
    if args.seed is not None:
        body["seed"] = args.seed
    if args.stop:
        body["stop"] = list(args.stop)
    return body


def generate_speculators(args: argparse.Namespace) -> tuple[SpeculatorSpec, ...]:
    """The server's default speculators for the model and format (see
    :func:`~treeserve.actors.speculator_factory.default_speculators`), then ``--draft-layers``'
    self-drafter; none for ``--speculate none``."""
    if args.speculate == SpeculationMode.NONE:
        return ()
    specs = default_speculators(model_name(args), args.dtype, args.device)
    if args.draft_layers:
        try:
            specs += (parse_speculator(f"self:{args.draft_layers}", parse_expansion(args.expansion)),)
        except ValueError as exc:
            raise UserError(f"--draft-layers: {exc}") from None
    return specs


def compile_decode(args: argparse.Namespace) -> bool:
    """Whether this run uses the compiled decode step (``--compile``, see :data:`COMPILE_MIN_TOKENS`)."""
    if args.compile == "auto":
        return bool(args.max_tokens >= COMPILE_MIN_TOKENS)
    return bool(args.compile == "yes")


def check_body(body: dict[str, Any], *, vocab_size: int, context_length: int) -> Any:
    """The gateway's validation of ``body`` (a ``GenerateRequest``); its refusal as a :class:`UserError`."""
    import dataclasses

    from treeserve.actors.gateway.config import GatewayConfig
    from treeserve.actors.gateway.request import InvalidRequest, parse_generate

    # The limit a served gateway applies (the server keeps GatewayConfig's default).
    max_prompt_chars = next(f.default for f in dataclasses.fields(GatewayConfig) if f.name == "max_prompt_chars")
    try:
        return parse_generate(body, vocab_size=vocab_size, context_length=context_length,
                              max_prompt_chars=int(max_prompt_chars))
    except InvalidRequest as exc:
        raise UserError(str(exc)) from None


async def _generate_via_server(args: argparse.Namespace, body: dict[str, Any],
                               specs: tuple[SpeculatorSpec, ...]) -> dict[str, Any]:
    import tempfile

    from treeserve.cli_serve import server_config
    from treeserve.client import Client, ServerError
    from treeserve.server import Server, ServerConfig
    from treeserve.server_devices import DeviceUnavailableError

    with tempfile.TemporaryDirectory(prefix="treeserve-") as tmp:
        config = server_config(
            model=model_name(args),
            cache_dir=None if args.cache_dir is None else str(args.cache_dir),
            bind=f"ipc://{tmp}/gateway.sock",
            dtype=args.dtype,
            device=args.device,
            num_rows=GENERATE_ROWS,
            row_capacity=served_context(args, ServerConfig.max_tree_nodes) + ServerConfig.max_tree_nodes,
            speculators=tuple(s.to_wire() for s in specs),
            compile_decode=compile_decode(args),
        )
        # Fail fast on bad values, before any process starts (the body holds no token ids, so
        # the vocabulary is not consulted).
        check_body(body, vocab_size=1, context_length=config.row_capacity - config.max_tree_nodes)
        fields = dict(body)
        prompt = fields.pop("prompt") if "prompt" in fields else fields.pop("messages")
        speculate = fields.pop("speculate")
        try:
            async with Server(config, progress=progress) as server, Client(server.endpoint) as client:
                started = time.perf_counter()
                completion = await client.generate(prompt, speculate=speculate, **fields)
                elapsed = time.perf_counter() - started
                weight_format = server.model_info.get("weight_format", config.dtype)
        except (ServerError, DeviceUnavailableError) as exc:
            hint = ""
            if isinstance(exc, ServerError) and exc.code == "invalid_request" and "context" in str(exc):
                hint = " (--context N raises generate's context)"
            raise UserError(f"{exc}{hint}") from None
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
        "dtype": weight_format,
    }


def _generate_in_process(args: argparse.Namespace, body: dict[str, Any],
                         specs: tuple[SpeculatorSpec, ...]) -> dict[str, Any]:
    from treeserve.actors.acceptance import mean_tokens_per_step
    from treeserve.actors.gateway.request import InvalidRequest
    from treeserve.actors.gateway.stream import prompt_ids_for, scheduler_body
    from treeserve.actors.speculator_factory import load_drafter, make_speculators
    from treeserve.models import load_model
    from treeserve.ops.speculative import generate_incremental, generate_speculative
    from treeserve.ops.speculation_modes import SpeculationMode

    if args.device == "cpu":
        loaded = load_model(model_name(args), weight_format=args.dtype, cache_dir=args.cache_dir, progress=progress,
                            compile_decode=compile_decode(args))
        model = loaded.model
    else:  # formatted where it runs, as the verifier does (no compiled step off the CPU)
        from treeserve.ops.loaders.load import prepare_for_serving

        loaded = load_model(model_name(args), cache_dir=args.cache_dir, progress=progress)
        try:
            model = prepare_for_serving(loaded.model.to(args.device), loaded.source, args.dtype, cache_dir=args.cache_dir,
                                        compile_decode=False)
        except (ValueError, RuntimeError) as exc:  # a CPU-only format; no such device
            raise UserError(f"--device {args.device}: {exc}") from None
    tokenizer = loaded.tokenizer
    context = model.config.max_seq_len
    req = check_body(body, vocab_size=model.config.vocab_size, context_length=context)
    try:
        prompt_ids = prompt_ids_for(tokenizer, req, context)
    except InvalidRequest as exc:
        raise UserError(str(exc)) from None
    params = scheduler_body(req, prompt_ids, tokenizer.stop_ids).params
    if len(prompt_ids) + params.max_new_tokens > context:
        raise UserError(f"prompt ({len(prompt_ids)} tokens) + --max-tokens {params.max_new_tokens} exceeds the "
                        f"context of {context} tokens")
    try:
        drafters = [load_drafter(spec, model, weight_format=args.dtype, device=args.device,
                                 cache_dir=None if args.cache_dir is None else str(args.cache_dir)) for spec in specs]
    except ValueError as exc:
        raise UserError(str(exc)) from None
    speculators = make_speculators(specs, drafters, model.config.vocab_size)
    started = time.perf_counter()
    if req.speculate is SpeculationMode.NONE:
        result = generate_incremental(model, prompt_ids, params)
        accepted_per_step: list[int] = [0] * result.num_steps  # one token per step, no drafts
    else:
        result = generate_speculative(model, speculators, prompt_ids, params, req.speculate)
        accepted_per_step = list(result.accepted_per_step)
    elapsed = time.perf_counter() - started
    return {
        "text": tokenizer.decode([t for t in result.token_ids if t not in params.stop_token_ids]),
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason.value,
        "matched_stop": None,
        "num_prompt_tokens": len(prompt_ids),
        "num_steps": result.num_steps,
        "mean_accepted_per_step": mean_tokens_per_step(accepted_per_step),
        "tokens_per_s": len(result.token_ids) / elapsed if elapsed > 0 else 0.0,
        "ttft_s": None,
        "dtype": model.weight_format,
    }


def cmd_generate(args: argparse.Namespace) -> int:
    """Print one completion (or, with ``--json``, one JSON object with its stats)."""
    if not args.prompt:
        raise UserError("the prompt is empty")
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.context is not None and args.context < 2:
        raise UserError(f"--context must be at least 2 (a prompt token and an answer's), got {args.context}")
    if args.stop and args.in_process:
        raise UserError("--stop needs the server path (stop strings are matched by the gateway); drop --in-process")
    body = generate_body(args)
    specs = generate_speculators(args)
    if args.in_process:
        out = _generate_in_process(args, body, specs)
    else:
        import uvloop

        out = uvloop.run(_generate_via_server(args, body, specs))
    out.update(speculate=args.speculate)
    if args.json:
        print(json.dumps(out))
    else:
        print(out["text"])
        progress(f"{len(out['token_ids'])} tokens, {out['tokens_per_s']:.1f} tok/s, {out['num_steps']} steps, "
                 f"{out['mean_accepted_per_step']:.2f} tokens/step")
    return 0


__all__ = ["add_generate_parser", "check_body", "cmd_generate", "compile_decode", "generate_body", "generate_speculators"]
