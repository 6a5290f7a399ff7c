"""The same OpenAI-API traffic against treeserve's HTTP server and a peer server, side by side.

``bench/serving.py --peer llama-server`` runs this: for each client count, each server is
started afresh on the same GGUF (llama.cpp's ``llama-server`` with one parallel slot a client;
``treeserve serve --http`` with a KV row a client, as a user starts it), sent the same prompts
as streamed, greedy chat completions by that many concurrent clients, and stopped. A fresh
process per count keeps what one count's traffic taught a server (treeserve's suffix drafter,
llama-server's prompt cache) out of the next; the two servers take turns going first.

Per server and count: total completion tokens / wall time, time to first token (p50, p99),
and time per output token (median over requests of (end - first token) / (tokens - 1)).
Tokens are the servers' own ``usage.completion_tokens`` (``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

LLAMA_SERVER_ENV = "LLAMA_SERVER"
"""The ``llama-server`` binary to compare with (else ``llama-server`` on the PATH). Build it from
the llama.cpp sources that llama-cpp-python's sdist vendors (``bench/RESULTS.md``, "Served
speed against llama-server")."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


@dataclass
class Served:
    """A server process on 127.0.0.1:``port`` and what to call its model."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    model: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


async def _wait_ready(served: Served, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if served.process.poll() is not None:
                raise RuntimeError(f"{served.name} exited with {served.process.returncode} before it was ready")
            try:
                async with session.get(served.url + "/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{served.name} was not ready within {timeout_s:.0f} s")


def start_treeserve(model: str, clients: int, row_capacity: int, log: Path) -> Served:
    """``treeserve serve --http`` on ``model`` with a KV row a client (at least 16, its default)."""
    port = _free_port()
    args = [str(Path(sys.executable).with_name("treeserve")), "serve", "--model", model, "--no-zmq", "--http", f"127.0.0.1:{port}",
            "--num-rows", str(max(16, clients)), "--row-capacity", str(row_capacity), "--served-model-name", "treeserve"]
    process = subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    return Served("treeserve", process, port, "treeserve")


def start_llama_server(model: str, clients: int, row_capacity: int, threads: int, log: Path) -> Served:
    """``llama-server`` on ``model`` with one slot a client, each of ``row_capacity`` tokens."""
    binary = os.environ.get(LLAMA_SERVER_ENV) or shutil.which("llama-server")
    if binary is None:
        raise SystemExit(f"no llama-server: set {LLAMA_SERVER_ENV} (bench/RESULTS.md says how to build it)")
    port = _free_port()
    args = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(clients), "-c",
            str(clients * row_capacity), "-t", str(threads), "-tb", str(threads), "--no-webui"]
    process = subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    return Served("llama-server", process, port, "model")


def llama_server_version() -> str:
    binary = os.environ.get(LLAMA_SERVER_ENV) or shutil.which("llama-server") or "llama-server"
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    return lines[0].split(":", 1)[1].strip() if lines else "unknown"  # the vendored tree says "0.5.0-dev (build 0, ...)"


async def _one(session: aiohttp.ClientSession, served: Served, prompt: str, max_tokens: int) -> dict[str, float]:
    body = {"model": served.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with session.post(served.url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{served.name}: HTTP {response.status}: {(await response.text())[:300]}")
        async for raw in response.content:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                if first is None and (choice.get("delta") or {}).get("content"):
                    first = time.perf_counter()
            usage = chunk.get("usage")
            if usage:
                tokens = int(usage["completion_tokens"])
    end = time.perf_counter()
    if first is None or tokens == 0:
        raise RuntimeError(f"{served.name}: an answer without text or without usage")
    return {"ttft_s": first - started, "tokens": tokens, "tpot_s": (end - first) / max(1, tokens - 1), "end": end}


async def drive(served: Served, prompts: list[str], clients: int, max_tokens: int) -> dict[str, float]:
    """Every prompt once, by ``clients`` concurrent clients; the server's figures."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[dict[str, float]] = []
    timeout = aiohttp.ClientTimeout(total=1800)
    connector = aiohttp.TCPConnector(limit=clients + 4, force_close=True)  # a connection a request (llama-server closes them)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client() -> None:
            while not queue.empty():
                results.append(await _one(session, served, queue.get_nowait(), max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = max(r["end"] for r in results) - started
    ttfts = [r["ttft_s"] for r in results]
    return {
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "tpot_s": statistics.median(r["tpot_s"] for r in results),
        "requests": len(results),
        "tokens": sum(r["tokens"] for r in results),
    }


def compare(model: str, prompts: list[str], client_counts: list[int], max_tokens: int, row_capacity: int,
            threads: int, log_dir: Path, progress: Any = print) -> dict[str, Any]:
    """The side-by-side run; ``bench/serving.py --peer llama-server --json`` prints its result."""
    result: dict[str, Any] = {"peer": "llama-server", "peer_version": llama_server_version(), "model": model,
                              "max_tokens": max_tokens, "clients": {}}
    for index, clients in enumerate(client_counts):
        # Enough requests that every client has several: the prompts repeat where they must.
        wanted = max(len(prompts), 4 * clients)
        batch = [prompts[i % len(prompts)] for i in range(wanted)]
        order = ["treeserve", "llama-server"] if index % 2 == 0 else ["llama-server", "treeserve"]
        figures: dict[str, dict[str, float]] = {}
        for name in order:
            log = log_dir / f"{name}-{clients}.log"
            served = (start_treeserve(model, clients, row_capacity, log) if name == "treeserve"
                      else start_llama_server(model, clients, row_capacity, threads, log))
            try:
                asyncio.run(_wait_ready(served, 600))
                asyncio.run(drive(served, batch[: min(4, len(batch))], min(4, clients), 8))  # warm-up, untimed
                figures[name] = asyncio.run(drive(served, batch, clients, max_tokens))
            finally:
                served.stop()
            progress(f"[http_load] {clients} clients, {name}: {json.dumps({k: round(v, 4) for k, v in figures[name].items()})}")
        ours, theirs = figures["treeserve"], figures["llama-server"]
        result["clients"][str(clients)] = {
            "treeserve_tok_s": ours["tok_s"], "peer_tok_s": theirs["tok_s"],
            "treeserve_ttft_p50_s": ours["ttft_p50_s"], "peer_ttft_p50_s": theirs["ttft_p50_s"],
            "treeserve_ttft_p99_s": ours["ttft_p99_s"], "peer_ttft_p99_s": theirs["ttft_p99_s"],
            "treeserve_tpot_s": ours["tpot_s"], "peer_tpot_s": theirs["tpot_s"],
            "requests": ours["requests"], "tok_s_ratio": ours["tok_s"] / theirs["tok_s"],
        }
    return result
