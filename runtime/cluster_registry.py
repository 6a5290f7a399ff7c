"""``ClusterRegistry``: the head's record of joined nodes, and their liveness watch."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from treeserve.runtime.actor import Actor, handler
from treeserve.runtime.cluster_config import RegistryConfig
from treeserve.runtime.cluster_liveness import PingJudge, Verdict
from treeserve.runtime.errors import ActorDeadError, ActorError
from treeserve.runtime.ref import ActorRef

__all__ = ["ClusterRegistry", "NodeRecord"]

_log = logging.getLogger(__name__)
_STOP_TIMEOUT_S = 2.0


@dataclass(slots=True)
class NodeRecord:
    """One joined node as the head sees it: its ``agent``, the ``info`` it registered
    with (see ``NodeAgent.info``) and the endpoints of its children
    (``{name: endpoint}``, as of the last ping)."""

    agent: ActorRef
    info: dict[str, Any]
    children: dict[str, str] = field(default_factory=dict)

    @property
    def node_id(self) -> str:
        """The node's identity: its agent's endpoint."""
        return self.agent.endpoint


class ClusterRegistry(Actor):
    """Hosted on the head as ``REGISTRY_NAME``; joining nodes ``register`` with it.

    Handlers: ``register {agent, info}`` records a node and returns
    ``{node_id, num_nodes}``; ``children {agent, children}`` updates the endpoints of
    a node's children (also refreshed by every ping); ``node_ping {node_id}`` tells a node whether the head
    still counts it (False: it was dropped and should exit). Each registered node is
    pinged through its agent; after ``config.ping_misses`` failures in a row it is
    dropped: removed from ``nodes``, and its agent's and children's endpoints are marked
    down on the head, so every pending and later call to them fails with
    ``ActorDeadError`` at once. The head process awaits ``wait_for_nodes`` directly on
    this object (a plain method, not a handler).
    """

    max_concurrency = 16

    def __init__(self, config: RegistryConfig | None = None) -> None:
        self.config = config if config is not None else RegistryConfig()
        self.dropped: list[NodeRecord] = []
        self._nodes: dict[str, NodeRecord] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()

    async def on_stop(self) -> None:
        await self.tasks.aclose(_STOP_TIMEOUT_S)  # the node watchers

    @property
    def nodes(self) -> list[NodeRecord]:
        """The nodes currently registered, in registration order."""
        return list(self._nodes.values())

    async def wait_for_nodes(self, num_nodes: int, timeout_s: float) -> list[ActorRef]:
        """Wait until at least ``num_nodes`` nodes are registered and return their
        agents (registration order); ``TimeoutError`` says how many joined."""
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 0:
            raise ValueError(f"num_nodes must be an int >= 0, got {num_nodes!r}")
        try:
            async with asyncio.timeout(timeout_s):
                while len(self._nodes) < num_nodes:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(
                f"only {len(self._nodes)} of {num_nodes} nodes joined within {timeout_s}s "
                "(start them with `treeserve node --join <head endpoint>`)"
            ) from None
        return [record.agent for record in self._nodes.values()]

    async def wait_dropped(self, agent: ActorRef, timeout_s: float) -> NodeRecord:
        """Wait until the node of ``agent`` was dropped; returns its last record."""
        async with asyncio.timeout(timeout_s):
            while True:
                for record in self.dropped:
                    if record.agent == agent:
                        return record
                self._changed.clear()
                await self._changed.wait()

    @handler
    async def register(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ValueError("register needs a map {agent: ActorRef, info: map}")
        agent, info = body.get("agent"), body.get("info")
        if not isinstance(agent, ActorRef) or not isinstance(info, dict):
            raise ValueError("register needs an ActorRef 'agent' and a map 'info'")
        node_id = agent.endpoint
        old = self._watchers.pop(node_id, None)
        if old is not None:  # the same node registering again (it restarted its agent)
            old.cancel()
        self.node.mark_up(node_id)
        self._nodes[node_id] = NodeRecord(agent, info)
        self._watchers[node_id] = self.tasks.start(self._watch(node_id), f"watch {node_id}")
        _log.info("cluster: node %s joined with devices %s", node_id, info.get("devices"))
        self._changed.set()
        return {"node_id": node_id, "num_nodes": len(self._nodes)}

    @handler
    async def children(self, body: Any) -> bool:
        """A node reports its children ``{agent, children: {name: endpoint}}``; False
        when the node is not (or no longer) registered."""
        if not isinstance(body, dict) or not isinstance(body.get("agent"), ActorRef) \
                or not isinstance(body.get("children"), dict):
            raise ValueError("children needs a map {agent: ActorRef, children: map}")
        record = self._nodes.get(body["agent"].endpoint)
        if record is None:
            return False
        record.children = _endpoints(body["children"])
        return True

    @handler
    async def node_ping(self, body: Any) -> bool:
        if not isinstance(body, dict) or not isinstance(body.get("node_id"), str):
            raise ValueError("node_ping needs a map {node_id: str}")
        return body["node_id"] in self._nodes

    async def _watch(self, node_id: str) -> None:
        loop = asyncio.get_running_loop()
        interval = self.config.ping_interval_s
        judge = PingJudge(interval, self.config.ping_misses)
        while True:
            started = loop.time()
            await asyncio.sleep(interval)
            record = self._nodes[node_id]
            try:
                answer = await record.agent.ask("ping", timeout=interval)
            except ActorError as exc:
                verdict = judge.observe(False, started, loop.time())
                _log.info("cluster: node %s missed a ping (%d in a row): %s",
                          node_id, judge.misses_in_a_row, exc.message)
                if verdict is Verdict.LOST:
                    self._drop(node_id, f"{judge.misses_in_a_row} pings in a row failed; last: {exc.message}")
                    return
                continue
            judge.observe(True, started, loop.time())
            children = answer.get("children") if isinstance(answer, dict) else None
            if isinstance(children, dict):
                record.children = _endpoints(children)

    def _drop(self, node_id: str, reason: str) -> None:
        record = self._nodes.pop(node_id)
        self._watchers.pop(node_id, None)
        _log.warning("cluster: dropped node %s: %s", node_id, reason)
        # Calls to a vanished host would otherwise wait for their deadline: a crashed
        # machine sends no FIN, so no disconnect is ever seen.
        for endpoint in (node_id, *record.children.values()):
            self.node.mark_down(endpoint, ActorDeadError(f"node {node_id} lost: {reason}"))
        self.dropped.append(record)
        self._changed.set()


def _endpoints(children: dict[Any, Any]) -> dict[str, str]:
    return {k: v for k, v in children.items() if isinstance(k, str) and isinstance(v, str)}
