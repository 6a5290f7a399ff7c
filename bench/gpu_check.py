"""Issue 16's GPU checks in one run, prepared on the CPU so that the run on a GPU only confirms
and measures (well under 8 minutes on one H200):

1. install the wheels brought along (``--wheels``, default ``.whl/``) and treeserve itself into
   ``--site`` (no network there: pyzmq, gguf, pytest-asyncio; ``bench/gpu_wheels.sh`` fetches them);
2. ``pytest -m gpu`` over the test files that hold GPU tests;
3. the tree-attention kernel against a float64 reference on random trees (chains, wide, deep,
   64 nodes), GQA, batches with different prefixes, several splits, float32/bfloat16/float16;
4. the kernel against SDPA under the dense mask, 16- and 64-node trees at prefixes
   256/2048/8192 (bf16, the default model's 9/3 heads of 64): per call from Python and on the
   GPU's own clock, the kernel's host side alone, and a sweep of its launch shapes (16 or 32
   query rows a block, 2/4/8 blocks per multiprocessor);
5. the model on the device in float32: greedy tree speculation == incremental decoding;
6. decode and tree-verify steps in bf16 (the tree steps with the kernel and with SDPA);
7. ``treeserve generate`` through the whole actor system on the device (float32 tree == none,
   and bf16);
8. issue 41's speed figures (``bench/gpu_speed.py``): decoding eager and from CUDA graphs, HF
   transformers' static-cache ``torch.compile`` and prompt-lookup peers, captured tree verifies
   over a captured step, tree speculation, and 16 and 64 streams through the actors;
9. one JSON (``gpu_check.json``) and a log (``gpu_check.log``) under ``--out`` (default ``$OUT``).

The model is the default one when its GGUF is in the cache or given (``--gguf``, checked by
sha256 and installed into the cache as ``treeserve pull`` would); otherwise a random-weight twin
of its shapes with its real tokenizer (``--tokenizer-dir``), which measures the same and checks
exactness just as well (the report names which ran).

    python3 bench/gpu_check.py [--out DIR] [--gguf FILE] [--only STEP ...]
    python bench/gpu_check.py --dry-run     # here, on the CPU, at toy sizes: the kernel through the
                                            # g++ shim, the model's kernel path faked onto it
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STEPS = ("install", "pytest", "kernel_accuracy", "kernel_timing", "greedy_exactness", "model_timing", "generate", "speed")
SPEED_FIELDS = ("decode_tok_s", "hf_static_compile_tok_s", "tree_vs_step", "speculative", "batch_tok_s", "transformers")
"""Issue 41's fields, which the ``speed`` step (``bench/gpu_speed.py``) also writes at the JSON's top level."""
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
"""Issue 16's bounds against float64 (on the same rounded inputs)."""
TWIN_CONFIG = dict(vocab_size=49152, dim=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, ffn_dim=1536,
                   rope_base=100000.0, norm_eps=1e-5, max_seq_len=8192, qkv_bias=False, tie_embeddings=True)
"""SmolLM2-135M-Instruct's shapes (its GGUF's metadata), for the random-weight twin."""
PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a list.",
           "List three colours of the rainbow, one per line.")


class Report:
    """The run's JSON and log: every line printed goes to stdout and the log; the JSON is
    rewritten after each step, so a run cut short still leaves what it measured."""

    def __init__(self, out: Path, deadline_s: float) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.deadline_s = deadline_s
        self.json_path = out / "gpu_check.json"
        self.log_file = (out / "gpu_check.log").open("w", encoding="utf-8")
        self.data: dict[str, Any] = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                     "argv": sys.argv[1:], "steps": {}}
        self.started = time.perf_counter()

    def log(self, text: str) -> None:
        line = f"[{time.perf_counter() - self.started:7.1f}s] {text}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        self.json_path.write_text(json.dumps(self.data, indent=1, default=str), encoding="utf-8")

    def remaining_s(self) -> float:
        """Seconds left before ``--deadline-s`` (subprocesses are given at most this)."""
        return self.deadline_s - (time.perf_counter() - self.started)

    def step(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        if self.remaining_s() < 20:
            self.log(f"== {name}: skipped, past the deadline")
            self.data["steps"][name] = {"ok": None, "skipped": "past --deadline-s"}
            self.save()
            return
        self.log(f"== {name}")
        started = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # one failing step must not hide the others' figures
            self.log(traceback.format_exc())
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.perf_counter() - started, 1)
        self.data["steps"][name] = result
        self.log(f"== {name}: {'ok' if result.get('ok') else 'FAILED' if result.get('ok') is False else 'done'} "
                 f"in {result['seconds']} s")
        self.save()


