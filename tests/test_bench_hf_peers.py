"""bench/hf_peers.py on a tiny random Llama saved by transformers with an offline byte-level BPE
tokenizer (ChatML template): every peer generates and is timed, prompt lookup's greedy tokens
equal the eager and static-cache paths' (assisted greedy decoding is lossless), one peer's failure
leaves the others running, and the CLI prints the same JSON. CPU only, no compilation; no timing
is asserted beyond being positive."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from treeserve_testing.scripts import load_script

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 8
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Repetitive prompts, so that prompt lookup finds n-grams to draft from.
PROMPTS = ["abc abc abc abc abc", "the cat sat on the mat, the cat sat on the"]

hf_peers = load_script("treeserve_bench_hf_peers", ROOT / "bench" / "hf_peers.py")


def build_tiny_hf_folder(folder: Path) -> Path:
    """A random 2-layer ``LlamaForCausalLM`` (hidden 64) and a byte-level BPE tokenizer over the
    256 byte symbols plus ChatML specials, saved by ``save_pretrained``: no network."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = BackendTokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # scaled so that greedy text varies (the default init repeats one token)
        for name, param in model.named_parameters():
            if param.dim() == 2 and "embed" not in name:
                param.normal_(0, 2 / param.shape[1] ** 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_folder(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def result(tiny_dir: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    return hf_peers.hf_peer_timings(tiny_dir, PROMPTS, max_new_tokens=MAX_NEW, device="cpu", dtype="float32",
                                    compile=False, log=lambda line: None)


def greedy_tokens_agree(result: dict[str, Any], peer: str, reference: str) -> bool:
    """Whether ``peer`` generated, for every prompt, the same tokens as ``reference``."""
    return all(a["token_ids"] == b["token_ids"]
               for a, b in zip(result[peer]["per_prompt"], result[reference]["per_prompt"], strict=True))


def test_every_peer_generates_and_is_timed(result: dict[str, Any]) -> None:
    json.dumps(result)  # JSON-able as it is
    assert result["transformers"] == transformers.__version__ and result["torch"] == torch.__version__
    assert result["device"] == "cpu" and result["dtype"] == "float32" and result["chat_template"]
    im_start, im_end = 256, 257  # the specials after the 256 byte symbols
    for prompt in result["prompts"]:  # one user turn, then the assistant's generation prompt
        ids = prompt["prompt_ids"]
        assert ids[0] == im_start and ids.count(im_start) == 2 and ids.count(im_end) == 1
        assert len(ids) == len(prompt["prompt"].encode()) + 3 + len("user\n\nassistant\n")  # 3 specials
    for name in hf_peers.PEERS:
        peer = result[name]
        assert "error" not in peer, peer
        assert peer["tok_s"] > 0 and peer["seconds"] > 0 and peer["warmup_s"] > 0
        assert peer["tokens"] == sum(p["new_tokens"] for p in peer["per_prompt"]) > 0
        assert all(0 < len(p["token_ids"]) <= MAX_NEW and p["deterministic"] for p in peer["per_prompt"])
    assert result["static_compile"]["cache_implementation"] == "static"
    assert result["static_compile"]["compiled"] is False
    assert result["prompt_lookup"]["prompt_lookup_num_tokens"] == hf_peers.PROMPT_LOOKUP_TOKENS


def test_prompt_lookup_is_lossless(result: dict[str, Any]) -> None:
    assert [len(p["token_ids"]) for p in result["eager"]["per_prompt"]] == [MAX_NEW] * len(PROMPTS)  # no early EOS
    assert greedy_tokens_agree(result, "static_compile", "eager")
    assert greedy_tokens_agree(result, "prompt_lookup", "eager")
    assert greedy_tokens_agree(result, "prompt_lookup", "static_compile")
    corrupted = json.loads(json.dumps(result))  # the check catches a differing token
    corrupted["prompt_lookup"]["per_prompt"][-1]["token_ids"][-1] += 1
    assert not greedy_tokens_agree(corrupted, "prompt_lookup", "eager")


def test_one_failing_peer_leaves_the_others(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(hf_peers, "_run_static_compile", broken)
    result = hf_peers.hf_peer_timings(tiny_dir, PROMPTS[:1], max_new_tokens=2, device="cpu", dtype="float32",
                                      compile=False, log=lambda line: None)
    assert result["static_compile"] == {"error": "RuntimeError: boom"}
    assert result["eager"]["tokens"] > 0 and result["prompt_lookup"]["tokens"] > 0


def test_cli_prints_json(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert hf_peers.main([str(tiny_dir), "--device", "cpu", "--dtype", "float32", "--max-new", "2",
                          "--no-compile", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["compile"] is False and printed["max_new_tokens"] == 2
    assert all(printed[name]["tokens"] > 0 for name in hf_peers.PEERS)
