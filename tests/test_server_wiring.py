"""The server's composition root (``treeserve/server_wiring.py``): each actor's typed config
carries the ``ServerConfig`` values meant for it."""

from __future__ import annotations

from dataclasses import fields, replace

from treeserve.actors.scheduler.types import SchedulerConfig
from treeserve.actors.verifier_config import VerifierConfig
from treeserve.runtime import RestartStrategy
from treeserve import server_wiring as wiring
from treeserve.server_config import ServerConfig

CONFIG = ServerConfig(num_rows=3, row_capacity=777, max_wait_s=4.5, max_tree_nodes=9, step_timeout_s=12.0,
                      adaptive_speculation=False, max_prefill_tokens=333, max_decode_steps=5, scheduler="ssjf",
                      tp=2, dtype="bfloat16", cache_dir="/c", compile_decode=False, compile_in_background=True,
                      max_restarts=7, restart_window_s=9.0, heartbeat_interval_s=0.25)


def test_every_scheduler_setting_the_server_carries_reaches_the_scheduler() -> None:
    config = wiring.scheduler_config(CONFIG, vocab_size=101, use_states=True)
    shared = set(wiring.shared_fields(CONFIG, SchedulerConfig, {"policy": "scheduler"}))
    # By name: a setting added to both classes needs no wiring (and these must not drift apart).
    assert shared >= {"num_rows", "row_capacity", "max_wait_s", "max_tree_nodes", "step_timeout_s",
                      "adaptive_speculation", "max_prefill_tokens", "max_decode_steps", "policy"}
    for name in shared - {"policy"}:
        assert getattr(config, name) == getattr(CONFIG, name), name
    assert config.policy == "ssjf" and config.vocab_size == 101 and config.use_states
    untouched = {f.name for f in fields(SchedulerConfig)} - shared - {"vocab_size", "use_states"}
    assert all(getattr(config, name) == getattr(SchedulerConfig, name) for name in untouched)


def test_a_setting_both_configs_name_alike_needs_no_wiring() -> None:
    # The rule shared_fields applies, on a ServerConfig with one more value set.
    assert wiring.shared_fields(replace(CONFIG, num_rows=11), SchedulerConfig)["num_rows"] == 11
    assert "num_rows" not in wiring.shared_fields(CONFIG, VerifierConfig, {"num_rows": "no_such_field"})


def test_verifier_shards_supervisors_and_the_gateway() -> None:
    shards = wiring.verifier_configs(CONFIG, ("cpu", "cpu"), "tcp://127.0.0.1:9", num_threads=1)
    assert [s.tp_rank for s in shards] == [0, 1] and all(s.tp_size == 2 for s in shards)
    for shard in shards:
        assert (shard.dtype, shard.cache_dir, shard.num_rows, shard.row_capacity) == ("bfloat16", "/c", 3, 777)
        assert shard.compile_decode is False and shard.compile_in_background is True
        assert VerifierConfig.from_wire(shard.to_wire()) == shard
    together = wiring.supervisor_config(CONFIG, RestartStrategy.ONE_FOR_ALL)
    assert (together.strategy, together.max_restarts, together.within_s, together.heartbeat_interval_s) == (
        RestartStrategy.ONE_FOR_ALL, 7, 9.0, 0.25)
    gateway = wiring.gateway_config(CONFIG, vocab_size=101)
    assert gateway.context_length == 777 - 9 and gateway.vocab_size == 101 and gateway.scheduler_timeout_s == 12.0