# ---------------------------------------------------------------------------------------- 1
def install(wheels: Path, site: Path, report: Report) -> dict[str, Any]:
    """pip-install the carried wheels and treeserve (this checkout) into ``site``, offline; if
    the checkout does not build there, ``site/treeserve`` links its folders as the package
    mapping of ``pyproject.toml`` lays them out."""
    found = sorted(str(p) for p in wheels.glob("*.whl"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site)]
    results = {}
    for what, extra in (("wheels", found), ("treeserve", ["--no-build-isolation", str(REPO)])):
        if not extra:
            continue
        done = subprocess.run(pip + extra, capture_output=True, text=True, check=False, timeout=300)
        report.log(f"pip install {what}: rc {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        results[what] = done.returncode == 0
    if not results.get("treeserve"):
        import tomllib

        mapping = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
        package = site / "treeserve"
        shutil.rmtree(package, ignore_errors=True)
        package.mkdir(parents=True)
        for entry in (REPO / "treeserve").iterdir():
            (package / entry.name).symlink_to(entry)
        for name, folder in mapping.items():
            parts = name.split(".")
            if len(parts) == 2 and not (package / parts[1]).exists():
                (package / parts[1]).symlink_to(REPO / folder)
        results["treeserve_linked"] = True
    return {"ok": bool(results.get("wheels", True)) and (results.get("treeserve") or results.get("treeserve_linked")),
            "wheels": [Path(p).name for p in found], "site": str(site), **results}


def use_site(site: Path) -> None:
    """Put ``site`` first on this process's path and on its children's (``PYTHONPATH``)."""
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)


# ---------------------------------------------------------------------------------------- 2
def neutral_dir() -> str:
    """A working directory for subprocesses outside the checkout: ``python -m`` puts the working
    directory first on the path, and the checkout's ``treeserve/`` folder (the façade alone)
    would shadow the installed package, in the children the actor runtime starts too."""
    import tempfile

    return tempfile.gettempdir()


def run_gpu_tests(report: Report) -> dict[str, Any]:
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text(encoding="utf-8"))
    command = [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(REPO), "-q",
               "-m", "gpu", "-rs", *(str(REPO / f) for f in files)]
    done = subprocess.run(command, cwd=neutral_dir(), capture_output=True, text=True, check=False,
                          timeout=max(20.0, min(300.0, report.remaining_s() - 200)))  # leave the model steps time
    report.log(done.stdout[-20000:] + done.stderr[-5000:])
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    import pytest

    return {"ok": done.returncode == 0, "files": files, "summary": lines[-1] if lines else "",
            "pytest": pytest.__version__}


