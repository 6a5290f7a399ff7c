"""Forward-pass benchmark of the default model per weight format, against llama.cpp, in one run.

Measures on this machine, medians of repeats:

* the roofline: a STREAM-like copy (bytes read + written per second over a 1 GiB buffer),
  measured per format in turn with the one-row step over five rounds; each format's fraction
  of the roofline is the median of the rounds' step-over-roofline ratios (the bandwidth a
  shared host leaves us moves within minutes: a copy at the start of one run read 55.8 GB/s,
  the rounds after it 33.4), and the top-level figure is the formats' median;
* per format (float32, bfloat16, int8, q4_1): the 1-token decode step at batch 1 on a
  256-token cache (with the compiled decode step where the format has one), forwards over
  4, 16 and 64 tree nodes as ratios to that step, batched decode steps of 16 and 64 rows
  (tokens/s), the weight bytes one token reads and so the effective GB/s and fraction of the
  roofline, the load and compile (or compiled-step load) times, and the greedy agreement with
  float32: teacher-forced top-1 over float32's own greedy answers to chat prompts of the
  shipped prompt sets (``bench/data``, fetched by ``bench/data/fetch.py``);
* end to end at batch 1 without speculation (prefill of a 128-token prompt plus 128 greedy
  tokens): treeserve in the default format (``auto``: for a GGUF, as the file stores it)
  against llama.cpp (llama-cpp-python, 2 threads, ``reset()`` before each timed run, prefill
  and decode timed apart) on the original GGUF;
* with llama.cpp, each format's greedy agreement with llama.cpp on the same file: teacher-forced
  top-1 over llama.cpp's own greedy answers to the same chat prompts.

    python bench/forward.py --json [--model FILE.gguf] [--formats auto,bfloat16] [--repeats 7] [--no-llama-cpp]

``--contend`` measures instead how each format's one-row step slows beside a CPU-bound competitor
process (``--competitor spin``: one Python thread in a busy loop, which takes one of the cores;
``torch2``: a 2-thread float32 matmul loop, another 2-thread job), quiet and then contended,
and llama.cpp's decode tokens/s on the same file under the same competitor:
``{"contention": {FORMAT: {"quiet_step_ms", "contended_step_ms", "ratio"}, ..., "llama_cpp":
{"quiet_tok_s", "contended_tok_s", "ratio"}}}``.

llama-cpp-python is a bench-only extra, never a dependency (build flags for this CPU in
``bench/RESULTS.md``). JSON shape: ``{"roofline_gb_s", "default_format", "kernel_paths": {KERNEL:
PATH} (the instruction-set path each CPU kernel took), "formats": {NAME:
{"decode_tok_s", "tree_ratio": {"4","16","64"}, "batch_tok_s": {"16","64"}, "weight_gb_s",
"roofline_fraction", "agreement_with_float32", "load_s", "compile_s"}}, "e2e": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from treeserve.models import DEFAULT_MODEL, load_model
from treeserve.ops.formats import AUTO_FORMAT
from treeserve.ops.formats import DEFAULT_FORMAT as DEFAULT_WEIGHT_FORMAT
from treeserve.ops.formats import WeightFormat, weight_bytes_per_token
from treeserve.ops.model import Transformer
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental
from treeserve.ops.tree_attention import tree_mask_from_parents

DEFAULT_FORMAT = DEFAULT_WEIGHT_FORMAT.value
KNOWN_FORMATS = (AUTO_FORMAT, *(f.value for f in WeightFormat))
CACHE_LENGTH = 256
TREE_SIZES = (4, 16, 64)
BATCH_SIZES = (16, 64)
E2E_PROMPT_TOKENS = 128
E2E_NEW_TOKENS = 128
DATA_DIR = Path(__file__).parent / "data"


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 2, min_seconds: float = 1.0) -> float:
    """Median wall seconds of ``fn()`` over at least ``repeats`` runs, and over as many more as
    fill ``min_seconds`` (seven runs of a 7 ms step are 50 ms of a noisy machine), after
    ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    while len(times) < repeats or sum(times) < min_seconds:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def roofline_gb_s(repeats: int) -> float:
    """STREAM-like copy bandwidth: (bytes read + bytes written) / s over a 1 GiB float32 buffer."""
    src = torch.ones(1 << 28)  # touched, so no page is the shared zero page
    dst = torch.zeros_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


