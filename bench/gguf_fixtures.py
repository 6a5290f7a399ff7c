"""Write the GGUF test fixtures: a small llama model in every block type, with llama.cpp's own
logits on them, so CI compares treeserve against llama.cpp without it.

A tiny model (2 layers, width 256, so every K-quant fits) with the test suite's BPE tokenizer:
random weights, then :data:`TRAIN_STEPS` Adam steps on the tokenizer's corpus. Random weights
alone give flat logits (the top two a median 3-4% of the logits' range apart, where llama.cpp's
own int8 activations already move the logits by up to 2-3% of it), so top-1 agreement would
measure ties; five steps make the next token clear (a median gap of 30%) and leave the network
far from a lookup table. It is written in float32 by the gguf package's writer
(``tests/ops/conftest.py``'s ``write_gguf``), then requantized by llama.cpp
(``llama_model_quantize``) into each file type of :data:`FILE_TYPES`, once more with Llama 3.1's rope scaling (``rope_freqs``) in Q8_0, and as a
``qwen2`` model (Q/K/V biases, an untied head), a ``qwen3`` one (per-head Q/K norms), a ``phi3``
one (fused Q/K/V and gate/up tensors) and a ``gemma3`` one (:data:`GEMMA3`) in Q4_K_M;
each of these six architectures once more with its weight matrices spread over all eight block
types (``tiny-<arch>-mixed.gguf``: every tensor as llama.cpp's ``pure`` requantization into its
type wrote it, :func:`mixed_fixture`);
and tiny float32 models with other tokenizers: SentencePiece (with a space prefix, as Llama 2's,
and without, as Gemma's) and byte-level BPE with the ``llama-bpe`` and ``qwen2`` pre-tokenizers,
with llama.cpp's token ids on :data:`TOKENIZER_TEXTS`.
llama.cpp then scores the corpus's first :data:`NUM_TOKENS` tokens on each file (``logits_all``),
and the logits are saved beside it. Bench-only (llama-cpp-python builds in minutes; see
``bench/RESULTS.md`` for the flags):

    python bench/gguf_fixtures.py [--out tests/ops/data/gguf] [--only-mixed]

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
GEMMA3 = dict(qk_norm=True, num_kv_heads=1, head_dim=128, sliding_window=24, window_layers=(True, False), rope_base=1e6,
              rope_base_local=10000.0, rope_factors=(8.0,) * 64, activation="gelu_tanh", post_norms=True, embed_scale=16.0)
"""The gemma3 fixture's shape: what a Gemma 3 4B has, small (per-head Q/K norms, one KV head of
a size other than width / heads, norms on the attention's and MLP's outputs, GELU, embeddings
times sqrt(256)), with a window of 24 keys on its first layer (rope base 10000) and a global
second layer (base 1e6, linear scaling 8), so that 160 tokens cross the window many times."""


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


def train(model: Any, tokens: list[int], steps: int = TRAIN_STEPS) -> None:
    """``steps`` steps of next-token cross-entropy on ``tokens`` (the forward without its
    inference-mode decorator, so that gradients flow)."""
    import torch

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    x = torch.tensor([tokens])
    for _ in range(steps):
        logits = type(model).forward.__wrapped__(model, x, model.new_cache(1, len(tokens)))
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), x[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


TOKENIZER_TEXTS = (
    "Hello world", " leading space", "two  spaces and\ttabs\n\nnew lines", "numbers 3.14159 and 2024-12-05",
    "def f(x):\n    return x ** 2  # code", "Café naïve résumé déjà vu", "日本語のテキスト and 中文", "emoji 🙂🚀 end",
    "<s>special</s> text <unk> here", "quick brown fox jumps over the lazy dog", "   ", "",
    "I'm sure they'LL say: don't!", "1234567890 and 42, 3.5e10", "tabs\t\tand  \n  mixed\r\n lines  ",
)
"""Texts llama.cpp tokenizes with each tokenizer fixture: Unicode, digits (runs longer than
three, which split differently per pre-tokenizer), code, contractions, runs of whitespace and
line ends, characters outside the vocabulary (byte fallback) and special-token text."""
BPE_PRE_TYPES = ("llama-bpe", "qwen2")
"""The byte-level BPE pre-tokenizers checked besides ``smollm``: Llama 3's and Qwen2's (their
regexes split digits, contractions and whitespace differently), each on a vocabulary whose merges
cross every split (:func:`unsplit_bpe`)."""


def unsplit_bpe(helpers: Any) -> Any:
    """A byte-level BPE trained with no pre-tokenizer splits (600 tokens), on the texts and the
    corpus: its merges join digits into runs, words with the spaces and punctuation around them,
    and whitespace with line ends, so that each pre-tokenizer's splits change the ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([helpers.TOKENIZER_CORPUS, *(TOKENIZER_TEXTS * 8)], trainer)
    return backend


