"""Token trees and sampling params as msgpack-able dicts for actor message bodies.

Tree wire form (node 0 is the root = the request's last emitted token)::

    {"parents": [int] (T,), "tokens": [int] (T,),
     "proposal_children": [int] (P,), "proposal_speculators": [int] (P,), "proposal_q_rows": [int] (P,),
     "draft_probs": None | float32 array (R, V) | {"shape": [R, V], "index": [int], "values": [float]}}

The integer fields are plain lists, not arrays: a token tree has at most a few dozen nodes, and
every array costs one zmq frame while ``WireLimits.max_frames`` is 64 per message, so a step
with many rows would run out of frames. Incoming integer fields may also be int arrays (numpy
or torch). ``draft_probs`` (SpecInfer's drafting distributions, only for stochastic trees) is
the one large field: a dense float32 array (one frame), or, when it has at most
:data:`SPARSE_MAX_NONZEROS` non-zeros (point masses of the n-gram speculator, top-k drafts), a
sparse map of flat indices and float32 values, exact either way. Decoding validates everything
and raises ``ValueError`` naming the bad field.

A message with many trees stacks their dense ``draft_probs`` the same way: one ``(sum R_i, V)``
array beside the trees, each such tree's field then being ``{"stacked": R_i}``
(:func:`pack_trees`, :func:`unpack_trees`), so the trees of any number of rows cost one frame.
Per-row hidden states (``(n_i, D)`` float32 for row ``i``) travel the same way for the same
reason: stacked into one ``(sum n_i, D)`` array in the message (one frame, whatever the row
count), with each row's ``num_states`` beside its other fields (:func:`stack_states`,
:func:`split_states`, :func:`split_row_states`).

A request's sampling params are the same at every step: a receiver parses them once per
request with a :class:`ParamsCache`. The message bodies built from these fields are
:mod:`treeserve.actors.messages.checks`'.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree

SPARSE_MAX_NONZEROS = 4096
"""Largest non-zero count sent as a sparse ``draft_probs`` map instead of a dense array."""

_INT_FIELDS = ("parents", "tokens", "proposal_children", "proposal_speculators", "proposal_q_rows")
_TREE_FIELDS = frozenset((*_INT_FIELDS, "draft_probs"))
_PROPOSAL_FIELDS = ("proposal_children", "proposal_speculators", "proposal_q_rows")
_PARAM_FIELDS = frozenset(("temperature", "top_k", "top_p", "seed", "stop_token_ids", "max_new_tokens"))
_MAX_NODES = 1 << 16
_MAX_PROB_ELEMENTS = 1 << 28


def stack_states(parts: list[Any], dim: int) -> np.ndarray:
    """Rows' ``(n_i, dim)`` float states (numpy or torch) as one float32 ``(sum n_i, dim)`` array."""
    arrays = [np.asarray(p.float().cpu() if isinstance(p, Tensor) else p, dtype=np.float32) for p in parts]
    return np.concatenate(arrays) if arrays else np.zeros((0, dim), dtype=np.float32)


def split_states(value: Any, counts: list[int], dim: int | None = None) -> list[np.ndarray]:
    """Invert :func:`stack_states`: the rows' float32 ``(n_i, dim)`` states, given each row's
    ``counts[i]`` (``ValueError`` when the array, its width ``dim`` if given, or the counts do
    not fit)."""
    array = np.asarray(value)
    if array.ndim != 2 or (dim is not None and array.shape[1] != dim) or not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"states must be a float array of shape (n, {dim or 'D'}), got {array.dtype} {array.shape}")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts) or sum(counts) != array.shape[0]:
        raise ValueError(f"num_states {counts} do not add up to the {array.shape[0]} stacked states")
    bounds = np.cumsum([0, *counts])
    return [np.asarray(array[bounds[i]:bounds[i + 1]], dtype=np.float32) for i in range(len(counts))]


def tree_to_wire(tree: TokenTree) -> dict[str, Any]:
    """The wire dict of ``tree`` (see the module docstring); :func:`tree_from_wire` inverts it exactly."""
    wire: dict[str, Any] = {name: getattr(tree, name).tolist() for name in _INT_FIELDS}
    probs = tree.draft_probs
    if probs is None:
        wire["draft_probs"] = None
    else:
        dense = probs.detach().to("cpu", torch.float32).contiguous()  # (R, V)
        flat = dense.reshape(-1)
        index = flat.nonzero().flatten()
        if index.numel() <= SPARSE_MAX_NONZEROS:
            wire["draft_probs"] = {
                "shape": list(dense.shape),
                "index": index.tolist(),
                "values": flat[index].tolist(),  # float32 -> float64 -> float32 is exact
            }
        else:
            wire["draft_probs"] = dense.numpy()
    return wire


