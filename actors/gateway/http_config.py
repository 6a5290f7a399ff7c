"""Configuration of the OpenAI-compatible HTTP front end (``HttpGateway``), the address syntax
``HOST:PORT`` it is given on the command line, and the serving states ``/health`` reports."""

from __future__ import annotations

import enum
import ipaddress
import math
from dataclasses import dataclass

__all__ = ["HttpConfig", "ServingState", "is_loopback_host", "parse_http_address"]


class ServingState(enum.StrEnum):
    """What ``GET /health`` says: the server is loading (``starting``), serving (``ready``),
    has failed for good because a supervisor gave up (``failed``), or is shutting down."""

    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (``127.0.0.0/8``, ``::1``); any other
    name or address may be reachable from other machines."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_http_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6; port 0 picks a free one) as ``(host, port)``;
    ``ValueError`` naming the problem otherwise."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"the HTTP address must be HOST:PORT (e.g. 127.0.0.1:8000), got {address!r}")
    host, _, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"the HTTP address {address!r} has no host (e.g. 127.0.0.1:8000)")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"the HTTP address {address!r} needs a port in [0, 65535]")
    return host, int(port_text)


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """Configuration of the HTTP front end.

    ``host``/``port``: where it listens (loopback by default; port 0 picks a free one). Binding
    anywhere else needs ``api_key``: then every ``/v1/`` request must send
    ``Authorization: Bearer <api_key>`` (``/health`` and ``/metrics`` stay open, for probes and
    scrapers). ``model_name``: the one model id ``/v1/models`` lists and requests must name.
    ``max_concurrent_requests`` bounds generations in flight; beyond it requests get 429 with
    ``Retry-After: overloaded_retry_after_s``. While the server starts, or after it failed for
    good, requests get 503 with ``Retry-After`` (``starting_retry_after_s`` /
    ``failed_retry_after_s``, whole seconds). ``max_body_bytes`` bounds a request body. On
    shutdown, open generations are ended with an error event, then the server waits at most
    ``shutdown_timeout_s`` for their connections.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str = "treeserve"
    max_concurrent_requests: int = 256
    overloaded_retry_after_s: int = 1
    starting_retry_after_s: int = 5
    failed_retry_after_s: int = 10
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout_s: float = 2.0

    @classmethod
    def from_address(cls, address: str, *, api_key: str | None = None, model_name: str = "treeserve",
                     max_concurrent_requests: int = 256) -> HttpConfig:
        """A config listening on ``address`` (``HOST:PORT``)."""
        host, port = parse_http_address(address)
        return cls(host=host, port=port, api_key=api_key, model_name=model_name,
                   max_concurrent_requests=max_concurrent_requests)

    @property
    def address(self) -> str:
        """``HOST:PORT`` as configured (``[::1]:PORT`` for IPv6)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError("HttpConfig.host must be a non-empty host name or address")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"HttpConfig.port must be an int in [0, 65535], got {self.port!r}")
        if self.api_key is not None and (
            not isinstance(self.api_key, str) or not self.api_key
            or any(not ("!" <= ch <= "~") for ch in self.api_key)
        ):
            raise ValueError("the API key must be a non-empty string of printable ASCII without spaces")
        if self.api_key is None and not is_loopback_host(self.host):
            raise ValueError(f"the HTTP API binds to {self.host}, which is not loopback: "
                             "set an API key (--api-key) so that only clients holding it are served")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError("HttpConfig.model_name must be a non-empty string")
        for name in ("max_concurrent_requests", "max_body_bytes", "overloaded_retry_after_s",
                     "starting_retry_after_s", "failed_retry_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HttpConfig.{name} must be an int >= 1, got {value!r}")
        timeout = self.shutdown_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
                math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"HttpConfig.shutdown_timeout_s must be a positive number, got {timeout!r}")
