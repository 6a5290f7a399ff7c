"""Issue 41's figures, the ``speed`` step of ``bench/gpu_check.py``: the GPU path with CUDA
graphs against itself eager, against HF transformers' fast paths, with tree speculation, and
with many streams through the actors. Prepared and tested on the CPU (``--dry-run``: toy
sizes, the graphs' CPU twin, the CUDA tree kernel emulated); the device run only measures.

On the lent GPU, in bfloat16 (the GPU's serving format) unless said otherwise:

* ``decode_tok_s``: batch-1 greedy incremental decoding of the prompts, ``eager`` (every op
  launched from Python) and ``graphs`` (the model's steps replayed from CUDA graphs captured
  over the cache it runs in, :mod:`treeserve.ops.graph_step`); ``graph_capture_s``;
* ``hf_static_compile_tok_s`` and ``hf_prompt_lookup_tok_s``: HF transformers' ``generate()``
  with a static cache and ``torch.compile``, and its assisted generation by prompt lookup,
  on the very same prompt ids (``bench/hf_peers.py``; the model exported to HF's layout and
  checked to give the same logits);
* ``tree_vs_step``: a captured verify of a 16- and a 64-node tree over a 256-token prefix,
  over a captured decode step;
* ``speculative``: tree speculation (the server's default speculators for the model) at
  batch 1 with graphs, against graph-captured incremental decoding, and in float32 whether
  each prompt's tokens equal incremental decoding's;
* ``batch_tok_s``: total tokens/s of 16 and 64 concurrent streams through the actors (a
  :class:`treeserve.Server` on the GPU, ``speculate="none"``), beside one stream
  (``batch_tok_s["1"]``); and ``batch_inprocess_tok_s``, the same row counts stepped by the
  batched verifier in this process (what the actors add shows as the difference).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))  # its siblings: gpu_check's timer, hf_peers
from gpu_check import time_ms  # noqa: E402

FALLBACK_PROMPTS = ("What is the capital of France? Answer in one sentence, then name three sights there.",
                    "Write a Python function that reverses a list, and explain it.",
                    "List three colours of the rainbow, one per line.")


def mtbench_prompts(limit: int) -> tuple[list[str], str]:
    """The first ``limit`` MT-Bench first turns (``bench/data/mtbench.jsonl``, or its copy
    carried to the GPU machine under ``.gpu/``), else the built-in prompts; and which."""
    for path in (REPO / "bench" / "data" / "mtbench.jsonl", REPO / ".gpu" / "mtbench.jsonl"):
        if path.exists():
            lines = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
            return [str(record["prompt"]) for record in lines[:limit]], f"mtbench ({path.relative_to(REPO)})"
    return list(FALLBACK_PROMPTS[:limit]), "built-in (no mtbench.jsonl here)"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """``fn()`` and its wall seconds, the device synchronized on both sides."""
    sync(device)
    started = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - started


def serving_model(model_name: str, cache_dir: Path | None, device: str, dtype: str) -> tuple[Any, Any]:
    """(model, tokenizer): the model on ``device`` in ``dtype`` as a verifier shard prepares it."""
    from treeserve.ops.loaders.load import load_model, prepare_for_serving

    loaded = load_model(model_name, cache_dir=cache_dir)
    model = prepare_for_serving(loaded.model.to(device), loaded.source, dtype, cache_dir=cache_dir, compile_decode=False)
    return model, loaded.tokenizer


def export_hf(model_name: str, cache_dir: Path | None, folder: Path) -> Path:
    """The model as a Hugging Face Llama folder (config, float32 safetensors, the tokenizer's
    files), for HF's peers: the same weights and tokenizer."""
    from safetensors.torch import save_file

    from treeserve.ops.loaders.load import load_model

    loaded = load_model(model_name, cache_dir=cache_dir)
    config, model = loaded.model.config, loaded.model
    if config.windowed or config.post_norms or config.qkv_bias or config.qk_norm or config.activation != "silu":
        raise ValueError(f"export_hf writes plain Llama folders; {model_name} is not one")
    folder.mkdir(parents=True, exist_ok=True)
    state = {("lm_head.weight" if name == "lm_head.weight" else f"model.{name}"): tensor.detach().float().contiguous()
             for name, tensor in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.dim, "intermediate_size": config.ffn_dim, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "rope_theta": config.rope_base, "rms_norm_eps": config.norm_eps, "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": None, "eos_token_id": sorted(loaded.tokenizer.stop_ids),
    }
    (folder / "config.json").write_text(json.dumps(hf_config, indent=1), encoding="utf-8")
    loaded.tokenizer.save(folder)  # tokenizer.json + tokenizer_config.json, which AutoTokenizer reads
    return folder


