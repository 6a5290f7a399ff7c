"""``FeatureSpeculator``: the speculator that drafts with a
:class:`~treeserve.ops.feature_drafter.FeatureDrafter` from the verifier's own hidden states
(the speculator protocol of :mod:`~treeserve.ops.speculative`, plus ``add_features``)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from treeserve.ops.drafting import start_request, validate_expansion
from treeserve.ops.feature_drafter import FeatureDrafter
from treeserve.ops.graph_step import DraftGraphs
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.ssm import add_spine_children, fit_spine_widths
from treeserve.ops.token_tree import TokenTree, TokenTreeBuilder
from treeserve.ops.tree_attention import tree_mask_from_parents

DEFAULT_FEATURE_WIDTHS: tuple[int, ...] = (4, 2, 1)
"""Spine widths: four alternatives for the first token, two for the second, one third token.
Measured on the default model (5 MT-Bench prompts, greedy, bf16, 2 threads): deeper spines
accept a little more but their drafter steps and larger trees cost more than they gain."""

DEFAULT_DYNAMIC_TREE: tuple[int, int, int] | None = None
"""Greedy requests' dynamic tree ``(depth, top_k, num_nodes)`` (see :class:`FeatureSpeculator`),
or ``None`` for the greedy spine."""

class FeatureSpeculator:
    """Greedy-spine drafting with a :class:`FeatureDrafter` (speculator protocol + features).

    ``widths[d]`` children at the spine node of depth ``d`` (greedy: the drafter's top tokens;
    otherwise i.i.d. draws from its ``q``, each its own proposal), the first child extended; a
    tree has at most ``1 + sum(widths)`` nodes and ``max_depth``/``max_nodes`` cut the widths
    before any draw. With ``dynamic = (depth, top_k, num_nodes)``, greedy requests get a tree
    shaped by the drafter's confidence instead (EAGLE-2; see :meth:`_dynamic_tree`), and
    sampled ones keep the spine. Without the LLM's state of the token before the root (a
    one-token prompt, or features not delivered) it proposes the root alone.
    """

    uses_features = True

    def __init__(self, drafter: FeatureDrafter, widths: Sequence[int] = DEFAULT_FEATURE_WIDTHS, *,
                 capacity: int | None = None, dynamic: Sequence[int] | None = DEFAULT_DYNAMIC_TREE) -> None:
        self.drafter = drafter
        self.widths = validate_expansion(widths)
        if dynamic is not None:
            dynamic = validate_expansion(dynamic)
            if len(dynamic) != 3:
                raise ValueError(f"dynamic is (depth, top_k, num_nodes), got {dynamic!r}")
        self.dynamic = None if dynamic is None else (dynamic[0], dynamic[1], dynamic[2])
        self._capacity = capacity
        self._cache: KVCache | None = None
        self._history: list[int] = []
        self._states: list[Tensor] = []  # (n_i, D) chunks: the LLM's states of history[:num_states]
        self._num_states = 0
        self._num_pairs = 0  # pairs (f_i, x_{i+1}) with true states committed to the cache
        self._root_prediction: Tensor | None = None  # the drafter's state after the last pair

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Start a request; its states arrive through :meth:`add_features`. Where the drafter
        has captured caches (:func:`~treeserve.ops.graph_step.attach_draft_graphs`, on a GPU),
        this speculator drafts in a free one, handed back when it is dropped."""
        graphs = self.drafter.draft_step
        if self._cache is None and isinstance(graphs, DraftGraphs):
            self._cache = graphs.lease(self._capacity)
            if self._cache is not None:
                weakref.finalize(self, graphs.release, self._cache)
        self._cache, self._history = start_request(self._cache, self.drafter, self._capacity, prompt_ids)
        self._states, self._num_states, self._num_pairs = [], 0, 0
        self._root_prediction = None

    def add_features(self, states: Tensor) -> None:
        """The LLM's final hidden states ``(n, D)`` of the next ``n`` tokens of the request."""
        if states.dim() != 2 or states.shape[1] != self.drafter.drafter_config.dim:
            raise ValueError(f"states must be (n, {self.drafter.drafter_config.dim}), got {tuple(states.shape)}")
        if self._num_states + states.shape[0] > len(self._history):
            raise ValueError("more states than tokens: add_features must follow prefill/accept")
        self._states.append(states.detach().to(self.drafter.dtype))
        self._num_states += states.shape[0]

    def _all_states(self) -> Tensor:
        if len(self._states) > 1:
            self._states = [torch.cat(self._states)]
        return self._states[0]

    def propose(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        max_depth: int | None = None,
        max_nodes: int | None = None,
    ) -> TokenTree:
        """Draft a greedy-spine tree rooted at the last token seen (see the class docstring)."""
        if self._cache is None or not self._history:
            raise RuntimeError("FeatureSpeculator.prefill must be called before propose")
        root = self._history[-1]
        builder = TokenTreeBuilder(root, with_probs=not params.is_greedy)
        num_pairs = len(self._history) - 1  # pairs up to (f_{n-2}, root)
        if self._num_states < num_pairs or num_pairs == 0:
            return builder.build()
        cache, drafter = self._cache, self.drafter
        device = drafter.device
        with torch.no_grad():
            cache.truncate(0, self._num_pairs)  # drop the last spine (predicted states)
            # Depth D feeds D - 1 spine states after the pairs (the new pairs themselves too).
            room = cache.capacity - num_pairs
            dynamic = params.is_greedy and self.dynamic is not None
            widths = fit_spine_widths(self.widths, max_depth, max_nodes, room)
            if room < 1 or not (dynamic or widths):
                return builder.build()
            start = self._num_pairs
            if start < num_pairs:
                states = self._all_states()[start:num_pairs]  # (m, D)
                tokens = torch.tensor([self._history[start + 1: num_pairs + 1]], dtype=torch.long, device=device)
                self._root_prediction = drafter.features(states[None].to(device), tokens, cache)[0, -1]  # (D,)
                cache.commit(0, range(num_pairs - start))
                self._num_pairs = num_pairs
            assert self._root_prediction is not None
            if dynamic:
                self._dynamic_tree(builder, max_depth, max_nodes, room)
                return builder.build()
            predicted = self._root_prediction
            node = 0
            for depth, width in enumerate(widths):
                if depth > 0:
                    token = torch.tensor([[builder.token_of(node)]], dtype=torch.long, device=device)
                    predicted = drafter.features(predicted[None, None], token, cache)[0, -1]
                    cache.commit(0, [0])
                node = add_spine_children(builder, node, drafter.head(predicted), drafter.draft_ids,
                                          drafter.to_full_vocab, params, generator, width)
        return builder.build()

    def _dynamic_tree(self, builder: TokenTreeBuilder, max_depth: int | None, max_nodes: int | None,
                      room: int) -> None:
        """Greedy only: a tree shaped by the drafter's confidence (EAGLE-2). Each depth expands
        the ``top_k`` nodes of the newest layer with the highest path probability (the product
        of the drafter's probabilities along the path), each into its ``top_k`` likeliest
        children, with one drafter forward for the whole layer; then the ``num_nodes - 1``
        likeliest drafted nodes form the tree (a child is never likelier than its parent, so
        they are connected). Under sampling, draws would decide the shape, which multi-step
        speculative sampling does not allow: those requests keep the spine."""
        assert self.dynamic is not None and self._root_prediction is not None
        depth_limit, top_k, num_nodes = self.dynamic
        if max_depth is not None:
            depth_limit = min(depth_limit, max_depth)
        budget = min(num_nodes, max_nodes if max_nodes is not None else num_nodes) - 1
        if depth_limit < 1 or budget < 1:
            return
        drafter, cache = self.drafter, self._cache
        assert cache is not None
        device = drafter.device
        # Drafted nodes: token, parent (-1: the root), path log-probability under the drafter, depth.
        tokens: list[int] = []
        parents: list[int] = []
        values: list[float] = []
        depths: list[int] = []

        def add_children(parent: int, base: float, logits: Tensor) -> list[int]:
            logp = torch.log_softmax(logits.float(), dim=-1)
            top = torch.topk(logp, min(top_k, logp.numel()))
            ids = drafter.draft_ids[top.indices].tolist()
            added = []
            for token, value in zip(ids, top.values.tolist()):
                tokens.append(int(token))
                parents.append(parent)
                values.append(base + float(value))
                depths.append(1 if parent < 0 else depths[parent] + 1)
                added.append(len(tokens) - 1)
            return added

        layer = add_children(-1, 0.0, drafter.head(self._root_prediction))
        inputs: dict[int, Tensor] = {i: self._root_prediction for i in layer}  # the parent's state
        for _ in range(1, depth_limit):
            expand = sorted(layer, key=lambda i: -values[i])[:top_k]
            # Feed the expanded nodes with their ancestors (pending, never committed), each
            # seeing the committed pairs and its own ancestors only.
            fed: set[int] = set()
            for node in expand:
                while node >= 0 and node not in fed:
                    fed.add(node)
                    node = parents[node]
            order = sorted(fed)
            if len(order) > room:
                break
            index = {node: i for i, node in enumerate(order)}
            tree_parents = torch.tensor([index.get(parents[n], -1) for n in order], device=device)
            mask = tree_mask_from_parents(tree_parents)
            positions = torch.tensor([[self._num_pairs + depths[n] - 1 for n in order]], device=device)
            states = torch.stack([inputs[n] for n in order])[None]
            fed_tokens = torch.tensor([[tokens[n] for n in order]], dtype=torch.long, device=device)
            predicted = drafter.features(states, fed_tokens, cache, tree_mask=mask[None], positions=positions)[0]
            logits = drafter.head(predicted[[index[n] for n in expand]])  # (k, K)
            layer = []
            for row, node in enumerate(expand):
                children = add_children(node, values[node], logits[row])
                for child in children:
                    inputs[child] = predicted[index[node]]
                layer.extend(children)
        # Parents first: a child's value never exceeds its parent's, and at equal values the
        # shallower (earlier) node wins.
        keep = sorted(range(len(tokens)), key=lambda i: (-values[i], depths[i], i))[:budget]
        node_of: dict[int, int] = {}
        for i in sorted(keep):  # drafting order: parents first
            node_of[i] = builder.add_proposal(0 if parents[i] < 0 else node_of[parents[i]], tokens[i])

    def accept(self, new_tokens: Sequence[int]) -> None:
        """Append the emitted tokens (their states follow through :meth:`add_features`)."""
        if self._cache is None:
            raise RuntimeError("FeatureSpeculator.prefill must be called before accept")
        self._history.extend(int(t) for t in new_tokens)


__all__ = [
    "DEFAULT_FEATURE_DRAFTER_FILE",
    "DEFAULT_FEATURE_WIDTHS",
    "DraftStep",
    "FeatureDrafter",
    "FeatureSpeculator",
    "compile_draft_step",
    "draft_hidden",
    "init_feature_drafter",
    "load_feature_drafter",
    "save_feature_drafter",
]
