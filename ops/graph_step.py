"""Captured forwards: every decode, tree-verify and batched step a server runs, replayed from
CUDA graphs on fixed shapes (a CPU twin replays the same function on the same buffers).

On a GPU a step of the default model is some 300 kernel launches from Python (10-22 ms on an
H200, against well under a millisecond of weight reads): the host is the bottleneck.
:class:`GraphStep` captures the forward once per shape at start-up and then launches it as one
graph. What makes a forward capturable, and one capture serve every step of its shape:

* **Buckets.** Shapes are fixed by rows (:data:`ROW_BUCKETS`, up to the cache's rows) and new
  tokens per row (:data:`NODE_BUCKETS`: a decode step is 1, trees 4 to 64). A step pads up to
  the next bucket: pad nodes of a real row see only themselves (no real node sees them), and
  pad rows are scored but never read.
* **Static buffers.** Tokens, positions, the tree mask and the rows' lengths are copied into
  buffers the graph reads; the KV cache is the server's own storage (a graph is captured over
  it). Padding writes its keys and values where nothing committed lives: a real row's pad
  nodes after its own new tokens, a pad row into the cache's ``headroom`` (slots past its
  capacity), and a pad row attends over no committed slot.
* **No host read.** Nothing in the step reads a device value back: the rows' room is checked
  by the caller (the verifier checks every tree against its row before the forward), the
  attention's launch is planned for the whole cache (each row reads its own length on the
  device), and the pending slots are marked from the host's own counts.

On CUDA the tree kernel (:mod:`~treeserve.ops.kernels.tree_attention_cuda`, when cupy is
installed) runs inside the graph for every step, decode included; without cupy, SDPA under a
mask over the whole cache. On the CPU the same function runs eagerly on the same buffers
(:class:`Replay`), which is what the tests check: a captured step's hidden states equal the
eager forward's for every bucket, padding and row offset. A model the kernel does not cover
(sliding windows, another attention scale: Gemma 3) is captured with SDPA; serving captures
only where :func:`kernel_fits`. A forward the graphs do not take (a cache they were not
captured over, such as a prefill's scratch cache, or more rows or nodes than captured) runs
the model's eager blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from treeserve.ops.decode_step import blocks_hidden
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.model import Transformer
from treeserve.ops.tree_attention import MAX_TREE_NODES, ancestor_bits_from_mask, is_cuda_kernel_available

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Row counts a step is captured for (the cache's own row count is always one)."""

NODE_BUCKETS = (1, 4, 8, 16, 32, 64)
"""New tokens per row a step is captured for: a decode step, then token trees."""

HEADROOM = max(NODE_BUCKETS)
"""Slots past a cache's capacity that a captured step needs (:meth:`Transformer.new_cache`'s
``headroom``): where the pad rows of the largest bucket write."""


def kernel_fits(model: Transformer) -> bool:
    """Whether a captured step of ``model`` runs the CUDA tree kernel: on a CUDA device with
    cupy, for attention over every visible key at ``1 / sqrt(hd)`` (no sliding window). Only
    then does serving capture (the SDPA fallback would read the whole cache every step)."""
    config = model.config
    return (model.device.type == "cuda" and is_cuda_kernel_available() and not config.windowed
            and config.attn_scale is None)


