"""bench/prefill.py on a tiny random model: every mode runs and the report adds up."""

from __future__ import annotations

from pathlib import Path

from tests.ops.conftest import make_tiny_model
from treeserve_testing.scripts import load_script

PREFILL_PY = Path(__file__).resolve().parents[1] / "bench" / "prefill.py"


def test_measure_reports_every_mode_and_the_ratios() -> None:
    bench = load_script("treeserve_bench_prefill", PREFILL_PY)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 12]
    report = bench.measure(make_tiny_model(0), prompts, repeats=2)
    assert (report["burst"], report["prompt_tokens"], report["longest_prompt"]) == (3, 20, 12)
    ms = report["median_ms"]
    assert set(ms) == {"serial", "batched", "one_prompt_with_head", "one_prompt_no_head"}
    assert all(value >= 0 for value in ms.values())
    assert report["batched_over_serial"] > 0 and report["no_head_over_with_head"] > 0

