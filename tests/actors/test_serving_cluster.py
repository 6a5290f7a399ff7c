"""A head and a second node as separate processes on loopback ports: tensor parallelism with
rank 0 on the head and rank 1 on the node (one gloo group across both), and the speculator on
the node. Greedy output must equal plain incremental decoding."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path


from treeserve.client import Client
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental
from treeserve.server import Server, ServerConfig

import tiny_model_files as tiny  # registered by conftest.py

PROMPTS = [[5, 9, 11, 30, 7], [40, 41, 42, 43, 40, 41, 42]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_tp2_across_head_and_node_with_remote_speculator(tmp_path: Path) -> None:
    folder = tiny.write_tiny_hf_model(tmp_path / "model")
    cluster = f"tcp://127.0.0.1:{_free_port()}"
    node = subprocess.Popen([sys.executable, "-m", "treeserve.cli", "node", "--join", cluster])
    try:
        config = ServerConfig(
            model=str(folder), bind="tcp://127.0.0.1:0", num_rows=2, row_capacity=160, max_tree_nodes=32, tp=2,
            speculators=({"kind": "ngram"}, {"kind": "self", "layers": 2, "expansion": [1, 2, 1]}),
            num_nodes=1, cluster_bind=cluster, node_wait_timeout_s=60,
        )
        async with Server(config) as server, Client(server.endpoint) as client:
            head = server.runtime.endpoint
            assert server.verifiers[0].endpoint != server.verifiers[1].endpoint
            assert all(ref.endpoint != head for ref in (server.verifiers[1], *server.speculators))
            for prompt in PROMPTS:
                completion = await client.generate(prompt, speculate="tree", max_tokens=16)
                params = SamplingParams(max_new_tokens=16, stop_token_ids=(tiny.EOS_ID,))
                assert list(completion.token_ids) == generate_incremental(tiny.make_tiny_model(), prompt, params).token_ids
        # The node notices the head is gone and exits by itself.
        assert await asyncio.to_thread(node.wait, 30) == 0
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
