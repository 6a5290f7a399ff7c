"""``preload``: a prestarted verifier reads its model before its parent asks for it. The next
load of the same model takes that copy, once; preloading never pulls or converts (that stays
with the parent, so two processes never write one cache)."""

from __future__ import annotations

from pathlib import Path

import torch

from treeserve.ops.loaders import load as load_module
from treeserve.ops.loaders.load import converted_dir_for, load_model, preload


def _tiny_gguf(tmp_path: Path, tiny_model_factory, tiny_bpe_backend, write_tiny_gguf) -> Path:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_model_factory(seed=5, vocab_size=tiny_bpe_backend.get_vocab_size()), "llama",
                    tiny_bpe_backend)
    return path


def test_preload_reads_only_what_an_earlier_start_converted(
    tmp_path: Path, tiny_model_factory, tiny_bpe_backend, write_tiny_gguf
) -> None:
    gguf = _tiny_gguf(tmp_path, tiny_model_factory, tiny_bpe_backend, write_tiny_gguf)
    cache = str(tmp_path / "cache")
    assert not preload(str(gguf), cache)
    assert not converted_dir_for(gguf, cache).exists()  # nothing was converted by the preload
    assert not preload("smollm2-135m-instruct", str(tmp_path / "empty-cache"))  # not pulled: no download
    assert not (tmp_path / "empty-cache").exists()

    first = load_model(str(gguf), cache_dir=cache)  # the parent's start: converts
    assert first.was_converted
    assert preload(str(gguf), cache)
    taken = load_model(str(gguf), cache_dir=cache)
    again = load_model(str(gguf), cache_dir=cache)
    assert taken.model is not again.model  # the preloaded copy serves one load only
    tokens = torch.tensor([[5, 9, 31, 2]])
    for loaded in (taken, again):
        assert not loaded.was_converted
        assert torch.equal(loaded.model(tokens, loaded.model.new_cache(1, 8)),
                           first.model(tokens, first.model.new_cache(1, 8)))
    assert not load_module._preloaded


def test_preload_is_taken_by_its_own_model_and_cache_only(
    tmp_path: Path, tiny_model_factory, tiny_bpe_backend, write_tiny_gguf
) -> None:
    gguf = _tiny_gguf(tmp_path, tiny_model_factory, tiny_bpe_backend, write_tiny_gguf)
    cache, other = str(tmp_path / "cache"), str(tmp_path / "other")
    load_model(str(gguf), cache_dir=cache)
    assert preload(str(gguf), cache)
    load_model(str(gguf), cache_dir=other)  # another cache: reads its own copy
    assert (str(gguf), cache) in load_module._preloaded
    load_model(str(gguf), cache_dir=cache, dtype=torch.bfloat16)  # not float32: not the preloaded copy
    assert (str(gguf), cache) in load_module._preloaded
    load_module._preloaded.clear()


def test_preloaded_format_buffers_give_the_same_model(
    tmp_path: Path, tiny_model_factory, tiny_bpe_backend, write_tiny_gguf
) -> None:
    gguf = _tiny_gguf(tmp_path, tiny_model_factory, tiny_bpe_backend, write_tiny_gguf)
    cache = str(tmp_path / "cache")
    reference = load_model(str(gguf), cache_dir=cache, weight_format="int8", compile_decode=False)  # saves the buffers
    assert preload(str(gguf), cache, weight_format="int8")
    assert len(load_module._preloaded_buffers) == 1
    taken = load_model(str(gguf), cache_dir=cache, weight_format="int8", compile_decode=False)
    assert not load_module._preloaded_buffers and not load_module._preloaded
    assert taken.model.weight_format == "int8"
    tokens = torch.tensor([[5, 9, 31, 2]])
    assert torch.equal(taken.model(tokens, taken.model.new_cache(1, 8)),
                       reference.model(tokens, reference.model.new_cache(1, 8)))