STEP_ROUNDS = 5


def step_against_roofline(model: Transformer, repeats: int) -> tuple[float, float, float]:
    """The one-row step and the copy roofline measured in turn over ``STEP_ROUNDS`` rounds:
    (the rounds' median step in seconds, their median roofline in GB/s, and the median over
    rounds of the step's weight bandwidth over that round's roofline). On a shared host the
    memory bandwidth left to this machine moves by 1.5x within minutes (31.7 and 50.6 GB/s at
    the starts of two runs here), so a roofline taken minutes before the step misreads it."""
    bytes_per_token = weight_bytes_per_token(model)
    steps, rooflines, fractions = [], [], []
    for _ in range(STEP_ROUNDS):
        roofline = roofline_gb_s(3)
        one = step_seconds(model, 1, repeats)
        steps.append(one)
        rooflines.append(roofline)
        fractions.append(bytes_per_token / one / 1e9 / roofline)
    return statistics.median(steps), statistics.median(rooflines), statistics.median(fractions)


def binary_tree(num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tree_mask (1, n, n), depth (n,)) of a complete binary token tree."""
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, num_nodes)])
    mask = tree_mask_from_parents(parents)
    return mask[None], mask.sum(-1) - 1


def filled_cache(model: Transformer, rows: int, length: int, extra: int) -> Any:
    """A cache of ``rows`` rows holding ``length`` committed random tokens each."""
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(rows, length + extra)
    model.hidden_states(torch.randint(0, model.config.vocab_size, (rows, length), generator=gen), cache)
    for row in range(rows):
        cache.commit(row, range(length))
    return cache


def step_seconds(model: Transformer, rows: int, repeats: int) -> float:
    """Median time of one decode step (one token per row) on ``CACHE_LENGTH`` committed tokens."""
    cache = filled_cache(model, rows, CACHE_LENGTH, 4)
    tokens = torch.full((rows, 1), 5)

    def step() -> None:
        model(tokens, cache)
        for row in range(rows):
            cache.truncate(row, CACHE_LENGTH)

    return median_seconds(step, repeats)


def tree_seconds(model: Transformer, num_nodes: int, repeats: int) -> float:
    """Median time of one forward over a ``num_nodes``-node binary tree on the same cache."""
    cache = filled_cache(model, 1, CACHE_LENGTH, num_nodes)
    mask, depth = binary_tree(num_nodes)
    tokens = torch.randint(0, model.config.vocab_size, (1, num_nodes), generator=torch.Generator().manual_seed(1))
    positions = (CACHE_LENGTH + depth)[None]
    return median_seconds(lambda: model(tokens, cache, tree_mask=mask, positions=positions), repeats)


AGREEMENT_SETS = ("gsm8k", "humaneval", "mtbench")
"""The prompt sets the agreement is measured on (the first prompts of each), whatever else is
fetched into ``bench/data``: the figure must not change with the other sets present."""


def chat_prompts(tokenizer: Any, limit: int) -> list[list[int]]:
    """Chat-templated prompt ids of the first prompts of each of :data:`AGREEMENT_SETS`."""
    prompts: list[list[int]] = []
    for name in AGREEMENT_SETS:
        path = DATA_DIR / f"{name}.jsonl"
        if not path.exists():
            continue
        lines = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
        for line in lines[: max(1, limit // 3)]:
            text = json.loads(line)["prompt"]
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            prompts.append(tokenizer.encode(chat)[:512])
    if not prompts:
        raise FileNotFoundError(f"no prompt sets in {DATA_DIR}; fetch them with: python bench/data/fetch.py mtbench humaneval gsm8k")
    return prompts[:limit]


def greedy_answers(model: Transformer, prompts: list[list[int]], num_tokens: int, stop_ids: tuple[int, ...]) -> list[list[int]]:
    """float32's greedy answers (the reference the formats are compared on)."""
    params = SamplingParams(max_new_tokens=num_tokens, stop_token_ids=stop_ids)
    return [generate_incremental(model, prompt, params).token_ids for prompt in prompts]