def tree_from_wire(wire: Any) -> TokenTree:
    """Rebuild a :class:`TokenTree` from its wire dict; ``ValueError`` says what is malformed."""
    if not isinstance(wire, Mapping):
        raise ValueError(f"a token tree must be a map, got {type(wire).__name__}")
    unknown = set(wire) - _TREE_FIELDS
    if unknown:
        raise ValueError(f"unknown token tree fields {sorted(map(str, unknown))}; expected {sorted(_TREE_FIELDS)}")
    missing = _TREE_FIELDS - set(wire) - {"draft_probs"}
    if missing:
        raise ValueError(f"token tree is missing fields {sorted(missing)}")
    root = _root_only_token(wire)
    if root is not None:
        return TokenTree.root_only(root)
    ints = {name: _int_vector(wire[name], name) for name in _INT_FIELDS}
    probs = _draft_probs(wire.get("draft_probs"))
    try:
        return TokenTree(
            ints["parents"],
            ints["tokens"],
            ints["proposal_children"],
            ints["proposal_speculators"],
            ints["proposal_q_rows"],
            probs,
        )
    except ValueError as exc:
        raise ValueError(f"invalid token tree: {exc}") from None


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """The wire dict of ``params``: its six fields by name (``stop_token_ids`` as a list)."""
    return {
        "temperature": float(params.temperature),
        "top_k": params.top_k,
        "top_p": float(params.top_p),
        "seed": params.seed,
        "stop_token_ids": list(params.stop_token_ids),
        "max_new_tokens": params.max_new_tokens,
    }


def params_from_wire(wire: Any) -> SamplingParams:
    """Rebuild :class:`SamplingParams`; absent fields take their defaults, unknown ones are
    rejected, and every value is validated (``ValueError`` with the field's name)."""
    if not isinstance(wire, Mapping):
        raise ValueError(f"sampling params must be a map, got {type(wire).__name__}")
    unknown = set(wire) - _PARAM_FIELDS
    if unknown:
        raise ValueError(f"unknown sampling params fields {sorted(map(str, unknown))}; expected {sorted(_PARAM_FIELDS)}")
    fields = dict(wire)
    stops = fields.get("stop_token_ids")
    if stops is not None:
        if not isinstance(stops, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {type(stops).__name__}")
        fields["stop_token_ids"] = tuple(stops)
    elif "stop_token_ids" in fields:
        fields["stop_token_ids"] = ()
    if fields.get("top_k") is not None and isinstance(fields["top_k"], float) and fields["top_k"].is_integer():
        fields["top_k"] = int(fields["top_k"])
    for name in ("top_p", "max_new_tokens"):
        if name in fields and fields[name] is None:
            del fields[name]  # None means "default" for the fields that have no None value
    try:
        return SamplingParams(**fields)
    except TypeError as exc:
        raise ValueError(f"invalid sampling params: {exc}") from None


class ParamsCache:
    """Each request's parsed :class:`SamplingParams`, so a receiver parses them once per request.

    ``parse`` reuses the parsed params while a request's wire dict is unchanged (one dict
    comparison instead of a parse); ``forget`` drops a request (at its ``release``). At most
    ``max_entries`` requests are kept, the oldest forgotten first (a lost ``release`` only costs
    a parse later)."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[Any, SamplingParams]] = OrderedDict()

    def parse(self, request_id: str, wire: Any) -> SamplingParams:
        hit = self._entries.get(request_id)
        if hit is not None and hit[0] == wire:
            return hit[1]
        params = params_from_wire(wire)
        self._entries[request_id] = (wire, params)
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return params

    def forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._entries)


def pack_trees(trees: Sequence[TokenTree | None]) -> tuple[list[dict[str, Any] | None], np.ndarray | None]:
    """The trees' wire dicts, their dense ``draft_probs`` stacked into one float32 ``(sum R_i, V)``
    array (None: no tree has dense probs); :func:`unpack_trees` inverts it exactly."""
    wires: list[dict[str, Any] | None] = []
    dense: list[np.ndarray] = []
    for tree in trees:
        wire = None if tree is None else tree_to_wire(tree)
        if wire is not None and isinstance(wire["draft_probs"], np.ndarray):
            dense.append(wire["draft_probs"])
            wire["draft_probs"] = {"stacked": int(wire["draft_probs"].shape[0])}
        wires.append(wire)
    if not dense:
        return wires, None
    if len({d.shape[1] for d in dense}) != 1:  # every draft is over the verifier's vocabulary
        raise ValueError(f"trees' draft_probs have different vocab sizes {sorted({d.shape[1] for d in dense})}")
    return wires, np.concatenate(dense)


def unpack_trees(wires: Sequence[Any], stacked: Any) -> list[TokenTree | None]:
    """Decode :func:`pack_trees`' output (``ValueError`` names what is malformed)."""
    counts: list[int | None] = []
    for wire in wires:
        probs = wire.get("draft_probs") if isinstance(wire, Mapping) else None
        if isinstance(probs, Mapping) and set(probs) == {"stacked"}:
            counts.append(_count(probs["stacked"], "a tree's stacked draft_probs rows"))
        else:
            counts.append(None)
    if all(c is None for c in counts):
        if stacked is not None:
            raise ValueError("the body's stacked draft_probs belong to no tree")
        return [None if w is None else tree_from_wire(w) for w in wires]
    if stacked is None:
        raise ValueError("trees refer to stacked draft_probs but the body has none")
    array = np.asarray(stacked)
    if array.ndim != 2 or array.dtype.kind != "f" or array.shape[0] != sum(c or 0 for c in counts):
        raise ValueError(f"stacked draft_probs {array.dtype} {array.shape} do not hold the trees' "
                         f"{sum(c or 0 for c in counts)} rows")
    trees: list[TokenTree | None] = []
    offset = 0
    for wire, count in zip(wires, counts):
        if count is not None:
            wire = {**wire, "draft_probs": array[offset:offset + count]}
            offset += count
        trees.append(None if wire is None else tree_from_wire(wire))
    return trees


def split_row_states(stacked: Any, counts: Sequence[int | None], dim: int | None = None) -> list[np.ndarray | None]:
    """Each row's slice of ``stacked`` states, given each row's count (None: the row has none)."""
    if all(c is None for c in counts):
        return [None] * len(counts)
    if stacked is None:
        raise ValueError("rows give num_states but the body has no stacked 'states'")
    parts = split_states(stacked, [c or 0 for c in counts], dim)
    return [None if c is None else p for c, p in zip(counts, parts)]


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _root_only_token(wire: Mapping[str, Any]) -> int | None:
    """The token of a one-node tree sent as lists (a plain decode step's: parents ``[-1]``, one
    int token, no proposals, no probabilities), or None for any other wire tree, which the full
    parse checks."""
    parents, tokens = wire["parents"], wire["tokens"]
    if not (isinstance(parents, list) and isinstance(tokens, list) and len(parents) == len(tokens) == 1):
        return None
    if type(parents[0]) is not int or parents[0] != -1 or type(tokens[0]) is not int:
        return None
    if wire.get("draft_probs") is not None or any(not isinstance(wire[name], list) or wire[name] for name in _PROPOSAL_FIELDS):
        return None
    return int(tokens[0])


def _int_vector(value: Any, name: str) -> Tensor:
    if isinstance(value, Tensor):
        array = value.detach().cpu().numpy()
    elif isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (list, tuple)):
        if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise ValueError(f"token tree field {name!r} must hold integers")
        if len(value) > _MAX_NODES:
            raise ValueError(f"token tree field {name!r} is too long ({len(value)} > {_MAX_NODES})")
        return torch.tensor(value, dtype=torch.long).reshape(-1)
    else:
        raise ValueError(f"token tree field {name!r} must be a list or an integer array, got {type(value).__name__}")
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"token tree field {name!r} must be a 1-D integer array, got {array.dtype} {array.shape}")
    if array.shape[0] > _MAX_NODES:
        raise ValueError(f"token tree field {name!r} is too long ({array.shape[0]} > {_MAX_NODES})")
    return torch.from_numpy(np.array(array, dtype=np.int64))  # copy: decoded arrays are read-only