def hf_matches(folder: Path, model: Any, ids: list[int], device: str) -> float:
    """The largest gap between HF's float32 logits of ``ids`` and ``model``'s (float32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids], device=device)).logits[0].float()
        ours = model(torch.tensor([ids], device=device), model.new_cache(1, len(ids)))[0].float()
    del hf
    return float((theirs - ours).abs().max())


def generations(model: Any, all_ids: Sequence[list[int]], max_new: int, device: str, *, cache: Any = None,
                speculators: Callable[[], list[Any]] | None = None, max_tree_nodes: int = 64) -> dict[str, Any]:
    """Greedy batch-1 generation of every prompt (incremental, or speculative with fresh
    ``speculators()`` per prompt), in ``cache`` when given: tokens/s over all of them, the
    tokens, and for speculation the tokens a step."""
    from treeserve.ops.sampling import SamplingParams
    from treeserve.ops.speculation_modes import SpeculationMode
    from treeserve.ops.speculative import generate_incremental, generate_speculative

    params = SamplingParams(max_new_tokens=max_new)
    tokens, seconds, steps = [], 0.0, 0
    for ids in all_ids:
        if speculators is None:
            result, elapsed = timed(lambda: generate_incremental(model, ids, params, cache=cache), device)
        else:
            made = speculators()
            result, elapsed = timed(lambda: generate_speculative(model, made, ids, params, SpeculationMode.TREE,
                                                                 cache=cache, max_tree_nodes=max_tree_nodes), device)
        tokens.append(list(result.token_ids))
        seconds += elapsed
        steps += result.num_steps
    total = sum(len(t) for t in tokens)
    return {"tok_s": round(total / seconds, 2), "tokens": total, "seconds": round(seconds, 3),
            "tokens_per_step": round(total / steps, 3) if steps else None, "token_ids": tokens}


def captured_cache(model: Any, rows: int, capacity: int, **options: Any) -> tuple[Any, Any]:
    """A cache with headroom and a :class:`~treeserve.ops.graph_step.GraphStep` captured over it,
    attached to ``model``."""
    from treeserve.ops.graph_step import HEADROOM, attach_graphs

    cache = model.new_cache(rows, capacity, headroom=HEADROOM)
    return cache, attach_graphs(model, cache, **options)


def tree_vs_step(model: Any, device: str, prefix: int, reps: int) -> dict[str, Any]:
    """Captured 16- and 64-node tree verifies over a ``prefix``-token row, per captured decode step."""
    from treeserve.ops.tree_attention import tree_mask_from_parents

    cache, step = captured_cache(model, 1, prefix + 64, row_buckets=(1,), node_buckets=(1, 16, 64))
    gen = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        model.hidden_states(torch.randint(0, vocab, (1, prefix), generator=gen).to(device), cache)
    cache.commit(0, range(prefix))

    def per_call_ms(fn: Callable[[], Any]) -> float:
        return round(time_ms(fn, device, reps=reps), 4)  # gpu_check's timer: median of 5 rounds

    decode = torch.randint(0, vocab, (1, 1), generator=gen).to(device)
    out: dict[str, Any] = {"prefix": prefix, "step_ms": per_call_ms(lambda: model(decode, cache))}
    for nodes in (16, 64):
        parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, nodes)]])
        mask = tree_mask_from_parents(parents).to(device)
        positions = (cache.lengths[:, None] + mask.sum(-1) - 1).to(device)
        tokens = torch.randint(0, vocab, (1, nodes), generator=gen).to(device)
        out[f"tree_{nodes}_ms"] = per_call_ms(lambda: model(tokens, cache, tree_mask=mask, positions=positions))
        out[str(nodes)] = round(out[f"tree_{nodes}_ms"] / out["step_ms"], 3)
    out["replays"], out["eager_calls"] = step.replays, step.eager_calls
    model.decode_step = None
    return out


def batch_inprocess(model: Any, rows: int, prompt: list[int], steps: int, device: str) -> float:
    """Tokens/s of ``rows`` rows decoding together (one root a row, greedy) through
    :func:`~treeserve.ops.batch_step.verify_rows`, with graphs captured over the rows."""
    from treeserve.ops.batch_step import RowStep, prefill_rows, verify_rows
    from treeserve.ops.sampling import SamplingParams
    from treeserve.ops.token_tree import TokenTree

    cache, _ = captured_cache(model, rows, len(prompt) + steps + 2, node_buckets=(1,))
    prefill_rows(model, cache, [(row, prompt[:-1]) for row in range(rows)])
    roots = [prompt[-1]] * rows
    params = SamplingParams()

    def run() -> None:
        for _ in range(steps):
            results = verify_rows(model, cache, [RowStep(r, TokenTree.root_only(roots[r]), params) for r in range(rows)])
            roots[:] = [result.bonus_token for result in results]

    _, seconds = timed(run, device)
    model.decode_step = None
    return round(rows * steps / seconds, 1)


async def actor_streams(model_name: str, cache_dir: Path | None, device: str, dtype: str, prompts: list[str],
                        counts: Sequence[int], max_new: int) -> dict[str, Any]:
    """Total tokens/s of ``n`` concurrent streams (each prompt cycled) through a
    :class:`treeserve.Server` on ``device`` for each ``n`` in ``counts``; graphs captured at its start."""
    from treeserve import Client, Server
    from treeserve.actors.scheduler.types import SchedulerSettings
    from treeserve.server_config import ServerConfig

    out: dict[str, Any] = {}
    longest = max(counts)
    with tempfile.TemporaryDirectory(prefix="treeserve-gpu-") as tmp:
        config = ServerConfig(model=model_name, device=device, dtype=dtype, bind=f"ipc://{tmp}/gw.sock",
                              num_rows=longest, row_capacity=1024, cache_dir=None if cache_dir is None else str(cache_dir),
                              scheduling=SchedulerSettings(adaptive_speculation=False))
        started = time.perf_counter()
        async with Server(config) as server, Client(server.endpoint) as client:
            out["server_start_s"] = round(time.perf_counter() - started, 1)
            await client.generate("Hello", speculate="none", max_tokens=4)
            for count in counts:
                jobs = [prompts[i % len(prompts)] for i in range(count)]
                began = time.perf_counter()
                done = await asyncio.gather(*(client.generate([{"role": "user", "content": p}], speculate="none",
                                                              max_tokens=max_new) for p in jobs))
                wall = time.perf_counter() - began
                out[str(count)] = round(sum(len(c.token_ids) for c in done) / wall, 1)
    return out


def default_speculators(model_name: str, model: Any, device: str, dtype: str, cache_dir: Path | None,
                        capacity: int) -> tuple[list[str], Callable[[], list[Any]]]:
    """(kinds, a maker of one request's speculators): the server's defaults for the model, a
    feature drafter's steps captured on a GPU as a speculator actor captures them."""
    from treeserve.actors.speculator_factory import capture_drafters, load_drafter, make_speculators
    from treeserve.actors.speculator_factory import default_speculators as defaults

    specs = defaults(model_name, dtype, device)
    drafters = [load_drafter(spec, model, device=device, cache_dir=None if cache_dir is None else str(cache_dir))
                for spec in specs]
    capture_drafters(drafters, capacity)
    return [spec.kind.value for spec in specs], lambda: make_speculators(specs, drafters, model.config.vocab_size,
                                                                         capacity)


def equal_count(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def speed(model_name: str, cache_dir: Path | None, device: str, *, small: bool, log: Callable[[str], None] = print,
          parts: Sequence[str] = ("decode", "hf", "tree", "speculative", "batch", "actors")) -> dict[str, Any]:
    """Issue 41's JSON fields (see the module docstring); ``small``: the CPU dry run's sizes."""
    dtype = "float32" if small else "bfloat16"
    limit, max_new = (2, 8) if small else (8, 128)
    prompts, source = mtbench_prompts(limit)
    model, tokenizer = serving_model(model_name, cache_dir, device, dtype)
    all_ids = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    capacity = max(len(ids) for ids in all_ids) + max_new + 64
    out: dict[str, Any] = {"dtype": dtype, "prompts": len(prompts), "prompt_source": source, "max_new_tokens": max_new}
    if "decode" in parts or "speculative" in parts:
        eager = generations(model, all_ids, max_new, device)
        cache, step = captured_cache(model, 1, capacity, row_buckets=(1,))
        graphs = generations(model, all_ids, max_new, device, cache=cache)
        out["decode_tok_s"] = {"eager": eager["tok_s"], "graphs": graphs["tok_s"]}
        out["graph_capture_s"] = round(step.capture_seconds or 0.0, 3)
        out["graphs_equal_eager"] = equal_count(graphs["token_ids"], eager["token_ids"])
        log(f"decode: eager {eager['tok_s']} tok/s, graphs {graphs['tok_s']} tok/s (capture {out['graph_capture_s']} s)")
    if "speculative" in parts:
        kinds, make = default_speculators(model_name, model, device, dtype, cache_dir, capacity)
        tree = generations(model, all_ids, max_new, device, cache=cache, speculators=make)
        out["speculative"] = {"speculators": kinds, "tok_s": tree["tok_s"], "incremental_tok_s": graphs["tok_s"],
                              "tokens_per_step": tree["tokens_per_step"], "prompts": len(prompts),
                              "equal_in_serving_format": equal_count(tree["token_ids"], graphs["token_ids"])}
        out["speculative"]["equal_to_incremental"] = float32_equality(model_name, cache_dir, device, all_ids, max_new,
                                                                      capacity)
        log(f"speculative: {out['speculative']}")
    model.decode_step = None
    if "tree" in parts:
        out["tree_vs_step"] = tree_vs_step(model, device, prefix=64 if small else 256, reps=2 if small else 50)
        log(f"tree_vs_step: {out['tree_vs_step']}")
    if "batch" in parts:
        counts = (2, 4) if small else (1, 16, 64)
        out["batch_inprocess_tok_s"] = {str(n): batch_inprocess(model, n, all_ids[0], 4 if small else 64, device)
                                        for n in counts}
        log(f"batch in process: {out['batch_inprocess_tok_s']}")
    del model
    if "hf" in parts:
        out.update(hf_peers(model_name, cache_dir, device, dtype, all_ids, max_new, small, log))
    if "actors" in parts:
        counts = (1, 2) if small else (1, 16, 64)
        out["batch_tok_s"] = asyncio.run(actor_streams(model_name, cache_dir, device, dtype, prompts, counts, max_new))
        log(f"through the actors: {out['batch_tok_s']}")
    return out


def float32_equality(model_name: str, cache_dir: Path | None, device: str, all_ids: list[list[int]], max_new: int,
                     capacity: int) -> int:
    """Prompts whose float32 tree-speculative tokens (graphs) equal incremental decoding's."""
    model, _ = serving_model(model_name, cache_dir, device, "float32")
    cache, _ = captured_cache(model, 1, capacity, row_buckets=(1,))
    _, make = default_speculators(model_name, model, device, "float32", cache_dir, capacity)
    plain = generations(model, all_ids, max_new, device, cache=cache)
    tree = generations(model, all_ids, max_new, device, cache=cache, speculators=make)
    return equal_count(tree["token_ids"], plain["token_ids"])


def hf_peers(model_name: str, cache_dir: Path | None, device: str, dtype: str, all_ids: list[list[int]],
             max_new: int, small: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """HF's static-cache ``torch.compile`` and prompt-lookup peers on the same prompt ids."""
    from hf_peers import hf_peer_timings

    from treeserve.ops.loaders.load import load_model

    folder = export_hf(model_name, cache_dir, Path(tempfile.mkdtemp(prefix="treeserve-hf-")))
    reference = load_model(model_name, cache_dir=cache_dir).model.to(device)
    gap = hf_matches(folder, reference, all_ids[0], device)
    del reference
    peers = hf_peer_timings(folder, [""] * len(all_ids), token_ids=all_ids, max_new_tokens=max_new, device=device,
                            dtype=dtype, compile=not small, peers=("prompt_lookup", "static_compile"), log=log)
    return {"transformers": peers["transformers"], "hf_float32_logit_gap": gap,
            "hf_static_compile_tok_s": peers["static_compile"].get("tok_s"),
            "hf_prompt_lookup_tok_s": peers["prompt_lookup"].get("tok_s"),
            "hf": {k: v for k, v in peers.items() if k not in ("prompts",)}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model treeserve loads (a name or a converted folder)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--small", action="store_true", help="the dry run's sizes")
    parser.add_argument("--parts", nargs="+", default=None)
    args = parser.parse_args(argv)
    kwargs = {} if args.parts is None else {"parts": args.parts}
    print(json.dumps(speed(args.model, args.cache_dir, args.device, small=args.small, **kwargs), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
