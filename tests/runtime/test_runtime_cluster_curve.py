"""CURVE on cluster links (``runtime/curve.py``): a node whose key is on the head's
allow-list joins and is served over CURVE, children included; a node with any other key,
with the wrong server key, or without CURVE, is refused."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from treeserve.runtime import ActorRef, LinkCurve, Runtime, RuntimeConfig, SupervisorConfig
from treeserve.runtime.cluster import (
    ClusterRegistry,
    JoinError,
    NodeConfig,
    RegistryConfig,
    join,
    spawn_on,
    start_registry,
)
from treeserve.runtime.outbound import Outbound
from treeserve_testing.runtime_actors import EchoActor
from treeserve.transport.codec import decode, encode
from treeserve.transport.messages import Request
from treeserve.transport.sockets import CurveClientConfig, generate_keypair

pytestmark = pytest.mark.timeout(60)

SERVER = generate_keypair()  # the cluster's server key pair, presented by every ROUTER
HEAD = generate_keypair()
NODE = generate_keypair()
STRANGER = generate_keypair()
ALLOWED = frozenset({HEAD[0], NODE[0]})

FAST_NODE = NodeConfig(
    devices=("cpu",),
    supervisor=SupervisorConfig(heartbeat_interval_s=0.2, heartbeat_misses=5, start_timeout_s=30.0),
    ping_interval_s=0.1,
    ping_misses=3,
    register_timeout_s=10.0,
)


def member(keys: tuple[bytes, bytes], server: tuple[bytes, bytes] = SERVER) -> LinkCurve:
    return LinkCurve(*server, *keys, allowed_public_keys=ALLOWED)


@contextlib.asynccontextmanager
async def curve_head() -> AsyncIterator[tuple[Runtime, ClusterRegistry]]:
    config = RuntimeConfig(bind="tcp://127.0.0.1:0", curve=member(HEAD))
    async with Runtime(config) as rt:
        yield rt, await start_registry(rt, RegistryConfig(ping_interval_s=0.1, ping_misses=3))


async def answers(endpoint: str, target: str, curve: CurveClientConfig | None) -> bool:
    """Whether a bare DEALER (CURVE with ``curve``, else plaintext) gets any answer at all."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            curve.server_public_key, curve.public_key, curve.secret_key)
    sock.connect(endpoint)
    try:
        await sock.send_multipart(encode(Request(1, target, "echo", "hi", 2000, False)))
        if not await sock.poll(1000):
            return False
        decode(await sock.recv_multipart())  # a reply, or an error: either way, answered
        return True
    finally:
        sock.close(linger=0)
        ctx.term()


async def test_an_allow_listed_node_joins_and_every_link_is_curve() -> None:
    async with curve_head() as (rt, registry):
        joined: asyncio.Future[ActorRef] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(join(rt.endpoint, node_config=dataclasses.replace(
            FAST_NODE, curve=member(NODE)), on_ready=joined.set_result))
        try:
            agent = await asyncio.wait_for(joined, 15)  # node -> head
            assert [r.agent for r in registry.nodes] == [agent]
            assert (await agent.ask("info"))["endpoint"] == agent.endpoint  # head -> node
            echo = await spawn_on(agent, EchoActor, "echo", timeout=30)  # a child of the node
            assert await echo.ask("echo", [1, "a"]) == [1, "a"]  # head -> child
            good = member(NODE).client_config()
            for endpoint, target in ((rt.endpoint, "cluster-registry"), (agent.endpoint, "node-agent"),
                                     (echo.endpoint, "echo")):
                assert await answers(endpoint, target, good), endpoint  # the probe itself works
                assert not await answers(endpoint, target, None), f"{endpoint} answered plaintext"
                assert not await answers(endpoint, target, member(STRANGER).client_config()), endpoint
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("curve", [
    pytest.param(member(STRANGER), id="key-not-on-the-allow-list"),
    pytest.param(member(NODE, server=generate_keypair()), id="wrong-server-key"),
    pytest.param(None, id="plaintext"),
])
async def test_a_node_the_head_does_not_admit_is_refused(curve: LinkCurve | None) -> None:
    async with curve_head() as (rt, registry):
        config = dataclasses.replace(FAST_NODE, curve=curve, register_timeout_s=2.5)
        with pytest.raises(JoinError, match="refused the handshake"):
            await asyncio.wait_for(join(rt.endpoint, node_config=config), 20)
        assert registry.nodes == [] and registry.dropped == []


async def test_a_full_queue_to_a_refusing_head_still_says_the_handshake_was_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A send to a link whose handshake failed can find no completed connection and fail as a
    full queue before (or instead of) timing out: the join must retry it as a link not up yet,
    and its error must still say the handshake was refused (the race once seen in CI)."""
    async with curve_head() as (rt, registry):
        original = Outbound._send

        def full(self: Outbound, endpoint: str, frames: list[object]) -> bool:
            sent = original(self, endpoint, frames)  # connects, so the handshake still happens
            return sent and endpoint != rt.endpoint

        monkeypatch.setattr(Outbound, "_send", full)
        config = dataclasses.replace(FAST_NODE, curve=None, register_timeout_s=2.5)
        with pytest.raises(JoinError, match="queue full .*refused the handshake"):
            await asyncio.wait_for(join(rt.endpoint, node_config=config), 20)
        assert registry.nodes == [] and registry.dropped == []


def test_link_curve_validates_keys_and_round_trips() -> None:
    curve = member(NODE)
    assert LinkCurve.from_map(curve.to_map()) == curve
    assert NODE[0] in curve.server_config().allowed_client_public_keys
    assert member(STRANGER).server_config().allowed_client_public_keys == ALLOWED | {STRANGER[0]}
    assert NODE[1] not in repr(curve).encode()  # secrets stay out of logs
    with pytest.raises(ValueError, match="public_key"):
        LinkCurve(SERVER[0], SERVER[1], b"short", NODE[1], ALLOWED)
    with pytest.raises(ValueError, match="frozenset"):
        LinkCurve(*SERVER, *NODE, allowed_public_keys={HEAD[0]})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="LinkCurve"):
        NodeConfig(curve="keys")  # type: ignore[arg-type]
