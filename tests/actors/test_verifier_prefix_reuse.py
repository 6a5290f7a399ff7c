"""Prefix reuse in the verifier: a released row keeps its K/V, and a prompt admitted to it later
computes only what it does not share with them; the answer is the same bits as on a shard that
prefills every prompt whole.

On a tiny random model in q4_1 (the fused, row-invariant op), two shards in this process take
the same calls, one with ``reuse_prefixes`` and one without: three rows prefilled and stepped,
the middle one released and then padded by steps of its neighbours (its free slots are written
by the pad trees), then prompts that share all, part or none of what the released row held
(its prompt and its generated tokens, as a conversation's next turn would). Every greedy and
seeded token must be the same on both shards, the reusing shard must report the shared tokens
as reused, and the whole-prefill shard none. A shard that trusted more of a row than the row's
record matches (a longest common prefix that ignores where the tokens differ), or that let the
pad trees overwrite a released row's slots, gives other tokens: both were tried and fail here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from treeserve.actors.messages.verifier import PrefillBody, PrefillReply, PrefillRow, StepRow
from treeserve.actors.verifier import VerifierShard
from treeserve.actors.verifier_group import VerifierGroup
from treeserve.actors.verifier_rows import RowTokens
from treeserve.models import load_model
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree
from treeserve.runtime import Runtime

import tiny_model_files as tiny  # registered by conftest.py
from tiny_model_files import FUSED_DIMS, q4_1_or_skip

pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(max_new_tokens=200)
SEEDED = SamplingParams(temperature=0.9, seed=7, max_new_tokens=200)


def test_row_tokens_reuse_the_longest_common_prefix_of_a_matching_record() -> None:
    rows = RowTokens()
    assert rows.reusable(0, [1, 2, 3], committed=0) == 0  # no record
    rows.set(0, [1, 2, 3])
    rows.extend(0, [4, 5])
    assert rows.reusable(0, [1, 2, 3, 4, 9], committed=5) == 4
    assert rows.reusable(0, [1, 2], committed=5) == 2
    assert rows.reusable(0, [7, 2, 3], committed=5) == 0
    assert rows.reusable(0, [1, 2, 3], committed=4) == 0  # the record does not account for the row
    assert rows.reusable(0, [1, 2, 3], committed=5) == 0  # ... and was dropped
    rows.set(1, [6, 6])
    rows.move(1, 2)
    assert rows.reusable(1, [6], committed=0) == 0 and rows.reusable(2, [6, 6], committed=2) == 2
    rows.extend(3, [1])  # no record: still none
    assert rows.reusable(3, [1], committed=1) == 0


def shard_config(model_dir: Path, reuse: bool) -> dict[str, Any]:
    return {"model": str(model_dir), "cache_dir": str(model_dir.parent / "cache"), "dtype": "q4_1", "num_rows": 3,
            "row_capacity": 128, "num_threads": 1, "compile_decode": False, "reuse_prefixes": reuse}


async def prefill(group: VerifierGroup, rows: list[PrefillRow]) -> list[int]:
    """Prefill ``rows``; how many tokens each reused (the reply's ``reused``)."""
    reply = await group.shards[0].ask("prefill", PrefillBody(tuple(rows)).to_wire())
    return [r.reused for r in PrefillReply.from_wire(reply, [r.row for r in rows]).rows]


async def decode(group: VerifierGroup, roots: dict[int, int], params: dict[int, SamplingParams], steps: int,
                 trees: bool = False) -> dict[int, list[int]]:
    """``steps`` verify calls over ``roots``' rows (row -> root token); one-node trees, or with
    ``trees`` a two-node chain of the root and a guess (so that drafts are accepted or not)."""
    out: dict[int, list[int]] = {row: [] for row in roots}
    roots = dict(roots)
    for _ in range(steps):
        rows = []
        for row, root in roots.items():
            tree = TokenTree.from_parents([-1, 0], [root, (root * 7 + 3) % FUSED_DIMS["vocab_size"]]) if trees \
                else TokenTree.root_only(root)
            rows.append(StepRow(row, tree, params[row], f"r{row}"))
        for row, verdict in zip(rows, await group.step(rows, return_states=False)):
            assert verdict.error is None
            out[row.row] += verdict.new_tokens
            roots[row.row] = verdict.new_tokens[-1]
    return out


async def scenario(group: VerifierGroup) -> tuple[list[list[int]], list[list[int]]]:
    """The calls both shards take: (each phase's tokens, each prefill's reused counts)."""
    first = [[5, 9, 14, 5, 9, 21, 33, 2, 17, 60, 61, 62], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53],
             [7, 8, 9, 10, 11, 12, 13]]
    params = {0: GREEDY, 1: SEEDED, 2: GREEDY}
    reused = [await prefill(group, [PrefillRow(i, p) for i, p in enumerate(first)])]
    out = await decode(group, {i: p[-1] for i, p in enumerate(first)}, params, 6, trees=True)
    phases = [out[0], out[1], out[2]]
    held = first[1] + out[1]  # row 1: its prompt (its last token the first root) and what it emitted
    await group.release(1, "r1")
    # Rows 0 and 2 step on while row 1 is free: their blocks bridge it with pad trees.
    more = await decode(group, {0: out[0][-1], 2: out[2][-1]}, params, 4, trees=True)
    phases += [more[0], more[2]]
    # The next turn of row 1's conversation: all it held, and a new message.
    turn = held + [3, 4, 5]
    reused.append(await prefill(group, [PrefillRow(1, turn)]))
    phases.append((await decode(group, {1: turn[-1]}, {1: SEEDED}, 5))[1])
    await group.release(1, "r1")
    # A prompt that shares only the start of the last one; then one that shares nothing.
    for prompt in (turn[:6] + [70, 71, 72], [90, 91, 92, 93]):
        reused.append(await prefill(group, [PrefillRow(1, prompt)]))
        phases.append((await decode(group, {1: prompt[-1]}, {1: GREEDY}, 5))[1])
        await group.release(1, "r1")
    return phases, reused


async def test_a_reused_prefix_gives_the_whole_prefills_tokens(tmp_path: Path) -> None:
    model_dir = tiny.write_tiny_hf_model(tmp_path / "tiny", seed=3, **FUSED_DIMS)
    q4_1_or_skip(load_model(str(model_dir), weight_format="q4_1", cache_dir=tmp_path / "cache",
                            compile_decode=False).model)
    async with Runtime() as rt:
        reusing = VerifierGroup([await rt.spawn(VerifierShard, shard_config(model_dir, True), name="reusing")],
                                timeout_s=60)
        whole = VerifierGroup([await rt.spawn(VerifierShard, shard_config(model_dir, False), name="whole")],
                              timeout_s=60)
        assert (await reusing.shards[0].ask("info"))["prefix_reuse"] is True
        assert (await whole.shards[0].ask("info"))["prefix_reuse"] is False
        got, got_reused = await scenario(reusing)
        want, want_reused = await scenario(whole)
    assert got == want
    assert all(n == 0 for counts in want_reused for n in counts)
    # Nothing held at first; then row 1's whole turn (its 14 prompt tokens and what it emitted
    # but the last, which no step committed), 6 shared tokens, none.
    assert got_reused == [[0, 0, 0], [14 + len(got[1]) - 1], [6], [0]]
