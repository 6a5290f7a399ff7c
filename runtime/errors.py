"""The runtime's small exception hierarchy and its mapping to wire ``Error`` messages.

Every failure a caller of ``ActorRef.ask`` / ``ask_stream`` can see is an ``ActorError``
carrying the wire ``ErrorCode`` and whether retrying may help, so the same typed error
reaches the caller whether the actor lives in this process or another one.
"""

from __future__ import annotations

from typing import Any

from treeserve.transport.messages import Error
from treeserve.transport.wire import RETRYABLE_CODES, ErrorCode

__all__ = [
    "ActorDeadError",
    "ActorError",
    "CallCancelled",
    "ConnectionLost",
    "DeadlineExceeded",
    "NoSuchActor",
    "NoSuchMethod",
    "OverloadedError",
    "RemoteError",
    "RuntimeClosedError",
    "SupervisorGaveUp",
    "error_from_wire",
    "error_to_wire",
]


class ActorError(Exception):
    """Base class of every runtime error; ``code`` is the wire reason and ``retryable``
    says whether resending the same request (if idempotent) may succeed."""

    default_code: ErrorCode = ErrorCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode | None = None,
        retryable: bool | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code: ErrorCode = code if code is not None else self.default_code
        self.retryable: bool = self.code in RETRYABLE_CODES if retryable is None else retryable
        self.details = details


class ActorDeadError(ActorError):
    """The target actor (or its whole process) died or was stopped before answering."""

    default_code = ErrorCode.ACTOR_DEAD


class ConnectionLost(ActorDeadError):
    """Raised on the caller's side: the connection to the callee's node dropped after it
    was established, or the node said nothing for longer than its liveness timeout. The
    answer can no longer arrive (a ROUTER drops replies to a vanished connection)."""


class DeadlineExceeded(ActorError, TimeoutError):
    """The call's deadline passed before a reply arrived; the callee drops or cancels
    the work. Also a ``TimeoutError`` so generic timeout handling catches it."""

    default_code = ErrorCode.DEADLINE_EXCEEDED


class OverloadedError(ActorError):
    """The callee's mailbox is full, or the caller has too many calls in flight."""

    default_code = ErrorCode.OVERLOADED


class NoSuchActor(ActorError):
    """No actor with the target name is registered on the target node."""

    default_code = ErrorCode.NO_SUCH_ACTOR


class NoSuchMethod(ActorError):
    """The target actor has no handler of that name (or of that kind: unary vs stream)."""

    default_code = ErrorCode.NO_SUCH_METHOD


class CallCancelled(ActorError):
    """The callee (not the caller) cancelled the call, e.g. it was shutting down."""

    default_code = ErrorCode.CANCELLED


class RuntimeClosedError(ActorError):
    """The local runtime is closed or closing; no new calls are accepted."""

    default_code = ErrorCode.UNAVAILABLE


class SupervisorGaveUp(ActorError):
    """A supervisor exceeded its restart intensity and stopped restarting children."""

    default_code = ErrorCode.ACTOR_DEAD


class RemoteError(ActorError):
    """Any other failure reported by the callee: a handler raised (code ``INTERNAL``),
    the request was malformed, etc. ``message`` is the callee's text."""


_BY_CODE: dict[ErrorCode, type[ActorError]] = {
    ErrorCode.ACTOR_DEAD: ActorDeadError,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    ErrorCode.OVERLOADED: OverloadedError,
    ErrorCode.NO_SUCH_ACTOR: NoSuchActor,
    ErrorCode.NO_SUCH_METHOD: NoSuchMethod,
    ErrorCode.CANCELLED: CallCancelled,
}


def error_from_wire(err: Error) -> ActorError:
    """Build the typed exception a caller sees for a wire ``Error``."""
    cls = _BY_CODE.get(err.code, RemoteError)
    return cls(err.message, code=err.code, retryable=err.retryable, details=err.details)


def error_to_wire(msg_id: int | None, exc: BaseException) -> Error:
    """Describe ``exc`` (raised by a handler or by the runtime) as a wire ``Error``;
    non-runtime exceptions become ``INTERNAL`` with the exception type in the text."""
    if isinstance(exc, ActorError):
        return Error(msg_id, exc.code, exc.message, exc.retryable, exc.details)
    text = f"{type(exc).__name__}: {exc}"
    return Error(msg_id, ErrorCode.INTERNAL, text, False, None)


def error_from_local(exc: BaseException) -> ActorError:
    """The exception an in-process caller sees for ``exc``: identical in type and text
    to what a remote caller would get after a wire round trip."""
    if isinstance(exc, ActorError):
        return exc
    return error_from_wire(error_to_wire(None, exc))
