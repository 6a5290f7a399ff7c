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


def test_in_process_generate_runs_the_server_paths_pieces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny.write_tiny_hf_model(tmp_path / "tiny", max_seq_len=4096)
    settings_file = folder / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text(encoding="utf-8"))
    # A template that writes its own BOS, for a tokenizer that adds one: a path that renders the
    # template and then encodes it with the tokenizer's BOS would show a second one.
    settings.update(add_bos_token=True, chat_template="<bos>{% for m in messages %} w5 {{ m['content'] }}{% endfor %}"
                                                      "{% if add_generation_prompt %} w6{% endif %}")
    settings_file.write_text(json.dumps(settings), encoding="utf-8")

    def generate(*flags: str) -> dict:
        with pytest.raises(SystemExit) as exited:
            main(["generate", "w7 w9 w11", "--model", str(folder), "--format", "float32", "--max-tokens", "16",
                  "--json", *flags])
        assert exited.value.code == 0
        return json.loads(capsys.readouterr().out)

    for speculate in ("tree", "none"):
        served = generate("--speculate", speculate)
        local = generate("--speculate", speculate, "--in-process")
        assert local["num_prompt_tokens"] == served["num_prompt_tokens"] == 6  # <bos> w5 w7 w9 w11 w6: one BOS
        assert local["token_ids"] == served["token_ids"] and local["finish_reason"] == served["finish_reason"]
        assert local["text"] == served["text"]
    assert local["mean_accepted_per_step"] == served["mean_accepted_per_step"] == 1.0  # none: one token per step


def test_serve_refuses_the_oracle_policy_and_a_distilled_speculator_without_its_file(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--scheduler", "sjf-oracle"])  # needs true lengths: a benchmark's bound only
    assert exited.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--speculator", "distilled"])
    assert exited.value.code == 2 and "distilled:PATH" in capsys.readouterr().err


def test_serve_flag_defaults_are_the_server_configs() -> None:
    from treeserve.actors.scheduler.actor import SchedulerConfig
    from treeserve.actors.scheduler.types import SchedulerSettings
    from treeserve.cli import build_parser
    from treeserve.server import ServerConfig

    args, config = build_parser().parse_args(["serve"]), ServerConfig()
    assert args.num_rows == config.num_rows == SchedulerConfig().num_rows
    assert (args.row_capacity, args.max_prefill_tokens, args.max_wait_s, args.policy, args.bind, args.tp) == (
        config.row_capacity, config.scheduling.max_prefill_tokens, config.scheduling.max_wait_s,
        config.scheduling.policy, config.bind, config.tp)
    with pytest.raises(ValueError, match="sjf-oracle"):
        SchedulerSettings(policy="sjf-oracle")
    with pytest.raises(ValueError, match="needs 'path'"):
        ServerConfig(speculators=({"kind": "distilled", "expansion": [2]},))


def test_generate_names_its_limits_and_the_flags_that_raise_them(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny.write_tiny_hf_model(tmp_path / "tiny", max_seq_len=4096)

    def refused(*flags: str) -> str:
        with pytest.raises(SystemExit) as exited:
            main(["generate", "--model", str(folder), "--raw", "--speculate", "none", *flags])
        assert exited.value.code == 2
        return capsys.readouterr().err

    assert "--max-tokens must be at least 1, got -5" in refused("w5", "--max-tokens", "-5")
    long_prompt = " ".join(["w7"] * 600)  # 600 tokens: past a --context of 512
    error = refused(long_prompt, "--max-tokens", "4", "--context", "512")
    assert "the context holds 512 tokens" in error and "--context N raises" in error
    with pytest.raises(SystemExit) as exited:
        main(["generate", long_prompt, "--model", str(folder), "--raw", "--speculate", "none", "--max-tokens", "4",
              "--context", "700", "--json"])
    assert exited.value.code == 0
    assert json.loads(capsys.readouterr().out)["num_prompt_tokens"] == 600
