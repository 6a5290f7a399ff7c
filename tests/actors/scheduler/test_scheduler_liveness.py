"""Bounded waits between the gateway and the scheduler.

* The gateway bounds each wait for the scheduler's next item by ``scheduler_timeout_s``: a
  scheduler that goes silent ends the stream with a non-retryable ``internal`` error.
* The scheduler keeps a queued stream alive with empty keepalive items (every quarter of its step
  timeout), so a consumer that bounds its waits by the step timeout never gives up on a request
  that merely waits for a row. Driven with a stand-in verifier (no model).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from treeserve.actors.gateway.actor import GatewayConfig
from treeserve_testing.gateway_fakes import fake_gateway
from treeserve.actors.scheduler.actor import SchedulerActor, SchedulerConfig
from treeserve.client import Client, ServerError
from treeserve.runtime import Runtime
from treeserve_testing.verifier_fakes import StepVerifier

pytestmark = pytest.mark.timeout(60)


async def test_gateway_ends_a_stream_whose_scheduler_goes_silent() -> None:
    config = GatewayConfig(bind="tcp://127.0.0.1:0", scheduler_timeout_s=0.3)
    async with fake_gateway(config, scheduler={"delay_s": 30}) as (gw, fake):
        async with Client(gw.endpoint) as client:
            with pytest.raises(ServerError) as failed:
                await asyncio.wait_for(client.generate("hello", max_tokens=4), 5)
    assert failed.value.code == "internal" and not failed.value.retryable
    assert "sent nothing" in failed.value.message
    assert [e for e, _ in fake.events] == ["start", "cancelled"]  # the scheduler's stream was closed


async def test_a_queued_stream_gets_keepalives_within_the_step_timeout() -> None:
    step_timeout_s = 0.8  # keepalive every 0.2 s
    config = SchedulerConfig(num_rows=1, row_capacity=256, vocab_size=100, max_tree_nodes=4,
                             step_timeout_s=step_timeout_s)
    async with Runtime() as rt:
        verifier = await rt.node.host("verifier", StepVerifier(step_s=0.05))
        scheduler = await rt.node.host("scheduler", SchedulerActor(config, [verifier]))

        def body(rid: str, max_tokens: int) -> dict[str, Any]:
            return {"request_id": rid, "prompt_ids": [1, 2, 3], "speculate": "none",
                    "params": {"max_new_tokens": max_tokens}}

        async def drain(rid: str, max_tokens: int) -> list[dict[str, Any]]:
            """Every item, each awaited for at most the step timeout (as the gateway does)."""
            items: list[dict[str, Any]] = []
            stream = scheduler.ask_stream("generate", body(rid, max_tokens))
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                while True:
                    try:
                        item = await asyncio.wait_for(anext(stream), step_timeout_s)
                    except StopAsyncIteration:
                        return items
                    items.append(item)

        # The first request holds the only row for about 30 steps (1.5 s: longer than the step timeout).
        first = asyncio.ensure_future(drain("first", 30))
        await asyncio.sleep(0.1)
        queued = await asyncio.wait_for(drain("queued", 2), 20)
        long_one = await first
    assert sum(len(i["token_ids"]) for i in long_one) == 30
    keepalives = [i for i in queued if i == {"token_ids": []}]
    assert keepalives, "a stream queued longer than the step timeout got no keepalive"
    assert [t for i in queued for t in i["token_ids"]] == [7, 7] and queued[-1]["done"]