def agreement(model: Transformer, prompts: list[list[int]], answers: list[list[int]]) -> float:
    """Fraction of answer positions where ``model``'s argmax, fed float32's answer so far
    (teacher forcing), is float32's next token."""
    agree = total = 0
    for prompt, answer in zip(prompts, answers):
        if not answer:
            continue
        seq = torch.tensor([prompt + answer[:-1]])
        cache = model.new_cache(1, seq.shape[1])
        logits = model(seq, cache)[0, len(prompt) - 1:]  # (len(answer), V)
        predicted = logits.argmax(-1).tolist()
        agree += sum(int(p == a) for p, a in zip(predicted, answer))
        total += len(answer)
    return agree / total if total else float("nan")


def e2e_treeserve(model: Transformer, prompt: list[int], repeats: int) -> float:
    """Tokens/s of prefill + ``E2E_NEW_TOKENS`` greedy tokens (no stop tokens), median."""
    params = SamplingParams(max_new_tokens=E2E_NEW_TOKENS)
    seconds = median_seconds(lambda: generate_incremental(model, prompt, params), repeats, warmup=1)
    return E2E_NEW_TOKENS / seconds


def llama_cpp_last_logits(llm: Any) -> Any:
    """The logits of the last token llama.cpp evaluated (llama-cpp-python keeps ``scores`` only
    with ``logits_all``; read without it, ``scores`` is all zeros and every argmax is token 0)."""
    import numpy as np

    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def e2e_llama_cpp(gguf: Path, prompt: list[int], threads: int, repeats: int) -> dict[str, Any]:
    """llama.cpp on the GGUF: e2e tokens/s, decode-only tokens/s and prefill ms (medians)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False, seed=0)
    rows = []
    for index in range(repeats + 1):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefilled = time.perf_counter()
        for _ in range(E2E_NEW_TOKENS):
            token = int(llama_cpp_last_logits(llm).argmax())  # greedy
            llm.eval([token])
        done = time.perf_counter()
        if index:  # the first run warms up
            rows.append((prefilled - start, done - prefilled))
    prefill = statistics.median(r[0] for r in rows)
    decode = statistics.median(r[1] for r in rows)
    e2e = statistics.median(E2E_NEW_TOKENS / (r[0] + r[1]) for r in rows)
    return {"llama_cpp_tok_s": e2e, "llama_cpp_decode_tok_s": E2E_NEW_TOKENS / decode,
            "llama_cpp_prefill_ms": prefill * 1e3, "llama_cpp_version": llama_cpp.__version__}


def llama_cpp_answers(gguf: Path, prompts: list[list[int]], num_tokens: int, stop_ids: tuple[int, ...],
                      threads: int) -> list[list[int]]:
    """llama.cpp's greedy answers to ``prompts`` on the GGUF (up to ``num_tokens`` or a stop)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False, seed=0)
    answers = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        answer: list[int] = []
        while len(answer) < num_tokens:
            token = int(llama_cpp_last_logits(llm).argmax())
            answer.append(token)
            if token in stop_ids:
                break
            llm.eval([token])
        answers.append(answer)
    return answers


