"""Frozen, validated configuration of the runtime and its supervisors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from treeserve.runtime.curve import LinkCurve
from treeserve.transport.wire import DEFAULT_LIMITS, WireLimits

__all__ = ["ChildTransport", "RestartStrategy", "RuntimeConfig", "SupervisorConfig"]


class RestartStrategy(enum.StrEnum):
    """What a supervisor restarts when one child fails: only it, or all its children."""

    ONE_FOR_ONE = "one_for_one"
    ONE_FOR_ALL = "one_for_all"


class ChildTransport(enum.StrEnum):
    """Endpoint kind a child process binds its node on."""

    IPC = "ipc"
    TCP = "tcp"


def _positive(owner: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{owner}.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    """How a supervisor watches and restarts its children.

    At most ``max_restarts`` restarts within any ``within_s`` seconds; one more failure
    and the supervisor gives up (stops its children and reports ``SupervisorGaveUp``).
    A child is declared dead when its process exits, when it misses
    ``heartbeat_misses`` consecutive ``heartbeat_interval_s`` beats (a hung or stopped
    process), or when it is not ready within ``start_timeout_s`` of being launched.
    """

    strategy: RestartStrategy = RestartStrategy.ONE_FOR_ONE
    max_restarts: int = 3
    within_s: float = 5.0
    heartbeat_interval_s: float = 0.5
    heartbeat_misses: int = 3
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, RestartStrategy):
            raise ValueError(
                f"SupervisorConfig.strategy must be one of {[s.value for s in RestartStrategy]}"
                f", got {self.strategy!r}"
            )
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise ValueError(f"SupervisorConfig.max_restarts must be an int, got {self.max_restarts!r}")
        if self.max_restarts < 0:
            raise ValueError(f"SupervisorConfig.max_restarts must be >= 0, got {self.max_restarts}")
        if isinstance(self.heartbeat_misses, bool) or not isinstance(self.heartbeat_misses, int):
            raise ValueError("SupervisorConfig.heartbeat_misses must be an int")
        if self.heartbeat_misses < 1:
            raise ValueError(
                f"SupervisorConfig.heartbeat_misses must be >= 1, got {self.heartbeat_misses}"
            )
        for name in ("within_s", "heartbeat_interval_s", "start_timeout_s"):
            _positive("SupervisorConfig", name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """Configuration of one process's runtime (one node).

    ``bind`` is the node's ROUTER endpoint (``inproc://``, ``ipc://`` or ``tcp://``);
    None binds a private ipc socket in a temporary directory. ``default_timeout_s`` is
    the deadline of an ``ask`` that passes none (None: wait forever, only sensible when
    the callee is supervised). ``max_in_flight`` bounds outstanding calls made by this
    node, ``mailbox_size`` is the default per-actor mailbox bound, ``stream_buffer`` the
    items buffered per incoming stream before it is cancelled as overloaded.
    ``close_timeout_s`` bounds ``Runtime.aclose``. ``child_transport`` is the endpoint
    kind of child processes, ``supervisor`` the config of the default supervisor.
    ``parent_endpoint``/``node_name`` are set only inside a child process: the node
    then sends heartbeats every ``heartbeat_interval_s`` to its parent. ``curve``
    secures every link of this node (its ROUTER admits only allow-listed CURVE keys, its
    calls are CURVE clients) and is passed on to its child processes; None: plaintext.
    """

    bind: str | None = None
    limits: WireLimits = DEFAULT_LIMITS
    default_timeout_s: float | None = 30.0
    max_in_flight: int = 10_000
    mailbox_size: int = 1024
    stream_buffer: int = 256
    close_timeout_s: float = 5.0
    child_transport: ChildTransport = ChildTransport.IPC
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    parent_endpoint: str | None = None
    node_name: str = ""
    heartbeat_interval_s: float = 0.5
    allow_public_bind: bool = False
    curve: LinkCurve | None = None

    def __post_init__(self) -> None:
        if self.curve is not None and not isinstance(self.curve, LinkCurve):
            raise ValueError(f"RuntimeConfig.curve must be a LinkCurve or None, got {type(self.curve).__name__}")
        if self.bind is not None and not self.bind.startswith(("inproc://", "ipc://", "tcp://")):
            raise ValueError(
                f"RuntimeConfig.bind must start with inproc://, ipc:// or tcp://, got {self.bind!r}"
            )
        if self.default_timeout_s is not None:
            _positive("RuntimeConfig", "default_timeout_s", self.default_timeout_s)
        for name in ("max_in_flight", "mailbox_size", "stream_buffer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RuntimeConfig.{name} must be an int >= 1, got {value!r}")
        _positive("RuntimeConfig", "close_timeout_s", self.close_timeout_s)
        _positive("RuntimeConfig", "heartbeat_interval_s", self.heartbeat_interval_s)
        if not isinstance(self.child_transport, ChildTransport):
            raise ValueError(
                f"RuntimeConfig.child_transport must be a ChildTransport, got {self.child_transport!r}"
            )
