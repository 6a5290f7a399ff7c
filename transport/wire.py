"""Every wire constant of the treeserve transport, in one place.

Peers written in other languages only need the values in this file (and
``PROTOCOL.md``) to speak the protocol; nothing else on the wire is implicit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "DEFAULT_LIMITS",
    "EXT_ACTOR_REF",
    "GATEWAY_LIMITS",
    "GATEWAY_TARGET",
    "EXT_TENSOR",
    "HEADER_VERSION_KEY",
    "HEADER_KIND_KEY",
    "PROTOCOL_VERSION",
    "RETRYABLE_CODES",
    "ErrorCode",
    "Kind",
    "WireLimits",
]

PROTOCOL_VERSION = 1
"""Major protocol version carried in every header as ``"v"``; a peer rejects any other value."""

HEADER_VERSION_KEY = "v"
HEADER_KIND_KEY = "kind"

EXT_TENSOR = 1
"""msgpack ext type code of a tensor reference; payload is a msgpack map {dtype, shape, frame}."""

EXT_ACTOR_REF = 2
"""msgpack ext type code of an actor address; payload is a msgpack map {endpoint, name}."""

_MIB = 1024 * 1024


class Kind(enum.StrEnum):
    """The message kind, carried in the header as ``"kind"``."""

    REQUEST = "request"
    REPLY = "reply"
    STREAM_ITEM = "stream_item"
    STREAM_END = "stream_end"
    ERROR = "error"
    CANCEL = "cancel"
    HEARTBEAT = "heartbeat"


class ErrorCode(enum.StrEnum):
    """Machine-readable reason carried by an ``error`` message; see ``RETRYABLE_CODES``."""

    BAD_MESSAGE = "bad_message"
    UNSUPPORTED_VERSION = "unsupported_version"
    TOO_LARGE = "too_large"
    UNKNOWN_KIND = "unknown_kind"
    BAD_TENSOR = "bad_tensor"
    OVERLOADED = "overloaded"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    ACTOR_DEAD = "actor_dead"
    NO_SUCH_ACTOR = "no_such_actor"
    NO_SUCH_METHOD = "no_such_method"
    INVALID_REQUEST = "invalid_request"
    INTERNAL = "internal"
    UNAVAILABLE = "unavailable"


RETRYABLE_CODES: frozenset[ErrorCode] = frozenset(
    {ErrorCode.OVERLOADED, ErrorCode.ACTOR_DEAD, ErrorCode.UNAVAILABLE}
)
"""Codes after which resending the same request (possibly elsewhere) may succeed.

Retrying is only safe for idempotent methods; the caller decides. ``DEADLINE_EXCEEDED``
is not retryable because the caller's budget is spent.
"""


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Size and shape limits that every received message is checked against before use.

    ``max_message_bytes`` bounds the sum of all frames (also set as ZMQ_MAXMSGSIZE per
    frame, so zmq drops an oversized frame before it is buffered); ``max_frames`` bounds
    the frame count (header + tensor frames); ``max_header_bytes`` bounds frame 0;
    ``max_depth`` bounds container nesting in the header; ``max_container_len`` bounds
    each array/map length; ``max_str_len`` bounds each str/bin/ext length inside the
    header. Tensors at least ``zero_copy_threshold`` bytes are sent without copying.
    ``sndhwm``/``rcvhwm``/``linger_ms`` are zmq socket options in messages / milliseconds.
    """

    max_message_bytes: int = 256 * _MIB
    max_frames: int = 64
    max_header_bytes: int = 4 * _MIB
    max_depth: int = 32
    max_container_len: int = 1_000_000
    max_str_len: int = 4 * _MIB
    zero_copy_threshold: int = 64 * 1024
    sndhwm: int = 1000
    rcvhwm: int = 1000
    linger_ms: int = 0

    def __post_init__(self) -> None:
        positive = {
            "max_message_bytes": self.max_message_bytes,
            "max_frames": self.max_frames,
            "max_header_bytes": self.max_header_bytes,
            "max_depth": self.max_depth,
            "max_container_len": self.max_container_len,
            "max_str_len": self.max_str_len,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"WireLimits.{name} must be a positive int, got {value!r}")
        non_negative = {
            "zero_copy_threshold": self.zero_copy_threshold,
            "sndhwm": self.sndhwm,
            "rcvhwm": self.rcvhwm,
            "linger_ms": self.linger_ms,
        }
        for name, value in non_negative.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"WireLimits.{name} must be an int >= 0, got {value!r}")
        if self.max_header_bytes > self.max_message_bytes:
            raise ValueError(
                f"WireLimits.max_header_bytes ({self.max_header_bytes}) must not exceed "
                f"max_message_bytes ({self.max_message_bytes})"
            )
        if self.max_frames < 1:
            raise ValueError("WireLimits.max_frames must allow at least the header frame")


DEFAULT_LIMITS = WireLimits()

GATEWAY_TARGET = "gateway"
"""The ``target`` every client request names (PROTOCOL.md)."""

GATEWAY_LIMITS = WireLimits(
    max_message_bytes=2 * 1024 * 1024,
    max_frames=1,
    max_header_bytes=1024 * 1024,
    max_container_len=262_144,
    max_str_len=1024 * 1024,
)
"""Receive limits of the gateway's public socket: clients send small header-only requests, so
anything bigger or with tensor frames is refused (``too_large``) before it is used. Clients
check their requests against it before sending."""
