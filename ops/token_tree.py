"""Token trees: the speculated continuations that one verification pass checks at once.

A :class:`TokenTree` is stored as flat tensors in topological order (``parents[i] < i``).
Node 0 is the ROOT: the last accepted token, whose KV is not yet in the LLM's cache, so a
verify pass feeds ``[root, draft nodes...]`` and the root's logits give the first prediction.

Besides the trie itself (``parents``, ``tokens``) a tree records, for stochastic verification
(SpecInfer's multi-step speculative sampling), every *proposal*: one draw by one speculator
of a child token at a node. Proposals are kept in try order, grouped by parent node; a trie
node reached by several proposals (duplicate draws, or several speculators proposing the
same token) appears once in ``parents``/``tokens`` but once per proposal in the proposal
list. Each proposal points to a row of ``draft_probs`` holding the drafting distribution q
that it was drawn from (rows are shared by the i.i.d. draws of one speculator at one node).
Trees built for greedy verification carry no ``draft_probs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from treeserve.ops.tree_attention import tree_mask_from_parents


@dataclass(frozen=True, eq=False)
class Proposal:
    """One draw of a child token at a node: the ``child`` trie node, the proposing
    ``speculator`` index and the ``q_row`` of ``draft_probs`` it was sampled from (None for
    greedy trees, which carry no drafting distributions)."""

    child: int
    speculator: int
    q_row: int | None


@dataclass(frozen=True, eq=False)
class TokenTree:
    """A token tree with its proposals (see the module docstring for the contract).

    Fields (all on the CPU, int64 unless noted):
    ``parents`` ``(T,)`` parent node per node, ``-1`` only for the root (node 0), ``parents[i] < i``;
    ``tokens`` ``(T,)`` token id per node;
    ``proposal_children`` ``(P,)`` child node of each proposal, grouped by parent in try order;
    ``proposal_speculators`` ``(P,)`` proposing speculator index of each proposal;
    ``proposal_q_rows`` ``(P,)`` row of ``draft_probs`` per proposal (ignored if ``draft_probs`` is None);
    ``draft_probs`` float ``(R, V)`` drafting distributions, or None for greedy trees.
    Every non-root node is the child of at least one proposal. Build trees with
    :class:`TokenTreeBuilder`, :meth:`from_parents`, :meth:`chain` or :func:`merge_trees`.
    """

    parents: Tensor
    tokens: Tensor
    proposal_children: Tensor
    proposal_speculators: Tensor
    proposal_q_rows: Tensor
    draft_probs: Tensor | None = None

    def __post_init__(self) -> None:
        n = self.parents.shape[0]
        if self.parents.dim() != 1 or n == 0 or self.tokens.shape != self.parents.shape:
            raise ValueError(
                f"a token tree needs 1-D parents and tokens of equal non-zero length, got "
                f"{tuple(self.parents.shape)} and {tuple(self.tokens.shape)}"
            )
        if int(self.parents[0]) != -1 or bool((self.parents[1:] < 0).any()):
            raise ValueError("node 0 must be the only root (parent -1); got parents " f"{self.parents.tolist()}")
        if bool((self.parents >= torch.arange(n)).any()):
            raise ValueError(f"parents must precede their children (parents[i] < i), got {self.parents.tolist()}")
        children = self.proposal_children
        if not (children.shape == self.proposal_speculators.shape == self.proposal_q_rows.shape):
            raise ValueError("proposal tensors must have equal shapes")
        if bool(((children < 1) | (children >= n)).any()):
            raise ValueError(f"proposal children must be non-root nodes, got {children.tolist()}")
        if n > 1 and int(torch.bincount(children, minlength=n)[1:].min()) == 0:
            raise ValueError("every non-root node must be proposed at least once")
        proposal_parents = self.parents[children]
        if children.numel() > 1 and bool((proposal_parents[1:] < proposal_parents[:-1]).any()):
            raise ValueError("proposals must be grouped by parent node in ascending parent order")
        if self.draft_probs is not None:
            rows = self.draft_probs.shape[0]
            if self.draft_probs.dim() != 2 or bool(((self.proposal_q_rows < 0) | (self.proposal_q_rows >= rows)).any()):
                raise ValueError(f"proposal_q_rows must index the {rows} rows of a 2-D draft_probs")

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _trusted(
        parents: Tensor,
        tokens: Tensor,
        proposal_children: Tensor,
        proposal_speculators: Tensor,
        proposal_q_rows: Tensor,
        draft_probs: Tensor | None,
    ) -> TokenTree:
        # For trees made by this module's own code, whose invariants hold by construction:
        # skips __post_init__'s checks, which cost more than building a small tree.
        tree = object.__new__(TokenTree)
        for name, value in (
            ("parents", parents),
            ("tokens", tokens),
            ("proposal_children", proposal_children),
            ("proposal_speculators", proposal_speculators),
            ("proposal_q_rows", proposal_q_rows),
            ("draft_probs", draft_probs),
        ):
            object.__setattr__(tree, name, value)
        return tree

    @staticmethod
    def from_parents(parents: Sequence[int] | Tensor, tokens: Sequence[int] | Tensor) -> TokenTree:
        """Tree from parent indices and tokens, one proposal (speculator 0) per non-root node, no q."""
        par = torch.as_tensor(parents, dtype=torch.long).reshape(-1)
        tok = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        children = torch.arange(1, par.shape[0])
        order = torch.argsort(par[1:], stable=True)  # group proposals by parent
        children = children[order]
        zeros = torch.zeros_like(children)
        return TokenTree(par, tok, children, zeros, zeros.clone(), None)

    @staticmethod
    def root_only(token: int) -> TokenTree:
        """The one-node tree of a plain decode step: ``token`` and no proposals. Built without
        :meth:`from_parents`' checks, which hold by construction (about 100 us of a decode
        step's overhead otherwise, measured)."""
        none = torch.zeros(0, dtype=torch.long)
        return TokenTree._trusted(torch.tensor([-1]), torch.tensor([int(token)]), none, none.clone(), none.clone(), None)

    @staticmethod
    def chain(root_token: int, draft_tokens: Sequence[int]) -> TokenTree:
        """A chain ``root -> draft_tokens[0] -> draft_tokens[1] ...`` (sequence speculation)."""
        n = len(draft_tokens) + 1
        return TokenTree.from_parents(list(range(-1, n - 1)), [root_token, *draft_tokens])

    # ------------------------------------------------------------------ queries
    @property
    def num_nodes(self) -> int:
        """Number of nodes including the root."""
        return int(self.parents.shape[0])

    @property
    def root_token(self) -> int:
        """Token id of the root (the last accepted token)."""
        return int(self.tokens[0])

    @property
    def num_speculators(self) -> int:
        """One more than the largest proposing speculator index (1 for a root-only tree)."""
        if self.proposal_speculators.numel() == 0:
            return 1
        return int(self.proposal_speculators.max()) + 1

    def parents_tensor(self) -> Tensor:
        """Parent index per node ``(T,)`` (root ``-1``), the form the attention kernels take."""
        return self.parents

    def depths(self) -> Tensor:
        """Depth per node ``(T,)``; the root has depth 0. Tree positions are ``length + depth``."""
        par = self.parents.tolist()
        depth = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            depth[i] = depth[par[i]] + 1
        return torch.tensor(depth, dtype=torch.long)

    def tree_mask(self) -> Tensor:
        """Bool ``(T, T)``: ``mask[i, j]`` iff ``j`` is ``i`` or an ancestor of ``i``."""
        mask: Tensor = tree_mask_from_parents(self.parents)
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive (ascending)."""
        if not 0 <= node < self.num_nodes:
            raise IndexError(f"node {node} outside a tree of {self.num_nodes} nodes")
        par = self.parents.tolist()
        path = [node]
        while par[path[-1]] >= 0:
            path.append(par[path[-1]])
        return path[::-1]

    def children_of(self, node: int) -> list[int]:
        """Distinct child nodes of ``node`` in ascending order."""
        return (self.parents == node).nonzero().flatten().tolist()

    def proposals(self) -> list[list[Proposal]]:
        """Per node, its proposals in try order (list of length ``num_nodes``)."""
        result: list[list[Proposal]] = [[] for _ in range(self.num_nodes)]
        par = self.parents.tolist()
        has_q = self.draft_probs is not None
        for child, spec, row in zip(
            self.proposal_children.tolist(), self.proposal_speculators.tolist(), self.proposal_q_rows.tolist()
        ):
            result[par[child]].append(Proposal(child, spec, row if has_q else None))
        return result

    def restricted(self, keep: Tensor) -> TokenTree:
        """The subtree of nodes where ``keep`` ``(T,)`` bool is True (must include the root and
        be closed under ancestors); proposals of dropped nodes are dropped too."""
        keep = keep.to(torch.bool)
        if not bool(keep[0]) or bool((keep[1:] & ~keep[self.parents[1:]]).any()):
            raise ValueError("a restricted tree must keep the root and every kept node's parent")
        new_index = torch.cumsum(keep.long(), 0) - 1  # old node -> new node
        kept = keep.nonzero().flatten()
        parents = torch.where(self.parents[kept] >= 0, new_index[self.parents[kept].clamp(min=0)], -1)
        prop_keep = keep[self.proposal_children]
        return TokenTree._trusted(
            parents,
            self.tokens[kept],
            new_index[self.proposal_children[prop_keep]],
            self.proposal_speculators[prop_keep],
            self.proposal_q_rows[prop_keep],
            self.draft_probs,
        )

    def first_chain(self) -> TokenTree:
        """The chain that follows each node's first proposal (sequence-based speculation)."""
        keep = torch.zeros(self.num_nodes, dtype=torch.bool)
        props = self.proposals()
        node = 0
        keep[0] = True
        while props[node]:
            node = props[node][0].child
            keep[node] = True
        chain = self.restricted(keep)
        # Only the first proposal per node survives: later ones were draws of the same node's
        # q that chose another token, so proposals at chain nodes stay i.i.d. draws of q.
        first = torch.ones(chain.proposal_children.shape[0], dtype=torch.bool)
        seen: set[int] = set()
        for i, parent in enumerate(chain.parents[chain.proposal_children].tolist()):
            first[i] = parent not in seen
            seen.add(parent)
        return TokenTree._trusted(
            chain.parents,
            chain.tokens,
            chain.proposal_children[first],
            chain.proposal_speculators[first],
            chain.proposal_q_rows[first],
            chain.draft_probs,
        )


