"""bench/http_load.py's load generator against a fake OpenAI server whose timing and token counts
are known: every prompt is sent once, tokens come from the servers' usage, and TTFT, time per
output token and tokens/s follow from the streamed chunks' times."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from aiohttp import web

from treeserve_testing.scripts import load_script

HTTP_LOAD_PY = Path(__file__).resolve().parents[1] / "bench" / "http_load.py"
FIRST_S, GAP_S, TOKENS = 0.05, 0.01, 6


async def fake_completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["temperature"] == 0
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.sleep(FIRST_S)
    for index in range(TOKENS):
        if index:
            await asyncio.sleep(GAP_S)
        chunk = {"choices": [{"index": 0, "delta": {"content": f"t{index} "}}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": TOKENS, "total_tokens": TOKENS + 3}}
    await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return response


async def test_drive_counts_every_request_and_times_them() -> None:
    bench = load_script("treeserve_bench_http_load", HTTP_LOAD_PY)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake_completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        served = bench.Served("fake", idle, port, "m")
        figures = await bench.drive(served, [f"prompt {i}" for i in range(8)], 4, 16)
    finally:
        idle.kill()
        idle.wait()
        await runner.cleanup()
    assert figures["requests"] == 8 and figures["tokens"] == 8 * TOKENS
    assert FIRST_S <= figures["ttft_p50_s"] <= figures["ttft_p99_s"] < FIRST_S + 0.5
    assert GAP_S * 0.9 <= figures["tpot_s"] < GAP_S + 0.05
    # Two requests a client, one after another: at most 8 * 6 tokens over about 2 requests' time.
    one_request_s = FIRST_S + (TOKENS - 1) * GAP_S
    assert 0.3 * 48 / (2 * one_request_s) < figures["tok_s"] <= 48 / (2 * one_request_s)
