"""``VerifierGroup``: tensor-parallel fan-out behind one object.

In this process, with stand-in shards: every shard receives the one body the group built (the
same object), marked ``rank0_answers`` when there is more than one shard; rank 0's reply comes
back as typed verdicts (stacked hidden states split per row); a reply for other rows, without
a field or with states that do not add up is a ``MalformedReply``; a dead rank's retryable
error wins over the error it caused in another.

With real shards in child processes (tiny float32 model, gloo): a TP=2 group gives the same
verdicts as a TP=1 group (hidden states within float tolerance), and rank 1 answers ``None``
to a ``rank0_answers`` call while it still answers in full without it.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from treeserve.actors.messages.checks import MalformedReply
from treeserve.actors.messages.verifier import PrefillRow, RowVerdict, StepRow
from treeserve.actors.verifier import VerifierShard
from treeserve.actors.verifier_group import VerifierGroup
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental
from treeserve.ops.token_tree import TokenTree
from treeserve.runtime import Actor, ActorError, Runtime, RuntimeConfig, SupervisorConfig, handler
from treeserve.transport.wire import ErrorCode

import tiny_model_files as tiny  # registered by conftest.py

pytestmark = pytest.mark.timeout(180)

DIM = 4


class StandInShard(Actor):
    """Answers like a verifier rank (one token 7 per row, states of ``DIM`` zeros), records every
    body it gets; ``reply`` (rank 0's next step reply) or ``error`` override the answer."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.bodies: list[Any] = []
        self.reply: Any = None
        self.error: ActorError | None = None

    def _answer(self, body: Any) -> bool:
        self.bodies.append(body)
        if self.error is not None:
            raise self.error
        return not (self.rank > 0 and body.get("rank0_answers"))

    @handler
    async def prefill(self, body: Any) -> Any:
        if not self._answer(body):
            return None
        rows = [{"row": r["row"], "length": len(r["prompt_ids"]) - 1} for r in body["rows"]]
        return {"rows": rows}

    @handler
    async def step(self, body: Any) -> Any:
        if not self._answer(body):
            return None
        if self.reply is not None:
            return self.reply
        rows = [{"row": r["row"], "accepted": [0], "bonus_token": 7, "new_tokens": [7], "num_states": 1}
                for r in body["rows"]]
        return {"rows": rows, "states": np.zeros((len(rows), DIM), dtype=np.float32)}

    @handler
    async def release(self, body: Any) -> None:
        self._answer(body)


def root_row(row: int, root: int = 3) -> StepRow:
    return StepRow(row, TokenTree.from_parents([-1], [root]), SamplingParams(), f"r{row}")


async def test_the_group_builds_one_body_for_every_shard_and_answers_with_rank_0() -> None:
    async with Runtime() as rt:
        shards = [StandInShard(rank) for rank in range(3)]
        group = VerifierGroup([await rt.node.host(f"rank{s.rank}", s) for s in shards], timeout_s=10)
        verdicts = await group.step([root_row(0), root_row(2)], return_states=True)
        assert [(v.row, v.accepted, v.new_tokens, v.error) for v in verdicts] == \
            [(0, (0,), (7,), None), (2, (0,), (7,), None)]
        assert all(v.states is not None and v.states.shape == (1, DIM) for v in verdicts)
        await group.prefill([PrefillRow(1, [5, 6, 7])])
        await group.release(1, "r1")
        for method in range(3):  # step, prefill, release: one body object, whatever the rank
            bodies = [s.bodies[method] for s in shards]
            assert all(b is bodies[0] for b in bodies)
        assert [b.get("rank0_answers") for b in shards[0].bodies] == [True, True, None]

        alone = StandInShard(0)
        single = VerifierGroup([await rt.node.host("alone", alone)], timeout_s=10)
        await single.step([root_row(0)], return_states=False)
        assert "rank0_answers" not in alone.bodies[0]  # one shard: nothing to mark


@pytest.mark.parametrize(("reply", "return_states", "message"), [
    ({"rows": [{"row": 1, "accepted": [0], "new_tokens": [7]}]}, False, "asked for rows"),
    ({"rows": [{"row": 0, "accepted": [0]}]}, False, "lacks"),
    ({"rows": [{"row": 0, "accepted": [0], "new_tokens": [7]}]}, True, "lacks"),  # no num_states
    ({"rows": [{"row": 0, "accepted": [0], "new_tokens": ["7"]}]}, False, "new_tokens"),
    ({"rows": [{"row": 0, "accepted": [0], "new_tokens": [7], "num_states": 2}],
      "states": np.zeros((1, DIM), dtype=np.float32)}, True, "add up"),
    ({"trees": []}, False, "no list of row maps"),
])
async def test_a_reply_that_does_not_answer_the_rows_asked_is_malformed(
    reply: Any, return_states: bool, message: str
) -> None:
    async with Runtime() as rt:
        shard = StandInShard(0)
        group = VerifierGroup([await rt.node.host("rank0", shard)], timeout_s=10)
        shard.reply = reply
        with pytest.raises(MalformedReply, match=message):
            await group.step([root_row(0)], return_states=return_states)


async def test_a_failed_row_and_stacked_states_come_back_per_row() -> None:
    async with Runtime() as rt:
        shard = StandInShard(0)
        group = VerifierGroup([await rt.node.host("rank0", shard)], timeout_s=10)
        states = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM)
        shard.reply = {"rows": [{"row": 0, "accepted": [0, 1], "new_tokens": [4, 5], "num_states": 2},
                                {"row": 1, "error": "numerical failure"},
                                {"row": 2, "accepted": [0], "new_tokens": [6], "num_states": 1}], "states": states}
        zero, failed, two = await group.step([root_row(0), root_row(1), root_row(2)], return_states=True)
    assert failed == RowVerdict(1, error="numerical failure")
    assert zero.states is not None and np.array_equal(zero.states, states[:2]) and zero.new_tokens == (4, 5)
    assert two.states is not None and np.array_equal(two.states, states[2:])


