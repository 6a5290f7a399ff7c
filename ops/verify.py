"""Token tree verification: greedy, keyed (seeded requests), and SpecInfer's multi-step
speculative sampling (MSS, unseeded requests).

Every verifier takes one row's token tree and the LLM's logits for its nodes ``(T, V)`` (logits
of node ``i`` = the LLM's next-token prediction after the path root..i) and returns the
accepted path plus one bonus token, so every step emits ``len(accepted) - 1 + 1`` new tokens.
A batched verifier calls them per row. Stochastic verification runs on the CPU: the logits
are moved there, and a ``generator`` must be a CPU generator.

Greedy and keyed verification share one rule: each node has a *target*, the token plain
decoding would emit there (the argmax, or the keyed sample of
:func:`~treeserve.ops.sampling.sample_keyed` for the node's position), and the accepted path
follows children whose token is their parent's target. So their output is, token for token,
what decoding without speculation emits from the same logits, whatever the tree holds. MSS
accepts more drafts (a proposal ``x`` from ``q`` passes w.p. ``min(1, p(x)/q(x))``, against
``p(x)`` for a fixed target) but what it emits depends on the tree, which is why seeded
requests are verified by key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from treeserve.ops.sampling import (
    Randomness,
    SampleKey,
    SamplingParams,
    is_distribution,
    keyed_argmax,
    logits_to_probs,
    sample_keyed,
)
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


VerifyFn = Callable[[TokenTree, Tensor, SamplingParams, Randomness], VerifyResult]
"""Signature of a verifier: ``(tree, logits (T, V), params, randomness) -> VerifyResult``;
``randomness`` is a :class:`~treeserve.ops.sampling.SampleKey` placed at the position the
root's logits predict, a CPU ``torch.Generator``, or None (greedy)."""


def _follow_targets(tree: TokenTree, target_at: Callable[[int, int], int]) -> VerifyResult:
    """From the root, follow the child whose token is ``target_at(node, depth)``; the target of
    the last node reached is the bonus token. Targets are asked for the path's nodes only."""
    children: list[dict[int, int]] = [{} for _ in range(tree.num_nodes)]
    for node, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        if parent >= 0:
            children[parent].setdefault(token, node)  # first child wins for duplicate tokens
    accepted = [0]
    while True:
        target = target_at(accepted[-1], len(accepted) - 1)
        child = children[accepted[-1]].get(target)
        if child is None:
            return VerifyResult(accepted, target)
        accepted.append(child)


def verify_greedy(tree: TokenTree, logits: Tensor) -> VerifyResult:
    """Greedy verification: from the root, follow the child whose token is the LLM's argmax.

    At the first node with no such child the LLM's argmax there is the bonus token. The output
    equals plain greedy decoding whatever the tree holds.
    """
    if logits.shape[0] != tree.num_nodes:
        raise ValueError(f"logits have {logits.shape[0]} rows for a tree of {tree.num_nodes} nodes")
    targets = logits.argmax(dim=-1).tolist()  # (T,) one host sync
    return _follow_targets(tree, lambda node, _depth: int(targets[node]))


def check_proposals(tree: TokenTree) -> None:
    """:class:`VerificationError` for a proposal that its ``q`` could not draw (a speculator's
    bug), in a tree that carries ``draft_probs``; on the host, where the tree is."""
    if tree.draft_probs is not None and tree.proposal_children.numel() > 0:
        proposed = tree.tokens[tree.proposal_children]  # (P,)
        q_of_proposed = tree.draft_probs[tree.proposal_q_rows, proposed]  # (P,)
        bad = (q_of_proposed <= 0).nonzero()
        if bad.numel() > 0:
            i = int(bad[0, 0])
            raise VerificationError(
                f"token {int(proposed[i])} was proposed from a q that gives it probability {float(q_of_proposed[i])}"
            )


