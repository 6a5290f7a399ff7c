"""``LocalSupervisor`` and ``Actor.tasks``: an in-process actor whose owned task dies is restarted
under the same name (refs stay valid), its owned tasks end with it, and past its restart
intensity the supervisor gives up and says so."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from treeserve.runtime import (
    Actor,
    ActorDeadError,
    ActorRef,
    NoSuchActor,
    Runtime,
    SupervisorConfig,
    SupervisorGaveUp,
    handler,
)

pytestmark = pytest.mark.timeout(30)


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def generation_when_up(ref: ActorRef) -> int:
    """The incarnation answering ``ref`` once one is hosted again."""
    async with asyncio.timeout(10):
        while True:
            try:
                return int(await ref.ask("generation"))
            except (NoSuchActor, ActorDeadError):
                await asyncio.sleep(0.01)


class Looper(Actor):
    """Runs an owned background loop; ``crash`` makes the loop raise."""

    incarnations: list[Looper] = []

    def __init__(self) -> None:
        self.crash_now = asyncio.Event()
        self.loop_cancelled = False
        Looper.incarnations.append(self)

    async def on_start(self) -> None:
        self.tasks.start(self._loop(), "loop")

    async def _loop(self) -> None:
        try:
            await self.crash_now.wait()
        except asyncio.CancelledError:
            self.loop_cancelled = True
            raise
        raise RuntimeError("the loop hit a bug")

    @handler
    async def crash(self) -> None:
        self.crash_now.set()

    @handler
    async def generation(self) -> int:
        return Looper.incarnations.index(self)


async def test_failed_owned_task_restarts_the_actor_then_the_supervisor_gives_up() -> None:
    Looper.incarnations.clear()
    gave_up: list[SupervisorGaveUp] = []
    async with Runtime() as rt:
        sup = rt.local_supervisor(SupervisorConfig(max_restarts=2, within_s=60), name="local",
                                  on_give_up=gave_up.append)
        ref = await sup.start_child("looper", Looper)
        assert await ref.ask("generation") == 0
        for restarts in (1, 2):
            await ref.ask("crash")
            await until(lambda: sup.num_restarts == restarts)
            assert await generation_when_up(ref) == restarts  # the same ref reaches the new incarnation
            assert Looper.incarnations[restarts - 1].loop_cancelled is False  # it died of its bug
        assert sup.gave_up is None and gave_up == []
        await ref.ask("crash")
        await until(lambda: sup.gave_up is not None)
        assert gave_up == [sup.gave_up] and "more than 2 restarts" in sup.gave_up.message
        with pytest.raises(NoSuchActor):
            await ref.ask("generation")
        with pytest.raises(SupervisorGaveUp):
            await sup.start_child("another", Looper)


async def test_owned_tasks_are_cancelled_when_the_actor_stops() -> None:
    Looper.incarnations.clear()
    async with Runtime() as rt:
        ref = await rt.spawn(Looper, name="looper")
        await rt.stop(ref)
        assert Looper.incarnations[0].loop_cancelled


class FailsToStart(Actor):
    started: list[Any] = []

    async def on_start(self) -> None:
        FailsToStart.started.append(self.tasks.start(asyncio.sleep(3600), "sleeper"))
        raise ValueError("no")


async def test_tasks_of_a_failed_start_end_with_it() -> None:
    FailsToStart.started.clear()
    async with Runtime() as rt:
        with pytest.raises(ValueError):
            await rt.spawn(FailsToStart, name="x")
        [task] = FailsToStart.started
        assert task.cancelled()
