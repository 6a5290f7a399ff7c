"""Speculators: the protocol, expansion-based tree drafting, and the small-model speculator.

A speculator follows one request's token sequence (prompt, then every emitted token) and,
each step, proposes a :class:`~treeserve.ops.token_tree.TokenTree` rooted at the last token
of that sequence. Drafting rule (what :func:`treeserve.ops.verify.verify_stochastic` assumes):
with greedy params a node's children are the drafter's top-k tokens (no q stored); otherwise
they are ``k`` i.i.d. draws *with replacement* from the drafter's ``q`` at that node
(``q = logits_to_probs(drafter_logits, params)``, the same transform as the LLM's target),
each draw recorded as its own proposal (duplicates are tried in turn by the verifier).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from treeserve.ops.expansion import DEFAULT_EXPANSION as DEFAULT_EXPANSION  # re-exported: the configs live there
from treeserve.ops.expansion import validate_expansion as validate_expansion
from treeserve.ops.expansion import worst_case_num_nodes as worst_case_num_nodes
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.model import Transformer
from treeserve.ops.sampling import SamplingParams, logits_to_probs, sample_from_probs
from treeserve.ops.token_tree import TokenTree, TokenTreeBuilder
from treeserve.ops.tree_attention import tree_mask_from_parents


class Speculator(Protocol):
    """Drafts token trees for one request and stays in step with its accepted tokens.

    ``prefill(prompt_ids)`` starts a request (resets any state). ``propose(params, generator,
    max_depth=None, max_nodes=None)`` returns a token tree rooted at the last token seen (the
    last prompt token, then the last emitted token) with nodes at most ``max_depth`` deep and at
    most ``max_nodes`` nodes, root included (None: the speculator's own limits). For stochastic
    verification to stay lossless the limits must be applied by a rule that does not look at
    this step's random draws (e.g. a worst-case size bound), never by cutting a drawn tree.
    ``accept(new_tokens)`` appends the tokens the verifier emitted this step (accepted drafts
    then the bonus token, which is the next root).
    """

    def prefill(self, prompt_ids: Sequence[int]) -> None: ...

    def propose(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        max_depth: int | None = None,
        max_nodes: int | None = None,
    ) -> TokenTree: ...

    def accept(self, new_tokens: Sequence[int]) -> None: ...


NextLogitsFn = Callable[[list[int], list[int], list[int]], Tensor]
"""``(parents, tokens, frontier) -> logits (F, V)``: the drafter's next-token logits at each
frontier node of the partial tree given by ``parents``/``tokens`` (root first)."""


def start_request(
    cache: KVCache | None, model: Transformer, capacity: int | None, prompt_ids: Sequence[int]
) -> tuple[KVCache, list[int]]:
    """What a model-backed speculator's ``prefill`` starts from: its one-row cache (made by
    ``model`` on first use, then reused) emptied, and the prompt as the history.
    ``ValueError`` on an empty prompt."""
    if not prompt_ids:
        raise ValueError("a speculator needs a non-empty prompt")
    if cache is None:
        cache = model.new_cache(1, capacity)
    cache.reset_row(0)
    return cache, [int(t) for t in prompt_ids]


def split_node_budget(max_nodes: int, num_speculators: int) -> list[int]:
    """Per-speculator node limits (root included) whose trie merge fits ``max_nodes`` nodes.

    Merged trees share the root, so the merge has at most ``1 + sum(limit - 1)`` nodes: the
    ``max_nodes - 1`` draft nodes are split evenly, the remainder to the first speculators
    (so 2 nodes over 2 speculators give the first one a draft and the second none, rather than
    nothing to either). Fixed before drafting: a cut that depended on the draws would bias
    multi-step speculative sampling."""
    if num_speculators < 1:
        return []
    drafts, extra = divmod(max(max_nodes - 1, 0), num_speculators)
    return [1 + drafts + (1 if index < extra else 0) for index in range(num_speculators)]


def expand_token_tree(
    root_token: int,
    expansion: Sequence[int],
    next_logits: NextLogitsFn,
    params: SamplingParams,
    generator: torch.Generator | None,
    *,
    speculator: int = 0,
) -> TokenTree:
    """Expansion-based token tree: at step ``i`` every frontier node gets ``expansion[i]`` children.

    One ``next_logits`` call per step scores the whole frontier (so a model drafter runs one
    batched forward per step). Greedy params take the top-``k`` distinct tokens; otherwise each
    frontier node's ``q`` row is stored and ``k`` draws with replacement become ``k`` proposals
    (equal draws share one trie node). The next frontier is the distinct new children.
    """
    config = validate_expansion(expansion)
    is_greedy = params.is_greedy
    builder = TokenTreeBuilder(root_token, with_probs=not is_greedy)
    frontier = [0]
    for width in config:
        logits = next_logits(builder.parents, builder.tokens, frontier)  # (F, V)
        new_frontier: list[int] = []
        if is_greedy:
            top = torch.topk(logits.float(), min(width, logits.shape[-1]), dim=-1).indices.tolist()  # (F, k)
            for node, row in zip(frontier, top):
                for token in row:
                    new_frontier.append(builder.add_proposal(node, token, speculator=speculator))
        else:
            q = logits_to_probs(logits.detach().to("cpu"), params)  # (F, V)
            draws = sample_from_probs(q, generator, width).tolist()  # (F, k)
            for node, q_node, row in zip(frontier, q, draws):
                q_row = builder.add_probs(q_node)
                for token in row:
                    child = builder.add_proposal(node, token, speculator=speculator, q_row=q_row)
                    if child not in new_frontier:
                        new_frontier.append(child)
        frontier = new_frontier
    return builder.build()


class ModelSpeculator:
    """A small speculative model (SSM: any :class:`Transformer`) drafting expansion-based trees.

    It owns a batch-1 KV cache over the request's tokens. Step 0 of :meth:`propose` feeds the
    tokens not yet cached (the root, plus any accepted token whose KV was not kept) and commits
    them, since they are all accepted; each later step feeds every draft node so far as one
    token tree (one forward, tree mask + depth positions) because pending slots are only visible
    within one forward. :meth:`accept` commits the pending KV of the accepted draft nodes that
    the last forward computed. ``capacity`` bounds prompt + generated + one tree (default: the
    model's ``max_seq_len``); near it the tree is drafted shallower rather than overflow.
    """

    def __init__(self, model: Transformer, expansion: Sequence[int], *, capacity: int | None = None) -> None:
        self.model = model
        self.expansion = validate_expansion(expansion)
        self._capacity = capacity
        self._cache: KVCache | None = None
        self._history: list[int] = []
        self._last_tree: TokenTree | None = None
        self._num_fed_drafts = 0  # drafts (nodes 1..n) whose KV the last forward left pending

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Start a request with ``prompt_ids`` (non-empty); the KV is computed lazily by propose."""
        self._cache, self._history = start_request(self._cache, self.model, self._capacity, prompt_ids)
        self._last_tree = None
        self._num_fed_drafts = 0

    def _require_cache(self) -> KVCache:
        if self._cache is None:
            raise RuntimeError("ModelSpeculator.prefill must be called before propose/accept")
        return self._cache

    def propose(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        max_depth: int | None = None,
        max_nodes: int | None = None,
    ) -> TokenTree:
        """Draft a tree rooted at the last token seen (see the class docstring).

        The depth is the longest prefix of the expansion config whose worst-case tree fits
        ``max_depth``, ``max_nodes`` and the cache room, decided before any draw.
        """
        cache = self._require_cache()
        device = self.model.device
        with torch.no_grad():
            # The root's KV may be cached already (propose called again without accept): feed it
            # again anyway, since its logits are the first drafting distribution.
            start = min(int(cache.lengths[0]), len(self._history) - 1)
            cache.truncate(0, start)
            uncached = self._history[start:]  # ends with the root
            tokens = torch.tensor([uncached], dtype=torch.long, device=device)  # (1, U)
            logits = self._forward(cache, tokens, None, None)  # (1, U, V)
            cache.commit(0, range(len(uncached)))
            root_logits = logits[0, -1:]  # (1, V)
            committed = int(cache.lengths[0])  # the root sits at position committed - 1
            self._num_fed_drafts = 0
            expansion = self._fitting_expansion(max_depth, max_nodes, cache.capacity - committed)

            def next_logits(parents: list[int], tokens: list[int], frontier: list[int]) -> Tensor:
                if frontier == [0]:
                    return root_logits
                # Draft nodes 1..n become new tokens 0..n-1; the (committed) root is their prefix.
                rel_parents = torch.tensor([p - 1 for p in parents[1:]], dtype=torch.long)  # (n,)
                mask = tree_mask_from_parents(rel_parents)  # (n, n)
                depths = mask.sum(dim=-1)  # (n,) ancestors incl. self = depth below the root
                positions = (committed - 1 + depths)[None].to(device)  # (1, n)
                draft_tokens = torch.tensor([tokens[1:]], dtype=torch.long, device=device)  # (1, n)
                out = self._forward(cache, draft_tokens, mask[None].to(device), positions)  # (1, n, V)
                self._num_fed_drafts = len(parents) - 1
                return out[0, torch.tensor(frontier, device=device) - 1]  # (F, V)

            if expansion:
                tree = expand_token_tree(self._history[-1], expansion, next_logits, params, generator)
            else:
                tree = TokenTree.from_parents([-1], [self._history[-1]])
        self._last_tree = tree
        return tree

    def _fitting_expansion(self, max_depth: int | None, max_nodes: int | None, room: int) -> tuple[int, ...]:
        expansion = self.expansion if max_depth is None else self.expansion[: max(max_depth, 0)]
        sizes = worst_case_num_nodes(expansion)
        depth = len(expansion)
        # Step d (d >= 1) feeds the drafts of depth <= d, so depth D needs sizes[D - 1] - 1 slots.
        while depth > 0 and (
            (max_nodes is not None and sizes[depth] > max_nodes) or sizes[depth - 1] - 1 > room
        ):
            depth -= 1
        return expansion[:depth]

    def _forward(self, cache: KVCache, tokens: Tensor, tree_mask: Tensor | None, positions: Tensor | None) -> Tensor:
        out = self.model(tokens, cache, tree_mask=tree_mask, positions=positions)
        assert isinstance(out, Tensor)
        return out

    def accept(self, new_tokens: Sequence[int]) -> None:
        """Append the emitted tokens; keep the pending KV of the accepted drafts already computed."""
        cache = self._require_cache()
        keep: list[int] = []
        tree = self._last_tree
        if tree is not None and self._num_fed_drafts > 0:
            children: dict[tuple[int, int], int] = {
                (p, t): i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())) if p >= 0
            }
            node = 0
            # The last token is the next root: its KV is computed with its logits next step.
            for token in list(new_tokens)[:-1]:
                child = children.get((node, int(token)))
                if child is None or child > self._num_fed_drafts:
                    break
                keep.append(child - 1)  # draft node i sat at pending slot i - 1
                node = child
        if keep:
            cache.commit(0, keep)
        else:
            cache.truncate(0, int(cache.lengths[0]))  # drop pending slots
        self._history.extend(int(t) for t in new_tokens)
        self._last_tree = None
        self._num_fed_drafts = 0