def accept_on_device(tokens: Tensor, tree_mask: Tensor, num_nodes: Tensor, targets: Tensor) -> Tensor:
    """Verification of a batch of packed trees where their ``targets`` ``(B, T)`` are (each
    node's target: the token plain decoding emits after it), with no host read: ``(B, 2)``
    long, each row's last accepted node and its bonus token. The path is that node's ancestors
    (the caller's host-side tree has them), so one read of ``2 B`` numbers replaces a read per
    node.

    ``tokens`` ``(B, T)``, ``tree_mask`` ``(B, T, T)`` (ancestors and self) and ``num_nodes``
    ``(B,)`` (nodes past it are padding), as a batched verify step has them. The rule is
    :func:`_follow_targets`', node for node: a node is on the accepted path iff every node from
    node 0 down to it is its parent's target, counting among siblings of one token only the
    first (``_follow_targets`` keeps the first child of a token). Those nodes form one chain;
    its deepest node is the last accepted, and its target the bonus.
    """
    width = tokens.shape[1]
    index = torch.arange(width, device=tokens.device)
    valid = index[None, :] < num_nodes.to(tokens.device)[:, None]  # (B, T); num_nodes: on the device already, or a copy
    proper = tree_mask & ~torch.eye(width, dtype=torch.bool, device=tokens.device)  # (B, T, T) strict ancestors
    parent = (proper.long() * index).amax(dim=-1)  # (B, T): the nearest ancestor (ancestors come first)
    has_parent = proper.any(dim=-1)
    same_slot = (parent[:, :, None] == parent[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :])
    shadowed = (same_slot & (index[:, None] > index[None, :]) & (has_parent & valid)[:, None, :]).any(dim=-1)
    hit = valid & has_parent & ~shadowed & (tokens == targets.gather(1, parent))
    on_path = hit | (index == 0)[None, :]  # node 0, the root, is always accepted
    reaches_root = tree_mask[:, :, 0] & valid
    accepted = reaches_root & ~(tree_mask & ~on_path[:, None, :]).any(dim=-1)  # (B, T) a chain per row
    depth = torch.where(accepted, tree_mask.sum(dim=-1), -1)
    last = depth.argmax(dim=-1)  # (B,)
    return torch.stack([last, targets.gather(1, last[:, None])[:, 0]], dim=1)


def keyed_targets(logits: Tensor, params: SamplingParams, key: SampleKey, depths: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The keyed targets ``(T,)`` of one tree's nodes at ``depths``, on the logits' device:
    :func:`~treeserve.ops.sampling.sample_keyed` of each node's probabilities at position
    ``key.position + depth``, as :func:`verify_keyed` draws them (the same keys; the same
    probabilities up to the device's rounding). Also a bool scalar, False where a node's
    probabilities are not a distribution: ``sample_keyed`` raises there, so the caller then
    verifies the row on the host, which says so."""
    probs = logits_to_probs(logits, params)  # (T, V)
    return keyed_argmax(probs, key.seed, [key.position + d for d in depths]), is_distribution(probs)


def verify_keyed(tree: TokenTree, logits: Tensor, params: SamplingParams, key: SampleKey) -> VerifyResult:
    """Keyed verification of a seeded request: lossless, and reproducible from the seed.

    The target of a node at depth ``d`` is ``sample_keyed(p, key.seed, [key.position + d])``,
    ``p`` the LLM's probabilities there (``logits_to_probs``: temperature, top-k, top-p): the
    token that decoding without speculation samples for that sequence position. The accepted
    path follows children equal to their parent's target; the last node's target is the bonus.

    Lossless: the emitted token at each position is a keyed Gumbel-max draw from the LLM's
    ``p`` there, with noise that is fresh for every position, so the output has exactly the
    LLM's distribution, whatever the tree holds (drafts, their ``q`` and ``draft_probs``
    decide nothing; a tree without ``draft_probs`` is fine). Reproducible: the same seed and
    the same logits along the emitted path give the same tokens, with any tree, in any batch.
    A draft ``x`` is accepted w.p. ``p(x)`` (below MSS's ``min(1, p(x)/q(x))``).
    A tree that carries ``draft_probs`` is still checked as MSS checks it (a proposal its ``q``
    could not draw is a speculator's bug: :class:`VerificationError`).
    Greedy ``params`` fall back to :func:`verify_greedy`.
    """
    if params.is_greedy:
        return verify_greedy(tree, logits)
    if logits.shape[0] != tree.num_nodes:
        raise ValueError(f"logits have {logits.shape[0]} rows for a tree of {tree.num_nodes} nodes")
    check_proposals(tree)
    cpu_logits = logits.detach().to("cpu")

    def target_at(node: int, depth: int) -> int:
        probs = logits_to_probs(cpu_logits[node : node + 1], params)  # (1, V)
        return sample_keyed(probs, key.seed, [key.position + depth])[0]

    return _follow_targets(tree, target_at)


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


def verify(tree: TokenTree, logits: Tensor, params: SamplingParams, randomness: Randomness) -> VerifyResult:
    """Greedy verification for greedy ``params``; keyed verification when ``randomness`` is a
    :class:`~treeserve.ops.sampling.SampleKey` (seeded requests); multi-step speculative
    sampling from the ``torch.Generator`` otherwise."""
    if params.is_greedy:
        return verify_greedy(tree, logits)
    if isinstance(randomness, SampleKey):
        return verify_keyed(tree, logits, params, randomness)
    return verify_stochastic(tree, logits, params, randomness)
