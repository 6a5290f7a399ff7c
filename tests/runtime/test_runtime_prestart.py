"""Prestarted children (``runtime.process.prestart``): a child started before its spec exists
runs its warm-up in its own process and is the one the next launch of its actor class uses;
one nobody claims exits when discarded; a failing warm-up costs nothing but its time."""

from __future__ import annotations

import time

import pytest

from treeserve.runtime import Runtime
from treeserve.runtime.process import Warmup, discard_prestarted, prestart
from treeserve_testing.runtime_actors import EchoActor, WorkerActor

ECHO = f"{EchoActor.__module__}:{EchoActor.__qualname__}"
HOOK = "treeserve_testing.runtime_actors:warm_up"


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    discard_prestarted()


async def test_launch_claims_the_prestarted_child_and_its_warm_up_ran_there() -> None:
    child = prestart(Warmup(ECHO, hook=HOOK, hook_args={"tag": "weights"}))
    async with Runtime() as rt:
        ref = await rt.spawn(EchoActor, name="echo", process="child")
        assert await ref.ask("pid") == child.pid  # the prestarted process, not a new one
        assert await ref.ask("warmed") == ["weights"]  # the hook ran in that process, once
        assert discard_prestarted() == 0  # claimed: nothing left to discard


async def test_a_prestarted_child_serves_only_its_own_actor_class() -> None:
    child = prestart(Warmup(ECHO, hook=HOOK, hook_args={"tag": "x"}))
    async with Runtime() as rt:
        worker = await rt.spawn(WorkerActor, name="worker", process="child")
        assert await worker.ask("pid") != child.pid
        echo = await rt.spawn(EchoActor, name="echo", process="child")
        assert await echo.ask("pid") == child.pid


async def test_each_prestarted_child_is_used_once() -> None:
    first = prestart(Warmup(ECHO))
    async with Runtime() as rt:
        a = await rt.spawn(EchoActor, name="a", process="child")
        b = await rt.spawn(EchoActor, name="b", process="child")
        pids = {await a.ask("pid"), await b.ask("pid")}
        assert first.pid in pids and len(pids) == 2


async def test_a_failing_warm_up_still_starts_the_actor() -> None:
    child = prestart(Warmup(ECHO, hook="treeserve_testing.runtime_actors:warm_up_fails", hook_args={"tag": "t"}))
    async with Runtime() as rt:
        ref = await rt.spawn(EchoActor, name="echo", process="child")
        assert await ref.ask("pid") == child.pid
        assert await ref.ask("echo", "still here") == "still here"


async def test_a_prestarted_child_that_died_is_replaced_by_a_fresh_one() -> None:
    child = prestart(Warmup(ECHO))
    child.kill_now()
    deadline = time.monotonic() + 10
    while child.returncode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    async with Runtime() as rt:
        ref = await rt.spawn(EchoActor, name="echo", process="child")
        assert await ref.ask("pid") != child.pid


def test_an_unclaimed_child_exits_when_discarded(capfd: pytest.CaptureFixture[str]) -> None:
    child = prestart(Warmup(ECHO, hook=HOOK, hook_args={"tag": "never used"}))
    time.sleep(0.5)  # let it reach its wait for the spec (or not: either way it must go)
    assert discard_prestarted() == 1
    assert child.returncode is not None
    assert "Traceback" not in capfd.readouterr().err


def test_prestart_refuses_a_malformed_actor_path() -> None:
    with pytest.raises(ValueError, match="pkg.module:Class"):
        prestart(Warmup("no_colon_here"))
    assert discard_prestarted() == 0
