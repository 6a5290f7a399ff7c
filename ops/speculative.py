"""In-process generation loops for one request: plain incremental decoding and tree speculation.

Both loops obey the same stopping rule, so in greedy float32 they return the same tokens (and
for a seeded request, whose tokens are keyed by position, the same tokens whenever the LLM's
logits agree; see :class:`~treeserve.ops.sampling.SampleKey`):
generation ends right after a token in ``params.stop_token_ids`` (kept in the output) or when
``params.max_new_tokens`` tokens exist. The speculative loop verifies one token tree per step
with one LLM forward (tree mask + depth positions), commits the accepted path in the LLM's
KV cache and feeds the emitted tokens back to the speculators. Functions are per request
(batch 1); a batched verifier packs its rows' trees with
:func:`~treeserve.ops.token_tree.pack_trees`, runs one forward, then calls the verifier and
``cache.commit`` per row exactly as here.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from treeserve.ops.drafting import Speculator, split_node_budget
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.model import Transformer
from treeserve.ops.speculation_modes import SpeculationMode
from treeserve.ops.sampling import SamplingParams, make_generator, randomness_for, sample_token
from treeserve.ops.token_tree import TokenTree, merge_trees, pack_trees
from treeserve.ops.verify import VerifyFn, verify


class FinishReason(enum.Enum):
    """Why generation ended: a stop token was emitted, or ``max_new_tokens`` was reached."""

    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True)
class GenerationResult:
    """Generated tokens and step statistics of one request.

    ``num_steps``: LLM forward passes that emitted tokens (incremental: one per token, the
    prefill included; speculative: one verify pass per step). ``accepted_per_step``: draft
    tokens the verifier accepted at each speculative step (empty for incremental decoding),
    counted before truncation at a stop token or ``max_new_tokens``.
    """

    token_ids: list[int]
    num_steps: int
    finish_reason: FinishReason
    accepted_per_step: tuple[int, ...] = ()

    @property
    def mean_accepted_per_step(self) -> float:
        """Mean accepted draft tokens per verify step (0.0 for incremental decoding)."""
        return sum(self.accepted_per_step) / len(self.accepted_per_step) if self.accepted_per_step else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Mean emitted tokens per LLM step (1.0 for incremental decoding)."""
        return len(self.token_ids) / self.num_steps if self.num_steps else 0.0


def _check_prompt(model: Transformer, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    vocab = model.config.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if len(prompt) + params.max_new_tokens > model.config.max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the model's "
            f"max_seq_len {model.config.max_seq_len}"
        )
    return prompt


def _logits(model: Transformer, tokens: Tensor, cache: KVCache, *, logits_to_keep: int | None = None,
            **kwargs: Tensor) -> Tensor:
    out = model(tokens, cache, logits_to_keep=logits_to_keep, **kwargs)
    assert isinstance(out, Tensor)
    return out


def _logits_and_hidden(
    model: Transformer, tokens: Tensor, cache: KVCache, **kwargs: Tensor
) -> tuple[Tensor, Tensor]:
    logits, hidden = model(tokens, cache, return_hidden=True, **kwargs)
    return logits, hidden


def emit_until_done(
    emitted: list[int], new_tokens: Sequence[int], params: SamplingParams
) -> tuple[list[int], FinishReason | None]:
    """Append ``new_tokens`` to ``emitted`` under the stopping rule.

    Returns the tokens actually taken (a prefix of ``new_tokens``) and the finish reason if
    generation ended on one of them.
    """
    taken: list[int] = []
    for token in new_tokens:
        taken.append(token)
        if params.is_stop(token):
            emitted.extend(taken)
            return taken, FinishReason.STOP
        if len(emitted) + len(taken) >= params.max_new_tokens:
            emitted.extend(taken)
            return taken, FinishReason.LENGTH
    emitted.extend(taken)
    return taken, None


def _request_cache(model: Transformer, cache: KVCache | None, needed: int) -> KVCache:
    """A one-row cache of at least ``needed`` slots: ``cache`` emptied (one a captured step was
    captured over, say: :mod:`~treeserve.ops.graph_step`), or a new one of exactly that size."""
    if cache is None:
        return model.new_cache(1, needed)
    if cache.batch_size != 1 or cache.capacity < needed:
        raise ValueError(f"the request needs a 1-row cache of {needed} slots, got {cache.batch_size} rows of {cache.capacity}")
    cache.reset_row(0)
    return cache


def generate_incremental(
    model: Transformer, prompt_ids: Sequence[int], params: SamplingParams, *, generator: torch.Generator | None = None,
    cache: KVCache | None = None,
) -> GenerationResult:
    """Plain autoregressive decoding, one LLM forward per token (the losslessness reference).

    A seeded request samples the token of sequence position ``n`` with the key
    ``(params.seed, n)`` (``generator`` is then unused); an unseeded one draws from
    ``generator`` (CPU; default: a fresh random one). ``cache``: a one-row cache to run in
    (emptied first; default: a new one sized to the request).
    """
    prompt = _check_prompt(model, prompt_ids, params)
    if generator is None and not params.is_greedy:
        generator = make_generator(params)
    cache = _request_cache(model, cache, len(prompt) + params.max_new_tokens)
    emitted: list[int] = []
    num_steps = 0
    with torch.no_grad():
        feed = prompt
        while True:
            logits = _logits(model, torch.tensor([feed], device=model.device), cache, logits_to_keep=1)  # (1, 1, V)
            cache.commit(0, range(len(feed)))
            num_steps += 1
            position = len(prompt) + len(emitted)  # the sequence position this token takes
            token = sample_token(logits[0, -1].cpu(), params, randomness_for(params, position, generator))
            _, finish = emit_until_done(emitted, [token], params)
            if finish is not None:
                return GenerationResult(emitted, num_steps, finish)
            feed = [token]


