"""Calls across processes: the actor runs in a child process, the caller here."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

from treeserve.runtime import (
    ActorDeadError,
    ActorRef,
    ChildTransport,
    DeadlineExceeded,
    NoSuchMethod,
    OverloadedError,
    RemoteError,
    Runtime,
    RuntimeConfig,
)
from treeserve_testing.runtime_actors import EchoActor, ProbeActor, TinyMailboxWorker, WorkerActor
from treeserve.transport.codec import decode, encode
from treeserve.transport.messages import Error, Reply, Request
from treeserve.transport.wire import ErrorCode

pytestmark = pytest.mark.timeout(60)


class NotImportableByChildren(WorkerActor):
    """Claims to live in a module that does not exist, as a typo would."""


NotImportableByChildren.__module__ = "treeserve_no_such_module"


async def test_child_that_cannot_start_is_a_typed_error() -> None:
    async with Runtime() as rt:
        with pytest.raises(ActorDeadError, match="while starting"):
            await rt.spawn(NotImportableByChildren, name="x", process="child")
        # The name is free again and the runtime still works.
        worker = await rt.spawn(WorkerActor, name="x", process="child")
        assert await worker.ask("echo", 1) == 1


async def wait_for_event(probe: ActorRef, event: list[Any], timeout_s: float = 5.0) -> list[Any]:
    """Poll the probe until ``event`` was recorded; return all events."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        events = await probe.ask("get_events")
        if event in events or loop.time() > end:
            return list(events)
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("transport", [ChildTransport.IPC, ChildTransport.TCP])
async def test_tell_ask_stream_across_processes(transport: ChildTransport) -> None:
    async with Runtime(RuntimeConfig(child_transport=transport)) as rt:
        probe = await rt.spawn(ProbeActor, name="probe")
        echo = await rt.spawn(EchoActor, name="echo")
        worker = await rt.spawn(WorkerActor, probe, name="w", process="child")
        assert not worker.is_local and worker.endpoint.startswith(transport.value)
        assert await worker.ask("pid") != await echo.ask("pid")
        # The ref passed as a constructor arg works in the child: it told us it started.
        events = await wait_for_event(probe, ["started", await worker.ask("pid")])
        assert events[0][0] == "started"
        assert await worker.ask("echo", {"a": [1, 2.5, "x", b"y", None]}) == {"a": [1, 2.5, "x", b"y", None]}
        for i in range(3):
            await worker.tell("count", i + 1)
        assert await worker.ask("get_count") == 6
        # A ref inside a body is callable on the other side (the child calls us back).
        assert await worker.ask("call", {"ref": echo, "value": [7]}) == [7]
        assert [x async for x in worker.ask_stream("count_up", {"n": 20})] == list(range(20))
        arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
        back = await worker.ask("echo", arr)
        np.testing.assert_array_equal(back, arr)
        with pytest.raises(RemoteError) as info:
            await worker.ask("fail", "bad thing")
        assert info.value.code is ErrorCode.INTERNAL and "bad thing" in info.value.message
        with pytest.raises(NoSuchMethod):
            await worker.ask("no_such_handler")
        got: list[int] = []
        with pytest.raises(RemoteError, match="stream broke"):
            async for x in worker.ask_stream("fail_after", 3):
                got.append(x)
        assert got == [0, 1, 2]


async def test_deadline_travels_with_the_request() -> None:
    async with Runtime() as rt:
        probe = await rt.spawn(ProbeActor, name="probe")
        worker = await rt.spawn(WorkerActor, probe, name="w", process="child")
        # Running work past its deadline is cancelled at the callee.
        with pytest.raises(DeadlineExceeded):
            await worker.ask("sleep", {"s": 5, "tag": "long"}, timeout=0.3)
        assert ["cancelled", "long"] in await wait_for_event(probe, ["cancelled", "long"])
        # Work still queued when its deadline passes is dropped, never run.
        first = asyncio.ensure_future(worker.ask("sleep", {"s": 0.5, "tag": "first"}, timeout=5))
        await asyncio.sleep(0.05)
        with pytest.raises(DeadlineExceeded):
            await worker.ask("sleep", {"s": 0.01, "tag": "late"}, timeout=0.2)
        assert await first == "first"
        assert await worker.ask("get_ran") == ["first"]


async def test_callee_enforces_the_deadline_without_any_cancel() -> None:
    """A raw client that never sends Cancel: only the callee's own deadline acts."""
    async with Runtime() as rt:
        probe = await rt.spawn(ProbeActor, name="probe")
        worker = await rt.spawn(WorkerActor, probe, name="w", process="child")
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.connect(worker.endpoint)
        try:
            async def answer() -> Any:
                return decode(await asyncio.wait_for(raw.recv_multipart(), 5))

            await raw.send_multipart(encode(Request(1, "w", "sleep", {"s": 5, "tag": "long"}, 300)))
            err = await answer()
            assert isinstance(err, Error) and err.id == 1 and err.code is ErrorCode.DEADLINE_EXCEEDED
            assert ["cancelled", "long"] in await wait_for_event(probe, ["cancelled", "long"])
            await raw.send_multipart(encode(Request(2, "w", "sleep", {"s": 0.5, "tag": "first"}, 5000)))
            await raw.send_multipart(encode(Request(3, "w", "sleep", {"s": 0.01, "tag": "late"}, 200)))
            answers = {m.id: m for m in [await answer(), await answer()]}
            assert isinstance(answers[2], Reply) and answers[2].body == "first"
            assert isinstance(answers[3], Error) and answers[3].code is ErrorCode.DEADLINE_EXCEEDED
            assert await worker.ask("get_ran") == ["first"]
            await asyncio.sleep(0.1)
            # "late" was dropped while queued: its handler never even started.
            events = await probe.ask("get_events")
            assert ["sleeping", "first"] in events
            assert ["sleeping", "late"] not in events and ["cancelled", "late"] not in events
        finally:
            raw.close(linger=0)
            ctx.term()


