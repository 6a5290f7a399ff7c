"""Cancel, disconnect, overload, deadline and shutdown: the scheduler stream is always
cancelled (freeing its KV row) and the client gets the documented answer."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio

from treeserve.actors.gateway.actor import GatewayConfig
from treeserve_testing.gateway_fakes import ScriptedScheduler, fake_gateway
from treeserve.client import Client, DeadlineExceededError, OverloadedError, UnavailableError
from treeserve.transport.codec import decode, encode
from treeserve.transport.messages import Request, StreamItem

pytestmark = pytest.mark.timeout(60)

SLOW = {"delay_s": 0.02, "chunk_sizes": [1]}  # 50 tokens/s: streams stay open for seconds
FAST_LIVENESS = GatewayConfig(bind="tcp://127.0.0.1:0", heartbeat_interval_s=0.1, disconnect_timeout_s=0.5)


async def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def _cancelled(fake: ScriptedScheduler) -> list[str]:
    return [rid for event, rid in fake.events if event == "cancelled"]


async def test_breaking_out_of_the_stream_cancels_the_scheduler() -> None:
    async with fake_gateway(scheduler=SLOW) as (gw, fake):
        async with Client(gw.endpoint, timeout=20) as client:
            async with contextlib.aclosing(client.stream("abcdef", max_tokens=1000)) as chunks:
                got = 0
                async for _ in chunks:
                    got += 1
                    if got == 3:
                        break
            # Well before disconnect_timeout_s (3 s): the cancel message did it.
            await _until(lambda: len(_cancelled(fake)) == 1, timeout_s=1.5)
            await _until(lambda: gw.num_active_streams == 0)
            assert gw.stats_counters.num_cancels == 1
            assert gw.stats_counters.num_disconnects == 0
            assert (await client.generate("next", max_tokens=4)).text == "next"
    assert [e for e, _ in fake.events].count("done") == 1


async def test_plain_break_without_aclosing_also_cancels() -> None:
    # The abandoned generator is finalized by the event loop's async-generator hook.
    async with fake_gateway(scheduler=SLOW) as (gw, fake):
        async with Client(gw.endpoint, timeout=20) as client:
            async for _ in client.stream("abcdef", max_tokens=1000):
                break
            await _until(lambda: len(_cancelled(fake)) == 1, timeout_s=1.5)
            assert gw.stats_counters.num_disconnects == 0


async def test_cancelling_the_consuming_task_cancels_the_scheduler() -> None:
    async with fake_gateway(scheduler=SLOW) as (gw, fake):
        async with Client(gw.endpoint, timeout=20) as client:
            seen = asyncio.Event()

            async def consume() -> None:
                async for _ in client.stream("xyz", max_tokens=1000):
                    seen.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(seen.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _until(lambda: len(_cancelled(fake)) == 1, timeout_s=1.5)
            await _until(lambda: gw.num_active_streams == 0)
            assert gw.stats_counters.num_cancels == 1
            assert gw.stats_counters.num_disconnects == 0


async def _raw_stream(endpoint: str, num_items: int) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket]:
    """Open a generate stream from a bare DEALER (sends no heartbeats), read some items."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    request = Request(1, "gateway", "generate", {"prompt": "abc", "max_tokens": 1000}, None, True)
    await sock.send_multipart(encode(request))
    for _ in range(num_items):
        assert await sock.poll(5000)
        assert isinstance(decode(await sock.recv_multipart()), StreamItem)
    return ctx, sock


async def test_client_closing_its_socket_mid_stream_cancels_the_scheduler() -> None:
    async with fake_gateway(FAST_LIVENESS, scheduler=SLOW) as (gw, fake):
        ctx, sock = await _raw_stream(gw.endpoint, 2)
        sock.close(linger=0)
        ctx.term()
        await _until(lambda: len(_cancelled(fake)) == 1, timeout_s=3.0)
        await _until(lambda: gw.num_active_streams == 0)
        assert gw.stats_counters.num_disconnects == 1


async def test_client_gone_while_scheduler_is_silent_is_noticed_by_heartbeats() -> None:
    # The scheduler produces nothing for 30 s: only the gateway's heartbeat (send fails)
    # or the client's missing heartbeats can reveal that the client left.
    async with fake_gateway(FAST_LIVENESS, scheduler={"delay_s": 30.0}) as (gw, fake):
        ctx, sock = await _raw_stream(gw.endpoint, 0)
        await _until(lambda: len(fake.events) == 1)
        sock.close(linger=0)
        ctx.term()
        await _until(lambda: len(_cancelled(fake)) == 1, timeout_s=3.0)
        assert gw.num_active_streams == 0


