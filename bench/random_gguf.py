"""Write a random-weight GGUF in the shape of a real model, for timing an architecture that has
no weights here: float32 through the gguf package's writer (``tests/ops/conftest.py``'s
``write_gguf``), then requantized by llama.cpp into a file type. Its tokenizer is the tests'
small byte-level BPE, padded with unused control tokens to the model's vocabulary, so that
``bench/forward.py --model FILE`` can run it against llama.cpp (the speed figures hold; the
agreement figures of random weights do not mean much).

    python bench/random_gguf.py --shape gemma3-270m --file-type Q4_K_M --out /tmp/gemma3-270m-Q4_K_M.gguf

Bench-only (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
from gguf_fixtures import conftest, llama_quantize  # bench/, the script's folder, is on the path

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # Gemma 3 270M (google/gemma-3-270m's config): 18 layers of width 640, 4 query heads over one
    # KV head of 256, windows of 512 keys on five layers in six.
    "gemma3-270m": ("gemma3", dict(
        vocab_size=262144, dim=640, num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256, ffn_dim=2048,
        max_seq_len=32768, rope_base=1e6, norm_eps=1e-6, qk_norm=True, sliding_window=512,
        window_layers=tuple(i % 6 < 5 for i in range(18)), rope_base_local=10000.0, activation="gelu_tanh",
        post_norms=True, embed_scale=math.sqrt(640))),
    # SmolLM2-135M's shape as phi3 (fused Q/K/V and gate/up in the file).
    "phi3-135m": ("phi3", dict(
        vocab_size=49152, dim=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, ffn_dim=1536,
        max_seq_len=8192, rope_base=1e5, norm_eps=1e-5)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-270m")
    parser.add_argument("--file-type", default="Q4_K_M", help="llama.cpp's LLAMA_FTYPE_MOSTLY_<this>")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    arch, shape = SHAPES[args.shape]
    h = conftest()
    backend = h.train_tiny_bpe()
    tokens, merges = h.bpe_vocab_and_merges(backend)
    padded = tokens + [f"<unused{i}>" for i in range(shape["vocab_size"] - len(tokens))]

    def write_tokenizer(writer: Any) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(padded)
        writer.add_token_merges(merges)
        writer.add_token_types([3 if t.startswith("<|") or t.startswith("<unused") else 1 for t in padded])

    torch.manual_seed(0)
    model = h.make_tiny_model(0, weight_scale=0.02, **shape)
    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:
        source = Path(tmp) / "f32.gguf"
        h.write_gguf(source, model, arch, None, tokenizer=write_tokenizer)
        del model
        llama_quantize(source, args.out, args.file_type)
    print(args.out, args.out.stat().st_size)


if __name__ == "__main__":
    main()
