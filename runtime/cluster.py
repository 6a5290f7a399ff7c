"""Actors on more than one machine: a head places actors on joined nodes.

The *head* is an ordinary ``Runtime`` bound on TCP that hosts a ``ClusterRegistry``
(``start_registry``). A *node* (``treeserve node --join tcp://HEAD:PORT``, i.e.
``join``) runs its own runtime, hosts a ``NodeAgent``, registers the agent with the
head's registry and serves until the head goes away. The head then starts actors on
the node with ``spawn_on(agent, "pkg.module:Class", name, args)``: each runs in a child
process of the node, supervised (and restarted on the same endpoint) by the node, and
is called by the head directly through the returned ``ActorRef`` (refs travel in
bodies both ways). Failure handling:

* a remote child dies: the node restarts it; the head's pending calls to it fail with
  ``ActorDeadError`` (lost connection) and the same ref reaches the new incarnation;
* a node dies or hangs: the registry drops it after a few failed pings and marks its
  agent and children dead on the head, so calls fail with ``ActorDeadError`` at once;
* the head goes away: the node notices after a few failed pings and exits (its
  runtime kills its children).

Trust and security: joining a head lets it start any importable actor class on the
node. A non-loopback ``advertise_host`` needs ``allow_public_bind=True`` (the supervisor
passes that flag on to the node's child processes through ``ChildLaunch``). The links
are plain ZMTP unless the head's ``RuntimeConfig.curve`` and the node's
``NodeConfig.curve`` are set (``runtime/curve.py``): then every ROUTER of the cluster,
children included, admits only allow-listed CURVE client keys, and a node whose key is
not on the head's list gets no message through, so ``join`` fails with ``JoinError``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from treeserve.runtime.actor import Actor
from treeserve.runtime.cluster_agent import NodeAgent, SpawnRequest, detect_devices
from treeserve.runtime.cluster_config import (
    AGENT_NAME,
    REGISTRY_NAME,
    NodeConfig,
    NodeExit,
    RegistryConfig,
    host_endpoint,
)
from treeserve.runtime.cluster_liveness import PingJudge, Verdict
from treeserve.runtime.cluster_registry import ClusterRegistry, NodeRecord
from treeserve.runtime.config import ChildTransport, RestartStrategy, RuntimeConfig
from treeserve.runtime.errors import ActorDeadError, ActorError, DeadlineExceeded, NoSuchActor, OverloadedError
from treeserve.runtime.ref import ActorRef
from treeserve.runtime.runtime import Runtime
from treeserve.transport.sockets import is_loopback_endpoint

__all__ = [
    "AGENT_NAME",
    "REGISTRY_NAME",
    "ClusterError",
    "ClusterRegistry",
    "JoinError",
    "NodeAgent",
    "NodeConfig",
    "NodeExit",
    "NodeRecord",
    "NodeRuntime",
    "RegistryConfig",
    "actor_path",
    "join",
    "spawn_on",
    "start_registry",
]

_log = logging.getLogger(__name__)
_REGISTER_ATTEMPT_S = 2.0
_REGISTER_RETRY_S = 0.2


class ClusterError(Exception):
    """A cluster-level failure that is not a single call's ``ActorError``."""


class JoinError(ClusterError):
    """A node could not join its head (nothing answered in time, or it refused)."""


def actor_path(actor_cls: type[Actor]) -> str:
    """``"pkg.module:QualName"`` of an actor class, as ``spawn_on`` and children need."""
    path = f"{actor_cls.__module__}:{actor_cls.__qualname__}"
    if "<locals>" in path:
        raise ValueError(f"{path} is not importable by another process; define it at module level")
    return path


class NodeRuntime(Runtime):
    """A ``Runtime`` whose child processes bind TCP on ``host`` (the node's advertised
    address) instead of loopback, so that the head can reach them directly."""

    def __init__(self, config: RuntimeConfig, host: str) -> None:
        super().__init__(config)
        self._child_host = host

    def child_endpoint(self, name: str) -> str:
        """A fresh TCP port on the advertised host (kept across restarts by the supervisor)."""
        return host_endpoint(self._child_host)


async def start_registry(runtime: Runtime, config: RegistryConfig | None = None) -> ClusterRegistry:
    """Host a ``ClusterRegistry`` on the head ``runtime`` (which must be bound on
    ``tcp://`` so nodes can reach it) and return the actor object, whose
    ``wait_for_nodes`` the head awaits. Nodes join at ``runtime.endpoint``."""
    if not runtime.endpoint.startswith("tcp://"):
        raise ValueError(
            f"the head runtime must be bound on tcp:// for nodes to join, got {runtime.endpoint!r}; "
            "set RuntimeConfig.bind (e.g. tcp://127.0.0.1:0, or a public address with allow_public_bind)"
        )
    registry = ClusterRegistry(config)
    await runtime.node.host(REGISTRY_NAME, registry)
    return registry