def _draft_probs(value: Any) -> Tensor | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        return _sparse_probs(value)
    if isinstance(value, Tensor):
        array = value.detach().cpu().float().numpy()
    elif isinstance(value, np.ndarray):
        array = value
    else:
        raise ValueError(f"draft_probs must be None, a float array or a sparse map, got {type(value).__name__}")
    if array.ndim != 2 or array.dtype.kind != "f":
        raise ValueError(f"draft_probs must be a 2-D float array (R, V), got {array.dtype} {array.shape}")
    probs = torch.from_numpy(np.array(array, dtype=np.float32))
    _check_probs(probs)
    return probs


def _sparse_probs(value: Mapping[Any, Any]) -> Tensor:
    if set(value) != {"shape", "index", "values"}:
        raise ValueError(f"sparse draft_probs needs exactly the fields shape, index, values; got {sorted(map(str, value))}")
    shape, index, values = value["shape"], value["index"], value["values"]
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) != 2
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape)
    ):
        raise ValueError(f"sparse draft_probs shape must be [rows, vocab], got {shape!r}")
    if math.prod(shape) > _MAX_PROB_ELEMENTS:
        raise ValueError(f"sparse draft_probs shape {shape} is too large")
    if not isinstance(index, (list, tuple)) or not isinstance(values, (list, tuple)) or len(index) != len(values):
        raise ValueError("sparse draft_probs index and values must be lists of equal length")
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < math.prod(shape) for i in index):
        raise ValueError(f"sparse draft_probs index entries must be integers in [0, {math.prod(shape)})")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise ValueError("sparse draft_probs values must be numbers")
    flat = torch.zeros(math.prod(shape), dtype=torch.float32)
    flat[torch.tensor(index, dtype=torch.long)] = torch.tensor(values, dtype=torch.float32)
    probs = flat.reshape(shape[0], shape[1])
    _check_probs(probs)
    return probs


def _check_probs(probs: Tensor) -> None:
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
        raise ValueError("draft_probs must be finite and non-negative")


__all__ = [
    "SPARSE_MAX_NONZEROS", "ParamsCache", "pack_trees", "params_from_wire", "params_to_wire", "split_row_states",
    "split_states", "stack_states", "tree_from_wire", "tree_to_wire", "unpack_trees",
]