# ---------------------------------------------------------------------------------------- 3
def random_parents(num_nodes: int, shape: str, gen: Any) -> list[int]:
    import torch

    if shape == "chain":
        return list(range(-1, num_nodes - 1))
    if shape == "wide":
        return [-1] + [0] * (num_nodes - 1)
    if shape == "binary":
        return [-1] + [(i - 1) // 2 for i in range(1, num_nodes)]
    low = 4 if shape == "deep" else num_nodes
    return [-1] + [int(torch.randint(max(0, i - low), i, (1,), generator=gen)) for i in range(1, num_nodes)]


def reference(q: Any, k: Any, v: Any, lengths: list[int], mask: Any) -> Any:
    """float64 attention of each new token over its prefix and its tree-visible new tokens."""
    import torch

    batch, heads, num_new, head_dim = q.shape
    group = heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b, length in enumerate(lengths):
        visible = torch.ones(num_new, length + num_new, dtype=torch.bool, device=q.device)
        visible[:, length:] = mask[b]
        keys = k[b, :, : length + num_new].double().repeat_interleave(group, 0)  # (H, S, hd)
        values = v[b, :, : length + num_new].double().repeat_interleave(group, 0)
        scores = (q[b].double() @ keys.transpose(1, 2) / math.sqrt(head_dim)).masked_fill(~visible, -math.inf)
        out[b] = torch.softmax(scores, -1) @ values
    return out


def kernel_for(device: str, shim_dir: Path) -> Callable[..., Any]:
    """The kernel's entry point on ``device``: CuPy on CUDA, the g++ shim on the CPU."""
    from treeserve.ops.kernels import tree_attention_cuda

    if device.startswith("cuda"):
        return tree_attention_cuda.tree_attention_cuda
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the shim is a test helper, not installed
    from treeserve_testing import tree_attention_shim

    library = tree_attention_shim.build(shim_dir)

    def on_cpu(q: Any, k: Any, v: Any, lengths: Any, bits: Any, *, max_prefix_length: int | None = None,
               num_splits: int | None = None) -> Any:
        return tree_attention_cuda.run_tree_attention(q, k, v, lengths, bits, launch=tree_attention_shim.launcher(library),
                                                      num_sms=8, max_prefix_length=max_prefix_length,
                                                      num_splits=num_splits)

    return on_cpu


def kernel_accuracy(device: str, kernel: Callable[..., Any], small: bool) -> dict[str, Any]:
    import torch

    from treeserve.ops.tree_attention import ancestor_bits_from_mask, tree_mask_from_parents

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    # name: (heads, kv heads, head dim, prefixes, tree shapes, nodes)
    cases = {
        "chain8": (9, 3, 64, [0, 45], ["chain", "chain"], 8),
        "wide16": (9, 3, 64, [300, 3], ["wide", "wide"], 16),
        "deep64": (9, 3, 64, [0, 1000, 33], ["deep", "random", "chain"], 64),
        "random64_mha128": (4, 4, 128, [2000], ["random"], 64),
        "gqa8x2_batch4": (16, 2, 64, [129, 4000, 1, 0], ["random", "deep", "wide", "binary"], 33),
    }
    gen = torch.Generator().manual_seed(0)
    worst: dict[str, float] = {name: 0.0 for name in dtypes}
    rows = []
    for name, (heads, kv_heads, head_dim, prefixes, shapes, nodes) in cases.items():
        if small:
            prefixes = [min(p, 70) for p in prefixes]
        trees = [random_parents(nodes, shape, gen) for shape in shapes]
        mask = tree_mask_from_parents(torch.tensor(trees))
        bits = ancestor_bits_from_mask(mask).to(device)
        batch, capacity = len(prefixes), max(prefixes) + nodes + 7
        for dtype_name, dtype in dtypes.items():
            q = torch.randn(batch, nodes, heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
            k = torch.randn(batch, kv_heads, capacity, head_dim, generator=gen).to(device, dtype)
            v = torch.randn(batch, kv_heads, capacity, head_dim, generator=gen).to(device, dtype)
            lengths = torch.tensor(prefixes, device=device)
            expected = reference(q, k, v, prefixes, mask.to(device))
            for splits in (None, 3):
                got = kernel(q, k, v, lengths, bits, num_splits=splits)
                error = (got.double() - expected).abs().max().item()
                worst[dtype_name] = max(worst[dtype_name], error if error == error else math.inf)
                rows.append({"case": name, "dtype": dtype_name, "num_splits": splits or "auto", "max_error": error})
    ok = all(worst[name] < TOLERANCE[name] for name in dtypes)
    return {"ok": ok, "max_error": worst, "tolerance": TOLERANCE, "cases": rows}


# ---------------------------------------------------------------------------------------- 4
def time_ms(fn: Callable[[], Any], device: str, *, reps: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean time of ``reps`` back-to-back calls, in ms (CUDA
    events on a GPU): the wall time a caller sees, the host's launch costs included."""
    import torch

    for _ in range(3):
        fn()
    results = []
    for _ in range(rounds):
        if device.startswith("cuda"):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            stop.record()
            stop.synchronize()
            results.append(start.elapsed_time(stop) / reps)
        else:
            started = time.perf_counter()
            for _ in range(reps):
                fn()
            results.append((time.perf_counter() - started) * 1e3 / reps)
    return sorted(results)[len(results) // 2]


def device_ms(fn: Callable[[], Any], wall_ms: float, *, reps: int, rounds: int = 5) -> float | None:
    """The GPU's own time per call, in ms: a spin kernel holds the stream while the host queues
    ``reps`` calls, so the events between them time only the queued work (median of
    ``rounds``). None where the host did not get ahead (the spin ended before the last call
    was queued)."""
    import torch

    cycles = int((1.5 * reps * wall_ms + 5) * 2.5e6)  # ms at up to 2.5 GHz
    results = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        if start.query():  # the spin was over before the host had queued everything
            stop.synchronize()
            return None
        stop.synchronize()
        results.append(start.elapsed_time(stop) / reps)
    return sorted(results)[len(results) // 2]


def kernel_timing(device: str, kernel: Callable[..., Any], small: bool) -> dict[str, Any]:
    import torch

    from treeserve.ops.tree_attention import (
        ancestor_bits_from_mask,
        attention_under_mask,
        build_attention_mask,
        tree_mask_from_parents,
    )

    from treeserve.ops.kernels.tree_attention_cuda import ROW_VARIANTS, cupy_launch, num_sms_of, run_tree_attention

    heads, kv_heads, head_dim = 9, 3, 64
    index = torch.device(device).index or 0
    num_sms = num_sms_of(index) if device.startswith("cuda") else 8
    grid = [(16, 32), (64, 64)] if small else [(n, p) for n in (16, 64) for p in (256, 2048, 8192)]
    reps = 2 if small else 50
    gen = torch.Generator().manual_seed(1)
    rows = []
    for nodes, prefix in grid:
        capacity = prefix + nodes + 16
        q = torch.randn(1, nodes, heads, head_dim, generator=gen).to(device, torch.bfloat16).transpose(1, 2)
        k = torch.randn(1, kv_heads, capacity, head_dim, generator=gen).to(device, torch.bfloat16)
        v = torch.randn(1, kv_heads, capacity, head_dim, generator=gen).to(device, torch.bfloat16)
        lengths = torch.tensor([prefix], device=device)
        tree = tree_mask_from_parents(torch.tensor([random_parents(nodes, "binary", gen)])).to(device)
        bits = ancestor_bits_from_mask(tree)
        slots = prefix + nodes
        mask = build_attention_mask(lengths, tree, nodes, slots)

        def ours() -> Any:
            return kernel(q, k, v, lengths, bits, max_prefix_length=prefix)

        def sdpa() -> Any:
            return attention_under_mask(q, k[:, :, :slots], v[:, :, :slots], mask)

        def sdpa_with_mask() -> Any:
            return attention_under_mask(q, k[:, :, :slots], v[:, :, :slots],
                                        build_attention_mask(lengths, tree, nodes, slots))

        row = {"nodes": nodes, "prefix": prefix, "kernel_ms": time_ms(ours, device, reps=reps),
               "sdpa_dense_mask_ms": time_ms(sdpa, device, reps=reps),
               "sdpa_building_the_mask_ms": time_ms(sdpa_with_mask, device, reps=reps)}
        row["sdpa_over_kernel"] = round(row["sdpa_dense_mask_ms"] / row["kernel_ms"], 2)
        if device.startswith("cuda"):  # where the time goes: the GPU's own, and the host's
            row["kernel_gpu_ms"] = device_ms(ours, row["kernel_ms"], reps=reps)
            row["sdpa_dense_mask_gpu_ms"] = device_ms(sdpa, row["sdpa_dense_mask_ms"], reps=reps)
            row["kernel_host_ms_without_launch"] = time_ms(lambda: run_tree_attention(
                q, k, v, lengths, bits, launch=lambda *args: None, num_sms=num_sms, max_prefix_length=prefix),
                device, reps=reps)
            launch = cupy_launch(index)
            for rows_per_block in ROW_VARIANTS:  # the launch shapes the kernel takes, on the GPU's own clock
                for per_sm in (2, 4, 8):
                    def variant() -> Any:
                        return run_tree_attention(q, k, v, lengths, bits, launch=launch, num_sms=num_sms,
                                                  max_prefix_length=prefix, rows=rows_per_block, blocks_per_sm=per_sm)

                    row[f"gpu_ms_rows{rows_per_block}_blocks_per_sm{per_sm}"] = device_ms(variant, row["kernel_ms"],
                                                                                        reps=reps)
        rows.append(row)
    at_issue = [r for r in rows if r["nodes"] == 64 and r["prefix"] == 2048]
    return {"ok": None, "cases": rows, "dtype": "bfloat16", "heads": [heads, kv_heads, head_dim],
            "kernel_at_least_as_fast_at_64_nodes_2048": at_issue[0]["sdpa_over_kernel"] >= 1.0 if at_issue else None,
            "note": "CPU dry run: the kernel runs under the g++ shim, so its times mean nothing" if small else ""}


# ---------------------------------------------------------------------------------------- 5, 6
def build_twin(folder: Path, tokenizer_dir: Path, config: dict[str, Any]) -> Path:
    """A converted-model folder (``load_model`` reads it) with random weights of ``config``'s
    shapes and the default model's tokenizer files (built once per cache)."""
    import torch
    from safetensors.torch import save_file

    from treeserve.ops.loaders.load import CONFIG_FILE, CONVERTED_FORMAT_VERSION, WEIGHTS_FILE
    from treeserve.ops.model import Transformer
    from treeserve.ops.model_config import ModelConfig

    if (folder / CONFIG_FILE).exists():
        return folder
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**config))
    with torch.no_grad():  # scaled so that greedy text varies (torch's default init repeats one token)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape))
            elif param.dim() == 2 and "embed" not in name:
                param.normal_(0, 2 / math.sqrt(param.shape[1]))
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / WEIGHTS_FILE))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    meta = {"format_version": CONVERTED_FORMAT_VERSION, "architecture": "llama", "source": "gpu_check random twin",
            "config": config}
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return folder


def resolve_model(args: argparse.Namespace, report: Report) -> tuple[str, str]:
    """(model name or folder, what it is): the default model when its GGUF is here, else the twin."""
    from treeserve.ops.loaders.registry import DEFAULT_MODEL, pull, pulled_path, resolve_cache_dir

    if args.model is not None:
        return args.model, "as given"
    if args.gguf is not None and not args.dry_run:
        from treeserve.ops.loaders.registry import get_spec

        spec = get_spec(DEFAULT_MODEL)
        target = resolve_cache_dir(args.cache_dir) / "models" / spec.name / spec.gguf_filename
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            shutil.copy(args.gguf, target)
        pull(DEFAULT_MODEL, args.cache_dir, progress=lambda p: report.log(f"{p.stage}: {p.message}"))  # sha256 check
    if not args.dry_run and pulled_path(DEFAULT_MODEL, args.cache_dir) is not None:
        return DEFAULT_MODEL, "the default model (SmolLM2-135M-Instruct, real weights)"
    tokenizer_dir = next((d for d in tokenizer_dirs(args) if (d / "tokenizer.json").exists()), None)
    if tokenizer_dir is None:
        raise FileNotFoundError("no default-model GGUF and no tokenizer files for the twin: pass --gguf or --tokenizer-dir")
    config = dict(TWIN_CONFIG, num_layers=2) if args.dry_run else dict(TWIN_CONFIG)
    name = "twin-tiny" if args.dry_run else "twin"
    folder = build_twin(resolve_cache_dir(args.cache_dir) / "gpu-check" / name, tokenizer_dir, config)
    return str(folder), f"a random-weight twin of the default model ({config['num_layers']} layers, its tokenizer)"


def tokenizer_dirs(args: argparse.Namespace) -> list[Path]:
    from treeserve.ops.loaders.registry import resolve_cache_dir

    found = [args.tokenizer_dir] if args.tokenizer_dir is not None else []
    found.append(REPO / ".gpu" / "tokenizer")
    found += sorted((resolve_cache_dir(None) / "converted").glob("SmolLM2-135M-Instruct*"))
    return found


def kernel_calls(kernel: Callable[..., Any], device: str) -> tuple[list[int], Callable[[], None]]:
    """Count the model's calls of the CUDA tree kernel; on the CPU route the model's tree
    forwards onto ``kernel`` (the shim) as a GPU would route them. Returns (counter, undo)."""
    from treeserve.ops import model as model_module
    from treeserve.ops.kernels import tree_attention_cuda

    calls = [0]
    real_kernel, real_rule = tree_attention_cuda.tree_attention_cuda, model_module.uses_tree_kernel

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return kernel(*args, **kwargs)

    tree_attention_cuda.tree_attention_cuda = counted
    if not device.startswith("cuda"):
        model_module.uses_tree_kernel = lambda device, tree_mask, num_new: tree_mask is not None and num_new <= 64

    def undo() -> None:
        tree_attention_cuda.tree_attention_cuda = real_kernel
        model_module.uses_tree_kernel = real_rule

    return calls, undo


def greedy_exactness(model_name: str, args: argparse.Namespace, device: str, kernel: Callable[..., Any]) -> dict[str, Any]:
    import torch

    from treeserve.actors.speculator_factory import default_speculators, load_drafter, make_speculators, parse_speculator
    from treeserve.ops.loaders.load import load_model
    from treeserve.ops.sampling import SamplingParams
    from treeserve.ops.speculative import generate_incremental, generate_speculative
    from treeserve.ops.speculation_modes import SpeculationMode

    loaded = load_model(model_name, cache_dir=args.cache_dir)  # float32: the exact reference
    model = loaded.model.to(device)
    specs = default_speculators(model_name) + (parse_speculator(f"self:{max(1, model.config.num_layers // 3)}"),)
    drafters = [load_drafter(spec, model, device=device, cache_dir=args.cache_dir) for spec in specs]
    max_new = 8 if args.dry_run else 64
    params = SamplingParams(max_new_tokens=max_new)
    calls, undo = kernel_calls(kernel, device)
    rows = []
    try:
        for prompt in PROMPTS[: 2 if args.dry_run else 3]:
            ids = loaded.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            with torch.inference_mode():
                plain = generate_incremental(model, ids, params)
                before = calls[0]
                tree = generate_speculative(model, make_speculators(specs, drafters, model.config.vocab_size), ids,
                                            params, SpeculationMode.TREE)
            rows.append({"prompt": prompt, "equal": plain.token_ids == tree.token_ids, "num_tokens": len(plain.token_ids),
                         "tree_steps": tree.num_steps, "mean_tokens_per_step": round(tree.mean_tokens_per_step, 2),
                         "kernel_calls": calls[0] - before})
    finally:
        undo()
    return {"ok": all(r["equal"] for r in rows) and all(r["kernel_calls"] > 0 for r in rows),
            "speculators": [s.kind.value for s in specs], "rows": rows}


def model_timing(model_name: str, args: argparse.Namespace, device: str, kernel: Callable[..., Any]) -> dict[str, Any]:
    import torch

    from treeserve.ops import model as model_module
    from treeserve.ops.loaders.load import load_model, prepare_for_serving
    from treeserve.ops.tree_attention import tree_mask_from_parents

    loaded = load_model(model_name, cache_dir=args.cache_dir)
    model = prepare_for_serving(loaded.model.to(device), loaded.source, "bfloat16", cache_dir=args.cache_dir,
                                compile_decode=False)
    prefix = 64 if args.dry_run else 256
    reps = 2 if args.dry_run else 20
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    result: dict[str, Any] = {"ok": None, "dtype": "bfloat16", "prefix": prefix}
    for rows in (1, 8):
        cache = model.new_cache(rows, prefix + 80)
        with torch.inference_mode():
            model(torch.randint(0, vocab, (rows, prefix), generator=gen).to(device), cache)
            for row in range(rows):
                cache.commit(row, range(prefix))
        tokens = torch.randint(0, vocab, (rows, 1), generator=gen).to(device)
        result[f"decode_{rows}_rows_ms"] = time_ms(lambda: model(tokens, cache), device, reps=reps)
        if rows != 1:
            continue
        for nodes in (16, 64):
            parents = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, nodes)]])
            mask = tree_mask_from_parents(parents).to(device)
            positions = (cache.lengths[:, None] + mask.sum(-1) - 1).to(device)
            tree_tokens = torch.randint(0, vocab, (1, nodes), generator=gen).to(device)

            def tree_step() -> Any:
                return model(tree_tokens, cache, tree_mask=mask, positions=positions)

            calls, undo = kernel_calls(kernel, device)
            try:
                result[f"tree_{nodes}_kernel_ms"] = time_ms(tree_step, device, reps=reps)
                result[f"tree_{nodes}_kernel_calls"] = calls[0]
            finally:
                undo()
            real_rule = model_module.uses_tree_kernel
            model_module.uses_tree_kernel = lambda device, tree_mask, num_new: False  # SDPA under the dense mask
            try:
                result[f"tree_{nodes}_sdpa_ms"] = time_ms(tree_step, device, reps=reps)
            finally:
                model_module.uses_tree_kernel = real_rule
            result[f"tree_{nodes}_over_decode"] = round(result[f"tree_{nodes}_kernel_ms"] / result["decode_1_rows_ms"], 2)
    return result