@pytest.mark.parametrize("is_id_reused", [False, True], ids=["real", "wrong-impl-reuses-ids"])
async def test_late_reply_is_discarded_never_cross_delivered(is_id_reused: bool) -> None:
    async with Runtime() as rt:
        probe = await rt.spawn(ProbeActor, name="probe")
        worker = await rt.spawn(WorkerActor, probe, name="w", process="child")
        if is_id_reused:  # a deliberately wrong id allocator: this test must notice it
            rt.node._outbound._ids = itertools.repeat(5)
        with pytest.raises(DeadlineExceeded):
            await worker.ask("stubborn", {"s": 0.4, "tag": "A"}, timeout=0.1)
        # B queues behind A's late reply on the same connection; it must get its own.
        if is_id_reused:
            # The check below notices: B is refused as a duplicate id, or gets A's reply.
            with pytest.raises((RemoteError, AssertionError)):
                assert await worker.ask("echo", "B", timeout=5) == "B"
            return
        assert await worker.ask("echo", "B", timeout=5) == "B"
        assert rt.node.stats.num_late_replies >= 1
        values = await asyncio.gather(*(worker.ask("echo", i) for i in range(100)))
        assert values == list(range(100))


async def test_cancelling_the_caller_cancels_the_remote_handler() -> None:
    async with Runtime() as rt:
        probe = await rt.spawn(ProbeActor, name="probe")
        worker = await rt.spawn(WorkerActor, probe, name="w", process="child")
        task = asyncio.ensure_future(worker.ask("sleep", {"s": 10, "tag": "c"}, timeout=30))
        assert ["sleeping", "c"] in await wait_for_event(probe, ["sleeping", "c"])  # the handler runs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ["cancelled", "c"] in await wait_for_event(probe, ["cancelled", "c"])
        assert await worker.ask("echo", 1) == 1  # the worker is free again


async def test_leaving_a_remote_stream_cancels_the_generator() -> None:
    # A buffer this large means only an explicit Cancel can stop the generator in time.
    async with Runtime(RuntimeConfig(stream_buffer=1_000_000)) as rt:
        probe = await rt.spawn(ProbeActor, name="probe")
        worker = await rt.spawn(WorkerActor, probe, name="w", process="child")
        body = {"n": 100_000, "delay": 0.005, "tag": "s1"}
        async with contextlib.aclosing(worker.ask_stream("count_up", body)) as items:
            async for item in items:
                if item == 3:
                    break
        assert ["cancelled", "s1"] in await wait_for_event(probe, ["cancelled", "s1"])

        streaming = asyncio.Event()

        async def consume() -> None:
            async for _ in worker.ask_stream("count_up", {**body, "tag": "s2"}):
                streaming.set()

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(streaming.wait(), 10)  # the generator runs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ["cancelled", "s2"] in await wait_for_event(probe, ["cancelled", "s2"])


async def test_remote_overload_is_a_typed_error() -> None:
    async with Runtime() as rt:
        worker = await rt.spawn(TinyMailboxWorker, name="w", process="child")
        calls = [
            asyncio.ensure_future(worker.ask("sleep", {"s": 0.3, "tag": i}, timeout=10)) for i in range(8)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        overloaded = [r for r in results if isinstance(r, OverloadedError)]
        done = [r for r in results if not isinstance(r, BaseException)]
        assert overloaded and done, results
        assert all(e.code is ErrorCode.OVERLOADED and e.retryable for e in overloaded)
        assert len(done) + len(overloaded) == 8
        assert await worker.ask("echo", "still fine") == "still fine"


async def test_lost_connection_fails_waiting_calls_of_an_unsupervised_peer() -> None:
    async with Runtime() as rt:
        ctx = zmq.asyncio.Context()
        server = ctx.socket(zmq.ROUTER)  # accepts requests, never answers
        port = server.bind_to_random_port("tcp://127.0.0.1")
        try:
            call = asyncio.ensure_future(rt.ref(f"tcp://127.0.0.1:{port}", "x").ask("m", timeout=60))
            request = decode((await asyncio.wait_for(server.recv_multipart(), 5))[1:])
            assert isinstance(request, Request) and request.target == "x"
            server.close(linger=0)  # the peer goes away: its answer can never come
            with pytest.raises(ActorDeadError, match="connection"):
                await asyncio.wait_for(call, 5)
            assert rt.node.stats.num_disconnects == 1
        finally:
            server.close(linger=0)
            ctx.term()
