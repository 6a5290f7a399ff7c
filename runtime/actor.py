"""The ``Actor`` base class and the ``@handler`` / ``@stream_handler`` decorators."""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from treeserve.runtime.errors import ActorError
from treeserve.runtime.ref import ActorRef
from treeserve.runtime.tasks import TaskOwner
from treeserve.transport.messages import ActorAddress

__all__ = ["Actor", "ActorNode", "HandlerKind", "HandlerSpec", "handler", "stream_handler"]

_ATTR = "__treeserve_handler__"

F = TypeVar("F", bound=Callable[..., Any])


class ActorNode(Protocol):
    """What an actor may ask of the node that hosts it (``node.Node``): its endpoint, refs to
    other actors, hosting and stopping actors beside it, and marking another node down or up."""

    @property
    def endpoint(self) -> str: ...

    def ref(self, address: ActorAddress) -> ActorRef: ...

    async def host(self, name: str, actor: Actor, mailbox_size: int | None = None,
                   on_failure: Callable[[BaseException], None] | None = None) -> ActorRef: ...

    async def stop_actor(self, name: str, timeout_s: float) -> None: ...

    def mark_down(self, endpoint: str, exc: ActorError) -> None: ...

    def mark_up(self, endpoint: str) -> None: ...


class HandlerKind(enum.Enum):
    """A unary handler returns one value; a stream handler is an async generator."""

    UNARY = "unary"
    STREAM = "stream"


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """One message handler of an actor class: its function, kind, and whether it takes
    the request body as its single argument (``takes_body``) or no argument."""

    func: Callable[..., Any]
    kind: HandlerKind
    takes_body: bool

    def bind(self, actor: Actor, body: Any) -> Any:
        """Call the handler on ``actor``: a coroutine (unary) or an async iterator."""
        if self.takes_body:
            return self.func(actor, body)
        return self.func(actor)


def _mark(func: F, kind: HandlerKind, check: Callable[[Any], bool], what: str) -> F:
    if not check(func):
        raise TypeError(f"@{what} needs an {'async generator' if kind is HandlerKind.STREAM else 'async'} "
                        f"method, got {func!r}")
    params = list(inspect.signature(func).parameters.values())
    if len(params) not in (1, 2):
        raise TypeError(f"handler {func.__qualname__} must take (self) or (self, body)")
    setattr(func, _ATTR, HandlerSpec(func, kind, takes_body=len(params) == 2))
    return func


def handler(func: F) -> F:
    """Mark an ``async def method(self, body)`` (or ``(self)``) as a message handler;
    ``ask(method_name, body)`` runs it and replies with its return value."""
    return _mark(func, HandlerKind.UNARY, inspect.iscoroutinefunction, "handler")


def stream_handler(func: F) -> F:
    """Mark an ``async def method(self, body)`` async generator as a stream handler;
    ``ask_stream(method_name, body)`` yields each value it yields, in order."""
    return _mark(func, HandlerKind.STREAM, inspect.isasyncgenfunction, "stream_handler")


class Actor:
    """Base class of every actor. Subclasses define handlers with ``@handler`` /
    ``@stream_handler`` and may override ``on_start``/``on_stop``.

    The runtime runs at most ``max_concurrency`` messages of one actor at a time
    (default 1: handlers never interleave, so actor state needs no locks) and queues at
    most ``mailbox_size`` more (None: the runtime's default); a message arriving at a
    full mailbox is refused with ``OverloadedError``. ``self.ref``, ``self.node`` and
    ``self.tasks`` are available from ``on_start`` on.

    Background work (a step loop, a receive loop) is started with ``self.tasks.start``:
    the runtime cancels and awaits those tasks when the actor stops (after ``on_stop``),
    and a task that dies of an exception is logged and reported to the actor's
    supervisor, which restarts the actor (``LocalSupervisor``); never use a bare
    ``asyncio.create_task``.
    """

    max_concurrency: ClassVar[int] = 1
    mailbox_size: ClassVar[int | None] = None
    handlers: ClassVar[dict[str, HandlerSpec]] = {}

    _ref: ActorRef | None = None
    _node: ActorNode | None = None
    _tasks: TaskOwner | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if isinstance(cls.max_concurrency, bool) or not isinstance(cls.max_concurrency, int) \
                or cls.max_concurrency < 1:
            raise TypeError(f"{cls.__qualname__}.max_concurrency must be an int >= 1")
        table: dict[str, HandlerSpec] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                spec = getattr(value, _ATTR, None)
                if isinstance(spec, HandlerSpec):
                    table[name] = spec
                elif name in table:
                    del table[name]  # overridden by a non-handler
        cls.handlers = table

    def attach(self, node: ActorNode, ref: ActorRef, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Called by the runtime before ``on_start``; binds the actor to its node.
        ``on_failure`` hears of every owned task that dies of an exception."""
        self._node = node
        self._ref = ref
        self._tasks = TaskOwner(f"actor:{ref.name}", on_failure)

    @property
    def tasks(self) -> TaskOwner:
        """The owner of this actor's background tasks (closed when the actor stops)."""
        if self._tasks is None:
            raise RuntimeError(f"{type(self).__qualname__} is not attached to a runtime yet")
        return self._tasks

    @property
    def ref(self) -> ActorRef:
        """This actor's own reference (pass it to others so they can call back)."""
        if self._ref is None:
            raise RuntimeError(f"{type(self).__qualname__} is not attached to a runtime yet")
        return self._ref

    @property
    def node(self) -> ActorNode:
        """The node hosting this actor (use ``node.ref(address)`` to call other actors)."""
        if self._node is None:
            raise RuntimeError(f"{type(self).__qualname__} is not attached to a runtime yet")
        return self._node

    async def on_start(self) -> None:
        """Runs once before the first message; raising here fails the spawn."""

    async def on_stop(self) -> None:
        """Runs once after the last message when the actor is stopped gracefully."""


