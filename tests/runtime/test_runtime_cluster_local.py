"""Cluster pieces in one process: configs, request validation, an in-process node
joining an in-process head, group supervision, and what join does without a head."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator

import pytest

from treeserve.runtime import (
    ActorDeadError,
    ActorRef,
    RemoteError,
    RestartStrategy,
    Runtime,
    RuntimeConfig,
    SupervisorConfig,
)
from treeserve.runtime.cluster import (
    ClusterRegistry,
    JoinError,
    NodeConfig,
    NodeExit,
    RegistryConfig,
    join,
    spawn_on,
    start_registry,
)
from treeserve.runtime.cluster_agent import SpawnRequest
from treeserve.runtime.cluster_liveness import PingJudge, Verdict
from treeserve_testing.runtime_actors import EchoActor, WorkerActor

pytestmark = pytest.mark.timeout(60)

FAST_NODE = NodeConfig(
    devices=("cpu",),
    supervisor=SupervisorConfig(heartbeat_interval_s=0.2, heartbeat_misses=5, start_timeout_s=30.0),
    ping_interval_s=0.1,
    ping_misses=3,
    register_timeout_s=10.0,
)


def test_node_config_refuses_public_or_wildcard_hosts_without_consent() -> None:
    with pytest.raises(ValueError, match="allow_public_bind"):
        NodeConfig(advertise_host="10.1.2.3")
    for host in ("0.0.0.0", "*", "", "tcp://127.0.0.1"):
        with pytest.raises(ValueError, match="advertise_host"):
            NodeConfig(advertise_host=host, allow_public_bind=True)
    assert NodeConfig(advertise_host="10.1.2.3", allow_public_bind=True).advertise_host == "10.1.2.3"
    assert NodeConfig(advertise_host="::1").advertise_host == "::1"
    with pytest.raises(ValueError, match="devices"):
        NodeConfig(devices=("gpu0",))
    with pytest.raises(ValueError, match="ping_misses"):
        NodeConfig(ping_misses=0)
    with pytest.raises(ValueError, match="ping_interval_s"):
        RegistryConfig(ping_interval_s=0)


def test_ping_judge_counts_misses_in_a_row_but_not_our_own_stalls() -> None:
    judge = PingJudge(interval_s=1.0, num_misses=3)
    assert judge.observe(False, started=0.0, now=2.0) is Verdict.SUSPECT
    assert judge.observe(False, started=2.0, now=4.0) is Verdict.SUSPECT
    assert judge.observe(True, started=4.0, now=5.0) is Verdict.ALIVE  # resets the count
    assert [judge.observe(False, t, t + 2.0) for t in (5.0, 7.0)] == [Verdict.SUSPECT] * 2
    # A round that took far longer than sleep + ping timeout: our loop was blocked.
    assert judge.observe(False, started=9.0, now=20.0) is Verdict.SUSPECT
    assert judge.misses_in_a_row == 2
    assert judge.observe(False, started=20.0, now=22.0) is Verdict.LOST
    with pytest.raises(ValueError):
        PingJudge(interval_s=0.0, num_misses=3)


def test_spawn_request_validation() -> None:
    ok = SpawnRequest.from_body(
        {"actor": "a.b:C", "name": "x", "args": [1], "group": "tp", "strategy": "one_for_all"})
    assert ok.strategy is RestartStrategy.ONE_FOR_ALL and ok.args == [1] and ok.group == "tp"
    bad = [
        ([1], "a map"),
        ({"actor": "a.b.C", "name": "x"}, "pkg.module:Class"),
        ({"actor": "a:C", "name": ""}, "non-empty str 'name'"),
        ({"actor": "a:C", "name": "$x"}, "must not start"),
        ({"actor": "a:C", "name": "x", "args": "no"}, "must be a list"),
        ({"actor": "a:C", "name": "x", "strategy": "sometimes"}, "one_for_one"),
        ({"actor": "a:C", "name": "x", "group": "$g"}, "group"),
        ({"actor": "a:C", "name": "x", "extra": 1}, "unknown keys"),
    ]
    for body, message in bad:
        with pytest.raises(ValueError, match=message):
            SpawnRequest.from_body(body)


@contextlib.asynccontextmanager
async def head_and_node(
    node_config: NodeConfig = FAST_NODE,
) -> AsyncIterator[tuple[Runtime, ClusterRegistry, ActorRef, asyncio.Task[NodeExit]]]:
    """A head and an in-process node joined to it; yields (head, registry, agent, join task)."""
    async with Runtime(RuntimeConfig(bind="tcp://127.0.0.1:0")) as rt:
        registry = await start_registry(rt, RegistryConfig(ping_interval_s=0.1, ping_misses=3))
        task = asyncio.ensure_future(join(rt.endpoint, node_config=node_config))
        try:
            [agent] = await registry.wait_for_nodes(1, timeout_s=10)
            yield rt, registry, agent, task
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_in_process_node_joins_places_actors_and_rejects_bad_requests() -> None:
    async with head_and_node() as (rt, registry, agent, _task):
        info = await agent.ask("info")
        port = await agent.ask("free_port")
        assert isinstance(port, int) and 0 < port < 65536
        assert info["devices"] == ["cpu"] and info["endpoint"] == agent.endpoint
        assert info["pid"] == os.getpid() and registry.nodes[0].info == info
        with pytest.raises(ValueError, match="pkg.module:Class"):
            await spawn_on(agent, "no_colon", "x")  # refused before anything is sent
        with pytest.raises(ActorDeadError, match="while starting"):
            await spawn_on(agent, "treeserve_no_such_module:Actor", "x", timeout=30)
        echo = await spawn_on(agent, EchoActor, "x", timeout=30)  # the name is free again
        assert await echo.ask("echo", [1, "a"]) == [1, "a"]
        with pytest.raises(RemoteError, match="unknown keys"):
            await agent.ask("spawn", {"actor": "a:B", "name": "y", "colour": "red"})
        with pytest.raises(RemoteError, match="needs an ActorRef"):
            await rt.ref(rt.endpoint, "cluster-registry").ask("register", {"agent": "me", "info": {}})
        with pytest.raises(TimeoutError, match="only 1 of 2 nodes"):
            await registry.wait_for_nodes(2, timeout_s=0.3)
        # The registry keeps the node while it answers (several ping rounds pass).
        await asyncio.sleep(0.5)
        assert [r.agent for r in registry.nodes] == [agent] and registry.dropped == []
        assert registry.nodes[0].children == {"x": echo.endpoint}


async def wait_pid_changed(agent: ActorRef, name: str, old_pid: int, timeout_s: float = 20.0) -> int:
    end = time.monotonic() + timeout_s
    while (pid := await agent.ask("pid", {"name": name})) in (None, old_pid):
        assert time.monotonic() < end, f"{name} was not restarted"
        await asyncio.sleep(0.05)
    await agent.ask("wait_running", {"name": name, "timeout_s": timeout_s}, timeout=timeout_s + 5)
    return int(pid)


async def test_group_strategy_one_for_all_restarts_and_stops_the_whole_group() -> None:
    async with head_and_node() as (_rt, _registry, agent, _task):
        ranks = [await spawn_on(agent, WorkerActor, f"rank{i}", group="tp", strategy="one_for_all", timeout=30)
                 for i in range(2)]
        loner = await spawn_on(agent, WorkerActor, "loner", timeout=30)
        with pytest.raises(RemoteError, match="one_for_all, not one_for_one"):
            await spawn_on(agent, WorkerActor, "rank2", group="tp", strategy="one_for_one", timeout=30)
        pids = [await r.ask("pid") for r in ranks]
        loner_pid = await loner.ask("pid")
        os.kill(pids[0], signal.SIGKILL)
        new_pids = [await wait_pid_changed(agent, f"rank{i}", pids[i]) for i in range(2)]
        assert all(new != old for new, old in zip(new_pids, pids, strict=True))  # both restarted
        assert [await r.ask("pid", timeout=10) for r in ranks] == new_pids
        assert await loner.ask("pid") == loner_pid  # another group is untouched
        assert await agent.ask("stop", {"name": "rank1"}) == ["rank0", "rank1"]
        with pytest.raises(RemoteError, match="no actor named"):
            await agent.ask("state", {"name": "rank0"})
        assert await agent.ask("state", {"name": "loner"}) == "running"


async def test_in_process_node_leaves_when_the_head_closes() -> None:
    async with Runtime(RuntimeConfig(bind="tcp://127.0.0.1:0")) as rt:
        registry = await start_registry(rt)
        task = asyncio.ensure_future(join(rt.endpoint, node_config=FAST_NODE))
        try:
            await registry.wait_for_nodes(1, timeout_s=10)
            await rt.aclose()
            assert await asyncio.wait_for(task, 10) is NodeExit.HEAD_LOST
        finally:
            task.cancel()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_join_without_a_head_fails_with_join_error() -> None:
    config = NodeConfig(devices=("cpu",), register_timeout_s=0.5)
    with pytest.raises(JoinError, match="no cluster registry answered"):
        await asyncio.wait_for(join(f"tcp://127.0.0.1:{free_port()}", node_config=config), 10)
    async with Runtime(RuntimeConfig(bind="tcp://127.0.0.1:0")) as rt:  # a head without registry
        with pytest.raises(JoinError, match="no actor 'cluster-registry'"):
            await asyncio.wait_for(join(rt.endpoint, node_config=config), 10)


async def test_join_and_registry_refuse_unreachable_setups() -> None:
    with pytest.raises(ValueError, match="advertise_host"):
        await join("tcp://10.1.2.3:5000", node_config=NodeConfig(devices=("cpu",)))
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        await join("ipc:///tmp/x.sock")
    async with Runtime() as rt:  # ipc-bound: no other host could join
        with pytest.raises(ValueError, match="must be bound on tcp://"):
            await start_registry(rt)


def test_child_launch_carries_allow_public_bind() -> None:
    """A node advertising a non-loopback host needs its children to bind there too: the flag
    must survive the launch spec. (No traffic is sent to a non-loopback address here: this
    workplace only allows loopback targets.)"""
    import io

    from treeserve.runtime.process import ChildLaunch, read_launch

    for flag in (False, True):
        launch = ChildLaunch(
            actor="treeserve_testing.runtime_actors:EchoActor", name="e", node_name="n", bind="tcp://127.0.0.1:0",
            parent_endpoint="ipc:///tmp/x.sock", parent_pid=1, heartbeat_interval_s=0.5, allow_public_bind=flag,
        )
        assert read_launch(io.BytesIO(launch.to_bytes())).allow_public_bind is flag
