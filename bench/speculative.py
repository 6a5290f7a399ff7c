"""Speculative-decoding benchmark: treeserve's loops against HF transformers (and llama.cpp).

One run of the default model (or ``--model``) at batch 1 on this CPU, on the same chat-templated
prompt ids, for every mode and temperature:

- ``incremental``: :func:`treeserve.ops.speculative.generate_incremental` (the reference);
- ``chain``: sequence-based speculation (:attr:`SpeculationMode.CHAIN`) with one speculator
  (the feature drafter when its weights exist, else the first distilled SSM, else n-gram);
  ``chain:<kind>`` picks the kind;
- ``tree:ngram``, ``tree:suffix`` (``treeserve.ops.suffix``: the suffixes of every earlier request
  of the run, as one server process would hold them; see below), ``tree:feature`` (the
  EAGLE-style drafter of ``treeserve.ops.feature_drafter``),
  ``tree:distilled`` (with ``--ssm PATH``, a ``treeserve distill`` file; its SSMs are merged)
  and ``tree:merged`` (every available speculator merged);
- peers on the same weights and dtype: ``hf-generate`` (``generate()``), ``hf-prompt-lookup``
  (``prompt_lookup_num_tokens=10``), and, when ``llama_cpp`` is importable, ``llama-cpp`` and
  ``llama-cpp-lookup`` (llama-cpp-python's speculative decoding with its prompt-lookup draft,
  ``LlamaPromptLookupDecoding(num_pred_tokens=10)``: the model-free drafter it ships).

Prompts are the outer loop: each prompt runs every mode (order rotated per prompt) before the
next, after one untimed warm-up generation per mode, so slow drift on a shared machine hits
all modes alike. Per (mode, temperature) it reports the median over prompts of per-prompt
tokens/s (end to end, prefill included), total tokens / total seconds, the mean tokens per
verify step in SpecInfer's convention (accepted drafts + the LLM's own token, pooled over all
steps; 1.0 for incremental, null for peers), the ratio of the median to incremental's, and at
temperature 0 the fraction of prompts whose tokens equal incremental's (treeserve's
speculation is lossless, so anything below 1.0 for a treeserve mode is a bug or float noise).

The suffix drafter's index is what a server would hold after answering the run's earlier
prompts at the same temperature, never the same prompt's earlier answers: each temperature has
its own index, the warm-up a throwaway one. ``--repeat K`` sends the prompt list K times over
(repetitive traffic: an agent loop or a templated client asking again); then the index holds
the earlier rounds' answers to the same prompts, which is the point.

    python bench/speculative.py --dataset mtbench --limit 10 --json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from treeserve.actors.speculator_factory import (
    NGRAM_OPTIONS,
    SpeculatorKind,
    SpeculatorSpec,
    load_drafter,
    make_speculator,
    parse_speculator,
)
from treeserve.ops.drafting import Speculator
from treeserve.ops.formats import FORMAT_NAMES
from treeserve.ops.model import Transformer
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental, generate_speculative
from treeserve.ops.speculation_modes import SpeculationMode
from treeserve.ops.suffix import SuffixIndex, SuffixSpeculator

logger = logging.getLogger("bench.speculative")

DATA_DIR = Path(__file__).resolve().parent / "data"
TREESERVE_MODES = ("incremental", "chain", "tree:ngram", "tree:suffix", "tree:feature", "tree:distilled", "tree:merged")
PEER_MODES = ("hf-generate", "hf-prompt-lookup", "llama-cpp", "llama-cpp-lookup")
ALL_MODES = TREESERVE_MODES + PEER_MODES
HF_PROMPT_LOOKUP_TOKENS = 10
LLAMA_CPP_LOOKUP_TOKENS = 10  # as HF_PROMPT_LOOKUP_TOKENS


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: its dataset id and its text."""

    id: str
    text: str


@dataclass(frozen=True)
class Generated:
    """What one mode produced for one prompt. ``num_steps``/``accepted_per_step`` are None for peers."""

    token_ids: list[int]
    num_steps: int | None = None
    accepted_per_step: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Mode:
    """A named way to generate: ``run(prompt_ids, params) -> Generated``; ``is_treeserve`` for our loops."""

    name: str
    run: Callable[[list[int], SamplingParams], Generated]
    is_treeserve: bool
    detail: str = ""
    history: Callable[[str], None] | None = None  # switches what a suffix drafter has seen (a key per stream)


