"""The message bodies the serving actors send each other, as typed frozen dataclasses: what
they share (this module) and the bodies themselves, one module per conversation:
:mod:`~treeserve.actors.messages.gateway` (gateway -> scheduler),
:mod:`~treeserve.actors.messages.verifier` (scheduler <-> verifier),
:mod:`~treeserve.actors.messages.speculator` (scheduler <-> speculator) and
:mod:`~treeserve.actors.messages.length` (scheduler <-> length predictor).

One class per body; ``to_wire()`` gives the msgpack-able dict a sender passes to ``ask``, and
``from_wire(...)`` is the receiver's one validation of it, at its handler's entry (a request
body) or where the answer comes back (a reply). After that, the actors pass the typed objects
and never re-check a field. The wire shapes are the handlers' docstrings' (``actors/verifier.py``,
``actors/speculator.py``, ``actors/length_predictor.py``, ``actors/scheduler/actor.py``); token trees
and sampling params keep the field codecs of :mod:`~treeserve.actors.messages.tree_wire`.

Errors: a malformed *request* body raises ``ValueError`` naming the field, which the runtime
answers as ``invalid_request`` (the receiver's range checks against its own config, such as a
row number or a token id, come with the body's parse); a malformed *reply* raises
:class:`MalformedReply`, a bug on one side.

Frames: a message's tensors travel as one frame per kind, whatever the row count. The rows'
hidden states are stacked into one ``(sum n_i, D)`` float32 array (each row says its
``num_states``), and so are the trees' dense ``draft_probs``: ``(sum R_i, V)`` in the body's
``"draft_probs"``, each such tree's field then being ``{"stacked": R_i}``
(:func:`~treeserve.actors.messages.tree_wire.pack_trees`). Sparse and absent ``draft_probs`` stay in
the tree, costing no frame.

Params: a request's sampling params are the same at every step, so a receiver parses each
request's params once (:class:`~treeserve.actors.messages.tree_wire.ParamsCache`), not once per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class MalformedReply(RuntimeError):
    """A speculator or verifier answered something the scheduler cannot use (wrong rows,
    missing fields): a bug on one side, handled like any unexpected step failure."""


# ---------------------------------------------------------------------- field checks
# A request body's fields, checked at the receiver's handler entry: ValueError naming the field.
def check_request_id(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"request_id must be a non-empty string, got {value!r}")
    return value


def check_token_ids(value: Any, name: str, vocab_size: int | None = None, *,
                    non_empty: bool = False) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or (non_empty and not value):
        raise ValueError(f"{name} must be a {'non-empty ' if non_empty else ''}list of token ids")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in value):
        raise ValueError(f"{name} must hold non-negative integers")
    if vocab_size is not None and any(t >= vocab_size for t in value):
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size})")
    return tuple(value)


def check_flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def check_entries(body: Mapping[str, Any], name: str, what: str) -> list[Any] | tuple[Any, ...]:
    value = body[name]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{what} needs a non-empty list {name!r}")
    return value


__all__ = ["MalformedReply", "check_entries", "check_flag", "check_request_id", "check_token_ids"]