class TokenTreeBuilder:
    """Grows a token tree as a trie: :meth:`add_proposal` reuses the child with the same token.

    Use one builder per step; ``with_probs`` decides whether proposals carry q rows
    (stochastic verification) or not (greedy). Not thread-safe.
    """

    def __init__(self, root_token: int, *, with_probs: bool) -> None:
        self._parents: list[int] = [-1]
        self._tokens: list[int] = [int(root_token)]
        self._child_by_token: list[dict[int, int]] = [{}]
        self._proposals: list[list[tuple[int, int, int]]] = [[]]  # per parent: (child, spec, q_row)
        self._with_probs = with_probs
        self._probs: list[Tensor] = []

    @property
    def num_nodes(self) -> int:
        """Number of trie nodes so far, root included."""
        return len(self._parents)

    @property
    def parents(self) -> list[int]:
        """Parent index per node so far (a copy; root -1)."""
        return list(self._parents)

    @property
    def tokens(self) -> list[int]:
        """Token id per node so far (a copy)."""
        return list(self._tokens)

    def token_of(self, node: int) -> int:
        """Token id of ``node``."""
        return self._tokens[node]

    def depth_of(self, node: int) -> int:
        """Depth of ``node`` (root 0)."""
        depth = 0
        while self._parents[node] >= 0:
            node = self._parents[node]
            depth += 1
        return depth

    def find_child(self, parent: int, token: int) -> int | None:
        """The child of ``parent`` carrying ``token``, or None."""
        return self._child_by_token[parent].get(int(token))

    def add_probs(self, probs: Tensor) -> int:
        """Store a drafting distribution ``(V,)`` and return its q row index."""
        if not self._with_probs:
            raise ValueError("this builder makes a greedy tree: it stores no drafting distributions")
        self._probs.append(probs.detach().reshape(-1).float().cpu())
        return len(self._probs) - 1

    def add_many_probs(self, probs: Tensor) -> int:
        """Store drafting distributions ``(R, V)``; return the q row index of the first one."""
        first = len(self._probs)
        for row in probs:
            self.add_probs(row)
        return first

    def add_proposal(self, parent: int, token: int, *, speculator: int = 0, q_row: int | None = None) -> int:
        """Record that ``speculator`` drew ``token`` at ``parent`` (from q row ``q_row``).

        Returns the child node (new, or the existing one with that token).
        """
        if not 0 <= parent < self.num_nodes:
            raise IndexError(f"parent {parent} outside a tree of {self.num_nodes} nodes")
        if self._with_probs and q_row is None:
            raise ValueError("a stochastic tree needs the q row each proposal was drawn from")
        token = int(token)
        child = self._child_by_token[parent].get(token)
        if child is None:
            child = self.num_nodes
            self._parents.append(parent)
            self._tokens.append(token)
            self._child_by_token.append({})
            self._proposals.append([])
            self._child_by_token[parent][token] = child
        self._proposals[parent].append((child, speculator, q_row if q_row is not None else 0))
        return child

    def build(self) -> TokenTree:
        """Freeze the tree (proposals grouped by parent, in insertion order within a parent)."""
        flat = [p for per_parent in self._proposals for p in per_parent]
        cols = list(zip(*flat)) if flat else [(), (), ()]
        probs: Tensor | None = None
        if self._with_probs:
            probs = torch.stack(self._probs) if self._probs else torch.zeros(0, 0)
        return TokenTree._trusted(
            torch.tensor(self._parents, dtype=torch.long),
            torch.tensor(self._tokens, dtype=torch.long),
            torch.tensor(cols[0], dtype=torch.long),
            torch.tensor(cols[1], dtype=torch.long),
            torch.tensor(cols[2], dtype=torch.long),
            probs,
        )