@dataclass(frozen=True)
class Measurement:
    """One timed generation of ``mode`` on prompt ``prompt_id`` at ``temperature``."""

    mode: str
    temperature: float
    prompt_id: str
    generated: Generated
    seconds: float


@dataclass
class Available:
    """Speculators by kind (``ngram``, ``distilled``) and the modes skipped with the reason."""

    speculators: dict[str, list[Speculator]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def load_prompts(dataset: str | None = None, prompts_file: str | Path | None = None, limit: int | None = None,
                 data_dir: Path = DATA_DIR) -> list[Prompt]:
    """Prompts of ``data_dir/<dataset>.jsonl`` (``id``/``prompt`` objects) or of a one-per-line file.

    Lines are split on "\\n" only (some sets hold U+2028 inside prompts); blank lines are skipped.
    """
    if (dataset is None) == (prompts_file is None):
        raise ValueError("give exactly one of --dataset NAME or --prompts FILE")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    prompts: list[Prompt] = []
    if dataset is not None:
        path = data_dir / f"{dataset}.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found; fetch it with: python bench/data/fetch.py {dataset}")
        for line in path.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                record = json.loads(line)
                prompts.append(Prompt(str(record["id"]), str(record["prompt"])))
    else:
        lines = Path(prompts_file).read_text(encoding="utf-8").split("\n")  # type: ignore[arg-type]
        prompts = [Prompt(str(i), line) for i, line in enumerate(lines) if line.strip()]
    return prompts[:limit] if limit is not None else prompts


def _from_factory(spec: SpeculatorSpec, model: Transformer) -> Speculator:
    """The speculator the server would run for ``spec`` (:mod:`treeserve.actors.speculator_factory`)."""
    return make_speculator(spec, load_drafter(spec, model), model.config.vocab_size)


def load_speculators(model: Transformer, *, ngram_options: dict[str, int] | None = None,
                     with_distilled: bool = True, ssm_path: str | Path | None = None,
                     feature_path: str | Path | None = None) -> Available:
    """The n-gram and suffix speculators (the server's options), the feature drafter of
    ``feature_path`` (default: the shipped one) when it fits ``model``, and the distilled SSMs
    of ``ssm_path`` (none is shipped).

    Any failure of the feature or distilled load is logged and recorded as a skip, never raised.
    """
    available = Available()
    options = NGRAM_OPTIONS if ngram_options is None else ngram_options
    available.speculators["ngram"] = [_from_factory(SpeculatorSpec(SpeculatorKind.NGRAM, dict(options)), model)]
    available.speculators["suffix"] = [_from_factory(parse_speculator(SpeculatorKind.SUFFIX), model)]
    try:
        available.speculators["feature"] = [_from_factory(parse_speculator(f"{SpeculatorKind.FEATURE.value}:{feature_path or ''}"), model)]
    except (FileNotFoundError, ValueError) as exc:
        logger.warning("feature drafter unavailable, skipping tree:feature (%s)", exc)
        available.skipped["tree:feature"] = f"{type(exc).__name__}: {exc}"
    if not with_distilled:
        return available
    if ssm_path is None:
        available.skipped["tree:distilled"] = "no --ssm file (none is shipped; `treeserve distill` writes one)"
        return available
    try:
        # Every SSM of the file, merged (a distilled:PATH spec picks one of them).
        from treeserve.ops.ssm import load_distilled_speculators

        ssms = list(load_distilled_speculators(model, ssm_path))
        if not ssms:
            raise FileNotFoundError("load_distilled_speculators returned no speculators")
    except Exception as exc:  # noqa: BLE001 - any failure just skips the distilled modes
        reason = f"{type(exc).__name__}: {exc}"
        logger.warning("distilled speculators unavailable, skipping tree:distilled (%s)", reason)
        available.skipped["tree:distilled"] = reason
        return available
    available.speculators["distilled"] = ssms
    return available


def _from_result(result: Any) -> Generated:
    return Generated(list(result.token_ids), int(result.num_steps), tuple(result.accepted_per_step))


def _incremental_run(model: Transformer) -> Callable[[list[int], SamplingParams], Generated]:
    def run(ids: list[int], params: SamplingParams) -> Generated:
        return _from_result(generate_incremental(model, ids, params))

    return run


