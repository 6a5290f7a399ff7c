"""``NodeAgent``: the actor through which the head places actors on a joined node."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from treeserve.runtime.actor import Actor, handler
from treeserve.runtime.cluster_config import NodeConfig
from treeserve.runtime.config import RestartStrategy
from treeserve.runtime.errors import ActorError
from treeserve.runtime.ref import ActorRef
from treeserve.runtime.supervisor import ChildSpec, Supervisor

if TYPE_CHECKING:
    from treeserve.runtime.runtime import Runtime

__all__ = ["NodeAgent", "SpawnRequest", "detect_devices"]

_log = logging.getLogger(__name__)


def detect_devices() -> list[str]:
    """The devices this host offers: ``["cuda:0", ...]`` when torch sees CUDA devices,
    else ``["cpu"]`` (also when torch is not installed). Blocking (imports torch)."""
    if importlib.util.find_spec("torch") is None:
        return ["cpu"]
    import torch

    # device_count() queries the driver (or NVML) without creating a CUDA context
    # here: the agent process itself never computes, its children do.
    num_devices = int(torch.cuda.device_count())
    return [f"cuda:{i}" for i in range(num_devices)] or ["cpu"]


def _str_field(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"spawn needs a non-empty str {key!r}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class SpawnRequest:
    """A validated ``spawn`` body: actor class ``actor`` ("pkg.module:Class"), its
    ``name`` (unique on the node), constructor ``args`` (msgpack-able values and refs),
    and optionally the supervision ``group`` it joins (children of one group share a
    supervisor, e.g. the ranks of one tensor-parallel group with ``one_for_all``) and
    that group's ``strategy``. Without a group the child gets a supervisor of its own."""

    actor: str
    name: str
    args: list[Any] = field(default_factory=list)
    group: str | None = None
    strategy: RestartStrategy | None = None

    @classmethod
    def from_body(cls, body: Any) -> SpawnRequest:
        """Validate a wire body; raises ``ValueError`` with a readable message."""
        if not isinstance(body, dict):
            raise ValueError("spawn needs a map {actor, name, args[, group, strategy]}")
        unknown = set(body) - {"actor", "name", "args", "group", "strategy"}
        if unknown:
            raise ValueError(f"spawn got unknown keys {sorted(unknown)}")
        actor, name = _str_field(body, "actor"), _str_field(body, "name")
        module, sep, qualname = actor.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"spawn 'actor' must be 'pkg.module:Class', got {actor!r}")
        if name.startswith("$") or "/" in name:
            raise ValueError(f"actor name must not start with '$' nor contain '/': {name!r}")
        args = body.get("args", [])
        if not isinstance(args, list):
            raise ValueError(f"spawn 'args' must be a list, got {type(args).__name__}")
        group = body.get("group")
        if group is not None and (not isinstance(group, str) or not group or group.startswith("$")):
            raise ValueError(f"spawn 'group' must be a non-empty str not starting with '$', got {group!r}")
        strategy = body.get("strategy")
        try:
            parsed = None if strategy is None else RestartStrategy(strategy)
        except ValueError:
            raise ValueError(
                f"spawn 'strategy' must be one of {[s.value for s in RestartStrategy]}, got {strategy!r}"
            ) from None
        return cls(actor, name, args, group, parsed)


@dataclass(slots=True)
class _Group:
    supervisor: Supervisor
    strategy: RestartStrategy
    names: set[str] = field(default_factory=set)


def _name_of(body: Any) -> str:
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise ValueError("needs a map {name: str}")
    name: str = body["name"]
    return name


