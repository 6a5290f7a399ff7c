"""treeserve's asyncio actor runtime: actors, refs, nodes, supervision."""

from treeserve.runtime.actor import Actor, HandlerKind, handler, stream_handler
from treeserve.runtime.config import (
    ChildTransport,
    RestartStrategy,
    RuntimeConfig,
    SupervisorConfig,
)
from treeserve.runtime.errors import (
    ActorDeadError,
    ActorError,
    CallCancelled,
    DeadlineExceeded,
    NoSuchActor,
    NoSuchMethod,
    OverloadedError,
    RemoteError,
    RuntimeClosedError,
    SupervisorGaveUp,
)
from treeserve.runtime.node import Node, NodeStats
from treeserve.runtime.ref import ActorRef
from treeserve.runtime.restart import RestartIntensity
from treeserve.runtime.runtime import Placement, Runtime
from treeserve.runtime.supervisor import ChildSpec, ChildState, Supervisor

__all__ = [
    "Actor",
    "ActorDeadError",
    "ActorError",
    "ActorRef",
    "CallCancelled",
    "ChildSpec",
    "ChildState",
    "ChildTransport",
    "DeadlineExceeded",
    "HandlerKind",
    "NoSuchActor",
    "NoSuchMethod",
    "Node",
    "NodeStats",
    "OverloadedError",
    "Placement",
    "RemoteError",
    "RestartIntensity",
    "RestartStrategy",
    "Runtime",
    "RuntimeClosedError",
    "RuntimeConfig",
    "Supervisor",
    "SupervisorConfig",
    "SupervisorGaveUp",
    "handler",
    "stream_handler",
]
