"""A model-free drafter over everything a server has seen (SuffixDecoding-style).

:class:`SuffixIndex` is shared by every request of a speculator process. It keeps the recent
token sequences of all requests (each request's prompt, then its emitted tokens, as they
arrive) up to ``capacity`` tokens, evicting the least recently extended sequences first, and
indexes every n-gram of ``min_ngram..max_ngram`` tokens by the places it occurred. A request's
:class:`SuffixSpeculator` looks up the longest suffix of its own tokens that occurred anywhere
(another request's answer, a template, an earlier turn of an agent loop, its own prompt), counts
what followed its most recent ``max_matches`` occurrences in a trie, and proposes the most
frequent continuations: nodes are taken best first by their empirical path probability (the
product of ``count(child) / count(parent)`` along the path), down to ``min_probability``, up to
the node budget. So a continuation seen 9 times out of 10 fills the tree before one seen once.

Proposals are a deterministic function of the tokens seen, so for stochastic verification each
carries a point-mass ``q`` on its token, as the n-gram drafter's do (multi-step speculative
sampling stays lossless with point masses). A lookup costs microseconds to a few hundred of them
(an n-gram hash per length, then at most ``max_matches`` slices), and needs no model.

Memory is bounded by ``capacity``: each stored token carries ``max_ngram - min_ngram + 1``
index entries, an evicted sequence's entries are removed with it, and each n-gram keeps only
its ``4 * max_matches`` to ``8 * max_matches`` most recent occurrences.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree, TokenTreeBuilder


@dataclass(eq=False)
class _Sequence:
    """One request's tokens as the index holds them (shared with its speculator)."""

    key: int
    tokens: list[int] = field(default_factory=list)
    indexed: int = 0  # tokens [0, indexed) are in the index
    evicted: bool = False


@dataclass
class _Node:
    count: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


