"""``Supervisor``: watches child processes by exit status and heartbeats, restarts them."""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from treeserve.runtime.actor import ActorNode
from treeserve.runtime.config import RestartStrategy, RuntimeConfig, SupervisorConfig
from treeserve.runtime.errors import ActorDeadError, ActorError, SupervisorGaveUp
from treeserve.runtime.process import ChildLaunch, ChildProcess, encode_args
from treeserve.runtime.ref import ActorRef
from treeserve.runtime.restart import RestartIntensity
from treeserve.runtime.stall import StallGuard
from treeserve.runtime.tasks import TaskOwner
from treeserve.transport.messages import ActorAddress, Heartbeat

__all__ = ["ChildSpec", "ChildState", "SupervisingRuntime", "Supervisor"]


class SupervisingRuntime(Protocol):
    """What a supervisor needs of its runtime (``runtime.Runtime``): its node, its settings and
    the endpoint each child binds."""

    @property
    def node(self) -> ActorNode: ...

    @property
    def config(self) -> RuntimeConfig: ...

    def child_endpoint(self, name: str) -> str: ...

_log = logging.getLogger(__name__)
_KILL_GRACE_S = 0.0  # a failed child is killed at once; it is not trusted to exit


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """A supervised actor: class ``actor`` ("pkg.module:Class"), ``args`` (msgpack-able
    values and ``ActorRef``s),
    its ``name`` (unique in the runtime) and whether Linux's parent-death signal is used
    (``use_pdeathsig``; the death pipe is always used)."""

    actor: str
    name: str
    args: list[Any] = field(default_factory=list)
    use_pdeathsig: bool = True


class ChildState(enum.Enum):
    """Where a supervised child is in its life."""

    STARTING = "starting"
    RUNNING = "running"
    DEAD = "dead"


class _Child:
    __slots__ = ("endpoint", "generation", "last_beat", "process", "ready", "spec", "state")

    def __init__(self, spec: ChildSpec, endpoint: str) -> None:
        self.spec = spec
        self.endpoint = endpoint  # fixed after the first start: refs stay valid
        self.generation = 0
        self.process: ChildProcess | None = None
        self.state = ChildState.STARTING
        self.last_beat = 0.0
        self.ready: asyncio.Future[str] | None = None

    @property
    def node_name(self) -> str:
        return f"{self.spec.name}/{self.generation}"


