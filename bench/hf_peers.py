"""HF transformers' own fast paths, timed as peers of treeserve (issue 41): batch 1, greedy.

Three peers on one ``AutoModelForCausalLM`` loaded from a Hugging Face folder (``config.json``,
safetensors, tokenizer files), each prompt chat-templated when the tokenizer has a template:

- ``eager``: plain ``generate()`` (dynamic cache, no compilation);
- ``static_compile``: ``generate()`` with a static cache and ``torch.compile`` — the path the
  installed transformers documents ("Static kv-cache and torch.compile" in its inference
  optimization guide). From transformers 4.47 on, ``generate(cache_implementation="static")``
  compiles the model's forward itself for the decode steps (prefill stays eager) under a
  ``CompileConfig`` (here ``fullgraph=True, mode="reduce-overhead"``, retried with
  ``fullgraph=False`` if the full graph fails); the static cache is sized once for the longest
  prompt, so no call re-creates it and recompiles. Older versions get the guide's manual
  ``model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``.
  Generate compiles only on accelerators unless told otherwise: on CPU, ``compile=True`` sets
  ``CompileConfig._compile_all_devices`` (transformers' testing switch) so the path is the same;
  ``compile=False`` times the static cache alone;
- ``prompt_lookup``: assisted generation with the prompt-lookup candidate generator
  (``prompt_lookup_num_tokens``), eager, dynamic cache. Greedy assisted decoding is lossless, so
  its tokens should equal ``eager``'s up to float noise.

Each peer runs one untimed warm-up generation on the first prompt (``warmup_s``; for
``static_compile`` that is the compilation, also reported as ``compile_s``), then every prompt
``repeats`` times. ``tok_s`` is generated tokens (EOS included when it stops generation, the prompt
never) over generation wall time; on CUDA the device is synchronized before each clock read.
A peer that fails is recorded as ``{"error": ...}`` and the others still run.

    python bench/hf_peers.py MODEL_DIR --device cpu --max-new 8 --no-compile --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

PROMPT_LOOKUP_TOKENS = 10  # as bench/speculative.py's HF_PROMPT_LOOKUP_TOKENS
DEFAULT_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is, then list three operations it supports and their costs.",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
]
PEERS = ("eager", "prompt_lookup", "static_compile")


def _versions() -> dict[str, str]:
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__}


def _transformers_at_least(major: int, minor: int) -> bool:
    import transformers

    found = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    return found >= (major, minor)


def load_peer(model_dir: str | Path, device: str, dtype: str) -> tuple[Any, Any]:
    """(model in eval mode on ``device`` in ``dtype``, tokenizer) from an HF folder."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_logging: Any = transformers.utils.logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch_dtype = getattr(torch, dtype)
    dtype_kwarg = {"dtype" if _transformers_at_least(4, 56) else "torch_dtype": torch_dtype}  # renamed in 4.56
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), **dtype_kwarg)
    model = model.to(device=device, dtype=torch_dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return model, tokenizer


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """``prompt`` as one user turn of the chat template (generation prompt added, BOS once) when
    the tokenizer has a template, else the plain text with the tokenizer's special tokens."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(prompt).input_ids)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    bos = tokenizer.bos_token_id
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _generate(model: Any, ids: list[int], device: str, kwargs: dict[str, Any]) -> tuple[list[int], float]:
    """(generated ids, wall seconds) of one greedy ``generate()`` call."""
    input_ids = torch.tensor([ids], device=device)
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    _sync(device)
    seconds = time.perf_counter() - start
    return out[0, len(ids):].tolist(), seconds


def _common_kwargs(model: Any, tokenizer: Any, max_new_tokens: int) -> dict[str, Any]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = eos[0] if isinstance(eos, list) else eos
    return {"max_new_tokens": max_new_tokens, "min_new_tokens": 0, "do_sample": False, "num_beams": 1,
            "repetition_penalty": 1.0, "eos_token_id": eos, "pad_token_id": pad if pad is not None else 0}


def _static_compile_kwargs(model: Any, *, compile: bool, fullgraph: bool, max_cache_len: int,
                           device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``generate`` kwargs, what was asked for) of the static-cache peer."""
    kwargs: dict[str, Any] = {"cache_implementation": "static"}
    info: dict[str, Any] = {"cache_implementation": "static", "compile": compile, "max_cache_len": max_cache_len}
    import transformers

    generation_config_class: Any = transformers.GenerationConfig
    known = generation_config_class()
    if hasattr(known, "max_cache_len"):
        kwargs["max_cache_len"] = max_cache_len  # one cache (and one graph) for every prompt
    compile_config_class: Any = getattr(transformers, "CompileConfig", None)  # None before 4.47
    if not compile:
        if hasattr(known, "disable_compile"):
            kwargs["disable_compile"] = True
        return kwargs, info
    if compile_config_class is None:  # the guide's manual compile
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=fullgraph)
        info.update(how="model.forward = torch.compile(...)", mode="reduce-overhead", fullgraph=fullgraph)
        return kwargs, info
    config = compile_config_class(fullgraph=fullgraph, mode="reduce-overhead")
    if not device.startswith("cuda"):
        config._compile_all_devices = True  # generate compiles on accelerators only by default
    kwargs["compile_config"] = config
    info.update(how="generate(compile_config=CompileConfig(...))", mode="reduce-overhead", fullgraph=fullgraph)
    return kwargs, info


