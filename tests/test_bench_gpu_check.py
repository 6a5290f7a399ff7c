"""bench/gpu_check.py's CPU parts: its flags, its report, and its steps in a dry run (the kernel
through the g++ shim, a tiny twin of the default model). The GPU run itself cannot run here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from treeserve_testing.scripts import load_script

GPU_CHECK_PY = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def test_flags_default_to_out_and_the_carried_wheels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bench = load_script("treeserve_bench_gpu_check", GPU_CHECK_PY)
    monkeypatch.setenv("OUT", str(tmp_path))
    args = bench.parse_args([])
    assert args.out == tmp_path and args.wheels.name == ".whl" and not args.dry_run
    monkeypatch.delenv("OUT")
    assert bench.parse_args([]).out.parts[-2:] == ("out", "gpu_check")
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "no-such-step"])


def test_a_failing_step_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    bench = load_script("treeserve_bench_gpu_check", GPU_CHECK_PY)
    report = bench.Report(tmp_path, deadline_s=60)
    report.step("broken", lambda: {"x": 1 / 0})
    report.step("fine", lambda: {"ok": True})
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["steps"]["broken"]["ok"] is False and "ZeroDivisionError" in saved["steps"]["broken"]["error"]
    assert saved["steps"]["fine"]["ok"] is True
    assert "ZeroDivisionError" in (tmp_path / "gpu_check.log").read_text()
    late = bench.Report(tmp_path, deadline_s=0)
    late.step("too_late", lambda: {"ok": True})
    assert late.data["steps"]["too_late"] == {"ok": None, "skipped": "past --deadline-s"}


@pytest.mark.skipif(shutil.which("g++") is None, reason="the dry run emulates the kernel with g++")
def test_dry_run_kernel_steps(tmp_path: Path) -> None:
    bench = load_script("treeserve_bench_gpu_check", GPU_CHECK_PY)
    code = bench.main(["--dry-run", "--out", str(tmp_path), "--only", "kernel_accuracy", "kernel_timing"])
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0 and saved["device"] == "cpu" and saved["failed_steps"] == []
    accuracy = saved["steps"]["kernel_accuracy"]
    assert accuracy["ok"] and accuracy["max_error"]["float32"] < 1e-4
    assert {row["case"] for row in accuracy["cases"]} >= {"chain8", "wide16", "deep64", "gqa8x2_batch4"}
    timing = saved["steps"]["kernel_timing"]["cases"]
    assert [(row["nodes"], row["prefix"]) for row in timing] == [(16, 32), (64, 64)]
    assert all(row["kernel_ms"] > 0 and row["sdpa_dense_mask_ms"] > 0 for row in timing)
