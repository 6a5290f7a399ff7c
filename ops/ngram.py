"""A model-free n-gram (suffix-match) speculator over the prompt and the generated text.

It finds the longest recent suffix of the token sequence (up to ``max_ngram`` tokens) that
occurred earlier, and proposes what followed the most recent ``num_branches`` earlier
occurrences with distinct continuations, each up to ``num_draft_tokens`` long, as a small
trie (a chain when ``num_branches == 1``). Proposals are deterministic given the sequence: for
stochastic verification each proposal carries a point-mass ``q`` on its token. A point mass
is a valid drafting distribution for multi-step speculative sampling (accept with probability
``p(x)``, then the residual is ``p`` with ``x`` removed), so verification stays lossless.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree, TokenTreeBuilder


class NGramSpeculator:
    """Suffix-match speculator implementing the :class:`~treeserve.ops.drafting.Speculator` protocol.

    ``vocab_size`` sizes the point-mass drafting distributions. Lookups use an index from each
    n-gram (``min_ngram <= n <= max_ngram``) to the positions that followed it, updated as
    tokens arrive, so a step costs ``O(max_ngram + num_branches * num_draft_tokens)`` lookups.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        max_ngram: int = 3,
        min_ngram: int = 1,
        num_draft_tokens: int = 4,
        num_branches: int = 1,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if num_draft_tokens < 1 or num_branches < 1:
            raise ValueError(
                f"num_draft_tokens and num_branches must be >= 1, got {num_draft_tokens} and {num_branches}"
            )
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.num_draft_tokens = num_draft_tokens
        self.num_branches = num_branches
        self._history: list[int] = []
        # n-gram -> positions right after its occurrences, ascending.
        self._index: dict[tuple[int, ...], list[int]] = {}

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Start a request with ``prompt_ids`` (non-empty)."""
        if not prompt_ids:
            raise ValueError("a speculator needs a non-empty prompt")
        self._history = []
        self._index = {}
        self.accept(prompt_ids)

    def accept(self, new_tokens: Sequence[int]) -> None:
        """Append emitted tokens and index the n-grams that end at each of them."""
        for token in new_tokens:
            self._history.append(int(token))
            end = len(self._history)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._index.setdefault(tuple(self._history[end - n : end]), []).append(end)

    def continuations(self, max_depth: int) -> list[list[int]]:
        """Up to ``num_branches`` continuations (most recent match first) of the longest matched suffix."""
        history = self._history
        end = len(history)
        length = min(self.num_draft_tokens, max_depth)
        if length < 1:
            return []
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            positions = self._index.get(tuple(history[end - n :]), [])
            found: list[list[int]] = []
            for start in reversed(positions):
                if start >= end:  # the suffix itself: nothing follows it yet
                    continue
                continuation = history[start : start + length]
                if continuation not in found:
                    found.append(continuation)
                if len(found) == self.num_branches:
                    break
            if found:
                return found
        return []

    def propose(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        max_depth: int | None = None,
        max_nodes: int | None = None,
    ) -> TokenTree:
        """A trie of the matched continuations rooted at the last token (root only if no match).

        ``max_nodes`` cuts the trie (branches in match order); that is lossless here because
        the proposals are a deterministic function of the tokens so far, not random draws.
        """
        if not self._history:
            raise RuntimeError("NGramSpeculator.prefill must be called before propose")
        depth = self.num_draft_tokens if max_depth is None else max_depth
        builder = TokenTreeBuilder(self._history[-1], with_probs=not params.is_greedy)
        for continuation in self.continuations(depth):
            node = 0
            for token in continuation:
                child = builder.find_child(node, token)
                if child is None:
                    if max_nodes is not None and builder.num_nodes >= max_nodes:
                        break
                    q_row = None
                    if not params.is_greedy:
                        q_row = builder.add_probs(torch.nn.functional.one_hot(torch.tensor(token), self.vocab_size).float())
                    child = builder.add_proposal(node, token, q_row=q_row)
                node = child
        return builder.build()
