"""GGUF round trips: tiny llama (Q/K permuted like llama.cpp) and qwen2 (bias, untied) models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from treeserve.ops.loaders.gguf import permute_for_llama_rope, read_gguf, unpermute_llama_rope
from treeserve.ops.model import Transformer
from treeserve.ops.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Tokenizers split 2024 days; café 🙂 <|im_start|>user"


def logits_of(model: Transformer, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens]), model.new_cache(1, len(tokens)))[0]


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("qwen2", {"qkv_bias": True, "tie_embeddings": False})],
)
def test_gguf_round_trip_gives_same_logits(
    tmp_path: Path, tiny_model_factory, tiny_bpe_backend, write_tiny_gguf, arch, overrides
) -> None:
    vocab = tiny_bpe_backend.get_vocab_size()
    source = tiny_model_factory(seed=3, vocab_size=vocab, **overrides)
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(path, source, arch, tiny_bpe_backend)
    loaded = read_gguf(path)
    assert loaded.architecture == arch
    assert loaded.config == source.config
    model = Transformer.from_state_dict(loaded.config, loaded.state_dict)
    tokens = [5, 77, 200, 3, 150, 9, 11]
    got = logits_of(model, tokens)
    assert (got - logits_of(expected, tokens)).abs().max().item() <= 1e-5
    # Q8_0 only touched ffn_down, so the source model is close but not identical.
    assert (got - logits_of(source, tokens)).abs().max().item() < 0.5

    if arch == "llama":
        # The permutation matters: skipping the undo step changes the logits.
        wrong = read_gguf(path, unpermute_qk=False)
        bad = Transformer.from_state_dict(wrong.config, wrong.state_dict)
        assert (logits_of(bad, tokens) - got).abs().max().item() > 1e-2

    tokenizer = Tokenizer.from_gguf(path)
    assert tokenizer.encode(TEXT) == tiny_bpe_backend.encode(TEXT).ids
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    assert {0, 2} <= tokenizer.stop_ids
    assert tokenizer.encode("<|im_start|>")[0] == 1  # specials are matched as one token
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    weight = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    permuted = permute_for_llama_rope(weight, 4)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(unpermute_llama_rope(permuted, 4), weight)


def test_incremental_detokenizer_never_splits_characters(tiny_bpe_backend) -> None:
    tokenizer = Tokenizer(tiny_bpe_backend, bos_id=1, eos_id=2, chat_template=None)
    text = "naïve 日本 🙂 ok"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.finish())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    # Byte-level tokens of the emoji alone do not decode to a complete character.
    naive = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in naive)


def _retyped_gguf(source: Path, target: Path, *, arch: str | None = None, q2k_tensor: str | None = None,
                  rotary: int | None = None) -> None:
    """A copy of ``source`` under another architecture name, with one tensor stored as Q2_K
    (random bytes: a block type treeserve does not read), or with rope over ``rotary`` of each
    head's dimensions."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    old_arch = reader.fields["general.architecture"].contents()
    new_arch = arch or old_arch
    writer = gguf.GGUFWriter(str(target), new_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        name = key.replace(f"{old_arch}.", f"{new_arch}.", 1)
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, kind)
    if rotary is not None:
        writer.add_rope_dimension_count(rotary)
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if tensor.name == q2k_tensor:
            raw = np.random.default_rng(0).integers(0, 256, size=(shape[0], shape[1] // 256 * 84), dtype=np.uint8)
            writer.add_tensor(tensor.name, raw, raw_dtype=gguf.GGMLQuantizationType.Q2_K)  # a byte shape
        elif tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(tensor.name, np.asarray(tensor.data).reshape(shape))
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("change", ["arch", "block_type", "partial_rotary"])
def test_unsupported_ggufs_fail_in_one_line_before_converting(
    tmp_path: Path, tiny_model_factory, tiny_bpe_backend, write_tiny_gguf, capsys, change: str
) -> None:
    """An unsupported architecture or block type: ``generate`` prints one ``treeserve: error:``
    line naming what is supported, exits with status 2, and leaves nothing in the cache."""
    from treeserve.cli import main
    from treeserve.ops.loaders.gguf import GGUFFormatError
    from treeserve.ops.loaders.load import load_model

    source = tiny_model_factory(seed=3, vocab_size=tiny_bpe_backend.get_vocab_size(), ffn_dim=256)
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good, source, "llama", tiny_bpe_backend)
    bad = tmp_path / "bad.gguf"
    if change == "arch":
        _retyped_gguf(good, bad, arch="gemma9")
        expected = r"unsupported GGUF architecture 'gemma9'; supported: llama, qwen2, qwen3"
    elif change == "partial_rotary":  # as Phi-4-mini's: refused, not served with a whole-head rope
        _retyped_gguf(good, bad, rotary=4)
        expected = r"GGUF rope over 4 of each head's 8 dimensions \(partial rotary\) is not supported"
    else:
        _retyped_gguf(good, bad, q2k_tensor="blk.0.ffn_down.weight")
        expected = r"tensor blk\.0\.ffn_down\.weight is stored as Q2_K.*supported block types: F32, F16, BF16, Q4_0"
    cache = tmp_path / "cache"
    with pytest.raises(GGUFFormatError, match=expected):
        load_model(bad, cache_dir=cache)
    assert not (cache / "converted").exists() or not any((cache / "converted").iterdir())
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(bad), "--cache-dir", str(cache), "--in-process", "hello"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("treeserve: error: ") and "Traceback" not in "\n".join(err)
    assert len([line for line in err if not line.startswith("[treeserve]")]) == 1


def test_serve_reports_an_unsupported_gguf_on_health(tmp_path: Path, tiny_model_factory, tiny_bpe_backend,
                                                      write_tiny_gguf) -> None:
    """A server given an unsupported GGUF fails its start with the one-line reason, and
    ``/health`` says ``failed`` with that reason (not ``starting``) until it closes."""
    import asyncio

    import aiohttp

    from treeserve.ops.loaders.registry import ModelLoadError
    from treeserve.server import Server, ServerConfig

    source = tiny_model_factory(seed=3, vocab_size=tiny_bpe_backend.get_vocab_size())
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good, source, "llama", tiny_bpe_backend)
    bad = tmp_path / "bad.gguf"
    _retyped_gguf(good, bad, arch="gemma9")

    async def run() -> tuple[int, dict]:  # type: ignore[type-arg]
        server = Server(ServerConfig(model=str(bad), cache_dir=str(tmp_path / "cache"), bind=None, http="127.0.0.1:0"))
        try:
            with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gemma9'"):
                await server.start()
            async with aiohttp.ClientSession() as session, session.get(f"{server.http_url}/health") as response:
                return response.status, await response.json()
        finally:
            await server.aclose()

    status, body = asyncio.run(run())
    assert status == 503 and body["status"] == "failed"
    assert any("unsupported GGUF architecture 'gemma9'; supported: llama, qwen2, qwen3" in f for f in body["failures"])
