"""``Runtime``: the per-process entry point that owns a node, its actors and children."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from types import TracebackType
import itertools
from typing import Any, Literal

import zmq.asyncio

from treeserve.runtime.actor import Actor, handler
from treeserve.runtime.config import ChildTransport, RuntimeConfig, SupervisorConfig
from treeserve.runtime.errors import RuntimeClosedError, SupervisorGaveUp
from treeserve.runtime.local_supervisor import LocalSupervisor
from treeserve.runtime.node import Node
from treeserve.runtime.ref import ActorRef
from treeserve.runtime.socket_dirs import SocketDir
from treeserve.runtime.supervisor import ChildSpec, Supervisor
from treeserve.runtime.tasks import TaskOwner
from treeserve.transport.messages import ActorAddress, Heartbeat

__all__ = ["Placement", "Runtime", "SYSTEM_ACTOR"]

_log = logging.getLogger(__name__)

SYSTEM_ACTOR = "$runtime"
"""Reserved name of the actor through which child processes report readiness."""


class Placement(enum.StrEnum):
    """Where ``Runtime.spawn`` runs an actor: in this process, or in a supervised child."""

    LOCAL = "local"
    CHILD = "child"


class _SystemActor(Actor):
    """Receives ``child_ready`` reports from child processes of this runtime."""

    mailbox_size = 1024

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    @handler
    async def child_ready(self, body: Any) -> bool:
        if not isinstance(body, dict):
            raise ValueError("child_ready needs a map {node, endpoint}")
        node_name, endpoint = body.get("node"), body.get("endpoint")
        if not isinstance(node_name, str) or not isinstance(endpoint, str):
            raise ValueError("child_ready needs str 'node' and str 'endpoint'")
        return self._runtime.on_child_ready(node_name, endpoint)


class Runtime:
    """One process's actor runtime: use ``async with Runtime(config) as rt:`` inside any
    running event loop (asyncio or uvloop; the runtime never creates or sets one).

    ``spawn`` starts actors in this process or in supervised child processes and returns
    their ``ActorRef``. ``aclose`` (also run by ``async with``) stops children, actors
    and sockets; it is idempotent and bounded by ``config.close_timeout_s``.
    """

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        self.config = config if config is not None else RuntimeConfig()
        self._ctx: zmq.asyncio.Context | None = None
        self._node: Node | None = None
        self._socket_dir: SocketDir | None = None
        self._supervisors: list[Supervisor] = []
        self._local_supervisors: list[LocalSupervisor] = []
        self._root: Supervisor | None = None
        self._tasks = TaskOwner("runtime")
        self._child_names: set[str] = set()
        self._child_ids = itertools.count()
        self._is_started = False
        self._is_closed = False
        self._closing: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Bind the node and start serving. Call once."""
        if self._is_started:
            raise RuntimeError("Runtime.start() called twice")
        self._is_started = True
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        try:
            bind = cfg.bind
            if bind is None:
                bind = f"ipc://{self._ensure_tmpdir()}/node.sock"
            node = Node(
                self._ctx,
                bind,
                limits=cfg.limits,
                max_in_flight=cfg.max_in_flight,
                mailbox_size=cfg.mailbox_size,
                stream_buffer=cfg.stream_buffer,
                default_timeout_s=cfg.default_timeout_s,
                allow_public_bind=cfg.allow_public_bind,
                curve=cfg.curve,
            )
            self._node = node
            await node.start()
            node.on_heartbeat = self._on_heartbeat
            await node.host(SYSTEM_ACTOR, _SystemActor(self))
            if cfg.parent_endpoint is not None:
                self._tasks.start(self._beat(cfg.parent_endpoint), "heartbeat")
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop everything this runtime owns; safe to call repeatedly and concurrently."""
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        self._closing = asyncio.get_running_loop().create_future()
        self._is_closed = True
        timeout_s = self.config.close_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await self._tasks.aclose(timeout_s)
                for local in self._local_supervisors:  # no restart may race the node's shutdown
                    await local.aclose(timeout_s / 4)
                # This process's actors stop first, while the child processes they call are
                # still there (a scheduler's last release to a verifier that was already gone
                # waited 1.7 s for its failure); then the children, all at once.
                if self._node is not None:
                    await self._node.stop_actors(timeout_s / 4)
                await asyncio.gather(*(sup.aclose(timeout_s / 2) for sup in reversed(self._supervisors)))
                if self._node is not None:
                    await self._node.aclose(timeout_s / 4)
        except TimeoutError:
            _log.warning("runtime: aclose timed out after %.1fs; forcing", timeout_s)
        finally:
            for sup in self._supervisors:
                sup.kill_now()
            if self._ctx is not None:
                self._ctx.destroy(linger=0)
            if self._socket_dir is not None:
                self._socket_dir.remove()
            self._closing.set_result(None)

    # ------------------------------------------------------------------ actors

    @property
    def node(self) -> Node:
        """This process's node (raises before ``start``)."""
        if self._node is None:
            raise RuntimeError("Runtime is not started; use `async with Runtime(...)`")
        return self._node

    @property
    def endpoint(self) -> str:
        """The endpoint other processes use to reach this runtime's actors."""
        return self.node.endpoint

    async def spawn(
        self,
        actor_cls: type[Actor],
        *args: Any,
        name: str,
        process: Placement | Literal["local", "child"] = Placement.LOCAL,
        supervisor: Supervisor | None = None,
        use_pdeathsig: bool = True,
    ) -> ActorRef:
        """Start ``actor_cls(*args)`` as ``name`` and return its ref.

        ``process="local"`` runs it in this process (any args). ``process="child"``
        runs it in a new child process supervised by ``supervisor`` (default: the
        runtime's root supervisor built from ``config.supervisor``); then ``actor_cls``
        must be importable at module level and ``args`` msgpack-able, since the child
        re-creates the actor from ``"module:QualName"`` and the args (no pickle).
        """
        if self._is_closed:
            raise RuntimeClosedError("runtime closed")
        if not name or name.startswith("$") or "/" in name:
            raise ValueError(f"actor name must be non-empty, not start with '$' nor contain '/': {name!r}")
        placement = Placement(process)
        if placement is Placement.LOCAL:
            return await self.node.host(name, actor_cls(*args))
        if name in self._child_names:
            raise ValueError(f"a child actor named {name!r} already exists")
        path = f"{actor_cls.__module__}:{actor_cls.__qualname__}"
        if "<locals>" in path:
            raise ValueError(f"{path} is not importable by a child process; define it at module level")
        sup = supervisor if supervisor is not None else self._root_supervisor()
        self._child_names.add(name)
        try:
            return await sup.start_child(ChildSpec(path, name, list(args), use_pdeathsig))
        except BaseException:
            self._child_names.discard(name)
            raise

    async def stop(self, ref: ActorRef) -> None:
        """Stop a local actor (its callers get ``ActorDeadError``)."""
        if not ref.is_local:
            raise ValueError(f"{ref} is not hosted by this runtime")
        await self.node.stop_actor(ref.name, self.config.close_timeout_s)

    def ref(self, endpoint: str, name: str) -> ActorRef:
        """A ref to actor ``name`` on the node at ``endpoint``."""
        return self.node.ref(ActorAddress(endpoint, name))

    def supervisor(
        self,
        config: SupervisorConfig,
        *,
        name: str = "supervisor",
        clock: Callable[[], float] = time.monotonic,
        on_give_up: Callable[[SupervisorGaveUp], None] | None = None,
    ) -> Supervisor:
        """A new supervisor owned (and closed) by this runtime."""
        if self._is_closed:
            raise RuntimeClosedError("runtime closed")
        sup = Supervisor(self, config, name=name, clock=clock, on_give_up=on_give_up)
        self._supervisors.append(sup)
        return sup

    def local_supervisor(
        self,
        config: SupervisorConfig,
        *,
        name: str = "local-supervisor",
        clock: Callable[[], float] = time.monotonic,
        on_give_up: Callable[[SupervisorGaveUp], None] | None = None,
    ) -> LocalSupervisor:
        """A new supervisor of actors in this process (``max_restarts`` within ``within_s``
        of ``config``), owned (and closed) by this runtime."""
        if self._is_closed:
            raise RuntimeClosedError("runtime closed")
        sup = LocalSupervisor(self.node, max_restarts=config.max_restarts, within_s=config.within_s, name=name,
                              stop_timeout_s=self.config.close_timeout_s, clock=clock, on_give_up=on_give_up)
        self._local_supervisors.append(sup)
        return sup

    def _root_supervisor(self) -> Supervisor:
        if self._root is None:
            self._root = self.supervisor(self.config.supervisor, name="root-supervisor")
        return self._root

    # ------------------------------------------------------------------ children

    def child_endpoint(self, name: str) -> str:
        """The endpoint a child hosting actor ``name`` binds (kept across restarts)."""
        if self.config.child_transport is ChildTransport.TCP:
            return "tcp://127.0.0.1:0"
        return f"ipc://{self._ensure_tmpdir()}/{next(self._child_ids)}.sock"

    def _ensure_tmpdir(self) -> str:
        # Created on first need only (runtime/socket_dirs.py: removed on every exit that
        # runs code; a SIGKILLed owner's folder is removed when the next one is created).
        if self._socket_dir is None:
            self._socket_dir = SocketDir.create()
        return self._socket_dir.path

    def on_child_ready(self, node_name: str, endpoint: str) -> bool:
        """A child process reports it serves; routed to its supervisor."""
        return any(sup.on_ready(node_name, endpoint) for sup in self._supervisors)

    def _on_heartbeat(self, beat: Heartbeat) -> None:
        for sup in self._supervisors:
            if sup.on_heartbeat(beat):
                return

    async def _beat(self, parent: str) -> None:
        node = self.node
        seq = 0
        while True:
            node.send_heartbeat(parent, Heartbeat(seq, time.time(), self.config.node_name))
            seq += 1
            await asyncio.sleep(self.config.heartbeat_interval_s)