class NodeAgent(Actor):
    """Runs in a joined node's process and places actors there for the head.

    Handlers: ``spawn`` (see ``SpawnRequest``) starts the actor in a supervised child
    process of this node and returns its ``ActorRef`` (the child binds on the node's
    advertised host, so the head calls it directly); ``pid {name}`` and ``state {name}``
    report on a child's current incarnation; ``wait_running {name, timeout_s}`` waits
    until it serves (after a restart); ``stop {name}`` stops the child *and the rest of
    its group* and returns the stopped names; ``info`` describes the node; ``free_port``
    picks a port for a rendezvous on the node; ``ping`` answers the head's liveness
    checks with the node's children and their endpoints. With a ``registry`` ref, each
    started child is also reported to it before ``spawn`` answers. Handlers run
    concurrently (a slow ``spawn`` must not starve pings).
    """

    max_concurrency = 64

    def __init__(
        self,
        runtime: Runtime,
        config: NodeConfig,
        devices: Sequence[str],
        registry: ActorRef | None = None,
    ) -> None:
        self._runtime = runtime
        self._registry = registry
        self._config = config
        self._devices = list(devices)
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, str] = {}  # child name -> group key
        self._endpoints: dict[str, str] = {}  # child name -> endpoint, once started

    @handler
    async def spawn(self, body: Any) -> ActorRef:
        request = SpawnRequest.from_body(body)
        if request.name in self._group_of:
            raise ValueError(f"an actor named {request.name!r} already runs on this node")
        key = request.group if request.group is not None else f"${request.name}"
        group = self._groups.get(key)
        if group is None:
            strategy = request.strategy or self._config.default_strategy
            sup_config = dataclasses.replace(self._config.supervisor, strategy=strategy)
            group = _Group(self._runtime.supervisor(sup_config, name=f"node-group-{key}"), strategy)
            self._groups[key] = group
        elif request.strategy is not None and request.strategy is not group.strategy:
            raise ValueError(
                f"group {key!r} is supervised {group.strategy.value}, not {request.strategy.value}")
        self._group_of[request.name] = key  # reserved while the child starts
        group.names.add(request.name)
        try:
            ref = await group.supervisor.start_child(ChildSpec(request.actor, request.name, request.args))
        except BaseException:
            self._group_of.pop(request.name, None)
            group.names.discard(request.name)
            if not group.names and self._groups.get(key) is group:
                del self._groups[key]
                await group.supervisor.aclose(self._config.close_timeout_s)
            raise
        self._endpoints[request.name] = ref.endpoint
        _log.info("node: started %s as %r on %s", request.actor, request.name, ref.endpoint)
        await self._report_children()
        return ref

    async def _report_children(self) -> None:
        # Before the spawn is answered, so the head can mark this child dead if the
        # node is lost before its next ping reports it.
        if self._registry is None:
            return
        body = {"agent": self.ref, "children": dict(self._endpoints)}
        try:
            await self._registry.ask("children", body, timeout=self._config.ping_interval_s * 2)
        except ActorError as exc:
            _log.warning("node: could not report children to the head: %s", exc.message)

    def _group(self, name: str) -> _Group:
        key = self._group_of.get(name)
        if key is None:
            raise ValueError(f"no actor named {name!r} was spawned on this node")
        return self._groups[key]

    @handler
    async def pid(self, body: Any) -> int | None:
        """The process id of the child's current incarnation (None while restarting)."""
        name = _name_of(body)
        return self._group(name).supervisor.pid(name)

    @handler
    async def state(self, body: Any) -> str:
        """``starting``, ``running`` or ``dead``."""
        name = _name_of(body)
        return self._group(name).supervisor.state(name).value

    @handler
    async def wait_running(self, body: Any) -> bool:
        """Wait up to ``timeout_s`` until the child serves; errors if its supervisor
        gave up or on timeout."""
        name = _name_of(body)
        timeout_s = body.get("timeout_s", 10.0)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
            raise ValueError(f"wait_running 'timeout_s' must be a positive number, got {timeout_s!r}")
        await self._group(name).supervisor.wait_running(name, float(timeout_s))
        return True

    @handler
    async def stop(self, body: Any) -> list[str]:
        """Stop the child and every other child of its group; returns their names."""
        name = _name_of(body)
        key = self._group_of.get(name)
        if key is None:
            raise ValueError(f"no actor named {name!r} was spawned on this node")
        group = self._groups.pop(key)
        for member in group.names:
            self._group_of.pop(member, None)
            self._endpoints.pop(member, None)
        await group.supervisor.aclose(self._config.close_timeout_s)
        return sorted(group.names)

    @handler
    async def info(self) -> dict[str, Any]:
        """``{name, host, advertise_host, num_cpus, devices, endpoint, pid}``."""
        return {
            "name": self._config.name or socket.gethostname(),
            "host": socket.gethostname(),
            "advertise_host": self._config.advertise_host,
            "num_cpus": os.cpu_count() or 1,
            "devices": list(self._devices),
            "endpoint": self._runtime.endpoint,
            "pid": os.getpid(),
        }

    @handler
    async def free_port(self) -> int:
        """A TCP port that is free right now on the advertised host, e.g. for the
        rendezvous (``dist_init``) of a tensor-parallel group whose rank 0 runs here."""
        family = socket.AF_INET6 if ":" in self._config.advertise_host else socket.AF_INET
        with socket.socket(family) as sock:
            sock.bind((self._config.advertise_host, 0))
            port: int = sock.getsockname()[1]
        return port

    @handler
    async def ping(self) -> dict[str, Any]:
        """Liveness answer: ``{children: {name: endpoint}}`` of the started children."""
        return {"children": dict(self._endpoints)}
