"""Write the GGUF test fixtures: a small llama model in every block type, with llama.cpp's own
logits on them, so CI compares treeserve against llama.cpp without it.

A tiny model (2 layers, width 256, so every K-quant fits) with the test suite's BPE tokenizer:
random weights, then :data:`TRAIN_STEPS` Adam steps on the tokenizer's corpus. Random weights
alone give flat logits (the top two a median 3-4% of the logits' range apart, where llama.cpp's
own int8 activations already move the logits by up to 2-3% of it), so top-1 agreement would
measure ties; five steps make the next token clear (a median gap of 30%) and leave the network
far from a lookup table. It is written in float32 by the gguf package's writer
(``tests/ops/conftest.py``'s ``write_gguf``), then requantized by llama.cpp
(``llama_model_quantize``) into each file type of :data:`FILE_TYPES`. llama.cpp then scores the
corpus's first :data:`NUM_TOKENS` tokens on each file (``logits_all``), and the logits are saved
beside it. Bench-only (llama-cpp-python builds in minutes; see
``bench/RESULTS.md`` for the flags):

    python bench/gguf_fixtures.py [--out tests/ops/data/gguf]

Rerun only to change the fixtures; ``tests/ops/test_gguf_fixtures.py`` reads what it wrote.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "ops" / "data" / "gguf"
FILE_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
"""llama.cpp's file types (``LLAMA_FTYPE_MOSTLY_*``): together they hold every block type
treeserve reads (Q4_K_M mixes Q4_K and Q6_K, Q5_K_M Q5_K and Q6_K)."""
DIMS = dict(dim=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, ffn_dim=256, max_seq_len=512)
SEED = 11
NUM_TOKENS = 160
TRAIN_STEPS = 5


def conftest() -> Any:
    """``tests/ops/conftest.py`` as a module (its model, tokenizer and GGUF writer)."""
    spec = importlib.util.spec_from_file_location("ops_conftest", ROOT / "tests" / "ops" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_cpp_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits ``(len(tokens), V)`` float32 for ``tokens`` from the start."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, n_threads_batch=2, n_batch=512,
                          logits_all=True, verbose=False, seed=0)
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def train(model: Any, tokens: list[int]) -> None:
    """:data:`TRAIN_STEPS` steps of next-token cross-entropy on ``tokens`` (the forward without
    its inference-mode decorator, so that gradients flow)."""
    import torch

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    x = torch.tensor([tokens])
    for _ in range(TRAIN_STEPS):
        logits = type(model).forward.__wrapped__(model, x, model.new_cache(1, len(tokens)))
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), x[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def main() -> None:
    import llama_cpp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    helpers = conftest()
    backend = helpers.train_tiny_bpe()
    vocab = backend.get_vocab_size()
    model = helpers.make_tiny_model(SEED, vocab_size=vocab, weight_scale=0.06, **DIMS)
    corpus = backend.encode(helpers.TOKENIZER_CORPUS).ids
    train(model, corpus[:200])
    tokens = corpus[:NUM_TOKENS]
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "tiny-f32.gguf"
        helpers.write_gguf(source, model, "llama", backend)
        meta: dict[str, Any] = {"tokens": tokens, "dims": DIMS, "seed": SEED, "train_steps": TRAIN_STEPS, "vocab_size": vocab,
                                "llama_cpp_version": llama_cpp.__version__, "files": {}}
        for name in FILE_TYPES:
            target = args.out / f"tiny-llama-{name}.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
            params.allow_requantize = True  # write_gguf stores ffn_down as Q8_0
            if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
                raise SystemExit(f"llama.cpp could not write {name}")
            logits = llama_cpp_logits(target, tokens)
            np.save(args.out / f"tiny-llama-{name}.logits.npy", logits.astype(np.float16))
            import gguf

            types = sorted({t.tensor_type.name for t in gguf.GGUFReader(str(target)).tensors})
            meta["files"][name] = {"block_types": types, "bytes": target.stat().st_size}
            print(name, types, target.stat().st_size, flush=True)
    (args.out / "fixtures.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