class SuffixIndex:
    """The shared index of recent token sequences (see the module docstring).

    ``capacity``: the most tokens kept over all sequences (the sequence being extended is never
    evicted, however long); ``min_ngram``/``max_ngram``: the suffix lengths looked up, longest
    first; ``max_matches``: the most recent occurrences whose continuations are counted.
    """

    def __init__(self, *, capacity: int = 65536, min_ngram: int = 2, max_ngram: int = 6, max_matches: int = 32) -> None:
        if capacity < 1 or max_matches < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need capacity >= 1, max_matches >= 1 and 1 <= min_ngram <= max_ngram, got "
                             f"{capacity}, {max_matches}, {min_ngram}, {max_ngram}")
        self.capacity = capacity
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_matches = max_matches
        self._sequences: OrderedDict[int, _Sequence] = OrderedDict()  # least recently extended first
        self._keys = itertools.count()
        self._num_tokens = 0
        # hash of an n-gram -> (sequence, position right after an occurrence), oldest first
        self._index: dict[int, list[tuple[_Sequence, int]]] = {}

    @property
    def num_tokens(self) -> int:
        """Tokens held now (at most ``capacity``, or the one sequence being extended)."""
        return self._num_tokens

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def open(self) -> _Sequence:
        """A new, empty sequence (one request's)."""
        sequence = _Sequence(next(self._keys))
        self._sequences[sequence.key] = sequence
        return sequence

    def extend(self, sequence: _Sequence, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to ``sequence`` and index the n-grams ending at each of them; then
        evict the least recently extended other sequences while over capacity."""
        if sequence.evicted:  # evicted while its request ran: held and indexed again
            sequence.evicted = False
            sequence.indexed = 0
            self._sequences[sequence.key] = sequence
            self._num_tokens += len(sequence.tokens)
        sequence.tokens.extend(int(t) for t in tokens)
        self._num_tokens += len(tokens)
        self._sequences.move_to_end(sequence.key)
        history = sequence.tokens
        for end in range(sequence.indexed + 1, len(history) + 1):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                entries = self._index.setdefault(hash(tuple(history[end - n:end])), [])
                entries.append((sequence, end))
                if len(entries) > 8 * self.max_matches:
                    del entries[: len(entries) - 4 * self.max_matches]
        sequence.indexed = len(history)
        while self._num_tokens > self.capacity:
            oldest = next(iter(self._sequences.values()))
            if oldest is sequence:  # only the one being extended is left
                break
            self._evict(oldest)

    def _evict(self, sequence: _Sequence) -> None:
        """Forget ``sequence``: its index entries go too, so the index stays bounded by the
        tokens held (an n-gram no held sequence has is dropped)."""
        del self._sequences[sequence.key]
        sequence.evicted = True
        self._num_tokens -= len(sequence.tokens)
        history = sequence.tokens
        for end in range(1, sequence.indexed + 1):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                key = hash(tuple(history[end - n:end]))
                entries = self._index.get(key)
                if entries is None:
                    continue
                kept = [entry for entry in entries if entry[0] is not sequence]
                if kept:
                    entries[:] = kept
                else:
                    del self._index[key]

    @property
    def num_index_keys(self) -> int:
        """Distinct n-grams indexed now (bounded by the tokens held times the n-gram lengths)."""
        return len(self._index)

    def continuations(self, sequence: _Sequence, max_depth: int) -> _Node:
        """The trie of what followed the longest suffix of ``sequence`` found (up to
        ``max_depth`` tokens each, counts per node; an empty root when none was found)."""
        history = sequence.tokens
        root = _Node()
        if max_depth < 1:
            return root
        for n in range(min(self.max_ngram, len(history)), self.min_ngram - 1, -1):
            suffix = history[len(history) - n:]
            entries = self._index.get(hash(tuple(suffix)))
            if not entries:
                continue
            for other, start in reversed(entries):  # most recent first
                if root.count >= self.max_matches:
                    break
                tokens = other.tokens
                if start >= len(tokens) or tokens[start - n:start] != suffix:  # its end, or a hash collision
                    continue
                node = root
                node.count += 1
                for token in tokens[start:start + max_depth]:
                    node = node.children.setdefault(token, _Node())
                    node.count += 1
            if root.count:
                return root
        return root


class SuffixSpeculator:
    """One request's view of a shared :class:`SuffixIndex` (the
    :class:`~treeserve.ops.drafting.Speculator` protocol): its tokens go into the index as they
    arrive, and each step proposes the most frequent continuations of its longest suffix seen.

    ``num_draft_tokens`` bounds the depth and ``max_nodes`` the tree (the actor's share of the
    budget overrides it); nodes whose path probability falls below ``min_probability`` are left
    out (a rarely seen continuation costs the verifier more than it wins).

    ``indexes_traffic``: what it accepts outlives the request (the index is shared), so a
    server feeds it the tokens a request emitted after its last proposal when it ends."""

    indexes_traffic = True

    def __init__(self, index: SuffixIndex, vocab_size: int, *, num_draft_tokens: int = 16, max_nodes: int = 24,
                 min_probability: float = 0.1) -> None:
        if vocab_size < 1 or num_draft_tokens < 1 or max_nodes < 1 or not 0.0 <= min_probability <= 1.0:
            raise ValueError(f"need vocab_size, num_draft_tokens and max_nodes >= 1 and 0 <= min_probability <= 1, got "
                             f"{vocab_size}, {num_draft_tokens}, {max_nodes}, {min_probability}")
        self.index = index
        self.vocab_size = vocab_size
        self.num_draft_tokens = num_draft_tokens
        self.max_nodes = max_nodes
        self.min_probability = min_probability
        self._sequence: _Sequence | None = None

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Start a request with ``prompt_ids`` (non-empty): a new sequence in the index."""
        if not prompt_ids:
            raise ValueError("a speculator needs a non-empty prompt")
        self._sequence = self.index.open()
        self.index.extend(self._sequence, prompt_ids)

    def accept(self, new_tokens: Sequence[int]) -> None:
        """Append the tokens the verifier emitted."""
        if self._sequence is None:
            raise RuntimeError("SuffixSpeculator.prefill must be called before accept")
        self.index.extend(self._sequence, new_tokens)

    def propose(self, params: SamplingParams, generator: torch.Generator | None, max_depth: int | None = None,
                max_nodes: int | None = None) -> TokenTree:
        """The most frequent continuations as a trie rooted at the last token (root only if none).

        Which nodes are kept is a deterministic function of the tokens seen, never of random
        draws, so cutting the trie to ``max_nodes`` is lossless."""
        if self._sequence is None:
            raise RuntimeError("SuffixSpeculator.prefill must be called before propose")
        depth = self.num_draft_tokens if max_depth is None else min(max_depth, self.num_draft_tokens)
        budget = self.max_nodes if max_nodes is None else max_nodes
        builder = TokenTreeBuilder(self._sequence.tokens[-1], with_probs=not params.is_greedy)
        trie = self.index.continuations(self._sequence, depth)
        order = itertools.count()
        frontier: list[tuple[float, int, int, _Node, int]] = []  # (-probability, order, parent slot, node, token)
        for token, child in trie.children.items():
            heapq.heappush(frontier, (-child.count / trie.count, next(order), 0, child, token))
        while frontier and builder.num_nodes < budget:
            negative, _, parent, node, token = heapq.heappop(frontier)
            if -negative < self.min_probability:
                break
            q_row = None
            if not params.is_greedy:
                q_row = builder.add_probs(torch.nn.functional.one_hot(torch.tensor(token), self.vocab_size).float())
            slot = builder.add_proposal(parent, token, q_row=q_row)
            for next_token, child in node.children.items():
                heapq.heappush(frontier, (negative * child.count / node.count, next(order), slot, child, next_token))
        return builder.build()


__all__ = ["SuffixIndex", "SuffixSpeculator"]