def bpe_pre_fixture(helpers: Any, backend: Any, out: Path, pre: str) -> dict[str, Any]:
    """A tiny llama GGUF whose byte-level BPE tokenizer (``backend``'s vocabulary and merges) has
    the pre-tokenizer ``pre``, and llama.cpp's token ids for :data:`TOKENIZER_TEXTS`."""
    import llama_cpp

    tokens, merges = helpers.bpe_vocab_and_merges(backend)

    def write_tokenizer(writer: Any) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])

    model = helpers.make_tiny_model(SEED, vocab_size=len(tokens), dim=64, num_layers=1, num_heads=4, num_kv_heads=2,
                                    head_dim=16, ffn_dim=128, max_seq_len=256)
    target = out / f"tiny-bpe-{pre}-F32.gguf"
    helpers.write_gguf(target, model, "llama", None, tokenizer=write_tokenizer)
    llm = llama_cpp.Llama(model_path=str(target), vocab_only=True, verbose=False)
    ids = [llm.tokenize(text.encode(), add_bos=False, special=True) for text in TOKENIZER_TEXTS]
    return {"file": target.name, "texts": list(TOKENIZER_TEXTS), "ids": ids, "bytes": target.stat().st_size}


def sentencepiece_fixture(helpers: Any, out: Path, tmp: Path, *, space_prefix: bool = True) -> dict[str, Any]:
    """A tiny llama GGUF whose tokenizer is SentencePiece-style (``tokenizer.ggml.model`` =
    ``llama``: pieces with "▁" for spaces, scores, byte fallback tokens; a space put before the
    text, or not, as Gemma's converter writes it), and llama.cpp's token ids for
    :data:`TOKENIZER_TEXTS` on it."""
    import gguf
    import llama_cpp
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator([helpers.TOKENIZER_CORPUS], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    pieces = [p for p, _ in sorted(trained.get_vocab().items(), key=lambda item: item[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *(-float(i) for i in range(len(pieces)))]  # earlier merges first

    def write_tokenizer(writer: Any) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_add_space_prefix(space_prefix)

    model = helpers.make_tiny_model(SEED, vocab_size=len(tokens), dim=64, num_layers=1, num_heads=4, num_kv_heads=2,
                                    head_dim=16, ffn_dim=128, max_seq_len=256)
    target = out / ("tiny-spm-F32.gguf" if space_prefix else "tiny-spm-no-prefix-F32.gguf")
    helpers.write_gguf(target, model, "llama", None, tokenizer=write_tokenizer)
    llm = llama_cpp.Llama(model_path=str(target), vocab_only=True, verbose=False)
    ids = [llm.tokenize(text.encode(), add_bos=False, special=True) for text in TOKENIZER_TEXTS]
    assert gguf.GGUFReader(str(target)).fields["tokenizer.ggml.model"].contents() == "llama"
    return {"file": target.name, "texts": list(TOKENIZER_TEXTS), "ids": ids, "bytes": target.stat().st_size}


def llama_quantize(source: Path, target: Path, file_type: str, *, pure: bool = False) -> None:
    """llama.cpp's requantization of ``source`` into ``target`` (``LLAMA_FTYPE_MOSTLY_<file_type>``;
    ``pure``: every tensor in the file type's own block type, the head and embedding included)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.allow_requantize = True  # write_gguf stores ffn_down as Q8_0
    params.pure = pure
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not write {target.name}")


MIXED_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
"""Every integer block type treeserve reads, each with the llama.cpp file type whose ``pure``
requantization stores every tensor in it (the K-quants through their ``_S`` file types)."""
PURE_FILE_TYPES = {"Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S"}


def mixed_types(names: list[str], offset: int) -> dict[str, str]:
    """The block type of each of a file's weight matrices (``names``, in file order) in a mixed
    fixture: :data:`MIXED_TYPES` in turn from ``offset``, so that every type holds at least one
    matrix (a llama-shaped file of two layers has 14 linears and its embedding) and each
    architecture puts them on other tensors."""
    return {name: MIXED_TYPES[(i + offset) % len(MIXED_TYPES)] for i, name in enumerate(names)}


def splice(source: Path, parts: dict[str, Path], types: dict[str, str], target: Path) -> None:
    """``target``: ``source``'s metadata and tensors, with each tensor named in ``types`` taken, as
    llama.cpp's bytes, from the file ``parts[type]`` (``source`` requantized by llama.cpp with
    every tensor in that type)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    stored = {kind: {t.name: t for t in gguf.GGUFReader(str(path)).tensors} for kind, path in parts.items()}
    writer = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        chosen = stored[types[tensor.name]][tensor.name] if tensor.name in types else tensor
        assert chosen.tensor_type.name == types.get(tensor.name, tensor.tensor_type.name), (tensor.name, chosen.tensor_type)
        writer.add_tensor(tensor.name, np.asarray(chosen.data), raw_dtype=chosen.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def mixed_fixture(source: Path, target: Path, offset: int, tokens: list[int]) -> dict[str, Any]:
    """``source`` (a float32 GGUF) with its weight matrices in every block type
    (:func:`mixed_types`, from llama.cpp's ``pure`` requantizations), and llama.cpp's logits on
    ``tokens`` beside it: its ``fixtures.json`` entry, with the type of each tensor."""
    import gguf

    names = [t.name for t in gguf.GGUFReader(str(source)).tensors if len(t.shape) == 2]
    types = mixed_types(names, offset)
    parts = {}
    for kind in MIXED_TYPES:
        parts[kind] = target.with_name(f"{target.stem}-pure-{kind}.gguf")
        llama_quantize(source, parts[kind], PURE_FILE_TYPES.get(kind, kind), pure=True)
    try:
        splice(source, parts, types, target)
    finally:
        for path in parts.values():
            path.unlink()
    np.save(target.with_suffix(".logits.npy"), llama_cpp_logits(target, tokens).astype(np.float16))
    held = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(target)).tensors if t.name in types}
    assert held == types, (held, types)
    print(target.name, sorted(set(held.values())), target.stat().st_size, flush=True)
    return {"file": target.name, "block_types": sorted(set(held.values())), "tensor_types": held,
            "bytes": target.stat().st_size}


def quantize_and_score(source: Path, target: Path, file_type: str, tokens: list[int]) -> dict[str, Any]:
    """:func:`llama_quantize`, and llama.cpp's logits on ``tokens`` saved beside the file: its
    entry in ``fixtures.json``."""
    import gguf

    llama_quantize(source, target, file_type)
    np.save(target.with_suffix(".logits.npy"), llama_cpp_logits(target, tokens).astype(np.float16))
    types = sorted({t.tensor_type.name for t in gguf.GGUFReader(str(target)).tensors})
    print(target.name, types, target.stat().st_size, flush=True)
    return {"file": target.name, "block_types": types, "bytes": target.stat().st_size}


def main() -> None:
    import llama_cpp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only-mixed", action="store_true",
                        help="write only the mixed-type files, keeping the other fixtures and their entries")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    helpers = conftest()
    backend = helpers.train_tiny_bpe()
    vocab = backend.get_vocab_size()
    corpus = backend.encode(helpers.TOKENIZER_CORPUS).ids
    tokens = corpus[:NUM_TOKENS]

    def trained(steps: int = TRAIN_STEPS, **overrides: Any) -> Any:
        model = helpers.make_tiny_model(SEED, vocab_size=vocab, weight_scale=0.06, **{**DIMS, **overrides})
        train(model, corpus[:200], steps)
        return model

    from treeserve.ops.loaders.hf import hf_rope_factors

    # Llama 3.1's rope scaling: per-frequency factors (the llama3 formula on a short original
    # context, so that they span 1 to 8), trained on its own rope so its next tokens are as clear.
    factors = hf_rope_factors({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}, helpers.make_tiny_model(SEED, **DIMS).config.rope_base, DIMS["head_dim"])
    # name: (GGUF architecture, training steps, shape). qwen2 (Q/K/V biases, an untied head),
    # qwen3 (per-head Q/K norms), phi3 and gemma3 train eight steps, where five left two near
    # ties (gaps of 0.3% of the range).
    architectures: dict[str, tuple[str, int, dict[str, Any]]] = {
        "llama": ("llama", TRAIN_STEPS, {}), "llama3": ("llama", TRAIN_STEPS, {"rope_factors": factors}),
        "qwen2": ("qwen2", 8, {"qkv_bias": True, "tie_embeddings": False}), "qwen3": ("qwen3", 8, {"qk_norm": True}),
        "phi3": ("phi3", 8, {}), "gemma3": ("gemma3", 8, GEMMA3)}
    meta: dict[str, Any] = {"tokens": tokens, "dims": DIMS, "seed": SEED, "train_steps": TRAIN_STEPS, "vocab_size": vocab,
                            "llama_cpp_version": llama_cpp.__version__, "files": {}}
    if args.only_mixed:
        meta = json.loads((args.out / "fixtures.json").read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        def source(model: Any, arch: str, name: str) -> Path:
            path = Path(tmp) / f"{name}-f32.gguf"
            helpers.write_gguf(path, model, arch, backend)
            return path

        def fixture(model: Any, arch: str, name: str, file_type: str) -> dict[str, Any]:
            return quantize_and_score(source(model, arch, name), args.out / f"{name}-{file_type}.gguf", file_type, tokens)

        # Every architecture with its weight matrices in every block type, one file each.
        meta["mixed"] = {}
        for offset, (name, (arch, steps, overrides)) in enumerate(architectures.items()):
            model = trained(steps, **overrides)
            entry = mixed_fixture(source(model, arch, f"tiny-{name}"), args.out / f"tiny-{name}-mixed.gguf", offset, tokens)
            meta["mixed"][name] = {**entry, "train_steps": steps}
        if not args.only_mixed:
            model = trained()
            for file_type in FILE_TYPES:
                meta["files"][file_type] = fixture(model, "llama", "tiny-llama", file_type)
            meta["llama3"] = {**fixture(trained(rope_factors=factors), "llama", "tiny-llama3", "Q8_0"),
                              "rope_factors": list(factors)}
            for name in ("qwen2", "qwen3", "phi3", "gemma3"):
                arch, steps, overrides = architectures[name]
                meta[name] = {**fixture(trained(steps, **overrides), arch, f"tiny-{name}", "Q4_K_M"), "train_steps": steps}
            meta["sentencepiece"] = sentencepiece_fixture(helpers, args.out, Path(tmp))
            meta["sentencepiece_no_prefix"] = sentencepiece_fixture(helpers, args.out, Path(tmp), space_prefix=False)
            unsplit = unsplit_bpe(helpers)
            for pre in ("smollm", *BPE_PRE_TYPES):
                meta[f"bpe_{pre}"] = bpe_pre_fixture(helpers, unsplit, args.out, pre)
    if not args.only_mixed:
        # The byte-level BPE (smollm pre-tokenizer) of the other files, on the same texts.
        bpe = llama_cpp.Llama(model_path=str(args.out / "tiny-llama-Q8_0.gguf"), vocab_only=True, verbose=False)
        meta["byte_level_bpe"] = {"file": "tiny-llama-Q8_0.gguf", "texts": list(TOKENIZER_TEXTS),
                                  "ids": [bpe.tokenize(t.encode(), add_bos=False, special=True) for t in TOKENIZER_TEXTS]}
    (args.out / "fixtures.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
