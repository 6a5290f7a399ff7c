"""bench/gpu_speed.py (issue 41's figures, gpu_check's ``speed`` step) in its CPU dry run on a
tiny Hugging Face folder: every field the device run reports is produced, tokens from the
captured steps equal plain generation's, and the model exported for HF's peers gives HF the
same logits (where transformers is installed). Nothing here is timed against a bar."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from treeserve_testing.scripts import load_script

from .test_loader_hf import write_hf_folder

ROOT = Path(__file__).resolve().parents[2]
speed_bench = load_script("treeserve_bench_gpu_speed", ROOT / "bench" / "gpu_speed.py")


def test_the_dry_run_reports_every_field(tmp_path: Path, tiny_model_factory: Any, tiny_bpe_backend: Any,
                                         chatml_template: str) -> None:
    model = tiny_model_factory(4, vocab_size=tiny_bpe_backend.get_vocab_size(), weight_scale=0.3, max_seq_len=2048)
    folder = tmp_path / "tiny"
    write_hf_folder(folder, model, tiny_bpe_backend, chatml_template, "llama")
    parts = ["decode", "speculative", "tree", "batch", "actors"]
    has_hf = importlib.util.find_spec("transformers") is not None
    out = speed_bench.speed(str(folder), tmp_path / "cache", "cpu", small=True, log=lambda line: None,
                            parts=parts + (["hf"] if has_hf else []))
    assert out["decode_tok_s"]["eager"] > 0 and out["decode_tok_s"]["graphs"] > 0
    assert out["graphs_equal_eager"] == out["prompts"] == 2
    speculative = out["speculative"]
    assert speculative["equal_to_incremental"] == speculative["prompts"] == 2 and speculative["tok_s"] > 0
    assert set(out["tree_vs_step"]) >= {"16", "64", "step_ms"} and out["tree_vs_step"]["eager_calls"] == 0
    assert set(out["batch_inprocess_tok_s"]) == {"2", "4"} and all(v > 0 for v in out["batch_inprocess_tok_s"].values())
    assert out["batch_tok_s"]["1"] > 0 and out["batch_tok_s"]["2"] > 0
    if has_hf:
        assert out["hf_float32_logit_gap"] < 1e-3
        assert out["hf_static_compile_tok_s"] > 0 and out["hf_prompt_lookup_tok_s"] > 0
