"""The server's composition root (``treeserve/server_wiring.py``): each actor's typed config
carries the ``ServerConfig`` values meant for it."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest

from treeserve.actors.scheduler.types import SchedulerConfig, SchedulerSettings
from treeserve.actors.verifier_config import VerifierConfig
from treeserve.runtime import RestartStrategy
from treeserve import server_wiring as wiring
from treeserve.cli import build_parser
from treeserve.cli_common import UserError
from treeserve.cli_serve import scheduler_settings
from treeserve.ops.remaining_head import load_remaining_head
from treeserve.server_config import ServerConfig

SETTINGS = SchedulerSettings(policy="ssjf", max_wait_s=4.5, max_queue=77, predict_timeout_s=3.0, max_predict_batch=5,
                             adaptive_speculation=False, max_prefill_tokens=333, max_decode_steps=5, decode_ahead_s=0.2,
                             preempt_rows=2, max_preemptions=3)
CONFIG = ServerConfig(num_rows=3, row_capacity=777, max_tree_nodes=9, step_timeout_s=12.0, scheduling=SETTINGS,
                      tp=2, dtype="bfloat16", cache_dir="/c", compile_decode=False, compile_in_background=True,
                      max_restarts=7, restart_window_s=9.0, heartbeat_interval_s=0.25)


def test_every_scheduler_setting_and_shared_shape_reaches_the_scheduler() -> None:
    config = wiring.scheduler_config(CONFIG, vocab_size=101, use_states=True)
    # The settings travel whole: a new one needs no wiring.
    for f in fields(SchedulerSettings):
        assert getattr(config, f.name) == getattr(SETTINGS, f.name) != getattr(SchedulerSettings(), f.name), f.name
    # The shapes shared with the verifier and gateway, by name.
    assert (config.num_rows, config.row_capacity, config.max_tree_nodes, config.step_timeout_s) == (3, 777, 9, 12.0)
    assert config.vocab_size == 101 and config.use_states


def test_a_setting_both_configs_name_alike_needs_no_wiring() -> None:
    # The rule shared_fields applies, on a ServerConfig with one more value set.
    assert wiring.shared_fields(replace(CONFIG, num_rows=11), SchedulerConfig)["num_rows"] == 11
    assert "num_rows" not in wiring.shared_fields(CONFIG, VerifierConfig, {"num_rows": "no_such_field"})


def test_the_scheduling_flags_are_the_settings_fields_with_the_same_defaults() -> None:
    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("serve"))  # type: ignore[union-attr]
    group = next(g for g in serve._action_groups if g.title == "scheduling")
    names = {f.name for f in fields(SchedulerSettings)}
    assert group._group_actions and all(a.dest in names for a in group._group_actions)
    assert scheduler_settings(parser.parse_args(["serve"])) == ServerConfig().scheduling == SchedulerSettings()
    flags = ["serve", "--scheduler", "ssjf", "--max-wait-s", "4.5", "--no-adaptive", "--max-prefill-tokens", "333",
             "--decode-ahead", "5", "--max-queue", "77", "--preempt-rows", "4", "--max-preemptions", "2"]
    assert scheduler_settings(parser.parse_args(flags)) == SchedulerSettings(
        policy="ssjf", max_wait_s=4.5, adaptive_speculation=False, max_prefill_tokens=333, max_decode_steps=5,
        max_queue=77, preempt_rows=4, max_preemptions=2)
    with pytest.raises(UserError, match="preemption"):
        scheduler_settings(parser.parse_args(["serve", "--preempt-rows", "2"]))  # fcfs has no lengths to compare
    with pytest.raises(UserError, match="max_queue"):
        scheduler_settings(parser.parse_args(["serve", "--max-queue", "0"]))


def test_verifier_shards_supervisors_and_the_gateway() -> None:
    shards = wiring.verifier_configs(CONFIG, ("cpu", "cpu"), "tcp://127.0.0.1:9", num_threads=1)
    assert [s.tp_rank for s in shards] == [0, 1] and all(s.tp_size == 2 for s in shards)
    for shard in shards:
        # The running rows, then the park rows of preempted requests.
        assert (shard.dtype, shard.cache_dir, shard.num_rows, shard.row_capacity) == ("bfloat16", "/c", 3 + 2, 777)
        assert shard.compile_decode is False and shard.compile_in_background is True
        assert VerifierConfig.from_wire(shard.to_wire()) == shard
    together = wiring.supervisor_config(CONFIG, RestartStrategy.ONE_FOR_ALL)
    assert (together.strategy, together.max_restarts, together.within_s, together.heartbeat_interval_s) == (
        RestartStrategy.ONE_FOR_ALL, 7, 9.0, 0.25)
    gateway = wiring.gateway_config(CONFIG, vocab_size=101)
    assert gateway.context_length == 777 - 9 and gateway.vocab_size == 101 and gateway.scheduler_timeout_s == 12.0


def test_the_remaining_head_is_wired_with_preemption_for_the_model_it_fits(tmp_path: Path) -> None:
    preempting = ServerConfig(scheduling=SchedulerSettings(policy="ssjf", preempt_rows=2))
    head, unfit = wiring.remaining_head(preempting, 576)  # the default model: the shipped head
    assert head is not None and head.dim == 576 and unfit is None
    assert wiring.remaining_head(replace(preempting, remaining_head="none"), 576) == (None, None)
    assert wiring.remaining_head(ServerConfig(), 576) == (None, None)  # no preemption, no re-prediction
    head, unfit = wiring.remaining_head(replace(preempting, model="other/model"), 64)
    assert head is None and unfit is not None and "no re-prediction head" in unfit
    load_remaining_head().save(tmp_path / "head.npz")
    with pytest.raises(ValueError, match="576"):  # a head given for another model's width is refused
        wiring.remaining_head(replace(preempting, model="other/model", remaining_head=str(tmp_path / "head.npz")), 64)
    config = wiring.scheduler_config(preempting, 100, False, load_remaining_head())
    assert config.remaining_head is not None and config.preempt_rows == 2