def measure_format(name: str, args: argparse.Namespace, prompts: list[list[int]],
                   answers: list[list[int]], peer_answers: list[list[int]] | None) -> tuple[dict[str, Any], Transformer]:
    started = time.perf_counter()
    loaded = load_model(args.model, weight_format=name)
    model = loaded.model
    step = model.decode_step
    compile_s = 0.0 if step is None else (step.compile_seconds or step.load_seconds or 0.0)  # type: ignore[attr-defined]
    load_s = time.perf_counter() - started - compile_s
    one, roofline, fraction = step_against_roofline(model, args.repeats)
    bytes_per_token = weight_bytes_per_token(model)
    entry: dict[str, Any] = {
        "decode_step_ms": round(one * 1e3, 2),
        "decode_tok_s": round(1 / one, 1),
        "tree_ratio": {str(n): round(tree_seconds(model, n, args.repeats) / one, 2) for n in TREE_SIZES},
        "batch_tok_s": {str(b): round(b / step_seconds(model, b, max(3, args.repeats // 2)), 1) for b in BATCH_SIZES},
        "weight_mb_per_token": round(bytes_per_token / 1e6, 1),
        "weight_gb_s": round(bytes_per_token / one / 1e9, 2),
        "roofline_gb_s": round(roofline, 1),  # measured between this format's steps
        "roofline_fraction": round(fraction, 3),
        "agreement_with_float32": round(agreement(model, prompts, answers), 4),
        "agreement_with_llama_cpp": None if peer_answers is None else round(agreement(model, prompts, peer_answers), 4),
        "weight_format": model.weight_format,
        "load_s": round(load_s, 2),
        "compile_s": round(compile_s, 2),
        "compiled_decode_step": step is not None,
        # The q4_1 format on the AVX2 kernels runs its blocks in one C++ op (nothing compiled).
        "fused_decode_step": bool(getattr(step, "is_fused", False)),
    }
    entry["batch_speedup_64"] = round(entry["batch_tok_s"]["64"] / entry["decode_tok_s"], 1)
    return entry, model


def kernel_paths() -> dict[str, str]:
    """The instruction-set path each CPU kernel takes in this process (``TREESERVE_ISA`` applied)."""
    from treeserve.ops.kernels import codes8, cpp_build, decode_layers, dense_cpu, q4_amx, q8_amx, tree_attention_cpu

    wide = "AVX-512" if cpp_build.simd16_flags() == cpp_build.AVX512 else "AVX2"
    q4 = ("int8 rows, AVX2 (q_avx2.cpp)" if q4_amx.avx2() else "int8 rows, AVX512-VNNI (q4_amx.cpp)"
          if q4_amx.int8_rows() else "bf16, AVX-512 and AMX tiles (q4_amx.cpp)" if q4_amx.tiles()
          else "bf16, AVX-512 (q4_amx.cpp)" if q4_amx.available() else "torch's int4 kernel")
    c8 = ("int8 rows, AVX2 (q_avx2.cpp)" if codes8.avx2() else "int8 rows, AVX512-VNNI (q4_amx.cpp)"
          if codes8.available() else "none: q4_1 or bfloat16")
    head = ("int16 rows, AVX2 (q_avx2.cpp)" if q8_amx.int16_rows() else "AVX-512 (q8_amx.cpp)"
            if q8_amx.available() else "bfloat16")
    return {
        "isa_cap": cpp_build.isa_cap(),
        "q4_products": q4,
        "codes8_products": c8,
        "int_head": head,
        "one_op": f"decode_layers.cpp, {wide} build" if decode_layers.available() else "none: the compiled step",
        "attention": f"tree_attention_cpu.cpp, {wide} build" if tree_attention_cpu.available() else "torch's",
        "float32_products": f"dense_cpu.cpp, {wide} build" if dense_cpu.available() else "F.linear",
    }


COMPETITORS = {
    "spin": "while True: pass",
    "torch2": "import torch\ntorch.set_num_threads(2)\na = torch.randn(512, 512)\nwhile True: a @ a",
}
"""CPU-bound competitor processes for ``--contend``: one busy core, or a 2-thread job."""


class Competitor:
    """A competitor process for the duration of a ``with`` block (given a second to start)."""

    def __init__(self, kind: str) -> None:
        self.code = COMPETITORS[kind]
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Competitor:
        self.process = subprocess.Popen([sys.executable, "-c", self.code])
        time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()


def contention(args: argparse.Namespace, formats: list[str]) -> dict[str, Any]:
    """Each format's one-row step quiet and beside the competitor; llama.cpp's decode likewise."""
    out: dict[str, Any] = {}
    loaded = None
    for name in formats:
        loaded = load_model(args.model, weight_format=name)
        model = loaded.model
        quiet = step_seconds(model, 1, args.repeats)
        with Competitor(args.competitor):
            busy = step_seconds(model, 1, args.repeats)
        out[name] = {"quiet_step_ms": round(quiet * 1e3, 2), "contended_step_ms": round(busy * 1e3, 2),
                     "ratio": round(busy / quiet, 2)}
        print(f"[forward] contention {name}: {json.dumps(out[name])}", file=sys.stderr, flush=True)
        del model
    if loaded is not None and not args.no_llama_cpp and loaded.source.suffix == ".gguf":
        source = loaded.source
        gen = torch.Generator().manual_seed(2)
        prompt = torch.randint(100, loaded.config.vocab_size, (E2E_PROMPT_TOKENS,), generator=gen).tolist()
        try:
            quiet_tok = e2e_llama_cpp(source, prompt, args.threads, 3)["llama_cpp_decode_tok_s"]
            with Competitor(args.competitor):
                busy_tok = e2e_llama_cpp(source, prompt, args.threads, 3)["llama_cpp_decode_tok_s"]
            out["llama_cpp"] = {"quiet_tok_s": round(quiet_tok, 1), "contended_tok_s": round(busy_tok, 1),
                                "ratio": round(quiet_tok / busy_tok, 2)}
        except ImportError as exc:
            out["llama_cpp"] = {"skipped": str(exc)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name, .gguf path or model folder")
    parser.add_argument("--formats", default=",".join(KNOWN_FORMATS), help="comma-separated formats")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=9, help="chat prompts for the agreement with float32")
    parser.add_argument("--answer-tokens", type=int, default=64, help="float32 greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--contend", action="store_true", help="only the steps quiet and beside a competitor process")
    parser.add_argument("--competitor", choices=sorted(COMPETITORS), default="spin", help="with --contend")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in KNOWN_FORMATS]
    if unknown:
        parser.error(f"unknown formats {unknown}; known: {', '.join(KNOWN_FORMATS)}")
    if args.contend:
        found = {"model": args.model, "threads": torch.get_num_threads(), "competitor": args.competitor,
                 "kernel_paths": kernel_paths(),
                 "contention": contention(args, formats)}
        print(json.dumps(found, indent=1))
        return

    reference = load_model(args.model)  # float32, unformatted: the exact reference
    prompts = chat_prompts(reference.tokenizer, args.prompts)
    answers = greedy_answers(reference.model, prompts, args.answer_tokens, tuple(reference.tokenizer.stop_ids))
    gen = torch.Generator().manual_seed(2)
    e2e_prompt = torch.randint(100, reference.config.vocab_size, (E2E_PROMPT_TOKENS,), generator=gen).tolist()
    gguf = reference.source if reference.source.suffix == ".gguf" else None
    peer_answers = None
    if not args.no_llama_cpp and gguf is not None:
        try:
            peer_answers = llama_cpp_answers(gguf, prompts, args.answer_tokens, tuple(reference.tokenizer.stop_ids),
                                             args.threads)
        except ImportError:
            pass
    del reference

    result: dict[str, Any] = {
        "model": args.model, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cache_length": CACHE_LENGTH, "tree_shape": "complete binary tree",
        "roofline_gb_s": None, "default_format": DEFAULT_FORMAT, "kernel_paths": kernel_paths(), "formats": {},
        "agreement_prompts": len(prompts), "agreement_tokens": sum(len(a) for a in answers),
    }
    e2e: dict[str, Any] = {"prompt_tokens": E2E_PROMPT_TOKENS, "new_tokens": E2E_NEW_TOKENS, "format": DEFAULT_FORMAT,
                           "treeserve_tok_s": None, "llama_cpp_tok_s": None, "llama_cpp_decode_tok_s": None,
                           "llama_cpp_version": None}
    for name in formats:
        entry, model = measure_format(name, args, prompts, answers, peer_answers)
        result["formats"][name] = entry
        if name in (DEFAULT_FORMAT, AUTO_FORMAT) and e2e["treeserve_tok_s"] is None:
            e2e["format"] = entry["weight_format"]
            e2e["treeserve_tok_s"] = round(e2e_treeserve(model, e2e_prompt, max(3, args.repeats // 2)), 1)
        del model
        print(f"[forward] {name}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    if not args.no_llama_cpp and gguf is not None:
        try:
            e2e.update({k: (round(v, 1) if isinstance(v, float) else v)
                        for k, v in e2e_llama_cpp(gguf, e2e_prompt, args.threads, max(3, args.repeats // 2)).items()})
        except ImportError as exc:
            e2e["llama_cpp_skipped"] = str(exc)
    # The formats' rooflines, each measured in turn with its step: their median.
    result["roofline_gb_s"] = round(statistics.median(e["roofline_gb_s"] for e in result["formats"].values()), 1)
    result["e2e"] = e2e
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"roofline (copy) {result['roofline_gb_s']} GB/s; default format {DEFAULT_FORMAT}")
    for name, entry in result["formats"].items():
        print(f"{name:>9}: {entry['decode_tok_s']:6.1f} tok/s  {entry['weight_gb_s']:5.1f} GB/s "
              f"({entry['roofline_fraction']:.2f} of roofline)  tree 4/16/64 {entry['tree_ratio']}  "
              f"batch 16/64 {entry['batch_tok_s']} tok/s  agreement {entry['agreement_with_float32']}")
    print(f"e2e: {e2e}")


if __name__ == "__main__":
    main()