def _check_tree(tree: TokenTree, root: int, max_depth: int, max_nodes: int) -> None:
    # Speculators must respect the limits themselves: cutting a drawn tree here would depend on
    # the draws and bias stochastic verification.
    if tree.root_token != root:
        raise RuntimeError(f"a speculator proposed a tree rooted at {tree.root_token}, expected {root}")
    if tree.num_nodes > max_nodes or int(tree.depths().max()) > max_depth:
        raise RuntimeError(
            f"speculators proposed {tree.num_nodes} nodes / depth {int(tree.depths().max())}, "
            f"above the limits {max_nodes} / {max_depth} they were given"
        )


def generate_speculative(
    model: Transformer,
    speculators: Sequence[Speculator],
    prompt_ids: Sequence[int],
    params: SamplingParams,
    mode: SpeculationMode = SpeculationMode.TREE,
    *,
    generator: torch.Generator | None = None,
    verifier: VerifyFn = verify,
    max_tree_nodes: int = 64,
    cache: KVCache | None = None,
) -> GenerationResult:
    """Tree-based speculative generation of one request; lossless w.r.t. incremental decoding.

    The LLM prefills ``prompt[:-1]``; each step the speculators draft trees rooted at the last
    token within the depth still useful and a share of ``max_tree_nodes`` (and of the cache
    room), the trees are merged (``mode``) and, after one LLM forward, verified by ``verifier``
    (default: greedy, keyed for a seeded request, else multi-step speculative sampling from
    ``generator``; tests inject wrong ones); the accepted path is committed and the emitted
    tokens (accepted drafts + bonus) go to the speculators. The speculators draft from
    ``generator`` (default: one seeded from ``params.seed``); a seeded request's output does not
    depend on it, and equals :func:`generate_incremental`'s whenever the logits agree.
    With no speculators every step verifies a root-only tree (incremental decoding).
    Speculators with ``uses_features = True`` (e.g. :class:`~treeserve.ops.feature_speculator.FeatureSpeculator`)
    also get the LLM's final hidden states of every token it has processed, in order: the
    prompt's (but its last token) after the prefill, then each step's root and accepted drafts
    (``cache``: a one-row cache to run in, as :func:`generate_incremental` takes).
    """
    prompt = _check_prompt(model, prompt_ids, params)
    if max_tree_nodes < 1 or mode is SpeculationMode.NONE:  # none drafts nothing: generate_incremental
        raise ValueError(f"max_tree_nodes must be >= 1 and mode tree or chain, got {max_tree_nodes} and {mode.value}")
    if generator is None and not params.is_greedy:
        generator = make_generator(params)
    cache = _request_cache(model, cache, min(model.config.max_seq_len, len(prompt) + params.max_new_tokens + max_tree_nodes))
    device = model.device
    emitted: list[int] = []
    accepted_per_step: list[int] = []
    feature_users = [s for s in speculators if getattr(s, "uses_features", False)]
    with torch.no_grad():
        for speculator in speculators:
            speculator.prefill(prompt)
        if len(prompt) > 1:
            # Only the cache is kept (the first step's tree scores the root): no LM head.
            hidden = model.hidden_states(torch.tensor([prompt[:-1]], device=device), cache)
            for user in feature_users:
                user.add_features(hidden[0])  # type: ignore[attr-defined]
            cache.commit(0, range(len(prompt) - 1))
        root = prompt[-1]
        while True:
            remaining = params.max_new_tokens - len(emitted)
            length = int(cache.lengths[0])
            room = min(cache.capacity - length, max_tree_nodes)
            # The merged tree has at most 1 + sum(nodes_k - 1) nodes, so split the room.
            shares = split_node_budget(room, len(speculators))
            trees = [s.propose(params, generator, remaining - 1, share) for s, share in zip(speculators, shares)]
            tree = merge_trees(trees) if trees else TokenTree.from_parents([-1], [root])
            if mode is SpeculationMode.CHAIN:
                tree = tree.first_chain()
            _check_tree(tree, root, remaining - 1, room)
            packed = pack_trees([tree], [length])
            kwargs = {"tree_mask": packed.tree_mask.to(device), "positions": packed.positions.to(device)}
            if feature_users:
                logits, hidden = _logits_and_hidden(model, packed.tokens.to(device), cache, **kwargs)  # (1, T, V)
            else:
                logits = _logits(model, packed.tokens.to(device), cache, **kwargs)  # (1, T, V)
            result = verifier(tree, logits[0], params, randomness_for(params, length + 1, generator))
            accepted_per_step.append(result.num_accepted_drafts)
            new_tokens = result.new_tokens(tree)
            _, finish = emit_until_done(emitted, new_tokens, params)
            if finish is not None:
                return GenerationResult(emitted, len(accepted_per_step), finish, tuple(accepted_per_step))
            cache.commit(0, result.accepted)
            for speculator in speculators:
                speculator.accept(new_tokens)
            if feature_users:
                # Node i of the tree is packed at column i: the root and accepted drafts' states.
                accepted_hidden = hidden[0, torch.tensor(result.accepted, device=device)]
                for user in feature_users:
                    user.add_features(accepted_hidden)  # type: ignore[attr-defined]
            root = result.bonus_token
