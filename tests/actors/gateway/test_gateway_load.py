"""64 concurrent streaming clients: every request gets exactly its own tokens, in order,
none lost or duplicated, and the check fails for a gateway that loses one item."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from treeserve.actors.gateway.actor import GatewayActor, GatewayConfig
from treeserve_testing.gateway_fakes import expected_echo, fake_gateway
from treeserve.client import Client
from treeserve.transport.messages import Message, StreamItem

pytestmark = pytest.mark.timeout(120)

NUM_CLIENTS = 64
MAX_TOKENS = 40


def _prompt(i: int) -> str:
    return f"<{i:02d}>"  # unique per client, so a cross-wired token shows in the output


async def _one_client(endpoint: str, i: int) -> dict[str, Any]:
    async with Client(endpoint, timeout=60) as client:
        chunks = [c async for c in client.stream(_prompt(i), max_tokens=MAX_TOKENS)]
    return {"ids": [t for c in chunks for t in c.token_ids], "text": "".join(c.text for c in chunks)}


def check_results(results: list[dict[str, Any]]) -> None:
    """Each client received exactly the scripted echo of its own prompt."""
    assert len(results) == NUM_CLIENTS
    for i, got in enumerate(results):
        want = expected_echo(list(_prompt(i).encode()), MAX_TOKENS)
        assert got["ids"] == want, f"client {i}: tokens lost, duplicated or cross-wired"
        assert got["text"] == bytes(want).decode()


async def _run_clients(gateway_cls: type[GatewayActor]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    config = GatewayConfig(bind="tcp://127.0.0.1:0", max_concurrent_streams=NUM_CLIENTS)
    scheduler = {"chunk_sizes": [1, 2, 3], "delay_s": 0.002}
    async with fake_gateway(config, scheduler=scheduler, gateway_cls=gateway_cls) as (gw, fake):
        results = await asyncio.gather(*(_one_client(gw.endpoint, i) for i in range(NUM_CLIENTS)))
        assert gw.num_active_streams == 0
    return list(results), list(fake.events)


async def test_64_concurrent_clients_each_get_exactly_their_tokens() -> None:
    results, events = await _run_clients(GatewayActor)
    check_results(results)
    started = [rid for event, rid in events if event == "start"]
    finished = [rid for event, rid in events if event == "done"]
    assert len(set(started)) == NUM_CLIENTS and sorted(started) == sorted(finished)


class _LosesOneItem(GatewayActor):
    """Deliberately wrong: silently drops one stream item per stream but keeps the
    ``seq`` numbering gap-free, so only a content check can notice."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.dropped: set[tuple[bytes, int]] = set()

    async def _send(self, stream: Any, msg: Message) -> None:
        key = (stream.peer, stream.msg_id)
        if isinstance(msg, StreamItem) and msg.seq == 2 and key not in self.dropped:
            self.dropped.add(key)
            stream.seq -= 1  # the caller increments it after this send
            return
        await super()._send(stream, msg)


async def test_the_check_fails_for_a_gateway_that_loses_items() -> None:
    results, _ = await _run_clients(_LosesOneItem)
    with pytest.raises(AssertionError, match="lost, duplicated or cross-wired"):
        check_results(results)
