"""A supervisor that gives up is not hidden: the embedded server lists the failure, the gateway's
``info`` and ``health`` say ``failed``, new requests get a non-retryable ``unavailable``, and
``treeserve serve`` exits with status 1 so that a process manager can restart it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treeserve.client import Client, ServerError
from treeserve.server import Server, ServerConfig

import tiny_model_files as tiny  # registered by conftest.py

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model")


async def test_give_up_is_reported_and_refuses_requests_for_good(tiny_folder: Path) -> None:
    config = ServerConfig(model=str(tiny_folder), bind="tcp://127.0.0.1:0", num_rows=2, row_capacity=96,
                          max_tree_nodes=8, speculators=(), max_restarts=0, heartbeat_interval_s=0.25)
    async with Server(config) as server, Client(server.endpoint) as client:
        assert (await client.health()) == {"status": "ok", "failures": []}
        assert (await client.info())["status"] == "ok"
        assert len((await client.generate([5, 6, 7], max_tokens=4)).token_ids) == 4
        os.kill(server.verifier_supervisor.pid("verifier-0"), signal.SIGKILL)
        failures = await asyncio.wait_for(server.run_until(asyncio.Event()), 30)
        assert len(failures) == 1 and "verifier-supervisor" in failures[0]
        health = await client.health()
        assert health["status"] == "failed" and health["failures"] == failures
        info = await client.info()
        assert info["status"] == "failed" and info["failures"] == failures
        with pytest.raises(ServerError) as refused:
            await client.generate([5, 6, 7], max_tokens=4)
        assert refused.value.code == "unavailable" and not refused.value.retryable
        assert "will not recover" in refused.value.message


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_serve_exits_with_status_1_when_a_supervisor_gives_up(tiny_folder: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "treeserve.cli", "serve", "--model", str(tiny_folder), "--bind", "tcp://127.0.0.1:0",
         "--format", "float32", "--speculator", "none", "--num-rows", "2", "--row-capacity", "96",
         "--max-restarts", "0"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while not any("ready: clients connect" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stderr.readline())
        [verifier] = _children(proc.pid)  # no speculator, no predictor: the verifier shard alone
        os.kill(verifier, signal.SIGKILL)
        assert proc.wait(60) == 1
        rest = proc.stderr.read()
        assert re.search(r"treeserve: error: the server failed: .*verifier-supervisor", rest), rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