def merge_trees(trees: Sequence[TokenTree]) -> TokenTree:
    """Trie-merge the token trees of any number of speculators into one token tree.

    All trees must share the root token. Speculator indices are renumbered so tree ``k``'s
    indices follow those of trees ``0..k-1`` (tree ``k`` of single-speculator trees becomes
    speculator ``k``). At every node the proposals of tree 0 are tried first, then tree 1's,
    and so on, in each tree's own order; every proposal keeps its own drafting distribution.
    Either all trees carry ``draft_probs`` or none does.
    """
    if not trees:
        raise ValueError("merge_trees needs at least one tree")
    root = trees[0].root_token
    if any(t.root_token != root for t in trees):
        raise ValueError(f"trees to merge must share the root token, got {[t.root_token for t in trees]}")
    # A root-only tree has no proposals, so it merges with either kind.
    with_probs = any(t.draft_probs is not None for t in trees)
    if any(t.draft_probs is None and t.proposal_children.numel() > 0 for t in trees) and with_probs:
        raise ValueError("cannot merge greedy trees (no draft_probs) with stochastic trees")
    builder = TokenTreeBuilder(root, with_probs=with_probs)
    spec_offset = 0
    for tree in trees:
        row_offset = builder.add_many_probs(tree.draft_probs) if tree.draft_probs is not None else 0
        node_map = [0] * tree.num_nodes  # node of `tree` -> merged node
        par = tree.parents.tolist()
        # Proposals are grouped by parent in ascending order and parents precede children,
        # so every proposal's parent is mapped before the proposal is replayed.
        for child, spec, row in zip(
            tree.proposal_children.tolist(), tree.proposal_speculators.tolist(), tree.proposal_q_rows.tolist()
        ):
            node_map[child] = builder.add_proposal(
                node_map[par[child]],
                int(tree.tokens[child]),
                speculator=spec + spec_offset,
                q_row=row + row_offset if with_probs else None,
            )
        spec_offset += tree.num_speculators
    return builder.build()