# ---------------------------------------------------------------------------------------- 7
def generate_runs(model_name: str, args: argparse.Namespace, device: str, report: Report) -> dict[str, Any]:
    max_tokens = "8" if args.dry_run else "64"
    runs = {"float32_tree": ("float32", "tree"), "float32_none": ("float32", "none"), "bfloat16_tree": ("bfloat16", "tree")}
    out: dict[str, Any] = {}
    for name, (fmt, speculate) in runs.items():
        command = [sys.executable, "-m", "treeserve.cli", "generate", PROMPTS[0], "--device", device, "--format", fmt,
                   "--speculate", speculate, "--max-tokens", max_tokens, "--json", "--model", model_name]
        if args.cache_dir is not None:
            command += ["--cache-dir", str(args.cache_dir)]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=neutral_dir(), capture_output=True, text=True, check=False,
                                  timeout=max(10.0, min(180.0, report.remaining_s() - 5)))
        except subprocess.TimeoutExpired as exc:
            report.log(f"$ {' '.join(command)}: timed out\n{exc.stderr[-4000:] if isinstance(exc.stderr, str) else ''}")
            out[name] = {"ok": False, "error": "timed out"}
            continue
        report.log(f"$ {' '.join(command)}\n{done.stderr[-4000:]}")
        lines = done.stdout.strip().splitlines()
        try:
            reply = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            out[name] = {"ok": False, "rc": done.returncode, "stdout": done.stdout[-2000:]}
            continue
        out[name] = {"ok": done.returncode == 0, "wall_s": round(time.perf_counter() - started, 1),
                     **{k: reply.get(k) for k in ("text", "token_ids", "tokens_per_s", "num_steps",
                                                  "mean_accepted_per_step", "ttft_s")}}
    same = (out.get("float32_tree", {}).get("token_ids") is not None
            and out["float32_tree"].get("token_ids") == out.get("float32_none", {}).get("token_ids"))
    return {"ok": all(r.get("ok") for r in out.values()) and same, "float32_tree_equals_none": same, "runs": out}