class Supervisor:
    """Supervises actors that each run in their own child process.

    A child is failed when its process exits, when no heartbeat arrived for
    ``heartbeat_interval_s * heartbeat_misses`` (hung loop, SIGSTOP), or when it does not
    become ready within ``start_timeout_s``. A failed child is SIGKILLed, every pending
    call to it fails with ``ActorDeadError`` at once, and it is restarted (just it, or all
    children, per ``strategy``) on the *same endpoint*, so existing ``ActorRef``s reach
    the new incarnation; calls made while it restarts fail fast with ``ActorDeadError``
    (retryable). Past ``max_restarts`` within ``within_s`` the supervisor gives up: it
    kills all its children, marks them dead for good, records ``gave_up`` and calls
    ``on_give_up`` (escalation). ``clock`` (seconds) drives heartbeat ages and the
    restart window.
    """

    def __init__(
        self,
        runtime: SupervisingRuntime,
        config: SupervisorConfig,
        *,
        name: str = "supervisor",
        clock: Callable[[], float] = time.monotonic,
        on_give_up: Callable[[SupervisorGaveUp], None] | None = None,
    ) -> None:
        self.config = config
        self.name = name
        self.gave_up: SupervisorGaveUp | None = None
        self._giving_up = False  # from the give-up's start: no child starts while it takes them down
        self.num_restarts = 0
        self._stall_guard: StallGuard | None = None
        self._runtime = runtime
        self._clock = clock
        self._on_give_up = on_give_up
        self._intensity = RestartIntensity(config.max_restarts, config.within_s)
        self._children: dict[str, _Child] = {}
        self._tasks = TaskOwner(name)
        self._monitor: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._is_closed = False

    # ------------------------------------------------------------------ public API

    async def start_child(self, spec: ChildSpec) -> ActorRef:
        """Launch ``spec`` in a new process, wait until it serves, supervise it and
        return its ref. Raises ``ActorDeadError`` if it fails to start."""
        if self._is_closed or self._giving_up:
            raise SupervisorGaveUp(f"{self.name} is not accepting children")
        if spec.name in self._children:
            raise ValueError(f"{self.name} already supervises a child named {spec.name!r}")
        child = _Child(spec, self._runtime.child_endpoint(spec.name))
        self._children[spec.name] = child
        if self._monitor is None:  # judges RUNNING children only, so start it first
            self._monitor = self._tasks.start(self._watch(), "monitor")
        try:
            await self._launch(child)
        except BaseException:
            del self._children[spec.name]
            await self._kill(child)
            raise
        return self._runtime.node.ref(ActorAddress(child.endpoint, spec.name))

    def state(self, name: str) -> ChildState:
        """The current state of child ``name``."""
        return self._children[name].state

    @property
    def num_stalled_ticks(self) -> int:
        """Monitor ticks skipped because this supervisor's own loop had been blocked."""
        return 0 if self._stall_guard is None else self._stall_guard.num_stalled

    def pid(self, name: str) -> int | None:
        """The process id of child ``name``'s current incarnation."""
        proc = self._children[name].process
        return None if proc is None else proc.pid

    async def wait_running(self, name: str, timeout_s: float) -> None:
        """Wait until child ``name`` serves again (after a restart); raises
        ``SupervisorGaveUp`` if the supervisor gave up, ``TimeoutError`` on timeout."""
        async with asyncio.timeout(timeout_s):
            while True:
                if self.gave_up is not None:
                    raise SupervisorGaveUp(self.gave_up.message)
                if self._children[name].state is ChildState.RUNNING:
                    return
                self._changed.clear()
                await self._changed.wait()

    def on_heartbeat(self, beat: Heartbeat) -> bool:
        """Record a heartbeat; False when it is not from one of our children."""
        name, _, _generation = beat.node.rpartition("/")
        child = self._children.get(name)
        if child is None or child.node_name != beat.node:
            return False
        child.last_beat = self._clock()
        return True

    def on_ready(self, node_name: str, endpoint: str) -> bool:
        """Record that child process ``node_name`` serves on ``endpoint``."""
        name, _, _generation = node_name.rpartition("/")
        child = self._children.get(name)
        if child is None or child.node_name != node_name or child.ready is None:
            return False
        if not child.ready.done():
            child.ready.set_result(endpoint)
        return True

    async def aclose(self, timeout_s: float) -> None:
        """Stop monitoring and end every child (death pipe, then SIGKILL). Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        await self._tasks.aclose(timeout_s)
        children = list(self._children.values())
        await asyncio.gather(*(self._kill(c, grace_s=min(1.0, timeout_s)) for c in children))
        for child in children:
            child.state = ChildState.DEAD
            self._runtime.node.mark_down(child.endpoint, ActorDeadError(f"actor {child.spec.name!r} stopped"))

    def kill_now(self) -> None:
        """SIGKILL every child without waiting; ``Runtime.aclose`` calls this last so
        no child outlives a shutdown that hit its timeout."""
        for child in self._children.values():
            if child.process is not None:
                child.process.kill_now()

    # ------------------------------------------------------------------ internals

    async def _launch(self, child: _Child) -> None:
        child.generation += 1
        child.state = ChildState.STARTING
        loop = asyncio.get_running_loop()
        child.ready = loop.create_future()
        spec = child.spec
        child.process = ChildProcess.launch(ChildLaunch(
            actor=spec.actor,
            name=spec.name,
            node_name=child.node_name,
            bind=child.endpoint,
            parent_endpoint=self._runtime.node.endpoint,
            parent_pid=os.getpid(),
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            args=encode_args(list(spec.args)),
            use_pdeathsig=spec.use_pdeathsig,
            allow_public_bind=self._runtime.config.allow_public_bind,
            curve=self._runtime.config.curve,
        ))
        try:
            async with asyncio.timeout(self.config.start_timeout_s):
                while not child.ready.done():
                    if child.process.returncode is not None:
                        raise ActorDeadError(
                            f"child {spec.name!r} exited with {child.process.returncode} while starting")
                    await asyncio.wait([child.ready], timeout=0.05)
        except TimeoutError:
            raise ActorDeadError(
                f"child {spec.name!r} not ready within {self.config.start_timeout_s}s") from None
        child.endpoint = child.ready.result()
        child.last_beat = self._clock()
        child.state = ChildState.RUNNING
        self._runtime.node.mark_up(child.endpoint)
        self._changed.set()

    async def _kill(self, child: _Child, grace_s: float = _KILL_GRACE_S) -> None:
        if child.process is not None:
            await child.process.kill(grace_s)

    def _failure(self, child: _Child, now: float) -> str | None:
        if child.state is not ChildState.RUNNING or child.process is None:
            return None
        code = child.process.returncode
        if code is not None:
            return f"process exited with status {code}"
        silence = now - child.last_beat
        if silence > self.config.heartbeat_interval_s * self.config.heartbeat_misses:
            return f"no heartbeat for {silence:.2f}s"
        return None

    async def _watch(self) -> None:
        period = self.config.heartbeat_interval_s / 2
        guard = self._stall_guard = StallGuard(period, self._clock())
        while True:
            await asyncio.sleep(period)
            now = self._clock()
            if guard.tick(now):
                # Our own loop was blocked: heartbeats may sit unread in the socket, so
                # judge nobody until they have been processed.
                continue
            for child in list(self._children.values()):
                reason = self._failure(child, now)
                if reason is not None:
                    await self._on_failure(child, reason)
                    if self.gave_up is not None:
                        return
                    guard.reset(self._clock())  # handling took the restart's time, not a blocked loop's

    async def _on_failure(self, child: _Child, reason: str) -> None:
        _log.warning("%s: child %r failed: %s", self.name, child.spec.name, reason)
        victims = [child]
        if self.config.strategy is RestartStrategy.ONE_FOR_ALL:
            victims = list(self._children.values())
        await self._take_down(victims, f"actor {child.spec.name!r} died: {reason}")
        while True:
            if not self._intensity.try_restart(self._clock()):
                await self._give_up(child, reason)
                return
            self.num_restarts += 1
            try:
                for victim in victims:
                    await self._launch(victim)
                return
            except ActorError as exc:
                reason = exc.message
                _log.warning("%s: restart failed: %s", self.name, reason)
                await self._take_down(victims, reason)

    async def _take_down(self, victims: list[_Child], reason: str) -> None:
        for victim in victims:
            victim.state = ChildState.DEAD
            # Fail callers first: they must not wait for the kill and reaping.
            self._runtime.node.mark_down(victim.endpoint, ActorDeadError(reason))
        self._changed.set()
        await asyncio.gather(*(self._kill(v) for v in victims))

    async def _give_up(self, child: _Child, reason: str) -> None:
        exc = SupervisorGaveUp(
            f"{self.name}: more than {self.config.max_restarts} restarts within "
            f"{self.config.within_s}s; last failure of {child.spec.name!r}: {reason}")
        self._giving_up = True
        await self._take_down(list(self._children.values()), exc.message)
        _log.error("%s", exc.message)
        # Recorded, escalated and only then announced: whoever sees ``gave_up`` (a waiter in
        # wait_running) sees a give-up that is complete, escalation included.
        self.gave_up = exc
        if self._on_give_up is not None:
            self._on_give_up(exc)
        self._changed.set()
