"""A head and a second node in its own OS process (as ``treeserve node --join`` runs):
placement on the node, calls from the head, restarts, node and head loss."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from treeserve.runtime import ActorDeadError, ActorRef, DeadlineExceeded, RemoteError, Runtime, RuntimeConfig
from treeserve.runtime.cluster import ClusterRegistry, RegistryConfig, spawn_on, start_registry
from treeserve_testing.cluster_actors import GlooRankActor
from treeserve_testing.runtime_actors import EchoActor, ProbeActor, WorkerActor

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and signals"),
]

HELPER = Path(__file__).with_name("cluster_node_main.py")


def is_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


async def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while not is_gone(pid) and time.monotonic() < end:
        await asyncio.sleep(0.05)
    return is_gone(pid)


@contextlib.asynccontextmanager
async def head() -> AsyncIterator[tuple[Runtime, ClusterRegistry]]:
    async with Runtime(RuntimeConfig(bind="tcp://127.0.0.1:0")) as rt:
        registry = await start_registry(rt, RegistryConfig(ping_interval_s=0.25, ping_misses=4))
        yield rt, registry


@contextlib.contextmanager
def node_process(head_endpoint: str, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    """A joining node in its own process; killed (with its children) if still alive."""
    proc = subprocess.Popen([sys.executable, str(HELPER), head_endpoint, *extra], stdout=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


async def first_items(stream: AsyncIterator[Any], n: int) -> list[Any]:
    return [await anext(stream) for _ in range(n)]


async def wait_for_event(probe: ActorRef, event: list[Any], timeout_s: float = 10.0) -> list[Any]:
    end = time.monotonic() + timeout_s
    while True:
        events: list[Any] = await probe.ask("get_events")
        if event in events or time.monotonic() > end:
            return events
        await asyncio.sleep(0.05)


async def wait_restarted(agent: ActorRef, name: str, old_pid: int, timeout_s: float = 20.0) -> int:
    """Wait until the node runs a new incarnation of ``name``; return its pid."""
    end = time.monotonic() + timeout_s
    while (pid := await agent.ask("pid", {"name": name})) in (None, old_pid):
        assert time.monotonic() < end, f"{name} was not restarted"
        await asyncio.sleep(0.05)
    assert await agent.ask("wait_running", {"name": name, "timeout_s": timeout_s}, timeout=timeout_s + 5) is True
    assert await agent.ask("state", {"name": name}) == "running"
    return int(pid)


async def test_remote_actor_calls_restart_stop_and_node_exits_with_head() -> None:
    async with head() as (rt, registry), contextlib.AsyncExitStack() as stack:
        node = stack.enter_context(node_process(rt.endpoint, "--devices", "cpu"))
        [agent] = await registry.wait_for_nodes(1, timeout_s=30)
        assert not agent.is_local
        [record] = registry.nodes
        assert record.info["pid"] == node.pid and record.info["endpoint"] == agent.endpoint
        assert record.info["devices"] == ["cpu"] and record.info["num_cpus"] >= 1

        probe = await rt.spawn(ProbeActor, name="probe")
        echo = await rt.spawn(EchoActor, name="echo")
        worker = await spawn_on(agent, WorkerActor, "w", [probe], timeout=30)
        assert worker.endpoint.startswith("tcp://127.0.0.1:")
        assert worker.endpoint not in (agent.endpoint, rt.endpoint)
        first_pid = await agent.ask("pid", {"name": "w"})
        assert await worker.ask("pid") == first_pid
        assert parent_pid(first_pid) == node.pid  # a child of the node, not of the head
        # The head-local probe ref passed as an arg reached the remote child, which called it.
        assert ["started", first_pid] in await wait_for_event(probe, ["started", first_pid])
        assert await worker.ask("echo", {"a": [1, 2.5, "x", b"y", None]}) == {"a": [1, 2.5, "x", b"y", None]}
        assert [x async for x in worker.ask_stream("count_up", {"n": 20})] == list(range(20))
        assert await worker.ask("call", {"ref": echo, "value": [7]}) == [7]
        await worker.tell("count", 5)
        assert await worker.ask("get_count") == 5

        # SIGKILL the remote child mid-stream: the head's stream fails at once, the
        # node's supervisor restarts the child on the same endpoint, the ref works again.
        stream = worker.ask_stream("count_up", {"n": 10_000, "delay": 0.05}, timeout=30)
        assert await first_items(stream, 2) == [0, 1]
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(ActorDeadError):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        second_pid = await wait_restarted(agent, "w", first_pid)
        assert parent_pid(second_pid) == node.pid
        assert await worker.ask("pid", timeout=10) == second_pid
        assert await worker.ask("get_count") == 0  # a fresh incarnation
        assert ["started", second_pid] in await wait_for_event(probe, ["started", second_pid])

        assert await agent.ask("stop", {"name": "w"}) == ["w"]
        assert await wait_gone(second_pid)
        with pytest.raises(RemoteError, match="no actor named 'w'"):
            await agent.ask("pid", {"name": "w"})
        await spawn_on(agent, EchoActor, "e", timeout=30)
        with pytest.raises(RemoteError, match="already runs"):
            await spawn_on(agent, EchoActor, "e", timeout=30)
        other_pid = await agent.ask("pid", {"name": "e"})
        await rt.aclose()  # the head goes away: the node must leave by itself

        assert await asyncio.to_thread(node.wait, 15) == 0
        assert await wait_gone(other_pid), "the node's child outlived it"


async def test_dead_node_fails_calls_and_is_dropped() -> None:
    async with head() as (rt, registry):
        with node_process(rt.endpoint, "--devices", "cpu") as node:
            [agent] = await registry.wait_for_nodes(1, timeout_s=30)
            worker = await spawn_on(agent, WorkerActor, "w", timeout=30)
            # Known to the head as soon as spawn answers, not only after the next ping.
            assert registry.nodes[0].children == {"w": worker.endpoint}
            child_pid = await worker.ask("pid")
            stream = worker.ask_stream("count_up", {"n": 10_000, "delay": 0.05}, timeout=30)
            assert await first_items(stream, 1) == [0]
            os.kill(node.pid, signal.SIGKILL)
            with pytest.raises(ActorDeadError):
                async with asyncio.timeout(10):
                    async for _ in stream:
                        pass
            record = await registry.wait_dropped(agent, timeout_s=10)
            assert registry.nodes == []
            assert record.children == {"w": worker.endpoint}
            # New calls fail at once (marked down), instead of waiting for their deadline.
            for ref in (worker, agent):
                with pytest.raises(ActorDeadError, match="lost"):
                    async with asyncio.timeout(5):
                        await ref.ask("pid", {"name": "w"}, timeout=30)
            assert await wait_gone(child_pid), "the dead node's child outlived it"


async def test_hung_node_is_dropped_then_leaves_when_it_resumes() -> None:
    async with head() as (rt, registry):
        with node_process(rt.endpoint, "--devices", "cpu") as node:
            [agent] = await registry.wait_for_nodes(1, timeout_s=30)
            worker = await spawn_on(agent, WorkerActor, "w", timeout=30)
            # Known to the head as soon as spawn answers, not only after the next ping.
            assert registry.nodes[0].children == {"w": worker.endpoint}
            child_pid = await worker.ask("pid")
            # A hung host sends no FIN: only the registry's pings can notice.
            os.kill(node.pid, signal.SIGSTOP)
            os.kill(child_pid, signal.SIGSTOP)
            try:
                # Control: the runtime alone only ends such a call at its deadline...
                with pytest.raises(DeadlineExceeded):
                    await worker.ask("echo", 1, timeout=0.3)
                assert registry.dropped == []
                # ...the registry's drop fails it with ActorDeadError long before.
                call = asyncio.ensure_future(worker.ask("echo", 1, timeout=30))
                with pytest.raises(ActorDeadError, match="lost"):
                    async with asyncio.timeout(10):
                        await call
                await registry.wait_dropped(agent, timeout_s=5)
            finally:
                os.kill(child_pid, signal.SIGCONT)
                os.kill(node.pid, signal.SIGCONT)
            # Resumed, the node learns the head dropped it and leaves (status 3).
            assert await asyncio.to_thread(node.wait, 15) == 3
            assert await wait_gone(child_pid)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_gloo_group_spans_head_child_and_remote_node_child() -> None:
    async with head() as (rt, registry):
        with node_process(rt.endpoint) as node:  # devices detected by the node
            local = await rt.spawn(GlooRankActor, name="rank0", process="child")
            [agent] = await registry.wait_for_nodes(1, timeout_s=30)
            remote = await spawn_on(agent, GlooRankActor, "rank1", timeout=30)
            # The rendezvous (rank 0's TCP store) is on the head: the remote rank dials in.
            init = f"tcp://127.0.0.1:{free_port()}"
            bodies = [
                {"init_method": init, "rank": rank, "world_size": 2, "values": values, "timeout_s": 40}
                for rank, values in enumerate([[1, 2, 3], [10, 20, 30]])
            ]
            results = await asyncio.gather(
                local.ask("all_reduce", bodies[0], timeout=50), remote.ask("all_reduce", bodies[1], timeout=50))
            assert [r["sum"] for r in results] == [[11.0, 22.0, 33.0]] * 2
            assert [r["rank"] for r in results] == [0, 1]
            assert parent_pid(results[0]["pid"]) == os.getpid()
            assert parent_pid(results[1]["pid"]) == node.pid
            num_cuda = results[1]["num_cuda_devices"]
            expected = [f"cuda:{i}" for i in range(num_cuda)] or ["cpu"]
            assert registry.nodes[0].info["devices"] == expected