@dataclass(frozen=True, eq=False)
class PackedTrees:
    """Forward inputs for a batch of token trees, one per cache row, padded to a common ``T``.

    ``tokens`` ``(B, T)``, ``tree_mask`` bool ``(B, T, T)``, ``positions`` ``(B, T)`` (committed
    length + depth), ``num_nodes`` the real node count per row. Padding slots hold
    ``pad_token_id``, see only themselves, are seen by no real node and sit at the row's
    committed length, so after the forward row ``b``'s logits ``[:num_nodes[b]]`` belong to
    its tree and commit keeps only real nodes.
    """

    tokens: Tensor
    tree_mask: Tensor
    positions: Tensor
    num_nodes: tuple[int, ...]


def pack_trees(trees: Sequence[TokenTree], lengths: Sequence[int], pad_token_id: int = 0) -> PackedTrees:
    """Pad ``trees`` (row ``b`` has committed length ``lengths[b]``) into one batched forward's inputs."""
    if not trees or len(trees) != len(lengths):
        raise ValueError(f"pack_trees needs one committed length per tree, got {len(trees)} trees and {len(lengths)} lengths")
    width = max(t.num_nodes for t in trees)
    batch = len(trees)
    tokens = torch.full((batch, width), pad_token_id, dtype=torch.long)
    mask = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)  # (B, T, T) padding sees itself
    positions = torch.zeros(batch, width, dtype=torch.long)
    for row, (tree, length) in enumerate(zip(trees, lengths)):
        n = tree.num_nodes
        tokens[row, :n] = tree.tokens
        mask[row, :n, :n] = tree.tree_mask()
        positions[row] = int(length)
        positions[row, :n] += tree.depths()
    return PackedTrees(tokens, mask, positions, tuple(t.num_nodes for t in trees))
