"""A Node.js client written from the protocol docs talks to the real gateway.

Needs ``node`` and ``npm ci --prefix tests/node`` (zeromq v6 ships its prebuilt addon
inside the npm package); skipped otherwise.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from treeserve.actors.gateway import GatewayConfig
from treeserve.testing.gateway_fakes import ByteTokenizer, expected_echo, fake_gateway

HERE = Path(__file__).resolve().parent
NODE = shutil.which("node")

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(NODE is None, reason="node is not installed"),
    pytest.mark.skipif(
        not (HERE / "node_modules" / "zeromq").is_dir(),
        reason="tests/node/node_modules is missing: run `npm ci --prefix tests/node`",
    ),
]

PROMPT = "nöde 世界"
MAX_TOKENS = 18  # the echo ends on a character boundary


async def test_node_client_streams_errors_and_cancels() -> None:
    assert NODE is not None
    scenario = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "cancel_prompt": "long"}
    config = GatewayConfig(bind="tcp://127.0.0.1:0", model_name="fake-bytes", context_length=512)
    async with fake_gateway(config, scheduler={"chunk_sizes": [1, 2, 3], "delay_s": 0.01}) as (gw, fake):
        proc = await asyncio.create_subprocess_exec(
            NODE, str(HERE / "client.mjs"), gw.endpoint, json.dumps(scenario),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, f"node client failed:\n{stdout.decode()}\n{stderr.decode()}"

        async def cancel_reached() -> None:
            while not any(event == "cancelled" for event, _ in fake.events):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(cancel_reached(), 5)
    lines = [json.loads(line) for line in stdout.decode().splitlines()]
    by_event: dict[str, list[dict[str, object]]] = {}
    for line in lines:
        by_event.setdefault(str(line["event"]), []).append(line)

    [info] = by_event["info"]
    assert info["model"] == "fake-bytes" and info["vocab_size"] == ByteTokenizer.vocab_size
    assert info["eos_ids"] == [ByteTokenizer.EOS]

    want = expected_echo(list(PROMPT.encode()), MAX_TOKENS)
    items = by_event["item"]
    assert [i["seq"] for i in items] == list(range(len(items)))
    assert [t for i in items for t in i["token_ids"]] == want  # type: ignore[attr-defined]
    text = "".join(str(i["text"]) for i in items)
    assert text == bytes(want).decode() and "\ufffd" not in text
    [end] = by_event["end"]
    assert end["seq"] == len(items) and end["text"] == text and end["token_ids"] == want
    assert end["finish_reason"] == "length" and end["num_prompt_tokens"] == len(PROMPT.encode())

    [error] = by_event["error"]
    assert error["code"] == "invalid_request" and "max_tokens" in str(error["message"])
    assert error["retryable"] is False

    [cancel] = by_event["cancel_sent"]
    assert cancel["items"] == 2
    assert by_event["done"] == [{"event": "done"}]
