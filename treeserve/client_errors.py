"""The exceptions the Python client raises, and how a runtime ``ActorError`` becomes one.

The client calls the gateway through the runtime's ``Outbound``, whose failures are typed
``ActorError``s carrying the wire code; a client user gets the small hierarchy below
instead (``ServerError`` subclasses by code), so that catching ``OverloadedError`` or
``UnavailableError`` needs no knowledge of the runtime.
"""

from __future__ import annotations

from typing import Any

from treeserve.runtime.errors import ActorError, ConnectionLost, RuntimeClosedError

__all__ = [
    "ClientClosedError",
    "ClientError",
    "ConnectTimeoutError",
    "ConnectionLostError",
    "DeadlineExceededError",
    "InvalidRequestError",
    "OverloadedError",
    "RequestCancelledError",
    "ServerError",
    "UnavailableError",
    "client_error",
]


class ClientError(Exception):
    """Base class of every error raised by ``Client``."""


class ClientClosedError(ClientError):
    """The client was closed (before or during the call)."""


class ServerError(ClientError):
    """The gateway answered with an ``error``: ``code`` (wire error code), ``message``
    (its text) and ``retryable`` (resending may succeed, e.g. ``overloaded``)."""

    def __init__(self, code: str, message: str, retryable: bool = False,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable
        self.details = details


class InvalidRequestError(ServerError, ValueError):
    """The request was rejected (``invalid_request``, or ``too_large`` before sending)."""


class OverloadedError(ServerError):
    """The gateway has too many streams open (``overloaded``); back off and retry."""


class UnavailableError(ServerError):
    """The gateway or the model behind it is unavailable (shutting down, actor died)."""


class ConnectionLostError(UnavailableError):
    """Client-side: the gateway stopped answering (no message, not even a heartbeat,
    within ``server_timeout_s`` while a call was open), or its connection dropped."""


class ConnectTimeoutError(UnavailableError):
    """Client-side: the gateway could not be reached within ``connect_timeout_s`` (no server
    at the endpoint yet, or one that refuses our CURVE keys); the message names both."""


class DeadlineExceededError(ServerError, TimeoutError):
    """The call's ``timeout`` ran out (detected by the gateway or by the client)."""


class RequestCancelledError(ServerError):
    """The gateway cancelled the call."""


_BY_CODE: dict[str, type[ServerError]] = {
    "invalid_request": InvalidRequestError,
    "too_large": InvalidRequestError,
    "overloaded": OverloadedError,
    "unavailable": UnavailableError,
    "actor_dead": UnavailableError,
    "deadline_exceeded": DeadlineExceededError,
    "cancelled": RequestCancelledError,
}


def client_error(exc: ActorError) -> ClientError:
    """The client's exception for a failed call: the gateway's ``error`` keeps its code,
    text and ``retryable`` flag; a lost connection and a closed client are the client's own."""
    if isinstance(exc, RuntimeClosedError):
        return ClientClosedError("client closed")
    if isinstance(exc, ConnectionLost):
        return ConnectionLostError("unavailable", exc.message, True)
    code = str(exc.code)
    return _BY_CODE.get(code, ServerError)(code, exc.message, exc.retryable, exc.details)
