"""``treeserve serve --http ... --no-zmq`` end to end, as a person runs it: the process says where
the OpenAI clients go, the official client is served, the one-line load summary appears every
``--log-every-s`` and counts the request, and Ctrl-C stops it with status 0."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

import tiny_model_files as tiny  # registered by conftest.py

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_http_only_with_load_log(tmp_path: Path) -> None:
    folder = tiny.write_tiny_hf_model(tmp_path / "tiny")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "treeserve.cli", "serve", "--model", str(folder), "--no-zmq",
         "--http", f"127.0.0.1:{port}", "--served-model-name", "tiny", "--format", "float32", "--speculator", "none",
         "--num-rows", "2", "--row-capacity", "96", "--log-every-s", "0.5"],
        stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)  # type: ignore[union-attr]
    reader.start()
    seen: list[str] = []

    def wait_for(needle: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.append(line)
            if needle in line:
                return line

    try:
        ready = wait_for("ready:")
        assert f"OpenAI clients use http://127.0.0.1:{port}/v1" in ready and "tcp://" not in ready
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as api:
            done = api.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=5, temperature=0)
        assert done.usage is not None and done.usage.completion_tokens == len(done.choices[0].text.split()) == 5
        summary = wait_for("1 done")
        assert summary.startswith("[treeserve] load: 0 running, 0 queued, 2/2 rows free |"), summary
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
