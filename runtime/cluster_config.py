"""Frozen, validated configuration and wire names of a multi-host cluster.

A cluster is one *head* runtime hosting a ``ClusterRegistry`` plus any number of
*nodes* (``treeserve node --join``) that each host a ``NodeAgent`` and offer their
devices to the head. These constants and configs are shared by both sides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from treeserve.runtime.config import RestartStrategy, SupervisorConfig
from treeserve.runtime.curve import LinkCurve
from treeserve.transport.sockets import is_loopback_endpoint

__all__ = [
    "AGENT_NAME",
    "REGISTRY_NAME",
    "NodeConfig",
    "NodeExit",
    "RegistryConfig",
    "host_endpoint",
]

REGISTRY_NAME = "cluster-registry"
"""Name of the ``ClusterRegistry`` actor on the head's node."""

AGENT_NAME = "node-agent"
"""Name of the ``NodeAgent`` actor on every joined node."""


class NodeExit(enum.StrEnum):
    """Why ``join`` returned: the head stopped answering, or it no longer knows us
    (it declared this node dead, e.g. after a network partition)."""

    HEAD_LOST = "head_lost"
    DROPPED_BY_HEAD = "dropped_by_head"


def host_endpoint(host: str, port: int = 0) -> str:
    """``tcp://host:port``, with brackets around an IPv6 address."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _positive(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{owner}.{name} must be a positive number, got {value!r}")


def _count(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """How a joining node serves the head.

    ``advertise_host`` is the address the node's runtime and every child actor bind,
    and so the address the head connects to; it must be an address of this host that
    the head can reach (loopback only works when the head runs on the same host). A
    non-loopback address needs ``allow_public_bind=True``. ``curve`` secures the links:
    the node's ROUTERs (its own and its children's) admit only the allow-listed CURVE
    keys and its calls to the head are CURVE clients; the head's runtime must be given a
    matching ``RuntimeConfig.curve`` (``runtime/curve.py``). Without it the links are
    plaintext and unauthenticated: use a trusted network. ``devices`` overrides device
    detection (None: ``["cuda:0", ...]`` when torch sees CUDA devices, else ``["cpu"]``). ``supervisor`` configures the
    supervisors of the node's child actors (``strategy`` is the default for spawned
    groups). The node pings the head every ``ping_interval_s`` and exits after
    ``ping_misses`` failed pings in a row; it gives up joining after
    ``register_timeout_s``. ``name`` is a label for logs (default: the hostname).
    """

    advertise_host: str = "127.0.0.1"
    allow_public_bind: bool = False
    devices: tuple[str, ...] | None = None
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    ping_interval_s: float = 0.5
    ping_misses: int = 4
    register_timeout_s: float = 30.0
    close_timeout_s: float = 5.0
    name: str = ""
    curve: LinkCurve | None = None

    def __post_init__(self) -> None:
        host = self.advertise_host
        if not isinstance(host, str) or not host or "/" in host or host in ("*", "0.0.0.0", "::"):
            raise ValueError(
                f"NodeConfig.advertise_host must be one concrete address of this host that the "
                f"head can reach (e.g. 10.0.0.5), got {host!r}"
            )
        if not self.allow_public_bind and not is_loopback_endpoint(host_endpoint(host)):
            raise ValueError(
                f"NodeConfig.advertise_host {host!r} is not a loopback address: pass "
                "allow_public_bind=True (--allow-public-bind) to serve other hosts, and a LinkCurve "
                "(curve=) to encrypt and authenticate the links, or a trusted network"
            )
        if self.curve is not None and not isinstance(self.curve, LinkCurve):
            raise ValueError(f"NodeConfig.curve must be a LinkCurve or None, got {type(self.curve).__name__}")
        if self.devices is not None:
            if not isinstance(self.devices, tuple) or not self.devices or not all(
                isinstance(d, str) and (d == "cpu" or d.startswith("cuda:")) for d in self.devices
            ):
                raise ValueError(
                    f"NodeConfig.devices must be None or a non-empty tuple of 'cpu' / 'cuda:N', "
                    f"got {self.devices!r}"
                )
        if not isinstance(self.supervisor, SupervisorConfig):
            raise ValueError("NodeConfig.supervisor must be a SupervisorConfig")
        for name in ("ping_interval_s", "register_timeout_s", "close_timeout_s"):
            _positive("NodeConfig", name, getattr(self, name))
        _count("NodeConfig", "ping_misses", self.ping_misses)
        if not isinstance(self.name, str):
            raise ValueError(f"NodeConfig.name must be a str, got {self.name!r}")

    @property
    def default_strategy(self) -> RestartStrategy:
        """The restart strategy of a spawned group that names none."""
        return self.supervisor.strategy


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    """How the head's ``ClusterRegistry`` watches joined nodes: it asks each node's
    agent to ``ping`` every ``ping_interval_s`` (each ping may take that long) and
    drops the node after ``ping_misses`` failed pings in a row. Dropping a node marks
    its agent and all its child actors dead on the head, so calls to them fail with
    ``ActorDeadError`` instead of waiting for their deadline."""

    ping_interval_s: float = 0.5
    ping_misses: int = 3

    def __post_init__(self) -> None:
        _positive("RegistryConfig", "ping_interval_s", self.ping_interval_s)
        _count("RegistryConfig", "ping_misses", self.ping_misses)