# ---------------------------------------------------------------------------------------- 8
def speed_step(model_name: str, args: argparse.Namespace, device: str, small: bool, report: Report) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_speed import speed

    result = speed(model_name, args.cache_dir, device, small=small, log=report.log,
                   **({} if args.speed_parts is None else {"parts": args.speed_parts}))
    report.data.update({key: result[key] for key in SPEED_FIELDS if key in result})
    return {"ok": True, **result}


# ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where the JSON and log go (default: $OUT, else bench/out/gpu_check)")
    parser.add_argument("--device", default=None, help="cuda (default where torch sees one) or cpu")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU at toy sizes, to test this script")
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl")
    parser.add_argument("--site", type=Path, default=Path("/tmp/treeserve-site"))
    parser.add_argument("--cache-dir", type=Path, default=None, help="treeserve's cache (default: its own)")
    parser.add_argument("--gguf", type=Path, default=None, help="the default model's GGUF, carried along")
    parser.add_argument("--model", default=None, help="any model treeserve loads (overrides the default/twin choice)")
    parser.add_argument("--tokenizer-dir", type=Path, default=None, help="tokenizer.json + tokenizer_config.json for the twin")
    parser.add_argument("--deadline-s", type=float, default=450.0,
                        help="steps not started by then are skipped, subprocesses are cut at it (default 450)")
    parser.add_argument("--only", nargs="+", choices=STEPS, default=None, help="run these steps only")
    parser.add_argument("--speed-parts", nargs="+", default=None,
                        choices=("decode", "hf", "tree", "speculative", "batch", "actors"),
                        help="the speed step's parts (default: all), to split it over two device calls")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "out" / "gpu_check"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report(args.out, args.deadline_s)
    steps = set(args.only or STEPS)
    if args.dry_run:
        steps.discard("install")
    if "install" in steps:
        report.step("install", lambda: install(args.wheels, args.site, report))
        use_site(args.site)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    small = args.dry_run or device == "cpu"
    report.data.update(device=device, dry_run=args.dry_run, torch=torch.__version__, python=sys.version.split()[0])
    if device.startswith("cuda"):
        report.data["gpu"] = torch.cuda.get_device_name(0)
        from treeserve.ops.kernels.tree_attention_cuda import driver_launch

        report.data["kernel_launch"] = "cuLaunchKernel" if driver_launch() is not None else "cupy"
        try:
            import cupy

            report.data["cupy"] = cupy.__version__
        except ImportError as exc:
            report.data["cupy"] = f"missing: {exc}"
    from treeserve.ops.tree_attention import is_cuda_kernel_available

    report.data["cuda_kernel_available"] = is_cuda_kernel_available()
    report.log(f"device {device}, torch {torch.__version__}, steps {sorted(steps)}")
    if "pytest" in steps:
        report.step("pytest", lambda: run_gpu_tests(report))
    import tempfile

    uses_kernel = steps & {"kernel_accuracy", "kernel_timing", "greedy_exactness", "model_timing"}
    kernel = kernel_for(device, Path(tempfile.mkdtemp(prefix="gpu-check-shim-"))) if uses_kernel else None
    if "kernel_accuracy" in steps:
        report.step("kernel_accuracy", lambda: kernel_accuracy(device, kernel, small))
    if "kernel_timing" in steps:
        report.step("kernel_timing", lambda: kernel_timing(device, kernel, small))
    chosen: dict[str, str] = {}

    def choose_model() -> dict[str, Any]:
        chosen["name"], chosen["what"] = resolve_model(args, report)
        report.data["model"] = dict(chosen)
        return {"ok": True, **chosen}

    if steps & {"greedy_exactness", "model_timing", "generate", "speed"}:
        report.step("model", choose_model)
    if chosen:
        model_name = chosen["name"]
        if "greedy_exactness" in steps:
            report.step("greedy_exactness", lambda: greedy_exactness(model_name, args, device, kernel))
        if "model_timing" in steps:
            report.step("model_timing", lambda: model_timing(model_name, args, device, kernel))
        if "generate" in steps:
            report.step("generate", lambda: generate_runs(model_name, args, device, report))
        if "speed" in steps:
            report.step("speed", lambda: speed_step(model_name, args, device, small, report))
    if device.startswith("cuda"):
        from treeserve.ops.kernels.tree_attention_cuda import LAUNCHES

        report.data["kernel_launches_by_path"] = dict(LAUNCHES)  # this process's, not pytest's or the actors'
    failed = [name for name, step in report.data["steps"].items() if step.get("ok") is False]
    report.data["failed_steps"] = failed
    report.save()
    report.log(f"done: {'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)}; "
               f"{report.json_path} and its log")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
