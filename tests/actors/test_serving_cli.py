"""``treeserve generate`` end to end on a tiny model folder: the embedded server path, --json, --stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treeserve.cli import main

import tiny_model_files as tiny  # registered by conftest.py

pytestmark = pytest.mark.timeout(300)


def _generate(capsys: pytest.CaptureFixture[str], folder: Path, *flags: str) -> dict:
    with pytest.raises(SystemExit) as exited:
        main(["generate", "w5 w9 w11", "--model", str(folder), "--raw", "--max-tokens", "24", "--speculate", "none",
              "--json", *flags])
    assert exited.value.code == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_and_stop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # generate sizes its one row as max_tokens + 2048 tokens (at least 512): the model must hold that.
    folder = tiny.write_tiny_hf_model(tmp_path / "tiny", max_seq_len=4096)
    full = _generate(capsys, folder)
    assert full["finish_reason"] in ("length", "stop") and full["matched_stop"] is None and len(full["text"]) > 12
    stop = full["text"][len(full["text"]) // 2:][:3]
    cut = _generate(capsys, folder, "--stop", stop)
    assert cut["text"] == full["text"][:full["text"].index(stop)] and cut["matched_stop"] == stop
    assert cut["finish_reason"] == "stop" and cut["token_ids"] == full["token_ids"][:len(cut["token_ids"])]
    with pytest.raises(SystemExit) as exited:
        main(["generate", "hi", "--model", str(folder), "--in-process", "--stop", "x"])
    assert exited.value.code == 2 and "--stop needs the server path" in capsys.readouterr().err