async def spawn_on(
    agent: ActorRef,
    actor_cls_path: str | type[Actor],
    name: str,
    args: Sequence[Any] = (),
    *,
    group: str | None = None,
    strategy: RestartStrategy | str | None = None,
    timeout: float | None = None,
) -> ActorRef:
    """Start ``actor_cls_path(*args)`` as ``name`` in a supervised child process of the
    node whose ``NodeAgent`` is ``agent``; returns the new actor's ref once it serves.

    Children of one ``group`` share a supervisor (``strategy``, e.g. ``one_for_all``
    for the ranks of one tensor-parallel group); without a group the child is
    supervised alone. ``args`` must be msgpack-able (refs allowed, tensors not).
    ``timeout`` bounds the whole start (None: the runtime's default deadline; pass the
    model load time for heavy actors). Raises ``ValueError`` on a malformed request
    before sending anything, and the agent's ``ActorError`` otherwise.
    """
    path = actor_cls_path if isinstance(actor_cls_path, str) else actor_path(actor_cls_path)
    body: dict[str, Any] = {"actor": path, "name": name, "args": list(args)}
    if group is not None:
        body["group"] = group
    if strategy is not None:
        body["strategy"] = RestartStrategy(strategy).value
    SpawnRequest.from_body(body)
    ref = await agent.ask("spawn", body, timeout=timeout)
    if not isinstance(ref, ActorRef):
        raise ClusterError(f"agent {agent} answered spawn with {type(ref).__name__}, not a ref")
    return ref


def _check_can_join(head_endpoint: str, config: NodeConfig) -> None:
    if not isinstance(head_endpoint, str) or not head_endpoint.startswith("tcp://"):
        raise ValueError(f"the head endpoint must look like tcp://HOST:PORT, got {head_endpoint!r}")
    own = host_endpoint(config.advertise_host)
    if is_loopback_endpoint(own) and not is_loopback_endpoint(head_endpoint):
        raise ValueError(
            f"the head {head_endpoint} is reached through a non-loopback address, but this node "
            f"advertises {config.advertise_host}: pass an address of this host that the head can "
            "reach as advertise_host (--advertise-host), with allow_public_bind"
        )


async def join(
    head_endpoint: str,
    *,
    node_config: NodeConfig | None = None,
    on_ready: Callable[[ActorRef], None] | None = None,
) -> NodeExit:
    """Join the head at ``head_endpoint`` as a node and serve it until it goes away.

    Starts a runtime bound on ``tcp://<advertise_host>:0`` (children on the same host),
    hosts a ``NodeAgent`` as ``AGENT_NAME``, registers it with the head's registry
    (retrying up to ``register_timeout_s``; then ``JoinError``), calls ``on_ready`` with
    the agent's ref, then pings the head every ``ping_interval_s``. Returns
    ``NodeExit.HEAD_LOST`` after ``ping_misses`` failed pings in a row and
    ``NodeExit.DROPPED_BY_HEAD`` when the head no longer counts this node; either way
    every child actor of the node has been stopped. Cancel the calling task to leave
    early (the cancellation propagates after the same cleanup).
    """
    config = node_config if node_config is not None else NodeConfig()
    _check_can_join(head_endpoint, config)
    if config.devices is not None:
        devices = list(config.devices)
    else:
        devices = await asyncio.to_thread(detect_devices)
    runtime_config = RuntimeConfig(
        bind=host_endpoint(config.advertise_host),
        child_transport=ChildTransport.TCP,
        supervisor=config.supervisor,
        allow_public_bind=config.allow_public_bind,
        close_timeout_s=config.close_timeout_s,
        curve=config.curve,
    )
    async with NodeRuntime(runtime_config, config.advertise_host) as rt:
        registry = rt.ref(head_endpoint, REGISTRY_NAME)
        agent = await rt.spawn(NodeAgent, rt, config, devices, registry, name=AGENT_NAME)
        info = await agent.ask("info")
        node_id = await _register(registry, agent, info, config.register_timeout_s)
        _log.info("node %s joined head %s with devices %s", node_id, head_endpoint, devices)
        if on_ready is not None:
            on_ready(agent)
        reason = await _watch_head(registry, node_id, config)
        _log.warning("node %s leaves: %s", node_id, reason.value)
        return reason


async def _register(registry: ActorRef, agent: ActorRef, info: dict[str, Any], timeout_s: float) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: ActorError | None = None
    while (left := deadline - loop.time()) > 0:
        try:
            ack = await registry.ask(
                "register", {"agent": agent, "info": info}, timeout=min(left, _REGISTER_ATTEMPT_S))
        except (DeadlineExceeded, ActorDeadError, NoSuchActor, OverloadedError) as exc:
            # The head may not be up yet, or not be hosting its registry yet, or the link to it
            # not be up (a send with no completed connection fails as a full queue).
            last = exc
            await asyncio.sleep(min(_REGISTER_RETRY_S, max(0.0, deadline - loop.time())))
            continue
        except ActorError as exc:
            raise JoinError(f"the head at {registry.endpoint} refused this node: {exc.message}") from exc
        if not isinstance(ack, dict) or not isinstance(ack.get("node_id"), str):
            raise JoinError(f"the head at {registry.endpoint} answered register with {ack!r}")
        node_id: str = ack["node_id"]
        return node_id
    detail = "" if last is None else f" (last error: {last.message})"
    raise JoinError(f"no cluster registry answered at {registry.endpoint} within {timeout_s}s{detail}")


async def _watch_head(registry: ActorRef, node_id: str, config: NodeConfig) -> NodeExit:
    loop = asyncio.get_running_loop()
    interval = config.ping_interval_s
    judge = PingJudge(interval, config.ping_misses)
    while True:
        started = loop.time()
        await asyncio.sleep(interval)
        try:
            is_known = await registry.ask("node_ping", {"node_id": node_id}, timeout=interval)
        except ActorError as exc:
            verdict = judge.observe(False, started, loop.time())
            _log.info("node %s: head ping failed (%d in a row): %s", node_id, judge.misses_in_a_row, exc.message)
            if verdict is Verdict.LOST:
                return NodeExit.HEAD_LOST
            continue
        judge.observe(True, started, loop.time())
        if is_known is False:
            return NodeExit.DROPPED_BY_HEAD
