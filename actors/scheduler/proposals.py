"""Speculator fan-out for one step: what to ask each speculator, and one token tree per row.

Pure decisions over the scheduler core's request states (no I/O). Each speculator gets a fixed
share of the step's tree budget (:func:`~treeserve.ops.drafting.split_node_budget`), so the
merged tree never needs a size cut that would depend on the draws; a speculator whose share
leaves it no draft node is not asked. Proposals for a row are merged (``merge_trees``), a
``chain`` row keeps the first chain, and the tree is cut to the row's depth budget.

Recovery: a speculator that failed, was left out of a step, or answered that it lost a request
(``missing``) gets that request's full token history, and every hidden state so far, on its
next proposal, so a restarted speculator rebuilds its state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from treeserve.ops.speculation_modes import SpeculationMode
from treeserve.actors.messages.speculator import ProposalRequest, ProposeBody, ProposeReply
from treeserve.actors.scheduler.types import ProposalAsk, RequestState, RowPlan
from treeserve.ops.drafting import split_node_budget
from treeserve.ops.token_tree import TokenTree, merge_trees


def proposal_asks(requests: Sequence[RequestState], tree_budget: int, num_speculators: int) -> tuple[ProposalAsk, ...]:
    """One ``propose`` call per speculator with a draft node to spend, each with one entry per
    request of ``requests`` (the rows that speculate this step, in plan order)."""
    if not requests:
        return ()
    asks = []
    for index, share in enumerate(split_node_budget(tree_budget, num_speculators)):
        if share <= 1:
            continue
        entries = []
        for req in requests:
            rebuild = index in req.needs_history
            parts = req.states_all if rebuild else req.states_pending
            entries.append(ProposalRequest(
                req.request_id,
                tuple(req.since_propose),
                max_depth=req.params.max_new_tokens - len(req.emitted) - 1,
                params=req.params,
                max_nodes=share,
                history=tuple(req.prompt_ids + req.emitted) if rebuild else None,
                states=(parts[0] if len(parts) == 1 else np.concatenate(parts)) if parts else None,
            ))
        asks.append(ProposalAsk(index, ProposeBody(tuple(entries))))
    return tuple(asks)


def take_proposals(requests: Sequence[RequestState], asks: Sequence[ProposalAsk], replies: Sequence[Any],
                   num_speculators: int) -> dict[str, list[TokenTree]]:
    """The decoded trees per request id from ``replies[i]`` to ``asks[i]`` (wire dicts as they
    came back; None: that speculator failed); records which speculators must be rebuilt from a
    request's history, and clears what the asked speculators have now seen.
    :class:`~treeserve.actors.messages.MalformedReply` for a reply that is not one tree (or None)
    per request."""
    if len(replies) != len(asks):
        raise ValueError(f"{len(replies)} proposal replies for {len(asks)} asks")
    proposed: dict[str, list[TokenTree]] = {req.request_id: [] for req in requests}
    for ask, wire in zip(asks, replies):
        if wire is None:
            continue
        reply = ProposeReply.from_wire(wire, len(requests), ask.speculator)
        for req, tree in zip(requests, reply.trees):
            if req.request_id in reply.missing:
                req.needs_history.add(ask.speculator)  # the speculator lost its state: resend history
            else:
                req.needs_history.discard(ask.speculator)
            if tree is not None:
                proposed[req.request_id].append(tree)
    if asks:
        asked = {ask.speculator for ask in asks}
        for req in requests:
            req.since_propose.clear()
            req.states_pending.clear()
            # A speculator left out this step missed these tokens: rebuild it from the history.
            req.needs_history.update(i for i in range(num_speculators) if i not in asked)
    return proposed


def verified_tree(root: int, proposed: Sequence[TokenTree], row: RowPlan, max_tree_nodes: int) -> TokenTree:
    """The tree to verify for ``row``: the proposals rooted at ``root`` merged (just the root
    without any), its first chain for a ``chain`` row, cut to ``row.max_depth`` (depth only: a
    depth cut does not depend on the draws)."""
    candidates = [t for t in proposed if t.root_token == root]
    if not candidates:  # a plain step's one node (depth 0, any mode): 60 us a row less than the checks below
        return TokenTree.root_only(root)
    tree = merge_trees(candidates)
    if row.mode == SpeculationMode.CHAIN:
        tree = tree.first_chain()
    keep = tree.depths() <= row.max_depth
    if not bool(keep.all()):
        tree = tree.restricted(keep)
    if tree.num_nodes > max_tree_nodes:  # the per-speculator shares prevent this
        raise RuntimeError(f"merged token tree of {tree.num_nodes} nodes exceeds max_tree_nodes")
    return tree


__all__ = ["proposal_asks", "take_proposals", "verified_tree"]
