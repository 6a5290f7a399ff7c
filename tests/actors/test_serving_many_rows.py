"""A server with 128 rows and 128 concurrent streaming clients, speculation on (the n-gram
drafter and a feature drafter, so every step carries the verifier's hidden states for every
row): all complete, none lost or duplicated, each equal to incremental decoding.

A step's tensors travel as one frame per kind (the rows' states stacked), whatever the row
count; with one frame per row, a 65-row step needs more than ``WireLimits.max_frames`` and
every request fails."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from treeserve.client import Client
from treeserve.ops.feature_drafter import init_feature_drafter, save_feature_drafter
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental
from treeserve.ops.ssm import ssm_config_for
from treeserve.server import Server, ServerConfig

import tiny_model_files as tiny  # registered by conftest.py

NUM_ROWS = 128
MAX_TOKENS = 6


@pytest.mark.timeout(600)
async def test_128_rows_serve_128_streaming_clients_with_states(tmp_path: Path) -> None:
    folder = tiny.write_tiny_hf_model(tmp_path / "model")
    model = tiny.make_tiny_model()
    config = ssm_config_for(model, num_layers=1, ffn_dim=model.config.ffn_dim, draft_vocab_size=model.config.vocab_size)
    torch.manual_seed(0)
    drafter_path = tmp_path / "fd.safetensors"
    save_feature_drafter(init_feature_drafter(model, config, torch.arange(model.config.vocab_size)), drafter_path)
    prompts = [torch.randint(3, model.config.vocab_size, (4 + i % 5,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(NUM_ROWS)]
    params = SamplingParams(max_new_tokens=MAX_TOKENS, stop_token_ids=(tiny.EOS_ID,))
    expected = [generate_incremental(model, p, params).token_ids for p in prompts]
    server_config = ServerConfig(
        model=str(folder), bind="tcp://127.0.0.1:0", num_rows=NUM_ROWS, row_capacity=64, max_tree_nodes=8,
        speculators=({"kind": "ngram"}, {"kind": "feature", "path": str(drafter_path), "expansion": [2, 1]}),
        max_concurrent_streams=2 * NUM_ROWS, heartbeat_interval_s=0.5, step_timeout_s=120.0,
    )
    async with Server(server_config) as server, Client(server.endpoint) as client:

        async def one(i: int) -> tuple[int, list[int]]:
            streamed: list[int] = []
            async for chunk in client.stream(prompts[i], speculate="tree", max_tokens=MAX_TOKENS):
                streamed.extend(chunk.token_ids)
            return i, streamed

        outcomes = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(NUM_ROWS))), 500)
        stats = await server.scheduler.ask("stats")
    assert sorted(i for i, _ in outcomes) == list(range(NUM_ROWS))  # nothing lost, nothing duplicated
    for i, streamed in outcomes:
        assert streamed == expected[i], f"client {i}"
    # The rows were served together (steps of many rows, the case that ran out of frames),
    # not one request after another.
    assert stats["num_steps"] < sum(len(e) for e in expected) / 4