def bucket_of(count: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``count``, or None when none does."""
    return next((bucket for bucket in buckets if bucket >= count), None)


class Replay:
    """The CPU twin of ``torch.cuda.CUDAGraph`` as used here: :meth:`replay` runs the
    captured function again and leaves its result in :attr:`output`, the same tensor every
    time (a graph's output buffer)."""

    def __init__(self, fn: Callable[[], Tensor]) -> None:
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        self.output.copy_(self.fn())


class CudaReplay:
    """A CUDA graph of ``fn``: warmed up on a side stream (cuBLAS's workspaces, the tree
    kernel's compile and attributes happen there, not in the capture), then captured into
    ``pool`` (shared by one step's graphs, which never run at once)."""

    def __init__(self, fn: Callable[[], Tensor], pool: Any, warmups: int = 2) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn()

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class Bucket:
    """One captured shape: ``rows`` x ``nodes`` new tokens, its input buffers and its graph."""

    rows: int
    nodes: int
    tokens: Tensor  # (rows, nodes) long
    positions: Tensor  # (rows, nodes) long
    tree_mask: Tensor  # (rows, nodes, nodes) bool
    lengths: Tensor  # (rows,) long: where each row attends from (pad rows: 0)
    write_at: Tensor  # (rows,) long: where each row writes (pad rows: the headroom)
    eye: Tensor  # (nodes, nodes) bool: the pad mask (each node sees itself)
    states: Tensor | None = None  # (rows, nodes, D): a drafter's input states (DraftGraphStep)
    graph: Replay | CudaReplay | None = None


class GraphStep:
    """``step(tokens (B, T), cache, tree_mask, positions) -> hidden (B, T, D)``, the model's
    attached step (``Transformer.decode_step``) for forwards of at most :attr:`max_new` new
    tokens a row, replayed from captured graphs where ``cache`` is (a row block of) the cache
    they were captured over; see the module docstring. ``use_kernel`` (default: on CUDA with
    cupy) runs the CUDA tree kernel inside the graphs; ``use_cuda_graphs`` (default: on CUDA)
    captures CUDA graphs, else :class:`Replay` twins. :meth:`capture` must run before serving
    (it is timed: :attr:`capture_seconds`)."""

    max_new = MAX_TREE_NODES
    is_fused = False

    def __init__(self, model: Transformer, cache: KVCache, *, row_buckets: Sequence[int] = ROW_BUCKETS,
                 node_buckets: Sequence[int] = NODE_BUCKETS, use_kernel: bool | None = None,
                 use_cuda_graphs: bool | None = None) -> None:
        if cache.headroom < max(node_buckets):
            raise ValueError(f"a captured step needs a cache with headroom >= {max(node_buckets)} "
                             f"(model.new_cache(..., headroom=graph_step.HEADROOM)); this one has {cache.headroom}")
        if max(node_buckets) > MAX_TREE_NODES:
            raise ValueError(f"node buckets go up to {MAX_TREE_NODES}, got {max(node_buckets)}")
        if cache.dtype != model.dtype or cache.num_layers != len(model.layers):
            raise ValueError("the cache does not belong to this model")
        on_cuda = cache.device.type == "cuda"
        self.model = model
        self.cache = cache
        self.use_kernel = (on_cuda and is_cuda_kernel_available()) if use_kernel is None else use_kernel
        if self.use_kernel and (model.config.windowed or model.config.attn_scale is not None):
            self.use_kernel = False  # the tree kernel attends to every key at 1 / sqrt(hd)
        self.use_cuda_graphs = on_cuda if use_cuda_graphs is None else use_cuda_graphs
        self.row_buckets = tuple(sorted({b for b in row_buckets if b < cache.batch_size} | {cache.batch_size}))
        self.node_buckets = tuple(sorted(set(node_buckets)))
        self.buckets: dict[tuple[int, int], Bucket] = {}
        self.capture_seconds: float | None = None
        self.replays = 0
        self.eager_calls = 0
        # The whole storage's slot count, as a shape (blocks_hidden reads only its length).
        self._all_slots = torch.empty(cache.capacity + cache.headroom, dtype=torch.bool)

    # ------------------------------------------------------------------ capture
    def capture(self) -> float:
        """Capture every bucket (largest first, so the shared pool is sized once); returns
        and records the seconds it took."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        for rows in sorted(self.row_buckets, reverse=True):
            for nodes in sorted(self.node_buckets, reverse=True):
                bucket = self._new_bucket(rows, nodes)
                self._reset_padding(bucket)
                fn = self._function(bucket)
                with torch.inference_mode():
                    bucket.graph = CudaReplay(fn, pool) if self.use_cuda_graphs else Replay(fn)
                self.buckets[rows, nodes] = bucket
        self.capture_seconds = time.perf_counter() - started
        logger.info("captured %d step shapes in %.2f s", len(self.buckets), self.capture_seconds)
        return self.capture_seconds

    def _new_bucket(self, rows: int, nodes: int) -> Bucket:
        device = self.cache.device
        return Bucket(rows, nodes, tokens=torch.zeros(rows, nodes, dtype=torch.long, device=device),
                      positions=torch.zeros(rows, nodes, dtype=torch.long, device=device),
                      tree_mask=torch.zeros(rows, nodes, nodes, dtype=torch.bool, device=device),
                      lengths=torch.zeros(rows, dtype=torch.long, device=device),
                      write_at=torch.zeros(rows, dtype=torch.long, device=device),
                      eye=torch.eye(nodes, dtype=torch.bool, device=device))

    def _function(self, bucket: Bucket) -> Callable[[], Tensor]:
        model, cache, rows = self.model, self.cache, bucket.rows
        keys = [k[:rows] for k in cache.keys]  # views of the first rows: fixed addresses
        values = [v[:rows] for v in cache.values]
        use_kernel, all_slots = self.use_kernel, self._all_slots

        def run() -> Tensor:
            bits = ancestor_bits_from_mask(bucket.tree_mask) if use_kernel else None
            return blocks_hidden(model, self._first_states(bucket), bucket.positions, bucket.tree_mask, bucket.lengths,
                                 keys, values, all_slots, write_at=bucket.write_at, ancestor_bits=bits)

        return run

    def _first_states(self, bucket: Bucket) -> Tensor:
        """The first block's input states ``(rows, nodes, D)`` of the bucket's inputs."""
        return self.model.embed(bucket.tokens)

    def _reset_padding(self, bucket: Bucket) -> None:
        """Every row and node of ``bucket`` padding (the caller then fills in its real rows and
        nodes): pad nodes see only themselves at position 0; pad rows attend from slot 0 and
        write into the headroom."""
        bucket.tokens.zero_()
        bucket.positions.zero_()
        if bucket.states is not None:
            bucket.states.zero_()
        bucket.tree_mask.copy_(bucket.eye)
        bucket.lengths.zero_()
        bucket.write_at.fill_(self.cache.capacity + self.cache.headroom - bucket.nodes)

    # ------------------------------------------------------------------ serving
    def row_offset(self, cache: KVCache) -> int | None:
        """The first row of the captured cache that ``cache`` is (a row block of
        :func:`~treeserve.ops.batch_step.row_block`), or None for another cache."""
        mine, theirs = self.cache.keys[0], cache.keys[0]
        if theirs.untyped_storage().data_ptr() != mine.untyped_storage().data_ptr() or theirs.stride() != mine.stride():
            return None
        offset, rest = divmod(theirs.data_ptr() - mine.data_ptr(), mine.stride(0) * mine.element_size())
        return offset if rest == 0 and 0 <= offset and offset + cache.batch_size <= self.cache.batch_size else None

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, cache: KVCache, tree_mask: Tensor | None = None,
                 positions: Tensor | None = None) -> Tensor:
        return self._run(tokens, cache, tree_mask, positions, None)

    def _run(self, tokens: Tensor, cache: KVCache, tree_mask: Tensor | None, positions: Tensor | None,
             states: Tensor | None) -> Tensor:
        num_rows, num_new = tokens.shape
        start = self.row_offset(cache)
        rows = None if start is None else bucket_of(start + num_rows, self.row_buckets)
        nodes = bucket_of(num_new, self.node_buckets)
        bucket = None if rows is None or nodes is None else self.buckets.get((rows, nodes))
        if bucket is None or bucket.graph is None or start is None:
            self.eager_calls += 1
            return self._eager(tokens, cache, tree_mask, positions, states)
        if positions is None:
            positions = cache.lengths[:, None] + torch.arange(num_new, device=cache.lengths.device)
        self._reset_padding(bucket)
        stop = start + num_rows
        bucket.tokens[start:stop, :num_new] = tokens
        bucket.positions[start:stop, :num_new] = positions
        if tree_mask is None:  # a chain: each new token sees itself and the ones before it
            bucket.tree_mask[start:stop, :num_new, :num_new] = torch.ones(
                num_new, num_new, dtype=torch.bool, device=tokens.device).tril()
        else:
            bucket.tree_mask[start:stop, :num_new, :num_new] = tree_mask
        bucket.lengths[start:stop] = cache.lengths
        bucket.write_at[start:stop] = cache.lengths
        if bucket.states is not None and states is not None:
            bucket.states[start:stop, :num_new] = states
        cache.mark_pending(num_new)
        bucket.graph.replay()
        self.replays += 1
        return bucket.graph.output[start:stop, :num_new].clone()

    def _eager(self, tokens: Tensor, cache: KVCache, tree_mask: Tensor | None, positions: Tensor | None,
               states: Tensor | None) -> Tensor:
        model = self.model
        return model.norm(model.run_blocks(model.embed(tokens), cache, positions, tree_mask))


def attach_graphs(model: Transformer, cache: KVCache, **options: Any) -> GraphStep:
    """Capture a :class:`GraphStep` over ``cache`` and attach it as the model's step (every
    forward of at most 64 new tokens a row runs it); returns it, :attr:`~GraphStep.capture_seconds`
    set."""
    step = GraphStep(model, cache, **options)
    step.capture()
    model.decode_step = step
    return step


class DraftGraphStep(GraphStep):
    """``step(states (B, T, D), tokens (B, T), cache, tree_mask, positions) -> (B, T, D)``: a
    feature drafter's forward (``FeatureDrafter.eager_features``: its ``fuse`` of the LLM's
    states with the tokens' embeddings, then its blocks) captured as :class:`GraphStep`
    captures the LLM's."""

    def _new_bucket(self, rows: int, nodes: int) -> Bucket:
        bucket = super()._new_bucket(rows, nodes)
        bucket.states = torch.zeros(rows, nodes, self.model.config.dim, dtype=self.model.dtype, device=self.cache.device)
        return bucket

    def _first_states(self, bucket: Bucket) -> Tensor:
        assert bucket.states is not None
        return cast(Tensor, self.model.fuse(bucket.states, bucket.tokens))  # type: ignore[operator]

    @torch.inference_mode()
    def __call__(self, states: Tensor, tokens: Tensor, cache: KVCache,  # type: ignore[override]
                 tree_mask: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        return self._run(tokens, cache, tree_mask, positions, states)

    def _eager(self, tokens: Tensor, cache: KVCache, tree_mask: Tensor | None, positions: Tensor | None,
               states: Tensor | None) -> Tensor:
        assert states is not None
        return cast(Tensor, self.model.eager_features(  # type: ignore[operator]
            states, tokens, cache, tree_mask=tree_mask, positions=positions))


class DraftGraphs:
    """A feature drafter's captured caches, one request each at a time: the drafter's
    ``draft_step`` (``features`` calls it) replays the graphs of the cache it is given, and runs
    the drafter eagerly on any other; :meth:`lease` hands a free cache to a request's speculator
    (``FeatureSpeculator.prefill``), :meth:`release` takes it back. Made by :func:`attach_draft_graphs`."""

    def __init__(self, steps: Sequence[DraftGraphStep]) -> None:
        self.steps = {id(step.cache): step for step in steps}
        self.free = [step.cache for step in steps]
        self.drafter = steps[0].model

    def lease(self, capacity: int | None) -> KVCache | None:
        """A free captured cache of at least ``capacity`` slots (None: any), or None."""
        for index, cache in enumerate(self.free):
            if capacity is None or cache.capacity >= capacity:
                return self.free.pop(index)
        return None

    def release(self, cache: KVCache) -> None:
        if id(cache) in self.steps and cache not in self.free:
            self.free.append(cache)

    def __call__(self, states: Tensor, tokens: Tensor, cache: KVCache, tree_mask: Tensor | None = None,
                 positions: Tensor | None = None) -> Tensor:
        step = self.steps.get(id(cache))
        if step is not None:
            return step(states, tokens, cache, tree_mask, positions)
        with torch.inference_mode():
            return cast(Tensor, self.drafter.eager_features(  # type: ignore[operator]
                states, tokens, cache, tree_mask=tree_mask, positions=positions))


def attach_draft_graphs(drafter: Transformer, capacity: int, *, slots: int = 4, **options: Any) -> DraftGraphs:
    """Capture ``slots`` one-row caches of ``capacity`` slots for a feature drafter and make
    them its ``draft_step`` (:class:`DraftGraphs`): a speculator actor on a GPU serves up to
    ``slots`` requests at once from graphs, more eagerly."""
    steps = []
    for _ in range(slots):
        step = DraftGraphStep(drafter, drafter.new_cache(1, capacity, headroom=HEADROOM), row_buckets=(1,), **options)
        step.capture()
        steps.append(step)
    graphs = DraftGraphs(steps)
    drafter.draft_step = graphs  # type: ignore[assignment]
    return graphs


__all__ = ["HEADROOM", "NODE_BUCKETS", "ROW_BUCKETS", "DraftGraphStep", "DraftGraphs", "GraphStep", "Replay",
           "attach_draft_graphs", "attach_graphs", "bucket_of", "kernel_fits"]
