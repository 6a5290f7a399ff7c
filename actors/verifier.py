"""``VerifierShard``: one tensor-parallel rank of the LLM verifier, with a multi-row KV cache.

Every rank receives the same calls in the same order (the scheduler fans each call out to all
shards and awaits all replies before the next call); rank 0's reply is the one used. Handlers:

* ``info`` -> ``{"vocab_size", "max_seq_len", "num_rows", "row_capacity", "eos_ids", "tp_rank", "tp_size",
  "weight_format", "prefix_reuse"}``
* ``prefill {"rows": [{"row", "prompt_ids"}]}`` -> ``{"rows": [{"row", "length", "reused"?}]}``: reset each
  row and commit its prompt except the last token (the root of the row's first token tree);
  a burst of admissions shares batched forwards (:func:`~treeserve.ops.batch_step.prefill_rows`).
* ``step {"rows": [{"row", "tree", "params", "request_id"}], "draft_probs"?}`` -> ``{"rows": [{"row",
  "accepted", "bonus_token", "new_tokens"}]}`` (the trees' dense draft probabilities stacked in
  ``draft_probs``, see :mod:`treeserve.actors.messages.checks`): one batched forward per compact block of rows
  (:func:`~treeserve.ops.batch_step.verify_rows`), verification, commit of the accepted paths.
  A row that fails numerically (non-finite logits or probabilities) answers
  ``{"row", "error": str}`` instead and commits only its root; the other rows of the step are
  unaffected. The caller should end that request and ``release`` its row; the row's
  cache is then zeroed (attention reads masked slots too, and ``0 * NaN`` would carry a stale
  NaN into the row's next request).
  With ``"decode_steps": k > 1`` (one-node trees only) the call runs up to k plain decode
  steps, each rooted at the token the last one emitted, and each row's verdict carries the up
  to k tokens (a row stops after a stop token), and with ``"return_states"`` the states of the
  k roots: one call, and one hop to the compute thread, for k tokens
  (:class:`~treeserve.actors.messages.verifier.StepBody`).
* ``release {"row", "request_id"}`` -> None: forget the request's generator; the row's cache is
  forgotten too, or, where prefixes are reused (``info``'s ``"prefix_reuse"``: the fused,
  row-invariant forward, unless ``reuse_prefixes`` is off), kept: the row's next ``prefill``
  computes only what its prompt does not share with the row's tokens
  (:mod:`~treeserve.actors.verifier_rows`), with K/V equal to a whole prefill's bit for bit.
* ``move {"src", "dst"}`` -> None: move row ``src``'s committed cache to the empty row ``dst``
  (:meth:`~treeserve.ops.kv_cache.KVCache.move_row`): the scheduler parks a preempted request
  in a row its steps do not run, and moves it back when it resumes. The request's generator and
  params stay (they are keyed by request, not row).

Randomness: a seeded request's tokens are keyed by ``(seed, sequence position)``
(:class:`~treeserve.ops.sampling.SampleKey`, placed by ``verify_rows`` at the row's committed
length + 1) and verified by :func:`~treeserve.ops.verify.verify_keyed`, so its text depends on
the seed and the LLM's logits only, never on the trees, the other rows or earlier requests; no
generator is kept for it. An unseeded request draws from a ``torch.Generator`` stream of its
own (multi-step speculative sampling, which accepts more drafts).

Group calls: a ``prefill`` or ``step`` body with ``"rank0_answers": true`` (sent by
:class:`~treeserve.actors.verifier_group.VerifierGroup` to more than one shard) is answered in
full by rank 0 alone; ranks >= 1 run the same forwards and commits, skip collecting hidden
states and answer ``None``, since their rows would be thrown away. Without it every rank answers.

Rank agreement: only rank 0 verifies (it holds the unseeded requests' ``torch.Generator``s,
created on first use); it broadcasts each row's decision (accepted path and bonus token)
over the process group before any rank commits, so every rank commits identical paths even if
float summation differed between ranks. A verification failure is broadcast too, so all ranks
raise and roll back together. Bad input raises ``ValueError`` before any collective runs.

The forward runs in a worker thread (the event loop keeps answering heartbeats); calls are
serialized and a cancelled call still finishes its compute before the next one starts, so the
cache never sees two steps at once. A caller whose ``step`` failed or timed out cannot know
whether it committed and should ``release`` and re-``prefill`` that request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from treeserve.actors.messages.verifier import (
    PrefillBody,
    PrefilledRow,
    PrefillReply,
    RowMove,
    RowRelease,
    RowVerdict,
    StepBody,
    StepReply,
)
from treeserve.actors.model_host import SerialOffload, check_int, consume_exception
from treeserve.actors.messages.tree_wire import ParamsCache
from treeserve.actors.verifier_rows import RowTokens, warm_up, zero_row
from treeserve.actors.verifier_config import VerifierConfig
from treeserve.actors.verify_fns import RowGuard, process_group_backend, rank0_broadcast_verifier, row_checked_verifier
from treeserve.ops.batch_step import (
    RowStep,
    prefill_rows,
    verify_rows,
    verify_rows_with_states,
)
from treeserve.ops.formats import AUTO_FORMAT, resolve_format
from treeserve.ops.graph_step import HEADROOM, GraphStep, attach_graphs, kernel_fits
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.loaders.load import load_model, prepare_for_serving, stored_types_of
from treeserve.ops.loaders.prepare import import_compiler, loads_a_compiled_step
from treeserve.ops.model import Transformer
from treeserve.ops.sampling import SamplingParams, make_generator
from treeserve.ops.token_tree import TokenTree
from treeserve.ops.verify import VerifyFn, VerifyResult, verify
from treeserve.runtime import Actor, handler

_log = logging.getLogger(__name__)


def _float32(states: Tensor) -> np.ndarray:
    """Hidden states as the float32 array that travels."""
    return np.asarray(states.float().cpu(), dtype=np.float32)


class VerifierShard(Actor):
    """One verifier rank (see the module docstring for the handlers and the TP contract)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = VerifierConfig.from_wire(config)
        self._offload = SerialOffload()
        self._model: Transformer | None = None
        self._cache: KVCache | None = None
        self._info: dict[str, Any] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._params = ParamsCache()  # each request's params, parsed at its first step
        self._setup: asyncio.Future[None] | None = None
        self._has_group = False
        self._rows_to_scrub: set[int] = set()  # rows whose cache may hold non-finite values
        self._row_tokens = RowTokens()  # what each row's committed slots hold, for prefix reuse
        self._reuse = False  # set with the model: prefixes are reused where the forward is row-invariant

    # ------------------------------------------------------------------ lifecycle
    async def on_start(self) -> None:
        """Load the model (fails the spawn on a bad path); start the TP rendezvous + sharding.

        The rendezvous waits for every rank, so it runs in the background: ranks may be
        spawned one after the other. Handlers wait for it to finish.
        """
        cfg = self.config
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        loaded = await asyncio.to_thread(load_model, cfg.model, cache_dir=cfg.cache_dir)  # float32: sharded, then formatted
        capacity = cfg.row_capacity if cfg.row_capacity is not None else loaded.config.max_seq_len
        if capacity > loaded.config.max_seq_len:
            raise ValueError(f"row_capacity {capacity} exceeds the model's max_seq_len {loaded.config.max_seq_len}")
        self._info = {
            "vocab_size": loaded.config.vocab_size,
            "dim": loaded.config.dim,
            "num_layers": loaded.config.num_layers,
            "max_seq_len": loaded.config.max_seq_len,
            "num_rows": cfg.num_rows,
            "row_capacity": capacity,
            "eos_ids": sorted(loaded.tokenizer.stop_ids),
            "tp_rank": cfg.tp_rank,
            "tp_size": cfg.tp_size,
            # What the model will be served in (auto resolved: for a GGUF, as it is stored).
            "weight_format": resolve_format(self._weight_format(), loaded.config, torch.device(cfg.device),
                                            stored_types_of(loaded.source, cfg.cache_dir)).value,
        }
        if cfg.compile_decode and loads_a_compiled_step(self._info["weight_format"], cfg.device):
            # Before this shard reports ready: in a thread beside the serving loop, these imports
            # would stop it (and its heartbeats) for most of a second (ops/loaders/prepare.py).
            await asyncio.to_thread(import_compiler)
        self._setup = asyncio.ensure_future(self._offload.run(self._shard_and_allocate, loaded.model, loaded.source, capacity))
        self._setup.add_done_callback(consume_exception)

    async def on_stop(self) -> None:
        """Let running compute finish, then leave the process group."""
        if self._setup is not None and not self._setup.done():
            self._setup.cancel()
        await self._offload.drain()
        if self._has_group:
            import torch.distributed as dist

            self._has_group = False
            try:
                dist.destroy_process_group()
            except Exception:  # the group may already be broken by a dead peer
                _log.warning("verifier rank %d: destroy_process_group failed", self.config.tp_rank, exc_info=True)

    def _shard_and_allocate(self, model: Transformer, source: Path, capacity: int) -> None:
        cfg = self.config
        if cfg.device.startswith("cuda:"):  # a bare "cuda" is the current device (NCCL binds to it)
            torch.cuda.set_device(torch.device(cfg.device))
        backend = process_group_backend(cfg.device, cfg.tp_size)
        if backend is not None:
            import torch.distributed as dist

            from treeserve.ops.tp import apply_tp, distributed_all_reduce

            # World size 1 (a lone CUDA shard) has no peers to meet: an in-process store.
            store = dist.HashStore() if cfg.dist_init is None else None  # type: ignore[attr-defined]
            dist.init_process_group(
                backend,
                init_method=cfg.dist_init,
                store=store,
                rank=cfg.tp_rank,
                world_size=cfg.tp_size,
                timeout=timedelta(seconds=cfg.dist_timeout_s),
            )
            self._has_group = True
            model = apply_tp(model, cfg.tp_rank, cfg.tp_size, distributed_all_reduce())
        model = model.to(cfg.device)
        model = prepare_for_serving(model, source, self._weight_format(), cache_dir=cfg.cache_dir,
                                    compile_decode=cfg.compile_decode, background=cfg.compile_in_background)
        # Every step replayed from CUDA graphs captured over this cache: one rank, and the tree
        # kernel (without it the captured attention would read the whole cache every step).
        graphs = cfg.compile_decode and cfg.tp_size == 1 and kernel_fits(model)
        cache = model.new_cache(cfg.num_rows, capacity, headroom=HEADROOM if graphs else 0)
        if graphs:
            try:
                self._info["graph_capture_s"] = round(attach_graphs(model, cache).capture_seconds or 0.0, 3)
            except Exception:  # a capture that fails must not stop serving: the eager forward runs
                _log.warning("capturing the CUDA graphs failed; the shard serves eagerly", exc_info=True)
        warm_up(model, cache)
        # Reuse is exact only where a prefill in two pieces gives a whole prefill's K/V bit for bit.
        self._reuse = self._info["prefix_reuse"] = cfg.reuse_prefixes and bool(getattr(model.decode_step, "is_fused", False))
        self._model = model
        self._cache = cache

    def _weight_format(self) -> str:
        """The format asked for: the int formats of GGUF blocks take a tensor whole, which a
        tensor-parallel shard does not hold, so auto means bfloat16 there (an explicit q4_1 or
        gguf with tp > 1 is refused by apply_format)."""
        cfg = self.config
        return "bfloat16" if cfg.tp_size > 1 and cfg.dtype == AUTO_FORMAT else cfg.dtype

    async def _ready(self) -> tuple[Transformer, KVCache]:
        if self._setup is None:
            raise RuntimeError("VerifierShard is not started")
        await asyncio.shield(self._setup)  # a cancelled caller must not cancel the setup itself
        assert self._model is not None and self._cache is not None
        return self._model, self._cache

    # ------------------------------------------------------------------ handlers
    @handler
    async def info(self) -> dict[str, Any]:
        """Model and cache facts the scheduler needs (waits for the TP rendezvous)."""
        await self._ready()
        return dict(self._info)

    @handler
    async def decode_step(self) -> dict[str, bool]:
        """Whether the model's decode step is fused (one C++ op), compiled yet (a background
        compile may still run) or replayed from CUDA graphs; waits for the setup like ``info``."""
        model, _ = await self._ready()
        step = getattr(model, "decode_step", None)
        return {"fused": bool(getattr(step, "is_fused", False)), "compiled": bool(getattr(step, "is_compiled", False)),
                "graphs": isinstance(step, GraphStep)}

    @handler
    async def prefill(self, body: Any) -> dict[str, Any] | None:
        """Reset each listed row and commit its ``prompt_ids[:-1]``; the last prompt token is the
        row's first root. A row with ``"return_states": true`` gets ``"num_states"`` in its reply,
        and the reply's ``"states"`` stacks those rows' final hidden states of ``prompt_ids[:-1]``
        (float32 ``(sum n, D)`` in row order, for feature-level drafters; one frame whatever the
        row count, see :class:`~treeserve.actors.messages.verifier.PrefillReply`). Every entry is checked
        before any row is reset. ``None`` on ranks >= 1 of a ``rank0_answers`` call."""
        call = PrefillBody.from_wire(body)
        acks_only = call.rank0_answers and self.config.tp_rank > 0
        model, cache = await self._ready()
        capacity = self._info["row_capacity"]
        for entry in call.rows:
            self._row(entry.row)
            if len(entry.prompt_ids) >= capacity:
                raise ValueError(f"a prompt of {len(entry.prompt_ids)} tokens leaves no room in a row of {capacity} tokens")
        jobs = [(entry.row, list(entry.prompt_ids[:-1])) for entry in call.rows]
        wants = [entry.return_states and not acks_only for entry in call.rows]
        for row, _ in jobs:
            await self._scrub_if_needed(cache, row)
        # A drafter that needs the prompt's states gets them whole (every rank decides alike).
        reuse = self._reuse and not any(entry.return_states for entry in call.rows)
        keep = [self._row_tokens.reusable(row, tokens, int(cache.lengths[row])) if reuse else 0 for row, tokens in jobs]
        for row, _ in jobs:
            self._row_tokens.forget(row)  # until the prefill has run
        results = await self._offload.run(functools.partial(prefill_rows, want_states=any(wants), keep=keep), model, cache,
                                          [(row, tokens[k:]) for (row, tokens), k in zip(jobs, keep)])
        if self._reuse:  # recorded only where they can be reused (no per-step work elsewhere)
            for row, tokens in jobs:
                self._row_tokens.set(row, tokens)
        if acks_only:
            return None
        return PrefillReply(tuple(PrefilledRow(row, length, _float32(states) if want else None, kept)
                                  for (row, _), (length, states), want, kept in zip(jobs, results, wants, keep))
                            ).to_wire(self._info["dim"])

    @handler
    async def step(self, body: Any) -> dict[str, Any] | None:
        """Verify one token tree per given row in batched forwards; commit each accepted path.
        With ``"return_states": true`` each row's reply carries ``"num_states"`` and the reply's
        ``"states"`` stacks the rows' final hidden states of their accepted nodes, root first
        (float32 ``(sum len(accepted), D)`` in row order; failed rows have none). ``None`` on
        ranks >= 1 of a ``rank0_answers`` call. Each request's params are parsed at its first
        step only (:class:`~treeserve.actors.messages.tree_wire.ParamsCache`)."""
        call = StepBody.from_wire(body, self._params)
        acks_only = call.rank0_answers and self.config.tp_rank > 0
        model, cache = await self._ready()
        steps = [RowStep(self._row(r.row), r.tree, r.params, self._generator_for(r.request_id, r.params))
                 for r in call.rows]
        want_states = call.return_states and not acks_only
        if call.decode_steps > 1:
            decoded, decoded_states, failures = await self._offload.run(
                self._decode_rows, model, cache, steps, call.decode_steps, want_states)
            self._rows_to_scrub.update(failures)
            if self._reuse:
                for s in steps:
                    self._row_tokens.extend(s.row, [s.tree.root_token, *decoded[s.row][:-1]])
            if acks_only:
                return None
            return StepReply(tuple(RowVerdict(s.row, error=failures[s.row]) if s.row in failures else
                                   RowVerdict(s.row, (0,), tuple(decoded[s.row]),
                                              _float32(torch.cat(decoded_states[s.row])) if want_states else None)
                                   for s in steps), want_states).to_wire(self._info["dim"])
        results, states, failures = await self._offload.run(self._verify_rows, model, cache, steps, want_states)
        self._rows_to_scrub.update(failures)
        emitted = [() if step.row in failures else tuple(result.new_tokens(step.tree)) for step, result in zip(steps, results)]
        if self._reuse:
            for step, new in zip(steps, emitted):
                self._row_tokens.extend(step.row, [step.tree.root_token, *new[:-1]])  # the accepted path
        if acks_only:
            return None
        verdicts = []
        for index, (step, result) in enumerate(zip(steps, results)):
            if step.row in failures:
                verdicts.append(RowVerdict(step.row, error=failures[step.row]))
            else:
                verdicts.append(RowVerdict(step.row, tuple(result.accepted), emitted[index],
                                           _float32(states[index]) if want_states else None))
        return StepReply(tuple(verdicts), want_states).to_wire(self._info["dim"])

    @handler
    async def release(self, body: Any) -> None:
        """Forget ``row``'s KV cache and ``request_id``'s generator and params (idempotent)."""
        call = RowRelease.from_wire(body)
        _model, cache = await self._ready()
        row = self._row(call.row)
        self._generators.pop(call.request_id, None)
        self._params.forget(call.request_id)
        if self._reuse and row not in self._rows_to_scrub:  # kept for the row's next prompt
            await self._offload.run(cache.truncate, row, int(cache.lengths[row]))  # its pending slots go
        else:
            self._row_tokens.forget(row)
            await self._offload.run(cache.reset_row, row)
        await self._scrub_if_needed(cache, row)

    @handler
    async def move(self, body: Any) -> None:
        """Move row ``src``'s committed cache to the empty row ``dst`` (``src`` ends empty)."""
        call = RowMove.from_wire(body)
        _model, cache = await self._ready()
        src, dst = self._row(call.src), self._row(call.dst)
        await self._scrub_if_needed(cache, dst)
        await self._offload.run(cache.reset_row, dst)  # a free row may keep its last tokens
        await self._offload.run(cache.move_row, src, dst)
        self._row_tokens.move(src, dst)

    async def _scrub_if_needed(self, cache: KVCache, row: int) -> None:
        """Zero the cache of a row that failed numerically (once): its next request must not
        read a stale NaN through attention's masked slots."""
        if row in self._rows_to_scrub:
            self._rows_to_scrub.discard(row)
            self._row_tokens.forget(row)
            await self._offload.run(zero_row, cache, row)

    # ------------------------------------------------------------------ helpers
    def _row(self, value: Any) -> int:
        row = check_int(value, "row")
        if row >= self.config.num_rows:
            raise ValueError(f"row {row} out of range: this verifier has {self.config.num_rows} rows")
        return row

    def _generator_for(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        """The stream of an unseeded sampled request on rank 0 (None otherwise: greedy and seeded
        requests draw nothing from a stream, and ranks >= 1 do not verify)."""
        if params.is_greedy or params.seed is not None or self.config.tp_rank != 0:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = self._generators[request_id] = make_generator(params)
        return generator

    def _decode_rows(
        self, model: Transformer, cache: KVCache, steps: list[RowStep], num_steps: int, want_states: bool
    ) -> tuple[dict[int, list[int]], dict[int, list[Tensor]], dict[int, str]]:
        """Up to ``num_steps`` plain decode steps of one-node trees: each step verifies every
        row still decoding and roots its next tree at the token it emitted; a row stops after a
        stop token or a numerical failure (row -> why; its earlier tokens are dropped with it).
        Each step is exactly a one-step call (same commits, same randomness placement), and with
        ``want_states`` keeps each row's root state ``(1, D)`` per step, as that call would."""
        tokens: dict[int, list[int]] = {step.row: [] for step in steps}
        states: dict[int, list[Tensor]] = {step.row: [] for step in steps}
        failures: dict[int, str] = {}
        active = steps
        for index in range(num_steps):
            results, step_states, failed = self._verify_rows(model, cache, active, want_states)
            failures.update(failed)
            following = []
            for position, (step, result) in enumerate(zip(active, results)):
                if step.row in failed:
                    continue
                tokens[step.row].append(result.bonus_token)
                if want_states:
                    states[step.row].append(step_states[position])
                if index + 1 < num_steps and not step.params.is_stop(result.bonus_token):
                    following.append(RowStep(step.row, TokenTree.root_only(result.bonus_token), step.params,
                                             step.generator))
            if not following:
                break
            active = following
        return tokens, states, failures

    def _verify_rows(
        self, model: Transformer, cache: KVCache, steps: list[RowStep], want_states: bool
    ) -> tuple[list[VerifyResult], list[Tensor], dict[int, str]]:
        """Results and states per step, and the rows whose verification failed (row -> why)."""
        verifier: VerifyFn = row_checked_verifier(verify)
        if self._has_group:
            device = cache.device if self.config.device != "cpu" else None
            verifier = rank0_broadcast_verifier(self.config.tp_rank, device, inner=verifier)
        guarded = RowGuard(verifier, steps)
        # One rank: greedy and seeded rows may be decided where the logits are (a GPU's), by
        # verify's own rule; rows with non-finite logits still reach the checked verifier.
        on_device = self.config.tp_size == 1
        if want_states:
            results, states = verify_rows_with_states(model, cache, steps, verifier=guarded, on_device=on_device)
        else:
            results, states = verify_rows(model, cache, steps, verifier=guarded, on_device=on_device), []
        return results, states, guarded.failures