def _time_peer(model: Any, tokenizer: Any, all_ids: list[list[int]], device: str, kwargs: dict[str, Any], *,
               repeats: int, log: Callable[[str], None], name: str) -> dict[str, Any]:
    """One warm-up generation, then every prompt ``repeats`` times: the peer's timings."""
    _, warmup_s = _generate(model, all_ids[0], device, kwargs)
    log(f"{name}: warm-up {warmup_s:.2f} s")
    per_prompt: list[dict[str, Any]] = []
    total_tokens, total_seconds = 0, 0.0
    for index, ids in enumerate(all_ids):
        runs = [_generate(model, ids, device, kwargs) for _ in range(repeats)]
        tokens = runs[0][0]
        seconds = [s for _, s in runs]
        total_tokens += sum(len(t) for t, _ in runs)
        total_seconds += sum(seconds)
        per_prompt.append({"prompt_tokens": len(ids), "new_tokens": len(tokens),
                           "seconds": seconds, "tok_s": sum(len(t) for t, _ in runs) / sum(seconds),
                           "deterministic": all(t == tokens for t, _ in runs), "token_ids": tokens,
                           "text": tokenizer.decode(tokens, skip_special_tokens=True)})
        log(f"{name}: prompt {index}: {len(tokens)} tokens, {per_prompt[-1]['tok_s']:.1f} tok/s")
    return {"tok_s": total_tokens / total_seconds if total_seconds > 0 else 0.0, "tokens": total_tokens,
            "seconds": total_seconds, "warmup_s": warmup_s, "per_prompt": per_prompt}


def _run_static_compile(model: Any, tokenizer: Any, all_ids: list[list[int]], device: str,
                        common: dict[str, Any], *, compile: bool, max_new_tokens: int, repeats: int,
                        log: Callable[[str], None]) -> dict[str, Any]:
    """The static-cache peer; a failed full-graph compile is retried once with graph breaks allowed."""
    max_cache_len = max(len(ids) for ids in all_ids) + max_new_tokens
    first_error = None
    for fullgraph in (True, False) if compile else (False,):
        kwargs, info = _static_compile_kwargs(model, compile=compile, fullgraph=fullgraph,
                                              max_cache_len=max_cache_len, device=device)
        try:
            result = _time_peer(model, tokenizer, all_ids, device, {**common, **kwargs}, repeats=repeats, log=log,
                                name="static_compile")
        except Exception as exc:  # noqa: BLE001 - a graph break under fullgraph: retry without
            if not (compile and fullgraph):
                raise
            first_error = f"{type(exc).__name__}: {exc}"[:2000]
            log(f"static_compile: fullgraph=True failed ({first_error[:200]}); retrying with fullgraph=False")
            torch._dynamo.reset()
            for attr in ("_compiled_call", "_last_compile_config"):
                if attr in model.__dict__:
                    delattr(model, attr)
            continue
        result["compile_s"] = result["warmup_s"]
        result["compiled"] = bool(compile and ("_compiled_call" in model.__dict__ or "compile_config" not in kwargs))
        result.update(info)
        if first_error is not None:
            result["fullgraph_error"] = first_error
        return result
    raise AssertionError("unreachable")