async def test_a_dead_rank_wins_over_the_error_it_caused_in_another() -> None:
    async with Runtime() as rt:
        shards = [StandInShard(rank) for rank in range(2)]
        group = VerifierGroup([await rt.node.host(f"rank{s.rank}", s) for s in shards], timeout_s=10)
        shards[0].error = ActorError("broken collective", code=ErrorCode.INTERNAL)
        shards[1].error = ActorError("rank 1 died", code=ErrorCode.ACTOR_DEAD)
        with pytest.raises(ActorError) as failed:
            await group.step([root_row(0)], return_states=False)
    assert failed.value.retryable and failed.value.message == "rank 1 died"


# ---------------------------------------------------------------------- real shards, TP=2 == TP=1
ROW_CAPACITY = 64
PROMPTS = [[5, 9, 14, 5, 9], [40, 41, 42, 43, 44], [7, 8]]
NUM_STEPS = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shard_config(model_dir: Path, rank: int, size: int, port: int) -> dict[str, Any]:
    return {"model": str(model_dir), "cache_dir": str(model_dir.parent / "cache"), "tp_rank": rank, "tp_size": size,
            "dist_init": f"tcp://127.0.0.1:{port}", "num_rows": 4, "row_capacity": ROW_CAPACITY, "num_threads": 1}


async def drive(group: VerifierGroup, references: list[list[int]]) -> list[Any]:
    """Prefill every prompt, then verify chains that draft the next two reference tokens (all
    accepted by a greedy row, so accepted paths are longer than the root), with states."""
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.8, seed=5)]
    outputs: list[Any] = [await group.prefill([PrefillRow(i, p, return_states=True) for i, p in enumerate(PROMPTS)])]
    emitted: list[list[int]] = [[] for _ in PROMPTS]
    for _ in range(NUM_STEPS):
        rows = []
        for i, prompt in enumerate(PROMPTS):
            root = emitted[i][-1] if emitted[i] else prompt[-1]
            drafts = references[i][len(emitted[i]):len(emitted[i]) + 2] if params[i].is_greedy else []
            rows.append(StepRow(i, TokenTree.from_parents(list(range(-1, len(drafts))), [root, *drafts]),
                                params[i], f"r{i}"))
        verdicts = await group.step(rows, return_states=True)
        for i, verdict in enumerate(verdicts):
            emitted[i] += verdict.new_tokens
        outputs.append(verdicts)
    for i in range(len(PROMPTS)):
        await group.release(i, f"r{i}")
    return outputs


async def test_a_tp2_group_verifies_as_tp1_and_rank_1_answers_nothing(tmp_path: Path) -> None:
    model_dir = tiny.write_tiny_hf_model(tmp_path / "tiny", seed=4)
    model = tiny.make_tiny_model(seed=4)
    params = SamplingParams(max_new_tokens=3 * NUM_STEPS)
    references = [generate_incremental(model, p, params).token_ids for p in PROMPTS]
    port = free_port()
    config = RuntimeConfig(supervisor=SupervisorConfig(start_timeout_s=90), default_timeout_s=90)
    async with Runtime(config) as rt:
        tp1, rank0, rank1 = await asyncio.gather(
            rt.spawn(VerifierShard, shard_config(model_dir, 0, 1, port), name="tp1", process="child"),
            *(rt.spawn(VerifierShard, shard_config(model_dir, r, 2, port), name=f"tp2r{r}", process="child")
              for r in (0, 1)),
        )
        prefill = {"rows": [{"row": 3, "prompt_ids": [5, 6, 7], "return_states": True}]}
        marked = await asyncio.gather(*(r.ask("prefill", {**prefill, "rank0_answers": True}) for r in (rank0, rank1)))
        assert marked[0]["rows"] == [{"row": 3, "length": 2, "num_states": 2}] and marked[1] is None
        unmarked = await asyncio.gather(*(r.ask("prefill", prefill) for r in (rank0, rank1)))
        assert unmarked[1]["rows"] == unmarked[0]["rows"]  # a direct call still gets every rank's rows
        want = await drive(VerifierGroup([tp1], timeout_s=60), references)
        got = await drive(VerifierGroup([rank0, rank1], timeout_s=60), references)
    assert max(len(v.accepted) for v in want[1]) == 3  # the drafts were accepted
    for want_prefill, got_prefill in zip(want[0], got[0]):
        np.testing.assert_allclose(got_prefill, want_prefill, atol=1e-4)
    for want_step, got_step in zip(want[1:], got[1:]):
        assert [(v.row, v.accepted, v.new_tokens, v.error) for v in got_step] == \
            [(v.row, v.accepted, v.new_tokens, v.error) for v in want_step]
        for w, g in zip(want_step, got_step):
            np.testing.assert_allclose(g.states, w.states, atol=1e-4)
