"""The default model (SmolLM2-135M-Instruct, float32) served through the whole actor system.

* Greedy output for none / chain / tree speculation is identical to plain incremental decoding
  run in this process on the same prompt ids.
* 64 concurrent streaming clients: every request completes (or gets an explicit overload
  error), none is lost or duplicated, streamed chunks add up to the completion, and batching
  does not change greedy output (same prompt -> same tokens as the in-process reference).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from treeserve.client import Client, OverloadedError
from treeserve.models import DEFAULT_MODEL, load_model
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental
from treeserve.server import Server, ServerConfig

pytestmark = pytest.mark.model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]


@pytest.fixture(scope="module")
def loaded() -> Any:
    return load_model(DEFAULT_MODEL, dtype=torch.float32)


def prompt_ids(loaded: Any, question: str) -> list[int]:
    return loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template([{"role": "user", "content": question}]))


def reference(loaded: Any, question: str, max_tokens: int) -> list[int]:
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=tuple(loaded.tokenizer.stop_ids))
    return generate_incremental(loaded.model, prompt_ids(loaded, question), params).token_ids


def server_config(tmp_path: Path, **overrides: Any) -> ServerConfig:
    base: dict[str, Any] = dict(bind=f"ipc://{tmp_path}/gw.sock", num_rows=16, row_capacity=512, max_tree_nodes=32)
    return ServerConfig(**{**base, **overrides})


async def test_default_model_greedy_identical_for_every_mode(loaded: Any, tmp_path: Path) -> None:
    expected = reference(loaded, QUESTIONS[0], 32)
    async with Server(server_config(tmp_path)) as server, Client(server.endpoint) as client:
        tree_steps = None
        for speculate in ("none", "chain", "tree"):
            completion = await client.generate(
                [{"role": "user", "content": QUESTIONS[0]}], speculate=speculate, max_tokens=32
            )
            assert list(completion.token_ids) == expected, speculate
            assert "Paris" in completion.text
            if speculate == "tree":
                tree_steps = completion.num_steps
        assert tree_steps is not None and tree_steps <= len(expected)


@pytest.mark.timeout(1200)
async def test_64_concurrent_streaming_clients(loaded: Any, tmp_path: Path) -> None:
    max_tokens = 4
    expected = {q: reference(loaded, q, max_tokens) for q in QUESTIONS}
    async with Server(server_config(tmp_path, max_concurrent_streams=256)) as server:

        async def one(i: int) -> tuple[int, Any]:
            question = QUESTIONS[i % len(QUESTIONS)]
            async with Client(server.endpoint) as client:
                streamed: list[int] = []
                try:
                    async for chunk in client.stream(
                        [{"role": "user", "content": question}],
                        speculate="tree" if i % 2 else "none",
                        max_tokens=max_tokens,
                    ):
                        streamed.extend(chunk.token_ids)
                except OverloadedError as exc:
                    return i, exc
                return i, streamed

        outcomes = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), 1100)
    assert sorted(i for i, _ in outcomes) == list(range(64))  # nothing lost, nothing duplicated
    completed = 0
    for i, outcome in outcomes:
        if isinstance(outcome, OverloadedError):
            continue
        completed += 1
        assert outcome == expected[QUESTIONS[i % len(QUESTIONS)]], f"client {i}"
    assert completed >= 16  # with 256 stream slots, none should be refused
