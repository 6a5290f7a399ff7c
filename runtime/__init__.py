"""treeserve's asyncio actor runtime: actors, refs, nodes, supervision.

One ``Runtime`` per process owns one ``Node``: a ROUTER bound on an endpoint hosting
actors, plus one DEALER per remote node it calls. ``rt.spawn(Cls, *args, name=...,
process="local" | "child")`` returns an ``ActorRef``; ``ref.ask`` / ``ref.tell`` /
``ref.ask_stream`` work the same for a local actor (no serialization) and a remote one.

Design decisions worth knowing:

* Deadlines travel as the caller's remaining budget (``Request.timeout_ms``); the callee
  drops queued work that is already late and cancels a running handler at its deadline.
  Request ids come from a per-node counter and are never reused, so a late reply is
  discarded, never delivered to another call.
* Cancelling a caller's task sends ``Cancel``; the callee cancels the handler (or the
  stream generator) without creating a task per message (workers are long-lived and
  resume via ``Task.uncancel``).
* A child process hosts one actor on its own node, is launched with
  ``python -m treeserve.runtime.child`` and a msgpack spec on stdin (no pickle), and
  dies with its parent (``PR_SET_PDEATHSIG`` plus stdin as a death pipe).
* Refs name a *slot* (endpoint + name), not an incarnation: a supervisor restarts a
  failed child on the same endpoint, so existing refs reach the new incarnation. While
  the child is down, calls fail fast with ``ActorDeadError`` (retryable); calls pending
  when it died fail at once with ``ActorDeadError``.
* A remote request arrives through ``Inbound`` (``runtime/inbound.py``, the ROUTER
  request path the public gateway uses too); remote calls leave through ``Outbound``
  (which the Python client uses too). With ``RuntimeConfig.curve`` (a ``LinkCurve``)
  every link is CURVE-encrypted and admits only allow-listed keys.
* The library never creates or sets an event loop; only ``treeserve.runtime.child``
  (a program entry point) runs ``uvloop.run``.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treeserve.runtime.actor import Actor, HandlerKind, handler, stream_handler
    from treeserve.runtime.config import (
        ChildTransport,
        RestartStrategy,
        RuntimeConfig,
        SupervisorConfig,
    )
    from treeserve.runtime.curve import LinkCurve
    from treeserve.runtime.errors import (
        ActorDeadError,
        ActorError,
        CallCancelled,
        ConnectionLost,
        DeadlineExceeded,
        NoSuchActor,
        NoSuchMethod,
        OverloadedError,
        RemoteError,
        RuntimeClosedError,
        SupervisorGaveUp,
    )
    from treeserve.runtime.local_supervisor import LocalSupervisor
    from treeserve.runtime.node import Node
    from treeserve.runtime.ref import ActorRef
    from treeserve.runtime.restart import RestartIntensity
    from treeserve.runtime.runtime import Placement, Runtime
    from treeserve.runtime.stats import NodeStats
    from treeserve.runtime.supervisor import ChildSpec, ChildState, Supervisor

# The names load lazily (PEP 562), so that importing one module of the package (the command
# line's prestart, :mod:`treeserve.runtime.process`) does not import all of it.
_LAZY = {
    "Actor": "treeserve.runtime.actor",
    "ActorDeadError": "treeserve.runtime.errors",
    "ActorError": "treeserve.runtime.errors",
    "ActorRef": "treeserve.runtime.ref",
    "CallCancelled": "treeserve.runtime.errors",
    "ChildSpec": "treeserve.runtime.supervisor",
    "ChildState": "treeserve.runtime.supervisor",
    "ChildTransport": "treeserve.runtime.config",
    "ConnectionLost": "treeserve.runtime.errors",
    "DeadlineExceeded": "treeserve.runtime.errors",
    "HandlerKind": "treeserve.runtime.actor",
    "LinkCurve": "treeserve.runtime.curve",
    "LocalSupervisor": "treeserve.runtime.local_supervisor",
    "NoSuchActor": "treeserve.runtime.errors",
    "NoSuchMethod": "treeserve.runtime.errors",
    "Node": "treeserve.runtime.node",
    "NodeStats": "treeserve.runtime.stats",
    "OverloadedError": "treeserve.runtime.errors",
    "Placement": "treeserve.runtime.runtime",
    "RemoteError": "treeserve.runtime.errors",
    "RestartIntensity": "treeserve.runtime.restart",
    "RestartStrategy": "treeserve.runtime.config",
    "Runtime": "treeserve.runtime.runtime",
    "RuntimeClosedError": "treeserve.runtime.errors",
    "RuntimeConfig": "treeserve.runtime.config",
    "Supervisor": "treeserve.runtime.supervisor",
    "SupervisorConfig": "treeserve.runtime.config",
    "SupervisorGaveUp": "treeserve.runtime.errors",
    "handler": "treeserve.runtime.actor",
    "stream_handler": "treeserve.runtime.actor",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'treeserve.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Actor",
    "ActorDeadError",
    "ActorError",
    "ActorRef",
    "CallCancelled",
    "ChildSpec",
    "ChildState",
    "ChildTransport",
    "ConnectionLost",
    "DeadlineExceeded",
    "HandlerKind",
    "LinkCurve",
    "LocalSupervisor",
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