def _speculative_run(model: Transformer, speculators: list[Speculator], mode: SpeculationMode,
                     max_tree_nodes: int) -> Callable[[list[int], SamplingParams], Generated]:
    def run(ids: list[int], params: SamplingParams) -> Generated:
        return _from_result(generate_speculative(model, speculators, ids, params, mode, max_tree_nodes=max_tree_nodes))

    return run


def _suffix_history(speculators: Sequence[Speculator]) -> Callable[[str], None] | None:
    """For modes with suffix drafters: ``switch(key)`` points them at the index of stream
    ``key`` (one per temperature, one for the warm-up), made empty on first use."""
    suffix = [s for s in speculators if isinstance(s, SuffixSpeculator)]
    if not suffix:
        return None
    indexes: dict[str, SuffixIndex] = {}

    def switch(key: str) -> None:
        for speculator in suffix:
            template = speculator.index
            speculator.index = indexes.setdefault(key, SuffixIndex(
                capacity=template.capacity, min_ngram=template.min_ngram, max_ngram=template.max_ngram,
                max_matches=template.max_matches))

    return switch


def treeserve_modes(model: Transformer, names: Sequence[str], available: Available, *,
                    max_tree_nodes: int = 64, merge: Sequence[str] | None = None) -> list[Mode]:
    """Our modes among ``names``; ones whose speculators are missing are skipped (recorded in ``available``)."""
    specs = available.speculators
    modes: list[Mode] = []
    for name in names:
        if name == "incremental":
            modes.append(Mode(name, _incremental_run(model), True))
            continue
        kind, _, which = name.partition(":")
        spec_mode = SpeculationMode.CHAIN if kind == "chain" else SpeculationMode.TREE
        if kind == "chain":
            which = which or next(k for k in ("feature", "distilled", "ngram") if k in specs)
            chosen = specs.get(which, [])[:1]
        elif kind == "tree" and which == "merged":
            # In --merge order: at a node, stochastic verification tries speculators in order.
            kinds = list(specs) if merge is None else [k for k in merge if k in specs]
            chosen = [s for k in kinds for s in specs[k]]
        elif kind == "tree":
            chosen = specs.get(which, [])
        else:
            continue
        if not chosen:
            available.skipped.setdefault(name, f"no {which!r} speculator available")
            continue
        detail = "+".join(type(s).__name__ for s in chosen)
        modes.append(Mode(name, _speculative_run(model, chosen, spec_mode, max_tree_nodes), True, detail,
                          _suffix_history(chosen)))
    return modes


def load_hf_model(source: Path, dtype: torch.dtype) -> Any:
    """HF ``AutoModelForCausalLM`` from a ``.gguf`` file (dequantized by transformers) or an HF folder."""
    import transformers
    from transformers import AutoModelForCausalLM

    hf_logging: Any = transformers.utils.logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    dtype_kwarg = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}  # renamed in 4.56
    model: Any
    if source.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, **dtype_kwarg)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source), **dtype_kwarg)
    return model.to(dtype).eval()


def hf_mode(hf_model: Any, name: str, *, prompt_lookup_num_tokens: int | None = None) -> Mode:
    """``generate()`` of ``hf_model``: greedy at temperature 0, else full-distribution sampling."""

    def run(ids: list[int], params: SamplingParams) -> Generated:
        input_ids = torch.tensor([ids])
        kwargs: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "min_new_tokens": 0,
            "attention_mask": torch.ones_like(input_ids),
            "eos_token_id": list(params.stop_token_ids) or None,
            "pad_token_id": params.stop_token_ids[0] if params.stop_token_ids else 0,
            "repetition_penalty": 1.0,
        }
        if params.is_greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_k=0, top_p=1.0)
            if params.seed is not None:
                torch.manual_seed(params.seed)
        if prompt_lookup_num_tokens is not None:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
        with torch.no_grad():
            out = hf_model.generate(input_ids, **kwargs)  # (1, prompt + new)
        return Generated(out[0, len(ids):].tolist())

    return Mode(name, run, False, f"prompt_lookup_num_tokens={prompt_lookup_num_tokens}" if prompt_lookup_num_tokens else "")