async def test_silent_client_is_disconnected_after_the_timeout() -> None:
    # Connected but never heartbeating (a hung client): cut off after disconnect_timeout_s.
    async with fake_gateway(FAST_LIVENESS, scheduler={"delay_s": 30.0}) as (gw, fake):
        ctx, sock = await _raw_stream(gw.endpoint, 0)
        try:
            await _until(lambda: len(_cancelled(fake)) == 1, timeout_s=3.0)
            assert gw.stats_counters.num_disconnects == 1
        finally:
            sock.close(linger=0)
            ctx.term()


async def test_heartbeating_client_is_kept_while_the_scheduler_is_silent() -> None:
    async with fake_gateway(FAST_LIVENESS, scheduler={"delay_s": 1.2, "chunk_sizes": [4]}) as (gw, fake):
        async with Client(gw.endpoint, timeout=20, heartbeat_interval_s=0.1) as client:
            done = await client.generate("abcd", max_tokens=4)  # 1.2 s > disconnect_timeout_s
    assert done.text == "abcd"
    assert _cancelled(fake) == [] and gw.stats_counters.num_disconnects == 0


async def test_a_stall_of_the_gateways_own_loop_disconnects_nobody() -> None:
    # The whole process stops for longer than disconnect_timeout_s (a GC pause, a blocking
    # call): the client's heartbeats were not late, the gateway's reading of them was.
    async with fake_gateway(FAST_LIVENESS, scheduler={"delay_s": 1.5, "chunk_sizes": [4]}) as (gw, fake):
        async with Client(gw.endpoint, timeout=20, heartbeat_interval_s=0.1) as client:
            pending = asyncio.ensure_future(client.generate("abcd", max_tokens=4))
            await _until(lambda: len(fake.events) == 1)
            time.sleep(0.8)  # blocks the loop that the gateway and the client share
            done = await pending
    assert done.text == "abcd"
    assert _cancelled(fake) == [] and gw.stats_counters.num_disconnects == 0
    assert gw.stats_counters.num_stalled_ticks >= 1


async def test_too_many_streams_is_overloaded_and_retryable() -> None:
    config = GatewayConfig(bind="tcp://127.0.0.1:0", max_concurrent_streams=2)
    async with fake_gateway(config, scheduler=SLOW) as (gw, fake):
        async with Client(gw.endpoint, timeout=20) as client:
            first = client.stream("aa", max_tokens=1000)
            second = client.stream("bb", max_tokens=1000)
            await first.__anext__()
            await second.__anext__()
            with pytest.raises(OverloadedError) as info:
                await client.generate("cc", max_tokens=2)
            assert info.value.code == "overloaded" and info.value.retryable is True
            await first.aclose()  # type: ignore[attr-defined]
            await _until(lambda: gw.num_active_streams == 1)
            assert (await client.generate("dd", max_tokens=2)).text == "dd"
            await second.aclose()  # type: ignore[attr-defined]
            await _until(lambda: len(_cancelled(fake)) == 2)
    assert gw.stats_counters.num_overloaded == 1


async def test_deadline_cancels_the_scheduler() -> None:
    async with fake_gateway(scheduler=SLOW) as (gw, fake):
        async with Client(gw.endpoint, timeout=0.3) as client:
            with pytest.raises(DeadlineExceededError):
                await client.generate("slow", max_tokens=1000)
            await _until(lambda: len(_cancelled(fake)) == 1, timeout_s=1.5)
            await _until(lambda: gw.num_active_streams == 0)


async def test_gateway_shutdown_tells_open_streams_unavailable() -> None:
    async with Client("tcp://127.0.0.1:1", timeout=20) as unused:
        assert unused.endpoint  # a client may be created before any server exists
    errors: list[BaseException] = []
    async with fake_gateway(scheduler=SLOW) as (gw, fake):
        client = Client(gw.endpoint, timeout=20)
        client.connect()

        async def consume() -> None:
            try:
                async for _ in client.stream("abc", max_tokens=1000):
                    pass
            except UnavailableError as exc:
                errors.append(exc)

        task = asyncio.create_task(consume())
        await _until(lambda: len(fake.events) == 1)
    await asyncio.wait_for(task, 5)
    await client.aclose()
    assert len(errors) == 1 and errors[0].retryable  # type: ignore[attr-defined]
    assert len(_cancelled(fake)) == 1
