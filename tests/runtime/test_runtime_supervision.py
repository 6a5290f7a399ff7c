"""Supervision of child processes: crash and hang detection, restarts, intensity."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import pytest

from treeserve.runtime import (
    ActorDeadError,
    ChildState,
    ChildTransport,
    RestartStrategy,
    Runtime,
    RuntimeConfig,
    SupervisorConfig,
    SupervisorGaveUp,
)
from treeserve_testing.runtime_actors import WorkerActor

pytestmark = pytest.mark.timeout(60)

async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``predicate`` until true (fails the test on timeout)."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


FAST = SupervisorConfig(heartbeat_interval_s=0.25, heartbeat_misses=4, max_restarts=5, within_s=30)


@pytest.mark.parametrize("transport", [ChildTransport.IPC, ChildTransport.TCP])
async def test_sigkilled_child_is_restarted_and_pending_callers_fail_fast(transport: ChildTransport) -> None:
    async with Runtime(RuntimeConfig(child_transport=transport)) as rt:
        sup = rt.supervisor(FAST)
        worker = await rt.spawn(WorkerActor, name="w", process="child", supervisor=sup)
        old_pid = await worker.ask("pid")
        assert sup.pid("w") == old_pid
        pending = [
            asyncio.ensure_future(worker.ask("sleep", {"s": 30, "tag": i}, timeout=60)) for i in range(3)
        ]
        await asyncio.sleep(0.2)
        os.kill(old_pid, signal.SIGKILL)
        started = time.monotonic()
        for call in pending:
            with pytest.raises(ActorDeadError):
                await asyncio.wait_for(call, 5)
        assert time.monotonic() - started < 3  # promptly, not at the 60 s deadline
        await until(lambda: sup.num_restarts == 1)
        await sup.wait_running("w", 10)
        # The same ref reaches the new incarnation.
        new_pid = await worker.ask("pid")
        assert new_pid != old_pid and sup.num_restarts == 1
        assert await worker.ask("echo", "again") == "again"


@pytest.mark.parametrize("how", ["sigstop", "blocked_loop"])
async def test_hung_child_is_detected_by_heartbeat(how: str) -> None:
    async with Runtime() as rt:
        sup = rt.supervisor(FAST)
        worker = await rt.spawn(WorkerActor, name="w", process="child", supervisor=sup)
        old_pid = await worker.ask("pid")
        if how == "sigstop":
            pending = asyncio.ensure_future(worker.ask("sleep", {"s": 30, "tag": 0}, timeout=60))
            await asyncio.sleep(0.1)
            os.kill(old_pid, signal.SIGSTOP)
        else:  # the handler blocks the child's event loop: no more heartbeats
            pending = asyncio.ensure_future(worker.ask("block", 30, timeout=60))
        # The process never exits by itself: only missed heartbeats can reveal it.
        with pytest.raises(ActorDeadError, match="heartbeat"):
            await asyncio.wait_for(pending, 10)
        await sup.wait_running("w", 10)
        assert await worker.ask("pid") != old_pid
        with pytest.raises(ProcessLookupError):  # the hung process was killed and reaped
            os.kill(old_pid, 0)


async def test_the_tick_after_a_restart_still_judges_the_children() -> None:
    # A restart takes as long as a child start. The watcher must not mistake that wait for its
    # own loop having been blocked and skip the next tick, which would double the time to notice
    # a child that dies again. The clock jumps 10 s per restart so that every relaunch "takes" long.
    clock: Callable[[], float] = lambda: time.monotonic() + 10.0 * sup.num_restarts  # noqa: E731
    async with Runtime() as rt:
        config = SupervisorConfig(heartbeat_interval_s=1.0, heartbeat_misses=4, max_restarts=5, within_s=60)
        sup = rt.supervisor(config, clock=clock)
        worker = await rt.spawn(WorkerActor, name="w", process="child", supervisor=sup)
        for restarts in (1, 2):
            pid = await worker.ask("pid")
            os.kill(pid, signal.SIGKILL)
            await until(lambda: sup.num_restarts == restarts)
            await sup.wait_running("w", 10)
            assert await worker.ask("pid") != pid
        assert sup.num_stalled_ticks == 0


async def test_restart_intensity_limit_gives_up() -> None:
    escalated: list[SupervisorGaveUp] = []
    async with Runtime() as rt:
        config = SupervisorConfig(heartbeat_interval_s=0.25, heartbeat_misses=4, max_restarts=1, within_s=60)
        sup = rt.supervisor(config, on_give_up=escalated.append)
        worker = await rt.spawn(WorkerActor, name="w", process="child", supervisor=sup)
        os.kill(await worker.ask("pid"), signal.SIGKILL)
        await until(lambda: sup.num_restarts == 1)
        await sup.wait_running("w", 10)  # first failure: restarted
        pid = await worker.ask("pid")
        os.kill(pid, signal.SIGKILL)  # second failure within 60 s: over the limit
        await until(lambda: sup.gave_up is not None)
        with pytest.raises(SupervisorGaveUp):
            await sup.wait_running("w", 10)
        assert sup.gave_up is not None and escalated == [sup.gave_up]
        assert sup.state("w") is ChildState.DEAD and sup.num_restarts == 1
        with pytest.raises(ActorDeadError):
            await worker.ask("pid", timeout=1)


async def test_one_for_all_restarts_the_siblings() -> None:
    async with Runtime() as rt:
        config = SupervisorConfig(
            strategy=RestartStrategy.ONE_FOR_ALL, heartbeat_interval_s=0.25, heartbeat_misses=4
        )
        sup = rt.supervisor(config)
        a = await rt.spawn(WorkerActor, name="a", process="child", supervisor=sup)
        b = await rt.spawn(WorkerActor, name="b", process="child", supervisor=sup)
        pid_a, pid_b = await a.ask("pid"), await b.ask("pid")
        os.kill(pid_a, signal.SIGKILL)
        await until(lambda: sup.num_restarts == 1)
        await sup.wait_running("a", 10)
        await sup.wait_running("b", 10)
        assert await a.ask("pid") != pid_a
        assert await b.ask("pid") != pid_b  # b was healthy but restarted with a
