"""Small actors used by the runtime's tests and benchmark (importable by child
processes, which re-create actors from their ``module:Class`` path)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from treeserve.runtime.actor import Actor, handler, stream_handler
from treeserve.runtime.ref import ActorRef

__all__ = ["EchoActor", "ProbeActor", "TinyMailboxWorker", "WorkerActor", "warm_up", "warm_up_fails"]

WARMED: list[str] = []
"""What :func:`warm_up` recorded in this process (a prestarted child's warm-up hook)."""


def warm_up(tag: str) -> None:
    """A warm-up hook (``runtime.process.Warmup``): records ``tag`` for :meth:`EchoActor.warmed`."""
    WARMED.append(tag)


def warm_up_fails(tag: str) -> None:
    """A warm-up hook that raises."""
    raise RuntimeError(f"warm-up {tag} failed on purpose")


class ProbeActor(Actor):
    """Records events told to it, so a test can observe what happened elsewhere."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    @handler
    async def record(self, body: Any) -> None:
        self.events.append(body)

    @handler
    async def get_events(self) -> list[Any]:
        return list(self.events)


class EchoActor(Actor):
    """Echoes bodies back; used for latency and tensor round trips."""

    @handler
    async def echo(self, body: Any) -> Any:
        return body

    @handler
    async def pid(self) -> int:
        return os.getpid()

    @handler
    async def warmed(self) -> list[str]:
        return list(WARMED)


class WorkerActor(Actor):
    """A child-process actor exercising every runtime feature.

    ``probe`` (optional ref) is told ``[event, payload]`` pairs: ``started``, ``sleeping``
    (the ``sleep`` handler began), ``cancelled`` (a handler observed CancelledError), ``ran``
    (a slow handler ran).
    """

    def __init__(self, probe: ActorRef | None = None) -> None:
        self.probe = probe
        self.num_told = 0
        self.ran: list[Any] = []

    async def on_start(self) -> None:
        await self._note("started", os.getpid())

    async def _note(self, event: str, payload: Any) -> None:
        if self.probe is not None:
            await self.probe.tell("record", [event, payload])

    @handler
    async def echo(self, body: Any) -> Any:
        return body

    @handler
    async def pid(self) -> int:
        return os.getpid()

    @handler
    async def count(self, body: Any) -> None:
        self.num_told += int(body)

    @handler
    async def get_count(self) -> int:
        return self.num_told

    @handler
    async def sleep(self, body: Any) -> Any:
        """Sleep ``body["s"]`` seconds, tagging the work with ``body["tag"]``."""
        try:
            await self._note("sleeping", body["tag"])
            await asyncio.sleep(float(body["s"]))
        except asyncio.CancelledError:
            await self._note("cancelled", body["tag"])
            raise
        self.ran.append(body["tag"])
        return body["tag"]

    @handler
    async def get_ran(self) -> list[Any]:
        return list(self.ran)

    @handler
    async def block(self, body: Any) -> None:
        """Block the whole event loop (a hung process, from the supervisor's view)."""
        time.sleep(float(body))

    @handler
    async def fail(self, body: Any) -> None:
        raise ValueError(str(body))

    @handler
    async def call(self, body: Any) -> Any:
        """Ask ``body["ref"].echo(body["value"])``: refs travel inside bodies."""
        ref = body["ref"]
        assert isinstance(ref, ActorRef)
        return await ref.ask("echo", body["value"], timeout=5.0)

    @stream_handler
    async def count_up(self, body: Any) -> AsyncIterator[int]:
        """Yield 0..n-1, pausing ``delay`` s between items."""
        n, delay = int(body["n"]), float(body.get("delay", 0.0))
        try:
            for i in range(n):
                if delay:
                    await asyncio.sleep(delay)
                yield i
        except (asyncio.CancelledError, GeneratorExit):
            await asyncio.shield(self._note("cancelled", body.get("tag", "stream")))
            raise

    @handler
    async def stubborn(self, body: Any) -> Any:
        """Ignore cancellation (and so the deadline): always reply, late if need be."""
        end = time.monotonic() + float(body["s"])
        while (left := end - time.monotonic()) > 0:
            try:
                await asyncio.sleep(left)
            except asyncio.CancelledError:
                await self._note("ignored-cancel", body["tag"])
        return body["tag"]

    @stream_handler
    async def fail_after(self, body: Any) -> AsyncIterator[int]:
        for i in range(int(body)):
            yield i
        raise RuntimeError("stream broke")


class TinyMailboxWorker(WorkerActor):
    """A ``WorkerActor`` whose mailbox holds two messages, to provoke overload."""

    mailbox_size = 2