def hf_peer_timings(model_dir: str | Path, prompts: list[str], *, max_new_tokens: int, device: str,
                    dtype: str = "bfloat16", compile: bool = True, repeats: int = 1,
                    log: Callable[[str], None] = print, peers: Sequence[str] = PEERS,
                    token_ids: list[list[int]] | None = None) -> dict[str, Any]:
    """Greedy batch-1 timings of HF transformers' peers (``eager``, ``prompt_lookup``,
    ``static_compile``; see the module docstring) on ``prompts``, JSON-able. Each peer's entry
    holds ``tok_s``, ``tokens``, ``seconds``, ``warmup_s`` and ``per_prompt`` (with each prompt's
    generated ``token_ids`` and ``text``), or ``{"error": ...}`` if it failed. ``peers``: which
    run (in :data:`PEERS` order); ``token_ids``: the prompts' ids as given (another server's, so
    both run the very same tokens) instead of the tokenizer's."""
    if not prompts:
        raise ValueError("no prompts")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    result: dict[str, Any] = {**_versions(), "device": device, "dtype": dtype, "max_new_tokens": max_new_tokens,
                              "repeats": repeats, "compile": compile, "model_dir": str(model_dir)}
    if device.startswith("cuda"):
        result["device_name"] = torch.cuda.get_device_name(torch.device(device))
    log(f"loading {model_dir} ({dtype} on {device}); transformers {result['transformers']}, torch {result['torch']}")
    model, tokenizer = load_peer(model_dir, device, dtype)
    all_ids = [prompt_ids(tokenizer, p) for p in prompts] if token_ids is None else [list(ids) for ids in token_ids]
    common = _common_kwargs(model, tokenizer, max_new_tokens)
    result["chat_template"] = bool(getattr(tokenizer, "chat_template", None))
    result["eos_token_id"] = common["eos_token_id"]
    result["prompts"] = [{"prompt": p, "prompt_ids": ids} for p, ids in zip(prompts, all_ids, strict=True)]
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "eager": lambda: _time_peer(model, tokenizer, all_ids, device, common, repeats=repeats, log=log,
                                    name="eager"),
        "prompt_lookup": lambda: {
            **_time_peer(model, tokenizer, all_ids, device,
                         {**common, "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}, repeats=repeats, log=log,
                         name="prompt_lookup"),
            "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS},
        "static_compile": lambda: _run_static_compile(model, tokenizer, all_ids, device, common, compile=compile,
                                                      max_new_tokens=max_new_tokens, repeats=repeats, log=log),
    }
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peers {sorted(unknown)}; known: {PEERS}")
    for name in (p for p in PEERS if p in peers):  # static_compile last: its compiled graphs and static cache stay on the model
        try:
            result[name] = runners[name]()
            log(f"{name}: {result[name]['tok_s']:.1f} tok/s over {result[name]['tokens']} tokens")
        except Exception as exc:  # noqa: BLE001 - one peer's failure is a result, not the end of the run
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            log(f"{name}: failed: {result[name]['error'][:300]}")
    return result


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="a Hugging Face-format folder (config.json, safetensors, tokenizer)")
    parser.add_argument("--prompts", default=None,
                        help="a text file with one prompt per line (default: three built in)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--max-new", type=int, default=128, help="max new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each prompt per peer")
    parser.add_argument("--no-compile", action="store_true", help="static cache without torch.compile")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    return parser


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the peers and print their timings; exit status 1 if every peer failed."""
    args = build_parser().parse_args(argv)
    prompts = DEFAULT_PROMPTS
    if args.prompts is not None:
        prompts = [line.strip() for line in Path(args.prompts).read_text(encoding="utf-8").splitlines() if line.strip()]
    result = hf_peer_timings(args.model_dir, prompts, max_new_tokens=args.max_new, device=args.device,
                             dtype=args.dtype, compile=not args.no_compile, repeats=args.repeats, log=_say)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"transformers {result['transformers']}, torch {result['torch']}, {args.device}, {args.dtype}")
        for name in PEERS:
            peer = result[name]
            line = (f"{peer['tok_s']:.1f} tok/s ({peer['tokens']} tokens in {peer['seconds']:.2f} s, "
                    f"warm-up {peer['warmup_s']:.2f} s)") if "error" not in peer else f"error: {peer['error']}"
            print(f"{name:>15}: {line}")
    return 1 if all("error" in result[name] for name in PEERS) else 0


if __name__ == "__main__":
    sys.exit(main())
