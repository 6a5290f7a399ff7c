"""Typed wire messages: one frozen dataclass per ``Kind``.

These are plain values; ``treeserve.transport.codec`` turns them into zmq frames and
back. ``body`` fields hold any msgpack-able value plus tensors (numpy arrays, torch CPU
tensors) and ``ActorAddress`` values at any depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from treeserve.transport.wire import ErrorCode, Kind

__all__ = [
    "ActorAddress",
    "Cancel",
    "Error",
    "Heartbeat",
    "Message",
    "Reply",
    "Request",
    "StreamEnd",
    "StreamItem",
    "kind_of",
]


@dataclass(frozen=True, slots=True)
class ActorAddress:
    """A serializable, hashable reference to an actor: the zmq ``endpoint`` of the process
    hosting it and the actor's ``name`` there. Encoded as msgpack ext ``EXT_ACTOR_REF``
    wherever it appears inside a ``body``; the runtime wraps it in a callable handle."""

    endpoint: str
    name: str


@dataclass(frozen=True, slots=True)
class Request:
    """Ask actor ``target`` to run ``method`` with ``body``; answered by exactly one
    ``Reply`` or ``Error``, or (when ``stream``) by ``StreamItem``s then one ``StreamEnd``
    or ``Error``, all carrying the same ``id``. ``timeout_ms`` is the caller's remaining
    budget at send time (relative, so clock skew between hosts does not matter); the
    callee computes its own local deadline on receipt. None means no deadline."""

    id: int
    target: str
    method: str
    body: Any = None
    timeout_ms: int | None = None
    stream: bool = False


@dataclass(frozen=True, slots=True)
class Reply:
    """The single successful result of the non-streaming ``Request`` with the same ``id``."""

    id: int
    body: Any = None


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One item of a streaming reply; ``seq`` counts from 0 and increases by one per item
    of the stream ``id``, so the receiver can detect loss or reordering."""

    id: int
    seq: int
    body: Any = None


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """Successful end of stream ``id``; ``seq`` equals the number of items sent before it,
    and ``body`` is an optional final value."""

    id: int
    seq: int
    body: Any = None


@dataclass(frozen=True, slots=True)
class Error:
    """Failure of request ``id`` (ends a stream, too). ``id`` is None when the offending
    message's id was unreadable. ``retryable`` tells the caller whether resending may
    succeed (see ``RETRYABLE_CODES``); ``details`` is optional structured context."""

    id: int | None
    code: ErrorCode
    message: str
    retryable: bool = False
    details: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Cancel:
    """The caller no longer wants the result of request ``id``; the callee should stop work
    and may answer with an ``Error`` of code ``CANCELLED`` or nothing at all."""

    id: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Liveness beacon from ``node``; ``seq`` increases by one per beat, ``sent_at`` is the
    sender's clock in seconds (informational only: receivers judge liveness with their own
    clock). Interval and miss threshold are owned by the runtime."""

    seq: int
    sent_at: float
    node: str = ""


Message: TypeAlias = Request | Reply | StreamItem | StreamEnd | Error | Cancel | Heartbeat


def kind_of(msg: Message) -> Kind:
    """Return the wire ``Kind`` of a message value; raises TypeError for non-messages."""
    if isinstance(msg, Request):
        return Kind.REQUEST
    if isinstance(msg, Reply):
        return Kind.REPLY
    if isinstance(msg, StreamItem):
        return Kind.STREAM_ITEM
    if isinstance(msg, StreamEnd):
        return Kind.STREAM_END
    if isinstance(msg, Error):
        return Kind.ERROR
    if isinstance(msg, Cancel):
        return Kind.CANCEL
    if isinstance(msg, Heartbeat):
        return Kind.HEARTBEAT
    raise TypeError(f"not a wire message: {type(msg).__name__}")
