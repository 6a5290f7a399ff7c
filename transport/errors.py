"""The transport's small exception hierarchy."""

from __future__ import annotations

from treeserve.transport.wire import ErrorCode

__all__ = ["DecodeError", "EncodeError", "InsecureBindError", "TransportError"]


class TransportError(Exception):
    """Base class of every error raised by ``treeserve.transport``."""


class EncodeError(TransportError, ValueError):
    """A message cannot be put on the wire: an unsupported value inside ``body``, a
    mistyped field, or a size/depth a peer with the same limits would reject."""


class DecodeError(TransportError):
    """A received message was rejected before anything acted on it. ``code`` says why
    (reply with it), ``message`` is human-readable; ``msg_id`` is the offending message's id
    and ``kind`` its ``kind`` string (possibly one no version defines) when the header was
    readable enough to recover them, else None. A receiver decides from ``kind`` whether to
    answer at all (answers are never answered, ``PROTOCOL.md`` section 6)."""

    def __init__(self, code: ErrorCode, message: str, msg_id: int | None = None,
                 kind: str | None = None) -> None:
        super().__init__(f"{code.value}: {message}" + ("" if msg_id is None else f" (id={msg_id})"))
        self.code = code
        self.message = message
        self.msg_id = msg_id
        self.kind = kind


class InsecureBindError(TransportError, ValueError):
    """Refused to bind a socket on a non-loopback address without ``allow_public_bind``."""
