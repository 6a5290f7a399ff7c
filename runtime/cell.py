"""``ActorCell``: one hosted actor's bounded mailbox and the workers that run it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from treeserve.runtime.actor import Actor, HandlerKind, HandlerSpec
from treeserve.runtime.calls import Envelope, EnvelopeState
from treeserve.runtime.errors import ActorDeadError, ActorError, CallCancelled, DeadlineExceeded
from treeserve.runtime.stats import NodeStats
from treeserve.runtime.tasks import TaskOwner

__all__ = ["ActorCell", "CellNode"]


class CellNode(Protocol):
    """What a cell needs of its node (``node.Node``): its tasks, its counters, and the ways to
    answer a call."""

    tasks: TaskOwner
    stats: NodeStats

    def finish_reply(self, env: Envelope, result: Any) -> None: ...

    def finish_error(self, env: Envelope, exc: BaseException) -> None: ...

    async def stream_item(self, env: Envelope, seq: int, item: Any) -> None: ...

    def finish_stream(self, env: Envelope, seq: int) -> None: ...

_log = logging.getLogger(__name__)


class _Worker:
    """One of an actor's ``max_concurrency`` workers. ``current`` is set only while a
    handler runs, so a cancel aimed at a request can never hit the next one."""

    __slots__ = ("cancel_reason", "current", "task")

    def __init__(self) -> None:
        self.current: Envelope | None = None
        self.cancel_reason: ActorError | None = None
        self.task: asyncio.Task[None] | None = None


class ActorCell:
    """Hosts one actor: a mailbox bounded to ``mailbox_size`` envelopes and up to
    ``actor.max_concurrency`` long-lived worker tasks that take envelopes in order.

    Workers start on demand: one at start, another whenever an envelope arrives and every
    worker is busy, until ``max_concurrency`` (the scheduler's 65,536 workers, all started
    up front, took 1.2 s to start and 1.6 s to stop). No task is created per message once
    the pool has grown to the actor's peak concurrency. Cancelling one request (caller cancelled, or its
    deadline passed while running) cancels the worker running it and then resumes that
    worker via ``Task.uncancel``; the handler observes ``CancelledError``. A request
    whose deadline passed while queued is dropped without running.
    """

    def __init__(self, node: CellNode, name: str, actor: Actor, mailbox_size: int) -> None:
        self.name = name
        self.actor = actor
        self.handlers: dict[str, HandlerSpec] = type(actor).handlers
        self.is_alive = False
        self._node = node
        self._queue: asyncio.Queue[Envelope] = asyncio.Queue(maxsize=mailbox_size)
        self._max_workers = type(actor).max_concurrency
        self._workers: list[_Worker] = []
        self._num_waiting = 0  # workers waiting for an envelope

    async def start(self) -> None:
        """Run ``on_start`` then start the workers (owned by the node)."""
        try:
            await self.actor.on_start()
        except BaseException:
            await self.actor.tasks.aclose(1.0)  # what on_start began dies with the failed start
            raise
        self.is_alive = True
        self._add_worker()

    def _add_worker(self) -> None:
        worker = _Worker()
        self._workers.append(worker)
        worker.task = self._node.tasks.start(self._work(worker), f"actor:{self.name}:{len(self._workers) - 1}")

    def offer(self, env: Envelope) -> bool:
        """Queue ``env``; False when the mailbox is full or the actor is not running."""
        if not self.is_alive:
            return False
        try:
            self._queue.put_nowait(env)
        except asyncio.QueueFull:
            return False
        # A woken worker leaves the count only once it has taken its envelope, so queued
        # envelopes beyond the waiting workers are the ones nobody will take now.
        if self._queue.qsize() > self._num_waiting and len(self._workers) < self._max_workers:
            self._add_worker()
        return True

    @property
    def num_queued(self) -> int:
        """Envelopes waiting in the mailbox."""
        return self._queue.qsize()

    def cancel(self, env: Envelope, reason: ActorError) -> None:
        """Stop ``env``: skip it if still queued, cancel its handler if running."""
        if env.state is EnvelopeState.QUEUED:
            env.is_cancelled = True
            return
        if env.state is not EnvelopeState.RUNNING:
            return
        for worker in self._workers:
            if worker.current is env and worker.cancel_reason is None and worker.task is not None:
                worker.cancel_reason = reason
                worker.task.cancel()
                return

    async def _work(self, worker: _Worker) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue
        node = self._node
        while True:
            self._num_waiting += 1
            try:
                env = await queue.get()
            finally:
                self._num_waiting -= 1
            if env.deadline is not None and loop.time() >= env.deadline:
                env.state = EnvelopeState.FINISHED
                node.stats.num_late_dropped += 1
                node.finish_error(env, DeadlineExceeded(
                    f"{self.name}.{env.method}: deadline passed while queued; not run"))
                continue
            if env.is_cancelled:
                env.state = EnvelopeState.FINISHED
                node.finish_error(env, CallCancelled("cancelled by the caller before it ran"))
                continue
            await self._execute(worker, env, loop)

    async def _execute(self, worker: _Worker, env: Envelope, loop: asyncio.AbstractEventLoop) -> None:
        node = self._node
        timer = None if env.deadline is None else loop.call_at(env.deadline, self._expire, worker, env)
        env.state = EnvelopeState.RUNNING
        worker.current = env
        result: Any = None
        error: BaseException | None = None
        try:
            if env.spec.kind is HandlerKind.UNARY:
                result = await env.spec.bind(self.actor, env.body)
            else:
                await self._run_stream(env)
        except asyncio.CancelledError as exc:
            if worker.cancel_reason is None:  # the actor is stopping
                env.state = EnvelopeState.FINISHED
                node.finish_error(env, ActorDeadError(f"actor {self.name!r} stopped while running"))
                raise
            error = worker.cancel_reason
            error.__cause__ = exc
        except Exception as exc:  # a handler failure is reported to its caller only
            error = exc
        finally:
            worker.current = None
            if timer is not None:
                timer.cancel()
        env.state = EnvelopeState.FINISHED
        if worker.cancel_reason is not None:
            worker.cancel_reason = None
            task = worker.task
            # The handler may have swallowed our cancel; either way reset the count. A
            # remaining count means the worker itself is being cancelled (shutdown).
            if task is not None and task.uncancel() > 0:
                node.finish_error(env, ActorDeadError(f"actor {self.name!r} stopped while running"))
                raise asyncio.CancelledError
        if error is not None:
            if env.spec.kind is HandlerKind.UNARY or not isinstance(error, asyncio.CancelledError):
                _log.debug("%s.%s failed: %r", self.name, env.method, error)
            node.finish_error(env, error)
        elif env.spec.kind is HandlerKind.UNARY:
            node.finish_reply(env, result)

    async def _run_stream(self, env: Envelope) -> None:
        agen = env.spec.bind(self.actor, env.body)
        node = self._node
        seq = 0
        try:
            async for item in agen:
                await node.stream_item(env, seq, item)
                seq += 1
        finally:
            await agen.aclose()
        node.finish_stream(env, seq)

    def _expire(self, worker: _Worker, env: Envelope) -> None:
        self.cancel(env, DeadlineExceeded(f"{self.name}.{env.method}: deadline passed while running"))

    async def stop(self, timeout_s: float) -> None:
        """Refuse new messages, cancel running handlers, fail queued callers with
        ``ActorDeadError``, then run ``on_stop`` (bounded by ``timeout_s``)."""
        if not self.is_alive:
            return
        self.is_alive = False
        # Workers running a handler first: their callers hear of the stop before the (maybe
        # tens of thousands of) idle workers are cancelled.
        busy = [w.task for w in self._workers if w.task is not None and w.current is not None]
        idle = [w.task for w in self._workers if w.task is not None and w.current is None]
        for tasks in (busy, idle):
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout_s)
        while not self._queue.empty():
            env = self._queue.get_nowait()
            env.state = EnvelopeState.FINISHED
            self._node.finish_error(env, ActorDeadError(f"actor {self.name!r} stopped"))
        try:
            async with asyncio.timeout(timeout_s):
                await self.actor.on_stop()
        except TimeoutError:
            _log.warning("actor %r: on_stop did not finish within %.1fs", self.name, timeout_s)
        except Exception:
            _log.exception("actor %r: on_stop failed", self.name)
        # Whatever on_stop left running of the actor's own tasks ends with it.
        await self.actor.tasks.aclose(timeout_s)
