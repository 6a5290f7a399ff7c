"""``TaskOwner``: the owner of a component's background tasks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["TaskOwner"]

_log = logging.getLogger(__name__)


class TaskOwner:
    """Owns long-lived background tasks of one component (node, supervisor, runtime).

    Every task started with ``start`` is cancelled and awaited by ``aclose`` (idempotent,
    bounded by ``timeout_s``); a task that dies with an exception is logged, not lost.
    Unlike a ``TaskGroup``, one failing task does not cancel its siblings: a node must
    keep serving other peers when one connection's task fails. ``on_failure`` (optional)
    is called with the exception of every task that dies of one (not of a cancel), after
    it is logged: an actor's supervisor uses it to restart the actor.
    """

    def __init__(self, owner: str, on_failure: Callable[[BaseException], None] | None = None) -> None:
        self._owner = owner
        self._on_failure = on_failure
        self._tasks: set[asyncio.Task[Any]] = set()
        self._is_closed = False

    def start(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Start ``coro`` as a task owned by this object."""
        if self._is_closed:
            coro.close()
            raise RuntimeError(f"{self._owner}: cannot start task {name!r} after aclose()")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self._owner}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        _log.error("%s: task %s failed", self._owner, task.get_name(), exc_info=exc)
        if self._on_failure is not None and not self._is_closed:
            try:
                self._on_failure(exc)
            except Exception:  # a broken callback must not hide the task's own failure
                _log.exception("%s: on_failure callback failed", self._owner)

    async def aclose(self, timeout_s: float) -> None:
        """Cancel every owned task and wait up to ``timeout_s`` for them to finish."""
        self._is_closed = True
        tasks = list(self._tasks)
        current = asyncio.current_task()
        for task in tasks:
            if task is not current:
                task.cancel()
        waiting = [t for t in tasks if t is not current]
        if waiting:
            _done, pending = await asyncio.wait(waiting, timeout=timeout_s)
            if pending:
                _log.warning("%s: %d tasks did not stop within %.1fs", self._owner, len(pending), timeout_s)
