"""treeserve.transport: bytes on the wire (ZeroMQ ROUTER/DEALER + msgpack).

See ``PROTOCOL.md`` in this package for the language-neutral specification.
"""

from treeserve.transport.codec import decode, encode
from treeserve.transport.errors import DecodeError, EncodeError, InsecureBindError, TransportError
from treeserve.transport.messages import (
    ActorAddress,
    Cancel,
    Error,
    Heartbeat,
    Message,
    Reply,
    Request,
    StreamEnd,
    StreamItem,
    kind_of,
)
from treeserve.transport.sockets import (
    CurveAuthenticator,
    CurveClientConfig,
    CurveServerConfig,
    bound_endpoint,
    generate_keypair,
    is_loopback_endpoint,
    make_dealer,
    make_router,
)
from treeserve.transport.wire import (
    DEFAULT_LIMITS,
    EXT_ACTOR_REF,
    EXT_TENSOR,
    PROTOCOL_VERSION,
    RETRYABLE_CODES,
    ErrorCode,
    Kind,
    WireLimits,
)

__all__ = [
    "DEFAULT_LIMITS",
    "EXT_ACTOR_REF",
    "EXT_TENSOR",
    "PROTOCOL_VERSION",
    "RETRYABLE_CODES",
    "ActorAddress",
    "Cancel",
    "CurveAuthenticator",
    "CurveClientConfig",
    "CurveServerConfig",
    "DecodeError",
    "EncodeError",
    "Error",
    "ErrorCode",
    "Heartbeat",
    "InsecureBindError",
    "Kind",
    "Message",
    "Reply",
    "Request",
    "StreamEnd",
    "StreamItem",
    "TransportError",
    "WireLimits",
    "bound_endpoint",
    "decode",
    "encode",
    "generate_keypair",
    "is_loopback_endpoint",
    "kind_of",
    "make_dealer",
    "make_router",
]