def llama_cpp_mode(gguf: Path, *, threads: int, n_ctx: int, seed: int, lookup: bool = False) -> Mode:
    """llama-cpp-python on the GGUF itself (its own quantized kernels); ``reset()`` before each run.
    ``lookup``: with its prompt-lookup draft model (``llama-cpp-lookup``), whose drafts its
    ``generate`` verifies in one batch per step, sampling each position in turn (so lossless)."""
    from llama_cpp import Llama

    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=LLAMA_CPP_LOOKUP_TOKENS)
    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, seed=seed,
                draft_model=draft, verbose=False)

    def run(ids: list[int], params: SamplingParams) -> Generated:
        llm.reset()
        if params.seed is not None and hasattr(llm, "set_seed"):
            llm.set_seed(params.seed)
        out: list[int] = []
        # temp 0 is llama.cpp's greedy sampler; otherwise top_k=0/top_p=1/min_p=0 keep the full distribution.
        for token in llm.generate(ids, temp=params.temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                                  repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if params.is_stop(int(token)) or len(out) >= params.max_new_tokens:
                break
        return Generated(out)

    if lookup:
        return Mode("llama-cpp-lookup", run, False, f"Q4_1 GGUF, prompt lookup, num_pred_tokens={LLAMA_CPP_LOOKUP_TOKENS}")
    return Mode("llama-cpp", run, False, "Q4_1 GGUF, llama.cpp kernels")


def _params(temperature: float, seed: int, stop_ids: Sequence[int], max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, stop_token_ids=tuple(stop_ids), max_new_tokens=max_tokens)


def run_benchmark(modes: Sequence[Mode], prompts: Sequence[tuple[str, list[int]]], temperatures: Sequence[float], *,
                  max_tokens: int, stop_ids: Sequence[int], seed: int = 0, warmup_tokens: int = 32,
                  progress: Callable[[str], None] | None = None) -> list[Measurement]:
    """Time every mode on every (prompt, temperature), prompts outermost, after one warm-up per mode.

    The mode order rotates by one per prompt so no mode always runs right after another. The
    sampling seed is ``seed + prompt index``, the same for every mode.
    """
    say = progress or (lambda _line: None)
    if not prompts or not modes:
        return []
    warm_params = _params(temperatures[0], seed, stop_ids, min(max_tokens, warmup_tokens))
    for mode in modes:
        if mode.history is not None:
            mode.history("warm-up")
        started = time.perf_counter()
        mode.run(list(prompts[0][1]), warm_params)
        say(f"warm-up {mode.name}: {time.perf_counter() - started:.1f} s")
    measurements: list[Measurement] = []
    for index, (prompt_id, ids) in enumerate(prompts):
        order = list(modes[index % len(modes):]) + list(modes[:index % len(modes)])
        for temperature in temperatures:
            params = _params(temperature, seed + index, stop_ids, max_tokens)
            for mode in order:
                if mode.history is not None:
                    mode.history(f"T={temperature:g}")
                started = time.perf_counter()
                generated = mode.run(list(ids), params)
                seconds = time.perf_counter() - started
                measurements.append(Measurement(mode.name, temperature, prompt_id, generated, seconds))
                steps = f", {len(generated.token_ids) / generated.num_steps:.2f} tok/step" if generated.num_steps else ""
                say(f"[{index + 1}/{len(prompts)}] id={prompt_id} T={temperature:g} {mode.name}: "
                    f"{len(generated.token_ids)} tok in {seconds:.2f} s "
                    f"({len(generated.token_ids) / seconds:.1f} tok/s{steps})")
    return measurements


def summarize(measurements: Sequence[Measurement], modes: Sequence[Mode]) -> list[dict[str, Any]]:
    """One result dict per (mode, temperature) in run order; see the module docstring for the fields."""
    by_key: dict[tuple[str, float], list[Measurement]] = {}
    for m in measurements:
        by_key.setdefault((m.mode, m.temperature), []).append(m)
    medians = {key: statistics.median(len(m.generated.token_ids) / m.seconds for m in group)
               for key, group in by_key.items()}
    detail = {mode.name: mode for mode in modes}
    results: list[dict[str, Any]] = []
    for (name, temperature), group in by_key.items():
        num_tokens = sum(len(m.generated.token_ids) for m in group)
        total_s = sum(m.seconds for m in group)
        mode = detail[name]
        accepted: float | None = None
        tokens_per_step: float | None = None
        if mode.is_treeserve:
            steps = sum(m.generated.num_steps or 0 for m in group)
            drafts = [a for m in group for a in (m.generated.accepted_per_step or ())]
            # SpecInfer convention: accepted drafts + the verifier's own token per step.
            accepted = 1.0 + sum(drafts) / len(drafts) if drafts else 1.0
            tokens_per_step = num_tokens / steps if steps else None
        base = medians.get(("incremental", temperature))
        matches: float | None = None
        if temperature == 0 and ("incremental", temperature) in by_key:
            reference = {m.prompt_id: m.generated.token_ids for m in by_key[("incremental", temperature)]}
            matches = sum(m.generated.token_ids == reference.get(m.prompt_id) for m in group) / len(group)
        results.append({
            "mode": name,
            "temperature": temperature,
            "tokens_per_s": medians[(name, temperature)],
            "tokens_per_s_total": num_tokens / total_s if total_s > 0 else None,
            "mean_accepted_per_step": accepted,
            "mean_tokens_per_step": tokens_per_step,
            "ratio_to_incremental": medians[(name, temperature)] / base if base else None,
            "greedy_matches_incremental": matches,
            "num_prompts": len(group),
            "num_tokens": num_tokens,
            "total_s": total_s,
            "is_treeserve": mode.is_treeserve,
            "detail": mode.detail,
            "per_prompt": [{"id": m.prompt_id, "num_tokens": len(m.generated.token_ids), "seconds": m.seconds}
                           for m in group],
        })
    return results


def _gguf_or_folder(model_name: str) -> Path:
    from treeserve.models import REGISTRY, pull

    return pull(model_name) if model_name in REGISTRY else Path(model_name).expanduser()


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", help="reads bench/data/NAME.jsonl (made by bench/data/fetch.py)")
    source.add_argument("--prompts", help="a text file with one prompt per line")
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=None,
                        help=f"subset of {' '.join(ALL_MODES)} (also chain:ngram, chain:distilled); default: all available")
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.8])
    parser.add_argument("--format", "--dtype", dest="dtype", choices=FORMAT_NAMES, default="float32",
                        help="weight format of treeserve's model (the peers run bfloat16 unless float32)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for every mode (default: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="registry name, .gguf path or HF folder (default: SmolLM2-135M)")
    parser.add_argument("--max-tree-nodes", type=int, default=64, help="token tree budget per verify step")
    parser.add_argument("--merge", nargs="+", default=None, metavar="KIND",
                        help="speculator kinds tree:merged merges, in the order tried at a node (default: every available kind)")
    parser.add_argument("--ssm", default=None, metavar="PATH",
                        help="distilled SSMs (a `treeserve distill` file) for the distilled modes; none is shipped")
    parser.add_argument("--feature-drafter", default=None, metavar="PATH",
                        help="feature drafter weights for tree:feature and the merge (default: the shipped one)")
    parser.add_argument("--warmup-tokens", type=int, default=32, help="max tokens of each mode's warm-up run")
    parser.add_argument("--repeat", type=int, default=1, metavar="K",
                        help="send the prompt list K times over (repetitive traffic; round r > 1 ids end in #r)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _peer_modes(requested: Sequence[str], source: Path, dtype: torch.dtype, *, threads: int, n_ctx: int, seed: int,
                available: Available) -> list[Mode]:
    """The requested peers that load; a failing one is recorded in ``available.skipped``, never raised."""
    modes: list[Mode] = []
    hf_wanted = [m for m in ("hf-generate", "hf-prompt-lookup") if m in requested]
    if hf_wanted:
        try:
            _say(f"loading HF transformers model from {source}")
            hf_model = load_hf_model(source, dtype)
        except Exception as exc:  # noqa: BLE001 - a missing peer skips its modes
            available.skipped.update({name: f"{type(exc).__name__}: {exc}" for name in hf_wanted})
        else:
            if "hf-generate" in hf_wanted:
                modes.append(hf_mode(hf_model, "hf-generate"))
            if "hf-prompt-lookup" in hf_wanted:
                modes.append(hf_mode(hf_model, "hf-prompt-lookup", prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS))
    for name in ("llama-cpp", "llama-cpp-lookup"):
        if name in requested:
            try:
                modes.append(llama_cpp_mode(source, threads=threads, n_ctx=n_ctx, seed=seed, lookup=name != "llama-cpp"))
            except Exception as exc:  # noqa: BLE001 - llama_cpp is optional and never installed by us
                available.skipped[name] = f"{type(exc).__name__}: {exc}"
    return modes


def _print_table(results: Sequence[dict[str, Any]]) -> None:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(f"{'mode':<18}{'T':>5}{'tok/s (median)':>16}{'tok/s (total)':>15}{'acc/step':>10}{'vs incr':>9}{'greedy=':>9}")
    for r in results:
        print(f"{r['mode']:<18}{r['temperature']:>5g}{r['tokens_per_s']:>16.2f}{fmt(r['tokens_per_s_total'], '.2f'):>15}"
              f"{fmt(r['mean_accepted_per_step'], '.2f'):>10}{fmt(r['ratio_to_incremental'], '.2f'):>9}"
              f"{fmt(r['greedy_matches_incremental'], '.2f'):>9}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    requested = list(args.modes or ALL_MODES)
    unknown = [m for m in requested if m not in ALL_MODES and not m.startswith(("chain:", "tree:"))]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {' '.join(ALL_MODES)}")
    if args.max_tokens < 1 or (args.threads is not None and args.threads < 1) or min(args.temperatures) < 0:
        parser.error("--max-tokens and --threads must be >= 1 and --temperatures >= 0")
    # WARNING: treeserve.models already reports its progress through the callback below.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    from treeserve.models import DEFAULT_MODEL, load_model

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)  # the HF peers run in this process, under the same setting
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    model_name = args.model or DEFAULT_MODEL
    # The served format (its kernels and compiled decode step); the HF peers run in ``dtype``.
    loaded = load_model(model_name, weight_format=args.dtype, progress=lambda p: _say(f"{p.stage}: {p.message}"))
    model, tokenizer = loaded.model, loaded.tokenizer
    prompts: list[tuple[str, list[int]]] = []
    for prompt in load_prompts(args.dataset, args.prompts, args.limit):
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt.text}])
        if len(ids) + args.max_tokens > model.config.max_seq_len:
            _say(f"skipping prompt {prompt.id}: {len(ids)} tokens + {args.max_tokens} exceed the context")
            continue
        prompts.append((prompt.id, ids))
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    prompts = [(prompt_id if round_ == 0 else f"{prompt_id}#{round_ + 1}", ids)
               for round_ in range(args.repeat) for prompt_id, ids in prompts]

    available = load_speculators(model, with_distilled=any("distilled" in m or m == "tree:merged" for m in requested),
                                 ssm_path=args.ssm, feature_path=args.feature_drafter)
    if args.modes is None and len(available.speculators) < 2:
        requested.remove("tree:merged")
        available.skipped["tree:merged"] = "only one speculator kind available (same as tree:ngram)"
    modes = treeserve_modes(model, [m for m in requested if m not in PEER_MODES], available,
                            max_tree_nodes=args.max_tree_nodes, merge=args.merge)
    source = _gguf_or_folder(model_name)
    n_ctx = max((len(ids) for _, ids in prompts), default=0) + args.max_tokens + 16
    modes += _peer_modes(requested, source, dtype, threads=threads, n_ctx=n_ctx, seed=args.seed, available=available)
    for name, reason in available.skipped.items():
        _say(f"skipped {name}: {reason}")

    measurements = run_benchmark(modes, prompts, args.temperatures, max_tokens=args.max_tokens,
                                 stop_ids=tokenizer.stop_ids, seed=args.seed, warmup_tokens=args.warmup_tokens,
                                 progress=_say)
    results = summarize(measurements, modes)
    try:
        import transformers

        hf_version: str | None = transformers.__version__
    except ImportError:
        hf_version = None
    report = {
        "dataset": args.dataset or str(args.prompts),
        "results": results,
        "config": {
            "model": model_name, "dtype": args.dtype, "threads": threads, "batch_size": 1,
            "max_tokens": args.max_tokens, "temperatures": args.temperatures, "seed": args.seed,
            "limit": args.limit, "num_prompts": len(prompts), "modes": [m.name for m in modes],
            "skipped": available.skipped, "ngram": dict(NGRAM_OPTIONS), "max_tree_nodes": args.max_tree_nodes,
            "merge": args.merge,
            "hf_prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS, "warmup_tokens": args.warmup_tokens,
            "peer_weights": str(source), "torch": torch.__version__, "transformers": hf_version,
            "cpu_count": os.cpu_count(), "order": "prompts outermost, mode order rotated per prompt",
        },
    }
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
