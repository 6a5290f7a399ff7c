"""Conversion of message bodies between the wire form (``ActorAddress``) and the
runtime form (``ActorRef``), so refs can travel inside any body."""

from __future__ import annotations

from typing import Any

from treeserve.runtime.ref import ActorRef, RefNode
from treeserve.transport.messages import ActorAddress

__all__ = ["body_from_wire", "body_to_wire"]

# Leaf types that can never contain a ref: returned untouched without walking.
_LEAVES: frozenset[type] = frozenset({type(None), bool, int, float, str, bytes})


def body_to_wire(body: Any) -> Any:
    """Replace every ``ActorRef`` in ``body`` (at any depth in lists, tuples and dict
    values) by its ``ActorAddress``. Containers without refs are returned as they are. A
    typed body (one with a ``to_wire()`` method, which a call inside one process passes as the
    object) becomes its wire form here, when it leaves the process."""
    if type(body) in _LEAVES:
        return body
    to_wire = getattr(type(body), "to_wire", None)
    if to_wire is not None:
        body = to_wire(body)
    return _to_wire(body)


def _to_wire(value: Any) -> Any:
    if isinstance(value, ActorRef):
        return value.address
    if isinstance(value, list | tuple):
        if all(type(v) in _LEAVES for v in value):
            return value
        items = [v if type(v) in _LEAVES else _to_wire(v) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return items
    if isinstance(value, dict):
        if all(type(v) in _LEAVES for v in value.values()):
            return value
        converted = {k: v if type(v) in _LEAVES else _to_wire(v) for k, v in value.items()}
        if all(converted[k] is v for k, v in value.items()):
            return value
        return converted
    return value


def body_from_wire(body: Any, node: RefNode) -> Any:
    """Replace every ``ActorAddress`` in a decoded ``body`` by an ``ActorRef`` bound to
    ``node``. Decoded containers are fresh, so they are updated in place."""
    if type(body) in _LEAVES:
        return body
    if isinstance(body, ActorAddress):
        return node.ref(body)
    if isinstance(body, list):
        for i, v in enumerate(body):
            if type(v) not in _LEAVES:
                body[i] = body_from_wire(v, node)
    elif isinstance(body, dict):
        for k, v in body.items():
            if type(v) not in _LEAVES:
                body[k] = body_from_wire(v, node)
    return body
