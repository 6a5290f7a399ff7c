"""``LocalSupervisor``: restarts actors hosted in this process when one of their owned tasks fails."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from treeserve.runtime.actor import Actor
from treeserve.runtime.errors import SupervisorGaveUp
from treeserve.runtime.ref import ActorRef
from treeserve.runtime.restart import RestartIntensity
from treeserve.runtime.tasks import TaskOwner

if TYPE_CHECKING:
    from treeserve.runtime.node import Node

__all__ = ["LocalSupervisor"]

_log = logging.getLogger(__name__)


class LocalSupervisor:
    """Supervises actors that run in this process (the scheduler, say), one for one.

    ``start_child(name, factory)`` hosts ``factory()`` as ``name``. When a task the actor
    owns (``Actor.tasks``) dies of an exception, the actor is stopped (its callers get
    ``ActorDeadError``; its ``on_stop`` fails what it still holds) and a fresh
    ``factory()`` is hosted under the same name, so existing ``ActorRef``s reach the new
    incarnation. Past ``max_restarts`` within ``within_s`` seconds (``clock``) it gives
    up: the actor stays stopped (calls get ``NoSuchActor``), ``gave_up`` records why and
    ``on_give_up`` is called, as ``Supervisor`` does for child processes.
    """

    def __init__(
        self,
        node: Node,
        *,
        max_restarts: int,
        within_s: float,
        name: str = "local-supervisor",
        stop_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        on_give_up: Callable[[SupervisorGaveUp], None] | None = None,
    ) -> None:
        self.name = name
        self.gave_up: SupervisorGaveUp | None = None
        self.num_restarts = 0
        self._node = node
        self._intensity = RestartIntensity(max_restarts, within_s)
        self._stop_timeout_s = stop_timeout_s
        self._clock = clock
        self._on_give_up = on_give_up
        self._factories: dict[str, Callable[[], Actor]] = {}
        self._restarting: set[str] = set()
        self._tasks = TaskOwner(name)
        self._is_closed = False

    async def start_child(self, name: str, factory: Callable[[], Actor]) -> ActorRef:
        """Host ``factory()`` as ``name`` and supervise it; return its ref."""
        if self._is_closed or self.gave_up is not None:
            raise SupervisorGaveUp(f"{self.name} is not accepting children")
        if name in self._factories:
            raise ValueError(f"{self.name} already supervises an actor named {name!r}")
        ref = await self._node.host(name, factory(), on_failure=self._failure_hook(name))
        self._factories[name] = factory
        return ref

    async def aclose(self, timeout_s: float) -> None:
        """Stop restarting (a restart under way is cancelled); the node stops the actors. Idempotent."""
        self._is_closed = True
        await self._tasks.aclose(timeout_s)

    def _failure_hook(self, name: str) -> Callable[[BaseException], None]:
        def on_failure(exc: BaseException) -> None:
            if self._is_closed or name in self._restarting:
                return
            self._restarting.add(name)
            self._tasks.start(self._restart(name, exc), f"restart:{name}")

        return on_failure

    async def _restart(self, name: str, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        _log.warning("%s: actor %r failed (%s); restarting it", self.name, name, reason)
        try:
            await self._node.stop_actor(name, self._stop_timeout_s)
            while True:
                if not self._intensity.try_restart(self._clock()):
                    self._give_up(name, reason)
                    return
                self.num_restarts += 1
                try:
                    await self._node.host(name, self._factories[name](), on_failure=self._failure_hook(name))
                    return
                except Exception as start_exc:  # a failed start counts as one more failure
                    reason = f"restart failed: {type(start_exc).__name__}: {start_exc}"
                    _log.warning("%s: %s", self.name, reason)
        finally:
            self._restarting.discard(name)

    def _give_up(self, name: str, reason: str) -> None:
        self.gave_up = SupervisorGaveUp(
            f"{self.name}: more than {self._intensity.max_restarts} restarts within "
            f"{self._intensity.within_s}s; last failure of {name!r}: {reason}")
        _log.error("%s", self.gave_up.message)
        if self._on_give_up is not None:
            self._on_give_up(self.gave_up)
