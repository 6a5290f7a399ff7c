"""Batched verification steps over a multi-row KV cache: row prefill and one-forward tree verify.

A verifier serving many requests keeps one KV cache with a row per request. Two ops live here:

* :func:`prefill_row` fills ONE row with a prompt without touching the others: the prompt runs
  on a temporary 1-row cache (exactly the single-request prefill of
  :func:`~treeserve.ops.speculative.generate_speculative`) and its slots are copied into the row.
* :func:`verify_rows` scores the token trees of several rows in one batched forward (trees
  padded with :func:`~treeserve.ops.token_tree.pack_trees`: pad nodes see only themselves and
  the committed prefix, no real node sees a pad), verifies each row with its own sampling
  params and generator, and commits each row's accepted path.

Only the participating rows run: the forward uses a zero-copy *row-block view* of the cache
(rows ``[start, stop)`` as one smaller cache sharing the storage). Rows inside a block that do
not participate (gaps) are padded with a one-node pad tree and committed with ``keep=[]``; a
gap is bridged only when that costs no more padded rows than the block has real ones and
every gap row has room, otherwise the rows are split into several blocks (one forward each).
Measured on CPU (4-layer dim-256 model, 8 rows of 199 committed tokens, 2 active rows with
8-node trees): running the 2-row view took 0.12-0.14 s per step against 0.22-0.31 s for
padding all 8 rows (a busy shared machine, so rough), so callers should keep active rows
compact (lowest free row first).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from treeserve.ops.kv_cache import CacheCapacityError, KVCache
from treeserve.ops.model import Transformer
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import PackedTrees, TokenTree, pack_trees
from treeserve.ops.verify import VerifyFn, VerifyResult, verify

Packer = Callable[[Sequence[TokenTree], Sequence[int], int], PackedTrees]
"""``(trees, committed lengths, pad_token_id) -> PackedTrees``; :func:`pack_trees` by default
(injectable so a test can prove that broken padding is caught)."""


@dataclass(frozen=True, eq=False)
class RowStep:
    """One request's part of a batched verify step: its cache ``row``, its token ``tree``
    (node 0 = the request's last emitted token, not yet cached), its sampling ``params`` and
    the CPU ``generator`` stochastic verification draws from (None for greedy)."""

    row: int
    tree: TokenTree
    params: SamplingParams
    generator: torch.Generator | None = None


def prefill_row(model: Transformer, cache: KVCache, row: int, token_ids: Sequence[int]) -> int:
    """Reset ``row`` of ``cache`` and commit ``token_ids`` into it; return the row's new length.

    The tokens run through ``model`` on a temporary 1-row cache sized to them (so the other
    rows are neither computed nor touched) and the resulting K/V slots are copied into
    ``[0, len(token_ids))`` of ``row``. Numerically this is the batch-1 causal prefill of the
    single-request loop. An empty ``token_ids`` just resets the row. Raises ``IndexError`` for
    a bad row and :class:`CacheCapacityError` (a ``ValueError``) when the row is too small.
    :func:`prefill_row_with_states` also returns the model's final hidden states.
    """
    return _prefill(model, cache, row, [int(t) for t in token_ids])[0]


def prefill_row_with_states(
    model: Transformer, cache: KVCache, row: int, token_ids: Sequence[int]
) -> tuple[int, Tensor]:
    """:func:`prefill_row`, also returning the final hidden states ``(n, D)`` of ``token_ids``
    (what a feature-level drafter reads; ``(0, D)`` for no tokens)."""
    return _prefill(model, cache, row, [int(t) for t in token_ids], want_states=True)


def _prefill(model: Transformer, cache: KVCache, row: int, tokens: list[int], *,
             want_states: bool = False) -> tuple[int, Tensor]:
    if not 0 <= row < cache.batch_size:
        raise IndexError(f"row {row} out of range for a KV cache of {cache.batch_size} rows")
    if len(tokens) > cache.capacity:
        raise CacheCapacityError(f"a prompt of {len(tokens)} tokens does not fit a row of {cache.capacity} slots")
    _check_token_ids(tokens, model.config.vocab_size)
    cache.reset_row(row)
    states = torch.zeros(0, model.config.dim, dtype=model.dtype, device=cache.device)
    if not tokens:
        return 0, states
    scratch = model.new_cache(1, len(tokens))
    with torch.no_grad():
        feed = torch.tensor([tokens], dtype=torch.long, device=cache.device)
        if want_states:
            _, hidden = model(feed, scratch, return_hidden=True)
            states = hidden[0]
        else:
            model(feed, scratch)
    num = len(tokens)
    for layer in range(cache.num_layers):
        cache.keys[layer][row, :, :num] = scratch.keys[layer][0]  # (n_kv, n, hd)
        cache.values[layer][row, :, :num] = scratch.values[layer][0]
    cache.lengths[row] = num
    cache.num_pending[row] = 0
    return num, states


def verify_rows(
    model: Transformer,
    cache: KVCache,
    steps: Sequence[RowStep],
    *,
    verifier: VerifyFn = verify,
    packer: Packer = pack_trees,
    pad_token_id: int = 0,
) -> list[VerifyResult]:
    """Verify every step's token tree with batched forwards and commit the accepted paths.

    Returns one :class:`VerifyResult` per step, in ``steps`` order. Each row's tree is scored
    against that row's committed prefix (positions = length + depth), verified by ``verifier``
    with the step's params and generator, and ``cache.commit(row, accepted)`` keeps exactly the
    accepted path. The step is atomic for the cache: inputs are validated before any forward
    (``ValueError``/``IndexError``: duplicate or bad rows, token ids outside the vocabulary, a
    tree that does not fit its row), and if a verifier raises, no row advances.
    (:func:`verify_rows_with_states` also returns the accepted nodes' hidden states.)
    """
    return _verify_rows(model, cache, steps, verifier, packer, pad_token_id, want_states=False)[0]


def verify_rows_with_states(
    model: Transformer,
    cache: KVCache,
    steps: Sequence[RowStep],
    *,
    verifier: VerifyFn = verify,
    packer: Packer = pack_trees,
    pad_token_id: int = 0,
) -> tuple[list[VerifyResult], list[Tensor]]:
    """:func:`verify_rows`, also returning per step the model's final hidden states
    ``(len(accepted), D)`` of its accepted nodes (root first), for feature-level drafters."""
    return _verify_rows(model, cache, steps, verifier, packer, pad_token_id, want_states=True)


def _verify_rows(
    model: Transformer, cache: KVCache, steps: Sequence[RowStep], verifier: VerifyFn, packer: Packer,
    pad_token_id: int, *, want_states: bool,
) -> tuple[list[VerifyResult], list[Tensor]]:
    if not steps:
        return [], []
    rows = [step.row for step in steps]
    if len(set(rows)) != len(rows):
        raise ValueError(f"each cache row may appear once per step, got rows {rows}")
    lengths = [int(x) for x in cache.lengths.tolist()]
    vocab = model.config.vocab_size
    for step in steps:
        if not 0 <= step.row < cache.batch_size:
            raise IndexError(f"row {step.row} out of range for a KV cache of {cache.batch_size} rows")
        room = cache.capacity - lengths[step.row]
        if step.tree.num_nodes > room:
            raise CacheCapacityError(
                f"row {step.row} has room for {room} more tokens but its token tree has {step.tree.num_nodes} nodes"
            )
        _check_token_ids(step.tree.tokens.tolist(), vocab)
    by_row = {step.row: step for step in steps}
    results: dict[int, VerifyResult] = {}
    states: dict[int, Tensor] = {}
    blocks = _plan_blocks(sorted(by_row), {r: s.tree.num_nodes for r, s in by_row.items()}, lengths, cache.capacity)
    views: list[tuple[int, KVCache]] = []
    try:
        for start, stop in blocks:
            view = _row_block(cache, start, stop)
            views.append((start, view))
            pad = TokenTree.from_parents([-1], [pad_token_id])
            trees = [by_row[r].tree if r in by_row else pad for r in range(start, stop)]
            packed = packer(trees, lengths[start:stop], pad_token_id)
            device = cache.device
            kwargs = {"tree_mask": packed.tree_mask.to(device), "positions": packed.positions.to(device)}
            if want_states:
                logits, hidden = model(packed.tokens.to(device), view, return_hidden=True, **kwargs)  # (B_block, T, V)
            else:
                logits = model(packed.tokens.to(device), view, **kwargs)
            assert isinstance(logits, Tensor)
            for offset, row in enumerate(range(start, stop)):
                real = by_row.get(row)
                if real is not None:
                    n = real.tree.num_nodes
                    results[row] = verifier(real.tree, logits[offset, :n], real.params, real.generator)
                    if want_states:
                        states[row] = hidden[offset, torch.tensor(results[row].accepted, device=device)]
    except BaseException:
        for start, view in views:
            for offset in range(view.batch_size):
                view.truncate(offset, lengths[start + offset])  # drop pending slots, advance nothing
        raise
    for start, view in views:
        for offset in range(view.batch_size):
            result = results.get(start + offset)
            view.commit(offset, result.accepted if result is not None else [])
    return [results[row] for row in rows], [states[row] for row in rows] if want_states else []


def _check_token_ids(tokens: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {bad[:8]}")


def _plan_blocks(rows: list[int], num_nodes: dict[int, int], lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """Split the sorted participating ``rows`` into row ranges ``[start, stop)``, one forward each.

    A range may bridge gaps of idle rows (padded, never committed) when every row in it has
    room for the range's widest tree and there are no more idle rows than participating ones.
    """
    blocks: list[tuple[int, int]] = []
    start, stop, width, num_real = rows[0], rows[0] + 1, num_nodes[rows[0]], 1
    for row in rows[1:]:
        new_width = max(width, num_nodes[row])
        num_idle = (row + 1 - start) - (num_real + 1)
        fits = all(lengths[r] + new_width <= capacity for r in range(start, row + 1))
        if fits and num_idle <= num_real + 1:
            stop, width, num_real = row + 1, new_width, num_real + 1
        else:
            blocks.append((start, stop))
            start, stop, width, num_real = row, row + 1, num_nodes[row], 1
    blocks.append((start, stop))
    return blocks


def _row_block(cache: KVCache, start: int, stop: int) -> KVCache:
    """A KVCache over rows ``[start, stop)`` sharing ``cache``'s storage (no copy).

    Writes, commits and length updates through the view land in ``cache``. The view has its
    own pending-slot bookkeeping; the rows' pending counts in ``cache`` are cleared because
    every caller commits or truncates all of the view's rows before ``cache`` is used again.
    """
    view = copy.copy(cache)
    view.keys = [k[start:stop] for k in cache.keys]  # (b, n_kv, capacity, hd) views
    view.values = [v[start:stop] for v in cache.values]
    view.lengths = cache.lengths[start:stop]  # a view: commit() updates cache.lengths
    view.batch_size = stop - start
    view.num_pending = [0] * (stop - start)
    cache.num_pending[start:stop] = [0] * (stop - start)
    return view


__all__ = ["Packer", "RowStep", "prefill_row", "verify_rows"]
