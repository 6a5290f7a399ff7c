"""A preempted request resumes exactly: through the whole server (tiny random model, float32,
greedy), a long request that is preempted for a far shorter one, parked in a park row and moved
back, writes the same tokens as the same request served alone.

The check is not one any server passes: with ``KVCache.move_row`` copying only the keys (the
values left behind), the resumed answer differs (tried: the assertion on the tokens failed).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from treeserve.actors.scheduler.types import SchedulerSettings
from treeserve.client import Client
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


def config(folder: Path, predictor: Path, preempt_rows: int) -> ServerConfig:
    return ServerConfig(
        model=str(folder), bind="tcp://127.0.0.1:0", num_rows=1, row_capacity=256, max_tree_nodes=16,
        speculators=(), heartbeat_interval_s=0.25, step_timeout_s=60.0, dtype="float32",
        scheduling=SchedulerSettings(policy="ssjf", max_wait_s=600.0, preempt_rows=preempt_rows),
        predictor=str(predictor),
    )


async def test_a_preempted_request_resumes_with_the_tokens_it_would_have_written(
        tiny_folder: Path, predictor_path: Path) -> None:
    async with Server(config(tiny_folder, predictor_path, 0)) as server, Client(server.endpoint) as client:
        alone = await client.generate(LONG_ANSWER_PROMPT, speculate="none", max_tokens=LONG_MAX_TOKENS)
    assert len(alone.token_ids) > 100  # long enough to be preempted (the rules keep the last 64 tokens)

    async with Server(config(tiny_folder, predictor_path, 1)) as server, Client(server.endpoint) as client:
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

    assert stats["num_preempted"] >= 1 and stats["num_resumed"] == stats["num_preempted"]
    assert finished == ["short", "long"]  # the later, shorter request overtook the running one
    assert tokens == list(alone.token_ids)
