"""Decode-ahead in the verifier: one ``step`` call of ``decode_steps`` k emits exactly what k
one-step calls emit, and leaves the cache where they leave it.

Two shards over the same tiny float32 model in this process: one answers k-step calls, the
other one-step calls, for a greedy row, a seeded sampled row and a row that stops on a stop
token mid-call; a one-step call after the k-step ones continues from the right place; the
greedy row's text is the model's own incremental decoding. A verifier that reuses the first
root for every step, that commits nothing between steps, or that places a seeded row's
randomness at the call's first position fails this. The states a k-step call returns are the
one-step calls' (one per new token, the roots'), so a feature drafter can follow a row that
decodes ahead. Bodies that carry a multi-node tree with ``decode_steps`` > 1 are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from treeserve.actors.messages.verifier import PrefillRow, RowVerdict, StepBody, StepRow
from treeserve.actors.verifier import VerifierShard
from treeserve.actors.verifier_group import VerifierGroup
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental
from treeserve.ops.token_tree import TokenTree
from treeserve.runtime import ActorError, Runtime

import tiny_model_files as tiny  # registered by conftest.py

pytestmark = pytest.mark.timeout(180)

PROMPTS = [[5, 9, 14, 5, 9], [40, 41, 42, 43, 44], [7, 8]]
K = 5
CALLS = 3


def shard_config(model_dir: Path) -> dict[str, Any]:
    return {"model": str(model_dir), "cache_dir": str(model_dir.parent / "cache"), "num_rows": 4,
            "row_capacity": 64, "num_threads": 1}


def single(token: int) -> TokenTree:
    return TokenTree.from_parents([-1], [token])


async def run(group: VerifierGroup, params: list[SamplingParams], decode_steps: int
              ) -> tuple[list[list[int]], list[np.ndarray]]:
    """Prefill every prompt, then ``CALLS * K`` tokens per row (fewer for a row that stopped) in
    calls of ``decode_steps`` steps (with states), then one more one-step call; each row's
    tokens and the states of those calls."""
    await group.prefill([PrefillRow(i, p) for i, p in enumerate(PROMPTS)])
    emitted: list[list[int]] = [[] for _ in PROMPTS]
    states: list[list[np.ndarray]] = [[] for _ in PROMPTS]
    stopped: set[int] = set()
    for _ in range(CALLS * K // decode_steps):
        rows = [StepRow(i, single(emitted[i][-1] if emitted[i] else PROMPTS[i][-1]), params[i], f"r{i}")
                for i in range(len(PROMPTS)) if i not in stopped]
        verdicts: list[RowVerdict] = await group.step(rows, return_states=True, decode_steps=decode_steps)
        for row, verdict in zip(rows, verdicts):
            assert verdict.error is None and verdict.accepted == (0,) and 1 <= len(verdict.new_tokens) <= decode_steps
            assert verdict.states is not None and verdict.states.shape[0] == len(verdict.new_tokens)
            emitted[row.row] += verdict.new_tokens
            states[row.row].append(verdict.states)
            if params[row.row].is_stop(verdict.new_tokens[-1]):
                stopped.add(row.row)
            else:
                assert len(verdict.new_tokens) == decode_steps  # only a stop token ends a row early
    rows = [StepRow(i, single(emitted[i][-1]), params[i], f"r{i}") for i in range(len(PROMPTS)) if i not in stopped]
    for row, verdict in zip(rows, await group.step(rows, return_states=False)):
        emitted[row.row] += verdict.new_tokens
    return emitted, [np.concatenate(parts) for parts in states]


async def test_k_steps_in_one_call_emit_what_k_calls_emit(tmp_path: Path) -> None:
    model_dir = tiny.write_tiny_hf_model(tmp_path / "tiny", seed=4)
    greedy = SamplingParams(max_new_tokens=64)
    reference = generate_incremental(tiny.make_tiny_model(seed=4), PROMPTS[0], greedy).token_ids
    # A stop token the third row first emits in the middle of its second call.
    third = generate_incremental(tiny.make_tiny_model(seed=4), PROMPTS[2], greedy).token_ids
    stop_at = third[next(i for i in range(K, 2 * K - 1) if third[i] not in third[:i])]
    params = [greedy, SamplingParams(temperature=0.9, seed=11, max_new_tokens=64),
              SamplingParams(stop_token_ids=(stop_at,), max_new_tokens=64)]
    async with Runtime() as rt:
        ahead = VerifierGroup([await rt.spawn(VerifierShard, shard_config(model_dir), name="ahead")], timeout_s=60)
        plain = VerifierGroup([await rt.spawn(VerifierShard, shard_config(model_dir), name="plain")], timeout_s=60)
        got, got_states = await run(ahead, params, K)
        want, want_states = await run(plain, params, 1)
        assert got == want
        for mine, theirs in zip(got_states, want_states):
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)
        assert got[0] == reference[:CALLS * K + 1]
        assert got[2][-1] == stop_at and K < len(got[2]) < 2 * K  # stopped in its second call's middle
        assert len(set(got[1])) > 1  # the sampled row really sampled

        bad = StepRow(0, TokenTree.from_parents([-1, 0], [3, 4]), greedy, "r0")
        with pytest.raises(ValueError, match="one-node trees"):
            StepBody((bad,), decode_steps=2)
        forged = StepBody((StepRow(0, single(3), greedy, "r0"),)).to_wire()
        with pytest.raises(ActorError, match="one-node trees"):
            await ahead.shards[0].ask("step", {**forged, "decode_steps": 2, "rows": [
                {**forged["rows"][0], "tree": StepBody((bad,)).to_wire()["rows"][0]["tree"]}]})
