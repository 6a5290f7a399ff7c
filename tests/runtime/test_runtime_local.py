"""In-process runtime behaviour: the fast same-node path, typed errors, deadlines,
cancellation, overload, shutdown, the restart-intensity policy and uvloop embedding."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
import pytest
import uvloop

from treeserve.runtime import (
    Actor,
    ActorDeadError,
    DeadlineExceeded,
    NoSuchActor,
    NoSuchMethod,
    OverloadedError,
    RemoteError,
    RestartIntensity,
    Runtime,
    RuntimeClosedError,
    RuntimeConfig,
    handler,
    stream_handler,
)
from treeserve_testing.runtime_actors import WorkerActor
from treeserve.transport.wire import ErrorCode

pytestmark = pytest.mark.timeout(30)


class Counter(Actor):
    """Non-atomic read-modify-write: only safe because handlers never interleave."""

    def __init__(self) -> None:
        self.value = 0
        self.log: list[str] = []
        self.gate = asyncio.Event()

    @handler
    async def add(self, body: Any) -> int:
        current = self.value
        await asyncio.sleep(0)
        self.value = current + int(body)
        return self.value

    @handler
    async def get(self) -> int:
        return self.value

    @handler
    async def wait_gate(self, body: Any) -> str:
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.log.append(f"cancelled:{body}")
            raise
        self.log.append(f"ran:{body}")
        return str(body)

    @handler
    async def open_gate(self) -> None:
        self.gate.set()

    @handler
    async def boom(self, body: Any) -> None:
        raise KeyError(body)

    @handler
    async def tensor_sum(self, body: Any) -> float:
        return float(np.asarray(body).sum())

    @stream_handler
    async def upto(self, body: Any) -> Any:
        try:
            for i in range(int(body)):
                yield i
                await asyncio.sleep(0)
        except (asyncio.CancelledError, GeneratorExit):
            self.log.append("stream-closed")
            raise


class Wide(Counter):
    max_concurrency = 4


class Tiny(Counter):
    mailbox_size = 1


async def test_ask_tell_and_stream_in_process() -> None:
    async with Runtime() as rt:
        ref = await rt.spawn(Counter, name="c")
        assert ref.is_local
        results = await asyncio.gather(*(ref.ask("add", 1) for _ in range(50)))
        # With interleaving handlers the read-modify-write would lose updates.
        assert sorted(results) == list(range(1, 51))
        await ref.tell("add", 10)
        assert await ref.ask("get") == 60
        assert [x async for x in ref.ask_stream("upto", 5)] == [0, 1, 2, 3, 4]
        arr = np.ones((4, 4), dtype=np.float32)
        assert await ref.ask("tensor_sum", arr) == 16.0


async def test_typed_errors_in_process() -> None:
    async with Runtime() as rt:
        ref = await rt.spawn(Counter, name="c")
        with pytest.raises(RemoteError) as info:
            await ref.ask("boom", "k")
        assert info.value.code is ErrorCode.INTERNAL and "KeyError" in info.value.message
        with pytest.raises(NoSuchMethod):
            await ref.ask("nope")
        with pytest.raises(NoSuchMethod):  # a stream handler is not a unary one
            await ref.ask("upto", 3)
        with pytest.raises(NoSuchActor):
            await rt.ref(rt.endpoint, "ghost").ask("get")
        with pytest.raises(ValueError):
            await rt.spawn(Counter, name="c")
        assert await ref.ask("get") == 0  # the actor survived its handler's failure


async def test_deadline_drops_queued_and_cancels_running_work() -> None:
    async with Runtime() as rt:
        ref = await rt.spawn(Counter, name="c")
        actor: Any = None
        first = asyncio.ensure_future(ref.ask("wait_gate", "first", timeout=0.2))
        queued = asyncio.ensure_future(ref.ask("wait_gate", "queued", timeout=0.1))
        with pytest.raises(DeadlineExceeded):
            await first
        with pytest.raises(DeadlineExceeded):
            await queued
        assert isinstance(DeadlineExceeded("x"), TimeoutError)
        await ref.ask("open_gate")
        await ref.ask("wait_gate", "after")
        actor = rt.node._cells["c"].actor  # white-box: what the callee saw
        assert actor.log == ["cancelled:first", "ran:after"]  # "queued" never ran
        assert rt.node.stats.num_late_dropped == 1


async def test_caller_cancellation_reaches_handler() -> None:
    async with Runtime() as rt:
        ref = await rt.spawn(Counter, name="c")
        task = asyncio.ensure_future(ref.ask("wait_gate", "x", timeout=10))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)
        actor: Any = rt.node._cells["c"].actor
        assert actor.log == ["cancelled:x"]
        assert await ref.ask("get") == 0  # the worker survived the cancel


async def test_breaking_a_stream_closes_the_generator() -> None:
    async with Runtime() as rt:
        ref = await rt.spawn(Counter, name="c")
        async with contextlib.aclosing(ref.ask_stream("upto", 10_000)) as items:
            async for item in items:
                if item == 3:
                    break
        await asyncio.sleep(0.01)
        actor: Any = rt.node._cells["c"].actor
        assert actor.log == ["stream-closed"]
        assert await ref.ask("get") == 0


async def test_overload_full_mailbox_and_in_flight_limit() -> None:
    async with Runtime(RuntimeConfig(max_in_flight=2)) as rt:
        ref = await rt.spawn(Tiny, name="t")
        running = asyncio.ensure_future(ref.ask("wait_gate", "a"))
        await asyncio.sleep(0.01)  # "a" now runs; the mailbox (size 1) is empty
        queued = asyncio.ensure_future(ref.ask("wait_gate", "b"))
        await asyncio.sleep(0)
        with pytest.raises(OverloadedError) as info:
            await ref.ask("wait_gate", "c")
        assert info.value.retryable
        actor: Any = rt.node._cells["t"].actor
        actor.gate.set()
        assert await running == "a" and await queued == "b"
        # Outgoing limit: two remote calls in flight, the third is refused at once.
        far = rt.ref("ipc:///nonexistent/treeserve-test.sock", "x")
        calls = [asyncio.ensure_future(far.ask("get", timeout=0.5)) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(OverloadedError):
            await far.ask("get", timeout=0.5)
        for call in calls:
            with pytest.raises(DeadlineExceeded):
                await call


async def test_concurrency_limit_is_respected() -> None:
    async with Runtime() as rt:
        wide = await rt.spawn(Wide, name="w")
        tasks = [asyncio.ensure_future(wide.ask("wait_gate", i)) for i in range(3)]
        await asyncio.sleep(0.05)
        # Three waiters and the opener run at once (max_concurrency=1 would deadlock).
        assert await asyncio.wait_for(wide.ask("open_gate"), 1.0) is None
        assert sorted(await asyncio.gather(*tasks)) == ["0", "1", "2"]


async def test_concurrency_limit_is_an_upper_bound() -> None:
    """Workers start on demand, but never more than ``max_concurrency``: with all four busy,
    a fifth call waits in the mailbox (here until its deadline) and runs nothing."""
    async with Runtime() as rt:
        wide = await rt.spawn(Wide, name="w")
        busy = [asyncio.ensure_future(wide.ask("wait_gate", i, timeout=5.0)) for i in range(4)]
        await asyncio.sleep(0.05)
        with pytest.raises(DeadlineExceeded):
            await wide.ask("open_gate", timeout=0.3)
        assert not any(task.done() for task in busy)
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)


async def test_stop_fails_pending_callers_and_aclose_is_idempotent() -> None:
    rt = Runtime()
    await rt.start()
    ref = await rt.spawn(Counter, name="c")
    pending = asyncio.ensure_future(ref.ask("wait_gate", "x", timeout=10))
    queued = asyncio.ensure_future(ref.ask("wait_gate", "y", timeout=10))
    await asyncio.sleep(0.01)
    await rt.stop(ref)
    with pytest.raises(ActorDeadError):
        await pending
    with pytest.raises(ActorDeadError):
        await queued
    await asyncio.gather(rt.aclose(), rt.aclose())
    await rt.aclose()
    with pytest.raises(RuntimeClosedError):
        await rt.spawn(Counter, name="d")


def test_restart_intensity_policy_with_fake_clock() -> None:
    policy = RestartIntensity(max_restarts=2, within_s=10.0)
    assert policy.try_restart(0.0)
    assert policy.try_restart(1.0)
    assert not policy.try_restart(2.0)  # a third restart within 10 s
    assert not policy.try_restart(9.9)
    assert policy.try_restart(10.5)  # the restart at t=0 left the window
    assert not policy.try_restart(10.9)
    assert policy.try_restart(11.5)
    with pytest.raises(ValueError):
        RestartIntensity(max_restarts=-1, within_s=1.0)


def test_runtime_inside_a_uvloop_loop_owned_by_the_test() -> None:
    loop = uvloop.new_event_loop()
    try:
        async def main() -> tuple[int, str, str]:
            async with Runtime() as rt:
                ref = await rt.spawn(Counter, name="c")
                child = await rt.spawn(WorkerActor, name="w", process="child")
                await ref.ask("add", 2)
                echoed = await child.ask("echo", "from child")
                return await ref.ask("get"), echoed, type(asyncio.get_running_loop()).__module__

        value, echoed, loop_module = loop.run_until_complete(main())
        assert value == 2 and echoed == "from child" and loop_module.startswith("uvloop")
    finally:
        loop.close()


def test_config_validation_messages() -> None:
    with pytest.raises(ValueError, match="bind"):
        RuntimeConfig(bind="http://x")
    with pytest.raises(ValueError, match="mailbox_size"):
        RuntimeConfig(mailbox_size=0)
