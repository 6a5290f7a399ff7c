"""Configured pyzmq asyncio sockets: ROUTER servers, DEALER clients, optional CURVE.

Every socket gets the same options from ``WireLimits`` (MAXMSGSIZE, HWMs, LINGER).
A ROUTER refuses a non-loopback tcp bind unless told otherwise, and a CURVE ROUTER only
accepts clients whose public key is on its allow-list, checked by a running
``CurveAuthenticator`` (ZAP handler) that the caller owns.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from treeserve.transport.errors import InsecureBindError, TransportError
from treeserve.transport.wire import DEFAULT_LIMITS, WireLimits

__all__ = [
    "CurveAuthenticator",
    "CurveClientConfig",
    "CurveServerConfig",
    "bound_endpoint",
    "generate_keypair",
    "is_loopback_endpoint",
    "make_dealer",
    "make_router",
]

_log = logging.getLogger(__name__)
_Z85_KEY_LEN = 40
_AUTH_STOP_TIMEOUT_S = 1.0


def generate_keypair() -> tuple[bytes, bytes]:
    """Return a new CURVE ``(public_key, secret_key)`` pair, each 40 bytes of Z85 text."""
    public, secret = zmq.curve_keypair()
    return public, secret


def _check_key(owner: str, name: str, key: object) -> None:
    if not isinstance(key, bytes) or len(key) != _Z85_KEY_LEN:
        raise ValueError(f"{owner}.{name} must be a 40-byte Z85 CURVE key (see generate_keypair)")


@dataclass(frozen=True, slots=True)
class CurveServerConfig:
    """CURVE identity of a ROUTER and the public keys of the clients it accepts (Z85,
    40 bytes each). An empty allow-list admits nobody."""

    public_key: bytes
    secret_key: bytes
    allowed_client_public_keys: frozenset[bytes] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        _check_key("CurveServerConfig", "public_key", self.public_key)
        _check_key("CurveServerConfig", "secret_key", self.secret_key)
        if not isinstance(self.allowed_client_public_keys, frozenset):
            raise ValueError("CurveServerConfig.allowed_client_public_keys must be a frozenset")
        for key in self.allowed_client_public_keys:
            _check_key("CurveServerConfig", "allowed_client_public_keys[...]", key)


@dataclass(frozen=True, slots=True)
class CurveClientConfig:
    """CURVE identity of a DEALER and the public key of the server it expects (Z85)."""

    server_public_key: bytes
    public_key: bytes
    secret_key: bytes

    def __post_init__(self) -> None:
        _check_key("CurveClientConfig", "server_public_key", self.server_public_key)
        _check_key("CurveClientConfig", "public_key", self.public_key)
        _check_key("CurveClientConfig", "secret_key", self.secret_key)


class _AllowList:
    """pyzmq credentials provider: one allow-list per ZAP domain."""

    def __init__(self) -> None:
        self.keys_by_domain: dict[str, frozenset[bytes]] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        is_allowed = key in self.keys_by_domain.get(domain, frozenset())
        if not is_allowed:
            _log.warning("CURVE client refused on ZAP domain %r", domain)
        return is_allowed


class CurveAuthenticator:
    """Owns the ZAP handler of one ``zmq.asyncio.Context`` (at most one per context),
    needed by every CURVE ROUTER made from that context. Use
    ``async with CurveAuthenticator(ctx) as auth:`` and keep it open for as long as any of
    its sockets live: libzmq admits every CURVE client when no ZAP handler runs.
    ``aclose()`` is idempotent and bounded by a short timeout."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self._ctx = ctx
        self._allow = _AllowList()
        self._auth: AsyncioAuthenticator | None = None
        self._domain_ids = itertools.count()
        self._is_closed = False

    @property
    def is_running(self) -> bool:
        """True between ``start()`` and ``aclose()``."""
        return self._auth is not None

    def start(self) -> None:
        """Bind the ZAP handler (must be called with the event loop running)."""
        if self._is_closed:
            raise TransportError("CurveAuthenticator was closed; make a new one")
        if self._auth is not None:
            return
        auth = AsyncioAuthenticator(self._ctx)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=self._allow)
        self._auth = auth

    def register(self, allowed_client_public_keys: frozenset[bytes]) -> str:
        """Reserve a fresh ZAP domain admitting exactly these client keys; return its name."""
        if self._auth is None:
            raise TransportError("CurveAuthenticator is not running; call start() first")
        domain = f"treeserve-{next(self._domain_ids)}"
        self._allow.keys_by_domain[domain] = allowed_client_public_keys
        # The pyzmq authenticator looks providers up by exact domain.
        self._auth.configure_curve_callback(domain=domain, credentials_provider=self._allow)
        return domain

    async def aclose(self) -> None:
        """Stop the ZAP handler and wait (bounded) for its task to end."""
        self._is_closed = True
        auth, self._auth = self._auth, None
        if auth is None:
            return
        task: Any = getattr(auth, "_AsyncioAuthenticator__task", None)
        auth.stop()
        if isinstance(task, asyncio.Future):
            await asyncio.wait([task], timeout=_AUTH_STOP_TIMEOUT_S)

    async def __aenter__(self) -> CurveAuthenticator:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for inproc:// and ipc:// endpoints and tcp:// on 127.0.0.0/8, ::1 or localhost."""
    if endpoint.startswith(("inproc://", "ipc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name, or a hostname: not provably loopback


def _apply_limits(sock: zmq.asyncio.Socket, limits: WireLimits) -> None:
    # MAXMSGSIZE is per frame: zmq disconnects a peer sending a bigger frame before
    # buffering it. The codec enforces the total over all frames.
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, limits.sndhwm)
    sock.setsockopt(zmq.RCVHWM, limits.rcvhwm)
    sock.setsockopt(zmq.LINGER, limits.linger_ms)


def _check_scheme(endpoint: str) -> None:
    if not endpoint.startswith(("inproc://", "ipc://", "tcp://")):
        raise ValueError(f"unsupported endpoint {endpoint!r}: use inproc://, ipc:// or tcp://")


def make_router(
    ctx: zmq.asyncio.Context,
    bind: str,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
    curve: CurveServerConfig | None = None,
    authenticator: CurveAuthenticator | None = None,
    allow_public_bind: bool = False,
    handover: bool = False,
) -> zmq.asyncio.Socket:
    """Create a ROUTER bound to ``bind`` (``tcp://127.0.0.1:0`` picks a free port; see
    ``bound_endpoint``). ROUTER_MANDATORY is on, so sending to a vanished peer raises
    ``zmq.ZMQError(EHOSTUNREACH)`` instead of dropping silently. A non-loopback tcp bind
    raises ``InsecureBindError`` unless ``allow_public_bind``. With ``curve``, a running
    ``authenticator`` on the same context is required and enforces the allow-list.
    ``handover`` (ROUTER_HANDOVER): a peer reconnecting with the routing id of a connection
    the ROUTER still holds takes that id over, instead of being refused it, so a client that
    sets its own id is reachable again under it at once after a reconnect."""
    _check_scheme(bind)
    if not allow_public_bind and not is_loopback_endpoint(bind):
        raise InsecureBindError(
            f"refusing to bind {bind!r}: not a loopback address; pass allow_public_bind=True "
            "(and use CURVE) to serve other hosts"
        )
    if curve is not None and (authenticator is None or not authenticator.is_running):
        raise ValueError(
            "a CURVE router needs a running CurveAuthenticator on the same context; without "
            "one libzmq would admit every client"
        )
    sock = ctx.socket(zmq.ROUTER)
    try:
        _apply_limits(sock, limits)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if handover:
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if curve is not None:
            assert authenticator is not None  # checked above
            domain = authenticator.register(curve.allowed_client_public_keys)
            sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
        if bind.startswith("tcp://[") or bind.count(":") > 2:
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(bind)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def make_dealer(
    ctx: zmq.asyncio.Context,
    connect: str,
    *,
    identity: bytes | None = None,
    limits: WireLimits = DEFAULT_LIMITS,
    curve: CurveClientConfig | None = None,
    before_connect: Callable[[zmq.asyncio.Socket], None] | None = None,
) -> zmq.asyncio.Socket:
    """Create a DEALER connected to ``connect``; ``identity`` (1..255 bytes, not starting
    with a zero byte) is the routing id the ROUTER sees, else zmq picks one.
    ``before_connect(sock)`` runs on the configured socket just before it connects (attach a
    socket monitor there: one attached later can miss the first handshake)."""
    _check_scheme(connect)
    if identity is not None and not (1 <= len(identity) <= 255 and identity[0] != 0):
        raise ValueError("identity must be 1..255 bytes and must not start with a zero byte")
    sock = ctx.socket(zmq.DEALER)
    try:
        _apply_limits(sock, limits)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if curve is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
        if connect.startswith("tcp://[") or connect.count(":") > 2:
            sock.setsockopt(zmq.IPV6, 1)
        if before_connect is not None:
            before_connect(sock)
        sock.connect(connect)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def bound_endpoint(sock: zmq.asyncio.Socket) -> str:
    """The endpoint ``sock`` last bound, with the real port after a ``:0`` / ``:*`` bind."""
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if not endpoint:
        raise TransportError("socket has not been bound")
    return endpoint
