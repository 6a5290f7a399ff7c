"""A preempted request resumes exactly: through the whole server (tiny random model, float32,
greedy), a long request that is preempted for a far shorter one, parked in a park row and moved
back, writes the same tokens as the same request served alone.

The check is not one any server passes: with ``KVCache.move_row`` copying only the keys (the
values left behind), the resumed answer differs (tried: the assertion on the tokens failed).

The second test has the prompt predictor call both requests short, so only the hidden-state
re-prediction (a head that reads every state as "runs to the cap") can preempt the long one:
asking the verifier for states mid-answer must not change a token either. Without the head the
long request keeps its row (asserted), so the preemption there is the head's doing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from treeserve.actors.scheduler.types import SchedulerSettings
from treeserve.client import Client
from treeserve.ops.remaining_head import RemainingHead
from treeserve.server import Server, ServerConfig

import tiny_model_files as tiny  # registered by tests/actors/conftest.py

LONG_ANSWER_PROMPT = [3, 4]  # predicted long by the head below
SHORT_ANSWER_PROMPT = list(range(20, 44))  # predicted short
LONG_MAX_TOKENS = 200


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def predictor_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_prompt_len_predictor(tmp_path_factory.mktemp("predictor") / "tiny.npz",
                                           [2, 3, 3, 4, 20, 24, 28, 30], [190, 200, 180, 200, 4, 3, 4, 5], 200)


@pytest.fixture(scope="module")
def all_short_predictor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_prompt_len_predictor(tmp_path_factory.mktemp("predictor") / "short.npz",
                                           [2, 3, 3, 4, 20, 24, 28, 30], [5, 4, 5, 4, 4, 3, 4, 5], 200)


@pytest.fixture(scope="module")
def to_the_cap_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    width = tiny.TINY_CONFIG["dim"] + 2
    path = tmp_path_factory.mktemp("head") / "head.npz"
    RemainingHead("tiny", width - 2, 16, 200, np.zeros(width), np.ones(width), np.zeros(width), 20.0,
                  np.zeros(width), 1.0).save(path)
    return path


def config(folder: Path, predictor: Path, preempt_rows: int, head: Path | None = None) -> ServerConfig:
    return ServerConfig(
        model=str(folder), bind="tcp://127.0.0.1:0", num_rows=1, row_capacity=256, max_tree_nodes=16,
        speculators=(), heartbeat_interval_s=0.25, step_timeout_s=60.0, dtype="float32",
        scheduling=SchedulerSettings(policy="ssjf", max_wait_s=600.0, preempt_rows=preempt_rows),
        predictor=str(predictor), remaining_head=None if head is None else str(head),
    )


async def long_then_short(server_config: ServerConfig) -> tuple[list[str], list[int], dict[str, Any]]:
    """The long request, then the short one once the long streams: which finished first, the
    long one's tokens and the scheduler's stats."""
    async with Server(server_config) as server, Client(server.endpoint) as client:
        finished: list[str] = []
        tokens: list[int] = []
        long = client.stream(LONG_ANSWER_PROMPT, speculate="none", max_tokens=LONG_MAX_TOKENS)
        async for chunk in long:  # it holds the only running row from its first token on
            tokens.extend(chunk.token_ids)
            break
        short = asyncio.ensure_future(client.generate(SHORT_ANSWER_PROMPT, speculate="none", max_tokens=8))
        short.add_done_callback(lambda _: finished.append("short"))
        async for chunk in long:
            tokens.extend(chunk.token_ids)
        finished.append("long")
        await asyncio.wait_for(short, 60)
        stats = await server.scheduler.ask("stats")
    return finished, tokens, stats


async def alone(folder: Path, predictor: Path) -> list[int]:
    async with Server(config(folder, predictor, 0)) as server, Client(server.endpoint) as client:
        done = await client.generate(LONG_ANSWER_PROMPT, speculate="none", max_tokens=LONG_MAX_TOKENS)
    assert len(done.token_ids) > 100  # long enough to be preempted (the rules keep the last 64 tokens)
    return list(done.token_ids)


async def test_a_preempted_request_resumes_with_the_tokens_it_would_have_written(
        tiny_folder: Path, predictor_path: Path) -> None:
    expected = await alone(tiny_folder, predictor_path)
    finished, tokens, stats = await long_then_short(config(tiny_folder, predictor_path, 1))
    assert stats["num_preempted"] >= 1 and stats["num_resumed"] == stats["num_preempted"]
    assert finished == ["short", "long"]  # the later, shorter request overtook the running one
    assert tokens == expected


async def test_a_request_its_states_show_long_is_preempted_and_resumes_exactly(
        tiny_folder: Path, all_short_predictor: Path, to_the_cap_head: Path) -> None:
    expected = await alone(tiny_folder, all_short_predictor)
    finished, tokens, stats = await long_then_short(config(tiny_folder, all_short_predictor, 1))
    assert stats["num_preempted"] == 0 and finished == ["long", "short"]  # the prompt predictor alone: no
    finished, tokens, stats = await long_then_short(config(tiny_folder, all_short_predictor, 1, to_the_cap_head))
    assert stats["num_repredicted"] >= 1 and stats["num_preempted"] >= 1
    assert finished == ["short", "long"]
    assert tokens == expected
