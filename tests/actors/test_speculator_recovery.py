"""SpeculatorActor: a request whose state was lost (the child was SIGKILLed and restarted) never
fails a propose batch; with ``history`` it is rebuilt and drafts as a freshly started request."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from treeserve.actors.speculator import SpeculatorActor, SpeculatorConfig
from treeserve.actors.messages.tree_wire import params_to_wire, tree_from_wire
from treeserve.ops.sampling import SamplingParams
from treeserve.runtime import RemoteError, Runtime, SupervisorConfig

pytestmark = pytest.mark.timeout(120)


import tiny_model_files as tiny  # registered by conftest.py
GREEDY = params_to_wire(SamplingParams())


def entry(rid: str, new_tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {"request_id": rid, "new_tokens": new_tokens, "max_depth": 4, "params": GREEDY, **extra}


async def test_lost_state_gives_root_only_tree_then_history_rebuilds_it(tmp_path: Path) -> None:
    model_dir = tiny.write_tiny_hf_model(tmp_path / "tiny", seed=2)
    config = {"model": str(model_dir), "capacity": 64, "num_threads": 1, "speculators": [
        {"kind": "ngram", "num_draft_tokens": 3}, {"kind": "self", "layers": 2, "expansion": [2, 1, 1]}]}
    prompt = [10, 11, 12, 10, 11]
    async with Runtime() as rt:
        sup = rt.supervisor(SupervisorConfig(heartbeat_misses=6, max_restarts=3, within_s=60, start_timeout_s=90))
        spec = await rt.spawn(SpeculatorActor, config, name="spec", process="child", supervisor=sup)
        await spec.ask("start", {"request_id": "a", "prompt_ids": prompt})
        first = await spec.ask("propose", {"requests": [entry("a", [])]})
        assert first["missing"] == [] and tree_from_wire(first["trees"][0]).num_nodes > 1
        pid = sup.pid("spec")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        # Wait for the restart itself: until the supervisor notices the death (its next tick,
        # late on a loaded machine) the old child still reads as running.
        async with asyncio.timeout(30):
            while sup.num_restarts == 0:
                await asyncio.sleep(0.02)
        await sup.wait_running("spec", 30)
        assert sup.pid("spec") != pid and sup.num_restarts == 1

        emitted = [12, 13]  # what the verifier emitted after the first step (drafts + bonus)
        lost = await spec.ask("propose", {"requests": [entry("a", emitted), entry("b", [])]})
        assert lost["missing"] == ["a", "b"]
        root_only = tree_from_wire(lost["trees"][0])
        assert root_only.tokens.tolist() == [13] and root_only.num_nodes == 1
        assert lost["trees"][1] is None  # no tokens, no history: the root is unknown

        history = prompt + emitted
        recovered = await spec.ask("propose", {"requests": [entry("a", emitted, history=history)]})
        assert recovered["missing"] == []
        await spec.ask("start", {"request_id": "fresh", "prompt_ids": history})
        fresh = await spec.ask("propose", {"requests": [entry("fresh", [])]})
        tree, expected = tree_from_wire(recovered["trees"][0]), tree_from_wire(fresh["trees"][0])
        assert tree.num_nodes > 1 and tree.root_token == 13
        assert tree.tokens.tolist() == expected.tokens.tolist() and tree.parents.tolist() == expected.parents.tolist()

        # The rebuilt state is kept: the next propose advances it like any other request.
        nxt = await spec.ask("propose", {"requests": [entry("a", [14]), entry("fresh", [14])]})
        assert nxt["missing"] == [] and nxt["trees"][0] == nxt["trees"][1]
        full = tree_from_wire(nxt["trees"][0])
        assert full.num_nodes > 2
        # max_nodes bounds the merged tree (each speculator drafts within its share of it).
        for budget in (2, 5):
            cut = await spec.ask("propose", {"requests": [entry("fresh", [], max_nodes=budget)]})
            small = tree_from_wire(cut["trees"][0])
            assert 1 <= small.num_nodes <= budget and small.root_token == full.root_token
        # Out of step (an earlier propose carrying [15] never arrived): the history wins.
        resync = await spec.ask("propose", {"requests": [entry("a", [16], history=history + [14, 15, 16])]})
        await spec.ask("start", {"request_id": "fresh2", "prompt_ids": history + [14, 15, 16]})
        fresh2 = await spec.ask("propose", {"requests": [entry("fresh2", [])]})
        assert resync["missing"] == [] and resync["trees"] == fresh2["trees"]
        await spec.ask("release", {"request_id": "a"})
        again = await spec.ask("propose", {"requests": [entry("a", [15])]})
        assert again["missing"] == ["a"]
        with pytest.raises(RemoteError, match="token ids"):
            await spec.ask("propose", {"requests": [entry("a", [10_000])]})


def test_speculator_config_validation() -> None:
    good = {"model": "m", "speculators": [{"kind": "ngram"}, {"kind": "self", "layers": 2, "expansion": [1, 2]}]}
    assert len(SpeculatorConfig.from_wire(good).speculators) == 2
    for bad, message in [
        ({**good, "speculators": [{"kind": "magic"}]}, "kind"),
        ({**good, "speculators": [{"kind": "self", "layers": 2}]}, "expansion"),
        ({**good, "speculators": [{"kind": "self", "layers": 0, "expansion": [1]}]}, "layers"),
        ({**good, "speculators": [{"kind": "ngram", "max_ngram": 0}]}, "max_ngram"),
        ({**good, "speculators": [{"kind": "ngram", "depth": 3}]}, "unknown keys"),
        ({**good, "speculators": [{"kind": "model", "expansion": [1]}]}, "model"),
        ({**good, "dtype": "int3"}, "dtype"),  # int8 is a weight format now
        ({**good, "colour": 1}, "unknown"),
        ({"speculators": []}, "model"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculatorConfig.from_wire(bad)


async def test_forget_traffic_empties_the_suffix_index_for_later_requests(tmp_path: Path) -> None:
    """The suffix index learns from every request; after ``forget_traffic`` a new request over
    the same tokens drafts nothing from before, while one in flight keeps its index."""
    model_dir = tiny.write_tiny_hf_model(tmp_path / "tiny", seed=2)
    config = {"model": str(model_dir), "capacity": 64, "num_threads": 1,
              "speculators": [{"kind": "suffix", "num_draft_tokens": 3}]}
    async with Runtime() as rt:
        spec = await rt.spawn(SpeculatorActor, config, name="spec", process="child")
        await spec.ask("start", {"request_id": "a", "prompt_ids": [5, 6, 7, 8, 9]})
        await spec.ask("start", {"request_id": "b", "prompt_ids": [1, 6, 7]})
        learned = tree_from_wire((await spec.ask("propose", {"requests": [entry("b", [])]}))["trees"][0])
        assert learned.tokens.tolist() == [7, 8, 9]  # from request a's tokens
        await spec.ask("forget_traffic", None)
        await spec.ask("start", {"request_id": "c", "prompt_ids": [1, 6, 7]})
        fresh = await spec.ask("propose", {"requests": [entry("c", []), entry("b", [])]})
        assert tree_from_wire(fresh["trees"][0]).tokens.tolist() == [7]
        assert tree_from_wire(fresh["trees"][1]).tokens.tolist() == [7, 8, 9]
        # The new index learns again: request c's tokens draft for the next one.
        await spec.ask("propose", {"requests": [entry("c", [2, 3])]})
        await spec.ask("start", {"request_id": "d", "prompt_ids": [9, 7, 2]})
        again = await spec.ask("propose", {"requests": [entry("d", [])]})
        assert tree_from_wire(again["trees"][0]).tokens.tolist() == [2, 3]


async def test_a_released_request_leaves_its_last_tokens_in_the_suffix_index(tmp_path: Path) -> None:
    """A request decoded without proposals (an adaptive server at plain decoding) is seen by
    its speculators only at ``start`` and ``release``: the release's ``new_tokens`` go into the
    shared index, so the next request over the same prompt drafts the answer. Speculators whose
    state dies with the request (n-gram) are not fed."""
    model_dir = tiny.write_tiny_hf_model(tmp_path / "tiny", seed=2)
    config = {"model": str(model_dir), "capacity": 64, "num_threads": 1,
              "speculators": [{"kind": "ngram", "num_draft_tokens": 3}, {"kind": "suffix", "num_draft_tokens": 4}]}
    async with Runtime() as rt:
        spec = await rt.spawn(SpeculatorActor, config, name="spec", process="child")
        await spec.ask("start", {"request_id": "a", "prompt_ids": [5, 6, 7]})
        await spec.ask("release", {"request_id": "a", "new_tokens": [21, 22, 23, 24]})
        await spec.ask("release", {"request_id": "a", "new_tokens": [30]})  # idempotent: a is gone
        await spec.ask("start", {"request_id": "b", "prompt_ids": [1, 6, 7]})
        tree = tree_from_wire((await spec.ask("propose", {"requests": [entry("b", [])]}))["trees"][0])
        assert tree.tokens.tolist() == [7, 21, 22, 23, 24]  # request a's answer, as deep as max_depth allows
        await spec.ask("start", {"request_id": "c", "prompt_ids": [1, 6, 7]})
        await spec.ask("release", {"request_id": "c"})  # nothing new: the index keeps a's answer alone
        await spec.ask("start", {"request_id": "d", "prompt_ids": [9, 6, 7]})
        again = tree_from_wire((await spec.ask("propose", {"requests": [entry("d", [])]}))["trees"][0])
        assert again.tokens.tolist() == [7, 21, 22, 23, 24]
