"""Token tree verification: greedy, and SpecInfer's multi-step speculative sampling (MSS).

Both verifiers take one row's token tree and the LLM's logits for its nodes ``(T, V)`` (logits
of node ``i`` = the LLM's next-token prediction after the path root..i) and return the
accepted path plus one bonus token, so every step emits ``len(accepted) - 1 + 1`` new tokens.
A batched verifier calls them per row. Stochastic verification runs on the CPU: the logits
are moved there once and the ``generator`` must be a CPU generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from treeserve.ops.sampling import SamplingParams, logits_to_probs
from treeserve.ops.token_tree import TokenTree


class VerificationError(ValueError):
    """The tree breaks the verifier's assumptions (e.g. a proposal that its q could not draw)."""


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one token tree.

    ``accepted``: node indices of the accepted path, root first (always starts with 0).
    ``bonus_token``: the token the LLM itself contributes after the accepted path (the correction
    at the first mismatch, or the next token after an accepted leaf); it is the next root.
    """

    accepted: list[int]
    bonus_token: int

    @property
    def num_accepted_drafts(self) -> int:
        """How many draft (non-root) nodes were accepted."""
        return len(self.accepted) - 1

    def new_tokens(self, tree: TokenTree) -> list[int]:
        """Tokens this step emits: the accepted drafts' tokens, then the bonus token."""
        return [int(tree.tokens[i]) for i in self.accepted[1:]] + [self.bonus_token]


VerifyFn = Callable[[TokenTree, Tensor, SamplingParams, torch.Generator | None], VerifyResult]
"""Signature of a verifier: ``(tree, logits (T, V), params, generator) -> VerifyResult``."""


def verify_greedy(tree: TokenTree, logits: Tensor) -> VerifyResult:
    """Greedy verification: from the root, follow the child whose token is the LLM's argmax.

    At the first node with no such child the LLM's argmax there is the bonus token. The output
    equals plain greedy decoding whatever the tree holds.
    """
    if logits.shape[0] != tree.num_nodes:
        raise ValueError(f"logits have {logits.shape[0]} rows for a tree of {tree.num_nodes} nodes")
    targets = logits.argmax(dim=-1).tolist()  # (T,) one host sync
    children: list[dict[int, int]] = [{} for _ in range(tree.num_nodes)]
    for node, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        if parent >= 0:
            children[parent].setdefault(token, node)  # first child wins for duplicate tokens
    accepted = [0]
    while (child := children[accepted[-1]].get(targets[accepted[-1]])) is not None:
        accepted.append(child)
    return VerifyResult(accepted, int(targets[accepted[-1]]))


def verify_stochastic(
    tree: TokenTree, logits: Tensor, params: SamplingParams, generator: torch.Generator | None
) -> VerifyResult:
    """Multi-step speculative sampling (SpecInfer, Alg. 2): lossless w.r.t. ``logits_to_probs``.

    At the current node with target ``p`` (the LLM's probabilities after temperature/top-k/top-p)
    the node's proposals are tried in order; proposal ``x`` drawn from ``q_i`` is accepted with
    probability ``min(1, p(x) / q_i(x))``; on rejection ``p <- norm(max(0, p - q_i))``. Accepting
    moves to the child (with the child's fresh ``p``); when all proposals are rejected, or the
    node has none, the bonus token is sampled from the current (residual) ``p``.

    Drafting assumption (what makes this lossless): the proposals at a node are *independent*
    draws, proposal ``j`` from its own ``q_j`` (``draft_probs[q_row]``), made without looking at
    the LLM; the number and order of proposals may depend on anything drafted earlier. i.i.d.
    draws with replacement from one speculator (duplicates kept as separate proposals) and
    deterministic proposals (point-mass ``q``) both qualify. Greedy ``params`` fall back to
    :func:`verify_greedy`.
    """
    if params.is_greedy:
        return verify_greedy(tree, logits)
    if tree.draft_probs is None and tree.proposal_children.numel() > 0:
        raise VerificationError("stochastic verification needs a tree with draft_probs (drafted with temperature > 0)")
    if logits.shape[0] != tree.num_nodes:
        raise ValueError(f"logits have {logits.shape[0]} rows for a tree of {tree.num_nodes} nodes")
    probs = logits_to_probs(logits.detach().to("cpu"), params)  # (T, V)
    draft_probs = tree.draft_probs
    proposals = tree.proposals()
    tokens = tree.tokens.tolist()
    accepted = [0]
    while True:
        node = accepted[-1]
        p = probs[node]
        next_node = None
        for proposal in proposals[node]:
            assert draft_probs is not None and proposal.q_row is not None  # checked above
            q = draft_probs[proposal.q_row]
            x = tokens[proposal.child]
            qx = float(q[x])
            if qx <= 0.0:
                raise VerificationError(f"token {x} was proposed from a q that gives it probability {qx}")
            u = float(torch.rand((), generator=generator))
            if u * qx < float(p[x]):  # u < p(x)/q(x), i.e. accept w.p. min(1, p(x)/q(x))
                next_node = proposal.child
                break
            residual = torch.clamp(p - q, min=0.0)
            mass = float(residual.sum())
            # mass == 0 means p <= q everywhere, i.e. p == q, where rejection has probability 0;
            # it can only come from float rounding, so p is kept as is.
            if mass > 0.0:
                p = residual / mass
        if next_node is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return VerifyResult(accepted, bonus)
        accepted.append(next_node)


def verify(tree: TokenTree, logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> VerifyResult:
    """Greedy verification for greedy ``params``, multi-step speculative sampling otherwise."""
    if params.is_greedy:
        return verify_greedy(tree, logits)
    return verify_stochastic(tree, logits, params, generator)
